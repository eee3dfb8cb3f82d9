"""tools/bench.py's RoPE section: the rotation op alone, ours against each peer's."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rope_llama.bench.timing import alternate, compute_dtype, ratios
from rope_llama.kernels.rope import apply_rotary
from rope_llama.model.rope import RotaryEmbedding


def rope_fns(
    B: int, H: int, L: int, D: int, peers: dict, device, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    """{side: fn}: forward + backward of RoPE on q and k of shape (B, H, L, D) (torchtune: (B, L, H, D))."""
    q, k = (torch.randn(B, H, L, D, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = RotaryEmbedding(D).to(device).cos_sin(None, dtype, seq_len=L)

    def ours():
        q.grad = k.grad = None
        torch.autograd.backward((apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)), (gq, gk))

    fns = {"ours": ours}
    if "transformers" in peers:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        def hf():
            q.grad = k.grad = None
            torch.autograd.backward(apply_rotary_pos_emb(q, k, cos[None], sin[None]), (gq, gk))

        fns["transformers"] = hf
    if "torchtune" in peers:
        from torchtune.modules import RotaryPositionalEmbeddings

        tt = RotaryPositionalEmbeddings(D, max_seq_len=L).to(device)
        qt, kt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k))  # its layout
        gqt, gkt = gq.transpose(1, 2).contiguous(), gk.transpose(1, 2).contiguous()

        def torchtune():
            qt.grad = kt.grad = None
            torch.autograd.backward((tt(qt), tt(kt)), (gqt, gkt))

        fns["torchtune"] = torchtune
    return fns


def bench_rope(args: dict, peers: dict, device) -> dict:
    B, H, L, D = args["rope_shape"]
    fns = rope_fns(B, H, L, D, peers, device, compute_dtype(args, device))
    seconds, errors = alternate(fns, args["repeats"], args["warmup"], device)
    calls_per_s = {side: 1 / s for side, s in seconds.items()}
    return dict(shape_BHLD=[B, H, L, D], calls_per_s=calls_per_s, ratio=ratios(calls_per_s), errors=errors)
