"""The `logger` group's targets (configs/logger/): Lightning's CSV and Weights & Biases loggers with this
project's defaults. (`logger=none` is Trainer(logger=[]): no logger.)"""

from __future__ import annotations

import netrc
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, WandbLogger


def csv_logger(save_dir: str | Path) -> CSVLogger:
    """metrics.csv in the run directory `save_dir`. A resumed run keeps its earlier file as metrics.<n>.csv
    (Lightning would overwrite it)."""
    run_dir = Path(save_dir)
    previous = run_dir / "metrics.csv"
    if previous.exists():
        n = 1 + sum(1 for _ in run_dir.glob("metrics.*.csv"))
        previous.rename(run_dir / f"metrics.{n}.csv")
    # flush often: a killed run keeps its metrics up to the last few steps
    return CSVLogger(save_dir=run_dir, name="", version="", flush_logs_every_n_steps=10)


def wandb_mode(requested: str) -> str:
    """`auto`: online when logged in (WANDB_API_KEY or a netrc entry), else offline (no account needed)."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        return "online" if netrc.netrc().authenticators("api.wandb.ai") else "offline"
    except (FileNotFoundError, netrc.NetrcParseError):
        return "offline"


def wandb_logger(
    save_dir: str | Path,
    project: str,
    entity: str | None = None,
    mode: str = "auto",
    tags: list[str] | None = None,
    name: str | None = None,
) -> WandbLogger:
    """A Weights & Biases run in `save_dir` (the run directory), named after it unless `name` is given;
    `mode` as in `wandb_mode`."""
    return WandbLogger(
        project=project,
        entity=entity,
        name=name or Path(save_dir).name,
        save_dir=str(save_dir),
        mode=wandb_mode(mode),
        tags=list(tags or []),
    )


def finish_wandb(trainer) -> None:
    """Close this run's wandb run, so the next job of a Hydra sweep (same process) starts its own."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()
