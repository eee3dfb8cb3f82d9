"""Export a checkpoint as one GGUF file that llama.cpp runs (its `llama` architecture).

    python scripts/export_gguf.py ckpt=runs/default out=exports/default.gguf
    python scripts/export_gguf.py ckpt=runs/default out=exports/default-f16.gguf dtype=f16

The mapping is rope_llama/interchange/gguf.py's; docs/export.md lists what is written, what llama.cpp
cannot express (refused before anything is written) and the tolerances.
"""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rope_llama import CONFIGS
from rope_llama.cli.errors import one_sentence_errors
from rope_llama.cli.options import require
from rope_llama.cli.schema import check_command
from rope_llama.core.checkpoint import load_checkpoint, resolve_checkpoint
from rope_llama.core.checks import check_switch
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.interchange.destination import check_export_destination
from rope_llama.interchange.gguf import check_dtype, gguf_writer, save
from rope_llama.model.rope import ntk_base


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse a directory, or an existing file unless overwriting."""
    if out.is_dir():
        raise ValueError(f"out={out} is a directory; give a file path such as {out / 'model.gguf'}.")
    if out.exists() and not overwrite:
        raise ValueError(f"out={out} exists; pass overwrite=true to replace it.")


def export(
    ckpt: str | os.PathLike, out: str | os.PathLike, dtype: str = "f32", overwrite: bool = False
) -> Path:
    """Write checkpoint `ckpt` as the GGUF file `out`; returns `out`.

    Raises ValueError (one sentence) before writing anything if the model or `out` cannot be exported.
    """
    check_switch("overwrite", overwrite)
    out = Path(out).expanduser().resolve()
    check_out(out, overwrite)
    check_dtype(dtype)
    ckpt = resolve_checkpoint(ckpt)
    check_export_destination(out, ckpt, out_is_file=True)
    loaded = load_checkpoint(ckpt)
    cfg = loaded.config
    tokenizer_file = loaded.tokenizer_file()
    if out == tokenizer_file.resolve():  # overwrite=true would destroy the source
        raise ValueError(f"out={out} is the tokenizer being exported; choose another path.")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    writer = gguf_writer(cfg, loaded.model.state_dict(), tokenizer, dtype, name=out.stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"  # same filesystem; created with the umask's mode
    try:
        save(writer, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if cfg.rope.scaling == "ntk":
        base = ntk_base(cfg.rope.base, cfg.rope.factor, cfg.head_dim)
        print(f"note: static ntk exported as plain RoPE with freq_base={base} (identical frequencies).")
    return out


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="export_gguf")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    check_command("export_gguf", cfg)
    require(cfg, ("ckpt", "out"), "ckpt=<.ckpt file or run directory> out=<file.gguf>")
    path = export(cfg.ckpt, cfg.out, dtype=str(cfg.dtype), overwrite=cfg.overwrite)
    print(f"Exported {cfg.ckpt} to {path} ({cfg.dtype})")


if __name__ == "__main__":
    main()
