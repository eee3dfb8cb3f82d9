"""How many training steps until a model copies from its context (an induction head forms)?

    python tools/induction_probe.py                          # model=small's shape, 1500 steps
    python tools/induction_probe.py steps=3000 lr=1e-3 seq_len=128 batch_size=16 repeats=2
    python tools/induction_probe.py alphabet=128 optim=muon lr=3e-3 mix_previous_tokens=1 steps=800

Trains a fresh decoder on synthetic windows only: random-token segments (8-24 tokens, uniform over the
vocabulary) that each occur `repeats` times in shuffled order, so a repeated segment sits at a varying
distance from its first occurrence and only content matching (an induction head) predicts it; a
fixed offset would let a positional head solve the task without generalising. Prints the loss and the
copy accuracy (argmax on every target inside a repeated segment, after its first token) every
`every` steps, and the first step at which copy accuracy passes `threshold`. reports/2026-11-27-recall-rounds.md (Recall
windows) explains why this is the bottleneck of a retrieval-capable base model.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from rope_llama.cli.errors import USER_ERRORS, one_sentence_errors
from rope_llama.core.checks import check_number
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama
from rope_llama.training.optim import OptimConfig, build_optimizer


@dataclass
class ProbeConfig:
    steps: int = 1500
    optim: str = "adamw"  # or "muon" (training/optim.py: Muon on the blocks' matrices, AdamW on the rest)
    lr: float = 1e-3  # AdamW's, constant after `warmup` steps
    muon_lr: float = 0.02
    warmup: int = 20
    batch_size: int = 16
    seq_len: int = 128
    repeats: int = 2  # occurrences of each segment in a window
    vocab_size: int = 4096
    alphabet: int = 0  # segments draw from token ids 2 .. 2 + alphabet - 1; 0 = every id but BOS/EOS
    d_model: int = 256  # model=small's shape
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    mix_previous_tokens: int = 0  # model.mix_previous_tokens: the n preceding tokens' embeddings mixed in
    every: int = 50
    threshold: float = 0.5
    seed: int = 0


def repeat_windows(rng: np.random.Generator, cfg: ProbeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, seq_len + 1) token windows and the (B, seq_len) mask of the targets a copy predicts."""
    windows, masks = [], []
    for _ in range(cfg.batch_size):
        tokens, repeat = [], []  # repeat[t]: token t continues a segment already seen whole before
        while len(tokens) < cfg.seq_len + 1:
            segments = [
                rng.integers(2, 2 + (cfg.alphabet or cfg.vocab_size - 2), size=int(rng.integers(8, 25)))
                for _ in range(4)
            ]
            seen = set()
            for i in rng.permutation(np.repeat(np.arange(len(segments)), cfg.repeats)):
                tokens += segments[i].tolist()
                repeat += [False] + [i in seen] * (len(segments[i]) - 1)  # a segment's first token is new
                seen.add(i)
        windows.append(tokens[: cfg.seq_len + 1])
        masks.append(repeat[1 : cfg.seq_len + 1])  # per target
    return torch.tensor(windows), torch.tensor(masks)


def run(cfg: ProbeConfig) -> int | None:
    """Train and report; returns the first step whose copy accuracy passed the threshold (or None)."""
    for name in ("steps", "batch_size", "seq_len", "repeats", "every", "warmup"):
        value = getattr(cfg, name)
        check_number(name, value, minimum=1, integer=True, allowed="a positive integer")
    if not 0 <= cfg.alphabet <= cfg.vocab_size - 2:
        raise ValueError(
            f"alphabet must lie in [0, vocab_size - 2 = {cfg.vocab_size - 2}], got {cfg.alphabet}."
        )
    torch.manual_seed(cfg.seed)
    keys = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mix_previous_tokens")
    shape = {k: getattr(cfg, k) for k in keys}
    model = Llama(ModelConfig(**shape))
    settings = OptimConfig(name=cfg.optim, lr=cfg.lr, weight_decay=0.0, muon_lr=cfg.muon_lr)
    opt = build_optimizer(model, settings, fused=False, precision="bf16-mixed")  # the autocast below
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    rng, start, formed = np.random.default_rng(cfg.seed), time.time(), None
    for step in range(1, cfg.steps + 1):
        windows, copyable = repeat_windows(rng, cfg)
        with torch.autocast("cpu", torch.bfloat16):  # the default job's precision on CPU
            logits = model(windows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % cfg.every == 0 or step == cfg.steps:
            hits = (logits.argmax(-1) == windows[:, 1:]) & copyable
            accuracy = hits.sum().item() / copyable.sum().item()
            print(
                f"step {step:5d}  loss {loss.item():.3f}  copy accuracy {accuracy:.3f}  {time.time() - start:.0f} s",
                flush=True,
            )
            if formed is None and accuracy >= cfg.threshold:
                formed = step
    tokens = cfg.batch_size * cfg.seq_len
    print(
        f"copy accuracy passed {cfg.threshold:.0%} at step {formed} ({formed * tokens:,} tokens)"
        if formed
        else f"copy accuracy stayed below {cfg.threshold:.0%} for {cfg.steps} steps ({cfg.steps * tokens:,} tokens)"
    )
    return formed


@one_sentence_errors(errors=USER_ERRORS)
def main(argv: list[str]) -> None:
    cfg = OmegaConf.merge(OmegaConf.structured(ProbeConfig), OmegaConf.from_dotlist(argv))
    run(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
