"""When a hand-written autograd Function pays off: the one rule every kernel of this package shares."""

from __future__ import annotations

import torch


def needs_custom_backward(*tensors: torch.Tensor) -> bool:
    """True when autograd will run an eager backward through `tensors`: the one case where the
    hand-written Functions beat the plain ops. Without autograd, `Function.apply` only adds its call
    overhead; under torch.compile, inductor fuses the plain formulas itself."""
    return (
        torch.is_grad_enabled()
        and any(t.requires_grad for t in tensors)
        and not torch.compiler.is_compiling()
    )
