"""Preallocated key/value cache: one (B, n_kv_heads, capacity, head_dim) buffer per layer.

Cache slots are independent from RoPE positions: slot 0 may hold a token at position 10_000.
Keys are stored after rotation, so decoding never re-rotates old keys.

Two ways to write: the default appends at the Python-int `length` and attention covers the filled
slots (any number of tokens, shapes change every step); with `write_slot` set (a (1,) tensor), a
one-token step writes there and attention covers every slot under `slot_mask()`: shapes stay fixed,
so `torch.compile` builds the decode step once (inference/generation.py, compile=True).
"""

from __future__ import annotations

import torch

from inference.memory import check_fits


def cache_bytes(
    n_layers: int, batch_size: int, n_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of a KVCache: k and v of every layer, 2 * n_layers * (B, n_kv_heads, capacity, head_dim),
    plus its int64 slot index."""
    return 2 * n_layers * batch_size * n_kv_heads * capacity * head_dim * dtype.itemsize + 8 * capacity


class CacheFullError(ValueError):
    """Raised when a forward would write past the cache capacity."""


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        capacity: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        rope_seq_len: int | None = None,
    ):
        """rope_seq_len: the total length dynamic-NTK RoPE is scaled for during this generation
        (None = the largest position seen so far); fixed so keys already cached stay consistent."""
        if capacity < 1:
            raise ValueError(f"KV cache capacity must be a positive number of tokens, got {capacity}.")
        check_fits(
            cache_bytes(n_layers, batch_size, n_kv_heads, capacity, head_dim, dtype),
            f"a KV cache of {batch_size} x {capacity:,} tokens",
            "the cache capacity or the batch size",
            device,
        )
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        # One tensor per layer (not one stacked tensor): a compiled step then writes in place,
        # where a write into a view of a shared buffer is copied whole by inductor.
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.key_mask: torch.Tensor | None = None  # (B, capacity) bool; False marks padding slots
        self.rope_seq_len = rope_seq_len
        self.length = 0  # filled slots, a Python int so the decode loop never syncs with the device
        self.write_slot: torch.Tensor | None = None  # (1,) long: static-shape one-token writes go here
        self._slots = torch.arange(capacity, device=device)

    @classmethod
    def for_model(cls, config, batch_size: int, capacity: int, device=None, dtype=None, rope_seq_len=None):
        """Cache shaped for a ModelConfig."""
        return cls(
            config.n_layers,
            batch_size,
            config.n_kv_heads,
            capacity,
            config.head_dim,
            device=device or "cpu",
            dtype=dtype or torch.float32,
            rope_seq_len=rope_seq_len,
        )

    @staticmethod
    def bytes_for_model(config, batch_size: int, capacity: int, dtype: torch.dtype) -> int:
        """What `for_model` with these arguments allocates (cache_bytes for a ModelConfig)."""
        return cache_bytes(config.n_layers, batch_size, config.n_kv_heads, capacity, config.head_dim, dtype)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def reset(self) -> None:
        self.length = 0
        self.key_mask = None

    def rewind(self, length: int) -> None:
        """Forget every slot from `length` on: the next write goes there (e.g. to score another
        continuation of the same prefix). Slots are overwritten, never cleared."""
        if not 0 <= length <= self.length:
            raise ValueError(f"Cannot rewind the KV cache to {length} tokens: it holds {self.length}.")
        self.length = length

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.capacity:
            raise CacheFullError(
                f"KV cache is full: {self.length} cached + {new_tokens} new tokens exceed its capacity "
                f"of {self.capacity}; allocate a larger cache."
            )

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v: (B, n_kv_heads, L, D) at the next slots (or at `write_slot`); return the
        (B, KV, S, D) keys and values to attend over: the filled slots (or every slot)."""
        if self.write_slot is not None:  # static shapes: index by a tensor, attend over all slots
            self.k[layer][:, :, self.write_slot] = k
            self.v[layer][:, :, self.write_slot] = v
            return self.k[layer], self.v[layer]
        start, end = self.length, self.length + k.shape[2]
        self.k[layer][:, :, start:end] = k  # in-place: no per-step allocation
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def select_next_slot(self) -> None:
        """Point `write_slot` at the next free slot (a view of a preallocated index: no allocation)."""
        self.write_slot = self._slots[self.length : self.length + 1]

    def slot_mask(self) -> torch.Tensor:
        """(B|1, 1, 1, capacity) bool for a one-token step at `write_slot`: the slots written so far,
        padding excluded (the attention mask of the static-shape path)."""
        mask = self._slots <= self.write_slot  # (capacity,)
        if self.key_mask is not None:
            return (mask & self.key_mask)[:, None, None, :]
        return mask[None, None, None, :]

    def advance(self, new_tokens: int) -> None:
        """Called once per forward, after every layer wrote its keys."""
        self.length += new_tokens
