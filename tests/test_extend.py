"""Self-Extend and log-n attention (model/extend.py): the math against hand-computed values and an
independent loop, the model paths against each other, and every refusal."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from rope_llama.inference.evaluation import method_positions, split_method
from rope_llama.inference.generation import (
    GREEDY,
    GenerationError,
    compiled_fixed_shape_step,
    generate,
    score_tokens,
)
from rope_llama.interchange.hf import ExportError
from rope_llama.kernels import attention as kernel_attention
from rope_llama.kernels import use_kernels
from rope_llama.kernels.self_extend import self_extend_attention
from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import (
    ExtendConfig,
    grouped_key_positions,
    grouped_query_positions,
    logn_scale,
    matched_group,
    merged_attention,
    neighbour_mask,
    self_extend_reach,
)
from rope_llama.model.kv_cache import KVCache
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig
from tests.helpers import L0, ROPES, TEXT, run_generate_main, save_run, text_tokenizer, tiny


def rotate_pair(x: torch.Tensor, position: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE of one vector (D,) at one position, written out pair by pair (half layout: channel i
    pairs with i + D/2), independently of model/rope.py."""
    d = x.numel()
    out = x.clone()
    for i in range(d // 2):
        angle = position * base ** (-2 * i / d)
        a, b = x[i].item(), x[i + d // 2].item()
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + d // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


# ----------------------------------------------------------------------------- the math


def seen_distances(seq_len: int, window: int, group: int) -> torch.Tensor:
    """(L, L): the distance each query sees to each key under Self-Extend (upper triangle unused)."""
    pos = torch.arange(seq_len)
    grouped = (
        grouped_query_positions(pos, window, group)[:, None] - grouped_key_positions(pos, group)[None, :]
    )
    return torch.where(neighbour_mask(pos, pos, window), pos[:, None] - pos[None, :], grouped)


def test_grouped_distances_match_the_hand_computed_table():
    """L=8, W=3, G=2: grouped query position q // 2 + 2, key k // 2; below the window the true distance.
    Row q lists the distance the query sees to keys 0..q, worked out by hand."""
    expected = [
        [0],
        [1, 0],
        [2, 1, 0],
        [3, 2, 1, 0],
        [4, 4, 2, 1, 0],
        [4, 4, 3, 2, 1, 0],
        [5, 5, 4, 4, 2, 1, 0],
        [5, 5, 4, 4, 3, 2, 1, 0],
    ]
    seen = seen_distances(8, window=3, group=2)
    assert [seen[q, : q + 1].tolist() for q in range(8)] == expected


@pytest.mark.parametrize(
    "seq_len, window, group", [(8, 3, 2), (100, 16, 4), (300, 64, 6), (50, 64, 8), (97, 5, 1)]
)
def test_reach_is_the_largest_distance_the_merge_shows(seq_len, window, group):
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    largest = seen_distances(seq_len, window, group)[causal].max().item()
    assert self_extend_reach(seq_len, window, group) == largest


def test_matched_group_is_the_least_group_within_three_quarters_of_the_training_length():
    # hand-computed at W = 64, L0 = 256 (reach at most 191): G = 7 reaches 1023 // 7 + 64 - 9 = 201, G = 8 183
    assert matched_group(1024, 64, 256) == 8 and matched_group(4096, 64, 256) == 32
    assert matched_group(256, 64, 256) == 1  # inside the training length: plain attention
    for seq_len in (257, 512, 1000, 4096, 20000):
        group = matched_group(seq_len, 64, 256)
        assert self_extend_reach(seq_len, 64, group) <= 191
        assert group == 2 or self_extend_reach(seq_len, 64, group - 1) > 191
    with pytest.raises(ValueError, match=r"extend window \(192\) must be at most 191 \(75% of the training"):
        matched_group(1024, 192, 256)


def test_neighbour_mask_is_the_papers_triangle_difference():
    """The reference builds the neighbour region as the causal triangle minus the triangle shifted by
    W (rows W.., columns ..-W); re-derived here, it must equal our rule on every causal pair."""
    L, W = 11, 4
    reference = torch.tril(torch.ones(L, L))
    reference[W:, :-W] -= torch.tril(torch.ones(L - W, L - W))
    pos = torch.arange(L)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    assert torch.equal(neighbour_mask(pos, pos, W) & causal, reference.bool())


def test_merged_attention_equals_an_explicit_loop_over_pairs():
    """1 head, D=4, L=8, W=3, G=2: every score from `rotate_pair` at the positions the paper assigns."""
    L, D, W, G = 8, 4, 3, 2
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, D, generator=gen, dtype=torch.float64) for _ in range(3))
    expected = torch.empty(L, D, dtype=torch.float64)
    for i in range(L):
        scores = []
        for j in range(i + 1):
            pq, pk = (i, j) if i - j < W else (i // G + W - W // G, j // G)
            scores.append(rotate_pair(q[i], pq) @ rotate_pair(k[j], pk) / math.sqrt(D))
        probs = torch.stack(scores).softmax(0)
        expected[i] = (probs[:, None] * v[: i + 1]).sum(0)

    pos = torch.arange(L)
    gq, gk = grouped_query_positions(pos, W, G), grouped_key_positions(pos, G)

    def rot(x, positions):
        return torch.stack([rotate_pair(x[n], int(p)) for n, p in enumerate(positions)])

    out = merged_attention(
        rot(q, pos)[None, None],
        rot(k, pos)[None, None],
        rot(q, gq)[None, None],
        rot(k, gk)[None, None],
        v[None, None],
        neighbour_mask(pos, pos, W)[None, None],
        mask=None,
    )
    torch.testing.assert_close(out[0, 0], expected, rtol=0, atol=1e-12)


def test_logn_scale_equals_the_closed_form():
    positions = torch.tensor([0, 1, 255, 256, 511, 4095, 2**40])
    expected = [1.0, 1.0, 1.0, math.log(257) / math.log(256), 9 / 8, 1.5, math.log(2**40 + 1) / math.log(256)]
    torch.testing.assert_close(logn_scale(positions, 256), torch.tensor(expected), rtol=1e-7, atol=0)
    assert logn_scale(torch.arange(256), 256).eq(1.0).all()  # exactly 1 inside the training length


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "longlm"}, "Unknown extend method 'longlm'; valid methods are none, self_extend, logn."),
        ({"window": 0}, "extend window must be an integer >= 1 (a number of positions), got 0."),
        ({"group": True}, "extend group must be an integer >= 1 (a group size), got True."),
        ({"group": 2.5}, "extend group must be an integer >= 1 (a group size), got 2.5."),
        (
            {"original_max_len": 1},
            "extend original_max_len must be an integer >= 2 (a training length (log-n divides by its log)), got 1.",
        ),
    ],
)
def test_config_errors_are_one_sentence(kwargs, message):
    with pytest.raises(ValueError) as e:
        ExtendConfig(**kwargs)
    assert str(e.value) == message


# ----------------------------------------------------------------------------- the model

L = 80  # tokens of the model tests: past the window, the group's reach and L0
EXTENDS = {
    "self_extend": ExtendConfig(method="self_extend", window=6, group=4),
    "logn": ExtendConfig(method="logn", original_max_len=L0),
}


def extended(rope: RopeConfig, extend: ExtendConfig, n_kv_heads: int = 2, vocab_size: int = 97) -> Llama:
    """A tiny model whose random weights are sharp enough that an extension changes its logits visibly."""
    return tiny(vocab_size, rope, extend=extend, n_kv_heads=n_kv_heads, init_std=0.1)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(autouse=True, scope="module")
def own_compiled_graphs():
    """The compiled decode step is shared by the whole process, and Dynamo compiles one code object at
    most recompile_limit times: the graphs of this module (every layout x extension) must not add up
    with other modules' shapes."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("rope", list(ROPES))
def test_self_extend_without_grouped_scores_is_plain_attention_exactly(rope):
    """Every distance below the window, or a group of 1 (grouped positions are the true ones): Self-Extend
    is plain attention, bit for bit, in the full forward and through the cache; log-n inside the training
    length too."""
    plain = extended(ROPES[rope], ExtendConfig())
    idx = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        expected = plain(idx)
        cached = score_tokens(plain, idx, chunk=9)
        for extend in (
            ExtendConfig(method="self_extend", window=40, group=4),
            ExtendConfig(method="self_extend", window=8, group=1),
            ExtendConfig(method="logn", original_max_len=40),
        ):
            plain.use_positions(extend=extend)
            assert torch.equal(plain(idx), expected)
            assert torch.equal(score_tokens(plain, idx, chunk=9), cached)


def test_extensions_change_the_logits_beyond_the_window():
    """The guard for every exactness test below: past the window (or L0) the logits do differ."""
    idx = torch.randint(0, 97, (1, L))
    with torch.no_grad():
        plain = extended(ROPES["none"], ExtendConfig())(idx)
        for extend in EXTENDS.values():
            assert (extended(ROPES["none"], extend)(idx) - plain).abs().max() > 1e-2


@pytest.mark.parametrize("extend", list(EXTENDS))
@pytest.mark.parametrize("rope", list(ROPES))
def test_cache_paths_equal_the_full_forward(rope, extend):
    """Chunked prefill, then one token at a time through the eager forward and through the compiled
    fixed-shape step, at positions 100.. in a left-padded cache, equal the full forward (atol 1e-5)
    for every RoPE scaling x extension."""
    model = extended(ROPES[rope], EXTENDS[extend])
    idx = torch.randint(0, 97, (1, L))
    positions = torch.arange(100, 100 + L)
    seq_len = 100 + L
    pad, prefill = 3, L - 10
    with torch.no_grad():
        full = model(idx, position_ids=positions)
        # chunked prefill of the whole sequence, uneven chunks
        cache = KVCache.for_model(model, 1, L, seq_len=seq_len)
        chunks = [
            model(idx[:, s : s + 13], position_ids=positions[s : s + 13], kv_cache=cache)
            for s in range(0, L, 13)
        ]
        torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=0)
        # left padded prefill, then eager one-token steps, then fixed-shape steps
        cache = KVCache.for_model(model, 1, pad + L + 2, seq_len=seq_len)  # 2 slots never written
        cache.key_mask = torch.arange(cache.capacity)[None] >= pad
        ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), idx[:, :prefill]], 1)
        slot_positions = torch.cat([positions[:1].repeat(pad), positions])
        out = [model(ids, position_ids=slot_positions[: pad + prefill], kv_cache=cache)[:, pad:]]
        for t in range(prefill, L):
            if t < L - 5:
                out.append(model(idx[:, t : t + 1], position_ids=positions[t : t + 1], kv_cache=cache))
            else:
                slot = cache.next_slot()
                at = model.position_encoding(
                    positions[t, None, None], torch.float32, seq_len, cache.at_slot(slot)
                )
                out.append(compiled_fixed_shape_step()(model, idx[:, t : t + 1], at, cache, slot)[:, None])
                cache.advance(1)
    torch.testing.assert_close(torch.cat(out, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("extend", list(EXTENDS))
def test_compiled_decode_equals_eager(extend):
    """generate(compile=True) with an extension: a left-padded batch at start position 50 picks the
    eager loop's greedy tokens, and the eager loop equals recomputing each row alone without a cache."""
    model = extended(ROPES["yarn"], EXTENDS[extend])
    prompts = [torch.randint(1, 97, (n,)).tolist() for n in (12, 30)]
    eager = generate(model, prompts, 24, GREEDY, start_pos=50).tokens
    assert generate(model, prompts, 24, GREEDY, start_pos=50, compile=True).tokens == eager
    for prompt, tokens in zip(prompts, eager):
        seq = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(24):
                logits = model(seq, position_ids=torch.arange(50, 50 + seq.shape[1]))[:, -1]
                seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        assert seq[0, len(prompt) :].tolist() == tokens


def test_training_backpropagates_through_the_merge_with_and_without_kernels():
    """Self-Extend in a training config: the merged attention is differentiable, and the kernels'
    RoPE rotates the grouped positions as the plain one does (same loss and gradients)."""
    idx, targets = torch.randint(0, 97, (2, L)), torch.randint(0, 97, (2, L))
    results = []
    for kernels in (False, True):
        model = use_kernels(extended(ROPES["yarn"], EXTENDS["self_extend"]).train(), kernels)
        loss = model(idx, targets=targets)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (plain, plain_grads), (kernel, kernel_grads) = results
    torch.testing.assert_close(kernel, plain, atol=1e-6, rtol=0)
    for a, b in zip(plain_grads, kernel_grads):
        assert a.isfinite().all()
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_logn_scales_the_queries_by_the_closed_form():
    """log-n attention equals plain attention over queries multiplied by max(1, log(p + 1) / log(L0))."""
    model = extended(ROPES["none"], EXTENDS["logn"])
    attn, x = model.blocks[0].attn, torch.randn(1, L, 64)
    positions = model.position_encoding(torch.arange(L), torch.float32, L, None)
    scale = torch.tensor([max(1.0, math.log(p + 1) / math.log(L0)) for p in range(L)])
    with torch.no_grad():
        q, k, v = attn.qkv(x).split([64, 32, 32], dim=-1)
        q = model.rope(q.view(1, L, 4, 16).transpose(1, 2)) * scale[:, None]
        k = model.rope(k.view(1, L, 2, 16).transpose(1, 2))
        v = v.view(1, L, 2, 16).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        expected = attn.o_proj(y.transpose(1, 2).reshape(1, L, 64))
        torch.testing.assert_close(attn(x, model.rope, positions, None, None), expected, atol=1e-6, rtol=0)


def test_self_extend_cache_keeps_both_rotations_and_counts_them():
    model = extended(ROPES["none"], EXTENDS["self_extend"])
    cache = KVCache.for_model(model, 2, 50)
    plain = KVCache.for_model(extended(ROPES["none"], ExtendConfig()), 2, 50)
    assert plain.k_grouped is None and plain.slot_positions is None
    assert cache.nbytes == KVCache.bytes_for_model(model.config, 2, 50, torch.float32) - 8 * 50
    assert cache.nbytes == plain.nbytes * 3 // 2 + cache.slot_positions.nbytes
    with pytest.raises(
        ValueError, match="This KV cache holds no Self-Extend keys; build it with KVCache.for_model"
    ):
        model(torch.zeros(2, 3, dtype=torch.long), kv_cache=plain)


def test_old_configs_load_without_an_extension():
    logn = ExtendConfig(method="logn", original_max_len=L0)
    cfg = ModelConfig(rope=RopeConfig(original_max_len=L0), extend=logn).to_dict()
    assert ModelConfig.from_dict(cfg).extend == logn
    del cfg["extend"]  # a checkpoint written before extensions existed
    assert ModelConfig.from_dict(cfg).extend.method == "none"


def test_native_decode_refuses_an_extension():
    model = extended(ROPES["none"], EXTENDS["self_extend"], n_kv_heads=4)
    with pytest.raises(GenerationError) as e:
        generate(model, [[1, 2, 3]], 4, GREEDY, native=True)
    assert str(e.value) == "native decoding does not implement extend=self_extend; use compile=true."


@pytest.mark.parametrize("target", ["hf", "gguf"])
def test_export_refuses_an_extension(target, tmp_path):
    """transformers' Llama and GGUF cannot express an extension: both exports refuse it, write nothing."""
    from rope_llama.cli.export_gguf import export as export_gguf
    from rope_llama.cli.export_hf import export as export_hf

    tok = text_tokenizer(tmp_path)
    ckpt = (
        save_run(extended(ROPES["none"], EXTENDS["logn"], vocab_size=tok.vocab_size), tok, tmp_path / "run")
        / "checkpoints"
        / "last.ckpt"
    )
    export, out, where = {
        "hf": (export_hf, tmp_path / "hf", "transformers' Llama"),
        "gguf": (export_gguf, tmp_path / "m.gguf", "a GGUF file"),
    }[target]
    with pytest.raises(ExportError) as e:
        export(ckpt, out)
    assert str(e.value) == (
        f"extend=logn cannot be exported: {where} cannot express Self-Extend or log-n attention, "
        "so the exported model would compute something else."
    )
    assert not out.exists()


# ----------------------------------------------------------------------------- methods and command lines


def test_methods_compose_a_scaling_with_an_extension():
    assert split_method("yarn") == ("yarn", None)
    assert split_method("self_extend") == ("none", "self_extend")
    assert split_method("llama3+logn") == ("llama3", "logn")
    assert split_method("ckpt+self_extend") == ("ckpt", "self_extend")
    for bad in ("logn+yarn", "yarn+yarn", "self_extend+logn", "yarn+", "longlm"):
        with pytest.raises(ValueError, match=f"Unknown method '{re.escape(bad)}'; a method is a RoPE method"):
            split_method(bad)
    own = ExtendConfig(method="logn", window=16, group=4, original_max_len=64)
    config = ModelConfig(rope=RopeConfig(original_max_len=64), extend=own, lengths=256)
    extend_of = lambda method, options=None: method_positions(config, method, 4.0, None, options)[1]
    assert extend_of("ckpt") == own  # the checkpoint's own, unchanged
    assert extend_of("yarn") == ExtendConfig(method="none", window=16, group=4, original_max_len=256)
    assert extend_of("yarn+self_extend", {"group": 8}) == ExtendConfig(
        method="self_extend", window=16, group=8, original_max_len=256
    )
    with pytest.raises(ValueError, match="extend group must be an integer >= 1"):
        extend_of("self_extend", {"group": 0})


def test_generate_cli_scores_with_an_extension_override(tmp_path, monkeypatch, capsys):
    """generate.py extend=self_extend extend.window=... scores what the model scores with that extension."""
    tok = text_tokenizer(tmp_path)
    model = extended(ROPES["none"], ExtendConfig(), vocab_size=tok.vocab_size)
    run = save_run(model, tok, tmp_path / "run")
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT * 3)
    args = [f"ckpt={run}", "mode=score", f"text_file={text_file}", "chunk=16"]
    code, out, _ = run_generate_main(
        args + ["extend=self_extend", "extend.window=8", "extend.group=4"], monkeypatch, capsys
    )
    model.use_positions(extend=ExtendConfig(method="self_extend", window=8, group=4, original_max_len=L0))
    losses = score_tokens(model, torch.tensor([tok.bos_id, *tok.encode(TEXT * 3)]), chunk=16)
    overall = next(line for line in out.splitlines() if line.strip().startswith("overall"))
    assert code == 0 and overall.split()[1:3] == [str(losses.numel()), f"{float(losses.double().mean()):.4f}"]
    code, _, err = run_generate_main(args + ["extend=self_extend", "extend.group=0"], monkeypatch, capsys)
    assert code == 2 and "extend group must be an integer >= 1 (a group size), got 0." in err


# ----------------------------------------------------------------------------- the blocked kernel


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("cached", [0, 3, 6, 7, 20])  # slots before the queries: none, < W, = W, > W
@pytest.mark.parametrize("queries", [1, 9, 31])
def test_blocked_self_extend_equals_the_merged_attention(cached, queries, dtype, atol):
    """kernels/self_extend.py's flash passes merged by log-sum-exp equal `merged_attention` over the
    band mask, for queries in the last L of S slots, blocks that do not divide L, and grouped heads."""
    window, S = 6, cached + queries
    torch.manual_seed(cached * 100 + queries)
    q, q_grouped = (torch.randn(2, 4, queries, 8, dtype=dtype) for _ in range(2))
    k, k_grouped, v = (torch.randn(2, 2, S, 8, dtype=dtype) for _ in range(3))
    slots = torch.arange(S)
    near = neighbour_mask(slots[cached:], slots, window)[None, None]
    mask = None if cached == 0 else (slots[None] <= slots[cached:, None])[None, None]
    expected = merged_attention(q, k, q_grouped, k_grouped, v, near, mask)
    got = self_extend_attention(q, k, q_grouped, k_grouped, v, window, block=4)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("rope", list(ROPES))  # every scaling, and the interleaved layout
def test_kernel_model_equals_the_plain_merge_in_every_path(rope, monkeypatch):
    """use_kernels: the full forward, a chunked prefill and decode steps after it equal the plain model
    (atol 1e-5), and the blocked kernel did run for the consecutive forwards, not for a padded one."""
    calls = []
    real = kernel_attention.self_extend_attention
    monkeypatch.setattr(kernel_attention, "self_extend_attention", lambda *a: calls.append(1) or real(*a))
    plain = extended(ROPES[rope], EXTENDS["self_extend"])
    fast = use_kernels(extended(ROPES[rope], EXTENDS["self_extend"]))
    idx = torch.randint(0, 97, (2, L))
    positions = torch.arange(100, 100 + L)
    with torch.no_grad():
        torch.testing.assert_close(
            fast(idx, position_ids=positions), plain(idx, position_ids=positions), atol=1e-5, rtol=0
        )
        assert calls, "the blocked kernel did not run"
        outputs = []
        for model in (plain, fast):
            cache = KVCache.for_model(model, 2, L, seq_len=100 + L)
            prefill = L - 4  # uneven chunks, then one token at a time
            out = [
                model(
                    idx[:, s : min(s + 17, prefill)],
                    position_ids=positions[s : min(s + 17, prefill)],
                    kv_cache=cache,
                )
                for s in range(0, prefill, 17)
            ]
            out += [
                model(idx[:, t : t + 1], position_ids=positions[t : t + 1], kv_cache=cache)
                for t in range(L - 4, L)
            ]
            outputs.append(torch.cat(out, 1))
        torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=0)
        calls.clear()
        cache = KVCache.for_model(fast, 1, L, seq_len=100 + L)
        cache.key_mask = torch.arange(L)[None] >= 2  # left padding: the positions are not one run
        fast(idx[:1], position_ids=positions, kv_cache=cache)
        assert not calls


def test_fused_token_losses_equal_the_plain_head():
    """Scoring through the kernels' head (chunked log-sum-exp, no logits tensor) equals the plain
    per-token cross-entropy (atol 1e-5, fp32), with and without the cache, and last_only gives the last
    row of the full logits."""
    plain = extended(ROPES["yarn"], ExtendConfig())
    fast = use_kernels(extended(ROPES["yarn"], ExtendConfig()))
    idx = torch.randint(0, 97, (3, 700))  # more rows than one chunk of the head
    with torch.no_grad():
        logits = plain(idx[:, :-1])
        expected = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten(), reduction="none").view(3, -1)
        for model in (plain, fast):
            torch.testing.assert_close(
                model(idx[:, :-1], targets=idx[:, 1:], reduction="none"), expected, atol=1e-5, rtol=0
            )
            torch.testing.assert_close(score_tokens(model, idx, chunk=256), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(fast(idx[:, :-1], last_only=True), logits[:, -1:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="reduction must be mean, or none without target_weights"):
        plain(idx[:, :-1], targets=idx[:, 1:], reduction="sum")
