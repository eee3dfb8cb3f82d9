"""Token cache: tokenize every split once into token shards (data/shards.py), memory-map them later.

Layout of one cache directory (<cache_root>/<kind>-<key[:16]>/, on a local disk or an object store):
    tokenizer.json           the tokenizer the ids belong to
    train-00000.bin/.json    token shards of shard_tokens ids and their sidecars (data/shards.py); each
    val-00000.bin/.json      document is BOS ... EOS and may continue into the next shard
    test-00000.bin/.json
    meta.json                written LAST: its presence is what makes the cache complete

The key hashes the source config and files, the split rule, the shard size and the tokenizer settings, so
changing any of them selects another directory. A FileLock beside a local directory serialises builders.

Preparation streams the source (`stream_documents`), tokenizes blocks of TOKENIZE_BLOCK_CHARS characters per
worker with `datasets`' map over `workers` processes (the order is kept, so any number of workers writes the same shards)
and writes each shard as it fills. A killed preparation resumes at its first unfinished shard.

Integrity: opening a complete cache checks meta.json, the tokenizer's hash and every shard's size (no shard is
read); each shard's xxh3_64 and id range are checked when a reader first touches it (`ShardedTokens`), and
for every shard by `prepare(verify=True)` (scripts/prepare_data.py), which rebuilds a damaged one.
"""

import contextlib
import hashlib
import json
import os
import tempfile
import time

import numpy as np
import tokenizers
from filelock import FileLock
from tqdm import tqdm

from rope_llama import checkout
from rope_llama.core.checkpoint import atomic_file
from rope_llama.core.checks import check_number
from rope_llama.data import DataError
from rope_llama.data.shards import ShardedTokens, ShardWriter, Store, content_problem, finished_shards
from rope_llama.data.sources import (
    HOLDOUT_BLOCK_CHARS,
    SHAKESPEARE_TEST,
    SHAKESPEARE_VAL,
    SPLITS,
    source_chars,
    source_fingerprint,
    stream_documents,
)
from rope_llama.data.tokenizer import Tokenizer, train_tokenizer

FORMAT_VERSION = 3
SPLIT_RULE = {
    "shakespeare": [SHAKESPEARE_VAL, SHAKESPEARE_TEST],
    "carve": f"smallest-sha256-v1 up to {HOLDOUT_BLOCK_CHARS} chars, else sha256-below-fraction-v1",
}
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SHARD_TOKENS = 2**24  # 32 MiB of uint16: a reader's first-use check of one shard takes milliseconds
TOKENIZER_SAMPLE_CHARS = 10**8  # characters of training documents a trained tokenizer learns from
TOKENIZE_BLOCK_CHARS = 2**25  # text per worker handed out at once: bounds memory, amortises their start


def default_cache_root() -> str:
    """Where token caches go unless data.cache_dir says: <checkout>/.cache/data when the package runs from a
    checkout, else the user's cache directory ($XDG_CACHE_HOME, by default ~/.cache) /rope-llama/data."""
    root = checkout()
    if root is not None:
        return str(root / ".cache" / "data")
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(
        user_cache, "rope-llama", "data"
    )  # beside the C decode step's (kernels/cpu_decode.py)


class TokenCache:
    """A complete cache directory: metadata, tokenizer and each split's shards as one token stream."""

    def __init__(self, directory: str, built: bool = False):
        self.dir, self.store = directory, Store(directory)
        self.built = built  # True when this call tokenized (rather than reused) the cache
        self.meta = json.loads(self.store.read("meta.json"))
        self.dtype = np.dtype(self.meta["dtype"])
        self._tokenizer = None

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self._local_path("tokenizer.json"))
        return self._tokenizer

    def tokens(self, split: str) -> ShardedTokens:
        """`split`'s token stream, (n_tokens,), over its memory-mapped shards."""
        shards = self.meta["splits"][split]["shards"]
        return ShardedTokens(
            self._local_path(""), split, shards, self.dtype, self.meta["tokenizer"]["vocab_size"]
        )

    def documents(self, split: str) -> list[np.ndarray]:
        """One (n_i,) token array per document, each starting with BOS and ending with EOS."""
        tokens, starts = self.tokens(split), []
        for k, info in enumerate(self.meta["splits"][split]["shards"]):
            sidecar = json.loads(self.store.read(f"{info['name']}.json"))
            starts += [int(tokens.bounds[k]) + s for s in sidecar["doc_starts"]]
        bounds = [*starts, tokens.n]
        return [tokens.read(a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]

    def chars_per_token(self, split: str) -> float:
        info = self.meta["splits"][split]
        return info["chars"] / max(info["tokens"], 1)

    def _local_path(self, name: str) -> str:
        if not self.store.local:
            raise DataError(
                f"token cache {self.dir} is on an object store; training memory-maps shards from a local or "
                "shared filesystem: copy the directory there and point data.cache_dir at its parent."
            )
        return os.path.join(self.store.root, name) if name else self.store.root


def cache_key(
    source: dict,
    vocab_size: int,
    tokenizer_path: str | None,
    token_dtype: str | None,
    shard_tokens: int = SHARD_TOKENS,
    tokenizer_sample_chars: int = TOKENIZER_SAMPLE_CHARS,
) -> str:
    """sha256 over everything the cached tokens and their files depend on."""
    if tokenizer_path is None:
        tok = {
            "train": "byte-level-bpe",
            "vocab_size": vocab_size,
            "sample_chars": tokenizer_sample_chars,
            "tokenizers": tokenizers.__version__,
        }
    else:
        tok = {"file_sha256": Tokenizer.from_file(tokenizer_path).sha256}
    state = {
        "format": FORMAT_VERSION,
        "source": source_fingerprint(source),
        "split_rule": SPLIT_RULE,
        "tokenizer": tok,
        "dtype": token_dtype,
        "shard_tokens": shard_tokens,
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=list).encode()).hexdigest()


def prepare(
    source: dict,
    vocab_size: int = 4096,
    tokenizer_path: str | None = None,
    cache_root: str | None = None,
    token_dtype: str | None = None,
    shard_tokens: int = SHARD_TOKENS,
    tokenizer_sample_chars: int = TOKENIZER_SAMPLE_CHARS,
    workers: int = 1,
    verify: bool = False,
) -> TokenCache:
    """Return the complete cache for these settings, building (or finishing) it first if needed; safe across
    processes on a local disk. `verify` also hashes every shard, rebuilding from a damaged one on."""
    if token_dtype is not None and token_dtype not in DTYPES:
        raise DataError(
            f"token_dtype {token_dtype!r} is not supported; allowed values are null, {list(DTYPES)}."
        )
    for name, value in (("shard_tokens", shard_tokens), ("tokenizer_sample_chars", tokenizer_sample_chars),
                        ("workers", workers)):  # fmt: skip
        check_number(name, value, minimum=1, integer=True, allowed="a positive integer", error=DataError)
    root = cache_root or default_cache_root()
    key = cache_key(source, vocab_size, tokenizer_path, token_dtype, shard_tokens, tokenizer_sample_chars)
    directory = f"{root.rstrip('/')}/{source.get('kind', 'data')}-{key[:16]}"
    store = Store(directory)
    lock = FileLock(store.root + ".lock") if store.local else contextlib.nullcontext()
    with lock:
        problem = invalid_reason(store, key, verify)
        if problem is None:
            return TokenCache(directory)
        if problem != "meta.json is missing" or store.names():
            print(f"token cache {directory} is not complete ({problem}); building what is missing.")
        settings = dict(vocab_size=vocab_size, tokenizer_path=tokenizer_path, token_dtype=token_dtype,
                        shard_tokens=shard_tokens, sample_chars=tokenizer_sample_chars, workers=workers)  # fmt: skip
        _build(store, key, source, **settings)
        return TokenCache(directory, built=True)


def invalid_reason(store: Store, key: str, verify: bool = False) -> str | None:
    """Why `store` is not a complete cache for `key`, or None when it is; `verify` also hashes each shard."""
    if not store.exists("meta.json"):
        return "meta.json is missing"
    try:
        meta = json.loads(store.read("meta.json"))
        if meta.get("format_version") != FORMAT_VERSION or meta.get("key") != key:
            return "metadata format or key does not match"
        if meta.get("sha256") != _meta_digest(meta):
            return "meta.json does not match its hash (edited or damaged)"
        if (
            not store.exists("tokenizer.json")
            or _sha256(store.read("tokenizer.json")) != meta["tokenizer"]["sha256"]
        ):
            return "tokenizer.json is missing or does not match its hash"
        dtype, vocab_size = np.dtype(meta["dtype"]), meta["tokenizer"]["vocab_size"]
        for split in SPLITS:
            for info in meta["splits"][split]["shards"]:
                name, expected = f"{info['name']}.bin", info["tokens"] * dtype.itemsize
                if store.size(name) != expected:
                    return f"{name} is missing or is not {expected} bytes"
                if not store.exists(f"{info['name']}.json"):
                    return f"{info['name']}.json is missing"
                if verify and (problem := content_problem(store, info, dtype, vocab_size)):
                    return problem
    except (ValueError, KeyError, TypeError) as e:
        return f"metadata is unreadable: {type(e).__name__}: {e}"
    return None


def _build(
    store: Store, key, source, vocab_size, tokenizer_path, token_dtype, shard_tokens, sample_chars, workers
):
    """Tokenize `source` into `store`, keeping the finished shards of an earlier, killed or damaged build."""
    store.remove("meta.json")  # incomplete from here until the new one is written
    dtype_name = token_dtype or ("uint16" if vocab_size <= 2**16 else "uint32")
    _check_vocab_fits(vocab_size, dtype_name)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = _tokenizer(store, source, vocab_size, tokenizer_path, sample_chars, scratch)
        dtype_name = token_dtype or ("uint16" if tokenizer.vocab_size <= 2**16 else "uint32")
        _check_vocab_fits(tokenizer.vocab_size, dtype_name)
        t1 = time.perf_counter()
        dtype = np.dtype(dtype_name)
        writers = {
            split: ShardWriter(
                store,
                split,
                shard_tokens,
                dtype,
                tokenizer.sha256,
                finished_shards(store, split, dtype, tokenizer.sha256),
            )
            for split in SPLITS
        }
        if any(w.shards for w in writers.values()):
            kept = ", ".join(f"{split}: {len(w.shards)}" for split, w in writers.items())
            print(f"keeping the finished shards of an earlier preparation ({kept}); resuming after them.")
        n_tokens = _tokenize(source, tokenizer, writers, workers)
        shards = {split: writer.close() for split, writer in writers.items()}
    t2 = time.perf_counter()
    for name in store.names():  # shards past the end, left by a build that was cut differently
        stem = name.rsplit(".", 1)[0]
        split, _, k = stem.rpartition("-")
        if split in shards and k.isdigit() and int(k) >= len(shards[split]):
            store.remove(name)
    print(
        f"prepared {n_tokens:,} tokens in {t2 - t0:.1f}s (tokenizer {t1 - t0:.1f}s, "
        f"tokenizing {n_tokens / max(t2 - t1, 1e-9):,.0f} tokens/s) -> {store.url}"
    )
    meta = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "source": source,
        "source_fingerprint": source_fingerprint(source),
        "tokenizer": {
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
        },
        "dtype": dtype_name,
        "shard_tokens": shard_tokens,
        "splits": {split: _split_meta(sidecars) for split, sidecars in shards.items()},
    }
    _write_meta(store, meta)


def _tokenizer(store: Store, source, vocab_size, tokenizer_path, sample_chars, scratch) -> Tokenizer:
    """The cache's tokenizer: kept from an earlier build, copied from `tokenizer_path`, or trained on the first
    `sample_chars` characters of the training documents (whole documents; nothing held out leaks in)."""
    local = os.path.join(store.root if store.local else scratch, "tokenizer.json")
    if store.exists("tokenizer.json"):
        if not store.local:
            with open(local, "wb") as f:
                f.write(store.read("tokenizer.json"))
        with contextlib.suppress(DataError):
            kept = Tokenizer(local)
            given = Tokenizer.from_file(tokenizer_path).sha256 if tokenizer_path else None
            if given in (None, kept.sha256):
                return kept  # deterministic training, atomic write: an earlier build's is this build's
    if tokenizer_path is None:
        sample, chars = [], 0
        for split, text in stream_documents(source):
            if split == "train":
                sample.append(text)
                chars += len(text)
                if chars >= sample_chars:
                    break
        train_tokenizer(sample, vocab_size, local)
    else:
        with open(tokenizer_path, "rb") as f, atomic_file(local) as out:
            out.write(f.read())
    if not store.local:
        with open(local, "rb") as f:
            store.write("tokenizer.json", f.read())
    return Tokenizer(local)


def _tokenize(source: dict, tokenizer: Tokenizer, writers: dict[str, ShardWriter], workers: int) -> int:
    """Stream the source through the workers into the writers; returns the tokens encoded."""
    bar = tqdm(total=source_chars(source), unit="char", unit_scale=True, desc="preparing")
    t0, tokens, block, chars = time.perf_counter(), 0, [], 0
    encode = BlockEncoder(tokenizer, workers, next(iter(writers.values())).dtype)
    for index, (split, text) in enumerate(stream_documents(source)):
        if index >= writers[split].resume.index:  # earlier ones are in finished shards
            block.append((index, split, text))
        chars += len(text)
        if chars >= TOKENIZE_BLOCK_CHARS * workers:
            tokens += encode.into(block, writers)
            bar.update(chars)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0) / 1e6:.2f}M tokens/s")
            block, chars = [], 0
    tokens += encode.into(block, writers)
    bar.update(chars)
    bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9) / 1e6:.2f}M tokens/s")
    bar.close()
    return tokens


class BlockEncoder:
    """Encodes blocks of documents as BOS ids EOS with `datasets`' map over `workers` processes, in order."""

    def __init__(self, tokenizer: Tokenizer, workers: int, dtype: np.dtype):
        self.tokenizer, self.workers, self.dtype = tokenizer, workers, dtype
        # one function for every block: a tokenizer loaded per block, the old ones still alive, encodes ever
        # slower (half the speed after 20 blocks)
        self.encode = _Encode(tokenizer.path)
        if workers > 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process

    def into(self, block: list[tuple[int, str, str]], writers: dict[str, ShardWriter]) -> int:
        """Append every (index, split, text) of `block` to its split's writer; returns the tokens encoded."""
        if not block:
            return 0
        import datasets  # heavy import, only when tokenizing

        datasets.disable_progress_bars()  # the preparation's own bar reports progress
        texts = datasets.Dataset.from_dict({"text": [text for _, _, text in block]})
        procs = min(self.workers, len(block))
        encoded = texts.map(
            self.encode,
            batched=True,
            batch_size=64,
            num_proc=procs if procs > 1 else None,
            remove_columns=["text"],
            keep_in_memory=True,
            load_from_cache_file=False,
        )
        ids = encoded.data.column("ids").combine_chunks()
        flat = ids.flatten().to_numpy().astype(self.dtype)
        lengths = ids.value_lengths().to_numpy()
        ends = np.cumsum(lengths)
        for (index, split, text), end, n in zip(block, ends, lengths):
            writers[split].add(index, flat[end - n : end], len(text))
        return int(ends[-1])


class _Encode:
    """map()'s function: texts -> BOS ids EOS lists; loads the tokenizer once per worker process."""

    def __init__(self, path: str):
        self.path, self._tokenizer = path, None

    def __getstate__(self):
        return {"path": self.path, "_tokenizer": None}

    def __call__(self, batch: dict) -> dict:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.path)
        tok = self._tokenizer
        # numpy rows reach Arrow without a Python int per token
        return {
            "ids": [
                np.array([tok.bos_id, *ids, tok.eos_id], np.int32) for ids in tok.encode_batch(batch["text"])
            ]
        }


def _split_meta(sidecars: list[dict]) -> dict:
    return {
        "tokens": sum(s["tokens"] for s in sidecars),
        "documents": sum(len(s["doc_starts"]) for s in sidecars),
        "chars": sum(s["chars"] for s in sidecars),
        "shards": [{k: s[k] for k in ("name", "tokens", "xxh3_64", "max_id")} for s in sidecars],
    }


def _check_vocab_fits(vocab_size: int, dtype_name: str) -> None:
    limit = np.iinfo(DTYPES[dtype_name]).max + 1
    if vocab_size > limit:
        raise DataError(
            f"vocab size {vocab_size} does not fit token dtype {dtype_name}; it allows at most {limit}."
        )


def _meta_digest(meta: dict) -> str:
    """The hash of meta.json's own entries (all but this one): an edited count (chars, tokens) is found at open."""
    return _sha256(
        json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode("utf-8")
    )


def _write_meta(store: Store, meta: dict) -> None:
    store.write("meta.json", json.dumps({**meta, "sha256": _meta_digest(meta)}).encode("utf-8"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
