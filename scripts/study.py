"""The RoPE extrapolation study, end to end, as subprocesses of the real entry points (resumable).

    python scripts/study.py out=runs/study                      # seeds=3, two corpora (docs/extrapolation.md)
    python scripts/study.py out=runs/study seeds=1 corpora=[own]
    python scripts/study.py out=/tmp/smoke smoke=true -- data.cache_dir=/tmp/cache   # minutes, tiny model

Steps (each skipped when its output already exists, so a killed study resumes; a killed training
continues from its checkpoints/last.ckpt with ckpt_path=last):
  1. train `seeds` base models at max_len 256 with rope=none and the `recipe` experiment
     (recall_base: a model that retrieves)                        -> out/runs/base_s<k>
  2. evaluate every scaling method and attention extension zero-shot on each corpus
     (own = the held-out split of the training data; kjv = the King James Bible's test books)
                                                                   -> out/eval/<corpus>/base_s<k>
  3. fine-tune the first `finetune_seeds` bases at 1024 with PI and with YaRN (experiment=extend_context:
     pi, yarn from the first seed's base, pi_s<k>, yarn_s<k> from seed k's), evaluate their own RoPE
  4. train a model with a larger RoPE base (seed 0), evaluate it with `none`; with `pose`, fine-tune the same
     bases with PoSE (experiment=pose: 256-token windows whose position ids span 4L or 16L, same steps and
     tokens as the full-length fine-tunes; the base's RoPE, PI or YaRN: pose4_none, pose4_pi, ..., pose16_yarn);
     with `randomized`, train a base from scratch on randomized position ids (experiment=randomized_positions,
     seed 0: randomized)
  5. the retrieval suite (passkey, multi-key, variable tracking) on every base and fine-tuned model
  6. out/summary.md: per corpus, mean and across-seed range per method and length; paired
     comparisons (bootstrap over documents x seeds, or prompts' depths x seeds) marking the
     significant orderings, also between the trained extensions; each training's cost (steps, tokens,
     attention FLOPs, seconds) beside the length it reaches; retrieval accuracy with Wilson 95% intervals;
     plots beside it.
Up to `jobs` steps (default 3) run at once, each with cores / jobs torch threads and its output in
out/logs/<step>.log (jobs=1: one after another, on the terminal); a line per step says when it starts
and how long it took. Arguments after `--` go to every train.py run (e.g. data=... overrides).
docs/extrapolation.md.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from omegaconf import OmegaConf

from rope_llama import CONFIGS, ROOT
from rope_llama.core.checkpoint import atomic_write_text, resolve_checkpoint
from rope_llama.core.checks import check_lengths, check_number, is_integer
from rope_llama.core.cli import USER_ERRORS, one_sentence_errors
from rope_llama.core.threads import check_threads
from rope_llama.inference.options import write_csv
from rope_llama.inference.reporting import fmt, miss_column, miss_shares, plot_vs_length
from rope_llama.inference.retrieval import GREEDY_MISSES, HELDOUT, TASKS, greedy_miss, pooled_heldout
from rope_llama.inference.stats import pairwise_markdown, pairwise_table, wilson_interval

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

# RoPE scalings, the attention extensions (model/extend.py) alone and composed with a scaling
ZERO_SHOT = "[none,linear,ntk,dynamic_ntk,yarn,llama3,self_extend,logn,yarn+logn,llama3+self_extend]"
RETRIEVAL_METHODS = "[none,ntk,dynamic_ntk,yarn,llama3,self_extend]"


@dataclass
class StudyConfig:
    out: str = "runs/study"
    smoke: bool = False  # tiny model, few steps, short lengths: checks the pipeline in minutes
    # base models: a count n (seeds 0..n-1) or the seeds themselves, e.g. [7,10,11]; seed k trains with
    # seed=1337+k data.seed=1337+k ++data.recall.seed=k (its run: base_s<k>).
    # Any: OmegaConf 2.3 has no int | list[int] field
    seeds: Any = 3
    # the bases of the first N seeds are fine-tuned (PI and YaRN at 1024; with `pose`, six PoSE fine-tunes). One
    # keeps the study near 90 minutes on 2 cores; each more adds two full-length fine-tunes (~11-13 min each, side by
    # side) and six PoSE ones (~7-8 min each) with their evaluations. The first seed's fine-tunes are named pi, yarn,
    # pose<F>_<scaling> (as in every earlier study, so those resume), seed k's with the suffix _s<k>.
    finetune_seeds: int = 1
    # experiment= of every trained model: recall_base (models that retrieve, docs/data.md); null: the default job
    recipe: str | None = "recall_base"
    corpora: list[str] = field(default_factory=lambda: ["own", "kjv"])  # own | a data config group
    # reuse one trained base model (run dir or .ckpt) as the only seed; `recipe` must be what it was trained with
    # (the fine-tunes start from it with that experiment: recipe=null for a default-job model)
    base_ckpt: str | None = None
    large_base_ckpt: str | None = None  # reuse a trained large-base model instead of step 4
    large_base: float = 500000.0
    pose: bool = True  # PoSE fine-tunes of the fine-tuned seeds' bases (POSE_FINETUNES)
    randomized: bool = True  # a base trained from scratch on randomized position ids (seed 0)
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096])
    max_windows: int = 4
    retrieval: bool = True
    # retrieval suite tasks (scripts/passkey.py): heldout = the held-out wording families, pooled as the headline
    retrieval_tasks: list[str] = field(default_factory=lambda: ["passkey", HELDOUT])
    retrieval_lengths: list[int] | None = None  # null = lengths
    retrieval_trials: int = 4  # prompts per (task, length, depth) cell and model
    threads: Any = (
        "auto"  # torch threads of the evaluations: auto (cores / jobs when jobs > 1, else the free cores) | N
    )
    # steps run at once: on the 2-core CPU three one-thread trainings side by side do 1.3x the steps of one
    # two-thread training (docs/performance.md); a lane's steps (train, then its evaluations) stay in order
    jobs: int = 3


SMOKE_TRAIN = ["model=tiny", "data.max_len=32", "data.batch_size=8", "trainer.max_steps=20",
               "trainer.val_check_interval=10", "trainer.limit_val_batches=2", "optim.warmup_steps=5",
               "sample.max_new_tokens=0"]  # fmt: skip
SMOKE_EXTEND = ["data.max_len=128", "data.batch_size=2", "trainer.max_steps=10",
                "trainer.val_check_interval=5", "optim.warmup_steps=2"]  # fmt: skip
SMOKE_POSE = ["trainer.max_steps=10", "optim.warmup_steps=2"]  # fmt: skip
SMOKE_LENGTHS = [32, 64, 128, 256, 512]
# PoSE fine-tunes: (target length / L, RoPE scaling: the base's, or PI / YaRN matched to the target); runs
# pose<factor>_<none|pi|yarn>
POSE_FINETUNES = tuple((factor, scaling) for factor in (4, 16) for scaling in ("none", "linear", "yarn"))
SCALING_NAMES = {"none": "none", "linear": "pi", "yarn": "yarn"}
REACH_TOLERANCE = 1.10  # a length is reached while perplexity stays within 10% of the base's at L
SMOKE_RETRIEVAL_LENGTHS = [512, 1024]  # the prompts' fixed parts need a few hundred tokens with a tiny BPE
RANDOMIZED = "randomized"  # the randomized-positions base's run
TRAINED = "study_trained"  # marker file in a run directory: its training finished
DONE = "study_done"  # marker file in an evaluation's out directory: every output of the step is written


class Steps:
    """Runs the study's steps as subprocesses, up to `jobs` at once (one lane of dependent steps per
    worker thread). With jobs > 1 each step's output goes to out/logs/<step>.log and its torch threads
    are the machine's cores / jobs; a failure lets the running steps finish, starts no new one, and is
    raised by `run_lanes`."""

    def __init__(self, out: Path, jobs: int) -> None:
        self.out, self.jobs = out, jobs
        self.stopped = threading.Event()  # a step failed: the others start nothing new
        self.lock = threading.Lock()
        self.started = time.monotonic()

    def say(self, line: str) -> None:
        with self.lock:  # one whole line per print, whichever worker prints
            minutes = (time.monotonic() - self.started) / 60
            print(f"[study {minutes:5.1f} min] {line}", flush=True)

    def step(self, name: str, done: Path, command: list[str]) -> None:
        """Run one entry point unless its marker `done` exists; a failure stops the study with one sentence.
        The study writes `done` (atomically) only after the command succeeded, so a step killed while
        writing its outputs runs again."""
        if done.exists():
            self.say(f"{name}: done ({done} exists), skipped")
            return
        if self.stopped.is_set():
            raise Cancelled(name)
        begun = time.monotonic()
        if self.jobs == 1:
            self.say(f"{name}: {' '.join(command)}")
            returncode = subprocess.run([sys.executable, *command], cwd=ROOT).returncode
            where = ""
        else:
            log = self.out / "logs" / (name.replace(" ", "_") + ".log")
            log.parent.mkdir(parents=True, exist_ok=True)
            threads = str(max(1, (os.cpu_count() or 1) // self.jobs))
            self.say(f"{name}: started, output in {log}: {' '.join(command)}")
            with open(log, "w") as f:
                env = {**os.environ, "OMP_NUM_THREADS": threads}  # jobs processes share the cores
                returncode = subprocess.run([sys.executable, *command], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode  # fmt: skip
            last = log.read_text(errors="replace").replace("\r", "\n").strip().rsplit("\n", 1)[-1]
            where = (
                f" ({last.removeprefix('error: ')!r}; its output: {log})" if last else f" (its output: {log})"
            )
        if returncode != 0:
            raise RuntimeError(f"step {name!r} failed{where}; fix it and re-run the same command to resume.")
        atomic_write_text(done, " ".join(command) + "\n")
        self.say(f"{name}: finished in {(time.monotonic() - begun) / 60:.1f} min")

    def guarded(self, lane: Callable[[], None]) -> None:
        try:
            lane()
        except BaseException:  # any failure (a step's, or the study's own): no new step starts
            self.stopped.set()
            raise

    def run_lanes(self, lanes: list[Callable[[], None]]) -> None:
        """Run each lane (a function calling `step` in order) on a pool of `jobs` workers, in list
        order; a lane that needs another's output waits for it, so it must come after that lane.
        Re-raises the first failure in lane order once every running step has ended."""
        with ThreadPoolExecutor(self.jobs) as pool:
            futures = [pool.submit(self.guarded, lane) for lane in lanes]
        if failures := [e for f in futures if (e := f.exception()) and not isinstance(e, Cancelled)]:
            raise failures[0]


class Cancelled(Exception):
    """A step not started because another step failed."""


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
    """For every length beyond training: every pair of `model`'s methods compared on the same windows
    (mean loss difference in nats; units = (seed, document, window), clusters = (document, seed))."""
    rows, text = [], []
    for length in sorted({w["length"] for w in windows if w["model"] == model and w["length"] > max_len}):
        cell = [w for w in windows if w["model"] == model and w["length"] == length]
        by_method = defaultdict(dict)
        for w in cell:
            by_method[w["method"]][w["seed"], w["document"], w["window"]] = w["loss"]
        units = sorted(next(iter(by_method.values())))
        values = {m: np.array([v[u] for u in units]) for m, v in by_method.items()}
        clusters = np.array([[u[1], u[0]] for u in units])
        table = pairwise_table(values, clusters, higher_is_better=False)
        rows += [{"corpus": corpus, "model": model, "length": length, **r} for r in table]
        text += [f"\n#### {corpus}, {model}, T = {length}: loss difference (nats), row minus column\n",
                 pairwise_markdown(table), "", "Significant orderings (95%): " + orderings(table), ""]  # fmt: skip
    return rows, "\n".join(text)


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


def seed_means(rows: list[dict], column: str) -> list[float]:
    """The mean of `column` over each seed's rows, one value per seed, in the order of the seeds."""
    per_seed = defaultdict(list)
    for r in rows:
        per_seed[r["seed"]].append(r[column])
    return [float(np.mean(v)) for _, v in sorted(per_seed.items())]


def retrieval_tables(trials: list[dict]) -> tuple[list[dict], list[dict], str]:
    """Greedy and ranking accuracy per (task, model/method, length) pooled over seeds, each with its
    Wilson 95% interval and the range of the per-seed accuracies, and the mean first-token margin with
    its range over seeds (when every trial has one); paired differences of each between the base
    model's methods on the same prompts (units = prompts, clusters = (seed, depth)).
    -> (accuracy rows, paired rows, markdown)."""
    has_margin = all(MARGIN_COLUMN in t for t in trials)
    # each greedy miss's kind from the answer itself, so studies scored before passkey.py wrote it get it too
    # (read_csv may have parsed an all-digit answer as a number: its digits are what greedy_miss reads)
    has_answers = all("answer" in t and "key" in t for t in trials)
    misses = [greedy_miss(str(t["answer"]), int(t["key"])) if has_answers else "" for t in trials]
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
        if has_margin:
            seed_margin = seed_means(rows, MARGIN_COLUMN)
            row |= {"margin_mean": float(np.mean([r[MARGIN_COLUMN] for r in rows])),
                    "margin_seed_min": min(seed_margin), "margin_seed_max": max(seed_margin)}  # fmt: skip
        if has_answers:
            row |= miss_shares(rows)
        accuracy.append(row)
    text, paired = [], []
    base_only = [t for t in trials if t["model"].startswith("base")]  # paired: the base models' methods
    base_seeds = sorted({t["seed"] for t in base_only})
    base_trials = defaultdict(list)  # (task, length) -> the base models' trials, paired across methods
    for t in base_only:
        base_trials[t["task"], t["length"]].append(t)
    metrics = RETRIEVAL_METRICS + ((("margin", MARGIN_COLUMN),) if has_margin else ())
    for task in sorted(dict.fromkeys(r["task"] for r in accuracy), key=headline_first):
        sel = [r for r in accuracy if r["task"] == task]
        lengths = sorted({r["length"] for r in sel})
        for name, column in metrics:
            title = (
                "first-token margin (nats), mean over prompts [range of the seeds' means]"
                if name == "margin"
                else f"{name} accuracy, pooled over seeds [Wilson 95%]"
            )
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
                text.append(
                    f"\n{task} ({name}), base models, T = {length}: significant orderings (95%): {orderings(table)}"
                )
    return accuracy, paired, "\n".join(text) + "\n"


def headline_first(task: str) -> int:
    """Table order: the held-out families pooled (the headline), the passkey beside it, then the rest."""
    return {HELDOUT: 0, "passkey": 1}.get(task, 2)


def table_head(lengths: list[int]) -> list[str]:
    """A retrieval table's header and separator lines: model/method, then one column per length."""
    return ["| model/method | " + " | ".join(map(str, lengths)) + " |", "|---" * (len(lengths) + 1) + "|"]


def retrieval_cell(row: dict, name: str) -> str:
    """One table cell: an accuracy with its Wilson interval, or the mean margin with its seed range."""
    if name == "margin":
        return f"{row['margin_mean']:+.2f} [{row['margin_seed_min']:+.2f}, {row['margin_seed_max']:+.2f}]"
    return f"{row[f'{name}_acc']:.0%} [{row[f'{name}_low']:.0%}, {row[f'{name}_high']:.0%}]"


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


# ----------------------------------------------------------------------------- the study


def seed_list(seeds: Any) -> list[int]:
    """The base models' seeds from `seeds`: a count n means 0..n-1; a list names them (distinct, >= 0)."""
    if is_integer(seeds) and seeds >= 1:
        return list(range(seeds))
    distinct = isinstance(seeds, list) and len(set(map(str, seeds))) == len(seeds) > 0
    if distinct and all(is_integer(k) and k >= 0 for k in seeds):
        return seeds
    raise ValueError(f"seeds must be a count >= 1 or a list of distinct seeds >= 0, got {seeds!r}.")


def check_config(cfg: StudyConfig) -> None:
    seeds = seed_list(cfg.seeds)
    if cfg.base_ckpt and len(seeds) != 1:
        raise ValueError(f"base_ckpt reuses one base model, so it needs seeds=1, got seeds={cfg.seeds}.")
    if not cfg.corpora:
        raise ValueError("corpora is empty; give at least one, e.g. corpora=[own].")
    if unknown := [t for t in cfg.retrieval_tasks if t not in (*TASKS, HELDOUT)]:
        raise ValueError(f"retrieval_tasks {unknown} are unknown; allowed tasks are {[*TASKS, HELDOUT]}.")
    check_number("finetune_seeds", cfg.finetune_seeds, minimum=0, maximum=len(seeds), integer=True,
                 allowed=f"an integer from 0 to the number of seeds ({len(seeds)})")  # fmt: skip
    check_number("jobs", cfg.jobs, minimum=1, integer=True, means="steps run at once")
    # What the steps will pass on, checked before the first one starts (a step would find it only hours in).
    recipes = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
    if cfg.recipe is not None and cfg.recipe not in recipes:
        raise ValueError(
            f"recipe={cfg.recipe!r} is not an experiment; choose one of {', '.join(recipes)} or null."
        )
    groups = sorted(p.stem for p in (CONFIGS / "data").glob("*.yaml"))
    if unknown := [c for c in cfg.corpora if c != "own" and c not in groups]:
        raise ValueError(
            f"corpora {unknown} are unknown; a corpus is `own` or a data group ({', '.join(groups)})."
        )
    for name in ("base_ckpt", "large_base_ckpt"):
        if getattr(cfg, name) is not None:
            resolve_checkpoint(getattr(cfg, name))  # one sentence when it does not exist
    for name in ("lengths", "retrieval_lengths"):
        if getattr(cfg, name) is not None:
            check_lengths(name, list(getattr(cfg, name)))
    for name, minimum in (("max_windows", 1), ("retrieval_trials", 1)):
        check_number(name, getattr(cfg, name), minimum=minimum, integer=True)
    check_threads(cfg.threads)


def run(cfg: StudyConfig, train_extra: list[str]) -> None:
    check_config(cfg)
    out = Path(cfg.out).resolve()
    lengths = SMOKE_LENGTHS if cfg.smoke else list(cfg.lengths)
    retrieval_lengths = SMOKE_RETRIEVAL_LENGTHS if cfg.smoke else list(cfg.retrieval_lengths or lengths)
    # smoke trains at max_len 32, too short for recall windows: the recipe is a full-size choice
    recipe = [cfg.recipe] if cfg.recipe and not cfg.smoke else []
    train_args = (SMOKE_TRAIN if cfg.smoke else []) + train_extra
    extend_args = SMOKE_EXTEND if cfg.smoke else []
    base_len = 32 if cfg.smoke else 256
    threads = [f"threads={cfg.threads}"]
    as_list = lambda xs: "[" + ",".join(map(str, xs)) + "]"  # noqa: E731

    def experiment(*names: str) -> list[str]:
        """One experiment= override, the recipe first: Hydra merges a list in order, while a second
        experiment= would replace the recipe (a fine-tune would lose e.g. its model.mix_previous_tokens)."""
        names = (*recipe, *names)
        return [f"experiment=[{','.join(names)}]"] if names else []

    steps = Steps(out, cfg.jobs)

    def train(name: str, *args: str) -> Path:
        run_dir = out / "runs" / name
        # last.ckpt alone does not mean done (it is also written every 100 steps and on SIGTERM):
        # the study marks a finished training itself, and an interrupted one resumes exactly.
        resume = ["ckpt_path=last"] if (run_dir / "checkpoints" / "last.ckpt").exists() else []
        steps.step(f"train {name}", run_dir / TRAINED,
                   ["train.py", f"hydra.run.dir={run_dir}", *train_args, *args, *resume])  # fmt: skip
        return run_dir

    def evaluate(name: str, ckpt: Path, methods: str) -> None:
        for corpus in cfg.corpora:
            data = [] if corpus == "own" else [f"data={corpus}"]
            steps.step(f"eval {name} on {corpus}", out / "eval" / corpus / name / DONE,
                       ["scripts/eval_extrapolation.py", f"ckpt={ckpt}", f"out={out / 'eval' / corpus / name}",
                        f"methods={methods}", f"lengths={as_list(lengths)}", f"max_windows={cfg.max_windows}",
                        *threads, *data])  # fmt: skip

    def retrieve(name: str, ckpt: Path, methods: str) -> None:
        if cfg.retrieval:
            depths = "[0.0,0.5,1.0]" if cfg.smoke else "[0.0,0.25,0.5,0.75,1.0]"
            options = ["task_options.multikey.keys=2", "task_options.vartrack.chains=1"] if cfg.smoke else []
            steps.step(f"retrieval {name}", out / "retrieval" / name / DONE,
                       ["scripts/passkey.py", f"ckpt={ckpt}", f"out={out / 'retrieval' / name}", f"methods={methods}",
                        f"tasks={as_list(cfg.retrieval_tasks)}", f"depths={depths}", f"trials={cfg.retrieval_trials}",
                        f"lengths={as_list(retrieval_lengths)}", *options, *threads])  # fmt: skip

    seeds = seed_list(cfg.seeds)
    bases = {
        f"base_s{k}": Path(cfg.base_ckpt) if cfg.base_ckpt else out / "runs" / f"base_s{k}" for k in seeds
    }
    # set when a base's training ends: its fine-tunes start
    trained = {name: threading.Event() for name in bases}
    finetuned = seeds[: cfg.finetune_seeds]
    suffix = lambda k: "" if k == seeds[0] else f"_s{k}"  # noqa: E731
    finetunes = {  # name -> (base it starts from, experiment, overrides)
        f"{method}{suffix(k)}": (f"base_s{k}", "extend_context", (*rope, *extend_args))
        for k in finetuned
        for method, rope in (("pi", ()), ("yarn", ("rope=yarn",)))
    }
    for k in finetuned if cfg.pose else ():
        for factor, scaling in POSE_FINETUNES:
            # the factor follows from target_len and the base's length (model/context.py)
            pose_args = (f"rope={scaling}", f"positions.target_len={factor * base_len}")
            name = f"pose{factor}_{SCALING_NAMES[scaling]}{suffix(k)}"
            finetunes[name] = (f"base_s{k}", "pose", (*pose_args, *(SMOKE_POSE if cfg.smoke else [])))

    def base_lane(seed: int) -> None:
        name = f"base_s{seed}"
        try:
            if not cfg.base_ckpt:
                seeded = [f"seed={1337 + seed}", f"data.seed={1337 + seed}", f"++data.recall.seed={seed}"]
                train(name, *experiment(), f"data.max_len={base_len}", "rope=none", *seeded)
        finally:  # also on failure, so the fine-tunes' lanes stop waiting (and then start nothing)
            trained[name].set()
        evaluate(name, bases[name], ZERO_SHOT)
        retrieve(name, bases[name], RETRIEVAL_METHODS)

    def extend_lane(name: str) -> None:
        base, recipe_name, overrides = finetunes[name]
        trained[base].wait()
        if steps.stopped.is_set():
            raise Cancelled(f"train {name}")
        init = resolve_checkpoint(bases[base])  # init_from takes a .ckpt file
        run_dir = train(name, *experiment(recipe_name), f"init_from={init}", *overrides)
        evaluate(name, run_dir, "[ckpt]")
        retrieve(name, run_dir, "[ckpt]")

    def randomized_lane() -> None:
        # target_len: the longest evaluated length, as the paper's L_max covers the test lengths
        args = (*experiment("randomized_positions"), f"data.max_len={base_len}", "rope=none")
        run_dir = train(RANDOMIZED, *args, f"positions.target_len={max(lengths)}")
        evaluate(RANDOMIZED, run_dir, "[none]")
        retrieve(RANDOMIZED, run_dir, "[none]")

    def large_base_lane() -> None:
        large_args = (*experiment(), f"data.max_len={base_len}", "rope=none", f"rope.base={cfg.large_base}")
        large = Path(cfg.large_base_ckpt) if cfg.large_base_ckpt else train("large_base", *large_args)
        evaluate("large_base", large, "[none]")

    # after the bases, the longest lanes first (a base trained from scratch takes twice a fine-tune's lane), so
    # that they do not end the study alone on one core; the fine-tunes fill the other workers
    extra = [randomized_lane] if cfg.randomized else []
    steps.run_lanes([*(lambda k=k: base_lane(k) for k in seeds), large_base_lane, *extra,
                     *(lambda name=name: extend_lane(name) for name in finetunes)])  # fmt: skip
    models = [*bases, *finetunes, "large_base", *([RANDOMIZED] if cfg.randomized else [])]
    summarise(cfg, out, models, base_len, train_extra, seeds)


def model_and_seed(run_name: str, first_seed: int) -> tuple[str, int]:
    """The model a study run belongs to and its seed: base_s<k>, pi_s<k>, pose4_yarn_s<k> -> (base | pi |
    pose4_yarn, k); an unsuffixed fine-tune (pi, yarn, pose4_pi, ...) -> the first seed's; large_base and
    randomized (trained with the default seeds) -> seed 0."""
    if "_s" in run_name and run_name.rsplit("_s", 1)[1].isdigit():
        model, seed = run_name.rsplit("_s", 1)
        return model, int(seed)
    return run_name, 0 if run_name in ("large_base", RANDOMIZED) else first_seed


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
    header = (
        f"# RoPE extrapolation study ({'smoke' if cfg.smoke else 'full'})\n\n{len(seeds)} base model(s) trained at "
        f"L = {base_len} (recipe: {(not cfg.smoke and cfg.recipe) or 'the default job'}; seeds {', '.join(map(str, seeds))}); "
        + (
            f"`pi`/`yarn` fine-tuned at 4L from the base{several} of seed{several} {', '.join(map(str, finetuned))}; "
            if finetuned
            else "no fine-tunes; "
        )
        + "`large_base` "
        + (
            f"reused from {cfg.large_base_ckpt}. "
            if cfg.large_base_ckpt
            else f"(seed 0) trained with rope.base={cfg.large_base:g}. "
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
    if paired:  # empty when no length exceeds the training length
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
        accuracy, paired_retrieval, md = retrieval_tables(trials + pooled_heldout(trials))
        write_csv(out / "retrieval.csv", accuracy)
        if paired_retrieval:  # empty when the base models ran a single retrieval method
            write_csv(out / "paired_retrieval.csv", paired_retrieval)
        text += ["\n## Retrieval\n", md]
        for task in dict.fromkeys(r["task"] for r in accuracy):
            rows = [r for r in accuracy if r["task"] == task]
            plot_vs_length(rows, task, out / f"retrieval_{task}.png")
            plot_vs_length(rows, task, out / f"retrieval_{task}_ranking.png", metric="ranking")
    (out / "summary.md").write_text("\n".join(text), encoding="utf-8")
    print(
        f"[study] wrote {out / 'summary.md'}, summary.png, paired_ppl.csv"
        + (", retrieval.csv, paired_retrieval.csv, retrieval_<task>[_ranking].png" if cfg.retrieval else "")
    )


@one_sentence_errors(errors=(*USER_ERRORS, RuntimeError))  # RuntimeError: a step that failed
def main(argv: list[str]) -> None:
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    cfg = OmegaConf.merge(OmegaConf.structured(StudyConfig), OmegaConf.from_dotlist(ours))
    run(OmegaConf.to_object(cfg), extra)


if __name__ == "__main__":
    main(sys.argv[1:])
