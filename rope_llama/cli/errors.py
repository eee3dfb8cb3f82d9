"""What every command-line entry point shares (train.py, generate.py, scripts/): a user error is one line,
`error: <sentence>` on stderr, and exit status 2, never a traceback; configs become objects through
`build`, which raises the error of the object itself.

    @hydra.main(...)
    @one_sentence_errors
    def main(cfg): ...

HYDRA_FULL_ERROR=1 (Hydra's own switch) shows the traceback instead.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Callable

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

# Bad options, values and files. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, OmegaConfBaseException)


# Top-level packages of checkouts before the code became the `rope_llama` package: the `.hydra/config.yaml`
# of runs trained then name their targets from these.
LEGACY_PACKAGES = ("model.", "kernels.", "training.", "inference.", "data.")


def current_targets(node):
    """A copy of config `node` whose legacy `_target_`s (LEGACY_PACKAGES) name today's `rope_llama.` paths."""
    if not isinstance(node, DictConfig | ListConfig):
        return node
    node = copy.deepcopy(node)
    for parent in [node, *_nodes(node)]:
        target = parent.get("_target_") if isinstance(parent, DictConfig) else None
        if isinstance(target, str) and target.startswith(LEGACY_PACKAGES):
            parent["_target_"] = "rope_llama." + target
    return node


def _nodes(node):
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        child = node._get_node(key)  # unresolved: an interpolation may only resolve inside Hydra
        if isinstance(child, DictConfig | ListConfig):
            yield child
            yield from _nodes(child)


def build(node, **kwargs):
    """hydra.utils.instantiate(node, **kwargs), raising a user error of the config's target as it is: Hydra
    wraps it in an InstantiationException whose first line names the target instead of the problem."""
    try:
        return instantiate(current_targets(node), **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, USER_ERRORS):
            raise e.__cause__ from None
        raise  # a bug (a `_target_` that does not exist, an argument it does not take): Hydra's message


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
