"""Side-by-side speed of our Llama against transformers, litgpt, torchtune and llama.cpp, in ONE process.

    python tools/bench.py                                   # full run: both shapes, eager + compile
    python tools/bench.py compile=false shapes=[small]      # eager only, default shape only
    python tools/bench.py quick=true shapes=[tiny]          # smoke run (seconds; what the test uses)
    python tools/bench.py device=cuda threads=16 out=gpu.json

Every peer gets exactly our shape and, where it can load them, our weights (transformers through
interchange/hf.py, litgpt through its own HF converter, llama.cpp from an fp32 GGUF of scripts/export_gguf.py;
llama.cpp only decodes, on the CPU in float32). Calls are interleaved (ours, peer, ours, peer, ...)
and each number is a median, so a busy machine slows every side alike and the ratios stay meaningful;
absolute numbers are only worth quoting from a quiet machine. Every ratio is ours / peer of a
throughput: > 1 means we are faster. A peer that cannot be imported or compiled is reported, not fatal.
Results go to `out` (JSON) and a markdown table on stdout.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rope_llama import CONFIGS
from rope_llama.bench.generation import bench_decode_latency, bench_generate, bench_self_extend
from rope_llama.bench.peers import (
    LLAMA_CPP,
    MODEL_PEERS,
    build_models,
    import_peers,
    llama_cpp_parity,
    llama_cpp_runs,
    parity,
)
from rope_llama.bench.report import evaluate_targets, markdown
from rope_llama.bench.rope_op import bench_rope
from rope_llama.bench.scoring import bench_scoring
from rope_llama.bench.threads import bench_threads
from rope_llama.bench.timing import PRECISIONS, Progress, compute_dtype, matmul_peak
from rope_llama.bench.training import bench_train, resolve_train_precisions, time_to_quality, train_dtypes
from rope_llama.cli.instantiate import build
from rope_llama.core.device import resolve_device
from rope_llama.core.precision import AUTO
from rope_llama.kernels.cpuinfo import cpu_model
from rope_llama.model.config import ModelConfig, TrainedLengths
from rope_llama.model.context import resolve_positions

DEFAULTS = dict(
    shapes=[
        "small",
        "tiny",
    ],  # rope_llama/configs/model/<shape>.yaml; the first one is the "default shape" of the targets
    vocab=4096,
    batch=16,
    seq_len=256,
    compile=True,  # also time torch.compile'd training steps (eager is always timed)
    native_decode=True,  # ours decodes through the C step (kernels/cpu_decode.c) where it runs: CPU, fp32
    compile_decode=True,  # and through the compiled static-shape step (eager is always timed beside them)
    prompt_len=32,
    new_tokens=256,
    contexts=[128, 512, 1024, 2048, 4096],
    extend_context=4096,  # Self-Extend on vs off: prefill of this many tokens and decode at this context
    latency_steps=128,  # timed one-token steps per context (cheap; more steps, steadier medians)
    latency_block=16,  # consecutive steps per context before the next context takes its turn
    rope_shape=[8, 8, 1024, 64],  # (B, H, L, D)
    matmul_n=2048,
    repeats=9,  # medians of 9 interleaved calls: run-to-run spread of a ratio was ~5% with 5
    warmup=2,
    peers=["transformers", "litgpt", "torchtune", "llama.cpp"],
    device="auto",
    precision="auto",  # auto: bf16 on GPU, fp32 on CPU; bf16 on a CPU with AMX (bf16 matmuls ~6x fp32) is an option
    # training is also timed under these autocasts (every side alike), beside `precision`; auto: bf16
    # where the device multiplies bf16 matrices natively (trainer.precision=auto's rule), else none
    train_precisions=["auto"],
    ttq=False,  # also run tools/time_to_quality.py (real train.py runs: 10-40 min on a 2-core CPU)
    ttq_recipes=["auto"],  # tools/time_to_quality.py's auto: adamw and muon, fp32 and (natively) bf16
    ttq_thresholds=[2.10, 2.02],  # held-out val bpc of the default job
    threads=None,
    shared_cores=True,  # CPU: decode and scoring with 1 thread and one per core, quiet and beside a training job
    score_lengths=[1024, 4096],  # scoring section: window lengths (the threads section scores the shortest)
    score_chunk=4096,  # tokens per forward of our scoring (rope_llama/configs/eval.yaml's chunk)
    quick=False,
    out="bench.json",
    seed=0,
)
QUICK = dict(  # quick=true: a smoke run of every section in seconds (numbers are meaningless)
    batch=2,
    seq_len=32,
    compile=False,
    compile_decode=False,
    prompt_len=8,
    new_tokens=8,
    contexts=[16, 64],
    extend_context=96,  # past the default window (64): the merged attention runs
    latency_steps=3,
    score_lengths=[32, 96],
    score_chunk=64,
    rope_shape=[2, 2, 64, 16],
    matmul_n=256,
    repeats=2,
    warmup=1,
    train_precisions=[],
)
# ----------------------------------------------------------------------------- setup


def parse_args(argv: list[str]) -> dict:
    """key=value arguments (OmegaConf syntax, e.g. shapes=[small,tiny]) over DEFAULTS (and QUICK)."""
    given = OmegaConf.to_container(OmegaConf.from_dotlist(argv)) if argv else {}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise SystemExit(f"error: unknown arguments {unknown}; allowed are {sorted(DEFAULTS)}.")
    quick = bool(given.get("quick", DEFAULTS["quick"]))
    return {**DEFAULTS, **(QUICK if quick else {}), **given}


def check_args(args: dict) -> None:
    """Fail within seconds, not after minutes of benchmarking: every shape must be a rope_llama/configs/model
    group and the output file's directory must be writable."""
    shapes = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))
    unknown = [s for s in args["shapes"] if s not in shapes]
    if unknown:
        raise SystemExit(
            f"error: unknown shapes {unknown}; allowed are rope_llama/configs/model groups {shapes}."
        )
    out = Path(args["out"])
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: cannot create the directory of out={out}: {e.strerror}.") from None
    if not os.access(out.parent, os.W_OK):
        raise SystemExit(f"error: out={out} is not writable; choose another path.")
    if args["precision"] != "auto" and args["precision"] not in PRECISIONS:
        raise SystemExit(f"error: precision={args['precision']} is unknown; allowed are auto, fp32, bf16.")
    bad = [p for p in args["train_precisions"] if p not in (*PRECISIONS, AUTO)]
    if bad:
        raise SystemExit(
            f"error: train_precisions {bad} are unknown; allowed are {sorted([AUTO, *PRECISIONS])}."
        )


def machine(device: torch.device) -> dict:
    return dict(
        cpu=cpu_model(),
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        load_average_at_start=os.getloadavg(),  # > cores means the numbers are shared with other work
    )


def model_config(shape: str, vocab: int, max_len: int) -> ModelConfig:
    """The rope_llama/configs/model/<shape>.yaml group composed by Hydra and built as train.py builds it."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={shape}", f"data.max_len={max_len}"])
    lengths = TrainedLengths.of(max_len)
    group = lambda name: OmegaConf.to_container(cfg[name], resolve=True)
    rope, extend = resolve_positions(None, group("rope"), group("extend"), training=lengths)
    return replace(build(cfg.model, vocab_size=vocab), rope=rope, extend=extend, lengths=lengths)


# ----------------------------------------------------------------------------- timing


# ----------------------------------------------------------------------------- sections


# ----------------------------------------------------------------------------- report


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    check_args(args)
    if args["threads"]:
        torch.set_num_threads(int(args["threads"]))
    device = resolve_device(args["device"])
    # the precisions that will run, recorded in the output as such
    args["train_precisions"] = resolve_train_precisions(list(args["train_precisions"]), device)
    peers, unavailable = import_peers(list(args["peers"]))
    if LLAMA_CPP in peers and not llama_cpp_runs(args, device):
        del peers[LLAMA_CPP]
        dtype = str(compute_dtype(args, device)).removeprefix("torch.")
        unavailable[LLAMA_CPP] = f"timed against our CPU float32 paths only, not {device.type} {dtype}"
    for name, why in unavailable.items():
        print(f"[bench] {name}: skipped ({why})", file=sys.stderr)
    model_peers = {p: v for p, v in peers.items() if p in MODEL_PEERS}
    gguf_workdir = tempfile.TemporaryDirectory(prefix="bench-llama-cpp-")  # llama.cpp's GGUF files
    llama_cpp_dir = Path(gguf_workdir.name) if LLAMA_CPP in peers else None
    if "transformers" in peers:
        import transformers

        transformers.logging.set_verbosity_error()  # generate() warns about unused generation flags
    results: dict = dict(
        machine=machine(device),
        args=args,
        shapes=list(args["shapes"]),
        peers=peers,
        peers_unavailable=unavailable,
        dtype=str(compute_dtype(args, device)).removeprefix("torch."),  # what precision=auto resolved to
        note="Ratios are ours / peer of medians of interleaved runs; absolute numbers need a quiet machine.",
    )
    train_runs = [
        (shape, c, dtype)
        for dtype in train_dtypes(args, device)
        for shape in args["shapes"]
        for c in ((False, True) if args["compile"] else (False,))
    ]
    shared_cores = bool(args["shared_cores"]) and device.type == "cpu"
    progress = Progress(6 + len(train_runs) + bool(args["ttq"]) + shared_cores)
    default_cfg = model_config(args["shapes"][0], args["vocab"], args["seq_len"])
    progress("parity of the peers' logits and the matmul peak")
    parity_models = build_models(default_cfg, model_peers, device, 64, 0)
    results["parity_max_abs_logit_diff"] = parity(parity_models, args["vocab"], device)
    if llama_cpp_dir is not None:
        results["parity_max_abs_logit_diff"][LLAMA_CPP] = llama_cpp_parity(
            parity_models["ours"], llama_cpp_dir
        )
    peak_dtypes = train_dtypes(args, device)  # the MFU of each run is against its own dtype's peak
    peaks = {dtype: matmul_peak(args, device, dtype) for dtype in peak_dtypes}  # before and after training
    progress("generation: prefill and decode tokens/s")
    results["generate"] = bench_generate(default_cfg, args, model_peers, device, llama_cpp_dir)
    progress(f"decode latency at contexts {list(args['contexts'])}")
    results["decode_latency"] = bench_decode_latency(default_cfg, args, device, llama_cpp_dir)
    gguf_workdir.cleanup()
    progress(
        f"scoring {list(args['score_lengths'])} tokens, ours and transformers; every remap vs plain attention"
    )
    results["scoring"] = bench_scoring(default_cfg, args, model_peers, device)
    progress(f"Self-Extend on vs off at context {args['extend_context']}")
    results["self_extend"] = bench_self_extend(default_cfg, args, device)
    if shared_cores:
        progress("threads: 1 against one per core, quiet and beside a training-like job")
        results["threads"] = bench_threads(default_cfg, args)
    progress("the RoPE op")
    results["rope"] = bench_rope(args, peers, device)
    results["train"] = []
    for shape, compiled, dtype in train_runs:
        name = str(dtype).removeprefix("torch.")
        progress(f"training step, model={shape}, {'compiled' if compiled else 'eager'}, {name}")
        cfg = model_config(shape, args["vocab"], args["seq_len"])
        results["train"].append(bench_train(cfg, shape, args, model_peers, device, compiled, dtype))
    peaks = {dtype: max(peak, matmul_peak(args, device, dtype)) for dtype, peak in peaks.items()}
    results["matmul_peak_flops"] = peaks[peak_dtypes[0]]
    results["matmul_peak_flops_by_dtype"] = {str(d).removeprefix("torch."): f for d, f in peaks.items()}
    for t in results["train"]:
        t["mfu"] = t["achieved_flops"] / results["matmul_peak_flops_by_dtype"][t["dtype"]]
    if args["ttq"]:
        progress(f"time to quality: {', '.join(args['ttq_recipes'])} (real train.py runs)")
        results["time_to_quality"] = time_to_quality(args)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    results["targets"] = evaluate_targets(results)
    Path(args["out"]).write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"\nwrote {args['out']}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
