"""Rotary position embeddings (RoPE) with every common context-extension scaling.

One `RotaryEmbedding` per model, shared by all attention layers. It owns a lazily built
cos/sin cache that grows (at least doubling) with the largest position requested, up to
TABLE_MAX_POSITIONS, and is rebuilt when the device changes; farther positions are computed
directly for the ids requested. Angles are formed in float64 (`rope_cos_sin`, also under
autocast) and stored as float32; tables are cast to the activation dtype only when they are used.

Each scaling method is a small pure function on the inverse frequencies; `rope_frequencies`
is the single place that chooses between them. Formulas:

- none:        inv_freq_i = base^(-2i/d)                                  (RoFormer)
- linear:      inv_freq_i / factor                   (position interpolation, Chen et al. 2023)
- ntk:         base' = base * factor^(d/(d-2))                    (NTK-aware, bloc97 2023)
- dynamic_ntk: base' = base * (factor*L/L0 - (factor-1))^(d/(d-2)) for total length L > L0
- yarn:        NTK-by-parts ramp between interpolation and extrapolation + attention
               factor 0.1*ln(factor)+1 on cos and sin                  (Peng et al. 2023)
- llama3:      wavelength bands: high frequencies kept, low ones / factor, smooth in between

`transformers` (modeling_rope_utils) is the numerical reference for linear, dynamic, yarn
and llama3; tests/test_rope.py checks parity against it. model/context.py's `resolve_positions` turns a
trained model's RopeConfig and an override (generate.py rope=..., the evaluation scripts) into the one to run.

This file is the plain reference; kernels/rope.py holds a faster drop-in for `rotate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import nn


class RopeScaling(StrEnum):
    NONE = "none"
    LINEAR = "linear"
    NTK = "ntk"
    DYNAMIC_NTK = "dynamic_ntk"
    YARN = "yarn"
    LLAMA3 = "llama3"


SCALINGS = tuple(s.value for s in RopeScaling)
# The scalings whose frequencies depend on the reference length original_max_len.
RELATIVE_SCALINGS = (RopeScaling.DYNAMIC_NTK, RopeScaling.YARN, RopeScaling.LLAMA3)


def enum_choice(value: str | StrEnum, choices: type[StrEnum], kind: str, plural: str) -> str:
    """A config field given as an enum member or its value -> the value; an unknown one is one sentence
    naming the valid values (kind "rope scaling", plural "scalings")."""
    value = value.value if isinstance(value, choices) else value
    valid = [c.value for c in choices]
    if value not in valid:
        raise ValueError(f"Unknown {kind} {value!r}; valid {plural} are {', '.join(valid)}.")
    return value


LAYOUTS = ("half", "interleaved")

# Positions the shared cos/sin table covers at most; farther ones are computed for the ids asked.
# 2^16 is 16x the longest length the scripts evaluate, and bounds the table (cos and sin, float32)
# to 2^16 * rotary_dim * 2 * 4 bytes: 32 MiB at rotary_dim 64, 64 MiB at 128.
TABLE_MAX_POSITIONS = 2**16
# float64 holds every integer position exactly below 2^53; beyond it angles would be off by whole positions.
MAX_EXACT_POSITIONS = 2**53


@dataclass(frozen=True)
class RopeConfig:
    """Everything that defines the rotation; validated on construction.

    base:              RoPE base (theta). Larger = longer wavelengths.
    scaling:           one of SCALINGS.
    factor:            context-extension factor s >= 1 (unused by `none`).
    original_max_len:  the length L0 the scaling is relative to; None until model/context.py's
                       `resolve_positions` fills it from the model's trained lengths (none, linear and ntk
                       never read it).
    layout:            "half" pairs channel i with i + d/2 (HF / NeoX, rotate_half);
                       "interleaved" pairs channels (2i, 2i+1) (Meta / GPT-J).
    rotary_dim:        rotate only the first `rotary_dim` channels of each head (None = all).
    beta_fast, beta_slow:  YaRN ramp bounds, in rotations over L0.
    attention_factor:  YaRN cos/sin multiplier; None = 0.1*ln(factor)+1.
    low_freq_factor, high_freq_factor:  Llama-3 wavelength band edges (L0 / factor).
    max_position:      optional hard capacity: positions >= max_position raise ValueError.
    """

    # metadata: each field's allowed values for the option schemas (core/schema.py; check_number's words)
    base: float = field(default=10000.0, metadata={"above": 1})
    scaling: str = field(default="none", metadata={"choices": SCALINGS})
    factor: float | None = field(
        default=1.0,
        metadata={
            "minimum": 1,
            "maximum": 2**20,
            "means": "1 = no scaling",
            "none_means": "derived by model/context.py",
        },
    )
    original_max_len: int | None = field(default=None, metadata={"minimum": 1})
    layout: str = field(default="half", metadata={"choices": LAYOUTS})
    rotary_dim: int | None = field(default=None, metadata={"minimum": 2})
    beta_fast: float = field(default=32.0, metadata={"above": 0})
    beta_slow: float = field(default=1.0, metadata={"above": 0})
    attention_factor: float | None = field(default=None, metadata={"above": 0})
    low_freq_factor: float = field(default=1.0, metadata={"above": 0})
    high_freq_factor: float = field(default=4.0, metadata={"above": 0})
    max_position: int | None = field(default=None, metadata={"minimum": 1})

    def __post_init__(self):
        object.__setattr__(
            self, "scaling", enum_choice(self.scaling, RopeScaling, "rope scaling", "scalings")
        )
        if self.layout not in LAYOUTS:
            raise ValueError(f"Unknown rope layout {self.layout!r}; valid layouts are {', '.join(LAYOUTS)}.")
        if not self.base > 1.0:
            raise ValueError(f"rope base must be > 1, got {self.base}.")
        if not self.factor >= 1.0:
            raise ValueError(f"rope factor must be >= 1 (1 = no scaling), got {self.factor}.")
        if self.original_max_len is not None and self.original_max_len < 1:
            raise ValueError(f"rope original_max_len must be a positive length, got {self.original_max_len}.")
        if self.rotary_dim is not None and (self.rotary_dim <= 0 or self.rotary_dim % 2):
            raise ValueError(f"rope rotary_dim must be a positive even number, got {self.rotary_dim}.")
        if self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"rope beta_fast ({self.beta_fast}) must be greater than beta_slow ({self.beta_slow})."
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope high_freq_factor ({self.high_freq_factor}) must be greater than "
                f"low_freq_factor ({self.low_freq_factor})."
            )
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ValueError(f"rope attention_factor must be > 0, got {self.attention_factor}.")
        if self.max_position is not None and self.max_position < 1:
            raise ValueError(f"rope max_position must be a positive length or None, got {self.max_position}.")


# ----------------------------------------------------------------------------- pure math


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """theta_i = base^(-2i/dim) for i in [0, dim/2), float32, shape (dim/2,)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def ntk_base(base: float, factor: float, dim: int) -> float:
    """Static NTK-aware base: keeps the highest frequency, divides the lowest by `factor`."""
    return base * factor ** (dim / (dim - 2))


def dynamic_ntk_base(base: float, factor: float, dim: int, seq_len: int, original_max_len: int) -> float:
    """HF "dynamic" NTK: the base grows with the total length once it exceeds original_max_len."""
    seq_len = max(seq_len, original_max_len)  # inside the training length nothing changes
    return base * ((factor * seq_len / original_max_len) - (factor - 1)) ** (dim / (dim - 2))


def yarn_attention_factor(factor: float) -> float:
    """YaRN's temperature sqrt(1/t) = 0.1 ln(s) + 1, folded into cos and sin."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def yarn_inv_freq(
    base: float, dim: int, factor: float, original_max_len: int, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """NTK-by-parts: extrapolate dims that rotate > beta_fast times over L0, interpolate
    those that rotate < beta_slow times, linear ramp in between. Shape (dim/2,)."""

    def correction_dim(num_rotations: float) -> float:  # dim index that rotates num_rotations times in L0
        return dim * math.log(original_max_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1 = keep the original frequency (high-frequency dims)
    inv_freq = default_inv_freq(base, dim)
    return inv_freq / factor * (1 - extrapolation_weight) + inv_freq * extrapolation_weight


def llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_len: int,
) -> torch.Tensor:
    """Llama 3.1: wavelengths shorter than L0/high_freq_factor kept, longer than
    L0/low_freq_factor divided by `factor`, smooth interpolation in between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_len / low_freq_factor
    high_freq_wavelen = original_max_len / high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_frequencies(
    cfg: RopeConfig, head_dim: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, shape (rotary_dim/2,)) and the cos/sin attention factor.

    `seq_len` is the total sequence length; only `dynamic_ntk` reads it (None = original_max_len).
    """
    dim = rotary_dim_of(cfg, head_dim)
    scaling = RopeScaling(cfg.scaling)
    if scaling in RELATIVE_SCALINGS and cfg.original_max_len is None:
        raise ValueError(
            f"rope scaling {cfg.scaling!r} is relative to a length, but original_max_len is unset; "
            "resolve the config against the model's trained lengths (model/context.py)."
        )
    if scaling in (RopeScaling.NTK, RopeScaling.DYNAMIC_NTK) and dim <= 2:  # exponent d/(d-2) is undefined
        raise ValueError(f"rope scaling {cfg.scaling!r} needs a rotary dimension > 2, got {dim}.")
    attention_factor = 1.0
    if scaling is RopeScaling.NONE:
        inv_freq = default_inv_freq(cfg.base, dim)
    elif scaling is RopeScaling.LINEAR:
        inv_freq = default_inv_freq(cfg.base, dim) / cfg.factor
    elif scaling is RopeScaling.NTK:
        inv_freq = default_inv_freq(ntk_base(cfg.base, cfg.factor, dim), dim)
    elif scaling is RopeScaling.DYNAMIC_NTK:
        length = cfg.original_max_len if seq_len is None else seq_len
        inv_freq = default_inv_freq(
            dynamic_ntk_base(cfg.base, cfg.factor, dim, length, cfg.original_max_len), dim
        )
    elif scaling is RopeScaling.YARN:
        inv_freq = yarn_inv_freq(
            cfg.base, dim, cfg.factor, cfg.original_max_len, cfg.beta_fast, cfg.beta_slow
        )
        attention_factor = yarn_attention_factor(cfg.factor)
    else:  # LLAMA3
        inv_freq = llama3_inv_freq(
            default_inv_freq(cfg.base, dim),
            cfg.factor,
            cfg.low_freq_factor,
            cfg.high_freq_factor,
            cfg.original_max_len,
        )
    if cfg.attention_factor is not None:  # explicit override (any scaling)
        attention_factor = cfg.attention_factor
    return inv_freq, float(attention_factor)


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles position * inv_freq, times `attention_factor`, float32.

    position_ids: (...) integer tensor; inv_freq: (R/2,) -> cos, sin: (..., R), channels in `layout`
    order ("half": the R/2 angles twice over, "interleaved": each angle twice in a row).
    The angle is formed in float64, which keeps integer positions exact up to 2^53 (float32 only up to
    2^24), and cos/sin reduce even huge float64 angles exactly (a modulo by a rounded 2*pi would not).
    Autocast never casts float64, so the result is the same under autocast.
    """
    angles = position_ids.to(torch.float64)[..., None] * inv_freq.to(torch.float64)  # (..., R/2)
    if layout == "half":
        angles = torch.cat((angles, angles), dim=-1)
    else:
        angles = angles.repeat_interleave(2, dim=-1)
    return (angles.cos() * attention_factor).float(), (angles.sin() * attention_factor).float()


def rotary_dim_of(cfg: RopeConfig, head_dim: int) -> int:
    """Number of rotated channels; validates it against the head dimension."""
    dim = head_dim if cfg.rotary_dim is None else cfg.rotary_dim
    if dim % 2:
        raise ValueError(f"RoPE needs an even rotary dimension, got {dim} (head_dim={head_dim}).")
    if dim > head_dim:
        raise ValueError(f"rope rotary_dim ({dim}) cannot exceed the head dimension ({head_dim}).")
    return dim


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim (HF / NeoX layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...) (Meta / GPT-J interleaved layout)."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """x * cos + rotate(x) * sin on the first R channels of x; the rest pass through untouched.

    x: (..., L, D); cos, sin: (L, R) or (B, L, R) with R <= D even, already in x's dtype.
    A (B, L, R) table gets singleton head dims inserted so it broadcasts against (B, ..., L, D).
    """
    while cos.ndim < x.ndim:
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    rotate = rotate_half if layout == "half" else rotate_pairs
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return x * cos + rotate(x) * sin
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)


# ----------------------------------------------------------------------------- module


class RotaryEmbedding(nn.Module):
    """Cached RoPE for heads of size `head_dim`; one instance per model.

    rope(x, position_ids)         rotates x: (..., L, D); position_ids None (0..L-1), (L,) or (B, L).
    rope.cos_sin(position_ids, dtype, seq_len)  returns the gathered (cos, sin) once so every
                                  layer can reuse them with `rope.rotate(x, cos, sin)`.

    The cos/sin table is shared by every caller, so it is safe across grad modes, dtypes and
    devices by construction, not by the callers' care:
    - it is built with inference mode and autograd off, a plain float32 tensor that never requires
      grad: a table grown under torch.inference_mode (a text sample at validation) serves the next
      training step, whose autograd may save slices of it;
    - it is never written in place (growing replaces it), so cos/sin handed out earlier stay valid;
    - it is cast to the caller's dtype only when handed out, and rebuilt when the device changes;
    - it covers positions below TABLE_MAX_POSITIONS; a request reaching further (seq_len above
      it, dynamic NTK included) is computed for exactly the requested ids by the same
      `rope_cos_sin`, so memory follows the request, never the largest position.
    """

    def __init__(self, head_dim: int, config: RopeConfig | None = None):
        super().__init__()
        self.config = config or RopeConfig()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(self.config, head_dim)
        inv_freq, self.attention_factor = rope_frequencies(self.config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # derived from config, never saved
        self._cos: torch.Tensor | None = None  # (capacity, rotary_dim) float32, attention factor folded in
        self._sin: torch.Tensor | None = None
        self._cache_key: tuple | None = None  # (frequency length for dynamic NTK, device)

    @property
    def is_dynamic(self) -> bool:
        return self.config.scaling == RopeScaling.DYNAMIC_NTK.value

    @property
    def cached_len(self) -> int:
        return 0 if self._cos is None else self._cos.shape[0]

    def _frequencies(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(R/2,) inverse frequencies on `device`; dynamic NTK's depend on the total length `seq_len`."""
        if self.is_dynamic:
            return rope_frequencies(self.config, self.head_dim, seq_len=seq_len)[0].to(device)
        return self.inv_freq.to(device)

    def _cos_sin_of(self, position_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (..., R) float32, for position_ids (...) with frequencies for `seq_len`."""
        inv_freq = self._frequencies(seq_len, position_ids.device)
        return rope_cos_sin(position_ids, inv_freq, self.attention_factor, self.config.layout)

    def _build(self, capacity: int, seq_len: int, device: torch.device) -> None:
        # A plain tensor that never requires grad, whatever mode the caller is in (class docstring).
        with torch.inference_mode(False), torch.no_grad():
            positions = torch.arange(capacity, device=device)
            self._cos, self._sin = self._cos_sin_of(positions, seq_len)
        self._cache_key = (seq_len if self.is_dynamic else None, device)

    def _ensure(self, needed: int, seq_len: int, device: torch.device) -> None:
        """Grow (at least doubling, at most to TABLE_MAX_POSITIONS) or rebuild the table so
        positions < `needed` are covered; needed <= TABLE_MAX_POSITIONS."""
        key = (seq_len if self.is_dynamic else None, device)
        if self._cos is not None and key == self._cache_key and needed <= self.cached_len:
            return
        capacity = max(needed, 2 * self.cached_len if key == self._cache_key else needed)
        if self.is_dynamic:
            capacity = needed  # the table is tied to one frequency length; no point over-allocating
        limit = min(TABLE_MAX_POSITIONS, self.config.max_position or TABLE_MAX_POSITIONS)
        self._build(min(capacity, limit), seq_len, device)

    def _check_capacity(self, needed: int) -> None:
        """Positions < `needed` must be within max_position and exact in float64."""
        cap = self.config.max_position
        if cap is not None and needed > cap:
            raise ValueError(f"position {needed - 1} is beyond the RoPE capacity max_position={cap}.")
        if needed > MAX_EXACT_POSITIONS:
            raise ValueError(
                f"position {needed - 1} is beyond 2^53 - 1, the largest position RoPE keeps exact."
            )

    def check_position_ids(self, position_ids: torch.Tensor, num_tokens: int, batch: int | None) -> None:
        """Validate shape and dtype of position ids for `num_tokens` tokens (per row of `batch`)."""
        if (
            position_ids.dtype.is_floating_point
            or position_ids.dtype.is_complex
            or position_ids.dtype == torch.bool
        ):
            raise ValueError(f"position_ids must be an integer tensor, got dtype {position_ids.dtype}.")
        shape = tuple(position_ids.shape)
        if position_ids.ndim == 1 and shape[0] == num_tokens:
            return
        if position_ids.ndim == 2 and shape[1] == num_tokens and (batch is None or shape[0] in (1, batch)):
            return
        expected = f"({num_tokens},)" if batch is None else f"({num_tokens},) or ({batch}, {num_tokens})"
        raise ValueError(f"position_ids must have shape {expected}, got {shape}.")

    def cos_sin(
        self,
        position_ids: torch.Tensor | None,
        dtype: torch.dtype,
        seq_len: int | None = None,
        device: torch.device | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather cos and sin for `position_ids`, cast to `dtype`.

        position_ids: None (then 0..seq_len-1), (L,) or (B, L) integer tensor, or floating for
            fractional positions (leaky ReRoPE's, model/extend.py), computed for exactly those ids.
        seq_len: exclusive upper bound on the positions and, for dynamic NTK, the total length
            the frequencies are scaled for (fixed for one generation so cached keys stay
            consistent). When given, the caller promises 0 <= position_ids < seq_len and no check
            runs (the decode loop stays free of host syncs); when omitted it is max(position_ids)+1
            and the ids are validated, which costs a host sync.
        Returns (cos, sin), each (L, R) or (B, L, R), R = rotary_dim.
        """
        if position_ids is None:
            if seq_len is None:
                raise ValueError("cos_sin needs position_ids or seq_len.")
            device = device or self.inv_freq.device
        else:
            device = position_ids.device
            if seq_len is None:
                if position_ids.numel() and int(position_ids.min()) < 0:
                    raise ValueError(
                        f"position_ids must be non-negative, got minimum {int(position_ids.min())}."
                    )
                seq_len = int(position_ids.max()) + 1 if position_ids.numel() else 0
        self._check_capacity(seq_len)
        fractional = position_ids is not None and position_ids.is_floating_point()
        if seq_len > TABLE_MAX_POSITIONS or fractional:  # only the requested ids, never a table up to them
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=device)
            cos, sin = self._cos_sin_of(position_ids, seq_len)
        else:
            self._ensure(max(seq_len, 1), seq_len, device)
            if position_ids is None:  # 0..seq_len-1: a slice, no gather
                cos, sin = self._cos[:seq_len], self._sin[:seq_len]
            else:
                cos, sin = self._cos[position_ids], self._sin[position_ids]
        return cos.to(dtype), sin.to(dtype)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, seq_dim: int = -2
    ) -> torch.Tensor:
        """Rotate x: (..., L, D) (or L at `seq_dim`, e.g. (B, L, H, D) with seq_dim=1)."""
        if not x.is_floating_point():
            raise TypeError(f"RoPE input must be a floating-point tensor, got dtype {x.dtype}.")
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"RoPE input has last dimension {x.shape[-1]}, expected head_dim={self.head_dim}."
            )
        moved = seq_dim not in (-2, x.ndim - 2)
        if moved:
            x = x.movedim(seq_dim, -2)
        num_tokens = x.shape[-2]
        if position_ids is None:  # positions 0..L-1: the sequence length is the token count
            cos, sin = self.cos_sin(None, x.dtype, seq_len=num_tokens, device=x.device)
        else:
            self.check_position_ids(position_ids, num_tokens, x.shape[0] if x.ndim >= 3 else None)
            cos, sin = self.cos_sin(position_ids.to(x.device), x.dtype)
        y = self.rotate(x, cos, sin)
        return y.movedim(-2, seq_dim) if moved else y

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply_rotary` in this RoPE's layout: how every attention layer rotates q and k.

        x: (..., L, D); cos, sin: (L, R) or (B, L, R) from `cos_sin`, in x's dtype.
        """
        return apply_rotary(x, cos, sin, self.config.layout)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={c.base}, scaling={c.scaling}, "
            f"factor={c.factor}, original_max_len={c.original_max_len}, layout={c.layout}"
        )
