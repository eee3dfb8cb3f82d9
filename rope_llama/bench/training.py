"""tools/bench.py's training section: a training step of ours and of each peer, in each requested
precision, with MFU against the measured matmul peak; and the time-to-quality section."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from rope_llama.bench.peers import build_models, logits_fn
from rope_llama.bench.time_to_quality import main as time_to_quality_runs
from rope_llama.bench.timing import PRECISIONS, alternate, autocast, compute_dtype, ratios
from rope_llama.core.precision import AUTO, bf16_is_native, expand_auto
from rope_llama.model.config import ModelConfig


def resolve_train_precisions(names: list[str], device: torch.device) -> list[str]:
    """`auto` -> bf16 where the device multiplies bf16 matrices natively, nothing elsewhere: emulated
    bf16 matmuls would make the training section take hours."""
    if AUTO not in names:
        return names
    native, reason = bf16_is_native(device.type)
    print(
        f"[bench] train_precisions=[auto]: {'' if native else 'no '}bf16 training rows ({reason})",
        file=sys.stderr,
    )
    return expand_auto(names, ["bf16"] if native else [])


def bench_train(
    cfg: ModelConfig, shape: str, args: dict, peers: dict, device, compiled: bool, dtype: torch.dtype
) -> dict:
    """Tokens/s of forward + backward + AdamW step, identical loss and optimizer on every side."""
    B, L = args["batch"], args["seq_len"]
    models = build_models(cfg, peers, device, L, args["seed"])
    idx = torch.randint(cfg.vocab_size, (B, L + 1), device=device)
    inputs, targets = idx[:, :-1], idx[:, 1:]

    def step_fn(side, model):
        model.train()
        forward = logits_fn(side, torch.compile(model) if compiled else model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def loss_fn():  # each side's own training loss: ours fuses the LM head into it (kernels/loss.py)
            if side == "ours":
                return forward(inputs, targets=targets)
            return F.cross_entropy(forward(inputs).flatten(0, 1).float(), targets.flatten())

        def step():
            with autocast(device, dtype):
                loss = loss_fn()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    seconds, errors = alternate(
        {side: step_fn(side, m) for side, m in models.items()}, args["repeats"], args["warmup"], device
    )
    tokens_per_s = {side: B * L / s for side, s in seconds.items()}
    flops_per_token = models["ours"].flops_per_token(L)
    return dict(
        shape=shape,
        compile=compiled,
        dtype=str(dtype).removeprefix("torch."),
        batch=B,
        seq_len=L,
        parameters=models["ours"].num_parameters(),
        tokens_per_s=tokens_per_s,
        ratio=ratios(tokens_per_s),
        flops_per_token=flops_per_token,
        achieved_flops=flops_per_token * tokens_per_s.get("ours", float("nan")),
        errors=errors,
    )


def train_dtypes(args: dict, device: torch.device) -> list[torch.dtype]:
    """`precision`'s dtype first (the targets read it), then each of `train_precisions` not yet in."""
    dtypes = [compute_dtype(args, device)]
    for name in args["train_precisions"]:
        if PRECISIONS[name] not in dtypes:
            dtypes.append(PRECISIONS[name])
    return dtypes


def time_to_quality(args: dict) -> list[dict]:
    """tools/time_to_quality.py's recipes (real train.py runs on the default data), in a subprocess each."""
    out = Path(args["out"]).with_suffix(".ttq.json")
    thresholds = ",".join(str(t) for t in args["ttq_thresholds"])
    return time_to_quality_runs(
        [f"recipes=[{','.join(args['ttq_recipes'])}]", f"thresholds=[{thresholds}]", f"out={out}"]
    )
