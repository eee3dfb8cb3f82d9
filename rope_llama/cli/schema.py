"""Every command's option schema: key -> `Option` (core/schema.py) for each key its composed config can
hold, whichever group options were chosen, and the cross-field rules. `check_command` runs both on the
composed config first thing in each entry point, before anything is loaded, created or written; a
refusal is one sentence naming the key, the value and what is allowed (exit 2 through cli/errors.py).

The dataclass-backed groups (model, rope, extend, optim, positions, data.recall, the study) take their
options from the dataclasses; the YAML-only groups (data, trainer, callbacks, logger, sample) and each
command's own keys are declared here. tests/test_schema.py fails when a composed config holds a key no
schema names, and throws PROBES at every key.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import DictConfig

from rope_llama.core.schema import (
    FLAG,
    FREE,
    TEXT,
    Option,
    OptionError,
    Schema,
    check_config,
    choice,
    dataclass_options,
    either,
    integer,
    items,
    number,
    value_at,
)
from rope_llama.data.datamodule import SAMPLINGS
from rope_llama.data.positions import PositionsConfig
from rope_llama.data.recall import RecallConfig
from rope_llama.interchange.gguf import DTYPES as GGUF_DTYPES
from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import ExtendConfig
from rope_llama.model.rope import RopeConfig
from rope_llama.study.config import StudyConfig
from rope_llama.training.optim import OptimConfig
from rope_llama.training.trainer_checks import ACCELERATORS, PRECISIONS

FIVE_DIGIT_KEYS = 90_000  # passkeys are 10000..99999: more candidates than that cannot be drawn distinct

OPTIONAL_TEXT = Option("text", allow_none=True)
SEED = integer(minimum=0)
THREADS = either(choice("auto"), integer(minimum=1))
DTYPE = choice("auto", "float32", "bfloat16", "float16")
SPLIT = choice("val", "test")  # held-out documents
LENGTHS = items(nonempty=True, unique=True)  # integers >= 2 or "2x": core/checks.py's check_lengths
METHODS = items(TEXT, nonempty=True, unique=True)  # names: inference/evaluation.py's check_method
ROPE, EXTEND = dataclass_options(RopeConfig, "rope"), dataclass_options(ExtendConfig, "extend")
# a number as rope.factor allows it, or per length
FACTOR = either(choice("matched"), dataclasses.replace(ROPE["rope.factor"], allow_none=False, none_means=""))
# the evaluation scripts' extension fields for every method: ExtendConfig's, null = the checkpoint's
EXTEND_OPTIONS = {
    **{
        f"extend_options.{name}": dataclasses.replace(
            EXTEND[f"extend.{name}"], allow_none=True, none_means="the checkpoint's"
        )
        for name in ("window", "shift", "local_window", "chunk", "leak")
    },
    "extend_options.group": either(
        choice("matched"), EXTEND["extend.group"], allow_none=True, none_means="the checkpoint's"
    ),
    "rope_options": FREE,  # extra RoPE fields: RopeConfig checks them when each method is built
}

# ----------------------------------------------------------------------------- groups

DATA_SOURCE = {
    "data.source.kind": choice("shakespeare", "kjv", "hf", "text_files"),
    "data.source.val_plays": items(TEXT),
    "data.source.test_plays": items(TEXT),
    "data.source.val_books": items(TEXT),
    "data.source.test_books": items(TEXT),
    "data.source.path": TEXT,
    "data.source.name": OPTIONAL_TEXT,
    "data.source.data_files": FREE,  # datasets' own: a path, a list or a split mapping
    "data.source.text_column": TEXT,
    "data.source.streaming": FLAG,
    "data.source.max_documents": integer(minimum=1, allow_none=True, none_means="every row"),
    "data.source.holdout_fraction": number(above=0, below=1),
    "data.source.paths": either(TEXT, items(TEXT, nonempty=True)),
    "data.source.separator": OPTIONAL_TEXT,
}
DATA = {
    **DATA_SOURCE,
    "data.max_len": integer(minimum=1),
    "data.batch_size": integer(minimum=1),
    "data.num_workers": integer(minimum=0),
    "data.vocab_size": integer(minimum=1),
    "data.seed": SEED,
    "data.sampling": choice(*SAMPLINGS),
    "data.cache_dir": OPTIONAL_TEXT,
    "data.tokenizer_path": OPTIONAL_TEXT,
    "data.val_max_batches": integer(minimum=1, allow_none=True, none_means="the whole split"),
    "data.val_batch_size": integer(minimum=1, allow_none=True, none_means="batch_size"),
    "data.token_dtype": choice("uint16", "uint32", allow_none=True, none_means="by the vocabulary"),
    "data.shard_tokens": integer(minimum=1),
    "data.tokenizer_sample_chars": integer(minimum=1),
    **dataclass_options(RecallConfig, "data.recall"),
    "data.positions": FREE,  # the positions group itself, interpolated: its keys are checked there
}
TRAINER = {
    "trainer.accelerator": choice(*ACCELERATORS),
    "trainer.devices": either(
        integer(minimum=1), choice("auto", -1), items(integer(minimum=0), nonempty=True)
    ),
    "trainer.num_nodes": integer(minimum=1),
    "trainer.strategy": choice(*StrategyRegistry.available_strategies(), "auto"),
    "trainer.precision": choice(*PRECISIONS),
    "trainer.max_steps": integer(minimum=1),
    "trainer.val_check_interval": either(integer(minimum=1), number(above=0, maximum=1)),
    "trainer.check_val_every_n_epoch": integer(
        minimum=1, allow_none=True, none_means="by val_check_interval"
    ),
    "trainer.limit_val_batches": either(integer(minimum=0), number(minimum=0, maximum=1)),
    "trainer.log_every_n_steps": integer(minimum=1),
    "trainer.gradient_clip_val": number(minimum=0, allow_none=True, none_means="no clipping"),
    "trainer.accumulate_grad_batches": integer(minimum=1),
    "trainer.deterministic": either(FLAG, choice("warn")),
    "trainer.enable_model_summary": FLAG,
    "trainer.num_sanity_val_steps": integer(minimum=-1, means="-1 = every batch"),
    "trainer.use_distributed_sampler": FLAG,
}
# What training logs: the metrics a checkpoint callback may monitor (training/module.py).
LOGGED_METRICS = ("val/loss", "val/ppl", "val/bpc", "train/loss", "val/recall_digits", "val/recall_exact")
CALLBACKS = {
    "callbacks.save_last.ckpt_dir": TEXT,
    "callbacks.progress_bar.refresh_rate": integer(minimum=0, means="0 = off"),
    "callbacks.lr_monitor.logging_interval": choice("step", "epoch", allow_none=True),
    "callbacks.checkpoint.dirpath": TEXT,
    "callbacks.checkpoint.every_n_train_steps": integer(minimum=1),
    "callbacks.checkpoint.keep_all": FLAG,
    "callbacks.best.dirpath": TEXT,
    "callbacks.best.filename": TEXT,
    "callbacks.best.monitor": choice(*LOGGED_METRICS),
    "callbacks.best.mode": choice("min", "max"),
    "callbacks.best.save_top_k": integer(minimum=-1, means="-1 = every checkpoint"),
    "callbacks.best.enable_version_counter": FLAG,
    "callbacks.recall_probe.windows": integer(minimum=1),
    "callbacks.recall_probe.warn_after": number(minimum=0, maximum=1),
    "callbacks.recall_probe.warn_below": number(minimum=0, maximum=1),
    "callbacks.ema.decay": number(above=0, below=1),
    "callbacks.ema.update_starting_at_step": integer(minimum=0, allow_none=True, none_means="from the first"),
    "callbacks.ema.use_buffers": FLAG,
}
LOGGER = {
    "logger": FREE,  # the group itself: a logger's keys below, or [] (logger=none)
    "logger.save_dir": TEXT,
    "logger.project": TEXT,
    "logger.entity": OPTIONAL_TEXT,
    "logger.name": OPTIONAL_TEXT,
    "logger.mode": choice("auto", "online", "offline"),
    "logger.tags": items(TEXT),
}
SAMPLE = {
    "sample.run_dir": TEXT,
    "sample.prompt": TEXT,
    "sample.max_new_tokens": integer(minimum=0, means="0 = no sample"),
    "sample.temperature": number(minimum=0, maximum=100, means="0 = greedy"),
    "sample.top_k": integer(minimum=0, means="0 = no limit"),
}

TRAIN: Schema = {
    **dataclass_options(ModelConfig, "model", skip=("rope", "extend", "lengths")),
    **ROPE,
    **EXTEND,
    **DATA,
    **dataclass_options(PositionsConfig, "positions"),
    **TRAINER,
    **CALLBACKS,
    **LOGGER,
    **dataclass_options(OptimConfig, "optim"),
    **SAMPLE,
    "seed": SEED,
    "run_name": Option("text", max_chars=200),  # a directory name (most file systems allow 255 bytes)
    "ckpt_path": OPTIONAL_TEXT,
    "init_from": OPTIONAL_TEXT,
    "overwrite": FLAG,
    "compile": either(FLAG, choice("auto")),
    "kernels": FLAG,
    "checkpoint_blocks": FLAG,
}
INFERENCE = {"device": TEXT, "dtype": DTYPE, "threads": THREADS, "seed": SEED}
GENERATE: Schema = {
    **ROPE,
    **EXTEND,
    **INFERENCE,
    "ckpt": TEXT,
    "mode": choice("sample", "score"),
    "start_pos": integer(minimum=0),
    "cache_len": integer(minimum=1, allow_none=True, none_means="prompt + max_new_tokens"),
    "prompt": OPTIONAL_TEXT,
    "prompt_file": OPTIONAL_TEXT,
    "num_samples": integer(minimum=1),
    "max_new_tokens": integer(minimum=1),
    "temperature": number(minimum=0, maximum=100, means="0 = greedy"),
    "top_k": integer(minimum=0, means="0 = no limit"),
    "top_p": number(above=0, maximum=1),
    "greedy": FLAG,
    "compile": FLAG,
    "native": FLAG,
    "stop": either(TEXT, items(Option("text", nonempty=True))),
    "chat": FLAG,
    "system": OPTIONAL_TEXT,
    "stream": FLAG,
    "text_file": OPTIONAL_TEXT,
    "chunk": integer(minimum=1),
}
EVALUATION = {**INFERENCE, **EXTEND_OPTIONS, "ckpt": TEXT, "out": TEXT, "overwrite": FLAG, "lengths": LENGTHS, "methods": METHODS,
              "factor": FACTOR, "batch_tokens": integer(minimum=1), "reuse": FLAG,
              "focus_lengths": items(unique=True), "focus_count": integer(minimum=1)}  # fmt: skip
EVAL: Schema = {
    **EVALUATION,
    **DATA,
    "split": SPLIT,
    "max_windows": integer(minimum=1),
    "sliding_stride": integer(minimum=1, allow_none=True, none_means="skip"),
    "chunk": integer(minimum=1),
    "bootstrap": choice("window", "document"),
    "n_boot": integer(minimum=1),
    "curve_buckets": integer(minimum=1),
}
PASSKEY: Schema = {
    **EVALUATION,
    "tasks": items(TEXT, nonempty=True, unique=True),
    "task_options.heldout.facts": integer(minimum=1),
    "task_options.multikey.keys": integer(minimum=1),
    "task_options.multiquery.keys": integer(minimum=1),
    "task_options.multiquery.queries": integer(minimum=1),
    "task_options.multivalue.values": integer(minimum=1),
    "task_options.vartrack.chains": integer(minimum=1),
    "task_options.vartrack.hops": integer(minimum=1),
    "depths": items(number(minimum=0, maximum=1), nonempty=True, unique=True),
    "focus_depths": items(
        number(minimum=0, maximum=1), nonempty=True, unique=True, allow_none=True, none_means="depths"
    ),
    "trials": integer(minimum=1),
    "candidates": integer(minimum=2, maximum=FIVE_DIGIT_KEYS, means="the five-digit keys there are"),
    "max_new_tokens": integer(minimum=1),
    "chat": FLAG,
}
VISUALIZE: Schema = {
    **INFERENCE,
    **EXTEND_OPTIONS,
    **DATA,
    "view": choice("rope", "attention"),
    "out": TEXT,
    "overwrite": FLAG,
    "ckpt": OPTIONAL_TEXT,
    "wandb": FLAG,
    "head_dim": integer(minimum=2),
    "base": number(above=1),
    "training_len": integer(minimum=2),
    "factor": number(minimum=1),
    "bases": items(number(above=1), nonempty=True),
    "window": integer(minimum=1),
    "group": integer(minimum=1),
    "methods": METHODS,
    "lengths": items(
        nonempty=True, unique=True, allow_none=True, none_means="the checkpoint's context and 4x"
    ),
    "start_pos": integer(minimum=0),
    "text_file": OPTIONAL_TEXT,
    "split": SPLIT,
    "needle": FLAG,
    "layers": items(integer(minimum=0), nonempty=True, allow_none=True, none_means="every layer"),
    "heatmap_layers": items(integer(minimum=0), nonempty=True, allow_none=True, none_means="first and last"),
    "queries": integer(minimum=1, allow_none=True, none_means="every position"),
    "grid": integer(minimum=2),
    "buckets": integer(minimum=1),
    "factor_mode": FACTOR,
}
EXPORT = {"ckpt": TEXT, "out": TEXT, "overwrite": FLAG}
SCHEMAS: dict[str, Schema] = {
    "train": TRAIN,
    "generate": GENERATE,
    "eval": EVAL,
    "passkey": PASSKEY,
    "visualize": VISUALIZE,
    "prepare_data": {**DATA, "workers": integer(minimum=1), "verify": FLAG},
    "export_hf": EXPORT,
    "export_gguf": {**EXPORT, "dtype": choice(*GGUF_DTYPES)},
    "import_hf": {"hf_dir": TEXT, "out": TEXT, "overwrite": FLAG},
    "import_gguf": {"gguf": TEXT, "out": TEXT, "overwrite": FLAG},
    "study": dataclass_options(StudyConfig, ""),
}

# ----------------------------------------------------------------------------- cross-field rules


def present(cfg: DictConfig, key: str):
    return value_at(cfg, key)[1]


def in_a_sweep() -> bool:
    """Whether this process is one run of a Hydra multirun (`-m rope=none,linear rope.factor=2`), where one
    factor is shared by every setting of the sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().get("mode") == RunMode.MULTIRUN


def unused_factor(cfg: DictConfig) -> None:
    """A factor with no scaling would do nothing: the user meant a scaling."""
    factor = present(cfg, "rope.factor")
    if present(cfg, "rope.scaling") == "none" and factor not in (None, 1, 1.0) and not in_a_sweep():
        raise OptionError(
            f"rope.factor={factor} does nothing with rope.scaling=none; choose a scaling (e.g. rope=yarn) "
            "or leave factor at 1."
        )


def warmup_within_schedule(cfg: DictConfig) -> None:
    """A warmup longer than the schedule never reaches the configured learning rate (a short smoke run
    sets optim.warmup_steps=0 or a few steps)."""
    steps = present(cfg, "optim.schedule_steps") or present(cfg, "trainer.max_steps")
    warmup = present(cfg, "optim.warmup_steps")
    if warmup and steps and warmup > steps:
        raise OptionError(
            f"optim.warmup_steps={warmup} must be at most the schedule's {steps} steps (optim.schedule_steps, "
            "else trainer.max_steps): the learning rate would never reach optim.lr; lower optim.warmup_steps."
        )


CLUSTER_ENVIRONMENT = ("SLURM_NTASKS", "WORLD_SIZE", "MASTER_ADDR", "LSB_JOBID", "OMPI_COMM_WORLD_SIZE")


def nodes_need_a_cluster(cfg: DictConfig, env: Mapping[str, str] | None = None) -> None:
    """Several nodes with no launcher environment would wait forever for nodes that never join."""
    env = os.environ if env is None else env
    nodes = present(cfg, "trainer.num_nodes")
    if nodes and nodes > 1 and not any(k in env for k in CLUSTER_ENVIRONMENT):
        raise OptionError(
            f"trainer.num_nodes={nodes} needs a cluster launcher (SLURM, torchrun: one of "
            f"{', '.join(CLUSTER_ENVIRONMENT)} set), and none is; on one machine use trainer.num_nodes=1."
        )


def cache_dir_reachable(cfg: DictConfig) -> None:
    """A remote cache directory needs its fsspec file system installed."""
    cache = present(cfg, "data.cache_dir")
    if isinstance(cache, str) and "://" in cache:
        import fsspec

        protocol = cache.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as e:
            raise OptionError(
                f"data.cache_dir={cache} needs the fsspec file system for {protocol!r}: {e}"
            ) from None


def lengths_in_order(cfg: DictConfig) -> None:
    """Lengths are a set of cells: one given twice would be scored twice."""
    lengths = present(cfg, "lengths")
    if lengths is not None and len({str(t) for t in lengths}) < len(lengths):
        raise OptionError(f"lengths {list(lengths)} names a length twice; give each once.")


Rule = Callable[[DictConfig], None]
RULES: dict[str, tuple[Rule, ...]] = {
    "train": (unused_factor, warmup_within_schedule, nodes_need_a_cluster, cache_dir_reachable),
    "generate": (unused_factor,),
    "eval": (lengths_in_order, cache_dir_reachable),
    "passkey": (lengths_in_order,),
    "visualize": (lengths_in_order,),
    "prepare_data": (cache_dir_reachable,),
}


def check_command(command: str, cfg: DictConfig, error: type[ValueError] = OptionError) -> None:
    """Every option of `command`'s composed config, then its cross-field rules: one sentence, as `error`."""
    check_config(cfg, SCHEMAS[command], error)
    for rule in RULES.get(command, ()):
        try:
            rule(cfg)
        except OptionError as e:
            raise error(str(e)) from None
