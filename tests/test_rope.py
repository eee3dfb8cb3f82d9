"""RoPE: published-formula invariants, transformers parity, cache behaviour, validation."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rope_llama.interchange.hf import hf_config_dict
from rope_llama.model.config import ModelConfig
from rope_llama.model.rope import (
    SCALINGS,
    TABLE_MAX_POSITIONS,
    RopeConfig,
    RotaryEmbedding,
    apply_rotary,
    default_inv_freq,
    rope_cos_sin,
    rope_frequencies,
)

D = 16
L0 = 64


def make_cfg(scaling: str, **kw) -> RopeConfig:
    factor = 1.0 if scaling == "none" else 4.0
    return RopeConfig(scaling=scaling, factor=kw.pop("factor", factor), original_max_len=L0, **kw)


ALL = [(s, layout) for s in SCALINGS for layout in ("half", "interleaved")]


@pytest.mark.parametrize("scaling,layout", ALL)
def test_identity_at_position_zero(scaling, layout):
    rope = RotaryEmbedding(D, make_cfg(scaling, layout=layout))
    x = torch.randn(2, 3, 1, D)
    y = rope(x, torch.tensor([0]))
    torch.testing.assert_close(y, x * rope.attention_factor)


@pytest.mark.parametrize("scaling,layout", ALL)
def test_norm_preserved_times_attention_factor(scaling, layout):
    rope = RotaryEmbedding(D, make_cfg(scaling, layout=layout))
    x = torch.randn(2, 4, 300, D, dtype=torch.float64)
    y = rope(x.float()).double()
    expected = x.norm(dim=-1) * rope.attention_factor
    torch.testing.assert_close(y.norm(dim=-1), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", [s for s in SCALINGS if s != "dynamic_ntk"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_relative_property(scaling, layout):
    """q_m . k_n depends only on m - n for fixed-frequency scalings."""
    rope = RotaryEmbedding(D, make_cfg(scaling, layout=layout))
    q, k = torch.randn(D), torch.randn(D)

    def score(m, n):
        qm = rope(q.view(1, D), torch.tensor([m]))
        kn = rope(k.view(1, D), torch.tensor([n]))
        return (qm * kn).sum()

    torch.testing.assert_close(score(7, 3), score(107, 103), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(score(5, 5), score(60, 60), rtol=1e-4, atol=1e-4)
    # ...and does depend on it: two distances can score alike by chance (1 draw in 400 for 3 and 4), eight cannot
    by_distance = torch.stack([score(7, 7 - d) for d in range(8)])
    assert by_distance.max() - by_distance.min() > 1e-2


def test_matches_explicit_block_diagonal_rotation():
    """Seeds 001/003: y = R_m x with 2x2 blocks R(m theta_i) on pairs (2i, 2i+1)."""
    rope = RotaryEmbedding(D, RopeConfig(layout="interleaved"))
    x = torch.randn(D, dtype=torch.float64)
    m = 37
    theta = default_inv_freq(10000.0, D).double()
    blocks = []
    for t in theta:
        c, s = math.cos(m * t), math.sin(m * t)
        blocks.append(torch.tensor([[c, -s], [s, c]], dtype=torch.float64))
    expected = torch.block_diag(*blocks) @ x
    y = rope(x.float().view(1, D), torch.tensor([m])).double().view(D)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_interleaved_equals_permuted_half(scaling):
    half = RotaryEmbedding(D, make_cfg(scaling, layout="half"))
    inter = RotaryEmbedding(D, make_cfg(scaling, layout="interleaved"))
    x = torch.randn(2, 3, 50, D)
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])  # interleaved pair i -> (i, i + D/2)
    torch.testing.assert_close(inter(x)[..., perm], half(x[..., perm]))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_partial_rotary_tail_untouched(layout):
    rope = RotaryEmbedding(D, RopeConfig(rotary_dim=8, layout=layout))
    x = torch.randn(2, 2, 20, D)
    y = rope(x)
    assert torch.equal(y[..., 8:], x[..., 8:])  # bit-identical pass-through
    full = RotaryEmbedding(8, RopeConfig(layout=layout))
    torch.testing.assert_close(y[..., :8], full(x[..., :8]))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_batched_position_ids_equal_per_row(scaling):
    rope = RotaryEmbedding(D, make_cfg(scaling))
    x = torch.randn(3, 2, 10, D)
    ids = torch.stack([torch.arange(10), torch.arange(100, 110), torch.arange(50_000, 50_010)])
    y = rope(x, ids)
    for b in range(3):  # seq_len pinned: dynamic NTK scales for the whole batch's length
        cos, sin = rope.cos_sin(ids[b], x.dtype, seq_len=50_010)
        torch.testing.assert_close(y[b : b + 1], apply_rotary(x[b : b + 1], cos, sin))


def test_offset_ids_equal_slicing_a_longer_sequence():
    rope = RotaryEmbedding(D, RopeConfig())
    x = torch.randn(1, 2, 400, D)
    torch.testing.assert_close(rope(x)[..., 300:340, :], rope(x[..., 300:340, :], torch.arange(300, 340)))


def test_large_offsets():
    rope = RotaryEmbedding(D, RopeConfig())
    x = torch.randn(1, 1, 4, D)
    y = rope(x, torch.arange(50_000, 50_004))
    theta = default_inv_freq(10000.0, D)
    angle = 50_000 * theta[0]  # highest frequency
    expected0 = x[0, 0, 0, 0] * math.cos(angle) - x[0, 0, 0, D // 2] * math.sin(angle)
    torch.testing.assert_close(y[0, 0, 0, 0], expected0, rtol=1e-3, atol=1e-3)
    assert rope.cached_len >= 50_004


def test_seq_dim_for_blhd_inputs():
    rope = RotaryEmbedding(D, RopeConfig())
    x = torch.randn(2, 12, 3, D)  # (B, L, H, D)
    torch.testing.assert_close(rope(x, seq_dim=1), rope(x.transpose(1, 2)).transpose(1, 2))


def test_gradcheck_float64():
    rope = RotaryEmbedding(8, make_cfg("yarn"))
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rope.cos_sin(torch.arange(5), torch.float64)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,))


def test_gradient_flows_through_module():
    rope = RotaryEmbedding(D, RopeConfig())
    x = torch.randn(1, 2, 5, D, requires_grad=True)
    (rope(x) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach(), rtol=1e-5, atol=1e-5)  # rotation is orthogonal


# ------------------------------------------------------------------------- cache


def test_cache_lazy_grows_by_doubling_and_reuses():
    rope = RotaryEmbedding(D, RopeConfig())
    assert rope.cached_len == 0
    rope(torch.randn(1, 10, D))
    assert rope.cached_len == 10
    table = rope._cos
    rope(torch.randn(1, 8, D))
    assert rope._cos is table  # reused, not rebuilt
    rope(torch.randn(1, 11, D))
    assert rope.cached_len == 20  # at least doubled
    rope(torch.randn(1, 4, D), torch.arange(1000, 1004))
    assert rope.cached_len == 1004


def test_cache_rebuilt_on_device_change():
    rope = RotaryEmbedding(D, RopeConfig())
    rope(torch.randn(1, 10, D))
    rope._cache_key = (None, torch.device("meta"))  # pretend the table lives elsewhere
    before = rope._cos
    rope(torch.randn(1, 10, D))
    assert rope._cos is not before and rope._cos.device.type == "cpu"


def test_angles_float32_under_bf16_autocast():
    rope = RotaryEmbedding(64, RopeConfig())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = rope.cos_sin(torch.tensor([4095, 4096]), torch.float32)
    assert rope._cos.dtype == torch.float32
    assert not torch.equal(cos[0], cos[1]) and not torch.equal(sin[0], sin[1])
    # A bf16 angle computation would map both positions to the same value (4096 spacing is 16 in bf16).
    assert torch.tensor(4095.0, dtype=torch.bfloat16) == torch.tensor(4096.0, dtype=torch.bfloat16)


def test_tables_cast_to_activation_dtype_only_at_use():
    rope = RotaryEmbedding(D, RopeConfig())
    y = rope(torch.randn(1, 5, D, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and rope._cos.dtype == torch.float32


def test_max_position_capacity():
    rope = RotaryEmbedding(D, RopeConfig(max_position=32))
    rope(torch.randn(1, 32, D))
    with pytest.raises(ValueError, match="beyond the RoPE capacity max_position=32"):
        rope(torch.randn(1, 1, D), torch.tensor([32]))


def test_one_rope_module_shared_by_every_layer():
    from rope_llama.model.llama import Llama

    model = Llama(ModelConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=2))
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(ropes) == 1 and ropes[0] is model.rope
    calls = []
    original = model.rope.cos_sin
    model.rope.cos_sin = lambda *a, **k: calls.append(1) or original(*a, **k)
    model(torch.randint(0, 50, (1, 8)))
    assert len(calls) == 1  # gathered once per forward, reused by all 3 layers


# ------------------------------------------------------------------------- grad modes, dtypes, devices


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_table_grown_under_inference_mode_serves_a_training_step(layout):
    """A text sample at validation grows the table under inference_mode; the next training step's
    autograd saves a slice of that same table."""
    rope = RotaryEmbedding(D, RopeConfig(layout=layout))
    rope(torch.randn(1, 8, D))
    with torch.inference_mode():
        rope(torch.randn(1, 40, D))
    assert rope.cached_len == 40 and not rope._cos.is_inference() and not rope._cos.requires_grad
    x = torch.randn(1, 2, 8, D, requires_grad=True)
    (rope(x) ** 2).sum().backward()  # positions 0..7: a slice of the table, no gather
    torch.testing.assert_close(x.grad, 2 * x.detach(), rtol=1e-5, atol=1e-5)  # rotation is orthogonal


def test_dtype_switch_casts_the_one_float32_table():
    rope = RotaryEmbedding(D, make_cfg("yarn"))
    ids = torch.tensor([3, 700, 20_000])
    cos32, sin32 = rope.cos_sin(ids, torch.float32)
    table = rope._cos
    with torch.inference_mode():
        cos16, sin16 = rope.cos_sin(ids, torch.bfloat16)
    assert cos16.dtype == sin16.dtype == torch.bfloat16
    assert torch.equal(cos16, cos32.bfloat16()) and torch.equal(sin16, sin32.bfloat16())
    assert rope._cos is table and table.dtype == torch.float32
    again32, _ = rope.cos_sin(ids, torch.float32)
    assert torch.equal(again32, cos32)


def test_cache_key_follows_the_device():
    rope = RotaryEmbedding(D, RopeConfig())
    expected, _ = rope.cos_sin(torch.arange(10), torch.float32)
    cos, _ = rope.cos_sin(torch.arange(10, device="meta"), torch.float32, seq_len=10)
    assert cos.device.type == "meta" and rope._cos.device.type == "meta"
    back, _ = rope.cos_sin(torch.arange(10), torch.float32)  # rebuilt on the CPU, same values
    assert rope._cos.device.type == "cpu" and torch.equal(back, expected)


# ------------------------------------------------------------------------- positions beyond the table


def reference_cos_sin(cfg: RopeConfig, position: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (R,) of one position, angles in float64 with math, channels in the layout's order."""
    inv_freq, attention_factor = rope_frequencies(cfg, D, seq_len=seq_len)
    angles = [position * float(f) for f in inv_freq]
    angles = angles + angles if cfg.layout == "half" else [a for a in angles for _ in range(2)]
    cos = [attention_factor * math.cos(a) for a in angles]
    sin = [attention_factor * math.sin(a) for a in angles]
    return torch.tensor(cos, dtype=torch.float64), torch.tensor(sin, dtype=torch.float64)


FAR_SETTINGS = [  # (scaling, layout, rotary_dim): both layouts, partial rotation, yarn's factor, dynamic NTK
    ("none", "half", None),
    ("none", "interleaved", 8),
    ("yarn", "half", None),
    ("yarn", "interleaved", 8),
    ("dynamic_ntk", "half", None),
    ("dynamic_ntk", "interleaved", 8),
    ("llama3", "half", 8),
]


@pytest.mark.parametrize("position", [2**24 + 1, 10**12 + 3])
@pytest.mark.parametrize("scaling,layout,rotary_dim", FAR_SETTINGS)
def test_far_positions_match_a_float64_reference(position, scaling, layout, rotary_dim):
    """float32 angles lose integer positions above 2^24, and a table up to 10^12 would take terabytes."""
    cfg = make_cfg(scaling, layout=layout, rotary_dim=rotary_dim)
    rope = RotaryEmbedding(D, cfg)
    ids = torch.tensor([[7, position], [position, 0]])
    for seq_len in (None, position + 5):  # ids validated here, or bounded by the decode loop's promise
        cos, sin = rope.cos_sin(ids, torch.float32, seq_len=seq_len)
        ref_cos, ref_sin = reference_cos_sin(cfg, position, position + 1 if seq_len is None else seq_len)
        for got in (cos[0, 1], cos[1, 0]):
            torch.testing.assert_close(got.double(), ref_cos, rtol=0, atol=1e-6)
        for got in (sin[0, 1], sin[1, 0]):
            torch.testing.assert_close(got.double(), ref_sin, rtol=0, atol=1e-6)
    assert rope.cached_len == 0  # served without any table


@pytest.mark.parametrize("scaling", ["none", "dynamic_ntk"])
def test_table_stays_bounded_after_huge_positions(scaling):
    rope = RotaryEmbedding(D, make_cfg(scaling))
    rope(torch.randn(1, 3 * TABLE_MAX_POSITIONS // 4, D))  # 3/4 of the limit: doubling is capped below
    rope(torch.randn(1, 1, D), torch.tensor([3 * TABLE_MAX_POSITIONS // 4]))
    assert rope.cached_len <= TABLE_MAX_POSITIONS
    rope(torch.randn(1, 1, 2, D), torch.tensor([10**12, 10**12 + 3]))
    rope.cos_sin(torch.tensor([[10**12 + 9]]), torch.float32, seq_len=10**12 + 10)
    assert rope.cached_len <= TABLE_MAX_POSITIONS


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("scaling", ["none", "yarn", "llama3"])
def test_table_and_direct_computation_agree(scaling, layout):
    """seq_len = the limit is served by the table, one more by direct computation of the same ids."""
    rope = RotaryEmbedding(D, make_cfg(scaling, layout=layout))
    ids = torch.tensor([0, 1, 777, 40_000, TABLE_MAX_POSITIONS - 1])
    from_table = rope.cos_sin(ids, torch.float32, seq_len=TABLE_MAX_POSITIONS)
    assert rope.cached_len == TABLE_MAX_POSITIONS
    direct = rope.cos_sin(ids, torch.float32, seq_len=TABLE_MAX_POSITIONS + 1)
    torch.testing.assert_close(direct, from_table)
    pure = rope_cos_sin(ids, rope.inv_freq, rope.attention_factor, layout)
    torch.testing.assert_close(pure, from_table)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_relative_property_at_far_positions(layout):
    """q_m . k_n at m, n near 10^12 equals the score at m - n, n = 0: the angles keep every position.
    Unit q and k from a fixed seed: a float64 angle near 10^12 is exact to about 10^12 * 2^-52 = 2e-4 rad,
    so the far score may differ by a few 1e-4 (float32 angles there would be off by whole turns)."""
    rope = RotaryEmbedding(D, RopeConfig(layout=layout))
    q, k = F.normalize(torch.randn(2, 1, D, generator=torch.Generator().manual_seed(0)), dim=-1)

    def score(m, n):
        return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum()

    far = 10**12
    torch.testing.assert_close(score(far + 7, far + 3), score(4, 0), rtol=0, atol=1e-3)
    torch.testing.assert_close(score(2**24 + 1, 2**24), score(1, 0), rtol=1e-5, atol=1e-5)


def test_model_logits_at_a_far_start_equal_those_at_zero():
    """Plain RoPE sees only relative distances, so a whole sequence shifted to 10^12 scores the same."""
    from rope_llama.model.llama import Llama

    torch.manual_seed(0)
    model = Llama(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2)).eval()
    idx = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        near = model(idx)
        far = model(idx, position_ids=torch.arange(10**12, 10**12 + 12))
    torch.testing.assert_close(far, near, rtol=1e-4, atol=1e-4)
    assert model.rope.cached_len <= TABLE_MAX_POSITIONS


def test_positions_beyond_float64_exactness_are_refused():
    rope = RotaryEmbedding(D, RopeConfig())
    rope.cos_sin(torch.tensor([2**53 - 1]), torch.float32)
    with pytest.raises(
        ValueError,
        match=r"position 9007199254740992 is beyond 2\^53 - 1, the largest position RoPE keeps exact",
    ):
        rope.cos_sin(torch.tensor([2**53]), torch.float32)


# ------------------------------------------------------------------------- parity with transformers

SETTINGS = [(64, 10000.0, 4.0, 256, 1024), (32, 500000.0, 8.0, 128, 2000), (128, 10000.0, 2.0, 2048, 4096)]


def hf_init(rope_type_cfg: RopeConfig, head_dim: int, seq_len=None):
    cfg = ModelConfig(vocab_size=10, d_model=head_dim * 2, n_heads=2, rope=rope_type_cfg)
    hf_cfg = LlamaConfig(**hf_config_dict(cfg))
    rope_type = hf_cfg.rope_parameters["rope_type"]
    if rope_type == "default":  # static NTK exports as a plain RoPE with a larger base
        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg, device="cpu")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("scaling", ["linear", "dynamic_ntk", "yarn", "llama3", "ntk"])
@pytest.mark.parametrize("head_dim,base,factor,original,seq_len", SETTINGS)
def test_frequencies_match_transformers(scaling, head_dim, base, factor, original, seq_len):
    cfg = RopeConfig(base=base, scaling=scaling, factor=factor, original_max_len=original)
    ours, ours_af = rope_frequencies(cfg, head_dim, seq_len=seq_len)
    theirs, theirs_af = hf_init(cfg, head_dim, seq_len=seq_len)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert ours_af == pytest.approx(theirs_af, rel=1e-12)


def test_yarn_attention_factor_formula_and_override():
    _, af = rope_frequencies(RopeConfig(scaling="yarn", factor=16.0, original_max_len=L0), 64)
    assert af == pytest.approx(0.1 * math.log(16.0) + 1)
    _, af = rope_frequencies(
        RopeConfig(scaling="yarn", factor=16.0, original_max_len=L0, attention_factor=1.5), 64
    )
    assert af == 1.5


def test_dynamic_ntk_unchanged_inside_training_length():
    cfg = RopeConfig(scaling="dynamic_ntk", factor=4.0, original_max_len=256)
    plain = default_inv_freq(10000.0, 64)
    torch.testing.assert_close(rope_frequencies(cfg, 64, seq_len=200)[0], plain)
    assert (rope_frequencies(cfg, 64, seq_len=1024)[0][1:] < plain[1:]).all()


def test_ntk_endpoints():
    """Static NTK keeps the highest frequency and divides the lowest by the factor (d/(d-2) exponent)."""
    for d, factor in [(64, 4.0), (128, 8.0), (16, 2.0)]:
        plain = default_inv_freq(10000.0, d).double()
        cfg = RopeConfig(scaling="ntk", factor=factor)
        ntk = rope_frequencies(cfg, d)[0].double()
        assert ntk[0] == plain[0] == 1.0
        torch.testing.assert_close(ntk[-1], plain[-1] / factor, rtol=1e-6, atol=0)


def test_linear_factor_one_equals_none():
    x = torch.randn(1, 2, 30, D)
    a = RotaryEmbedding(D, RopeConfig(scaling="linear", factor=1.0))(x)
    b = RotaryEmbedding(D, RopeConfig())(x)
    assert torch.equal(a, b)


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(scaling="rope2"), "Unknown rope scaling 'rope2'; valid scalings are none, linear, ntk"),
        (dict(factor=0.5), "rope factor must be >= 1"),
        (dict(beta_fast=1.0, beta_slow=2.0), "beta_fast (1.0) must be greater than beta_slow (2.0)"),
        (dict(low_freq_factor=4.0, high_freq_factor=1.0), "high_freq_factor (1.0) must be greater"),
        (dict(layout="spiral"), "Unknown rope layout 'spiral'"),
        (dict(rotary_dim=7), "rotary_dim must be a positive even number"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RopeConfig(**kwargs)


def test_input_validation():
    rope = RotaryEmbedding(D, RopeConfig(max_position=100))
    with pytest.raises(TypeError, match="floating-point"):
        rope(torch.ones(1, 4, D, dtype=torch.long))
    with pytest.raises(ValueError, match="expected head_dim=16"):
        rope(torch.randn(1, 4, 8))
    with pytest.raises(ValueError, match="must have shape"):
        rope(torch.randn(1, 4, D), torch.arange(5))
    with pytest.raises(ValueError, match="integer tensor"):
        rope(torch.randn(1, 4, D), torch.arange(4.0))
    with pytest.raises(ValueError, match="non-negative"):
        rope(torch.randn(1, 4, D), torch.tensor([-1, 0, 1, 2]))
    with pytest.raises(ValueError, match="beyond the RoPE capacity"):
        rope(torch.randn(1, 4, D), torch.arange(97, 101))
    with pytest.raises(ValueError, match="even rotary dimension"):
        RotaryEmbedding(15, RopeConfig())
    with pytest.raises(ValueError, match="cannot exceed the head dimension"):
        RotaryEmbedding(16, RopeConfig(rotary_dim=32))
