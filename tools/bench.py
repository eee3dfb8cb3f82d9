"""Side-by-side speed of our Llama against transformers, litgpt, torchtune and llama.cpp, in ONE process.

    python scripts/bench.py                                   # full run: both shapes, eager + compile
    python scripts/bench.py compile=false shapes=[small]      # eager only, default shape only
    python scripts/bench.py quick=true shapes=[tiny]          # smoke run (seconds; what the test uses)
    python scripts/bench.py device=cuda threads=16 out=gpu.json

Every peer gets exactly our shape and, where it can load them, our weights (transformers through
model/hf.py, litgpt through its own HF converter, llama.cpp from an fp32 GGUF of scripts/export_gguf.py;
llama.cpp only decodes, on the CPU in float32). Calls are interleaved (ours, peer, ours, peer, ...)
and each number is a median, so a busy machine slows every side alike and the ratios stay meaningful;
absolute numbers are only worth quoting from a quiet machine. Every ratio is ours / peer of a
throughput: > 1 means we are faster. A peer that cannot be imported or compiled is reported, not fatal.
Results go to `out` (JSON) and a markdown table on stdout.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rope_llama import CONFIGS
from rope_llama.bench.time_to_quality import main as time_to_quality_runs
from rope_llama.bench.time_to_quality import markdown as ttq_markdown
from rope_llama.core.cli import build, error_sentence
from rope_llama.core.device import DTYPES, resolve_device
from rope_llama.core.precision import AUTO, bf16_is_native, expand_auto
from rope_llama.data.tokenizer import train_tokenizer
from rope_llama.inference.generation import GREEDY, CompiledStep, EagerStep, generate
from rope_llama.interchange.gguf import gguf_writer, save
from rope_llama.interchange.hf import hf_config_dict, to_hf_state_dict
from rope_llama.kernels import use_kernels
from rope_llama.kernels.cpu_decode import NativeStep
from rope_llama.kernels.cpuinfo import cpu_model
from rope_llama.kernels.rope import apply_rotary
from rope_llama.model.config import ModelConfig
from rope_llama.model.extend import ExtendConfig
from rope_llama.model.kv_cache import KVCache
from rope_llama.model.llama import Llama
from rope_llama.model.rope import RotaryEmbedding
from rope_llama.training.throughput import measure_matmul_peak

DEFAULTS = dict(
    shapes=[
        "small",
        "tiny",
    ],  # configs/model/<shape>.yaml; the first one is the "default shape" of the targets
    vocab=4096,
    batch=16,
    seq_len=256,
    compile=True,  # also time torch.compile'd training steps (eager is always timed)
    native_decode=True,  # ours decodes through the C step (kernels/cpu_decode.c) where it runs: CPU, fp32
    compile_decode=True,  # and through the compiled static-shape step (eager is always timed beside them)
    prompt_len=32,
    new_tokens=256,
    contexts=[128, 512, 1024, 2048, 4096],
    extend_context=4096,  # Self-Extend on vs off: prefill of this many tokens and decode at this context
    latency_steps=128,  # timed one-token steps per context (cheap; more steps, steadier medians)
    latency_block=16,  # consecutive steps per context before the next context takes its turn
    rope_shape=[8, 8, 1024, 64],  # (B, H, L, D)
    matmul_n=2048,
    repeats=9,  # medians of 9 interleaved calls: run-to-run spread of a ratio was ~5% with 5
    warmup=2,
    peers=["transformers", "litgpt", "torchtune", "llama.cpp"],
    device="auto",
    precision="auto",  # auto: bf16 on GPU, fp32 on CPU; bf16 on a CPU with AMX (bf16 matmuls ~6x fp32) is an option
    # training is also timed under these autocasts (every side alike), beside `precision`; auto: bf16
    # where the device multiplies bf16 matrices natively (trainer.precision=auto's rule), else none
    train_precisions=["auto"],
    ttq=False,  # also run scripts/time_to_quality.py (real train.py runs: 10-40 min on a 2-core CPU)
    ttq_recipes=["auto"],  # scripts/time_to_quality.py's auto: adamw and muon, fp32 and (natively) bf16
    ttq_thresholds=[2.10, 2.02],  # held-out val bpc of the default job
    threads=None,
    quick=False,
    out="bench.json",
    seed=0,
)
QUICK = dict(  # quick=true: a smoke run of every section in seconds (numbers are meaningless)
    batch=2,
    seq_len=32,
    compile=False,
    compile_decode=False,
    prompt_len=8,
    new_tokens=8,
    contexts=[16, 64],
    extend_context=96,  # past the default window (64): the merged attention runs
    latency_steps=3,
    rope_shape=[2, 2, 64, 16],
    matmul_n=256,
    repeats=2,
    warmup=1,
    train_precisions=[],
)
LLAMA_CPP = "llama.cpp"
PEER_MODULES = {
    "transformers": "transformers",
    "litgpt": "litgpt",
    "torchtune": "torchtune.modules",
    LLAMA_CPP: "llama_cpp",
}
PEER_PACKAGES = {
    "transformers": "transformers",
    "litgpt": "litgpt",
    "torchtune": "torchtune",
    LLAMA_CPP: "llama-cpp-python",
}
MODEL_PEERS = ("transformers", "litgpt")  # full torch-model peers; torchtune only takes part in the RoPE op


# ----------------------------------------------------------------------------- setup


def parse_args(argv: list[str]) -> dict:
    """key=value arguments (OmegaConf syntax, e.g. shapes=[small,tiny]) over DEFAULTS (and QUICK)."""
    given = OmegaConf.to_container(OmegaConf.from_dotlist(argv)) if argv else {}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise SystemExit(f"error: unknown arguments {unknown}; allowed are {sorted(DEFAULTS)}.")
    quick = bool(given.get("quick", DEFAULTS["quick"]))
    return {**DEFAULTS, **(QUICK if quick else {}), **given}


def check_args(args: dict) -> None:
    """Fail within seconds, not after minutes of benchmarking: every shape must be a configs/model
    group and the output file's directory must be writable."""
    shapes = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))
    unknown = [s for s in args["shapes"] if s not in shapes]
    if unknown:
        raise SystemExit(f"error: unknown shapes {unknown}; allowed are configs/model groups {shapes}.")
    out = Path(args["out"])
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: cannot create the directory of out={out}: {e.strerror}.") from None
    if not os.access(out.parent, os.W_OK):
        raise SystemExit(f"error: out={out} is not writable; choose another path.")
    if args["precision"] != "auto" and args["precision"] not in PRECISIONS:
        raise SystemExit(f"error: precision={args['precision']} is unknown; allowed are auto, fp32, bf16.")
    bad = [p for p in args["train_precisions"] if p not in (*PRECISIONS, AUTO)]
    if bad:
        raise SystemExit(
            f"error: train_precisions {bad} are unknown; allowed are {sorted([AUTO, *PRECISIONS])}."
        )


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


class Progress:
    """One line per section on stderr with the elapsed time: a full run takes several minutes."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.done += 1
        elapsed = int(time.perf_counter() - self.start)
        print(f"[bench {elapsed // 60}:{elapsed % 60:02d}] {self.done}/{self.total} {what}", file=sys.stderr)


def import_peers(names: list[str]) -> tuple[dict, dict]:
    """({peer: version} of those that import, {peer: reason} of those that do not)."""
    available, unavailable = {}, {}
    for name in names:
        if name not in PEER_MODULES:
            raise SystemExit(f"error: unknown peer {name!r}; known peers are {sorted(PEER_MODULES)}.")
        try:
            importlib.import_module(PEER_MODULES[name])
            available[name] = importlib.metadata.version(PEER_PACKAGES[name])
        except Exception as e:  # any import failure means "unavailable", with the reason
            unavailable[name] = f"{type(e).__name__}: {error_sentence(e)}"
    return available, unavailable


def machine(device: torch.device) -> dict:
    return dict(
        cpu=cpu_model(),
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        load_average_at_start=os.getloadavg(),  # > cores means the numbers are shared with other work
    )


def model_config(shape: str, vocab: int, max_len: int) -> ModelConfig:
    """The configs/model/<shape>.yaml group composed by Hydra and built as train.py builds it."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={shape}", f"data.max_len={max_len}"])
    return build(cfg.model, vocab_size=vocab)


def hf_twin(model: Llama):
    """transformers.LlamaForCausalLM with our shape and weights (the same mapping as the parity tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**hf_config_dict(model.config), attn_implementation="sdpa"))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict(), model.config), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied head
    return hf


def litgpt_twin(model: Llama, block_size: int):
    """litgpt GPT with a LLaMA config of our shape, weights loaded through litgpt's own HF converter."""
    from litgpt import GPT, Config
    from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama

    cfg = model.config
    config = Config(
        name="bench-llama",
        block_size=block_size,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=cfg.vocab_size,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_query_groups=cfg.n_kv_heads,
        n_embd=cfg.d_model,
        head_size=cfg.head_dim,
        intermediate_size=cfg.ffn_hidden,
        rotary_percentage=1.0,
        rope_base=int(cfg.rope.base),
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=cfg.norm_eps,
        mlp_class_name="LLaMAMLP",
    )
    gpt = GPT(config)
    state: dict = {}
    copy_weights_hf_llama(config, {}, state, to_hf_state_dict(model.state_dict(), cfg))
    gpt.load_state_dict(state)
    if cfg.tie_embeddings:
        gpt.lm_head.weight = gpt.transformer.wte.weight  # litgpt has no tying option for LLaMA
    return gpt


def build_models(cfg: ModelConfig, peers: dict, device: torch.device, block_size: int, seed: int) -> dict:
    """{side: model}: ours plus each available full-model peer, all with the same weights."""
    torch.manual_seed(seed)
    ours = use_kernels(Llama(cfg))  # trains as train.py does by default (kernels: true)
    models = {"ours": ours}
    if "transformers" in peers:
        models["transformers"] = hf_twin(ours)
    if "litgpt" in peers:
        models["litgpt"] = litgpt_twin(ours, block_size)
    return {side: m.to(device) for side, m in models.items()}


def write_llama_cpp_gguf(model: Llama, workdir: Path) -> Path:
    """An fp32 GGUF of `model` in a new folder under `workdir` (a loaded GGUF is memory-mapped, so no
    file is ever rewritten), with a minimal byte-level tokenizer (the bench never tokenizes)."""
    folder = Path(tempfile.mkdtemp(dir=workdir))
    tokenizer = train_tokenizer(["bench"], vocab_size=260, path=str(folder / "tokenizer.json"))  # 2 merges
    path = folder / "model.gguf"
    save(gguf_writer(model.config, model.state_dict(), tokenizer, "f32", name="bench"), path)
    return path


class LlamaCppTwin:
    """llama.cpp (llama-cpp-python) running a GGUF of our weights with our thread count and an fp32 KV
    cache, as ours has. A greedy step is one llama_decode and an argmax of its logits, driven from
    Python one token at a time as our decode loops are."""

    def __init__(self, gguf_path: Path, n_ctx: int):
        import llama_cpp

        threads = torch.get_num_threads()
        self.llm = llama_cpp.Llama(
            str(gguf_path),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=llama_cpp.GGML_TYPE_F32,
            type_v=llama_cpp.GGML_TYPE_F32,
            verbose=False,
        )
        self._get_logits, self.n_vocab = llama_cpp.llama_get_logits, self.llm.n_vocab()

    def last_logits(self) -> np.ndarray:
        """The logits of the last token evaluated (a view of llama.cpp's buffer)."""
        return np.ctypeslib.as_array(self._get_logits(self.llm.ctx), shape=(self.n_vocab,))

    def next_token(self, tokens: list[int]) -> int:
        """Append `tokens` to the cache; the argmax of the last one's logits."""
        self.llm.eval(tokens)
        return int(self.last_logits().argmax())

    def logits(self, tokens: list[int]) -> np.ndarray:
        """(len(tokens), vocab) logits, one decode step per token from an empty cache."""
        self.llm.reset()
        rows = []
        for token in tokens:
            self.llm.eval([token])
            rows.append(self.last_logits().copy())
        return np.stack(rows)

    def generate(self, prompt: list[int], n: int) -> list[int]:
        """n greedy tokens after `prompt` (prefilled in one batch)."""
        self.llm.reset()
        out = [self.next_token(prompt)]
        while len(out) < n:
            out.append(self.next_token(out[-1:]))
        return out

    def step_at(self, ctx: int, token: int) -> int:
        """One decode step with exactly `ctx` tokens cached (eval drops the cached positions >= ctx)."""
        self.llm.n_tokens = ctx
        return self.next_token([token])

    def close(self) -> None:
        """Free llama.cpp's model and context now (its finalizer fails at interpreter exit)."""
        self.llm.close()


def llama_cpp_runs(args: dict, device: torch.device) -> bool:
    """llama.cpp is timed against our CPU float32 paths only (the GGUF is fp32, the build CPU-only)."""
    return device.type == "cpu" and compute_dtype(args, device) == torch.float32


def logits_fn(side: str, model) -> Callable[[torch.Tensor], torch.Tensor]:
    if side == "transformers":
        return lambda idx: model(input_ids=idx, use_cache=False).logits
    return model  # ours and litgpt return the logits


@torch.no_grad()
def parity(models: dict, vocab: int, device: torch.device) -> dict:
    """Max |logits - ours| per peer: proves every side computes the same network."""
    idx = torch.randint(vocab, (2, 16), device=device)
    ref = models["ours"].eval()(idx)
    return {
        side: float((logits_fn(side, m.eval())(idx) - ref).abs().max())
        for side, m in models.items()
        if side != "ours"
    }


@torch.no_grad()
def llama_cpp_parity(model: Llama, workdir: Path) -> float:
    """Max |logits - ours| of llama.cpp decoding 16 tokens one by one from a GGUF of `model`."""
    idx = torch.randint(model.config.vocab_size, (16,))
    twin = LlamaCppTwin(write_llama_cpp_gguf(model, workdir), n_ctx=16)
    theirs = twin.logits(idx.tolist())
    twin.close()
    return float((torch.from_numpy(theirs) - model.eval()(idx[None])[0]).abs().max())


# ----------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, device) -> tuple[dict, dict]:
    """({side: median seconds per call}, {side: error}). Calls interleave across sides so drifts
    in machine load hit every side alike; a side that fails in warm-up is dropped with its error."""
    errors = {}
    for side, fn in list(fns.items()):
        try:
            for _ in range(warmup):
                fn()
        except Exception as e:  # e.g. torch.compile failing for one peer
            errors[side] = f"{type(e).__name__}: {error_sentence(e)}"
            del fns[side]
    times: dict[str, list[float]] = {side: [] for side in fns}
    for _ in range(repeats):
        for side, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[side].append(time.perf_counter() - t0)
    return {side: statistics.median(t) for side, t in times.items()}, errors


def ratios(values: dict) -> dict:
    """ours / peer for every peer with a value (values are throughputs: > 1 = ours faster)."""
    return {side: values["ours"] / v for side, v in values.items() if side != "ours" and "ours" in values}


PRECISIONS = {
    "fp32": DTYPES["float32"],
    "bf16": DTYPES["bfloat16"],
}  # precision= -> the dtype every side uses


def compute_dtype(args: dict, device: torch.device) -> torch.dtype:
    """The dtype every side computes in: training autocasts to it, generation and the RoPE op run in
    it, and the MFU is relative to its matmul peak. precision=auto: bf16 on GPU, fp32 on CPU."""
    if args["precision"] == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return PRECISIONS[args["precision"]]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed-precision autocast to `dtype` (bf16: flash attention through SDPA on GPU); none for fp32."""
    return torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


# ----------------------------------------------------------------------------- sections


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


DECODERS = {"native": dict(native=True), "compiled": dict(compile=True), "eager": {}}  # generate() kwargs


def our_decoders(args: dict, device: torch.device) -> list[str]:
    """Our decode paths to time, fastest first: the first is "ours" in the ratios and the targets,
    the others are reported beside it as ours_<path>. The C step runs on the CPU in float32 only."""
    native = args["native_decode"] and device.type == "cpu" and compute_dtype(args, device) == torch.float32
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


@torch.inference_mode()
def bench_self_extend(cfg: ModelConfig, args: dict, device) -> dict:
    """Our own cost of Self-Extend (model/extend.py, default window and group): prefill of
    `extend_context` tokens through the KV cache, and one-token decode steps with that many tokens
    cached (the cache rewound before each, as in bench_decode_latency), with the extension off and on,
    same weights, eager and compiled decode (the C step does not implement it)."""
    ctx, steps = args["extend_context"], args["latency_steps"]
    dtype = compute_dtype(args, device)
    torch.manual_seed(args["seed"])
    off = Llama(cfg).to(device).eval().to(dtype)
    extend = ExtendConfig(method="self_extend", original_max_len=args["seq_len"])
    on = Llama(replace(cfg, extend=extend)).to(device).eval().to(dtype)
    on.load_state_dict(off.state_dict())
    models = {"off": off, "on": on}
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


def rope_fns(
    B: int, H: int, L: int, D: int, peers: dict, device, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    """{side: fn}: forward + backward of RoPE on q and k of shape (B, H, L, D) (torchtune: (B, L, H, D))."""
    q, k = (torch.randn(B, H, L, D, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = RotaryEmbedding(D).to(device).cos_sin(None, dtype, seq_len=L)

    def ours():
        q.grad = k.grad = None
        torch.autograd.backward((apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)), (gq, gk))

    fns = {"ours": ours}
    if "transformers" in peers:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        def hf():
            q.grad = k.grad = None
            torch.autograd.backward(apply_rotary_pos_emb(q, k, cos[None], sin[None]), (gq, gk))

        fns["transformers"] = hf
    if "torchtune" in peers:
        from torchtune.modules import RotaryPositionalEmbeddings

        tt = RotaryPositionalEmbeddings(D, max_seq_len=L).to(device)
        qt, kt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k))  # its layout
        gqt, gkt = gq.transpose(1, 2).contiguous(), gk.transpose(1, 2).contiguous()

        def torchtune():
            qt.grad = kt.grad = None
            torch.autograd.backward((tt(qt), tt(kt)), (gqt, gkt))

        fns["torchtune"] = torchtune
    return fns


def bench_rope(args: dict, peers: dict, device) -> dict:
    B, H, L, D = args["rope_shape"]
    fns = rope_fns(B, H, L, D, peers, device, compute_dtype(args, device))
    seconds, errors = alternate(fns, args["repeats"], args["warmup"], device)
    calls_per_s = {side: 1 / s for side, s in seconds.items()}
    return dict(shape_BHLD=[B, H, L, D], calls_per_s=calls_per_s, ratio=ratios(calls_per_s), errors=errors)


def matmul_peak(args: dict, device, dtype: torch.dtype) -> float:
    """Best achieved FLOP/s of a large square `dtype` matmul (the MFU denominator), best of 3."""
    return max(measure_matmul_peak(device, dtype, n=args["matmul_n"]) for _ in range(3))


def train_dtypes(args: dict, device: torch.device) -> list[torch.dtype]:
    """`precision`'s dtype first (the targets read it), then each of `train_precisions` not yet in."""
    dtypes = [compute_dtype(args, device)]
    for name in args["train_precisions"]:
        if PRECISIONS[name] not in dtypes:
            dtypes.append(PRECISIONS[name])
    return dtypes


def time_to_quality(args: dict) -> list[dict]:
    """scripts/time_to_quality.py's recipes (real train.py runs on the default data), in a subprocess each."""
    out = Path(args["out"]).with_suffix(".ttq.json")
    thresholds = ",".join(str(t) for t in args["ttq_thresholds"])
    return time_to_quality_runs(
        [f"recipes=[{','.join(args['ttq_recipes'])}]", f"thresholds=[{thresholds}]", f"out={out}"]
    )


# ----------------------------------------------------------------------------- report

TARGETS = [  # (name, description, comparison, threshold); re-set from measured limits, see docs/performance.md
    ("train_eager_vs_transformers", "training tokens/s, default shape, eager, vs transformers", ">=", 1.0),
    (
        "train_compile_vs_transformers",
        "training tokens/s, default shape, compiled, vs transformers",
        ">=",
        1.0,
    ),
    (
        "train_bf16_vs_transformers",
        "training tokens/s, default shape, eager, bf16 autocast, vs transformers",
        ">=",
        1.25,
    ),
    ("decode_vs_transformers", "decode tokens/s vs transformers generate", ">=", 4.0),
    ("decode_vs_litgpt", "decode tokens/s vs litgpt generate", ">=", 2.0),
    ("latency_longest_over_shortest", "decode latency at the longest context / the shortest", "<=", 2.2),
    ("rope_vs_transformers", "RoPE op (fwd + bwd, q and k) vs transformers apply_rotary_pos_emb", ">=", 1.5),
    ("train_mfu", "training MFU, default shape, eager, vs the measured matmul peak of its dtype", ">=", 0.55),
]


def target_values(results: dict) -> dict:
    default, dtype = results["shapes"][0], results["dtype"]
    train = {(t["shape"], t["compile"], t["dtype"]): t for t in results["train"]}
    eager, compiled = train.get((default, False, dtype), {}), train.get((default, True, dtype), {})
    bf16 = train.get((default, False, "bfloat16"), {})
    return {
        "train_eager_vs_transformers": eager.get("ratio", {}).get("transformers"),
        "train_compile_vs_transformers": compiled.get("ratio", {}).get("transformers"),
        "train_bf16_vs_transformers": bf16.get("ratio", {}).get("transformers"),
        "decode_vs_transformers": results["generate"]["ratio_decode"].get("transformers"),
        "decode_vs_litgpt": results["generate"]["ratio_decode"].get("litgpt"),
        "latency_longest_over_shortest": results["decode_latency"]["longest_over_shortest"],
        "rope_vs_transformers": results["rope"]["ratio"].get("transformers"),
        "train_mfu": eager.get("mfu"),
    }


def evaluate_targets(results: dict) -> list[dict]:
    values = target_values(results)
    rows = []
    for name, what, op, threshold in TARGETS:
        value = values[name]
        met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
        rows.append(dict(name=name, what=what, value=value, target=f"{op} {threshold}", met=met))
    return rows


def fmt(x) -> str:
    return "-" if x is None else f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"


def markdown(results: dict) -> str:
    lines = ["| measurement | side | ours | peer | ours / peer |", "|---|---|---|---|---|"]

    def rows(label, values, ratio):
        for side, r in ratio.items():
            lines.append(f"| {label} | {side} | {fmt(values['ours'])} | {fmt(values[side])} | {r:.2f}x |")
        if not ratio and "ours" in values:
            lines.append(f"| {label} | - | {fmt(values['ours'])} | - | - |")

    for t in results["train"]:
        mode = "compiled" if t["compile"] else "eager"
        label = f"train tok/s {t['shape']} {t['batch']}x{t['seq_len']} {mode} {t['dtype']}"
        rows(label, t["tokens_per_s"], t["ratio"])
    g = results["generate"]
    rows(f"prefill tok/s (prompt {g['prompt_len']})", g["prefill_tokens_per_s"], g["ratio_prefill"])
    rows(f"decode tok/s ({g['new_tokens']} new)", g["decode_tokens_per_s"], g["ratio_decode"])
    r = results["rope"]
    rows(f"RoPE fwd+bwd calls/s {tuple(r['shape_BHLD'])}", r["calls_per_s"], r["ratio"])
    latency = results["decode_latency"]
    columns = {f"ours ({path})": s for path, s in latency["seconds_per_token_by_decoder"].items()}
    columns |= latency["peer_seconds_per_token"]  # {side: {context: seconds}}
    ratios_by_context = latency["ratio_by_context"]
    header = [f"{side} ms / token" for side in columns] + [f"ours / {peer}" for peer in ratios_by_context]
    lines += ["", "| context | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for ctx in latency["seconds_per_token"]:
        cells = [f"{1000 * s[ctx]:.2f}" for s in columns.values()]
        cells += [f"{r[ctx]:.2f}x" for r in ratios_by_context.values()]
        lines.append(f"| {ctx} | " + " | ".join(cells) + " |")
    se = results["self_extend"]
    lines += [
        "",
        f"| Self-Extend (W={se['window']}, G={se['group']}) at context {se['context']} | off | on | on / off |",
    ]
    lines.append("|---|---|---|---|")
    for what, ratio in se["on_over_off"].items():
        rates = (
            se["prefill_tokens_per_s"]
            if what == "prefill"
            else {side: se["decode_tokens_per_s"][f"{side}_{what}"] for side in ("off", "on")}
        )
        label = "prefill tok/s" if what == "prefill" else f"decode tok/s ({what})"
        lines.append(f"| {label} | {fmt(rates['off'])} | {fmt(rates['on'])} | {ratio:.2f}x |")
    if "time_to_quality" in results:
        lines += [
            "",
            ttq_markdown(results["time_to_quality"], sorted(results["args"]["ttq_thresholds"], reverse=True)),
        ]
    lines += ["", "| target | value | wanted | met |", "|---|---|---|---|"]
    for t in results["targets"]:
        met = "not measured" if t["met"] is None else "yes" if t["met"] else "no"
        lines.append(f"| {t['what']} | {fmt(t['value'])} | {t['target']} | {met} |")
    errors = {**results["peers_unavailable"]}
    for section in (*results["train"], results["generate"], results["self_extend"], results["rope"]):
        errors |= {
            f"{side} ({section.get('shape', '')}{' compiled' if section.get('compile') else ''})": e
            for side, e in section["errors"].items()
        }
    lines += [f"\nunavailable / failed: {name}: {why}" for name, why in errors.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    check_args(args)
    if args["threads"]:
        torch.set_num_threads(int(args["threads"]))
    device = resolve_device(args["device"])
    # the precisions that will run, recorded in the output as such
    args["train_precisions"] = resolve_train_precisions(list(args["train_precisions"]), device)
    peers, unavailable = import_peers(list(args["peers"]))
    if LLAMA_CPP in peers and not llama_cpp_runs(args, device):
        del peers[LLAMA_CPP]
        dtype = str(compute_dtype(args, device)).removeprefix("torch.")
        unavailable[LLAMA_CPP] = f"timed against our CPU float32 paths only, not {device.type} {dtype}"
    for name, why in unavailable.items():
        print(f"[bench] {name}: skipped ({why})", file=sys.stderr)
    model_peers = {p: v for p, v in peers.items() if p in MODEL_PEERS}
    gguf_workdir = tempfile.TemporaryDirectory(prefix="bench-llama-cpp-")  # llama.cpp's GGUF files
    llama_cpp_dir = Path(gguf_workdir.name) if LLAMA_CPP in peers else None
    if "transformers" in peers:
        import transformers

        transformers.logging.set_verbosity_error()  # generate() warns about unused generation flags
    results: dict = dict(
        machine=machine(device),
        args=args,
        shapes=list(args["shapes"]),
        peers=peers,
        peers_unavailable=unavailable,
        dtype=str(compute_dtype(args, device)).removeprefix("torch."),  # what precision=auto resolved to
        note="Ratios are ours / peer of medians of interleaved runs; absolute numbers need a quiet machine.",
    )
    train_runs = [
        (shape, c, dtype)
        for dtype in train_dtypes(args, device)
        for shape in args["shapes"]
        for c in ((False, True) if args["compile"] else (False,))
    ]
    progress = Progress(5 + len(train_runs) + bool(args["ttq"]))
    default_cfg = model_config(args["shapes"][0], args["vocab"], args["seq_len"])
    progress("parity of the peers' logits and the matmul peak")
    parity_models = build_models(default_cfg, model_peers, device, 64, 0)
    results["parity_max_abs_logit_diff"] = parity(parity_models, args["vocab"], device)
    if llama_cpp_dir is not None:
        results["parity_max_abs_logit_diff"][LLAMA_CPP] = llama_cpp_parity(
            parity_models["ours"], llama_cpp_dir
        )
    peak_dtypes = train_dtypes(args, device)  # the MFU of each run is against its own dtype's peak
    peaks = {dtype: matmul_peak(args, device, dtype) for dtype in peak_dtypes}  # before and after training
    progress("generation: prefill and decode tokens/s")
    results["generate"] = bench_generate(default_cfg, args, model_peers, device, llama_cpp_dir)
    progress(f"decode latency at contexts {list(args['contexts'])}")
    results["decode_latency"] = bench_decode_latency(default_cfg, args, device, llama_cpp_dir)
    gguf_workdir.cleanup()
    progress(f"Self-Extend on vs off at context {args['extend_context']}")
    results["self_extend"] = bench_self_extend(default_cfg, args, device)
    progress("the RoPE op")
    results["rope"] = bench_rope(args, peers, device)
    results["train"] = []
    for shape, compiled, dtype in train_runs:
        name = str(dtype).removeprefix("torch.")
        progress(f"training step, model={shape}, {'compiled' if compiled else 'eager'}, {name}")
        cfg = model_config(shape, args["vocab"], args["seq_len"])
        results["train"].append(bench_train(cfg, shape, args, model_peers, device, compiled, dtype))
    peaks = {dtype: max(peak, matmul_peak(args, device, dtype)) for dtype, peak in peaks.items()}
    results["matmul_peak_flops"] = peaks[peak_dtypes[0]]
    results["matmul_peak_flops_by_dtype"] = {str(d).removeprefix("torch."): f for d, f in peaks.items()}
    for t in results["train"]:
        t["mfu"] = t["achieved_flops"] / results["matmul_peak_flops_by_dtype"][t["dtype"]]
    if args["ttq"]:
        progress(f"time to quality: {', '.join(args['ttq_recipes'])} (real train.py runs)")
        results["time_to_quality"] = time_to_quality(args)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    results["targets"] = evaluate_targets(results)
    Path(args["out"]).write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"\nwrote {args['out']}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
