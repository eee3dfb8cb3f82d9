"""The network and everything that runs it: RoPE, attention, KV cache, decoder, Lightning module."""
