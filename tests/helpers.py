"""Shared test helpers: compose the real Hydra config tree and shrink it, tiny corpora."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def small_corpus(folder: Path, n_files: int = 8, chars: int = 6000) -> str:
    """A few UTF-8 files cut from a real play; returns a glob for data=text_files."""
    from data.markdown import play_to_text
    from data.sources import shakespeare_plays

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
        "data.max_len=32",
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
    """Compose configs/<config_name>.yaml as the CLI would and register it as the running Hydra config."""
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
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def last_weights(run_dir: Path) -> dict:
    """The network weights in run_dir/checkpoints/last.ckpt (safe load)."""
    from inference.checkpoint import model_state_from_checkpoint, safe_load

    return model_state_from_checkpoint(safe_load(run_dir / "checkpoints" / "last.ckpt"))
