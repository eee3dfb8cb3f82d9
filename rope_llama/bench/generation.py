"""tools/bench.py's generation sections: prefill and decode of ours (eager, compiled, the C step) and of
each peer, decode latency against context length, and Self-Extend against plain attention."""

from __future__ import annotations

import random
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from rope_llama.bench.peers import LLAMA_CPP, LlamaCppTwin, build_models, write_llama_cpp_gguf
from rope_llama.bench.timing import alternate, compute_dtype, ratios, sync
from rope_llama.inference.generation import GREEDY, CompiledStep, EagerStep, generate
from rope_llama.kernels import use_kernels
from rope_llama.kernels.cpu_decode import DEFINES, NativeStep
from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import ExtendConfig
from rope_llama.model.kv_cache import KVCache
from rope_llama.model.llama import Llama

DECODERS = {"native": dict(native=True), "compiled": dict(compile=True), "eager": {}}  # generate() kwargs


def our_decoders(args: dict, device: torch.device) -> list[str]:
    """Our decode paths to time, fastest first: the first is "ours" in the ratios and the targets,
    the others are reported beside it as ours_<path>. The C step runs on the CPU in float32 or bf16."""
    native = args["native_decode"] and device.type == "cpu" and compute_dtype(args, device) in DEFINES
    return ["native"] * native + ["compiled"] * bool(args["compile_decode"]) + ["eager"]


def our_side(decoders: list[str], path: str) -> str:
    return "ours" if path == decoders[0] else f"ours_{path}"


def generation_fns(
    models: dict, prompt: torch.Tensor, decoders: list[str], llama_cpp: LlamaCppTwin | None = None
) -> dict[str, Callable[[int], object]]:
    """{side: fn(new_tokens)}: greedy batch-1 generation with each side's own generate and KV cache,
    ours once per decode path (our_decoders), llama.cpp through its decode loop (LlamaCppTwin)."""
    ours = models["ours"]
    fns = {
        our_side(decoders, path): lambda n, kwargs=DECODERS[path]: generate(
            ours, [prompt.tolist()], n, GREEDY, **kwargs
        )
        for path in decoders
    }
    if "transformers" in models:
        hf = models["transformers"]
        fns["transformers"] = lambda n: hf.generate(
            prompt[None], do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
        )
    if "litgpt" in models:
        from litgpt.generate.base import generate as litgpt_generate

        gpt = models["litgpt"]
        gpt.set_kv_cache(batch_size=1, device=prompt.device)
        fns["litgpt"] = lambda n: litgpt_generate(gpt, prompt, prompt.numel() + n, temperature=0.0)
    if llama_cpp is not None:
        fns[LLAMA_CPP] = lambda n: llama_cpp.generate(prompt.tolist(), n)
    return fns


def bench_generate(cfg: ModelConfig, args: dict, peers: dict, device, llama_cpp_dir: Path | None) -> dict:
    """Prefill and decode tokens/s. Each side's prefill is timed as a 1-token generation, and decode
    as the extra time of an N-token one, so the same method applies to every generate().
    llama_cpp_dir: where llama.cpp's GGUF of the same model goes (None: llama.cpp is not timed)."""
    P, N = args["prompt_len"], args["new_tokens"]
    dtype = compute_dtype(args, device)
    models = build_models(cfg, peers, device, P + N, args["seed"])
    models = {side: m.eval().to(dtype) for side, m in models.items()}
    prompt = torch.randint(cfg.vocab_size, (P,), device=device)
    decoders = our_decoders(args, device)
    twin = None
    if llama_cpp_dir is not None:
        twin = LlamaCppTwin(write_llama_cpp_gguf(models["ours"], llama_cpp_dir), n_ctx=P + N)
    fns = generation_fns(models, prompt, decoders, twin)

    def timed(n):
        return {side: torch.inference_mode()(lambda f=f: f(n)) for side, f in fns.items()}

    first, errors = alternate(timed(1), args["repeats"], args["warmup"], device)
    full, errors_full = alternate(timed(N), args["repeats"], args["warmup"], device)
    if twin is not None:
        twin.close()
    both = first.keys() & full.keys()
    prefill = {side: P / first[side] for side in both}
    decode = {side: (N - 1) / max(full[side] - first[side], 1e-9) for side in both}
    cache = KVCache.for_model(models["ours"], 1, P + N)
    return dict(
        decoders=decoders,  # decoders[0] is "ours"
        prompt_len=P,
        new_tokens=N,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        ratio_prefill=ratios(prefill),
        ratio_decode=ratios(decode),
        kv_cache_bytes=cache.nbytes,  # ours: the preallocated cache of this generation
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        * 1024,  # process peak so far (Linux: KiB)
        peak_cuda_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        errors={**errors, **errors_full},
    )


@torch.inference_mode()
def bench_decode_latency(cfg: ModelConfig, args: dict, device, llama_cpp_dir: Path | None) -> dict:
    """Seconds per one-token step of each of our decode paths (our_decoders; the first is "ours")
    and of llama.cpp (llama_cpp_dir not None) with exactly `ctx` tokens in the cache, for each
    context. The cache is rewound to `ctx` before every timed step, so each one decodes at the same
    context. Contexts (and paths) take turns in blocks of `latency_block` consecutive steps: one
    context's consecutive steps are what a generation does (its cache stays warm from step to step,
    where a step-by-step rotation over five caches evicts it), and the turns still spread load
    drifts over all contexts."""
    contexts, steps = args["contexts"], args["latency_steps"]
    block = max(1, min(args["latency_block"], steps))
    torch.manual_seed(args["seed"])
    dtype = compute_dtype(args, device)
    model = Llama(cfg).to(device).eval().to(dtype)
    paths = our_decoders(args, device)
    gguf_path = None if llama_cpp_dir is None else write_llama_cpp_gguf(model, llama_cpp_dir)
    caches, steppers, twins, tokens = {}, {}, {}, {}
    for ctx in contexts:
        capacity = ctx + 1  # the prompt and the one slot every timed step writes
        caches[ctx] = KVCache.for_model(model, 1, capacity, seq_len=capacity)
        positions = torch.arange(capacity, device=device)[None]
        for path in paths:  # every path writes the same slot of the same cache
            step_class = {"native": NativeStep, "compiled": CompiledStep, "eager": EagerStep}[path]
            steppers[ctx, path] = step_class(model, caches[ctx], positions)
        prompt = torch.randint(cfg.vocab_size, (1, ctx), device=device)
        first = model(prompt, kv_cache=caches[ctx])[:, -1:].argmax(-1)
        tokens |= {(ctx, path): first for path in paths}
        if gguf_path is not None:
            twins[ctx] = LlamaCppTwin(gguf_path, n_ctx=capacity)
            tokens[ctx, LLAMA_CPP] = twins[ctx].next_token(prompt[0].tolist())

    def step(ctx: int, path: str) -> None:
        if path == LLAMA_CPP:
            tokens[ctx, path] = twins[ctx].step_at(ctx, tokens[ctx, path])
            return
        caches[ctx].rewind(ctx)  # the step attends over exactly ctx cached tokens + itself
        tokens[ctx, path] = steppers[ctx, path](tokens[ctx, path]).argmax(-1, keepdim=True)

    keys = list(tokens)
    for key in keys:  # one untimed step each: first-call allocations (and the compile)
        step(*key)
    times: dict[tuple, list[float]] = {key: [] for key in keys}
    order = random.Random(args["seed"])
    for _ in range(-(-steps // block)):
        # A new order each round: in a fixed one a block always follows the same other block, and what
        # that one leaves in the caches biases it (docs/performance.md, Decode latency growth).
        for key in order.sample(keys, len(keys)):
            for _ in range(block):
                sync(device)
                t0 = time.perf_counter()
                step(*key)
                sync(device)
                times[key].append(time.perf_counter() - t0)
    for twin in twins.values():
        twin.close()
    by_path = {
        path: {str(ctx): statistics.median(times[ctx, path]) for ctx in contexts}
        for path in [*paths, *([LLAMA_CPP] if twins else [])]
    }
    growth = {path: s[str(max(contexts))] / s[str(min(contexts))] for path, s in by_path.items()}
    peers = {LLAMA_CPP: by_path.pop(LLAMA_CPP)} if twins else {}
    return dict(
        decoder=paths[0],
        seconds_per_token=by_path[paths[0]],
        kv_cache_bytes={str(ctx): c.nbytes for ctx, c in caches.items()},
        longest_over_shortest=growth[paths[0]],
        seconds_per_token_by_decoder=by_path,
        longest_over_shortest_by_decoder={path: growth[path] for path in paths},
        peer_seconds_per_token=peers,  # llama.cpp's steps, timed in the same rotation
        peer_longest_over_shortest={peer: growth[peer] for peer in peers},
        ratio_by_context={  # ours (the first path) / peer in tokens/s: > 1 = ours faster at that context
            peer: {ctx: s / by_path[paths[0]][ctx] for ctx, s in seconds.items()}
            for peer, seconds in peers.items()
        },
    )


def extension_models(
    cfg: ModelConfig, args: dict, device, dtype: torch.dtype, methods: tuple[str, ...]
) -> tuple[dict, dict]:
    """({"off": model, method: the same weights with that extension (its defaults, L0 = seq_len), ...},
    {method: its ExtendConfig}), with the kernels installed, as inference loads models."""
    torch.manual_seed(args["seed"])
    off = use_kernels(Llama(cfg)).to(device).eval().to(dtype)
    models, extends = {"off": off}, {}
    for method in methods:
        extends[method] = ExtendConfig(method=method, original_max_len=args["seq_len"])
        model = use_kernels(Llama(replace(cfg, extend=extends[method]))).to(device).eval().to(dtype)
        model.load_state_dict(off.state_dict())
        models[method] = model
    return models, extends


@torch.inference_mode()
def bench_self_extend(cfg: ModelConfig, args: dict, device) -> dict:
    """Our own cost of Self-Extend (model/extend.py, default window and group): prefill of
    `extend_context` tokens through the KV cache, and one-token decode steps with that many tokens
    cached (the cache rewound before each, as in bench_decode_latency), with the extension off and on,
    same weights, eager and compiled decode (the C step does not implement it)."""
    ctx, steps = args["extend_context"], args["latency_steps"]
    models, extends = extension_models(cfg, args, device, compute_dtype(args, device), ("self_extend",))
    models, extend = {"off": models["off"], "on": models["self_extend"]}, extends["self_extend"]
    prompt = torch.randint(cfg.vocab_size, (1, ctx), device=device)
    caches = {side: KVCache.for_model(m, 1, ctx + 1, seq_len=ctx + 1) for side, m in models.items()}

    def prefill(side: str) -> torch.Tensor:
        caches[side].reset()
        return models[side](prompt, kv_cache=caches[side])[:, -1:].argmax(-1)

    seconds, errors = alternate(
        {side: lambda s=side: prefill(s) for side in models}, args["repeats"], 1, device
    )
    paths = ["compiled"] * bool(args["compile_decode"]) + ["eager"]
    positions = torch.arange(ctx + 1, device=device)[None]
    steppers, tokens = {}, {}
    for side, model in models.items():
        first = prefill(side)
        for path in paths:
            steppers[side, path] = {"compiled": CompiledStep, "eager": EagerStep}[path](
                model, caches[side], positions
            )
            tokens[side, path] = first

    def step(key: tuple[str, str]) -> None:
        caches[key[0]].rewind(ctx)  # every step attends over exactly ctx cached tokens + itself
        tokens[key] = steppers[key](tokens[key]).argmax(-1, keepdim=True)

    decode, decode_errors = alternate({key: lambda k=key: step(k) for key in steppers}, steps, 1, device)
    timed = {"prefill": seconds} | {path: {s: decode[s, p] for s, p in decode if p == path} for path in paths}
    return dict(
        context=ctx,
        window=extend.window,
        group=extend.group,
        prefill_tokens_per_s={side: ctx / s for side, s in seconds.items()},
        decode_tokens_per_s={f"{side}_{path}": 1 / s for (side, path), s in decode.items()},
        on_over_off={  # tokens/s with Self-Extend / without: < 1 = it costs that much (a side that failed: none)
            what: s["off"] / s["on"] for what, s in timed.items() if s.keys() == {"off", "on"}
        },
        kv_cache_bytes={side: c.nbytes for side, c in caches.items()},
        errors={**errors, **{f"{s}_{p}": e for (s, p), e in decode_errors.items()}},
    )
