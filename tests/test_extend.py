"""The remaps (Self-Extend, STRING, DCA, ReRoPE, leaky ReRoPE) and log-n attention (model/extend.py): the
math against hand-computed values and an independent loop, the model paths against each other, the
blocked kernel against the plain merge, and every refusal."""

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
from rope_llama.kernels import use_kernels
from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import (
    ExtendConfig,
    logn_scale,
    matched_group,
    merged_attention,
    regions,
    remap_parameters,
    remapped_distances,
    remapped_query_positions,
    self_extend_reach,
    self_extend_remap,
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
    return remapped_distances(self_extend_remap(window, group), pos, pos).long()


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


def test_neighbour_region_is_the_papers_triangle_difference():
    """The reference builds the neighbour region as the causal triangle minus the triangle shifted by
    W (rows W.., columns ..-W); re-derived here, it must equal our rule on every causal pair."""
    L, W = 11, 4
    reference = torch.tril(torch.ones(L, L))
    reference[W:, :-W] -= torch.tril(torch.ones(L - W, L - W))
    pos = torch.arange(L)
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    assert torch.equal((regions(self_extend_remap(W, 2), pos, pos) == 0) & causal, reference.bool())


def test_remapped_distances_match_the_hand_computed_tables():
    """L=10, row q lists the distance the query sees to keys 0..q, worked out by hand from each paper.
    STRING S=4, W=2: d >= 4 is seen as d - 2. DCA s=5, w=2 (chunks of c=3): the previous chunk's keys
    from min(q % 3 + 3, 5), older ones from min(2 * 3 - 1, 5) = 5, keys at k % 3. ReRoPE w=3: d >= 3
    is seen as 3; leaky k=2: as 3 + (d - 3) / 2."""
    pos = torch.arange(10)
    expected = {
        "string": [
            [0],
            [1, 0],
            [2, 1, 0],
            [3, 2, 1, 0],
            [2, 3, 2, 1, 0],
            [3, 2, 3, 2, 1, 0],
            [4, 3, 2, 3, 2, 1, 0],
            [5, 4, 3, 2, 3, 2, 1, 0],
            [6, 5, 4, 3, 2, 3, 2, 1, 0],
            [7, 6, 5, 4, 3, 2, 3, 2, 1, 0],
        ],
        "dca": [
            [0],
            [1, 0],
            [2, 1, 0],
            [3, 2, 1, 0],
            [4, 3, 2, 1, 0],
            [5, 4, 3, 2, 1, 0],
            [5, 4, 3, 3, 2, 1, 0],
            [5, 4, 3, 4, 3, 2, 1, 0],
            [5, 4, 3, 5, 4, 3, 2, 1, 0],
            [5, 4, 3, 5, 4, 3, 3, 2, 1, 0],
        ],
        "rerope": [[min(q - k, 3) for k in range(q + 1)] for q in range(10)],
        "leaky_rerope": [
            [q - k if q - k < 3 else 3 + (q - k - 3) / 2 for k in range(q + 1)] for q in range(10)
        ],
    }
    configs = {
        "string": ExtendConfig("string", shift=4, local_window=2),
        "dca": ExtendConfig("dca", chunk=5, local_window=2),
        "rerope": ExtendConfig("rerope", local_window=3),
        "leaky_rerope": ExtendConfig("leaky_rerope", local_window=3, leak=2.0),
    }
    for method, table in expected.items():
        seen = remapped_distances(configs[method].remap, pos, pos)
        assert [seen[q, : q + 1].tolist() for q in range(10)] == table, method


def paper_positions(method: str, i: int, j: int) -> tuple[float, float]:
    """Where each paper puts query i and key j <= i, written out independently of model/extend.py (DCA's
    intra-chunk pair at i % c, j % c, as its reference does). Parameters as in LOOP_CONFIGS."""
    d = i - j
    if method == "self_extend":  # W=3, G=2
        return (i, j) if d < 3 else (i // 2 + 3 - 3 // 2, j // 2)
    if method == "string":  # S=4, W=2
        return (i, j) if d < 4 else (i - 4 + 2, j)
    if method == "dca":  # s=5, w=2, c=3
        if i // 3 == j // 3:
            return i % 3, j % 3
        return (min(i % 3 + 3, 5) if i // 3 - j // 3 == 1 else min(2 * 3 - 1, 5)), j % 3
    if method == "rerope":  # w=3
        return (i, j) if d < 3 else (3, 0)
    return (i, j) if d < 3 else ((i + 3 * (2 - 1)) / 2, j / 2)  # leaky_rerope: w=3, k=2


LOOP_CONFIGS = {
    "self_extend": ExtendConfig("self_extend", window=3, group=2),
    "string": ExtendConfig("string", shift=4, local_window=2),
    "dca": ExtendConfig("dca", chunk=5, local_window=2),
    "rerope": ExtendConfig("rerope", local_window=3),
    "leaky_rerope": ExtendConfig("leaky_rerope", local_window=3, leak=2.0),
}


@pytest.mark.parametrize("method", list(LOOP_CONFIGS))
def test_merged_attention_equals_an_explicit_loop_over_pairs(method):
    """1 head, D=4, L=11: every score from `rotate_pair` at the positions the paper assigns."""
    L, D = 11, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, D, generator=gen, dtype=torch.float64) for _ in range(3))
    expected = torch.empty(L, D, dtype=torch.float64)
    for i in range(L):
        scores = []
        for j in range(i + 1):
            pq, pk = paper_positions(method, i, j)
            scores.append(rotate_pair(q[i], pq) @ rotate_pair(k[j], pk) / math.sqrt(D))
        probs = torch.stack(scores).softmax(0)
        expected[i] = (probs[:, None] * v[: i + 1]).sum(0)

    remap = LOOP_CONFIGS[method].remap
    pos = torch.arange(L)

    def rot(x, positions):
        return torch.stack([rotate_pair(x[n], float(p)) for n, p in enumerate(positions)])[None, None]

    far_keys = None if remap.key_map is None else rot(k, remap.key_map(pos))
    out = merged_attention(
        rot(q, pos),
        rot(k, pos),
        tuple(rot(q, p) for p in remapped_query_positions(remap, pos)),
        far_keys,
        v[None, None],
        regions(remap, pos, pos)[None, None],
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
        (
            {"method": "longlm"},
            "Unknown extend method 'longlm'; valid methods are none, self_extend, logn, string, dca, rerope, "
            "leaky_rerope.",
        ),
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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shift": 1}, "extend shift must be an integer >= 2 (None = L0 // 3), got 1."),
        (
            {"leak": 1.0},
            "extend leak must be a finite number > 1 (the slope past the window is 1 / leak), got 1.0.",
        ),
        (
            {"method": "string", "shift": 100, "original_max_len": 64},
            "extend shift must be above local_window (4) and at most the training length (64) for extend=string, "
            "got 100.",
        ),
        (
            {"method": "string", "shift": 8, "local_window": 8},
            "extend shift must be above local_window (8) for extend=string, got 8.",
        ),
        (
            {"method": "dca", "chunk": 16, "local_window": 16},
            "extend local_window must be an integer in [1, 15] (below the chunk, 16) for extend=dca, got 16.",
        ),
        (
            {"method": "dca", "chunk": 300, "original_max_len": 256},
            "extend chunk must be at most the training length (256) for extend=dca, got 300.",
        ),
        (
            {"method": "rerope", "local_window": 256, "original_max_len": 256},
            "extend local_window must be an integer >= 1 and below the training length (256) for extend=rerope, "
            "got 256.",
        ),
        (
            {"method": "leaky_rerope"},
            "extend=leaky_rerope derives local_window from original_max_len, which is unset; give "
            "extend.local_window or extend.original_max_len (the training length).",
        ),
    ],
)
def test_remap_parameters_that_cannot_work_are_one_sentence(kwargs, message):
    with pytest.raises(ValueError) as e:
        ExtendConfig(**kwargs)
    assert str(e.value) == message


def test_defaults_derive_from_the_training_length():
    """STRING S = L0 // 3, W = min(128, L0 // 16); DCA s = 3 L0 // 4, w = L0 // 8; ReRoPE w = L0 // 4,
    leaky k = 16 (module docstring: whose choice each is)."""
    for l0, string, dca, rerope in ((4096, (1365, 128), (3072, 512), 1024), (256, (85, 16), (192, 32), 64)):
        got = {
            m: remap_parameters(ExtendConfig(m, original_max_len=l0))
            for m in ("string", "dca", "rerope", "leaky_rerope")
        }
        assert got["string"] == {"shift": string[0], "window": string[1]}
        assert got["dca"] == {"chunk": dca[0], "window": dca[1]}
        assert got["rerope"] == {"window": rerope}
        assert got["leaky_rerope"] == {"window": rerope, "leak": 16.0}


# ----------------------------------------------------------------------------- the model

L = 80  # tokens of the model tests: past the window, the group's reach and L0
EXTENDS = {
    "self_extend": ExtendConfig(method="self_extend", window=6, group=4),
    "logn": ExtendConfig(method="logn", original_max_len=L0),
    "string": ExtendConfig(method="string", shift=12, local_window=4, original_max_len=L0),
    "dca": ExtendConfig(method="dca", chunk=16, local_window=4, original_max_len=L0),
    "rerope": ExtendConfig(method="rerope", local_window=8, original_max_len=L0),
    "leaky_rerope": ExtendConfig(method="leaky_rerope", local_window=8, leak=4.0, original_max_len=L0),
}
REMAPS = [m for m in EXTENDS if m != "logn"]


def extended(rope: RopeConfig, extend: ExtendConfig, n_kv_heads: int = 2, vocab_size: int = 97) -> Llama:
    """A tiny model whose random weights are sharp enough that an extension changes its logits visibly."""
    return tiny(vocab_size, rope, extend=extend, n_kv_heads=n_kv_heads, init_std=0.1)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(autouse=True)
def own_compiled_graphs():
    """The compiled decode step is shared by the whole process, and Dynamo compiles one code object at
    most recompile_limit times: the graphs of one test must not add up with other tests' (this module
    alone has every layout x extension, more than the limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("rope", list(ROPES))
def test_remaps_without_far_scores_are_plain_attention_exactly(rope):
    """Every distance below the window (the first chunk for DCA), or a group of 1 (grouped positions are
    the true ones): a remap is plain attention, bit for bit, in the full forward and through the cache;
    log-n inside the training length too."""
    plain = extended(ROPES[rope], ExtendConfig())
    idx = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        expected = plain(idx)
        cached = score_tokens(plain, idx, chunk=9)
        for extend in (
            ExtendConfig(method="self_extend", window=40, group=4),
            ExtendConfig(method="self_extend", window=8, group=1),
            ExtendConfig(method="logn", original_max_len=40),
            ExtendConfig(method="string", shift=40, local_window=4),
            ExtendConfig(method="dca", chunk=48, local_window=8),
            ExtendConfig(method="rerope", local_window=40),
            ExtendConfig(method="leaky_rerope", local_window=40),
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


@pytest.mark.parametrize("extend", REMAPS)
def test_training_backpropagates_through_the_merge_with_and_without_kernels(extend):
    """A remap in a training config: the merged attention is differentiable, and the kernels'
    RoPE rotates the far positions as the plain one does (same loss and gradients)."""
    idx, targets = torch.randint(0, 97, (2, L)), torch.randint(0, 97, (2, L))
    results = []
    for kernels in (False, True):
        model = use_kernels(extended(ROPES["yarn"], EXTENDS[extend]).train(), kernels)
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


@pytest.mark.parametrize("extend", REMAPS)
def test_remap_cache_keeps_each_maps_keys_and_counts_them(extend):
    """Slot positions for every remap; a second key buffer for every far key map but STRING's (the
    identity), so STRING's cache is the plain one plus positions."""
    model = extended(ROPES["none"], EXTENDS[extend])
    cache = KVCache.for_model(model, 2, 50)
    plain = KVCache.for_model(extended(ROPES["none"], ExtendConfig()), 2, 50)
    assert plain.k_far is None and plain.slot_positions is None
    assert (cache.k_far is None) == (extend == "string")
    assert cache.nbytes == KVCache.bytes_for_model(model.config, 2, 50, torch.float32) - 8 * 50
    buffers = 2 if extend == "string" else 3
    assert cache.nbytes == plain.nbytes * buffers // 2 + cache.slot_positions.nbytes
    with pytest.raises(ValueError) as e:
        model(torch.zeros(2, 3, dtype=torch.long), kv_cache=plain)
    assert str(e.value) == (
        f"This KV cache holds no keys for extend={extend}; build it with KVCache.for_model after use_positions."
    )


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


@pytest.mark.parametrize(
    "extend, name",
    [
        ("logn", "log-n attention"),
        ("string", "STRING"),
        ("dca", "Dual Chunk Attention"),
        ("rerope", "ReRoPE"),
        ("leaky_rerope", "leaky ReRoPE"),
        ("self_extend", "Self-Extend"),
    ],
)
@pytest.mark.parametrize("target", ["hf", "gguf"])
def test_export_refuses_an_extension(target, extend, name, tmp_path):
    """transformers' Llama and GGUF cannot express an extension: both exports refuse it, write nothing."""
    from rope_llama.cli.export_gguf import export as export_gguf
    from rope_llama.cli.export_hf import export as export_hf

    tok = text_tokenizer(tmp_path)
    ckpt = (
        save_run(extended(ROPES["none"], EXTENDS[extend], vocab_size=tok.vocab_size), tok, tmp_path / "run")
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
        f"extend={extend} cannot be exported: {where} cannot express {name}, "
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
    for method in ("string", "dca", "rerope", "leaky_rerope"):  # every remap composes with every scaling
        assert split_method(f"yarn+{method}") == ("yarn", method)
        assert extend_of(f"llama3+{method}") == ExtendConfig(
            method=method, window=16, group=4, original_max_len=256
        )
        with pytest.raises(ValueError, match=f"Unknown method '{method}\\+yarn'"):
            split_method(f"{method}+yarn")


@pytest.mark.parametrize(
    "extend, options",
    [
        ("self_extend", {"window": 8, "group": 4}),
        ("string", {"shift": 12, "local_window": 4}),
        ("dca", {}),  # the defaults from L0 = 32: chunk 24, local window 4
        ("rerope", {}),
        ("leaky_rerope", {"leak": 4.0}),
    ],
)
def test_generate_cli_scores_with_an_extension_override(extend, options, tmp_path, monkeypatch, capsys):
    """generate.py extend=<method> extend.<field>=... scores what the model scores with that extension."""
    tok = text_tokenizer(tmp_path)
    model = extended(ROPES["none"], ExtendConfig(), vocab_size=tok.vocab_size)
    run = save_run(model, tok, tmp_path / "run")
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT * 3)
    args = [f"ckpt={run}", "mode=score", f"text_file={text_file}", "chunk=16"]
    overrides = [f"extend={extend}", *(f"extend.{k}={v}" for k, v in options.items())]
    code, out, _ = run_generate_main(args + overrides, monkeypatch, capsys)
    model.use_positions(extend=ExtendConfig(method=extend, original_max_len=L0, **options))
    losses = score_tokens(model, torch.tensor([tok.bos_id, *tok.encode(TEXT * 3)]), chunk=16)
    overall = next(line for line in out.splitlines() if line.strip().startswith("overall"))
    assert code == 0 and overall.split()[1:3] == [str(losses.numel()), f"{float(losses.double().mean()):.4f}"]
    code, _, err = run_generate_main(args + [f"extend={extend}", "extend.group=0"], monkeypatch, capsys)
    assert code == 2 and "extend.group must be an integer >= 1 (a group size), got 0." in err


def test_generate_cli_refuses_a_remap_that_cannot_work(tmp_path, monkeypatch, capsys):
    """generate.py extend=dca with its local window as large as its chunk: exit 2, one sentence."""
    tok = text_tokenizer(tmp_path)
    run = save_run(extended(ROPES["none"], ExtendConfig(), vocab_size=tok.vocab_size), tok, tmp_path / "run")
    args = [f"ckpt={run}", "prompt=ROMEO:", "extend=dca", "extend.chunk=16", "extend.local_window=16"]
    code, _, err = run_generate_main(args, monkeypatch, capsys)
    message = (
        "extend local_window must be an integer in [1, 15] (below the chunk, 16) for extend=dca, got 16."
    )
    assert code == 2 and message in err
