"""optim=adamw|muon: which parameters each optimizer owns, stepping, schedules and checkpoint state."""

from __future__ import annotations

import copy

import pytest
import torch

from model.config import ModelConfig
from model.llama import Llama
from training.optim import (
    MuonWithAdamW,
    OptimConfig,
    build_optimizer,
    is_hidden_matrix,
    lr_multiplier,
    warmup_cosine,
    warmup_stable_decay,
)


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


def test_scheduler_scales_muon_and_adamw_learning_rates():
    model = tiny_model()
    optimizer = opt(model, "muon")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, 2, 10, 0.1))
    assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5)
    assert optimizer.adamw.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.5)
    for _ in range(10):
        train_steps(model, optimizer, 1)
        schedule.step()
    assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.1)
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
    assert resumed.muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.1)
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
    with pytest.raises(ValueError, match=r"optim.name='sgd'; choose one of adamw, muon"):
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
            r"Unknown learning-rate schedule optim.schedule='linear'; choose one of cosine, wsd.",
        ),
        ("decay_fraction", 0.0, r"optim.decay_fraction must be in \(0, 1\], got 0.0."),
        ("decay_fraction", 1.5, r"optim.decay_fraction must be in \(0, 1\], got 1.5."),
    ],
)
def test_bad_schedule_settings_are_one_sentence(field, value, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**{field: value})
