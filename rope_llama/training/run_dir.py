"""A run directory belongs to one run: a plain name, a place of its own (not inside another run's directory,
not the folder of runs), an exclusive lock for the run's lifetime, and nothing written into it (Hydra's
`.hydra/` included) until every check has passed.

configs/train.yaml sets `hydra.output_subdir: null` and logs to stdout only, so Hydra merely creates the
directory; `write_hydra_config` writes `.hydra/config.yaml` and `overrides.yaml` once the run is accepted.
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rope_llama.core.checkpoint import CheckpointError, atomic_write_text
from rope_llama.interchange.destination import is_run_directory, run_directory_at_or_above

PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]*")
# Set by torchrun, SLURM and Lightning's own launcher in every process but the first.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK")


def check_run_name(run_name) -> None:
    """run_name is a plain relative name: runs/<run_name> and nothing else (hydra.run.dir sets any path)."""
    name = str(run_name) if run_name is not None else ""
    if not PLAIN_NAME.fullmatch(name):  # its first character excludes ".", ".." and "-x"
        raise ValueError(
            f"run_name={name!r} is not a plain name; use letters, digits and . _ = + - (no '/', not empty), "
            "or hydra.run.dir=<path> for a directory elsewhere."
        )


def is_first_process() -> bool:
    """Whether this is rank 0 of a data-parallel run (or a run of one process)."""
    return all(os.environ.get(name, "0") in ("", "0") for name in RANK_VARIABLES)


def check_run_directory(run_dir: Path) -> None:
    """One sentence when `run_dir` (resolved) lies inside another run's directory (e.g. in its checkpoints/)
    or holds run directories itself (the runs folder): training there would mix two runs' files."""
    if (outer := run_directory_at_or_above(run_dir.parent)) is not None:
        raise ValueError(
            f"The run directory {run_dir} is inside the run directory {outer} (it holds checkpoints/ or "
            ".hydra/); give a directory of its own, e.g. run_name=<name> for runs/<name>."
        )
    if run_dir.is_dir() and any(is_run_directory(child) for child in run_dir.iterdir()):
        raise ValueError(
            f"The run directory {run_dir} holds other runs' directories (a folder of runs, such as runs/); "
            f"give a directory of its own, e.g. {run_dir}/<name>."
        )


class RunLock:
    """An exclusive, non-blocking lock on `run_dir` for this process's lifetime: a second process training
    into the same directory is refused in one sentence. The directory is resolved first (a symbolic link to
    a run's directory is that run's, and takes that run's lock) and refused in one sentence when it lies in
    another run's directory or is a folder of runs (`check_run_directory`). The lock file sits beside the
    directory (a refused run must not write into it) and is removed on release."""

    def __init__(self, run_dir: Path):
        run_dir = Path(run_dir).resolve()
        self.path = run_dir.parent / f".{run_dir.name}.lock"
        self.run_dir = run_dir
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        check_run_directory(self.run_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"{self.run_dir} is in use by another training process (it holds {self.path}); wait for it "
                "to finish or choose another run_name."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking: a waiter never takes a lock on a dead file
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def write_hydra_config(run_dir: Path, cfg: DictConfig, task_overrides: list[str]) -> None:
    """What Hydra would have written before the checks: the composed config (unresolved) and the overrides."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    task = OmegaConf.masked_copy(
        cfg, [k for k in cfg if k != "hydra"]
    )  # as Hydra saves it (an in-process compose keeps it)
    atomic_write_text(hydra_dir / "config.yaml", OmegaConf.to_yaml(task))
    atomic_write_text(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(task_overrides))))
