"""RoPE rotation as a hand-written autograd Function: a drop-in for model/rope.py's `apply_rotary`.

For the half layout over every channel, both halves of the output are written straight into one
tensor with `mul`/`addcmul_` (no `rotate_half` / `cat` temporaries), and the backward is the
transposed rotation (angle -> -angle), so only the small cos/sin tables are saved. Every other case
(interleaved layout, partial rotation, tables that need a gradient, torch.compile, which fuses the
plain formula itself) takes the plain `apply_rotary`.
"""

from __future__ import annotations

import torch

from rope_llama.kernels.autograd import needs_custom_backward
from rope_llama.model import rope


def _rotate_half_into(x: torch.Tensor, c1, c2, s1, s2) -> torch.Tensor:
    """(x1*c1 - x2*s1, x2*c2 + x1*s2) written straight into the two halves of one output."""
    out = torch.empty_like(x)
    x1, x2 = x.chunk(2, dim=-1)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, c1, out=o1).addcmul_(x2, s1, value=-1)
    torch.mul(x2, c2, out=o2).addcmul_(x1, s2)
    return out


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (half layout) through _rotate_half_into."""
    (c1, c2), (s1, s2) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
    return _rotate_half_into(x, c1, c2, s1, s2)


class _RotateHalf(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin with the transposed rotation as its backward."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate_half(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        (c1, c2), (s1, s2) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
        return _rotate_half_into(grad, c1, c2, -s2, -s1), None, None  # exact transpose for any tables


def _broadcasts_into(shape: torch.Size, target: torch.Size) -> bool:
    """True when a tensor of `shape` broadcasts against `target` without enlarging it. Plain Python:
    torch.broadcast_shapes imports sympy on its first call, a cost every process's first forward paid."""
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """model.rope.apply_rotary, same arguments and result: x (..., L, D); cos, sin (L, R) or (B, L, R)."""
    while cos.ndim < x.ndim:
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    fast = (
        layout == "half"
        and cos.shape[-1] == x.shape[-1]
        and not torch.compiler.is_compiling()
        and cos.dtype == x.dtype
        and not (cos.requires_grad or sin.requires_grad)
        and _broadcasts_into(cos.shape, x.shape)  # the output has x's shape
    )
    if not fast:
        return rope.apply_rotary(x, cos, sin, layout)
    return _RotateHalf.apply(x, cos, sin) if needs_custom_backward(x) else _rotate_half(x, cos, sin)


class KernelRotaryEmbedding(rope.RotaryEmbedding):
    """RotaryEmbedding whose `rotate` (every attention layer's q and k) is this file's apply_rotary."""

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin, self.config.layout)
