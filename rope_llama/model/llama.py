"""LLaMA-style decoder: RMSNorm, grouped-query attention with RoPE, SwiGLU, tied LM head.

Every attention layer uses the model's ONE RotaryEmbedding: cos/sin are gathered once per forward
(`Llama.position_encoding`, with what a context extension of model/extend.py adds: log-n query scales,
a remap's far rotations and regions) and every layer rotates with them through
`rope.rotate`, in the layout of the rope's config.
Projections are fused (qkv, gate+up) for speed; export to Hugging Face splits them again.

Plain PyTorch, one path per op: this is the reference network. kernels/ holds faster drop-ins for
some of its modules (same parameters, same state dict) that are installed from outside
(`kernels.use_kernels(model)`); nothing here depends on them.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import (
    ExtendConfig,
    Remap,
    logn_scale,
    merged_attention,
    regions,
    remapped_query_positions,
)
from rope_llama.model.kv_cache import KVCache, SlotWrite
from rope_llama.model.rope import RopeConfig, RotaryEmbedding


def autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul dtype autocast would choose for `t` (bf16 on GPU), else its own dtype."""
    device_type = t.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else t.dtype


class PositionEncoding(NamedTuple):
    """What attention needs about the positions of one forward's tokens, built once per forward by
    `Llama.position_encoding` and shared by every layer.

    cos, sin:     (L, R) or (B, L, R): the rotation at the tokens' true positions (queries and keys).
    query_scale:  logn: (L, 1) or (B, 1, L, 1), multiplies the rotated queries; else None.
    far_queries:  a remap (model/extend.py): ((cos, sin), ...) per far region, each shaped like cos, the
                  queries' rotations there; None when neither the cache nor the merge needs them.
    far_keys:     a remap whose far key map is not the identity: (cos, sin) at the far key positions.
    region:       a remap when some pair may be far: (B|1, 1, L, S) uint8 (`regions`), the region of
                  each pair; None when `start` is set or attention is plain.
    remap, start: a remap as `region`, when the positions are consecutive (every key at its slot plus
                  one offset, rows alike, no padding, L > 1): the Remap and the position of key slot 0.
                  A blocked kernel then finds each region's key ranges with no (L, S) tensor.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    query_scale: torch.Tensor | None = None
    far_queries: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    far_keys: tuple[torch.Tensor, torch.Tensor] | None = None
    region: torch.Tensor | None = None
    remap: Remap | None = None
    start: int | None = None

    @property
    def merged(self) -> bool:
        """True when attention merges far scores (else every pair it scores is near)."""
        return self.region is not None or self.start is not None


def consecutive(positions: torch.Tensor) -> bool:
    """positions: (B|1, S) -> True when every row is the same run p, p + 1, ..., with S > 1 (a host sync)."""
    if positions.shape[-1] < 2:
        return False
    return bool((positions.diff(dim=-1) == 1).all() and (positions == positions[:1]).all())


def merged_region(encoding: PositionEncoding, L: int, S: int, device) -> torch.Tensor:
    """(B|1, 1, L, S) uint8: the region of each pair of a merged attention (`regions`); from the remap
    when the positions are consecutive (the L queries fill the last L of the S slots)."""
    if encoding.region is not None:
        return encoding.region
    positions = torch.arange(encoding.start, encoding.start + S, device=device)
    return regions(encoding.remap, positions[S - L :], positions)[None, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.dropout = cfg.dropout
        # called with what this layer scores, when set (viz/attention_maps.py draws it): (layer,
        # q, k, q_far, k_far, region, mask) as `attention_probabilities` takes them
        self.observer = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        encoding: PositionEncoding,
        kv_cache: KVCache | SlotWrite | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x: (B, L, C) -> (B, L, C); mask: None (causal, the L queries in the last L of the S key slots)
        or (B|1, 1, L, S) bool."""
        B, L, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim],
            dim=-1,
        )
        q = q.view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, D)
        k = k.view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, L, D)
        v = v.view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q_rot, k_rot = rope.rotate(q, encoding.cos, encoding.sin), rope.rotate(k, encoding.cos, encoding.sin)
        if encoding.query_scale is not None:
            q_rot = q_rot * encoding.query_scale
        k_far = None if encoding.far_keys is None else rope.rotate(k, *encoding.far_keys)
        if kv_cache is not None:  # keys are cached after rotation (both rotations with a far key map)
            k_rot, v, k_far = kv_cache.update(self.layer, k_rot, v, k_far)
        dropout_p = self.dropout if self.training else 0.0
        merged = encoding.merged
        q_far = tuple(rope.rotate(q, cos, sin) for cos, sin in encoding.far_queries) if merged else ()
        if self.observer is not None:
            region = merged_region(encoding, L, k_rot.shape[2], x.device) if merged else None
            self.observer(self.layer, q_rot, k_rot, q_far, k_far if merged else None, region, mask)
        if not merged:
            y = self.attend(q_rot, k_rot, v, mask, mask is None and L > 1, dropout_p)
        else:
            y = self.attend_merged(q_rot, k_rot, q_far, k_far, v, encoding, mask, dropout_p)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, -1))

    def attend_merged(self, q, k, q_far, k_far, v, encoding, mask, dropout_p: float) -> torch.Tensor:
        """Remapped attention (`merged_attention`): q and each of q_far (B, H, L, D), k, k_far (None:
        k), v (B, KV, S, D) -> (B, H, L, D); which score a pair uses is `encoding.region` (or its remap)."""
        region = merged_region(encoding, q.shape[2], k.shape[2], q.device)
        return merged_attention(q, k, q_far, k_far, v, region, mask, dropout_p)

    def attend(self, q, k, v, mask, is_causal: bool, dropout_p: float) -> torch.Tensor:
        """Softmax attention of q: (B, H, L, D) over k, v: (B, KV, S, D) -> (B, H, L, D); mask None or
        (B|1, 1, L, S) bool. is_causal: the L queries fill the last L of the S slots and query i sees
        slots 0..S-L+i (SDPA's is_causal when L == S; a chunk after cached slots when L < S)."""
        L, S = q.shape[2], k.shape[2]
        if is_causal and L < S:  # SDPA aligns is_causal to the first slot: spell the chunk's mask out
            slots = torch.arange(S, device=q.device)
            mask, is_causal = slots <= slots[S - L :, None], False  # (L, S)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=is_causal,
            dropout_p=dropout_p,
            enable_gqa=self.n_kv_heads != self.n_heads,  # no repeat_interleave copy of K/V
        )


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

    def loss(
        self, hidden: torch.Tensor, targets: torch.Tensor, target_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean cross-entropy of the logits of hidden: (..., C) against targets: (...) class ids.

        target_weights: (...) non-negative per-target weights (None = all 1): then the weighted mean,
            sum(w * ce) / sum(w).
        Returns a scalar in float32 (float64 for float64 weights): bf16 logits are upcast first.
        """
        logits = self(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if target_weights is None:
            return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        losses = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
        weights = target_weights.flatten().to(losses.dtype)
        return (losses * weights).sum() / weights.sum()

    def token_losses(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of each target: hidden (..., C), targets (...) -> (...) float32 (float64 for
        float64 weights), -log softmax(hidden @ W.T)[target]; what scoring reads instead of the logits."""
        logits = self(hidden)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        losses = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
        return losses.view(targets.shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()  # p=0: skip the call

    def forward(self, x, rope, encoding, kv_cache, mask):
        """x: (B, L, C) -> (B, L, C); the other arguments as in Attention.forward."""
        x = x + self.drop(self.attn(self.attn_norm(x), rope, encoding, kv_cache, mask))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.mix_previous_tokens:  # (n, C): row i gates the embedding i + 1 back (ModelConfig says why)
            self.previous_token_gates = nn.Parameter(torch.ones(cfg.mix_previous_tokens, cfg.d_model))
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

    def use_positions(self, rope: RopeConfig | None = None, extend: ExtendConfig | None = None) -> None:
        """Run with another RoPE and/or extension (an inference-time override; model/context.py resolves
        them); weights are unchanged. `self.config` becomes a new config: the one it was built from (a
        checkpoint's) is frozen and never changes, so passing it back restores the model's own. The new
        rope keeps the class of the old one, so a drop-in installed from outside stays. A KV cache is
        built for one extension (`KVCache.for_model`): build it after this call."""
        self.config = replace(self.config, rope=rope or self.config.rope, extend=extend or self.config.extend)
        if rope is not None:
            self.rope = type(self.rope)(self.config.head_dim, rope).to(self.embed.weight.device)

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
        """None when causal attention over the filled slots is exact (no padding): the L queries are
        the last L of them, which `Attention.attend` reads from is_causal without a (L, S) mask."""
        if kv_cache is None or kv_cache.key_mask is None:
            return None
        start, total = kv_cache.length, kv_cache.length + L
        query_slot = torch.arange(start, total, device=device)[:, None]
        key_slot = torch.arange(total, device=device)[None, :]
        causal = key_slot <= query_slot  # (L, S) causal over cache slots
        # padding keys are never attended (a row still sees itself)
        seen = kv_cache.key_mask[:, None, :total] | (key_slot == query_slot)
        return (causal & seen)[:, None]  # (B, 1, L, S)

    def forward(
        self,
        idx: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        targets: torch.Tensor | None = None,
        target_weights: torch.Tensor | None = None,
        reduction: str = "mean",
        last_only: bool = False,
    ) -> torch.Tensor:
        """idx: (B, L) token ids -> logits (B, L, vocab), float32 unless autocast says otherwise.

        position_ids: None (0..L-1, or continuing after the cache's filled slots), (L,) or (B, L).
        kv_cache: if given, new keys/values go to its next slots and attention covers all filled ones.
        targets: (B, L) next-token ids; if given, returns the mean cross-entropy (float32 scalar)
            instead of the logits (`LMHead.loss`), or with reduction="none" each target's (B, L)
            (`LMHead.token_losses`).
        target_weights: (B, L) per-target loss weights (with targets and the mean; None = all 1).
        last_only: logits (B, 1, vocab) of the last position only: a prefill that reads only the
            next token skips the head's other L - 1 rows.
        """
        if reduction not in ("mean", "none") or (reduction == "none" and target_weights is not None):
            raise ValueError(f"reduction must be mean, or none without target_weights, got {reduction!r}.")
        B, L = idx.shape
        start = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None:
            kv_cache.check_room(L)
        if position_ids is not None:
            self.rope.check_position_ids(position_ids, L, B)
        seq_len = kv_cache.seq_len if kv_cache is not None else None
        x = self.embed_tokens(idx, kv_cache)
        if position_ids is None:
            position_ids = torch.arange(start, start + L, device=idx.device)
            seq_len = seq_len or start + L
        dtype = autocast_dtype(x)  # the dtype q and k will have
        encoding = self.position_encoding(
            position_ids, dtype, seq_len, kv_cache, default=kv_cache is None and seq_len == L
        )
        x = self.hidden_states(x, encoding, kv_cache, self._attention_mask(L, kv_cache, idx.device))
        if kv_cache is not None:
            kv_cache.advance(L)
        if targets is not None and reduction == "none":
            return self.lm_head.token_losses(x, targets)
        if targets is not None:
            return self.lm_head.loss(x, targets, target_weights)
        return self.lm_head(x[:, -1:] if last_only else x)

    def embed_tokens(self, idx: torch.Tensor, kv_cache: KVCache | SlotWrite | None = None) -> torch.Tensor:
        """idx: (B, L) ids -> (B, L, C) embeddings; with `mix_previous_tokens` = n, each plus
        sum_i gates[i] * the embedding of the token i + 1 back (zero before the first token and over
        padding). With a cache the predecessors of the first new tokens are read from it, and idx is
        recorded there."""
        x = self.embed(idx)
        n = self.config.mix_previous_tokens
        if not n:
            return x
        if (
            kv_cache is None
        ):  # (B, L, n, C): embedding i + 1 back, zeros before the first token (all when i >= L)
            L = x.shape[1]
            previous = torch.stack(
                [F.pad(x[:, : max(L - i, 0)], (0, 0, min(i, L), 0)) for i in range(1, n + 1)], 2
            )
        else:
            ids, exists = kv_cache.previous_tokens(idx, n)
            previous = self.embed(ids) * exists[..., None]
        return x + (self.previous_token_gates * previous).sum(2)

    def position_encoding(
        self,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
        seq_len: int | None,
        kv_cache: KVCache | SlotWrite | None,
        default: bool = False,
    ) -> PositionEncoding:
        """Everything attention needs about the positions of one forward's tokens (`PositionEncoding`).

        position_ids: (L,) or (B, L); seq_len: as in `rope.cos_sin` (None = the largest id + 1, which
        costs a host sync); default: the ids are 0..L-1 and seq_len is L, so cos/sin are a slice of the
        table (no gather, no host sync). With a remap and a cache, the tokens' positions are recorded in
        the cache here (before any layer attends), and its far keys are written by every forward, so a
        later forward whose pairs reach a far region finds them all.
        """
        if default:
            cos, sin = self.rope.cos_sin(None, dtype, seq_len=seq_len, device=position_ids.device)
        else:  # (the sync in the gather path is a torch.compile graph break)
            cos, sin = self.rope.cos_sin(position_ids, dtype, seq_len=seq_len)
        extend = self.config.extend
        query_scale = None
        if extend.logn:  # (L,) -> (L, 1), (B, L) -> (B, 1, L, 1): one scale per query row
            scale = logn_scale(position_ids, extend.original_max_len).to(dtype)[..., None]
            query_scale = scale if scale.ndim == 2 else scale[:, None]
        remap = extend.remap
        if remap is None:
            return PositionEncoding(cos, sin, query_scale)
        if kv_cache is not None and not kv_cache.holds(extend):
            raise ValueError(
                f"This KV cache holds no keys for extend={extend.method}; build it with KVCache.for_model "
                "after use_positions."
            )
        # the remapped ids are rotated with the true ids' RoPE length (dynamic NTK's frequencies)
        seq_len = int(position_ids.max()) + 1 if seq_len is None else seq_len
        merge = not extend.plain_within(seq_len)
        if kv_cache is None and not merge:
            return PositionEncoding(cos, sin, query_scale)
        far_queries = tuple(
            self.rope.cos_sin(ids, dtype, seq_len=seq_len)
            for ids in remapped_query_positions(remap, position_ids)
        )
        far_keys = None
        if remap.key_map is not None:
            far_keys = self.rope.cos_sin(remap.key_map(position_ids), dtype, seq_len=seq_len)
        query_positions = position_ids if position_ids.ndim == 2 else position_ids[None]  # (B|1, L)
        key_positions = query_positions if kv_cache is None else kv_cache.record_positions(position_ids)
        prefill = query_positions.shape[-1] > 1  # a decode step (also SlotWrite's) keeps the plain merge
        padded = prefill and kv_cache is not None and kv_cache.key_mask is not None
        if merge and prefill and not padded and consecutive(key_positions):
            start = int(key_positions[0, 0])
            return PositionEncoding(cos, sin, query_scale, far_queries, far_keys, None, remap, start)
        region = regions(remap, query_positions, key_positions)[:, None] if merge else None
        return PositionEncoding(cos, sin, query_scale, far_queries, far_keys, region)

    def hidden_states(
        self,
        x: torch.Tensor,
        encoding: PositionEncoding,
        kv_cache: KVCache | SlotWrite | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """(B, L, C) embeddings -> (B, L, C) normalised hidden states: every block, then the final norm.

        encoding: from `self.position_encoding`; kv_cache and mask as in Attention.forward. `forward` runs this
        between the embedding and the head; a caller with its own positions and mask
        (`fixed_shape_step` of inference/generation.py) runs it directly.
        """
        for block in self.blocks:
            x = block(x, self.rope, encoding, kv_cache, mask)
        return self.norm(x)
