"""How every entry point fails (cli/*.py, tools/): a user error is one line, `error: <sentence>` on stderr,
and exit status 2, never a traceback.

    @hydra.main(...)
    @one_sentence_errors
    def main(cfg): ...

HYDRA_FULL_ERROR=1 (Hydra's own switch) shows the traceback instead.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

from omegaconf.errors import OmegaConfBaseException

# Bad options, values and files. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, OmegaConfBaseException)


def error_sentence(error: BaseException) -> str:
    """The first line of an error's message (the sentence; torch and Hydra may append detail lines), led by the
    option's name where OmegaConf keeps it only in a detail line ("Value '1.5' ... converted to Integer")."""
    sentence = (str(error).strip().splitlines() or [""])[0]
    key = getattr(error, "full_key", None) if isinstance(error, OmegaConfBaseException) else None
    return f"{key}: {sentence}" if key and key not in sentence else sentence


def one_sentence_errors(
    main: Callable | None = None, *, errors: tuple[type[BaseException], ...] = USER_ERRORS
):
    """Decorate `main` so that `errors` print one `error:` line and exit 2, and Ctrl-C exits 130 quietly.
    `@one_sentence_errors(errors=...)` widens the set, e.g. for an entry point's own failure type."""
    if main is None:
        return functools.partial(one_sentence_errors, errors=errors)

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:  # e.g. while streaming text: stop quietly, as shells expect
            print(file=sys.stderr)
            sys.exit(130)
        except errors as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {error_sentence(e)}", file=sys.stderr)
            sys.exit(2)

    return wrapper
