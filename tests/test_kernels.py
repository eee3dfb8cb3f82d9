"""kernels/: every kernel against the plain op it replaces, and `use_kernels` as a pure swap.

Each op: torch.autograd.gradcheck in float64, then forward and backward equal to the plain op in
float32 (atol 1e-5, rtol 1e-5: float32 rounding of a different operation order) and in bfloat16
(atol and rtol 2e-2: a few bf16 ulps, where the plain op rounds each intermediate product).
"""

import re

import pytest
import torch
import torch.nn.functional as F

from rope_llama.inference.generation import score_tokens
from rope_llama.kernels import KERNELS, use_kernels
from rope_llama.kernels import attention as kernel_attention
from rope_llama.kernels.loss import linear_cross_entropy
from rope_llama.kernels.remap import remap_attention
from rope_llama.kernels.rms_norm import KernelRMSNorm
from rope_llama.kernels.rope import _broadcasts_into
from rope_llama.kernels.rope import apply_rotary as kernel_apply_rotary
from rope_llama.kernels.swiglu import silu_mul
from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import ExtendConfig, merged_attention, regions
from rope_llama.model.kv_cache import KVCache
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig, RotaryEmbedding, apply_rotary
from tests.helpers import ROPES
from tests.test_extend import EXTENDS, LOOP_CONFIGS, REMAPS, L, extended

pytestmark = (
    pytest.mark.hardware
)  # precision=auto's branch: .ci/run runs this file with bf16 forced on and off

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def tiny(rope: RopeConfig | None = None, **kw) -> Llama:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, init_std=0.3)
    return Llama(ModelConfig(rope=rope or RopeConfig(original_max_len=32), **{**cfg, **kw}))


def assert_same_forward_and_backward(
    kernel, plain, inputs: list[torch.Tensor], dtype: torch.dtype, compute_dtype: torch.dtype | None = None
) -> None:
    """kernel(*inputs) and plain(*inputs) with inputs in `dtype`: same output and same input gradients,
    to the tolerance of `compute_dtype` (default `dtype`; bf16 under bf16 autocast)."""
    tol = TOLERANCES[compute_dtype or dtype]
    inputs = [t.detach().to(dtype).requires_grad_(t.is_floating_point()) for t in inputs]
    out, out_plain = kernel(*inputs), plain(*inputs)
    assert out.dtype == out_plain.dtype
    torch.testing.assert_close(out, out_plain, atol=tol, rtol=tol)
    grad = torch.randn_like(out)
    wrt = [t for t in inputs if t.requires_grad]
    for g, g_plain in zip(torch.autograd.grad(out, wrt, grad), torch.autograd.grad(out_plain, wrt, grad)):
        assert g.dtype == g_plain.dtype
        torch.testing.assert_close(g, g_plain, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("batched_tables", [False, True])  # (L, R) tables, or (B, L, R) from (B, L) ids
def test_rope_kernel_gradcheck_and_equals_plain(batched_tables):
    rope = RotaryEmbedding(16, RopeConfig(scaling="yarn", factor=4.0, original_max_len=8))
    ids = torch.arange(30, 35)[None].expand(2, -1) if batched_tables else torch.arange(30, 35)
    cos, sin = rope.cos_sin(ids, torch.float64)
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert kernel_apply_rotary(x, cos, sin).grad_fn.name() == "_RotateHalfBackward"  # the kernel runs
    assert torch.autograd.gradcheck(lambda t: kernel_apply_rotary(t, cos, sin), (x,))
    for dtype, tol in TOLERANCES.items():
        tables = cos.to(dtype), sin.to(dtype)
        assert_same_forward_and_backward(
            lambda t, c=tables: kernel_apply_rotary(t, *c),
            lambda t, c=tables: apply_rotary(t, *c),
            [x],
            dtype,
        )
        with torch.no_grad():  # without autograd the kernel writes the halves straight into the output
            y = x.detach().to(dtype)
            torch.testing.assert_close(
                kernel_apply_rotary(y, *tables), apply_rotary(y, *tables), atol=tol, rtol=tol
            )


@pytest.mark.parametrize("cfg", [RopeConfig(layout="interleaved"), RopeConfig(rotary_dim=8)])
def test_rope_kernel_takes_the_plain_path_where_it_does_not_apply(cfg):
    rope = RotaryEmbedding(16, cfg)
    cos, sin = rope.cos_sin(torch.arange(5), torch.float32)
    x = torch.randn(2, 5, 16, requires_grad=True)
    assert torch.equal(kernel_apply_rotary(x, cos, sin, cfg.layout), apply_rotary(x, cos, sin, cfg.layout))


@pytest.mark.parametrize(
    "shape, target",
    [
        ((1, 1, 256, 16), (16, 8, 256, 16)),
        ((256, 16), (16, 8, 256, 16)),
        ((16, 1, 256, 16), (16, 8, 256, 16)),
        ((2, 1, 256, 16), (16, 8, 256, 16)),  # does not broadcast at all
        ((16, 8, 256, 16), (8, 256, 16)),  # would enlarge the target
        ((1, 256, 32), (1, 256, 16)),
    ],
)
def test_broadcasts_into_agrees_with_torch(shape, target):
    """The RoPE kernel's shape check (plain Python, no sympy import) says what torch.broadcast_shapes says."""
    try:
        expected = torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        expected = False
    assert _broadcasts_into(torch.Size(shape), torch.Size(target)) == expected


# ----------------------------------------------------------------------------- SwiGLU and RMSNorm


def test_silu_mul_gradcheck_and_equals_plain():
    gate_up = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    assert silu_mul(gate_up).grad_fn.name() == "_SiluMulBackward"
    assert torch.autograd.gradcheck(silu_mul, (gate_up,))

    def plain(t):
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    for dtype in TOLERANCES:
        assert_same_forward_and_backward(silu_mul, plain, [gate_up], dtype)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's reference, bf16 input
def test_rms_norm_kernel_gradcheck_and_equals_torch():
    """Gradcheck in float64 (input and weight), and the output and both gradients of torch's
    nn.RMSNorm in float32 and for a bfloat16 input (weight gradients summed over 28 rows: 10x tol)."""
    norm = KernelRMSNorm(6, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert norm(x).grad_fn.name() == "_RMSNormBackward"
    assert torch.autograd.gradcheck(norm, (x,))
    reference = torch.nn.RMSNorm(6, eps=1e-5).double()
    reference.load_state_dict(norm.state_dict())  # same parameter name: checkpoints are unchanged
    for dtype, tol in TOLERANCES.items():
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


# ----------------------------------------------------------------------------- fused head + loss


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


@pytest.mark.parametrize("chunk_rows", [1, 7, 256])
def test_fused_weighted_loss_equals_the_weighted_mean(chunk_rows):
    """With per-target weights (recall answers weigh more, data/recall.py): loss and gradients equal
    sum(w * ce) / sum(w) of the plain logits; weights of 1 give the plain mean."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11))
    weights = torch.ones(3, 11)
    weights[:, 4:7] = 5.0
    loss = linear_cross_entropy(hidden, weight, targets, chunk_rows, target_weights=weights)
    (2.5 * loss).backward()
    fused = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    per_target = F.cross_entropy((hidden @ weight.T).flatten(0, 1), targets.flatten(), reduction="none")
    ref = (per_target * weights.flatten().double()).sum() / weights.sum()
    (2.5 * ref).backward()
    for got, expected in zip(fused, (ref.detach(), hidden.grad, weight.grad)):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)
    ones = linear_cross_entropy(hidden, weight, targets, chunk_rows, target_weights=torch.ones(3, 11))
    torch.testing.assert_close(ones, F.cross_entropy((hidden @ weight.T).flatten(0, 1), targets.flatten()))
    assert not torch.allclose(ref, per_target.mean())  # the weights matter in this example


def test_weighted_loss_kernel_equals_the_plain_head():
    """KernelLMHead.loss and LMHead.loss agree with weights too (float32)."""
    plain = tiny().lm_head
    kernel = use_kernels(tiny()).lm_head
    hidden = torch.randn(2, 9, 64)
    targets = torch.randint(0, 97, (2, 9))
    weights = torch.rand(2, 9) * 4
    assert_same_forward_and_backward(
        lambda h: kernel.loss(h, targets, weights),
        lambda h: plain.loss(h, targets, weights),
        [hidden],
        torch.float32,
        torch.float32,
    )


def test_fused_loss_gradcheck():
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (5,))
    assert torch.autograd.gradcheck(
        lambda h, w: linear_cross_entropy(h, w, targets, chunk_rows=2), (hidden, weight)
    )


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_fused_loss_equals_the_plain_head_loss(dtype):
    """The kernel head against model/llama.py's LMHead.loss: float32 weights, and bf16 autocast (the
    training precision), where both compute the logits in bf16 and the softmax in float32."""
    plain = tiny().lm_head
    kernel = use_kernels(tiny()).lm_head
    hidden = torch.randn(2, 9, 64)
    targets = torch.randint(0, 97, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        assert_same_forward_and_backward(
            lambda h: kernel.loss(h, targets),
            lambda h: plain.loss(h, targets),
            [hidden],
            torch.float32,
            dtype,
        )


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


def test_fused_loss_rejects_mismatched_targets():
    with pytest.raises(ValueError, match="6 hidden rows but 5 targets"):
        linear_cross_entropy(torch.randn(6, 4), torch.randn(9, 4), torch.zeros(5, dtype=torch.long))


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("mask", [False, True])
def test_attention_kernel_equals_plain_and_upcasts_only_a_bf16_backward(mask):
    """bf16 inputs with autograd: the kernel runs the flash op in float32 and casts back, so it agrees
    with the plain bf16 op to bf16 tolerance, output and gradients. In float32, or with no backward to
    follow, it is the plain op itself (bit-equal)."""
    model = tiny()
    plain, kernel = model.blocks[0].attn, use_kernels(tiny()).blocks[0].attn
    q, k, v = torch.randn(2, 4, 12, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    attn_mask = torch.rand(1, 1, 12, 12) > 0.3 if mask else None
    attn_mask = attn_mask | torch.eye(12, dtype=torch.bool) if mask else None  # no fully masked row
    args = (attn_mask, not mask, 0.0)
    assert_same_forward_and_backward(
        lambda *t: kernel.attend(*t, *args), lambda *t: plain.attend(*t, *args), [q, k, v], torch.bfloat16
    )
    for dtype in (torch.float32, torch.bfloat16):
        x = [t.to(dtype) for t in (q, k, v)]
        with torch.no_grad():
            assert torch.equal(kernel.attend(*x, *args), plain.attend(*x, *args))
    x = [t.requires_grad_() for t in (q, k, v)]
    assert torch.equal(kernel.attend(*x, *args), plain.attend(*x, *args))


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("masked", [False, True])
def test_a_bf16_decode_query_attends_in_float32_like_the_flash_kernel(heads, kv_heads, masked):
    """One query per head in bf16 without autograd: `one_query_attention` (float32 matmuls and softmax) is
    the float32 attention of the same bf16 inputs rounded to bf16, grouped as enable_gqa groups, and
    at least as close to it as the bf16 flash op; longer queries and autograd keep the flash op."""
    torch.manual_seed(0)
    q = torch.randn(2, heads, 1, 16).bfloat16()
    k, v = (torch.randn(2, kv_heads, 40, 16).bfloat16() for _ in range(2))
    mask = (torch.rand(2, 1, 1, 40) > 0.4) | (torch.arange(40) == 39) if masked else None
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                           enable_gqa=kv_heads != heads)  # fmt: skip
    flash = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != heads)
    got = kernel_attention.one_query_attention(q, k, v, mask)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), exact, atol=1e-6, rtol=2**-8)  # bf16's rounding of it
    assert (got.float() - exact).abs().max() <= (flash.float() - exact).abs().max() + 1e-6
    kernel = use_kernels(tiny(n_heads=heads, n_kv_heads=kv_heads, d_model=16 * heads)).blocks[0].attn
    with torch.no_grad():
        assert torch.equal(kernel.attend(q, k, v, mask, False, 0.0), got)
        longer = torch.cat([q, q], dim=2)  # two queries: the flash op, as the plain module runs it
        assert torch.equal(kernel.attend(longer, k, v, None, False, 0.0),
                           super(type(kernel), kernel).attend(longer, k, v, None, False, 0.0))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
def test_a_chunk_after_cached_slots_attends_as_its_causal_mask(dtype, heads, kv_heads):
    """L queries in the last L of S slots (is_causal, L < S), no autograd: the kernel's two flash calls
    merged by log-sum-exp give the float32 attention under the chunk's (L, S) causal mask (fp32 to 1e-6;
    bf16 within the rounding of its two bf16 parts and their merge), and the plain module spells that
    mask out."""
    torch.manual_seed(0)
    q = torch.randn(2, heads, 7, 16).to(dtype)
    k, v = (torch.randn(2, kv_heads, 19, 16).to(dtype) for _ in range(2))
    mask = torch.arange(19) <= torch.arange(12, 19)[:, None]  # query i at slot 12 + i
    gqa = kv_heads != heads
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
    kernel = use_kernels(tiny(n_heads=heads, n_kv_heads=kv_heads, d_model=16 * heads)).blocks[0].attn
    plain = super(type(kernel), kernel).attend(q, k, v, None, True, 0.0)
    assert torch.equal(plain, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa))
    with torch.no_grad():
        got = kernel.attend(q, k, v, None, True, 0.0)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(got.float(), exact, atol=2**-8, rtol=2**-7)  # two bf16 roundings at most


@pytest.mark.parametrize("grad, dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_attention_kernel_upcasts_a_compiled_bf16_backward_too(grad, dtype):
    """Under torch.compile the flash op is still PyTorch's, in the dtype it is given: the graph dynamo
    traces from a bf16 training call must run it in float32, and a call without autograd in bf16."""
    kernel = use_kernels(tiny()).blocks[0].attn
    seen = []

    def record(gm, example_inputs):  # a dynamo backend: note the attention op's dtype, run the graph
        sdpa = [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
        seen.extend(n.meta["example_value"].dtype for n in sdpa)
        return gm

    q, k, v = (torch.randn(2, h, 12, 16, dtype=torch.bfloat16, requires_grad=grad) for h in (4, 2, 2))
    torch._dynamo.reset()
    torch.compile(lambda *t: kernel.attend(*t, None, True, 0.0), backend=record, fullgraph=True)(q, k, v)
    assert seen == [dtype]


# ----------------------------------------------------------------------------- use_kernels


def test_use_kernels_swaps_classes_and_keeps_every_tensor():
    model = tiny()
    before = {name: t.data_ptr() for name, t in model.state_dict().items()}
    plain_classes = [type(m) for m in model.modules()]
    assert use_kernels(model) is model
    kernel_classes = [type(m) for m in model.modules()]
    assert set(KERNELS.values()) <= set(kernel_classes) and not set(KERNELS) & set(kernel_classes)
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == before  # same keys, same tensors
    assert model.lm_head.weight is model.embed.weight  # the tie survives
    model.use_positions(RopeConfig(scaling="ntk", factor=2.0))
    assert type(model.rope) is KERNELS[RotaryEmbedding]  # an override keeps the kernel
    use_kernels(model, False)
    assert [type(m) for m in model.modules()] == plain_classes


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_model_with_kernels_trains_like_the_plain_model(layout):
    """float32: loss, logits without autograd, and every parameter's gradient (the tied embedding gets
    both of its gradients) equal the plain model's. bf16 autocast: the loss is equal to bf16 tolerance,
    and the gradients are as far from the float32 ones as the plain model's are (bf16 rounding
    compounds through the layers, for the plain ops as much as for the kernels)."""
    model = tiny(RopeConfig(layout=layout, original_max_len=32))
    idx, targets = torch.randint(0, 97, (2, 20)), torch.randint(0, 97, (2, 20))

    def run(kernels: bool, bf16: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
        use_kernels(model, kernels)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(idx, targets=targets)
            with torch.inference_mode():
                logits = model(idx)
        loss.backward()
        return loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters()}

    (loss, logits, grads), (loss_k, logits_k, grads_k) = run(False, False), run(True, False)
    torch.testing.assert_close(loss_k, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_k, logits, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_k[name], grad, atol=1e-5, rtol=1e-4, msg=name)

    (loss_16, _, grads_16), (loss_16k, _, grads_16k) = run(False, True), run(True, True)
    torch.testing.assert_close(loss_16k, loss_16, atol=2e-2, rtol=2e-2)
    reference = torch.cat([g.flatten() for g in grads.values()])

    def error(g: dict) -> float:
        return float((torch.cat([t.flatten() for t in g.values()]) - reference).norm() / reference.norm())

    assert error(grads_16k) <= 1.25 * error(grads_16)


TINY_BENCH = ["shape=tiny", "vocab=64", "batch=2", "seq_len=16", "repeats=2"]


def test_bench_kernels_smoke(capsys):
    """tools/bench_kernels.py (the measurement behind the `kernels` default) runs and prints its table."""
    from tools.bench_kernels import main

    main([*TINY_BENCH, "precisions=[fp32,bf16]", "warmup=0"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| fp32", "| bf16"))]
    assert len(rows) == 2 and all(row.count("x (") == 1 for row in rows)


def test_bench_chunked_scoring_scores_alike_every_way(run_dir, capsys):
    """tools/bench_chunked_scoring.py on a saved run: the kernel's chunks, the masked chunks and one
    forward give one mean loss per length (fp32, 1e-5), and the table has a row per side and length."""
    from tools.bench_chunked_scoring import main

    result = main([f"ckpt={run_dir}", "lengths=[40,96]", "chunk=16", "threads=1", "dtype=float32"])
    for t in (40, 96):
        losses = [result["losses"][side, t] for side in ("kernel chunks", "masked chunks", "one forward")]
        assert max(losses) - min(losses) < 1e-5
    assert sum(line.startswith(("| 40 |", "| 96 |")) for line in capsys.readouterr().out.splitlines()) == 6


@pytest.mark.slow
def test_bench_kernels_compares_compiled_blocks(capsys):
    """compare=compile times a model with its blocks compiled beside an eager one, in the precisions asked."""
    from tools.bench_kernels import main

    main(["compare=compile", "precisions=[fp32]", *TINY_BENCH])
    out = capsys.readouterr().out
    assert "| eager (s/step) | blocks compiled (s/step) |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| fp32", "| bf16"))]
    assert len(rows) == 1 and rows[0].startswith("| fp32") and rows[0].count("x (") == 1


def test_bench_kernels_compares_muons_newton_schulz_dtypes(capsys):
    """compare=muon_dtype times optim=muon's step with its Newton-Schulz iterations in bf16 and in fp32."""
    from tools.bench_kernels import main

    main(["compare=muon_dtype", "precisions=[fp32]", *TINY_BENCH])
    out = capsys.readouterr().out
    assert "| Muon, Newton-Schulz in bf16 (s/step) | in fp32 (s/step) |" in out
    rows = [line for line in out.splitlines() if line.startswith("| fp32")]
    assert len(rows) == 1 and rows[0].count("x (") == 1


@pytest.mark.parametrize(
    "flags, precisions", [("fpu avx2 amx_bf16", ["fp32", "bf16"]), ("fpu avx2", ["fp32"])]
)
def test_bench_kernels_times_bf16_only_where_the_cpu_multiplies_it_natively(flags, precisions, monkeypatch):
    from tools.bench_kernels import parse

    monkeypatch.delenv("ROPE_LLAMA_FORCE_CPU_BF16", raising=False)  # the patched flags decide
    monkeypatch.setattr("rope_llama.core.precision.cpu_flags", lambda: set(flags.split()))
    assert parse([])["precisions"] == precisions
    assert parse(["precisions=[bf16]"])["precisions"] == ["bf16"]  # an explicit list is used as given


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare=speed"], "compare must be one of ['compile', 'kernels', 'muon_dtype'], got 'speed'."),
        (["precisions=[fp16]"], "precisions must be a non-empty list of ['fp32', 'bf16'], got ['fp16']."),
        (["precisions=fp32"], "precisions must be a non-empty list of ['fp32', 'bf16'], got 'fp32'."),
        (["steps=3"], "unknown arguments ['steps']"),
    ],
)
def test_bench_kernels_refuses_bad_options(argv, message):
    from tools.bench_kernels import parse

    with pytest.raises(SystemExit, match=re.escape(message)):
        parse(argv)


# ----------------------------------------------------------------------------- the blocked remap kernel (model/extend.py)


@pytest.mark.parametrize("method", list(LOOP_CONFIGS))
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("cached", [0, 2, 3, 4, 20])  # slots before the queries: none, < w, = w, > w
@pytest.mark.parametrize("queries", [1, 9, 31])
def test_blocked_remap_equals_the_merged_attention(method, cached, queries, dtype, atol):
    """kernels/remap.py's flash passes merged by log-sum-exp equal `merged_attention` over the regions,
    for queries in the last L of S slots, slot 0 at position 4 (DCA's chunks of 3 then start mid-block),
    blocks that do not divide L, and grouped heads."""
    remap, S, start = LOOP_CONFIGS[method].remap, cached + queries, 4
    torch.manual_seed(cached * 100 + queries)
    q, *q_far = (torch.randn(2, 4, queries, 8, dtype=dtype) for _ in range(1 + len(remap.query_maps)))
    k, k_far, v = (torch.randn(2, 2, S, 8, dtype=dtype) for _ in range(3))
    k_far = None if remap.key_map is None else k_far
    positions = torch.arange(start, start + S)
    region = regions(remap, positions[cached:], positions)[None, None]
    mask = None if cached == 0 else (positions[None] <= positions[cached:, None])[None, None]
    expected = merged_attention(q, k, tuple(q_far), k_far, v, region, mask)
    got = remap_attention(q, k, tuple(q_far), k_far, v, remap, start, block=4)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("extend", REMAPS)
@pytest.mark.parametrize("rope", list(ROPES))  # every scaling, and the interleaved layout
def test_kernel_model_equals_the_plain_merge_in_every_path(rope, extend, monkeypatch):
    """use_kernels: the full forward, a chunked prefill and decode steps after it equal the plain model
    (atol 1e-5), and the blocked kernel did run for the consecutive forwards, not for a padded one."""
    calls = []
    real = kernel_attention.remap_attention
    monkeypatch.setattr(kernel_attention, "remap_attention", lambda *a: calls.append(1) or real(*a))
    plain = extended(ROPES[rope], EXTENDS[extend])
    fast = use_kernels(extended(ROPES[rope], EXTENDS[extend]))
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
