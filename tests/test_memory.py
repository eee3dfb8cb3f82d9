"""The memory budget: refusals come before the allocation, in one sentence naming size, limit and knob."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from rope_llama.cli import eval_extrapolation
from rope_llama.core import memory
from rope_llama.core.memory import MemoryBudgetError, check_fits, human_bytes, new_kv_cache
from rope_llama.inference.generation import score_tokens
from rope_llama.model.kv_cache import KVCache, cache_bytes
from tests.helpers import CONFIGS, ROOT, run_generate_main, save_run, text_tokenizer, tiny

GiB = 2**30


@pytest.fixture(scope="module")
def model_and_run(tmp_path_factory):
    """The tiny model of tests/helpers.py and a run directory holding it."""
    tok = text_tokenizer(tmp_path_factory.mktemp("tok"))
    model = tiny(tok.vocab_size)
    return model, save_run(model, tok, tmp_path_factory.mktemp("run"))


def pretend_available(monkeypatch, nbytes: int | None) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda device: nbytes)


# ----------------------------------------------------------------------------- the check


def test_check_fits_refuses_above_the_headroom_and_accepts_below(monkeypatch):
    pretend_available(monkeypatch, 10 * GiB)
    check_fits(8 * GiB, "the KV cache for 3 tokens", "max_new_tokens or cache_len")  # exactly 80%
    with pytest.raises(MemoryBudgetError) as refusal:
        check_fits(9 * GiB, "the KV cache for 3 tokens", "max_new_tokens or cache_len")
    assert str(refusal.value) == (
        "The KV cache for 3 tokens needs 9.0 GiB but at most 8.0 GiB may be used (80% of the 10.0 GiB "
        "of CPU memory available); lower max_new_tokens or cache_len."
    )
    assert isinstance(refusal.value, ValueError)  # the CLIs' one-sentence error path
    pretend_available(monkeypatch, None)  # unreadable: nothing is refused
    check_fits(2**80, "anything", "nothing")


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (512, "512.0 B"),
        (1536, "1.5 KiB"),
        (512 * GiB, "512.0 GiB"),
        (3 * 2**50, "3.0 PiB"),
        (2**70, "1024.0 EiB"),
    ],
)
def test_human_bytes(nbytes, text):
    assert human_bytes(nbytes) == text


def test_meminfo_is_read_in_kib_and_falls_back_to_sysconf(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
    )
    assert memory.meminfo_available(meminfo) == 20_000_000 * 1024
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(memory.os, "sysconf", lambda name: pages[name])
    assert memory.meminfo_available(tmp_path / "missing") == 1000 * 4096  # no /proc: the free pages

    def unknown_name(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(memory.os, "sysconf", unknown_name)  # a platform without these names
    assert memory.meminfo_available(tmp_path / "missing") is None


def test_cgroup_limit_counts_reclaimable_cache_as_free(tmp_path):
    assert memory.cgroup_available(tmp_path) is None  # no cgroup files: no limit
    (tmp_path / "memory.max").write_text("max\n")  # v2 without a limit
    (tmp_path / "memory.current").write_text(f"{3 * GiB}\n")
    (tmp_path / "memory.stat").write_text(f"anon {2 * GiB}\ninactive_file {GiB}\n")
    assert memory.cgroup_available(tmp_path) is None
    (tmp_path / "memory.max").write_text(f"{4 * GiB}\n")
    assert memory.cgroup_available(tmp_path) == 2 * GiB  # 4 - 3 used + 1 reclaimable
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{8 * GiB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{7 * GiB}\n")
    (v1 / "memory" / "memory.stat").write_text(f"cache {GiB}\ntotal_inactive_file {GiB // 2}\n")
    assert memory.cgroup_available(v1) == GiB + GiB // 2


def test_cpu_memory_is_the_smaller_of_the_kernel_and_the_cgroup(monkeypatch):
    monkeypatch.setattr(memory, "meminfo_available", lambda: 20 * GiB)
    monkeypatch.setattr(memory, "cgroup_available", lambda: 6 * GiB)
    assert memory.available_memory("cpu") == 6 * GiB
    monkeypatch.setattr(memory, "cgroup_available", lambda: None)
    assert memory.available_memory(torch.device("cpu")) == 20 * GiB
    assert memory.available_memory("meta") is None  # nothing to read: nothing is refused


# ----------------------------------------------------------------------------- the KV cache and the engine


def test_kv_cache_bytes_are_what_it_allocates(model_and_run):
    config = model_and_run[0].config
    cache = KVCache(config.n_layers, 3, config.n_kv_heads, 50, config.head_dim, dtype=torch.bfloat16)
    allocated = sum(t.nbytes for t in (*cache.k, *cache.v)) + cache._slots.nbytes
    assert KVCache.bytes_for_model(config, 3, 50, torch.bfloat16) == allocated
    assert (
        cache_bytes(config.n_layers, 3, config.n_kv_heads, 50, config.head_dim, torch.bfloat16) == allocated
    )


def test_kv_cache_is_refused_before_it_is_allocated(model_and_run, monkeypatch):
    pretend_available(monkeypatch, 2**20)

    def no_allocation(*args, **kwargs):
        raise AssertionError("the cache was allocated before the budget check")

    monkeypatch.setattr(torch, "zeros", no_allocation)
    with pytest.raises(
        MemoryBudgetError, match=r"^A KV cache of 2 x 10,000 tokens needs 9\.8 MiB .*; lower the "
    ):
        new_kv_cache(model_and_run[0], batch_size=2, capacity=10_000)


def test_scoring_is_refused_with_its_knobs(model_and_run, monkeypatch):
    pretend_available(monkeypatch, 2**20)
    with pytest.raises(
        MemoryBudgetError, match=r"^Scoring 9,999 tokens in chunks of 64 needs .*; lower chunk or"
    ):
        score_tokens(model_and_run[0], torch.zeros(10_000, dtype=torch.long), chunk=64)


def test_bootstrap_resamples_are_refused_before_they_are_drawn(monkeypatch):
    """n_boot=10**10 on 4 windows: an (n_boot, 4) int64 draw, once a numpy MemoryError (or the host's
    memory); the study's paired significance resamples through the same function."""
    from rope_llama.inference.evaluation import bootstrap_bytes, bootstrap_mean
    from rope_llama.inference.stats import paired_bootstrap

    def no_draw(*args, **kwargs):
        raise AssertionError("the resamples were drawn before the budget check")

    monkeypatch.setattr(np.random, "default_rng", no_draw)
    pretend_available(monkeypatch, 64 * GiB)
    with pytest.raises(MemoryBudgetError) as refusal:
        bootstrap_mean(np.ones(4), n_boot=10**10)
    assert str(refusal.value) == (
        "10,000,000,000 bootstrap resamples of 4 units needs 1.1 TiB but at most 51.2 GiB may be used (80% of "
        "the 64.0 GiB of CPU memory available); lower n_boot."
    )
    assert bootstrap_bytes(10**10, 4) == 24 * 10**10 * 4 + 24 * 10**10
    with pytest.raises(MemoryBudgetError, match="of 3 units needs"):
        paired_bootstrap(np.ones(6), np.zeros(6), clusters=[0, 0, 1, 1, 2, 2], n_boot=10**10)


# ----------------------------------------------------------------------------- command lines


# num_samples: the rows (one per sample) are counted from the prompt encoded once, before a billion copies
# and their streams exist (they once exhausted the memory before the KV cache was checked)
HUGE_GENERATIONS = {
    "max_new_tokens": (["max_new_tokens=1000000000"], r"1,000,000,000 tokens after 1 prompt of", "GiB", ""),
    "num_samples": (
        ["num_samples=1000000000", "max_new_tokens=4"],
        r"4 tokens after 1,000,000,000 prompts \(1 x num_samples=1,000,000,000\) of",
        "TiB",
        "num_samples, ",
    ),
}


@pytest.mark.parametrize("knob", list(HUGE_GENERATIONS))
def test_generate_refuses_a_billion_new_tokens_or_samples_before_printing_or_allocating(
    knob, model_and_run, monkeypatch, capsys
):
    extra, what, unit, lower = HUGE_GENERATIONS[knob]
    pretend_available(monkeypatch, 64 * GiB)
    code, out, err = run_generate_main(
        [f"ckpt={model_and_run[1]}", "prompt=ROMEO:", *extra], monkeypatch, capsys
    )
    assert code == 2 and out == ""
    assert re.fullmatch(
        rf"error: Generating {what} up to \d+ tokens \([\d,]+ KV cache slots\) needs [\d.]+ {unit} but at most "
        r"51\.2 GiB may be used \(80% of the 64\.0 GiB of CPU memory available\); "
        rf"lower {lower}max_new_tokens, cache_len or the prompts\.\n",
        err,
    )


def test_passkey_refuses_ten_million_tokens_before_building_a_prompt(model_and_run, tmp_path):
    """A real process with the real available memory: the prompts alone would be gigabytes, their
    padded prefill's attention mask hundreds of terabytes."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "passkey.py"),
            f"ckpt={model_and_run[1]}",
            f"out={out}",
            "lengths=[10000000]",
            "device=cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "error: Answering 25 retrieval prompts of 10,000,000 tokens (1 per forward) needs "
    )
    assert "TiB but at most " in proc.stderr and proc.stderr.endswith("; lower lengths or trials.\n")
    assert proc.stderr.count("\n") == 1 and not out.exists()


def test_eval_refuses_a_length_before_loading_data(model_and_run, tmp_path, monkeypatch):
    def no_data(*args):
        raise AssertionError("the data was loaded before the budget check")

    monkeypatch.setattr(eval_extrapolation, "long_documents", no_data)
    pretend_available(monkeypatch, 64 * GiB)
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            "eval",
            overrides=[
                f"ckpt={model_and_run[1]}",
                f"out={tmp_path / 'out'}",
                "device=cpu",
                "lengths=[1000000000]",
            ],
        )
    with pytest.raises(
        MemoryBudgetError,
        match=r"^Scoring 1,000,000,000 tokens in chunks of 4,096 needs .*; lower lengths or chunk\.$",
    ):
        eval_extrapolation.run(cfg)
    assert not (tmp_path / "out").exists()
