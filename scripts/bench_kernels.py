"""One training step with kernels on against off (kernels/; `kernels: true|false` in configs/train.yaml).

    python scripts/bench_kernels.py               # model=small, batch 16 x 256, fp32 and bf16 autocast
    python scripts/bench_kernels.py repeats=15 threads=1 shape=tiny

A step is forward + fused-or-plain loss + backward + fused AdamW, eager, as train.py runs it. One model
and one optimizer serve both settings: `use_kernels` swaps the modules' classes between calls, so
the only difference is the kernels. Calls alternate (off, on, off, on, ...) after a warm-up, and
each repeat's on/off ratio is taken from adjacent calls, so a busy machine slows both alike; the
table gives medians and the quartiles of the ratios. Speed-up = time off / time on: > 1 means the
kernels are faster. On a shared machine, threads=1 keeps one descheduled thread from stalling the other.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python scripts/bench_kernels.py`

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from inference.cli import build
from kernels import use_kernels
from model.llama import Llama

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = dict(shape="small", vocab=4096, batch=16, seq_len=256, repeats=9, warmup=2, seed=0, threads=None)
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}  # bf16: autocast, as trainer.precision=bf16-mixed


def training_step(args: dict, precision: str):
    """A closure running one eager training step of a fresh model=<shape> in `precision`, and the model."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={args['shape']}", f"data.max_len={args['seq_len']}"])
    torch.manual_seed(args["seed"])
    model = Llama(build(cfg.model, vocab_size=args["vocab"])).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(args["vocab"], (args["batch"], args["seq_len"] + 1))
    dtype = PRECISIONS[precision]

    def step():
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(idx[:, :-1], targets=idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    given = OmegaConf.to_container(OmegaConf.from_dotlist(argv)) if argv else {}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise SystemExit(f"error: unknown arguments {unknown}; allowed are {sorted(DEFAULTS)}.")
    args = {**DEFAULTS, **given}
    if args["threads"]:
        torch.set_num_threads(args["threads"])
    print(
        f"model={args['shape']}, batch {args['batch']} x {args['seq_len']}, "
        f"{torch.get_num_threads()} threads, medians of {args['repeats']} alternated repeats\n"
    )
    print(
        "| precision | kernels off (s/step) | kernels on (s/step) | speed-up: per-repeat ratios, median (quartiles) |"
    )
    print("|---|---|---|---|")
    for precision in PRECISIONS:
        step, model = training_step(args, precision)
        times = {False: [], True: []}
        for repeat in range(args["warmup"] + args["repeats"]):
            for enabled in (False, True) if repeat % 2 else (True, False):  # alternate which goes first
                use_kernels(model, enabled)
                seconds = timed(step)
                if repeat >= args["warmup"]:
                    times[enabled].append(seconds)
        ratios = [off / on for off, on in zip(times[False], times[True])]
        low, median, high = statistics.quantiles(ratios, n=4)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {precision} | {off:.3f} | {on:.3f} | {median:.2f}x ({low:.2f}-{high:.2f}) |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
