"""ModelConfig: the shape of the decoder, its RoPE and extension, and the lengths it was trained at;
frozen and validated on construction (an override is `dataclasses.replace`, a new config)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

from rope_llama.model.extend import ExtendConfig
from rope_llama.model.rope import RopeConfig


@dataclass(frozen=True)
class TrainedLengths:
    """The lengths a checkpoint's weights were trained at.

    trained_len:  tokens per training window.
    context_len:  the longest length the checkpoint claims: PoSE's target (its ids span it on shorter
                  windows), an import's context length, else trained_len. Matched factors, `1x` and the
                  inference L0 are relative to it.
    """

    trained_len: int
    context_len: int

    def __post_init__(self):
        for name in ("trained_len", "context_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model lengths.{name} must be an integer >= 1, got {value!r}.")
        if self.context_len < self.trained_len:
            raise ValueError(
                f"model lengths.context_len ({self.context_len}) must be >= trained_len ({self.trained_len})."
            )

    @classmethod
    def of(cls, value: TrainedLengths | Mapping | int | None) -> TrainedLengths | None:
        """A record, its dict (a checkpoint's), or one length for both (an older checkpoint's max_len)."""
        if value is None or isinstance(value, TrainedLengths):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(value, value)
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            if unknown := sorted(set(value) - known):
                raise ValueError(f"Unknown model lengths keys {unknown}; allowed keys are {sorted(known)}.")
            return cls(**value)
        raise ValueError(f"model lengths must be a mapping of trained_len and context_len, got {value!r}.")


@dataclass(frozen=True)
class ModelConfig:
    # metadata: each field's allowed values for the option schemas (core/schema.py; check_number's words)
    vocab_size: int = field(default=4096, metadata={"minimum": 1})
    d_model: int = field(default=256, metadata={"minimum": 1})
    n_layers: int = field(default=4, metadata={"minimum": 1})
    n_heads: int = field(default=4, metadata={"minimum": 1})
    n_kv_heads: int | None = field(
        default=None, metadata={"minimum": 1}
    )  # None = n_heads (MHA); fewer = grouped-query attention
    ffn_hidden: int | None = field(
        default=None, metadata={"minimum": 1}
    )  # None = 8/3 * d_model rounded up to ffn_multiple_of (LLaMA)
    ffn_multiple_of: int = field(default=64, metadata={"minimum": 1})
    norm_eps: float = field(default=1e-5, metadata={"above": 0, "below": 1})
    tie_embeddings: bool = True
    dropout: float = field(default=0.0, metadata={"minimum": 0, "below": 1})
    init_std: float = field(default=0.02, metadata={"above": 0, "maximum": 1})
    # Add learned per-channel gates times the embeddings of the n preceding tokens to each token's
    # embedding (Olsson et al. 2022's "smeared keys", at the input; a short causal convolution): one
    # attention layer can then match a token's context against earlier ones, so a copy (induction)
    # head forms without the long plateau of a two-layer circuit; n = 2 matches on two tokens, which
    # copying digits needs when a digit repeats. transformers' Llama cannot express it (export refuses).
    # docs/data.md, Recall windows. 0 = off.
    mix_previous_tokens: int = field(default=0, metadata={"minimum": 0, "means": "0 = off"})
    rope: RopeConfig = field(default_factory=RopeConfig)
    extend: ExtendConfig = field(default_factory=ExtendConfig)  # absent in older checkpoints: none
    # what training wrote (model/context.py); None only until train.py or an import sets it
    lengths: TrainedLengths | None = None

    def __post_init__(self):
        set_field = lambda name, value: object.__setattr__(self, name, value)  # frozen: only here
        if isinstance(self.rope, Mapping):  # built from a checkpoint or a Hydra config
            set_field("rope", RopeConfig(**{k: v for k, v in self.rope.items() if not k.startswith("_")}))
        if isinstance(self.extend, Mapping):
            set_field(
                "extend", ExtendConfig(**{k: v for k, v in self.extend.items() if not k.startswith("_")})
            )
        set_field("lengths", TrainedLengths.of(self.lengths))
        if self.n_kv_heads is None:
            set_field("n_kv_heads", self.n_heads)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_multiple_of"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be a positive integer, got {getattr(self, name)}.")
        if self.d_model % self.n_heads:
            raise ValueError(f"model d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}).")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model head dim d_model/n_heads = {self.head_dim} must be even for RoPE; "
                f"change d_model ({self.d_model}) or n_heads ({self.n_heads})."
            )
        mix = self.mix_previous_tokens
        if isinstance(mix, bool) or not isinstance(mix, int) or mix < 0:
            raise ValueError(f"model mix_previous_tokens must be an integer >= 0 (0 = off), got {mix!r}.")
        if self.ffn_hidden is None:
            hidden = int(8 * self.d_model / 3)
            set_field("ffn_hidden", -(-hidden // self.ffn_multiple_of) * self.ffn_multiple_of)
        if self.ffn_hidden < 1:
            raise ValueError(f"model ffn_hidden must be a positive integer, got {self.ffn_hidden}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model dropout must be in [0, 1), got {self.dropout}.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        """Plain dict (rope, extend and lengths nested), safe for checkpoints loaded with weights_only=True."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(
                f"Unknown model config keys {sorted(unknown)}; allowed keys are {sorted(known)}."
            )
        return cls(**d)
