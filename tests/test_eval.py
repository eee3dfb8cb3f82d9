"""Extrapolation evaluation: metrics against the training loss, the KV-cache scorer, bootstrap, passkey, CLIs."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rope_llama.core import memory
from rope_llama.core.checkpoint import load_checkpoint
from rope_llama.core.memory import MemoryBudgetError
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.evaluation import (
    answer_and_rank,
    bootstrap_mean,
    continuation_logprobs,
    forward_groups,
    matched_factor,
    method_rope,
    rows_per_forward,
    sliding_losses,
    split_windows,
    window_losses,
)
from rope_llama.inference.generation import GREEDY, check_scoring, generate, score_tokens
from rope_llama.inference.options import datamodule_for, method_ropes
from rope_llama.inference.retrieval import GREEDY_MISSES, build_prompt, first_integer
from rope_llama.inference.stats import wilson_interval
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig
from rope_llama.training.module import LitLlama
from scripts import eval_extrapolation, passkey, study
from tests.helpers import CONFIGS, L0, ROOT, compose_train, small_corpus, tiny_overrides
from train import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny model trained for a few seconds, with the saved Hydra config train.py's CLI writes."""
    tmp = tmp_path_factory.mktemp("eval")
    corpus = small_corpus(tmp / "corpus", n_files=8, chars=12000)  # test documents of ~4k tokens
    run = tmp / "run"
    cfg = compose_train(tiny_overrides(tmp, corpus) + ["trainer.max_steps=30", "optim.lr=1e-2"], run)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models are fastest on one thread, and the machine is shared
    train(cfg)
    (run / ".hydra").mkdir()
    OmegaConf.save({k: v for k, v in cfg.items() if k != "hydra"}, run / ".hydra" / "config.yaml")
    yield run
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(run_dir):
    return load_checkpoint(run_dir)


def compose_script(name: str, run_dir, out, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(name, overrides=[f"ckpt={run_dir}", f"out={out}", "device=cpu", *overrides])


def eval_cfg(run_dir, out, *overrides: str):
    return compose_script("eval", run_dir, out, "max_windows=3", "n_boot=200", *overrides)


def rows_by(path) -> dict[tuple, dict]:
    with open(path) as f:
        return {(r["method"], int(r["length"]), r["metric"]): r for r in csv.DictReader(f)}


# ----------------------------------------------------------------------------- the grid


def test_grid_writes_csv_markdown_and_plots(run_dir, tmp_path):
    cfg = eval_cfg(
        run_dir, tmp_path, "lengths=[16,32,128]", "methods=[none,linear,yarn]", "sliding_stride=16"
    )
    eval_extrapolation.run(cfg)
    rows = rows_by(tmp_path / "results.csv")
    assert len(rows) == 3 * 3 * 3  # methods x lengths x {ppl, tail_ppl, sliding_ppl}
    for (method, length, _metric), r in rows.items():
        assert float(r["ci_low"]) <= float(r["value"]) <= float(r["ci_high"]), r
        assert int(r["n_windows"]) >= 2 and math.isclose(float(r["value"]), math.exp(float(r["loss"])))
        assert float(r["factor"]) == (1.0 if method == "none" else matched_factor(length, L0))
    for metric in ("ppl", "tail_ppl"):  # within the training length nothing is scaled: the same numbers
        assert rows["none", 16, metric]["value"] == rows["yarn", 16, metric]["value"]
    assert rows["none", 128, "ppl"]["value"] != rows["linear", 128, "ppl"]["value"]  # scaling does act
    md = (tmp_path / "results.md").read_text()
    assert "### ppl" in md and "### tail_ppl" in md and "### sliding_ppl" in md and "**" in md
    assert "| none |" in md and "| 16 | 32 | 128 |" in md
    for png in ("ppl_vs_length.png", "loss_vs_position.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "windows.csv") as f:  # the per-window units whose mean is each ppl
        windows = list(csv.DictReader(f))
    for (method, length, metric), r in rows.items():
        cell = [w for w in windows if w["method"] == method and int(w["length"]) == length]
        assert len(cell) == int(r["n_windows"]) and len({(w["document"], w["window"]) for w in cell}) == len(
            cell
        )
        if metric in ("ppl", "tail_ppl"):
            column = "loss" if metric == "ppl" else "tail_loss"
            assert np.mean([float(w[column]) for w in cell]) == pytest.approx(float(r["loss"]), abs=1e-5)
    with open(tmp_path / "curves.csv") as f:
        curve = [r for r in csv.DictReader(f) if r["method"] == "none" and r["length"] == "128"]
    assert curve[0]["start"] == "0" and curve[-1]["end"] == "128"


def test_grid_composes_extensions_with_rope_scalings(run_dir, tmp_path):
    """`self_extend` and `yarn+logn` in the grid: inside the window and the training length they are
    exactly `none` and `yarn`; beyond, they change the numbers; the scaling keeps its matched factor."""
    cfg = eval_cfg(
        run_dir,
        tmp_path,
        f"lengths=[16,{4 * L0}]",
        "methods=[none,yarn,self_extend,yarn+logn]",
        "extend_options.window=16",
        "extend_options.group=4",
    )
    eval_extrapolation.run(cfg)
    rows = rows_by(tmp_path / "results.csv")
    for metric in ("ppl", "tail_ppl"):
        assert rows["self_extend", 16, metric]["value"] == rows["none", 16, metric]["value"]
        assert rows["yarn+logn", 16, metric]["value"] == rows["yarn", 16, metric]["value"]
        assert rows["self_extend", 4 * L0, metric]["value"] != rows["none", 4 * L0, metric]["value"]
        assert rows["yarn+logn", 4 * L0, metric]["value"] != rows["yarn", 4 * L0, metric]["value"]
    assert float(rows["yarn+logn", 4 * L0, "ppl"]["factor"]) == 4.0
    assert float(rows["self_extend", 4 * L0, "ppl"]["factor"]) == 1.0


def test_matched_group_gives_each_length_the_least_group_that_fits(run_dir, tmp_path):
    """extend_options.group=matched scores length T exactly as the fixed group matched_group(T) does:
    at W = 16, L0 = 32 (reach at most 23), length 128 takes G = 15 (127 // 14 + 16 - 1 = 24, 127 // 15 +
    16 - 1 = 23), and a length inside the training length takes G = 1, plain attention."""
    grid = ["methods=[none,self_extend]", "extend_options.window=16"]
    for name, lengths, group in [("matched", "[32,128]", "matched"), ("g15", "[128]", "15")]:
        eval_extrapolation.run(
            eval_cfg(run_dir, tmp_path / name, f"lengths={lengths}", *grid, f"extend_options.group={group}")
        )
    matched, fixed = rows_by(tmp_path / "matched" / "results.csv"), rows_by(tmp_path / "g15" / "results.csv")
    for metric in ("ppl", "tail_ppl"):
        assert matched["self_extend", 128, metric]["value"] == fixed["self_extend", 128, metric]["value"]
        assert matched["self_extend", 128, metric]["value"] != matched["none", 128, metric]["value"]
        assert matched["self_extend", 32, metric]["value"] == matched["none", 32, metric]["value"]


def test_matched_and_fixed_factors(ckpt, run_dir, tmp_path):
    assert [matched_factor(t, 256) for t in (128, 256, 1024, 4096)] == [1.0, 1.0, 4.0, 16.0]
    matched = method_ropes(eval_cfg(run_dir, tmp_path), ckpt, ["yarn", "ntk"], 128)
    assert matched["yarn"][0].factor == 4.0 and matched["yarn"][0].original_max_len == L0
    assert matched["ntk"][1] == 4.0 and matched["ntk"][0].scaling == "ntk"
    fixed = method_ropes(eval_cfg(run_dir, tmp_path, "factor=16"), ckpt, ["linear"], 64)
    assert fixed["linear"][0].factor == 16.0
    with pytest.raises(ValueError, match="Unknown method 'rope'"):
        method_rope(ckpt.config.rope, "rope", 2.0, L0)


def test_in_window_loss_equals_the_training_modules_loss(ckpt, run_dir, tmp_path):
    """`none` inside the training length is exactly what LitLlama computes on the same windows."""
    cfg = eval_cfg(run_dir, tmp_path, f"lengths=[{L0}]", "methods=[none]")
    eval_extrapolation.run(cfg)
    documents = [d for d in datamodule_for(cfg, ckpt).documents("test") if len(d) > L0]
    windows, _ = split_windows(documents, L0, max_windows=3)
    lit = LitLlama(ckpt.config)
    lit.model.load_state_dict(ckpt.model.state_dict())
    with torch.inference_mode():
        reference = float(
            lit.eval()._loss((windows[:, :-1], windows[:, 1:]))
        )  # mean over all windows' tokens
    row = rows_by(tmp_path / "results.csv")["none", L0, "ppl"]
    assert len(windows) == int(row["n_windows"]) >= 2
    assert float(row["loss"]) == pytest.approx(reference, abs=1e-5)
    assert float(rows_by(tmp_path / "results.csv")["none", L0, "tail_ppl"]["loss"]) == pytest.approx(
        reference, abs=1e-5
    )


def test_linear_with_factor_one_equals_none(run_dir, tmp_path):
    eval_extrapolation.run(
        eval_cfg(run_dir, tmp_path, "lengths=[16,96]", "methods=[none,linear]", "factor=1")
    )
    rows = rows_by(tmp_path / "results.csv")
    for length in (16, 96):
        for metric in ("ppl", "tail_ppl"):
            a, b = (
                float(rows["none", length, metric]["value"]),
                float(rows["linear", length, metric]["value"]),
            )
            assert a == pytest.approx(b, rel=1e-6)


@pytest.mark.parametrize("method", ["none", "dynamic_ntk", "yarn"])
def test_kv_cache_scorer_equals_one_forward(ckpt, method):
    model = ckpt.model
    model.set_rope(method_rope(ckpt.config.rope, method, 4.0, L0))
    windows = torch.randint(0, 300, (2, 4 * L0 + 1))
    chunked = window_losses(model, windows, chunk=L0 - 5)  # several chunks, not aligned with anything
    with torch.inference_mode():
        logits = model(windows[:, :-1])  # one forward, one attention matrix
    full = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(2, -1)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    model.set_rope(ckpt.config.rope)


def test_sliding_window_scores_each_token_once_with_bounded_context(ckpt):
    model, tokens = ckpt.model, torch.randint(0, 300, (101,))
    plain = sliding_losses(model, tokens, length=20, stride=20, chunk=64)
    windows = tokens[:-1].view(5, 20)  # stride == length: non-overlapping windows of 20 predictions
    torch.testing.assert_close(
        plain, window_losses(model, torch.cat([windows, tokens[20::20, None]], 1), 64).flatten()
    )
    slid = sliding_losses(model, tokens, length=20, stride=5, chunk=64)
    assert slid.shape == (100,)
    torch.testing.assert_close(slid[:20], plain[:20])  # the first window is scored whole
    # prediction 57 (of tokens[58]) is scored by the window starting at 40: context tokens[40:58]
    torch.testing.assert_close(slid[57], score_tokens(model, tokens[40:59], 64)[-1])
    assert not torch.allclose(slid[20:], plain[20:])  # more context changes the losses


def random_model(scaling: str) -> Llama:
    """A tiny random model with sharp logits, its RoPE scaled by 4 from L0."""
    torch.manual_seed(0)
    rope = method_rope(RopeConfig(original_max_len=L0), scaling, 4.0, L0)
    config = ModelConfig(
        vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, init_std=0.3, rope=rope
    )
    return Llama(config).eval()


def one_window_at_a_time_sliding(model, tokens, length, stride, chunk) -> torch.Tensor:
    """The sliding-window definition, one window per score_tokens call: each window scores the
    predictions no earlier window scored."""
    n, losses, scored, begin = tokens.numel() - 1, [], 0, 0
    while scored < n:
        end = min(begin + length, n)
        losses.append(score_tokens(model, tokens[begin : end + 1], chunk)[scored - begin :])
        scored, begin = end, begin + stride
    return torch.cat(losses)


@pytest.mark.parametrize("scaling", ["none", "linear", "dynamic_ntk", "yarn", "llama3"])
def test_batched_scoring_equals_one_window_at_a_time(scaling):
    model = random_model(scaling)
    windows = torch.randint(0, 300, (7, 3 * L0 + 1))  # past L0: every scaling acts
    alone = window_losses(model, windows, chunk=L0 - 5, batch=1)
    for batch in (3, 7, 16):  # 7 windows: a short last batch, one batch, a batch larger than the windows
        torch.testing.assert_close(window_losses(model, windows, L0 - 5, batch), alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(score_tokens(model, windows[2], L0 - 5), alone[2], atol=1e-5, rtol=0)
    tokens = torch.randint(0, 300, (101,))
    for stride in (5, 7, 20):  # 7: the last window is shorter than the others (its own dynamic-NTK length)
        reference = one_window_at_a_time_sliding(model, tokens, 20, stride, chunk=8)
        for batch in (1, 4):
            torch.testing.assert_close(
                sliding_losses(model, tokens, 20, stride, 8, batch), reference, atol=1e-5, rtol=0
            )


def test_scoring_memory_check_counts_every_row(monkeypatch):
    model = random_model("none")
    monkeypatch.setattr(memory, "available_memory", lambda device: 4 * 2**20)
    check_scoring(model, 1000, 64)  # one row fits in 80% of 4 MiB ...
    with pytest.raises(
        MemoryBudgetError, match=r"^Scoring 8 x 1,000 tokens in chunks of 64 needs .*; lower chunk"
    ):
        check_scoring(model, 1000, 64, rows=8)  # ... eight do not
    with pytest.raises(MemoryBudgetError, match=r"^Scoring 8 x 1,000 tokens"):
        score_tokens(model, torch.zeros(8, 1001, dtype=torch.long), 64)
    assert [rows_per_forward(4096, t) for t in (256, 1000, 4096, 8192)] == [16, 4, 1, 1]


def test_a_batch_that_does_not_fit_is_refused_naming_batch_tokens(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device: 16 * 2**20)
    with pytest.raises(
        MemoryBudgetError, match=r"^Scoring 1,000 x 1,000 tokens .*; lower lengths, chunk or batch_tokens\.$"
    ):
        eval_extrapolation.run(eval_cfg(run_dir, tmp_path, "lengths=[1000]", "batch_tokens=1000000"))
    cfg = compose_script("passkey", run_dir, tmp_path, "lengths=[1000]", "batch_tokens=1000000")
    with pytest.raises(
        MemoryBudgetError,
        match=r"^Answering 25 retrieval prompts of 1,000 tokens \(25 per forward\) needs .*; "
        r"lower lengths, trials or batch_tokens\.$",
    ):
        passkey.run(cfg)
    assert list(tmp_path.iterdir()) == []


def test_bootstrap_interval_contains_the_mean_and_is_seeded():
    values = torch.tensor([2.0, 2.5, 3.0, 4.0, 2.2, 3.3])
    mean, low, high = bootstrap_mean(values, seed=1)
    assert mean == pytest.approx(float(values.double().mean())) and low < mean < high
    assert bootstrap_mean(values, seed=1) == (mean, low, high)
    assert bootstrap_mean(values, seed=2) != (mean, low, high)
    grouped = bootstrap_mean(values, groups=[0, 0, 0, 1, 1, 1], seed=1)
    assert grouped[0] == pytest.approx(mean) and grouped[1] <= mean <= grouped[2]
    assert bootstrap_mean(torch.tensor([3.0]), seed=0) == (3.0, 3.0, 3.0)


def test_too_short_data_and_unknown_method_fail_with_one_sentence(run_dir, tmp_path):
    with pytest.raises(ValueError, match=r"No test document has the 1000001 tokens"):
        eval_extrapolation.run(eval_cfg(run_dir, tmp_path, "lengths=[1000000]"))
    with pytest.raises(ValueError, match="Unknown method 'pi'"):
        eval_extrapolation.run(eval_cfg(run_dir, tmp_path, "lengths=[16]", "methods=[pi]"))


# ----------------------------------------------------------------------------- passkey


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_file(str(ckpt.tokenizer_file()))


def test_first_integer():
    assert first_integer(" 71432.") == 71432
    assert first_integer("key is 07143") == 7143
    assert first_integer("none") is None
    assert first_integer("") is None


def test_ranking_shares_one_prefill_and_matches_scoring(ckpt, tok):
    p = build_prompt("passkey", tok, 200, 0.5, np.random.default_rng(0))
    prompt = p.tokens
    candidates = [tok.encode(f" {k}") for k in (p.answer, 99999, 4)]
    [ranked] = continuation_logprobs(ckpt.model, [prompt], [candidates])
    for cand, score in zip(candidates, ranked):
        reference = -float(score_tokens(ckpt.model, torch.tensor(prompt + cand), 64)[-len(cand) :].sum())
        assert score == pytest.approx(reference, abs=1e-4)


@pytest.mark.parametrize("method", ["none", "yarn", "dynamic_ntk"])
def test_one_prefill_answers_as_generate_and_ranks_as_scoring_alone(run_dir, tok, method):
    """answer_and_rank decodes the greedy answer and scores the candidates from one prefill: the
    answers equal generate's, and the scores equal continuation_logprobs' (its own prefill), for
    left-padded prompts of two lengths (candidates as long as the answer, so dynamic NTK is fixed for
    the same length in all three)."""
    model = load_checkpoint(run_dir).model
    model.set_rope(method_rope(model.config.rope, method, 4.0, L0))
    rng = np.random.default_rng(1)
    prompts = [build_prompt("passkey", tok, length, 0.5, rng).tokens for length in (200, 300)]
    candidates = [[tok.encode(f" {k}") for k in (1234567, 7654321, 4444444)] for _ in prompts]
    assert {len(c) for row in candidates for c in row} == {8}  # " " and 7 digits: as long as the answer
    greedy, scores, next_logprobs = answer_and_rank(model, prompts, candidates, max_new_tokens=8)
    assert greedy == generate(model, prompts, 8, GREEDY).tokens and {len(g) for g in greedy} == {8}
    np.testing.assert_allclose(scores, continuation_logprobs(model, prompts, candidates), atol=1e-5)
    assert next_logprobs.argmax(-1).tolist() == [g[0] for g in greedy]  # the log-probs greedy chose from
    torch.testing.assert_close(next_logprobs.exp().sum(-1), torch.ones(2))
    assert answer_and_rank(model, prompts, candidates, max_new_tokens=0)[0] == [[], []]


def test_first_token_margin_is_the_lead_over_the_best_other_token():
    logprobs = torch.tensor([0.1, 0.5, 0.2, 0.2]).log()
    assert passkey.first_token_margin(logprobs, 1) == (pytest.approx(np.log(0.5 / 0.2)), 2)  # ties: the first
    margin, runner_up = passkey.first_token_margin(logprobs, 0)
    assert margin == pytest.approx(np.log(0.1 / 0.5)) and runner_up == 1  # negative: greedy writes token 1


def test_forward_groups_share_a_forward_only_at_one_dynamic_length():
    assert forward_groups([5, 7, 5, 5, 7], rows=2, dynamic=False) == [[0, 1], [2, 3], [4]]
    assert forward_groups([5, 7, 5, 5, 7], rows=2, dynamic=True) == [[0, 2], [3], [1, 4]]


@pytest.mark.parametrize("method", ["none", "yarn", "dynamic_ntk"])
def test_batched_passkey_answers_equal_each_prompt_alone(run_dir, tok, method):
    """Left-padded prompts of three lengths (each row's RoPE positions start at 0, as alone), key
    continuations of different lengths: the greedy answer, rank and log-prob of every prompt are
    the same batched as one at a time."""
    model = load_checkpoint(run_dir).model  # its own copy: the RoPE is replaced
    model.set_rope(method_rope(model.config.rope, method, 4.0, L0))
    rng = np.random.default_rng(0)
    prompts = [
        build_prompt(task, tok, length, 0.5, rng)
        for task, length in (("passkey", 200), ("multikey", 400), ("passkey", 260))
    ]
    candidates = [passkey.candidate_tokens(tok, p.answer, rng, 4) + [tok.encode(" 7")] for p in prompts]
    assert len({len(p.tokens) for p in prompts}) == 3  # really padded
    batched = passkey.answer_prompts(model, tok, prompts, candidates, max_new_tokens=6, rows=3)
    for row, p, c in zip(batched, prompts, candidates):  # the margin's sign: did greedy begin with the key?
        [[first]] = generate(model, [p.tokens], 1, GREEDY).tokens
        assert (row["first_margin"] > 0) == (first == c[0][0])
        assert (row["runner_up"] == tok.decode([first])) == (row["first_margin"] < 0)
    alone = [
        passkey.answer_prompts(model, tok, [p], [c], max_new_tokens=6, rows=1)[0]
        for p, c in zip(prompts, candidates)
    ]
    floats = ("key_logprob", "first_margin")
    for b, a in zip(batched, alone):
        assert {k: v for k, v in b.items() if k not in floats} == {
            k: v for k, v in a.items() if k not in floats
        }
        assert [b[k] for k in floats] == pytest.approx([a[k] for k in floats], abs=1e-4)
    scores_alone = [continuation_logprobs(model, [p.tokens], [c])[0] for p, c in zip(prompts, candidates)]
    scores = continuation_logprobs(model, [p.tokens for p in prompts], candidates)  # one forward, padded
    if method == "dynamic_ntk":  # its frequencies follow the longest row: why forward_groups splits them
        assert not np.allclose(scores, scores_alone, atol=1e-4)
    else:
        np.testing.assert_allclose(scores, scores_alone, atol=1e-4)


def test_passkey_results_equal_with_and_without_batching(run_dir, tmp_path):
    """Every trial of the grid (answers, ranks, log-probs) is the same one prompt per forward
    (batch_tokens=1) as with every prompt of a length in one forward, Self-Extend's merge included."""
    results = {}
    for batch_tokens in (1, 100_000):
        out = tmp_path / str(batch_tokens)
        overrides = ("lengths=[200,260]", "depths=[0,1]", "trials=3", "methods=[none,dynamic_ntk,yarn,llama3+self_extend]",
                     "extend_options.window=16", "extend_options.group=4")  # fmt: skip
        passkey.run(compose_script("passkey", run_dir, out, *overrides, f"batch_tokens={batch_tokens}"))
        with open(out / "trials.csv") as f:
            results[batch_tokens] = list(csv.DictReader(f))
    one, batched = results[1], results[100_000]
    assert len(one) == len(batched) == 2 * 2 * 3 * 4
    for a, b in zip(one, batched):
        assert {k: v for k, v in a.items() if k != "key_logprob"} == {
            k: v for k, v in b.items() if k != "key_logprob"
        }
        assert float(a["key_logprob"]) == pytest.approx(float(b["key_logprob"]), abs=1e-4)
        assert a["rank_correct"] == str(int(a["key_rank"] == "1"))


def test_retrieval_suite_writes_tables_intervals_and_plots(run_dir, tmp_path, capsys):
    cfg = compose_script(
        "passkey", run_dir, tmp_path, "lengths=[320,400]", "depths=[0,1]", "trials=2", "methods=[none,yarn]",
        "tasks=[passkey,multikey]", "task_options.multikey.keys=2",
    )  # fmt: skip
    table = passkey.run(cfg)
    assert len(table) == 2 * 2 * 2 * 2 and all(r["trials"] == 2 for r in table)
    with open(tmp_path / "trials.csv") as f:
        trials = list(csv.DictReader(f))
    assert len(trials) == 2 * 2 * 2 * 2 * 2 and {t["method"] for t in trials} == {"none", "yarn"}
    assert {t["task"] for t in trials} == {"passkey", "multikey"}
    assert (
        sorted(t["trial"] for t in trials) == ["0"] * 16 + ["1"] * 16
    )  # each prompt's index within its cell
    assert {t["factor"] for t in trials if t["method"] == "yarn" and t["length"] == "320"} == {str(320 / L0)}
    with open(tmp_path / "accuracy.csv") as f:
        by_length = list(csv.DictReader(f))
    assert len(by_length) == 2 * 2 * 2 and all(r["trials"] == "4" for r in by_length)
    for r in by_length:  # every greedy accuracy sits inside its Wilson interval, which is never empty
        assert float(r["greedy_low"]) <= float(r["greedy_acc"]) <= float(r["greedy_high"])
        misses = [float(r[passkey.miss_column(kind)]) for kind in GREEDY_MISSES]
        assert float(r["greedy_acc"]) + sum(misses) == pytest.approx(1.0)  # every trial counted once
        assert float(r["greedy_high"]) - float(r["greedy_low"]) > 0.2  # 4 trials: a wide interval
    for name in ("passkey_yarn", "multikey_none", "passkey_vs_length", "multikey_vs_length"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert "Chance: ranking 10%" in capsys.readouterr().out


def test_suite_prompts_do_not_depend_on_the_other_tasks(run_dir, tmp_path):
    """A task's prompts are a function of (seed, task, length, depth): running it alone or beside
    another task gives the same keys."""
    keys = {}
    for i, tasks in enumerate(("[multikey]", "[passkey,multikey]")):
        out = tmp_path / str(i)
        passkey.run(compose_script("passkey", run_dir, out, "lengths=[400]", "depths=[0.5]", "trials=3",
                                   "methods=[none]", f"tasks={tasks}", "max_new_tokens=1"))  # fmt: skip
        with open(out / "trials.csv") as f:
            keys[tasks] = [r["key"] for r in csv.DictReader(f) if r["task"] == "multikey"]
    assert keys["[multikey]"] == keys["[passkey,multikey]"] and len(keys["[multikey]"]) == 3


def test_suite_refuses_unknown_tasks_and_options_before_loading(tmp_path):
    for overrides, message in (
        (["tasks=[needle]"], "retrieval task 'needle' is unknown"),
        (["tasks=[passkey,passkey]"], "tasks lists a task twice"),
        (["tasks=[multikey]", "task_options.multikey.keys=99"], r"keys must be an integer in \[1, 16\]"),
        (
            ["tasks=[vartrack]", "+task_options.vartrack.depth=2"],
            r"vartrack takes the options \['chains', 'hops'\]",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            passkey.run(compose_script("passkey", tmp_path / "missing", tmp_path / "out", *overrides))


# ----------------------------------------------------------------------------- command lines


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("eval_extrapolation.py", ["out={OUT}"], "No checkpoint given"),
        ("eval_extrapolation.py", ["ckpt=/nonexistent", "out={OUT}"], "does not exist"),
        ("passkey.py", ["ckpt=/nonexistent", "out={OUT}", "depths=[1.5]"], "depths must lie in [0, 1]"),
    ],
)
def test_cli_errors_are_one_sentence(script, args, message, tmp_path):
    args = [a.format(OUT=tmp_path / "out") for a in args]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True, cwd="/"
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", [eval_extrapolation, passkey])
@pytest.mark.parametrize(
    "override, message",
    [
        ("methods=[none,pi]", "Unknown method 'pi'; a method is a RoPE method (none, linear, "),
        ("methods=yarn", "methods must be a list, e.g. methods=[none,yarn], got 'yarn'."),
        ("lengths=[64,1]", "lengths must be a non-empty list of integers >= 2, got [64, 1]."),
        ("lengths=64", "lengths must be a list, e.g. lengths=[256,1024], got 64."),
        ("batch_tokens=0", "batch_tokens must be an integer >= 1, got 0."),
        ("batch_tokens=many", "batch_tokens must be an integer >= 1, got 'many'."),
        ("out={FILE}", "is a file; give a directory for the results."),
        ("out={FILE}/results", "cannot be created: {FILE} is a file; give a directory for the results."),
        (
            "out=/proc/rope-llama/results",
            "out=/proc/rope-llama/results is not writable: creating a file in /proc",
        ),
    ],
)
def test_options_are_refused_before_the_checkpoint_is_loaded(
    script, override, message, tmp_path, monkeypatch
):
    """A bad method, length or output directory costs no checkpoint (nor data) load, and leaves no files."""

    def no_load(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the options were checked")

    monkeypatch.setattr(script, "load_model", no_load)
    file = tmp_path / "file"
    file.write_text("")
    name = "eval" if script is eval_extrapolation else "passkey"
    cfg = compose_script(
        name, "/nonexistent", tmp_path / "out", override.format(FILE=file)
    )  # a later out= wins
    with pytest.raises(ValueError) as refusal:
        script.run(cfg)
    assert message.format(FILE=file) in str(refusal.value)
    assert list(tmp_path.iterdir()) == [file]


def test_study_resumes_an_interrupted_training_and_skips_a_finished_one(tmp_path, monkeypatch):
    commands = []

    def fake_run(command, cwd, **_):  # records train.py's command line, then "fails" to stop the study
        commands.append(command)
        return subprocess.CompletedProcess(command, returncode=1)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    base = tmp_path / "runs" / "base_s0"
    (base / "checkpoints").mkdir(parents=True)
    (base / "checkpoints" / "last.ckpt").touch()  # written every 100 steps: not a finished training
    with pytest.raises(RuntimeError, match="step 'train base_s0' failed"):
        study.run(study.StudyConfig(out=str(tmp_path), jobs=1), [])
    assert commands[-1][1] == "train.py" and commands[-1][-1] == "ckpt_path=last"
    assert "seed=1337" in commands[-1] and "experiment=[recall_base]" in commands[-1]  # seed 0, recipe
    (base / study.TRAINED).touch()  # the study's marker: base is skipped, the next step runs
    with pytest.raises(RuntimeError, match="step 'eval base_s0 on own' failed"):
        study.run(study.StudyConfig(out=str(tmp_path), jobs=1), [])


def test_study_fine_tunes_keep_the_recipe(tmp_path, monkeypatch):
    """With recipe=recall_base the PI/YaRN fine-tunes start from a base with previous-token mixing, so
    their composed config must keep the recipe's model (and data) settings and add extend_context's."""
    commands = []

    def fake_run(command, cwd, **_):
        commands.append(command)
        return subprocess.CompletedProcess(command, returncode=1)  # stop the study after this step

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    base = tmp_path / "runs" / "base_s0"
    base.mkdir(parents=True)
    (base / study.TRAINED).touch()
    for corpus in ("own", "kjv"):  # base_s0's evaluations and retrieval are done: the PI fine-tune runs next
        (tmp_path / "eval" / corpus / "base_s0").mkdir(parents=True)
        (tmp_path / "eval" / corpus / "base_s0" / "windows.csv").touch()
    (tmp_path / "retrieval" / "base_s0").mkdir(parents=True)
    (tmp_path / "retrieval" / "base_s0" / "trials.csv").touch()
    monkeypatch.setattr(study, "resolve_checkpoint", lambda run_dir: run_dir / "last.ckpt")
    with pytest.raises(RuntimeError, match="step 'train pi' failed"):
        study.run(study.StudyConfig(out=str(tmp_path), seeds=1, recipe="recall_base", jobs=1), [])
    overrides = [c for c in commands[-1][2:] if not c.startswith(("hydra.", "init_from="))]
    assert overrides == ["experiment=[recall_base,extend_context]"]
    cfg = compose_train(overrides, tmp_path / "pi")
    assert cfg.model.mix_previous_tokens == 3 and cfg.data.recall.fraction > 0  # the recipe's
    assert cfg.data.max_len == 1024 and cfg.rope.factor == 4.0  # extend_context's
    assert cfg.optim.name == "muon" and cfg.optim.muon_lr == 2e-3  # the recipe's optimizer at fine-tune rates


def test_study_seed_list_names_the_bases_and_fine_tunes_the_first(tmp_path, monkeypatch):
    """seeds=[7,3]: base_s7 and base_s3 train with seeds 1344 and 1340 (recall seeds 7 and 3), and the
    PI fine-tune starts from the first seed's base, not from a base_s0 that does not exist."""
    commands = []

    def fake_run(command, cwd, **_):
        commands.append(command)
        return subprocess.CompletedProcess(command, returncode=1 if command[1] == "train.py" else 0)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    monkeypatch.setattr(study, "resolve_checkpoint", lambda run_dir: run_dir / "last.ckpt")
    with pytest.raises(RuntimeError, match="step 'train base_s7' failed"):
        study.run(study.StudyConfig(out=str(tmp_path), seeds=[7, 3], corpora=["own"], jobs=1), [])
    assert commands[-1][-3:] == ["seed=1344", "data.seed=1344", "++data.recall.seed=7"]
    for seed in (7, 3):  # both bases trained: the study goes on to the fine-tune
        (tmp_path / "runs" / f"base_s{seed}").mkdir(parents=True)
        (tmp_path / "runs" / f"base_s{seed}" / study.TRAINED).touch()
    commands.clear()
    with pytest.raises(RuntimeError, match="step 'train pi' failed"):
        study.run(study.StudyConfig(out=str(tmp_path), seeds=[7, 3], corpora=["own"], jobs=1), [])
    evaluations = ["scripts/eval_extrapolation.py", "scripts/passkey.py"] * 2  # base_s7's, then base_s3's
    assert [c[1] for c in commands] == [*evaluations, "train.py"]
    assert f"init_from={tmp_path / 'runs' / 'base_s7' / 'last.ckpt'}" in commands[-1]


def test_study_runs_jobs_steps_at_once_and_fine_tunes_only_after_the_first_base(tmp_path, monkeypatch):
    """jobs=3: never more than three subprocesses at once (and three do overlap), each with the cores / 3
    threads and its output in out/logs/; every step runs once; the PI and YaRN fine-tunes, whose lanes
    have workers while base_s0 still trains, start only after that training has ended."""
    lock, running, events, envs = threading.Lock(), [0], [], []

    def fake_run(command, cwd, stdout, stderr, env):
        name = next(c for c in command[2:] if c.startswith(("hydra.run.dir=", "out=")))
        Path(name.split("=", 1)[1]).mkdir(parents=True, exist_ok=True)  # as train.py does
        with lock:
            running[0] += 1
            events.append(("start", command[1], name, running[0]))
            envs.append((env["OMP_NUM_THREADS"], Path(stdout.name).parent))
        time.sleep(0.5 if name.endswith("runs/base_s0") else 0.05)  # the first base trains longest
        with lock:
            running[0] -= 1
            events.append(("end", command[1], name, running[0]))
        return subprocess.CompletedProcess(command, returncode=0)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    monkeypatch.setattr(study, "resolve_checkpoint", lambda run_dir: run_dir / "last.ckpt")
    monkeypatch.setattr(study, "summarise", lambda *args: None)  # the fakes write no tables
    study.run(study.StudyConfig(out=str(tmp_path), seeds=2, corpora=["own"], jobs=3), [])
    starts = [e for e in events if e[0] == "start"]
    assert max(e[3] for e in starts) == 3  # three at once, never four
    assert (
        len(starts) == len({(e[1], e[2]) for e in starts}) == 5 + 5 + 4
    )  # trainings, evaluations, retrievals
    assert set(envs) == {(str(max(1, (os.cpu_count() or 1) // 3)), tmp_path / "logs")}
    order = [(e[0], e[2].rsplit("/", 1)[-1]) for e in events if e[1] == "train.py"]
    base_end = order.index(("end", "base_s0"))
    assert base_end < order.index(("start", "pi")) and base_end < order.index(("start", "yarn"))


def test_study_finetune_seeds_fine_tunes_each_base_after_its_own_training(tmp_path, monkeypatch):
    """seeds=[7,3] finetune_seeds=2: PI and YaRN fine-tunes of both bases, the first seed's named pi / yarn
    and seed 3's pi_s3 / yarn_s3, each from its own base and started only after that base's training
    ended (base_s3 trains longest here, so a fine-tune that waited for base_s7 alone would start early)."""
    lock, events, commands = threading.Lock(), [], {}

    def fake_run(command, cwd, stdout, stderr, env):
        name = next(c for c in command[2:] if c.startswith(("hydra.run.dir=", "out=")))
        Path(name.split("=", 1)[1]).mkdir(parents=True, exist_ok=True)
        with lock:
            events.append(("start", command[1], name.rsplit("/", 1)[-1]))
            commands[command[1], name.rsplit("/", 1)[-1]] = command
        time.sleep(0.5 if name.endswith("runs/base_s3") else 0.05)
        with lock:
            events.append(("end", command[1], name.rsplit("/", 1)[-1]))
        return subprocess.CompletedProcess(command, returncode=0)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    monkeypatch.setattr(study, "resolve_checkpoint", lambda run_dir: run_dir / "last.ckpt")
    summarised = []
    monkeypatch.setattr(study, "summarise", lambda cfg, out, models, *rest: summarised.append(models))
    cfg = study.StudyConfig(out=str(tmp_path), seeds=[7, 3], corpora=["own"], jobs=4, finetune_seeds=2)
    study.run(cfg, [])
    order = [(e[0], e[2]) for e in events if e[1] == "train.py"]
    for name, base in (("pi", "base_s7"), ("yarn", "base_s7"), ("pi_s3", "base_s3"), ("yarn_s3", "base_s3")):
        command = commands["train.py", name]
        assert f"init_from={tmp_path / 'runs' / base / 'last.ckpt'}" in command
        assert ("rope=yarn" in command) == name.startswith("yarn")
        assert order.index(("end", base)) < order.index(("start", name))
    assert order.index(("start", "pi")) < order.index(("end", "base_s3"))  # not held back by the other base
    assert summarised == [["base_s7", "base_s3", "pi", "yarn", "pi_s3", "yarn_s3", "large_base"]]


def test_study_names_map_to_model_and_seed():
    assert study.model_and_seed("base_s3", 7) == ("base", 3)
    assert study.model_and_seed("yarn_s3", 7) == ("yarn", 3)
    assert study.model_and_seed("pi", 7) == ("pi", 7)  # the first seed's fine-tune
    assert study.model_and_seed("large_base", 7) == ("large_base", 0)


@pytest.mark.parametrize("finetune_seeds", [-1, 3, 1.5, True])
def test_study_rejects_bad_finetune_seeds_in_one_sentence(finetune_seeds):
    with pytest.raises(
        ValueError, match=r"^finetune_seeds must be an integer from 0 to the number of seeds \(2\)"
    ):
        study.check_config(study.StudyConfig(seeds=2, finetune_seeds=finetune_seeds))


def test_study_failure_with_jobs_starts_nothing_new_and_names_the_step_and_its_log(tmp_path, monkeypatch):
    commands = []

    def fake_run(command, cwd, stdout, stderr, env):
        commands.append(command)
        fails = "base_s0" in command[2]
        stdout.write("Epoch 0: 10%\rEpoch 0: 20%\nerror: out of memory\n" if fails else "")
        return subprocess.CompletedProcess(command, returncode=1 if fails else 0)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    log = tmp_path / "logs" / "train_base_s0.log"
    message = rf"^step 'train base_s0' failed \('out of memory'; its output: {log}\); fix it and re-run"
    with pytest.raises(RuntimeError, match=message):
        study.run(study.StudyConfig(out=str(tmp_path), seeds=2, jobs=2), [])
    assert [c[1] for c in commands] in (["train.py"], ["train.py"] * 2)  # base_s1's may have started already
    assert all("base_s" in c[2] for c in commands)  # no fine-tune, large base or evaluation began


@pytest.mark.parametrize("seeds", [0, -1, True, [], [1, 1], [2, -3], "3"])
def test_study_rejects_bad_seeds_in_one_sentence(seeds):
    with pytest.raises(ValueError, match=r"^seeds must be a count >= 1 or a list of distinct seeds"):
        study.check_config(study.StudyConfig(seeds=seeds))


@pytest.mark.parametrize("jobs", [0, -2, 1.5])
def test_study_rejects_bad_jobs_in_one_sentence(jobs):
    with pytest.raises(ValueError, match=r"^jobs must be an integer >= 1 \(steps run at once\), got"):
        study.check_config(study.StudyConfig(jobs=jobs))


@pytest.mark.slow
def test_study_smoke_runs_every_step_and_resumes(tmp_path):
    """~6 minutes on 2 shared cores: seven tiny trainings (two seeds, both fine-tuned), twelve evaluations
    on two corpora and six retrieval runs, each a subprocess."""
    corpus = small_corpus(tmp_path / "corpus", n_files=8, chars=12000)
    data = [
        "data=text_files",
        f"data.source.paths=[{corpus}]",
        "data.vocab_size=320",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    command = [
        sys.executable,
        str(ROOT / "scripts" / "study.py"),
        f"out={tmp_path / 'study'}",
        "smoke=true",
        "seeds=2",
        "finetune_seeds=2",
        "threads=1",
        "--",
        *data,
    ]
    subprocess.run(command, check=True, cwd=ROOT)
    study_dir = tmp_path / "study"
    summary = (study_dir / "summary.md").read_text()
    assert all(f"| {m} | " in summary for m in ("base/yarn", "pi/ckpt", "yarn/ckpt", "large_base/none"))
    assert "### own: perplexity" in summary and "### kjv: perplexity" in summary
    assert "| base/yarn | 2 | " in summary  # two seeds behind every base cell
    assert "| yarn/ckpt | 2 | " in summary  # and behind each fine-tune (yarn, yarn_s1)
    assert (study_dir / "runs" / "yarn_s1" / study.TRAINED).is_file()
    assert "Significant orderings (95%)" in summary and "### vartrack: greedy accuracy" in summary
    for name in (
        "summary.png",
        "retrieval_passkey.png",
        "paired_ppl.csv",
        "retrieval.csv",
        "paired_retrieval.csv",
    ):
        assert (study_dir / name).is_file()
    with open(study_dir / "paired_ppl.csv") as f:
        paired = list(csv.DictReader(f))
    n_methods = len(study.ZERO_SHOT.strip("[]").split(","))
    assert len(paired) == 2 * 4 * n_methods * (n_methods - 1) // 2  # corpora x lengths beyond L x pairs
    again = subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    assert again.stdout.count("skipped") == 27  # resumable: every step's output exists


def test_study_tables_average_seeds_and_mark_only_significant_orderings():
    """Constructed per-window losses: `good` is 0.1 nats better than `none` on every window of every
    seed, `same` equals `none` up to symmetric noise. The seed table shows each seed's perplexity
    mean and range; the paired table marks good < none and good < same, and nothing else."""
    rng = np.random.default_rng(0)
    windows = []
    for seed in range(3):
        for document in range(2):
            for window in range(4):
                base = 4.0 + 0.2 * seed + rng.normal(0, 0.3)  # seeds and windows differ a lot
                noise = 0.01 if (seed + document + window) % 2 else -0.01
                for method, loss in (("none", base), ("good", base - 0.1), ("same", base + noise)):
                    row = {"model": "base", "method": method, "length": 512, "seed": seed}
                    windows.append({**row, "document": document, "window": window, "loss": loss})
    table = study.seed_table(windows, "own")
    per_seed = [
        np.exp(np.mean([w["loss"] for w in windows if w["method"] == "none" and w["seed"] == s]))
        for s in range(3)
    ]
    assert (
        f"| base/none | 3 | {np.mean(per_seed):,.2f} [{min(per_seed):,.2f}, {max(per_seed):,.2f}] |" in table
    )
    assert "| base/good | 3 | **" in table  # the best mean is bold
    rows, text = study.paired_ppl(windows, "own", "base", max_len=256)
    significant = {(r["a"], r["b"]): r["better"] for r in rows if r["significant"]}
    assert significant == {("none", "good"): "good", ("good", "same"): "good"}
    good_vs_none = next(r for r in rows if {r["a"], r["b"]} == {"none", "good"})
    assert good_vs_none["diff"] == pytest.approx(0.1) and good_vs_none["clusters"] == 6  # documents x seeds
    assert "Significant orderings (95%): good < none, good < same" in text


def test_study_retrieval_tables_pool_seeds_with_wilson_intervals():
    """Greedy: yarn always right, none in trial 0 only. Ranking: both rank the key first except in one
    of none's prompts, so the ranking has no significant ordering."""
    trials = []
    for seed in range(2):
        for depth in (0.0, 0.5, 1.0):
            for trial in range(5):
                for method, correct in (("yarn", 1), ("none", int(trial == 0))):
                    ranked = int((method, seed, depth, trial) != ("none", 1, 0.0, 4))
                    trials.append({"task": "passkey", "model": "base", "seed": seed, "method": method, "length": 512,
                                   "depth": depth, "trial": trial, "greedy_correct": correct, "rank_correct": ranked})  # fmt: skip
    accuracy, paired, text = study.retrieval_tables(trials)
    none = next(r for r in accuracy if r["method"] == "base/none")
    assert none["trials"] == 30 and none["greedy_acc"] == pytest.approx(6 / 30) and none["seeds"] == 2
    assert (none["greedy_low"], none["greedy_high"]) == pytest.approx(wilson_interval(6, 30))
    assert none["ranking_acc"] == pytest.approx(29 / 30)
    assert (none["ranking_seed_min"], none["ranking_seed_max"]) == pytest.approx((14 / 15, 1.0))
    assert [(r["metric"], r["better"], r["significant"]) for r in paired] == [
        ("greedy", "yarn", True),
        ("ranking", "", False),  # no better method named without significance
    ]
    assert "(greedy), base models, T = 512: significant orderings (95%): yarn < none" in text
    assert "(ranking), base models, T = 512: significant orderings (95%): none" in text
    assert "| base/yarn | 100% [" in text and "### passkey: ranking accuracy" in text
    assert "margin" not in text and "margin_mean" not in none  # trials.csv files without the margin column
    assert "greedy misses" not in text and "miss_overrun" not in none  # nor answers: no miss kinds guessed
    assert "| base/none | 20% / 20% |" in text  # the per-seed table: trial 0 of 5 per depth on each seed


def test_study_retrieval_tables_show_a_base_that_never_copies_seed_by_seed():
    """Seed 2 writes every key, seed 10 none: pooled that is 50%; the per-seed table, in seed order, shows both."""
    trials = [{"task": "passkey", "model": "base", "seed": seed, "method": "none", "length": 256, "depth": 0.5,
               "trial": trial, "greedy_correct": int(seed == 2), "rank_correct": 1}
              for seed in (10, 2) for trial in range(4)]  # fmt: skip
    trials.append(trials[0] | {"model": "yarn", "method": "ckpt", "seed": 0})  # a fine-tune: not a base seed
    _, _, text = study.retrieval_tables(trials)
    assert "| base/none | 50% [" in text
    assert "### passkey: greedy accuracy per seed (base models: 2 / 10)" in text
    assert "| base/none | 100% / 0% |" in text


def test_study_retrieval_tables_class_the_greedy_misses():
    """Four prompts per method: yarn writes two keys and overruns two; none answers prose first three times and
    writes another number once. Answers come as trials.csv gives them, all-digit ones parsed as numbers."""
    answers = {"yarn": [" 10388.", 10388, 103888, " 103888."], "none": [" the road", "\n", " and the", 12]}
    trials = [{"task": "passkey", "model": "base", "seed": 0, "method": method, "length": 512, "depth": 0.5,
               "trial": i, "greedy_correct": int(str(answer).strip(" .") == "10388"), "rank_correct": 1,
               "key": 10388, "answer": answer}
              for method, given in answers.items() for i, answer in enumerate(given)]  # fmt: skip
    accuracy, _, text = study.retrieval_tables(trials)
    yarn = next(r for r in accuracy if r["method"] == "base/yarn")
    assert (yarn["greedy_acc"], yarn["miss_overrun"], yarn["miss_prose_first"]) == (0.5, 0.5, 0.0)
    assert (
        "### passkey: greedy misses by kind (prose first / overrun / wrong digits), pooled over seeds" in text
    )
    assert "| base/none | 75% / 0% / 25% |" in text


def test_study_retrieval_tables_compare_first_token_margins():
    """yarn's margin is none's plus 0.5 on every prompt (+ noise shared by both), on seed-specific
    levels: the mean, the seeds' range and the significant ordering follow from that construction."""
    rng = np.random.default_rng(0)
    trials = []
    for seed, level in ((0, -1.0), (1, 1.0)):
        for depth in (0.0, 0.5, 1.0):
            for trial in range(5):
                shared = float(rng.normal())
                for method, shift in (("none", 0.0), ("yarn", 0.5)):
                    trials.append({"task": "passkey", "model": "base", "seed": seed, "method": method, "length": 512,
                                   "depth": depth, "trial": trial, "greedy_correct": 1, "rank_correct": 1,
                                   "first_margin": level + shared + shift})  # fmt: skip
    accuracy, paired, text = study.retrieval_tables(trials)
    none, yarn = (next(r for r in accuracy if r["method"] == f"base/{m}") for m in ("none", "yarn"))
    margins = {
        s: [t["first_margin"] for t in trials if t["method"] == "none" and t["seed"] == s] for s in (0, 1)
    }
    assert none["margin_mean"] == pytest.approx(np.mean(margins[0] + margins[1]))
    assert (none["margin_seed_min"], none["margin_seed_max"]) == pytest.approx(
        (min(map(np.mean, margins.values())), max(map(np.mean, margins.values())))
    )
    assert yarn["margin_mean"] == pytest.approx(none["margin_mean"] + 0.5)
    margin_row = next(r for r in paired if r["metric"] == "margin")
    assert margin_row["better"] == "yarn" and margin_row["significant"]
    assert margin_row["diff"] == pytest.approx(-0.5 if margin_row["a"] == "none" else 0.5)
    tied = [r["significant"] for r in paired if r["metric"] != "margin"]
    assert tied == [False, False]  # greedy and ranking: every prompt right with both methods
    assert "### passkey: first-token margin (nats)" in text
    assert f"| base/yarn | {yarn['margin_mean']:+.2f} [" in text
    assert "(margin), base models, T = 512: significant orderings (95%): yarn < none" in text
