"""out/summary.md and the files beside it: every table (tables.py) and plot (plots.py, and the retrieval
plots of inference/reporting.py) of a finished or partly finished study."""

from __future__ import annotations

from pathlib import Path

from rope_llama.core.checkpoint import atomic_write_text
from rope_llama.inference.reporting import plot_vs_length, write_csv
from rope_llama.inference.retrieval import pooled_heldout
from rope_llama.study.config import StudyConfig, model_and_seed
from rope_llama.study.plots import plot_corpora, plot_depths
from rope_llama.study.tables import (
    RECALL_COLUMN,
    cost_table,
    paired_extensions,
    paired_ppl,
    read_csv,
    retrieval_tables,
    seed_table,
)


def summarise(
    cfg: StudyConfig, out: Path, models: list[str], base_len: int, train_extra: list[str], seeds: list[int]
) -> None:
    """out/summary.md, paired_ppl.csv, retrieval.csv, paired_retrieval.csv and the plots."""
    # the model and seed columns each run's CSV rows get
    columns = {m: dict(zip(("model", "seed"), model_and_seed(m, seeds[0]))) for m in models}
    finetuned = seeds[: cfg.finetune_seeds]
    several = "s" if len(finetuned) > 1 else ""
    windows = {
        corpus: [w for m in models for w in read_csv(out / "eval" / corpus / m / "windows.csv", **columns[m])]
        for corpus in cfg.corpora
    }
    bases = (
        f"The base model {cfg.base_ckpt} (context L = {base_len}); "
        if cfg.base_ckpt
        else f"{len(seeds)} base model(s) trained at L = {base_len} (recipe: "
        f"{(not cfg.smoke and cfg.recipe) or 'the default job'}; seeds {', '.join(map(str, seeds))}); "
    )
    header = (
        f"# RoPE extrapolation study ({'smoke' if cfg.smoke else 'full'})\n\n{bases}"
        + (
            f"`pi`/`yarn` fine-tuned at 4L from the base{several} of seed{several} {', '.join(map(str, finetuned))}; "
            if finetuned
            else "no fine-tunes; "
        )
        + (
            f"`large_base` reused from {cfg.large_base_ckpt}. "
            if cfg.large_base_ckpt
            else f"`large_base` (seed 0) trained with rope.base={cfg.large_base:g}. "
            if cfg.large_base is not None
            else "no large-base model. "
        )
        + (f"Every training ran with `{' '.join(train_extra)}`. " if train_extra else "")
        + f"Corpora: {', '.join(cfg.corpora)} (own = the training data's held-out test split). Per-model tables and "
        "plots: eval/<corpus>/<model>/, retrieval/<model>/.\n\n## Perplexity\n"
    )
    text, paired = [header], []
    for corpus, rows in windows.items():
        text.append(seed_table(rows, corpus))
        rows_paired, md = paired_ppl(rows, corpus, "base", base_len)
        extension_rows, extension_md = paired_extensions(rows, corpus, base_len, seeds[0])
        paired += rows_paired + extension_rows
        text += [md, extension_md]
    if paired:  # empty when no length reaches the training length
        write_csv(out / "paired_ppl.csv", paired)
    text.append(cost_table(out, windows, models, base_len, seeds[0]))
    plot_corpora(windows, base_len, out / "summary.png")
    if cfg.retrieval:
        trials = [
            t
            for m in models
            if (out / "retrieval" / m / "trials.csv").exists()
            for t in read_csv(out / "retrieval" / m / "trials.csv", **columns[m])
        ]
        trials += pooled_heldout(trials)  # the held-out families together: the headline task
        accuracy, paired_retrieval, md = retrieval_tables(trials)
        write_csv(out / "retrieval.csv", accuracy)
        if paired_retrieval:  # empty when the base models ran a single retrieval method
            write_csv(out / "paired_retrieval.csv", paired_retrieval)
        text += ["\n## Retrieval\n", md]
        retrieval_plots(accuracy, trials, out)
    atomic_write_text(out / "summary.md", "\n".join(text))
    print(
        f"[study] wrote {out / 'summary.md'}, summary.png, paired_ppl.csv"
        + (
            ", retrieval.csv, paired_retrieval.csv, retrieval_<task>[_ranking|_depths|_recall_depths].png"
            if cfg.retrieval
            else ""
        )
    )


def retrieval_plots(accuracy: list[dict], trials: list[dict], out: Path) -> None:
    """Per task (`retrieval_tables` rows, the trials behind them): accuracy vs length, greedy and ranking,
    greedy accuracy by depth, and recall by depth for a task that asks for a list."""
    for task in dict.fromkeys(r["task"] for r in accuracy):
        rows = [r for r in accuracy if r["task"] == task]
        plot_vs_length(rows, task, out / f"retrieval_{task}.png")
        plot_vs_length(rows, task, out / f"retrieval_{task}_ranking.png", metric="ranking")
        plot_depths(trials, task, out / f"retrieval_{task}_depths.png")
        if "recall_mean" in rows[0]:  # all-or-nothing answers are rare there: recall differs
            plot_depths(trials, task, out / f"retrieval_{task}_recall_depths.png", column=RECALL_COLUMN)
