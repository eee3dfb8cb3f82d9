"""train.py: configs compose, a tiny model learns, exact resume, init_from, wandb offline, sweeps, DDP."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from torch.optim.optimizer import register_optimizer_step_post_hook

from rope_llama.cli import train as train_module
from rope_llama.cli.instantiate import build
from rope_llama.cli.train import (
    build_callbacks,
    build_trainer,
    resume_command,
    run_positions,
    run_summary,
    train,
)
from rope_llama.core.checkpoint import CheckpointError, model_state_from_checkpoint, safe_load
from rope_llama.model.config import ModelConfig
from rope_llama.model.rope import RopeConfig
from rope_llama.training.callbacks import TextSample
from rope_llama.training.loggers import csv_logger, finish_wandb
from rope_llama.training.module import LitLlama
from rope_llama.training.optim import OptimConfig, build_optimizer, lr_multiplier
from rope_llama.training.throughput import matmul_dtype
from tests.helpers import CONFIGS, L0, compose_train, last_weights, small_corpus, tiny_overrides, train_cli

pytestmark = (
    pytest.mark.hardware
)  # precision=auto's branch: .ci/run runs this file with bf16 forced on and off


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return small_corpus(tmp_path_factory.mktemp("corpus"))


def run_train(tmp_path: Path, corpus: str, *extra: str, name: str = "run") -> tuple[dict, Path]:
    run_dir = tmp_path / name
    cfg = compose_train(tiny_overrides(tmp_path, corpus) + list(extra), run_dir)
    return train(cfg), run_dir


def losses(run_dir: Path, key: str = "train/loss") -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


# ----------------------------------------------------------------------------- every config file


@pytest.mark.parametrize(
    "group", ["model", "rope", "data", "positions", "trainer", "logger", "callbacks", "optim", "experiment"]
)
def test_every_config_file_composes_and_instantiates(group, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for option in options(group):
        overrides = [f"{group}={option}"]
        if group == "data" and option == "text_files":
            overrides.append("data.source.paths=[x.txt]")  # required field (???) in that file
        cfg = compose_train(overrides, tmp_path / f"{group}-{option}")
        lengths, rope, extend = run_positions(cfg, None)  # as train.py resolves them (from scratch)
        assert (
            isinstance(rope, RopeConfig) and rope.original_max_len == lengths.trained_len == cfg.data.max_len
        )
        model_config = build(cfg.model, vocab_size=256)  # as train.py fills it from the tokenizer
        assert isinstance(model_config, ModelConfig)
        model_config = replace(model_config, rope=rope, extend=extend, lengths=lengths)
        optim = build(cfg.optim)
        build_optimizer(LitLlama(model_config, optim).model, optim, fused=False)
        datamodule = build(cfg.data)  # constructs only; no download or preparation
        assert datamodule.max_len == cfg.data.max_len
        callbacks = build_callbacks(cfg.callbacks)
        assert all(isinstance(c, L.Callback) for c in callbacks)
        assert isinstance(build(cfg.sample, tokenizer=None), TextSample)
        trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
        if trainer_cfg.get("strategy") in ("ddp", "fsdp") or trainer_cfg["accelerator"] == "gpu":
            assert trainer_cfg["_target_"] == "lightning.pytorch.Trainer"  # needs several devices / a GPU
        else:
            trainer = build_trainer(cfg.trainer, logger=build(cfg.logger), callbacks=callbacks)
            assert trainer.max_steps == cfg.trainer.max_steps
            finish_wandb(trainer)  # a wandb run left open would be reused by later tests


def test_logger_options_build_lightnings_loggers(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    built = {}
    for option in options("logger"):
        cfg = compose_train([f"logger={option}"], tmp_path / option)
        trainer = build_trainer(
            cfg.trainer, logger=build(cfg.logger), callbacks=build_callbacks(cfg.callbacks)
        )
        built[option] = [type(logger).__name__ for logger in trainer.loggers]
        finish_wandb(trainer)
    assert built == {"csv": ["CSVLogger"], "none": [], "wandb": ["WandbLogger"]}


def test_pose_experiment_trains_short_windows_towards_a_matched_length(tmp_path):
    cfg = compose_train(["experiment=pose", "rope=yarn"], tmp_path)
    assert cfg.positions.kind == "pose" and cfg.data.positions.target_len == 1024 and cfg.data.max_len == 256
    assert (
        cfg.rope.scaling == "yarn" and cfg.rope.factor is None
    )  # follows from the lengths (model/context.py)
    extend = compose_train(["experiment=extend_context"], tmp_path / "extend")
    assert cfg.trainer.max_steps == extend.trainer.max_steps  # the full-length fine-tune's steps
    assert (
        cfg.data.batch_size * cfg.data.max_len == extend.data.batch_size * extend.data.max_len
    )  # and tokens


def test_invalid_combination_fails_with_one_sentence(tmp_path, corpus):
    base = tiny_overrides(tmp_path, corpus)
    for bad, message in [
        (["model.n_heads=3"], "must be divisible by n_heads (3)"),
        (["data.max_len=100000"], "max_len"),
        (
            ["positions=pose", "positions.target_len=16"],
            "positions.target_len must be an integer >= data.max_len (32)",
        ),
        (
            ["positions=pose", "positions.chunks=0"],
            "positions.chunks must be an integer >= 1, got 0.",
        ),
        (["positions=pose", "positions.chunks=33"], "got 33."),
        (["positions=randomized", "positions.target_len=8"], "for randomized, got 8."),
    ]:
        proc = train_cli(*base, *bad, f"hydra.run.dir={tmp_path / 'bad'}")
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- training behaviour


def test_tiny_model_learns_and_writes_checkpoints(tmp_path, corpus):
    metrics, run_dir = run_train(
        tmp_path, corpus, "trainer.max_steps=40", "optim.lr=1e-2", "trainer.log_every_n_steps=1"
    )
    curve = losses(run_dir)
    assert len(curve) >= 3 and curve[-1] < curve[0] - 1.0, curve
    assert {"val/loss", "val/ppl", "val/bpc"} <= set(metrics)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (
        run_dir / "checkpoints" / "best.ckpt"
    ).is_file()
    assert (run_dir / "tokenizer.json").is_file() and "step 40" in (run_dir / "samples.txt").read_text()
    ckpt = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert ckpt["model_config"]["lengths"] == {"trained_len": 32, "context_len": 32}
    assert ckpt["model_config"]["rope"]["original_max_len"] == 32  # from the run's own windows
    assert len(ckpt["tokenizer"]["sha256"]) == 64


def test_resume_command_repeats_the_runs_own_overrides(monkeypatch):
    """The SIGTERM hint resumes the same run: its recipe and settings, its directory, ckpt_path=last."""
    run_dir = Path("runs/2026-11-26_03-00-00")
    task = [
        "experiment=[recall_base,extend_context]",
        "++data.recall.flat_share=0.5",
        "ckpt_path=runs/x/a.ckpt",
    ]
    assert resume_command(task, ["hydra.verbose=true"], run_dir) == (
        "python train.py 'experiment=[recall_base,extend_context]' ++data.recall.flat_share=0.5 "
        "run_name=2026-11-26_03-00-00 ckpt_path=last"
    )
    named = resume_command(["run_name=mine", "seed=3"], [], Path("runs/mine"))
    assert named == "python train.py run_name=mine seed=3 ckpt_path=last"
    placed = resume_command(["seed=3"], ["hydra.run.dir=/tmp/my run"], Path("/tmp/my run"))
    assert placed == "python train.py seed=3 'hydra.run.dir=/tmp/my run' ckpt_path=last"
    monkeypatch.setattr(train_module, "checkout", lambda: None)  # an installed copy: its console script
    assert resume_command(["seed=3"], [], Path("runs/x")) == "rope-train seed=3 run_name=x ckpt_path=last"


@pytest.mark.parametrize(
    "optim, positions", [("adamw", "contiguous"), ("muon", "contiguous"), ("adamw", "pose")]
)
def test_resume_gives_identical_weights(tmp_path, corpus, optim, positions, capsys):
    """The learning-rate schedule past the resume point is part of it: a frozen LR diverges. PoSE's
    position ids are drawn per batch index, so they resume too."""
    # fp32 whatever the host: Muon's Newton-Schulz dtype follows the precision (test_optim covers both)
    keep_steps = ["callbacks.checkpoint.keep_all=true", f"optim={optim}", "trainer.precision=32-true"]
    keep_steps += (
        [f"positions={positions}", f"++positions.target_len={4 * L0}"] if positions == "pose" else []
    )
    _, full = run_train(tmp_path, corpus, *keep_steps, name="full")
    said = "Muon's Newton-Schulz: float32 (optim.muon_dtype=auto)" in capsys.readouterr().out
    assert said == (optim == "muon")
    mid = full / "checkpoints" / "step000010.ckpt"
    assert mid.is_file()
    _, resumed = run_train(tmp_path, corpus, *keep_steps, f"ckpt_path={mid}", name="resumed")
    last = safe_load(resumed / "checkpoints" / "last.ckpt")
    assert last["global_step"] == 20
    context = 4 * L0 if positions == "pose" else L0  # PoSE's checkpoint records its target as its context
    assert last["model_config"]["lengths"] == {"trained_len": L0, "context_len": context}
    a, b = last_weights(full), last_weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    _, fresh = run_train(tmp_path, corpus, "seed=7", name="other_seed")
    assert not torch.equal(last_weights(fresh)["embed.weight"], a["embed.weight"])  # the check can fail


def test_a_resume_with_other_settings_is_refused(tmp_path, corpus):
    """Another optimizer cannot load the run's optimizer state (a KeyError deep in Lightning); another RoPE
    would continue the weights under other positions without a word."""
    _, run = run_train(tmp_path, corpus, "trainer.max_steps=4", "trainer.val_check_interval=4", name="first")
    last = run / "checkpoints" / "last.ckpt"
    for changed, said in [
        (["optim=muon"], "optim.name='adamw' -> 'muon'"),
        (["rope=yarn", "rope.factor=4"], "rope.scaling='none' -> 'yarn'"),
    ]:
        with pytest.raises(CheckpointError, match="resumes a run trained with other settings") as refused:
            run_train(tmp_path, corpus, "trainer.max_steps=8", f"ckpt_path={last}", *changed, name="again")
        assert said in str(refused.value) and "init_from=" in str(refused.value)
    _, resumed = run_train(tmp_path, corpus, "trainer.max_steps=8", "trainer.val_check_interval=4",
                           f"ckpt_path={last}", name="same")  # fmt: skip
    assert safe_load(resumed / "checkpoints" / "last.ckpt")["global_step"] == 8  # the same settings resume


def test_schedule_steps_stops_a_run_where_the_longer_schedule_was(tmp_path, corpus):
    """trainer.max_steps=10 on a 20-step schedule ends with the 20-step run's step-10 weights; on its
    own 10-step schedule (the learning rate decayed sooner) it does not."""
    _, full = run_train(tmp_path, corpus, "callbacks.checkpoint.keep_all=true", name="full")
    at_10 = model_state_from_checkpoint(safe_load(full / "checkpoints" / "step000010.ckpt"))
    _, cut = run_train(tmp_path, corpus, "trainer.max_steps=10", "optim.schedule_steps=20", name="cut")
    _, own = run_train(tmp_path, corpus, "trainer.max_steps=10", name="own")
    cut_weights, own_weights = last_weights(cut), last_weights(own)
    assert at_10.keys() == cut_weights.keys() and all(torch.equal(at_10[k], cut_weights[k]) for k in at_10)
    assert not torch.equal(at_10["embed.weight"], own_weights["embed.weight"])


def test_wsd_schedule_drives_the_logged_learning_rate(tmp_path, corpus):
    """optim.schedule=wsd reaches the optimizer: the monitor's learning rates are the schedule's."""
    _, run_dir = run_train(
        tmp_path, corpus, "optim.schedule=wsd", "optim.decay_fraction=0.25", "trainer.log_every_n_steps=1"
    )
    cfg = OptimConfig(lr=2e-3, warmup_steps=5, schedule="wsd", decay_fraction=0.25)
    with open(run_dir / "metrics.csv") as f:
        logged = {
            int(r["step"]): float(r["lr-AdamW/pg1"]) for r in csv.DictReader(f) if r.get("lr-AdamW/pg1")
        }
    assert sorted(logged) == list(range(20))
    assert [logged[s] for s in range(20)] == pytest.approx(
        [cfg.lr * lr_multiplier(cfg, s, 20) for s in range(20)]
    )
    assert logged[10] == logged[14] == cfg.lr > logged[17] > logged[19]  # constant, then decaying


def test_schedule_steps_must_be_a_positive_integer():
    with pytest.raises(
        ValueError,
        match=r"optim.schedule_steps must be an integer >= 1 or null \(trainer.max_steps\), got 0\.",
    ):
        OptimConfig(schedule_steps=0)


def test_ema_checkpoints_hold_the_average_and_resume_both_trajectories(tmp_path, corpus):
    ema = ["callbacks=ema", "callbacks.ema.decay=0.8", "callbacks.checkpoint.keep_all=true"]
    _, full = run_train(tmp_path, corpus, *ema, name="full")
    mid = full / "checkpoints" / "step000010.ckpt"
    _, resumed = run_train(tmp_path, corpus, *ema, f"ckpt_path={mid}", name="resumed")
    a, b = (safe_load(run / "checkpoints" / "last.ckpt") for run in (full, resumed))
    for entry in ("state_dict", "current_model_state"):  # the average and the raw weights
        assert a[entry].keys() == b[entry].keys()
        for name in a[entry]:
            assert torch.equal(a[entry][name], b[entry][name]), (entry, name)
    average, raw = a["state_dict"]["model.embed.weight"], a["current_model_state"]["model.embed.weight"]
    assert not torch.equal(average, raw)  # the check can fail: decay 0.8 over 20 steps is not the raw
    assert torch.equal(last_weights(full)["embed.weight"], average)  # what generate.py and the scripts load


def test_ema_validates_and_saves_the_raw_weights_before_its_first_update(tmp_path, corpus):
    keep = "callbacks.checkpoint.keep_all=true"
    _, plain = run_train(tmp_path, corpus, keep, name="plain")
    _, ema = run_train(
        tmp_path, corpus, keep, "callbacks=ema", "callbacks.ema.update_starting_at_step=15", name="ema"
    )

    def val_losses(run_dir: Path) -> list[str]:
        with open(run_dir / "metrics.csv") as f:
            return [r["val/loss"] for r in csv.DictReader(f) if r.get("val/loss")]

    (plain_10, plain_20), (ema_10, ema_20) = val_losses(plain), val_losses(ema)
    assert ema_10 == plain_10 and ema_20 != plain_20  # step 10: not averaging yet; step 20: the average
    at_10 = [safe_load(run / "checkpoints" / "step000010.ckpt")["state_dict"] for run in (plain, ema)]
    for name in at_10[0]:
        assert torch.equal(at_10[0][name], at_10[1][name]), name


def test_init_from_loads_weights_into_a_new_run_with_another_rope(tmp_path, corpus):
    """The fine-tune's RoPE is relative to the base's length (its checkpoint's, nothing typed) and a null
    factor follows from the new length: 2 x L0 / L0."""
    _, base = run_train(tmp_path, corpus, "trainer.max_steps=10", name="base")
    base_weights = last_weights(base)
    _, ext = run_train(
        tmp_path,
        corpus,
        "rope=yarn",
        "rope.factor=null",
        f"data.max_len={2 * L0}",
        f"init_from={base / 'checkpoints' / 'last.ckpt'}",
        "trainer.max_steps=10",
        "optim.lr=1e-30",  # updates below float32 resolution: the run must start from (and keep) the loaded weights
        name="extended",
    )
    ckpt = safe_load(ext / "checkpoints" / "last.ckpt")
    rope = ckpt["model_config"]["rope"]
    assert ckpt["global_step"] == 10 and rope["scaling"] == "yarn"
    assert (rope["factor"], rope["original_max_len"]) == (2.0, L0)
    assert ckpt["model_config"]["lengths"] == {"trained_len": 2 * L0, "context_len": 2 * L0}
    for k, v in base_weights.items():
        assert torch.equal(model_state_from_checkpoint(ckpt)[k], v), k


def grad_norms_at_step(run) -> list[float]:
    """Global gradient norm seen by every optimizer step (after clipping) while `run()` trains."""
    norms = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    handle = register_optimizer_step_post_hook(record)  # grads stay until zero_grad
    try:
        run()
    finally:
        handle.remove()
    return norms


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gradients_are_clipped_under_fp32_and_bf16_mixed(precision, tmp_path, corpus):
    """bf16-mixed (trainer=gpu's precision) used to stop at the first step: Lightning refuses to clip
    a fused AdamW's gradients under mixed precision, so the override in LitLlama must clip them.
    (16-mixed cannot run here: Lightning turns it into bf16-mixed on CPU.)"""
    steps = ["logger=none", "trainer.max_steps=3", f"trainer.precision={precision}"]
    free = grad_norms_at_step(
        lambda: run_train(tmp_path, corpus, *steps, "trainer.gradient_clip_val=0", name="free")
    )
    clip = min(free) / 4  # below every unclipped norm, so each step must be clipped
    clipped = grad_norms_at_step(
        lambda: run_train(tmp_path, corpus, *steps, f"trainer.gradient_clip_val={clip}", name="clipped")
    )
    assert len(free) == len(clipped) == 3
    assert all(n == pytest.approx(clip, rel=1e-3) for n in clipped), (clip, clipped)


def test_wandb_offline_writes_a_run_directory(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    _, run_dir = run_train(tmp_path, corpus, "logger=wandb", "trainer.max_steps=10", name="wb")
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_logger_none_trains_and_checkpoints(tmp_path, corpus, capsys):
    _, run_dir = run_train(
        tmp_path, corpus, "logger=none", "trainer.max_steps=4", "trainer.limit_val_batches=0", name="nolog"
    )
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["last.ckpt"]  # no last-v1.ckpt copy
    assert not (run_dir / "metrics.csv").exists()
    out = capsys.readouterr().out  # validation off: no score, no best.ckpt
    assert "(last.ckpt)" in out and "Final validation: none ran" in out and "best.ckpt" not in out


def test_the_last_step_is_validated_when_max_steps_is_not_a_multiple_of_the_interval(tmp_path, corpus):
    metrics, run_dir = run_train(tmp_path, corpus, "trainer.max_steps=14", name="tail")  # interval 10
    with open(run_dir / "metrics.csv") as f:
        validated = [int(r["step"]) + 1 for r in csv.DictReader(f) if r.get("val/loss")]
    assert validated == [10, 14]  # Lightning logs the 0-based index of the last finished step
    assert "val/bpc" in metrics and (run_dir / "checkpoints" / "best.ckpt").exists()


def test_new_run_refuses_a_run_directory_with_checkpoints(tmp_path, corpus):
    _, run_dir = run_train(tmp_path, corpus, "logger=none", "trainer.max_steps=2", name="taken")
    before = (run_dir / "checkpoints" / "last.ckpt").read_bytes()
    with pytest.raises(
        CheckpointError, match=r"taken already holds checkpoints \(best.ckpt, last.ckpt\); resume"
    ):
        run_train(tmp_path, corpus, "logger=none", "trainer.max_steps=2", "seed=5", name="taken")
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() == before  # nothing was written
    run_train(
        tmp_path, corpus, "logger=none", "trainer.max_steps=2", "seed=5", "overwrite=true", name="taken"
    )
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() != before


def test_run_summary_names_existing_checkpoints_and_scores(tmp_path):
    (tmp_path / "best.ckpt").touch()
    (tmp_path / "last.ckpt").touch()
    summary = run_summary({"val/loss": 1.5, "val/bpc": 2.0, "train/loss": 1.0}, tmp_path, 100)
    assert (
        summary
        == f"Checkpoints: {tmp_path} (best.ckpt, last.ckpt)\nFinal validation: val/loss=1.5000, val/bpc=2.0000"
    )
    assert "none ran" in run_summary({}, tmp_path / "missing", 100).splitlines()[1]
    recall = run_summary({"val/bpc": 2.0, "val/recall_digits": 0.125, "val/recall_exact": 0.0}, tmp_path, 100)
    assert recall.endswith("val/bpc=2.0000, val/recall_digits=0.1250, val/recall_exact=0.0000")


def test_hydra_multirun_over_two_rope_settings(tmp_path, corpus):
    sweep = tmp_path / "sweep"
    proc = train_cli(
        "-m",
        "rope=none,linear",
        "rope.factor=2",
        *tiny_overrides(tmp_path, corpus),
        "trainer.max_steps=4",
        "optim.warmup_steps=2",
        "trainer.val_check_interval=2",
        "sample.max_new_tokens=0",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "checkpoints" / "last.ckpt").exists())
    assert len(runs) == 2
    scalings = {safe_load(r / "checkpoints" / "last.ckpt")["model_config"]["rope"]["scaling"] for r in runs}
    assert scalings == {"none", "linear"}


# Recall windows with weighted answers: the halves of a batch carry different sums of weights, so the
# processes' weighted means must be combined by their shares of the weight, not averaged.
WEIGHTED_RECALL = [
    "data.max_len=256",  # room for the facts and question of a recall window in the tiny tokenizer's tokens
    "++data.recall.fraction=0.5",
    "++data.recall.min_pairs=1",
    "++data.recall.max_pairs=2",
    "++data.recall.answer_weight=8",
]


@pytest.mark.slow  # three training processes each: kept out of the default run, which must stay under 10 minutes
@pytest.mark.parametrize(
    "data",
    [[], WEIGHTED_RECALL, ["data.shard_tokens=2048"]],  # the last: windows across the edges of eight shards
    ids=["text", "weighted_recall", "shards"],
)
def test_two_cpu_processes_train_the_one_process_model(tmp_path, corpus, data):
    # data.batch_size is the global batch: two processes take half of each batch and average their
    # gradients, so they train the one-process model (fp32; the sums run in another order) and score
    # the same validation windows
    runs = {}
    for processes in (1, 2):
        runs[processes] = tmp_path / f"p{processes}"
        proc = train_cli(
            "trainer=ddp",
            "trainer.accelerator=cpu",
            f"trainer.devices={processes}",
            "trainer.precision=32-true",
            *tiny_overrides(tmp_path, corpus),
            "trainer.max_steps=6",
            "trainer.val_check_interval=3",
            "trainer.limit_val_batches=3",
            "data.val_batch_size=4",
            "logger=csv",
            f"hydra.run.dir={runs[processes]}",
            *data,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert safe_load(runs[2] / "checkpoints" / "last.ckpt")["global_step"] == 6
    one, two = last_weights(runs[1]), last_weights(runs[2])
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-4
    assert losses(runs[2], "val/loss")[-1] == pytest.approx(losses(runs[1], "val/loss")[-1], rel=1e-5)


@pytest.mark.slow  # compiles the training step (about a minute on 2 cores with a cold inductor cache)
def test_compiled_training_trains_the_eager_model(tmp_path, corpus):
    # compile=true compiles each block in place (configure_model): same parameters and checkpoint keys,
    # and in fp32 the same weights as the eager run to rounding (inductor fuses the ops in another order)
    common = [
        "trainer.precision=32-true",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "logger=csv",
    ]
    _, eager = run_train(tmp_path, corpus, *common, name="eager")
    torch._dynamo.utils.counters.clear()  # count this run's graphs only
    _, compiled = run_train(tmp_path, corpus, *common, "compile=true", name="compiled")
    # one graph for the training step and one for validation (no_grad): the text sample's KV-cache decode
    # runs eager instead of recompiling the blocks for every layer and length
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    one, two = last_weights(eager), last_weights(compiled)
    assert one.keys() == two.keys()
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-4
    assert losses(compiled, "val/loss")[-1] == pytest.approx(losses(eager, "val/loss")[-1], rel=1e-4)


@pytest.mark.slow  # compiles the training step twice
def test_each_compiled_run_of_a_sweep_is_compiled(tmp_path, corpus):
    """A sweep (train.py -m) trains its settings one after another in one process, and a new head count
    is two new graphs (training, validation) for the same block code: without a fresh dynamo cache per
    run, the runs past dynamo's recompile limit (8 graphs, so the fifth architecture) would train eager.
    Here the limit is the two graphs of one run, and hitting it is an error."""
    common = [
        "trainer.precision=32-true",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "compile=true",
    ]
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        run_train(tmp_path, corpus, *common, name="four_heads")
        torch._dynamo.utils.counters.clear()
        run_train(tmp_path, corpus, *common, "model.n_heads=2", "model.n_kv_heads=1", name="two_heads")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_resumed_run_keeps_the_earlier_metrics_file(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,train/loss\n1,5.0\n")
    csv_logger(tmp_path)
    assert (tmp_path / "metrics.1.csv").read_text() == "step,train/loss\n1,5.0\n"
    assert not (tmp_path / "metrics.csv").exists()


@pytest.mark.parametrize(
    "precision, dtype",
    [
        ("32-true", torch.float32),
        ("bf16-mixed", torch.bfloat16),
        ("16-mixed", torch.float16),
        ("bf16-true", torch.bfloat16),
    ],
)
def test_mfu_peak_is_measured_in_the_dtype_the_matmuls_run_in(precision, dtype):
    assert matmul_dtype(precision) == dtype


def test_training_continues_after_a_sample_longer_than_the_training_length(tmp_path, corpus):
    """The sample at step 10 (under inference_mode) grows the shared RoPE table past max_len=32;
    step 11 trains on that table and its autograd saves slices of it."""
    metrics, run_dir = run_train(tmp_path, corpus, "sample.max_new_tokens=40")
    assert safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 20
    samples = (run_dir / "samples.txt").read_text()
    assert "step 10" in samples and "step 20" in samples and "val/loss" in metrics


def test_checkpoints_that_do_not_fit_are_refused_before_the_run_directory_is_written(tmp_path, corpus):
    _, base = run_train(tmp_path, corpus, "logger=none", "trainer.max_steps=2", name="base")
    last = base / "checkpoints" / "last.ckpt"
    weights_only = tmp_path / "weights_only.ckpt"  # what scripts/import_hf.py writes: no training state
    torch.save(
        {k: v for k, v in safe_load(last).items() if k in ("state_dict", "model_config")}, weights_only
    )
    wider = ["model.d_model=128"]
    moved = tmp_path / "moved.ckpt"  # outside its run directory: no saved settings, the weights are compared
    moved.write_bytes(last.read_bytes())
    shapes = "tensor 'embed.weight' has shape [320, 64] in the checkpoint but [320, 128] in the model (and "
    for option, path, overrides, sentence in [
        ("init_from", last, wider, f"init_from {last} does not fit this model (the same model= and data "
         f"tokenizer are needed): {shapes}"),
        ("ckpt_path", moved, wider, f"ckpt_path {moved} does not fit this model (resume with the run's own "
         f"model= and data settings): {shapes}"),
        ("ckpt_path", weights_only, [], f"ckpt_path {weights_only} holds no training state to resume "
         f"(optimizer, schedule, step); pass init_from={weights_only} to start a new run from its weights."),
    ]:  # fmt: skip
        run_dir = tmp_path / f"{option}-{path.stem}"
        with pytest.raises(CheckpointError) as info:
            run_train(tmp_path, corpus, f"{option}={path}", *overrides, name=run_dir.name)
        assert str(info.value).startswith(sentence) and "\n" not in str(info.value), str(info.value)
        if overrides:  # what to change, from the checkpoint's saved model_config
            derived = ", ffn_hidden 192 in the checkpoint, 352 here" if option == "ckpt_path" else ""
            assert str(info.value).endswith(  # init_from takes the unnamed fields from the checkpoint
                f"; model settings that differ: d_model 64 in the checkpoint, 128 here{derived}."
            )
        assert list(run_dir.iterdir()) == []  # refused before anything was written into the run directory


def test_recall_runs_log_the_held_out_recall_probe_and_plain_runs_do_not(tmp_path, corpus):
    recall = ["data.max_len=128", "data.recall.fraction=0.5", "++data.recall.max_pairs=1"]
    metrics, run_dir = run_train(tmp_path, corpus, *recall, name="recall")
    with open(run_dir / "metrics.csv") as f:
        probed = [
            (int(r["step"]) + 1, float(r["val/recall_digits"]))
            for r in csv.DictReader(f)
            if r.get("val/recall_digits")
        ]
    assert [step for step, _ in probed] == [10, 20] and all(0 <= d <= 1 for _, d in probed)
    assert 0 <= metrics["val/recall_exact"] <= 1 and -1 <= metrics["val/digit_similarity"] <= 1
    plain, _ = run_train(tmp_path, corpus, "data.max_len=128", name="plain")
    assert "val/bpc" in plain and not {"val/recall_digits", "val/digit_similarity"} & set(plain)
