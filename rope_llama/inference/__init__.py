"""Inference: loading a checkpoint with RoPE and extension overrides (loading.py), generation and scoring
through the KV cache (generation.py), evaluation over lengths and methods (evaluation.py), the retrieval
prompts (retrieval.py), statistics (stats.py) and the tables and plots the evaluations share
(reporting.py). Checkpoints, devices and the memory budget are core/'s."""
