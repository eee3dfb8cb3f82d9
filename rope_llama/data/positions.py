"""Position ids of training windows: contiguous (0..L-1), PoSE chunks, or randomized positions.

The model takes (B, L) position ids; training feeds them per batch from the `positions` config group:

- contiguous:  0..L-1 for every window (no ids in the batch: the model's default, bit-identical to before).
- pose:        PoSE (Zhu et al. 2023, arXiv 2309.10400). The window is cut into `chunks` chunks at
               distinct cut points drawn uniformly; chunk i keeps contiguous positions shifted by a skip
               u_i, with u_1 = 0 and u_i ~ U{u_(i-1), ..., target_len - L} (the paper's draw), so the
               first chunk starts at 0 and the last position is below `target_len`. An L-token window
               thus shows relative distances up to target_len - 1. The text itself stays contiguous.
- randomized:  Randomized positional encodings (Ruoss et al. 2023): each window's positions are a
               sorted random subset of L distinct values of [0, target_len).

Draws are a pure function of (seed, batch index), so a resumed run gets the same ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from rope_llama.core.checks import check_number
from rope_llama.data import DataError
from rope_llama.model.rope import MAX_EXACT_POSITIONS

KINDS = ("contiguous", "pose", "randomized")
STREAM = 3  # the ids' own RNG stream: never the window starts' (seed, i) or an epoch's (seed, epoch, 1)


@dataclass(frozen=True)
class PositionsConfig:
    """kind: one of KINDS; target_len: the length the positions span (pose, randomized); chunks: PoSE's."""

    # metadata: each field's allowed values (core/schema.py); `check` adds the rules relative to max_len
    kind: str = field(default="contiguous", metadata={"choices": KINDS})
    target_len: int | None = field(default=None, metadata={"minimum": 1})
    chunks: int = field(default=2, metadata={"minimum": 1})

    @classmethod
    def from_options(cls, options: Mapping | None) -> PositionsConfig:
        """The `positions` config node (None = contiguous); unknown keys are one sentence."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(options) - known):
            raise DataError(
                f"Unknown positions option(s) {', '.join(unknown)}; valid are {', '.join(sorted(known))}."
            )
        return cls(**options)

    def check(self, max_len: int) -> None:
        """Refuse settings that cannot make ids for windows of `max_len` tokens, in one sentence."""
        if self.kind not in KINDS:
            raise DataError(f"positions.kind must be one of {', '.join(KINDS)}, got {self.kind!r}.")
        if self.kind == "contiguous":
            return
        check_number("positions.target_len", self.target_len, minimum=max_len, maximum=MAX_EXACT_POSITIONS,
                     integer=True, allowed=f"an integer >= data.max_len ({max_len}) and <= 2^53 for {self.kind}",
                     error=DataError)  # fmt: skip
        if self.kind == "pose":
            check_number("positions.chunks", self.chunks, minimum=1, maximum=max_len, integer=True,
                         allowed=f"an integer in [1, data.max_len={max_len}]", error=DataError)  # fmt: skip

    def context_len(self, max_len: int) -> int:
        """The context length a model trained with these ids is meant for: PoSE's target, else max_len."""
        return self.target_len if self.kind == "pose" else max_len


def pose_position_ids(
    rng: np.random.Generator, rows: int, length: int, target_len: int, chunks: int
) -> np.ndarray:
    """(rows, length) int64 PoSE ids: `chunks` contiguous runs, the first from 0, each later one shifted by
    a skip drawn from [previous skip, target_len - length]."""
    room = target_len - length
    ids = np.empty((rows, length), np.int64)
    for r in range(rows):
        # where chunks 2..N start: distinct cut points inside the window
        cuts = np.sort(rng.choice(np.arange(1, length), chunks - 1, replace=False))
        sizes = np.diff(np.concatenate([[0], cuts, [length]]))
        skips = np.zeros(chunks, np.int64)
        for c in range(1, chunks):  # u_c ~ U{u_(c-1), ..., room}: skips never decrease
            skips[c] = rng.integers(skips[c - 1], room + 1)
        ids[r] = np.arange(length) + np.repeat(skips, sizes)
    return ids


def randomized_position_ids(rng: np.random.Generator, rows: int, length: int, target_len: int) -> np.ndarray:
    """(rows, length) int64: each row a sorted sample of `length` distinct values of [0, target_len)."""
    return np.stack([np.sort(rng.choice(target_len, length, replace=False)) for _ in range(rows)])


class PositionSampler:
    """Batch i's (B, L) position ids, a pure function of (seed, i); None for contiguous windows."""

    def __init__(self, config: PositionsConfig, batch_size: int, max_len: int, seed: int):
        config.check(max_len)
        self.config, self.batch_size, self.max_len, self.seed = config, batch_size, max_len, seed

    def batch(self, i: int) -> torch.Tensor | None:
        c = self.config
        if c.kind == "contiguous":
            return None
        rng = np.random.default_rng([self.seed, i, STREAM])
        if c.kind == "pose":
            ids = pose_position_ids(rng, self.batch_size, self.max_len, c.target_len, c.chunks)
        else:
            ids = randomized_position_ids(rng, self.batch_size, self.max_len, c.target_len)
        return torch.from_numpy(ids)
