"""Every numeric option of the typed groups against 0, -1, nan, inf and a huge value: each is refused in one
sentence naming the option, or listed here as valid (with why). Derived from the schemas themselves
(OptimConfig's fields, the trainer checks' keys), so a new numeric option joins the table by existing."""

from __future__ import annotations

import dataclasses
import math

import pytest
from omegaconf import OmegaConf

from rope_llama.data.positions import PositionsConfig
from rope_llama.inference.generation import SamplingConfig
from rope_llama.training.callbacks import TextSample
from rope_llama.training.optim import OptimConfig
from rope_llama.training.trainer_checks import check_trainer
from tests.helpers import CONFIGS

PROBES = {"0": 0, "-1": -1, "nan": math.nan, "inf": math.inf, "huge": 10**30}

# (option, probe) pairs that are valid, and why
VALID = {
    ("optim.min_lr_ratio", "0"): "decay to zero",
    ("optim.weight_decay", "0"): "no decay",
    ("optim.weight_decay", "huge"): "any strength is a well-defined (if useless) decay",
    ("optim.muon_weight_decay", "0"): "no decay",
    ("optim.muon_weight_decay", "huge"): "as weight_decay",
    ("optim.muon_momentum", "0"): "no momentum",
    ("optim.warmup_steps", "0"): "no warmup",
    ("optim.warmup_steps", "huge"): "a warmup longer than the run: the rate ramps all run",
    ("optim.lr", "huge"): "allowed; the loss guard stops a diverging run",
    ("optim.muon_lr", "huge"): "as lr",
    ("optim.schedule_steps", "huge"): "a longer schedule stops the run early in it",
    ("trainer.max_steps", "huge"): "a long run",
    ("trainer.val_check_interval", "huge"): "validation never runs before the end",
    ("trainer.accumulate_grad_batches", "huge"): "a large effective batch",
    ("trainer.gradient_clip_val", "0"): "Lightning: 0 means no clipping",
    ("trainer.gradient_clip_val", "huge"): "clipping that never triggers",
    ("trainer.log_every_n_steps", "huge"): "rare logging",
    ("trainer.limit_val_batches", "0"): "no validation",
    ("trainer.limit_val_batches", "huge"): "every validation window",
    ("trainer.num_sanity_val_steps", "0"): "no sanity check",
    ("trainer.devices", "-1"): "Lightning: every device",
    ("trainer.num_nodes", "huge"): "the launcher (torchrun, SLURM) decides how many nodes join",
    ("trainer.num_sanity_val_steps", "-1"): "Lightning: every validation batch",
    ("trainer.num_sanity_val_steps", "huge"): "as -1",
    ("sample.max_new_tokens", "0"): "no sample",
    ("sample.max_new_tokens", "huge"): "bounded by the memory check when it runs",
    ("sample.temperature", "0"): "greedy",
    ("sample.temperature", "huge"): "nearly uniform, but finite and well defined",
    ("sample.top_k", "0"): "no top-k filter",
    ("sample.top_k", "huge"): "no filter in effect",
}

OPTIM = [f.name for f in dataclasses.fields(OptimConfig) if f.type in ("float", "int", "int | None")]
TRAINER_CFG = OmegaConf.load(CONFIGS / "trainer" / "cpu.yaml")
TRAINER = [k for k, v in TRAINER_CFG.items() if isinstance(v, int | float) and not isinstance(v, bool)]


def build_optim(name: str, value):
    OptimConfig(**{name: value})


def build_trainer(name: str, value):
    cfg = TRAINER_CFG.copy()
    cfg[name] = value
    check_trainer(cfg)


def build_sample(name: str, value):
    args = dict(tokenizer=None, run_dir=".", prompt="x", max_new_tokens=8, temperature=0.8, top_k=50)
    TextSample(**(args | {name: value}))


def build_positions(name: str, value):
    PositionsConfig(**{"kind": "pose", "target_len": 64, "chunks": 2, name: value}).check(32)


CASES = (
    [(f"optim.{n}", build_optim, n) for n in OPTIM]
    + [(f"positions.{n}", build_positions, n) for n in ("target_len", "chunks")]
    + [(f"trainer.{n}", build_trainer, n) for n in TRAINER]
    + [(f"sample.{n}", build_sample, n) for n in ("max_new_tokens", "temperature", "top_k")]
)


def test_the_table_covers_every_numeric_option_of_the_schemas():
    assert {"optim.lr", "optim.min_lr_ratio", "optim.warmup_steps", "optim.betas"} - {
        c[0] for c in CASES
    } == {
        "optim.betas"  # a pair: its own test below
    }
    assert {"trainer.max_steps", "trainer.val_check_interval", "trainer.gradient_clip_val"} <= {
        c[0] for c in CASES
    }
    assert all(key in {c[0] for c in CASES} for key, _ in VALID)  # no stale entry


@pytest.mark.parametrize("probe", list(PROBES))
@pytest.mark.parametrize("option, build, name", CASES, ids=[c[0] for c in CASES])
def test_each_value_is_refused_in_one_sentence_or_documented_valid(option, build, name, probe):
    value = PROBES[probe]
    if (option, probe) in VALID:
        build(name, value)
        return
    with pytest.raises(ValueError) as refusal:
        build(name, value)
    sentence = str(refusal.value)
    short = option.split(".", 1)[1]  # SamplingConfig names the option without its group
    assert (option in sentence or sentence.startswith(short)) and "\n" not in sentence, sentence
    assert sentence.endswith(".") and f"got {value!r}" in sentence.replace(f"got {value}", f"got {value!r}")


@pytest.mark.parametrize("betas", [[0.9], [0.9, 1.0], [-0.1, 0.95], [0.9, math.nan]])
def test_betas_are_a_pair_in_zero_one(betas):
    with pytest.raises(ValueError, match=r"^optim\.betas"):
        OptimConfig(betas=betas)


def test_sampling_refuses_what_would_be_silent_noise():
    with pytest.raises(ValueError, match="inf would sample uniform noise"):
        SamplingConfig(temperature=math.inf)
