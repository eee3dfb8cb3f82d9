"""`python scripts/eval_extrapolation.py ...` from the checkout: the entry point is rope_llama/cli/eval_extrapolation.py (installed: `rope-eval`)."""

from rope_llama.cli.eval_extrapolation import main

if __name__ == "__main__":
    main()
