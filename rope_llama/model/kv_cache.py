"""Preallocated key/value cache: one (B, n_kv_heads, capacity, head_dim) buffer per layer.

Cache slots are independent from RoPE positions: slot 0 may hold a token at position 10_000.
Keys are stored after rotation, so decoding never re-rotates old keys. With a remap (model/extend.py)
a cache built for the model (`for_model`) keeps each slot's position, which the regions are read from
(`positions=True`), and, when the far key map is not the identity (every remap but STRING,
`far_keys=True`), every key rotated at its far position too, in a second key buffer of the same size:
a key's far rotation never changes, so it is written once like the other. A model with `mix_previous_tokens` needs the ids before each new token:
a cache built for it (`token_ids=True`) keeps every slot's token id, so chunked prefill, one-token
steps and `rewind` all find a token's predecessors (and whether they are padding).

Two ways to write, chosen by what the caller hands the model as its cache:
- the KVCache itself: `update` appends at the Python-int `length` and attention covers the filled
  slots (any number of tokens; shapes change every step). This is what `model(..., kv_cache=cache)`
  always does.
- `cache.at_slot(slot)`, a SlotWrite: one token per row is written at the (1,) tensor `slot` and
  attention covers every slot under `SlotWrite.mask()`. Shapes stay fixed, so `torch.compile` builds
  such a step once (inference/generation.py, compile=True). The cache keeps no trace of it: nothing
  but an explicit SlotWrite takes this path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rope_llama.model.extend import ExtendConfig
    from rope_llama.model.llama import Llama


def cache_bytes(
    n_layers: int,
    batch_size: int,
    n_kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype: torch.dtype,
    positions: bool = False,
    far_keys: bool = False,
    token_ids: bool = False,
) -> int:
    """Bytes of a KVCache: k and v of every layer, 2 * n_layers * (B, n_kv_heads, capacity, head_dim),
    plus its int64 slot index; `positions` adds the (B, capacity) int64 slot positions, `far_keys` the
    far keys of every layer, `token_ids` the (B, capacity) int64 slot token ids."""
    buffers = 3 if far_keys else 2
    extra = 8 * batch_size * capacity * (int(positions) + int(token_ids))
    return (
        buffers * n_layers * batch_size * n_kv_heads * capacity * head_dim * dtype.itemsize
        + 8 * capacity
        + extra
    )


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
        seq_len: int | None = None,
        positions: bool = False,
        far_keys: bool = False,
        token_ids: bool = False,
    ):
        """seq_len: the sequence length RoPE is computed for during this generation (dynamic NTK's
        scale; None = the largest position seen so far), fixed so keys already cached stay consistent.
        positions: keep the slots' positions; far_keys: keep a remap's far keys (module docstring).
        token_ids: also keep each slot's token id (previous-token mixing; module docstring)."""
        if capacity < 1:
            raise ValueError(f"KV cache capacity must be a positive number of tokens, got {capacity}.")
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        # One tensor per layer (not one stacked tensor): a compiled step then writes in place,
        # where a write into a view of a shared buffer is copied whole by inductor.
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.k_far = (
            [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)] if far_keys else None
        )
        # (B, capacity) int64: the position of each slot's token (a remap's regions)
        self.slot_positions = (
            torch.zeros(batch_size, capacity, dtype=torch.long, device=device) if positions else None
        )
        # (B, capacity) int64: the token id of each slot (the predecessor of the next slot's token)
        self.token_ids = (
            torch.zeros(batch_size, capacity, dtype=torch.long, device=device) if token_ids else None
        )
        self.key_mask: torch.Tensor | None = None  # (B, capacity) bool; False marks padding slots
        self.seq_len = seq_len
        self.length = 0  # filled slots, a Python int so the decode loop never syncs with the device
        self._slots = torch.arange(capacity, device=device)  # slot indices: SlotWrite's slot and mask

    @classmethod
    def for_model(cls, model: Llama, batch_size: int, capacity: int, seq_len: int | None = None) -> KVCache:
        """Cache shaped for `model`'s config, on the device and in the dtype of its weights."""
        config, weight = model.config, model.embed.weight
        return cls(
            config.n_layers,
            batch_size,
            config.n_kv_heads,
            capacity,
            config.head_dim,
            device=weight.device,
            dtype=weight.dtype,
            seq_len=seq_len,
            positions=config.extend.remap is not None,
            far_keys=config.extend.remaps_keys,
            token_ids=config.mix_previous_tokens > 0,
        )

    @staticmethod
    def bytes_for_model(config, batch_size: int, capacity: int, dtype: torch.dtype) -> int:
        """What a cache of a model with this ModelConfig allocates in `dtype` (cache_bytes)."""
        return cache_bytes(
            config.n_layers,
            batch_size,
            config.n_kv_heads,
            capacity,
            config.head_dim,
            dtype,
            config.extend.remap is not None,
            config.extend.remaps_keys,
            config.mix_previous_tokens > 0,
        )

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def holds(self, extend: ExtendConfig) -> bool:
        """True when this cache keeps what the ExtendConfig `extend` reads: slot positions for a remap,
        far keys when its far key map is not the identity."""
        return self.slot_positions is not None and (self.k_far is not None or not extend.remaps_keys)

    @property
    def nbytes(self) -> int:
        kept = [t for t in (*(self.k_far or ()), self.slot_positions, self.token_ids) if t is not None]
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *kept))

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

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, k_far: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write k, v (and the far keys of a cache that keeps them): (B, KV, L, D) at the next L slots;
        return the (B, KV, S, D) keys, values and far keys (None without) of the S = length + L
        filled slots, to attend over."""
        start, end = self.length, self.length + k.shape[2]
        self.k[layer][:, :, start:end] = k  # in-place: no per-step allocation
        self.v[layer][:, :, start:end] = v
        if k_far is None:
            return self.k[layer][:, :, :end], self.v[layer][:, :, :end], None
        self.k_far[layer][:, :, start:end] = k_far
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end], self.k_far[layer][:, :, :end]

    def record_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Write the positions (L,) or (B, L) of the next L slots of a cache that keeps them; return the (B, S)
        positions of the S = length + L filled slots."""
        start, end = self.length, self.length + position_ids.shape[-1]
        self.slot_positions[:, start:end] = position_ids
        return self.slot_positions[:, :end]

    def previous_tokens(self, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the ids idx: (B, L) of the next L slots; return the ids 1..n slots before each (B, L, n)
        and whether each exists (B, L, n) bool: False before slot 0 and on padding slots."""
        return previous_tokens(
            self, idx, torch.arange(self.length, self.length + idx.shape[1], device=idx.device), n
        )

    def next_slot(self) -> torch.Tensor:
        """(1,) long index of the next free slot, a view of a preallocated index (no allocation)."""
        return self._slots[self.length : self.length + 1]

    def at_slot(self, slot: torch.Tensor) -> SlotWrite:
        """The fixed-shape way to write one token per row at `slot` (module docstring)."""
        return SlotWrite(self, slot)

    def advance(self, new_tokens: int) -> None:
        """Called once per forward, after every layer wrote its keys."""
        self.length += new_tokens


class SlotWrite:
    """A one-token write into `cache` at the (1,) long tensor `slot`, whose shapes never change.

    `update` has KVCache.update's contract, so the model's layers take either; it attends over every
    slot of the cache, which `mask` restricts to the slots up to `slot` that are not padding.
    The caller advances the cache.
    """

    def __init__(self, cache: KVCache, slot: torch.Tensor):
        self.cache, self.slot = cache, slot

    def holds(self, extend: ExtendConfig) -> bool:
        return self.cache.holds(extend)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, k_far: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write k, v (and far keys): (B, KV, 1, D) at `slot`; return the (B, KV, capacity, D)
        keys, values and far keys (None without)."""
        keys, values = self.cache.k[layer], self.cache.v[layer]
        keys[:, :, self.slot] = k
        values[:, :, self.slot] = v
        if k_far is None:
            return keys, values, None
        far = self.cache.k_far[layer]
        far[:, :, self.slot] = k_far
        return keys, values, far

    def record_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Write the positions (B, 1) of the token at `slot`; return the (B, capacity) positions."""
        self.cache.slot_positions[:, self.slot] = position_ids
        return self.cache.slot_positions

    def previous_tokens(self, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KVCache.previous_tokens for the one token per row idx: (B, 1) at `slot`."""
        return previous_tokens(self.cache, idx, self.slot, n)

    def mask(self) -> torch.Tensor:
        """(B|1, 1, 1, capacity) bool attention mask: the slots written so far, padding excluded."""
        mask = self.cache._slots <= self.slot  # (capacity,)
        if self.cache.key_mask is not None:
            return (mask & self.cache.key_mask)[:, None, None, :]
        return mask[None, None, None, :]


def previous_tokens(
    cache: KVCache, idx: torch.Tensor, slots: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write idx: (B, L) at the (L,) long `slots` of `cache.token_ids`; return the ids at slots - 1 ..
    slots - n (B, L, n) and (B, L, n) bool: that slot exists (>= 0) and is not padding."""
    if cache.token_ids is None:
        raise ValueError(
            "This KV cache keeps no token ids; build it with KVCache.for_model for a model with mix_previous_tokens."
        )
    cache.token_ids[:, slots] = idx
    before = slots[:, None] - torch.arange(1, n + 1, device=slots.device)  # (L, n)
    exists = (before >= 0).expand(idx.shape[0], -1, -1)
    before = before.clamp(min=0)
    if cache.key_mask is not None:
        exists = exists & cache.key_mask[:, before]
    return cache.token_ids[:, before], exists
