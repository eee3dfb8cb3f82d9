"""rope-llama: small LLaMA-style models with one shared RoPE module and every context-extension method.

Layers, in order: a module imports only from its own package, from this module, and from the packages
listed before its own (tests/test_layers.py parses every import, type-only and function-local ones
included, and fails on one that reaches down the list):

    model/        the plain network: config, RoPE, extensions, attention and blocks, KV cache (torch only)
    kernels/      faster drop-ins for model/'s ops, and the C decode step
    core/         what the rooms below share: checkpoint format, devices and dtypes, precision, threads,
                  the memory budget, number checks
    data/         text sources, the tokenizer, token cache and shards, position ids, recall windows,
                  the LightningDataModule
    interchange/  the Hugging Face and GGUF mappings, both directions
    inference/    generation through the KV cache, scoring, evaluation, retrieval prompts, statistics,
                  reports
    viz/          what visualize.py draws: RoPE geometry, the model's own attention maps, the figures
    training/     the Lightning module, callbacks (the text sample included), optimizers, loggers, run
                  directories
    study/        the extrapolation study: its options, lanes of entry-point subprocesses, tables, plots
    cli/          the entry points (console scripts) and what they share: one-sentence errors, config ->
                  object building, option checks
    bench/        tools/bench.py's measurements: ours against transformers, litgpt and llama.cpp
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# The Hydra config tree ships inside the package (package data: pyproject.toml), so an installed copy runs as
# the checkout does; every entry point composes from it (hydra.main's config_path).
CONFIGS = PACKAGE / "configs"


def checkout() -> Path | None:
    """The checkout this package runs from (an editable install, PYTHONPATH or `python train.py` there), or
    None for an installed copy: what decides where caches go by default (data/cache.py)."""
    root = PACKAGE.parent
    return root if (root / "pyproject.toml").is_file() and (root / "train.py").is_file() else None
