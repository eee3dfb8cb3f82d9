"""Optimizers for `optim=adamw|muon` and the learning-rate schedule.

adamw: AdamW on every parameter, weight decay on matrices only (norm gains are never decayed).
muon:  Muon (torch.optim.Muon's update, its Newton-Schulz iterations in a chosen dtype) on the hidden
       matrices of the blocks (attention and MLP projections), AdamW on the rest: the embedding (tied with
       the LM head: a lookup table whose rows update independently, which orthogonalised updates would
       mix) and the norm gains (vectors, which Muon cannot take).
Both are one `torch.optim.Optimizer` to Lightning, so its closure, clipping, checkpointing and LR
scheduler work unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from rope_llama.core.schema import check_fields

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
MUON_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # and "auto": resolve_muon_dtype


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

    # metadata: each field's allowed values (core/schema.py), checked on construction and by the train schema
    name: str = field(default="adamw", metadata={"choices": OPTIMIZERS})
    lr: float = field(default=3e-3, metadata={"above": 0, "maximum": 10})
    # after the warmup: cosine, or wsd (constant, then a linear decay at the end)
    schedule: str = field(default="cosine", metadata={"choices": SCHEDULES})
    # the schedule decays to lr * min_lr_ratio at the last step (< 0 would be gradient ascent)
    min_lr_ratio: float = field(default=0.1, metadata={"minimum": 0, "maximum": 1})
    decay_fraction: float = field(
        default=0.3, metadata={"above": 0, "maximum": 1}
    )  # wsd: the share that decays
    weight_decay: float = field(default=0.1, metadata={"minimum": 0, "maximum": 10})  # matrices only
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={"minimum": 0, "below": 1})
    warmup_steps: int = field(default=100, metadata={"minimum": 0})
    # the schedule's length; longer stops mid-decay
    schedule_steps: int | None = field(
        default=None, metadata={"minimum": 1, "none_means": "trainer.max_steps"}
    )
    muon_lr: float = field(default=0.01, metadata={"above": 0, "maximum": 10})
    muon_momentum: float = field(default=0.95, metadata={"minimum": 0, "below": 1})
    muon_weight_decay: float = field(default=0.0, metadata={"minimum": 0, "maximum": 10})
    # Newton-Schulz's dtype: auto (the run's matmul dtype), bfloat16 or float32
    muon_dtype: str = field(default="auto", metadata={"choices": ("auto", *MUON_DTYPES)})

    def __post_init__(self):
        check_fields(self, "optim")
        self.betas = tuple(self.betas)  # a YAML list
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas must be two numbers [beta1, beta2], got {list(self.betas)!r}.")


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


def resolve_muon_dtype(muon_dtype: str, precision: str) -> torch.dtype:
    """The dtype of Muon's Newton-Schulz iterations for `optim.muon_dtype` in a run of Lightning
    `precision`: auto follows the run's matmuls, bf16 in bf16 runs (as torch's Muon always does) and
    fp32 otherwise, since CPUs without bf16 matrix instructions emulate bf16 matmuls, ~45x slower than
    fp32 on the default model's matrices (docs/performance.md)."""
    if muon_dtype == "auto":
        return torch.bfloat16 if str(precision).startswith("bf16") else torch.float32
    return MUON_DTYPES[muon_dtype]


def newton_schulz(
    matrix: torch.Tensor, dtype: torch.dtype, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration (Jordan et al. 2024) on a (rows, cols) matrix, in `dtype`:
    about U V^T of its SVD U S V^T (singular values pulled towards 1, not exactly to it), as torch's."""
    a, b, c = coefficients
    wide = matrix.to(dtype)
    if matrix.size(0) > matrix.size(1):  # iterate on the wide orientation: the Gram matrix is the smaller
        wide = wide.T
    wide = wide / wide.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1: inside the basin
    for _ in range(steps):
        gram = wide @ wide.T
        wide = torch.addmm(wide, torch.addmm(gram, gram, gram, beta=b, alpha=c), wide, beta=a)
    return wide.T if matrix.size(0) > matrix.size(1) else wide


class Muon(torch.optim.Muon):
    """torch.optim.Muon (Nesterov momentum, "original" per-matrix learning-rate scale) with its
    Newton-Schulz iterations in `orthogonalise_dtype`: torch's always runs them in bf16. In bf16 its
    steps equal torch's bit for bit (tests/test_optim.py); its state is torch's, so checkpoints of
    either resume in the other."""

    def __init__(self, params, orthogonalise_dtype: torch.dtype, **kwargs):
        super().__init__(params, adjust_lr_fn="original", **kwargs)
        self.orthogonalise_dtype = orthogonalise_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = newton_schulz(
                    update,
                    self.orthogonalise_dtype,
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                )
                rows, cols = param.shape
                param.mul_(1 - lr * group["weight_decay"])
                # the update's RMS grows with sqrt(rows/cols): one lr suits square and tall matrices alike
                param.add_(update, alpha=-lr * math.sqrt(max(1, rows / cols)))
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `hidden`, AdamW on `rest`, stepped together as one optimizer.

    The inner optimizers' param-group dicts are this optimizer's groups (shared, not copied), so an LR
    scheduler that scales `group["lr"]` scales Muon's and AdamW's own learning rates alike.
    """

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW):
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


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, fused: bool, precision: str = "32-true"
) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` names over `model`'s parameters (`fused`: AdamW's fused kernels) for a run
    of Lightning `precision` (which picks Muon's Newton-Schulz dtype under muon_dtype=auto)."""
    named = list(model.named_parameters())
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            adamw_groups(named, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, fused=fused
        )
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [(n, p) for n, p in named if not is_hidden_matrix(n, p)]
    muon = Muon(
        hidden,
        orthogonalise_dtype=resolve_muon_dtype(cfg.muon_dtype, precision),
        lr=cfg.muon_lr,
        momentum=cfg.muon_momentum,
        weight_decay=cfg.muon_weight_decay,
    )
    adamw = torch.optim.AdamW(adamw_groups(rest, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, fused=fused)
    return MuonWithAdamW(muon, adamw)
