"""The attention a model computes on one window, reduced to what can be drawn (scripts/visualize.py
view=attention): per layer and head, the mass at each relative distance, the entropy of each query's
row, a pooled query x key heatmap, and a needle's share of the last query's attention.

    maps = record_attention(model, tokens, heat_layers=[0, 3], grid=128, needle=(120, 131))
    maps.distance_mass   # (layers, H, L): mean over queries of the probability at distance d (sums to 1)
    maps.entropy         # (layers, H, Q): nats, per recorded query (the last Q = `queries` of the window)
    maps.heatmaps[0]     # (H, G, G): mean probability per cell of a G x G grid over queries x keys
    maps.needle_mass     # (layers, H): the last query's probability on the needle's tokens

Layers not in `layers` are not recorded (their rows stay 0); `queries` keeps the cost of a long window to
its last rows, where the positions past the training length are.

Each layer's Attention calls its `observer` with the very queries, keys and merge rule it attends with,
and the probabilities come from model/extend.py's `attention_probabilities`, which the merged attention
itself reads: a map is the model's attention (a remap's merged one included), not a re-derivation.
The rows are processed in blocks, so memory stays bounded by the block, not by L x L.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rope_llama.model.extend import attention_probabilities
from rope_llama.model.llama import Llama


@dataclass
class AttentionMaps:
    """What `record_attention` keeps of one forward (shapes in the module docstring)."""

    distance_mass: torch.Tensor
    entropy: torch.Tensor
    heatmaps: dict[int, torch.Tensor] = field(default_factory=dict)
    needle_mass: torch.Tensor | None = None


class _Recorder:
    """The observer every Attention layer calls during one forward of a single sequence."""

    def __init__(self, layers: int, heads: int, length: int, queries: int, heat_layers, grid: int, needle):
        self.length, self.first, self.needle = length, length - queries, needle
        self.grid = min(grid, queries)
        self.heat_layers = set(heat_layers)
        self.mass = torch.zeros(layers, heads, length, dtype=torch.float64)
        self.entropy = torch.zeros(layers, heads, queries, dtype=torch.float64)
        self.needle_mass = torch.zeros(layers, heads, dtype=torch.float64) if needle else None
        self.heatmaps: dict[int, torch.Tensor] = {}

    def __call__(self, layer, q, k, q_far, k_far, region, mask) -> None:
        L, S = q.shape[2], k.shape[2]
        if q.shape[0] != 1 or L != self.length or S != L:
            raise ValueError("Attention maps are recorded on one whole window without a KV cache.")
        first, queries = self.first, L - self.first
        key_bins = torch.arange(L, device=q.device) * self.grid // L  # the grid cell of each key slot
        query_bins = (torch.arange(L, device=q.device) - first).clamp(min=0) * self.grid // queries
        heat = torch.zeros(q.shape[1], self.grid, self.grid, dtype=torch.float64, device=q.device)
        for a, b, probs in attention_probabilities(q, k, q_far, k_far, region, mask, first):
            probs = probs.flatten(1, 2)[0].double()  # (H, b - a, end)
            end = probs.shape[-1]
            rows = torch.arange(a, b, device=q.device)
            distance = (rows[:, None] - torch.arange(end, device=q.device)[None]).clamp(min=0)
            flat = distance.flatten().expand(probs.shape[0], -1)
            self.mass[layer].scatter_add_(1, flat.cpu(), probs.flatten(1).cpu())  # masked pairs add 0
            self.entropy[layer, :, a - first : b - first] = -torch.special.xlogy(probs, probs).sum(-1).cpu()
            if layer in self.heat_layers:
                per_key = torch.zeros(probs.shape[0], b - a, self.grid, dtype=torch.float64, device=q.device)
                per_key.index_add_(2, key_bins[:end], probs)
                heat.index_add_(1, query_bins[a:b], per_key)
            if self.needle and a <= L - 1 < b:
                start, stop = self.needle
                self.needle_mass[layer] = probs[:, L - 1 - a, start:stop].sum(-1).cpu()
        self.mass[layer] /= queries
        if layer in self.heat_layers:
            key_counts = torch.bincount(key_bins, minlength=self.grid).double()
            query_counts = torch.bincount(query_bins[first:], minlength=self.grid).double()
            self.heatmaps[layer] = (heat / (query_counts[:, None] * key_counts[None, :])).cpu()


@torch.inference_mode()
def record_attention(
    model: Llama,
    tokens: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    heat_layers=(),
    grid: int = 128,
    needle: tuple[int, int] | None = None,
    layers=None,
    queries: int | None = None,
) -> AttentionMaps:
    """One forward of `tokens` (L,) at `position_ids` (L,) (None = 0..L-1) through `model`, recording the
    attention of `layers` (None = every layer; module docstring) for the last `queries` rows (None = all);
    heatmaps for `heat_layers`, `grid` cells per side; `needle` = the [start, stop) token span whose share
    of the last query's attention is kept."""
    cfg = model.config
    queries = len(tokens) if queries is None else min(queries, len(tokens))
    recorder = _Recorder(cfg.n_layers, cfg.n_heads, len(tokens), queries, heat_layers, grid, needle)
    chosen = range(cfg.n_layers) if layers is None else sorted(set(layers) | set(heat_layers))
    attentions = [model.blocks[i].attn for i in chosen]
    for attention in attentions:
        attention.observer = recorder
    try:
        ids = None if position_ids is None else position_ids[None]
        model(tokens[None].to(model.embed.weight.device), position_ids=ids, last_only=True)
    finally:
        for attention in attentions:
            attention.observer = None
    return AttentionMaps(recorder.mass, recorder.entropy, recorder.heatmaps, recorder.needle_mass)
