"""Run the bad-input cases of issue #78 against a checkout, as a user would, and print one table row each.

    python tools/option_cases.py checkout=/path/to/clone out=cases.json [timeout=90]
    python tools/option_cases.py mode=schema        # this checkout's check_command on each case, in-process

Each case runs its entry point from `checkout` (its own code, its own .venv-free PYTHONPATH) with a tiny
model and a few steps; a row says how it ended: `refused` (exit 2, one `error:` line), `traceback`,
`accepted` (exit 0), `hang` (killed at the timeout) or `other`. Used for
reports/2026-12-01-option-schema.md's before/after table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = ["model=tiny", "data.max_len=32", "trainer.max_steps=2", "trainer.val_check_interval=2",
         "trainer.limit_val_batches=1", "optim.warmup_steps=1", "sample.max_new_tokens=4", "compile=false"]  # fmt: skip
CASES = [
    ("train", "model.n_layers=nan"),
    ("train", "model.ffn_hidden=1e30"),
    ("train", "model.init_std=-1"),
    ("train", "rope=yarn rope.beta_slow=0"),
    ("train", "rope=llama3 rope.low_freq_factor=0"),
    ("train", "rope=yarn rope.original_max_len=inf"),
    ("train", "data.seed=nan"),
    ("train", "data.val_max_batches=str"),
    ("train", "optim.lr=1e30"),
    ("train", "callbacks.best.save_top_k=nan"),
    ("train", "callbacks.best.monitor=bogus"),
    ("train", "run_name=" + "x" * 300),
    ("train", "model.norm_eps=inf"),
    ("train", "model.init_std=1e30"),
    ("train", "rope.base=inf"),
    ("train", "rope=yarn rope.factor=inf"),
    ("train", "rope.factor=4"),
    ("train", "trainer.limit_val_batches=1e30"),
    ("train", "callbacks=ema callbacks.ema.decay=nan"),
    ("train", "callbacks.checkpoint.every_n_train_steps=nan"),
    ("train", "model.tie_embeddings=maybe"),
    ("train", "trainer.deterministic=maybe"),
    ("train", "optim.warmup_steps=100"),
    ("train", "trainer.num_nodes=2"),
    ("train", "+trainer.strategy=bogus"),
    ("generate", "top_k=inf"),
    ("generate", "seed=str"),
    ("generate", "seed=1.5"),
    ("generate", "temperature=1e30"),
    ("generate", "top_k=2.5"),
    ("generate", "greedy=maybe"),
    ("generate", "stream=maybe"),
    ("generate", "rope=yarn rope.factor=inf"),
    ("eval", "lengths=[16,16,32]"),
    ("eval", "factor=1e30"),
    ("eval", "factor=true"),
    ("passkey", "tasks=[]"),
    ("passkey", "depths=[]"),
    ("passkey", "candidates=100000"),
    ("prepare_data", "verify=maybe"),
    ("export_hf", "overwrite=no"),
]
SCRIPTS = {"train": "train.py", "generate": "generate.py", "eval": "scripts/eval_extrapolation.py",
           "passkey": "scripts/passkey.py", "prepare_data": "scripts/prepare_data.py",
           "export_hf": "scripts/export_hf.py"}  # fmt: skip


def outcome(proc: subprocess.CompletedProcess | None) -> tuple[str, str]:
    if proc is None:
        return "hang", ""
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if proc.returncode == 0:
        return "accepted", ""
    if "Traceback" in proc.stderr:
        return "traceback", last
    if proc.returncode == 2 and last.startswith("error: "):
        return "refused", last
    return "other", f"exit {proc.returncode}: {last}"


def run(checkout: Path, args: list[str], cwd: Path, timeout: float):
    env = {**os.environ, "PYTHONPATH": str(checkout), "WANDB_MODE": "disabled"}
    try:
        return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return None


def overrides_of(case: str) -> list[str]:
    return [case] if case.startswith("run_name=") else case.split(" ")


def schema_rows() -> None:
    """Each case's composed config through this checkout's `check_command` (no process, no model)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from rope_llama import CONFIGS
    from rope_llama.cli.schema import check_command

    for command, case in CASES:
        with initialize_config_dir(str(CONFIGS), version_base=None):
            cfg = compose(command, overrides=overrides_of(case))
        with open_dict(cfg):
            cfg.hydra = OmegaConf.create({"runtime": {"output_dir": "/tmp/run"}})
        try:
            check_command(command, cfg)
            said = "passes the schema"
        except ValueError as e:
            said = str(e)
        print(f"| {SCRIPTS[command]} | `{case[:60]}` | {said} |")


def main() -> None:
    options = dict(a.split("=", 1) for a in sys.argv[1:])
    if options.get("mode") == "schema":
        return schema_rows()
    checkout, timeout = Path(options["checkout"]).resolve(), float(options.get("timeout", 90))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = f"data.cache_dir={tmp / 'cache'}"
        base = run(checkout, ["train.py", *TRAIN, cache, f"hydra.run.dir={tmp / 'base'}"], checkout, 600)
        assert base is not None and base.returncode == 0, base and base.stderr[-2000:]
        run(
            checkout, ["scripts/export_hf.py", f"ckpt={tmp / 'base'}", f"out={tmp / 'hf'}"], checkout, 300
        )  # to overwrite
        for command, case in CASES:
            extra = overrides_of(case)
            out = tmp / f"out{len(rows)}"
            args = {
                "train": ["train.py", *TRAIN, cache, *extra]
                + ([] if case.startswith("run_name=") else [f"hydra.run.dir={tmp / f'run{len(rows)}'}"]),
                "generate": ["generate.py", f"ckpt={tmp / 'base'}", "prompt=ROMEO:", "max_new_tokens=4", *extra],
                "eval": ["scripts/eval_extrapolation.py", f"ckpt={tmp / 'base'}", f"out={out}", "methods=[none]",
                         "max_windows=1", "n_boot=10", *extra],
                "passkey": ["scripts/passkey.py", f"ckpt={tmp / 'base'}", f"out={out}", "methods=[none]",
                            "lengths=[32]", "trials=1", *extra],
                "prepare_data": ["scripts/prepare_data.py", "data.max_len=32", cache, *extra],
                "export_hf": ["scripts/export_hf.py", f"ckpt={tmp / 'base'}", f"out={tmp / 'hf'}", *extra],
            }[command]  # fmt: skip
            start = time.perf_counter()
            kind, line = outcome(run(checkout, args, checkout, timeout))
            rows.append({"command": SCRIPTS[command], "case": case[:60], "outcome": kind, "message": line[:200],
                         "seconds": round(time.perf_counter() - start, 1)})  # fmt: skip
            print(f"| {SCRIPTS[command]} | `{case[:60]}` | {kind} | {line[:160]} |", flush=True)
    Path(options["out"]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
