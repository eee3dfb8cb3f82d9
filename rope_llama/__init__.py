"""rope-llama: small LLaMA-style models with one shared RoPE module and every context-extension method.

Layers, each importing only those above it in this list:
    model/        the plain network (torch only)
    kernels/      faster drop-ins for model/'s ops and the C decode step (model/ only)
    core/         what every layer shares: checkpoint format, config -> object building, devices and
                  dtypes, precision choice, the memory budget
    interchange/  the Hugging Face and GGUF mappings, both directions
    data/, training/, inference/, bench/   meet only through core/ and model/
"""

from pathlib import Path

# The checkout: train.py, generate.py and configs/ live beside the package (installed editable by `make setup`).
ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
