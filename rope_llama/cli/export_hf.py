"""Export a checkpoint as a Hugging Face `LlamaForCausalLM` directory (transformers, vLLM, llama.cpp).

    python scripts/export_hf.py ckpt=runs/shakespeare out=exports/shakespeare-hf
    python scripts/export_hf.py ckpt=runs/shakespeare/checkpoints/last.ckpt out=exports/x overwrite=true

The directory loads with `AutoModelForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)`
and nothing else. The mapping itself lives in interchange/hf.py; docs/export.md lists what maps to what.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import hydra
from omegaconf import DictConfig
from safetensors.torch import save_file
from tokenizers import processors
from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

from rope_llama import CONFIGS
from rope_llama.cli.errors import one_sentence_errors
from rope_llama.cli.options import require
from rope_llama.cli.schema import check_command
from rope_llama.core.checkpoint import load_checkpoint, resolve_checkpoint
from rope_llama.core.checks import check_switch
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.interchange.destination import check_export_destination, move_into_place
from rope_llama.interchange.hf import hf_config_dict, to_hf_state_dict
from rope_llama.model.rope import ntk_base


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty `out` unless overwriting, and a file where the directory should go."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={out} is a file; give a directory path.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"out={out} is not empty; pass overwrite=true to replace it.")


def hf_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Our tokenizer as a transformers fast tokenizer that prepends bos, like generate.py and training; bos and
    eos are the tokenizer's own (<|bos|>, <|eos|> when trained here; an imported one keeps its names)."""
    backend = copy.deepcopy(tok.hf)  # ours stays untouched; the post-processor only applies to special tokens
    bos, eos = backend.id_to_token(tok.bos_id), backend.id_to_token(tok.eos_id)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        clean_up_tokenization_spaces=False,  # byte-level BPE decodes exactly; no " ," -> "," rewriting
    )


def export(ckpt: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write checkpoint `ckpt` as a Hugging Face Llama directory at `out`; returns `out`.

    Raises ValueError (one sentence) before writing anything if the model or `out` cannot be exported.
    """
    check_switch("overwrite", overwrite)
    out = Path(out).expanduser().resolve()
    check_out(out, overwrite)
    ckpt = resolve_checkpoint(ckpt)
    check_export_destination(out, ckpt, out_is_file=False)
    loaded = load_checkpoint(ckpt)
    cfg = loaded.config
    hf_config = LlamaConfig(**hf_config_dict(cfg), architectures=["LlamaForCausalLM"], dtype="float32")
    tokenizer_file = loaded.tokenizer_file().resolve()
    if out == tokenizer_file.parent:  # the export's own tokenizer.json would replace the one it reads
        raise ValueError(
            f"out={out} holds {tokenizer_file}, the checkpoint's tokenizer; choose another directory."
        )
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    hf_config.bos_token_id, hf_config.eos_token_id = tokenizer.bos_id, tokenizer.eos_id
    if cfg.rope.scaling == "ntk":
        base = ntk_base(cfg.rope.base, cfg.rope.factor, cfg.head_dim)
        print(f"note: static ntk exported as plain RoPE with rope_theta={base} (identical frequencies).")
    state = to_hf_state_dict(loaded.model.state_dict(), cfg)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp.")
    )  # same filesystem: rename is atomic
    try:
        hf_config.save_pretrained(tmp)
        save_file(
            state, tmp / "model.safetensors", metadata={"format": "pt"}
        )  # "pt": what transformers expects
        GenerationConfig(
            bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id
        ).save_pretrained(tmp)
        hf_tokenizer(tokenizer).save_pretrained(tmp)
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name="export_hf")
@one_sentence_errors
def main(cfg: DictConfig) -> None:
    check_command("export_hf", cfg)
    require(cfg, ("ckpt", "out"), "ckpt=<.ckpt file or run directory> out=<directory>")
    path = export(cfg.ckpt, cfg.out, overwrite=cfg.overwrite)
    print(f"Exported {cfg.ckpt} to {path}")


if __name__ == "__main__":
    main()
