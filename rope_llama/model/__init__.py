"""The plain network: config, RoPE (and its overrides), attention and decoder blocks, KV cache, HF mapping."""
