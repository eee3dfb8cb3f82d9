"""The figures of scripts/visualize.py: each takes the rows of its CSV and writes one PNG, so a picture
shows exactly the numbers saved beside it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

BAND_COLOURS = {"kept": "tab:green", "ramped": "tab:orange", "interpolated": "tab:red"}


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_wavelengths(rows: list[dict], training_len: int, factor: float, path: Path) -> None:
    """Wavelength per rotary pair, one line per scaling; each pair's band marked; L0 and s L0 dashed."""
    fig, ax = plt.subplots(figsize=(8, 5))
    by_scaling = defaultdict(list)
    for r in rows:
        by_scaling[r["scaling"]].append(r)
    for scaling, sel in by_scaling.items():
        line = ax.plot([r["pair"] for r in sel], [r["wavelength"] for r in sel], label=scaling)[0]
        if scaling in ("yarn", "llama3"):
            for band, colour in BAND_COLOURS.items():
                pts = [r for r in sel if r["band"] == band]
                ax.scatter([r["pair"] for r in pts], [r["wavelength"] for r in pts], s=14, color=colour,
                           edgecolor=line.get_color(), zorder=3, label=f"{scaling}: {band}")  # fmt: skip
    ax.axhline(training_len, color="gray", linestyle="--", linewidth=1, label=f"L0 = {training_len}")
    ax.axhline(
        training_len * factor,
        color="gray",
        linestyle=":",
        linewidth=1,
        label=f"s L0 = {training_len * factor:g}",
    )
    ax.set(
        yscale="log", xlabel="rotary pair i", ylabel="wavelength 2π/θ_i (tokens)", title="RoPE wavelengths"
    )
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def plot_relative(rows: list[dict], path: Path) -> None:
    """Score of fixed q, k against m - n, one panel per scaling, one line per absolute offset."""
    scalings = list(dict.fromkeys(r["scaling"] for r in rows))
    fig, axes = plt.subplots(1, len(scalings), figsize=(3.2 * len(scalings), 3.4), squeeze=False, sharey=True)
    for ax, scaling in zip(axes[0], scalings):
        for offset in dict.fromkeys(r["offset"] for r in rows):
            sel = [r for r in rows if r["scaling"] == scaling and r["offset"] == offset]
            ax.plot(
                [r["distance"] for r in sel], [r["score"] for r in sel], label=f"offset {offset:g}", alpha=0.8
            )
        ax.set(title=scaling, xlabel="m - n")
    axes[0][0].set_ylabel("<rot(q, m), rot(k, n)>")
    axes[0][-1].legend(fontsize=7)
    _save(fig, path)


def plot_decay(rows: list[dict], training_len: int, path: Path) -> None:
    """RoFormer's relative upper bound against distance, one line per scaling and base."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["curve"] for r in rows):
        sel = [r for r in rows if r["curve"] == name]
        ax.plot([r["distance"] for r in sel], [r["bound"] for r in sel], label=name)
    ax.axvline(training_len, color="gray", linestyle="--", linewidth=1)
    ax.set(
        xscale="log",
        xlabel="relative distance m",
        ylabel="(1/(d/2)) Σ_j |S_j|",
        title="long-term decay bound",
    )
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_remaps(rows: list[dict], training_len: int, path: Path) -> None:
    """The relative distance attention uses against the true one, per method."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        sel = [r for r in rows if r["method"] == method]
        ax.plot([r["distance"] for r in sel], [r["seen"] for r in sel], label=method)
    ax.axhline(training_len, color="gray", linestyle="--", linewidth=1, label=f"L0 = {training_len}")
    ax.set(xlabel="true distance", ylabel="distance attention uses", title="position remaps")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_heatmaps(
    maps: dict[int, np.ndarray], title: str, marks: tuple[float, float] | None, path: Path
) -> None:
    """One panel per (layer, head): mean probability per query x key cell, log colour scale; the needle's
    key cells (fractions of the window) marked."""
    layers = sorted(maps)
    heads = maps[layers[0]].shape[0]
    fig, axes = plt.subplots(
        len(layers), heads, figsize=(1.9 * heads, 1.9 * len(layers) + 0.6), squeeze=False
    )
    positive = [m[m > 0] for m in maps.values()]
    low = max(min(float(p.min()) for p in positive if p.size), 1e-8)
    norm = LogNorm(vmin=low, vmax=max(float(p.max()) for p in positive if p.size))
    for row, layer in enumerate(layers):
        for head in range(heads):
            ax = axes[row][head]
            image = ax.imshow(np.ma.masked_less_equal(maps[layer][head], 0), norm=norm, cmap="viridis",
                              extent=(0, 1, 1, 0), aspect="auto")  # fmt: skip
            if marks:
                ax.axvspan(*marks, color="red", alpha=0.25)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"L{layer} H{head}", fontsize=7)
    fig.suptitle(title + " (query rows x key columns)", fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.6)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(
    rows: list[dict], x: str, y: str, xlabel: str, ylabel: str, path: Path, log_x: bool, log_y: bool = False
) -> None:
    """Panels: lengths x methods; in each, every head thin and each layer's head average bold."""
    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(len(lengths), len(methods), figsize=(3.6 * len(methods), 3 * len(lengths)),
                             squeeze=False, sharey=True)  # fmt: skip
    cmap = plt.get_cmap("viridis")
    for i, length in enumerate(lengths):
        for j, method in enumerate(methods):
            ax = axes[i][j]
            sel = [r for r in rows if r["length"] == length and r["method"] == method]
            layers = sorted({r["layer"] for r in sel})
            for rank, layer in enumerate(layers):
                colour = cmap(rank / max(1, len(layers) - 1))  # by rank: recorded layers need not be 0..n-1
                curves = defaultdict(list)
                for r in sel:
                    if r["layer"] == layer:
                        curves[r["head"]].append((r[x], r[y]))
                for points in curves.values():
                    ax.plot(*zip(*points), color=colour, alpha=0.15, linewidth=0.7)
                mean = np.mean([[p[1] for p in points] for points in curves.values()], axis=0)
                ax.plot(
                    [p[0] for p in next(iter(curves.values()))], mean, color=colour, label=f"layer {layer}"
                )
            ax.set(title=f"{method}, T={length}", xlabel=xlabel)
            if log_x:
                ax.set_xscale("symlog", linthresh=1)
            if log_y:
                ax.set_yscale("log")
            if j == 0:
                ax.set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    _save(fig, path)


def plot_needle(rows: list[dict], path: Path) -> None:
    """The answer token's attention on the needle, per layer (the head that attends most, and the mean)."""
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        for method in dict.fromkeys(r["method"] for r in rows):
            sel = [r for r in rows if r["length"] == length and r["method"] == method]
            layers = sorted({r["layer"] for r in sel})
            best = [max(r["needle_mass"] for r in sel if r["layer"] == layer) for layer in layers]
            mean = [np.mean([r["needle_mass"] for r in sel if r["layer"] == layer]) for layer in layers]
            line = ax.plot(layers, best, marker="o", label=f"{method} (best head)")[0]
            ax.plot(layers, mean, linestyle="--", color=line.get_color(), label=f"{method} (mean)")
        ax.set(title=f"T={length}", xlabel="layer", ylabel="answer's attention on the needle")
    axes[0][-1].legend(fontsize=7)
    _save(fig, path)
