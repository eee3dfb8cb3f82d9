"""A remap's merged attention (model/extend.py: Self-Extend, STRING, DCA, ReRoPE, leaky ReRoPE) as
flash-attention passes merged by their log-sum-exp: a drop-in for `merged_attention` when positions
are consecutive (no padding, rows alike).

The plain formulation builds one (L, S) score matrix per position map, selects between them and runs
one float32 softmax: several passes over L x S floats that plain causal attention never makes. But
each region of a remap holds, for a query at q, one run of keys (`region_bounds`: region r holds the
keys at bounds[r] < k <= bounds[r - 1], bounds[-1] = q), and the bounds never decrease as q grows.
With consecutive positions, a block of queries a..b-1 therefore sees in region r

    every key from bounds[r](b - 1) + 1 to bounds[r - 1](a):   one unmasked flash call (its keys and
                                                               queries rotated at that region's map)
    the keys before and after that run:                        a masked call each, the mask read from
                                                               `regions` over just those keys

and each row's outputs are averaged with weights exp(lse_i - max lse): the softmax over the union of
the disjoint key sets, exactly. A chunked remap's blocks are also cut at chunk starts, so inside a
block its far bounds are constant and only the near region's causal edge is masked. No (L, S) tensor
is ever made; the masks are at most a block by the block plus the band.
"""

from __future__ import annotations

import math

import torch

from rope_llama.model.extend import Remap, region_bounds, regions

BLOCK = 128  # queries per call: the masked edges stay small against the unmasked runs


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and each row's log-sum-exp of the scaled scores, on the CPU's flash kernel.

    q: (B, H, M, D); k, v: (B, KV, N, D), H a multiple of KV; mask: None or (M, N) bool, True = attend.
    Returns (B, H, M, D) in q's dtype and (B, H, M) float32; a row that sees no key gets output 0 and
    lse -inf (the kernel itself writes lse 0 there).
    """
    additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -math.inf)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=additive
    )[:2]
    if mask is not None:
        seen = mask.any(-1)  # (M,)
        out = torch.where(seen[:, None], out, 0.0)
        lse = torch.where(seen, lse, -math.inf)
    return out, lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One softmax over the union of disjoint key sets, from each set's (output, lse): sum_i
    exp(lse_i - m) out_i / sum_i exp(lse_i - m), m the largest lse of the row."""
    top = torch.stack([lse for _, lse in parts]).amax(0)  # (B, H, M); every row has some key
    weights = [torch.exp(lse - top)[..., None] for _, lse in parts]
    total = sum(w * out.float() for w, (out, _) in zip(weights, parts))
    return (total / sum(weights)).to(parts[0][0].dtype)


def query_blocks(remap: Remap, first: int, queries: int, block: int) -> list[tuple[int, int]]:
    """(a, b) row ranges of at most `block` queries; a chunked remap's also start at every chunk start.
    first: the position of query row 0."""
    cuts = set(range(0, queries, block))
    if remap.chunked:
        cuts.update(range(-first % remap.cut, queries, remap.cut))
    starts = sorted(cuts)
    return list(zip(starts, [*starts[1:], queries]))


def remap_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    q_far: tuple[torch.Tensor, ...],
    k_far: torch.Tensor | None,
    v: torch.Tensor,
    remap: Remap,
    start: int,
    block: int = BLOCK,
) -> torch.Tensor:
    """`merged_attention` for consecutive positions: key slot j at position start + j, the L queries the
    last L of the S slots, no padding.

    q and each of q_far (one per far region): (B, H, L, D); k, v, k_far (None: k): (B, KV, S, D).
    Returns (B, H, L, D) in q's dtype.
    """
    L, S = q.shape[2], k.shape[2]
    queries, keys = (q, *q_far), (k, *(k if k_far is None else k_far for _ in q_far))
    first = start + S - L  # the position of query row 0
    out = []
    for a, b in query_blocks(remap, first, L, block):
        ends = torch.tensor([first + a, first + b - 1])  # the block's first and last query positions
        # key slots bounding each region at the two ends: region r holds slots lows[r] < j <= highs[r]
        bounds = [ends - start, *(x - start for x in region_bounds(remap, ends)), torch.tensor([-1, -1])]
        parts = []
        for r, (qr, kr) in enumerate(zip(queries, keys)):
            (high_a, high_b), (low_a, low_b) = bounds[r].tolist(), bounds[r + 1].tolist()
            if low_b < high_a:  # a run every query of the block sees, and the edges before and after
                runs = [
                    (low_a + 1, low_b + 1, True),
                    (low_b + 1, high_a + 1, False),
                    (high_a + 1, high_b + 1, True),
                ]
            else:
                runs = [(low_a + 1, high_b + 1, True)]
            for x, y, masked in runs:
                x, y = max(x, 0), min(y, S)
                if x >= y:
                    continue
                mask = None
                if masked:
                    qpos = torch.arange(first + a, first + b)
                    kpos = torch.arange(start + x, start + y)
                    mask = (regions(remap, qpos, kpos) == r) & (kpos[None] <= qpos[:, None])
                parts.append(attention_with_lse(qr[:, :, a:b], kr[:, :, x:y], v[:, :, x:y], mask))
        out.append(merge(parts))
    return torch.cat(out, 2)
