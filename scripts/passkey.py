"""Passkey retrieval (Landmark attention, Mohtashami & Jaggi 2023) at lengths beyond training.

    python scripts/passkey.py ckpt=runs/base out=results/passkey lengths=[256,1024,4096] trials=5

A 5-digit key is hidden at a given depth of repeated filler text, then the model is asked for it.
Two scores per trial: greedy generation (the first integer in the output must be the key) and
likelihood ranking (the key's continuation must be the most likely of `candidates` random keys).
Writes to `out`: trials.csv (one row per prompt), passkey.csv (accuracy per method x length x
depth) and passkey_<method>.png (length x depth heatmaps). Options: configs/passkey.yaml.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python scripts/x.py` from anywhere

import hydra
import matplotlib
import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from data.tokenizer import Tokenizer
from inference.cli import one_sentence_errors
from inference.evaluation import continuation_logprobs, forward_groups, rows_per_forward
from inference.generation import GREEDY, check_integer, generate, generation_bytes
from inference.loading import load_model
from inference.memory import check_fits
from inference.retrieval import FILLER, INTRO, NEEDLE, QUESTION, first_integer, random_keys
from scripts.common import (
    CONFIGS,
    check_common,
    method_extends,
    method_names,
    method_ropes,
    option_list,
    with_largest_cache,
    write_csv,
)

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


@dataclass(frozen=True)
class PasskeyPrompt:
    tokens: list[int]  # bos + intro + filler... + needle + filler... + question
    key: int
    needle_start: int  # token index where the needle sentence begins
    depth: float  # realised depth: filler repetitions before the needle / all repetitions


def build_prompt(tok: Tokenizer, length: int, depth: float, key: int) -> PasskeyPrompt:
    """A prompt of about `length` tokens (never more, unless the fixed parts alone are longer) with
    the needle after round(depth * repetitions) of the filler. Pieces are tokenized separately and
    concatenated, so the needle's token position is exact."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depths must lie in [0, 1] (0 = start, 1 = end), got {depth}.")
    intro, filler, question = tok.encode(INTRO), tok.encode(FILLER), tok.encode(QUESTION)
    needle = tok.encode(NEEDLE.format(key=key))
    fixed = 1 + len(intro) + len(needle) + len(question)
    repeats = max(0, (length - fixed) // len(filler))
    before = round(depth * repeats)
    tokens = [tok.bos_id, *intro, *filler * before, *needle, *filler * (repeats - before), *question]
    return PasskeyPrompt(tokens, key, 1 + len(intro) + before * len(filler), before / max(repeats, 1))


def candidate_tokens(tok: Tokenizer, key: int, rng: np.random.Generator, count: int) -> list[list[int]]:
    """The continuations the ranking compares: the true key first, then count - 1 random decoys."""
    return [tok.encode(f" {k}") for k in (key, *random_keys(rng, count - 1, exclude=key))]


def answer_prompts(
    model,
    tok: Tokenizer,
    prompts: list[PasskeyPrompt],
    candidates: list[list[list[int]]],
    max_new_tokens: int,
    rows: int,
) -> list[dict]:
    """Greedy answers and likelihood ranks of `prompts`, `rows` prompts per forward (left padded);
    candidates[i] are prompt i's continuations, its true key first. `forward_groups` keeps every
    prompt's result equal to answering it alone."""
    dynamic = model.rope.is_dynamic
    answers: list[str] = [""] * len(prompts)
    scores: list[list[float]] = [[] for _ in prompts]
    for group in forward_groups([len(p.tokens) + max_new_tokens for p in prompts], rows, dynamic):
        out = generate(model, [prompts[i].tokens for i in group], max_new_tokens, GREEDY, eos_id=tok.eos_id)
        for i, new in zip(group, out.tokens):
            answers[i] = tok.decode(new)
    ranked_lengths = [len(p.tokens) + max(map(len, c)) for p, c in zip(prompts, candidates)]
    for group in forward_groups(ranked_lengths, rows, dynamic):
        logprobs = continuation_logprobs(
            model, [prompts[i].tokens for i in group], [candidates[i] for i in group]
        )
        for i, row in zip(group, logprobs):
            scores[i] = row
    out_rows = []
    for p, answer, (key_logprob, *decoy_logprobs) in zip(prompts, answers, scores):
        rank = 1 + sum(d > key_logprob for d in decoy_logprobs)  # 1 = the key is the most likely (ties too)
        out_rows.append(
            {
                "tokens": len(p.tokens),
                "depth_real": p.depth,
                "key": p.key,
                "answer": answer,
                "greedy_correct": int(first_integer(answer) == p.key),
                "rank_correct": int(rank == 1),
                "key_rank": rank,
                "key_logprob": key_logprob,
            }
        )
    return out_rows


def accuracy_table(trials: list[dict]) -> list[dict]:
    """Mean greedy and ranking accuracy per (method, length, depth)."""
    cells: dict[tuple, list[dict]] = {}
    for t in trials:
        cells.setdefault((t["method"], t["length"], t["depth"], t["factor"]), []).append(t)
    return [
        {
            "method": m,
            "length": length,
            "depth": d,
            "factor": f,
            "trials": len(rows),
            "greedy_acc": float(np.mean([r["greedy_correct"] for r in rows])),
            "rank_acc": float(np.mean([r["rank_correct"] for r in rows])),
        }
        for (m, length, d, f), rows in cells.items()
    ]


def plot_heatmaps(table: list[dict], method: str, chance: float, path: Path) -> None:
    """Accuracy heatmaps (rows lengths, columns depths): greedy and likelihood ranking."""
    sel = [r for r in table if r["method"] == method]
    lengths, depths = sorted({r["length"] for r in sel}), sorted({r["depth"] for r in sel})
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.5 * len(lengths) + 2.5))
    for ax, (key, title) in zip(
        axes, [("greedy_acc", "greedy"), ("rank_acc", f"ranking (chance {chance:.0%})")]
    ):
        grid = np.array(
            [
                [next(r[key] for r in sel if r["length"] == t and r["depth"] == d) for d in depths]
                for t in lengths
            ]
        )
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set(xticks=range(len(depths)), xticklabels=depths, yticks=range(len(lengths)), yticklabels=lengths)
        ax.set(xlabel="depth", ylabel="length (tokens)", title=f"{method}: {title}")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.0%}", ha="center", va="center", color="white" if v < 0.5 else "black")
    fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_memory(model, cfg: DictConfig) -> None:
    """Refuse the longest length before any prompt is built: its prompts (every depth's trials) are
    held at once and answered `rows_per_forward` at a time in one left-padded batch (the keys' digits
    may tokenize to different lengths)."""
    longest = max(cfg.lengths)
    prompts = cfg.trials * len(cfg.depths)
    rows = min(rows_per_forward(cfg.batch_tokens, longest), prompts)
    nbytes = generation_bytes(
        model.config,
        rows,
        longest,
        longest + cfg.max_new_tokens,
        model.embed.weight.dtype,
        padded=True,
        native=False,
    )
    prompt_lists = 8 * prompts * longest  # a list slot per token; the filler's ints are shared objects
    what = (
        f"answering {prompts} passkey prompt{'s' * (prompts > 1)} of {longest:,} tokens ({rows} per forward)"
    )
    knob = "lengths, trials or batch_tokens" if rows > 1 else "lengths or trials"
    check_fits(nbytes + prompt_lists, what, knob, model.embed.weight.device)


@torch.inference_mode()
def run(cfg: DictConfig) -> list[dict]:
    check_common(cfg)
    check_integer("trials", cfg.trials, 1)
    check_integer("candidates", cfg.candidates, 2)
    check_integer("max_new_tokens", cfg.max_new_tokens, 1)
    depths = option_list(cfg, "depths", "[0,0.5,1]")
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d <= 1:
            raise ValueError(f"depths must lie in [0, 1] (0 = start, 1 = end), got {d!r}.")
    ckpt, tok = load_model(cfg.ckpt, cfg.device, cfg.dtype)
    methods = method_names(cfg.methods, ckpt)
    extends = method_extends(cfg, ckpt, methods)
    with_largest_cache(ckpt.model, extends)
    check_memory(ckpt.model, cfg)
    rng = np.random.default_rng(cfg.seed)
    trials = []
    for length in tqdm(sorted(cfg.lengths), desc="passkey", unit="length"):
        prompt_depths, prompts, candidates = [], [], []  # the same prompts and decoys for every method
        for depth in depths:
            decoy_rng = np.random.default_rng([cfg.seed, length, round(depth * 100)])
            for key in random_keys(rng, cfg.trials):
                prompt_depths.append(depth)
                prompts.append(build_prompt(tok, length, depth, key))
                candidates.append(candidate_tokens(tok, key, decoy_rng, cfg.candidates))
        rows = rows_per_forward(cfg.batch_tokens, length)
        for method, (rope, factor) in method_ropes(cfg, ckpt, methods, length).items():
            ckpt.model.set_rope(rope)
            ckpt.model.set_extend(extends[method])
            answered = answer_prompts(ckpt.model, tok, prompts, candidates, cfg.max_new_tokens, rows)
            for depth, row in zip(prompt_depths, answered):
                trials.append({"method": method, "length": length, "depth": depth, "factor": factor, **row})

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    table = accuracy_table(trials)
    write_csv(out / "trials.csv", trials)
    write_csv(out / "passkey.csv", table)
    chance = 1 / cfg.candidates
    for method in methods:
        plot_heatmaps(table, method, chance, out / f"passkey_{method}.png")
        rows = [r for r in table if r["method"] == method]
        print(
            f"{method:>12}: greedy {np.mean([r['greedy_acc'] for r in rows]):.0%}, "
            f"ranking {np.mean([r['rank_acc'] for r in rows]):.0%} over all cells"
        )
    print(
        f"Chance: ranking {chance:.0%} (1 of {cfg.candidates} candidates); greedy ~0% (a 5-digit key). "
        f"Wrote {out}/trials.csv, passkey.csv, passkey_<method>.png"
    )
    return table


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="passkey")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
