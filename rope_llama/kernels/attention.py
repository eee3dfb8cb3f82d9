"""Attention whose training backward runs in fp32 on the CPU (a drop-in for `Attention.attend`), and
whose remapped merge (Self-Extend, STRING, DCA, ReRoPE) runs as blocked flash passes
(`Attention.attend_merged`, kernels/remap.py).

Under CPU bf16 autocast, PyTorch's flash-attention backward is slower in bf16 than in fp32 at the
lengths this repository trains at (measured in docs/performance.md, "Time to quality"), so when a
backward follows, q, k and v are upcast for the one call and the output cast back. Without autograd
(evaluation, prefill) the bf16 forward is the faster one and runs unchanged. Unlike the other kernels
this one also applies under torch.compile: inductor calls the same flash-attention op in the dtype it is
given, so a compiled training step needs the upcast as much as an eager one.

A decode step's single query in bf16 skips the CPU flash kernel, whose bf16 path is built for blocks of
queries and is several times slower for one than two float32 matmuls and a softmax on the same inputs
(docs/performance.md, "Decode attention"); `one_query_attention` computes in float32, as the flash kernel
accumulates.

A chunk scored after cached slots (`score_tokens` past its first chunk, a prefill into a filled cache)
is causal attention whose queries are the last L of S keys: one flash call needs the (L, S) mask then,
and the CPU kernel's masked path is slower per score than its causal one and scores the masked half of
the chunk's own square too; `cached_chunk_attention` runs the earlier slots unmasked and the chunk's own
square causally and merges the two by their log-sum-exp (docs/performance.md, "Chunked scoring").
"""

from __future__ import annotations

import torch

from rope_llama.kernels.autograd import backward_follows
from rope_llama.kernels.remap import attention_with_lse, merge, remap_attention
from rope_llama.model.llama import Attention


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """softmax(q k^T / sqrt(D)) v for one query per head, grouped-query: q (B, H, 1, D) over k, v
    (B, KV, S, D), mask None or (B|1, 1, 1, S) bool (True = attend) -> (B, H, 1, D) in q's dtype,
    computed in float32. Query heads h*H/KV .. (h+1)*H/KV - 1 share key-value head h, as enable_gqa."""
    B, H, _, D = q.shape
    KV = k.shape[1]
    grouped = q.reshape(B, KV, H // KV, D).float()  # (B, KV, G, D)
    scores = grouped @ k.float().transpose(-1, -2) * D**-0.5  # (B, KV, G, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v.float()  # (B, KV, G, D)
    return y.reshape(B, H, 1, D).to(q.dtype)


def cached_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q: (B, H, L, D), the last L of the S slots of k, v: (B, KV, S, D), L < S
    (query i sees slots 0..S-L+i) -> (B, H, L, D): every query sees all S-L earlier slots (one unmasked
    flash call) and its own chunk causally (one causal call), merged by their log-sum-exp. The same
    softmax as one call with the (L, S) mask, whose masked flash path is slower and scores every pair."""
    past = k.shape[2] - q.shape[2]
    earlier = attention_with_lse(q, k[:, :, :past], v[:, :, :past], None)
    own = attention_with_lse(q, k[:, :, past:], v[:, :, past:], None, causal=True)
    return merge([earlier, own])[0]


class KernelAttention(Attention):
    """Attention whose `attend` upcasts bf16 CPU inputs when a backward follows and runs a bf16 decode
    step's one query as float32 matmuls, and whose remapped merge is blocked flash attention where the
    positions allow it: same state dict."""

    def attend_merged(self, q, k, q_far, k_far, v, encoding, mask, dropout_p: float) -> torch.Tensor:
        # The CPU flash kernel returns each row's log-sum-exp; no backward is defined through it here.
        fast = encoding.start is not None and q.device.type == "cpu" and dropout_p == 0.0
        if not fast or backward_follows(q, k, v):
            return super().attend_merged(q, k, q_far, k_far, v, encoding, mask, dropout_p)
        return remap_attention(q, k, q_far, k_far, v, encoding.remap, encoding.start)

    def attend(self, q, k, v, mask, is_causal: bool, dropout_p: float) -> torch.Tensor:
        if q.device.type != "cpu":
            return super().attend(q, k, v, mask, is_causal, dropout_p)
        if not backward_follows(q, k, v):
            if is_causal and q.shape[2] < k.shape[2] and dropout_p == 0.0:
                return cached_chunk_attention(q, k, v)
            if q.dtype == torch.bfloat16 and q.shape[2] == 1 and not is_causal and dropout_p == 0.0:
                return one_query_attention(q, k, v, mask)  # a decode step
            return super().attend(q, k, v, mask, is_causal, dropout_p)
        if q.dtype != torch.bfloat16:
            return super().attend(q, k, v, mask, is_causal, dropout_p)
        with torch.autocast("cpu", enabled=False):
            y = super().attend(q.float(), k.float(), v.float(), mask, is_causal, dropout_p)
        return y.to(q.dtype)
