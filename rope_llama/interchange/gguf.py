"""The GGUF mapping (llama.cpp's `llama` architecture): the export and the tables the import
(interchange/gguf_import.py) reads backwards.

Export: our state dict -> transformers' names (hf.py), the q/k rows permuted per head from the half-split
rotation to llama.cpp's adjacent pairs, then gguf's own tensor-name map; the RoPE keys, the byte-level BPE
vocabulary, and the refusal of what llama.cpp cannot express.
scripts/export_gguf.py and scripts/import_gguf.py write the files atomically; docs/export.md lists what maps
to what.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from rope_llama.data.tokenizer import Tokenizer
from rope_llama.interchange.hf import (
    ExportError,
    check_expressible,
    claimed_context,
    half_to_interleaved,
    hf_rope_parameters,
    interleaved_to_half,
    to_hf_state_dict,
)
from rope_llama.model.config import ModelConfig
from rope_llama.model.rope import (
    RopeConfig,
    default_inv_freq,
    rope_frequencies,
    rotary_dim_of,
    yarn_attention_factor,
)

ARCH = gguf.MODEL_ARCH.LLAMA
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]  # "llama": the prefix of the architecture's keys
ROPE_FREQS = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"


def key(template: str) -> str:
    """A gguf.Keys template ("{arch}.context_length") for the llama architecture."""
    return template.format(arch=ARCH_NAME)


DTYPES = {  # dtype= -> (numpy type of the matrices, general.file_type); 1-D tensors always stay f32
    "f32": (np.float32, gguf.LlamaFileType.ALL_F32),
    "f16": (np.float16, gguf.LlamaFileType.MOSTLY_F16),
}

# ModelConfig field -> the key holding it, for both directions (export writes these, import reads them)
MODEL_KEYS = {
    "vocab_size": key(gguf.Keys.LLM.VOCAB_SIZE),
    "d_model": key(gguf.Keys.LLM.EMBEDDING_LENGTH),
    "ffn_hidden": key(gguf.Keys.LLM.FEED_FORWARD_LENGTH),
    "n_layers": key(gguf.Keys.LLM.BLOCK_COUNT),
    "n_heads": key(gguf.Keys.Attention.HEAD_COUNT),
    "n_kv_heads": key(gguf.Keys.Attention.HEAD_COUNT_KV),
    "norm_eps": key(gguf.Keys.Attention.LAYERNORM_RMS_EPS),
}
CONTEXT_LENGTH = key(gguf.Keys.LLM.CONTEXT_LENGTH)
ROPE = {  # the RoPE keys, by the name of their gguf.Keys.Rope constant
    name.lower(): key(getattr(gguf.Keys.Rope, name))
    for name in (
        "DIMENSION_COUNT",
        "FREQ_BASE",
        "SCALING_TYPE",
        "SCALING_FACTOR",
        "SCALING_ATTN_FACTOR",
        "SCALING_ORIG_CTX_LEN",
        "SCALING_FINETUNED",
        "SCALING_YARN_BETA_FAST",
        "SCALING_YARN_BETA_SLOW",
    )
}
ROPE_SCALE_LINEAR = key("{arch}.rope.scale_linear")  # the older spelling of a linear scaling factor


EXPORTABLE = ("none", "linear", "ntk", "yarn", "llama3")


LLAMA_CPP_YARN_BETAS = (32.0, 1.0)  # the llama architecture reads no beta from the file: these always apply


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ExportError(f"dtype={dtype} is not supported; choose one of {', '.join(DTYPES)}.")


def check_rope(rope: RopeConfig, head_dim: int) -> None:
    """One sentence for each RoPE setting llama.cpp's llama architecture cannot express."""
    if rotary_dim_of(rope, head_dim) != head_dim:
        raise ExportError(
            f"llama.cpp's llama architecture rotates the whole head; rotary_dim={rope.rotary_dim} < "
            f"head_dim={head_dim} cannot be exported."
        )
    if rope.scaling not in EXPORTABLE:
        raise ExportError(
            f"rope scaling {rope.scaling!r} has no GGUF form (llama.cpp would need frequencies that change "
            f"with the generation length); exportable are {', '.join(EXPORTABLE)}."
        )
    if rope.scaling == "yarn" and (rope.beta_fast, rope.beta_slow) != LLAMA_CPP_YARN_BETAS:
        raise ExportError(
            f"yarn with beta_fast={rope.beta_fast}, beta_slow={rope.beta_slow} cannot be exported; llama.cpp's "
            f"llama architecture always uses beta_fast={LLAMA_CPP_YARN_BETAS[0]}, beta_slow={LLAMA_CPP_YARN_BETAS[1]}."
        )


def add_rope(writer: gguf.GGUFWriter, rope: RopeConfig, head_dim: int, context_len: int) -> np.ndarray | None:
    """Write the RoPE keys (and the context length) from the Hugging Face mapping, as llama.cpp's
    converter reads them; returns the Llama-3 `rope_freqs` tensor, or None for the other scalings.
    `rope_config_from_gguf` is the inverse."""
    check_rope(rope, head_dim)
    # transformers has no key for an explicit attention factor outside yarn, llama.cpp has one: map without it
    params, max_positions = hf_rope_parameters(replace(rope, attention_factor=None), head_dim)
    writer.add_context_length(max_positions or context_len)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(params["rope_theta"])  # static ntk: the larger base, identical frequencies
    if params["rope_type"] in ("default", "llama3"):  # llama3 lives in the rope_freqs tensor
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    elif params["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params["factor"])
    elif params["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
    if rope.attention_factor is not None:  # llama.cpp multiplies its own yarn factor by this one
        own = yarn_attention_factor(rope.factor) if rope.scaling == "yarn" else 1.0
        writer.add_rope_scaling_attn_factors(rope.attention_factor / own)
    if params["rope_type"] != "llama3":
        return None
    return llama3_rope_freqs(rope, head_dim).numpy()


def llama3_rope_freqs(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """llama.cpp divides each base frequency by its factor: factors = plain / Llama-3 frequencies."""
    return default_inv_freq(rope.base, head_dim) / rope_frequencies(rope, head_dim)[0]


# ----------------------------------------------------------------------------- tokenizer

# tokenizer.ggml.pre -> the pre-tokenizer of that name (llama.cpp's regexes for it), both directions. Import
# also accepts the names transformers' GGUF conversion knows (its GGUF_PRE_TOKENIZER_SPLITS).
PRE_TOKENIZERS = {
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    # llama.cpp splits off every digit before the GPT-2 regex (transformers 5.23 knows no 'smollm')
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
}


def pre_tokenizer_spec(pre_tokenizer) -> dict | None:
    """A pre-tokenizer as tokenizer.json states it, without the keys that only change offsets."""
    probe = HFTokenizer(models.BPE())
    probe.pre_tokenizer = pre_tokenizer
    return strip_offsets(json.loads(probe.to_str())["pre_tokenizer"])


def strip_offsets(spec):
    if isinstance(spec, dict):
        return {k: strip_offsets(v) for k, v in spec.items() if k != "trim_offsets"}
    if isinstance(spec, list):
        return [strip_offsets(v) for v in spec]
    return spec


def pre_tokenizer_name(spec: dict) -> str | None:
    """The tokenizer.ggml.pre name of a tokenizer.json's pre-tokenizer, or None."""
    ours = strip_offsets(spec.get("pre_tokenizer") or {})
    return next((name for name, make in PRE_TOKENIZERS.items() if pre_tokenizer_spec(make()) == ours), None)


def gguf_vocab(tok: Tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str], str]:
    """(tokens, token types, merges, pre-tokenizer name) of a byte-level BPE, padded with unused tokens to
    the model's vocab."""
    spec = json.loads(tok.hf.to_str())
    model = spec["model"]
    pre = pre_tokenizer_name(spec)
    byte_level = (
        model["type"] == "BPE"
        and spec.get("normalizer") is None
        and pre is not None
        and not any(
            model.get(k) for k in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix")
        )
        and not model.get("ignore_merges")
    )
    if not byte_level:
        raise ExportError(
            f"tokenizer {tok.path} is not a byte-level BPE with the GPT-2 pre-tokenizer (or SmolLM's: digits "
            "split off first) and no normalizer; only those map to llama.cpp's 'gpt2' tokenizer."
        )
    vocab = tok.hf.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= vocab_size:
        raise ExportError(
            f"The tokenizer has token ids up to {max(vocab.values())} but the model only {vocab_size} rows."
        )
    # rows no token maps to (train.py pads the vocabulary), named as llama.cpp's converter names them
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in vocab.items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for added in spec["added_tokens"]:
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    if not merges:  # gguf stores no empty array, and llama.cpp refuses a BPE vocabulary without merges
        raise ExportError(
            f"tokenizer {tok.path} has no BPE merges; llama.cpp's 'gpt2' tokenizer needs at least one."
        )
    return tokens, [int(t) for t in types], merges, pre


# ----------------------------------------------------------------------------- tensors


def tensor_names(cfg: ModelConfig) -> dict[str, tuple[str, int | None]]:
    """The one tensor mapping, both directions: transformers' name -> (GGUF name, heads whose q/k rows
    llama.cpp's converter permutes, or None)."""
    names = gguf.get_tensor_name_map(ARCH, cfg.n_layers)
    hf = [("model.embed_tokens.weight", None), ("model.norm.weight", None)]
    hf += [] if cfg.tie_embeddings else [("lm_head.weight", None)]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        hf += [(p + "self_attn.q_proj.weight", cfg.n_heads), (p + "self_attn.k_proj.weight", cfg.n_kv_heads)]
        hf += [(p + f"self_attn.{n}.weight", None) for n in ("v_proj", "o_proj")]
        hf += [(p + f"mlp.{n}.weight", None) for n in ("gate_proj", "up_proj", "down_proj")]
        hf += [(p + f"{n}.weight", None) for n in ("input_layernorm", "post_attention_layernorm")]
    return {name: (names.get_name(name, try_suffixes=(".weight",)), heads) for name, heads in hf}


def gguf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: str) -> dict[str, np.ndarray]:
    """GGUF name -> array: transformers' layout, q/k rows in llama.cpp's adjacent-pair rotation order."""
    matrix_type = DTYPES[dtype][0]
    out = {}
    for hf_name, tensor in to_hf_state_dict(state, cfg).items():  # a tied head is stored once, as token_embd
        gguf_name, n_heads = tensor_names(cfg)[hf_name]
        if n_heads is not None:
            tensor = half_to_interleaved(tensor, n_heads, cfg.head_dim)
        array = tensor.detach().float().numpy()
        out[gguf_name] = array.astype(matrix_type) if array.ndim == 2 else array
    return out


def from_gguf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of `gguf_tensors` up to the storage type: GGUF names -> transformers' names (q/k rows back
    in the half-split order), as `hf.from_hf_state_dict` takes them."""
    out = {}
    for hf_name, (gguf_name, n_heads) in tensor_names(cfg).items():
        tensor = tensors[gguf_name]
        out[hf_name] = tensor if n_heads is None else interleaved_to_half(tensor, n_heads, cfg.head_dim)
    return out


def gguf_writer(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    dtype: str = "f32",
    name: str = "rope-llama",
) -> gguf.GGUFWriter:
    """The whole GGUF file in memory, for `save`; raises ExportError (one sentence) for what llama.cpp
    cannot run, before anything touches the disk."""
    check_dtype(dtype)
    check_expressible(cfg, "a GGUF file")
    writer = gguf.GGUFWriter(None, ARCH_NAME)
    tokens, types, merges, pre = gguf_vocab(tokenizer, cfg.vocab_size)
    rope_freqs = add_rope(writer, cfg.rope, cfg.head_dim, claimed_context(cfg))
    tensors = gguf_tensors(state, cfg, dtype)
    writer.add_name(name)
    writer.add_file_type(DTYPES[dtype][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for field, name_of_key in MODEL_KEYS.items():
        value = getattr(cfg, field)
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(name_of_key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)  # the regexes of our pre-tokenizer
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_add_bos_token(True)  # documents start with bos in training, and generate.py prepends it
    writer.add_add_eos_token(False)
    if rope_freqs is not None:
        writer.add_tensor(ROPE_FREQS, rope_freqs)
    for tensor_name, array in tensors.items():
        writer.add_tensor(tensor_name, array)
    return writer


def save(writer: gguf.GGUFWriter, path: str | os.PathLike) -> None:
    """Write a `gguf_writer` to `path` (in place; `export` makes it atomic)."""
    writer.write_header_to_file(path=Path(path))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
