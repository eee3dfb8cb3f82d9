"""When a kernel's backward path pays off: the rules every kernel of this package shares."""

from __future__ import annotations

import torch


def backward_follows(*tensors: torch.Tensor) -> bool:
    """True when autograd will run a backward through `tensors`, eager or compiled."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def needs_custom_backward(*tensors: torch.Tensor) -> bool:
    """True when autograd will run an eager backward through `tensors`: the one case where the
    hand-written Functions beat the plain ops. Without autograd, `Function.apply` only adds its call
    overhead; under torch.compile, inductor fuses the plain formulas itself."""
    return backward_follows(*tensors) and not torch.compiler.is_compiling()
