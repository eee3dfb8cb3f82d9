"""LightningDataModule serving (input, target) windows of `max_len` tokens from the token cache.

    dm = TextDataModule(source={"kind": "shakespeare"}, max_len=256, batch_size=32)
    dm.prepare_data(); dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))   # (B, max_len) int64 each; y[:, t] == x[:, t + 1]

A training batch is (inputs, targets[, target_weights[, position_ids]]), each (B, max_len): weights when
recall windows weigh their targets (None when only position ids follow), position ids when `positions` is
not contiguous (data/positions.py).

Training batches are random windows; batch number i is a pure function of (seed, i), and the DataModule
counts the batches the Lightning training loop has taken, so `state_dict()` / `load_state_dict()` (stored in
checkpoints by Lightning) resume the exact batch stream. Validation/test use fixed contiguous windows.

`batch_size` and `val_batch_size` are global: under data parallelism each of the W processes takes its
1/W of the rows of every batch, so the number of processes changes the speed, not the windows trained on
or scored (the unweighted loss averaged over the ranks is the one-process batch mean).
"""

import os
from collections.abc import Mapping

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from rope_llama.core.checks import check_number
from rope_llama.data import DataError
from rope_llama.data.cache import SHARD_TOKENS, TOKENIZER_SAMPLE_CHARS, TokenCache, prepare
from rope_llama.data.positions import PositionSampler, PositionsConfig
from rope_llama.data.recall import RecallConfig, RecallMixer
from rope_llama.data.shards import ShardedTokens
from rope_llama.data.tokenizer import Tokenizer


def _window_pair(
    tokens: ShardedTokens, starts: np.ndarray, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of max_len + 1 tokens at `starts` (B,) -> input (B, max_len), target (B, max_len) int64."""
    w = torch.from_numpy(np.stack([tokens.read(int(s), max_len + 1) for s in starts]).astype(np.int64))
    return w[:, :-1], w[:, 1:]


SAMPLINGS = ("random", "shuffled")


class RandomWindows(IterableDataset):
    """Yields whole training batches; batch i's B window starts are a pure function of (seed, i).

    `sampling="random"`: independent uniform starts from an RNG seeded with (seed, i), so in one epoch's
    worth of batches some text is drawn twice and about 1/e of it never. `"shuffled"`: each epoch cuts the
    tokens into non-overlapping windows at an offset drawn for that epoch and visits them in a shuffled
    order, so every token is trained on once per epoch (but for the fewer than B windows that the epoch's
    whole batches cannot hold, a different few each epoch).

    An "epoch" is len(self) batches (about one pass over the training tokens). Iteration starts at batch
    `self.consumed` and stops at the end of that epoch. With DataLoader workers, worker w yields batches
    i = w, w + W, ...; the DataLoader interleaves workers round-robin, so the order matches num_workers=0.
    Process `rank` of `world` data-parallel processes yields rows [rank * B / world, (rank + 1) * B / world)
    of each batch.
    """

    def __init__(
        self,
        data: ShardedTokens,
        batch_size: int,
        max_len: int,
        seed: int,
        recall: RecallMixer | None = None,
        sampling: str = "random",
        positions: PositionSampler | None = None,
    ):
        self.data, self.batch_size, self.max_len, self.seed = data, batch_size, max_len, seed
        self.sampling = sampling
        self.positions = positions  # position ids per batch (data/positions.py); None = contiguous
        self._epoch_starts: tuple[int, np.ndarray] | None = None  # (epoch, its shuffled starts): built once
        self.recall = recall  # data.recall: turns some training windows into recall windows (data/recall.py)
        self.consumed = (
            0  # batches taken by the training loop; advanced by TextDataModule.on_before_batch_transfer
        )
        self.rank, self.world = 0, 1  # set by TextDataModule from the trainer (data parallelism)

    def __len__(self) -> int:
        return max(1, self.data.n // (self.batch_size * self.max_len))

    def batch(self, i: int) -> tuple[torch.Tensor | None, ...]:
        """(input, target), each (B, L) int64, plus (B, L) loss weights when the recall windows weigh
        their targets (data.recall.answer_weight or unstated_share), plus (B, L) int64 position ids
        when they are not contiguous (the weights then None if the targets are unweighted)."""
        x, y = _window_pair(self.data, self.starts(i), self.max_len)
        # every rank builds the whole batch (its RNG draws are shared) and keeps its rows
        full = (x, y) if self.recall is None else self.recall.mix(i, x, y)
        ids = None if self.positions is None else self.positions.batch(i)
        if ids is not None:
            full = (*full, ids) if len(full) == 3 else (*full, None, ids)
        rows = self.batch_size // self.world
        return tuple(t if t is None else t[self.rank * rows : (self.rank + 1) * rows] for t in full)

    def starts(self, i: int) -> np.ndarray:
        """(B,) first tokens of batch i's windows; the last possible start is n - max_len - 1."""
        if self.sampling == "random":
            return np.random.default_rng([self.seed, i]).integers(
                0, self.data.n - self.max_len, size=self.batch_size
            )
        epoch, j = divmod(i, len(self))
        if self._epoch_starts is None or self._epoch_starts[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch, 1])  # its own stream: never batch (seed, i)'s
            offset = rng.integers(0, min(self.max_len, self.data.n - self.max_len))
            self._epoch_starts = (
                epoch,
                rng.permutation(np.arange(offset, self.data.n - self.max_len, self.max_len)),
            )
        order = self._epoch_starts[1]
        return order[np.arange(j * self.batch_size, (j + 1) * self.batch_size) % len(order)]

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        start = self.consumed
        end = (start // len(self) + 1) * len(self)
        for i in range(start + worker, end, workers):
            yield self.batch(i)


class ContiguousWindows(Dataset):
    """Non-overlapping windows: window g reads tokens g * max_len ... (g + 1) * max_len (inclusive).

    One process (world=1) reads every window in order. Process `rank` of `world` reads, of each run of
    `batch_size` consecutive windows (one global batch), its rows [rank * b, (rank + 1) * b), b =
    batch_size / world: its k-th batch of b is its share of the one-process k-th batch.
    """

    def __init__(
        self,
        data: ShardedTokens,
        max_len: int,
        max_windows: int | None = None,
        batch_size: int = 1,
        rank: int = 0,
        world: int = 1,
    ):
        self.data, self.max_len = data, max_len
        n = max(0, (data.n - 1) // max_len)
        n = n if max_windows is None else min(n, max_windows)
        self.batch_size, self.rows, self.rank = batch_size, batch_size // world, rank
        partial = min(self.rows, max(0, n % batch_size - rank * self.rows))  # its rows of a last, short batch
        self.n = n // batch_size * self.rows + partial

    def __len__(self) -> int:
        return self.n

    def window(self, k: int) -> int:
        """The global index of this process's k-th window."""
        return k // self.rows * self.batch_size + self.rank * self.rows + k % self.rows

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = np.array([self.window(k) * self.max_len])
        x, y = _window_pair(self.data, start, self.max_len)
        return x[0], y[0]


class TextDataModule(L.LightningDataModule):
    """Token cache -> train/val/test dataloaders. See docs/data.md for every argument."""

    def __init__(
        self,
        source: Mapping | str = "shakespeare",
        max_len: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        vocab_size: int = 4096,
        seed: int = 1337,
        cache_dir: str | None = None,
        tokenizer_path: str | None = None,
        val_max_batches: int | None = None,
        val_batch_size: int | None = None,
        token_dtype: str | None = None,
        recall: Mapping | None = None,
        sampling: str = "random",
        positions: Mapping | None = None,
        shard_tokens: int = SHARD_TOKENS,
        tokenizer_sample_chars: int = TOKENIZER_SAMPLE_CHARS,
    ):
        super().__init__()
        if sampling not in SAMPLINGS:
            raise DataError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}.")
        self.sampling = sampling
        self.source = _plain(source)
        self.recall = RecallConfig.from_options(recall)  # data.recall; None = no recall windows
        # Held-out windows per batch; fixed in a data config so changing batch_size keeps the same val set.
        val_batch_size = batch_size if val_batch_size is None else val_batch_size
        sizes = dict(
            max_len=max_len, batch_size=batch_size, vocab_size=vocab_size, val_batch_size=val_batch_size
        )
        for name, value in sizes.items():
            check_number(name, value, minimum=1, integer=True, allowed="a positive integer", error=DataError)
        check_number("data.num_workers", num_workers, minimum=0, integer=True,
                     means="0 = load in the main process", error=DataError)  # fmt: skip
        self.positions = PositionsConfig.from_options(_plain(positions) if positions is not None else None)
        self.positions.check(max_len)  # refused before any run directory or cache is written
        # train.py logs the whole config; the data module's own hparams would overwrite its `seed`
        self.save_hyperparameters(logger=False)
        self.max_len, self.batch_size, self.num_workers, self.seed = max_len, batch_size, num_workers, seed
        self.val_max_batches, self.val_batch_size = val_max_batches, val_batch_size
        self.cache: TokenCache | None = None
        self.train_set: RandomWindows | None = None
        self._resume_batches = 0  # from load_state_dict before setup
        self._given_tokenizer: Tokenizer | None = None  # data.tokenizer_path's file, read once

    # -- preparation ---------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Build the token cache once (Lightning calls this on rank 0 only); a no-op when it is valid."""
        self._prepare()

    def _prepare(self) -> TokenCache:
        if self.cache is None:
            hp = self.hparams
            self.cache = prepare(
                self.source,
                hp.vocab_size,
                hp.tokenizer_path,
                hp.cache_dir,
                hp.token_dtype,
                hp.shard_tokens,
                hp.tokenizer_sample_chars,
            )
        return self.cache

    def setup(self, stage: str | None = None) -> None:
        """Memory-map the cache (read only) and check the training split can fill one window."""
        cache = self._prepare()
        n_train = cache.meta["splits"]["train"]["tokens"]
        if n_train < self.max_len + 1:
            raise DataError(
                f"max_len {self.max_len} needs at least {self.max_len + 1} training tokens, but the train "
                f"split has {n_train}; use max_len <= {n_train - 1} or more data."
            )
        if self.train_set is None:
            mixer = (
                RecallMixer(cache.tokenizer, self.recall, self.max_len + 1)
                if self.recall.fraction > 0 or self.recall.copy_fraction > 0
                else None
            )
            positions = PositionSampler(self.positions, self.batch_size, self.max_len, self.seed)
            self.train_set = RandomWindows(
                cache.tokens("train"),
                self.batch_size,
                self.max_len,
                self.seed,
                mixer,
                self.sampling,
                positions,
            )
            self.train_set.consumed = self._resume_batches

    # -- what other code reads -------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        """The cache's tokenizer; with data.tokenizer_path, that file itself (the same bytes, checked), so
        the tokenizer_config.json beside it (an imported model's bos setting, end of turn, chat template)
        stays with it and checkpoints record where it came from."""
        cached = self._prepare().tokenizer
        given = self.hparams.tokenizer_path
        if given is None or not os.path.isfile(given):
            return cached
        if self._given_tokenizer is None:
            own = Tokenizer.from_file(given)
            self._given_tokenizer = own if own.sha256 == cached.sha256 else cached
        return self._given_tokenizer

    @property
    def vocab_size(self) -> int:
        """The tokenizer's real vocabulary size (may differ from the requested `vocab_size`)."""
        return self.tokenizer.vocab_size

    def documents(self, split: str = "test") -> list[np.ndarray]:
        """Held-out documents as token arrays (BOS ... EOS), e.g. for long-context evaluation."""
        return self._prepare().documents(split)

    def chars_per_token(self, split: str = "val") -> float:
        """Characters per token (BOS/EOS included) of `split`: bpc = loss_nats / ln(2) / chars_per_token."""
        return self._prepare().chars_per_token(split)

    # -- dataloaders -------------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        self.train_set.rank, self.train_set.world = self._shard()
        return DataLoader(
            self.train_set, batch_size=None, num_workers=self.num_workers
        )  # dataset yields batches

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def _eval_loader(self, split: str) -> DataLoader:
        cap = None if self.val_max_batches is None else self.val_max_batches * self.val_batch_size
        rank, world = self._shard()
        tokens = self._prepare().tokens(split)
        windows = ContiguousWindows(tokens, self.max_len, cap, self.val_batch_size, rank, world)
        return DataLoader(
            windows, batch_size=self.val_batch_size // world, shuffle=False, num_workers=self.num_workers
        )

    def _shard(self) -> tuple[int, int]:
        """(rank, world size) of this process among the data-parallel ones; (0, 1) without a trainer.
        The trainer configs set use_distributed_sampler=false: this module shards its batches itself."""
        if self.trainer is None:
            return 0, 1
        self.check_world_size(self.trainer.world_size)
        return self.trainer.global_rank, self.trainer.world_size

    def check_world_size(self, world: int) -> None:
        """Refuse batch sizes that `world` data-parallel processes cannot split into equal shares."""
        for name, size in (("batch_size", self.batch_size), ("val_batch_size", self.val_batch_size)):
            if size % world:
                raise DataError(
                    f"data.{name}={size} must be a multiple of the {world} data-parallel processes "
                    "(trainer.devices x trainer.num_nodes): each process takes an equal share of every batch."
                )

    # -- resumability --------------------------------------------------------------------------------------
    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        # Called once per batch the training loop actually uses (after Lightning's one-batch prefetch).
        if self.trainer is not None and self.trainer.training:
            self.train_set.consumed += 1
        return batch

    def state_dict(self) -> dict:
        consumed = self.train_set.consumed if self.train_set is not None else self._resume_batches
        return {
            "train_batches": consumed,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "max_len": self.max_len,
        }

    def load_state_dict(self, state: dict) -> None:
        saved = (state["seed"], state["batch_size"], state["max_len"])
        if saved != (self.seed, self.batch_size, self.max_len):
            print(f"resuming data with (seed, batch_size, max_len) != saved {saved}; batches will differ.")
        self._resume_batches = state["train_batches"]
        if self.train_set is not None:
            self.train_set.consumed = self._resume_batches


def _plain(source: Mapping | str) -> dict:
    """A source given as a kind name, a dict or an OmegaConf node -> a plain dict."""
    if isinstance(source, str):
        return {"kind": source}
    if isinstance(source, DictConfig):
        return OmegaConf.to_container(source, resolve=True)
    return dict(source)
