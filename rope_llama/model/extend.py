"""Training-free context extension in attention: Self-Extend and log-n scaling.

RoPE scalings (model/rope.py) change the rotation frequencies; the methods here change which
positions attention sees, with no training. They compose with every scaling: the model's one
`RotaryEmbedding` still serves every angle, for the true positions and for the grouped ones.

- self_extend (Jin et al. 2024, "LLM Maybe LongLM"; llama.cpp's group attention). With window W
  and group size G, a query at position q scores a key at position k with
    the neighbour score  <rot(q_vec, q), rot(k_vec, k)>                          if q - k < W,
    the grouped score    <rot(q_vec, q // G + W - W // G), rot(k_vec, k // G)>   otherwise,
  then the causal mask and one softmax over the merged scores. The shift W - W // G makes the
  grouped distance equal W where the neighbour window ends, so the distances a query sees run
  0..W-1 exactly, then grow G times slower: at most about q / G + W, which stays within the
  training length L0 while q / G + W <= L0.
- logn (Qwen's use_logn_attn): the query at position p is multiplied by max(1, log(n) / log(L0))
  with n = p + 1 (Qwen's 1-based count), so the attention entropy stays as in training as the
  context grows past L0; nothing changes inside the training length.

How keys are cached (model/kv_cache.py): after rotation, in BOTH rotations when self_extend is on,
the true-position key and the grouped-position key. A key's grouped position k // G never changes
as the context grows (only the query side is shifted), so both rotations are final once written,
and decoding never re-rotates the cached keys. The cost is a second key buffer, the size of the
first, allocated only for self_extend; the cache also keeps each slot's position, since the merge
rule reads true distances (positions are explicit, not cache slots).

This file is the math (pure functions) and the merged attention; model/llama.py wires them in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import torch
import torch.nn.functional as F

from rope_llama.model.rope import enum_choice


class ExtendMethod(StrEnum):
    NONE = "none"
    SELF_EXTEND = "self_extend"
    LOGN = "logn"


EXTEND_METHODS = tuple(m.value for m in ExtendMethod)

# Bytes of the explicit score matrices of one block of queries in `merged_attention`: the queries
# are processed in blocks so that a long sequence never holds (L, S) scores for every query at once.
SCORE_BLOCK_BYTES = 64 * 2**20
# The share of the training length a matched Self-Extend group's reach may use (`matched_group`).
MATCHED_REACH = 0.75


@dataclass(frozen=True)
class ExtendConfig:
    """Which extension attention uses; validated on construction.

    method:            one of EXTEND_METHODS.
    window:            self_extend: neighbour window W; keys closer than W positions keep their true
                       distance (the default is measured in docs/extrapolation.md).
    group:             self_extend: group size G; farther keys are seen G times closer.
    original_max_len:  logn: the length L0 the query scale is relative to; None until model/context.py
                       fills it from the model's trained lengths.
    """

    # metadata: each field's allowed values for the option schemas (core/schema.py; check_number's words)
    method: str = field(default="none", metadata={"choices": EXTEND_METHODS})
    window: int = field(default=64, metadata={"minimum": 1})
    group: int = field(default=32, metadata={"minimum": 1})
    original_max_len: int | None = field(default=None, metadata={"minimum": 2})

    def __post_init__(self):
        object.__setattr__(self, "method", enum_choice(self.method, ExtendMethod, "extend method", "methods"))
        for name, minimum, what in (
            ("window", 1, "a number of positions"),
            ("group", 1, "a group size"),
            ("original_max_len", 2, "a training length (log-n divides by its log)"),
        ):
            value = getattr(self, name)
            if name == "original_max_len" and value is None and not self.logn:
                continue  # only log-n reads it
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"extend {name} must be an integer >= {minimum} ({what}), got {value!r}.")

    @property
    def self_extend(self) -> bool:
        return self.method == ExtendMethod.SELF_EXTEND.value

    @property
    def logn(self) -> bool:
        return self.method == ExtendMethod.LOGN.value

    def plain_within(self, seq_len: int) -> bool:
        """True when positions below `seq_len` need no grouped score: every query-key distance is
        then below the window, or the group is 1 (a grouped position is then the true one), so
        Self-Extend is exactly plain attention (and cheaper)."""
        return not self.self_extend or seq_len <= self.window or self.group == 1


# ----------------------------------------------------------------------------- pure math


def grouped_key_positions(position_ids: torch.Tensor, group: int) -> torch.Tensor:
    """k // G: where a key sits for the grouped score. Same shape as position_ids."""
    return position_ids // group


def grouped_query_positions(position_ids: torch.Tensor, window: int, group: int) -> torch.Tensor:
    """q // G + W - W // G: where a query sits for the grouped score, so that grouped and true
    distances meet at W. Same shape as position_ids.

    Queries closer than W to position 0 never use a grouped score; for them the shifted position can
    exceed q, so it is capped at q: the result then never passes the largest true position, the range
    the RoPE table was asked for, and every grouped score that is used is unchanged.
    """
    return torch.minimum(position_ids, position_ids // group + (window - window // group))


def self_extend_reach(seq_len: int, window: int, group: int) -> int:
    """The largest query-key distance Self-Extend shows in a `seq_len`-token sequence: the last query
    against key 0, (seq_len - 1) // G + W - W // G when it is grouped, else the true seq_len - 1."""
    if seq_len <= window:
        return seq_len - 1
    return (seq_len - 1) // group + window - window // group


def matched_group(seq_len: int, window: int, max_len: int) -> int:
    """Self-Extend's counterpart of a matched RoPE factor: 1 (plain attention) when `seq_len` fits the
    training length, else the least group size G whose reach stays within MATCHED_REACH of it. Not the
    whole length: in training a distance d is seen only by the last max_len - d queries of a window,
    so the distances near max_len are barely trained (docs/extrapolation.md measures the choice)."""
    limit = int(MATCHED_REACH * max_len) - 1
    if window > limit:
        raise ValueError(
            f"extend window ({window}) must be at most {limit} ({MATCHED_REACH:.0%} of the training length "
            f"{max_len}, less one) for a matched group."
        )
    if seq_len <= max_len:
        return 1
    group = 2
    while self_extend_reach(seq_len, window, group) > limit:  # ends: the reach falls to W as G grows
        group += 1
    return group


def neighbour_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """True where a query scores a key with true positions (q - k < W), False where with grouped ones.

    query_positions: (..., L), key_positions: (..., S), broadcastable leading dims -> (..., L, S) bool.
    Keys after the query (q - k < 0) come out True; the causal mask removes them.
    """
    return (query_positions[..., :, None] - key_positions[..., None, :]) < window


def logn_scale(position_ids: torch.Tensor, original_max_len: int) -> torch.Tensor:
    """max(1, log(n) / log(L0)) with n = position + 1: the log-n query scale, float32, shape of
    position_ids. Formed in float64 so it is exactly 1 inside L0 and exact enough at any position."""
    n = position_ids.to(torch.float64) + 1
    return (n.log() / math.log(original_max_len)).clamp(min=1.0).float()


# ----------------------------------------------------------------------------- attention


def score_row_bytes(batch: int, n_heads: int, keys: int, itemsize: int) -> int:
    """Bytes `merged_attention` holds per query row: both scores, the float32 probabilities, the masks."""
    return batch * n_heads * keys * (2 * itemsize + 2 * 4) + 2 * batch * keys


def per_kv_head(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x (B, KV, R, M, K) @ y (B, KV, K, N) -> (B, KV, R, M, N): the R query heads that share a
    key-value head are the rows of one matmul, so the keys and values are never copied per head."""
    B, KV, R, M, _ = x.shape
    return (x.flatten(2, 3) @ y).view(B, KV, R, M, y.shape[-1])


def attention_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    q_grouped: torch.Tensor | None,
    k_grouped: torch.Tensor | None,
    near: torch.Tensor | None,
    mask: torch.Tensor | None,
    first: int = 0,
):
    """The softmax of attention, in blocks of queries: yields (a, b, probs) for query rows a..b-1 from row
    `first` on (0: every row),
    probs (B, KV, H/KV, b-a, end) float32 at least over the first `end` key slots (later ones are masked
    for the whole block), the query heads grouped by the key-value head they read.

    q, q_grouped: (B, H, L, D) queries rotated at their true and grouped positions; k, k_grouped:
        (B, KV, S, D) keys likewise, H a multiple of KV (query head h reads key-value head h // (H / KV),
        as SDPA's enable_gqa). q_grouped None: plain attention (every pair's true score).
    near: (B|1, 1, L, S) bool (`neighbour_mask`), True where the true score is used, else the grouped
        one; mask: None (causal) or (B|1, 1, L, S) bool, True = attend, never a slot after the query's
        own. The L queries sit in the last L of the S slots (or L = 1).
    Scores are scaled by 1/sqrt(D) as scaled_dot_product_attention; blocks hold at most
    SCORE_BLOCK_BYTES of scores. `merged_attention` and the attention maps (inference/attention_maps.py)
    both read these probabilities, so a map is the attention the model computes.
    """
    B, H, L, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    rep = H // KV
    shape = (B, KV, rep, L, D)  # the query heads grouped by the key-value head they read
    q = q.reshape(shape)
    q_grouped = None if q_grouped is None else q_grouped.reshape(shape)
    near = None if near is None else near[:, :, None]  # (B|1, 1, 1, L, S)
    mask = None if mask is None else mask[:, :, None]
    rows = max(1, SCORE_BLOCK_BYTES // score_row_bytes(B, H, S, q.element_size()))
    scale = 1.0 / math.sqrt(D)
    for a in range(first, L, rows):
        b = min(a + rows, L)
        end = S - L + b  # the slot of the block's last query: later keys are masked for the whole block
        scores = per_kv_head(q[..., a:b, :], k[:, :, :end].mT)  # (B, KV, H/KV, b-a, end)
        if q_grouped is not None:
            grouped = per_kv_head(q_grouped[..., a:b, :], k_grouped[:, :, :end].mT)
            scores = torch.where(near[..., a:b, :end], scores, grouped)
        if mask is None:
            allowed = (
                torch.arange(end, device=q.device) <= torch.arange(S - L + a, end, device=q.device)[:, None]
            )
        else:
            allowed = mask[..., a:b, :end]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
        yield a, b, scores.masked_fill(~allowed, -math.inf).softmax(-1)


def merged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    q_grouped: torch.Tensor,
    k_grouped: torch.Tensor,
    v: torch.Tensor,
    near: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Self-Extend attention: one softmax over the neighbour scores where `near`, grouped elsewhere
    (`attention_probabilities`, which says the shapes), times the values v (B, KV, S, D).
    Returns (B, H, L, D); the softmax runs in float32 at least (bf16 scores are upcast)."""
    B, H, L, D = q.shape
    out = []
    for _, _, probs in attention_probabilities(q, k, q_grouped, k_grouped, near, mask):
        probs = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
        out.append(per_kv_head(probs.to(v.dtype), v[:, :, : probs.shape[-1]]))
    return torch.cat(out, dim=-2).reshape(B, H, L, D)
