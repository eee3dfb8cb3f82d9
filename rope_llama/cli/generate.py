"""Sample from or score text with a trained checkpoint, through a preallocated KV cache.

    python generate.py ckpt=runs/shakespeare prompt="ROMEO:" max_new_tokens=200 temperature=0.8 top_k=50
    python generate.py ckpt=runs/shakespeare prompt="ROMEO:" greedy=true start_pos=4000 rope=ntk rope.factor=8
    python generate.py ckpt=runs/shakespeare mode=score text_file=hamlet.txt extend=self_extend extend.group=32
    python generate.py ckpt=runs/shakespeare prompt_file=prompts.txt num_samples=2 stop='["\\n\\n"]'
    python generate.py ckpt=runs/shakespeare mode=score text_file=hamlet.txt chunk=64

Every option is in configs/generate.yaml and docs/generate.md. The engine is inference/generation.py.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from rope_llama import CONFIGS
from rope_llama.cli.errors import one_sentence_errors
from rope_llama.cli.schema import check_command
from rope_llama.core.checkpoint import LoadedCheckpoint
from rope_llama.core.checks import check_number
from rope_llama.core.threads import apply_threads, check_threads
from rope_llama.data import DataError
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.generation import (
    GenerationError,
    SamplingConfig,
    TextStream,
    check_generation,
    generate,
    position_buckets,
    score_tokens,
)
from rope_llama.inference.loading import load_model


def load(cfg: DictConfig) -> tuple[LoadedCheckpoint, Tokenizer]:
    """The checkpoint `cfg.ckpt` on `cfg.device` in `cfg.dtype`, with the `rope=<group>` and
    `extend=<group>` overrides if given, on `threads`."""
    apply_threads(cfg.threads)  # silently: stdout and stderr carry the text
    rope, extend = (group_values(cfg, name) for name in ("rope", "extend"))
    return load_model(cfg.ckpt, cfg.device, cfg.dtype, rope, extend)


def group_values(cfg: DictConfig, name: str) -> dict | None:
    """A config group's values, None when the group was not chosen; without its `_target_`, which
    builds the config object in train.py."""
    if cfg.get(name) is None:
        return None
    return {k: v for k, v in OmegaConf.to_container(cfg[name], resolve=True).items() if k != "_target_"}


ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    r"""Command-line escapes: Hydra passes `\n` through literally, so prompt="A:\nB" and stop='["\n\n"]'
    would otherwise never mean a newline. Only \n, \t and \\ are replaced (non-ASCII text stays intact)."""
    return re.sub(r"\\([nt\\])", lambda m: ESCAPES[m.group(1)], text)


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"Cannot read {path}: {e}.") from None


def read_prompts(cfg: DictConfig) -> list[str]:
    """The prompt, or the lines of prompt_file; empty prompts are refused."""
    if (cfg.prompt is None) == (cfg.prompt_file is None):
        raise GenerationError(
            "Give exactly one of prompt=<text> or prompt_file=<file with one prompt per line>."
        )
    if cfg.prompt is not None:
        if not str(cfg.prompt):
            raise GenerationError("The prompt is empty; give prompt=<text>.")
        return [unescape(str(cfg.prompt))]
    lines = read_text(cfg.prompt_file).splitlines()
    for number, line in enumerate(lines, 1):
        if not line:
            raise GenerationError(f"Line {number} of {cfg.prompt_file} is an empty prompt; remove it.")
    if not lines:
        raise GenerationError(f"{cfg.prompt_file} holds no prompts; write one prompt per line.")
    return lines


def chat_prompt(tok: Tokenizer, text: str, system: str | None) -> list[int]:
    """`text` as the user's turn of the tokenizer's chat template (its own special tokens, no bos added),
    ending where the assistant's reply begins."""
    messages = ([{"role": "system", "content": unescape(system)}] if system else []) + [
        {"role": "user", "content": text}
    ]
    try:
        return tok.encode(tok.apply_chat_template(messages))
    except DataError as e:
        raise GenerationError(f"chat=true: {e}") from None


def stop_strings(stop) -> list[str]:
    """stop=null, one string or a list of strings (stop="END" is one string, not 3 letters), unescaped."""
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list | ListConfig) or not all(isinstance(s, str) and s for s in stop):
        raise GenerationError(f"stop must be a string or a list of non-empty strings, got {stop!r}.")
    return [unescape(s) for s in stop]


def run_sample(
    cfg: DictConfig, ckpt: LoadedCheckpoint, tok: Tokenizer, sampling: SamplingConfig, prompt_texts: list[str]
) -> None:
    once = [chat_prompt(tok, t, cfg.system) if cfg.chat else tok.prompt_ids(t) for t in prompt_texts]
    options = dict(start_pos=cfg.start_pos, cache_len=cfg.cache_len, compile=cfg.compile, native=cfg.native)
    # num_samples rows per prompt: refused before the rows (and their streams) are made
    check_generation(ckpt.model, once, cfg.max_new_tokens, **options, samples=cfg.num_samples)
    texts = [p for p in prompt_texts for _ in range(cfg.num_samples)]
    prompts = [ids for ids in once for _ in range(cfg.num_samples)]  # shared lists: generate only reads
    streams = [TextStream(tok.decode, stop_strings(cfg.stop)) for _ in prompts]
    live = cfg.stream and len(prompts) == 1  # interleaving several rows on one terminal is unreadable
    # The prompt is echoed with the first new text: a refusal (options, memory, positions) prints only itself.
    unechoed = [texts[0] + "\n" * bool(cfg.chat)] if live else []  # a chat reply starts on its own line

    def on_token(row: int, token: int) -> bool:
        text = streams[row].push(token)
        if live:
            print(*unechoed, text, sep="", end="", flush=True)
            unechoed.clear()
        return streams[row].stopped

    out = generate(
        ckpt.model,
        prompts,
        cfg.max_new_tokens,
        sampling,
        **options,
        eos_id=tok.stop_ids,  # an instruct model's end of turn too
        seed=cfg.seed,
        on_token=on_token,
    )
    for row, (text, stream) in enumerate(zip(texts, streams)):
        rest = stream.finish()
        if live:
            print(*unechoed, rest, sep="")
        else:
            print(f"{'-' * 20} sample {row}\n{text}{stream.text}" if len(texts) > 1 else text + stream.text)
    compiled = f"  compiled step built in {out.compile_seconds:.1f} s" if out.compile_seconds else ""
    print(
        f"\nprompt tokens: {out.prompt_tokens}  generated tokens: {out.generated_tokens}  "
        f"prefill: {out.prefill_tokens_per_s:.1f} tokens/s  decode: {out.decode_tokens_per_s:.1f} tokens/s"
        + compiled,
        file=sys.stderr,
    )


def run_score(cfg: DictConfig, ckpt: LoadedCheckpoint, tok: Tokenizer, text: str) -> None:
    tokens = torch.tensor(tok.prompt_ids(text))
    losses = score_tokens(ckpt.model, tokens, cfg.chunk, cfg.start_pos)
    context_len = ckpt.context_len
    print(f"{'positions':>16} {'tokens':>8} {'loss':>8} {'ppl':>10}   (context length {context_len})")
    for b in position_buckets(losses, context_len, cfg.start_pos):
        print(f"{f'{b.start}..{b.end}':>16} {b.tokens:8d} {b.loss:8.4f} {b.perplexity:10.2f}")
    loss = float(losses.double().mean())
    print(f"{'overall':>16} {losses.numel():8d} {loss:8.4f} {math.exp(loss):10.2f}")


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="generate")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    # options are checked before the (slow) checkpoint load
    check_command("generate", cfg, GenerationError)
    if OmegaConf.is_missing(cfg, "ckpt"):
        raise GenerationError("No checkpoint given; pass ckpt=<.ckpt file or run directory>.")
    check_threads(cfg.threads)
    if cfg.mode == "sample":
        sampling = SamplingConfig(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p), bool(cfg.greedy))
        check_number("num_samples", cfg.num_samples, minimum=1, integer=True, error=GenerationError)
        stop_strings(cfg.stop)
        if not isinstance(cfg.chat, bool):
            raise GenerationError(f"chat must be true or false, got {cfg.chat!r}.")
        texts = read_prompts(cfg)
        run_sample(cfg, *load(cfg), sampling, texts)
    elif cfg.mode == "score":
        if cfg.text_file is None:
            raise GenerationError("mode=score needs text_file=<file to score>.")
        run_score(cfg, *load(cfg), read_text(cfg.text_file))
    else:
        raise GenerationError(f"Unknown mode {cfg.mode!r}; valid modes are sample, score.")


if __name__ == "__main__":
    main()
