"""`python scripts/import_gguf.py ...` from the checkout: the entry point is rope_llama/cli/import_gguf.py (installed: `rope-import-gguf`)."""

from rope_llama.cli.import_gguf import main

if __name__ == "__main__":
    main()
