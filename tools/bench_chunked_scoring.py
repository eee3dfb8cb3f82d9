"""A long window's per-token loss on a checkpoint, three ways side by side: `score_tokens` in chunks with
the cached-chunk attention kernel (kernels/attention.py, `cached_chunk_attention`: what evaluation runs),
in chunks with each chunk's (L, S) mask handed to one flash call (the plain module's path), and in one
forward (no cache: causal attention in one call, the floor the chunks approach).

    python tools/bench_chunked_scoring.py ckpt=runs/smollm2 lengths=[8192,16384] chunk=4096 threads=2

Same weights, dtype (dtype=auto: bf16 where the CPU multiplies it natively) and tokens (the held-out plays)
for every side; sides alternate, best of `repeats`. Prints seconds, the speed-up of the kernel over the
masked chunks and against one forward (seconds over the kernel's), and each side's mean loss (the kernel must not move it).
"""

from __future__ import annotations

import sys
import time

import torch

from rope_llama.bench.options import parse_options
from rope_llama.bench.peers import held_out_tokens
from rope_llama.core.threads import apply_threads
from rope_llama.inference.generation import score_tokens
from rope_llama.inference.loading import load_model
from rope_llama.kernels.attention import KernelAttention
from rope_llama.model.llama import Attention

DEFAULTS = dict(
    ckpt="runs/smollm2", lengths=[8192, 16384], chunk=4096, threads="auto", dtype="auto", repeats=1
)


def attention_class(model, cls: type) -> None:
    """Every attention module of `model` computes through `cls` (the kernel or the plain module)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.__class__ = cls


@torch.inference_mode()
def main(argv: list[str]) -> dict:
    args = parse_options(argv, DEFAULTS)
    choice = apply_threads(args["threads"])
    print(f"threads: {choice.threads} ({choice.reason})")
    ckpt, tok = load_model(args["ckpt"], "cpu", args["dtype"])
    lengths, chunk = sorted(args["lengths"]), args["chunk"]
    tokens = torch.tensor(held_out_tokens(tok, max(lengths) + 1))
    sides = {  # name: (attention class, chunk)
        "kernel chunks": (KernelAttention, chunk),
        "masked chunks": (Attention, chunk),
        "one forward": (KernelAttention, max(lengths)),
    }
    seconds, losses = {}, {}
    for t in lengths:
        for _ in range(args["repeats"]):
            for name, (cls, size) in sides.items():
                attention_class(ckpt.model, cls)
                start = time.perf_counter()
                loss = score_tokens(ckpt.model, tokens[: t + 1], size).mean().item()
                elapsed = time.perf_counter() - start
                seconds[name, t] = min(seconds.get((name, t), elapsed), elapsed)
                losses[name, t] = loss
    print(f"\n{ckpt.path}, {ckpt.model.embed.weight.dtype}, chunk {chunk}, best of {args['repeats']}\n")
    print("| tokens | side | seconds | mean loss | seconds / the kernel's |")
    print("|---|---|---|---|---|")
    for t in lengths:
        for name in sides:
            ratio = seconds[name, t] / seconds["kernel chunks", t]
            print(f"| {t:,} | {name} | {seconds[name, t]:.1f} | {losses[name, t]:.5f} | {ratio:.2f}x |")
    return {"seconds": seconds, "losses": losses}


if __name__ == "__main__":
    main(sys.argv[1:])
