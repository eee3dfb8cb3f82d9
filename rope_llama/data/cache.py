"""Token cache: tokenize every split once, store flat token arrays + metadata, memory-map them later.

Layout of one cache directory (<cache_root>/<kind>-<key[:16]>/):
    tokenizer.json   the tokenizer the ids belong to
    train.bin        flat token ids, uint16 (vocab <= 65536) or uint32; each document is BOS ... EOS
    val.bin, test.bin
    meta.json        written LAST: its presence (and matching sizes/hashes) is what makes the cache valid

The key hashes the source config and files, the split rule and the tokenizer settings, so changing any of
them selects another directory. A FileLock beside the directory serialises concurrent builders.

Integrity: the build records each split's xxh3_64 content hash in meta.json; every open reads each .bin once,
in 1 MiB chunks, checking that hash and that every id is below the tokenizer's vocabulary size. Opening thus
costs one sequential read of all token files: hashing and the range check run at 5-16 GB/s from the page cache
on a 2-core CPU, so the disk's read speed is usually the limit (1B uint16 tokens, 2 GB, take 0.1-0.4 s when
cached). There is no sampled mode: every open is the full check. A failing cache is rebuilt.
"""

import contextlib
import glob
import hashlib
import json
import os
import time

import numpy as np
import tokenizers
import xxhash
from filelock import FileLock
from tqdm import tqdm

from rope_llama import ROOT
from rope_llama.core.checkpoint import atomic_file
from rope_llama.data import DataError
from rope_llama.data.sources import (
    SHAKESPEARE_TEST,
    SHAKESPEARE_VAL,
    SPLITS,
    load_documents,
    source_fingerprint,
)
from rope_llama.data.tokenizer import Tokenizer, train_tokenizer

FORMAT_VERSION = 2
SPLIT_RULE = {"shakespeare": [SHAKESPEARE_VAL, SHAKESPEARE_TEST], "carve": "smallest-sha256-v1"}
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
ENCODE_CHUNK_DOCS = (
    16  # documents per encode_batch call: enough for Rust-side parallelism, small enough for a live bar
)
# Small enough to stay in the CPU cache between the hash and the max; a multiple of every itemsize.
SCAN_CHUNK_BYTES = 2**20


def default_cache_root() -> str:
    """<checkout>/.cache/data (the checkout holds the rope_llama package)."""
    return str(ROOT / ".cache" / "data")


class TokenCache:
    """A validated cache directory: memory-mapped splits, metadata and tokenizer."""

    def __init__(self, directory: str, built: bool = False):
        self.dir = directory
        self.built = built  # True when this call tokenized (rather than reused) the cache
        with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
            self.meta = json.load(f)
        self.tokenizer = Tokenizer(os.path.join(directory, "tokenizer.json"))
        self.dtype = np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> np.ndarray:
        """Read-only memmap of shape (n_tokens,) for `split`."""
        n = self.meta["splits"][split]["tokens"]
        if n == 0:  # an empty file cannot be memory-mapped
            return np.empty(0, dtype=self.dtype)
        return np.memmap(os.path.join(self.dir, f"{split}.bin"), dtype=self.dtype, mode="r", shape=(n,))

    def documents(self, split: str) -> list[np.ndarray]:
        """One (n_i,) token array per document, each starting with BOS and ending with EOS."""
        tokens, offsets = self.tokens(split), self.meta["splits"][split]["offsets"]
        return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def chars_per_token(self, split: str) -> float:
        info = self.meta["splits"][split]
        return info["chars"] / max(info["tokens"], 1)


def cache_key(source: dict, vocab_size: int, tokenizer_path: str | None, token_dtype: str | None) -> str:
    """sha256 over everything the cached tokens depend on."""
    if tokenizer_path is None:
        tok = {"train": "byte-level-bpe", "vocab_size": vocab_size, "tokenizers": tokenizers.__version__}
    else:
        tok = {"file_sha256": Tokenizer.from_file(tokenizer_path).sha256}
    state = {
        "format": FORMAT_VERSION,
        "source": source_fingerprint(source),
        "split_rule": SPLIT_RULE,
        "tokenizer": tok,
        "dtype": token_dtype,
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=list).encode()).hexdigest()


def prepare(
    source: dict,
    vocab_size: int = 4096,
    tokenizer_path: str | None = None,
    cache_root: str | None = None,
    token_dtype: str | None = None,
) -> TokenCache:
    """Return the valid cache for these settings, building it first if needed (safe across processes)."""
    if token_dtype is not None and token_dtype not in DTYPES:
        raise DataError(
            f"token_dtype {token_dtype!r} is not supported; allowed values are null, {list(DTYPES)}."
        )
    root = cache_root or default_cache_root()
    key = cache_key(source, vocab_size, tokenizer_path, token_dtype)
    directory = os.path.join(root, f"{source.get('kind', 'data')}-{key[:16]}")
    os.makedirs(directory, exist_ok=True)
    with FileLock(directory + ".lock"):
        problem = invalid_reason(directory, key)
        if problem is None:
            return TokenCache(directory)
        if problem != "meta.json is missing" or os.listdir(directory):
            print(f"token cache {directory} is not valid ({problem}); rebuilding it.")
        _build(directory, key, source, vocab_size, tokenizer_path, token_dtype)
        return TokenCache(directory, built=True)


def invalid_reason(directory: str, key: str) -> str | None:
    """Why `directory` is not a valid cache for `key`, or None when it is."""
    path = os.path.join(directory, "meta.json")
    if not os.path.isfile(path):
        return "meta.json is missing"
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("format_version") != FORMAT_VERSION or meta.get("key") != key:
            return "metadata format or key does not match"
        tok_path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tok_path) or _sha256_file(tok_path) != meta["tokenizer"]["sha256"]:
            return "tokenizer.json is missing or does not match its hash"
        dtype, vocab_size = np.dtype(meta["dtype"]), Tokenizer(tok_path).vocab_size
        for split in SPLITS:
            bin_path, expected = (
                os.path.join(directory, f"{split}.bin"),
                meta["splits"][split]["tokens"] * dtype.itemsize,
            )
            if not os.path.isfile(bin_path) or os.path.getsize(bin_path) != expected:
                return f"{split}.bin is missing or is not {expected} bytes"
            digest, largest_id = scan_tokens(bin_path, dtype)
            if digest != meta["splits"][split]["xxh3_64"]:
                return f"{split}.bin does not match its content hash"
            if largest_id >= vocab_size:
                return (
                    f"{split}.bin holds token id {largest_id}, "
                    f"outside the tokenizer's vocabulary of {vocab_size}"
                )
    except (ValueError, KeyError, TypeError) as e:
        return f"metadata is unreadable: {type(e).__name__}: {e}"
    return None


def scan_tokens(path: str, dtype: np.dtype) -> tuple[str, int]:
    """(xxh3_64 hex digest, largest token id or -1 when empty) of a token file, reading it once."""
    digest, largest_id = xxhash.xxh3_64(), -1
    with open(path, "rb") as f:
        while chunk := f.read(SCAN_CHUNK_BYTES):
            digest.update(chunk)
            largest_id = max(largest_id, int(np.frombuffer(chunk, dtype).max()))
    return digest.hexdigest(), largest_id


def _build(directory, key, source, vocab_size, tokenizer_path, token_dtype) -> None:
    for stale in ["meta.json", *glob.glob(os.path.join(directory, "*.tmp"))]:  # leftovers of a killed run
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, stale))
    dtype_name = token_dtype or ("uint16" if vocab_size <= 2**16 else "uint32")
    _check_vocab_fits(vocab_size, dtype_name)
    t0 = time.perf_counter()
    docs = load_documents(source)
    tok_path = os.path.join(directory, "tokenizer.json")
    if tokenizer_path is None:
        tokenizer = train_tokenizer(docs["train"], vocab_size, tok_path)  # training split only: nothing leaks
    else:
        with open(tokenizer_path, "rb") as f:
            _atomic_write(tok_path, f.read())
        tokenizer = Tokenizer(tok_path)
    dtype_name = token_dtype or ("uint16" if tokenizer.vocab_size <= 2**16 else "uint32")
    _check_vocab_fits(tokenizer.vocab_size, dtype_name)
    t1 = time.perf_counter()
    splits = {
        split: _tokenize_split(docs[split], tokenizer, directory, split, DTYPES[dtype_name])
        for split in SPLITS
    }
    n_tokens, t2 = sum(s["tokens"] for s in splits.values()), time.perf_counter()
    print(
        f"prepared {n_tokens:,} tokens in {t2 - t0:.1f}s (reading + tokenizer {t1 - t0:.1f}s, "
        f"tokenizing {n_tokens / (t2 - t1):,.0f} tokens/s) -> {directory}"
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
        "splits": splits,
    }
    _write_meta(directory, meta)


def _check_vocab_fits(vocab_size: int, dtype_name: str) -> None:
    limit = np.iinfo(DTYPES[dtype_name]).max + 1
    if vocab_size > limit:
        raise DataError(
            f"vocab size {vocab_size} does not fit token dtype {dtype_name}; it allows at most {limit}."
        )


def _tokenize_split(docs: list[str], tokenizer: Tokenizer, directory: str, split: str, dtype) -> dict:
    """Write BOS doc EOS BOS doc EOS ... to <split>.bin atomically; return the split's metadata."""
    offsets, chars, digest = [0], 0, xxhash.xxh3_64()
    bar = tqdm(total=sum(map(len, docs)), unit="char", unit_scale=True, desc=f"tokenizing {split}")
    with atomic_file(os.path.join(directory, f"{split}.bin")) as f:
        for i in range(0, len(docs), ENCODE_CHUNK_DOCS):
            chunk = docs[i : i + ENCODE_CHUNK_DOCS]
            for ids in tokenizer.encode_batch(chunk):
                data = np.array([tokenizer.bos_id, *ids, tokenizer.eos_id], dtype=dtype).tobytes()
                f.write(data)
                digest.update(data)
                offsets.append(offsets[-1] + len(ids) + 2)
            n = sum(map(len, chunk))
            chars += n
            bar.update(n)
    bar.close()
    return {
        "tokens": offsets[-1],
        "xxh3_64": digest.hexdigest(),
        "documents": len(docs),
        "chars": chars,
        "offsets": offsets,
    }


def _write_meta(directory: str, meta: dict) -> None:
    _atomic_write(os.path.join(directory, "meta.json"), json.dumps(meta).encode("utf-8"))


def _atomic_write(path: str, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def _sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
