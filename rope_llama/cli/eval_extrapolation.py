"""Perplexity beyond the training length, for every RoPE scaling method, on held-out documents.

    python scripts/eval_extrapolation.py ckpt=runs/base out=results/base \
        lengths=[256,512,1024,2048,4096] methods=[none,linear,ntk,dynamic_ntk,yarn,llama3]
    python scripts/eval_extrapolation.py ckpt=runs/pi out=results/pi methods=[ckpt] sliding_stride=128

Writes to `out`: results.csv (method x length x metric, with 95% bootstrap intervals), results.md
(one table per metric), windows.csv (every window's mean loss per method and length: the units that
paired comparisons between methods use), curves.csv (bucketed loss vs position), ppl_vs_length.png
and loss_vs_position.png. Options: configs/eval.yaml; method: docs/extrapolation.md.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import hydra
import matplotlib
import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from rope_llama import CONFIGS
from rope_llama.cli.errors import one_sentence_errors
from rope_llama.cli.options import (
    begin,
    check_common,
    long_documents,
    method_grid,
    method_names,
    print_matched_groups,
    with_context_lengths,
    with_largest_cache,
)
from rope_llama.cli.schema import check_command
from rope_llama.core.checks import check_number
from rope_llama.inference.evaluation import (
    bootstrap_mean,
    bucket_curve,
    check_bootstrap,
    perplexity,
    rows_per_forward,
    sliding_window_losses,
    split_windows,
    window_counts,
    window_losses,
)
from rope_llama.inference.generation import check_scoring
from rope_llama.inference.loading import load_model
from rope_llama.inference.reporting import fmt, write_csv
from rope_llama.inference.units import (
    UNITS_FILE,
    UnitStore,
    model_fingerprint,
    positions_key,
    token_digest,
    unit_key,
)
from rope_llama.interchange.destination import staged

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

METRICS = {
    "ppl": "perplexity over whole windows of T tokens (one pass from position 0)",
    "tail_ppl": "perplexity over the last L positions of each window (L = training length)",
    "sliding_ppl": "Press-style sliding-window perplexity (windows of T, scored every `sliding_stride`)",
}
CSV_FIELDS = [
    "method", "length", "factor", "metric", "value", "loss", "ci_low", "ci_high",
    "n_windows", "n_documents", "bootstrap",
]  # fmt: skip


def metric_row(name: str, per_window: torch.Tensor, owners: torch.Tensor, cfg: DictConfig, **keys) -> dict:
    """One results.csv row: perplexity of the mean loss over windows and its bootstrap interval."""
    groups = owners if cfg.bootstrap == "document" else None
    loss, low, high = bootstrap_mean(per_window, groups, n_boot=cfg.n_boot, seed=cfg.seed)
    return {
        **keys,
        "metric": name,
        "value": perplexity(loss),
        "loss": loss,
        "ci_low": perplexity(low),
        "ci_high": perplexity(high),
        "n_windows": len(per_window),
        "n_documents": len(owners.unique()),
        "bootstrap": cfg.bootstrap,
    }


def cell_units(
    cfg: DictConfig, model, fingerprint: str, store: UnitStore, wins: torch.Tensor, context_len: int
) -> list[dict]:
    """Each window's mean loss, tail loss (its last `context_len` positions) and bucketed curve at the
    model's current positions: from `store` where an earlier run scored the same window the same way,
    else scored now and stored window by window. wins: (W, T + 1) ids."""
    length = wins.shape[1] - 1
    positions = positions_key(model, length)
    device = model.embed.weight.device.type
    keys = [
        unit_key(model=fingerprint, positions=positions, tokens=token_digest(w), chunk=cfg.chunk,
                 buckets=cfg.curve_buckets, tail=context_len, device=device)
        for w in wins
    ]  # fmt: skip
    missing = [i for i, k in enumerate(keys) if store.get(k) is None]
    batch = rows_per_forward(cfg.batch_tokens, length)
    for first in range(0, len(missing), batch):
        group = missing[first : first + batch]
        for i, loss in zip(group, window_losses(model, wins[group], cfg.chunk, batch)):  # loss: (T,)
            store.put(keys[i], {"loss": float(loss.double().mean()),
                                "tail_loss": float(loss[-context_len:].double().mean()),
                                "curve": bucket_curve(loss, cfg.curve_buckets)})  # fmt: skip
    return [store.get(k) for k in keys]


def focus_methods(cfg: DictConfig, rows: list[dict], methods: list[str], length: int) -> list[str]:
    """The methods evaluated at `length`: all, unless it is a focus length; then `none` (if asked for) and
    the `focus_count` methods of lowest perplexity at the longest evaluated length below it."""
    if length not in cfg.focus_lengths:
        return methods
    shorter = [r for r in rows if r["metric"] == "ppl" and r["length"] < length]
    if not shorter:
        raise ValueError(f"focus length {length} needs a shorter length evaluated first; add one to lengths.")
    below = max(r["length"] for r in shorter)
    ranked = sorted((r for r in shorter if r["length"] == below), key=lambda r: r["loss"])
    best = [r["method"] for r in ranked if r["method"] != "none"][: cfg.focus_count]
    chosen = [m for m in methods if m == "none" or m in best]
    print(f"focus length {length}: {', '.join(chosen)} (the best {cfg.focus_count} at {below}, and none)")
    return chosen


def evaluate_grid(
    cfg: DictConfig, ckpt, methods: list[str], documents: list, store: UnitStore
) -> tuple[list[dict], list[dict], list[dict]]:
    """Every (length, method) cell on the same documents -> (results rows, curve rows, window rows)."""
    context_len = ckpt.context_len
    fingerprint = model_fingerprint(ckpt.model)
    rows, curves, per_window = [], [], []
    for length in sorted(cfg.lengths):
        wins, owners = split_windows(documents, length, cfg.max_windows)
        chosen = focus_methods(cfg, rows, methods, length)
        for method in tqdm(chosen, desc=f"eval at {length}", unit="method"):
            cell = method_grid(cfg, ckpt, chosen, length)[method]  # from the checkpoint's own config alone
            ckpt.model.use_positions(cell.rope, cell.extend)
            keys = {"method": method, "length": length, "factor": cell.factor}
            units = cell_units(cfg, ckpt.model, fingerprint, store, wins, context_len)
            loss = torch.tensor([u["loss"] for u in units])
            rows.append(metric_row("ppl", loss, owners, cfg, **keys))
            rows.append(
                metric_row("tail_ppl", torch.tensor([u["tail_loss"] for u in units]), owners, cfg, **keys)
            )
            if cfg.sliding_stride is not None:
                batch = rows_per_forward(cfg.batch_tokens, length)
                stride = min(int(cfg.sliding_stride), length)  # a stride past T means plain windows
                sliding = sliding_window_losses(ckpt.model, wins, owners, length, stride, cfg.chunk, batch)
                rows.append(metric_row("sliding_ppl", sliding.mean(1), owners, cfg, **keys))
            # the mean over windows of each bucket's mean = the bucket of the mean curve (equal-width buckets)
            for b, (start, end, _) in enumerate(units[0]["curve"]):
                mean = float(np.mean([u["curve"][b][2] for u in units]))
                curves.append({**keys, "start": start, "end": end, "loss": mean})
            windows_seen = Counter()  # a window's index within its document
            for doc, unit in zip(owners.tolist(), units):
                per_window.append({**keys, "document": doc, "window": windows_seen[doc],
                                   "loss": unit["loss"], "tail_loss": unit["tail_loss"]})  # fmt: skip
                windows_seen[doc] += 1
    return rows, curves, per_window


def markdown_tables(rows: list[dict], header: str) -> str:
    """One table per metric: rows methods, columns lengths, the best (lowest) per column in bold."""
    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    out = [header]
    for metric in dict.fromkeys(r["metric"] for r in rows):
        cell = {(r["method"], r["length"]): r["value"] for r in rows if r["metric"] == metric}
        best = {t: min(v for (_, length), v in cell.items() if length == t) for t in lengths}
        out += [f"\n### {metric}: {METRICS[metric]}\n", "| method | " + " | ".join(map(str, lengths)) + " |"]
        out.append("|---" * (len(lengths) + 1) + "|")
        for m in methods:  # "-": a focus length that did not keep the method
            values = [
                "-"
                if (m, t) not in cell
                else f"**{fmt(cell[m, t])}**"
                if cell[m, t] == best[t]
                else fmt(cell[m, t])
                for t in lengths
            ]
            out.append(f"| {m} | " + " | ".join(values) + " |")
    return "\n".join(out) + "\n"


def plot_ppl_vs_length(rows: list[dict], context_len: int, path: Path) -> None:
    """Perplexity (and tail perplexity) vs evaluation length, one line per method, 95% bands."""
    metrics = [m for m in ("ppl", "tail_ppl") if any(r["metric"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for method in dict.fromkeys(r["method"] for r in rows):
            sel = sorted(
                (r for r in rows if r["metric"] == metric and r["method"] == method),
                key=lambda r: r["length"],
            )
            x = [r["length"] for r in sel]
            ax.plot(x, [r["value"] for r in sel], marker="o", label=method)
            ax.fill_between(x, [r["ci_low"] for r in sel], [r["ci_high"] for r in sel], alpha=0.15)
        ax.axvline(
            context_len, color="gray", linestyle="--", linewidth=1
        )  # the context length the checkpoint claims
        ax.set(xscale="log", yscale="log", xlabel="evaluation length (tokens)", ylabel=metric, title=metric)
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss_vs_position(curves: list[dict], context_len: int, path: Path) -> None:
    """Loss vs position at the longest length, one curve per method: the loss itself (left) and its excess over
    the lowest method's in each position bucket (right: who falls behind, and from where)."""
    longest = max(c["length"] for c in curves)
    at_longest = [c for c in curves if c["length"] == longest]  # a focus length runs only some methods
    by_method = {
        method: sorted((c for c in at_longest if c["method"] == method), key=lambda c: c["start"])
        for method in dict.fromkeys(c["method"] for c in at_longest)
    }
    x = [(c["start"] + c["end"]) / 2 for c in next(iter(by_method.values()))]
    losses = {m: np.array([c["loss"] for c in rows]) for m, rows in by_method.items()}
    lowest = np.min(np.stack(list(losses.values())), axis=0)  # (buckets,) the best method's loss per bucket
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = plt.get_cmap("tab20").colors  # distinct colours for up to 20 methods
    for k, (method, loss) in enumerate(losses.items()):
        style = {"color": colors[(2 * k) % 20 + (2 * k) // 20], "linestyle": "-" if k < 10 else "--"}
        axes[0].plot(x, loss, label=method, **style)
        axes[1].plot(x, loss - lowest, label=method, **style)
    for ax, ylabel in zip(axes, ("loss (nats / token)", "loss minus the lowest method's (nats)")):
        ax.axvline(context_len, color="gray", linestyle="--", linewidth=1)
        ax.set(xlabel="position", ylabel=ylabel)
    axes[0].set_title(f"loss vs position at T={longest}")
    axes[1].set_yscale("symlog", linthresh=0.05)  # linear near 0, where the close methods differ
    axes[1].set(ylim=(0, None), title="excess over the best method per position")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_options(cfg: DictConfig) -> Path:
    """Every option, before the checkpoint load; returns the results directory."""
    out = check_common(cfg)
    check_number("chunk", cfg.chunk, minimum=1, integer=True)
    if cfg.bootstrap not in ("window", "document"):
        raise ValueError(f"bootstrap must be window or document, got {cfg.bootstrap!r}.")
    check_number("max_windows", cfg.max_windows, minimum=1, integer=True, allow_none=True, none_means="all")
    check_number(
        "sliding_stride", cfg.sliding_stride, minimum=1, integer=True, allow_none=True, none_means="skip"
    )
    check_number("n_boot", cfg.n_boot, minimum=1, integer=True)  # bootstrap resamples
    check_number("curve_buckets", cfg.curve_buckets, minimum=1, integer=True)
    check_number("seed", cfg.seed, minimum=0, integer=True)
    if cfg.split not in ("val", "test"):
        raise ValueError(f"split must be val or test (held-out documents), got {cfg.split!r}.")
    return out


@torch.inference_mode()
def run(cfg: DictConfig) -> list[dict]:
    out = check_options(cfg)
    ckpt, _ = load_model(cfg.ckpt, cfg.device, cfg.dtype)
    cfg = with_context_lengths(cfg, ckpt)  # "2x" = twice the checkpoint's context length
    methods = method_names(cfg.methods, ckpt)
    print_matched_groups(cfg, ckpt, methods)
    with_largest_cache(ckpt.model, method_grid(cfg, ckpt, methods, max(cfg.lengths)))
    for length in cfg.lengths:  # before loading data; a shorter length may score more rows at once
        batch = rows_per_forward(cfg.batch_tokens, length)
        knob = "lengths, chunk or batch_tokens" if batch > 1 else "lengths or chunk"
        check_scoring(ckpt.model, length, cfg.chunk, knob=knob, rows=batch)
    begin(cfg, ckpt)
    documents = long_documents(cfg, ckpt, max(cfg.lengths) + 1)  # T + 1 tokens give T predictions
    windows = window_counts(documents, min(cfg.lengths), cfg.max_windows)  # the most of any length
    check_bootstrap(cfg.n_boot, len(documents) if cfg.bootstrap == "document" else sum(windows))
    store = UnitStore(out / UNITS_FILE, reuse=cfg.reuse)
    if store.reused:
        print(
            f"{store.reused} finished windows in {out / UNITS_FILE} are reused (reuse=false scores them again)"
        )
    rows, curves, per_window = evaluate_grid(cfg, ckpt, methods, documents, store)

    context_len = ckpt.context_len
    n_windows = {t: next(r["n_windows"] for r in rows if r["length"] == t) for t in sorted(cfg.lengths)}
    note = (
        f"# Extrapolation: {ckpt.path}\n\nContext length L = {context_len}; {len(documents)} {cfg.split} documents, "
        f"up to {cfg.max_windows} non-overlapping windows each (windows per length: {n_windows}). "
        f"Weights and activations in {str(ckpt.model.embed.weight.dtype).removeprefix('torch.')}. "
        f"Factors: {cfg.factor}. 95% intervals (results.csv) bootstrap over {cfg.bootstrap}s, seed {cfg.seed}"
        + (
            " (windows of one document are correlated: the intervals are optimistic)."
            if cfg.bootstrap == "window"
            else "."
        )
    )
    print(note.split("\n\n", 1)[1])
    with staged(out) as folder:  # a killed or failed run leaves no half result in out
        write_csv(folder / "results.csv", rows, CSV_FIELDS)
        write_csv(folder / "curves.csv", curves, ["method", "length", "factor", "start", "end", "loss"])
        write_csv(folder / "windows.csv", per_window)
        (folder / "results.md").write_text(markdown_tables(rows, note), encoding="utf-8")
        plot_ppl_vs_length(rows, context_len, folder / "ppl_vs_length.png")
        plot_loss_vs_position(curves, context_len, folder / "loss_vs_position.png")
    print(markdown_tables([r for r in rows if r["metric"] == "ppl"], ""))
    print(
        f"Wrote {cfg.out}/results.csv, results.md, windows.csv, curves.csv, ppl_vs_length.png, loss_vs_position.png"
    )
    return rows


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="eval")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    check_command("eval", cfg)  # every option before anything is loaded or written
    run(cfg)


if __name__ == "__main__":
    main()
