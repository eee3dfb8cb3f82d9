"""Import a Hugging Face `LlamaForCausalLM` directory as a checkpoint of this project.

    python scripts/import_hf.py hf_dir=exports/shakespeare-hf out=runs/imported/model.ckpt
    python generate.py ckpt=runs/imported/model.ckpt prompt="ROMEO:"
    python train.py init_from=runs/imported/model.ckpt ...

Reads config.json (through transformers, which also normalises older `rope_scaling` configs),
the safetensors weights (one file or an index of shards) and tokenizer.json, which is copied next
to the checkpoint. The mapping itself lives in interchange/hf.py; docs/export.md lists what maps to what.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import hydra
from omegaconf import DictConfig
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoConfig

from rope_llama import CONFIGS
from rope_llama.cli.errors import one_sentence_errors
from rope_llama.cli.options import require
from rope_llama.cli.schema import check_command
from rope_llama.core.checkpoint import atomic_torch_save, file_sha256, load_weights, weights_checkpoint
from rope_llama.core.checks import check_switch
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.interchange.destination import run_directory_at_or_above
from rope_llama.interchange.hf import from_hf_state_dict, model_config_from_hf
from rope_llama.model.llama import Llama


def load_safetensors(path: Path) -> dict:
    """One safetensors file; a truncated or foreign one is a sentence naming it, not a Rust traceback."""
    try:
        return load_file(path)
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or foreign): {e}.") from None


def read_safetensors(hf_dir: Path) -> dict:
    """model.safetensors, or every shard named in model.safetensors.index.json."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(
                f"{index} is not a safetensors index (a JSON object whose weight_map names the shards)."
            ) from None
        return {k: v for shard in shards for k, v in load_safetensors(hf_dir / shard).items()}
    if (hf_dir / "model.safetensors").is_file():
        return load_safetensors(hf_dir / "model.safetensors")
    raise ValueError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json (.bin is not read).")


def check_out(out: Path, hf_dir: Path, overwrite: bool) -> None:
    """Refuse an `out` that is, lies above or inside the directory being imported (writing there could
    replace the files being read), a directory, a file inside a run directory whatever `overwrite` says, or
    an existing file unless overwriting."""
    if out == hf_dir or out in hf_dir.parents or hf_dir in out.parents:
        raise ValueError(
            f"out={out} overlaps hf_dir={hf_dir}, the directory being imported; write the checkpoint outside it."
        )
    if out.is_dir():
        raise ValueError(f"out={out} is a directory; give the path of the .ckpt file to write.")
    if (run_dir := run_directory_at_or_above(out.parent)) is not None:  # its checkpoints, its last.ckpt
        raise ValueError(
            f"out={out} is inside the run directory {run_dir} (it holds checkpoints/ or .hydra/); an import "
            "never writes into a run directory: choose a path outside it."
        )
    if out.exists() and not overwrite:
        raise ValueError(f"out={out} already exists; pass overwrite=true to replace it.")


def read_tokenizer(hf_dir: Path, vocab_size: int) -> Tokenizer:
    """hf_dir/tokenizer.json, loaded with our wrapper to validate it before anything is written."""
    source = hf_dir / "tokenizer.json"
    if not source.is_file():
        raise ValueError(f"{hf_dir} has no tokenizer.json; generate.py and train.py need one.")
    tokenizer = Tokenizer.from_file(str(source))
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"The tokenizer has {tokenizer.vocab_size} tokens but the model only {vocab_size}.")
    return tokenizer


def copy_tokenizer(tokenizer: Tokenizer, dest: Path, overwrite: bool) -> None:
    """Copy the tokenizer file to `dest` atomically; a different tokenizer there is kept unless overwriting."""
    if dest.is_file() and file_sha256(dest) != tokenizer.sha256 and not overwrite:
        raise ValueError(f"{dest} exists with a different tokenizer; pass overwrite=true or another out.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    shutil.copyfile(tokenizer.path, tmp)
    os.replace(tmp, dest)


def import_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Convert the Llama directory `hf_dir` into the checkpoint `out` (+ tokenizer.json beside it)."""
    check_switch("overwrite", overwrite)
    hf_dir, out = Path(hf_dir).expanduser().resolve(), Path(out).expanduser().resolve()
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"hf_dir={hf_dir} has no config.json; give a LlamaForCausalLM directory.")
    check_out(out, hf_dir, overwrite)
    try:  # transformers validates the file and converts older `rope_scaling` configs to rope_parameters
        hf_config = AutoConfig.from_pretrained(hf_dir).to_dict()
    except (KeyError, TypeError) as e:
        raise ValueError(f"{hf_dir / 'config.json'} is not a valid transformers config: {e}") from None
    cfg = model_config_from_hf(hf_config)  # refuses what our model cannot express
    model = Llama(cfg)
    mismatch = f"The weights in {hf_dir} do not match its config.json"
    try:
        state = from_hf_state_dict(read_safetensors(hf_dir), cfg)
    except (KeyError, RuntimeError) as e:  # a missing tensor, or q/k/v (gate/up) shapes that cannot be fused
        raise ValueError(f"{mismatch}: {e}") from None
    load_weights(model, state, mismatch)
    tokenizer = read_tokenizer(hf_dir, cfg.vocab_size)
    tokenizer_dest = out.parent / "tokenizer.json"
    copy_tokenizer(tokenizer, tokenizer_dest, overwrite)
    # the checkpoint records the copy beside it, which generate.py and train.py then read
    atomic_torch_save(weights_checkpoint(model, Tokenizer(tokenizer_dest)), out)
    return out


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="import_hf")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    check_command("import_hf", cfg)
    require(cfg, ("hf_dir", "out"), "hf_dir=<LlamaForCausalLM directory> out=<.ckpt path>")
    path = import_hf(cfg.hf_dir, cfg.out, overwrite=cfg.overwrite)
    print(f"Imported {cfg.hf_dir} to {path}")


if __name__ == "__main__":
    main()
