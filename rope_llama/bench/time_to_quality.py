"""Time to quality: wall-clock and tokens until the default job first reaches each validation score.

    python tools/time_to_quality.py                                   # adamw and muon, fp32 (and bf16: below)
    python tools/time_to_quality.py recipes=[muon-bf16] thresholds=[2.10,2.02] out=ttq.json

Each recipe is `<optim>-<precision>` (optim: adamw | muon; precision: fp32 | bf16), trained by the real
`train.py` in a subprocess on the default data and model with validation every `val_every` steps. The
first validation at or below a threshold gives its training seconds (`time/train_s`, logged by the
LightningModule from the start of fit), its step and its tokens; `total_s` is the whole command, from
process start (imports, data preparation, the final checkpoint) to exit. `floor_s` beside each is the
host's bound for those tokens: the seconds their training FLOPs take at the matmul peak the run measured
(the denominator of its MFU), before any overhead; a bar below it needs fewer tokens or another host.
Run it on a quiet machine. `recipes=[auto]` (the default) is adamw and muon in fp32, and in bf16 too where
`trainer.precision=auto` would pick it on the default `trainer=cpu` (a CPU with AMX or AVX-512 BF16):
elsewhere bf16 matmuls are emulated and a default job in bf16 would take hours.
Every recipe keeps train.py's `compile=auto`, so the bf16 recipes of 500+ steps compile their blocks (the
cold compile counts in their seconds); `extra=[compile=false]` times them eager.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from rope_llama.core.precision import AUTO, bf16_is_native, expand_auto

OPTIMS = ("adamw", "muon")
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}
DEFAULTS = dict(
    recipes=[AUTO],  # auto: every optimizer in fp32, and in bf16 where this host multiplies bf16 natively
    thresholds=[2.10, 2.02],
    val_every=50,
    out="runs/ttq/ttq.json",
    extra=[],  # more train.py overrides for every recipe, e.g. extra=[trainer.max_steps=500]
)


def parse_args(argv: list[str]) -> dict:
    args = dict(DEFAULTS)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            raise SystemExit(
                f"error: unknown option {item!r}; options are {', '.join(DEFAULTS)} (key=value)."
            )
        if isinstance(DEFAULTS[key], list):
            value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        args[key] = type(DEFAULTS[key])(value) if not isinstance(DEFAULTS[key], list) else value
    args["thresholds"] = sorted((float(t) for t in args["thresholds"]), reverse=True)
    for recipe in args["recipes"]:
        optim, _, precision = recipe.partition("-")
        if recipe != AUTO and (optim not in OPTIMS or precision not in PRECISIONS):
            raise SystemExit(
                f"error: unknown recipe {recipe!r}; use auto or <{'|'.join(OPTIMS)}>-<{'|'.join(PRECISIONS)}>, "
                "e.g. muon-bf16."
            )
    args["recipes"] = resolve_recipes(args["recipes"])
    return args


def resolve_recipes(recipes: list[str]) -> list[str]:
    """`auto` -> each optimizer in fp32, and in bf16 where `trainer.precision=auto` picks bf16-mixed."""
    if AUTO not in recipes:
        return recipes
    native, reason = bf16_is_native("cpu")  # train.py's default trainer (trainer=cpu)
    precisions = ["fp32", "bf16"] if native else ["fp32"]
    print(f"[ttq] recipes=[auto]: {' and '.join(precisions)} ({reason})", file=sys.stderr)
    return expand_auto(recipes, [f"{optim}-{p}" for optim in OPTIMS for p in precisions])


def first_reaching(rows: list[dict], threshold: float, tokens_per_step: int) -> dict | None:
    """The first validation row with val/bpc <= threshold, as {step, tokens, train_s, bpc}."""
    for row in rows:
        if row.get("val/bpc") and float(row["val/bpc"]) <= threshold:
            step = int(row["step"]) + 1  # Lightning logs the 0-based index of the last finished step
            return dict(
                step=step,
                tokens=step * tokens_per_step,
                train_s=round(float(row["time/train_s"]), 1),
                bpc=round(float(row["val/bpc"]), 4),
            )
    return None


def seconds_per_token_at_peak(rows: list[dict]) -> float | None:
    """Training FLOPs per token / the matmul peak, the median over the logged steps: each step's
    `perf/mfu` / `perf/tokens_per_s` (both measured against the same peak by the LightningModule)."""
    ratios = sorted(float(r["perf/mfu"]) / float(r["perf/tokens_per_s"]) for r in rows if r.get("perf/mfu"))
    return ratios[len(ratios) // 2] if ratios else None


def run_recipe(recipe: str, args: dict, workdir: Path) -> dict:
    optim, _, precision = recipe.partition("-")
    run_dir = workdir / recipe
    overrides = [
        f"optim={optim}",
        f"trainer.precision={PRECISIONS[precision]}",
        f"trainer.val_check_interval={args['val_every']}",
        "callbacks.checkpoint.every_n_train_steps=100000",  # checkpoint saves are not what is timed
        "sample.max_new_tokens=0",
        "overwrite=true",
        f"hydra.run.dir={run_dir}",
        *args["extra"],
    ]
    print(f"[ttq] {recipe}: python train.py {' '.join(overrides)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    train = [sys.executable, "-m", "rope_llama.cli.train"]  # in this directory, as run_dir is
    proc = subprocess.run([*train, *overrides], capture_output=True, text=True)
    total_s = time.perf_counter() - start
    if proc.returncode != 0:
        return {"recipe": recipe, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    with open(run_dir / "metrics.csv") as f:
        logged = list(csv.DictReader(f))
    rows = [r for r in logged if r.get("val/bpc")]
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    tokens_per_step = cfg.data.batch_size * cfg.data.max_len * cfg.trainer.accumulate_grad_batches
    reached = {f"{t:.2f}": first_reaching(rows, t, tokens_per_step) for t in args["thresholds"]}
    at_peak = seconds_per_token_at_peak(logged)
    for hit in reached.values():
        if hit is not None and at_peak is not None:
            hit["floor_s"] = hit["tokens"] * at_peak
    return {
        "recipe": recipe,
        "total_s": round(total_s, 1),
        "final_bpc": round(float(rows[-1]["val/bpc"]), 4) if rows else None,
        "steps": int(rows[-1]["step"]) + 1 if rows else None,
        "reached": reached,
    }


def floor_cell(hit: dict) -> str:
    return f"{hit['floor_s']:.1f}" if "floor_s" in hit else "?"  # no step logged its throughput


def markdown(results: list[dict], thresholds: list[float]) -> str:
    head = "| recipe | " + " | ".join(f"to {t:.2f}: s (steps, M tokens; floor s)" for t in thresholds)
    lines = [head + " | final val bpc | whole command s |", "|---" * (len(thresholds) + 3) + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['recipe']} | error: {r['error']} |")
            continue
        cells = []
        for t in thresholds:
            hit = r["reached"][f"{t:.2f}"]
            cells.append(
                "not reached"
                if hit is None
                else f"{hit['train_s']} ({hit['step']}, {hit['tokens'] / 1e6:.2f}; {floor_cell(hit)})"
            )
        lines.append(f"| {r['recipe']} | " + " | ".join(cells) + f" | {r['final_bpc']} | {r['total_s']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> list[dict]:
    args = parse_args(argv)
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    results = [run_recipe(recipe, args, out.parent) for recipe in args["recipes"]]
    out.write_text(json.dumps({"args": args, "results": results}, indent=2))
    print(markdown(results, args["thresholds"]))
    return results
