"""The RoPE extrapolation study, end to end, as subprocesses of the real entry points (resumable).

    python scripts/study.py out=runs/study                      # ~90 min on a 2-core CPU
    python scripts/study.py out=runs/study base_ckpt=runs/base large_base_ckpt=runs/base500k
    python scripts/study.py out=/tmp/smoke smoke=true -- data.cache_dir=/tmp/cache   # minutes, tiny model

Steps (each skipped when its output already exists, so a killed study resumes; a killed training
continues from its checkpoints/last.ckpt with ckpt_path=last):
  1. train the base model at max_len 256 with rope=none          -> out/runs/base
  2. evaluate every scaling method and attention extension zero-shot -> out/eval/base
  3. fine-tune at 1024 with PI and with YaRN (experiment=extend_context), evaluate their own RoPE
  4. train a model with a larger RoPE base, evaluate it with `none`
  5. passkey retrieval on the base (scalings and Self-Extend) and fine-tuned models
  6. out/summary.md and out/summary.png: every model and method in one table and one plot
Arguments after `--` go to every train.py run (e.g. data=... overrides). docs/extrapolation.md.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python scripts/x.py` from anywhere

from omegaconf import OmegaConf

from inference.checkpoint import resolve_checkpoint
from inference.cli import USER_ERRORS, one_sentence_errors
from scripts.common import ROOT
from scripts.eval_extrapolation import markdown_tables, plot_ppl_vs_length

# RoPE scalings, the attention extensions (model/extend.py) alone and composed with a scaling
ZERO_SHOT = "[none,linear,ntk,dynamic_ntk,yarn,llama3,self_extend,logn,yarn+logn,llama3+self_extend]"


@dataclass
class StudyConfig:
    out: str = "runs/study"
    smoke: bool = False  # tiny model, few steps, short lengths: checks the pipeline in minutes
    base_ckpt: str | None = None  # reuse a trained base model (run dir or .ckpt) instead of step 1
    large_base_ckpt: str | None = None  # reuse a trained large-base model instead of step 4
    large_base: float = 500000.0
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096])
    max_windows: int = 4
    passkey: bool = True
    passkey_trials: int = 3
    threads: int | None = None  # torch threads for the evaluations (null = torch's default)


SMOKE_TRAIN = ["model=tiny", "data.max_len=32", "data.batch_size=8", "trainer.max_steps=20",
               "trainer.val_check_interval=10", "trainer.limit_val_batches=2", "optim.warmup_steps=5",
               "sample.max_new_tokens=0"]  # fmt: skip
SMOKE_EXTEND = ["data.max_len=128", "data.batch_size=2", "rope.original_max_len=32", "trainer.max_steps=10",
                "trainer.val_check_interval=5", "optim.warmup_steps=2"]  # fmt: skip
SMOKE_LENGTHS = [32, 64, 128, 256, 512]
TRAINED = "study_trained"  # marker file in a run directory: its training finished


def step(name: str, done: Path, command: list[str], touch_done: bool = False) -> None:
    """Run one entry point unless `done` exists; a failure stops the study with one sentence.
    touch_done: `done` is a marker the study writes once the command succeeded (not its output)."""
    if done.exists():
        print(f"[study] {name}: done ({done} exists), skipped")
        return
    print(f"[study] {name}: {' '.join(command)}", flush=True)
    if subprocess.run([sys.executable, *command], cwd=ROOT).returncode != 0:
        raise RuntimeError(f"step {name!r} failed; fix it and re-run the same command to resume.")
    if touch_done:
        done.touch()


def read_results(path: Path, model: str) -> list[dict]:
    """results.csv rows with numbers parsed and the method renamed `<model>/<method>`."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    numeric = ("value", "ci_low", "ci_high")
    return [
        {
            **r,
            **{k: float(r[k]) for k in numeric},
            "length": int(r["length"]),
            "method": f"{model}/{r['method']}",
        }
        for r in rows
    ]


def run(cfg: StudyConfig, train_extra: list[str]) -> None:
    out = Path(cfg.out).resolve()
    lengths = SMOKE_LENGTHS if cfg.smoke else list(cfg.lengths)
    train_args = (SMOKE_TRAIN if cfg.smoke else []) + train_extra
    extend_args = SMOKE_EXTEND if cfg.smoke else []
    base_len = 32 if cfg.smoke else 256
    evals = {"max_windows": cfg.max_windows, "threads": cfg.threads}
    common = [f"lengths=[{','.join(map(str, lengths))}]"] + [
        f"{k}={v if v is not None else 'null'}" for k, v in evals.items()
    ]

    def train(name: str, *args: str) -> Path:
        run_dir = out / "runs" / name
        # last.ckpt alone does not mean done (it is also written every 100 steps and on SIGTERM):
        # the study marks a finished training itself, and an interrupted one resumes exactly.
        resume = ["ckpt_path=last"] if (run_dir / "checkpoints" / "last.ckpt").exists() else []
        step(f"train {name}", run_dir / TRAINED,
             ["train.py", f"hydra.run.dir={run_dir}", *train_args, *args, *resume], touch_done=True)  # fmt: skip
        return run_dir

    def evaluate(name: str, ckpt: Path, methods: str) -> None:
        step(f"eval {name}", out / "eval" / name / "results.csv",
             ["scripts/eval_extrapolation.py", f"ckpt={ckpt}", f"out={out / 'eval' / name}", f"methods={methods}", *common])  # fmt: skip

    base = Path(cfg.base_ckpt) if cfg.base_ckpt else train("base", f"data.max_len={base_len}", "rope=none")
    evaluate("base", base, ZERO_SHOT)
    extended = {}
    for name, rope in [("pi", []), ("yarn", ["rope=yarn"])]:
        init = resolve_checkpoint(base)  # init_from takes a .ckpt file
        extended[name] = train(name, "experiment=extend_context", f"init_from={init}", *rope, *extend_args)
        evaluate(name, extended[name], "[ckpt]")
    large = (
        Path(cfg.large_base_ckpt)
        if cfg.large_base_ckpt
        else train("large_base", f"data.max_len={base_len}", "rope=none", f"rope.base={cfg.large_base}")
    )
    evaluate("large_base", large, "[none]")
    if cfg.passkey:
        depths = "[0.0,0.5,1.0]" if cfg.smoke else "[0.0,0.25,0.5,0.75,1.0]"
        for name, ckpt, methods in [
            ("base", base, "[none,ntk,dynamic_ntk,yarn,self_extend]"),
            *((n, c, "[ckpt]") for n, c in extended.items()),
        ]:
            step(f"passkey {name}", out / "passkey" / name / "passkey.csv",
                 ["scripts/passkey.py", f"ckpt={ckpt}", f"out={out / 'passkey' / name}", f"methods={methods}",
                  f"depths={depths}", f"trials={cfg.passkey_trials}", *common[:1], f"threads={evals['threads'] or 'null'}"])  # fmt: skip

    rows = [
        r
        for name in ("base", "pi", "yarn", "large_base")
        for r in read_results(out / "eval" / name / "results.csv", name)
    ]
    header = (
        f"# RoPE extrapolation study ({'smoke' if cfg.smoke else 'full'})\n\nBase models trained at L = {base_len}; "
        "`pi`/`yarn` fine-tuned at 4L from `base`; `large_base` trained with rope.base="
        f"{cfg.large_base:g}. Per-model tables, intervals and plots: eval/<model>/results.md."
    )
    (out / "summary.md").write_text(markdown_tables(rows, header), encoding="utf-8")
    plot_ppl_vs_length(rows, base_len, out / "summary.png")
    print(f"[study] wrote {out / 'summary.md'} and {out / 'summary.png'}")


@one_sentence_errors(errors=(*USER_ERRORS, RuntimeError))  # RuntimeError: a step that failed
def main(argv: list[str]) -> None:
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    cfg = OmegaConf.merge(OmegaConf.structured(StudyConfig), OmegaConf.from_dotlist(ours))
    run(OmegaConf.to_object(cfg), extra)


if __name__ == "__main__":
    main(sys.argv[1:])
