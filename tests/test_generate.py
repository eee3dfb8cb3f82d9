"""Generation and scoring: KV-cache exactness, left padding, explicit positions, sampling, the CLI."""

import copy
import platform

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from rope_llama.inference.generation import (
    GREEDY,
    GenerationError,
    SamplingConfig,
    TextStream,
    fixed_shape_step,
    generate,
    position_buckets,
    sample,
    score_tokens,
)
from rope_llama.model.config import ModelConfig
from rope_llama.model.kv_cache import KVCache
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig
from tests.helpers import L0, TEXT, prompt_ids, tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def no_cache_greedy(model: Llama, prompt: list[int], steps: int, start_pos: int = 0) -> list[int]:
    """Reference: recompute the whole sequence every step, no cache, same positions."""
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            positions = torch.arange(start_pos, start_pos + seq.shape[1])
            nxt = model(seq, position_ids=positions)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------- engine


@pytest.mark.parametrize("start_pos", [0, 100, 10**12])
def test_greedy_identical_with_and_without_cache(model, tok, start_pos):
    prompt = prompt_ids(tok, "ROMEO: But soft")
    out = generate(model, [prompt], 40, GREEDY, start_pos=start_pos)
    assert out.tokens[0] == no_cache_greedy(model, prompt, 40, start_pos)
    assert len(out.tokens[0]) == 40 and len(set(out.tokens[0])) > 5


def test_compiled_decode_equals_eager(model, tok):
    """generate(compile=True) (CompiledStep: torch.compile of fixed_shape_step) picks the same greedy
    tokens as the eager loop, for a left-padded batch at a non-zero start position, and a second
    generation of the same shape reuses the compiled step."""
    prompts = [prompt_ids(tok, t) for t in ("ROMEO:", "JULIET: O Romeo, Romeo, wherefore")]
    eager_run = generate(model, prompts, 30, GREEDY, start_pos=5)
    eager = eager_run.tokens
    compiled = generate(model, prompts, 30, GREEDY, start_pos=5, compile=True)
    assert compiled.tokens == eager
    # the first compiled step (graph build) is timed apart from prefill and decode
    assert eager_run.compile_seconds == 0 and compiled.compile_seconds > 0
    assert compiled.decode_steps == eager_run.decode_steps - 1
    torch._dynamo.utils.counters.clear()
    assert generate(model, prompts, 30, GREEDY, start_pos=5, compile=True).tokens == eager
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]  # nothing was compiled again


def test_compiled_decode_uses_each_models_own_weights(model, tok):
    """Every generate(compile=True) shares one compiled step (generation.compiled_fixed_shape_step):
    a second model of the same shape must decode with its own weights, not the first one's."""
    prompt = prompt_ids(tok, "ROMEO:")
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    first = generate(model, [prompt], 20, GREEDY, compile=True).tokens
    second = generate(other, [prompt], 20, GREEDY, compile=True).tokens
    assert second == generate(other, [prompt], 20, GREEDY).tokens
    assert first == generate(model, [prompt], 20, GREEDY).tokens and first != second


FIXED_SHAPE_ROPES = {
    "none": RopeConfig(original_max_len=L0),
    "yarn": RopeConfig(scaling="yarn", factor=4.0, original_max_len=L0),
    "dynamic_ntk": RopeConfig(scaling="dynamic_ntk", factor=4.0, original_max_len=L0),
    "interleaved": RopeConfig(layout="interleaved", original_max_len=L0),
}


def small_model(rope: RopeConfig, n_kv_heads: int, vocab_size: int = 97) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, rope=rope
    )
    return Llama(cfg).eval()


@pytest.mark.parametrize("rope", list(FIXED_SHAPE_ROPES))
@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_fixed_shape_step_equals_full_forward(rope, n_kv_heads):
    """The compiled step's math, eager: one token at a tensor slot, attention over every slot under
    the slot mask (left padding and never-written slots included) gives the full forward's logits."""
    model = small_model(FIXED_SHAPE_ROPES[rope], n_kv_heads)
    prompt = torch.randint(1, 97, (1, 6))
    rest = torch.randint(1, 97, (1, 5))
    positions = torch.arange(500, 511)
    with torch.no_grad():
        full = model(torch.cat([prompt, rest], dim=1), position_ids=positions)
        pad = 3  # the row is left padded by 3 slots: the mask must hide them
        cache = KVCache.for_model(model, 1, pad + 11 + 4, seq_len=511)  # 4 slots never written
        cache.key_mask = torch.arange(cache.capacity)[None] >= pad
        padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), prompt], dim=1)
        pad_positions = torch.cat([positions[:1].repeat(pad), positions[:6]])
        model(padded, position_ids=pad_positions, kv_cache=cache)
        steps = []
        for t in range(5):
            slot = cache.next_slot()
            at = model.position_encoding(positions[6 + t, None], torch.float32, 511, cache.at_slot(slot))
            steps.append(fixed_shape_step(model, rest[:, t : t + 1], at, cache, slot))
            cache.advance(1)
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 6:], atol=1e-5, rtol=0)


def test_an_eager_forward_after_a_fixed_shape_step_appends():
    """A fixed-shape step leaves no mode behind in the cache: a later eager forward on the same cache
    (as the bench's eager path runs after the compiled one) appends after the filled slots and
    attends over them only, never over the slots not yet written."""
    model = small_model(FIXED_SHAPE_ROPES["none"], n_kv_heads=2)
    tokens = torch.randint(1, 97, (1, 10))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache.for_model(model, 1, 16, seq_len=16)  # 6 slots never written
        model(tokens[:, :6], kv_cache=cache)
        slot = cache.next_slot()
        at = model.position_encoding(torch.tensor([6]), torch.float32, 16, cache.at_slot(slot))
        steps = [fixed_shape_step(model, tokens[:, 6:7], at, cache, slot)]
        cache.advance(1)
        steps += [model(tokens[:, t : t + 1], kv_cache=cache)[:, -1] for t in range(7, 10)]
    assert cache.length == 10
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 6:], atol=1e-5, rtol=0)


NATIVE_ROPES = {  # every RoPE setting the C step must reproduce (it reads only the cos/sin tables)
    "none": RopeConfig(original_max_len=L0),
    "yarn": RopeConfig(scaling="yarn", factor=4.0, original_max_len=L0),  # attention factor in cos/sin
    "dynamic_ntk": RopeConfig(scaling="dynamic_ntk", factor=2.0, original_max_len=L0),
    "interleaved": RopeConfig(layout="interleaved", original_max_len=L0),
    "partial": RopeConfig(rotary_dim=8, original_max_len=L0),
}


def native_logits(model: Llama, prompt: list[int], steps: int, start_pos: int) -> tuple[list, list]:
    """Greedy decode through the C step: (per-step logits, the full forward's logits at the same spots).
    The full forward runs into a fresh cache only to keep dynamic NTK's length fixed, as generate does."""
    from rope_llama.kernels.cpu_decode import NativeStep

    capacity = len(prompt) + steps
    cache = KVCache.for_model(model, 1, capacity, seq_len=start_pos + capacity)
    positions = torch.arange(start_pos, start_pos + capacity)[None]
    seq = torch.tensor([prompt])
    with torch.inference_mode():
        token = model(seq, position_ids=positions[:, : len(prompt)], kv_cache=cache)[:, -1:].argmax(-1)
        step = NativeStep(model, cache, positions)
        native, full = [], []
        for _ in range(steps):
            seq = torch.cat([seq, token], dim=1)
            native.append(step(token)[0])
            fresh = KVCache.for_model(model, 1, seq.shape[1], seq_len=cache.seq_len)
            full.append(model(seq, position_ids=positions[:, : seq.shape[1]], kv_cache=fresh)[0, -1])
            token = native[-1].argmax()[None, None]
    return native, full


@pytest.mark.parametrize("rope", list(NATIVE_ROPES))
@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped-query and multi-head attention
def test_native_decode_equals_the_full_forward(tok, rope, kv_heads):
    """The C decode step (kernels/cpu_decode.c) against the torch forward over the whole sequence, at
    every step, for each RoPE setting, GQA and MHA, positions past the training length included."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=kv_heads,
        init_std=0.3,
        rope=NATIVE_ROPES[rope],
    )
    model = Llama(cfg).eval()
    native, full = native_logits(model, prompt_ids(tok, "ROMEO: But soft"), 24, start_pos=40)
    for step, (a, b) in enumerate(zip(native, full)):  # logits reach ~10: float32 sums differ by ~1e-5
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5, msg=f"step {step}")
        assert a.argmax() == b.argmax(), step


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_bf16_native_decode_is_the_float32_forward_of_its_weights(tok, kv_heads):
    """Weights and KV cache in bf16 (the -DROPE_BF16 library): each step computes in float32, so its logits
    follow the float32 forward of the same bf16 weights more closely than torch's bf16 forward does (both
    read the cache the bf16 prefill wrote) and stay within a few bf16 roundings of it."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads,
                      init_std=0.3, rope=NATIVE_ROPES["none"])  # fmt: skip
    model = Llama(cfg).eval().to(torch.bfloat16)
    exact = copy.deepcopy(model).float()  # the same bf16 weights, float32 arithmetic
    prompt, start = prompt_ids(tok, "ROMEO: But soft"), 40
    native, torch_bf16 = native_logits(model, prompt, 16, start_pos=start)
    with torch.inference_mode():
        first = model(torch.tensor([prompt]), position_ids=torch.arange(start, start + len(prompt))[None])
        seq = prompt + [int(first[0, -1].argmax())] + [int(n.argmax()) for n in native[:-1]]
        positions = torch.arange(start, start + len(seq))[None]
        reference = exact(torch.tensor([seq]), position_ids=positions)[0, len(prompt) :]  # (16, V)
    assert all(n.dtype == torch.float32 for n in native)
    native_error = max((n - r).abs().max().item() for n, r in zip(native, reference))
    torch_error = max((t.float() - r).abs().max().item() for t, r in zip(torch_bf16, reference))
    assert native_error < torch_error
    assert native_error < 0.05 * reference.abs().max().item()


def test_native_generate_equals_eager_and_threads_agree(model, tok):
    """generate(native=True) picks the eager loop's greedy tokens; with 1 or 2 threads the C step
    gives bit-identical logits (each output row is summed by one thread)."""
    prompt = prompt_ids(tok, "JULIET: O Romeo")
    eager = generate(model, [prompt], 30, GREEDY, start_pos=5).tokens
    assert generate(model, [prompt], 30, GREEDY, start_pos=5, native=True).tokens == eager
    one_thread, _ = native_logits(model, prompt, 8, start_pos=0)
    torch.set_num_threads(2)
    try:
        two_threads, _ = native_logits(model, prompt, 8, start_pos=0)
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(one_thread, two_threads))


def mixed_precision(model: Llama) -> Llama:
    """A copy whose final norm is bf16 and every other weight float32."""
    mixed = copy.deepcopy(model)
    mixed.norm.to(torch.bfloat16)
    return mixed


def test_native_decode_refuses_what_it_cannot_compute(model, tok):
    prompt = prompt_ids(tok, "ROMEO:")
    for kwargs, message in [
        (dict(prompts=[prompt, prompt]), "runs one sequence; got a batch of 2"),
        (dict(compile=True), "choose one of them"),
        (dict(model=copy.deepcopy(model).to(torch.float64)), "in float32 or in bfloat16; got float64"),
        (dict(model=mixed_precision(model)), "in float32 or in bfloat16; got bfloat16, float32"),
    ]:
        args = dict(model=model, prompts=[prompt], max_new_tokens=4, sampling=GREEDY, native=True) | kwargs
        with pytest.raises(GenerationError, match=message):
            generate(**args)


def test_native_build_errors_are_one_sentence_and_leave_no_library(tmp_path, monkeypatch):
    from rope_llama.kernels.cpu_decode import NativeDecodeUnavailable, build, c_compiler

    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(NativeDecodeUnavailable, match="'no-such-compiler' was not found"):
        c_compiler()
    target = tmp_path / "cpu_decode.so"
    with pytest.raises(NativeDecodeUnavailable, match="compiling cpu_decode.c with .*false failed"):
        build("false", target)  # a "compiler" that always fails
    assert list(tmp_path.iterdir()) == []  # no partial library, no temporary directory left
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(NativeDecodeUnavailable, match="set XDG_CACHE_HOME to a writable directory"):
        build("cc", blocker / "cpu_decode.so")  # its directory cannot be created


@pytest.mark.parametrize("start_pos", [0, 7])
def test_left_padded_batch_equals_each_prompt_alone(model, tok, start_pos):
    texts = ["ROMEO:", "JULIET: O Romeo, Romeo, wherefore", "But soft, what"]
    prompts = [prompt_ids(tok, t) for t in texts]
    assert len({len(p) for p in prompts}) == 3  # really padded
    batch = generate(model, prompts, 25, GREEDY, start_pos=start_pos).tokens
    alone = [generate(model, [p], 25, GREEDY, start_pos=start_pos).tokens[0] for p in prompts]
    assert batch == alone
    assert generate(model, prompts, 25, GREEDY, start_pos=start_pos, cache_len=100).tokens == alone
    assert len({tuple(t) for t in batch}) == 3  # rows are not trivially identical


def record_positions(model: Llama, monkeypatch) -> list[torch.Tensor]:
    """Wrap model.forward so every position_ids tensor it receives is recorded."""
    seen, forward = [], model.forward

    def spy(idx, position_ids=None, kv_cache=None, **options):
        seen.append(position_ids.clone())
        return forward(idx, position_ids=position_ids, kv_cache=kv_cache, **options)

    monkeypatch.setattr(model, "forward", spy)
    return seen


@pytest.mark.parametrize("start", [5000, 10**12])  # far positions: nothing is sized by start_pos
def test_start_pos_reaches_the_model_as_given(model, tok, monkeypatch, start):
    prompts = [prompt_ids(tok, "ROMEO:"), prompt_ids(tok, "JULIET: O Romeo")]
    a, b = map(len, prompts)
    seen = record_positions(model, monkeypatch)
    generate(model, prompts, 6, GREEDY, start_pos=start)
    prefill, decode = seen[0], seen[1:]
    assert prefill.tolist() == [
        [start] * (b - a) + list(range(start, start + a)),
        list(range(start, start + b)),
    ]
    assert len(decode) == 5  # the 6th token is sampled, never fed back
    for step, pos in enumerate(decode):
        assert pos.tolist() == [[start + a + step], [start + b + step]]


def test_start_pos_changes_the_output(tok):
    """Plain RoPE is relative: a constant shift changes nothing but float rounding. Dynamic NTK
    scales with the total length, so at start_pos=5000 the model computes something else."""
    prompt = prompt_ids(tok, "ROMEO: But soft, what light")
    plain = tiny(tok.vocab_size)
    near, far = (generate(plain, [prompt], 30, GREEDY, start_pos=s).tokens[0] for s in (0, 5000))
    assert near == far
    dynamic = tiny(tok.vocab_size, RopeConfig(scaling="dynamic_ntk", factor=4.0, original_max_len=L0))
    near, far = (generate(dynamic, [prompt], 30, GREEDY, start_pos=s).tokens[0] for s in (0, 5000))
    assert near != far


def test_dynamic_ntk_cache_path_equals_full_forward(tok, monkeypatch):
    model = tiny(tok.vocab_size, RopeConfig(scaling="dynamic_ntk", factor=4.0, original_max_len=L0))
    prompt, steps = prompt_ids(tok, "ROMEO: But soft, what light through yonder"), 40
    assert len(prompt) + steps > L0  # the dynamic scale is active
    logits, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: logits.append(forward(*a, **kw)) or logits[-1])
    new = generate(model, [prompt], steps, GREEDY).tokens[0]
    monkeypatch.undo()
    cached = torch.cat([logits[0][:, -1:], *logits[1:]], dim=1)  # (1, steps, V) next-token logits
    seq = torch.tensor([prompt + new[:-1]])
    seq_len = len(prompt) + steps
    with torch.no_grad():
        same_len = KVCache.for_model(model, 1, seq.shape[1], seq_len=seq_len)
        full = model(seq, kv_cache=same_len)[:, len(prompt) - 1 :]
        other_len = model(seq)[:, len(prompt) - 1 :]  # scaled for seq.shape[1] instead
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)
    assert full.argmax(-1)[0].tolist() == new
    assert not torch.allclose(other_len, full, atol=1e-3)  # the length really matters


@pytest.mark.parametrize("scaling", ["none", "dynamic_ntk"])
@pytest.mark.parametrize("start_pos", [0, 37])
def test_score_equals_one_full_forward(tok, scaling, start_pos):
    model = tiny(tok.vocab_size, RopeConfig(scaling=scaling, factor=4.0, original_max_len=L0))
    torch.manual_seed(1)
    tokens = torch.randint(0, tok.vocab_size, (150,))  # beyond 4 * L0: several buckets
    losses = score_tokens(model, tokens, chunk=17, start_pos=start_pos)  # chunks straddle buckets
    with torch.no_grad():
        logits = model(tokens[None, :-1], position_ids=torch.arange(start_pos, start_pos + 149))
    expected = F.cross_entropy(logits[0], tokens[1:], reduction="none")
    assert losses.shape == (149,)
    torch.testing.assert_close(losses, expected, atol=1e-5, rtol=0)

    buckets = position_buckets(losses, L0, start_pos)
    assert [(b.start, b.end) for b in buckets] == [(0, 32), (32, 64), (64, 128), (128, 256)][
        1 if start_pos >= 32 else 0 :
    ]
    assert sum(b.tokens for b in buckets) == 149
    first = buckets[-1]  # positions 128.. -> losses[128 - start_pos:]
    assert first.loss == pytest.approx(float(expected[128 - start_pos :].mean()), abs=1e-5)


def test_sampling_is_reproducible_with_a_seed(model, tok):
    prompt = prompt_ids(tok, "ROMEO:")
    cfg = SamplingConfig(temperature=1.0, top_k=50, top_p=0.95)
    first, again, other = (generate(model, [prompt], 30, cfg, seed=s).tokens[0] for s in (0, 0, 1))
    assert first == again
    assert first != other


def test_sample_filters():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logits = probs.log().expand(4000, 4).contiguous()
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, SamplingConfig(top_k=1), gen), torch.zeros(4000, dtype=torch.long))
    drawn = sample(logits, SamplingConfig(top_p=0.5), gen)  # mass before: 0, .4, .7 -> keep {0, 1}
    assert set(drawn.tolist()) == {0, 1}
    assert (drawn == 0).float().mean() == pytest.approx(0.4 / 0.7, abs=0.03)  # renormalised
    assert set(sample(logits, SamplingConfig(top_k=3), gen).tolist()) == {0, 1, 2}
    assert set(sample(logits, SamplingConfig(), gen).tolist()) == {0, 1, 2, 3}
    assert torch.equal(
        sample(logits, SamplingConfig(temperature=0), gen), torch.zeros(4000, dtype=torch.long)
    )


def test_text_stream_never_releases_broken_utf8(tok):
    ids = tok.encode("Crème brûlée ✓")
    stream = TextStream(tok.decode)
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert "".join(pieces) == "Crème brûlée ✓" == stream.text
    assert "" in pieces[:-1]  # some character really was split across tokens
    assert all("\ufffd" not in p for p in pieces)


def test_text_stream_keeps_the_spaces_of_a_sentencepiece_style_tokenizer():
    """Metaspace decoders drop the leading space of a decode: token-by-token decoding would glue words."""
    sp = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    sp.train_from_iterator([TEXT] * 3, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *bytes_]))
    ids = sp.encode("But soft, what light ✓ é").ids
    stream = TextStream(sp.decode)
    assert "".join([stream.push(i) for i in ids] + [stream.finish()]) == "But soft, what light ✓ é"
    assert "".join(sp.decode([i]) for i in ids) != "But soft, what light ✓ é"  # the naive way fails


def test_text_stream_stops_at_a_stop_string_and_holds_its_prefix(tok):
    stream = TextStream(tok.decode, stop=["\n\n"])
    pieces = []
    for i in tok.encode("ROMEO: soft\nlight\n\nJULIET"):
        pieces.append(stream.push(i))
        if stream.stopped:
            break
    assert stream.stopped and stream.text == "ROMEO: soft\nlight"
    assert "".join(pieces) == "ROMEO: soft\nlight"  # the lone "\n" before the stop was never printed


def test_generate_stops_at_eos_and_on_token(model, tok):
    prompt = prompt_ids(tok, "ROMEO:")
    free = generate(model, [prompt], 20, GREEDY).tokens[0]
    assert generate(model, [prompt], 20, GREEDY, eos_id=free[5]).tokens[0] == free[: free.index(free[5])]
    out = generate(model, [prompt, prompt], 20, GREEDY, on_token=lambda row, t: row == 0)
    assert out.tokens == [free[:1], free]


def test_engine_errors(model):
    with pytest.raises(GenerationError, match="empty prompt"):
        generate(model, [[1, 2], []], 5)
    with pytest.raises(GenerationError, match="needs 13 KV cache slots but cache_len=12"):
        generate(model, [[1, 2, 3]], 10, cache_len=12)
    assert len(generate(model, [[1, 2, 3]], 10, cache_len=13).tokens[0]) == 10


def test_native_library_is_keyed_by_the_cpu(monkeypatch, tmp_path):
    """-march=native code from one CPU can crash another: a CPU with other features builds its own."""
    import rope_llama.kernels.cpu_decode as cpu_decode

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for features in ("flags: fpu avx2", "flags: fpu avx2 avx512f"):
        monkeypatch.setattr(cpu_decode, "cpu_features", lambda features=features: features)
        cpu_decode.library.cache_clear()  # functools.cache: one library per process otherwise
        cpu_decode.library()
    cpu_decode.library.cache_clear()
    assert len(list((tmp_path / "rope-llama").glob("cpu_decode-*.so"))) == 2


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx* are x86 flags")
@pytest.mark.parametrize("switch_off", ["-mno-avx512f", "-mno-avx2"])
def test_native_portable_path_equals_the_full_forward(tok, monkeypatch, tmp_path, switch_off):
    """CPUs without AVX-512 take the C step's AVX2 loops, CPUs without AVX2 (and other compilers) its
    portable ones: built here with those instructions switched off, each must match the full forward as
    the -march=native build does."""
    import rope_llama.kernels.cpu_decode as cpu_decode

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "FLAGS", [*cpu_decode.FLAGS, switch_off])
    cpu_decode.library.cache_clear()
    try:
        native, full = native_logits(tiny(tok.vocab_size), prompt_ids(tok, "ROMEO: But soft"), 24, 40)
    finally:
        cpu_decode.library.cache_clear()  # later tests load the regular build again
    for step, (a, b) in enumerate(zip(native, full)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5, msg=f"step {step}")


def test_previous_token_mixing_generates_alike_on_every_path():
    """Eager, compiled and left-padded batched decoding of a model with mix_previous_tokens give the
    greedy tokens of the full forward; the C step refuses it in one sentence."""
    model = tiny(97, init_std=0.3, mix_previous_tokens=2)
    prompts = [[5, 9, 11, 30, 2, 7, 64, 8], [40, 3, 17]]
    expected = []
    for prompt in prompts:
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        expected.append(seq[len(prompt) :])
    assert generate(model, prompts, 10, GREEDY).tokens == expected
    assert generate(model, prompts, 10, GREEDY, compile=True).tokens == expected
    with pytest.raises(GenerationError) as e:
        generate(model, prompts[:1], 4, GREEDY, native=True)
    assert str(e.value) == "native decoding does not implement model.mix_previous_tokens; use compile=true."
