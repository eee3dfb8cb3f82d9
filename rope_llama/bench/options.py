"""key=value options of the benchmark tools (tools/bench_*.py), typed by JSON where they parse as JSON."""

from __future__ import annotations

import json


def parse_options(argv: list[str], defaults: dict) -> dict:
    """`defaults` overridden by each key=value of argv; a value is its JSON reading (numbers, lists,
    true/false) and else the string itself. An unknown key exits with one sentence naming the options."""
    args = dict(defaults)
    for item in argv:
        key, _, value = item.partition("=")
        if key not in args:
            raise SystemExit(f"error: unknown option {key!r}; options are {', '.join(args)}.")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:  # a path, a dtype name, "auto"
            args[key] = value
    return args
