"""The plain network, torch only: config and trained lengths (config.py), RoPE and its scalings (rope.py),
the attention extensions (extend.py), the positions a run or an override resolves to (context.py),
attention, blocks and LM head (llama.py) and the KV cache (kv_cache.py)."""
