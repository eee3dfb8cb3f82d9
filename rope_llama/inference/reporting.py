"""Tables and plots the evaluation scripts and the study share: number formatting, CSV files, greedy-miss
shares, accuracy-vs-length plots."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from rope_llama.core.checkpoint import atomic_write_text
from rope_llama.inference.retrieval import GREEDY_MISSES


def fmt(value: float) -> str:
    return f"{value:,.2f}" if value < 1e5 else f"{value:.2e}"


def miss_column(kind: str) -> str:
    """The accuracy tables' column of a greedy miss kind ("prose first" -> "miss_prose_first")."""
    return "miss_" + kind.replace(" ", "_")


def miss_shares(rows: list[dict]) -> dict[str, float]:
    """Each greedy miss kind's share of the trials `rows` (their `greedy_miss`): with the greedy accuracy they add up to 1."""
    return {
        miss_column(kind): sum(r["greedy_miss"] == kind for r in rows) / len(rows) for kind in GREEDY_MISSES
    }


def plot_vs_length(table: list[dict], task: str, path: Path, metric: str = "greedy") -> None:
    """`metric` accuracy (row keys <metric>_acc, _low, _high) vs prompt length, one line per method,
    shaded by its Wilson 95% interval."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in table):
        rows = sorted((r for r in table if r["method"] == method), key=lambda r: r["length"])
        lengths = [r["length"] for r in rows]
        ax.plot(lengths, [r[f"{metric}_acc"] for r in rows], marker="o", label=method)
        ax.fill_between(
            lengths, [r[f"{metric}_low"] for r in rows], [r[f"{metric}_high"] for r in rows], alpha=0.15
        )
    ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel=f"{metric} accuracy", ylim=(-0.02, 1.02))
    ax.set_xticks(sorted({r["length"] for r in table}), labels=sorted({r["length"] for r in table}))
    ax.minorticks_off()  # the log axis' minor labels ("3 x 10^2") overprint the lengths
    ax.set_title(f"{task}: accuracy vs length (bands: Wilson 95%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_csv(path: Path, rows: list[dict], fields: list[str] | None = None) -> None:
    """rows -> CSV with a header (the first row's keys unless `fields` is given), written atomically."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fields or list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, text.getvalue())
