"""What bounds one decode step of an imported model: the step against its own matrix-vector products.

    python tools/profile_decode.py ckpt=runs/smollm2 threads=2 prompt_len=2048

Times, per generated token after a `prompt_len`-token prompt: (1) generate()'s eager and compiled decode
steps in bf16; (2) every weight matrix of the model times one vector, alone, in a loop (torch's
matrix-vector kernel on the same bf16 weights: what the step cannot go below without another kernel), and
the bytes it reads over that time; (3) one query's attention over the cached keys per block, as the model's
attention runs it and as PyTorch's flash op does. Then the op
table (self CPU time) of 16 eager steps. Used in reports/2026-12-02-real-model-bench.md.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from rope_llama.bench.peers import held_out_tokens
from rope_llama.core.checkpoint import load_checkpoint
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.generation import GREEDY, generate
from rope_llama.kernels import use_kernels

DEFAULTS = {"ckpt": "runs/smollm2", "threads": 2, "prompt_len": 2048, "new_tokens": 32, "dtype": "bfloat16"}


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.inference_mode()
def main(argv: list[str]) -> None:
    args = dict(DEFAULTS) | dict(item.split("=", 1) for item in argv)
    torch.set_num_threads(int(args["threads"]))
    P, N, dtype = int(args["prompt_len"]), int(args["new_tokens"]), getattr(torch, args["dtype"])
    loaded = load_checkpoint(args["ckpt"])
    prompt = held_out_tokens(Tokenizer.from_file(str(loaded.tokenizer_file())), P)
    model = use_kernels(copy.deepcopy(loaded.model).to(dtype)).eval()
    cfg = model.config
    print(f"threads {torch.get_num_threads()}; dtype {dtype}; load average {os.getloadavg()}")

    steps = {}
    for name, options in (("eager", {}), ("compiled", {"compile": True})):
        generate(model, [prompt], 4, GREEDY, **options)  # warm-up: shapes, the compiled graph
        stats = max((generate(model, [prompt], N, GREEDY, **options) for _ in range(2)),
                    key=lambda s: s.decode_tokens_per_s)  # fmt: skip
        steps[name] = 1 / stats.decode_tokens_per_s
        print(
            f"decode {name}: {stats.decode_tokens_per_s:.1f} tokens/s ({1e3 * steps[name]:.2f} ms per token)"
        )

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    vectors = {id(m): torch.randn(1, m.in_features, dtype=dtype) for m in linears}
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)

    def matvecs():
        for m in linears:
            F.linear(vectors[id(m)], m.weight)

    matvec = best_seconds(matvecs)
    print(f"matrix-vector products alone: {1e3 * matvec:.2f} ms per token, {len(linears)} matrices, "
          f"{weight_bytes / 1e6:.0f} MB at {weight_bytes / matvec / 1e9:.1f} GB/s")  # fmt: skip
    head = model.lm_head
    head_s = best_seconds(lambda: F.linear(vectors[id(head)], head.weight))
    print(f"  of which the head ({head.out_features} x {head.in_features}): {1e3 * head_s:.2f} ms")

    q = torch.randn(1, cfg.n_heads, 1, cfg.head_dim, dtype=dtype)
    k = torch.randn(1, cfg.n_kv_heads or cfg.n_heads, P, cfg.head_dim, dtype=dtype)
    attn = model.blocks[0].attn  # with use_kernels: the decode path the steps take
    attention = cfg.n_layers * best_seconds(lambda: attn.attend(q, k, k, None, False, 0.0), repeats=20)
    flash = cfg.n_layers * best_seconds(
        lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True), repeats=20
    )
    print(f"attention of one query over {P} cached keys, {cfg.n_layers} blocks: {1e3 * attention:.2f} ms "
          f"(PyTorch's flash op on the same inputs: {1e3 * flash:.2f} ms)")  # fmt: skip
    for name, seconds in steps.items():
        rest = seconds - matvec - attention
        print(f"{name}: matvecs {matvec / seconds:.0%}, attention {attention / seconds:.0%}, "
              f"the rest {1e3 * rest:.2f} ms ({rest / seconds:.0%})")  # fmt: skip

    generate(model, [prompt], 4, GREEDY)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, [prompt[:64]], 16, GREEDY)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))


if __name__ == "__main__":
    main(sys.argv[1:])
