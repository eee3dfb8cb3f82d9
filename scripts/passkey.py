"""`python scripts/passkey.py ...` from the checkout: the entry point is rope_llama/cli/passkey.py (installed: `rope-passkey`)."""

from rope_llama.cli.passkey import main

if __name__ == "__main__":
    main()
