"""optim=adamw|muon: which parameters each optimizer owns, stepping, schedules and checkpoint state."""

from __future__ import annotations

import copy

import pytest
import torch

from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama
from rope_llama.training.optim import (
    Muon,
    MuonWithAdamW,
    OptimConfig,
    build_optimizer,
    is_hidden_matrix,
    lr_multiplier,
    newton_schulz,
    resolve_muon_dtype,
    warmup_cosine,
    warmup_stable_decay,
)

pytestmark = (
    pytest.mark.hardware
)  # precision=auto's branch: .ci/run runs this file with bf16 forced on and off


def tiny_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2))


def train_steps(model: Llama, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> list[float]:
    """`steps` steps on one fixed random batch (learnable by memorising); returns the losses."""
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))
    losses = []
    for _ in range(steps):
        loss = model(x[:, :-1], targets=x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def opt(model: Llama, name: str) -> torch.optim.Optimizer:
    return build_optimizer(model, OptimConfig(name=name), fused=False)  # lr 3e-3, betas (0.9, 0.95), wd 0.1


def test_muon_owns_the_hidden_matrices_and_adamw_the_rest():
    model = tiny_model()
    optimizer = opt(model, "muon")
    assert isinstance(optimizer, MuonWithAdamW)
    muon_ids = {id(p) for g in optimizer.muon.param_groups for p in g["params"]}
    adamw_ids = {id(p) for g in optimizer.adamw.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        owner = muon_ids if is_hidden_matrix(name, p) else adamw_ids
        assert id(p) in owner, name
    assert not muon_ids & adamw_ids
    assert {n for n, p in model.named_parameters() if id(p) in muon_ids} == {
        n
        for n, _ in model.named_parameters()
        if n.startswith("blocks.")
        and n.endswith(("qkv.weight", "o_proj.weight", "gate_up.weight", "down_proj.weight"))
    }
    assert id(model.embed.weight) in adamw_ids  # tied with the head: a lookup table, not a hidden map


def test_muon_steps_both_optimizers_and_lowers_the_loss():
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = train_steps(model, opt(model, "muon"), 30)
    assert losses[-1] < losses[0] - 0.5
    for name, p in model.named_parameters():  # every parameter moved: both halves stepped
        assert not torch.equal(before[name], p), name


def test_muon_update_is_orthogonalised():
    """One Muon step moves a hidden matrix by lr * NS(grad): Newton-Schulz pulls the gradient's leading
    singular values to about one (it cannot lift the near-zero ones in 5 iterations)."""
    model = tiny_model()
    optimizer = opt(model, "muon")
    weight = model.blocks[0].attn.o_proj.weight
    before = weight.detach().clone()
    train_steps(model, optimizer, 1)
    update = (before - weight.detach()) / optimizer.muon.param_groups[0]["lr"]  # square: scale 1
    leading = torch.linalg.svdvals(update)[:8]
    assert leading.min() > 0.7 and leading.max() < 1.3, leading


def muon_pair(dtype: torch.dtype, **settings) -> tuple[list[torch.Tensor], ...]:
    """The same wide, square and tall matrices (Muon's three cases), stepped 4 times with the same
    gradients by torch.optim.Muon and by ours in `dtype`; returns ours, torch's and the start."""
    torch.manual_seed(0)
    start = [torch.randn(shape) for shape in ((8, 24), (16, 16), (24, 8))]
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    torch_s = [torch.nn.Parameter(w.clone()) for w in start]
    ours_opt = Muon(ours, orthogonalise_dtype=dtype, **settings)
    torch_opt = torch.optim.Muon(torch_s, adjust_lr_fn="original", **settings)
    for step in range(4):
        for params, optimizer in ((ours, ours_opt), (torch_s, torch_opt)):
            grads = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            optimizer.step()
    return ours, torch_s, start


@pytest.mark.parametrize("nesterov", [True, False])
def test_our_muon_in_bf16_is_torchs_muon_bit_for_bit(nesterov):
    ours, torchs, start = muon_pair(torch.bfloat16, lr=0.05, weight_decay=0.1, nesterov=nesterov)
    for a, b in zip(ours, torchs):
        assert torch.equal(a, b), a.shape
    assert not torch.equal(ours[0], start[0])


def test_a_torch_muon_state_resumes_in_ours():
    """Checkpoints written before training.optim.Muon (torch.optim.Muon's state) load and step on:
    the momentum buffers carry over, so the next step is torch's own (bf16) to the bit."""
    torch.manual_seed(0)
    start = torch.randn(16, 24)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]  # torch's, then ours
    old = torch.optim.Muon([params[0]], lr=0.05, adjust_lr_fn="original")
    for step in range(3):
        params[0].grad = torch.randn(16, 24, generator=torch.Generator().manual_seed(step))
        if step == 2:  # the resume point: copy the weights and state into ours, then both take step 2
            params[1].data.copy_(params[0].data)
            ours = Muon([params[1]], orthogonalise_dtype=torch.bfloat16, lr=0.05)
            ours.load_state_dict(copy.deepcopy(old.state_dict()))
            params[1].grad = params[0].grad.clone()
            ours.step()
        old.step()
    assert torch.equal(params[0], params[1]) and not torch.equal(params[0], start)


def test_our_muon_in_fp32_takes_torchs_steps_to_bf16_rounding():
    """Same update, finer arithmetic: the weights differ from torch's (bf16) by far less than the steps
    moved them, and its Newton-Schulz output keeps float32."""
    ours, torchs, start = muon_pair(torch.float32, lr=0.05, weight_decay=0.1)
    for a, b, w0 in zip(ours, torchs, start):
        moved = (b - w0).norm()
        assert moved > 0.1 and (a - b).norm() < 0.02 * moved, a.shape
        assert not torch.equal(a, b)
    assert (
        newton_schulz(torch.randn(6, 4), torch.float32, (3.4445, -4.775, 2.0315), 5, 1e-7).dtype
        == torch.float32
    )


@pytest.mark.parametrize(
    "muon_dtype, precision, expected",
    [
        ("auto", "bf16-mixed", torch.bfloat16),
        ("auto", "bf16-true", torch.bfloat16),
        ("auto", "32-true", torch.float32),
        ("auto", "16-mixed", torch.float32),
        ("float32", "bf16-mixed", torch.float32),
        ("bfloat16", "32-true", torch.bfloat16),
    ],
)
def test_muon_dtype_follows_the_runs_matmuls_unless_set(muon_dtype, precision, expected):
    assert resolve_muon_dtype(muon_dtype, precision) == expected
    optimizer = build_optimizer(
        tiny_model(), OptimConfig(name="muon", muon_dtype=muon_dtype), False, precision
    )
    assert optimizer.muon.orthogonalise_dtype == expected


def test_unknown_muon_dtype_is_one_sentence():
    with pytest.raises(
        ValueError, match=r"optim.muon_dtype must be one of auto, bfloat16, float32, got 'fp8'\."
    ):
        OptimConfig(name="muon", muon_dtype="fp8")


def test_scheduler_scales_muon_and_adamw_learning_rates():
    model = tiny_model()
    optimizer = opt(model, "muon")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, 2, 10, 0.1))
    assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5)
    assert optimizer.adamw.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.5)
    for _ in range(10):
        train_steps(model, optimizer, 1)
        schedule.step()
    assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(0.01 * 0.1)
    assert optimizer.adamw.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.1)


def test_scheduler_reaches_muon_and_adamw_after_a_resume():
    """Resuming loads the optimizer's state after the scheduler was built (as Lightning does): the
    schedule must still set the inner optimizers' learning rates, not a stale copy of their groups."""
    model = tiny_model()
    optimizer = opt(model, "muon")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, 2, 10, 0.1))
    for _ in range(4):
        train_steps(model, optimizer, 1)
        schedule.step()
    resumed = opt(copy.deepcopy(model), "muon")
    resumed_schedule = torch.optim.lr_scheduler.LambdaLR(resumed, lambda s: warmup_cosine(s, 2, 10, 0.1))
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    resumed_schedule.load_state_dict(schedule.state_dict())
    for _ in range(6):
        resumed_schedule.step()
    assert resumed.muon.param_groups[0]["lr"] == pytest.approx(0.01 * 0.1)
    assert resumed.adamw.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.1)
    assert [g["lr"] for g in resumed.param_groups] == [
        *(g["lr"] for g in resumed.muon.param_groups),
        *(g["lr"] for g in resumed.adamw.param_groups),
    ]


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_state_round_trip_resumes_exactly(name):
    """A resumed optimizer (state_dict -> load_state_dict) continues bit-identically."""
    model = tiny_model()
    optimizer = opt(model, name)
    train_steps(model, optimizer, 3)
    clone = copy.deepcopy(model)
    resumed = opt(clone, name)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    train_steps(model, optimizer, 3, seed=2)
    train_steps(clone, resumed, 3, seed=2)
    for (n, a), (_, b) in zip(model.named_parameters(), clone.named_parameters()):
        assert torch.equal(a, b), n


def test_unknown_optimizer_is_one_sentence():
    with pytest.raises(ValueError, match=r"optim.name must be one of adamw, muon, got 'sgd'\."):
        opt(tiny_model(), "sgd")


def test_warmup_stable_decay_holds_the_peak_then_decays_linearly():
    """warmup 10, 100 steps, the last 20 decaying to a tenth: 0.1 at step 0, 1 from 9 to 80, then a line."""
    values = [warmup_stable_decay(s, 10, 100, 0.1, 0.2) for s in range(101)]
    assert values[0] == pytest.approx(0.1) and values[9] == 1.0
    assert set(values[9:81]) == {1.0}
    assert values[90] == pytest.approx(1 - 0.9 * 10 / 20) and values[100] == pytest.approx(0.1)
    steps = [a - b for a, b in zip(values[80:100], values[81:101])]
    assert steps == pytest.approx([0.9 / 20] * 20)  # equal steps down: linear


def test_lr_multiplier_follows_the_configured_schedule():
    cosine, wsd = (
        OptimConfig(warmup_steps=10),
        OptimConfig(warmup_steps=10, schedule="wsd", decay_fraction=0.5),
    )
    assert lr_multiplier(cosine, 55, 100) == warmup_cosine(55, 10, 100, 0.1)
    assert (
        lr_multiplier(wsd, 55, 100)
        == warmup_stable_decay(55, 10, 100, 0.1, 0.5)
        != lr_multiplier(cosine, 55, 100)
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "schedule",
            "linear",
            r"optim.schedule must be one of cosine, wsd, got 'linear'\.",
        ),
        ("decay_fraction", 0.0, r"optim.decay_fraction must be a finite number in \(0, 1\], got 0.0."),
        ("decay_fraction", 1.5, r"optim.decay_fraction must be a finite number in \(0, 1\], got 1.5."),
    ],
)
def test_bad_schedule_settings_are_one_sentence(field, value, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**{field: value})
