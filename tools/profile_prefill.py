"""Where one bf16 prefill of an imported model spends its time, ours against transformers' (torch.profiler).

    python tools/profile_prefill.py ckpt=runs/smollm2 length=2048 threads=2

Ours: the model with use_kernels, a KV cache allocated inside the timed call, `last_only=True` (as generate()
runs it); transformers: the bench's twin (bench/peers.py) with `use_cache=True, logits_to_keep=1`. Prints the
best of 3 alternating timings of each and the op table (self CPU time) of one call each. Used in
reports/2026-12-01-real-model-finetune.md.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rope_llama.bench.peers import held_out_tokens, hf_twin
from rope_llama.core.checkpoint import load_checkpoint
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.kernels import use_kernels
from rope_llama.model.kv_cache import KVCache

DEFAULTS = {"ckpt": "runs/smollm2", "length": 2048, "threads": 2}


@torch.inference_mode()
def main(argv: list[str]) -> None:
    args = dict(DEFAULTS) | dict(item.split("=", 1) for item in argv)
    torch.set_num_threads(int(args["threads"]))
    L = int(args["length"])
    loaded = load_checkpoint(args["ckpt"])
    ids = torch.tensor([held_out_tokens(Tokenizer.from_file(str(loaded.tokenizer_file())), L)])
    ours = use_kernels(copy.deepcopy(loaded.model).to(torch.bfloat16)).eval()
    hf = hf_twin(loaded.model).eval().to(torch.bfloat16)

    def ours_prefill():
        cache = KVCache.for_model(ours, 1, L + 32, seq_len=L + 32)
        return ours(ids, position_ids=torch.arange(L)[None], kv_cache=cache, last_only=True)

    sides = {"ours": ours_prefill, "transformers": lambda: hf(ids, use_cache=True, logits_to_keep=1)}
    for fn in sides.values():
        fn()
    times = {name: [] for name in sides}
    for _ in range(3):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"threads {torch.get_num_threads()}; load average {os.getloadavg()}")
    for name, t in times.items():
        print(f"{name}: best {min(t):.3f} s ({L / min(t):.0f} tokens/s), all {[round(x, 3) for x in t]}")
    for name, fn in sides.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        print(f"=== {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main(sys.argv[1:])
