"""`python generate.py ...` from the checkout: the entry point is rope_llama/cli/generate.py (installed: `rope-generate`)."""

from rope_llama.cli.generate import main

if __name__ == "__main__":
    main()
