"""Inference: checkpoint loading, generation with the KV cache, scoring and evaluation, memory budget."""
