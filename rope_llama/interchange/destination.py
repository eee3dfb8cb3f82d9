"""Where an export or import may write: never into a run directory (a folder holding checkpoints/ or
.hydra/), nor into a folder above the checkpoint being exported, whatever `overwrite` says; and how a
finished directory goes into place. The exporters and scripts/import_gguf.py check here."""

from __future__ import annotations

import os
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


def move_into_place(tmp: Path, out: Path) -> None:
    """A new or empty `out` becomes the finished temp dir `tmp` in one rename; in a non-empty `out`, each
    file written replaces its namesake atomically (checkpoints last, so a reader never finds a new one
    beside old files) and every other file there is left as it is."""
    if out.is_dir() and any(out.iterdir()):
        for written in sorted(tmp.iterdir(), key=lambda p: (p.suffix == ".ckpt", p.name)):
            os.replace(written, out / written.name)
        tmp.rmdir()
        return
    if out.is_dir():
        out.rmdir()  # an empty target directory (e.g. made by the caller) is simply replaced
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # the mode mkdir would give, not mkdtemp's private 0700
    os.replace(tmp, out)
