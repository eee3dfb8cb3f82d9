"""Retrieval at lengths beyond training: passkey (Mohtashami & Jaggi 2023) and RULER's multi-key
needle and variable tracking (Hsieh et al. 2024); the prompts are inference/retrieval.py's.

    python scripts/passkey.py ckpt=runs/base out=results/passkey lengths=[256,1024,4096] trials=5
    python scripts/passkey.py ckpt=runs/base out=results/suite tasks=[passkey,multikey,vartrack]

Every prompt hides a 5-digit answer at a given depth of repeated filler text and asks for it. Two
scores per trial: greedy generation (the first integer in the output must be the answer) and
likelihood ranking (the answer's continuation must be the most likely of `candidates` random keys).
A greedy miss is classed (trials.csv's greedy_miss, the tables' miss_* shares): prose before any number,
the key's digits and then more (an overrun: the copy did not stop), the value of a needle not asked for
(multikey's other animals: trials.csv's `distractors`), one of several asked values without all the others
(incomplete: multiquery, multivalue), or another number.
Writes to `out`: trials.csv (one row per prompt), passkey.csv (accuracy per task x method x length
x depth), accuracy.csv (per task x method x length over all depths, with Wilson 95% intervals),
<task>_<method>.png (length x depth heatmaps) and <task>_vs_length.png (accuracy vs length per
method). Options: configs/passkey.yaml.
"""

from __future__ import annotations

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
    method_grid,
    method_names,
    option_list,
    print_matched_groups,
    with_context_lengths,
    with_largest_cache,
)
from rope_llama.cli.schema import check_command
from rope_llama.core.checks import check_number
from rope_llama.core.memory import check_fits
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.evaluation import answer_and_rank, answered_length, forward_groups, rows_per_forward
from rope_llama.inference.generation import generation_bytes
from rope_llama.inference.loading import load_model
from rope_llama.inference.reporting import miss_column, miss_shares, plot_vs_length, write_csv
from rope_llama.inference.retrieval import (
    GREEDY_MISSES,
    HELDOUT,
    HELDOUT_TASKS,
    TASKS,
    ChatTurns,
    RetrievalPrompt,
    answer_correct,
    answer_recall,
    answer_text,
    build_prompt,
    chat_turns,
    check_task_options,
    expand_tasks,
    greedy_miss,
    pooled_heldout,
    random_keys,
)
from rope_llama.inference.stats import wilson_interval
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


def candidate_tokens(
    tok: Tokenizer, answers: tuple[int, ...], rng: np.random.Generator, count: int
) -> list[list[int]]:
    """The continuations the ranking compares: the true answer first (`answer_text`), then count - 1
    decoys, each as many random keys (distinct first keys)."""
    firsts = random_keys(rng, count - 1, exclude=answers[0])
    decoys = [(k, *random_keys(rng, len(answers) - 1)) for k in firsts]
    return [tok.encode(answer_text(a)) for a in (answers, *decoys)]


def first_token_margin(next_logprobs: torch.Tensor, token: int) -> tuple[float, int]:
    """How far the answer's first token leads after the prompt: its log-prob minus that of the most
    likely other token (nats; > 0 means greedy decoding starts the answer), and that other token.
    next_logprobs: (V,) log-probs of the token after the prompt."""
    others = next_logprobs.clone()
    others[token] = float("-inf")
    runner_up = int(others.argmax())
    return float(next_logprobs[token] - others[runner_up]), runner_up


def greedy_tokens(max_new_tokens: int, candidates: list[list[int]]) -> int:
    """Tokens a prompt decodes greedily: max_new_tokens, or its true answer's (candidates[0]) and two more."""
    return max(max_new_tokens, len(candidates[0]) + 2)


def miss_of(answer: str, prompt: RetrievalPrompt) -> dict:
    """trials.csv's columns that class a greedy answer's miss: the values of the needles not asked for, and
    the kind. Classed from the prompt when the trials are written, so a stored answer gets today's kinds."""
    distractors = " ".join(map(str, prompt.distractors))
    return {
        "distractors": distractors,
        "greedy_miss": greedy_miss(answer, prompt.answers, prompt.distractors),
    }


def answer_prompts(
    model,
    tok: Tokenizer,
    prompts: list[RetrievalPrompt],
    candidates: list[list[list[int]]],
    max_new_tokens: int,
    rows: int,
) -> list[dict]:
    """Greedy answers and likelihood ranks of `prompts`, `rows` prompts per forward (left padded),
    one prefill per prompt for both (`answer_and_rank`); candidates[i] are prompt i's continuations,
    its true answer first; each decodes `greedy_tokens`. Prompts decoding as many tokens share forwards, and
    `forward_groups` keeps every prompt's result equal to answering it alone."""
    answered: dict[int, tuple] = {}  # prompt index -> (answer text, candidate log-probs, (margin, runner-up))
    new_tokens = [greedy_tokens(max_new_tokens, c) for c in candidates]
    lengths = [answered_length(len(p.tokens), c, n) for p, c, n in zip(prompts, candidates, new_tokens)]
    by_tokens: dict[int, list[int]] = {}  # prompts decoding as many tokens share forwards
    for i, n in enumerate(new_tokens):
        by_tokens.setdefault(n, []).append(i)
    for n, members in by_tokens.items():
        for group in forward_groups([lengths[i] for i in members], rows, model.rope.is_dynamic):
            group = [members[k] for k in group]
            greedy, logprobs, next_logprobs = answer_and_rank(
                model, [prompts[i].tokens for i in group], [candidates[i] for i in group], n
            )
            for i, new, row, after in zip(group, greedy, logprobs, next_logprobs):
                stop = next(
                    (k for k, t in enumerate(new) if t in tok.stop_ids), len(new)
                )  # eos or end of turn
                answer = tok.decode(new[:stop])
                answered[i] = answer, row, first_token_margin(after, candidates[i][0][0])  # [0]: the true key
    out_rows = []
    for i, p in enumerate(prompts):
        answer, (key_logprob, *decoy_logprobs), (margin, runner_up) = answered[i]
        rank = 1 + sum(d > key_logprob for d in decoy_logprobs)  # 1 = the key is the most likely (ties too)
        out_rows.append(
            {
                "tokens": len(p.tokens),
                "depth_real": p.depth,
                "key": p.answer,
                "answers": " ".join(map(str, p.answers)),
                "answer": answer,
                "greedy_correct": int(answer_correct(answer, p.answers)),
                "greedy_recall": answer_recall(answer, p.answers),
                "rank_correct": int(rank == 1),
                "key_rank": rank,
                "key_logprob": key_logprob,
                "first_margin": margin,
                "runner_up": tok.decode([runner_up]),
            }
        )
    return out_rows


def accuracy_table(trials: list[dict], by: tuple[str, ...]) -> list[dict]:
    """Greedy and ranking accuracy of the trials grouped by the keys `by` (in first-seen order), with
    the Wilson 95% interval of the greedy accuracy, the share of each kind of greedy miss (`greedy_miss`),
    and the mean and median first-token margin (how far the answer's first token led the most likely
    other one, in nats: a continuous view of the "prose first" misses)."""
    cells: dict[tuple, list[dict]] = {}
    for t in trials:
        cells.setdefault(tuple(t[k] for k in by), []).append(t)
    table = []
    for key, rows in cells.items():
        correct = sum(r["greedy_correct"] for r in rows)
        low, high = wilson_interval(correct, len(rows))
        table.append(
            {
                **dict(zip(by, key)),
                "trials": len(rows),
                "greedy_acc": correct / len(rows),
                "greedy_low": low,
                "greedy_high": high,
                "greedy_recall": float(np.mean([r["greedy_recall"] for r in rows])),  # RULER's credit
                **miss_shares(rows),
                "rank_acc": float(np.mean([r["rank_correct"] for r in rows])),
                "first_margin_mean": float(np.mean([r["first_margin"] for r in rows])),
                "first_margin_median": float(np.median([r["first_margin"] for r in rows])),
            }
        )
    return table


def plot_heatmaps(table: list[dict], title: str, chance: float, path: Path) -> None:
    """Accuracy heatmaps of one task and method (rows lengths, columns depths): greedy and ranking."""
    lengths, depths = sorted({r["length"] for r in table}), sorted({r["depth"] for r in table})
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.5 * len(lengths) + 2.5))
    for ax, (key, kind) in zip(
        axes, [("greedy_acc", "greedy"), ("rank_acc", f"ranking (chance {chance:.0%})")]
    ):
        cells = {(r["length"], r["depth"]): r[key] for r in table}
        # NaN (blank, "—") where a length ran other depths (focus_depths)
        grid = np.array([[cells.get((t, d), np.nan) for d in depths] for t in lengths], dtype=float)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set(xticks=range(len(depths)), xticklabels=depths, yticks=range(len(lengths)), yticklabels=lengths)
        ax.set(xlabel="depth", ylabel="length (tokens)", title=f"{title}: {kind}")
        for (i, j), v in np.ndenumerate(grid):
            text = "—" if np.isnan(v) else f"{v:.0%}"  # NaN: a blank cell, so dark text
            ax.text(j, i, text, ha="center", va="center", color="white" if v < 0.5 else "black")
    fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def task_options(cfg: DictConfig) -> dict[str, dict]:
    """{task: its options from `task_options`} for the tasks to run, checked before the model loads."""
    tasks = expand_tasks(option_list(cfg, "tasks", "[passkey,heldout]"))
    if len(set(tasks)) < len(tasks):
        raise ValueError(f"tasks lists a task twice: {tasks}.")
    given = cfg.task_options or {}
    # a family's own entry, else `heldout`'s (which sets every family)
    options = {t: dict(given.get(t) or given.get(HELDOUT if t in HELDOUT_TASKS else t) or {}) for t in tasks}
    for task, opts in options.items():
        check_task_options(task, **opts)
    return options


def check_memory(model, cfg: DictConfig, tasks: dict[str, dict]) -> None:
    """Refuse the longest length before any prompt is built: its prompts (every depth's trials) are
    held at once and answered `rows_per_forward` at a time in one left-padded batch (the keys' digits
    may tokenize to different lengths)."""
    longest = max(cfg.lengths)
    prompts = cfg.trials * len(depths_at(cfg, longest))
    rows = min(rows_per_forward(cfg.batch_tokens, longest), prompts)
    values = max(options.get("queries", options.get("values", 1)) for options in tasks.values())
    # after a prompt: its greedy answer, or its keys (" " + 5 digits, then ", " + 5 digits each)
    slots_after = max(cfg.max_new_tokens, 7 * values + 2)
    nbytes = generation_bytes(
        model.config,
        rows,
        longest,
        longest + slots_after,
        model.embed.weight.dtype,
        padded=True,
        native=False,
    )
    prompt_lists = 8 * prompts * longest  # a list slot per token; the filler's ints are shared objects
    what = f"answering {prompts} retrieval prompt{'s' * (prompts > 1)} of {longest:,} tokens ({rows} per forward)"
    knob = "lengths, trials or batch_tokens" if rows > 1 else "lengths or trials"
    check_fits(nbytes + prompt_lists, what, knob, model.embed.weight.device)


def depths_at(cfg: DictConfig, length: int) -> list[float]:
    """The depths asked at `length`: focus_depths at a focus length (when given), else depths."""
    if length in cfg.focus_lengths and cfg.focus_depths is not None:
        return list(cfg.focus_depths)
    return list(cfg.depths)


def check_depths(cfg: DictConfig) -> None:
    """depths and focus_depths lie in [0, 1]; focus_depths needs a focus length to apply to."""
    for key in ["depths"] + ([] if cfg.focus_depths is None else ["focus_depths"]):
        for d in option_list(cfg, key, "[0,0.5,1]"):
            if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d <= 1:
                raise ValueError(f"{key} must lie in [0, 1] (0 = start, 1 = end), got {d!r}.")
    if cfg.focus_depths is not None and not cfg.focus_lengths:
        raise ValueError(
            f"focus_depths={list(cfg.focus_depths)} applies at focus lengths, but focus_lengths is empty; "
            "give focus_lengths (e.g. [4x]) or leave focus_depths null."
        )


def task_prompts(
    cfg: DictConfig,
    tok: Tokenizer,
    task: str,
    options: dict,
    length: int,
    depth: float,
    chat: ChatTurns | None,
) -> tuple[list[RetrievalPrompt], list[list[list[int]]]]:
    """`trials` prompts of one cell and their ranking candidates, trial k a pure function of (seed, task,
    length, depth, k): the same for every method, unchanged by which other tasks run, and the first
    prompts of a run with more trials."""
    prompts, candidates = [], []
    for trial in range(cfg.trials):
        rng = np.random.default_rng([cfg.seed, TASKS.index(task), length, round(depth * 100), trial])
        prompts.append(build_prompt(task, tok, length, depth, rng, chat, **options))
        candidates.append(candidate_tokens(tok, prompts[-1].answers, rng, cfg.candidates))
    return prompts, candidates


def focus_methods(cfg: DictConfig, trials: list[dict], methods: list[str], length: int) -> list[str]:
    """The methods asked at `length`: all, unless it is a focus length; then `none` (if asked for) and the
    `focus_count` methods of highest greedy accuracy (every task's prompts pooled) at the longest length
    below it."""
    if length not in cfg.focus_lengths:
        return methods
    below = max(t["length"] for t in trials if t["length"] < length)
    accuracy = {m: np.mean([t["greedy_correct"] for t in trials if t["method"] == m and t["length"] == below])
                for m in methods if m != "none"}  # fmt: skip
    best = sorted(accuracy, key=lambda m: -accuracy[m])[: cfg.focus_count]  # a stable sort: ties keep order
    chosen = [m for m in methods if m == "none" or m in best]
    print(f"focus length {length}: {', '.join(chosen)} (the best {cfg.focus_count} at {below}, and none)")
    return chosen


def answered_units(
    cfg: DictConfig, model, tok: Tokenizer, fingerprint: str, store: UnitStore,
    prompts: list[RetrievalPrompt], candidates: list[list[list[int]]], rows: int,
) -> list[dict]:  # fmt: skip
    """`answer_prompts` of every prompt at the model's current positions: from `store` where an earlier
    run answered the same prompt the same way, else answered now and stored prompt by prompt."""
    device = model.embed.weight.device.type
    keys = [
        unit_key(model=fingerprint, tokens=token_digest(p.tokens), candidates=[token_digest(x) for x in c],
                 positions=positions_key(model, answered_length(len(p.tokens), c, greedy_tokens(cfg.max_new_tokens, c))),
                 max_new_tokens=cfg.max_new_tokens, device=device)
        for p, c in zip(prompts, candidates)
    ]  # fmt: skip
    missing = [i for i, k in enumerate(keys) if store.get(k) is None]
    for first in range(0, len(missing), rows):  # stored after each forward: a kill loses one at most
        group = missing[first : first + rows]
        answered = answer_prompts(
            model, tok, [prompts[i] for i in group], [candidates[i] for i in group], cfg.max_new_tokens, rows
        )
        for i, row in zip(group, answered):
            store.put(keys[i], row)
    return [store.get(k) for k in keys]


@torch.inference_mode()
def run(cfg: DictConfig) -> list[dict]:
    out = check_common(cfg)
    check_number("trials", cfg.trials, minimum=1, integer=True)
    check_number("candidates", cfg.candidates, minimum=2, integer=True)
    check_number("max_new_tokens", cfg.max_new_tokens, minimum=1, integer=True)
    if not isinstance(cfg.chat, bool):
        raise ValueError(f"chat must be true or false, got {cfg.chat!r}.")
    tasks = task_options(cfg)
    check_depths(cfg)
    ckpt, tok = load_model(cfg.ckpt, cfg.device, cfg.dtype)
    chat = chat_turns(tok) if cfg.chat else None
    cfg = with_context_lengths(cfg, ckpt)  # "2x" = twice the checkpoint's context length
    methods = method_names(cfg.methods, ckpt)
    print_matched_groups(cfg, ckpt, methods)
    with_largest_cache(ckpt.model, method_grid(cfg, ckpt, methods, max(cfg.lengths)))
    check_memory(ckpt.model, cfg, tasks)
    begin(cfg, ckpt)
    store = UnitStore(out / UNITS_FILE, reuse=cfg.reuse)
    if store.reused:
        print(
            f"{store.reused} answered prompts in {out / UNITS_FILE} are reused (reuse=false answers them again)"
        )
    fingerprint = model_fingerprint(ckpt.model)
    trials = []
    for length in sorted(cfg.lengths):
        chosen = focus_methods(cfg, trials, methods, length)
        for task in tqdm(tasks, desc=f"retrieval at {length}", unit="task"):
            prompt_cells, prompts, candidates = [], [], []  # (depth, trial index in its cell) per prompt
            for depth in depths_at(cfg, length):
                cell_prompts, cell_candidates = task_prompts(cfg, tok, task, tasks[task], length, depth, chat)
                prompt_cells += [(depth, trial) for trial in range(len(cell_prompts))]
                prompts += cell_prompts
                candidates += cell_candidates
            rows = rows_per_forward(cfg.batch_tokens, length)
            for method, cell in method_grid(
                cfg, ckpt, chosen, length
            ).items():  # the checkpoint's config alone
                ckpt.model.use_positions(cell.rope, cell.extend)
                answered = answered_units(cfg, ckpt.model, tok, fingerprint, store, prompts, candidates, rows)
                for (depth, trial), prompt, row in zip(prompt_cells, prompts, answered):
                    trials.append({"task": task, "method": method, "length": length, "depth": depth,
                                   "trial": trial, "factor": cell.factor, **row, **miss_of(row["answer"], prompt)})  # fmt: skip

    pooled = trials + pooled_heldout(trials)  # the held-out families together: the headline
    cells_table = accuracy_table(pooled, ("task", "method", "length", "depth", "factor"))
    by_length = accuracy_table(pooled, ("task", "method", "length", "factor"))
    with staged(out) as folder:  # a killed or failed run leaves no half result in out
        write_csv(folder / "trials.csv", trials)
        write_csv(folder / "passkey.csv", cells_table)
        write_csv(folder / "accuracy.csv", by_length)
        chance = 1 / cfg.candidates
        for task in [*tasks, HELDOUT] if set(HELDOUT_TASKS) & set(tasks) else tasks:
            plot_vs_length(
                [r for r in by_length if r["task"] == task], task, folder / f"{task}_vs_length.png"
            )
            for method in methods:
                cell_rows = [r for r in cells_table if r["task"] == task and r["method"] == method]
                plot_heatmaps(cell_rows, f"{task}, {method}", chance, folder / f"{task}_{method}.png")
                misses = ", ".join(
                    f"{kind} {np.mean([r[miss_column(kind)] for r in cell_rows]):.0%}"
                    for kind in GREEDY_MISSES
                )
                print(
                    f"{task:>8} {method:>12}: greedy {np.mean([r['greedy_acc'] for r in cell_rows]):.0%} "
                    f"(misses: {misses}), "
                    f"ranking {np.mean([r['rank_acc'] for r in cell_rows]):.0%} over all cells, "
                    f"first-token margin {np.mean([r['first_margin_mean'] for r in cell_rows]):+.2f} nats"
                )
    for row in by_length:
        if row["task"] == HELDOUT:
            print(
                f"headline (held-out families pooled) {row['method']:>12} at {row['length']}: greedy "
                f"{row['greedy_acc']:.0%} [{row['greedy_low']:.0%}, {row['greedy_high']:.0%}] of {row['trials']} prompts"
            )
    print(
        f"Chance: ranking {chance:.0%} (1 of {cfg.candidates} candidates); greedy ~0% (a 5-digit answer). "
        f"Wrote {cfg.out}/trials.csv, passkey.csv, accuracy.csv, <task>_<method>.png, <task>_vs_length.png"
    )
    return cells_table


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="passkey")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    check_command("passkey", cfg)  # every option before anything is loaded or written
    run(cfg)


if __name__ == "__main__":
    main()
