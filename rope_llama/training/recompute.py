"""Activation checkpointing of the transformer blocks (train.py `checkpoint_blocks=true`): each block keeps
only its input for the backward and recomputes the rest, so a long window's activations shrink from every
block's intermediates (about 30 kB per token per block for SmolLM2's 576 channels in bf16-mixed) to one
block's plus the block inputs, at the cost of a second forward of every block in the backward.

    checkpoint_blocks(model)   # a model.llama.Llama, in place: parameters and state dict unchanged

Uses `torch.utils.checkpoint` (non-reentrant: autocast and the RNG state are replayed as they were);
without autograd (validation, the text sample, generation) a block runs plainly.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Make every block of `model` recompute its activations in the backward instead of keeping them."""
    for block in model.blocks:
        block.forward = functools.partial(_recomputed, type(block).forward.__get__(block))


def _recomputed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
