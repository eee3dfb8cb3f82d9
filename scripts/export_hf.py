"""`python scripts/export_hf.py ...` from the checkout: the entry point is rope_llama/cli/export_hf.py (installed: `rope-export-hf`)."""

from rope_llama.cli.export_hf import main

if __name__ == "__main__":
    main()
