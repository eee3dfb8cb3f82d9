"""Decoder: parity with transformers.LlamaForCausalLM, KV cache exactness, config validation."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from rope_llama.interchange.hf import ExportError, from_hf_state_dict, hf_config_dict, to_hf_state_dict
from rope_llama.model.config import ModelConfig
from rope_llama.model.kv_cache import CacheFullError, KVCache
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig
from tests.helpers import L0, ROPES


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
        cache = KVCache.for_model(model, batch_size=2, capacity=48, seq_len=1040)
        steps = [model(idx[:, :25], position_ids=positions[:25], kv_cache=cache)]
        for t in range(25, 40):
            steps.append(model(idx[:, t : t + 1], position_ids=positions[t : t + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 40


@pytest.mark.parametrize("mix_previous_tokens", [0, 1, 3])
def test_kv_cache_multi_token_chunks_equal_full_forward(mix_previous_tokens):
    model = mixing_model(mix_previous_tokens) if mix_previous_tokens else tiny()
    idx = torch.randint(0, 97, (1, 60))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model, 1, 60)
        chunks = [model(idx[:, s : s + 16], kv_cache=cache) for s in range(0, 60, 16)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=5e-5, rtol=1e-5)


def greedy(model: Llama, prompt: torch.Tensor, steps: int, use_cache: bool) -> list[int]:
    tokens = prompt.clone()
    cache = KVCache.for_model(model, 1, prompt.shape[1] + steps) if use_cache else None
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
        cache = KVCache.for_model(model, 1, 8)
        cache.key_mask = torch.tensor([[False] * 3 + [True] * 5])
        out = model(padded, position_ids=torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4]]), kv_cache=cache)
    torch.testing.assert_close(out[:, 3:], alone, atol=1e-5, rtol=0)


def test_targets_give_the_cross_entropy_of_the_logits():
    """model(idx, targets=...) is the mean next-token cross-entropy of model(idx), in float32 also
    under bf16 autocast (the logits are upcast before the softmax)."""
    model = tiny(init_std=0.3)
    idx, targets = torch.randint(0, 97, (2, 20)), torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        expected = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        torch.testing.assert_close(model(idx, targets=targets), expected)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, logits = model(idx, targets=targets), model(idx)
    assert loss.dtype == torch.float32 and logits.dtype == torch.bfloat16
    torch.testing.assert_close(loss, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()))


def test_use_positions_changes_what_every_layer_rotates_with():
    """Attention reads the layout from the model's one RotaryEmbedding: after use_positions, the model equals
    one built with the new RoPE from the start (same weights), the layout included."""
    model = tiny()
    new = RopeConfig(layout="interleaved", scaling="yarn", factor=4.0, original_max_len=L0)
    fresh = tiny(new)
    fresh.load_state_dict(model.state_dict())
    idx = torch.randint(0, 97, (1, 3 * L0))
    with torch.no_grad():
        before = model(idx)
        model.use_positions(new)
        torch.testing.assert_close(model(idx), fresh(idx), atol=0, rtol=0)
    assert not torch.allclose(before, fresh(idx), atol=1e-3)


def test_cache_full_raises():
    model = tiny()
    cache = KVCache.for_model(model, 1, 4)
    model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
    with pytest.raises(CacheFullError, match="3 cached \\+ 2 new tokens exceed its capacity of 4"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)
    cache.reset()
    assert cache.length == 0


def test_rewind_replaces_the_forgotten_tokens():
    model = tiny().eval()
    prefix, a, b = torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]]), torch.tensor([[10, 11]])
    cache = KVCache.for_model(model, 1, 5)
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


def mixing_model(n: int = 2) -> Llama:
    """A tiny model mixing in the n preceding tokens, with random (not all-ones) gates."""
    model = tiny(init_std=0.3, mix_previous_tokens=n)
    with torch.no_grad():
        model.previous_token_gates.normal_()
    return model


def test_previous_token_mixing_is_the_gated_predecessor_embeddings():
    model = mixing_model(2)
    idx = torch.randint(0, 97, (2, 9))
    e, gates = model.embed(idx), model.previous_token_gates
    zero = torch.zeros_like(e[:, :1])
    one_back, two_back = torch.cat([zero, e[:, :-1]], dim=1), torch.cat([zero, zero, e[:, :-2]], dim=1)
    expected = e + gates[0] * one_back + gates[1] * two_back
    torch.testing.assert_close(model.embed_tokens(idx), expected, atol=1e-6, rtol=0)
    assert "previous_token_gates" not in tiny().state_dict()  # off: the model is unchanged
    with pytest.raises(ValueError, match="mix_previous_tokens must be an integer >= 0 .0 = off., got True"):
        ModelConfig(vocab_size=97, mix_previous_tokens=True)


@pytest.mark.parametrize("n", [1, 2])
def test_previous_token_mixing_steps_rewind_and_padding_equal_full_forward(n):
    """One-token steps, rewind and left padding find each token's predecessors (chunks: above)."""
    model = mixing_model(n)
    idx = torch.randint(1, 97, (2, 23))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache.for_model(model, 2, 23)
        prefill = model(idx[:, :20], kv_cache=cache)
        steps = [model(idx[:, s : s + 1], kv_cache=cache) for s in range(20, 23)]
        torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=5e-5, rtol=1e-5)
        cache.rewind(10)
        other = torch.randint(1, 97, (2, 4))
        rewound = model(other, kv_cache=cache)
        fresh = model(torch.cat([idx[:, :10], other], dim=1))[:, 10:]
        torch.testing.assert_close(rewound, fresh, atol=5e-5, rtol=1e-5)
        short = idx[:1, :5]  # after padding the first real token has no predecessor, as when alone
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)
        cache = KVCache.for_model(model, 1, 8)
        cache.key_mask = torch.tensor([[False] * 3 + [True] * 5])
        out = model(padded, position_ids=torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4]]), kv_cache=cache)
        torch.testing.assert_close(out[:, 3:], model(short), atol=5e-5, rtol=1e-5)


def test_previous_token_mixing_needs_a_cache_built_for_it():
    model = mixing_model()
    plain = KVCache(2, 1, 2, 8, 16)
    with pytest.raises(ValueError, match="keeps no token ids; build it with KVCache.for_model"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=plain)
    assert (
        KVCache.for_model(model, 1, 8).nbytes
        == KVCache.bytes_for_model(model.config, 1, 8, torch.float32) - 8 * 8
    )


def test_export_refuses_previous_token_mixing():
    with pytest.raises(ExportError) as e:
        hf_config_dict(mixing_model().config)
    assert str(e.value) == (
        "model.mix_previous_tokens=2 cannot be exported: transformers' Llama has no previous-token input "
        "mixing, so the exported model would compute something else."
    )


def test_mixing_more_previous_tokens_than_the_sequence_holds_is_all_zeros_beyond_it():
    """n > L: the embeddings further back than the first token are zeros, not wrapped-around slices."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, mix_previous_tokens=6)
    model = Llama(cfg).eval()
    idx = torch.randint(0, 64, (2, 4))
    x = model.embed(idx)
    gates = model.previous_token_gates
    expected = x.clone()
    for t in range(4):
        for i in range(1, t + 1):
            expected[:, t] += gates[i - 1] * x[:, t - i]
    torch.testing.assert_close(model.embed_tokens(idx), expected)
