"""Mapping between our Llama and `transformers.LlamaForCausalLM` (config, RoPE keys, weights).

Pure functions over state dicts: no import of transformers here, so the runtime does not
depend on it. Used by the parity tests and by scripts/export_hf.py / scripts/import_hf.py.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from rope_llama.model.config import ModelConfig, TrainedLengths
from rope_llama.model.extend import EXTEND_NAMES
from rope_llama.model.rope import RopeConfig, ntk_base, rotary_dim_of


class ExportError(ValueError):
    """A setting transformers' Llama cannot express."""


def hf_rope_parameters(rope: RopeConfig, head_dim: int) -> tuple[dict, int | None]:
    """(rope_parameters dict, max_position_embeddings override or None) for LlamaConfig."""
    if rotary_dim_of(rope, head_dim) != head_dim:
        raise ExportError(
            f"transformers' Llama rotates the whole head; rotary_dim={rope.rotary_dim} < head_dim={head_dim} "
            "cannot be exported."
        )
    s = rope.scaling
    params: dict = {"rope_theta": float(rope.base)}
    max_positions = None
    if s == "none":
        params["rope_type"] = "default"
    elif s == "ntk":  # static NTK-aware is exactly a larger base, which plain RoPE expresses
        params.update(rope_type="default", rope_theta=ntk_base(rope.base, rope.factor, head_dim))
    elif s == "linear":
        params.update(rope_type="linear", factor=float(rope.factor))
    elif s == "dynamic_ntk":  # HF's dynamic scaling reads the original length from max_position_embeddings
        params.update(rope_type="dynamic", factor=float(rope.factor))
        max_positions = rope.original_max_len
    elif s == "yarn":
        params.update(
            rope_type="yarn",
            factor=float(rope.factor),
            original_max_position_embeddings=rope.original_max_len,
            beta_fast=float(rope.beta_fast),
            beta_slow=float(rope.beta_slow),
            truncate=True,
        )
        max_positions = int(rope.original_max_len * rope.factor)  # the extended length, as HF states it
        if rope.attention_factor is not None:
            params["attention_factor"] = float(rope.attention_factor)
    elif s == "llama3":
        params.update(
            rope_type="llama3",
            factor=float(rope.factor),
            low_freq_factor=float(rope.low_freq_factor),
            high_freq_factor=float(rope.high_freq_factor),
            original_max_position_embeddings=rope.original_max_len,
        )
        max_positions = int(rope.original_max_len * rope.factor)  # Llama 3.1 style: 8192 * 16 = 131072
    if rope.attention_factor is not None and s != "yarn":
        raise ExportError(f"transformers supports an explicit attention_factor only with yarn, not {s!r}.")
    return params, max_positions


CONFIG_NAMES = {  # ModelConfig field -> LlamaConfig key, for both directions
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "ffn_hidden": "intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "norm_eps": "rms_norm_eps",
    "init_std": "initializer_range",
    "tie_embeddings": "tie_word_embeddings",
}


def check_expressible(cfg: ModelConfig, target: str) -> None:
    """Refuse a model with a context extension (model/extend.py) or previous-token mixing in one
    sentence: `target` (transformers' Llama, a GGUF file) has no way to express either."""
    if cfg.extend.method != "none":
        raise ExportError(
            f"extend={cfg.extend.method} cannot be exported: {target} cannot express "
            f"{EXTEND_NAMES[cfg.extend.method]}, "
            "so the exported model would compute something else."
        )
    if cfg.mix_previous_tokens:
        raise ExportError(
            f"model.mix_previous_tokens={cfg.mix_previous_tokens} cannot be exported: {target} has no previous-token input mixing, "
            "so the exported model would compute something else."
        )


def hf_config_dict(cfg: ModelConfig, max_position_embeddings: int | None = None) -> dict:
    """Keyword arguments for transformers.LlamaConfig equivalent to `cfg`."""
    check_expressible(cfg, "transformers' Llama")
    rope_parameters, max_override = hf_rope_parameters(cfg.rope, cfg.head_dim)
    return {theirs: getattr(cfg, ours) for ours, theirs in CONFIG_NAMES.items()} | dict(
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=max_override or max_position_embeddings or claimed_context(cfg),
        attention_bias=False,
        mlp_bias=False,
        rope_parameters=rope_parameters,
        source_rope=asdict(cfg.rope),  # ignored by HF; lets import_hf.py restore ntk / interleaved
        source_lengths=asdict(cfg.lengths) if cfg.lengths else None,  # ignored by HF; the trained lengths
    )


def claimed_context(cfg: ModelConfig) -> int | None:
    """The context length a model claims: its trained lengths', else (a model not yet trained) its RoPE's L0."""
    return cfg.lengths.context_len if cfg.lengths else cfg.rope.original_max_len


HF_ROPE_KEYS = {  # rope_type -> the keys of rope_parameters we can map (anything else is refused)
    "default": {"rope_theta"},
    "linear": {"rope_theta", "factor", "original_max_position_embeddings"},
    "dynamic": {"rope_theta", "factor", "original_max_position_embeddings"},
    "yarn": {"rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
    | {"attention_factor", "truncate"},
    "llama3": {"rope_theta", "factor", "original_max_position_embeddings"}
    | {"low_freq_factor", "high_freq_factor"},
}
HF_SCALINGS = {
    "default": "none",
    "linear": "linear",
    "dynamic": "dynamic_ntk",
    "yarn": "yarn",
    "llama3": "llama3",
}


def rope_config_from_hf(params: dict, max_position_embeddings: int) -> RopeConfig:
    """Inverse of `hf_rope_parameters`: LlamaConfig.rope_parameters -> RopeConfig (half layout)."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in HF_ROPE_KEYS:
        raise ExportError(
            f"rope_type {rope_type!r} has no equivalent here; supported are {', '.join(HF_ROPE_KEYS)}."
        )
    extra = {k: v for k, v in params.items() if k not in HF_ROPE_KEYS[rope_type] | {"rope_type"}}
    if any(v is not None and not (k == "partial_rotary_factor" and v == 1.0) for k, v in extra.items()):
        raise ExportError(
            f"rope_parameters keys {sorted(extra)} are not supported with rope_type {rope_type!r}."
        )
    if rope_type == "yarn" and params.get("truncate") is False:
        raise ExportError("yarn with truncate=false is not supported; our YaRN rounds the correction range.")
    rope = dict(base=float(params["rope_theta"]), scaling=HF_SCALINGS[rope_type])
    rope["original_max_len"] = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    if rope_type == "dynamic":  # HF's dynamic scaling is relative to max_position_embeddings
        rope["original_max_len"] = int(max_position_embeddings)
    shared = ("factor", "beta_fast", "beta_slow", "attention_factor", "low_freq_factor", "high_freq_factor")
    rope |= {k: float(params[k]) for k in shared if params.get(k) is not None}  # same names on both sides
    return RopeConfig(**rope)


def model_config_from_hf(hf: dict) -> ModelConfig:
    """Inverse of `hf_config_dict`: a LlamaConfig dict -> ModelConfig (training-only fields at defaults)."""
    if hf.get("model_type") != "llama":
        raise ExportError(f"model_type {hf.get('model_type')!r} is not supported; only 'llama' is.")
    for key, allowed in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if hf.get(key, allowed) != allowed:
            raise ExportError(f"{key}={hf[key]!r} is not supported; this model needs {key}={allowed!r}.")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        raise ExportError(f"head_dim={hf['head_dim']} != hidden_size/num_attention_heads is not supported.")
    hf = {"tie_word_embeddings": False} | hf  # transformers' default, where ours ties
    return ModelConfig(
        **{ours: hf[theirs] for ours, theirs in CONFIG_NAMES.items() if hf.get(theirs) is not None},
        rope=source_rope(hf) or rope_config_from_hf(hf["rope_parameters"], hf["max_position_embeddings"]),
        # recorded at export; else the length the model claims (what it was trained on is not in a config.json)
        lengths=TrainedLengths.of(hf.get("source_lengths") or int(hf["max_position_embeddings"])),
    )


def source_rope(hf: dict) -> RopeConfig | None:
    """The RopeConfig recorded at export, if the config's rope_parameters still say exactly that."""
    if not isinstance(hf.get("source_rope"), dict):
        return None
    rope = RopeConfig(**hf["source_rope"])
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    return rope if hf_rope_parameters(rope, head_dim)[0] == hf["rope_parameters"] else None


def interleaved_to_half(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Permute q/k projection rows so HF's half-split rotation equals our interleaved one.

    Per head, output channels (0, 1, 2, 3, ...) become (0, 2, 4, ..., 1, 3, 5, ...): pair
    (2i, 2i+1) moves to (i, i + D/2). q.k is unchanged because q and k get the same permutation.
    """
    w = weight.view(n_heads, head_dim // 2, 2, -1)
    return w.transpose(1, 2).reshape(n_heads * head_dim, -1)


def half_to_interleaved(weight: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of `interleaved_to_half`."""
    w = weight.view(n_heads, 2, head_dim // 2, -1)
    return w.transpose(1, 2).reshape(n_heads * head_dim, -1)


def hf_names(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """The one weight mapping, both directions derive from it: each of our tensors -> the LlamaForCausalLM
    tensors it holds, with their rows. A fused tensor of ours (q/k/v, gate/up) is theirs concatenated
    along dim 0 in this order; a tied head is their embedding (not stored apart)."""
    H, KV, D, F, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.d_model
    names = {
        "embed.weight": [("model.embed_tokens.weight", cfg.vocab_size)],
        "norm.weight": [("model.norm.weight", d)],
        "lm_head.weight": [
            ("model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight", cfg.vocab_size)
        ],
    }
    for i in range(cfg.n_layers):
        p, hp = f"blocks.{i}.", f"model.layers.{i}."
        names |= {
            p + "attn.qkv.weight": [
                (hp + "self_attn.q_proj.weight", H * D),
                (hp + "self_attn.k_proj.weight", KV * D),
                (hp + "self_attn.v_proj.weight", KV * D),
            ],
            p + "attn.o_proj.weight": [(hp + "self_attn.o_proj.weight", d)],
            p + "mlp.gate_up.weight": [(hp + "mlp.gate_proj.weight", F), (hp + "mlp.up_proj.weight", F)],
            p + "mlp.down_proj.weight": [(hp + "mlp.down_proj.weight", d)],
            p + "attn_norm.weight": [(hp + "input_layernorm.weight", d)],
            p + "mlp_norm.weight": [(hp + "post_attention_layernorm.weight", d)],
        }
    return names


def rotated_heads(cfg: ModelConfig) -> dict[str, int]:
    """Their q/k projections -> head count: the rows an interleaved RoPE layout permutes (q.k is unchanged,
    as q and k get the same permutation)."""
    return {
        f"model.layers.{i}.self_attn.{proj}.weight": heads
        for i in range(cfg.n_layers)
        for proj, heads in (("q_proj", cfg.n_heads), ("k_proj", cfg.n_kv_heads))
    }


def to_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (fused qkv / gate_up) -> LlamaForCausalLM names (split projections)."""
    out = {}
    for ours, parts in hf_names(cfg).items():
        out |= dict(zip([name for name, _ in parts], state[ours].split([rows for _, rows in parts])))
    if cfg.rope.layout == "interleaved":
        out |= {
            name: interleaved_to_half(out[name], heads, cfg.head_dim)
            for name, heads in rotated_heads(cfg).items()
        }
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


def from_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `to_hf_state_dict`: LlamaForCausalLM names -> our fused state dict."""
    if cfg.rope.layout == "interleaved":
        hf = hf | {
            name: half_to_interleaved(hf[name], heads, cfg.head_dim)
            for name, heads in rotated_heads(cfg).items()
        }
    return {ours: torch.cat([hf[name] for name, _ in parts]) for ours, parts in hf_names(cfg).items()}
