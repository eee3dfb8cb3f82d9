"""Token shards: a split's token stream cut into fixed-size files, each with its own hash and document starts.

A split's tokens are BOS doc EOS BOS doc EOS ..., cut every `shard_tokens` tokens (the last shard of a split
holds the rest), so a document may continue into the next shard and the stream does not depend on the
shard size. Files, in a cache directory on a local disk or an object store (any fsspec URL):

    train-00000.bin    the shard's ids, uint16 or uint32
    train-00000.json   its sidecar, written after the .bin: tokens, xxh3_64, largest id, `doc_starts` (offsets in
                       the shard where documents begin), characters of those documents, and `resume`: where
                       the next shard starts in the source (document index, tokens of it already written)

A shard is finished when its sidecar exists and the .bin has the sidecar's size and hash; a half-written one
has no sidecar and is rewritten. Readers (`ShardedTokens`) check a shard's hash and id range when they first
touch it, so opening a corpus reads no shard and a damaged one is refused in one sentence.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass

import fsspec
import numpy as np
import xxhash
from fsspec.implementations.local import LocalFileSystem

from rope_llama.core.checkpoint import atomic_file
from rope_llama.data import DataError

# Small enough to stay in the CPU cache between the hash and the max; a multiple of every itemsize.
SCAN_CHUNK_BYTES = 2**20


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}"


class Store:
    """A directory on a local disk or an object store (any fsspec URL, e.g. s3://bucket/prefix)."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.fs.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def size(self, name: str) -> int | None:
        try:
            return self.fs.size(self.path(name))
        except FileNotFoundError:
            return None

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self.path(name))

    def write(self, name: str, data: bytes) -> None:
        """Whole or not at all: a renamed temp file on disk; one PUT (atomic by itself) on an object store."""
        if self.local:
            with atomic_file(self.path(name)) as f:
                f.write(data)
        else:
            self.fs.pipe_file(self.path(name), data)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))

    def names(self) -> list[str]:
        return [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]

    def scan(self, name: str, dtype: np.dtype) -> tuple[str, int]:
        """(xxh3_64 hex digest, largest id or -1 when empty) of a token file, read once in chunks."""
        digest, largest_id = xxhash.xxh3_64(), -1
        with self.fs.open(self.path(name), "rb") as f:
            while chunk := f.read(SCAN_CHUNK_BYTES):
                digest.update(chunk)
                largest_id = max(largest_id, int(np.frombuffer(chunk, dtype).max()))
        return digest.hexdigest(), largest_id


@dataclass(frozen=True)
class Resume:
    """Where a shard starts in the source: the stream index of its first token's document and how many tokens
    of that document earlier shards hold (0 when the shard starts at a document's BOS)."""

    index: int = 0
    offset: int = 0


def content_problem(store: Store, info: dict, dtype: np.dtype, vocab_size: int | None = None) -> str | None:
    """Why the shard `info` (a sidecar or meta.json entry) does not hold what was recorded, or None: its hash
    and, given `vocab_size`, its largest id. One sequential read of the file."""
    name = f"{info['name']}.bin"
    digest, largest_id = store.scan(name, dtype)
    if digest != info["xxh3_64"]:
        return f"{name} does not match its content hash"
    if vocab_size is not None and largest_id >= vocab_size:
        return f"{name} holds token id {largest_id}, outside the tokenizer's vocabulary of {vocab_size}"
    return None


def finished_shards(store: Store, split: str, dtype: np.dtype, tokenizer_sha256: str) -> list[dict]:
    """Sidecars of split's shards 0, 1, ... that are finished (size and hash checked, same tokenizer), up to the
    first that is not; the caller rewrites from there."""
    sidecars = []
    while store.exists(f"{(name := shard_name(split, len(sidecars)))}.json"):
        try:
            info = json.loads(store.read(f"{name}.json"))
        except ValueError:
            break
        if info.get("tokenizer_sha256") != tokenizer_sha256:
            break
        if store.size(f"{name}.bin") != info["tokens"] * dtype.itemsize:
            break
        if content_problem(store, info, dtype) is not None:
            break
        sidecars.append(info)
    return sidecars


class ShardWriter:
    """Appends documents' tokens to one split, writing each full shard (.bin, then its sidecar) as it fills."""

    def __init__(
        self, store: Store, split: str, shard_tokens: int, dtype, tokenizer_sha256: str, done: list[dict]
    ):
        self.store, self.split, self.shard_tokens, self.dtype = store, split, shard_tokens, np.dtype(dtype)
        self.tokenizer_sha256 = tokenizer_sha256
        self.shards = list(done)  # sidecars of finished shards (kept from a killed run, then written here)
        # where the next shard begins; a split whose last shard is finished takes nothing more
        self.complete = bool(done) and done[-1]["resume"] is None
        self.resume = Resume(**done[-1]["resume"]) if done and not self.complete else Resume()
        if self.complete:
            self.resume = Resume(index=sys.maxsize)
        self.pieces: list[np.ndarray] = []
        self.buffered, self.doc_starts, self.chars = 0, [], 0

    def add(self, index: int, ids: np.ndarray, chars: int) -> None:
        """Append document number `index` of the source stream (ids: BOS ... EOS); documents before the
        resume point, already in finished shards, are ignored, and a document they hold a part of is cut."""
        if index < self.resume.index:
            return
        skipped = self.resume.offset if index == self.resume.index else 0
        if skipped:
            ids = ids[skipped:]  # its head ends the last finished shard
        else:
            self.doc_starts.append(self.buffered)
            self.chars += chars
        # a copy: a view would keep the whole block alive until this split's shard fills, and a held-out split
        # fills one shard in 1 / holdout_fraction blocks
        self.pieces.append(np.array(ids, dtype=self.dtype))
        self.buffered += len(ids)
        while self.buffered >= self.shard_tokens:
            # the next shard starts inside this document, or at the next one when it ends exactly here
            rest = self.buffered - self.shard_tokens
            cut = Resume(index, skipped + len(ids) - rest) if rest else Resume(index + 1)
            self._flush(self.shard_tokens, cut)

    def close(self) -> list[dict]:
        """Write the last, partial shard; return every shard's sidecar in order."""
        if not self.complete and (self.buffered or not self.shards):
            self._flush(self.buffered, None)
        return self.shards

    def _flush(self, n: int, resume: Resume | None) -> None:
        flat = np.concatenate(self.pieces) if self.pieces else np.empty(0, self.dtype)
        data = flat[:n].astype(self.dtype).tobytes()
        name = shard_name(self.split, len(self.shards))
        self.store.write(f"{name}.bin", data)
        largest = int(flat[:n].max()) if n else -1
        starts = [s for s in self.doc_starts if s < n]
        info = {
            "name": name,
            "tokens": n,
            "xxh3_64": xxhash.xxh3_64(data).hexdigest(),
            "max_id": largest,
            "doc_starts": starts,
            "chars": self.chars,
            "resume": None if resume is None else vars(resume),
            "tokenizer_sha256": self.tokenizer_sha256,
        }
        self.store.write(f"{name}.json", json.dumps(info).encode())  # last: the shard is now finished
        self.shards.append(info)
        self.pieces = [flat[n:]] if n < len(flat) else []
        self.buffered -= n
        self.doc_starts = [s - n for s in self.doc_starts if s >= n]
        self.chars = 0  # a document's characters count in the shard where it starts
        self.resume = resume or self.resume


class ShardedTokens:
    """A split's token stream over its shard files: `n` tokens, `read(start, length)`; picklable (memory-maps
    lazily, so DataLoader workers do not copy data). A shard's hash and largest id are checked the first time
    this process touches it."""

    def __init__(self, directory: str, split: str, shards: list[dict], dtype, vocab_size: int):
        self.dir, self.split, self.dtype, self.vocab_size = directory, split, np.dtype(dtype), vocab_size
        self.store = Store(directory)
        self.shards = [{k: s[k] for k in ("name", "tokens", "xxh3_64")} for s in shards]
        self.bounds = np.cumsum([0] + [s["tokens"] for s in shards])  # shard k holds [bounds[k], bounds[k+1])
        self.n = int(self.bounds[-1])
        self._maps: dict[int, np.ndarray] = {}

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}

    def __len__(self) -> int:
        return self.n

    def shard(self, k: int) -> np.ndarray:
        """Shard k's ids (memory-mapped), verified on first use."""
        if k not in self._maps:
            info, path = self.shards[k], f"{self.dir}/{self.shards[k]['name']}.bin"
            if content_problem(self.store, info, self.dtype, self.vocab_size) is not None:
                raise DataError(
                    f"token shard {path} does not match its hash in meta.json (damaged or changed on disk); "
                    "run scripts/prepare_data.py with the same data options to rebuild it."
                )
            self._maps[k] = np.memmap(path, dtype=self.dtype, mode="r", shape=(info["tokens"],))
        return self._maps[k]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream (a view when they lie in one shard)."""
        end = min(start + length, self.n)
        first = int(np.searchsorted(self.bounds, start, side="right")) - 1
        pieces = []
        k = first
        while start < end:
            lo = start - int(self.bounds[k])
            take = min(end - start, self.shards[k]["tokens"] - lo)
            if take > 0:
                pieces.append(self.shard(k)[lo : lo + take])
                start += take
            k += 1
        if not pieces:
            return np.empty(0, self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __getitem__(self, item: slice) -> np.ndarray:
        start, stop, step = item.indices(self.n)
        return self.read(start, max(0, stop - start))[::step]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole stream in memory (a copy: small splits and tests only)."""
        return np.array(self.read(0, self.n), dtype=dtype)
