"""tools/bench.py's scoring section: the per-token loss of a long window, the evaluation's workload.

Ours is `score_tokens` as scripts/eval_extrapolation.py runs it (the kernels installed, `score_chunk`
tokens per forward); transformers' is its forward of the same weights with a per-token cross-entropy
of the logits, the way a Hugging Face script scores text. Both in float32, and in bfloat16 where the
device multiplies it natively (every side alike). Every remap (model/extend.py: Self-Extend, STRING,
DCA, ReRoPE, leaky ReRoPE, each at its defaults) is timed against plain attention at the longest
length, same weights, ours only, all in one interleaved run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rope_llama.bench.generation import extension_models
from rope_llama.bench.peers import build_models
from rope_llama.bench.timing import alternate, ratios
from rope_llama.core.precision import bf16_is_native
from rope_llama.inference.generation import score_tokens
from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import REMAP_METHODS, remap_parameters


def scoring_dtypes(device: torch.device) -> list[torch.dtype]:
    """float32 always; bfloat16 where `precision=auto` would train in it."""
    native, _ = bf16_is_native("cuda" if device.type == "cuda" else "cpu")
    return [torch.float32, *([torch.bfloat16] if native else [])]


def hf_token_losses(model, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' forward over tokens[:, :-1] and the cross-entropy of each next token: (B, T)."""
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")


@torch.inference_mode()
def bench_scoring(cfg: ModelConfig, args: dict, peers: dict, device: torch.device) -> dict:
    """tokens/s of scoring each of `score_lengths` tokens, ours and transformers', per dtype; and ours
    with each remap over plain attention at the longest length (`bench_remap_scoring`)."""
    lengths, chunk = list(args["score_lengths"]), args["score_chunk"]
    longest = max(lengths)
    peer = {p: v for p, v in peers.items() if p == "transformers"}
    results: dict = {"lengths": lengths, "chunk": chunk, "tokens_per_s": {}, "ratio": {}, "errors": {}}
    for dtype in scoring_dtypes(device):
        name = str(dtype).removeprefix("torch.")
        models = {
            side: m.eval().to(dtype)
            for side, m in build_models(cfg, peer, device, longest, args["seed"]).items()
        }
        for length in lengths:
            tokens = torch.randint(cfg.vocab_size, (1, length + 1), device=device)
            fns = {"ours": lambda t=tokens, m=models["ours"]: score_tokens(m, t, chunk)}
            if "transformers" in models:
                fns["transformers"] = lambda t=tokens, m=models["transformers"]: hf_token_losses(m, t)
            seconds, errors = alternate(fns, args["repeats"], 1, device)
            rates = {side: length / s for side, s in seconds.items()}
            results["tokens_per_s"][f"{name}_{length}"] = rates
            results["ratio"][f"{name}_{length}"] = ratios(rates)
            results["errors"] |= {f"{side} {name} {length}": e for side, e in errors.items()}
    results["remaps"] = bench_remap_scoring(cfg, args, device, longest)
    results["errors"] |= {f"remap {side}": e for side, e in results["remaps"].pop("errors").items()}
    return results


@torch.inference_mode()
def bench_remap_scoring(cfg: ModelConfig, args: dict, device: torch.device, length: int) -> dict:
    """float32 scoring of one `length`-token window (`score_chunk` tokens per forward) with each remap
    at its defaults (L0 = seq_len) and without ("off"), same weights, the calls interleaved:
    tokens/s per side and each method's over_plain = its tokens/s / plain's (>= 1: no slower)."""
    models, extends = extension_models(cfg, args, device, torch.float32, REMAP_METHODS)
    tokens = torch.randint(cfg.vocab_size, (1, length + 1), device=device)
    fns = {side: lambda m=m: score_tokens(m, tokens, args["score_chunk"]) for side, m in models.items()}
    seconds, errors = alternate(fns, args["repeats"], 1, device)
    return dict(
        length=length,
        parameters={m: remap_parameters(e) for m, e in extends.items()},
        tokens_per_s={side: length / s for side, s in seconds.items()},
        over_plain={m: seconds["off"] / seconds[m] for m in extends if {"off", m} <= seconds.keys()},
        errors=errors,
    )
