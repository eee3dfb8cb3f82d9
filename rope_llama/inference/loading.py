"""A checkpoint ready to run: model on its device and dtype, RoPE and extension overrides applied, and
its tokenizer.

    ckpt, tokenizer = load_model("runs/default", device="auto", dtype="float32", rope={"scaling": "ntk", "factor": 8})

What generate.py and the scripts load; the checkpoint format itself is core/checkpoint.py's.
"""

from __future__ import annotations

import sys

from rope_llama.core.checkpoint import LoadedCheckpoint, load_checkpoint
from rope_llama.core.device import resolve_device, resolve_dtype
from rope_llama.core.precision import inference_dtype
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.generation import GenerationError
from rope_llama.kernels import use_kernels
from rope_llama.model.context import resolve_positions


def load_model(
    ckpt: str,
    device: str = "auto",
    dtype: str = "float32",
    rope: dict | None = None,
    extend: dict | None = None,
) -> tuple[LoadedCheckpoint, Tokenizer]:
    """Checkpoint (file or run directory) -> model on `device` in `dtype` (`auto`: `inference_dtype`),
    with `rope` (a configs/rope group's values) replacing the checkpoint's RoPE scaling and `extend`
    (a configs/extend group's) its attention extension when given, + its tokenizer."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(inference_dtype(dtype, torch_device)[0])  # before the (slow) load
    loaded = load_checkpoint(ckpt)
    tokenizer = Tokenizer.from_file(str(loaded.tokenizer_file()))
    if tokenizer.vocab_size > loaded.config.vocab_size:
        raise GenerationError(
            f"The tokenizer has {tokenizer.vocab_size} tokens but the model only {loaded.config.vocab_size}."
        )
    new_rope, new_extend = resolve_positions(loaded.config, rope, extend)
    if new_rope.base != loaded.config.rope.base:
        print(
            f"note: rope base {new_rope.base} differs from the checkpoint's {loaded.config.rope.base}.",
            file=sys.stderr,
        )
    # the fused scoring head and the remaps' merge; model/'s plain ops stay the reference
    use_kernels(loaded.model)
    loaded.model.to(device=torch_device, dtype=torch_dtype)
    # after the cast: RoPE frequencies stay float32 in a bf16/fp16 model
    loaded.model.use_positions(new_rope, new_extend)
    return loaded, tokenizer
