"""Extrapolation evaluation: metrics against the training loss, the KV-cache scorer, bootstrap, passkey, CLIs."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rope_llama.cli import eval_extrapolation, passkey
from rope_llama.cli.options import datamodule_for, method_grid
from rope_llama.cli.train import train
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
    method_positions,
    rows_per_forward,
    sliding_losses,
    split_windows,
    window_losses,
)
from rope_llama.inference.generation import GREEDY, check_scoring, generate, score_tokens
from rope_llama.inference.retrieval import GREEDY_MISSES, HELDOUT_TASKS, build_prompt, first_integer
from rope_llama.inference.stats import wilson_interval
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig
from rope_llama.training.module import LitLlama
from tests.helpers import CONFIGS, L0, ROOT, compose_train, small_corpus, tiny_overrides


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny model trained for a few seconds, with the .hydra/config.yaml train.py writes."""
    tmp = tmp_path_factory.mktemp("eval")
    corpus = small_corpus(tmp / "corpus", n_files=8, chars=12000)  # test documents of ~4k tokens
    run = tmp / "run"
    cfg = compose_train(tiny_overrides(tmp, corpus) + ["trainer.max_steps=30", "optim.lr=1e-2"], run)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models are fastest on one thread, and the machine is shared
    train(cfg)
    assert "hydra" not in OmegaConf.load(run / ".hydra" / "config.yaml")
    yield run
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(run_dir):
    return load_checkpoint(run_dir)


def compose_script(name: str, run_dir, out, *overrides: str):
    """rope_llama/configs/<name>.yaml as the CLI composes it, in float32 (the reference mode these tests compare
    against, on any CPU: dtype=auto would follow the host)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(
            name, overrides=[f"ckpt={run_dir}", f"out={out}", "device=cpu", "dtype=float32", *overrides]
        )


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


def test_grid_runs_every_remap_at_its_defaults(run_dir, tmp_path):
    """STRING, DCA, ReRoPE and leaky ReRoPE by name at the defaults of L0 = 32 (STRING S = 10, W = 2; DCA
    chunks of 24 - 4 = 20; ReRoPE w = 8): DCA inside its first chunk is exactly `none`; past L0 every
    remap changes the numbers; `yarn+string` keeps yarn's matched factor."""
    methods = "methods=[none,string,dca,rerope,leaky_rerope,yarn+string]"
    eval_extrapolation.run(eval_cfg(run_dir, tmp_path, f"lengths=[16,{4 * L0}]", methods))
    rows = rows_by(tmp_path / "results.csv")
    for metric in ("ppl", "tail_ppl"):
        assert rows["dca", 16, metric]["value"] == rows["none", 16, metric]["value"]
        for method in ("string", "dca", "rerope", "leaky_rerope", "yarn+string"):
            assert rows[method, 4 * L0, metric]["value"] != rows["none", 4 * L0, metric]["value"]
    assert float(rows["yarn+string", 4 * L0, "ppl"]["factor"]) == 4.0


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
    matched = method_grid(eval_cfg(run_dir, tmp_path), ckpt, ["yarn", "ntk"], 128)
    assert matched["yarn"].rope.factor == 4.0 and matched["yarn"].rope.original_max_len == L0
    assert matched["ntk"].factor == 4.0 and matched["ntk"].rope.scaling == "ntk"
    fixed = method_grid(eval_cfg(run_dir, tmp_path, "factor=16"), ckpt, ["linear"], 64)
    assert fixed["linear"].rope.factor == 16.0
    with pytest.raises(ValueError, match="Unknown method 'rope'"):
        method_positions(ckpt.config, "rope", 2.0)


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
    model.use_positions(method_positions(ckpt.config, method, 4.0)[0])
    windows = torch.randint(0, 300, (2, 4 * L0 + 1))
    chunked = window_losses(model, windows, chunk=L0 - 5)  # several chunks, not aligned with anything
    with torch.inference_mode():
        logits = model(windows[:, :-1])  # one forward, one attention matrix
    full = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(2, -1)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    model.use_positions(ckpt.config.rope)  # frozen: the checkpoint's own


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
    rope = method_positions(ModelConfig(rope=RopeConfig(original_max_len=L0), lengths=L0), scaling, 4.0)[0]
    config = ModelConfig(
        vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, init_std=0.3, rope=rope, lengths=L0
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
    with pytest.raises(ValueError, match=r"No test document has the 200001 tokens"):  # fits any host's memory
        eval_extrapolation.run(eval_cfg(run_dir, tmp_path, "lengths=[200000]"))
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
    model.use_positions(method_positions(model.config, method, 4.0)[0])
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
    model.use_positions(method_positions(model.config, method, 4.0)[0])
    rng = np.random.default_rng(0)
    prompts = [
        build_prompt(task, tok, length, 0.5, rng)
        for task, length in (("passkey", 200), ("multikey", 400), ("passkey", 260))
    ]
    candidates = [passkey.candidate_tokens(tok, p.answers, rng, 4) + [tok.encode(" 7")] for p in prompts]
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
                     "extend_options.window=16", "extend_options.group=4", "tasks=[passkey]")  # fmt: skip
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
    assert all(len(t["distractors"].split()) == (t["task"] == "multikey") for t in trials)  # the other animal
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


def test_heldout_families_are_scored_apart_and_pooled_as_the_headline(run_dir, tmp_path, capsys):
    cfg = compose_script("passkey", run_dir, tmp_path, "lengths=[400]", "depths=[0,1]", "trials=2",
                         "methods=[none]", "task_options.heldout.facts=2")  # fmt: skip
    passkey.run(cfg)  # the default tasks: passkey and heldout
    with open(tmp_path / "trials.csv") as f:
        trials = list(csv.DictReader(f))
    assert {t["task"] for t in trials} == {"passkey", *HELDOUT_TASKS} and len(trials) == 5 * 2 * 2
    with open(tmp_path / "accuracy.csv") as f:
        rows = {r["task"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"passkey", "heldout", *HELDOUT_TASKS} and rows["heldout"]["trials"] == "16"
    families = [float(rows[t]["greedy_acc"]) for t in HELDOUT_TASKS]
    assert float(rows["heldout"]["greedy_acc"]) == pytest.approx(np.mean(families))  # equal trials: the mean
    low, high = wilson_interval(round(16 * np.mean(families)), 16)
    assert float(rows["heldout"]["greedy_low"]) == pytest.approx(low)
    assert float(rows["heldout"]["greedy_high"]) == pytest.approx(high)
    out = capsys.readouterr().out
    assert "headline (held-out families pooled)         none at 400: greedy" in out
    assert (tmp_path / "heldout_vs_length.png").exists() and (tmp_path / "heldout_dialogue_none.png").exists()


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
        (
            "passkey.py",
            ["ckpt=/nonexistent", "out={OUT}", "depths=[1.5]"],
            "depths must be a non-empty duplicate-free list, each a finite number in [0, 1], got [1.5]",
        ),
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
        (
            "lengths=[64,1]",
            "lengths must be a non-empty list of integers >= 2 or multiples of the context length such as 2x, got [64, 1].",
        ),
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


@pytest.mark.parametrize("native, dtype", [("1", "bfloat16"), ("0", "float32")])
def test_dtype_auto_evaluates_in_bf16_where_training_would(
    run_dir, tmp_path, monkeypatch, capsys, native, dtype
):
    """eval_extrapolation.py dtype=auto: bf16 where precision=auto trains in it (the CPU's answer is
    forced here, both ways), and the results and the stderr line say which."""
    monkeypatch.setenv("ROPE_LLAMA_FORCE_CPU_BF16", native)
    eval_extrapolation.run(
        eval_cfg(run_dir, tmp_path, "lengths=[16]", "methods=[none]", "dtype=auto", "threads=1")
    )
    assert f"Weights and activations in {dtype}." in (tmp_path / "results.md").read_text()
    assert f"threads: 1 (threads was given); dtype: {dtype} (" in capsys.readouterr().err
