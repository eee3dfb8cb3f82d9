"""Where an export may write: never into a run directory (a folder holding checkpoints/ or .hydra/), nor
into a folder above the checkpoint being exported, whatever `overwrite` says. Both exporters check here."""

from __future__ import annotations

from pathlib import Path

RUN_MARKERS = ("checkpoints", ".hydra")


def run_directory_at_or_above(path: Path) -> Path | None:
    """The nearest folder at or above `path` that is a run directory, or None."""
    for folder in (path, *path.parents):
        if folder.is_dir() and any((folder / marker).is_dir() for marker in RUN_MARKERS):
            return folder
    return None


def check_export_destination(out: Path, ckpt: Path, *, out_is_file: bool) -> None:
    """One sentence when writing `out` could replace a run's files or the checkpoint being exported;
    symlinks are resolved."""
    out, ckpt = out.resolve(), ckpt.resolve()
    folder = out.parent if out_is_file else out
    run_dir = run_directory_at_or_above(folder)
    if run_dir is not None:
        raise ValueError(
            f"out={out} is inside the run directory {run_dir} (it holds checkpoints/ or .hydra/); exports "
            "never write into a run directory: choose a path outside it."
        )
    if out == ckpt or (not out_is_file and out in ckpt.parents):
        raise ValueError(
            f"out={out} would replace {ckpt}, the checkpoint being exported; choose another path."
        )
