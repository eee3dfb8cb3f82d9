"""Installable outside the checkout: the package, built as a wheel and installed into a fresh virtual
environment, trains, generates and evaluates through its console scripts from a directory outside the
clone, with the configs it ships and its caches in the user's cache directory.

Offline and without a second torch: the fresh environment sees the project environment's packages (the
pins of requirements.txt, pip included) through a .pth file, so `pip install --no-index` resolves pyproject.toml's
dependency ranges against what is installed: a range that excluded a pin would fail to install, since
nothing can be downloaded, and a CUDA build of torch is never fetched.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import rope_llama
from tests.helpers import ROOT, small_corpus

SCRIPTS = ("rope-train", "rope-generate", "rope-eval", "rope-passkey", "rope-study", "rope-prepare-data",
           "rope-export-hf", "rope-export-gguf", "rope-import-hf", "rope-import-gguf", "rope-visualize")  # fmt: skip
# What building must not copy: version control, environments, outputs and caches of the checkout.
NOT_SOURCES = (".git", ".venv", "runs", "outputs", "multirun", ".cache", "build", "dist", "*.egg-info",
               "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis")  # fmt: skip


def pins() -> dict[str, str]:
    """requirements.txt's pins: {name: version}."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    entries = [line.split("#")[0].strip() for line in lines]
    return dict(entry.split("==") for entry in entries if entry)


def test_the_declared_dependencies_admit_every_pin_and_name_each_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {(r := Requirement(line)).name: r.specifier for line in project["dependencies"]}
    assert len(declared) == len(project["dependencies"]) and sorted(declared) == sorted(pins())
    for name, version in pins().items():
        assert declared[name].contains(version), f"{name} {declared[name]} does not admit the pin {version}"
    assert tuple(project["scripts"]) == SCRIPTS


def test_caches_go_to_the_checkout_or_the_users_cache_directory(tmp_path, monkeypatch):
    from rope_llama.data import cache

    assert rope_llama.checkout() == ROOT and cache.default_cache_root() == str(ROOT / ".cache" / "data")
    monkeypatch.setattr(cache, "checkout", lambda: None)  # an installed copy
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.default_cache_root() == str(tmp_path / "rope-llama" / "data")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.default_cache_root() == str(tmp_path / "home" / ".cache" / "rope-llama" / "data")


def run(command: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_an_installed_package_trains_generates_and_evaluates_outside_the_checkout(tmp_path):
    """About a minute: build, install, then a 5-step tiny training, a generation and an evaluation."""
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # not the clone
    env |= {"XDG_CACHE_HOME": str(tmp_path / "user-cache"), "OMP_NUM_THREADS": "1"}
    # pip sees no index, no wheel folder and no config file: only what is installed can satisfy a range
    env |= {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    # Build from a copy: setuptools writes build/ and *.egg-info beside the sources it builds.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
         str(source)], tmp_path, env)  # fmt: skip
    (wheel,) = wheels.glob("rope_llama-*.whl")

    venv = tmp_path / "venv"
    # Without its own pip and setuptools: an older bundled setuptools would shadow the pinned one torch needs;
    # the project environment's pip installs into this one (its sys.prefix).
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    (fresh_site,) = (venv / "lib").glob("python3*/site-packages")
    (fresh_site / "project-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed = run([str(python), "-m", "pip", "install", "--no-index", str(wheel)], tmp_path, env)
    assert installed.stdout.strip().splitlines()[-1] == "Successfully installed rope-llama-0.1.0"  # alone
    where = run([str(python), "-c", "import rope_llama; print(rope_llama.CONFIGS, rope_llama.checkout())"],
                tmp_path, env).stdout.split()  # fmt: skip
    assert Path(where[0]).is_relative_to(venv) and (Path(where[0]) / "train.yaml").is_file()
    assert where[1] == "None"  # an installed copy, not a checkout
    assert all((bin_dir / script).is_file() for script in SCRIPTS)

    work = tmp_path / "work"  # outside the clone: runs/ and the outputs go here
    work.mkdir()
    corpus = small_corpus(tmp_path / "corpus", n_files=6, chars=6000)
    run([str(bin_dir / "rope-train"), "model=tiny", "data=text_files", f"data.source.paths=[{corpus}]",
         "data.vocab_size=320", "data.max_len=32", "data.batch_size=8", "trainer.max_steps=5",
         "trainer.val_check_interval=5", "trainer.limit_val_batches=2", "optim.warmup_steps=2",
         "sample.max_new_tokens=4", "run_name=tiny"], work, env)  # fmt: skip
    assert (work / "runs" / "tiny" / "checkpoints" / "last.ckpt").is_file()
    assert any((tmp_path / "user-cache" / "rope-llama" / "data").iterdir())  # the installed default cache

    generated = run([str(bin_dir / "rope-generate"), "ckpt=runs/tiny", "prompt=ROMEO:", "max_new_tokens=8",
                     "threads=1"], work, env)  # fmt: skip
    assert generated.stdout.startswith("ROMEO:")

    run([str(bin_dir / "rope-eval"), "ckpt=runs/tiny", "out=eval", "lengths=[32,64]", "methods=[none,yarn]",
         "max_windows=1", "n_boot=50", "threads=1"], work, env)  # fmt: skip
    assert (work / "eval" / "results.csv").is_file()
    print(f"built, installed, trained, generated and evaluated in {time.monotonic() - started:.0f} s")
