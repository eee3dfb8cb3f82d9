"""Devices and dtypes by the names the command lines take (the CPU's flags: kernels/cpuinfo.py).

device = resolve_device("auto")      # cuda when available, else cpu
dtype = resolve_dtype("bfloat16")    # torch.bfloat16
"""

from __future__ import annotations

import torch

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
