"""tools/bench.py's threads section: decode and scoring tokens/s with one torch thread and with one per
core, on a quiet machine and beside a training-like job, and the count `threads=auto` picks in each
(rope_llama/core/threads.py). This is what chooses the inference defaults; CPU only."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import torch

from rope_llama.bench.timing import alternate
from rope_llama.core.threads import choose_threads, usable_cores
from rope_llama.inference.generation import GREEDY, generate, score_tokens
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama

# Another job on the same cores: a matmul loop with torch's default threads, as a training run has.
LOAD = "import torch; a = torch.randn(512, 512); print('ready', flush=True)\nwhile True: a @ a"
CONDITIONS = ("quiet", "loaded")


@contextlib.contextmanager
def background_load(loaded: bool):
    """A training-like process on every core for the duration of the block (none when not `loaded`)."""
    if not loaded:
        yield
        return
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's default: every core
    load = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, text=True, env=env)
    try:
        load.stdout.readline()  # wait until it computes
        yield
    finally:
        load.kill()
        load.wait()


@torch.inference_mode()
def bench_threads(cfg: ModelConfig, args: dict) -> dict:
    """tokens/s of eager decode, the C decode step and scoring (`score_tokens`, the evaluation's path, of
    the shortest `score_lengths`) for 1 thread and one per core, quiet and loaded; and auto's choice in each."""
    cores = len(usable_cores())
    counts = sorted({1, cores})
    torch.manual_seed(args["seed"])
    model = Llama(cfg).eval()
    P, N, L = args["prompt_len"], args["new_tokens"], min(args["score_lengths"])
    prompt = torch.randint(cfg.vocab_size, (P,)).tolist()
    text = torch.randint(cfg.vocab_size, (L,))
    workloads = {  # name: (fn, tokens per call)
        "decode_eager": (lambda: generate(model, [prompt], N, GREEDY), N),
        "decode_native": (lambda: generate(model, [prompt], N, GREEDY, native=True), N),
        "score": (lambda: score_tokens(model, text, chunk=L), L - 1),
    }
    before = torch.get_num_threads()
    tokens_per_s: dict = {}
    auto: dict = {}
    errors: dict = {}
    try:
        for condition in CONDITIONS:
            with background_load(condition == "loaded"):
                auto[condition] = choose_threads("auto", cores=cores, env={}).threads
                fns = {
                    (name, n): lambda fn=fn, n=n: (torch.set_num_threads(n), fn())
                    for name, (fn, _) in workloads.items()
                    for n in counts
                }
                seconds, failed = alternate(fns, args["repeats"], args["warmup"], torch.device("cpu"))
            errors |= {f"{condition}_{name}_{n}": e for (name, n), e in failed.items()}
            tokens_per_s[condition] = {
                name: {str(n): workloads[name][1] / seconds[name, n] for n in counts if (name, n) in seconds}
                for name in workloads
            }
    finally:
        torch.set_num_threads(before)
    return dict(
        cores=cores,
        thread_counts=counts,
        prompt_len=P,
        new_tokens=N,
        score_len=L,
        tokens_per_s=tokens_per_s,  # {condition: {workload: {threads: tokens/s}}}
        auto_threads=auto,  # {condition: the count threads=auto picked while that condition held}
        one_over_all={  # tokens/s with 1 thread / with one per core: > 1 = one thread is faster
            condition: {
                name: t[str(1)] / t[str(cores)]
                for name, t in by_name.items()
                if str(1) in t and str(cores) in t
            }
            for condition, by_name in tokens_per_s.items()
        },
        errors=errors,
    )
