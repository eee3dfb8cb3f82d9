"""Import a Hugging Face `LlamaForCausalLM` directory as a checkpoint of this project.

    python scripts/import_hf.py hf_dir=exports/shakespeare-hf out=runs/imported/model.ckpt
    python generate.py ckpt=runs/imported/model.ckpt prompt="ROMEO:"
    python train.py init_from=runs/imported/model.ckpt ...

Reads config.json (through transformers, which also normalises older `rope_scaling` configs),
the safetensors weights (one file or an index of shards) and tokenizer.json, which is copied next
to the checkpoint. The mapping itself lives in model/hf.py; docs/export.md lists what maps to what.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python scripts/import_hf.py`

import hydra
from omegaconf import DictConfig
from safetensors.torch import load_file
from transformers import AutoConfig

from data.tokenizer import Tokenizer
from model.checkpoint import atomic_torch_save, file_sha256
from model.hf import from_hf_state_dict, model_config_from_hf
from model.llama import Llama
from scripts.common import CONFIGS, one_sentence_errors, require


def read_safetensors(hf_dir: Path) -> dict:
    """model.safetensors, or every shard named in model.safetensors.index.json."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(hf_dir / shard).items()}
    if (hf_dir / "model.safetensors").is_file():
        return load_file(hf_dir / "model.safetensors")
    raise ValueError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json (.bin is not read).")


def copy_tokenizer(hf_dir: Path, dest: Path, overwrite: bool) -> Tokenizer:
    """Copy hf_dir/tokenizer.json to `dest` (atomically) and load it with our wrapper to validate it."""
    source = hf_dir / "tokenizer.json"
    if not source.is_file():
        raise ValueError(f"{hf_dir} has no tokenizer.json; generate.py and train.py need one.")
    if dest.is_file() and file_sha256(dest) != file_sha256(source) and not overwrite:
        raise ValueError(f"{dest} exists with a different tokenizer; pass overwrite=true or another out.")
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    shutil.copyfile(source, tmp)
    os.replace(tmp, dest)
    return Tokenizer.from_file(str(dest))


def import_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Convert the Llama directory `hf_dir` into the checkpoint `out` (+ tokenizer.json beside it)."""
    hf_dir, out = Path(hf_dir).expanduser().resolve(), Path(out).expanduser().resolve()
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"hf_dir={hf_dir} has no config.json; give a LlamaForCausalLM directory.")
    if out.exists() and not overwrite:
        raise ValueError(f"out={out} already exists; pass overwrite=true to replace it.")
    try:  # transformers validates the file and converts older `rope_scaling` configs to rope_parameters
        hf_config = AutoConfig.from_pretrained(hf_dir).to_dict()
    except (KeyError, TypeError) as e:
        raise ValueError(f"{hf_dir / 'config.json'} is not a valid transformers config: {e}") from None
    cfg = model_config_from_hf(hf_config)  # refuses what our model cannot express
    model = Llama(cfg)
    try:
        model.load_state_dict(from_hf_state_dict(read_safetensors(hf_dir), cfg), strict=True)
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"The weights in {hf_dir} do not match its config.json: {e}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = copy_tokenizer(hf_dir, out.parent / "tokenizer.json", overwrite)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"The tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size}."
        )
    checkpoint = {
        "state_dict": {"model." + k: v for k, v in model.state_dict().items()},  # Lightning's module prefix
        "model_config": cfg.to_dict(),
        "tokenizer": {"path": tokenizer.path, "sha256": tokenizer.sha256},
        "train_max_len": cfg.rope.original_max_len,
    }
    atomic_torch_save(checkpoint, out)
    return out


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="import_hf")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    require(cfg, ("hf_dir", "out"), "hf_dir=<LlamaForCausalLM directory> out=<.ckpt path>")
    path = import_hf(cfg.hf_dir, cfg.out, overwrite=bool(cfg.overwrite))
    print(f"Imported {cfg.hf_dir} to {path}")


if __name__ == "__main__":
    main()
