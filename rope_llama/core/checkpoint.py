"""Checkpoints: this project's format (written and read here only), safe loading (never unpickles code),
atomic saving, and rebuilding a model alone.

The format: a dict holding the network's weights under `state_dict` (names prefixed `model.`, as
Lightning writes a LitLlama's) and the plain entries of `format_entries`: `format_version`,
`model_config` (ModelConfig.to_dict(), its trained lengths included) and `tokenizer` ({"path", "sha256"}). That
is all generate.py and the scripts need to rebuild model + tokenizer. A training checkpoint is Lightning's
dict with these entries added (training/module.py); scripts/import_hf.py writes `weights_checkpoint`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from rope_llama.core.memory import human_bytes
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama

# Raise it when an entry changes meaning, and teach `read_entries` the older versions; a checkpoint
# without the entry is version 1. Version 2 renamed `train_max_len` to `max_len`; version 3 moved that
# length into model_config's `lengths` (trained_len, context_len).
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
OLD_LENGTH_ENTRY = {1: "train_max_len", 2: "max_len"}  # the one length versions 1 and 2 recorded
STATE_PREFIX = "model."  # LitLlama's attribute holding the network: Lightning prefixes its weights with it


class TokenizerFile(Protocol):
    """What a checkpoint records of its tokenizer: data/tokenizer.py's Tokenizer is one (core/ comes before
    data/ in the layers, so it names only what it reads)."""

    path: str
    sha256: str


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, unsafe or incomplete."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A rebuilt model and what its checkpoint says. `config` is the checkpoint's own (frozen): overrides
    give the model a new config (`Llama.use_positions`) and never change this one."""

    model: Llama
    config: ModelConfig
    tokenizer_path: str | None
    tokenizer_sha256: str | None
    path: Path

    @property
    def context_len(self) -> int:
        """The length the checkpoint claims (ModelConfig.lengths owns it)."""
        return self.config.lengths.context_len

    def tokenizer_file(self) -> Path:
        """The tokenizer.json this model was trained with: the recorded path, else a copy in the
        run directory (train.py copies it there so runs can be moved); verified by its sha256."""
        candidates = [Path(self.tokenizer_path)] if self.tokenizer_path else []
        candidates += [self.path.parent / "tokenizer.json", self.path.parent.parent / "tokenizer.json"]
        for candidate in candidates:
            try:
                if candidate.is_file() and (self.tokenizer_sha256 in (None, file_sha256(candidate))):
                    return candidate
            except OSError:  # unreadable (permissions, I/O): the copy beside the run may still serve
                continue
        where = ", ".join(str(c) for c in candidates) or "nowhere (the checkpoint records no tokenizer)"
        raise CheckpointError(
            f"The tokenizer of {self.path} is missing or changed; looked for it at {where}."
        )


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A .ckpt file, or a run directory (its checkpoints/last.ckpt, else the newest .ckpt below it)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        last = p / "checkpoints" / "last.ckpt"
        if last.is_file():
            return last
        found = sorted(p.rglob("*.ckpt"), key=lambda f: f.stat().st_mtime)
        if found:
            return found[-1]
        raise CheckpointError(f"No .ckpt file found under the run directory {p}.")
    raise CheckpointError(f"Checkpoint {p} does not exist; pass a .ckpt file or a run directory.")


def safe_load(path: str | os.PathLike, map_location="cpu", mmap: bool = False) -> dict:
    """torch.load with weights_only=True: tensors and plain containers only, never code.
    mmap: map the tensors' storage instead of reading it (a cheap look at a large checkpoint)."""
    p = Path(path)
    try:
        obj = torch.load(p, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # torch names the blocked callable of a crafted file; damaged bytes fail on an unknown opcode
        # under the same "Weights only load failed" heading, so only a named callable means "crafted".
        forbidden = re.search(r"GLOBAL ([\w.]+)", str(e))
        if "Weights only load failed" not in str(e) or forbidden is None:
            raise CheckpointError(
                f"{p} is not a readable PyTorch checkpoint (truncated or foreign file)."
            ) from None
        raise CheckpointError(
            f"Refusing to load {p}: it contains objects other than tensors and plain data "
            f"({forbidden.group(1)}), and loading it could run code."
        ) from None
    except Exception as e:  # torch raises many types for a truncated or foreign file; all mean the same
        detail = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(
            f"{p} is not a readable PyTorch checkpoint (truncated or foreign file): {detail}"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{p} holds a {type(obj).__name__}, not a checkpoint dictionary.")
    return obj


class DiskFullError(OSError):
    """A write that ran out of space; the file it was replacing keeps its previous content."""


# Below this many free bytes a failed write is taken for a full disk (torch's zip writer reports ENOSPC as
# "unexpected pos", not as an OSError).
NEARLY_FULL_BYTES = 16 * 2**20


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a binary file that replaces `path` only if the block completes: a temp file in the same
    directory, fsynced, then renamed, so a crash or a full disk keeps the old file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # the mode open() would give, not mkstemp's private 0600
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free
        if isinstance(e, OSError | RuntimeError) and (
            getattr(e, "errno", None) == errno.ENOSPC or free < NEARLY_FULL_BYTES
        ):
            kept = "keeps its previous content" if path.exists() else "was not written"
            raise DiskFullError(
                f"No space left on the disk of {path.parent} ({human_bytes(free)} free) while writing "
                f"{path.name}; {path} {kept}. Free some space and run again."
            ) from e
        raise


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """torch.save through `atomic_file`."""
    with atomic_file(path) as f:
        torch.save(obj, f)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """A UTF-8 text file written through `atomic_file`."""
    with atomic_file(path) as f:
        f.write(text.encode("utf-8"))


def format_entries(config: ModelConfig, tokenizer: TokenizerFile | None) -> dict:
    """The plain entries a checkpoint carries beside the weights: the model config (with the lengths it
    was trained at, which a checkpoint must record) and the tokenizer file (path + sha256; none for a
    module trained without one)."""
    if config.lengths is None:
        raise ValueError(
            "A checkpoint must record the lengths its model was trained at (ModelConfig.lengths)."
        )
    return {
        "format_version": FORMAT_VERSION,
        "model_config": config.to_dict(),
        "tokenizer": {"path": str(Path(tokenizer.path).resolve()), "sha256": tokenizer.sha256}
        if tokenizer
        else {},
    }


def weights_checkpoint(model: Llama, tokenizer: TokenizerFile) -> dict:
    """A checkpoint of weights only (no training state): what generate.py, the scripts and `init_from` read."""
    state = {STATE_PREFIX + k: v for k, v in model.state_dict().items()}
    return {"state_dict": state, **format_entries(model.config, tokenizer)}


def read_entries(ckpt: dict, path: Path) -> tuple[ModelConfig, dict]:
    """(model config, tokenizer {"path", "sha256"}) of a checkpoint read from `path`. Versions 1 and 2
    recorded one length: it becomes both trained lengths (a PoSE checkpoint's windows were shorter, which
    they did not record); one that recorded none (an import) is taken at its RoPE's original_max_len."""
    if "model_config" not in ckpt:
        raise CheckpointError(f"{path} has no 'model_config'; it was not written by this project's train.py.")
    version = ckpt.get("format_version", 1)
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path} is in checkpoint format {version!r}, but this code reads formats up to {FORMAT_VERSION}; "
            "use the version of this project that wrote it."
        )
    saved = dict(ckpt["model_config"])
    if version in OLD_LENGTH_ENTRY and saved.get("lengths") is None:
        length = ckpt.get(OLD_LENGTH_ENTRY[version]) or (saved.get("rope") or {}).get("original_max_len")
        saved["lengths"] = length
    try:
        config = ModelConfig.from_dict(saved)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path} has an invalid model_config: {e}") from None
    if config.lengths is None:
        raise CheckpointError(f"{path} records no trained lengths (model_config.lengths).")
    return config, dict(ckpt.get("tokenizer") or {})


def checkpoint_context_len(path: str | os.PathLike) -> int:
    """The context length a checkpoint (file or run directory) claims, read without loading its weights."""
    file = resolve_checkpoint(path)
    return read_entries(safe_load(file, mmap=True), file)[0].lengths.context_len


def model_state_from_checkpoint(ckpt: dict) -> dict[str, torch.Tensor]:
    """The network's weights: the checkpoint's `state_dict` with the module prefix stripped."""
    state = ckpt.get("state_dict")
    if not isinstance(state, dict):
        raise CheckpointError("The checkpoint has no 'state_dict' entry.")
    return {k[len(STATE_PREFIX) :]: v for k, v in state.items() if k.startswith(STATE_PREFIX)} or state


def differing_settings(saved: dict | None, config: ModelConfig) -> str:
    """The model settings (not rope / extend / lengths, which hold no weights) in which a checkpoint's saved
    `model_config` differs from `config`, as "d_model 64 in the checkpoint, 128 here, ..." ("" if none)."""
    here = config.to_dict()
    positions = ("rope", "extend", "lengths")
    names = [k for k in here if k not in positions and k in (saved or {}) and saved[k] != here[k]]
    return ", ".join(f"{k} {saved[k]} in the checkpoint, {here[k]} here" for k in names)


def check_weights_fit(model: torch.nn.Module, state: dict, context: str, settings: str = "") -> None:
    """One sentence unless `state` loads strictly into `model`: `context`, then the first tensor that
    differs with its shape in the checkpoint and in the model (load_state_dict's first line names none),
    then `settings` (differing_settings) when known, which says what to change."""
    expected = model.state_dict()
    problems = []
    for name, tensor in expected.items():
        saved = state.get(name)
        if saved is None:
            problems.append(f"the model's tensor {name!r} is missing from the checkpoint")
        elif not isinstance(saved, torch.Tensor):
            problems.append(f"{name!r} is a {type(saved).__name__} in the checkpoint, not a tensor")
        elif saved.shape != tensor.shape:
            problems.append(
                f"tensor {name!r} has shape {list(saved.shape)} in the checkpoint but {list(tensor.shape)} in the model"
            )
    problems += [
        f"the checkpoint's tensor {name!r} has no place in the model"
        for name in state
        if name not in expected
    ]
    if problems:
        more = f" (and {len(problems) - 1} more mismatches)" if len(problems) > 1 else ""
        differ = f"; model settings that differ: {settings}" if settings else ""
        raise CheckpointError(f"{context}: {problems[0]}{more}{differ}.")


def load_weights(model: torch.nn.Module, state: dict, context: str, settings: str = "") -> None:
    """Load `state` strictly into `model`; a mismatch fails with check_weights_fit's sentence."""
    check_weights_fit(model, state, context, settings)
    model.load_state_dict(state, strict=True)


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_finite_weights(state: dict, path: str | os.PathLike) -> None:
    """One sentence when a checkpoint's weights hold nan or inf (a diverged or damaged run): every
    forward would give nan, and a fine-tune or an export would carry them on."""
    bad = [name for name, t in state.items() if isinstance(t, torch.Tensor) and t.is_floating_point()
           and not torch.isfinite(t).all()]  # fmt: skip
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise CheckpointError(
            f"{path} holds non-finite weights (nan or inf) in {bad[0]!r}{more}; it cannot be used."
        )


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> LoadedCheckpoint:
    """Rebuild the model (eval mode, weights loaded strictly) from a checkpoint file or run dir."""
    p = resolve_checkpoint(path)
    ckpt = safe_load(p, map_location)
    config, tokenizer = read_entries(ckpt, p)
    model = Llama(config)
    state = model_state_from_checkpoint(ckpt)
    check_finite_weights(state, p)
    load_weights(model, state, f"{p} weights do not match its model_config")
    return LoadedCheckpoint(
        model=model.eval(),
        config=config,
        tokenizer_path=tokenizer.get("path"),
        tokenizer_sha256=tokenizer.get("sha256"),
        path=p,
    )
