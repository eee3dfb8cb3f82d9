"""Length-extrapolation metrics: windows, perplexities, per-position curves, bootstrap intervals.

    rope = method_rope(ckpt.config.rope, "yarn", matched_factor(4096, 256), train_len=256)
    windows, docs = split_windows(documents, length=4096, max_windows=4)   # (W, 4097), (W,)
    losses = window_losses(model, windows, chunk=1024)                    # (W, 4096) nats per token
    loss, low, high = bootstrap_mean(losses.mean(1), groups=None, seed=0)  # point + 95% interval

Windows are non-overlapping slices of T + 1 tokens (T predictions each) cut from the start of a
document, so window 0 is the YaRN/PI protocol "first T tokens in one forward pass". Everything is
teacher-forced through `score_tokens`: a chunked pass through the KV cache that equals one forward
but never builds a T x T attention matrix, so 16x the training length fits in CPU memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from model.generation import override_rope, score_tokens
from model.kv_cache import KVCache
from model.llama import Llama
from model.rope import SCALINGS, RopeConfig

CKPT_METHOD = "ckpt"  # the checkpoint's own RoPE, unchanged (e.g. a PI / YaRN fine-tune)
METHODS = (*SCALINGS, CKPT_METHOD)


# ----------------------------------------------------------------------------- methods


def matched_factor(length: int, train_len: int) -> float:
    """Scale factor that maps `length` onto the training length ("matched"); never below 1."""
    return max(1.0, length / train_len)


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; valid methods are {', '.join(METHODS)}.")


def method_rope(ckpt_rope: RopeConfig, method: str, factor: float, train_len: int) -> RopeConfig:
    """The RoPE a method evaluates with: the checkpoint's (base, layout, ...) with the scaling
    replaced, `factor` and original_max_len = the checkpoint's training length. `ckpt` = unchanged."""
    check_method(method)
    if method == CKPT_METHOD:
        return ckpt_rope
    factor = 1.0 if method == "none" else float(factor)  # unused by `none`; 1 keeps reports honest
    return override_rope(ckpt_rope, {"scaling": method, "factor": factor, "original_max_len": train_len})


# ----------------------------------------------------------------------------- windows and losses


def split_windows(
    documents: Sequence[np.ndarray], length: int, max_windows: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each document into floor((n - 1) / T) non-overlapping windows of T + 1 tokens, at most
    `max_windows` per document (the first ones). Returns windows (W, T + 1) int64 and the
    document index of each window (W,)."""
    windows, owners = [], []
    for d, doc in enumerate(documents):
        count = (len(doc) - 1) // length
        if max_windows is not None:
            count = min(count, max_windows)
        for k in range(count):
            windows.append(torch.from_numpy(doc[k * length : (k + 1) * length + 1].astype(np.int64)))
            owners.append(d)
    if not windows:
        return torch.empty(0, length + 1, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return torch.stack(windows), torch.tensor(owners)


def window_losses(model: Llama, windows: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-token loss of each window, every window starting at position 0.

    windows: (W, T + 1) ids -> (W, T) float32, loss[w, t] = -log p(x[t + 1] | x[:t + 1]).
    """
    return torch.stack([score_tokens(model, w, chunk).cpu() for w in windows])


def sliding_losses(model: Llama, tokens: torch.Tensor, length: int, stride: int, chunk: int) -> torch.Tensor:
    """Press-style sliding-window evaluation: windows of `length` tokens every `stride` tokens;
    each scores only the tokens no earlier window scored, so every prediction (after the first
    window) sees at least length - stride tokens of context, at positions below `length`.

    tokens: (N + 1,) ids -> (N,) float32 losses aligned with tokens[1:].
    """
    if not 0 < stride <= length:
        raise ValueError(f"sliding_stride must be in [1, {length}] (the window length), got {stride}.")
    n = tokens.numel() - 1
    losses = torch.empty(n)
    scored = 0  # predictions [0, scored) are done
    begin = 0
    while scored < n:
        end = min(begin + length, n)  # this window predicts tokens[begin + 1 : end + 1]
        window = score_tokens(model, tokens[begin : end + 1], chunk).cpu()
        losses[scored:end] = window[scored - begin :]
        scored, begin = end, begin + stride
    return losses


def sliding_window_losses(
    model: Llama, windows: torch.Tensor, owners: torch.Tensor, length: int, stride: int, chunk: int
) -> torch.Tensor:
    """`sliding_losses` over the span each document's windows cover, cut back into the windows.

    windows: (W, T + 1), owners: (W,) as from split_windows -> (W, T), aligned with window_losses.
    """
    out = []
    for d in owners.unique(sorted=True):
        rows = windows[owners == d]  # consecutive windows of one document, sharing end tokens
        span = torch.cat([rows[:, :-1].flatten(), rows[-1, -1:]])  # (k * T + 1,)
        out.append(sliding_losses(model, span, length, stride, chunk).view(len(rows), length))
    return torch.cat(out)


# ----------------------------------------------------------------------------- statistics


def perplexity(loss: float) -> float:
    return math.exp(loss)


def bootstrap_mean(
    values: torch.Tensor | np.ndarray,
    groups: torch.Tensor | np.ndarray | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float, float]:
    """Mean of `values` (W,) and its percentile-bootstrap interval (low, high).

    groups: None resamples the values themselves (windows); otherwise (W,) labels whose groups are
    resampled whole (e.g. documents: windows of one document are correlated).
    Deterministic for a given seed. With a single unit the interval collapses to the mean.
    """
    values = np.asarray(values, dtype=np.float64)
    labels = np.arange(len(values)) if groups is None else np.asarray(groups)
    units = np.unique(labels)
    sums = np.array([values[labels == u].sum() for u in units])
    counts = np.array([(labels == u).sum() for u in units])
    mean = float(sums.sum() / counts.sum())
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(units), size=(n_boot, len(units)))  # (n_boot, units) resampled units
    boots = sums[picks].sum(1) / counts[picks].sum(1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(boots, [tail, 100 - tail])
    return mean, float(min(low, mean)), float(max(high, mean))  # percentile ends can miss a skewed mean


def bucket_curve(curve: torch.Tensor, n_buckets: int) -> list[tuple[int, int, float]]:
    """Average a per-position curve (T,) over at most `n_buckets` equal-width position ranges.

    Returns [(start, end, mean loss over positions [start, end)), ...] for plotting.
    """
    edges = np.unique(np.linspace(0, curve.numel(), min(n_buckets, curve.numel()) + 1).astype(int))
    return [(int(a), int(b), float(curve[a:b].double().mean())) for a, b in zip(edges[:-1], edges[1:])]


# ----------------------------------------------------------------------------- likelihood ranking


@torch.inference_mode()
def continuation_logprobs(
    model: Llama, prompt: Sequence[int], candidates: Sequence[Sequence[int]]
) -> list[float]:
    """Sum of token log-probs of each candidate continuation after `prompt`, sharing one prefill.

    The prompt (n tokens, positions 0..n-1) is cached once; each candidate is then written into the
    slots after it (the cache is rewound to n between candidates). Returns one float per candidate.
    """
    device = model.embed.weight.device
    n, longest = len(prompt), max(map(len, candidates))
    cache = KVCache.for_model(
        model.config,
        1,
        n + longest,
        device=device,
        dtype=model.embed.weight.dtype,
        rope_seq_len=n + longest,  # one dynamic-NTK length for the prompt and every candidate
    )
    last = model(torch.tensor([prompt], device=device), kv_cache=cache)[0, -1]  # (V,) logits after the prompt
    scores = []
    for cand in candidates:
        cache.rewind(n)  # the candidate overwrites the previous one's slots
        ids = torch.tensor([cand], device=device)
        logits = (
            torch.cat([last[None], model(ids[:, :-1], kv_cache=cache)[0]]) if len(cand) > 1 else last[None]
        )
        scores.append(-float(F.cross_entropy(logits.float(), ids[0], reduction="sum")))
    return scores
