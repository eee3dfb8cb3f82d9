"""inference/units.py: the store of finished units, their keys, and the evaluation scripts resuming from it."""

import csv
import json

import numpy as np
import pytest
import torch

from rope_llama.cli import eval_extrapolation, passkey
from rope_llama.inference.units import UnitStore, model_fingerprint, positions_key, token_digest, unit_key
from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import ExtendConfig
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig
from tests.test_eval import compose_script, eval_cfg, run_dir  # noqa: F401  (run_dir: the module fixture)


def test_store_keeps_units_across_instances_and_skips_a_torn_line(tmp_path):
    path = tmp_path / "units.jsonl"
    store = UnitStore(path)
    assert store.reused == 0 and store.get("a") is None
    store.put("a", {"loss": 1.5})
    with open(path, "a") as f:
        f.write('{"key": "b", "value": {"lo')  # a run killed mid-line
    again = UnitStore(path)
    assert again.reused == 1 and again.get("a") == {"loss": 1.5} and again.get("b") is None
    again.put("c", {"loss": 2.0})  # starts a line of its own after the torn one
    assert UnitStore(path).get("c") == {"loss": 2.0} and UnitStore(path).reused == 2
    assert UnitStore(path, reuse=False).reused == 0  # the file is ignored, not removed
    assert path.read_text().splitlines()[-1] == json.dumps({"key": "c", "value": {"loss": 2.0}})


def test_keys_name_what_is_computed_not_what_it_is_called():
    model = Llama(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64))
    plain = positions_key(model, 128)
    model.use_positions(RopeConfig(scaling="linear", factor=1.0, original_max_len=64))
    assert positions_key(model, 128) == plain  # PI at factor 1 is plain RoPE: one unit
    model.use_positions(RopeConfig(scaling="yarn", factor=4.0, original_max_len=64))
    assert positions_key(model, 128) != plain
    model.use_positions(RopeConfig(scaling="dynamic_ntk", factor=4.0, original_max_len=64))
    assert positions_key(model, 64) == plain != positions_key(model, 128)  # dynamic: only past its length
    model.use_positions(RopeConfig(), ExtendConfig(method="self_extend", window=8, group=2))
    assert positions_key(model, 128) != plain
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    with torch.no_grad():
        model.embed.weight[0, 0] += 1
    assert model_fingerprint(model) != before  # other weights: other units
    assert token_digest([1, 2]) == token_digest(torch.tensor([1, 2])) != token_digest([2, 1])
    assert unit_key(a=1, b=[2]) == unit_key(b=[2], a=1) != unit_key(a=1, b=[3])


def test_eval_with_more_windows_scores_only_the_new_ones(run_dir, tmp_path, monkeypatch):  # noqa: F811
    scored = []
    real = eval_extrapolation.window_losses

    def counting(model, windows, chunk, batch=1):
        scored.append(len(windows))
        return real(model, windows, chunk, batch)

    monkeypatch.setattr(eval_extrapolation, "window_losses", counting)
    eval_extrapolation.run(
        eval_cfg(run_dir, tmp_path / "none", "lengths=[16,32]", "methods=[none]", "max_windows=1")
    )
    alone = sum(scored)
    scored.clear()
    common = ("lengths=[16,32]", "methods=[none,linear,yarn]", "batch_tokens=1")
    eval_extrapolation.run(eval_cfg(run_dir, tmp_path / "main", *common, "max_windows=1"))
    # 16 and 32 lie within L0: PI at factor 1 computes what none does, so it scores nothing of its own
    yarn = sum(scored) - alone
    assert alone > 0 and 0 <= yarn <= alone
    scored.clear()
    eval_extrapolation.run(eval_cfg(run_dir, tmp_path / "main", *common, "max_windows=2", "overwrite=true"))
    widened = sum(scored)
    fresh = tmp_path / "fresh"
    eval_extrapolation.run(eval_cfg(run_dir, fresh, *common, "max_windows=2"))
    assert 0 < widened < sum(scored) - widened  # the second run scored fewer windows than a fresh one
    with open(tmp_path / "main" / "results.csv") as f, open(fresh / "results.csv") as g:
        assert list(csv.DictReader(f)) == list(csv.DictReader(g))  # and gives the same results
    scored.clear()
    eval_extrapolation.run(
        eval_cfg(run_dir, tmp_path / "main", *common, "max_windows=2", "overwrite=true", "reuse=false")
    )
    assert sum(scored) == sum(1 for _ in open(fresh / "units.jsonl"))  # reuse=false: everything again


def test_focus_length_keeps_none_and_the_best_of_the_length_below(run_dir, tmp_path):  # noqa: F811
    cfg = eval_cfg(run_dir, tmp_path, "lengths=[64,128,256]", "methods=[none,linear,ntk,yarn]",
                   "focus_lengths=[256]", "focus_count=1", "max_windows=1")  # fmt: skip
    rows = eval_extrapolation.run(cfg)
    at = {
        t: {r["method"]: r["loss"] for r in rows if r["length"] == t and r["metric"] == "ppl"}
        for t in (128, 256)
    }
    best = min((m for m in at[128] if m != "none"), key=at[128].get)
    assert set(at[128]) == {"none", "linear", "ntk", "yarn"} and set(at[256]) == {"none", best}
    assert "| linear |" in (tmp_path / "results.md").read_text()  # a dropped cell shows as "-"
    with pytest.raises(ValueError, match=r"focus_lengths \[64\] must be among lengths"):
        eval_extrapolation.run(eval_cfg(run_dir, tmp_path / "b", "lengths=[64,128]", "focus_lengths=[64]"))


def test_a_focus_length_asks_none_and_the_best_of_the_length_below_at_its_own_depths(run_dir, tmp_path):  # noqa: F811
    """focus_lengths keeps `none` and the focus_count best methods (greedy accuracy) of the length below;
    focus_depths gives that length its own, fewer depths; the heatmaps leave the depths it skipped blank."""
    methods = ("none", "linear", "yarn")
    cfg = compose_script("passkey", run_dir, tmp_path, "lengths=[320,400]", "depths=[0,0.5,1]", "trials=1",
                         f"methods=[{','.join(methods)}]", "tasks=[passkey]", "focus_lengths=[400]", "focus_count=1",
                         "focus_depths=[0.5]", "max_new_tokens=2")  # fmt: skip
    passkey.run(cfg)
    with open(tmp_path / "trials.csv") as f:
        trials = list(csv.DictReader(f))
    below = [t for t in trials if t["length"] == "320"]
    assert sorted((t["method"], float(t["depth"])) for t in below) == sorted(
        (m, d) for m in methods for d in (0.0, 0.5, 1.0)
    )
    accuracy = {
        m: np.mean([int(t["greedy_correct"]) for t in below if t["method"] == m]) for m in methods[1:]
    }
    best = max(methods[1:], key=accuracy.get)  # the first of the most accurate: a tie keeps the list order
    at = [t for t in trials if t["length"] == "400"]
    assert sorted((t["method"], float(t["depth"])) for t in at) == sorted([("none", 0.5), (best, 0.5)])
    assert (tmp_path / f"passkey_{best}.png").read_bytes()[:4] == b"\x89PNG"


def test_passkey_with_more_trials_answers_only_the_new_prompts(run_dir, tmp_path, monkeypatch):  # noqa: F811
    answered = []
    real = passkey.answer_prompts

    def counting(model, tok, prompts, *args):
        answered.append(len(prompts))
        return real(model, tok, prompts, *args)

    monkeypatch.setattr(passkey, "answer_prompts", counting)
    common = ("lengths=[400]", "depths=[0,1]", "methods=[none,yarn]", "tasks=[passkey,multiquery]",
              "task_options.multiquery.keys=2", "task_options.multiquery.queries=2")  # fmt: skip
    passkey.run(compose_script("passkey", run_dir, tmp_path, *common, "trials=1"))
    assert sum(answered) == 2 * 2 * 2  # tasks x depths x methods (yarn is stretched at 400 > L0)
    answered.clear()
    passkey.run(compose_script("passkey", run_dir, tmp_path, *common, "trials=2", "overwrite=true"))
    assert sum(answered) == 2 * 2 * 2  # only each cell's second trial
    fresh = tmp_path / "fresh"
    passkey.run(compose_script("passkey", run_dir, fresh, *common, "trials=2"))
    with open(tmp_path / "trials.csv") as f, open(fresh / "trials.csv") as g:
        widened, alone = list(csv.DictReader(f)), list(csv.DictReader(g))
    floats = ("key_logprob", "first_margin")  # prompts batched with other rows: equal to float rounding
    assert len(widened) == len(alone) == 2 * 2 * 2 * 2
    for a, b in zip(widened, alone):
        assert {k: v for k, v in a.items() if k not in floats} == {
            k: v for k, v in b.items() if k not in floats
        }
        assert [float(a[k]) for k in floats] == pytest.approx([float(b[k]) for k in floats], abs=1e-3)
