"""Optimizers for `optim=adamw|muon` and the learning-rate schedule.

adamw: AdamW on every parameter, weight decay on matrices only (norm gains are never decayed).
muon:  torch.optim.Muon on the hidden matrices of the blocks (attention and MLP projections), AdamW on
       the rest: the embedding (tied with the LM head: a lookup table whose rows update independently,
       which orthogonalised updates would mix) and the norm gains (vectors, which Muon cannot take).
Both are one `torch.optim.Optimizer` to Lightning, so its closure, clipping, checkpointing and LR
scheduler work unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to min_lr_ratio at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_stable_decay(
    step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float, decay_fraction: float
) -> float:
    """LR multiplier: linear warmup to 1, constant, then a linear decay to min_lr_ratio over the last
    `decay_fraction` of max_steps (Hu et al. 2024, MiniCPM; Hagele et al. 2024). Before its decay the
    learning rate does not depend on max_steps, so runs of different lengths share that phase."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, round(decay_fraction * max_steps))
    progress = min(1.0, max(0.0, (step - (max_steps - decay_steps)) / decay_steps))
    return 1 - (1 - min_lr_ratio) * progress


@dataclass
class OptimConfig:
    """configs/optim/<name>.yaml: the optimizer and its schedule; an unknown `name` fails on construction.
    `lr`, `betas` and `weight_decay` are AdamW's (with muon: for the parameters Muon does not take)."""

    name: str = "adamw"
    lr: float = 3e-3
    schedule: str = "cosine"  # after the warmup: cosine, or wsd (constant, then a linear decay at the end)
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio at the last step
    decay_fraction: float = 0.3  # wsd: the share of the schedule's steps that decay
    weight_decay: float = 0.1  # matrices only
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 100
    schedule_steps: int | None = (
        None  # the schedule's length (null: trainer.max_steps); longer stops mid-decay
    )
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(
                f"Unknown optimizer optim.name={self.name!r}; choose one of {', '.join(OPTIMIZERS)}."
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown learning-rate schedule optim.schedule={self.schedule!r}; choose one of {', '.join(SCHEDULES)}."
            )
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction!r}.")
        self.betas = tuple(self.betas)  # a YAML list
        steps = self.schedule_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(
                f"optim.schedule_steps must be a positive integer or null (= trainer.max_steps), got {steps!r}."
            )


def lr_multiplier(cfg: OptimConfig, step: int, schedule_steps: int) -> float:
    """The learning rate at `step` as a fraction of the configured one, for cfg.schedule."""
    if cfg.schedule == "wsd":
        return warmup_stable_decay(
            step, cfg.warmup_steps, schedule_steps, cfg.min_lr_ratio, cfg.decay_fraction
        )
    return warmup_cosine(step, cfg.warmup_steps, schedule_steps, cfg.min_lr_ratio)


def is_hidden_matrix(name: str, param: nn.Parameter) -> bool:
    """A 2-D weight inside a transformer block (q/k/v, output, gate/up, down projections)."""
    return param.ndim == 2 and name.startswith("blocks.")


def adamw_groups(named_params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices decayed, vectors (norm gains) not."""
    return [
        {"params": [p for _, p in named_params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named_params if p.ndim < 2], "weight_decay": 0.0},
    ]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `hidden`, AdamW on `rest`, stepped together as one optimizer.

    The inner optimizers' param-group dicts are this optimizer's groups (shared, not copied), so an LR
    scheduler that scales `group["lr"]` scales Muon's and AdamW's own learning rates alike.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        super().__init__([*muon.param_groups, *adamw.param_groups], defaults={})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning's closure runs forward, backward and gradient clipping
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # loading replaces the inner group dicts: share the new ones, or the LR schedule of a resumed
        # run would scale dicts no optimizer reads (its learning rate frozen at the resume step's)
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]


def build_optimizer(model: nn.Module, cfg: OptimConfig, fused: bool) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` names over `model`'s parameters (`fused`: AdamW's fused kernels)."""
    named = list(model.named_parameters())
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            adamw_groups(named, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, fused=fused
        )
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [(n, p) for n, p in named if not is_hidden_matrix(n, p)]
    # "original" scaling: the update's RMS grows with sqrt(rows/cols) as in Keller Jordan's Muon, so one
    # muon_lr suits the square attention and the wide MLP matrices alike.
    muon = torch.optim.Muon(
        hidden,
        lr=cfg.muon_lr,
        momentum=cfg.muon_momentum,
        weight_decay=cfg.muon_weight_decay,
        adjust_lr_fn="original",
    )
    adamw = torch.optim.AdamW(adamw_groups(rest, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, fused=fused)
    return MuonWithAdamW(muon, adamw)
