"""`trainer.precision=auto`: bf16 matmuls where the hardware makes them faster than fp32, fp32 elsewhere.

bf16-mixed keeps fp32 weights and optimizer state and runs the matmuls in bf16 (Lightning's autocast).
That pays on CUDA devices with bf16 support and on CPUs with bf16 matrix instructions: AMX tiles
(Intel Sapphire Rapids and later: `amx_bf16` in /proc/cpuinfo) or AVX-512 BF16 dot products (AMD Zen 4
and later, Intel Cooper Lake: `avx512_bf16`). On other CPUs bf16 matmuls are emulated and slower than fp32.
Explicit values (32-true, bf16-mixed, 16-mixed, ...) are passed to Lightning unchanged.
"""

from __future__ import annotations

import os

import torch

from rope_llama.kernels.cpuinfo import cpu_flags

AUTO = "auto"
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # CPU instructions that multiply bf16 matrices natively
# Set to 1 or 0, it replaces the CPU's answer (for testing only: the suite runs both ways in .ci/run).
FORCE_CPU_BF16 = "ROPE_LLAMA_FORCE_CPU_BF16"


def cpu_bf16_flags() -> list[str]:
    """The CPU's flags among BF16_CPU_FLAGS, or what FORCE_CPU_BF16 pretends."""
    forced = os.environ.get(FORCE_CPU_BF16)
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"{FORCE_CPU_BF16}={forced!r} is not allowed; set it to 1 or 0, or unset it.")
    if forced:
        return [f"{FORCE_CPU_BF16}=1"] if forced == "1" else []
    return [flag for flag in BF16_CPU_FLAGS if flag in cpu_flags()]


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
    native = cpu_bf16_flags()
    if native:
        return "bf16-mixed", f"{native[0]}: this CPU multiplies bf16 matrices natively, faster than fp32"
    return "32-true", "this CPU has no bf16 matrix instructions (amx_bf16, avx512_bf16): fp32 is faster"


def bf16_is_native(accelerator: str) -> tuple[bool, str]:
    """Whether `trainer.precision=auto` picks bf16-mixed on `accelerator`, and the reason in words."""
    precision, reason = resolve_precision(AUTO, accelerator)
    return precision == "bf16-mixed", reason


def inference_dtype(name: str, device: torch.device) -> tuple[str, str]:
    """(dtype name, reason) for an evaluation's `dtype`: `auto` is bfloat16 where `trainer.precision=auto`
    would train in bf16 on `device` (its matmuls are native there), else float32 (the reference mode)."""
    if name != AUTO:
        return name, "set explicitly"
    native, reason = bf16_is_native("cuda" if device.type == "cuda" else "cpu")
    return ("bfloat16" if native else "float32"), reason


def expand_auto(items: list[str], expansion: list[str]) -> list[str]:
    """`items` with each `auto` replaced by `expansion`, repeats dropped (first kept): the `auto` entry of
    the benchmarks' precision and recipe lists."""
    return list(dict.fromkeys(x for item in items for x in (expansion if item == AUTO else [item])))
