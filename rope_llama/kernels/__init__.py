"""Opt-in speed paths. Each is a drop-in for one plain op of model/, which stays the reference and
never imports this package; tests/test_kernels.py checks every kernel against its plain op.

    from rope_llama.kernels import use_kernels
    use_kernels(model)          # the model's modules below now compute through their kernels
    use_kernels(model, False)   # back to the plain modules

Module kernels (installed by `use_kernels`; training switches them with `kernels: true|false`):

    plain (model/)            kernel                       what it saves in eager training
    RotaryEmbedding.rotate    rope.KernelRotaryEmbedding   rotate_half's temporaries; a tables-only backward
    nn.RMSNorm                rms_norm.KernelRMSNorm       memory passes of the composite backward
    SwiGLU: silu(gate) * up   swiglu.KernelSwiGLU          the `cat` in the activation's backward
    LMHead.loss               loss.KernelLMHead            the (tokens, vocab) logits and their gradient
    Attention.attend          attention.KernelAttention    CPU bf16 flash backward, slower than fp32's (compiled too)

`use_kernels` swaps each module's class for its kernel subclass, which only overrides how the
module computes (no __init__, no state of its own). Parameters, buffers, weight ties, devices and
state_dict keys therefore stay the very same objects: checkpoints load either way, and an optimizer
or a torch.compile made afterwards sees the same parameters.

The C decode step (cpu_decode.py) is not a module: generation uses it through its own `native`
option (inference/generation.py, generate.py native=true).
"""

from __future__ import annotations

from torch import nn

from rope_llama.kernels.attention import KernelAttention
from rope_llama.kernels.loss import KernelLMHead
from rope_llama.kernels.rms_norm import KernelRMSNorm
from rope_llama.kernels.rope import KernelRotaryEmbedding
from rope_llama.kernels.swiglu import KernelSwiGLU
from rope_llama.model.llama import Attention, LMHead, SwiGLU
from rope_llama.model.rope import RotaryEmbedding

KERNELS: dict[type[nn.Module], type[nn.Module]] = {
    Attention: KernelAttention,
    RotaryEmbedding: KernelRotaryEmbedding,
    nn.RMSNorm: KernelRMSNorm,
    SwiGLU: KernelSwiGLU,
    LMHead: KernelLMHead,
}


def use_kernels(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Make every module of `model` whose class is in KERNELS compute through its kernel (enabled)
    or every kernel module compute plainly again (not enabled); returns `model`, changed in place."""
    swap = KERNELS if enabled else {kernel: plain for plain, kernel in KERNELS.items()}
    for module in model.modules():
        if type(module) in swap:
            module.__class__ = swap[type(module)]
    return model
