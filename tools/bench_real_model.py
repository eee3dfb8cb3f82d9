"""An imported real model (scripts/import_gguf.py, e.g. make smollm2) beside transformers and llama.cpp in one
process: decode, prefill and scoring throughput, ratios, and each workload's floor on this host.

    python tools/bench_real_model.py ckpt=runs/smollm2 gguf=<the original .gguf> threads=2 lengths=[2048,8192]
    python tools/bench_real_model.py ckpt=runs/smollm2 gguf=... threads=1 load=true   # beside another job

Sides: ours in bf16 and fp32 (decode also through the compiled step and the C step, `native`);
transformers' LlamaForCausalLM with the same weights (bench/peers.py's twin) in bf16 and fp32; llama.cpp on
an f16 re-export of the same weights (our exporter writes f32 / f16: the nearest to bf16), on an f32 one
(decode only: the equal-precision peer of our fp32 step) and on the original quantized file (reported, not
a target). Decode: greedy tokens after a
`prompt_len`-token prompt of a held-out play, the decode steps alone timed. Prefill: the prompt into an empty
KV cache. Scoring: every token's loss (ours: score_tokens in chunks; transformers: one forward and the
cross-entropy of all logits; llama.cpp: an eval with every position's logits). Prefill and scoring are the
best of `repeats` rounds, each round taking every side in turn. Floors: decode, the weight
and KV-cache bytes one token reads over the measured copy bandwidth; prefill, the FLOPs per token over the
measured matmul peak. Prints a markdown table and writes `out` (JSON).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rope_llama.bench.options import parse_options
from rope_llama.bench.peers import held_out_tokens, hf_twin, llama_cpp_model
from rope_llama.bench.threads import background_load
from rope_llama.core.checkpoint import load_checkpoint
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.generation import GREEDY, generate, score_tokens
from rope_llama.interchange.gguf import gguf_writer, save
from rope_llama.kernels import use_kernels
from rope_llama.training.throughput import measure_matmul_peak

DEFAULTS = dict(ckpt="runs/smollm2", gguf=None, threads=2, lengths=[2048, 8192], prompt_len=2048,
                new_tokens=32, chunk=2048, load=False, out="bench-real-model.json", scoring=True, compile=True,
                repeats=2)  # fmt: skip


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth() -> float:
    """Bytes per second of a 512 MiB float32 copy (read + write), best of 3: the decode floor's bandwidth."""
    src = torch.ones(128 * 2**20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return max(2 * src.numel() * 4 / timed(lambda: dst.copy_(src)) for _ in range(3))


def ours_sides(model) -> dict:
    return {
        "ours_bf16": use_kernels(copy.deepcopy(model).to(torch.bfloat16)),
        "ours_fp32": use_kernels(model),
    }


def ours_decode_through(model, prompt: list[int], n: int, **path: bool) -> float:
    """Decode tokens/s through another step: compile=True (torch.compile'd, built in the warm-up call)
    or native=True (the C step of kernels/cpu_decode.c)."""
    return generate(model, [prompt], n, GREEDY, **path).decode_tokens_per_s


def hf_sides(model) -> dict:
    twin = hf_twin(model).eval()
    return {"transformers_bf16": copy.deepcopy(twin).to(torch.bfloat16), "transformers_fp32": twin}


def ours_decode(model, prompt: list[int], n: int) -> tuple[float, float]:
    out = generate(model, [prompt], n, GREEDY)
    return out.prefill_tokens_per_s, out.decode_tokens_per_s


def hf_decode(model, prompt: list[int], n: int) -> tuple[float, float]:
    idx = torch.tensor([prompt])
    t0 = time.perf_counter()
    result = model(idx, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    cache, token = result.past_key_values, result.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(n - 1):
        result = model(token, past_key_values=cache, use_cache=True)
        cache, token = result.past_key_values, result.logits[:, -1].argmax(-1, keepdim=True)
    return len(prompt) / prefill, (n - 1) / (time.perf_counter() - t0)


def llama_cpp_decode(llm, prompt: list[int], n: int) -> tuple[float, float]:
    llm.reset()
    prefill = timed(lambda: llm.eval(prompt))
    t0 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([0])  # the token does not change the cost of a step
    return len(prompt) / prefill, (n - 1) / (time.perf_counter() - t0)


def ours_score(model, tokens: torch.Tensor, chunk: int) -> float:
    return (len(tokens) - 1) / timed(lambda: score_tokens(model, tokens, chunk))


def hf_score(model, tokens: torch.Tensor) -> float:
    def run():
        logits = model(tokens[None, :-1]).logits[0].float()
        F.cross_entropy(logits, tokens[1:])

    return (len(tokens) - 1) / timed(run)


def llama_cpp_score(llm, tokens: list[int]) -> float:
    llm.reset()
    return (len(tokens) - 1) / timed(lambda: llm.eval(tokens[:-1]))


def floors(cfg, n_params: int, context: int, bandwidth: float, peak: dict) -> dict:
    """Upper bounds on tokens/s: decode reads every bf16 weight and the KV cache once per token; prefill
    does 2 FLOPs per weight and the causal attention's 2 x 2 x layers x d_attn x context / 2."""
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * context * 2
    attention = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
    return {
        "decode_bf16": bandwidth / (2 * n_params + kv),
        "prefill_bf16": peak["bf16"] / (2 * n_params + attention),
        "prefill_fp32": peak["fp32"] / (2 * n_params + attention),
    }


@torch.inference_mode()
def main(argv: list[str]) -> dict:
    args = parse_options(argv, DEFAULTS)
    torch.set_num_threads(int(args["threads"]))
    loaded = load_checkpoint(args["ckpt"])
    tok = Tokenizer.from_file(str(loaded.tokenizer_file()))
    model, cfg = loaded.model, loaded.config
    lengths = sorted(int(t) for t in args["lengths"])
    tokens = held_out_tokens(tok, max(lengths + [args["prompt_len"]]) + 1)
    workdir = Path(tempfile.mkdtemp(prefix="bench-real-"))
    exports = {precision: workdir / f"{precision}.gguf" for precision in ("f16", "f32")}
    for precision, path in exports.items():
        save(gguf_writer(cfg, model.state_dict(), tok, precision, name="bench"), path)
    results = {"args": args, "threads": torch.get_num_threads(), "machine": platform_line()}
    results["loadavg"] = {"start": os.getloadavg()}  # 1, 5, 15 minutes: what else the cores were doing
    with background_load(bool(args["load"])):
        bandwidth = copy_bandwidth()
        peak = {name: measure_matmul_peak(torch.device("cpu"), dtype, n=2048)
                for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}  # fmt: skip
        sides = ours_sides(model) | hf_sides(model)
        cpp = {f"llama_cpp_{p}": path for p, path in exports.items()}
        cpp |= {"llama_cpp_original": Path(args["gguf"])} if args["gguf"] else {}
        llms = {name: llama_cpp_model(path, max(lengths) + 64, threads=int(args["threads"]),
                                      extra_buffers=False) for name, path in cpp.items()}  # fmt: skip
        prompt = tokens[: args["prompt_len"]]
        decode, prefill, scoring = {}, {}, {}
        for name, side in sides.items():
            fn = ours_decode if name.startswith("ours") else hf_decode
            fn(side, prompt[:64], 4)  # warm-up
            prefill[name, len(prompt)], decode[name] = fn(side, prompt, args["new_tokens"])
            print(f"[bench] {name}: decode {decode[name]:.1f} tokens/s; {load_line()}", file=sys.stderr)
        paths = [("bf16_native", "bf16", {"native": True}), ("fp32_native", "fp32", {"native": True})]
        paths += [("bf16_compiled", "bf16", {"compile": True})] if args["compile"] else []
        for name, precision, path in paths:  # decode only: these steps serve one-token forwards
            ours_decode_through(sides[f"ours_{precision}"], prompt[:64], 4, **path)
            decode[f"ours_{name}"] = ours_decode_through(
                sides[f"ours_{precision}"], prompt, args["new_tokens"], **path
            )
            print(
                f"[bench] ours_{name}: decode {decode[f'ours_{name}']:.1f} tokens/s; {load_line()}",
                file=sys.stderr,
            )
        for name, llm in llms.items():
            llama_cpp_decode(llm, prompt[:64], 4)
            prefill[name, len(prompt)], decode[name] = llama_cpp_decode(llm, prompt, args["new_tokens"])
            print(f"[bench] {name}: decode {decode[name]:.1f} tokens/s; {load_line()}", file=sys.stderr)
        for length in lengths:
            window = tokens[: length + 1]
            # best of `repeats` rounds, every side once per round: the side measured first at a new
            # length would otherwise pay the one-time costs (kernel selection for new shapes, first-touch
            # pages) alone
            for _ in range(int(args["repeats"])):
                for name, side in sides.items():
                    fn = ours_decode if name.startswith("ours") else hf_decode
                    best(prefill, (name, length), fn(side, window[:length], 2)[0])
                    if args["scoring"]:
                        ids = torch.tensor(window)
                        best(scoring, (name, length), (
                            ours_score(side, ids, int(args["chunk"]))
                            if name.startswith("ours")
                            else hf_score(side, ids)
                        ))  # fmt: skip
                for name, llm in llms.items():
                    if name == "llama_cpp_f32":
                        continue  # decode's equal-precision peer only
                    best(prefill, (name, length), llama_cpp_decode(llm, window[:length], 2)[0])
                    if args["scoring"]:
                        best(scoring, (name, length), llama_cpp_score(llm, window))
            print(f"[bench] length {length} done; {load_line()}", file=sys.stderr)
        for llm in llms.values():
            llm.close()
    results["loadavg"]["end"] = os.getloadavg()
    n_params = model.num_parameters()
    results |= {
        "bandwidth_bytes_per_s": bandwidth,
        "matmul_peak_flops": peak,
        "floors": {
            t: floors(cfg, n_params, t, bandwidth, peak) for t in sorted({args["prompt_len"], *lengths})
        },
        "decode": decode,
        "prefill": {f"{n}@{t}": v for (n, t), v in prefill.items()},
        "scoring": {f"{n}@{t}": v for (n, t), v in scoring.items()},
    }
    Path(args["out"]).write_text(json.dumps(results, indent=2))
    print(markdown(results, args["prompt_len"], lengths))
    return results


def best(table: dict, key, tokens_per_s: float) -> None:
    """Keep the highest tokens/s measured for `key`."""
    table[key] = max(table.get(key, 0.0), tokens_per_s)


def load_line() -> str:
    """The load average now (this process and the load it started included)."""
    return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def platform_line() -> str:
    from rope_llama.kernels.cpuinfo import cpu_model

    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def markdown(r: dict, prompt_len: int, lengths: list[int]) -> str:
    """The tables: tokens/s per side, ours / side ratios (bf16 against bf16 / f16, fp32 against fp32),
    and ours against the floors."""
    floor = r["floors"]
    load = r.get("loadavg", {})
    out = [
        f"load average (1 min) at start {load['start'][0]:.2f}, at end {load['end'][0]:.2f}" if load else ""
    ]
    out += [f"threads {r['threads']}; copy bandwidth {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; matmul peak "
           f"bf16 {r['matmul_peak_flops']['bf16'] / 1e9:.0f}, fp32 {r['matmul_peak_flops']['fp32'] / 1e9:.0f} GFLOP/s", ""]  # fmt: skip
    decode = r["decode"]
    fastest = {p: max(v for k, v in decode.items() if k.startswith(f"ours_{p}")) for p in ("bf16", "fp32")}
    out += [f"| decode (tokens/s, prompt {prompt_len}) | value | ours_bf16 / it | fastest ours at its precision / it |",
            "|---|---|---|---|"]  # fmt: skip
    for name, v in decode.items():
        precision = "fp32" if name.endswith(("fp32", "f32")) or "fp32_" in name else "bf16"
        out.append(
            f"| {name} | {v:.1f} | {decode['ours_bf16'] / v:.2f} | {fastest[precision] / v:.2f} ({precision}) |"
        )
    out.append(
        f"| floor (bf16 bytes / bandwidth) | {floor[prompt_len]['decode_bf16']:.1f} | ours_bf16 = "
        f"{decode['ours_bf16'] / floor[prompt_len]['decode_bf16']:.2f} of it | fastest bf16 = "
        f"{fastest['bf16'] / floor[prompt_len]['decode_bf16']:.2f} of it |"
    )
    for kind in ("prefill", "scoring"):
        if not r[kind]:
            continue
        out += ["", f"| {kind} (tokens/s) | " + " | ".join(str(t) for t in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]  # fmt: skip
        names = list(dict.fromkeys(k.split("@")[0] for k in r[kind]))
        for name in names:
            cells = []
            for t in lengths:
                v = r[kind].get(f"{name}@{t}")
                mine = r[kind].get(f"ours_{'fp32' if name.endswith('fp32') else 'bf16'}@{t}")
                cells.append("-" if v is None else f"{v:.0f} ({mine / v:.2f}x)")
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append(
            "| floor bf16 (FLOPs / peak) | "
            + " | ".join(f"{floor[t]['prefill_bf16']:.0f}" for t in lengths)
            + " |"
        )
    out.append("\n(x) = ours in the same precision / that side; llama.cpp sides are compared with ours_bf16.")
    return "\n".join(out)


if __name__ == "__main__":
    main(sys.argv[1:])
