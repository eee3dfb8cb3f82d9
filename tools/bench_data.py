"""Pretraining-scale data path: preparation speed and memory, and a training start, at a corpus and at 10x it.

    python tools/bench_data.py tokenizer=runs/default/tokenizer.json                 # 200M and 2B tokens
    python tools/bench_data.py tokenizer=... tokens=20e6 workers=[1,2] out=/tmp/bd  # a quick look

The corpus is written offline: copies of the embedded plays and KJV books, one file per document, each copy's
lines shuffled (no two files alike), about 2.85M tokens per copy with the default job's 4,096-token BPE. The
10x corpus is the first one plus nine times as many further copies. Steps, each a fresh process:

1. `scripts/prepare_data.py` on the corpus with each worker count (RAYON_NUM_THREADS=1: one core per
   worker), and with the largest worker count on the 10x corpus: seconds, tokens/s, peak RSS;
2. `train.py` on each prepared cache (default model and batch): seconds from the process start to the end of
   the first training step, and peak RSS until then.

Peak RSS is the largest sum over the process and its children, sampled every 250 ms; pages that forked workers
share with their parent count once per process there, so peak PSS (each shared page split among its sharers)
is printed beside it: the memory the tree really holds. Prints markdown tables; the caches and corpus stay in `out` for reuse.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
TOKENS_PER_COPY = 2.85e6  # plays + KJV with the default 4,096-token BPE
OPTIONS = {"tokenizer", "tokens", "workers", "out", "scale"}


def first_step_clock():
    """A Lightning callback (train.py's +callbacks.first_step) writing time.time() at the end of the first
    training step to $BENCH_FIRST_STEP_FILE; built here so that the benchmark itself never imports Lightning."""
    import lightning as L

    class FirstStepClock(L.Callback):
        def on_train_batch_end(self, *args, **kwargs) -> None:
            path = Path(os.environ["BENCH_FIRST_STEP_FILE"])
            if not path.exists():
                path.write_text(repr(time.time()))

    return FirstStepClock()


def write_corpus(directory: Path, copies: range, seed: int = 0) -> None:
    """Copy k of the plays and books into directory/copy_<k:04d>/, one file per document, lines shuffled."""
    from rope_llama.data.sources import load_documents

    documents = [d for split in load_documents({"kind": "shakespeare"}).values() for d in split]
    documents += [d for split in load_documents({"kind": "kjv"}).values() for d in split]
    for k in copies:
        folder = directory / f"copy_{k:04d}"
        if (folder / "done").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        rng = random.Random(seed * 1_000_003 + k)
        for j, doc in enumerate(documents):
            lines = doc.split("\n")
            rng.shuffle(lines)
            (folder / f"doc_{j:03d}.txt").write_text("\n".join(lines), encoding="utf-8")
        (folder / "done").write_text("")


def watch(
    args: list[str], env: dict, until: Path | None = None, timeout: float = 7200
) -> tuple[float, int, str]:
    """Run `args`; (seconds to exit or to `until` appearing, peak RSS bytes of the tree, stdout)."""
    os.sync()  # no writeback of earlier steps' files competes with this one
    start = time.time()
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    root, peak = psutil.Process(proc.pid), (0, 0)
    while proc.poll() is None and not (until is not None and until.exists()):
        try:
            tree = [p.memory_full_info() for p in [root, *root.children(recursive=True)]]
            peak = tuple(
                max(a, b) for a, b in zip(peak, (sum(m.rss for m in tree), sum(m.pss for m in tree)))
            )
        except psutil.Error:
            pass
        if time.time() - start > timeout:
            proc.kill()
            raise RuntimeError(f"{args[1]} ran past {timeout} s")
        time.sleep(0.25)
    if until is not None and until.exists():
        seconds = float(until.read_text()) - start
        proc.kill()
        proc.wait()
        return seconds, peak, ""
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} exited with {proc.returncode}")
    return time.time() - start, peak, out


def link_copies(out: Path, name: str, n: int) -> str:
    """A directory of links to the first n copies, so each corpus has a glob (and a token cache) of its own."""
    for k in range(n):
        link = out / name / f"copy_{k:04d}"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(out / "corpus" / f"copy_{k:04d}")
    return f"{out / name}/*/doc_*.txt"


def data_args(corpus: str, tokenizer: str, cache: Path) -> list[str]:
    return [
        "data=text_files",
        f"data.source.paths=[{corpus}]",
        f"data.tokenizer_path={tokenizer}",
        f"data.cache_dir={cache}",
    ]


def prepare(corpus: str, tokenizer: str, cache: Path, workers: int) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [
        sys.executable,
        "scripts/prepare_data.py",
        *data_args(corpus, tokenizer, cache),
        f"workers={workers}",
    ]
    seconds, peak, out = watch(args, env)
    directory = out.strip().splitlines()[-1].split(": ", 1)[1]
    meta = json.loads(Path(directory, "meta.json").read_text())
    tokens = sum(split["tokens"] for split in meta["splits"].values())
    rate = re.search(r"tokenizing ([\d,]+) tokens/s", out)
    return {"tokens": tokens, "seconds": seconds, "rss": peak, "tokenizing": rate.group(1) if rate else "(kept)",
            "shards": sum(len(s["shards"]) for s in meta["splits"].values()), "dir": directory}  # fmt: skip


def train_start(corpus: str, tokenizer: str, cache: Path, out: Path) -> dict:
    clock = out / "first_step"
    clock.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_FIRST_STEP_FILE": str(clock)}
    args = [sys.executable, "train.py", *data_args(corpus, tokenizer, cache), "trainer.max_steps=5",
            "optim.warmup_steps=1", "sample.max_new_tokens=0", "logger=csv", f"hydra.run.dir={out / 'run'}",
            "+callbacks.first_step._target_=tools.bench_data.first_step_clock"]  # fmt: skip
    seconds, peak, _ = watch(args, env, until=clock, timeout=1800)
    return {"seconds": seconds, "rss": peak}


def parse(argv: list[str]) -> dict:
    options = dict(a.split("=", 1) if "=" in a else (a, "") for a in argv)
    if unknown := sorted(set(options) - OPTIONS):
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; valid are {', '.join(sorted(OPTIONS))}.")
    tokenizer = os.path.abspath(options.get("tokenizer", ""))
    if not os.path.isfile(tokenizer):
        raise ValueError(
            f"tokenizer={tokenizer!r} is not a file; pass a tokenizer.json (e.g. runs/default/tokenizer.json)."
        )
    workers = options.get("workers", "[1,2]").strip("[]").split(",")
    if not all(w.isdigit() and int(w) >= 1 for w in workers):
        raise ValueError(f"workers must be integers >= 1, got {workers}.")
    try:
        tokens, scale = float(options.get("tokens", "200e6")), int(options.get("scale", "10"))
    except ValueError:
        raise ValueError("tokens must be a number (e.g. 200e6) and scale an integer.") from None
    out = Path(options.get("out", "/tmp/bench_data")).resolve()
    return {"tokenizer": tokenizer, "tokens": tokens, "workers": [int(w) for w in workers], "out": out,
            "scale": scale}  # fmt: skip


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def main(argv: list[str]) -> None:
    try:
        opt = parse(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    out, tok = opt["out"], opt["tokenizer"]
    copies = max(1, round(opt["tokens"] / TOKENS_PER_COPY))
    scaled = f"{opt['scale']}x"
    write_corpus(out / "corpus", range(copies * opt["scale"]))
    corpora = {
        "1x": link_copies(out, "corpus_1x", copies),
        scaled: link_copies(out, "corpus_big", copies * opt["scale"]),
    }
    print(f"corpus: {copies} copies (1x), {copies * opt['scale']} ({scaled}) in {out}", flush=True)
    rows = []
    for workers in opt["workers"]:
        result = prepare(corpora["1x"], tok, out / f"cache_w{workers}", workers)
        rows.append(("1x", workers, result))
        print(rows[-1], flush=True)
    rows.append(
        (scaled, max(opt["workers"]), prepare(corpora[scaled], tok, out / "cache_big", max(opt["workers"])))
    )
    print(rows[-1], flush=True)
    starts = []
    for name, cache in (("1x", out / f"cache_w{max(opt['workers'])}"), (scaled, out / "cache_big")):
        starts.append((name, train_start(corpora[name], tok, cache, out)))
        print(starts[-1], flush=True)
    head = "| corpus | workers | tokens | shards | seconds | tokens/s (wall) | tokenizing tokens/s | peak RSS MiB | peak PSS MiB |"
    print(f"\n{head}\n|---|---|---|---|---|---|---|---|---|")
    for name, workers, r in rows:
        (rss, pss), wall = r["rss"], r["tokens"] / r["seconds"]
        print(f"| {name} | {workers} | {r['tokens']:,} | {r['shards']} | {r['seconds']:.1f} | {wall:,.0f} | "
              f"{r['tokenizing']} | {mib(rss)} | {mib(pss)} |")  # fmt: skip
    print("\n| corpus | seconds from train.py start to the end of step 1 | peak RSS MiB | peak PSS MiB |")
    print("|---|---|---|---|")
    for name, r in starts:
        print(f"| {name} | {r['seconds']:.1f} | {mib(r['rss'][0])} | {mib(r['rss'][1])} |")


if __name__ == "__main__":
    main(sys.argv[1:])
