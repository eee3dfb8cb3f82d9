"""LLaMA-style decoder: RMSNorm, grouped-query attention with RoPE, SwiGLU, tied LM head.

Every attention layer uses the model's ONE RotaryEmbedding: cos/sin are gathered once per forward
and every layer rotates with them through `rope.rotate`, in the layout of the rope's config.
Projections are fused (qkv, gate+up) for speed; export to Hugging Face splits them again.

Plain PyTorch, one path per op: this is the reference network. kernels/ holds faster drop-ins for
some of its modules (same parameters, same state dict) that are installed from outside
(`kernels.use_kernels(model)`); nothing here depends on them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.kv_cache import KVCache, SlotWrite
from model.rope import RotaryEmbedding


def autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul dtype autocast would choose for `t` (bf16 on GPU), else its own dtype."""
    device_type = t.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else t.dtype


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | SlotWrite | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x: (B, L, C); cos, sin: (L, R) or (B, L, R); mask: None (causal) or (B|1, 1, L, S) bool."""
        B, L, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim],
            dim=-1,
        )
        q = q.view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)
        k = k.view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, L, D)
        v = v.view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)  # keys are cached after rotation
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


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., C): down_proj(silu(gate) * up), gate and up the halves of gate_up(x)."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LMHead(nn.Linear):
    """The output projection (V, C), and the training loss computed from its logits."""

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the logits of hidden: (..., C) against targets: (...) class ids.

        Returns a scalar in float32 (float64 for float64 weights): bf16 logits are upcast first.
        """
        logits = self(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()  # p=0: skip the call

    def forward(self, x, rope, cos, sin, kv_cache, mask):
        """x: (B, L, C) -> (B, L, C); the other arguments as in Attention.forward."""
        x = x + self.drop(self.attn(self.attn_norm(x), rope, cos, sin, kv_cache, mask))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope)  # the one instance all layers share
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)
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
        """Swap the RoPE scaling (e.g. an inference-time override); weights are unchanged. The new
        rope keeps the class of the old one, so a drop-in subclass installed from outside stays."""
        self.config.rope = rope_config
        self.rope = type(self.rope)(self.config.head_dim, rope_config).to(self.embed.weight.device)

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
            instead of the logits (`LMHead.loss`).
        """
        B, L = idx.shape
        start = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None:
            kv_cache.check_room(L)
        if position_ids is not None:
            self.rope.check_position_ids(position_ids, L, B)
        seq_len = kv_cache.seq_len if kv_cache is not None else None
        x = self.embed(idx)
        if position_ids is None:
            position_ids = torch.arange(start, start + L, device=idx.device)
            seq_len = seq_len or start + L
        dtype = autocast_dtype(x)  # the dtype q and k will have
        if kv_cache is None and seq_len == L:  # default training positions 0..L-1: a slice of the table,
            cos, sin = self.rope.cos_sin(None, dtype, seq_len=L, device=idx.device)  # no gather, no host sync
        else:  # (the sync in the gather path is a torch.compile graph break)
            cos, sin = self.rope.cos_sin(position_ids, dtype, seq_len=seq_len)
        x = self.hidden_states(x, cos, sin, kv_cache, self._attention_mask(L, kv_cache, idx.device))
        if kv_cache is not None:
            kv_cache.advance(L)
        if targets is not None:
            return self.lm_head.loss(x, targets)
        return self.lm_head(x)

    def hidden_states(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | SlotWrite | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """(B, L, C) embeddings -> (B, L, C) normalised hidden states: every block, then the final norm.

        cos, sin: (L, R) or (B, L, R) from `rope.cos_sin`; kv_cache and mask as in Attention.forward.
        `forward` runs this between the embedding and the head; a caller with its own cos/sin and
        mask (`fixed_shape_step` of inference/generation.py) runs it directly.
        """
        for block in self.blocks:
            x = block(x, self.rope, cos, sin, kv_cache, mask)
        return self.norm(x)
