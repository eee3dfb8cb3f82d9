"""The extrapolation study, which rope_llama/cli/study.py runs: its options and its runs' names (config.py),
its steps, each a subprocess of an entry point, in lanes run side by side (lanes.py), its tables
(tables.py), its plot (plots.py) and the summary that gathers them (summary.py)."""
