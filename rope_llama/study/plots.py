"""The study's plots: perplexity vs length per corpus, one line per model/method over seeds; retrieval accuracy
by needle depth, one heatmap row per model/method and one panel per length."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def plot_corpora(windows: dict[str, list[dict]], max_len: int, path: Path) -> None:
    """Perplexity vs length per corpus: one line per model/method, the mean over seeds (the range shaded)."""
    fig, axes = plt.subplots(1, len(windows), figsize=(7 * len(windows), 5), squeeze=False)
    for ax, (corpus, rows) in zip(axes[0], windows.items()):
        per_seed = defaultdict(list)
        for w in rows:
            per_seed[w["model"] + "/" + w["method"], w["length"], w["seed"]].append(w["loss"])
        curves = defaultdict(lambda: defaultdict(list))
        for (name, length, _), losses in per_seed.items():
            curves[name][length].append(float(np.exp(np.mean(losses))))
        colors = plt.get_cmap("tab20").colors  # more distinct colours than the default cycle's ten
        for (name, by_length), color in zip(curves.items(), colors[::2] + colors[1::2]):
            x = sorted(by_length)
            style = "-" if name.startswith("base/") else "--"  # single-seed models dashed
            ax.plot(x, [np.mean(by_length[t]) for t in x], style, marker="o", color=color, label=name)
            ax.fill_between(
                x, [min(by_length[t]) for t in x], [max(by_length[t]) for t in x], color=color, alpha=0.12
            )
        ax.axvline(max_len, color="gray", linestyle="--", linewidth=1)
        ax.set(
            xscale="log", yscale="log", xlabel="evaluation length (tokens)", ylabel="perplexity", title=corpus
        )
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def depth_grid(
    trials: list[dict], length: int, column: str
) -> tuple[list[str], list[float], np.ndarray, list[int]]:
    """The trials of one task at `length` as (model/method names in first-seen order, depths, the (names,
    depths) mean of `column` (NaN where a cell has no trial), the trial counts per cell, sorted, distinct)."""
    rows = [t for t in trials if t["length"] == length]
    names = list(dict.fromkeys(t["model"] + "/" + t["method"] for t in rows))
    depths = sorted({t["depth"] for t in rows})
    cells = defaultdict(list)
    for t in rows:
        cells[t["model"] + "/" + t["method"], t["depth"]].append(t[column])
    grid = np.array([[np.mean(cells[n, d]) if (n, d) in cells else np.nan for d in depths] for n in names])
    return names, depths, grid, sorted({len(v) for v in cells.values()})


def plot_depths(trials: list[dict], task: str, path: Path, column: str = "greedy_correct") -> None:
    """`task`'s accuracy (the mean of `column` over seeds and trials: a 0/1 score, or a share such as
    greedy_recall) by needle depth: one panel per prompt length, one row per model/method, the trials per
    cell in each panel's title."""
    rows = [t for t in trials if t["task"] == task]
    grids = {length: depth_grid(rows, length, column) for length in sorted({t["length"] for t in rows})}
    # a panel as wide as its depths: a focus length may run fewer (focus_depths)
    widths = [len(depths) for _, depths, _, _ in grids.values()]
    rows_shown = max(len(names) for names, _, _, _ in grids.values())
    fig, axes = plt.subplots(1, len(grids), figsize=(1.1 * sum(widths) + 3, 0.35 * rows_shown + 1.6), squeeze=False,
                             gridspec_kw={"width_ratios": widths})  # fmt: skip
    for ax, (length, (names, depths, grid, counts)) in zip(axes[0], grids.items()):
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=7, color="white" if v < 0.5 else "black")  # fmt: skip
        per_cell = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        ax.set(xticks=range(len(depths)), xticklabels=depths, xlabel="needle depth",
               title=f"T = {length} ({per_cell} per cell)")  # fmt: skip
        ax.set_yticks(range(len(names)), labels=names, fontsize=8)
    # greedy_correct -> "greedy accuracy"; a share that is no 0/1 score (greedy_recall) keeps its own name
    label = column.removesuffix("_correct") + " accuracy" if column.endswith("_correct") else column
    fig.suptitle(f"{task}: {label.replace('_', ' ')} by depth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
