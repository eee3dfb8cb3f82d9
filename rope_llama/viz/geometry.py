"""What a RoPE configuration does to positions, as numbers to plot (scripts/visualize.py view=rope).

    wavelengths = pair_wavelengths(rope, head_dim=64)                 # (R/2,) tokens per full turn
    bands = frequency_bands(rope, head_dim=64)                        # per pair: kept | ramped | interpolated
    scores = relative_scores(q, k, rope, 64, distances, offset=10**6) # <rot(q, o + d), rot(k, o)>
    bound = decay_bound(rope_frequencies(rope, 64)[0], distances)     # RoFormer's long-term decay

Every number comes from model/rope.py's own frequencies and rotation, so the pictures show what the
model computes. Formulas:

- wavelength of pair i: 2 pi / theta_i.
- relative property: with q and k rotated at positions m and n, the score depends on m - n only:
  <rot(q, m), rot(k, n)> = a^2 sum_i (q1 k1 + q2 k2) cos((m - n) theta_i) - (q2 k1 - q1 k2) sin((m - n) theta_i)
  over the rotary pairs (q1, q2) = (q_i, q_{i + R/2}) (half layout) and the attention factor a.
- long-term decay (RoFormer, Su et al. 2021, section 3.4.3): |sum_i h_i e^{i m theta_i}| <=
  max_i |h_{i+1} - h_i| sum_j |S_j| with S_j = sum_{i<j} e^{i m theta_i}; `decay_bound` is the
  relative upper bound (1 / (R/2)) sum_{j=1}^{R/2} |S_j|, which falls with the distance m.
"""

from __future__ import annotations

import math

import torch

from rope_llama.model.extend import ExtendConfig, remapped_distances
from rope_llama.model.rope import (
    RopeConfig,
    RotaryEmbedding,
    default_inv_freq,
    rope_frequencies,
    rotary_dim_of,
)

BANDS = ("kept", "ramped", "interpolated")  # a pair's frequency against the plain one: 1, between, 1 / factor


def pair_wavelengths(rope: RopeConfig, head_dim: int, seq_len: int | None = None) -> torch.Tensor:
    """(R/2,) float64: tokens per full turn of each rotary pair (seq_len: dynamic NTK's total length)."""
    inv_freq, _ = rope_frequencies(rope, head_dim, seq_len)
    return 2 * math.pi / inv_freq.double()


def frequency_bands(rope: RopeConfig, head_dim: int, seq_len: int | None = None) -> list[str]:
    """Per rotary pair, what the scaling did to its frequency: `kept` (as the plain RoPE's), `interpolated`
    (divided by the factor), `ramped` (in between: YaRN's ramp, Llama-3's smooth band, NTK's new base)."""
    scaled, _ = rope_frequencies(rope, head_dim, seq_len)
    plain = default_inv_freq(rope.base, rotary_dim_of(rope, head_dim))
    ratio = (scaled.double() / plain.double()).tolist()
    factor = rope.factor or 1.0
    bands = []
    for r in ratio:
        if math.isclose(r, 1.0, rel_tol=1e-4):
            bands.append("kept")
        elif math.isclose(r, 1.0 / factor, rel_tol=1e-4):
            bands.append("interpolated")
        else:
            bands.append("ramped")
    return bands


def relative_scores(
    q: torch.Tensor, k: torch.Tensor, rope: RopeConfig, head_dim: int, distances: torch.Tensor, offset: int
) -> torch.Tensor:
    """<rot(q, offset + d), rot(k, offset)> for each distance d, through the model's RotaryEmbedding.
    q, k: (D,) float; distances: (N,) int64 -> (N,) float64."""
    embedding = RotaryEmbedding(head_dim, rope)
    positions = torch.cat([offset + distances, torch.tensor([offset])]).to(torch.int64)
    cos, sin = embedding.cos_sin(positions, torch.float64)
    rows = torch.stack([q, k]).double()[:, None].expand(2, len(positions), head_dim)  # (2, N + 1, D)
    q_rot = embedding.rotate(rows[0], cos, sin)[:-1]  # queries at offset + d
    k_rot = embedding.rotate(rows[1], cos, sin)[-1]  # the key at offset
    return q_rot @ k_rot


def relative_scores_closed_form(
    q: torch.Tensor, k: torch.Tensor, rope: RopeConfig, head_dim: int, distances: torch.Tensor
) -> torch.Tensor:
    """The formula of the module docstring (half layout; channels past the rotary dimension add q . k)."""
    inv_freq, attention_factor = rope_frequencies(rope, head_dim)
    R = 2 * len(inv_freq)
    q, k = q.double(), k.double()
    q1, q2, k1, k2 = q[: R // 2], q[R // 2 : R], k[: R // 2], k[R // 2 : R]
    if rope.layout == "interleaved":
        q1, q2, k1, k2 = q[0:R:2], q[1:R:2], k[0:R:2], k[1:R:2]
    angles = distances.double()[:, None] * inv_freq.double()[None]  # (N, R/2)
    rotated = (q1 * k1 + q2 * k2) * angles.cos() - (q2 * k1 - q1 * k2) * angles.sin()
    return attention_factor**2 * rotated.sum(-1) + q[R:] @ k[R:]


def decay_bound(inv_freq: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """RoFormer's relative upper bound (1 / (R/2)) sum_j |S_j| at each distance m. inv_freq (R/2,),
    distances (N,) -> (N,) float64."""
    angles = distances.double()[:, None] * inv_freq.double()[None]  # (N, R/2)
    partial = torch.polar(torch.ones_like(angles), angles).cumsum(-1)  # S_1 .. S_{R/2}
    return partial.abs().mean(-1)


def seen_distances(extend: ExtendConfig, query_position: int, distances: torch.Tensor) -> torch.Tensor:
    """The relative distance attention uses for a key `d` tokens before a query at `query_position`:
    d itself without a remap (and for log-n), the remap's distance in the pair's region otherwise
    (model/extend.py). distances (N,) int64 -> (N,) float64 (leaky ReRoPE's are fractional)."""
    remap = extend.remap
    if remap is None:
        return distances.double()
    query = torch.tensor([query_position])
    return remapped_distances(remap, query, query - distances)[0]
