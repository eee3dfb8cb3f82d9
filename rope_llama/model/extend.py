"""Training-free context extension in attention: relative-position remaps (Self-Extend, STRING, Dual
Chunk Attention, ReRoPE, leaky ReRoPE) and log-n scaling.

RoPE scalings (model/rope.py) change the rotation frequencies; the methods here change which
positions attention sees, with no training. They compose with every scaling: the model's one
`RotaryEmbedding` still serves every angle, for the true positions and for the remapped ones.

One mechanism, a `Remap`: a query at position q and a key at k <= q fall in a region, and each
region scores the pair at its own positions. Region 0 ("near") always uses the true positions; the
far regions use the query at query_map(q) and the key at key_map(k), ONE key map shared by every far
region (so a KV cache keeps at most one more key rotation). Which region: by distance (`cut`: q - k <
cut is near, every other pair is far) or by chunk (`chunked`: the same chunk of length c is near, the
previous chunk region 1, any older chunk region 2). All regions' scores then go through the causal
mask and ONE softmax. Each method is a small pure function of its parameters returning its Remap:

- self_extend (Jin et al. 2024, "LLM Maybe LongLM"; llama.cpp's group attention), window W, group G:
  near q - k < W; far query q // G + W - W // G, key k // G. The shift W - W // G makes the grouped
  distance equal W where the window ends, so the distances a query sees run 0..W-1 exactly, then grow
  G times slower: at most about q / G + W (`self_extend_reach`).
- string (An et al. 2024, "Why does the effective context length of LLMs fall short?"), shift S and
  local window W: near q - k < S; far query q - S + W, key k (true): a distance d >= S is seen as
  d - S + W, so the rarely trained largest distances are never used. Choices the formula hides:
    * distance S is in the shifted part only. The reference (string_for_llama.py) merges a band of
      window S + 1 (distances 0..S) with a shifted triangle that also holds distance S, so its softmax
      counts key q - S twice; here each key is counted once, as every other method does.
    * its cos/sin temperature 0.1 ln 2 + 1 is not part of the method: it scales every score (inside
      the band too) by (0.1 ln 2 + 1)^2, a YaRN-like attention factor, which RopeConfig owns already:
      rope.attention_factor=1.0693 adds it to any method.
    * defaults: S = L0 // 3 (the paper's), W = min(128, L0 // 16) (at least 1): the paper's 128 for every model it
      runs (L0 >= 2048), and its 2,048-token TinyLlama proportion below, where 128 would exceed S.
- dca (An et al. 2024, ChunkLlama), chunk size s and local window w: chunks of c = s - w positions.
  Intra-chunk pairs (same chunk) are near, at true positions: the reference puts both at k % c and q %
  c, whose difference is q - k within a chunk, so the scores are the same (RoPE is relative). The
  successive-chunk query sits at min(q % c + c, s), the inter-chunk query at min(2c - 1, s) (the
  reference's successive map at c - 1), every far key at k % c: every distance stays within s.
  Defaults s = 3 * L0 // 4 and w = L0 // 8, at least 1 (the reference's replace_with_chunkllama). Its length
  dependent cos/sin scale (0.05 ln(T / L0) + 1, unused for the paper's results) is not taken, as
  STRING's temperature.
- rerope (Su 2023, bojone/rerope), window w: near q - k < w; far query at w, key at 0: every distance
  past w is seen as w. Default w = L0 // 4 (the reference's reported 1,024 of 4,096; its patch file
  uses 512).
- leaky_rerope, window w and leak k: far query at (q + w (k - 1)) / k, key at k / k, fractional
  positions: a distance d >= w is seen as w + (d - w) / k (slope 1/k). Default k = 16 (the reference's
  scaling_factor), w as rerope. The references also scale queries by log-n; here log-n is its own
  method (`logn`), not folded in.
- logn (Qwen's use_logn_attn): the query at position p is multiplied by max(1, log(n) / log(L0))
  with n = p + 1 (Qwen's 1-based count), so the attention entropy stays as in training as the
  context grows past L0; nothing changes inside the training length.

A remapped query position is capped at q (`remapped_query_positions`): a query uses a far map only
for keys in its region, where every map is at most q, so the cap changes no score that is used and
keeps every position within the range the RoPE table was asked for.

How keys are cached (model/kv_cache.py): after rotation, and, when the far key map is not the
identity, rotated at the far key position too. A key's far position depends on the key alone, never
on the query, so both rotations are final once written, and decoding never re-rotates the cached
keys. The cost is a second key buffer, the size of the first, for every remap but STRING; the cache
also keeps each slot's position, since the regions are read from true positions (positions are
explicit, not cache slots).

This file is the math (pure functions) and the merged attention; model/llama.py wires them in.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rope_llama.model.rope import enum_choice


class ExtendMethod(StrEnum):
    NONE = "none"
    SELF_EXTEND = "self_extend"
    LOGN = "logn"
    STRING = "string"
    DCA = "dca"
    REROPE = "rerope"
    LEAKY_REROPE = "leaky_rerope"


EXTEND_METHODS = tuple(m.value for m in ExtendMethod)
# What each method is called in a sentence (the exports' refusals).
EXTEND_NAMES = {
    "none": "plain attention",
    "self_extend": "Self-Extend",
    "logn": "log-n attention",
    "string": "STRING",
    "dca": "Dual Chunk Attention",
    "rerope": "ReRoPE",
    "leaky_rerope": "leaky ReRoPE",
}
# The methods that remap relative positions (a `Remap`); log-n scales queries instead.
REMAP_METHODS = ("self_extend", "string", "dca", "rerope", "leaky_rerope")

# Bytes of the explicit score matrices of one block of queries in `merged_attention`: the queries
# are processed in blocks so that a long sequence never holds (L, S) scores for every query at once.
SCORE_BLOCK_BYTES = 64 * 2**20
# The share of the training length a matched Self-Extend group's reach may use (`matched_group`).
MATCHED_REACH = 0.75
# Defaults derived from the training length L0 (module docstring says whose choice each is).
STRING_SHIFT_DIVISOR = 3  # S = L0 // 3
STRING_WINDOW = 128  # W = min(128, L0 // 16)
STRING_WINDOW_DIVISOR = 16
DCA_CHUNK_SHARE = (3, 4)  # s = 3 * L0 // 4
DCA_WINDOW_DIVISOR = 8  # w = L0 // 8
REROPE_WINDOW_DIVISOR = 4  # w = L0 // 4
LEAK = 16.0  # leaky ReRoPE's k: slope 1/k past the window


@dataclass(frozen=True)
class ExtendConfig:
    """Which extension attention uses; validated on construction.

    method:            one of EXTEND_METHODS.
    window:            self_extend: neighbour window W; keys closer than W positions keep their true
                       distance (the default is measured in docs/extrapolation.md).
    group:             self_extend: group size G; farther keys are seen G times closer.
    original_max_len:  the training length L0 that log-n and the derived defaults are relative to; None
                       until model/context.py fills it from the model's trained lengths.
    shift:             string: S; distances >= S are shifted (None = L0 // 3).
    local_window:      string: W, the distance S is seen as (None = min(128, L0 // 16)); dca: w, chunks
                       are of chunk - w positions (None = L0 // 8); rerope, leaky_rerope: w, distances
                       below it are kept (None = L0 // 4).
    chunk:             dca: chunk size s (None = 3 * L0 // 4).
    leak:              leaky_rerope: k; past the window distances grow with slope 1/k.
    Each numeric field's metadata holds its allowed range (keyword arguments of core/checks.py's
    check_number) and, in `means`, what it means or what None derives.
    """

    method: str = field(default="none", metadata={"choices": EXTEND_METHODS})
    window: int = field(default=64, metadata={"minimum": 1, "means": "a number of positions"})
    group: int = field(default=32, metadata={"minimum": 1, "means": "a group size"})
    original_max_len: int | None = field(
        default=None, metadata={"minimum": 2, "means": "a training length (log-n divides by its log)"}
    )
    shift: int | None = field(default=None, metadata={"minimum": 2, "means": "None = L0 // 3"})
    local_window: int | None = field(
        default=None,
        metadata={
            "minimum": 1,
            "means": "None = min(128, L0 // 16) for string, L0 // 8 for dca, L0 // 4 for (leaky) rerope",
        },
    )
    chunk: int | None = field(default=None, metadata={"minimum": 2, "means": "None = 3 * L0 // 4"})
    leak: float = field(default=LEAK, metadata={"above": 1, "means": "the slope past the window is 1 / leak"})

    def __post_init__(self):
        object.__setattr__(self, "method", enum_choice(self.method, ExtendMethod, "extend method", "methods"))
        for f in fields(self):
            if any(key in f.metadata for key, _, _ in BOUNDS):  # `method`'s metadata is its choices
                optional = "None" in f.type and not (f.name == "original_max_len" and self.logn)
                check_field(f.name, getattr(self, f.name), f.type.startswith("int"), optional, f.metadata)
        if self.method in REMAP_METHODS:
            remap_parameters(self)  # refuses parameters that cannot work, in one sentence

    @property
    def self_extend(self) -> bool:
        return self.method == ExtendMethod.SELF_EXTEND.value

    @property
    def logn(self) -> bool:
        return self.method == ExtendMethod.LOGN.value

    @property
    def remap(self) -> Remap | None:
        """The method's `Remap` (None: no remap, plain or log-n attention)."""
        if self.method not in REMAP_METHODS:
            return None
        return REMAPS[self.method](**remap_parameters(self))

    @property
    def remaps_keys(self) -> bool:
        """True when the far key map is not the identity: a KV cache then keeps a second key rotation."""
        return self.method in REMAP_METHODS and self.method != ExtendMethod.STRING.value

    def plain_within(self, seq_len: int) -> bool:
        """True when positions below `seq_len` need no far score: every pair is then near (every distance
        below the window, or every position in the first chunk), or Self-Extend's group is 1 (a grouped
        position is then the true one), so the method is exactly plain attention (and cheaper)."""
        remap = self.remap
        return remap is None or seq_len <= remap.cut or (self.self_extend and self.group == 1)


# The bound keys of a field's metadata (core/checks.py's check_number takes the same), how each reads.
BOUNDS = (
    ("minimum", ">=", operator.ge),
    ("above", ">", operator.gt),
    ("maximum", "<=", operator.le),
    ("below", "<", operator.lt),
)


def check_field(name: str, value, integer: bool, optional: bool, limits) -> None:
    """One sentence unless `value` is within `limits` (a field's metadata: minimum / maximum / above /
    below / means, as core/checks.py's check_number takes them); None passes when `optional`."""
    if value is None and optional:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and (isinstance(value, int) or (not integer and math.isfinite(value)))
    ok = ok and all(key not in limits or holds(value, limits[key]) for key, _, holds in BOUNDS)
    if not ok:
        bounds = " and ".join(f"{sign} {limits[key]}" for key, sign, _ in BOUNDS if key in limits)
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"extend {name} must be {kind} {bounds} ({limits['means']}), got {value!r}.")


def remap_parameters(cfg: ExtendConfig) -> dict:
    """The remap method's parameters with the defaults derived from L0 filled in, or one sentence naming
    the field, its value and what is allowed when they cannot work."""
    method, l0 = cfg.method, cfg.original_max_len
    if cfg.self_extend:
        return {"window": cfg.window, "group": cfg.group}
    derived = {
        "string": ("shift", "local_window"),
        "dca": ("chunk", "local_window"),
        "rerope": ("local_window",),
        "leaky_rerope": ("local_window",),
    }[method]
    if l0 is None and any(getattr(cfg, name) is None for name in derived):
        unset = next(name for name in derived if getattr(cfg, name) is None)
        raise ValueError(
            f"extend={method} derives {unset} from original_max_len, which is unset; give extend.{unset} or "
            "extend.original_max_len (the training length)."
        )
    bound = l0 if l0 is not None else math.inf
    if method == "string":
        shift = cfg.shift if cfg.shift is not None else l0 // STRING_SHIFT_DIVISOR
        window = cfg.local_window
        if window is None:
            window = max(1, min(STRING_WINDOW, l0 // STRING_WINDOW_DIVISOR))
        if not window < shift <= bound:
            within = "" if l0 is None else f" and at most the training length ({l0})"
            raise ValueError(
                f"extend shift must be above local_window ({window}){within} for extend=string, got {shift}."
            )
        return {"shift": shift, "window": window}
    if method == "dca":
        chunk = cfg.chunk if cfg.chunk is not None else l0 * DCA_CHUNK_SHARE[0] // DCA_CHUNK_SHARE[1]
        window = cfg.local_window if cfg.local_window is not None else max(1, l0 // DCA_WINDOW_DIVISOR)
        if not chunk <= bound:
            raise ValueError(
                f"extend chunk must be at most the training length ({l0}) for extend=dca, got {chunk}."
            )
        if not 1 <= window < chunk:
            raise ValueError(
                f"extend local_window must be an integer in [1, {chunk - 1}] (below the chunk, {chunk}) "
                f"for extend=dca, got {window}."
            )
        return {"chunk": chunk, "window": window}
    window = cfg.local_window if cfg.local_window is not None else l0 // REROPE_WINDOW_DIVISOR
    if not 1 <= window < bound:
        raise ValueError(
            f"extend local_window must be an integer >= 1 and below the training length ({l0}) for "
            f"extend={method}, got {window}."
        )
    return {"window": window} if method == "rerope" else {"window": window, "leak": cfg.leak}


# ----------------------------------------------------------------------------- the remaps


class Remap(NamedTuple):
    """Which relative distances use which query/key position map (module docstring).

    cut:         chunked False: a pair with q - k < cut is near, every other pair far (region 1);
                 chunked True: the chunk length c; the same chunk is near, the previous one region 1,
                 any older one region 2.
    query_maps:  one per far region: query positions (...) -> their positions in that region (...).
    key_map:     the far regions' key map, (...) -> (...); None: the true positions.
    """

    cut: int
    chunked: bool
    query_maps: tuple[Callable[[torch.Tensor], torch.Tensor], ...]
    key_map: Callable[[torch.Tensor], torch.Tensor] | None


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


def shifted_query_positions(position_ids: torch.Tensor, shift: int, window: int) -> torch.Tensor:
    """STRING's q - S + W (below 0 for queries that never use it; `remapped_query_positions` caps)."""
    return position_ids - shift + window


def chunk_key_positions(position_ids: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """DCA's k % c: a key's position inside its chunk."""
    return position_ids % chunk_len


def successive_query_positions(position_ids: torch.Tensor, chunk_len: int, chunk: int) -> torch.Tensor:
    """DCA's min(q % c + c, s): a query against the keys of the chunk before its own."""
    return torch.clamp(position_ids % chunk_len + chunk_len, max=chunk)


def fixed_positions(position_ids: torch.Tensor, position: int | float) -> torch.Tensor:
    """Every position at `position` (DCA's inter-chunk query, ReRoPE's query w and key 0)."""
    return torch.full_like(position_ids, position)


def leaky_query_positions(position_ids: torch.Tensor, window: int, leak: float) -> torch.Tensor:
    """Leaky ReRoPE's (q + w (k - 1)) / k, float64: against keys at k / k the distance is w + (d - w) / k."""
    return (position_ids.to(torch.float64) + window * (leak - 1)) / leak


def leaky_key_positions(position_ids: torch.Tensor, leak: float) -> torch.Tensor:
    """Leaky ReRoPE's k / k, float64."""
    return position_ids.to(torch.float64) / leak


def self_extend_remap(window: int, group: int) -> Remap:
    return Remap(
        window,
        False,
        (partial(grouped_query_positions, window=window, group=group),),
        partial(grouped_key_positions, group=group),
    )


def string_remap(shift: int, window: int) -> Remap:
    return Remap(shift, False, (partial(shifted_query_positions, shift=shift, window=window),), None)


def dca_remap(chunk: int, window: int) -> Remap:
    c = chunk - window
    inter = min(2 * c - 1, chunk)  # the reference's successive map at position c - 1
    maps = (
        partial(successive_query_positions, chunk_len=c, chunk=chunk),
        partial(fixed_positions, position=inter),
    )
    return Remap(c, True, maps, partial(chunk_key_positions, chunk_len=c))


def rerope_remap(window: int) -> Remap:
    return Remap(
        window, False, (partial(fixed_positions, position=window),), partial(fixed_positions, position=0)
    )


def leaky_rerope_remap(window: int, leak: float) -> Remap:
    return Remap(
        window,
        False,
        (partial(leaky_query_positions, window=window, leak=leak),),
        partial(leaky_key_positions, leak=leak),
    )


REMAPS = {
    "self_extend": self_extend_remap,
    "string": string_remap,
    "dca": dca_remap,
    "rerope": rerope_remap,
    "leaky_rerope": leaky_rerope_remap,
}


def remapped_query_positions(remap: Remap, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each far region's query positions, capped at the true ones (module docstring). Same shape."""
    return tuple(
        torch.minimum(position_ids.to(p.dtype), p) for p in (m(position_ids) for m in remap.query_maps)
    )


def region_bounds(remap: Remap, query_positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The last key position of each far region, nearest first: far region i (1, 2, ...) holds the keys
    at bounds[i] < k <= bounds[i - 1] (bounds[len] = -inf), the near region those above bounds[0].
    query_positions (...) -> tuple of (...), non-decreasing in the query position."""
    if not remap.chunked:
        return (query_positions - remap.cut,)
    start = query_positions // remap.cut * remap.cut  # the first position of the query's chunk
    return (start - 1, start - remap.cut - 1)


def regions(remap: Remap, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """The region of every pair: query_positions (..., L), key_positions (..., S), broadcastable leading
    dims -> (..., L, S) uint8, 0 = near (true positions), i = far region i. Keys after the query come out
    0; the causal mask removes them."""
    keys = key_positions[..., None, :]
    return sum((keys <= b[..., :, None]).to(torch.uint8) for b in region_bounds(remap, query_positions))


def remapped_distances(
    remap: Remap, query_positions: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor:
    """The relative distance each pair is scored at: (..., L), (..., S) -> (..., L, S) float64."""
    q, k = query_positions.to(torch.float64), key_positions.to(torch.float64)
    seen = q[..., :, None] - k[..., None, :]
    region = regions(remap, query_positions, key_positions)
    keys = k if remap.key_map is None else remap.key_map(key_positions).to(torch.float64)
    for i, far in enumerate(remapped_query_positions(remap, query_positions), start=1):
        seen = torch.where(region == i, far.to(torch.float64)[..., :, None] - keys[..., None, :], seen)
    return seen


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


def logn_scale(position_ids: torch.Tensor, original_max_len: int) -> torch.Tensor:
    """max(1, log(n) / log(L0)) with n = position + 1: the log-n query scale, float32, shape of
    position_ids. Formed in float64 so it is exactly 1 inside L0 and exact enough at any position."""
    n = position_ids.to(torch.float64) + 1
    return (n.log() / math.log(original_max_len)).clamp(min=1.0).float()


# ----------------------------------------------------------------------------- attention


def score_row_bytes(batch: int, n_heads: int, keys: int, itemsize: int, maps: int = 2) -> int:
    """Bytes `merged_attention` holds per query row: the scores of each of `maps` position maps (near
    and far), the float32 probabilities, the masks."""
    return batch * n_heads * keys * (maps * itemsize + 2 * 4) + 2 * batch * keys


def per_kv_head(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x (B, KV, R, M, K) @ y (B, KV, K, N) -> (B, KV, R, M, N): the R query heads that share a
    key-value head are the rows of one matmul, so the keys and values are never copied per head."""
    B, KV, R, M, _ = x.shape
    return (x.flatten(2, 3) @ y).view(B, KV, R, M, y.shape[-1])


def attention_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    q_far: tuple[torch.Tensor, ...],
    k_far: torch.Tensor | None,
    region: torch.Tensor | None,
    mask: torch.Tensor | None,
    first: int = 0,
):
    """The softmax of attention, in blocks of queries: yields (a, b, probs) for query rows a..b-1 from row
    `first` on (0: every row),
    probs (B, KV, H/KV, b-a, end) float32 at least over the first `end` key slots (later ones are masked
    for the whole block), the query heads grouped by the key-value head they read.

    q: (B, H, L, D) queries rotated at their true positions, q_far: one such per far region, rotated at
        that region's positions (empty: plain attention, every pair's true score); k: (B, KV, S, D) keys
        at their true positions, k_far at the far key positions (None: the true ones), H a multiple of KV
        (query head h reads key-value head h // (H / KV), as SDPA's enable_gqa).
    region: (B|1, 1, L, S) uint8 (`regions`), which score each pair uses (None with q_far empty);
        mask: None (causal) or (B|1, 1, L, S) bool, True = attend, never a slot after the query's
        own. The L queries sit in the last L of the S slots (or L = 1).
    Scores are scaled by 1/sqrt(D) as scaled_dot_product_attention; blocks hold at most
    SCORE_BLOCK_BYTES of scores. `merged_attention` and the attention maps (viz/attention_maps.py)
    both read these probabilities, so a map is the attention the model computes.
    """
    B, H, L, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    rep = H // KV
    shape = (B, KV, rep, L, D)  # the query heads grouped by the key-value head they read
    q = q.reshape(shape)
    q_far = tuple(x.reshape(shape) for x in q_far)
    k_far = k if k_far is None else k_far
    region = None if region is None else region[:, :, None]  # (B|1, 1, 1, L, S)
    mask = None if mask is None else mask[:, :, None]
    maps = 1 + len(q_far)
    rows = max(1, SCORE_BLOCK_BYTES // score_row_bytes(B, H, S, q.element_size(), maps))
    scale = 1.0 / math.sqrt(D)
    for a in range(first, L, rows):
        b = min(a + rows, L)
        end = S - L + b  # the slot of the block's last query: later keys are masked for the whole block
        scores = per_kv_head(q[..., a:b, :], k[:, :, :end].mT)  # (B, KV, H/KV, b-a, end)
        for i, far in enumerate(q_far, start=1):
            remapped = per_kv_head(far[..., a:b, :], k_far[:, :, :end].mT)
            scores = torch.where(region[..., a:b, :end] == i, remapped, scores)
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
    q_far: tuple[torch.Tensor, ...],
    k_far: torch.Tensor | None,
    v: torch.Tensor,
    region: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Remapped attention: one softmax over each pair's score in its region's positions
    (`attention_probabilities`, which says the shapes), times the values v (B, KV, S, D).
    Returns (B, H, L, D); the softmax runs in float32 at least (bf16 scores are upcast)."""
    B, H, L, D = q.shape
    out = []
    for _, _, probs in attention_probabilities(q, k, q_far, k_far, region, mask):
        probs = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
        out.append(per_kv_head(probs.to(v.dtype), v[:, :, : probs.shape[-1]]))
    return torch.cat(out, dim=-2).reshape(B, H, L, D)
