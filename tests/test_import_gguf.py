"""GGUF import: synthetic llama files written with gguf's own writer and quantizer, read back by
scripts/import_gguf.py and compared with transformers' GGUF loader (logits, tokenizer), and round trips
through both exports. The real model (SmolLM2 with llama.cpp as the reference) is tests/test_smollm2.py."""

import json
import math
import sys
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rope_llama.cli.export_gguf import export as export_gguf
from rope_llama.cli.export_hf import export as export_hf
from rope_llama.cli.import_gguf import import_gguf, main
from rope_llama.cli.import_hf import import_hf
from rope_llama.core.checkpoint import file_sha256, load_checkpoint
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.generation import generate
from rope_llama.inference.loading import load_model
from rope_llama.interchange.gguf import gguf_tensors, gguf_vocab, save
from rope_llama.interchange.gguf_import import llama3_parameters
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig

Q = gguf.GGMLQuantizationType
L0 = 32  # the original context of the scaled files; the logits run over 4 L0 = 128 tokens
TOKENS = 128
CHAT = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>{% endfor %}"


def tiny_config(tie: bool = True, **overrides) -> ModelConfig:
    fields = dict(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96)
    return ModelConfig(**fields | overrides, init_std=0.2, tie_embeddings=tie)


def random_model(cfg: ModelConfig) -> Llama:
    torch.manual_seed(0)
    model = Llama(cfg)
    with torch.no_grad():  # norms away from 1, so a norm read from the wrong tensor shows
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.8, 1.2)
    return model.eval()


def write_gguf(
    path,
    model: Llama,
    tokenizer: Tokenizer,
    matrices=Q.F32,
    embedding=None,
    keys: dict | None = None,
    rope_freqs: np.ndarray | None = None,
    context_length: int = L0,
    add_bos: bool = True,
    chat_template: str | None = CHAT,
    tensors: dict | None = None,
):
    """A llama GGUF file as llama.cpp's converter lays it out: metadata stated here key by key, matrices
    stored as `matrices` (the embedding as `embedding`) by gguf's own quantizer, 1-D tensors f32;
    `keys` adds or replaces metadata ({name: value}, None removes one), `tensors` adds or replaces tensors."""
    cfg = model.config
    writer = gguf.GGUFWriter(None, "llama")
    writer.add_name("synthetic")
    writer.add_context_length(context_length)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.ffn_hidden)
    writer.add_block_count(cfg.n_layers)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope.base)
    writer.add_vocab_size(cfg.vocab_size)
    token_list, types, merges, _ = gguf_vocab(tokenizer, cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(token_list)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, value in (keys or {}).items():
        writer.kv_data[0].pop(name, None)
        if value is not None:
            kind = {
                str: gguf.GGUFValueType.STRING,
                float: gguf.GGUFValueType.FLOAT32,
                bool: gguf.GGUFValueType.BOOL,
            }
            writer.add_key_value(name, value, kind.get(type(value), gguf.GGUFValueType.UINT32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    arrays = gguf_tensors(model.state_dict(), cfg, "f32") | (tensors or {})
    for name, array in arrays.items():
        qtype = (embedding or matrices) if name == "token_embd.weight" else matrices
        if isinstance(array, tuple):  # (raw bytes, type): a block type gguf cannot quantize
            writer.add_tensor(name, array[0], raw_dtype=array[1])
        elif array.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    save(writer, path)
    return path


def transformers_model(path, rope_parameters: dict | None = None):
    """transformers' own GGUF loader, fp32; `rope_parameters` replaces the RoPE it reads (its llama mapping
    reads no scaling key), `max_position_embeddings` stays the file's context length."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if rope_parameters is not None:
        config.rope_parameters = rope_parameters
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    ).eval()


def prompt(tokenizer: Tokenizer, text: str, n: int = TOKENS) -> torch.Tensor:
    ids = [tokenizer.bos_id, *tokenizer.encode(text)][:n]
    assert len(ids) == n
    return torch.tensor([ids])


def logits_both(path, out, ids, rope_parameters=None):
    ours = load_checkpoint(import_gguf(path, out)).model
    theirs = transformers_model(path, rope_parameters)
    with torch.no_grad():
        return ours(ids), theirs(ids).logits


@pytest.mark.parametrize(
    "matrices, embedding, tie",
    [
        (Q.F32, None, False),
        (Q.F16, None, True),
        (Q.BF16, None, True),
        (Q.Q8_0, None, False),
        (Q.Q4_1, Q.Q8_0, True),  # SmolLM2's layout: Q4_1 matrices, a Q8_0 embedding, tied
        (Q.Q4_1, Q.Q8_0, False),
        (Q.Q4_0, None, True),
        (Q.Q5_0, None, True),
        (Q.Q5_1, None, False),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_logits_equal_transformers_for_every_quantization(
    matrices, embedding, tie, tmp_path, macbeth_tokenizer, macbeth
):
    model = random_model(tiny_config(tie))
    path = write_gguf(tmp_path / "m.gguf", model, macbeth_tokenizer, matrices, embedding)
    ours, theirs = logits_both(path, tmp_path / "imported", prompt(macbeth_tokenizer, macbeth[5000:9000]))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert ours.abs().max() > 3  # sharp logits: a wrong tensor would show far beyond the tolerance

    imported = load_checkpoint(tmp_path / "imported").model
    assert imported.config.tie_embeddings is tie
    state, original = imported.state_dict(), model.state_dict()
    assert state.keys() == original.keys()
    for name, tensor in original.items():  # the stored values, with the q/k rows back in our order
        if matrices == Q.F32 or tensor.ndim == 1:
            assert torch.equal(state[name], tensor), name
        else:  # within the format's rounding: 4-bit blocks keep about a tenth of the range
            limit = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-2}.get(matrices, 0.25)
            error = (state[name] - tensor).abs().max() / tensor.abs().max()
            assert 0 < error < limit, (name, error)


def k_quant_blocks(rows: int, cols: int, qtype, rng) -> tuple[np.ndarray, Q]:
    """Random Q4_K / Q6_K blocks with small finite scales: gguf cannot quantize to K-quants, but dequantizes them."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    # (byte offset, f16 value) of the block scales: weights up to about 0.5
    scales = {Q.Q4_K: [(0, 5e-4), (2, 3e-4)], Q.Q6_K: [(size - 2, 1e-4)]}[qtype]
    for offset, value in scales:
        raw[..., offset : offset + 2] = (
            np.full(raw.shape[:2], value, dtype=np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
        )
    return raw.reshape(rows, -1), qtype


def test_k_quant_files_dequantize_like_transformers(tmp_path, macbeth_tokenizer, macbeth):
    cfg = tiny_config(False, d_model=256, ffn_hidden=256, n_layers=1)  # K-quant blocks span 256 columns
    model = random_model(cfg)
    rng = np.random.default_rng(0)
    shapes = {
        name: a.shape for name, a in gguf_tensors(model.state_dict(), cfg, "f32").items() if a.ndim == 2
    }
    tensors = {
        name: k_quant_blocks(
            *shape, Q.Q6_K if name in ("output.weight", "blk.0.ffn_down.weight") else Q.Q4_K, rng
        )
        for name, shape in shapes.items()
    }
    path = write_gguf(tmp_path / "k.gguf", model, macbeth_tokenizer, tensors=tensors)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert {types[name] for name in shapes} == {Q.Q4_K, Q.Q6_K}
    ours, theirs = logits_both(path, tmp_path / "imported", prompt(macbeth_tokenizer, macbeth[5000:9000]))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert ours.std() > 0.1


def hf_llama3_factors(base: float, head_dim: int, params: dict) -> np.ndarray:
    """rope_freqs as llama.cpp's converter computes it: plain / Llama-3 frequencies, here from transformers'
    own Llama-3 initialisation (independent of ours)."""
    config = LlamaConfig(
        hidden_size=head_dim, num_attention_heads=1, rope_parameters={"rope_theta": base, **params}
    )
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (plain / llama3).numpy()


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3 |= {"original_max_position_embeddings": L0}
YARN_KEYS = {
    "llama.rope.scaling.type": "yarn",
    "llama.rope.scaling.factor": 4.0,
    "llama.rope.scaling.original_context_length": L0,
}
# name -> (metadata, rope_freqs params or None, context length, the RopeConfig we expect, transformers' rope_parameters)
SCALED = {
    "linear": (
        {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
        None,
        L0,
        RopeConfig(scaling="linear", factor=4.0, original_max_len=L0),
        {"rope_type": "linear", "factor": 4.0},
    ),
    "linear_without_type": (  # llama.cpp takes a factor without a type as linear; the old key too
        {"llama.rope.scale_linear": 2.0},
        None,
        L0,
        RopeConfig(scaling="linear", factor=2.0, original_max_len=L0),
        {"rope_type": "linear", "factor": 2.0},
    ),
    "yarn": (
        YARN_KEYS,
        None,
        4 * L0,
        RopeConfig(scaling="yarn", factor=4.0, original_max_len=L0),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0, "truncate": True},
    ),
    "yarn_attn_factor": (  # llama.cpp multiplies its own 0.1 ln(s) + 1 by the file's factor
        YARN_KEYS | {"llama.rope.scaling.attn_factor": 1.25},
        None,
        4 * L0,
        RopeConfig(
            scaling="yarn", factor=4.0, original_max_len=L0, attention_factor=1.25 * (0.1 * math.log(4) + 1)
        ),
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": L0,
            "truncate": True,
            "attention_factor": 1.25 * (0.1 * math.log(4) + 1),
        },
    ),
    "llama3": (
        {},
        LLAMA3,
        4 * L0,
        RopeConfig(scaling="llama3", factor=4.0, original_max_len=L0, base=500.0),
        LLAMA3,
    ),
    "llama3_wider_bands": (  # Llama 3.1's shape: the file states no original length, the bands say it
        {},
        LLAMA3 | {"factor": 8.0, "high_freq_factor": 8.0},
        200,  # not a multiple of the factor: the original length comes from the bands
        RopeConfig(scaling="llama3", factor=8.0, original_max_len=L0, base=500.0, high_freq_factor=8.0),
        LLAMA3 | {"factor": 8.0, "high_freq_factor": 8.0},
    ),
}


@pytest.mark.parametrize("name", list(SCALED))
def test_rope_metadata_maps_to_our_rope_config_and_transformers_logits(
    name, tmp_path, macbeth_tokenizer, macbeth
):
    keys, llama3, context, expected, hf_params = SCALED[name]
    base = expected.base
    model = random_model(tiny_config(rope=RopeConfig(base=base, original_max_len=L0)))
    freqs = None if llama3 is None else hf_llama3_factors(base, 16, llama3)
    path = write_gguf(
        tmp_path / "m.gguf", model, macbeth_tokenizer, keys=keys, rope_freqs=freqs, context_length=context
    )
    ids = prompt(macbeth_tokenizer, macbeth[5000:9000])  # 4 L0: every scaling is active
    ours, theirs = logits_both(path, tmp_path / "imported", ids, {"rope_theta": base, **hf_params})
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)

    loaded = load_checkpoint(tmp_path / "imported")
    rope = loaded.config.rope
    assert replace(rope, attention_factor=None) == replace(expected, attention_factor=None)
    if expected.attention_factor is not None:
        assert rope.attention_factor == pytest.approx(expected.attention_factor, rel=1e-6)
    assert loaded.context_len == context  # the checkpoint claims the file's context length
    with torch.no_grad():  # the scaling matters at these lengths: unscaled RoPE is far off
        plain = transformers_model(path)(ids).logits
    assert (plain - ours).abs().max() > 0.05


def test_llama3_factors_are_recovered_or_refused():
    base, dim = 500000.0, 128  # Llama 3.1 8B: its own parameters come back from its tensor alone
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    params |= {"original_max_position_embeddings": 8192}
    factors = hf_llama3_factors(base, dim, {"rope_type": "llama3", **params})
    assert llama3_parameters(factors, base, dim, 131072, None) == {
        "rope_type": "llama3",
        "rope_theta": base,
        **params,
    }
    uniform = np.full(dim // 2, 2.0, dtype=np.float32)  # every frequency divided by 2: linear scaling
    assert llama3_parameters(uniform, base, dim, 8192, None) == {
        "rope_type": "linear",
        "rope_theta": base,
        "factor": 2.0,
    }
    damaged = factors.copy()
    damaged[40] *= 1.01
    for refused in (damaged, np.full(dim // 2, 0.5)):  # one factor off; every frequency multiplied
        with pytest.raises(ValueError, match=r"rope_freqs.weight=\[.*\] matches no Llama-3 scaling"):
            llama3_parameters(refused, base, dim, 131072, None)


REFUSED = {
    "partial rotary": (
        {"llama.rope.dimension_count": 8},
        "error: llama.rope.dimension_count=8 differs from the head dimension 16 (partial rotary): ",
    ),
    "longrope": (
        {"llama.rope.scaling.type": "longrope"},
        "error: llama.rope.scaling.type='longrope' has no equivalent here; supported are none, linear, yarn.",
    ),
    "yarn betas": (
        YARN_KEYS | {"llama.rope.scaling.yarn_beta_fast": 16.0},
        "error: llama.rope.scaling.yarn_beta_fast=16.0 cannot be imported: llama.cpp's llama architecture "
        "ignores it and uses 32.0",
    ),
    "unknown key": (
        {"llama.attention.sliding_window": 4096},
        "error: llama.attention.sliding_window=4096 has no equivalent in this model.",
    ),
    "architecture": (
        {"general.architecture": "qwen2"},
        "error: general.architecture='qwen2' is not supported; only llama.cpp's 'llama' is.",
    ),
    "pre-tokenizer": (
        {"tokenizer.ggml.pre": "made-up"},
        "error: tokenizer.ggml.pre='made-up' names no pre-tokenizer known here",
    ),
    "rope_freqs with yarn": (
        YARN_KEYS | {"rope_freqs": True},
        "error: rope_freqs.weight together with llama.rope.scaling.type='yarn' has no equivalent here",
    ),
    "arbitrary rope_freqs": (
        {"rope_freqs": False},
        "error: rope_freqs.weight=[",
    ),
}


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """scripts/import_gguf.py's entry point with these arguments, in this process (Hydra parsing included)."""
    monkeypatch.setattr(sys, "argv", ["import_gguf.py", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", list(REFUSED))
def test_unmappable_files_are_one_sentence_and_exit_2(name, tmp_path, macbeth_tokenizer, monkeypatch, capsys):
    keys, message = REFUSED[name]
    keys = dict(keys)
    freqs = keys.pop("rope_freqs", None)
    if freqs is not None:  # Llama-3 shaped (for yarn), or random factors no Llama-3 scaling gives
        rng = np.random.default_rng(0)
        freqs = hf_llama3_factors(1e4, 16, LLAMA3) if freqs else rng.uniform(1, 3, 8)
    path = write_gguf(
        tmp_path / "m.gguf", random_model(tiny_config()), macbeth_tokenizer, keys=keys, rope_freqs=freqs
    )
    code, out, err = run_main(monkeypatch, capsys, f"gguf={path}", f"out={tmp_path / 'imported'}")
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_tokenizer_encodes_like_transformers_and_keeps_special_tokens(tmp_path, macbeth_tokenizer, macbeth):
    path = write_gguf(tmp_path / "m.gguf", random_model(tiny_config()), macbeth_tokenizer)
    out = import_gguf(path, tmp_path / "imported").parent
    assert sorted(p.name for p in out.iterdir()) == ["model.ckpt", "tokenizer.json", "tokenizer_config.json"]
    ours = Tokenizer(str(out / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    passage = macbeth[60000:62000] + " naïve café — ünïcode 1234 x  \n\n\tend  "  # held out, odd spacing
    ids = ours.encode(passage)
    assert (
        ids == reference(passage, add_special_tokens=False)["input_ids"] == macbeth_tokenizer.encode(passage)
    )
    assert ours.decode(ids) == passage
    assert (ours.bos_id, ours.eos_id) == (macbeth_tokenizer.bos_id, macbeth_tokenizer.eos_id)

    saved = AutoTokenizer.from_pretrained(out)  # the folder is a transformers tokenizer as it is
    assert saved(passage)["input_ids"] == [ours.bos_id, *ids]  # the file's add_bos_token = true
    assert (saved.bos_token, saved.eos_token) == ("<|bos|>", "<|eos|>")
    messages = [
        {"role": "user", "content": "Who is there?"},
        {"role": "assistant", "content": "Nay, answer me."},
    ]
    assert saved.apply_chat_template(messages, tokenize=False) == reference.apply_chat_template(
        messages, tokenize=False
    )
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT and config["model_max_length"] == L0
    assert (config["add_bos_token"], config["add_eos_token"]) == (True, False)

    without_bos = write_gguf(
        tmp_path / "n.gguf", random_model(tiny_config()), macbeth_tokenizer, add_bos=False
    )
    folder = import_gguf(without_bos, tmp_path / "n").parent
    assert AutoTokenizer.from_pretrained(folder)(passage)["input_ids"] == ids


def sentencepiece_gguf(path, words: list[str]):
    """A llama GGUF file with a SentencePiece ('llama') vocabulary: <unk>, <s>, </s>, 256 byte tokens,
    then characters and words with scores (no merges: transformers derives them)."""
    pieces = ["▁" + w for w in words] + sorted({c for w in words for c in "▁" + w})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    cfg = tiny_config(vocab_size=len(tokens))
    model = random_model(cfg)
    writer = gguf.GGUFWriter(None, "llama")
    for add, value in [
        (writer.add_context_length, L0),
        (writer.add_embedding_length, cfg.d_model),
        (writer.add_feed_forward_length, cfg.ffn_hidden),
        (writer.add_block_count, cfg.n_layers),
        (writer.add_head_count, cfg.n_heads),
        (writer.add_head_count_kv, cfg.n_kv_heads),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_tokenizer_model, "llama"),
        (writer.add_token_list, tokens),
        (writer.add_token_types, types),
        (writer.add_token_scores, scores),
        (writer.add_bos_token_id, 1),
        (writer.add_eos_token_id, 2),
        (writer.add_unk_token_id, 0),
    ]:
        add(value)
    for name, array in gguf_tensors(model.state_dict(), cfg, "f32").items():
        writer.add_tensor(name, array)
    save(writer, path)
    return path


def test_sentencepiece_vocabulary_encodes_like_transformers(tmp_path, macbeth):
    words = sorted(set(macbeth[:3000].split()))[:150]
    path = sentencepiece_gguf(tmp_path / "sp.gguf", words)
    out = import_gguf(path, tmp_path / "imported").parent
    ours = Tokenizer(str(out / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = macbeth[3000:4000] + " ünïcode ✓"  # unseen words: characters and byte fallback
    ids = ours.encode(text)
    assert ids == reference(text, add_special_tokens=False)["input_ids"] and len(ids) > 100
    assert any(3 <= i < 259 for i in ids)  # byte tokens were used
    assert (ours.bos_id, ours.eos_id) == (1, 2)
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == reference(text)["input_ids"]
    exported = AutoTokenizer.from_pretrained(export_hf(out, tmp_path / "hf"))  # bos / eos keep their names
    assert len(exported) == len(reference) and (exported.bos_token, exported.eos_token) == ("<s>", "</s>")
    assert exported(text)["input_ids"] == [1, *ids]


@pytest.mark.parametrize("name", ["none", "yarn", "llama3"])
def test_import_export_import_gives_identical_weights(name, tmp_path, macbeth_tokenizer):
    keys, llama3, context, _, _ = SCALED[name] if name in SCALED else ({}, None, L0, None, None)
    base = 500.0 if llama3 else 1e4
    model = random_model(tiny_config(tie=name != "yarn", rope=RopeConfig(base=base, original_max_len=L0)))
    freqs = None if llama3 is None else hf_llama3_factors(base, 16, llama3)
    path = write_gguf(
        tmp_path / "m.gguf",
        model,
        macbeth_tokenizer,
        Q.Q4_1,
        keys=keys,
        rope_freqs=freqs,
        context_length=context,
    )
    first = load_checkpoint(import_gguf(path, tmp_path / "a"))

    exported = export_gguf(tmp_path / "a", tmp_path / "a.gguf")  # through our GGUF export
    second = load_checkpoint(import_gguf(exported, tmp_path / "b"))
    hf = export_hf(tmp_path / "a", tmp_path / "hf")  # through the Hugging Face pair
    third = load_checkpoint(import_hf(hf, tmp_path / "c" / "model.ckpt"))
    for back in (second, third):
        assert back.config.to_dict() | {"ffn_multiple_of": 0} == first.config.to_dict() | {
            "ffn_multiple_of": 0
        }
        state = back.model.state_dict()
        assert state.keys() == first.model.state_dict().keys()
        for key, tensor in first.model.state_dict().items():
            assert torch.equal(state[key], tensor), key
    assert second.context_len == first.context_len == context
    assert file_sha256(tmp_path / "b" / "tokenizer.json") == file_sha256(tmp_path / "a" / "tokenizer.json")


def test_output_runs_in_generate_and_refuses_what_it_would_overwrite(
    tmp_path, macbeth_tokenizer, monkeypatch, capsys
):
    path = write_gguf(tmp_path / "m.gguf", random_model(tiny_config()), macbeth_tokenizer, Q.Q8_0)
    out = tmp_path / "imported"
    code, stdout, err = run_main(monkeypatch, capsys, f"gguf={path}", f"out={out}")
    assert code == 0, err
    assert stdout.startswith(
        "m.gguf: 2 layers, d_model 64, 4 / 2 heads, vocab 320, tied head; rope none, base 10000; context 32; "
        "tensors 15 Q8_0, 5 F32\n"
        f"Imported {path} to {out / 'model.ckpt'} in "
    ), stdout
    loaded, tok = load_model(str(out), device="cpu")  # what generate.py ckpt=<out> loads
    assert tok.sha256 == file_sha256(out / "tokenizer.json") and loaded.context_len == L0
    assert len(generate(loaded.model, [[tok.bos_id, 5, 6]], 4).tokens[0]) == 4
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for args, message in [
        ([f"out={out}"], f"error: out={out} is not empty; pass overwrite=true"),
        ([f"out={out}", "overwrite=no"], "error: overwrite must be true or false, got 'no'."),
        ([f"out={path}"], f"error: out={path} is a file; give a directory"),
        (
            [f"out={tmp_path / 'run' / 'checkpoints'}", "overwrite=true"],
            f"error: out={tmp_path / 'run' / 'checkpoints'} is inside the run directory {tmp_path / 'run'} ",
        ),
        ([f"out={tmp_path / 'run'}", "overwrite=true"], f"error: out={tmp_path / 'run'} is inside the run"),
    ]:
        code, _, err = run_main(monkeypatch, capsys, f"gguf={path}", *args)
        assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]

    (out / "notes.txt").write_text("mine")
    code, _, err = run_main(monkeypatch, capsys, f"gguf={path}", f"out={out}", "overwrite=true")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "model.ckpt",
        "notes.txt",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imported", "m.gguf", "run"]  # no temp dirs left


def test_a_truncated_file_is_one_sentence(tmp_path, macbeth_tokenizer, monkeypatch, capsys):
    path = write_gguf(tmp_path / "m.gguf", random_model(tiny_config()), macbeth_tokenizer)
    path.write_bytes(path.read_bytes()[:5000])
    code, _, err = run_main(monkeypatch, capsys, f"gguf={path}", f"out={tmp_path / 'x'}")
    assert code == 2 and err.startswith(f"error: {path} is not a readable GGUF file") and err.count("\n") == 1
    assert not (tmp_path / "x").exists()
