"""Inference engine: prefill + decode through a preallocated KV cache, on-device sampling, scoring.

    sampling = SamplingConfig(temperature=0.8, top_k=50, top_p=0.95)
    out = generate(model, [[bos, *ids]], max_new_tokens=200, sampling=sampling, eos_id=eos, seed=0)
    out.tokens[0]                                    # the new token ids of row 0
    losses = score_tokens(model, tokens, chunk=64)   # (T-1,) per-token NLL, teacher-forced; (B, T) -> (B, T-1)
    buckets = position_buckets(losses, max_len=256)

Positions are explicit: a prompt of n tokens is placed at RoPE positions start_pos..start_pos+n-1,
whatever cache slots it lands in. Batches of prompts are LEFT padded: every row's first real token
sits at start_pos and padding slots are masked out of attention, so a row's output equals running it
alone. Generated ids come back to the host once per step (to stream and to stop); everything else
stays on the device.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from rope_llama.core.checks import check_number
from rope_llama.core.memory import check_fits, forward_bytes, new_kv_cache
from rope_llama.kernels.cpu_decode import NativeDecodeUnavailable, NativeStep, check_supported
from rope_llama.model.kv_cache import KVCache
from rope_llama.model.llama import Llama, PositionEncoding


class GenerationError(ValueError):
    """A user-facing generation problem (empty prompt, cache too small, bad option), one sentence."""


LARGEST_POSITION = torch.iinfo(torch.int64).max  # position ids are int64 tensors


def check_positions(start_pos: int, count: int) -> None:
    """start_pos must be a non-negative integer, and start_pos + count - 1 still an int64 position id."""
    check_number("start_pos", start_pos, minimum=0, integer=True, error=GenerationError)
    if start_pos + count - 1 > LARGEST_POSITION:
        raise GenerationError(
            f"start_pos={start_pos} with {count:,} tokens reaches position {start_pos + count - 1:,}, past the "
            f"largest position id {LARGEST_POSITION:,} (int64); lower start_pos."
        )


# ----------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the logits; validated on construction.

    temperature: divides the logits; 0 means greedy.
    top_k:       sample among the k most likely tokens (0 = no limit).
    top_p:       nucleus: the smallest set of most likely tokens whose probability reaches top_p (1 = all).
    greedy:      always take the argmax (temperature, top_k and top_p are then ignored).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    def __post_init__(self):
        if not (
            isinstance(self.temperature, int | float)
            and math.isfinite(self.temperature)
            and self.temperature >= 0
        ):
            raise GenerationError(
                f"temperature must be a finite number >= 0 (0 = greedy; inf would sample uniform noise), "
                f"got {self.temperature}."
            )
        check_number(
            "top_k", self.top_k, minimum=0, integer=True, means="0 = no limit", error=GenerationError
        )
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1] (1 = no nucleus filter), got {self.top_p}.")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


GREEDY = SamplingConfig(greedy=True)


def sample(
    logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits: (B, V) -> next token ids (B,), chosen on the logits' device (no host sync)."""
    if cfg.is_greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k:  # topk returns the candidates already sorted, which is all top-p needs
        values, candidates = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1)
    elif cfg.top_p < 1:
        values, candidates = logits.sort(dim=-1, descending=True)
    else:
        choice = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        return choice.squeeze(-1)
    if cfg.top_p < 1:
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely candidates
        values = values.masked_fill(mass_before >= cfg.top_p, -math.inf)  # the first one always stays
    choice = torch.multinomial(values.softmax(dim=-1), 1, generator=generator)  # (B, 1) index into candidates
    return candidates.gather(-1, choice).squeeze(-1)


# ----------------------------------------------------------------------------- generation


@dataclass
class Generation:
    """Result of `generate`: new ids per row (eos excluded) and the timings of the two phases."""

    tokens: list[list[int]]
    prompt_tokens: int  # real prompt tokens over all rows (bos included, padding not)
    prefill_seconds: float  # prompt forward + first token, synced
    decode_steps: int  # timed one-token forwards after the prefill
    decode_seconds: float
    compile_seconds: float = 0.0  # compile=True: the first CompiledStep call, which builds or loads the graph

    @property
    def generated_tokens(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens computed by the one-token forwards (every row of the batch) per second."""
        return len(self.tokens) * self.decode_steps / max(self.decode_seconds, 1e-9)


def left_pad(prompts: Sequence[Sequence[int]], start_pos: int, total: int, device) -> tuple:
    """Right-align prompts of different lengths.

    total: KV cache slots (>= n + new tokens). Returns idx (B, n) with padding id 0, position_ids
    (B, total) where row i's first real token is at start_pos and later slots continue from there
    (padding slots repeat start_pos; they are masked), and key_mask (B, total) bool, False on
    padding slots, or None when no row is padded.
    """
    n = max(map(len, prompts))
    pad = torch.tensor([n - len(p) for p in prompts], device=device)[:, None]  # (B, 1)
    idx = torch.zeros(len(prompts), n, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        idx[row, n - len(p) :] = torch.tensor(p, dtype=torch.long)
    slots = torch.arange(total, device=device)[None, :]  # (1, total)
    position_ids = start_pos + (slots - pad).clamp(min=0)
    key_mask = slots >= pad if min(map(len, prompts)) < n else None
    return idx, position_ids, key_mask


def cache_capacity(prompt_len: int, max_new_tokens: int, cache_len: int | None) -> int:
    """KV slots for a generation: prompt + new tokens, or `cache_len` if given (then checked)."""
    needed = prompt_len + max_new_tokens
    if cache_len is None:
        return needed
    check_number("cache_len", cache_len, minimum=1, integer=True, error=GenerationError)
    if needed > cache_len:
        raise GenerationError(
            f"The prompt ({prompt_len} tokens with bos) plus max_new_tokens={max_new_tokens} needs {needed} "
            f"KV cache slots but cache_len={cache_len}; raise cache_len or shorten the prompt or the generation."
        )
    return cache_len


def generation_bytes(
    config, batch: int, prompt_len: int, capacity: int, dtype: torch.dtype, padded: bool, native: bool
) -> int:
    """Bytes `generate` allocates besides the weights for `batch` prompts of up to `prompt_len`
    tokens: the KV cache, the (B, n) prompt ids and (B, capacity) position ids, the prefill forward
    (with its (B, n, n) mask when rows are padded) and, for the native step, cos/sin of every slot."""
    return (
        KVCache.bytes_for_model(config, batch, capacity, dtype)
        + 8 * batch * (prompt_len + capacity)
        + forward_bytes(config, batch, prompt_len, dtype, mask_keys=prompt_len if padded else 0)
        + (2 * 4 * capacity * config.head_dim if native else 0)
    )


def check_generation(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    start_pos: int = 0,
    cache_len: int | None = None,
    compile: bool = False,
    native: bool = False,
    samples: int = 1,
) -> int:
    """Every argument of `generate` and the memory it needs, checked before anything is allocated;
    returns the KV cache capacity. samples: each prompt is generated that many times (generate.py's
    num_samples, one row each), checked before the rows are made. Raises GenerationError or
    MemoryBudgetError (one sentence)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("Every prompt needs at least one token; got an empty prompt.")
    check_number("max_new_tokens", max_new_tokens, minimum=1, integer=True, error=GenerationError)
    if compile and native:
        raise GenerationError("compile and native are two decode paths; choose one of them.")
    n, batch = max(map(len, prompts)), len(prompts) * samples
    capacity = cache_capacity(n, max_new_tokens, cache_len)
    check_positions(start_pos, capacity)  # every slot gets a position id (left_pad)
    padded = min(map(len, prompts)) < n
    dtype = model.embed.weight.dtype
    rows = f" ({len(prompts)} x num_samples={samples:,})" if samples > 1 else ""
    check_fits(
        generation_bytes(model.config, batch, n, capacity, dtype, padded, native),
        f"generating {max_new_tokens:,} tokens after {batch:,} prompt{'s' * (batch > 1)}{rows} of up to {n:,} "
        f"tokens ({capacity:,} KV cache slots)",
        f"{'num_samples, ' * (samples > 1)}max_new_tokens, cache_len or the prompts",
        model.embed.weight.device,
    )
    return capacity


@torch.inference_mode()
def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    *,
    start_pos: int = 0,
    cache_len: int | None = None,
    eos_id: int | Collection[int] | None = None,
    seed: int = 0,
    on_token: Callable[[int, int], bool] | None = None,
    compile: bool = False,
    native: bool = False,
) -> Generation:
    """Prefill every prompt in one forward, then decode one token per step into a preallocated cache.

    prompts: token id lists (bos included by the caller), different lengths allowed (left padded).
    start_pos: absolute RoPE position of each prompt's first token.
    cache_len: KV cache slots (default prompt + max_new_tokens; it must hold at least that).
    eos_id: a row stops when it samples this id, or one of these ids (an instruct model's end of turn too;
        not included in its tokens).
    seed: seeds the torch.Generator used for sampling (same seed, same output).
    on_token(row, token): called on the host for each new token of an unfinished row; return True
        to stop that row (e.g. a stop string was completed). The row keeps the token.
    compile: decode through `CompiledStep` (torch.compile of `fixed_shape_step`): fixed shapes over
        the whole cache, built once per cache shape (seconds on a CPU), then faster per token.
    native: decode through `NativeStep`, the C step of kernels/cpu_decode.c (one sequence, float32,
        CPU; built once per machine): the fastest CPU path. Not together with compile.
    Generation ends when every row stopped or after max_new_tokens steps. Every argument and the
    memory needed are checked first (check_generation): a refusal allocates nothing.
    """
    capacity = check_generation(
        model,
        prompts,
        max_new_tokens,
        start_pos=start_pos,
        cache_len=cache_len,
        compile=compile,
        native=native,
    )
    device = model.embed.weight.device
    n, batch = max(map(len, prompts)), len(prompts)
    idx, position_ids, key_mask = left_pad(prompts, start_pos, capacity, device)
    # check_generation counted this cache: one reading of the free memory per call, not two
    cache = KVCache.for_model(model, batch, capacity, seq_len=start_pos + n + max_new_tokens)
    cache.key_mask = key_mask
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens: list[list[int]] = [[] for _ in range(batch)]
    active = [True] * batch
    stops = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)

    if native:
        try:
            check_supported(model, cache)  # the C step computes this model: checked before the prefill
        except NativeDecodeUnavailable as e:
            raise GenerationError(str(e)) from None
    step_class = NativeStep if native else CompiledStep if compile else EagerStep
    one_token = None  # built once a second token is needed: its setup is not part of the first token's time
    untimed = 1 if compile else 0  # the first compiled step builds the graph: timed on its own

    t0 = time.perf_counter()
    logits = model(idx, position_ids=position_ids[:, :n], kv_cache=cache, last_only=True)[:, -1]
    for step in range(max_new_tokens):
        next_token = sample(logits, sampling, generator)  # (B,)
        for row, token in enumerate(next_token.tolist()):  # the one host sync per step
            if not active[row]:
                continue
            if token in stops:
                active[row] = False
                continue
            tokens[row].append(token)
            if on_token is not None and on_token(row, token):
                active[row] = False
        if step == 0:
            t_prefill = t1 = time.perf_counter()
        elif step <= untimed:  # after the compiled step's first call
            t1 = time.perf_counter()
        if not any(active) or step == max_new_tokens - 1:
            break
        if one_token is None:
            one_token = step_class(model, cache, position_ids)
        logits = one_token(next_token[:, None])
    t2 = time.perf_counter()
    decode_steps = max(step - untimed, 0)
    return Generation(tokens, sum(map(len, prompts)), t_prefill - t0, decode_steps, t2 - t1, t1 - t_prefill)


# ----------------------------------------------------------------------------- one-token steps
# The decode loop of `generate` calls one of three steps, all with one contract: token ids (B, 1) ->
# next-token logits (B, V), the tokens' keys and values written at slot `cache.length`, the cache
# advanced by one. position_ids: (B, slots), the position of every slot of the generation.
#   EagerStep     the model's forward over the filled slots: the reference
#   CompiledStep  `fixed_shape_step` under torch.compile (generate(compile=True))
#   NativeStep    the C step of kernels/cpu_decode.py (generate(native=True))


class EagerStep:
    """The model's forward for one token per row over the filled cache slots."""

    def __init__(self, model: Llama, cache: KVCache, position_ids: torch.Tensor):
        self.model, self.cache, self.position_ids = model, cache, position_ids

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        positions = self.position_ids[:, self.cache.length, None]  # (B, 1)
        return self.model(token, position_ids=positions, kv_cache=self.cache)[:, -1]


def fixed_shape_step(
    model: Llama,
    token: torch.Tensor,
    encoding: PositionEncoding,
    cache: KVCache,
    slot: torch.Tensor,
) -> torch.Tensor:
    """The one-token forward whose shapes never change: token ids (B, 1) written at the (1,) long
    cache `slot`, attending over every slot under the slot mask (KVCache.at_slot) -> logits (B, V).

    encoding: the tokens' `model.position_encoding(ids, dtype, seq_len, cache.at_slot(slot))`, ids (B, 1);
    with a remap its region tensor covers every slot. No Python number in it changes from step
    to step, so torch.compile builds it once per cache shape. The caller advances the cache.
    """
    write = cache.at_slot(slot)
    x = model.hidden_states(model.embed_tokens(token, write), encoding, write, write.mask())
    return model.lm_head(x[:, -1])


# torch.compile options of the fixed-shape step. cpp_wrapper: the graph's kernel calls run from C++,
# not Python (docs/performance.md has the gain). The guard filter skips re-checking torch.nn's own
# modules (Linear, RMSNorm, Embedding) on every call; their weights are graph inputs, so new values
# are still used, and our own modules (the shared rope, whose config sets the layout) stay guarded.
COMPILE_OPTIONS = {
    "cpp_wrapper": True,
    "guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe,
}


@functools.cache
def compiled_fixed_shape_step() -> Callable:
    """torch.compile of `fixed_shape_step`, wrapped once per process rather than once per generation
    (building the wrapper is not free). The model is an argument, so any model shares it; Dynamo
    builds one graph per cache shape."""
    return torch.compile(fixed_shape_step, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS)


class CompiledStep:
    """`fixed_shape_step` under torch.compile. The positions' cos/sin (and what an extension adds) are
    gathered outside the graph, and the slot is a tensor, so the graph sees no Python number that
    changes."""

    def __init__(self, model: Llama, cache: KVCache, position_ids: torch.Tensor):
        self.model, self.cache, self.position_ids = model, cache, position_ids
        self.step = compiled_fixed_shape_step()

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        ids, slot = self.position_ids[:, cache.length, None], cache.next_slot()  # (B, 1), (1,)
        encoding = self.model.position_encoding(
            ids, self.model.embed.weight.dtype, cache.seq_len, cache.at_slot(slot)
        )
        logits = self.step(self.model, token, encoding, cache, slot)
        cache.advance(1)
        return logits


class TextStream:
    """Incremental detokenizer for one row: push token ids, get back the newly completed text.

    Text is only released once its UTF-8 bytes are complete (byte-level BPE can split a character
    across tokens) and once it cannot be the start of a stop string. When a stop string appears,
    the text is cut before it and `stopped` becomes True.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.text = ""  # complete text so far (cut at a stop string)
        self.stopped = False
        self._ids: list[int] = []
        self._context = 0  # ids[_context:_decoded] is the last decoded piece
        self._decoded = 0  # ids[:_decoded] are already in self.text
        self._released = 0  # len of the text already returned

    def push(self, token: int) -> str:
        """Add one id; return the text that became final (maybe "")."""
        self._ids.append(token)
        piece = self._decode_new(final=False)
        return "" if piece is None else self._extend(piece, final=False)

    def finish(self) -> str:
        """End of generation: release everything still held back."""
        return self._extend(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str | None:
        """Text of the ids not decoded yet; None while their last UTF-8 character is incomplete.

        Only a short window is decoded (O(1) per step), with the previous piece as context so that
        tokenizers which drop a leading space at the start of a decode (SentencePiece) stay exact.
        """
        context = self.decode(self._ids[self._context : self._decoded])
        window = self.decode(self._ids[self._context :])
        if window.endswith("\ufffd") and not final:  # a character split across tokens: wait for its bytes
            return None
        self._context, self._decoded = self._decoded, len(self._ids)
        return window[len(context) :]

    def _extend(self, piece: str, final: bool) -> str:
        if self.stopped:
            return ""
        search_from = max(0, len(self.text) - max(map(len, self.stop), default=0))
        self.text += piece
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        out, self._released = self.text[self._released : end], end
        return out

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        return max(
            (k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])),
            default=0,
        )


# ----------------------------------------------------------------------------- scoring


def check_scoring(
    model: Llama,
    n_tokens: int,
    chunk: int,
    start_pos: int = 0,
    knob: str = "chunk or the number of tokens",
    rows: int = 1,
) -> None:
    """`score_tokens`' options and the memory it needs to predict `n_tokens` tokens in each of `rows`
    sequences (its cache of rows x n_tokens slots, ids, positions and losses, and a chunk's forward
    over every row with a mask over every key and the float32 log-softmax of its logits), checked
    before anything is allocated; `knob` names the options to lower in the refusal."""
    check_number("chunk", chunk, minimum=1, integer=True, error=GenerationError)
    check_positions(start_pos, n_tokens)
    dtype, chunk_len = model.embed.weight.dtype, min(chunk, n_tokens)
    nbytes = (
        KVCache.bytes_for_model(model.config, rows, n_tokens, dtype)
        + (8 + 4) * rows * n_tokens  # int64 ids, float32 losses
        + 8 * n_tokens  # int64 positions, shared by the rows
        + forward_bytes(model.config, rows, chunk_len, dtype, mask_keys=n_tokens if n_tokens > chunk else 0)
        + 4 * model.config.vocab_size * rows * chunk_len
    )
    what = f"{rows:,} x {n_tokens:,}" if rows > 1 else f"{n_tokens:,}"
    check_fits(nbytes, f"scoring {what} tokens in chunks of {chunk:,}", knob, model.embed.weight.device)


@torch.inference_mode()
def score_tokens(model: Llama, tokens: torch.Tensor, chunk: int, start_pos: int = 0) -> torch.Tensor:
    """Teacher-forced per-token loss, streamed through the KV cache `chunk` tokens at a time (one
    forward without a cache when the text fits in one chunk).

    tokens: (T,) ids, or (B, T) ids scored together (one cache of B rows, B x chunk tokens per
    forward); every row is placed at positions start_pos..start_pos+T-1.
    Returns (T-1,) or (B, T-1) float32: loss[..., i] = -log p(tokens[..., i+1] | tokens[..., :i+1]),
    predicted at position start_pos+i. Each row equals one full forward over its tokens[:-1] alone
    (same positions, same dynamic-NTK length).
    """
    if tokens.ndim not in (1, 2) or tokens.shape[0] == 0 or tokens.shape[-1] < 2:
        raise GenerationError(
            f"Scoring needs (T,) or (B, T) token ids with B >= 1 and T >= 2, got shape {tuple(tokens.shape)}."
        )
    rows = tokens.reshape(-1, tokens.shape[-1])  # (B, T)
    batch, n = rows.shape[0], rows.shape[1] - 1  # n predictions per row
    check_scoring(model, n, chunk, start_pos, rows=batch)
    device = model.embed.weight.device
    rows = rows.to(device)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    if n <= chunk:  # one forward: no cache to fill (and at start 0, the table's positions as they are)
        position_ids = None if start_pos == 0 else torch.arange(start_pos, start_pos + n, device=device)
        losses = model(inputs, position_ids=position_ids, targets=targets, reduction="none")
        return losses.view(*tokens.shape[:-1], n)
    position_ids = torch.arange(start_pos, start_pos + n, device=device)
    cache = new_kv_cache(model, batch, n, seq_len=start_pos + n)
    losses = torch.empty(batch, n, device=device)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        losses[:, s:e] = model(  # (B, e - s): the kernels' head never holds more than a chunk of logits
            inputs[:, s:e],
            position_ids=position_ids[s:e],
            kv_cache=cache,
            targets=targets[:, s:e],
            reduction="none",
        )
    return losses.view(*tokens.shape[:-1], n)


@dataclass(frozen=True)
class Bucket:
    """Mean loss over the predictions made at positions [start, end)."""

    start: int
    end: int
    tokens: int
    loss: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def position_buckets(losses: torch.Tensor, max_len: int, start_pos: int = 0) -> list[Bucket]:
    """Group per-token losses by position: [0, L), [L, 2L), [2L, 4L), [4L, 8L), ... (empty ones dropped).

    losses: (N,) as returned by score_tokens; losses[i] was predicted at position start_pos + i.
    """
    buckets, end = [], start_pos + losses.numel()
    lo, hi = 0, max_len
    while lo < end:
        first, last = max(lo, start_pos) - start_pos, min(hi, end) - start_pos  # slice of `losses`
        if last > first:
            buckets.append(Bucket(lo, hi, last - first, float(losses[first:last].double().mean())))
        lo, hi = hi, 2 * hi
    return buckets
