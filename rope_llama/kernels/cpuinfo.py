"""What /proc/cpuinfo says: the CPU's feature flags pick the C decode step's loops here and the
training precision in core/precision.py.

    "amx_bf16" in cpu_flags()            # CPU feature flags (Linux; empty elsewhere)
"""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


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
