"""The position contract (model/context.py): trained lengths recorded once, overrides that return new
configs, every command's RoPE resolved from the checkpoint's own; and evaluation cells that do not
depend on which method ran before them."""

from __future__ import annotations

import csv
import dataclasses

import pytest
import torch

from rope_llama.cli import eval_extrapolation, passkey
from rope_llama.cli.train import run_positions, train
from rope_llama.core.checkpoint import load_checkpoint
from rope_llama.model.config import ModelConfig, TrainedLengths
from rope_llama.model.context import reference_len, resolve_positions
from rope_llama.model.extend import ExtendConfig
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig
from tests.helpers import L0, compose_train, last_weights, small_corpus, tiny_overrides
from tests.test_eval import compose_script, eval_cfg, rows_by

CHECKPOINT = ModelConfig(
    rope=RopeConfig(base=500.0, layout="interleaved", rotary_dim=8, original_max_len=32),
    extend=ExtendConfig(method="none", window=16, group=4),
    lengths=TrainedLengths(32, 64),
)


# ----------------------------------------------------------------------------- the record


def test_trained_lengths_are_validated_and_read_from_every_form():
    assert TrainedLengths.of(256) == TrainedLengths(256, 256)  # an older checkpoint's one max_len
    assert TrainedLengths.of({"trained_len": 256, "context_len": 1024}) == TrainedLengths(256, 1024)
    assert TrainedLengths.of(None) is None
    for bad, message in [
        ((0, 8), "model lengths.trained_len must be an integer >= 1, got 0."),
        ((8, True), "model lengths.context_len must be an integer >= 1, got True."),
        ((64, 32), "model lengths.context_len (32) must be >= trained_len (64)."),
    ]:
        with pytest.raises(ValueError) as e:
            TrainedLengths(*bad)
        assert str(e.value) == message
    with pytest.raises(ValueError, match=r"Unknown model lengths keys \['max_len'\]"):
        TrainedLengths.of({"max_len": 3})


def test_configs_are_frozen_and_an_override_is_a_new_one():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CHECKPOINT.rope = RopeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        CHECKPOINT.lengths.context_len = 1
    assert ModelConfig.from_dict(CHECKPOINT.to_dict()) == CHECKPOINT  # what a checkpoint stores


# ----------------------------------------------------------------------------- resolution


def test_inference_override_is_relative_to_the_claimed_context_and_keeps_the_weights_fields():
    assert resolve_positions(CHECKPOINT) == (CHECKPOINT.rope, CHECKPOINT.extend)  # no override: its own
    rope, extend = resolve_positions(
        CHECKPOINT,
        {"scaling": "ntk", "factor": 8.0, "original_max_len": None, "layout": "half", "_target_": "x"},
        {"method": "logn"},
    )
    assert (rope.scaling, rope.factor, rope.original_max_len) == ("ntk", 8.0, 64)  # None: context_len
    assert (rope.layout, rope.rotary_dim, rope.base) == (
        "interleaved",
        8,
        500.0,
    )  # how the weights were trained
    assert extend == ExtendConfig(method="logn", window=16, group=4, original_max_len=64)
    rope, _ = resolve_positions(CHECKPOINT, {"scaling": "yarn", "original_max_len": 48})
    assert (rope.original_max_len, rope.factor) == (48, CHECKPOINT.rope.factor)  # given values win
    with pytest.raises(ValueError, match="valid scalings are"):
        resolve_positions(CHECKPOINT, {"scaling": "bogus"})
    with pytest.raises(ValueError, match=r"Unknown rope keys \['theta'\]"):
        resolve_positions(CHECKPOINT, {"theta": 2.0})
    with pytest.raises(ValueError, match=r"Unknown extend keys \['size'\]"):
        resolve_positions(CHECKPOINT, None, {"size": 3})
    with pytest.raises(ValueError, match="rope.factor=null derives the factor from a training length"):
        resolve_positions(CHECKPOINT, {"scaling": "yarn", "factor": None})
    assert CHECKPOINT.rope.layout == "interleaved" and CHECKPOINT.lengths == TrainedLengths(32, 64)


def test_training_from_scratch_is_relative_to_its_own_windows():
    lengths = TrainedLengths(128, 512)  # PoSE: windows of 128 towards 512
    rope, extend = resolve_positions(None, {"scaling": "yarn", "factor": None}, {"method": "logn"}, lengths)
    assert (rope.original_max_len, rope.factor) == (128, 4.0)  # 512 / 128
    assert extend.original_max_len == 128
    rope, _ = resolve_positions(None, {"scaling": "linear", "factor": 2.0}, None, TrainedLengths(64, 64))
    assert (rope.original_max_len, rope.factor) == (64, 2.0)  # a number given is kept


def test_a_fine_tune_continues_the_base_positions():
    base = ModelConfig(lengths=TrainedLengths(256, 256), rope=RopeConfig(original_max_len=256))
    assert reference_len(base.rope, base.lengths) == 256
    rope, _ = resolve_positions(base, {"scaling": "linear", "factor": None}, None, TrainedLengths(1024, 1024))
    assert (rope.factor, rope.original_max_len) == (4.0, 256)
    pose_base = ModelConfig(lengths=TrainedLengths(256, 1024), rope=RopeConfig(original_max_len=256))
    rope, _ = resolve_positions(
        pose_base, {"scaling": "yarn", "factor": None}, None, TrainedLengths(256, 4096)
    )
    assert (rope.factor, rope.original_max_len) == (4.0, 1024)  # relative to the context it already claims
    scaled = ModelConfig(
        lengths=TrainedLengths(1024, 1024),
        rope=RopeConfig(scaling="linear", factor=4.0, original_max_len=256),
    )
    rope, _ = resolve_positions(
        scaled, {"scaling": "linear", "factor": None}, None, TrainedLengths(4096, 4096)
    )
    assert (rope.factor, rope.original_max_len) == (16.0, 256)  # the frequencies the weights first learned


@pytest.mark.parametrize(
    "recipe, factor",
    [
        (["experiment=extend_context"], 4.0),
        (["experiment=pose"], 4.0),
        (["experiment=pose", "positions.target_len=4096"], 16.0),
    ],
)
def test_fine_tune_recipes_type_no_factor(tmp_path, recipe, factor):
    """extend_context and pose state only the new length: the factor follows from the base checkpoint's."""
    base = ModelConfig(lengths=TrainedLengths(256, 256), rope=RopeConfig(original_max_len=256))
    for scaling in ("linear", "yarn"):
        cfg = compose_train([*recipe, f"rope={scaling}", "init_from=base.ckpt"], tmp_path / scaling)
        lengths, rope, _ = run_positions(cfg, base)
        assert (rope.scaling, rope.factor, rope.original_max_len) == (scaling, factor, 256)
        assert lengths.context_len == 256 * factor
    cfg = compose_train([*recipe, "rope=yarn", "rope.factor=2", "init_from=base.ckpt"], tmp_path / "given")
    assert run_positions(cfg, base)[1].factor == 2  # a number on the command line wins


def test_a_fine_tune_resumes_with_its_own_command(tmp_path):
    """The resume of an init_from run is its own command plus ckpt_path=last (what SIGTERM prints): init_from
    still gives the shape and the positions, the resumed checkpoint the weights, and the run ends where an
    uninterrupted one does."""
    corpus = small_corpus(tmp_path / "corpus", n_files=6, chars=4000)
    steps = ["logger=none", "trainer.val_check_interval=2", "compile=false"]
    base_overrides = [*tiny_overrides(tmp_path, corpus), *steps, "trainer.max_steps=2", "model.d_model=32"]
    train(compose_train(base_overrides, tmp_path / "base"))
    base = tmp_path / "base" / "checkpoints" / "last.ckpt"
    fine = [*tiny_overrides(tmp_path, corpus), *steps, f"init_from={base}", "experiment=extend_context",
            "rope=yarn", f"data.max_len={2 * L0}", "data.batch_size=2", "optim.warmup_steps=1"]  # fmt: skip
    train(compose_train([*fine, "trainer.max_steps=2"], tmp_path / "whole"))
    train(compose_train([*fine, "trainer.max_steps=1"], tmp_path / "parts"))
    train(compose_train([*fine, "trainer.max_steps=2", "ckpt_path=last"], tmp_path / "parts"))
    whole, parts = last_weights(tmp_path / "whole"), last_weights(tmp_path / "parts")
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)
    config = load_checkpoint(tmp_path / "parts").config
    assert (config.d_model, config.rope.scaling, config.rope.factor) == (32, "yarn", 2.0)


@pytest.mark.parametrize("recipe", [[], ["experiment=extend_context"], ["experiment=pose", "rope=yarn"]])
def test_init_from_keeps_the_checkpoints_rope_base_and_layout(tmp_path, recipe):
    """A real model's RoPE base (SmolLM2: 100000) is not the rope group's 10000: a fine-tune that names no
    rope.base trains with the checkpoint's base, layout and rotary_dim; one that names them gets its own."""
    base = ModelConfig(
        lengths=TrainedLengths(256, 256),
        rope=RopeConfig(base=100000.0, layout="interleaved", rotary_dim=8, original_max_len=256),
    )
    cfg = compose_train([*recipe, "init_from=base.ckpt"], tmp_path / "kept")
    rope = run_positions(cfg, base)[1]
    assert (rope.base, rope.layout, rope.rotary_dim) == (100000.0, "interleaved", 8)
    cfg = compose_train([*recipe, "init_from=base.ckpt", "rope.base=50000"], tmp_path / "named")
    assert run_positions(cfg, base, {"base"})[1].base == 50000.0
    assert run_positions(cfg, None)[1].base == 50000.0  # from scratch: the group's values, as before


def test_use_positions_leaves_the_checkpoint_config_and_restores_by_construction():
    torch.manual_seed(0)
    config = dataclasses.replace(
        CHECKPOINT, vocab_size=64, d_model=32, n_heads=2, n_kv_heads=2, rope=RopeConfig(original_max_len=32)
    )
    model = Llama(config).eval()
    idx = torch.randint(0, 64, (1, 80))
    with torch.no_grad():
        own = model(idx)
        model.use_positions(
            *resolve_positions(config, {"scaling": "yarn", "factor": 4.0}, {"method": "logn"})
        )
        assert config.rope.scaling == "none" and model.config.rope.scaling == "yarn"
        assert not torch.allclose(model(idx), own)
        model.use_positions(config.rope, config.extend)
        torch.testing.assert_close(model(idx), own, atol=0, rtol=0)


# ----------------------------------------------------------------------------- cells alone


@pytest.fixture(scope="module")
def yarn_run(tmp_path_factory):
    """A tiny model trained with YaRN x4 at L0, long enough that the methods' perplexities differ."""
    tmp = tmp_path_factory.mktemp("yarn")
    corpus = small_corpus(tmp / "corpus", n_files=8, chars=12000)
    run = tmp / "run"
    overrides = ["trainer.max_steps=60", "optim.lr=1e-2", "rope=yarn", "rope.factor=4"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    train(compose_train(tiny_overrides(tmp, corpus) + overrides, run))
    yield run
    torch.set_num_threads(threads)


def test_every_evaluation_cell_equals_the_same_cell_run_alone(yarn_run, tmp_path):
    """The default method list and `ckpt` in one grid: each cell's numbers are those of that method alone
    (the `ckpt` cell used to inherit the previous method's RoPE)."""
    assert load_checkpoint(yarn_run).config.rope.scaling == "yarn"
    lengths = f"lengths=[{L0},{4 * L0}]"
    eval_extrapolation.run(eval_cfg(yarn_run, tmp_path / "grid", lengths))
    grid = rows_by(tmp_path / "grid" / "results.csv")
    methods = list(dict.fromkeys(method for method, _, _ in grid))
    assert methods[-1] == "ckpt" and len(methods) == 10
    for method in methods:
        eval_extrapolation.run(eval_cfg(yarn_run, tmp_path / method, lengths, f"methods=[{method}]"))
        for key, row in rows_by(tmp_path / method / "results.csv").items():
            assert grid[key] == row, (key, grid[key], row)
    # the cells really differ, so the check can fail: `ckpt` at L0 used to be `none`'s to every digit
    assert grid["ckpt", L0, "ppl"]["value"] != grid["none", L0, "ppl"]["value"]
    far = [float(grid[m, 4 * L0, "ppl"]["value"]) for m in methods]
    assert max(far) / min(far) > 1.01


def test_every_retrieval_cell_equals_the_same_cell_run_alone(yarn_run, tmp_path):
    common = ["lengths=[200]", "depths=[0.5]", "trials=2", "tasks=[passkey]", "candidates=4"]
    passkey.run(compose_script("passkey", yarn_run, tmp_path / "grid", *common))
    with open(tmp_path / "grid" / "trials.csv") as f:
        grid = {(r["method"], r["task"], r["length"], r["depth"], r["trial"]): r for r in csv.DictReader(f)}
    methods = list(dict.fromkeys(key[0] for key in grid))
    assert methods[-1] == "ckpt" and len(methods) == 8
    for method in methods:
        passkey.run(compose_script("passkey", yarn_run, tmp_path / method, *common, f"methods=[{method}]"))
        with open(tmp_path / method / "trials.csv") as f:
            for row in csv.DictReader(f):
                key = (row["method"], row["task"], row["length"], row["depth"], row["trial"])
                assert grid[key] == row, (key, grid[key], row)
    margins = {m: [float(r["first_margin"]) for k, r in grid.items() if k[0] == m] for m in methods}
    assert margins["ckpt"] != margins["none"]  # the methods answer differently: the check can fail


def test_lengths_relative_to_the_checkpoints_context(yarn_run, tmp_path):
    """lengths=[1x,2x] evaluates at the checkpoint's context length and twice it."""
    eval_extrapolation.run(eval_cfg(yarn_run, tmp_path, "lengths=[1x,2x]", "methods=[none]"))
    assert {length for _, length, _ in rows_by(tmp_path / "results.csv")} == {L0, 2 * L0}
    with pytest.raises(ValueError, match="or multiples of the context length such as 2x, got"):
        eval_extrapolation.run(eval_cfg(yarn_run, tmp_path / "bad", "lengths=[2y]"))


def test_init_from_takes_the_checkpoints_shape(tmp_path):
    """A fine-tune names no model= of its own: the weights define the shape (a real model's too); a field
    the command line names stays, and must fit."""
    corpus = small_corpus(tmp_path / "corpus", n_files=6, chars=4000)
    steps = ["trainer.max_steps=2", "logger=none", "trainer.val_check_interval=2"]
    narrow = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.norm_eps=1e-6"]
    train(compose_train(tiny_overrides(tmp_path, corpus) + steps + narrow, tmp_path / "base"))
    base = tmp_path / "base" / "checkpoints" / "last.ckpt"
    fine = [*tiny_overrides(tmp_path, corpus), *steps, f"init_from={base}", f"data.max_len={2 * L0}"]
    train(compose_train(fine, tmp_path / "fine"))
    config = load_checkpoint(tmp_path / "fine").config
    assert (config.d_model, config.n_heads, config.n_kv_heads, config.norm_eps) == (32, 2, 1, 1e-6)
    assert config.lengths == TrainedLengths(2 * L0, 2 * L0)
    with pytest.raises(ValueError, match="does not fit this model"):
        train(compose_train([*fine, "model.d_model=64"], tmp_path / "named"))
