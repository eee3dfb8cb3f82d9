"""The peers of tools/bench.py: importing them, building each one's twin of our model with our weights
(transformers, litgpt, llama.cpp from a GGUF), and checking that their logits match ours."""

from __future__ import annotations

import importlib
import importlib.metadata
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from rope_llama.bench.timing import compute_dtype
from rope_llama.cli.errors import error_sentence
from rope_llama.data.sources import load_documents
from rope_llama.data.tokenizer import Tokenizer, train_tokenizer
from rope_llama.interchange.gguf import gguf_writer, save
from rope_llama.interchange.hf import hf_config_dict, to_hf_state_dict
from rope_llama.kernels import use_kernels
from rope_llama.model.config import ModelConfig
from rope_llama.model.llama import Llama

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


def held_out_tokens(tok: Tokenizer, n: int) -> list[int]:
    """The first n tokens of the held-out test plays (Hamlet first), in the checkpoint's tokenizer."""
    text = "\n\n".join(load_documents({"kind": "shakespeare"})["test"])
    ids = tok.encode(text)
    if len(ids) < n:
        raise SystemExit(f"error: the held-out plays have {len(ids)} tokens, fewer than {n}.")
    return ids[:n]


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


def llama_cpp_model(
    path: Path, n_ctx: int, threads: int = 2, logits_all: bool = False, extra_buffers: bool = True
):
    """llama.cpp (llama-cpp-python) on `path` with an fp32 KV cache, as ours has (its default f16 cache
    rounds keys and values). extra_buffers=False loads the weights into plain CPU buffers, without
    llama.cpp's extra buffer types (repacked / AMX weights): with them the first eval of a Q4_1 file
    segfaults on an AMX Xeon (llama-cpp-python 0.3.36); the plain buffers compute the same types."""
    import llama_cpp
    from llama_cpp import llama as module

    default = module.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = p.use_extra_bufts and extra_buffers
        return p

    module.llama_cpp.llama_model_default_params = params  # Llama() passes no such option through
    try:
        return llama_cpp.Llama(
            str(path),
            logits_all=logits_all,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=llama_cpp.GGML_TYPE_F32,
            type_v=llama_cpp.GGML_TYPE_F32,
            verbose=False,
        )
    finally:
        module.llama_cpp.llama_model_default_params = default


class LlamaCppTwin:
    """llama.cpp (llama-cpp-python) running a GGUF of our weights with our thread count and an fp32 KV
    cache, as ours has. A greedy step is one llama_decode and an argmax of its logits, driven from
    Python one token at a time as our decode loops are."""

    def __init__(self, gguf_path: Path, n_ctx: int):
        import llama_cpp

        self.llm = llama_cpp_model(gguf_path, n_ctx, threads=torch.get_num_threads())
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
