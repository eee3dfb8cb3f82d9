"""The machine: devices and dtypes by the names the command lines take, and what /proc/cpuinfo says.

device = resolve_device("auto")      # cuda when available, else cpu
dtype = resolve_dtype("bfloat16")    # torch.bfloat16
"amx_bf16" in cpu_flags()            # CPU feature flags (Linux; empty elsewhere)
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """`auto` (cuda when available, else cpu), `cpu`, `cuda` or `cuda:<index>`; one sentence otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"Unknown device {name!r}; use auto, cpu, cuda or cuda:<index>.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name} needs a CUDA GPU and none is available; use device=cpu or auto.")
    return device


def resolve_dtype(name: str) -> torch.dtype:
    """A DTYPES name -> the torch dtype; one sentence naming the valid ones otherwise."""
    if name not in DTYPES:
        raise ValueError(f"Unknown dtype {name!r}; valid dtypes are {', '.join(DTYPES)}.")
    return DTYPES[name]


def cpuinfo_value(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with one of `keys`; None where there is none
    (not Linux, or an architecture that names it otherwise)."""
    if not CPUINFO.exists():
        return None
    for line in CPUINFO.read_text().splitlines():
        if line.startswith(keys):
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where /proc/cpuinfo has none."""
    return set((cpuinfo_value("flags", "Features") or "").split())


def cpu_model() -> str:
    """The CPU's marketing name (x86 `model name`), else what `platform` knows."""
    return cpuinfo_value("model name") or platform.processor() or "unknown"
