"""Decoder: parity with transformers.LlamaForCausalLM, KV cache exactness, config validation."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from model.config import ModelConfig
from model.hf import from_hf_state_dict, hf_config_dict, to_hf_state_dict
from model.kv_cache import CacheFullError, KVCache
from model.llama import Llama, RMSNorm, one_query_attention, silu_mul
from model.loss import linear_cross_entropy
from model.rope import RopeConfig

L0 = 32  # training length the scalings are relative to


def tiny(rope: RopeConfig | None = None, **kw) -> Llama:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96)
    cfg.update(kw)
    return Llama(ModelConfig(rope=rope or RopeConfig(original_max_len=L0), **cfg)).eval()


def hf_twin(model: Llama) -> LlamaForCausalLM:
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_dict(model.config), attn_implementation="sdpa")).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict(), model.config), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied head is shared, not stored
    return hf


ROPES = {
    "none": RopeConfig(original_max_len=L0),
    "linear": RopeConfig(scaling="linear", factor=4.0, original_max_len=L0),
    "ntk": RopeConfig(scaling="ntk", factor=4.0, original_max_len=L0),
    "dynamic_ntk": RopeConfig(scaling="dynamic_ntk", factor=4.0, original_max_len=L0),
    "yarn": RopeConfig(scaling="yarn", factor=4.0, original_max_len=L0),
    "llama3": RopeConfig(scaling="llama3", factor=4.0, original_max_len=L0, base=500.0),
    "interleaved": RopeConfig(layout="interleaved", original_max_len=L0),
}


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_logits_match_transformers(name, n_kv_heads):
    model = tiny(ROPES[name], n_kv_heads=n_kv_heads)
    hf = hf_twin(model)
    idx = torch.randint(0, 97, (2, 3 * L0))  # beyond the original length: dynamic NTK is active
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_untied_head_and_state_dict_round_trip():
    model = tiny(tie_embeddings=False)
    hf = hf_twin(model)
    idx = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-4, rtol=0)
    back = from_hf_state_dict(to_hf_state_dict(model.state_dict(), model.config), model.config)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("n_kv_heads", [4, 1])
@pytest.mark.parametrize("name", ["none", "yarn", "dynamic_ntk", "interleaved"])
def test_kv_cache_prefill_then_decode_equals_full_forward(name, n_kv_heads):
    model = tiny(ROPES[name], n_kv_heads=n_kv_heads)
    idx = torch.randint(0, 97, (2, 40))
    positions = torch.arange(1000, 1040)  # non-zero start position, slot 0 of the cache
    with torch.no_grad():
        full = model(idx, position_ids=positions)
        cache = KVCache.for_model(model.config, batch_size=2, capacity=48, rope_seq_len=1040)
        steps = [model(idx[:, :25], position_ids=positions[:25], kv_cache=cache)]
        for t in range(25, 40):
            steps.append(model(idx[:, t : t + 1], position_ids=positions[t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 40


def test_kv_cache_multi_token_chunks_equal_full_forward():
    model = tiny()
    idx = torch.randint(0, 97, (1, 60))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model.config, 1, 60)
        chunks = [model(idx[:, s : s + 16], kv_cache=cache) for s in range(0, 60, 16)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=0)


def greedy(model: Llama, prompt: torch.Tensor, steps: int, use_cache: bool) -> list[int]:
    tokens = prompt.clone()
    cache = KVCache.for_model(model.config, 1, prompt.shape[1] + steps) if use_cache else None
    nxt = tokens
    with torch.no_grad():
        for _ in range(steps):
            logits = model(nxt if use_cache else tokens, kv_cache=cache)
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, token], dim=1)
            nxt = token
    return tokens[0, prompt.shape[1] :].tolist()


def test_greedy_32_tokens_identical_with_and_without_cache():
    model = tiny(init_std=0.3)  # a sharper random model so greedy output is not one repeated token
    prompt = torch.randint(0, 97, (1, 7))
    with_cache, without = greedy(model, prompt, 32, True), greedy(model, prompt, 32, False)
    assert with_cache == without and len(set(with_cache)) > 1


def test_left_padding_mask_matches_unpadded_row():
    model = tiny()
    short = torch.randint(1, 97, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)
    with torch.no_grad():
        alone = model(short)
        cache = KVCache.for_model(model.config, 1, 8)
        cache.key_mask = torch.tensor([[False] * 3 + [True] * 5])
        out = model(padded, position_ids=torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4]]), kv_cache=cache)
    torch.testing.assert_close(out[:, 3:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["none", "yarn", "dynamic_ntk", "interleaved"])
@pytest.mark.parametrize("n_kv_heads", [4, 1])
def test_static_decode_step_equals_full_forward(name, n_kv_heads):
    """The compiled decode path's math, eager: one token at a tensor slot, attention over every
    slot under slot_mask (left padding included) gives the full forward's logits."""
    model = tiny(ROPES[name], n_kv_heads=n_kv_heads)
    prompt = torch.randint(1, 97, (1, 6))
    rest = torch.randint(1, 97, (1, 5))
    positions = torch.arange(500, 511)
    with torch.no_grad():
        full = model(torch.cat([prompt, rest], dim=1), position_ids=positions)
        pad = 3  # the row is left padded by 3 slots: the mask must hide them
        cache = KVCache.for_model(model.config, 1, pad + 11 + 4, rope_seq_len=511)  # 4 slots never written
        cache.key_mask = torch.arange(cache.capacity)[None] >= pad
        padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), prompt], dim=1)
        pad_positions = torch.cat([positions[:1].repeat(pad), positions[:6]])
        model(padded, position_ids=pad_positions, kv_cache=cache)
        steps = []
        for t in range(5):
            cos, sin = model.rope.cos_sin(positions[6 + t, None], torch.float32, seq_len=511)
            cache.select_next_slot()
            steps.append(model.decode_step(rest[:, t : t + 1], cos, sin, cache))
            cache.advance(1)
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 6:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [1, 2])
def test_one_query_attention_equals_sdpa(batch):
    q, k, v = torch.randn(batch, 8, 1, 16), torch.randn(batch, 2, 9, 16), torch.randn(batch, 2, 9, 16)
    mask = torch.rand(batch, 1, 1, 9) > 0.3
    mask[..., 0] = True  # every row sees at least one key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(one_query_attention(q, k, v, mask), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk_rows", [1, 7, 256])
def test_fused_loss_equals_cross_entropy_of_logits(chunk_rows):
    """Loss and gradients of the chunked head + loss equal the plain formula (float64: exact up to
    rounding), also when the rows do not divide into chunks."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11))
    loss = linear_cross_entropy(hidden, weight, targets, chunk_rows)
    (2.5 * loss).backward()  # an upstream gradient that is not 1
    fused = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref = F.cross_entropy((hidden @ weight.T).flatten(0, 1), targets.flatten())
    (2.5 * ref).backward()
    for got, expected in zip(fused, (ref.detach(), hidden.grad, weight.grad)):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    with torch.no_grad():  # evaluation: the same value, no gradient work
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, chunk_rows), ref.detach())


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_fused_loss_does_no_gradient_work_without_autograd(mode):
    """Validation runs the loss under no_grad / inference_mode with parameters that require grad: only
    the head's forward matmul may run (2 N C V flops), not the two gradient matmuls as well."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (64,))
    with mode(), FlopCounterMode(display=False) as counter:
        linear_cross_entropy(hidden, weight, targets, chunk_rows=16)
    assert counter.get_total_flops() == 2 * 64 * 16 * 50


def test_training_and_inference_paths_give_the_same_logits():
    """With autograd on, RMSNorm, RoPE and SwiGLU run as custom autograd functions; without it
    (generation, evaluation) as plain ops. Both must compute the same logits."""
    model = tiny(init_std=0.3)
    idx = torch.randint(0, 97, (2, 20))
    with_autograd = model(idx)
    assert with_autograd.requires_grad
    with torch.inference_mode():
        torch.testing.assert_close(model(idx), with_autograd.detach(), atol=1e-4, rtol=1e-4)  # fp32 rounding


def test_model_loss_and_gradients_equal_logits_path():
    model = tiny(init_std=0.3)
    idx, targets = torch.randint(0, 97, (2, 20)), torch.randint(0, 97, (2, 20))
    model(idx, targets=targets).backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
    for name, p in model.named_parameters():  # the tied embedding gets both of its gradients
        torch.testing.assert_close(fused[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_silu_mul_gradient():
    gate_up = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(silu_mul, (gate_up,))
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's reference, bf16 input
def test_rms_norm_matches_torch_and_gradcheck():
    """Our RMSNorm's hand-written backward: gradcheck in float64 (input and weight), and the same
    output and gradients as torch's composite nn.RMSNorm in float32 and for a bfloat16 input."""
    norm = RMSNorm(6, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))
    reference = torch.nn.RMSNorm(6, eps=1e-5).double()
    reference.load_state_dict(norm.state_dict())  # same parameter name: checkpoints are unchanged
    for dtype, tol in [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]:
        ours, ref = norm.float(), reference.float()
        x = torch.randn(4, 7, 6).to(dtype).requires_grad_()
        grad = torch.randn(4, 7, 6).to(dtype)
        out, out_ref = ours(x), ref(x)
        assert out.dtype == out_ref.dtype == dtype
        torch.testing.assert_close(out, out_ref, atol=tol, rtol=tol)
        grads = torch.autograd.grad(out, (x, ours.weight), grad)
        grads_ref = torch.autograd.grad(out_ref, (x, ref.weight), grad)
        for g, g_ref in zip(grads, grads_ref):
            assert g.dtype == g_ref.dtype
            torch.testing.assert_close(g, g_ref, atol=tol * 10, rtol=tol)


def test_fused_loss_rejects_mismatched_targets():
    with pytest.raises(ValueError, match="6 hidden rows but 5 targets"):
        linear_cross_entropy(torch.randn(6, 4), torch.randn(9, 4), torch.zeros(5, dtype=torch.long))


def test_cache_full_raises():
    model = tiny()
    cache = KVCache.for_model(model.config, 1, 4)
    model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
    with pytest.raises(CacheFullError, match="3 cached \\+ 2 new tokens exceed its capacity of 4"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)
    cache.reset()
    assert cache.length == 0


def test_rewind_replaces_the_forgotten_tokens():
    model = tiny().eval()
    prefix, a, b = torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]]), torch.tensor([[10, 11]])
    cache = KVCache.for_model(model.config, 1, 5)
    with torch.no_grad():
        model(prefix, kv_cache=cache)
        model(a, kv_cache=cache)
        cache.rewind(3)
        rewound = model(b, kv_cache=cache)
        fresh = model(torch.cat([prefix, b], dim=1))[:, 3:]
    torch.testing.assert_close(rewound, fresh, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="Cannot rewind the KV cache to 6 tokens: it holds 5"):
        cache.rewind(6)


def test_parameter_count_and_flops():
    model = tiny()
    cfg = model.config
    per_layer = 64 * (4 + 2 * 2) * 16 + 64 * 64 + 3 * 64 * 96 + 2 * 64
    expected = 97 * 64 + 2 * per_layer + 64  # tied head counted once
    assert model.num_parameters() == expected
    assert (
        model.flops_per_token(32) == 6 * (expected - 97 * 64 + 97 * 64 - 2 * 2 * 64 - 64) + 12 * 2 * 64 * 32
    )
    assert cfg.head_dim == 16


def test_residual_projections_scaled_by_depth():
    torch.manual_seed(0)
    model = Llama(ModelConfig(vocab_size=50, d_model=256, n_layers=8, n_heads=4))
    std = model.blocks[0].attn.o_proj.weight.std().item()
    assert std == pytest.approx(0.02 / 4, rel=0.1)  # 0.02 / sqrt(2 * 8)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(d_model=66, n_heads=4), "d_model \\(66\\) must be divisible by n_heads \\(4\\)"),
        (dict(n_heads=4, n_kv_heads=3), "n_heads \\(4\\) must be divisible by n_kv_heads \\(3\\)"),
        (dict(d_model=36, n_heads=4), "head dim d_model/n_heads = 9 must be even"),
        (dict(n_layers=0), "n_layers must be a positive integer"),
        (dict(dropout=1.5), "dropout must be in \\[0, 1\\)"),
    ],
)
def test_model_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_config_dict_round_trip():
    cfg = ModelConfig(rope=RopeConfig(scaling="yarn", factor=2.0))
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg and isinstance(again.rope, RopeConfig)
    with pytest.raises(ValueError, match="Unknown model config keys \\['bogus'\\]"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})
