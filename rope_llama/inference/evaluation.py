"""Length-extrapolation metrics: windows, perplexities, per-position curves, bootstrap intervals.

    rope, extend = method_positions(ckpt.config, "yarn+logn", matched_factor(4096, 256))  # RoPE + extension
    model.use_positions(rope, extend)
    windows, docs = split_windows(documents, length=4096, max_windows=4)   # (W, 4097), (W,)
    losses = window_losses(model, windows, chunk=1024, batch=2)           # (W, 4096) nats per token
    loss, low, high = bootstrap_mean(losses.mean(1), groups=None, seed=0)  # point + 95% interval

Windows are non-overlapping slices of T + 1 tokens (T predictions each) cut from the start of a
document, so window 0 is the YaRN/PI protocol "first T tokens in one forward pass". Everything is
teacher-forced through `score_tokens`: a chunked pass through the KV cache that equals one forward
but never builds a T x T attention matrix, so 16x the training length fits in CPU memory; `batch`
windows share each pass (a cache of `batch` rows), every row equal to scoring it alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from rope_llama.core.memory import check_fits, new_kv_cache
from rope_llama.inference.generation import GREEDY, EagerStep, left_pad, sample, score_tokens
from rope_llama.model.config import ModelConfig
from rope_llama.model.context import resolve_positions
from rope_llama.model.extend import EXTEND_METHODS, ExtendConfig
from rope_llama.model.llama import Llama
from rope_llama.model.rope import SCALINGS, RopeConfig

CKPT_METHOD = "ckpt"  # the checkpoint's own RoPE and extension, unchanged (e.g. a PI / YaRN fine-tune)
METHODS = (*SCALINGS, CKPT_METHOD)  # the RoPE part of a method
EXTENSIONS = tuple(m for m in EXTEND_METHODS if m != "none")  # the extension part (model/extend.py)


# ----------------------------------------------------------------------------- methods


def matched_factor(length: int, max_len: int) -> float:
    """Scale factor that maps `length` onto the training length ("matched"); never below 1."""
    return max(1.0, length / max_len)


def split_method(method: str) -> tuple[str, str | None]:
    """A method is a RoPE method (`yarn`), an extension (`self_extend`, on the plain RoPE `none`) or
    both (`yarn+logn`) -> (RoPE method, extension or None)."""
    rope, plus, extension = method.partition("+")
    if not plus and rope in EXTENSIONS:
        rope, extension = "none", rope
    if rope not in METHODS or (plus and extension not in EXTENSIONS):
        raise ValueError(
            f"Unknown method {method!r}; a method is a RoPE method ({', '.join(METHODS)}), an extension "
            f"({', '.join(EXTENSIONS)}) or <RoPE method>+<extension>, e.g. yarn+logn."
        )
    return rope, extension or None


def check_method(method: str) -> None:
    split_method(method)


def method_positions(
    checkpoint: ModelConfig,
    method: str,
    factor: float,
    rope_options: dict | None = None,
    extend_options: dict | None = None,
) -> tuple[RopeConfig, ExtendConfig]:
    """The RoPE and extension a method evaluates with, resolved against the checkpoint's own frozen
    config (model/context.py): a named scaling replaces the checkpoint's with `factor` (1 for `none`),
    relative to the checkpoint's context length; `ckpt` keeps its own; an extension is the one the method
    names (none when it names none, except `ckpt` alone, which keeps the checkpoint's own).
    rope_options / extend_options: fields set for every method (e.g. base; window, group)."""
    scaling, extension = split_method(method)
    rope = dict(rope_options or {})
    if scaling == CKPT_METHOD:  # its own RoPE; options change only what they name
        rope = {"original_max_len": checkpoint.rope.original_max_len, **rope} if rope else None
    else:
        factor = 1.0 if scaling == "none" else float(factor)  # unused by `none`; 1 keeps reports honest
        rope.update(scaling=scaling, factor=factor, original_max_len=None)
    extend = None
    if extension is not None or scaling != CKPT_METHOD:
        extend = {**(extend_options or {}), "method": extension or "none", "original_max_len": None}
    return resolve_positions(checkpoint, rope, extend)


# ----------------------------------------------------------------------------- windows and losses


def split_windows(
    documents: Sequence[np.ndarray], length: int, max_windows: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each document into floor((n - 1) / T) non-overlapping windows of T + 1 tokens, at most
    `max_windows` per document (the first ones). Returns windows (W, T + 1) int64 and the
    document index of each window (W,)."""
    windows, owners = [], []
    for d, (doc, count) in enumerate(zip(documents, window_counts(documents, length, max_windows))):
        for k in range(count):
            windows.append(torch.from_numpy(doc[k * length : (k + 1) * length + 1].astype(np.int64)))
            owners.append(d)
    if not windows:
        return torch.empty(0, length + 1, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return torch.stack(windows), torch.tensor(owners)


def window_counts(documents: Sequence[np.ndarray], length: int, max_windows: int | None) -> list[int]:
    """How many windows of `length` tokens `split_windows` cuts from each document."""
    counts = [(len(doc) - 1) // length for doc in documents]
    return counts if max_windows is None else [min(c, max_windows) for c in counts]


def rows_per_forward(batch_tokens: int, length: int) -> int:
    """How many sequences of `length` tokens share one forward: as many as fit in `batch_tokens`
    tokens, at least one."""
    return max(1, batch_tokens // length)


def window_losses(model: Llama, windows: torch.Tensor, chunk: int, batch: int = 1) -> torch.Tensor:
    """Per-token loss of each window, every window starting at position 0, `batch` windows per
    scoring pass (each row's losses equal scoring it alone).

    windows: (W, T + 1) ids -> (W, T) float32, loss[w, t] = -log p(x[t + 1] | x[:t + 1]).
    """
    return torch.cat(
        [score_tokens(model, windows[i : i + batch], chunk).cpu() for i in range(0, len(windows), batch)]
    )


def sliding_losses(
    model: Llama, tokens: torch.Tensor, length: int, stride: int, chunk: int, batch: int = 1
) -> torch.Tensor:
    """Press-style sliding-window evaluation: windows of `length` tokens every `stride` tokens;
    each scores only the tokens no earlier window scored, so every prediction (after the first
    window) sees at least length - stride tokens of context, at positions below `length`.
    The whole windows are scored `batch` per pass; a shorter last one (its own dynamic-NTK length) alone.

    tokens: (N + 1,) ids -> (N,) float32 losses aligned with tokens[1:].
    """
    if not 0 < stride <= length:
        raise ValueError(f"sliding_stride must be in [1, {length}] (the window length), got {stride}.")
    n = tokens.numel() - 1
    pieces, scored, begin = [], 0, 0  # predictions [0, scored) are done; the next window starts at begin
    if n >= length:
        whole = tokens.unfold(0, length + 1, stride)  # (K, length + 1): the windows that fit whole
        losses = window_losses(model, whole, chunk, batch)  # (K, length)
        pieces = [losses[0], losses[1:, length - stride :].flatten()]  # later windows: their last `stride`
        scored, begin = (len(whole) - 1) * stride + length, len(whole) * stride
    if scored < n:  # the last window reaches the end before filling `length`
        pieces.append(score_tokens(model, tokens[begin:], chunk).cpu()[scored - begin :])
    return torch.cat(pieces)


def sliding_window_losses(
    model: Llama,
    windows: torch.Tensor,
    owners: torch.Tensor,
    length: int,
    stride: int,
    chunk: int,
    batch: int = 1,
) -> torch.Tensor:
    """`sliding_losses` over the span each document's windows cover, cut back into the windows.

    windows: (W, T + 1), owners: (W,) as from split_windows -> (W, T), aligned with window_losses.
    """
    out = []
    for d in owners.unique(sorted=True):
        rows = windows[owners == d]  # consecutive windows of one document, sharing end tokens
        span = torch.cat([rows[:, :-1].flatten(), rows[-1, -1:]])  # (k * T + 1,)
        out.append(sliding_losses(model, span, length, stride, chunk, batch).view(len(rows), length))
    return torch.cat(out)


# ----------------------------------------------------------------------------- statistics


def perplexity(loss: float) -> float:
    return math.exp(loss)


def bootstrap_bytes(n_boot: int, units: int) -> int:
    """Bytes `bootstrap_mean` allocates for `n_boot` resamples of `units` units: the (n_boot, units) int64
    picks and the sums and counts they gather, then the replicates, their counts and percentile's copy."""
    return 3 * 8 * n_boot * units + 3 * 8 * n_boot


def check_bootstrap(n_boot: int, units: int) -> None:
    """The memory budget for `n_boot` resamples of `units` units (numpy: host memory), before any is drawn."""
    check_fits(bootstrap_bytes(n_boot, units), f"{n_boot:,} bootstrap resamples of {units:,} units", "n_boot")


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
    check_bootstrap(n_boot, len(units))
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


def forward_groups(lengths: Sequence[int], rows: int, dynamic: bool) -> list[list[int]]:
    """Indices of the sequences that share one forward, in order, at most `rows` at a time.

    lengths: the length each sequence's dynamic-NTK frequencies are fixed for when it runs alone.
    dynamic: the RoPE is dynamic NTK, whose frequencies depend on that length: then only sequences
    of equal length share a forward, so every row computes exactly what it computes alone.
    """
    by_length: dict[int | None, list[int]] = {}
    for i, length in enumerate(lengths):
        by_length.setdefault(length if dynamic else None, []).append(i)
    return [group[k : k + rows] for group in by_length.values() for k in range(0, len(group), rows)]


def answered_length(prompt_len: int, candidates: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """The length `answer_and_rank` fixes dynamic NTK for, for one prompt alone: the prompt plus the
    longer of its greedy answer and its longest candidate (`forward_groups` groups by it)."""
    return prompt_len + max(max_new_tokens, *map(len, candidates))


def continuation_logprobs(
    model: Llama, prompts: Sequence[Sequence[int]], candidates: Sequence[Sequence[Sequence[int]]]
) -> list[list[float]]:
    """Sum of token log-probs of each prompt's candidate continuations, sharing one prefill
    (`answer_and_rank` without the greedy answer). Returns B lists of C floats."""
    return answer_and_rank(model, prompts, candidates, max_new_tokens=0)[1]


@torch.inference_mode()
def answer_and_rank(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    candidates: Sequence[Sequence[Sequence[int]]],
    max_new_tokens: int,
) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
    """Each prompt's greedy continuation, its candidates' log-probs and its next-token log-probs,
    from ONE prefill: the long prompt is the cost, the few new tokens are not.

    prompts: B token lists, left padded into one forward (row i at positions 0..n_i-1, as alone).
    candidates: per prompt, C non-empty token lists (the same C for every prompt).
    max_new_tokens: greedy tokens decoded into the slots after the prompts (0: none); then the cache
    is rewound to the prompts, and candidate c of every row is written into the same slots in one
    forward, rewound again between candidates. Dynamic NTK is fixed for the longest prompt +
    max(max_new_tokens, its longest candidate) of any row, which is each row's own (as alone) when
    they all share it (`forward_groups`).
    Returns (B greedy token lists of max_new_tokens, B lists of C summed log-probs, the (B, V) float32
    log-probs of the token after each prompt).
    """
    counts = sorted({len(row) for row in candidates})
    if len(candidates) != len(prompts) or len(counts) != 1:
        raise ValueError(
            f"Scoring continuations needs one candidate list per prompt, all of one size; got {len(prompts)} "
            f"prompts and {len(candidates)} lists of sizes {counts}."
        )
    device = model.embed.weight.device
    n, longest = max(map(len, prompts)), max(len(c) for row in candidates for c in row)
    slots = max(longest, max_new_tokens)
    idx, position_ids, key_mask = left_pad(prompts, 0, n + slots, device)
    cache = new_kv_cache(
        model,
        len(prompts),
        n + slots,
        seq_len=max(answered_length(len(p), row, max_new_tokens) for p, row in zip(prompts, candidates)),
    )
    cache.key_mask = key_mask
    # (B, 1, V): the logits after each prompt, the only ones read
    last = model(idx, position_ids=position_ids[:, :n], kv_cache=cache, last_only=True)
    answers, step, logits = [], EagerStep(model, cache, position_ids), last[:, -1]
    for i in range(max_new_tokens):
        answers.append(sample(logits, GREEDY))  # (B,)
        if i < max_new_tokens - 1:
            logits = step(answers[-1][:, None])
    greedy = torch.stack(answers, 1).tolist() if answers else [[] for _ in prompts]
    scores = []
    for column in zip(*candidates):  # candidate c of every prompt
        cache.rewind(n)  # overwrites the greedy tokens' and the previous candidates' slots
        width = max(map(len, column))
        # right padded: a slot after a row's candidate never changes the logits of its tokens
        ids = torch.tensor([[*c, *[0] * (width - len(c))] for c in column], device=device)  # (B, width)
        if width > 1:
            after = model(ids[:, :-1], position_ids=position_ids[:, n : n + width - 1], kv_cache=cache)
            logits = torch.cat([last, after], 1)  # (B, width, V): the logits predicting ids
        else:
            logits = last
        logprobs = logits.float().log_softmax(-1).gather(-1, ids[..., None])[..., 0]  # (B, width)
        sizes = torch.tensor([len(c) for c in column], device=device)
        real = torch.arange(width, device=device) < sizes[:, None]  # (B, width): each row's own tokens
        scores.append(logprobs.where(real, 0.0).sum(1))
    return greedy, torch.stack(scores, 1).tolist(), last[:, -1].float().log_softmax(-1)
