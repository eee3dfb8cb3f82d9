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
the disjoint key sets, exactly. A chunked remap's blocks are its chunks, so inside a block its far
bounds are constant and its near region is one causal square: three unmasked calls per chunk, as
ChunkLlama's reference computes it. A band remap's far
region (every key at least `cut` before the query) is instead one causal call over a square shifted by
`cut` (and one rectangle when cached keys precede it), as plain causal attention is computed: many
short calls cost more than their work (kernel overhead per call, docs/performance.md). No (L, S)
tensor is ever made; the masks are at most a block by the block plus the band.
"""

from __future__ import annotations

import math

import torch

from rope_llama.model.extend import Remap, region_bounds, regions

BLOCK = 128  # queries per call: the masked edges stay small against the unmasked runs


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and each row's log-sum-exp of the scaled scores, on the CPU's flash kernel.

    q: (B, H, M, D); k, v: (B, KV, N, D), H a multiple of KV; mask: None or (M, N) bool, True = attend;
    causal: row i sees keys 0..i (top-left aligned, as SDPA's is_causal).
    Returns (B, H, M, D) in q's dtype and (B, H, M) float32; a row that sees no key gets output 0 and
    lse -inf (the kernel itself writes lse 0 there).
    """
    additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -math.inf)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=additive
    )[:2]
    if mask is not None:
        seen = mask.any(-1)  # (M,)
        out = torch.where(seen[:, None], out, 0.0)
        lse = torch.where(seen, lse, -math.inf)
    return out, lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over the union of disjoint key sets, from each set's (output, lse): the output
    sum_i exp(lse_i - m) out_i / sum_i exp(lse_i - m), m the largest lse of the row, and the union's lse.
    Every row must see some key in some part."""
    top = torch.stack([lse for _, lse in parts]).amax(0)  # (B, H, M)
    weights = [torch.exp(lse - top)[..., None] for _, lse in parts]
    total = sum(weights)
    out = sum(w * out.float() for w, (out, _) in zip(weights, parts)) / total
    return out.to(parts[0][0].dtype), top + total[..., 0].log()


def query_blocks(remap: Remap, first: int, queries: int, block: int) -> list[tuple[int, int]]:
    """(a, b) row ranges: a band remap's of `block` queries, a chunked remap's one per chunk (its
    length is the block). first: the position of query row 0."""
    if remap.chunked:
        starts = sorted({0, *range(-first % remap.cut, queries, remap.cut)})
    else:
        starts = list(range(0, queries, block))
    return list(zip(starts, [*starts[1:], queries]))


def far_band_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cut: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output, lse) pairs, each (B, H, L, ...), of each query over the slots at least `cut` before its
    own (a band remap's far region): a causal square shifted by `cut`, one causal flash call (its block
    skipping intact), after a full-rectangle call over the keys every query sees. Rows with no such
    slot (the first cut - P queries, P cached slots before them) have lse -inf."""
    B, H, L, D = q.shape
    prefix = k.shape[2] - L  # P
    if prefix >= cut:  # every query has far keys; query i's reach ends at slot prefix - cut + i
        offset = prefix - cut
        parts = [
            attention_with_lse(q, k[:, :, offset : offset + L], v[:, :, offset : offset + L], None, True)
        ]
        if offset:
            parts.append(attention_with_lse(q, k[:, :, :offset], v[:, :, :offset], None))
        return parts
    first = cut - prefix  # queries before this one see no far key
    out = q.new_zeros(B, H, L, D)
    lse = torch.full((B, H, L), -math.inf, device=q.device)
    if first < L:
        keys = L - first  # the causal square's side
        out[:, :, first:], lse[:, :, first:] = attention_with_lse(
            q[:, :, first:], k[:, :, :keys], v[:, :, :keys], None, True
        )
    return [(out, lse)]


def blocked_attention(
    queries: tuple[torch.Tensor, ...],
    keys: tuple[torch.Tensor, ...],
    v: torch.Tensor,
    remap: Remap,
    start: int,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) over regions 0 .. len(queries) - 1, in blocks of queries (module docstring):
    queries[r] (B, H, L, D) and keys[r] (B, KV, S, D) rotated at region r's maps, slot j at position
    start + j, the L queries the last L of the S slots."""
    L, S = queries[0].shape[2], v.shape[2]
    first = start + S - L  # the position of query row 0
    outs, lses = [], []
    for a, b in query_blocks(remap, first, L, block):
        ends = torch.tensor([first + a, first + b - 1])  # the block's first and last query positions
        # key slots bounding each region at the two ends: region r holds slots lows[r] < j <= highs[r]
        bounds = [ends - start, *(x - start for x in region_bounds(remap, ends)), torch.tensor([-1, -1])]
        parts = []
        for r, (qr, kr) in enumerate(zip(queries, keys)):
            (high_a, high_b), (low_a, low_b) = bounds[r].tolist(), bounds[r + 1].tolist()
            if r == 0 and low_a == low_b:  # a run every query sees, then the causal square of the block
                runs = [(low_a + 1, high_a, None), (high_a, high_b + 1, "causal")]
            elif low_b < high_a:  # a run every query of the block sees, and the edges before and after
                runs = [
                    (low_a + 1, low_b + 1, "mask"),
                    (low_b + 1, high_a + 1, None),
                    (high_a + 1, high_b + 1, "mask"),
                ]
            else:
                runs = [(low_a + 1, high_b + 1, "mask")]
            for x, y, kind in runs:
                x, y = max(x, 0), min(y, S)
                if x >= y:
                    continue
                mask = None
                if kind == "mask":
                    qpos = torch.arange(first + a, first + b)
                    kpos = torch.arange(start + x, start + y)
                    mask = (regions(remap, qpos, kpos) == r) & (kpos[None] <= qpos[:, None])
                parts.append(
                    attention_with_lse(qr[:, :, a:b], kr[:, :, x:y], v[:, :, x:y], mask, kind == "causal")
                )
        out, lse = merge(parts)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


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
    last L of the S slots, no padding. block: queries per call of a band remap's near region (a
    chunked remap's blocks are its chunks).

    q and each of q_far (one per far region): (B, H, L, D); k, v, k_far (None: k): (B, KV, S, D).
    Returns (B, H, L, D) in q's dtype.
    """
    k_far = k if k_far is None else k_far
    if remap.chunked:  # a block per chunk: every far bound is constant, the near region a causal square
        keys = (k, *(k_far for _ in q_far))
        return blocked_attention((q, *q_far), keys, v, remap, start, block)[0]
    near = blocked_attention((q,), (k,), v, remap, start, block)
    return merge([near, *far_band_attention(q_far[0], k_far, v, remap.cut)])[0]
