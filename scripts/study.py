"""`python scripts/study.py ...` from the checkout: the entry point is rope_llama/cli/study.py (installed: `rope-study`)."""

from rope_llama.cli.study import main

if __name__ == "__main__":
    main()
