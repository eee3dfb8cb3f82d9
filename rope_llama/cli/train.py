"""Train a LLaMA-style model: compose the Hydra config -> DataModule + LitLlama + Trainer -> fit.
From the checkout `python train.py`; installed, the console script `rope-train` (same options).

python train.py                                   # small model, embedded Shakespeare, CPU
python train.py rope=ntk rope.factor=4 data.max_len=512 model=tiny trainer.max_steps=50
python train.py -m rope=none,linear,ntk           # a sweep, one run directory per setting
python train.py run_name=myrun ckpt_path=last     # resume runs/myrun exactly
python train.py experiment=extend_context init_from=runs/<run>/checkpoints/last.ckpt
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, ListConfig, OmegaConf

from rope_llama import CONFIGS, checkout
from rope_llama.cli.errors import USER_ERRORS, one_sentence_errors
from rope_llama.cli.instantiate import build
from rope_llama.cli.schema import check_command
from rope_llama.core.checkpoint import (
    CheckpointError,
    check_finite_weights,
    check_weights_fit,
    differing_settings,
    load_weights,
    model_state_from_checkpoint,
    read_entries,
    safe_load,
)
from rope_llama.core.precision import resolve_precision
from rope_llama.data.positions import PositionsConfig
from rope_llama.model.config import ModelConfig, TrainedLengths
from rope_llama.model.context import resolve_positions
from rope_llama.model.extend import ExtendConfig
from rope_llama.model.rope import RopeConfig
from rope_llama.training.callbacks import AtomicCheckpointIO, NewRunDirectories
from rope_llama.training.compile import resolve_compile
from rope_llama.training.loggers import finish_wandb
from rope_llama.training.module import LitLlama, NonFiniteLossError
from rope_llama.training.optim import resolve_muon_dtype
from rope_llama.training.run_dir import RunLock, check_run_name, is_first_process, write_hydra_config
from rope_llama.training.trainer_checks import check_trainer

VOCAB_MULTIPLE = 64  # pad the embedding table: matmuls on multiples of 64 are faster everywhere


def checkpoint_names(ckpt_dir: Path) -> list[str]:
    """The .ckpt files in a run's checkpoints/ directory, sorted ([] when it does not exist)."""
    return sorted(p.name for p in ckpt_dir.glob("*.ckpt"))


def refuse_to_overwrite(run_dir: Path, ckpt_path: str | None) -> None:
    """A run must not replace another run's checkpoints: a new run (e.g. a resume that forgot
    ckpt_path=last), or a resume of another run's checkpoint, into a directory that holds some."""
    existing = checkpoint_names(run_dir / "checkpoints")
    if not existing:
        return
    if ckpt_path is None:
        raise CheckpointError(
            f"{run_dir} already holds checkpoints ({', '.join(existing)}); resume that run with ckpt_path=last, "
            "choose another run_name, or pass overwrite=true to train a new run over it."
        )
    if Path(ckpt_path).resolve().parent != (run_dir / "checkpoints").resolve():
        raise CheckpointError(
            f"ckpt_path {ckpt_path} is another run's checkpoint, and resuming it into {run_dir} would replace "
            f"that directory's own checkpoints ({', '.join(existing)}); choose a new run_name, or pass "
            "overwrite=true."
        )


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    if ckpt_path in (None, ""):
        return None
    if ckpt_path == "last":
        last = run_dir / "checkpoints" / "last.ckpt"
        if not last.is_file():
            raise CheckpointError(
                f"ckpt_path=last but {last} does not exist; pass run_name=<the run to resume> or a .ckpt path."
            )
        return str(last)
    if Path(ckpt_path).is_dir():
        raise CheckpointError(
            f"ckpt_path {ckpt_path} is a directory; pass a .ckpt file (e.g. {Path(ckpt_path) / 'checkpoints' / 'last.ckpt'}) or `last`."
        )
    if not Path(ckpt_path).is_file():
        raise CheckpointError(f"ckpt_path {ckpt_path} does not exist.")
    return ckpt_path


def resume_weights(ckpt_path: str) -> tuple[dict, dict | None]:
    """The weights and saved model_config of the checkpoint to resume, read safely (tensors mapped, not
    read) so that a crafted, foreign or weights-only file is refused before anything is written into the
    run directory."""
    ckpt = safe_load(ckpt_path, mmap=True)
    if "optimizer_states" not in ckpt or "pytorch-lightning_version" not in ckpt:
        raise CheckpointError(
            f"ckpt_path {ckpt_path} holds no training state to resume (optimizer, schedule, step); "
            f"pass init_from={ckpt_path} to start a new run from its weights."
        )
    return model_state_from_checkpoint(ckpt), ckpt.get("model_config")


# What a resumed run must keep: its optimizer state, weights and positions were made with these.
RESUMED_GROUPS = ("model", "rope", "extend", "positions", "optim")
CHOOSERS = (".name", ".scaling", ".method", ".kind")  # named first: the change that explains the others


def flat(node, prefix: str) -> dict[str, object]:
    """A config node as dotted key -> value (lists as tuples), for comparing two runs' settings."""
    if isinstance(node, dict):
        return {
            k: v
            for key, sub in node.items()
            if not str(key).startswith("_")
            for k, v in flat(sub, f"{prefix}.{key}").items()
        }
    return {prefix: tuple(node) if isinstance(node, list) else node}


def resumed_settings(cfg: DictConfig, ckpt_path: str) -> None:
    """One sentence when a resume changes what the checkpoint's run trained with (its .hydra/config.yaml):
    another optimizer cannot load its state, another model or RoPE would continue different weights."""
    saved_path = Path(ckpt_path).resolve().parent.parent / ".hydra" / "config.yaml"
    if not saved_path.is_file():
        return  # a checkpoint outside a run directory: its weights are still checked against the model
    saved = OmegaConf.to_container(OmegaConf.load(saved_path), resolve=False)
    here = OmegaConf.to_container(cfg, resolve=False)
    changed = []
    for group in RESUMED_GROUPS:
        before, now = flat(saved.get(group, {}), group), flat(here.get(group, {}), group)
        changed += [
            f"{k}={before.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(before) | set(now), key=lambda k: (not k.endswith(CHOOSERS), k))
            if before.get(k) != now.get(k)
        ]
    if changed:
        raise CheckpointError(
            f"ckpt_path {ckpt_path} resumes a run trained with other settings ({', '.join(changed[:3])}"
            f"{f' and {len(changed) - 3} more' if len(changed) > 3 else ''}); resume with the run's own "
            "settings, or pass init_from= to start a new run from its weights."
        )


def group_values(node: DictConfig) -> dict:
    """A config group's values (the `rope` or `extend` group) as a plain dict for `resolve_positions`."""
    return OmegaConf.to_container(node, resolve=True)


# The RoPE fields the weights were trained with: an init_from run keeps the checkpoint's (a real model's
# base is rarely the rope group's 10000) unless the command line names them (rope.base=...).
WEIGHT_ROPE_FIELDS = ("base", "layout", "rotary_dim")


def run_positions(
    cfg: DictConfig, base: ModelConfig | None, named: set[str] = frozenset()
) -> tuple[TrainedLengths, RopeConfig, ExtendConfig]:
    """This run's trained lengths and the RoPE and extension it trains with (model/context.py): relative to
    its own windows from scratch, continuing the positions of `base` (the init_from checkpoint's config),
    whose base, layout and rotary_dim stay unless `named` (the rope fields the command line sets) has them."""
    positions = PositionsConfig.from_options(OmegaConf.to_container(cfg.data.positions, resolve=True))
    positions.check(cfg.data.max_len)
    lengths = TrainedLengths(cfg.data.max_len, positions.context_len(cfg.data.max_len))
    rope_values = group_values(cfg.rope)
    if base is not None:
        rope_values |= {f: getattr(base.rope, f) for f in WEIGHT_ROPE_FIELDS if f not in named}
    rope, extend = resolve_positions(base, rope_values, group_values(cfg.extend), training=lengths)
    return lengths, rope, extend


# The ModelConfig fields that shape the weights (or what they compute): an init_from run takes the checkpoint's.
WEIGHT_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "norm_eps", "tie_embeddings",
                 "mix_previous_tokens")  # fmt: skip


def fields_named(task_overrides: list[str], group: str = "model") -> set[str]:
    """The fields of `group` the command line sets itself (model.d_model=..., +model.x=..., rope.base=...)."""
    keys = (o.lstrip("+~").split("=", 1)[0] for o in task_overrides)
    return {k.removeprefix(f"{group}.") for k in keys if k.startswith(f"{group}.")}


def shape_of(init: ModelConfig, run: ModelConfig, named: set[str]) -> ModelConfig:
    """The run's model config with the init_from checkpoint's weight-defining fields, except those the
    command line names: those stay, and must fit the weights (load_weights says which do not)."""
    return replace(run, **{f: getattr(init, f) for f in WEIGHT_FIELDS if f not in named})


def describe_positions(lengths: TrainedLengths, rope: RopeConfig, extend: ExtendConfig) -> str:
    """One line: the lengths the checkpoint will record and what the RoPE is relative to."""
    scaled = "" if rope.scaling == "none" else f" x{rope.factor:g} relative to {rope.original_max_len}"
    ext = "" if extend.method == "none" else f", extend {extend.method}"
    return (
        f"Positions: windows of {lengths.trained_len}, context {lengths.context_len}; "
        f"rope {rope.scaling}{scaled} (base {rope.base:g}){ext}"
    )


def check_switches(cfg: DictConfig) -> None:
    """The run-level booleans, which OmegaConf leaves untyped in train.yaml."""
    for key in ("kernels", "overwrite", "checkpoint_blocks"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"{key} must be true or false, got {cfg[key]!r}.")


def data_parallel_processes(trainer_cfg: DictConfig) -> int | None:
    """How many processes `trainer_cfg` trains in (devices x num_nodes); None when Lightning decides
    (devices=auto or -1)."""
    devices = trainer_cfg.devices
    if isinstance(devices, int) and devices > 0:
        return devices * trainer_cfg.num_nodes
    if isinstance(devices, (list, ListConfig)):
        return len(devices) * trainer_cfg.num_nodes
    return None


def copy_tokenizer(path: str, run_dir: Path) -> None:
    """The run's tokenizer.json into its directory, with the tokenizer_config.json beside it when there is
    one (an imported model's bos setting, end of turn and chat template), so a run that moves keeps both."""
    shutil.copyfile(path, run_dir / "tokenizer.json")
    config = Path(path).parent / "tokenizer_config.json"
    if config.is_file():
        shutil.copyfile(config, run_dir / "tokenizer_config.json")


def build_trainer(trainer_cfg: DictConfig, **kwargs) -> L.Trainer:
    """The Lightning Trainer of `trainer_cfg`, with precision=auto resolved for this machine (and said)."""
    precision, why = resolve_precision(trainer_cfg.precision, trainer_cfg.accelerator)
    print(f"Precision: {precision} ({why})")
    return build(trainer_cfg, precision=precision, **kwargs)


def build_callbacks(callbacks_cfg: DictConfig) -> list[L.Callback]:
    """One callback per entry of the `callbacks` group, in order (an entry set to null is left out)."""
    return [build(node) for node in callbacks_cfg.values() if node is not None]


def setup_run(cfg: DictConfig):
    """Everything before fit; every bad setting fails here with one sentence, before anything is written
    into the run directory."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)  # stderr is for errors only
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    check_trainer(cfg.trainer)
    check_switches(cfg)
    trainer_cfg = cfg.trainer  # compile=auto follows the precision, device and length of the run
    compile_blocks, why = resolve_compile(
        cfg.compile, trainer_cfg.precision, trainer_cfg.accelerator, trainer_cfg.max_steps
    )
    if cfg.checkpoint_blocks and compile_blocks:  # recomputation is eager: compile=auto yields to it
        if cfg.compile is True:
            raise ValueError(
                "checkpoint_blocks=true recomputes the blocks eagerly; pass compile=false (or auto)."
            )
        compile_blocks, why = False, "checkpoint_blocks=true recomputes the blocks eagerly"
    optim = build(cfg.optim)
    sample = build(cfg.sample, tokenizer=None)  # its options fail now, not at the first validation
    model_config = build(cfg.model)  # shape errors before any data work; vocab_size comes below
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, run_dir)
    if not cfg.overwrite:
        refuse_to_overwrite(run_dir, ckpt_path)
    if ckpt_path:
        resumed_settings(cfg, ckpt_path)
    resume_state, resume_config = resume_weights(ckpt_path) if ckpt_path else (None, None)
    # With ckpt_path too (the resume of a run started from init_from: its own command plus ckpt_path=last),
    # init_from gives only what it gave at the start, the shape and the positions continued; the weights,
    # optimizer and step are the resumed run's.
    init_ckpt = safe_load(cfg.init_from, mmap=ckpt_path is not None) if cfg.init_from else None
    init_state = model_state_from_checkpoint(init_ckpt) if init_ckpt is not None and not ckpt_path else None
    for state, path in ((resume_state, ckpt_path), (init_state, cfg.init_from)):
        if state is not None:
            check_finite_weights(state, path)
    base = read_entries(init_ckpt, Path(cfg.init_from))[0] if init_ckpt is not None else None
    task = HydraConfig.get().overrides.task
    named_rope = fields_named(task, "rope")
    lengths, rope, extend = run_positions(cfg, base, named_rope)  # RoPE errors before any data work too
    if base is not None:  # the weights define the shape: a real model needs no model= of its own
        model_config = shape_of(base, model_config, fields_named(task))

    datamodule = build(cfg.data)
    if (processes := data_parallel_processes(cfg.trainer)) is not None:  # else checked when fit starts
        datamodule.check_world_size(processes)
    datamodule.prepare_data()
    datamodule.setup("fit")  # the tokenizer fixes the vocabulary size before the model is built
    tokenizer = sample.tokenizer = datamodule.tokenizer

    vocab_size = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE  # the tokenizer's, padded
    model_config = replace(model_config, vocab_size=vocab_size, rope=rope, extend=extend, lengths=lengths)
    print(describe_positions(lengths, rope, extend))
    module = LitLlama(
        model_config,
        optim,
        max_steps=cfg.trainer.max_steps,
        compile=compile_blocks,
        kernels=cfg.kernels,
        tokenizer=tokenizer,
        chars_per_token=datamodule.chars_per_token("val"),
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        checkpoint_blocks=cfg.checkpoint_blocks,
    )
    if resume_state is not None:  # Lightning loads it in fit, where a mismatch would be a traceback
        check_weights_fit(
            module.model,
            resume_state,
            f"ckpt_path {ckpt_path} does not fit this model (resume with the run's own model= and data settings)",
            differing_settings(resume_config, model_config),
        )
    # init_from is weights only: a new run (new optimizer, schedule, step 0), e.g. context extension
    if init_state is not None:
        load_weights(
            module.model,
            init_state,
            f"init_from {cfg.init_from} does not fit this model (the same model= and data tokenizer are needed)",
            differing_settings(init_ckpt.get("model_config"), model_config),
        )
        print(f"Initialised weights from {cfg.init_from}")
    callbacks = [*build_callbacks(cfg.callbacks), sample]  # their own refusals, before any write
    if is_first_process():  # every check passed: the run's own files go in now
        overrides = HydraConfig.get().overrides.task
        write_hydra_config(run_dir, cfg, overrides)
        copy_tokenizer(tokenizer.path, run_dir)  # the run stays usable if the cache moves

    trainer = build_trainer(
        cfg.trainer,
        logger=build(cfg.logger),
        callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=str(run_dir),
    )
    print(f"Compile: {'the blocks' if compile_blocks else 'off'} ({why})")
    if optim.name == "muon":  # the dtype configure_optimizers will pick: it decides Muon's speed on a CPU
        dtype = resolve_muon_dtype(optim.muon_dtype, str(trainer.precision))
        print(
            f"Muon's Newton-Schulz: {str(dtype).removeprefix('torch.')} (optim.muon_dtype={optim.muon_dtype})"
        )
    for logger in trainer.loggers:  # the composed config beside the metrics (wandb's run page, hparams.yaml)
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return run_dir, datamodule, module, trainer, ckpt_path


def train(cfg: DictConfig) -> dict[str, float]:
    """Set up and fit; returns the final callback metrics (val/loss, val/ppl, val/bpc, ...)."""
    run_dir, datamodule, module, trainer, ckpt_path = setup_run(cfg)
    print(f"Run directory: {run_dir}  ({module.model.num_parameters() / 1e6:.2f}M parameters)")
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    finally:
        finish_wandb(trainer)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        print(run_summary(metrics, run_dir / "checkpoints", cfg.trainer.val_check_interval))
    return metrics


def run_summary(metrics: dict[str, float], ckpt_dir: Path, val_check_interval) -> str:
    """The end-of-run lines: the checkpoints that exist and the last validation, or why none ran."""
    lines = [f"Checkpoints: {ckpt_dir} ({', '.join(checkpoint_names(ckpt_dir)) or 'none'})"]
    names = (
        "val/loss",
        "val/ppl",
        "val/bpc",
        "val/recall_digits",
        "val/recall_exact",
        "val/digit_similarity",
    )
    scores = [f"{k}={metrics[k]:.4f}" for k in names if k in metrics]
    if scores:
        lines.append(f"Final validation: {', '.join(scores)}")
    else:  # e.g. a smoke run shorter than the validation interval: say so instead of an empty line
        lines.append(
            f"Final validation: none ran (validation runs every trainer.val_check_interval={val_check_interval} "
            "steps); lower it or run scripts/eval_extrapolation.py on the checkpoint."
        )
    return "\n".join(lines)


def resume_command(task_overrides: list[str], hydra_overrides: list[str], run_dir: Path) -> str:
    """The command that resumes this run: its own overrides (a bare `run_name=` would drop e.g. its
    experiment= and train another recipe from the checkpoint) with ckpt_path=last, shell-quoted."""
    keep = [o for o in task_overrides if not o.lstrip("+~").startswith("ckpt_path=")]
    keep += [o for o in hydra_overrides if o.startswith("hydra.run.dir=")]
    if not any(o.startswith(("run_name=", "hydra.run.dir=")) for o in keep):
        keep.append(f"run_name={run_dir.name}")  # the default run_name is a timestamp: name it
    program = (
        "python train.py" if checkout() is not None else "rope-train"
    )  # the checkout's or the console script
    return " ".join([program, *map(shlex.quote, keep), "ckpt_path=last"])


def remove_empty_run_dir(run_dir: Path) -> None:
    """A run that failed before training leaves nothing behind: the run directory and the empty parents
    Hydra created for it; a directory that existed before this process is never removed, whatever it holds."""
    root = NewRunDirectories.created_root(run_dir)
    if root is None or not run_dir.is_dir() or any(run_dir.iterdir()):
        return
    path = run_dir.resolve()
    while True:
        path.rmdir()
        if path == root or any(path.parent.iterdir()):
            return
        path = path.parent


def run_dir_is_named(hydra_overrides: list[str]) -> bool:
    """Whether runs/<run_name> names the run directory (no hydra.run.dir / hydra.sweep.dir given)."""
    return not any(o.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for o in hydra_overrides)


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="train")
@one_sentence_errors(errors=(*USER_ERRORS, NonFiniteLossError))
def main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    lock = None
    try:
        check_command("train", cfg)  # every option before the lock, the data or any write
        if run_dir_is_named(HydraConfig.get().overrides.hydra):
            check_run_name(cfg.run_name)
        if is_first_process():  # the other ranks run inside the first one's lock
            lock = RunLock(run_dir).acquire()
        metrics = train(cfg)
    except SIGTERMException:  # the scheduler asked us to stop: SaveLastCheckpoint already wrote last.ckpt
        overrides = HydraConfig.get().overrides
        print(f"Stopped by SIGTERM; resume with: {resume_command(overrides.task, overrides.hydra, run_dir)}")
        sys.exit(0)
    except BaseException:  # refused or failed before training: leave no run directory behind
        remove_empty_run_dir(run_dir)
        raise
    finally:
        if lock is not None:
            lock.release()
    return metrics.get("val/loss")  # Hydra sweepers can minimise this


if __name__ == "__main__":
    main()
