"""tools/bench.py's sections (generation, scoring, training, the RoPE op, threads) against the peers
(transformers, litgpt, llama.cpp: peers.py), their timing and report, and the time-to-quality runs of
tools/time_to_quality.py."""
