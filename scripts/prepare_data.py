"""`python scripts/prepare_data.py ...` from the checkout: the entry point is rope_llama/cli/prepare_data.py (installed: `rope-prepare-data`)."""

from rope_llama.cli.prepare_data import main

if __name__ == "__main__":
    main()
