"""The study's perplexity plot: perplexity vs length per corpus, one line per model/method over seeds."""

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
