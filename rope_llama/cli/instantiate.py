"""Config nodes -> objects: `build` instantiates a node's `_target_` as Hydra does, raising the error of the
object itself (one sentence, cli/errors.py), and maps the targets that older runs' saved configs name.
"""

from __future__ import annotations

import copy

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig

from rope_llama.cli.errors import USER_ERRORS

# Top-level packages of checkouts before the code became the `rope_llama` package: the `.hydra/config.yaml`
# of runs trained then name their targets from these.
LEGACY_PACKAGES = ("model.", "kernels.", "training.", "inference.", "data.")
# Targets that moved inside the package since: saved configs of runs trained before name the old path.
MOVED_TARGETS = {"rope_llama.inference.samples.TextSample": "rope_llama.training.callbacks.TextSample"}


def current_target(target: str) -> str:
    """Today's path of a `_target_` an older run's config may name (LEGACY_PACKAGES, MOVED_TARGETS)."""
    if target.startswith(LEGACY_PACKAGES):
        target = "rope_llama." + target
    return MOVED_TARGETS.get(target, target)


def current_targets(node):
    """A copy of config `node` whose `_target_`s name today's paths (`current_target`)."""
    if not isinstance(node, DictConfig | ListConfig):
        return node
    node = copy.deepcopy(node)
    for parent in [node, *_nodes(node)]:
        target = parent.get("_target_") if isinstance(parent, DictConfig) else None
        if isinstance(target, str) and current_target(target) != target:
            parent["_target_"] = current_target(target)
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
