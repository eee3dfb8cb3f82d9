"""Tokenizing a local corpus into token shards with each candidate engine, at 1 and 2 worker processes.

    python tools/bench_prepare.py tokenizer=runs/default/tokenizer.json                  # ~20M tokens
    python tools/bench_prepare.py tokenizer=... copies=80 workers=[1,2] engines=[datasets,litdata]

The corpus is `copies` shuffled copies of the embedded plays and the KJV (one file per copy; each copy's line
order inside a play or book is shuffled, so no two files are equal); both engines encode each paragraph (text
between blank lines) as BOS ids EOS. Engines:

- datasets: `load_dataset("text", sample_by="paragraph")`, then `Dataset.map(batched, num_proc=N)` encoding
  BOS ids EOS, then one pass writing numpy uint16 shards (the llm.c / modded-nanogpt layout);
- litdata:  `litdata.optimize(fn, inputs=files, num_workers=N, item_loader=TokensLoader())`, the path litgpt
  takes for TinyLlama's pretraining data (LitData's own chunk format).

Each engine runs in a fresh temporary directory (no cache carried over); the time covers everything from the
files to the finished shards; each worker process tokenizes on one core (RAYON_NUM_THREADS=1 unless set). An
engine that cannot be imported is reported, not fatal. Prints a markdown table.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHARD_TOKENS = 2**24  # 16M tokens per numpy shard (32 MiB of uint16)
# One core per worker process: the tokenizer's own Rust thread pool would otherwise spread one worker over
# every core and hide how the engines scale with processes.
os.environ.setdefault("RAYON_NUM_THREADS", "1")


def write_corpus(directory: Path, copies: int, seed: int = 0) -> tuple[list[str], int]:
    """`copies` files of the plays and books with shuffled lines; (paths, characters)."""
    from rope_llama.data.sources import load_documents

    documents = [d for split in load_documents({"kind": "shakespeare"}).values() for d in split]
    documents += [d for split in load_documents({"kind": "kjv"}).values() for d in split]
    rng, paths, chars = random.Random(seed), [], 0
    for k in range(copies):
        shuffled = []
        for doc in documents:
            lines = doc.split("\n")
            rng.shuffle(lines)
            shuffled.append("\n".join(lines))
        text = "\n\n\n".join(shuffled)
        path = directory / f"copy_{k:04d}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(str(path))
        chars += len(text)
    return paths, chars


def run_datasets(paths: list[str], tokenizer_file: str, workers: int, out: Path) -> int:
    """Tokens written by the datasets engine."""
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tok = Tokenizer.from_file(tokenizer_file)
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")

    def encode(batch):
        return {"ids": [[bos, *e.ids, eos] for e in tok.encode_batch(batch["text"])]}

    # one example per paragraph (blank-line separated), as the litdata engine splits
    ds = datasets.load_dataset(
        "text", data_files=paths, sample_by="paragraph", split="train", cache_dir=str(out / "hf")
    )
    ds = ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
    buffer, buffered, total, shard = [], 0, 0, 0
    for row in ds.with_format("numpy").iter(batch_size=1024):
        for ids in row["ids"]:
            buffer.append(np.asarray(ids, np.uint16))
            buffered += len(ids)
        if buffered >= SHARD_TOKENS:
            np.concatenate(buffer).tofile(out / f"shard_{shard:05d}.bin")
            total, buffer, buffered, shard = total + buffered, [], 0, shard + 1
    if buffer:
        np.concatenate(buffer).tofile(out / f"shard_{shard:05d}.bin")
    return total + buffered


class TokenizeFile:
    """LitData's `fn`: a file's paragraphs as int16 token tensors (module level: its workers are spawned)."""

    def __init__(self, tokenizer_file: str):
        self.tokenizer_file = tokenizer_file

    def __call__(self, path: str):
        import torch
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(self.tokenizer_file)
        bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
        paragraphs = [p for p in Path(path).read_text(encoding="utf-8").split("\n\n") if p.strip()]
        for e in tok.encode_batch(paragraphs):
            yield torch.tensor([bos, *e.ids, eos], dtype=torch.int16)


def run_litdata(paths: list[str], tokenizer_file: str, workers: int, out: Path) -> int:
    """Tokens written by LitData's optimize."""
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    optimize(fn=TokenizeFile(tokenizer_file), inputs=paths, output_dir=str(out / "ld"), num_workers=workers,
             chunk_bytes="32MB", item_loader=TokensLoader(), mode="overwrite")  # fmt: skip
    return sum(os.path.getsize(p) for p in (out / "ld").glob("*.bin")) // 2


ENGINES = {"datasets": run_datasets, "litdata": run_litdata}


OPTIONS = {"tokenizer", "copies", "workers", "engines"}


def parse(argv: list[str]) -> tuple[str, int, list[int], list[str]]:
    """(tokenizer file, copies, worker counts, engines) from key=value arguments; a bad one is one sentence."""
    options = dict(a.split("=", 1) if "=" in a else (a, "") for a in argv)
    if unknown := sorted(set(options) - OPTIONS):
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; valid are {', '.join(sorted(OPTIONS))}.")
    tokenizer = options.get("tokenizer", "")
    if not os.path.isfile(tokenizer):
        raise ValueError(
            f"tokenizer={tokenizer!r} is not a file; pass a tokenizer.json (e.g. runs/default/tokenizer.json)."
        )
    copies, workers = options.get("copies", "8"), options.get("workers", "[1,2]").strip("[]").split(",")
    if not copies.isdigit() or int(copies) < 1 or not all(w.isdigit() and int(w) >= 1 for w in workers):
        raise ValueError(f"copies and workers must be integers >= 1, got copies={copies}, workers={workers}.")
    engines = options.get("engines", "[datasets,litdata]").strip("[]").split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        raise ValueError(f"engines {unknown} are unknown; valid are {', '.join(ENGINES)}.")
    return tokenizer, int(copies), [int(w) for w in workers], engines


def main(argv: list[str]) -> None:
    try:
        tokenizer, copies, workers, engines = parse(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        paths, chars = write_corpus(Path(tmp), copies)
        print(f"corpus: {len(paths)} files, {chars / 1e6:.0f}M characters")
        rows = []
        for engine in engines:
            for n in workers:
                out = Path(tempfile.mkdtemp(dir=tmp))
                try:
                    start = time.perf_counter()
                    tokens = ENGINES[engine](paths, tokenizer, n, out)
                    seconds = time.perf_counter() - start
                    rows.append((engine, n, tokens, seconds, f"{tokens / seconds:,.0f}"))
                except ImportError as e:
                    rows.append((engine, n, 0, 0.0, f"not importable: {e}"))
                print(rows[-1], flush=True)
    print("\n| engine | workers | tokens | seconds | tokens/s |\n|---|---|---|---|---|")
    for engine, n, tokens, seconds, rate in rows:
        print(f"| {engine} | {n} | {tokens:,} | {seconds:.1f} | {rate} |")


if __name__ == "__main__":
    main(sys.argv[1:])
