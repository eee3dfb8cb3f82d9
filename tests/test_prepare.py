"""Sharded preparation (data/cache.py, data/shards.py, scripts/prepare_data.py): workers, kills, damage, ranks."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import rope_llama.data.cache as cache_mod
from rope_llama.data import DataError
from rope_llama.data.cache import prepare
from rope_llama.data.datamodule import RandomWindows
from rope_llama.data.shards import ShardedTokens, ShardWriter, Store
from tests.helpers import ROOT, garbage, overwrite_bytes, text_corpus

VOCAB = 320
SHARD = 1000  # tokens per shard: the small corpus below spans several, and documents cross their edges
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def corpus(tmp_path: Path, n_files: int = 24) -> dict:
    return {"kind": "text_files", "paths": text_corpus(tmp_path, n_files=n_files, chars=2500)}


def shard_files(directory: str) -> dict[str, bytes]:
    """Every shard .bin and sidecar of a cache directory, by name."""
    names = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".json")) and n != "meta.json")
    return {n: Path(directory, n).read_bytes() for n in names}


@pytest.fixture
def small_blocks(monkeypatch):
    """Several tokenizer blocks per split, so workers and resumes meet block edges too."""
    monkeypatch.setattr(cache_mod, "TOKENIZE_BLOCK_CHARS", 6000)


def test_two_workers_write_the_one_worker_shards(tmp_path, small_blocks):
    source = corpus(tmp_path)
    one = prepare(source, VOCAB, cache_root=str(tmp_path / "one"), shard_tokens=SHARD, workers=1)
    two = prepare(source, VOCAB, cache_root=str(tmp_path / "two"), shard_tokens=SHARD, workers=2)
    assert len(one.meta["splits"]["train"]["shards"]) >= 4
    assert shard_files(one.dir) == shard_files(two.dir)
    assert one.meta["splits"] == two.meta["splits"]


def test_shards_hold_the_one_file_stream_whatever_their_size(tmp_path):
    source = corpus(tmp_path)
    whole = prepare(source, VOCAB, cache_root=str(tmp_path / "a"), shard_tokens=10**9)
    cut = prepare(source, VOCAB, cache_root=str(tmp_path / "b"), shard_tokens=SHARD)
    for split in ("train", "val", "test"):
        assert np.array_equal(np.array(whole.tokens(split)), np.array(cut.tokens(split)))
        docs_a, docs_b = whole.documents(split), cut.documents(split)
        assert len(docs_a) == len(docs_b) and all(np.array_equal(a, b) for a, b in zip(docs_a, docs_b))
    tokens = cut.tokens("train")
    stream = np.array(tokens)
    for start in (0, SHARD - 3, 2 * SHARD - 1, len(stream) - 7):  # reads across shard edges
        assert np.array_equal(tokens.read(start, 10), stream[start : start + 10])


KILLED_PREPARE = """
import sys, time
import rope_llama.data.cache as cache_mod
from rope_llama.data.shards import ShardWriter
cache_mod.TOKENIZE_BLOCK_CHARS = 6000
flush = ShardWriter._flush
def slow_flush(self, n, resume):  # time for the test to kill it between (and inside) shard writes
    flush(self, n, resume)
    time.sleep(0.3)
ShardWriter._flush = slow_flush
source = {"kind": "text_files", "paths": sys.argv[1]}
cache_mod.prepare(source, int(sys.argv[3]), cache_root=sys.argv[2], shard_tokens=int(sys.argv[4]))
"""


def test_a_sigkilled_preparation_resumes_to_the_same_shards(tmp_path, small_blocks, capsys):
    source = corpus(tmp_path)
    reference = prepare(source, VOCAB, cache_root=str(tmp_path / "ref"), shard_tokens=SHARD)
    root = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_PREPARE, source["paths"], str(root), str(VOCAB), str(SHARD)],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while len(list(root.glob("*/train-*.json"))) < 2:
        assert proc.poll() is None, "the preparation ended before two shards were written"
        assert time.time() < deadline, "no shard appeared"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (directory,) = [p for p in root.iterdir() if p.is_dir()]
    assert not (directory / "meta.json").exists()
    kept = sorted(p.name for p in directory.glob("train-*.json"))
    # a half-written next shard: data with no sidecar is never taken as finished
    Path(directory, f"train-{len(kept):05d}.bin").write_bytes(garbage("random_bytes", 100))
    capsys.readouterr()
    resumed = prepare(source, VOCAB, cache_root=str(root), shard_tokens=SHARD)
    assert resumed.built and f"earlier preparation (train: {len(kept)}, " in capsys.readouterr().out
    assert shard_files(resumed.dir) == shard_files(reference.dir)
    assert resumed.meta["splits"] == reference.meta["splits"]


def test_prepare_data_rebuilds_a_damaged_shard_and_what_follows(tmp_path):
    paths = corpus(tmp_path)["paths"]
    args = [
        sys.executable,
        "scripts/prepare_data.py",
        "data=text_files",
        f"data.source.paths=[{paths}]",
        f"data.vocab_size={VOCAB}",
        f"data.shard_tokens={SHARD}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "workers=2",
    ]
    first = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "built: " in first.stdout and "train: " in first.stdout
    directory = first.stdout.split("built: ")[1].strip()
    clean = shard_files(directory)
    overwrite_bytes(os.path.join(directory, "train-00001.bin"), 10, garbage("zeros", 8))
    with pytest.raises(DataError, match=r"^token shard .*train-00001\.bin does not match its hash"):
        ShardedTokens(directory, "train", json.load(open(f"{directory}/meta.json"))["splits"]["train"]["shards"],
                      np.uint16, VOCAB).read(SHARD, 1)  # fmt: skip
    second = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "not complete (train-00001.bin does not match its content hash)" in second.stdout
    assert (
        "keeping the finished shards of an earlier preparation (train: 1, val: 2, test: 2)" in second.stdout
    )
    assert shard_files(directory) == clean
    third = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert "complete and verified" in third.stdout and "not complete" not in third.stdout


def test_bad_preparation_options_are_one_sentence(tmp_path):
    for name, value in (("shard_tokens", 0), ("workers", -1), ("tokenizer_sample_chars", 1.5)):
        with pytest.raises(DataError, match=f"^{name} must be a positive integer, got {value}"):
            prepare(corpus(tmp_path, 4), VOCAB, cache_root=str(tmp_path / "c"), **{name: value})
    proc = subprocess.run(
        [sys.executable, "scripts/prepare_data.py", "workers=0", f"data.cache_dir={tmp_path}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == "error: workers must be an integer >= 1, got 0."


def test_an_object_store_url_receives_the_same_shards(tmp_path):
    source = corpus(tmp_path, 8)
    local = prepare(source, VOCAB, cache_root=str(tmp_path / "local"), shard_tokens=SHARD)
    remote = prepare(source, VOCAB, cache_root="memory://caches", shard_tokens=SHARD)
    store = Store(remote.dir)
    assert {n: store.read(n) for n in shard_files(local.dir)} == shard_files(local.dir)
    assert not prepare(source, VOCAB, cache_root="memory://caches", shard_tokens=SHARD, verify=True).built
    with pytest.raises(DataError, match="is on an object store; training memory-maps shards from a local"):
        remote.tokens("train")


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_read_disjoint_windows_whose_union_is_the_one_rank_stream(tmp_path, world):
    cache = prepare(corpus(tmp_path), VOCAB, cache_root=str(tmp_path / "c"), shard_tokens=SHARD)
    tokens = cache.tokens("train")
    one = RandomWindows(tokens, batch_size=8, max_len=64, seed=3)
    ranks = []
    for rank in range(world):
        windows = RandomWindows(tokens, batch_size=8, max_len=64, seed=3)
        windows.rank, windows.world = rank, world
        ranks.append(windows)
    stream = np.array(tokens)
    crossed = False
    for i in range(20):
        x, y = one.batch(i)
        starts = one.starts(i)
        crossed |= any(s // SHARD != (s + 64) // SHARD for s in starts)
        assert torch.equal(
            x, torch.from_numpy(np.stack([stream[s : s + 64] for s in starts]).astype(np.int64))
        )
        parts = [r.batch(i)[0] for r in ranks]
        assert torch.equal(torch.cat(parts), x)  # disjoint row blocks, together the one-rank batch
    assert crossed, "no window crossed a shard edge: the test would not see a wrong read"


def test_a_complete_split_takes_nothing_more(tmp_path):
    store = Store(str(tmp_path / "s"))
    writer = ShardWriter(store, "val", 4, np.uint16, "sha", [])
    writer.add(0, np.arange(6, dtype=np.uint16), 6)
    shards = writer.close()
    assert [s["tokens"] for s in shards] == [4, 2] and shards[0]["resume"] == {"index": 0, "offset": 4}
    again = ShardWriter(store, "val", 4, np.uint16, "sha", shards)
    again.add(1, np.arange(3, dtype=np.uint16), 3)
    assert again.close() == shards


def test_a_streamed_hub_style_source_routes_by_hash_past_one_block(tmp_path, monkeypatch):
    # the hub path (datasets.load_dataset(..., streaming=True)) on local json rows; a block smaller than the
    # corpus makes the carve route each document by its hash, as it does for fineweb-edu
    import rope_llama.data.sources as sources

    monkeypatch.setattr(sources, "HOLDOUT_BLOCK_CHARS", 2000)
    rows = [f"Row {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 5) for i in range(400)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    source = {
        "kind": "hf",
        "path": "json",
        "data_files": str(tmp_path / "rows.jsonl"),
        "holdout_fraction": 0.1,
    }
    streamed = sources.load_documents({**source, "streaming": True})
    assert sources.load_documents({**source, "streaming": False}) == streamed
    assert sorted(sum(streamed.values(), [])) == sorted(rows)
    for split, (lo, hi) in {"val": (0, 0.1), "test": (0.1, 0.2), "train": (0.2, 1)}.items():
        assert streamed[split] and all(lo <= sources.hash_fraction(t) < hi for t in streamed[split])
    cache = prepare({**source, "streaming": True}, VOCAB, cache_root=str(tmp_path / "c"), shard_tokens=SHARD)
    assert cache.meta["splits"]["val"]["documents"] == len(streamed["val"])
