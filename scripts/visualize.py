"""`python scripts/visualize.py ...` from the checkout: the entry point is rope_llama/cli/visualize.py (installed: `rope-visualize`)."""

from rope_llama.cli.visualize import main

if __name__ == "__main__":
    main()
