"""The option schemas (rope_llama/cli/schema.py) against every composed config and every probe.

Generated from the schemas and the config tree themselves: every key of every command's composed config
(with each option of each of its groups) must have an option, so a new key is covered the day it is
added; every key gets every probe of core/schema.py's PROBES (0, -1, nan, inf, 1e30, a string, a
fraction, `maybe`, true): a probe its option refuses must be refused by the command's check in one
sentence naming the key and the value; a probe it allows must pass the check or be refused by a
cross-field rule, and for train it must then build every object the run builds before its data (model,
positions, optimizer, text sample, callbacks): never a traceback."""

from __future__ import annotations

import copy
import math

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from rope_llama import CONFIGS
from rope_llama.cli import schema as cli_schema
from rope_llama.cli.instantiate import build
from rope_llama.cli.schema import SCHEMAS, check_command, nodes_need_a_cluster
from rope_llama.cli.train import build_callbacks, run_positions
from rope_llama.core.schema import (
    PROBES,
    Option,
    OptionError,
    annotation_option,
    dataclass_options,
    probe_values,
    shown,
    unlisted_keys,
)
from rope_llama.data.recall import RecallConfig
from rope_llama.study.config import StudyConfig
from rope_llama.training.trainer_checks import check_trainer

# command -> (its config file, the groups whose every option it composes)
COMMANDS = {
    "train": (
        "train",
        (
            "model",
            "rope",
            "extend",
            "data",
            "positions",
            "trainer",
            "callbacks",
            "logger",
            "optim",
            "experiment",
        ),
    ),  # fmt: skip
    "generate": ("generate", ("rope", "extend")),
    "eval": ("eval", ("data",)),
    "passkey": ("passkey", ()),
    "visualize": ("visualize", ("data",)),
    "prepare_data": ("prepare_data", ("data",)),
    "export_hf": ("export_hf", ()),
    "export_gguf": ("export_gguf", ()),
    "import_hf": ("import_hf", ()),
    "import_gguf": ("import_gguf", ()),
}
HYDRA_RUNTIME = {"hydra": {"runtime": {"output_dir": "/tmp/run"}}}  # what ${hydra:...} reads in a run


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def variants(command: str) -> list[tuple[str, ...]]:
    """The override lists to compose: the defaults, then each option of each group alone."""
    _, groups = COMMANDS[command]
    return [(), *((f"{g}={o}",) for g in groups for o in group_options(g))]


def composed(command: str, overrides: tuple[str, ...]):
    with initialize_config_dir(str(CONFIGS), version_base=None):
        cfg = compose(COMMANDS[command][0], overrides=list(overrides))
    with open_dict(cfg):
        cfg.hydra = OmegaConf.create({"run": {"dir": "/tmp/run"}, **HYDRA_RUNTIME["hydra"]})
    return cfg


CONFIGS_BY_COMMAND = {c: {v: composed(c, v) for v in variants(c)} for c in COMMANDS}
STUDY = OmegaConf.structured(StudyConfig)


@pytest.fixture(autouse=True)
def hydra_runtime(monkeypatch):
    """${hydra:runtime.output_dir} resolves as in a run (the train config's paths read it)."""
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: OmegaConf.create(HYDRA_RUNTIME["hydra"])))


CASES = [pytest.param(c, v, id=f"{c}[{' '.join(v) or 'defaults'}]") for c in COMMANDS for v in variants(c)]


@pytest.mark.parametrize(("command", "overrides"), CASES)
def test_every_key_of_every_composed_config_has_an_option(command, overrides):
    assert unlisted_keys(CONFIGS_BY_COMMAND[command][overrides], SCHEMAS[command]) == []


def test_every_key_of_the_study_has_an_option():
    assert unlisted_keys(STUDY, SCHEMAS["study"]) == []


@pytest.mark.parametrize(("command", "overrides"), CASES)
def test_the_shipped_configs_pass_their_schema(command, overrides):
    check_command(command, CONFIGS_BY_COMMAND[command][overrides])


def a_config_with(command: str, key: str):
    """A composed config of `command` that holds `key` (the defaults, else the first group option that does)."""
    for cfg in CONFIGS_BY_COMMAND[command].values():
        if OmegaConf.select(cfg, key, default="absent", throw_on_resolution_failure=False) != "absent":
            return copy.deepcopy(cfg)
    return None


def train_objects(cfg) -> None:
    """What train.py builds from its options before any data or write (cli/train.py's setup_run)."""
    check_trainer(cfg.trainer)
    build(cfg.optim)
    build(cfg.sample, tokenizer=None)
    build(cfg.model)
    run_positions(cfg, None)
    RecallConfig.from_options(OmegaConf.to_container(cfg.data.recall))
    build_callbacks(cfg.callbacks)


def key_cases():
    for command in COMMANDS:
        for key, option in SCHEMAS[command].items():
            if option.kind != "free" and not (key in cli_schema.DATA_SOURCE and command != "train"):
                yield pytest.param(command, key, id=f"{command}:{key}")  # sources: probed through train


@pytest.mark.parametrize(("command", "key"), list(key_cases()))
def test_every_probe_of_every_key(command, key):
    cfg = a_config_with(command, key) or copy.deepcopy(CONFIGS_BY_COMMAND[command][()])
    option = SCHEMAS[command][key]
    for probe, value in PROBES.items():
        OmegaConf.update(cfg, key, value, force_add=True)
        if not option.accepts(value):
            with pytest.raises(OptionError) as refused:
                check_command(command, cfg)
            message = str(refused.value)
            assert key in message and shown(value) in message and "\n" not in message, (probe, message)
            continue
        try:
            check_command(command, cfg)
            if command == "train":
                train_objects(cfg)
        except ValueError as e:  # a cross-field rule or a constructor's own check: still one sentence
            assert "\n" not in str(e), (probe, str(e))


def test_probes_are_refused_where_they_must_be():
    """The schema's answers for the probes the issue lists (tests above hold the command to them)."""
    train = SCHEMAS["train"]
    for key, probe in [("model.n_layers", "nan"), ("model.n_layers", "inf"), ("model.n_layers", "huge"),
                       ("model.init_std", "minus one"), ("rope.beta_slow", "zero"), ("rope.low_freq_factor", "zero"),
                       ("rope.original_max_len", "inf"), ("data.seed", "nan"), ("data.val_max_batches", "a string"),
                       ("optim.lr", "huge"), ("optim.weight_decay", "huge"), ("callbacks.best.save_top_k", "nan"),
                       ("callbacks.best.monitor", "a string"), ("model.norm_eps", "inf"), ("model.init_std", "huge"),
                       ("rope.base", "inf"), ("rope.factor", "inf"), ("rope.low_freq_factor", "minus one"),
                       ("rope.high_freq_factor", "nan"), ("rope.max_position", "nan"),
                       ("trainer.limit_val_batches", "huge"), ("callbacks.checkpoint.every_n_train_steps", "nan"),
                       ("callbacks.best.save_top_k", "inf"), ("callbacks.progress_bar.refresh_rate", "minus one"),
                       ("callbacks.ema.decay", "zero"), ("callbacks.ema.decay", "nan"),
                       ("callbacks.ema.update_starting_at_step", "minus one"), ("model.tie_embeddings", "maybe"),
                       ("trainer.deterministic", "maybe"), ("overwrite", "maybe")]:  # fmt: skip
        assert probe in probe_values(train[key]), (key, probe)
    generate = SCHEMAS["generate"]
    for key, probe in [("top_k", "inf"), ("seed", "a string"), ("seed", "a fraction"), ("temperature", "huge"),
                       ("top_k", "a fraction"), ("greedy", "maybe"), ("stream", "maybe"), ("native", "maybe"),
                       ("rope.factor", "inf")]:  # fmt: skip
        assert probe in probe_values(generate[key]), (key, probe)
    assert "huge" in probe_values(SCHEMAS["eval"]["factor"]) and "true" in probe_values(
        SCHEMAS["eval"]["factor"]
    )
    assert "maybe" in probe_values(SCHEMAS["prepare_data"]["verify"])
    assert "maybe" in probe_values(SCHEMAS["export_hf"]["overwrite"])


def test_overwrite_no_is_not_yes():
    cfg = copy.deepcopy(CONFIGS_BY_COMMAND["export_hf"][()])
    cfg.overwrite = "no"
    with pytest.raises(OptionError, match=r"overwrite must be true or false, got 'no'\."):
        check_command("export_hf", cfg)


@pytest.mark.parametrize(
    ("command", "key", "value", "message"),
    [
        ("passkey", "tasks", [], "tasks must be a non-empty"),
        ("passkey", "depths", [], "depths must be a non-empty"),
        ("passkey", "candidates", 100000, "candidates must be an integer in [2, 90000]"),
        ("eval", "lengths", [64, 64, 128], "lengths must be a non-empty duplicate-free list"),
        ("train", "run_name", "x" * 300, "run_name must be a string of at most 200 characters"),
        ("train", "trainer.strategy", "bogus", "trainer.strategy must be one of"),
        ("train", "trainer.limit_val_batches", 1.5, "trainer.limit_val_batches must be an integer >= 0 or"),
    ],
)
def test_the_issues_cases_are_one_sentence(command, key, value, message):
    cfg = copy.deepcopy(CONFIGS_BY_COMMAND[command][()])
    OmegaConf.update(cfg, key, value, force_add=True)
    with pytest.raises(OptionError) as refused:
        check_command(command, cfg)
    assert str(refused.value).startswith(message), str(refused.value)


def with_values(command: str, **values):
    cfg = copy.deepcopy(CONFIGS_BY_COMMAND[command][()])
    for key, value in values.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


def test_a_factor_without_a_scaling_is_refused():
    with pytest.raises(OptionError, match=r"rope.factor=4 does nothing with rope.scaling=none"):
        check_command("train", with_values("train", rope__factor=4))
    check_command("train", with_values("train", rope__factor=1))
    check_command("train", with_values("train", rope__scaling="linear", rope__factor=4))


def test_a_warmup_longer_than_the_schedule_is_refused():
    with pytest.raises(OptionError, match=r"optim.warmup_steps=51 must be at most the schedule's 50 steps"):
        check_command("train", with_values("train", trainer__max_steps=50, optim__warmup_steps=51))
    check_command("train", with_values("train", trainer__max_steps=50, optim__warmup_steps=50))
    longer = with_values("train", trainer__max_steps=50, optim__warmup_steps=51, optim__schedule_steps=100)
    check_command("train", longer)


def test_several_nodes_need_a_cluster_launcher():
    cfg = with_values("train", trainer__num_nodes=2)
    with pytest.raises(OptionError, match=r"trainer.num_nodes=2 needs a cluster launcher"):
        nodes_need_a_cluster(cfg, env={})
    nodes_need_a_cluster(cfg, env={"SLURM_NTASKS": "4"})
    nodes_need_a_cluster(with_values("train", trainer__num_nodes=1), env={})


def test_a_remote_cache_without_its_file_system_is_one_sentence(monkeypatch):
    import fsspec

    def missing(protocol):
        raise ImportError(f"Install s3fs to access {protocol}")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(
        OptionError, match=r"data.cache_dir=s3://bucket/x needs the fsspec file system for 's3'"
    ):
        check_command("train", with_values("train", data__cache_dir="s3://bucket/x"))


def test_options_come_from_the_dataclass_annotations_and_metadata():
    from dataclasses import dataclass, field

    @dataclass
    class Example:
        count: int = field(default=1, metadata={"minimum": 1})
        share: float | None = field(default=None, metadata={"minimum": 0, "maximum": 1})
        on: bool = True
        name: str = "x"
        pair: tuple[float, float] = (0.1, 0.2)

    options = dataclass_options(Example, "ex")
    assert options["ex.count"] == Option("number", integer=True, minimum=1)
    assert options["ex.share"] == Option("number", minimum=0, maximum=1, allow_none=True)
    assert options["ex.on"].kind == "flag" and options["ex.name"].kind == "text"
    assert options["ex.pair"].item == Option("number") and options["ex.pair"].kind == "list"
    assert annotation_option(int | None, {}).allow_none


@pytest.mark.parametrize(
    ("option", "refused", "allowed"),
    [
        (
            Option("number", integer=True, minimum=1),
            [0, -1, math.nan, math.inf, 1e30, "bogus", 1.5, True],
            [1, 10**40],
        ),
        (Option("number", above=0, below=1), [0, 1, math.nan, math.inf, -1, "x", True], [0.5, 1e-9]),
        (Option("flag"), ["maybe", "no", 0, 1, None], [True, False]),
        (Option("choice", choices=("a", 1)), ["b", True, 2], ["a", 1]),
        (Option("text", max_chars=3), [1, None, "abcd"], ["abc", ""]),
        (
            Option("list", item=Option("number"), nonempty=True, unique=True),
            [[], [1, 1], [math.nan], "x"],
            [[1, 2]],
        ),
    ],
)
def test_each_kind_refuses_and_allows(option, refused, allowed):
    for value in refused:
        assert not option.accepts(value), value
        with pytest.raises(OptionError, match=r"^k must be .*, got "):
            option.check("k", value)
    for value in allowed:
        option.check("k", value)
