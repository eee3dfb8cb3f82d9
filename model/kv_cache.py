"""Preallocated key/value cache: one (B, n_kv_heads, capacity, head_dim) buffer per layer.

Cache slots are independent from RoPE positions: slot 0 may hold a token at position 10_000.
Keys are stored after rotation, so decoding never re-rotates old keys.
"""

from __future__ import annotations

import torch


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
        shape = (n_layers, batch_size, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.key_mask: torch.Tensor | None = None  # (B, capacity) bool; False marks padding slots
        self.rope_seq_len = rope_seq_len
        self.length = 0  # filled slots, a Python int so the decode loop never syncs with the device

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

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def reset(self) -> None:
        self.length = 0
        self.key_mask = None

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.capacity:
            raise CacheFullError(
                f"KV cache is full: {self.length} cached + {new_tokens} new tokens exceed its capacity "
                f"of {self.capacity}; allocate a larger cache."
            )

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v: (B, n_kv_heads, L, D) at the next slots; return the filled (B, KV, S, D) views."""
        start, end = self.length, self.length + k.shape[2]
        self.k[layer, :, :, start:end] = k  # in-place: no per-step allocation
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, new_tokens: int) -> None:
        """Called once per forward, after every layer wrote its keys."""
        self.length += new_tokens
