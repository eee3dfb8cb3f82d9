"""One training step, two ways: kernels on against off (`kernels: true|false` in rope_llama/configs/train.yaml), the
transformer blocks compiled against eager (`compile: true|false`), or optim=muon's Newton-Schulz iterations
in fp32 against bf16 (`optim.muon_dtype`; bf16 is what torch.optim.Muon always uses).

    python tools/bench_kernels.py               # model=small, batch 16 x 256, fp32 (and bf16 autocast *)
    python tools/bench_kernels.py repeats=15 threads=1 shape=tiny
    python tools/bench_kernels.py compare=compile precisions=[fp32]
    python tools/bench_kernels.py compare=muon_dtype precisions=[fp32] batch=8

A step is forward + fused-or-plain loss + backward + fused AdamW, as train.py runs it. compare=kernels:
one model and one optimizer serve both settings (`use_kernels` swaps the modules' classes between calls),
so the only difference is the kernels. compare=compile: two models from the same seed, one with its blocks
compiled in place as train.py's compile=true does (kernels on in both); the warm-up calls hold the
compile. compare=muon_dtype: two models from the same seed, each stepped by optim=muon, its Newton-Schulz
iterations in bf16 in one and in fp32 in the other. Calls alternate (off, on, off, on, ...) after a
warm-up, and each repeat's ratio is taken from adjacent calls, so a busy machine slows both alike; the
table gives medians and the quartiles of the ratios. Speed-up = time off / time on: > 1 means the kernels
(or the compiled blocks, or the fp32 iterations) are faster. On a
shared machine, threads=1 keeps one descheduled thread from stalling the other.

* precisions defaults to fp32 and bf16 where trainer.precision=auto would train in bf16 (the CPU multiplies
bf16 matrices natively), else to fp32 alone: an emulated bf16 matmul ran about 100x slower than fp32.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rope_llama import CONFIGS
from rope_llama.cli.instantiate import build
from rope_llama.core.precision import AUTO, resolve_precision
from rope_llama.kernels import use_kernels
from rope_llama.model.llama import Llama
from rope_llama.training.compile import compile_blocks
from rope_llama.training.optim import OptimConfig, build_optimizer

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}  # bf16: autocast, as trainer.precision=bf16-mixed
COMPARISONS = {
    "kernels": ("kernels off", "kernels on"),
    "compile": ("eager", "blocks compiled"),
    "muon_dtype": ("Muon, Newton-Schulz in bf16", "in fp32"),
}
MUON_DTYPES = ((False, "bfloat16"), (True, "float32"))  # (the candidate?, optim.muon_dtype)
DEFAULTS = dict(
    compare="kernels",
    precisions=None,  # default_precisions()
    shape="small",
    vocab=4096,
    batch=16,
    seq_len=256,
    repeats=9,
    warmup=2,
    seed=0,
    threads=None,
)


def training_step(args: dict, precision: str, compiled: bool = False, muon_dtype: str | None = None):
    """A closure running one training step of a fresh model=<shape> with kernels on in `precision`, and
    the model; compiled: its blocks compiled in place after the kernels are in (as compile=true);
    muon_dtype: stepped by optim=muon with that optim.muon_dtype (else by AdamW)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={args['shape']}", f"data.max_len={args['seq_len']}"])
    torch.manual_seed(args["seed"])
    model = use_kernels(Llama(build(cfg.model, vocab_size=args["vocab"])).train())  # as train.py's default
    if compiled:
        compile_blocks(model)
    if muon_dtype is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        optimizer = build_optimizer(model, OptimConfig(name="muon", muon_dtype=muon_dtype), fused=True)
    idx = torch.randint(args["vocab"], (args["batch"], args["seq_len"] + 1))
    dtype = PRECISIONS[precision]

    def step():
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(idx[:, :-1], targets=idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model


def default_precisions() -> list[str]:
    """fp32, and bf16 where precision=auto would choose it on this CPU."""
    return list(PRECISIONS) if resolve_precision(AUTO, "cpu")[0] == "bf16-mixed" else ["fp32"]


def contenders(args: dict, precision: str) -> dict:
    """{False: the baseline step, True: the candidate step} of args['compare']."""
    if args["compare"] == "compile":
        return {compiled: training_step(args, precision, compiled)[0] for compiled in (False, True)}
    if args["compare"] == "muon_dtype":
        return {fp32: training_step(args, precision, muon_dtype=dtype)[0] for fp32, dtype in MUON_DTYPES}
    step, model = training_step(args, precision)

    def with_kernels(enabled: bool):
        def run():
            use_kernels(model, enabled)
            step()

        return run

    return {enabled: with_kernels(enabled) for enabled in (False, True)}


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def parse(argv: list[str]) -> dict:
    """The options of `argv` (key=value) over DEFAULTS; one sentence for an unknown key or value."""
    given = OmegaConf.to_container(OmegaConf.from_dotlist(argv)) if argv else {}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise SystemExit(f"error: unknown arguments {unknown}; allowed are {sorted(DEFAULTS)}.")
    args = {**DEFAULTS, **given}
    if args["compare"] not in COMPARISONS:
        raise SystemExit(f"error: compare must be one of {sorted(COMPARISONS)}, got {args['compare']!r}.")
    if args["precisions"] is None:
        args["precisions"] = default_precisions()
    precisions = args["precisions"]
    if not isinstance(precisions, list) or not precisions or not set(precisions) <= set(PRECISIONS):
        raise SystemExit(
            f"error: precisions must be a non-empty list of {list(PRECISIONS)}, got {precisions!r}."
        )
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args["threads"]:
        torch.set_num_threads(args["threads"])
    off_name, on_name = COMPARISONS[args["compare"]]
    print(
        f"model={args['shape']}, batch {args['batch']} x {args['seq_len']}, "
        f"{torch.get_num_threads()} threads, medians of {args['repeats']} alternated repeats\n"
    )
    print(
        f"| precision | {off_name} (s/step) | {on_name} (s/step) | speed-up: per-repeat ratios, median (quartiles) |"
    )
    print("|---|---|---|---|")
    for precision in args["precisions"]:
        steps = contenders(args, precision)
        times = {False: [], True: []}
        for repeat in range(args["warmup"] + args["repeats"]):
            for candidate in (False, True) if repeat % 2 else (True, False):  # alternate which goes first
                seconds = timed(steps[candidate])
                if repeat >= args["warmup"]:
                    times[candidate].append(seconds)
        ratios = [off / on for off, on in zip(times[False], times[True])]
        low, median, high = statistics.quantiles(ratios, n=4)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {precision} | {off:.3f} | {on:.3f} | {median:.2f}x ({low:.2f}-{high:.2f}) |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
