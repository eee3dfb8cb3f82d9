"""`python scripts/import_hf.py ...` from the checkout: the entry point is rope_llama/cli/import_hf.py (installed: `rope-import-hf`)."""

from rope_llama.cli.import_hf import main

if __name__ == "__main__":
    main()
