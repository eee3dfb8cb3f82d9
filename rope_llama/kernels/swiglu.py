"""SwiGLU's activation silu(gate) * up as a hand-written autograd Function: a drop-in for the
activation inside model/llama.py's `SwiGLU`.

The backward writes both halves of the gradient straight into one (..., 2F) tensor, where the plain
formula's `chunk` costs a `cat` pass over the largest activation of the block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rope_llama.kernels.autograd import needs_custom_backward
from rope_llama.model.llama import SwiGLU


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up of the fused (..., 2F) gate/up projection."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        silu_gate = F.silu(gate)
        ctx.save_for_backward(gate_up, silu_gate)
        return silu_gate * up

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        gate_up, silu_gate = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        grad_gate_up = torch.empty_like(gate_up)
        grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
        torch.mul(grad, silu_gate, out=grad_up)
        torch.mul(grad, up, out=grad_gate)  # d/d silu(gate), turned into d/d gate in place below
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate_up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2F) -> (..., F): silu(first half) * second half, through _SiluMul when an eager
    backward follows, else the plain formula."""
    if needs_custom_backward(gate_up):
        return _SiluMul.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class KernelSwiGLU(SwiGLU):
    """SwiGLU whose activation is `silu_mul`: same projections, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up(x)))
