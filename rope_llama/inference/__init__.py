"""Inference: the checkpoint format and loading, generation with the KV cache, scoring and evaluation,
the memory budget; and what every entry point shares: devices and dtypes by name, one-sentence errors."""
