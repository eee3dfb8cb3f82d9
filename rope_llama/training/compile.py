"""`compile=auto`: compile the transformer blocks where the run is long enough to earn the compile back.

`compile=true` compiles each block in place (`compile_blocks`, from LitLlama.configure_model); the blocks
share one code path, so inductor builds it once for all of them. On a 2-core AMX CPU under bf16-mixed that made the default
job's steps 1.3x faster for about 30 s of compiling from a cold cache (docs/performance.md, Time to quality).
`auto` turns it on where those measurements apply: a CPU run in bf16-mixed of at least MIN_STEPS steps,
with a C++ compiler for inductor's CPU kernels. Elsewhere it stays off: in fp32 the compiled blocks were
1.1x, within the host's step-to-step noise (an AVX2-only CPU: 1.09x per step, the same 15 minutes end to
end), and on GPUs compile time against step time was not measured here (set compile=true for long GPU
runs). Explicit true / false are used as given.
"""

from __future__ import annotations

import os
import shutil

import torch

from rope_llama.core.precision import resolve_precision, uses_cuda

AUTO = "auto"
MIN_STEPS = 500  # a cold compile (~30 s) over the ~0.1 s a step saves: break-even near 300 steps on 2 cores
COMPILERS = ("g++", "clang++", "c++")  # what inductor's CPU backend looks for when CXX is not set


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with ($CXX, else the first of COMPILERS), or None."""
    for name in (os.environ.get("CXX"), *COMPILERS):
        if name and shutil.which(name):
            return name
    return None


def compile_blocks(model: torch.nn.Module) -> None:
    """Compile each transformer block of `model` (a model.llama.Llama) in place: parameter names and
    checkpoints unchanged, and one graph for all the blocks, since they share one code path."""
    # A fresh dynamo cache first: in a sweep (train.py -m) every architecture adds its graphs to that code's
    # cache, and past dynamo's recompile limit the later runs would train eager.
    torch.compiler.reset()
    for block in model.blocks:
        block.compile()


def resolve_compile(
    requested: bool | str, precision: str | int, accelerator: str, max_steps: int
) -> tuple[bool, str]:
    """(compile the blocks?, the reason in words) for the `compile` setting of a run.

    precision and accelerator: the trainer's settings (precision may be `auto`); max_steps: the run's length.
    """
    if isinstance(requested, bool):
        return requested, "set explicitly"
    if requested != AUTO:
        raise ValueError(f"compile must be true, false or auto, got {requested!r}.")
    if uses_cuda(accelerator):
        return False, "auto compiles on CPUs only; its gain on GPUs was not measured here"
    if (resolved := resolve_precision(precision, accelerator)[0]) != "bf16-mixed":
        return False, f"auto compiles bf16-mixed runs only, not {resolved} (in fp32 the blocks gained 1.1x)"
    if max_steps < MIN_STEPS:
        return False, f"{max_steps} steps do not earn back compiling; auto needs {MIN_STEPS}+ steps"
    if (compiler := cxx_compiler()) is None:
        return False, f"no C++ compiler for inductor's CPU kernels: looked for $CXX, {', '.join(COMPILERS)}"
    return True, f"a {max_steps}-step bf16 CPU run earns back compiling its blocks, with {compiler}"
