"""Shared test helpers: compose the real Hydra config tree and shrink it, tiny corpora, tiny models and the
run directories and checkpoints the command lines load, crafted pickles. Shared fixtures: conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from rope_llama import CONFIGS  # noqa: F401  (re-exported: the tests compose the config tree from here)
from rope_llama.core.checkpoint import (
    atomic_torch_save,
    model_state_from_checkpoint,
    safe_load,
    weights_checkpoint,
)
from rope_llama.data.markdown import play_to_text
from rope_llama.data.sources import shakespeare_plays
from rope_llama.data.tokenizer import Tokenizer, train_tokenizer
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RopeConfig

ROOT = Path(__file__).resolve().parents[1]  # the checkout
L0 = 32  # the training length of the tiny runs, models and checkpoints below
# The RoPE settings every parity test runs (model, HF export, GGUF): each scaling, and the other layout.
ROPES = {
    "none": RopeConfig(original_max_len=L0),
    "linear": RopeConfig(scaling="linear", factor=4.0, original_max_len=L0),
    "ntk": RopeConfig(scaling="ntk", factor=4.0, original_max_len=L0),
    "dynamic_ntk": RopeConfig(scaling="dynamic_ntk", factor=4.0, original_max_len=L0),
    "yarn": RopeConfig(scaling="yarn", factor=4.0, original_max_len=L0),
    "llama3": RopeConfig(scaling="llama3", factor=4.0, original_max_len=L0, base=500.0),
    "interleaved": RopeConfig(layout="interleaved", original_max_len=L0),
}
TEXT = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.\n\n"
    "Crème brûlée, naïve café — “quotes” and ✓ marks keep multi-byte characters in the text.\n"
)


def small_corpus(folder: Path, n_files: int = 8, chars: int = 6000) -> str:
    """A few UTF-8 files cut from a real play; returns a glob for data=text_files."""
    from rope_llama.data.markdown import play_to_text
    from rope_llama.data.sources import shakespeare_plays

    text = play_to_text(shakespeare_plays()["macbeth"])
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (folder / f"doc{i}.txt").write_text(text[i * chars : (i + 1) * chars], encoding="utf-8")
    return str(folder / "*.txt")


def tiny_overrides(tmp_path: Path, corpus: str) -> list[str]:
    """Shrink the default job to seconds: tiny model, small local corpus, few steps."""
    return [
        "model=tiny",
        "data=text_files",
        f"data.source.paths=[{corpus}]",
        "data.vocab_size=320",
        f"data.max_len={L0}",
        "data.batch_size=8",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_steps=20",
        "trainer.val_check_interval=10",
        "trainer.limit_val_batches=2",
        "trainer.enable_model_summary=false",
        "optim.warmup_steps=5",
        "sample.max_new_tokens=8",
    ]


def compose_train(overrides: list[str], run_dir: Path, config_name: str = "train"):
    """Compose rope_llama/configs/<config_name>.yaml as the CLI would and register it as the running Hydra config."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.job.num = 0
    run_dir.mkdir(parents=True, exist_ok=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def train_cli(*args: str, timeout: float | None = None):
    """`python train.py <args>` as a user runs it, from the repo root; output captured as text."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def last_weights(run_dir: Path) -> dict:
    """The network weights in run_dir/checkpoints/last.ckpt (safe load)."""
    return model_state_from_checkpoint(safe_load(run_dir / "checkpoints" / "last.ckpt"))


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (symbolic links as they are) with its bytes; None for a folder or a link."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() and not p.is_symlink() else None
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def text_tokenizer(folder: Path) -> Tokenizer:
    """A 300-token byte-level BPE trained on TEXT, saved as folder/tokenizer.json."""
    return train_tokenizer([TEXT] * 4, vocab_size=300, path=str(folder / "tokenizer.json"))


def tiny(vocab_size: int, rope: RopeConfig | None = None, **overrides) -> Llama:
    """A seeded 2-layer model; `overrides` are ModelConfig fields (e.g. extend, n_kv_heads, init_std)."""
    torch.manual_seed(0)
    fields = dict(
        vocab_size=vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        init_std=0.3,  # a sharp random model: greedy output is not one repeated token
        rope=rope or RopeConfig(original_max_len=L0),
        lengths=L0,  # what a checkpoint records (model/context.py)
    )
    return Llama(ModelConfig(**fields | overrides)).eval()


def save_run(model: Llama, tok: Tokenizer, directory: Path) -> Path:
    """Make `directory` a run directory the CLIs can load: checkpoints/last.ckpt + the tokenizer it records."""
    atomic_torch_save(weights_checkpoint(model, tok), directory / "checkpoints" / "last.ckpt")
    return directory


def write_checkpoint(folder: Path, tokenizer: Tokenizer, rope: RopeConfig, tie: bool = True) -> Path:
    """folder/model.ckpt: a random model (init_std=0.3: sharp logits, varied greedy text) with the
    vocabulary padded beyond the tokenizer's, as train.py pads it."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=320,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=96,
        init_std=0.3,
        tie_embeddings=tie,
        rope=rope,
        lengths=L0,
    )
    path = folder / "model.ckpt"
    atomic_torch_save(weights_checkpoint(Llama(cfg), tokenizer), path)
    return path


def run_generate_main(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """generate.main() as the command line runs it (Hydra parsing included), without a new interpreter.
    Returns (exit code, stdout, stderr)."""
    from rope_llama.cli import generate

    monkeypatch.setattr(sys, "argv", ["generate.py", *argv])
    try:
        generate.main()
        code = 0
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class Exploit:
    """Unpickling it runs `touch <marker>`: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def crafted_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """(a checkpoint whose loading would create the marker file, the marker's path)."""
    marker, path = tmp_path / "pwned", tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "model_config": {}, "payload": Exploit(marker)}, path)
    return path, marker


def refusal(path: Path) -> str:
    """The one sentence every entry point prints for a crafted pickle: it names the blocked callable."""
    return (
        f"Refusing to load {path}: it contains objects other than tensors and plain data "
        f"({os.system.__module__}.system), and loading it could run code."
    )


def prompt_ids(tok, text: str) -> list[int]:
    return [tok.bos_id, *tok.encode(text)]


# The data tests' corpora and damage (test_data.py, test_datamodule.py).
def plain_play(name: str) -> str:
    return play_to_text(shakespeare_plays()[name])


def text_corpus(tmp_path, n_files=6, chars=3000) -> str:
    """n_files small UTF-8 files (slices of Macbeth); returns their glob."""
    text = plain_play("macbeth")
    folder = tmp_path / f"corpus{n_files}x{chars}"
    folder.mkdir(exist_ok=True)
    for i in range(n_files):
        (folder / f"doc{i}.txt").write_text(text[i * chars : (i + 1) * chars], encoding="utf-8")
    return str(folder / "*.txt")


def small_source(tmp_path, n_files=6) -> dict:
    return {"kind": "text_files", "paths": text_corpus(tmp_path, n_files)}


def overwrite_bytes(path: str, offset: int, data: bytes) -> None:
    """Write `data` over `path` at `offset` in place: the file keeps its size."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def garbage(damage: str, n: int) -> bytes:
    return np.random.default_rng(0).bytes(n) if damage == "random_bytes" else bytes(n)
