"""GGUF export: the file read back with gguf's reader (fast), and llama.cpp itself running it (slow).

The slow tests need the optional extra (requirements-gguf.txt: llama-cpp-python builds llama.cpp from
source), which `make test-slow` installs; they fail, not skip, when it is missing.
"""

import itertools
import math
import sys
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from tokenizers import normalizers

from rope_llama.bench.peers import llama_cpp_model
from rope_llama.cli.export_gguf import export, main
from rope_llama.core.checkpoint import load_checkpoint
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.generation import GREEDY, generate
from rope_llama.interchange.gguf import ARCH
from rope_llama.interchange.hf import from_hf_state_dict, interleaved_to_half, to_hf_state_dict
from rope_llama.model.config import ModelConfig
from rope_llama.model.rope import RopeConfig, RotaryEmbedding, ntk_base
from tests.helpers import L0, ROPES, write_checkpoint

EXPORTABLE = {
    **{name: rope for name, rope in ROPES.items() if name != "dynamic_ntk"},
    "yarn_attention_factor": replace(ROPES["yarn"], attention_factor=1.3),
    "llama3_attention_factor": replace(ROPES["llama3"], attention_factor=0.8),
}
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up")


def read(path) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """(metadata {key: value}, tensors {name: array in PyTorch's row-major shape}, {name: GGML type})."""
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    return fields, tensors, {t.name: t.tensor_type.name for t in reader.tensors}


def attention_scores(x: torch.Tensor, wq, wk, cfg: ModelConfig, layout: str) -> torch.Tensor:
    """Layer-0 pre-softmax scores q.k of every head, rotating q and k with `layout`."""
    rope = RotaryEmbedding(cfg.head_dim, replace(cfg.rope, layout=layout))
    q = (x @ wq.T).unflatten(-1, (cfg.n_heads, cfg.head_dim)).transpose(0, 1)
    k = (x @ wk.T).unflatten(-1, (cfg.n_kv_heads, cfg.head_dim)).transpose(0, 1)
    k = k.repeat_interleave(cfg.n_heads // cfg.n_kv_heads, dim=0)
    return rope(q) @ rope(k).transpose(-1, -2)


@pytest.mark.parametrize("name", list(EXPORTABLE))
def test_file_reads_back_with_the_weights_rope_and_vocab(name, tmp_path, macbeth_tokenizer):
    rope = EXPORTABLE[name]
    tie = name != "yarn"
    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, rope, tie=tie)
    fields, tensors, types = read(export(ckpt, tmp_path / "model.gguf"))
    ours = load_checkpoint(ckpt)
    cfg, state = ours.config, ours.model.state_dict()

    assert fields["general.architecture"] == "llama" and fields["general.file_type"] == 0
    shape = {"vocab_size": 320, "embedding_length": 64, "feed_forward_length": 96, "block_count": 2}
    shape |= {"attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16}
    assert {key: fields[f"llama.{key}"] for key in shape} == shape
    assert math.isclose(fields["llama.attention.layer_norm_rms_epsilon"], 1e-5, rel_tol=1e-6)
    extended = rope.scaling in ("yarn", "llama3")  # the context is stated as the extended one, as in HF
    assert fields["llama.context_length"] == (L0 * rope.factor if extended else L0)
    base = ntk_base(rope.base, rope.factor, 16) if rope.scaling == "ntk" else rope.base
    assert math.isclose(fields["llama.rope.freq_base"], base, rel_tol=1e-6)
    scaling = {"linear": "linear", "yarn": "yarn"}.get(rope.scaling, "none")
    assert fields["llama.rope.scaling.type"] == scaling  # llama3 is carried by the rope_freqs tensor
    if scaling != "none":
        assert fields["llama.rope.scaling.factor"] == rope.factor
    if scaling == "yarn":
        assert fields["llama.rope.scaling.original_context_length"] == L0
    if rope.attention_factor is not None:  # llama.cpp applies 0.1 ln(factor) + 1 itself under yarn
        own = 0.1 * math.log(rope.factor) + 1 if scaling == "yarn" else 1.0
        assert math.isclose(
            fields["llama.rope.scaling.attn_factor"] * own, rope.attention_factor, rel_tol=1e-6
        )
    else:
        assert "llama.rope.scaling.attn_factor" not in fields

    expected = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not tie else set())
    expected |= {"rope_freqs.weight"} if rope.scaling == "llama3" else set()
    expected |= {f"blk.{i}.{t}.weight" for i in range(2) for t in (*LAYER_TENSORS, "ffn_down")}
    assert set(tensors) == expected and set(types.values()) == {"F32"}
    if rope.scaling == "llama3":  # per frequency: 1 (short wavelengths) .. factor (long ones)
        factors = tensors["rope_freqs.weight"]
        wavelengths = 2 * math.pi * base ** (np.arange(0, 16, 2) / 16)
        assert np.allclose(factors[wavelengths < L0 / rope.high_freq_factor], 1.0)
        assert np.allclose(factors[wavelengths > L0 / rope.low_freq_factor], rope.factor)
        assert factors.min() == pytest.approx(1.0) and factors.max() == pytest.approx(rope.factor)

    # q/k rows: llama.cpp rotates adjacent pairs, so a half-layout model's rows are permuted per head
    q_ours = state["blocks.0.attn.qkv.weight"][:64]
    q_gguf = torch.from_numpy(tensors["blk.0.attn_q.weight"])
    assert torch.equal(q_gguf, q_ours) == (rope.layout == "interleaved")
    # ... which leaves every attention score unchanged
    wk_ours = state["blocks.0.attn.qkv.weight"][64:96]
    x = torch.randn(3 * L0, 64)
    torch.testing.assert_close(
        attention_scores(x, q_gguf, torch.from_numpy(tensors["blk.0.attn_k.weight"]), cfg, "interleaved"),
        attention_scores(x, q_ours, wk_ours, cfg, rope.layout),
        atol=1e-4,
        rtol=1e-5,
    )
    # and undoing the permutation and the name mapping gives back our weights bit for bit
    names = gguf.get_tensor_name_map(ARCH, cfg.n_layers)
    hf = {}
    for hf_name in to_hf_state_dict(state, cfg):
        tensor = torch.from_numpy(tensors[names.get_name(hf_name, try_suffixes=(".weight",))])
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = interleaved_to_half(tensor, 4 if "q_proj" in hf_name else 2, 16)
        hf[hf_name] = tensor
    back = from_hf_state_dict(hf, cfg)
    assert all(torch.equal(back[key], tensor) for key, tensor in state.items())


def test_vocabulary_is_the_tokenizers_padded_to_the_model(tmp_path, macbeth_tokenizer):
    fields, _, _ = read(
        export(write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"]), tmp_path / "m.gguf")
    )
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    by_id = {i: token for token, i in macbeth_tokenizer.hf.get_vocab(with_added_tokens=True).items()}
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 320
    assert tokens[:300] == [by_id[i] for i in range(300)]
    assert tokens[300:] == [f"[PAD{i}]" for i in range(300, 320)]
    control, normal, unused = (
        int(gguf.TokenType.CONTROL),
        int(gguf.TokenType.NORMAL),
        int(gguf.TokenType.UNUSED),
    )
    assert types == [control, control] + [normal] * 298 + [unused] * 20  # <|bos|>, <|eos|> are ids 0, 1
    merges = (
        macbeth_tokenizer.hf.get_vocab_size() - 258
    )  # each merge made one token beyond the 256 bytes + 2 specials
    assert len(fields["tokenizer.ggml.merges"]) == merges and fields["tokenizer.ggml.merges"][0] == "Ġ t"
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"]) == (0, 1)
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False


def test_f16_halves_the_matrices_and_keeps_norms_f32(tmp_path, macbeth_tokenizer):
    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["llama3"])
    fields, tensors, types = read(export(ckpt, tmp_path / "m.gguf", dtype="f16"))
    _, f32, _ = read(export(ckpt, tmp_path / "m32.gguf"))
    assert fields["general.file_type"] == 1
    assert {n for n, t in types.items() if t == "F32"} == {n for n, a in tensors.items() if a.ndim == 1}
    assert {t for n, t in types.items() if tensors[n].ndim == 2} == {"F16"}
    for name, array in tensors.items():
        np.testing.assert_allclose(array.astype(np.float32), f32[name], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize(
    "rope, message",
    [
        (ROPES["dynamic_ntk"], "rope scaling 'dynamic_ntk' has no GGUF form"),
        (RopeConfig(rotary_dim=8, original_max_len=L0), "rotates the whole head; rotary_dim=8 < head_dim=16"),
        (
            replace(ROPES["yarn"], beta_fast=16.0),
            "yarn with beta_fast=16.0, beta_slow=1.0 cannot be exported",
        ),
    ],
)
def test_refuses_what_llama_cpp_cannot_express_and_writes_nothing(rope, message, tmp_path, macbeth_tokenizer):
    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, rope)
    with pytest.raises(ValueError, match=message):
        export(ckpt, tmp_path / "new" / "m.gguf")  # not even the missing folder is made
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_refuses_to_overwrite_the_checkpoint_it_reads(tmp_path, macbeth_tokenizer):
    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"])
    before = ckpt.read_bytes()
    with pytest.raises(
        ValueError, match="would replace .*, the checkpoint being exported; choose another path"
    ):
        export(ckpt, ckpt, overwrite=True)
    assert ckpt.read_bytes() == before


def test_refuses_a_tokenizer_that_is_not_byte_level(tmp_path, macbeth_tokenizer):
    normalized = Tokenizer(macbeth_tokenizer.path)  # a copy: the module's fixture stays as it is
    normalized.hf.normalizer = normalizers.NFKC()
    changed = tmp_path / "tokenizer.json"
    normalized.hf.save(str(changed))
    ckpt = write_checkpoint(tmp_path / "run", Tokenizer(str(changed)), ROPES["none"])
    with pytest.raises(
        ValueError,
        match=r"is not a byte-level BPE with the GPT-2 pre-tokenizer \(or SmolLM.s: digits split off first\) and no normalizer",
    ):
        export(ckpt, tmp_path / "m.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "tokenizer.json"]


def test_cli_refuses_bad_dtype_and_existing_out_in_one_sentence(
    tmp_path, macbeth_tokenizer, monkeypatch, capsys
):
    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"])
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep")
    for args, message in [
        (
            [f"out={tmp_path / 'new.gguf'}", "dtype=bf16"],
            "error: dtype must be one of f32, f16, got 'bf16'.",
        ),
        ([f"out={out}"], f"error: out={out} exists; pass overwrite=true to replace it."),
        ([f"out={tmp_path}"], f"error: out={tmp_path} is a directory; give a file path"),
    ]:
        monkeypatch.setattr(
            sys, "argv", ["export_gguf.py", f"ckpt={ckpt}", *args]
        )  # in-process: no 15 s start
        with pytest.raises(SystemExit) as exit_info:
            main()
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert out.read_bytes() == b"keep" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "run"]
    monkeypatch.setattr(sys, "argv", ["export_gguf.py", f"ckpt={ckpt}", f"out={out}", "overwrite=true"])
    main()
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "run"]  # no temp file left behind


# ----------------------------------------------------------------------------- llama.cpp itself (slow)

LOGIT_ATOL = {"f32": 3e-4, "f16": 0.15}  # logits of about 10; f16: llama.cpp also rounds activations to f16


@pytest.fixture(scope="module")
def llama_cpp():
    import llama_cpp  # the optional extra, requirements-gguf.txt: `make test-slow` installs it

    return llama_cpp


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", [(name, "f32") for name in EXPORTABLE] + [("llama3", "f16")])
def test_llama_cpp_matches_our_logits_and_greedy_tokens(
    name, dtype, tmp_path, macbeth_tokenizer, macbeth, llama_cpp
):
    ckpt = write_checkpoint(tmp_path / "run", macbeth_tokenizer, EXPORTABLE[name], tie=name != "yarn")
    llm = llama_cpp_model(export(ckpt, tmp_path / "model.gguf", dtype=dtype), 256, logits_all=True)
    ours = load_checkpoint(ckpt).model
    prompt = [macbeth_tokenizer.bos_id, *macbeth_tokenizer.encode(macbeth[5000:9000])][
        : 3 * L0
    ]  # past L0: scalings act
    try:
        llm.eval(prompt)
        theirs = torch.from_numpy(np.array(llm.scores[: len(prompt)]))
        with torch.no_grad():
            torch.testing.assert_close(
                theirs, ours(torch.tensor([prompt]))[0], atol=LOGIT_ATOL[dtype], rtol=0
            )
        if dtype == "f32":  # f16 rounding can flip a near tie, so only the fp32 file must decode identically
            new = 24
            mine = generate(ours, [prompt], new, GREEDY, eos_id=None).tokens[0]  # generate.py greedy=true
            llm.reset()
            greedy = list(itertools.islice(llm.generate(prompt, temp=0.0), new))  # llama.cpp's greedy sampler
            assert greedy == mine and len(set(mine)) > 3
    finally:
        llm.close()


@pytest.mark.slow
def test_llama_cpp_tokenizes_and_detokenizes_like_ours(tmp_path, macbeth_tokenizer, macbeth, llama_cpp):
    path = export(
        write_checkpoint(tmp_path / "run", macbeth_tokenizer, ROPES["none"]), tmp_path / "model.gguf"
    )
    llm = llama_cpp_model(path, 256, logits_all=True)
    passage = macbeth[60000:62000] + " naïve café — ünïcode 1234 x  \n\n\tend  "  # held out, odd spacing
    try:
        ids = macbeth_tokenizer.encode(passage)
        assert llm.tokenize(passage.encode(), add_bos=True) == [
            macbeth_tokenizer.bos_id,
            *ids,
        ]  # bos, as generate.py
        assert llm.tokenize(passage.encode(), add_bos=False) == ids
        assert llm.detokenize(ids).decode() == passage
    finally:
        llm.close()
