"""Self-Extend's merged attention as flash-attention passes merged by their log-sum-exp: a drop-in for
model/extend.py's `merged_attention` when positions are consecutive (no padding, rows alike).

The plain formulation builds both (L, S) score matrices, selects between them and runs one float32
softmax: several passes over L x S floats that plain causal attention never makes. But with
consecutive positions the two scores cover disjoint key ranges: the query in slot s sees its
neighbours (slots s - W + 1 .. s) with the true rotations, and every slot up to s - W with the
grouped ones. The L queries fill the last L of S slots (P = S - L cached before them), so:

    grouped:    query i sees grouped keys up to slot P + i - W: a causal square shifted by W, one
                causal flash call (its block skipping intact), after a full-rectangle call over
                the keys every query sees when P > W
    neighbour:  the band of the W slots up to each query, in blocks of queries with one band mask

and each row's outputs are averaged with weights exp(lse_i - max lse): the softmax over the union of
the disjoint key sets, exactly.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128  # neighbour queries per call: a band mask of (128, 128 + W - 1) wastes little on masked keys


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and each row's log-sum-exp of the scaled scores, on the CPU's flash kernel.

    q: (B, H, M, D); k, v: (B, KV, N, D), H a multiple of KV; mask: None or (M, N) additive, q's dtype;
    causal: row i sees keys 0..i (top-left aligned, as SDPA's is_causal).
    Returns (B, H, M, D) in q's dtype and (B, H, M) float32. Every row must see a key: the kernel
    writes lse 0, not -inf, for a row that sees none (the band rows always see their own slot).
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One softmax over the union of disjoint key sets, from each set's (output, lse): sum_i
    exp(lse_i - m) out_i / sum_i exp(lse_i - m), m the largest lse of the row."""
    top = torch.stack([lse for _, lse in parts]).amax(0)  # (B, H, M); every row has some key
    weights = [torch.exp(lse - top)[..., None] for _, lse in parts]
    total = sum(w * out.float() for w, (out, _) in zip(weights, parts))
    return (total / sum(weights)).to(parts[0][0].dtype)


def band_mask(block: int, window: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(block, block + W - 1) additive mask: query row r of a block whose first query is in slot s0
    sees neighbour key s0 - W + 1 + j when r <= j <= r + W - 1."""
    r = torch.arange(block, device=device)[:, None]
    j = torch.arange(block + window - 1, device=device)[None]
    seen = (j >= r) & (j <= r + window - 1)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, -math.inf)


def neighbour_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of each query over the W slots up to its own, true rotations: q (B, H, L, D) in
    the last L of the S slots of k, v (B, KV, S, D); blocks of `block` queries share one band mask."""
    L, S = q.shape[2], k.shape[2]
    mask = band_mask(block, window, q.dtype, q.device)
    outs, lses = [], []
    for a in range(0, L, block):
        b = min(a + block, L)
        start = S - L + a - window + 1  # slot of the mask's key column 0
        lo, hi = max(start, 0), S - L + b
        out, lse = attention_with_lse(
            q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], mask[: b - a, lo - start : hi - start]
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, lse) pairs, each (B, H, L, ...), of each query over the slots at least W before its own,
    grouped rotations; rows with no such slot (the first W - P queries) have lse -inf."""
    B, H, L, D = q.shape
    S = k.shape[2]
    prefix = S - L  # P: cached slots before the first query
    if prefix >= window:  # every query has grouped keys; query i's reach ends at slot prefix - W + i
        offset = prefix - window
        parts = [
            attention_with_lse(
                q, k[:, :, offset : offset + L], v[:, :, offset : offset + L], None, causal=True
            )
        ]
        if offset:
            parts.append(attention_with_lse(q, k[:, :, :offset], v[:, :, :offset], None))
        return parts
    first = window - prefix  # queries before this one see no grouped key
    out = q.new_zeros(B, H, L, D)
    lse = torch.full((B, H, L), -math.inf, device=q.device)
    if first < L:
        keys = S - window  # = L - first: the causal square's side
        out[:, :, first:], lse[:, :, first:] = attention_with_lse(
            q[:, :, first:], k[:, :, :keys], v[:, :, :keys], None, causal=True
        )
    return [(out, lse)]


def self_extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    q_grouped: torch.Tensor,
    k_grouped: torch.Tensor,
    v: torch.Tensor,
    window: int,
    block: int = BLOCK,
) -> torch.Tensor:
    """`merged_attention` for consecutive positions: the L queries are the last L of the S slots, each
    key at its slot's position plus the queries' offset, no padding.

    q, q_grouped: (B, H, L, D); k, k_grouped, v: (B, KV, S, D). Returns (B, H, L, D) in q's dtype.
    """
    parts = grouped_attention(q_grouped, k_grouped, v, window)
    return merge([neighbour_attention(q, k, v, window, block), *parts])
