"""tools/time_to_quality.py: the first validation reaching each threshold, from a real (tiny) run."""

from __future__ import annotations

import csv

import pytest

from rope_llama.bench import time_to_quality as ttq
from tests.helpers import small_corpus, tiny_overrides

pytestmark = (
    pytest.mark.hardware
)  # precision=auto's branch: .ci/run runs this file with bf16 forced on and off


def test_first_reaching_takes_the_first_validation_at_or_below_the_threshold():
    rows = [
        {"step": "49", "val/bpc": "2.5", "time/train_s": "10.0"},
        {"step": "99", "val/bpc": "2.09", "time/train_s": "20.5"},
        {"step": "149", "val/bpc": "2.01", "time/train_s": "31.0"},
    ]
    assert ttq.first_reaching(rows, 2.10, 4096) == dict(step=100, tokens=409600, train_s=20.5, bpc=2.09)
    assert ttq.first_reaching(rows, 2.01, 10)["step"] == 150  # "at or below"
    assert ttq.first_reaching(rows, 2.0, 10) is None


def test_the_floor_is_the_median_seconds_per_token_at_the_matmul_peak():
    rows = [
        {"step": "9", "perf/mfu": "0.5", "perf/tokens_per_s": "1000"},  # 5e-4 s per token at the peak
        {"step": "19", "perf/mfu": "0.6", "perf/tokens_per_s": "1000"},
        {"step": "19", "val/bpc": "2.3", "perf/mfu": ""},  # a validation row carries no throughput
        {"step": "29", "perf/mfu": "0.9", "perf/tokens_per_s": "3000"},
    ]
    assert ttq.seconds_per_token_at_peak(rows) == pytest.approx(5e-4)  # median of 3e-4, 5e-4, 6e-4
    assert ttq.seconds_per_token_at_peak([{"step": "9", "val/bpc": "2.3"}]) is None


@pytest.mark.parametrize(
    "precision, expected",
    [
        ("bf16-mixed", ["adamw-fp32", "adamw-bf16", "muon-fp32", "muon-bf16"]),
        ("32-true", ["adamw-fp32", "muon-fp32"]),  # no bf16 job where its matmuls would be emulated
    ],
)
def test_auto_recipes_run_bf16_only_where_trainer_precision_auto_picks_it(monkeypatch, precision, expected):
    monkeypatch.setattr(ttq, "bf16_is_native", lambda accelerator: (precision == "bf16-mixed", "the reason"))
    assert ttq.parse_args([])["recipes"] == expected  # the default is [auto]
    assert ttq.parse_args(["recipes=[muon-bf16,auto]"])["recipes"] == list(
        dict.fromkeys(["muon-bf16", *expected])
    )
    assert ttq.parse_args(["recipes=[adamw-bf16]"])["recipes"] == ["adamw-bf16"]  # named recipes run as given


@pytest.mark.parametrize("bad", ["recipes=[sgd-fp32]", "recipes=[muon-fp8]", "speed=11"])
def test_bad_options_are_one_sentence(bad):
    with pytest.raises(SystemExit, match=r"^error: unknown (recipe|option)"):
        ttq.parse_args([bad])


@pytest.mark.slow  # a real training run: kept out of the default run, which must stay under 10 minutes
def test_a_tiny_recipe_reports_time_steps_and_tokens(tmp_path):
    corpus = small_corpus(tmp_path / "corpus")
    extra = [o for o in tiny_overrides(tmp_path, corpus) if not o.startswith("trainer.val_check_interval")]
    results = ttq.main(
        ["recipes=[muon-fp32]", "thresholds=[99,0.1]", "val_every=5", f"out={tmp_path / 'ttq.json'}"]
        + [f"extra=[{','.join(extra)}]"]
    )
    (result,) = results
    assert "error" not in result, result
    with open(tmp_path / "muon-fp32" / "metrics.csv") as f:
        validations = [r for r in csv.DictReader(f) if r.get("val/bpc")]
    assert len(validations) == 4  # 20 steps, validated every 5
    first = result["reached"]["99.00"]  # every score is below 99: the first validation, after 5 steps
    assert first["step"] == 5 and first["tokens"] == 5 * 8 * 32 and first["train_s"] > 0
    assert 0 < first["floor_s"] < first["train_s"]  # no run beats its own matmul peak
    assert result["reached"]["0.10"] is None and result["steps"] == 20
