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
    training/     the Lightning module, callbacks (the text sample included), optimizers, loggers, run
                  directories
    study/        the extrapolation study: its options, lanes of entry-point subprocesses, tables, plots
    cli/          the entry points (console scripts) and what they share: one-sentence errors, config ->
                  object building, option checks
    bench/        tools/bench.py's measurements: ours against transformers, litgpt and llama.cpp
"""

from pathlib import Path

# The checkout: train.py, generate.py and configs/ live beside the package (installed editable by `make setup`).
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
