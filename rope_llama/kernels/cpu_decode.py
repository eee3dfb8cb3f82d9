"""The C decode step (kernels/cpu_decode.c): built once per machine, bound with ctypes, called per token.

A drop-in for generation's eager one-token step (inference/generation.py `EagerStep`), checked
against the torch forward (tests/test_generate.py). `generate(..., native=True)` (and
`generate.py native=true`) decodes through it: one sequence, on the CPU, weights and KV cache in float32
or in bfloat16 (a second library built with -DROPE_BF16; activations stay float32). The prompt still
goes through the torch forward, which fills the same KV cache the C step then reads and extends.
Why C: kernels/cpu_decode.c, first comment.

The library is compiled with the system's C compiler (`$CC`, else `cc`) and OpenMP, for this CPU
(-march=native), into ~/.cache/rope-llama/ (or $XDG_CACHE_HOME) under a name hashed from the source,
the flags, the compiler and the CPU's features, so an edited source or another CPU (a home
directory shared by a cluster's nodes) builds anew and a finished library is never rebuilt. It
links the libgomp torch has already loaded, so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from rope_llama.kernels.cpuinfo import cpuinfo_value
from rope_llama.kernels.rms_norm import rms_norm_eps

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
# gcc gives AVX-512 CPUs 256-bit vectors by default; 512-bit ones read the weights faster
# (docs/performance.md). Other compilers or CPUs may refuse the flag: the build then retries without it.
WIDE_VECTORS = ["-mprefer-vector-width=512"]


class NativeDecodeUnavailable(RuntimeError):
    """The C decode step cannot serve this generation (the message says why)."""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rope-llama"


def c_compiler() -> str:
    name = os.environ.get("CC") or "cc"
    found = shutil.which(name)
    if found is None:
        raise NativeDecodeUnavailable(f"native decoding needs a C compiler; {name!r} was not found (set CC).")
    return found


def build(compiler: str, target: Path, defines: tuple[str, ...] = ()) -> None:
    """Compile SOURCE (with the -D `defines`) into `target`, atomically: a concurrent process sees the
    whole library or none."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        workdir = tempfile.TemporaryDirectory(dir=target.parent)
    except OSError as e:
        raise NativeDecodeUnavailable(
            f"cannot write the compiled C step to {target.parent}: {e.strerror}; "
            "set XDG_CACHE_HOME to a writable directory."
        ) from None
    with workdir as tmp:
        out = Path(tmp) / target.name
        for flags in (FLAGS + WIDE_VECTORS, FLAGS):
            run = subprocess.run(
                [compiler, *flags, *defines, str(SOURCE), "-o", str(out), "-lm"],
                capture_output=True,
                text=True,
            )
            if run.returncode == 0:
                os.replace(out, target)
                return
        reason = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise NativeDecodeUnavailable(f"compiling {SOURCE.name} with {compiler} failed: {reason}")


class _Model(ctypes.Structure):
    """kernels/cpu_decode.c's Model struct, field for field."""

    _fields_ = [
        *[
            (name, ctypes.c_int)
            for name in (
                "n_layers",
                "d_model",
                "n_heads",
                "n_kv_heads",
                "head_dim",
                "ffn_hidden",
                "vocab",
                "rotary_dim",
                "interleaved",
                "capacity",
                "n_threads",
            )
        ],
        ("eps", ctypes.c_float),
        *[(name, ctypes.c_void_p) for name in ("embed", "head", "final_norm")],
        *[
            (name, ctypes.POINTER(ctypes.c_void_p))
            for name in ("attn_norm", "qkv", "o_proj", "mlp_norm", "gate_up", "down", "k_cache", "v_cache")
        ],
        *[(name, ctypes.c_void_p) for name in ("x", "xn", "qkv_out", "attn", "ffn", "hidden", "scores")],
    ]


def cpu_features() -> str:
    """The CPU's feature flags (Linux), else its name: part of the library's cache key, since
    -march=native code built on one CPU may crash on another sharing the same home directory."""
    return cpuinfo_value("flags", "Features") or platform.processor()


# The library for each storage dtype of weights and KV cache: its -D switches.
DEFINES = {torch.float32: (), torch.bfloat16: ("-DROPE_BF16",)}


@functools.cache
def library(dtype: torch.dtype = torch.float32) -> ctypes.CDLL:
    """The compiled C step for weights and cache in `dtype`, built on first use and loaded once per process."""
    compiler, defines = c_compiler(), DEFINES[dtype]
    key = [
        SOURCE.read_bytes(),
        " ".join(FLAGS + list(defines)).encode(),
        compiler.encode(),
        cpu_features().encode(),
    ]
    tag = hashlib.sha256(b"\0".join(key)).hexdigest()[:16]
    target = cache_dir() / f"cpu_decode-{platform.machine()}-{tag}.so"
    if not target.exists():
        build(compiler, target, defines)
    lib = ctypes.CDLL(str(target))
    pointer = ctypes.c_void_p
    lib.native_step.argtypes = [ctypes.POINTER(_Model), ctypes.c_int, ctypes.c_int, pointer, pointer, pointer]
    lib.native_step.restype = None
    return lib


def check_supported(model, cache) -> None:
    """Raise NativeDecodeUnavailable with the reason unless the C step computes exactly this model."""
    tensors = [*model.parameters(), *cache.k, *cache.v]
    if any(t.device.type != "cpu" for t in tensors):
        raise NativeDecodeUnavailable("native decoding runs on the CPU; the model or its cache is elsewhere.")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= set(DEFINES):
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise NativeDecodeUnavailable(
            f"native decoding runs with every weight and the KV cache in float32 or in bfloat16; got {names}."
        )
    if cache.batch_size != 1 or cache.key_mask is not None:
        raise NativeDecodeUnavailable(
            f"native decoding runs one sequence; got a batch of {cache.batch_size} (use compile=true)."
        )
    if any(not t.is_contiguous() for t in tensors):  # the C code reads every tensor row-major
        raise NativeDecodeUnavailable("native decoding needs contiguous weight and KV-cache tensors.")
    if model.config.extend.method != "none":
        raise NativeDecodeUnavailable(
            f"native decoding does not implement extend={model.config.extend.method}; use compile=true."
        )
    if model.config.mix_previous_tokens:
        raise NativeDecodeUnavailable(
            "native decoding does not implement model.mix_previous_tokens; use compile=true."
        )
    if model.training and model.config.dropout > 0:
        raise NativeDecodeUnavailable("native decoding has no dropout; call model.eval() first.")


class NativeStep:
    """The C decode step with generation.EagerStep's contract: token ids (1, 1) -> logits (1, V).

    Writes the token's key and value at slot `cache.length` and advances the cache. cos/sin of every
    position of the generation are gathered once here (position_ids: (1, slots)), so a step does no
    torch work besides allocating its logits.
    """

    def __init__(self, model, cache, position_ids: torch.Tensor):
        check_supported(model, cache)
        self.lib, self.cache = library(model.embed.weight.dtype), cache
        cfg, blocks = model.config, model.blocks
        # cos/sin of every slot's position, (1, slots, R) -> (slots, R)
        cos, sin = model.rope.cos_sin(position_ids, torch.float32, seq_len=cache.seq_len)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        scratch = {
            "x": cfg.d_model,
            "xn": cfg.d_model,
            "qkv_out": (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim,
            "attn": cfg.n_heads * cfg.head_dim,
            "ffn": 2 * cfg.ffn_hidden,
            "hidden": cfg.ffn_hidden,
            "scores": cfg.n_heads * cache.capacity,
        }
        self._buffers = {name: torch.empty(size) for name, size in scratch.items()}
        self._tables = {}  # ctypes pointer arrays: kept alive as long as the struct points at them

        def table(name: str, tensors: list[torch.Tensor]):
            self._tables[name] = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
            return self._tables[name]

        self.model_struct = _Model(
            n_layers=cfg.n_layers,
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            ffn_hidden=cfg.ffn_hidden,
            vocab=cfg.vocab_size,
            rotary_dim=self.cos.shape[-1],
            interleaved=int(cfg.rope.layout != "half"),
            capacity=cache.capacity,
            n_threads=torch.get_num_threads(),  # the same thread count torch uses
            eps=rms_norm_eps(blocks[0].attn_norm, torch.float32),  # every norm of the model has the same eps
            embed=model.embed.weight.data_ptr(),
            head=model.lm_head.weight.data_ptr(),
            final_norm=model.norm.weight.data_ptr(),
            attn_norm=table("attn_norm", [b.attn_norm.weight for b in blocks]),
            qkv=table("qkv", [b.attn.qkv.weight for b in blocks]),
            o_proj=table("o_proj", [b.attn.o_proj.weight for b in blocks]),
            mlp_norm=table("mlp_norm", [b.mlp_norm.weight for b in blocks]),
            gate_up=table("gate_up", [b.mlp.gate_up.weight for b in blocks]),
            down=table("down", [b.mlp.down_proj.weight for b in blocks]),
            k_cache=table("k_cache", cache.k),
            v_cache=table("v_cache", cache.v),
            **{name: t.data_ptr() for name, t in self._buffers.items()},
        )
        self.vocab_size, self.row_bytes = cfg.vocab_size, self.cos.shape[-1] * self.cos.element_size()

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        cache.check_room(1)
        slot, token_id = cache.length, int(token.reshape(-1)[0])
        if not 0 <= token_id < self.vocab_size:  # the C code would read outside the embedding
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size}).")
        logits = torch.empty(1, self.vocab_size)
        self.lib.native_step(
            ctypes.byref(self.model_struct),
            token_id,
            slot,
            self.cos.data_ptr() + slot * self.row_bytes,  # the cos / sin row of this slot's position
            self.sin.data_ptr() + slot * self.row_bytes,
            logits.data_ptr(),
        )
        cache.advance(1)
        return logits
