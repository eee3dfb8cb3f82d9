"""Time to quality of the default job per recipe: `python tools/time_to_quality.py [recipes=[...]] ...`.
What it measures and its options: rope_llama/bench/time_to_quality.py (also bench.py's `ttq=true`)."""

import sys

from rope_llama.bench.time_to_quality import main

if __name__ == "__main__":
    main(sys.argv[1:])
