"""The README's quick start, in the order a newcomer types it: `make train`, then the next command as
printed, on a tiny model in a scratch directory."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from tests.helpers import ROOT, small_corpus, tiny_overrides


def quick_start_commands() -> list[str]:
    """The command lines of the README's Quick start block, comments dropped."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Quick start\n+```bash\n(.*?)```", readme, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def make_train_command(args: list[str]) -> list[str]:
    """What `make train ARGS=...` runs (make -n), with this interpreter and the checkout's train.py."""
    printed = subprocess.run(
        ["make", "-n", "-s", "-C", str(ROOT), "train", f"PY={sys.executable}", f"ARGS={shlex.join(args)}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in printed.splitlines() if " train.py " in f" {line} ")
    return [str(ROOT / "train.py") if word == "train.py" else word for word in shlex.split(line)]


def test_readme_quick_start_runs_in_order(tmp_path):
    commands = quick_start_commands()
    assert commands[0] == "make train" and commands[1].startswith("python generate.py ckpt=runs/default ")
    corpus = small_corpus(tmp_path / "corpus", n_files=6, chars=4000)
    tiny = [*tiny_overrides(tmp_path, corpus), "trainer.max_steps=4", "trainer.val_check_interval=2",
            "optim.warmup_steps=2"]  # fmt: skip
    train = make_train_command(tiny)
    assert "run_name=default" in train
    trained = subprocess.run(train, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (tmp_path / "runs" / "default" / "checkpoints" / "last.ckpt").is_file()
    generate = shlex.split(commands[1])
    generate = [sys.executable, str(ROOT / "generate.py"), *generate[2:], "max_new_tokens=4", "threads=1"]
    sampled = subprocess.run(generate, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert sampled.stdout.startswith("ROMEO:") and "generated tokens: 4" in sampled.stderr
    again = subprocess.run(train, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr  # runs/default is kept
