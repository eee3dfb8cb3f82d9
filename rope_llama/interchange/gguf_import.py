"""The GGUF import (`read_gguf`): interchange/gguf.py's export tables read backwards, every tensor
dequantized by gguf itself (`gguf.quants.dequantize`), the RoPE keys and a Llama-3 `rope_freqs` tensor mapped
back to a RopeConfig, the tokenizer rebuilt by transformers' own GGUF conversion. scripts/import_gguf.py
writes the checkpoint atomically; docs/export.md lists what maps to what.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from rope_llama.interchange.gguf import (
    ARCH_NAME,
    CONTEXT_LENGTH,
    LLAMA_CPP_YARN_BETAS,
    MODEL_KEYS,
    PRE_TOKENIZERS,
    ROPE,
    ROPE_FREQS,
    ROPE_SCALE_LINEAR,
    from_gguf_tensors,
    key,
    llama3_rope_freqs,
    tensor_names,
)
from rope_llama.interchange.hf import ExportError, rope_config_from_hf, to_hf_state_dict
from rope_llama.model.config import ModelConfig, TrainedLengths
from rope_llama.model.rope import RopeConfig, default_inv_freq, yarn_attention_factor


class UnsupportedGGUF(ValueError):
    """A GGUF file, or a key or tensor in it, that this model cannot hold."""


@dataclass
class ImportedGGUF:
    """What `read_gguf` makes of a file: everything a checkpoint and its tokenizer files need."""

    config: ModelConfig
    state: dict[str, torch.Tensor]  # our names (fused qkv / gate_up), float32
    context_length: int  # llama.context_length: the length the file says the model runs at
    tokenizer_json: str  # a tokenizers tokenizer.json
    tokenizer_config: dict  # transformers' tokenizer_config.json: special tokens, add_bos, chat template
    tensor_types: dict[str, int]  # GGML type name -> tensor count, as stored in the file


# llama.* keys that are read (MODEL_KEYS, CONTEXT_LENGTH, ROPE) or checked here; any other is refused
HEAD_DIM_KEYS = (key(gguf.Keys.Attention.KEY_LENGTH), key(gguf.Keys.Attention.VALUE_LENGTH))
ZERO_KEYS = (key(gguf.Keys.LLM.EXPERT_COUNT), key(gguf.Keys.LLM.EXPERT_USED_COUNT))  # MoE: only 0
KNOWN_KEYS = {
    *MODEL_KEYS.values(),
    CONTEXT_LENGTH,
    *ROPE.values(),
    ROPE_SCALE_LINEAR,
    *HEAD_DIM_KEYS,
    *ZERO_KEYS,
}
# GGUF rope.scaling.type -> transformers' rope_type (hf.py maps that to ours)
SCALING_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}


def field_values(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key -> its value (arrays as lists), without the reader's own GGUF.* header entries."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def shown(value: Any) -> str:
    """A metadata value for an error sentence: long arrays shortened."""
    if isinstance(value, list) and len(value) > 4:
        return f"[{', '.join(map(repr, value[:4]))}, ... ({len(value)} values)]"
    return repr(value)


def check_keys(fields: dict[str, Any]) -> None:
    """One sentence for a file of another architecture or kind, or a llama.* key that is not mapped."""
    architecture = fields.get("general.architecture")
    if architecture != ARCH_NAME:
        raise UnsupportedGGUF(
            f"general.architecture={architecture!r} is not supported; only llama.cpp's 'llama' is."
        )
    if fields.get("general.type", "model") != "model":
        raise UnsupportedGGUF(f"general.type={fields['general.type']!r} is not a model (an adapter?).")
    if fields.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, 1) > 1:
        raise UnsupportedGGUF(
            f"split.count={fields['split.count']}: the file is one part of a split model; merge the parts "
            "first (llama.cpp's gguf-split --merge)."
        )
    for name, value in fields.items():
        if name.startswith(f"{ARCH_NAME}.") and name not in KNOWN_KEYS:
            raise UnsupportedGGUF(f"{name}={shown(value)} has no equivalent in this model.")
    for name in ZERO_KEYS:
        if fields.get(name, 0):
            raise UnsupportedGGUF(f"{name}={fields[name]}: mixture-of-experts layers are not supported.")


def scalar(fields: dict[str, Any], name: str, default: Any = None) -> Any:
    """A required (default None) or optional key; an array of equal values (one per layer) counts as one."""
    if name not in fields:
        if default is None:
            raise UnsupportedGGUF(f"The file has no {name}, which the llama architecture needs.")
        return default
    value = fields[name]
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedGGUF(f"{name}={shown(value)} differs between layers, which is not supported.")
        value = value[0]
    return value


def model_config_from_gguf(
    fields: dict[str, Any], tensors: dict[str, gguf.ReaderTensor]
) -> tuple[ModelConfig, int]:
    """Inverse of `gguf_writer`'s keys: (ModelConfig, llama.context_length); training-only fields at their
    defaults. An absent `output.weight` means a tied head, as llama.cpp reads it."""
    check_keys(fields)
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise UnsupportedGGUF("The file has no token_embd.weight tensor.")
    rows = int(embedding.shape[-1])  # the reader states shapes in GGML's order: (columns, rows)
    optional = {"vocab_size": rows, "n_kv_heads": 0}  # absent: the embedding's rows; multi-head attention
    values = {field: scalar(fields, name, optional.get(field)) for field, name in MODEL_KEYS.items()}
    if values["vocab_size"] != rows:
        raise UnsupportedGGUF(
            f"{MODEL_KEYS['vocab_size']}={values['vocab_size']} but token_embd.weight has {rows} rows."
        )
    values["n_kv_heads"] = values["n_kv_heads"] or values["n_heads"]
    values["norm_eps"] = float(values["norm_eps"])
    n_heads, d_model = values["n_heads"], values["d_model"]
    if not n_heads or d_model % n_heads:
        raise UnsupportedGGUF(
            f"{MODEL_KEYS['d_model']}={d_model} is not divisible by {MODEL_KEYS['n_heads']}={n_heads}."
        )
    head_dim = d_model // n_heads
    for name in HEAD_DIM_KEYS:
        if fields.get(name, head_dim) != head_dim:
            raise UnsupportedGGUF(
                f"{name}={fields[name]} differs from embedding_length / head_count = {head_dim}; "
                "this model has no such projections."
            )
    context_length = int(scalar(fields, CONTEXT_LENGTH))
    rope_freqs = tensors.get(ROPE_FREQS)
    rope = rope_config_from_gguf(
        fields,
        head_dim,
        context_length,
        None if rope_freqs is None else dequantized(rope_freqs),
    )
    try:
        cfg = ModelConfig(
            **values,
            tie_embeddings="output.weight" not in tensors,
            rope=rope,
            lengths=TrainedLengths.of(context_length),  # what the file claims; its training is not recorded
        )
    except (TypeError, ValueError) as e:
        raise UnsupportedGGUF(f"The file's model shape is not valid here: {e}") from None
    return cfg, context_length


def rope_config_from_gguf(
    fields: dict[str, Any], head_dim: int, context_length: int, rope_freqs: np.ndarray | None
) -> RopeConfig:
    """Inverse of `add_rope`: the RoPE keys (and a Llama-3 `rope_freqs` tensor) -> RopeConfig, half layout
    (the q/k rows are permuted back). Through the Hugging Face mapping, like the export; llama.cpp's
    defaults where a key is absent (freq_base 10000, betas 32 / 1, the yarn original length = the
    context length). One sentence for what cannot be mapped."""
    dim = int(scalar(fields, ROPE["dimension_count"], head_dim))
    if dim != head_dim:
        raise UnsupportedGGUF(
            f"{ROPE['dimension_count']}={dim} differs from the head dimension {head_dim} (partial rotary): "
            "llama.cpp's llama architecture refuses such a file and transformers reads the key as head_dim, "
            "so nothing defines what it computes."
        )
    base = float(scalar(fields, ROPE["freq_base"], 10000.0))
    factor_key = ROPE["scaling_factor"] if ROPE["scaling_factor"] in fields else ROPE_SCALE_LINEAR
    factor = float(fields.get(factor_key, 1.0)) or 1.0  # llama.cpp reads 0 as "no scaling"
    # without a type llama.cpp takes a factor as linear; type none ignores any factor
    stype = fields.get(ROPE["scaling_type"], "linear" if factor != 1.0 else "none")
    if stype not in SCALING_TYPES:
        raise UnsupportedGGUF(
            f"{ROPE['scaling_type']}={stype!r} has no equivalent here; supported are {', '.join(SCALING_TYPES)}."
        )
    if stype != "none" and factor < 1.0:
        raise UnsupportedGGUF(
            f"{factor_key}={factor} is below 1; only context extension (>= 1) is supported."
        )
    betas = (
        float(fields.get(ROPE["scaling_yarn_beta_fast"], LLAMA_CPP_YARN_BETAS[0])),
        float(fields.get(ROPE["scaling_yarn_beta_slow"], LLAMA_CPP_YARN_BETAS[1])),
    )
    for name, value, default in zip(
        (ROPE["scaling_yarn_beta_fast"], ROPE["scaling_yarn_beta_slow"]), betas, LLAMA_CPP_YARN_BETAS
    ):
        if value != default:  # llama.cpp's llama architecture never reads them: what would the file mean?
            raise UnsupportedGGUF(
                f"{name}={value} cannot be imported: llama.cpp's llama architecture ignores it and uses "
                f"{default}, so the file does not say which one the model was trained with."
            )
    params = {"rope_type": SCALING_TYPES[stype], "rope_theta": base}
    if stype == "linear":
        params["factor"] = factor
    elif stype == "yarn":
        params.update(factor=factor, beta_fast=betas[0], beta_slow=betas[1], truncate=True)
    if stype != "none" and ROPE["scaling_orig_ctx_len"] in fields:
        params["original_max_position_embeddings"] = int(fields[ROPE["scaling_orig_ctx_len"]])
    if rope_freqs is not None:
        if stype != "none":
            raise UnsupportedGGUF(
                f"{ROPE_FREQS} together with {ROPE['scaling_type']}={stype!r} has no equivalent here; "
                "per-frequency factors are read as Llama-3 scaling only without another scaling."
            )
        original = fields.get(ROPE["scaling_orig_ctx_len"])
        params = llama3_parameters(rope_freqs, base, head_dim, context_length, original)
    try:
        rope = rope_config_from_hf(params, context_length)
    except (ExportError, TypeError, ValueError) as e:
        raise UnsupportedGGUF(f"The file's RoPE keys {params} are not valid here: {e}") from None
    if ROPE["scaling_attn_factor"] in fields:  # llama.cpp multiplies its own yarn factor by this one
        own = yarn_attention_factor(rope.factor) if rope.scaling == "yarn" else 1.0
        rope = replace(rope, attention_factor=float(fields[ROPE["scaling_attn_factor"]]) * own)
    return rope


# Factors of a rope_freqs tensor must come back to this relative precision (f32 storage is 6e-8)
FREQS_RTOL = 2e-6


def llama3_parameters(
    factors: np.ndarray, base: float, head_dim: int, context_length: int, original: int | None
) -> dict:
    """Transformers' rope_parameters of the Llama-3 scaling whose per-frequency factors (what llama.cpp
    divides each frequency by) are `factors`, or one sentence that none is.

    The factors fix only the frequencies the model uses: 1 above the high-frequency band, `factor` below
    the low one, (1 - s) / factor + s = 1 / f in between, with s linear in 1 / wavelength. That gives
    `factor` and the two band edges L0 / high_freq_factor and L0 / low_freq_factor (exactly when two
    frequencies or more fall in between, else any edge between two frequencies serves). L0 is then the
    file's original context length if it states one, else the Llama-3 convention low_freq_factor = 1;
    Llama 3.1's own parameters (8, 1, 4, 8192) come back from its tensor. Each candidate is checked by
    recomputing the factors."""
    factors = np.asarray(factors, dtype=np.float64)
    inv_freq = default_inv_freq(base, head_dim).double().numpy()
    if factors.shape != inv_freq.shape or not np.isfinite(factors).all() or factors.min() <= 0:
        raise UnsupportedGGUF(
            f"{ROPE_FREQS} has shape {list(factors.shape)} or values that are not per-frequency factors "
            f"(head_dim / 2 = {head_dim // 2} positive numbers)."
        )
    factor = float(factors.max())
    uniform = np.allclose(factors, factors[0], rtol=FREQS_RTOL, atol=0)  # every frequency divided alike
    if uniform and math.isclose(factor, 1.0, rel_tol=FREQS_RTOL):
        return {"rope_type": "default", "rope_theta": base}
    if uniform and factor > 1:
        return {"rope_type": "linear", "rope_theta": base, "factor": factor}
    for candidate in llama3_candidates(factors, inv_freq, factor, context_length, original):
        try:
            rope = RopeConfig(
                scaling="llama3",
                base=base,
                factor=candidate["factor"],
                original_max_len=candidate["original_max_position_embeddings"],
                low_freq_factor=candidate["low_freq_factor"],
                high_freq_factor=candidate["high_freq_factor"],
            )
        except ValueError:
            continue
        if np.allclose(llama3_rope_freqs(rope, head_dim).double().numpy(), factors, rtol=FREQS_RTOL, atol=0):
            return {"rope_type": "llama3", "rope_theta": base} | candidate
    raise UnsupportedGGUF(
        f"{ROPE_FREQS}={shown([round(float(f), 6) for f in factors])} matches no Llama-3 scaling, and this "
        "model cannot hold explicit per-frequency factors."
    )


def llama3_candidates(
    factors: np.ndarray, inv_freq: np.ndarray, factor: float, context_length: int, original: int | None
):
    """Llama-3 parameters that may reproduce `factors` (see `llama3_parameters`), simplest first."""
    x = inv_freq / (2 * math.pi)  # 1 / wavelength, decreasing with the index
    close = lambda a, b: abs(a - b) <= FREQS_RTOL * max(abs(a), abs(b))  # noqa: E731
    high = np.array([close(f, 1.0) for f in factors])  # kept: short wavelengths
    low = np.array([close(f, factor) for f in factors])  # divided by factor: long wavelengths
    middle = ~(high | low)
    # s = (1/f - 1/factor) / (1 - 1/factor) = (x - a) / (b - a) with a = 1/low-band edge, b = 1/high-band edge
    s = (1 / factors[middle] - 1 / factor) / (1 - 1 / factor)
    top = x[high].min() if high.any() else 2 * x.max()  # b lies below every kept frequency ...
    bottom = x[low].max() if low.any() else 0.0  # ... a above every divided one
    if middle.sum() >= 2:
        solution = np.linalg.lstsq(np.stack([1 - s, s], axis=1), x[middle], rcond=None)[0]
        edges = [tuple(solution)]
    elif middle.sum() == 1:  # x = a (1 - s) + b s: a anywhere its b stays in range; the middle of that
        xm, sm = x[middle][0], s[0]
        lo = max(bottom, (xm - top * sm) / (1 - sm))
        a = (lo + xm) / 2
        edges = [(a, (xm - a * (1 - sm)) / sm)]
    else:  # no frequency in between: both edges in the gap between the two bands
        edges = [(bottom + (top - bottom) / 3, bottom + 2 * (top - bottom) / 3)]
    factors_to_try = dict.fromkeys([round(factor, 4), factor])
    lengths = [n for n in (original, context_length / factor) if n and float(n).is_integer()]
    for f in factors_to_try:
        for length in lengths:  # Llama 3's band factors 1 and 4 at the stated original length
            yield candidate(f, int(length), 1.0, 4.0)
        for a, b in edges:
            if not 0 < a < b:
                continue
            # the stated original length, then the Llama-3 convention low_freq_factor = 1, then context / factor
            options = [int(n) for n in (original,) if n] + [max(1, round(1 / a))] + [int(n) for n in lengths]
            for length in options:
                for digits in (4, None):  # round band factors first: files come from round parameters
                    low_f, high_f = length * a, length * b
                    if digits is not None:
                        low_f, high_f = round(low_f, digits), round(high_f, digits)
                    yield candidate(f, length, low_f, high_f)


def candidate(factor: float, length: int, low: float, high: float) -> dict:
    return {
        "factor": float(factor),
        "original_max_position_embeddings": int(length),
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
    }


def dequantized(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A tensor in float32, row-major (PyTorch's shape), by gguf's own dequantization of its type."""
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise UnsupportedGGUF(
            f"Tensor {tensor.name} is stored as {tensor.tensor_type.name}, which gguf {gguf_version()} "
            "cannot dequantize."
        ) from None
    return np.asarray(array, dtype=np.float32)


def gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def read_tensors(reader: gguf.GGUFReader, cfg: ModelConfig, expected: dict[str, tuple]) -> dict:
    """Our state dict from the file's tensors: each dequantized, checked against its expected shape, the
    q/k rows permuted back (`from_gguf_tensors`) and fused as ours (hf.from_hf_state_dict)."""
    from rope_llama.interchange.hf import from_hf_state_dict

    stored = {t.name: t for t in reader.tensors}
    for name in stored:
        if name not in expected and name != ROPE_FREQS:
            raise UnsupportedGGUF(f"The file has a tensor {name}, which this model has no place for.")
    tensors = {}
    for name, shape in expected.items():
        if name not in stored:
            raise UnsupportedGGUF(f"The file has no tensor {name}, which a llama model of its shape needs.")
        array = dequantized(stored[name])
        if tuple(array.shape) != tuple(shape):
            raise UnsupportedGGUF(
                f"Tensor {name} has shape {list(array.shape)}, but the file's keys need {list(shape)}."
            )
        # an f32 tensor is a view of the file, which the reader maps read-only
        tensors[name] = torch.from_numpy(array if array.flags.writeable else array.copy())
    return from_hf_state_dict(from_gguf_tensors(tensors, cfg), cfg)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF name -> the (row-major) shape a model of `cfg` needs, without allocating it."""
    from rope_llama.model.llama import Llama

    with torch.device("meta"):
        state = Llama(cfg).state_dict()
    shapes = {name: tuple(t.shape) for name, t in to_hf_state_dict(state, cfg).items()}
    return {gguf_name: shapes[hf_name] for hf_name, (gguf_name, _) in tensor_names(cfg).items()}


def read_gguf(path: str | os.PathLike) -> ImportedGGUF:
    """A llama GGUF file -> config, our state dict (float32), tokenizer files; raises UnsupportedGGUF
    (one sentence) for anything that cannot be mapped, before the slow part."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:  # a truncated or foreign file
        raise UnsupportedGGUF(f"{path} is not a readable GGUF file: {e}") from None
    fields = field_values(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg, context_length = model_config_from_gguf(fields, tensors)
    tokenizer_json, tokenizer_config = gguf_tokenizer(path, fields, cfg.vocab_size, context_length)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    state = read_tensors(reader, cfg, expected_shapes(cfg))
    return ImportedGGUF(cfg, state, context_length, tokenizer_json, tokenizer_config, types)


# ----------------------------------------------------------------------------- tokenizer (import)

TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE; SentencePiece (transformers converts both)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def gguf_tokenizer(
    path: Path, fields: dict[str, Any], vocab_size: int, context_length: int
) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json dict) from the file's vocabulary, by transformers' own
    GGUF conversion (`get_gguf_tokenizer`, `convert_gguf_tokenizer`: what `AutoTokenizer.from_pretrained(...,
    gguf_file=...)` runs); the pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre`; a post-processor
    that adds bos / eos as the file's add_bos_token / add_eos_token say. The config keeps the special tokens
    and the chat template in transformers' format, so AutoTokenizer loads the folder as it is."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    kind = fields.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise UnsupportedGGUF(
            f"tokenizer.ggml.model={kind!r} is not supported; supported are {', '.join(TOKENIZER_MODELS)} "
            "(byte-level BPE, SentencePiece)."
        )
    pre = fields.get("tokenizer.ggml.pre")
    if kind == "gpt2" and pre not in PRE_TOKENIZERS and pre not in GGUF_PRE_TOKENIZER_SPLITS:
        known = sorted({*PRE_TOKENIZERS, *GGUF_PRE_TOKENIZER_SPLITS})
        raise UnsupportedGGUF(
            f"tokenizer.ggml.pre={pre!r} names no pre-tokenizer known here (known: {', '.join(known)})."
        )
    if kind == "llama" and not fields.get("tokenizer.ggml.add_space_prefix", True):
        raise UnsupportedGGUF(
            "tokenizer.ggml.add_space_prefix=False is not supported: transformers' SentencePiece conversion "
            "always prepends the space."
        )
    architecture, tokenizer_dict, config = get_gguf_tokenizer(str(path))
    try:
        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (ValueError, KeyError, TypeError) as e:
        raise UnsupportedGGUF(f"transformers cannot convert the file's tokenizer: {e}") from None
    if kind == "gpt2" and pre in PRE_TOKENIZERS:
        backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend = without_foreign_tokens(backend, tokenizer_dict["tokens"])
    if backend.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise UnsupportedGGUF(
            f"The file's vocabulary has {backend.get_vocab_size(with_added_tokens=True)} tokens but the "
            f"model only {vocab_size} rows."
        )
    add = {role: bool(config.get(f"add_{role}_token", False)) for role in ("bos", "eos")}
    added = [
        (config[f"{role}_token"], role)
        for role in ("bos", "eos")
        if add[role] and config.get(f"{role}_token")
    ]
    if any(backend.token_to_id(token) is None for token, _ in added):
        raise UnsupportedGGUF(f"The file's special tokens {config} are not in its vocabulary.")

    def part(sequence: str, type_id: int) -> list[str]:  # [bos] sequence [eos], as the file's flags say
        bos = [f"{t}:{type_id}" for t, role in added if role == "bos"]
        return bos + [f"{sequence}:{type_id}"] + [f"{t}:{type_id}" for t, role in added if role == "eos"]

    backend.post_processor = processors.TemplateProcessing(
        single=part("$A", 0),
        pair=part("$A", 0) + part("$B", 1),
        special_tokens=[(token, backend.token_to_id(token)) for token in dict.fromkeys(t for t, _ in added)],
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{name: config[name] for name in SPECIAL_TOKENS if config.get(name) is not None},
        "add_bos_token": add["bos"],
        "add_eos_token": add["eos"],
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
    }
    templates = {k: v for k, v in fields.items() if k.startswith("tokenizer.chat_template.")}
    if templates:  # named templates besides the default: transformers' list form
        named = [
            {"name": k.removeprefix("tokenizer.chat_template."), "template": v} for k, v in templates.items()
        ]
        default = (
            [{"name": "default", "template": config["chat_template"]}] if config.get("chat_template") else []
        )
        tokenizer_config["chat_template"] = default + named
    elif config.get("chat_template"):
        tokenizer_config["chat_template"] = config["chat_template"]
    return backend.to_str(), tokenizer_config


def without_foreign_tokens(backend: HFTokenizer, tokens: list[str]) -> HFTokenizer:
    """The tokenizer without the added tokens the file does not list: transformers' GPT-2 class adds its
    default `<|endoftext|>` to a vocabulary that lacks it, an id the model has no row for."""
    spec = json.loads(backend.to_str())
    kept = [t for t in spec["added_tokens"] if t["id"] < len(tokens) and tokens[t["id"]] == t["content"]]
    if len(kept) == len(spec["added_tokens"]):
        return backend
    return HFTokenizer.from_str(json.dumps(spec | {"added_tokens": kept}))


def describe(imported: ImportedGGUF) -> str:
    """One line on what was imported: shape, RoPE, storage types, context length."""
    cfg, rope = imported.config, imported.config.rope
    scaling = rope.scaling if rope.scaling == "none" else f"{rope.scaling} x{rope.factor:g}"
    types = ", ".join(f"{n} {name}" for name, n in sorted(imported.tensor_types.items(), key=lambda t: -t[1]))
    return (
        f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} / {cfg.n_kv_heads} heads, vocab "
        f"{cfg.vocab_size}, {'tied' if cfg.tie_embeddings else 'separate'} head; rope {scaling}, base "
        f"{rope.base:g}; context {imported.context_length}; tensors {types}"
    )
