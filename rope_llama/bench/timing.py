"""Timing for tools/bench.py: interleaved medians (a busy machine slows every side alike), ratios,
progress lines, and the compute dtype of a run."""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

from rope_llama.cli.errors import error_sentence
from rope_llama.core.device import DTYPES
from rope_llama.training.throughput import measure_matmul_peak


class Progress:
    """One line per section on stderr with the elapsed time: a full run takes several minutes."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.done += 1
        elapsed = int(time.perf_counter() - self.start)
        print(f"[bench {elapsed // 60}:{elapsed % 60:02d}] {self.done}/{self.total} {what}", file=sys.stderr)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, device) -> tuple[dict, dict]:
    """({side: median seconds per call}, {side: error}). Calls interleave across sides so drifts
    in machine load hit every side alike, in a new seeded order each round: in a fixed order a side
    always follows the same other one, and one that follows a side sharing its weights (ours after
    ours_eager) finds them in the CPU's caches. A side that fails in warm-up is dropped with its error."""
    errors = {}
    for side, fn in list(fns.items()):
        try:
            for _ in range(warmup):
                fn()
        except Exception as e:  # e.g. torch.compile failing for one peer
            errors[side] = f"{type(e).__name__}: {error_sentence(e)}"
            del fns[side]
    times: dict[str, list[float]] = {side: [] for side in fns}
    order = random.Random(0)
    for _ in range(repeats):
        for side, fn in order.sample(list(fns.items()), len(fns)):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[side].append(time.perf_counter() - t0)
    return {side: statistics.median(t) for side, t in times.items()}, errors


def ratios(values: dict) -> dict:
    """ours / peer for every peer with a value (values are throughputs: > 1 = ours faster)."""
    return {side: values["ours"] / v for side, v in values.items() if side != "ours" and "ours" in values}


PRECISIONS = {
    "fp32": DTYPES["float32"],
    "bf16": DTYPES["bfloat16"],
}  # precision= -> the dtype every side uses


def compute_dtype(args: dict, device: torch.device) -> torch.dtype:
    """The dtype every side computes in: training autocasts to it, generation and the RoPE op run in
    it, and the MFU is relative to its matmul peak. precision=auto: bf16 on GPU, fp32 on CPU."""
    if args["precision"] == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return PRECISIONS[args["precision"]]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed-precision autocast to `dtype` (bf16: flash attention through SDPA on GPU); none for fp32."""
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


def matmul_peak(args: dict, device, dtype: torch.dtype) -> float:
    """Best achieved FLOP/s of a large square `dtype` matmul (the MFU denominator), best of 3."""
    return max(measure_matmul_peak(device, dtype, n=args["matmul_n"]) for _ in range(3))
