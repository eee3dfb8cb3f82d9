"""`trainer.precision=auto`: bf16 matmuls where the hardware makes them faster than fp32, fp32 elsewhere.

bf16-mixed keeps fp32 weights and optimizer state and runs the matmuls in bf16 (Lightning's autocast).
That pays on CUDA devices with bf16 support and on CPUs with AMX tiles (Intel Sapphire Rapids and
later: `amx_bf16` in /proc/cpuinfo); on other CPUs bf16 matmuls are emulated and slower than fp32.
Explicit values (32-true, bf16-mixed, 16-mixed, ...) are passed to Lightning unchanged.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

AUTO = "auto"


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; empty elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def uses_cuda(accelerator: str) -> bool:
    """Whether a Lightning `accelerator` setting runs on a CUDA device."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def resolve_precision(requested: str | int, accelerator: str) -> tuple[str, str]:
    """(Lightning precision, the reason in words) for `trainer.precision` on `accelerator`."""
    requested = str(requested)
    if requested != AUTO:
        return requested, "set explicitly"
    if uses_cuda(accelerator):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16-mixed", f"{torch.cuda.get_device_name()} multiplies bf16 matrices natively"
        return "32-true", "this CUDA device has no native bf16 matmuls"
    if "amx_bf16" in cpu_flags():
        return "bf16-mixed", "this CPU has AMX tiles (amx_bf16): bf16 matmuls are faster than fp32"
    return "32-true", "this CPU has no AMX tiles: bf16 matmuls would be slower than fp32"
