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
import re


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


def check_switch(name: str, value) -> None:
    """One sentence unless `value` is a real bool: Hydra reads true / false as one, and a string such as
    `no` would otherwise count as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}.")


RELATIVE_LENGTH = re.compile(r"^(\d+(?:\.\d+)?)x$")  # "2x": twice the checkpoint's context length


def relative_length(value) -> float | None:
    """The multiple of a relative length ("4x" -> 4.0, "0.5x" -> 0.5), None for anything else."""
    match = RELATIVE_LENGTH.match(value) if isinstance(value, str) else None
    return float(match.group(1)) if match and float(match.group(1)) > 0 else None


def check_lengths(name: str, lengths: list, relative: bool = False) -> None:
    """Evaluation lengths: a non-empty list of integers >= 2 (a window needs a token to predict), or with
    `relative` also multiples of the checkpoint's context length ("1x", "4x", "0.5x")."""
    if lengths and all((is_integer(t) and t >= 2) or (relative and relative_length(t)) for t in lengths):
        return
    allowed = "integers >= 2 or multiples of the context length such as 2x" if relative else "integers >= 2"
    raise ValueError(f"{name} must be a non-empty list of {allowed}, got {list(lengths)}.")


def resolve_lengths(lengths: list, context_len: int) -> list[int]:
    """Relative lengths ("2x") as tokens of `context_len`; integers as they are."""
    return [round(relative_length(t) * context_len) if relative_length(t) else int(t) for t in lengths]
