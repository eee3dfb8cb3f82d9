"""RMSNorm with a hand-written backward: a drop-in for torch's nn.RMSNorm, which model/llama.py uses.

The forward is one reduction (`vector_norm`) and two products; the backward works from the saved
normalised input and (..., 1) reciprocal RMS, about half the memory passes of nn.RMSNorm's composite
autograd (which keeps pow, mean, rsqrt and both products as separate ops).
"""

from __future__ import annotations

import torch
from torch import nn

from rope_llama.kernels.autograd import needs_custom_backward


def rms_norm_eps(norm: nn.RMSNorm, dtype: torch.dtype) -> float:
    """The epsilon `norm` uses for inputs of `dtype`: nn.RMSNorm's default (the dtype's eps) for None."""
    return torch.finfo(dtype).eps if norm.eps is None else norm.eps


class _RMSNorm(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        opmath = torch.promote_types(x.dtype, torch.float32)  # bf16/fp16 inputs are reduced in float32
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=opmath)  # one read of x
        rstd = rstd.square_().div_(x.shape[-1]).add_(eps).rsqrt_()  # (..., 1): cheap in-place ops
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, rstd, weight)
        return (x_hat * weight).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x_hat, rstd, weight = ctx.saved_tensors
        grad_x_hat = grad * weight
        mean_dot = torch.linalg.vecdot(grad_x_hat, x_hat, dim=-1).unsqueeze(-1).div_(x_hat.shape[-1])
        # d/dx = rstd * (g_hat - x_hat * mean(g_hat * x_hat)), with g_hat = grad * weight
        grad_x = grad_x_hat.addcmul_(x_hat, mean_dot, value=-1).mul_(rstd)
        grad_weight = (grad * x_hat).flatten(0, -2).sum(0)
        return grad_x.to(grad.dtype), grad_weight.to(weight.dtype), None


class KernelRMSNorm(nn.RMSNorm):
    """nn.RMSNorm computed by _RMSNorm when an eager backward will follow; otherwise torch's own
    op, which inductor fuses and which without autograd costs less than a Function call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not needs_custom_backward(x, self.weight):
            return super().forward(x)
        return _RMSNorm.apply(x, self.weight, rms_norm_eps(self, x.dtype))
