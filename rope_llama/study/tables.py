"""The study's tables: perplexity per method and length over seeds, paired comparisons, what each training
costs and the length it reaches, retrieval accuracy with Wilson intervals (markdown and CSV rows)."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from rope_llama.inference.reporting import fmt, miss_column, miss_shares
from rope_llama.inference.retrieval import GREEDY_MISSES, HELDOUT, greedy_miss
from rope_llama.inference.stats import pairwise_markdown, pairwise_table, wilson_interval
from rope_llama.study.config import model_and_seed

REACH_TOLERANCE = 1.10  # a length is reached while perplexity stays within 10% of the base's at L


def read_csv(path: Path, **extra) -> list[dict]:
    """CSV rows with numeric fields parsed and `extra` columns added."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            try:
                r[k] = int(v) if v.lstrip("-").isdigit() else float(v)
            except ValueError:
                pass
        r.update(extra)
    return rows


# ----------------------------------------------------------------------------- perplexity tables


def seed_table(windows: list[dict], corpus: str) -> str:
    """Markdown: perplexity per model/method (rows) and length (columns) as the mean over seeds of
    each seed's perplexity, with the range over seeds when there are several; best mean in bold."""
    per_seed = defaultdict(list)  # (model/method, length, seed) -> window losses
    for w in windows:
        per_seed[w["model"] + "/" + w["method"], w["length"], w["seed"]].append(w["loss"])
    cells = defaultdict(list)  # (row, length) -> one perplexity per seed
    for (row, length, _), losses in per_seed.items():
        cells[row, length].append(float(np.exp(np.mean(losses))))
    rows = list(dict.fromkeys(r for r, _ in cells))
    lengths = sorted({t for _, t in cells})
    best = {t: min(np.mean(cells[r, t]) for r in rows if (r, t) in cells) for t in lengths}
    out = [f"\n### {corpus}: perplexity, mean over seeds [min, max]\n",
           "| model/method | seeds | " + " | ".join(map(str, lengths)) + " |", "|---" * (len(lengths) + 2) + "|"]  # fmt: skip
    for r in rows:
        values = []
        for t in lengths:
            v = cells.get((r, t), [])
            text = (
                "—" if not v else fmt(np.mean(v)) + (f" [{fmt(min(v))}, {fmt(max(v))}]" if len(v) > 1 else "")
            )
            values.append(f"**{text}**" if v and np.mean(v) == best[t] else text)
        out.append(
            f"| {r} | {max(len(cells.get((r, t), [])) for t in lengths)} | " + " | ".join(values) + " |"
        )
    return "\n".join(out) + "\n"


def paired_ppl(windows: list[dict], corpus: str, model: str, max_len: int) -> tuple[list[dict], str]:
    """For the training length and every length beyond: every pair of `model`'s methods compared on the same windows
    (mean loss difference in nats; units = (seed, document, window), clusters = (document, seed))."""
    rows, text = [], []
    # from the training length on: inside it the remaps differ from plain RoPE (and every scaling equals it)
    for length in sorted({w["length"] for w in windows if w["model"] == model and w["length"] >= max_len}):
        cell = [w for w in windows if w["model"] == model and w["length"] == length]
        by_method = defaultdict(dict)
        for w in cell:
            by_method[w["method"]][w["seed"], w["document"], w["window"]] = w["loss"]
        if len(by_method) < 2:  # one method (e.g. a retrieval-only study's reference): nothing to pair
            continue
        units = sorted(next(iter(by_method.values())))
        values = {m: np.array([v[u] for u in units]) for m, v in by_method.items()}
        clusters = np.array([[u[1], u[0]] for u in units])
        table = pairwise_table(values, clusters, higher_is_better=False)
        rows += [{"corpus": corpus, "model": model, "length": length, **r} for r in table]
        ranking = against_best(table, {m: float(v.mean()) for m, v in values.items()}, higher_is_better=False)
        text += [f"\n#### {corpus}, {model}, T = {length}: each method against the best (loss, nats)\n",
                 against_best_markdown(ranking, "mean loss"),
                 f"\n#### {corpus}, {model}, T = {length}: loss difference (nats), row minus column\n",
                 pairwise_markdown(table), "", "Significant orderings (95%): " + orderings(table), ""]  # fmt: skip
    return rows, "\n".join(text)


def against_best(table: list[dict], means: dict[str, float], higher_is_better: bool) -> list[dict]:
    """Each method against the best one (highest or lowest mean) from `pairwise_table` rows of the same
    methods: one row per method, best first, then by mean: method, mean, diff = method - best (0 for the
    best), ci_low, ci_high (its 95% interval) and significant (the interval excludes 0)."""
    best = (max if higher_is_better else min)(means, key=means.get)
    rows = [{"method": best, "mean": means[best], "diff": 0.0, "ci_low": 0.0, "ci_high": 0.0, "significant": False}]  # fmt: skip
    for r in table:
        if best in (r["a"], r["b"]):
            # rows hold a - b: turned into other - best
            other, sign = (r["b"], 1) if r["a"] == best else (r["a"], -1)
            low, high = sorted((-sign * r["ci_low"] + 0.0, -sign * r["ci_high"] + 0.0))  # + 0.0: no "-0.000"
            rows.append({"method": other, "mean": means[other], "diff": -sign * r["diff"] + 0.0, "ci_low": low,
                         "ci_high": high, "significant": r["significant"]})  # fmt: skip
    return [rows[0], *sorted(rows[1:], key=lambda r: -r["mean"] if higher_is_better else r["mean"])]


def against_best_markdown(rows: list[dict], value: str, digits: int = 3) -> str:
    """`against_best` rows as a ranking table: rank, method, `value` (the mean's name), difference to
    the best [95%], a * where it is significant."""
    lines = [f"| rank | method | {value} | minus the best [95%] |", "|---|---|---|---|"]
    for rank, r in enumerate(rows, 1):
        diff = (
            "best"
            if rank == 1
            else f"{r['diff']:+.{digits}f} [{r['ci_low']:+.{digits}f}, {r['ci_high']:+.{digits}f}]"
            + " *" * r["significant"]
        )
        lines.append(f"| {rank} | {r['method']} | {r['mean']:.4f} | {diff} |")
    return "\n".join(lines)


def orderings(table: list[dict]) -> str:
    """The significant pairwise orderings, 'a < b' meaning a is better, or 'none'."""
    pairs = [
        f"{r['better']} < {r['b'] if r['better'] == r['a'] else r['a']}" for r in table if r["significant"]
    ]
    return ", ".join(pairs) or "none"


# ----------------------------------------------------------------------------- trained extensions: comparison and cost


def extension_losses(windows: list[dict], length: int, seed: int) -> dict[str, dict]:
    """{model/method: {(document, window): loss}} at `length` on `seed`'s windows: every trained extension
    (the fine-tunes with their own RoPE, the other bases with none) and the base's best zero-shot method
    there (the lowest mean loss), the one every extension is measured against."""
    cell = [w for w in windows if w["length"] == length and w["seed"] == seed]
    by_name = defaultdict(dict)
    for w in cell:
        by_name[w["model"] + "/" + w["method"]][w["document"], w["window"]] = w["loss"]
    zero_shot = [n for n in by_name if n.startswith("base/")]
    if not zero_shot:
        return {}
    best = min(zero_shot, key=lambda n: np.mean(list(by_name[n].values())))
    return {n: v for n, v in by_name.items() if n == best or not n.startswith("base/")}


def paired_extensions(windows: list[dict], corpus: str, max_len: int, seed: int) -> tuple[list[dict], str]:
    """Beyond the training length: the trained extensions and the best zero-shot method compared pairwise
    on the same windows of `seed` (units (document, window), clusters = documents)."""
    rows, text = [], []
    for length in sorted({w["length"] for w in windows if w["length"] > max_len}):
        by_name = extension_losses(windows, length, seed)
        if len(by_name) < 3:  # the best zero-shot method and at least two extensions
            continue
        units = sorted(set.intersection(*(set(v) for v in by_name.values())))
        values = {n: np.array([v[u] for u in units]) for n, v in by_name.items()}
        table = pairwise_table(values, np.array([u[0] for u in units]), higher_is_better=False)
        rows += [{"corpus": corpus, "model": "extensions", "length": length, **r} for r in table]
        text += [f"\n#### {corpus}, trained extensions (seed {seed}), T = {length}: loss difference (nats), row minus column\n",
                 pairwise_markdown(table), "", "Significant orderings (95%): " + orderings(table), ""]  # fmt: skip
    return rows, "\n".join(text)


def training_cost(run_dir: Path) -> dict:
    """Steps, tokens, attention FLOPs (forward + backward, 12 * layers * d_model * L per token, as
    LitLlama's MFU counts them) and training seconds of one study run, from its saved config and metrics."""
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    steps, batch, length = cfg.trainer.max_steps, cfg.data.batch_size, cfg.data.max_len
    tokens = steps * batch * length
    seconds = [
        r["time/train_s"]
        for r in read_csv(run_dir / "metrics.csv")
        if isinstance(r.get("time/train_s"), float)
    ]
    return {"steps": steps, "tokens": tokens, "attention_flops": tokens * 12 * cfg.model.n_layers * cfg.model.d_model * length,
            "seconds": max(seconds, default=float("nan"))}  # fmt: skip


def reach(ppl: dict[int, float], threshold: float, max_len: int) -> int | None:
    """The longest length T >= max_len whose perplexity, and every evaluated one from max_len to T, stays at
    or below `threshold`; None when the first already does not."""
    reached = None
    for length in sorted(t for t in ppl if t >= max_len):
        if ppl[length] > threshold:
            break
        reached = length
    return reached


def seed_perplexities(rows: list[dict], seed: int) -> dict[str, dict[int, float]]:
    """{model/method: {length: perplexity over its windows}} of `seed`'s evaluation rows."""
    losses = defaultdict(lambda: defaultdict(list))
    for w in rows:
        if w["seed"] == seed:
            losses[w["model"] + "/" + w["method"]][w["length"]].append(w["loss"])
    return {
        n: {t: float(np.exp(np.mean(v))) for t, v in by_length.items()} for n, by_length in losses.items()
    }


def cost_table(out: Path, windows: dict[str, list[dict]], models: list[str], max_len: int, seed: int) -> str:
    """Markdown: for each training of `seed` (and the base's best zero-shot method, at no cost), its cost
    and, per corpus, the length it reaches (REACH_TOLERANCE x the base's `none` perplexity at the training
    length) with its perplexity at 4L and at the longest length."""

    corpora = list(windows)
    ppl = {c: seed_perplexities(rows, seed) for c, rows in windows.items()}
    thresholds = {
        c: REACH_TOLERANCE * ppl[c].get("base/none", {}).get(max_len, float("nan")) for c in corpora
    }
    longest = max(w["length"] for rows in windows.values() for w in rows)
    shown = sorted({4 * max_len, longest})

    def cell(c: str, name: str) -> str:
        curve = ppl[c].get(name, {})
        at = " / ".join(f"{curve[t]:.1f}" if t in curve else "-" for t in shown)
        return f"{reach(curve, thresholds[c], max_len) or '-'} ({at})"

    lines, zero_shot = [], []
    # the best zero-shot method: the one reaching furthest, then the lowest perplexity there
    for c in corpora:
        curves = {n: curve for n, curve in ppl[c].items() if n.startswith("base/")}
        reaches = {n: reach(curve, thresholds[c], max_len) or 0 for n, curve in curves.items()}
        best = max(reaches, key=lambda n: (reaches[n], -curves[n].get(reaches[n], np.inf)), default=None)
        zero_shot.append(f"{best.removeprefix('base/')}: {cell(c, best)}" if best else "-")
    lines.append("| none: the base's best zero-shot method | 0 | 0 | 0 | 0 | " + " | ".join(zero_shot) + " |")
    for model in models:
        name, run_seed = model_and_seed(model, seed)
        run_dir = out / "runs" / model
        if run_seed != seed or not (run_dir / ".hydra" / "config.yaml").exists():
            continue  # another seed's run, or a reused checkpoint (base_ckpt, large_base_ckpt)
        cost = training_cost(run_dir)
        # a fine-tune with its own RoPE, a base with none
        cells = [cell(c, f"{name}/ckpt" if f"{name}/ckpt" in ppl[c] else f"{name}/none") for c in corpora]
        lines.append(f"| {model} | {cost['steps']} | {cost['tokens'] / 1e6:.2f}M | {cost['attention_flops']:.2e} | "
                     f"{cost['seconds']:.0f} | " + " | ".join(cells) + " |")  # fmt: skip
    at = " / ".join(map(str, shown))
    return "\n".join([
        f"\n### What each training buys (seed {seed})\n",
        f"Per corpus: the reach, the longest evaluated length up to which perplexity stays within "
        f"{REACH_TOLERANCE - 1:.0%} of the base's `none` at L = {max_len} "
        f"({', '.join(f'{c}: {t:.2f}' for c, t in thresholds.items())}), and in brackets the perplexity at {at}; "
        "fine-tunes with their own RoPE, bases with `none`. Seconds: training time as the study ran it (steps side "
        "by side, one thread each). A fine-tune's cost adds to its base's (the base_s row).\n",
        "| training | steps | tokens | attention FLOPs | seconds | " + " | ".join(corpora) + " |",
        "|---" * (5 + len(corpora)) + "|",
        *lines, ""])  # fmt: skip


# ----------------------------------------------------------------------------- retrieval tables


# (name, trials.csv column): the exact answer (greedy decoding), and the key scored above the other
# candidates (scripts/passkey.py), which separates methods where exact copies are rare
RETRIEVAL_METRICS = (("greedy", "greedy_correct"), ("ranking", "rank_correct"))


# The answer's first-token log-prob minus the best other token's (nats): continuous, so its paired
# differences can order methods whose greedy accuracies tie. trials.csv files older than it lack it.
MARGIN_COLUMN = "first_margin"

# The share of the asked values the greedy answer gives (RULER's string_match_all): the score of a task that
# asks for a list (multiquery, multivalue), where an all-or-nothing greedy answer is rare for every method
RECALL_COLUMN = "greedy_recall"
# metrics shown as a mean over prompts with the range of the seeds' means (no Wilson interval: not 0/1)
MEAN_METRICS = ("margin", "recall")


def seed_means(rows: list[dict], column: str) -> list[float]:
    """The mean of `column` over each seed's rows, one value per seed, in the order of the seeds."""
    per_seed = defaultdict(list)
    for r in rows:
        per_seed[r["seed"]].append(r[column])
    return [float(np.mean(v)) for _, v in sorted(per_seed.items())]


def csv_values(cell) -> tuple[int, ...]:
    """The integers of a trials.csv cell of space-separated values (read_csv parses a single one as a number and
    none as "")."""
    return tuple(int(v) for v in str(cell).split())


def answers_of(trial: dict) -> tuple[int, ...]:
    """A trial's asked values: its `answers`, or its `key` where a trials.csv predates that column."""
    return csv_values(trial.get("answers", trial["key"]))


def distractors_of(trial: dict) -> tuple[int, ...]:
    """A trial's `distractors`: the values of the needles not asked for."""
    return csv_values(trial.get("distractors", ""))


def retrieval_tables(trials: list[dict]) -> tuple[list[dict], list[dict], str]:
    """Greedy and ranking accuracy per (task, model/method, length) pooled over seeds, each with its
    Wilson 95% interval and the range of the per-seed accuracies, the mean first-token margin with
    its range over seeds (when every trial has one) and, for a task that asks for a list, the mean recall
    the same way; paired differences of each between the base model's methods on the same prompts
    (units = prompts, clusters = (seed, depth)).
    -> (accuracy rows, paired rows, markdown)."""
    has_margin = all(MARGIN_COLUMN in t for t in trials)
    # tasks whose prompts ask for several values get recall beside the all-or-nothing greedy accuracy
    by_task = defaultdict(list)
    for t in trials:
        by_task[t["task"]].append(t)
    lists = {task for task, ts in by_task.items()
             if all(RECALL_COLUMN in t for t in ts) and any(len(answers_of(t)) > 1 for t in ts)}  # fmt: skip

    def mean_metrics(task: str) -> tuple:  # the metrics of `task` shown as means (MEAN_METRICS)
        return (("margin", MARGIN_COLUMN),) * has_margin + (("recall", RECALL_COLUMN),) * (task in lists)

    # each greedy miss's kind from the answer itself, so studies scored before passkey.py wrote it get it too
    # (read_csv may have parsed an all-digit answer as a number: its digits are what greedy_miss reads)
    has_answers = all("answer" in t and "key" in t for t in trials)
    # (trials.csv files older than its `distractors` column class no answer as another needle's)
    misses = [
        greedy_miss(str(t["answer"]), answers_of(t), distractors_of(t)) if has_answers else "" for t in trials
    ]
    cells = defaultdict(list)
    for t, miss in zip(trials, misses):
        cells[t["task"], t["model"] + "/" + t["method"], t["length"]].append(t | {"greedy_miss": miss})
    accuracy = []
    for (task, method, length), rows in cells.items():
        seeds = len({r["seed"] for r in rows})
        row = {"task": task, "method": method, "length": length, "trials": len(rows), "seeds": seeds}
        for name, column in RETRIEVAL_METRICS:
            correct = sum(r[column] for r in rows)
            seed_acc = seed_means(rows, column)
            low, high = wilson_interval(correct, len(rows))
            row |= {f"{name}_acc": correct / len(rows), f"{name}_low": low, f"{name}_high": high,
                    f"{name}_seed_min": min(seed_acc), f"{name}_seed_max": max(seed_acc)}  # fmt: skip
        for name, column in mean_metrics(task):
            seed_mean = seed_means(rows, column)
            row |= {f"{name}_mean": float(np.mean([r[column] for r in rows])),
                    f"{name}_seed_min": min(seed_mean), f"{name}_seed_max": max(seed_mean)}  # fmt: skip
        if has_answers:
            row |= miss_shares(rows)
        accuracy.append(row)
    text, paired = [], []
    base_only = [t for t in trials if t["model"].startswith("base")]  # paired: the base models' methods
    base_seeds = sorted({t["seed"] for t in base_only})
    base_trials = defaultdict(list)  # (task, length) -> the base models' trials, paired across methods
    for t in base_only:
        base_trials[t["task"], t["length"]].append(t)
    for task in sorted(dict.fromkeys(r["task"] for r in accuracy), key=headline_first):
        sel = [r for r in accuracy if r["task"] == task]
        lengths = sorted({r["length"] for r in sel})
        for name, column in RETRIEVAL_METRICS + mean_metrics(task):
            title = {
                "margin": "first-token margin (nats), mean over prompts [range of the seeds' means]",
                "recall": "recall (the share of the asked values the greedy answer gives), mean over prompts "
                "[range of the seeds' means]",
            }.get(name, f"{name} accuracy, pooled over seeds [Wilson 95%]")
            text += [f"\n### {task}: {title}\n", *table_head(lengths)]
            for method in dict.fromkeys(r["method"] for r in sel):
                cell = {r["length"]: r for r in sel if r["method"] == method}
                text.append(f"| {method} | " + " | ".join(
                    "—" if t not in cell else retrieval_cell(cell[t], name) for t in lengths) + " |")  # fmt: skip
            if name == "greedy" and len(base_seeds) > 1:
                # pooling hides a base that never copies: each seed's own accuracy, seed by seed
                seeds = " / ".join(map(str, base_seeds))
                text += [
                    f"\n### {task}: greedy accuracy per seed (base models: {seeds})\n",
                    *table_head(lengths),
                ]
                for method in dict.fromkeys(r["method"] for r in sel):
                    text.append(f"| {method} | " + " | ".join(
                        " / ".join(f"{a:.0%}" for a in seed_means(cells[task, method, t], column))
                        if (task, method, t) in cells else "—" for t in lengths) + " |")  # fmt: skip
            if name == "greedy" and has_answers:
                # why the greedy answers miss: the first token went to prose, the copy did not stop, or other digits
                text += [f"\n### {task}: greedy misses by kind ({' / '.join(GREEDY_MISSES)}), pooled over seeds\n",
                         *table_head(lengths)]  # fmt: skip
                for method in dict.fromkeys(r["method"] for r in sel):
                    cell = {r["length"]: r for r in sel if r["method"] == method}
                    text.append(f"| {method} | " + " | ".join(
                        " / ".join(f"{cell[t][miss_column(kind)]:.0%}" for kind in GREEDY_MISSES)
                        if t in cell else "—" for t in lengths) + " |")  # fmt: skip
            for length in lengths:
                by_method = defaultdict(dict)
                for t in base_trials[task, length]:
                    by_method[t["method"]][t["seed"], t["depth"], t["trial"]] = t[column]
                if len(by_method) < 2:
                    continue
                units = sorted(next(iter(by_method.values())))
                values = {m: np.array([v[u] for u in units], dtype=float) for m, v in by_method.items()}
                table = pairwise_table(values, np.array([[u[0], u[1]] for u in units]), higher_is_better=True)
                paired += [{"task": task, "metric": name, "length": length, **r} for r in table]
                ranking = against_best(
                    table, {m: float(v.mean()) for m, v in values.items()}, higher_is_better=True
                )
                text += [
                    f"\n{task} ({name}), base models, T = {length}: significant orderings (95%): {orderings(table)}",
                    f"\n{task} ({name}), base models, T = {length}, each method against the best:\n",
                    against_best_markdown(ranking, "mean" if name in MEAN_METRICS else "accuracy"),
                ]
    return accuracy, paired, "\n".join(text) + "\n"


def headline_first(task: str) -> int:
    """Table order: the held-out families pooled (the headline), the passkey beside it, then the rest."""
    return {HELDOUT: 0, "passkey": 1}.get(task, 2)


def table_head(lengths: list[int]) -> list[str]:
    """A retrieval table's header and separator lines: model/method, then one column per length."""
    return ["| model/method | " + " | ".join(map(str, lengths)) + " |", "|---" * (len(lengths) + 1) + "|"]


def retrieval_cell(row: dict, name: str) -> str:
    """One table cell: an accuracy with its Wilson interval, or the mean margin or recall with its seed range."""
    if name in MEAN_METRICS:
        form = "+.2f" if name == "margin" else ".0%"
        return f"{row[f'{name}_mean']:{form}} [{row[f'{name}_seed_min']:{form}}, {row[f'{name}_seed_max']:{form}}]"
    return f"{row[f'{name}_acc']:.0%} [{row[f'{name}_low']:.0%}, {row[f'{name}_high']:.0%}]"
