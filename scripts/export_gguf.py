"""`python scripts/export_gguf.py ...` from the checkout: the entry point is rope_llama/cli/export_gguf.py (installed: `rope-export-gguf`)."""

from rope_llama.cli.export_gguf import main

if __name__ == "__main__":
    main()
