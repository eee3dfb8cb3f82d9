"""One sentence for a bad number: every typed option (optimizer, trainer, sample, generation, evaluation)
checks its numbers through `check_number` before anything is built or written.

    check_number("optim.lr", lr, above=0)                    # a finite number > 0
    check_number("trainer.accumulate_grad_batches", n, minimum=1, integer=True)
"""

from __future__ import annotations

import math


def describe(minimum=None, maximum=None, above=None, below=None, integer=False) -> str:
    """The allowed values in words: 'an integer >= 1', 'a finite number in [0, 1]', ..."""
    kind = "an integer" if integer else "a finite number"
    low = f"[{minimum}" if minimum is not None else f"({above}" if above is not None else None
    high = f"{maximum}]" if maximum is not None else f"{below})" if below is not None else None
    if low and high:
        return f"{kind} in {low}, {high}"
    if low:
        return f"{kind} {'>=' if minimum is not None else '>'} {low[1:]}"
    if high:
        return f"{kind} {'<=' if maximum is not None else '<'} {high[:-1]}"
    return kind


def check_number(
    name: str,
    value,
    *,
    minimum=None,
    maximum=None,
    above=None,
    below=None,
    integer: bool = False,
    allow_none: bool = False,
    none_means: str = "",
) -> None:
    """Raise ValueError naming `name`, the allowed values and `value` unless it is allowed."""
    if value is None and allow_none:
        return
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = is_number and (not integer or isinstance(value, int)) and math.isfinite(value)
    ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    ok = ok and (above is None or value > above) and (below is None or value < below)
    if not ok:
        allowed = describe(minimum, maximum, above, below, integer)
        if allow_none:
            allowed += f" or null{f' ({none_means})' if none_means else ''}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}.")
