"""The study's retrieval tables and depth pictures over the trials.csv of several scripts/passkey.py runs: one
comparison split between folders (methods answered side by side, an in-window reference at its own length)
read as one base model, on the prompts that every method of a (task, length) answered.

    python tools/retrieval_tables.py out=runs/multivalue-tables \
        runs=runs/smollm2-multivalue-a,runs/smollm2-multivalue-b,runs/smollm2-multivalue-1x

Writes out/summary.md (study/tables.py's `retrieval_tables`: greedy and ranking accuracy with Wilson
intervals, the first-token margin, recall for a task that asks for a list, each paired against the best
method over depth clusters), out/retrieval.csv, out/paired_retrieval.csv and study/summary.py's pictures
(`retrieval_<task>_depths.png`, `_recall_depths.png`, ...). A prompt some method lacks (a loop stopped
mid-depth) is left out of its (task, length) for every method, so the pairs stay paired; how many were kept
is printed. A prompt two folders answered for the same method is read from the first. The held-out families'
trials are also pooled as task `heldout`, the suite's headline, as the study's summary does.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from rope_llama.cli.errors import one_sentence_errors
from rope_llama.core.checkpoint import atomic_write_text
from rope_llama.inference.reporting import write_csv
from rope_llama.inference.retrieval import pooled_heldout
from rope_llama.study.summary import retrieval_plots
from rope_llama.study.tables import read_csv, retrieval_tables

OPTIONS = ("out", "runs")


def parse(argv: list[str]) -> dict:
    """key=value arguments -> {"out": Path, "runs": [Path, ...]}; bad ones raise ValueError (one sentence)."""
    if malformed := [a for a in argv if "=" not in a]:
        raise ValueError(f"arguments are key=value ({', '.join(OPTIONS)}), got {malformed[0]!r}.")
    args = dict(item.split("=", 1) for item in argv)
    if unknown := sorted(set(args) - set(OPTIONS)):
        raise ValueError(f"unknown options {unknown}; options are {', '.join(OPTIONS)}.")
    if not args.get("out") or not args.get("runs"):
        raise ValueError("out=<directory> and runs=<folder>[,<folder> ...] are both required.")
    runs = [Path(r) for r in args["runs"].split(",")]
    if missing := [str(r) for r in runs if not (r / "trials.csv").is_file()]:
        raise ValueError(
            f"no trials.csv in {', '.join(missing)}; runs= takes scripts/passkey.py out folders."
        )
    return {"out": Path(args["out"]), "runs": runs}


def common_prompts(trials: list[dict]) -> tuple[list[dict], dict]:
    """The trials whose (depth, trial) every method of their (task, length) answered, and per (task, length)
    (kept prompts, the most any method answered)."""
    answered = defaultdict(lambda: defaultdict(set))  # (task, length) -> method -> {(depth, trial)}
    for t in trials:
        answered[t["task"], t["length"]][t["method"]].add((t["depth"], t["trial"]))
    common = {cell: set.intersection(*by_method.values()) for cell, by_method in answered.items()}
    kept = [t for t in trials if (t["depth"], t["trial"]) in common[t["task"], t["length"]]]
    counts = {cell: (len(common[cell]), max(map(len, answered[cell].values()))) for cell in answered}
    return kept, counts


def first_answers(trials: list[dict]) -> list[dict]:
    """Each (task, length, method, depth, trial) once, from the first run that answered it: two folders holding
    the same method's prompt would count it twice and break the pairing."""
    seen, kept = set(), []
    for t in trials:
        prompt = (t["task"], t["length"], t["method"], t["depth"], t["trial"])
        if prompt not in seen:
            seen.add(prompt)
            kept.append(t)
    return kept


@one_sentence_errors
def main(argv: list[str]) -> None:
    args = parse(argv)
    read = [t for run in args["runs"] for t in read_csv(run / "trials.csv", model="base", seed=0)]
    trials = first_answers(read)
    if dropped := len(read) - len(trials):
        print(f"{dropped} prompts answered again in a later folder of runs= are read from the first")
    trials, counts = common_prompts(trials)
    for (task, length), (kept, most) in sorted(counts.items()):
        print(f"{task} at {length}: {kept} prompts answered by every method (of up to {most})")
    trials += pooled_heldout(trials)  # after the common prompts, so the pooled pairs stay paired too
    accuracy, paired, markdown = retrieval_tables(trials)
    out = args["out"]
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "retrieval.csv", accuracy)
    if paired:
        write_csv(out / "paired_retrieval.csv", paired)
    retrieval_plots(accuracy, trials, out)
    atomic_write_text(out / "summary.md", f"# Retrieval over {', '.join(map(str, args['runs']))}\n{markdown}")
    print(f"wrote {out / 'summary.md'}, retrieval.csv, paired_retrieval.csv and the pictures")


if __name__ == "__main__":
    main(sys.argv[1:])
