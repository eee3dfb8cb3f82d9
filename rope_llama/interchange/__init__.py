"""Other formats, both directions: Hugging Face safetensors + config.json (hf.py), GGUF for llama.cpp
(gguf.py), and the checks on an export's destination (destination.py). The entry points are
cli/export_hf.py, cli/import_hf.py and cli/export_gguf.py."""
