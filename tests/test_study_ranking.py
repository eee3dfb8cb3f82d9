"""The study's rankings against the best method (rope_llama/study/tables.py `against_best`)."""

from __future__ import annotations

import numpy as np
import pytest

from rope_llama.inference.stats import pairwise_table
from rope_llama.study import plots, summary, tables


def test_against_best_turns_every_pair_with_the_best_into_method_minus_best():
    """Losses on 8 units: `good` is 0.1 below `none` everywhere, `close` 0.001 above `good` up to a sign that
    alternates, `bad` 0.5 above. The best is the lowest mean (good); each other row is its own mean minus
    good's with the interval turned the same way, ranked by mean; `close` alone is not significant."""
    rng = np.random.default_rng(0)
    base = 4 + rng.normal(0, 0.3, 8)
    wiggle = np.array([0.02, -0.018] * 4)
    values = {"none": base, "close": base - 0.1 + wiggle, "good": base - 0.1, "bad": base + 0.5}
    table = pairwise_table(values, np.arange(8), higher_is_better=False)
    means = {m: float(v.mean()) for m, v in values.items()}
    rows = tables.against_best(table, means, higher_is_better=False)
    assert [r["method"] for r in rows] == ["good", "close", "none", "bad"]
    by = {r["method"]: r for r in rows}
    assert by["none"]["diff"] == pytest.approx(0.1) and by["bad"]["diff"] == pytest.approx(0.6)
    assert by["none"]["ci_low"] <= 0.1 <= by["none"]["ci_high"] and by["none"]["significant"]
    assert by["close"]["diff"] == pytest.approx(0.001) and not by["close"]["significant"]
    assert by["close"]["ci_low"] < 0 < by["close"]["ci_high"]
    text = tables.against_best_markdown(rows, "mean loss")
    assert text.splitlines()[2] == f"| 1 | good | {means['good']:.4f} | best |"
    assert text.splitlines()[5].startswith("| 4 | bad |") and text.splitlines()[5].endswith(" * |")
    assert not text.splitlines()[3].endswith("* |")  # close: its interval holds 0


def test_against_best_takes_the_highest_mean_when_higher_is_better():
    """Accuracies per prompt: yarn 1, 1, 1, 0; none 0 everywhere. yarn is best and none's row is negative."""
    values = {"none": np.zeros(4), "yarn": np.array([1.0, 1, 1, 0])}
    table = pairwise_table(values, np.arange(4), higher_is_better=True)
    rows = tables.against_best(table, {"none": 0.0, "yarn": 0.75}, higher_is_better=True)
    assert [r["method"] for r in rows] == ["yarn", "none"]
    assert rows[1]["diff"] == pytest.approx(-0.75) and rows[1]["ci_high"] <= 0
    tied = tables.against_best(
        pairwise_table({"a": np.ones(3), "b": np.ones(3)}, np.arange(3), higher_is_better=True),
        {"a": 1.0, "b": 1.0},
        higher_is_better=True,
    )
    assert "| 2 | b | 1.0000 | +0.000 [+0.000, +0.000] |" in tables.against_best_markdown(tied, "accuracy")


def test_the_study_tables_rank_against_the_best_for_perplexity_and_retrieval():
    """paired_ppl and retrieval_tables both print the ranking against the best per cell."""
    windows = [
        {
            "model": "base",
            "method": m,
            "length": 512,
            "seed": 0,
            "document": d,
            "window": 0,
            "loss": 4 + d + delta,
        }
        for d in range(3)
        for m, delta in (("none", 0.2), ("yarn", 0.0))
    ]
    _, text = tables.paired_ppl(windows, "own", "base", max_len=256)
    assert "own, base, T = 512: each method against the best (loss, nats)" in text
    assert (
        "| 1 | yarn | 5.0000 | best |" in text and "| 2 | none | 5.2000 | +0.200 [+0.200, +0.200] * |" in text
    )
    trials = [
        {"task": "passkey", "model": "base", "seed": 0, "method": m, "length": 512, "depth": d, "trial": 0,
         "greedy_correct": int(m == "yarn"), "rank_correct": 1}
        for d in (0.0, 0.5, 1.0)
        for m in ("none", "yarn")
    ]  # fmt: skip
    _, _, text = tables.retrieval_tables(trials)
    assert "passkey (greedy), base models, T = 512, each method against the best:" in text
    assert (
        "| 1 | yarn | 1.0000 | best |" in text and "| 2 | none | 0.0000 | -1.000 [-1.000, -1.000] * |" in text
    )


def test_the_depth_heatmap_averages_each_method_and_depth_and_counts_its_trials(tmp_path):
    """yarn answers at depth 0 in 2 of 2 trials and at 0.5 in 1 of 2; none only ran at depth 0 (0 of 1)."""
    trials = [
        {"task": "passkey", "model": "base", "method": m, "length": 512, "depth": d, "greedy_correct": c}
        for m, d, c in (
            ("yarn", 0.0, 1),
            ("yarn", 0.0, 1),
            ("yarn", 0.5, 1),
            ("yarn", 0.5, 0),
            ("none", 0.0, 0),
        )
    ]
    names, depths, grid, counts = plots.depth_grid(trials, 512, "greedy_correct")
    assert names == ["base/yarn", "base/none"] and depths == [0.0, 0.5] and counts == [1, 2]
    np.testing.assert_array_equal(grid, [[1.0, 0.5], [0.0, np.nan]])
    plots.plot_depths(trials, "passkey", tmp_path / "depths.png")
    assert (tmp_path / "depths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_depth_heatmap_gives_a_length_with_fewer_depths_a_narrower_panel(tmp_path, monkeypatch):
    """A focus length asked at 2 of 4 depths gets a panel half as wide: every cell the same width."""
    cell = {"task": "passkey", "model": "base", "method": "yarn", "greedy_correct": 1}
    trials = [
        cell | {"length": length, "depth": d}
        for length, depths in ((512, (0.0, 0.25, 0.5, 1.0)), (1024, (0.0, 1.0)))
        for d in depths
    ]
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)  # keep the figure to measure its panels
    plots.plot_depths(trials, "passkey", tmp_path / "depths.png")
    wide, narrow = (ax.get_position().width for ax in figures[0].axes)
    assert narrow / wide == pytest.approx(0.5, rel=0.02)


def test_paired_perplexity_starts_at_the_training_length():
    """Windows at 128, 256 (= L) and 512: the remap `dca` is 0.01 below `none` at L, so L gets its table (where
    the remaps differ from plain RoPE); 128 gets none."""
    windows = [
        {
            "model": "base",
            "method": m,
            "length": t,
            "seed": 0,
            "document": d,
            "window": 0,
            "loss": 4 + d - delta,
        }
        for t in (128, 256, 512)
        for d in range(3)
        for m, delta in (("none", 0.0), ("dca", 0.01))
    ]
    rows, text = tables.paired_ppl(windows, "own", "base", max_len=256)
    assert sorted({r["length"] for r in rows}) == [256, 512]
    assert "own, base, T = 256: each method against the best" in text and "T = 128" not in text


def test_paired_ppl_skips_a_length_with_one_method():
    """A study with one perplexity method (methods=[none] beside a retrieval suite) has nothing to pair:
    no rows and no table, where pairwise_table would refuse and stop the summary after every step ran."""
    windows = [
        {
            "model": "base",
            "method": "none",
            "length": t,
            "seed": 0,
            "document": d,
            "window": 0,
            "loss": 4.0 + d,
        }
        for t in (256, 512)
        for d in range(3)
    ]
    assert tables.paired_ppl(windows, "own", "base", max_len=256) == ([], "")


def test_a_task_asking_for_a_list_is_ranked_by_recall_too(tmp_path):
    """multivalue asks for 4 keys: no method gives all 4 (greedy 0 everywhere, no order), `rerope` gives 2-3 of
    them, `yarn` 1. Recall ranks rerope first with yarn's paired difference significant; the passkey (one key)
    and a multivalue file older than the recall column get no recall table."""

    def trial(task, method, depth, recall, answers="11111 22222 33333 44444"):
        return {"task": task, "model": "base", "seed": 0, "method": method, "length": 512, "depth": depth,
                "trial": 0, "key": 11111, "answers": answers, "answer": " 11111.", "greedy_correct": 0,
                "rank_correct": 1, "greedy_recall": recall}  # fmt: skip

    recalls = {"rerope": (0.5, 0.75, 0.5, 0.75), "yarn": (0.25, 0.25, 0.25, 0.25)}
    trials = [
        trial("multivalue", m, d, r) for m, rs in recalls.items() for d, r in zip((0.1, 0.4, 0.6, 0.9), rs)
    ]
    trials += [trial("passkey", m, d, 1.0, answers="11111") for m in recalls for d in (0.1, 0.9)]
    accuracy, paired, text = tables.retrieval_tables(trials)
    by = {(r["task"], r["method"]): r for r in accuracy}
    assert by["multivalue", "base/rerope"]["recall_mean"] == pytest.approx(0.625)
    assert "recall_mean" not in by["passkey", "base/rerope"]
    assert "### multivalue: recall (the share of the asked values the greedy answer gives)" in text
    assert "| base/rerope | 62% [62%, 62%] |" in text
    assert "multivalue (recall), base models, T = 512, each method against the best:" in text
    assert "| 1 | rerope | 0.6250 | best |" in text
    assert "| 2 | yarn | 0.2500 | -0.375 [-0.500, -0.250] * |" in text
    assert {r["metric"] for r in paired if r["task"] == "multivalue"} == {"greedy", "ranking", "recall"}
    assert "passkey (recall)" not in text and "### passkey: recall" not in text
    summary.retrieval_plots(accuracy, trials, tmp_path)
    assert (tmp_path / "retrieval_multivalue_recall_depths.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "retrieval_passkey_recall_depths.png").exists()
    older = [{k: v for k, v in t.items() if k != "greedy_recall"} for t in trials]
    assert "recall" not in tables.retrieval_tables(older)[2].replace("greedy_recall", "")
