"""One sentence for a bad number: every typed option and argument outside model/ (optimizer, trainer,
sample, data, positions, generation, evaluation, statistics) checks its numbers through `check_number`
before anything is built or written. model/ (torch only, importing nothing of the package) checks its
own config fields.

    check_number("optim.lr", lr, above=0)                    # a finite number > 0
    check_number("trainer.accumulate_grad_batches", n, minimum=1, integer=True)
    check_number("top_k", k, minimum=0, integer=True, means="0 = no limit", error=GenerationError)
"""

from __future__ import annotations

import math
import numbers


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


def is_integer(value) -> bool:
    """An int, numpy's included, but not a bool (Hydra reads `true` as one, and True == 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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
    means: str = "",
    allowed: str | None = None,
    error: type[ValueError] = ValueError,
) -> None:
    """Raise `error` (a ValueError) naming `name`, the allowed values and `value` unless it is allowed.
    `means` says what a special value does ('0 = no limit'); `allowed` words the allowed values where
    the bounds alone do not say where they come from ('an integer >= data.max_len (256)')."""
    if value is None and allow_none:
        return
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    # an int is finite, however large (math.isfinite would overflow converting 10**400 to a float)
    ok = is_number and (is_integer(value) or (not integer and math.isfinite(value)))
    ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    ok = ok and (above is None or value > above) and (below is None or value < below)
    if not ok:
        words = allowed or describe(minimum, maximum, above, below, integer)
        if means:
            words += f" ({means})"
        if allow_none:
            words += f" or null{f' ({none_means})' if none_means else ''}"
        raise error(f"{name} must be {words}, got {value!r}.")


def check_lengths(name: str, lengths: list) -> None:
    """Evaluation lengths: a non-empty list of integers >= 2 (a window needs a token to predict)."""
    if not lengths or not all(is_integer(t) and t >= 2 for t in lengths):
        raise ValueError(f"{name} must be a non-empty list of integers >= 2, got {list(lengths)}.")
