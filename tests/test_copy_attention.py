"""tools/copy_attention.py: the positions it compares, the attention it records, its table."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rope_llama.inference.retrieval import NEEDLE, QUESTION, build_prompt
from tests.helpers import save_run, tiny
from tools.copy_attention import (
    CopyAttentionConfig,
    answer_positions,
    asking,
    last_query_attention,
    main,
    measure,
    report,
    without_needle,
)


def test_answer_positions_split_the_needle_from_the_filler(macbeth_tokenizer):
    tok = macbeth_tokenizer
    prompt = build_prompt("passkey", tok, 256, 0.5, np.random.default_rng(0))
    needle, others = answer_positions(prompt.tokens, prompt.needle_start)
    key = tok.encode(f" {prompt.answer}")
    assert prompt.tokens[needle : needle + len(key)] == key  # the key starts right after the needle's " is"
    is_id = prompt.tokens[-1]
    assert all(prompt.tokens[p - 1] == is_id for p in others) and needle not in others
    assert len(others) == prompt.tokens[:-2].count(is_id) - 1  # every earlier " is" but the needle's
    assert asking(prompt, tok, "".join(QUESTION)) == prompt
    other = asking(prompt, tok, " What is the black ring? The black ring is")
    n_question = len(tok.encode("".join(QUESTION)))
    assert other.tokens[:-n_question] == prompt.tokens[:-n_question] != other.tokens
    assert (
        tok.decode(other.tokens).endswith("? The black ring is") and other.needle_start == prompt.needle_start
    )
    with pytest.raises(ValueError, match="question must be a non-empty text"):
        asking(prompt, tok, " ")
    cut = without_needle(prompt, tok)
    assert tok.decode(cut).count(str(prompt.answer)) == 0 and tok.decode(cut).endswith("".join(QUESTION))
    assert len(prompt.tokens) - len(cut) == len(tok.encode(NEEDLE.format(key=prompt.answer)))
    with pytest.raises(ValueError, match="does not occur in its needle"):
        answer_positions([5, 6, 7, 5], needle_start=3)


def test_recorded_logits_are_the_attention_the_layer_computes():
    model = tiny(64, n_layers=2)
    idx = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    captured = {}

    def keep_qkv(module, args, out):  # the layer's own q, k (before RoPE) from its fused projection
        captured[module] = out

    handle = model.blocks[1].attn.qkv.register_forward_hook(keep_qkv)
    with torch.no_grad(), last_query_attention(model) as logits:
        out = model(idx)
    handle.remove()
    H, KV, D = model.config.n_heads, model.config.n_kv_heads, model.config.head_dim
    q, k, _ = captured[model.blocks[1].attn.qkv].split([H * D, KV * D, KV * D], dim=-1)
    cos, sin = model.rope.cos_sin(torch.arange(20), torch.float32)
    q = model.rope.rotate(q.view(1, 20, H, D).transpose(1, 2), cos, sin)
    k = model.rope.rotate(k.view(1, 20, KV, D).transpose(1, 2), cos, sin).repeat_interleave(H // KV, dim=1)
    expected = torch.einsum("bhd,bhsd->bhs", q[:, :, -1], k) / D**0.5
    torch.testing.assert_close(logits[1], expected, rtol=1e-4, atol=1e-4)
    assert set(logits) == {0, 1} and logits[0].shape == (1, H, 20)
    assert "attend" not in vars(model.blocks[0].attn)  # the method is restored on leaving
    torch.testing.assert_close(model(idx), out)
    assert F.softmax(logits[1], -1).sum(-1).allclose(torch.ones(1, H))


def test_measure_and_report_on_a_checkpoint(tmp_path, macbeth_tokenizer, capsys):
    tok = macbeth_tokenizer
    run = save_run(tiny(tok.vocab_size), tok, tmp_path / "run")
    results = measure(CopyAttentionConfig(ckpt=str(run), length=256, depths=[0.0, 1.0], trials=2, heads=3))
    for depth in (0.0, 1.0):
        r = results[depth]
        assert 0 <= r["p_answer"] <= 1 and 0 <= r["p_answer_no_needle"] <= 1 and r["top"] in (0.0, 0.5, 1.0)
        assert r["needle"].shape == (2, 4) and ((r["needle"] + r["others"]) <= 1 + 1e-5).all()
    table = report(results, heads=3)
    assert table.count("\n  ") == 3 and "P(key's first token)" in table and "without the needle" in table
    with pytest.raises(ValueError, match="trials must be a positive integer, got 0"):
        measure(CopyAttentionConfig(ckpt=str(run), trials=0))
    with pytest.raises(SystemExit):
        main([])
    assert "missing mandatory value: ckpt" in capsys.readouterr().err
