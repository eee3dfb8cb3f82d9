"""LLaMA-style decoder: RMSNorm, grouped-query attention with RoPE, SwiGLU, tied LM head.

Every attention layer uses the model's ONE RotaryEmbedding; cos/sin are gathered once per
forward and shared. Projections are fused (qkv, gate+up) for speed; export to Hugging Face
splits them again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.kv_cache import KVCache
from model.loss import autocast_dtype, linear_cross_entropy
from model.rope import RotaryEmbedding, apply_rotary, needs_custom_backward


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.layout = cfg.rope.layout
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x, cos, sin, kv_cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
        """x: (B, L, C); cos, sin: (L, R) or (B, L, R); mask: None (causal) or (B|1, 1, L, S) bool."""
        B, L, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim],
            dim=-1,
        )
        q = q.view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)
        k = k.view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, L, D)
        v = v.view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin, self.layout), apply_rotary(k, cos, sin, self.layout)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)  # keys are cached after rotation
        if L == 1 and torch.compiler.is_compiling():  # a compiled decode step: see one_query_attention
            return self.o_proj(one_query_attention(q, k, v, mask).reshape(B, 1, -1))
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None and L > 1 and k.shape[2] == L,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,  # no repeat_interleave copy of K/V
        )
        return self.o_proj(y.transpose(1, 2).reshape(B, L, -1))


def one_query_attention(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one query per head: q (B, H, 1, D), k/v (B, KV, S, D), mask (B|1, 1, 1, S) bool
    or None -> (B, H, 1, D). Two small matmuls and a softmax that inductor fuses; the CPU flash
    kernel of SDPA costs more than that for a single query."""
    B, H, _, D = q.shape
    q = q.view(B, k.shape[1], H // k.shape[1], D)  # query heads grouped under their KV head (GQA)
    scores = (q @ k.transpose(-1, -2)) * D**-0.5  # (B, KV, G, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v).view(B, H, 1, D)


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up of the fused (..., 2F) gate/up projection. The backward writes both halves of
    the gradient straight into one (..., 2F) tensor: the plain formula's chunk would cost a `cat`
    pass over the largest activation of the block (eager only; inductor fuses the plain formula)."""

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
    """(..., 2F) -> (..., F): silu(first half) * second half (the SwiGLU activation)."""
    if needs_custom_backward(gate_up):
        return _SiluMul.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _RMSNorm(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, with a hand-written backward: about half
    the memory passes of the composite nn.RMSNorm (whose autograd keeps pow, mean, rsqrt, and both
    products as separate ops). Saves the normalised x and the (..., 1) reciprocal RMS (eager only)."""

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


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter, same state dict) computed by _RMSNorm when an eager backward will
    follow (rope.needs_custom_backward); otherwise torch's own op, which inductor fuses and which
    without autograd is cheaper than _RMSNorm.apply (9 against 17 us per call at decode size)."""

    def eps_for(self, dtype: torch.dtype) -> float:
        """The epsilon used for inputs of `dtype`: nn.RMSNorm's default (the dtype's eps) for None."""
        return torch.finfo(dtype).eps if self.eps is None else self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not needs_custom_backward(x, self.weight):
            return super().forward(x)
        return _RMSNorm.apply(x, self.weight, self.eps_for(x.dtype))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()  # p=0: skip the call

    def forward(self, x, cos, sin, kv_cache, mask):
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin, kv_cache, mask))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope)  # the one instance all layers share
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(self._init_weights)
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # GPT-2: keep the residual stream's scale
        for block in self.blocks:
            nn.init.normal_(block.attn.o_proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.down_proj.weight, std=residual_std)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_std)

    def set_rope(self, rope_config) -> None:
        """Swap the RoPE scaling (e.g. an inference-time override); weights are unchanged."""
        self.config.rope = rope_config
        self.rope = RotaryEmbedding(self.config.head_dim, rope_config).to(self.embed.weight.device)
        for block in self.blocks:
            block.attn.layout = rope_config.layout

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Unique parameters (a tied head counts once); `non_embedding` drops the token table."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 * matmul params + attention
        12 * layers * d_attn * seq_len (PaLM appendix B; causal masking not discounted)."""
        cfg = self.config
        matmul_params = (
            self.num_parameters(non_embedding=True) + cfg.vocab_size * cfg.d_model
        )  # the head is a matmul
        matmul_params -= sum(p.numel() for n, p in self.named_parameters() if "norm" in n)
        return 6 * matmul_params + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len

    def _attention_mask(self, L: int, kv_cache: KVCache | None, device) -> torch.Tensor | None:
        """None when plain causal attention (or decoding one token without padding) is exact."""
        if kv_cache is None:
            return None
        start, total = kv_cache.length, kv_cache.length + L
        if kv_cache.key_mask is None and (L == 1 or start == 0):
            return None
        query_slot = torch.arange(start, total, device=device)[:, None]
        key_slot = torch.arange(total, device=device)[None, :]
        mask = key_slot <= query_slot  # (L, S) causal over cache slots
        if kv_cache.key_mask is not None:  # padding keys are never attended (a row still sees itself)
            mask = mask & (kv_cache.key_mask[:, None, :total] | (key_slot == query_slot))
            return mask[:, None]  # (B, 1, L, S)
        return mask[None, None]  # (1, 1, L, S)

    def forward(
        self,
        idx: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """idx: (B, L) token ids -> logits (B, L, vocab), float32 unless autocast says otherwise.

        position_ids: None (0..L-1, or continuing after the cache's filled slots), (L,) or (B, L).
        kv_cache: if given, new keys/values go to its next slots and attention covers all filled ones.
        targets: (B, L) next-token ids; if given, returns the mean cross-entropy (float32 scalar)
            instead of the logits, through the fused head + loss (model/loss.py: no logits tensor).
        """
        B, L = idx.shape
        start = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None:
            kv_cache.check_room(L)
        if position_ids is not None:
            self.rope.check_position_ids(position_ids, L, B)
        rope_len = kv_cache.rope_seq_len if kv_cache is not None else None
        x = self.embed(idx)
        if position_ids is None:
            position_ids = torch.arange(start, start + L, device=idx.device)
            rope_len = rope_len or start + L
        dtype = autocast_dtype(x)  # the dtype q and k will have
        if kv_cache is None and rope_len == L:  # default training positions 0..L-1: a slice of the table,
            cos, sin = self.rope.cos_sin(None, dtype, seq_len=L, device=idx.device)  # no gather, no host sync
        else:  # (the sync in the gather path is a torch.compile graph break)
            cos, sin = self.rope.cos_sin(position_ids, dtype, seq_len=rope_len)
        x = self._layers(x, cos, sin, kv_cache, self._attention_mask(L, kv_cache, idx.device))
        if kv_cache is not None:
            kv_cache.advance(L)
        if targets is not None:
            return linear_cross_entropy(x, self.lm_head.weight, targets)
        return self.lm_head(x)

    def _layers(self, x, cos, sin, kv_cache, mask) -> torch.Tensor:
        """(B, L, C) embeddings -> (B, L, C) normalised hidden states: every block, then the final norm."""
        for block in self.blocks:
            x = block(x, cos, sin, kv_cache, mask)
        return self.norm(x)

    def decode_step(self, idx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache):
        """One token per row, written at `kv_cache.write_slot`, attending over every cache slot under
        `kv_cache.slot_mask()` -> next-token logits (B, vocab).

        idx: (B, 1); cos, sin: (B, 1, R) or (1, R) for the tokens' positions (rope.cos_sin).
        Shapes are the same at every step and no Python number changes, so `torch.compile` builds
        this once per cache shape (generation.generate with compile=True). The caller advances the cache.
        """
        x = self._layers(self.embed(idx), cos, sin, kv_cache, kv_cache.slot_mask())
        return self.lm_head(x[:, -1])
