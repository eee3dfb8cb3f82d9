"""The entry points, one module each (installed as console scripts, pyproject.toml; `python -m
rope_llama.cli.<name>` runs one too; train.py, generate.py and scripts/ in the checkout call them), and
what they share: one-sentence errors (errors.py), config -> object building with the targets of older
runs' configs (instantiate.py), option checks and the evaluation scripts' method grid (options.py)."""
