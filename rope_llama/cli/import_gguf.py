"""Import a GGUF file of llama.cpp's `llama` architecture as a checkpoint of this project.

    python scripts/import_gguf.py gguf=SmolLM2-135M-Instruct.Q4_1.gguf out=runs/smollm2
    python generate.py ckpt=runs/smollm2 prompt="The capital of France is" greedy=true
    python train.py init_from=runs/smollm2/model.ckpt ...

`out` becomes a directory holding model.ckpt (float32 weights, every quantization dequantized by gguf
itself), tokenizer.json and tokenizer_config.json (special tokens and chat template, in transformers'
format). The mapping lives in rope_llama/interchange/gguf.py; docs/export.md lists what maps to what.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rope_llama import CONFIGS
from rope_llama.cli.errors import one_sentence_errors
from rope_llama.cli.options import require
from rope_llama.cli.schema import check_command
from rope_llama.core.checkpoint import atomic_torch_save, atomic_write_text, load_weights, weights_checkpoint
from rope_llama.core.checks import check_switch
from rope_llama.data import DataError
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.interchange.destination import move_into_place, run_directory_at_or_above
from rope_llama.interchange.gguf_import import describe, read_gguf
from rope_llama.model.llama import Llama

CHECKPOINT, TOKENIZER, TOKENIZER_CONFIG = "model.ckpt", "tokenizer.json", "tokenizer_config.json"


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse a file, a folder inside (or being) a run directory whatever `overwrite` says, and a
    non-empty folder unless overwriting."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={out} is a file; give a directory for {CHECKPOINT} and its tokenizer.")
    run_dir = run_directory_at_or_above(out)
    if run_dir is not None:
        raise ValueError(
            f"out={out} is inside the run directory {run_dir} (it holds checkpoints/ or .hydra/); an import "
            "never writes into a run directory: choose a path outside it."
        )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(
            f"out={out} is not empty; pass overwrite=true to replace its {CHECKPOINT} and tokenizer."
        )


def import_gguf(gguf: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Convert the GGUF file `gguf` into the directory `out`; returns the checkpoint's path. Raises
    ValueError (one sentence) before writing anything when the file or `out` cannot be used."""
    check_switch("overwrite", overwrite)
    source = Path(gguf).expanduser().resolve()
    if not source.is_file():
        raise ValueError(f"gguf={source} is not a file; give the path of a .gguf file.")
    out = Path(out).expanduser().resolve()
    check_out(out, overwrite)
    imported = read_gguf(source)
    model = Llama(imported.config)
    load_weights(model, imported.state, f"The tensors of {source} do not fit its keys")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp."))  # same filesystem: atomic rename
    try:
        atomic_write_text(tmp / TOKENIZER, imported.tokenizer_json)
        config = json.dumps(imported.tokenizer_config, indent=2, ensure_ascii=False) + "\n"
        atomic_write_text(tmp / TOKENIZER_CONFIG, config)
        try:  # our loader accepts it (bos / eos found) ...
            tokenizer = Tokenizer(str(tmp / TOKENIZER))
        except DataError as e:
            need = str(e).split("; ", 1)[-1]
            raise ValueError(
                f"The vocabulary of {source} has no token this project reads as bos / eos; {need}"
            ) from None
        tokenizer.path = str(out / TOKENIZER)  # ... and the checkpoint records where it will be
        checkpoint = weights_checkpoint(model, tokenizer)
        atomic_torch_save(checkpoint, tmp / CHECKPOINT)
        move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{source.name}: {describe(imported)}")
    return out / CHECKPOINT


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="import_gguf")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    check_command("import_gguf", cfg)
    require(cfg, ("gguf", "out"), "gguf=<file.gguf> out=<directory to write>")
    start = time.perf_counter()
    path = import_gguf(cfg.gguf, cfg.out, overwrite=cfg.overwrite)
    print(f"Imported {cfg.gguf} to {path} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
