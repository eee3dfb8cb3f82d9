"""`python train.py ...` from the checkout: the entry point is rope_llama/cli/train.py (installed: `rope-train`)."""

from rope_llama.cli.train import main

if __name__ == "__main__":
    main()
