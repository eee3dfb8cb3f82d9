"""The memory budget: refuse an allocation that cannot fit, in one sentence, before making it.

    check_fits(nbytes, "the KV cache for 1,000,000,003 tokens", "max_new_tokens or cache_len", device)

Available memory is what the device can still give this process: on a CPU the kernel's MemAvailable,
lowered to what is left under the container's cgroup limit; on a GPU the driver's free memory plus
what PyTorch's allocator holds unused. A request may use at most HEADROOM of it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rope_llama.model.extend import SCORE_BLOCK_BYTES, score_row_bytes
from rope_llama.model.kv_cache import KVCache

# The estimates leave out small buffers and allocator rounding, and other processes keep allocating.
HEADROOM = 0.8
UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
# (limit, usage, statistics, reclaimable page-cache key) of the container's cgroup: v2, then v1
CGROUPS = (
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),
    (
        "memory/memory.limit_in_bytes",
        "memory/memory.usage_in_bytes",
        "memory/memory.stat",
        "total_inactive_file",
    ),
)


class MemoryBudgetError(ValueError):
    """An allocation larger than the memory budget: a user error, reported in one sentence."""


def human_bytes(nbytes: float) -> str:
    """Bytes in binary units with one decimal: 1536 -> '1.5 KiB'."""
    value, unit = float(nbytes), UNITS[0]
    for bigger in UNITS[1:]:
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def meminfo_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), else the free
    physical pages (os.sysconf); None where neither can be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts in KiB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # a name (or sysconf itself) the platform lacks
        return None


def cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under this container's cgroup memory limit, reclaimable page cache counted as free
    (as the kubelet counts it); None without a limit."""
    for limit_file, usage_file, stat_file, cache_key in CGROUPS:
        try:
            limit = int((root / limit_file).read_text())  # cgroup v2 writes "max" for no limit
            usage = int((root / usage_file).read_text())
            stats = dict(line.split() for line in (root / stat_file).read_text().splitlines())
        except (OSError, ValueError):
            continue
        return max(0, limit - usage + int(stats.get(cache_key, 0)))
    return None


def available_memory(device: torch.device | str) -> int | None:
    """Bytes this process can still allocate on `device`; None when that cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return min((n for n in (meminfo_available(), cgroup_available()) if n is not None), default=None)
    return None


def check_fits(nbytes: int, what: str, knob: str, device: torch.device | str = "cpu") -> None:
    """Raise MemoryBudgetError unless `what` (nbytes on `device`) fits in HEADROOM of the memory
    available now. The sentence names the size, the limit and the option to lower (`knob`).
    Nothing is refused where the available memory cannot be read."""
    available = available_memory(device)
    if available is None or nbytes <= HEADROOM * available:
        return
    raise MemoryBudgetError(
        f"{what[:1].upper()}{what[1:]} needs {human_bytes(nbytes)} but at most {human_bytes(HEADROOM * available)} "
        f"may be used ({HEADROOM:.0%} of the {human_bytes(available)} of {torch.device(device).type.upper()} memory "
        f"available); lower {knob}."
    )


def forward_bytes(config, batch: int, tokens: int, dtype: torch.dtype, mask_keys: int = 0) -> int:
    """Peak bytes of one forward of a ModelConfig's model over (batch, tokens) ids, besides the
    weights and the KV cache: every intermediate of a block (input and normed input, the attention's
    qkv, rotated q and k and output, the MLP's gate/up and SwiGLU output; counted together, as the
    allocator may keep the freed ones), the logits (counted as float32) and, when the forward builds
    an attention mask over `mask_keys` keys, the (batch, tokens, mask_keys) bool mask with the
    additive `dtype` copy attention makes of it."""
    attention = 3 * (config.n_heads + config.n_kv_heads) * config.head_dim
    block = 2 * config.d_model + attention + 3 * config.ffn_hidden
    per_token = block * dtype.itemsize + 4 * config.vocab_size + mask_keys * (1 + dtype.itemsize)
    return batch * tokens * per_token + remap_score_bytes(config, batch, max(tokens, mask_keys), dtype)


def remap_score_bytes(config, batch: int, keys: int, dtype: torch.dtype) -> int:
    """A remap's merged attention (model/extend.py) holds one block of query rows' scores at a time:
    SCORE_BLOCK_BYTES, or a single row when one row over `keys` keys is larger; 0 without a remap."""
    remap = config.extend.remap
    if remap is None:
        return 0
    maps = 1 + len(remap.query_maps)
    return max(score_row_bytes(batch, config.n_heads, keys, dtype.itemsize, maps), SCORE_BLOCK_BYTES)


def new_kv_cache(model, batch_size: int, capacity: int, seq_len: int | None = None) -> KVCache:
    """KVCache.for_model, refused in one sentence before anything is allocated when it cannot fit."""
    if capacity >= 1:  # KVCache itself refuses the rest
        check_fits(
            KVCache.bytes_for_model(model.config, batch_size, capacity, model.embed.weight.dtype),
            f"a KV cache of {batch_size} x {capacity:,} tokens",
            "the cache capacity or the batch size",
            model.embed.weight.device,
        )
    return KVCache.for_model(model, batch_size, capacity, seq_len=seq_len)
