"""Throughput accounting: the matmul peak that model FLOP utilisation (MFU) is measured against.

MFU = model FLOPs per second / the achieved FLOP/s of a large square matmul on the same device, in the
dtype the training matmuls run in (bf16 under bf16-mixed): a peak measured, not a datasheet's, so the
ratio says how much of what this machine really does the model gets.
"""

from __future__ import annotations

import time

import torch


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """Achieved FLOP/s of a square matmul on this device: the denominator of our MFU."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):  # warm up kernels / caches
        a @ b
    reps, best = 5, float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def matmul_dtype(precision: str) -> torch.dtype:
    """The dtype a Lightning `precision` setting runs the matmuls in ("bf16-mixed" -> bfloat16, ...)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float64 if precision.startswith("64") else torch.float32
