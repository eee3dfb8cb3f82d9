"""Where a command may write: exports, imports and results directories (evaluation, retrieval, study,
pictures) never write into a run directory (a folder holding checkpoints/ or .hydra/), an export never into
a folder above the checkpoint being exported, results never into a folder of checkpoints (.ckpt files),
whatever `overwrite` says; a non-empty results directory is refused unless the command is told to
overwrite (or resume) it; and a finished directory goes into place in one rename (`staged`). The exporters,
the importers and the scripts that write results check here."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rope_llama.core.checks import check_switch

RUN_MARKERS = ("checkpoints", ".hydra")


def is_run_directory(folder: Path) -> bool:
    """Whether `folder` holds checkpoints/ or .hydra/."""
    return folder.is_dir() and any((folder / marker).is_dir() for marker in RUN_MARKERS)


def run_directory_at_or_above(path: Path) -> Path | None:
    """The nearest folder at or above `path` that is a run directory, or None."""
    return next((folder for folder in (path, *path.parents) if is_run_directory(folder)), None)


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


# what a non-empty results directory needs, by the switch its command offers
AGAIN = {"overwrite": "overwrite=true to replace its results", "resume": "resume=true to continue in it"}


def claim_results_directory(out: str | os.PathLike, switch: str, value: bool) -> Path:
    """`out` resolved (symlinks included), refused in one sentence before any work unless it is, or can be
    created as, a directory this process can write to, outside every run directory, holding no checkpoints,
    and empty unless the command's `switch` (overwrite, or resume for a command that resumes) is true.
    Creates nothing: the test file in the nearest existing directory is anonymous and removed."""
    check_switch(switch, value)
    path = Path(out).expanduser().resolve()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise ValueError(f"out={out} {where}; give a directory for the results.")
    if (run_dir := run_directory_at_or_above(existing)) is not None:
        raise ValueError(
            f"out={out} is inside the run directory {run_dir} (it holds checkpoints/ or .hydra/); results "
            "never go into a run directory: choose a directory outside it."
        )
    if path.is_dir() and any(path.glob("*.ckpt")):
        raise ValueError(
            f"out={out} holds checkpoints (.ckpt files); results never go into a checkpoints folder: "
            "choose another directory."
        )
    if path.is_dir() and any(path.iterdir()) and not value:
        raise ValueError(f"out={out} is not empty; pass {AGAIN[switch]}, or give another out.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(
            f"out={out} is not writable: creating a file in {existing} failed ({e.strerror}); "
            "give another directory."
        ) from None
    return path


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A new folder beside `out` (the same filesystem) to write a result into: moved into place
    (`move_into_place`) when the block ends, removed when it fails, so `out` never holds half a result."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp."))
    try:
        yield tmp
        move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
