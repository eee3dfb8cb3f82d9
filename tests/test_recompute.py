"""training/recompute.py: blocks that recompute their activations in the backward give the plain model's
loss and gradients, keep its state dict, and keep less for the backward."""

import copy

import torch

from rope_llama.kernels import use_kernels
from rope_llama.training.recompute import checkpoint_blocks
from tests.helpers import tiny


def loss_and_grads(model, idx, targets):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, targets=targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def saved_bytes(model, idx, targets) -> int:
    """Bytes of the tensors autograd keeps for the backward of one forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, targets=targets)
    return total


def test_recomputed_blocks_give_the_same_loss_and_gradients():
    plain = use_kernels(tiny(96, n_layers=3).train())  # the training path: kernels and bf16 autocast
    recomputed = copy.deepcopy(plain)
    checkpoint_blocks(recomputed)
    idx = torch.randint(96, (2, 64))
    targets = torch.randint(96, (2, 64))
    loss, grads = loss_and_grads(plain, idx, targets)
    loss_r, grads_r = loss_and_grads(recomputed, idx, targets)
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys() and all(torch.equal(grads[k], grads_r[k]) for k in grads)
    assert recomputed.state_dict().keys() == plain.state_dict().keys()
    assert saved_bytes(recomputed, idx, targets) < saved_bytes(plain, idx, targets) / 2
    with torch.no_grad():  # without autograd a block runs plainly
        assert torch.equal(recomputed(idx), plain(idx))
