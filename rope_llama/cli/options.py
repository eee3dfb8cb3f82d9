"""What the entry points share: option checks (missing `???` values, lists, the results directory), and the
evaluation scripts' method grid, thread and dtype report and held-out documents."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf

from rope_llama.cli.instantiate import build
from rope_llama.core.checkpoint import LoadedCheckpoint
from rope_llama.core.checks import check_lengths, check_number, resolve_lengths
from rope_llama.core.precision import inference_dtype
from rope_llama.core.threads import apply_threads, check_threads
from rope_llama.inference.evaluation import CKPT_METHOD, check_method, matched_factor, method_positions
from rope_llama.interchange.destination import claim_results_directory
from rope_llama.model.extend import ExtendConfig, matched_group
from rope_llama.model.rope import RopeConfig

MATCHED = "matched"  # factor / extend_options.group chosen per evaluation length from the training length


def require(cfg: DictConfig, keys: tuple[str, ...], usage: str) -> None:
    """One sentence naming the first missing `???` option and how to pass it."""
    for key in keys:
        if OmegaConf.is_missing(cfg, key):
            raise ValueError(f"No {key} given; pass {usage}.")


def option_list(cfg: DictConfig, key: str, example: str) -> list:
    """cfg[key] as a list; one sentence when the command line gave a single value instead."""
    if not isinstance(cfg[key], ListConfig):
        raise ValueError(f"{key} must be a list, e.g. {key}={example}, got {cfg[key]!r}.")
    return list(cfg[key])


def check_common(cfg: DictConfig) -> Path:
    """Options shared by the scripts, checked before the (slow) checkpoint load; returns the results
    directory (`claim_results_directory`)."""
    if OmegaConf.is_missing(cfg, "ckpt"):
        raise ValueError("No checkpoint given; pass ckpt=<.ckpt file or run directory>.")
    if OmegaConf.is_missing(cfg, "out"):
        raise ValueError("No output directory given; pass out=<directory for the results>.")
    check_lengths("lengths", option_list(cfg, "lengths", "[256,1024]"), relative=True)
    methods = option_list(cfg, "methods", "[none,yarn]")
    if not methods:
        raise ValueError(
            "methods is empty; give e.g. methods=[none,yarn,self_extend,yarn+logn] (ckpt = the checkpoint's own RoPE)."
        )
    for method in methods:
        check_method(str(method))
    options = extend_options(cfg)
    if options.get("group") == MATCHED:
        options["group"] = 1  # resolved per length once the checkpoint's training length is known
    elif isinstance(options.get("group"), str):
        raise ValueError(
            f"extend_options.group must be an integer >= 1 or `matched`, got {options['group']!r}."
        )
    try:  # a bad window or group fails before the load
        replace(ExtendConfig(), **options)
    except TypeError as e:
        raise ValueError(f"Unknown extend_options {sorted(options)}: {e}.") from None
    out = claim_results_directory(cfg.out, "overwrite", cfg.overwrite)
    if cfg.factor != MATCHED and not (isinstance(cfg.factor, int | float) and cfg.factor >= 1):
        raise ValueError(f"factor must be `matched` or a number >= 1, got {cfg.factor!r}.")
    check_number("batch_tokens", cfg.batch_tokens, minimum=1, integer=True)
    check_threads(cfg.threads)
    check_focus(cfg)
    return out


def begin(cfg: DictConfig, ckpt: LoadedCheckpoint) -> None:
    """Once every check passed (a refusal stays one line): set torch's threads for `threads=<auto|N>`
    (core/threads.py) and say on stderr how the run computes: threads and dtype, each with its reason."""
    choice = apply_threads(cfg.threads)
    weight = ckpt.model.embed.weight
    reason = inference_dtype(str(cfg.dtype), weight.device)[1]
    dtype = str(weight.dtype).removeprefix("torch.")
    print(f"threads: {choice.threads} ({choice.reason}); dtype: {dtype} ({reason})", file=sys.stderr)


def with_context_lengths(cfg: DictConfig, ckpt: LoadedCheckpoint) -> DictConfig:
    """A copy of `cfg` whose relative `lengths` and `focus_lengths` ("2x") are tokens of the checkpoint's
    context length; a focus length must be one of the lengths, above the shortest."""
    lengths = resolve_lengths(list(cfg.lengths), ckpt.context_len)
    if any(t < 2 for t in lengths):
        raise ValueError(
            f"lengths {list(cfg.lengths)} of context {ckpt.context_len} give {lengths}; each needs >= 2 tokens."
        )
    focus = resolve_lengths(list(cfg.focus_lengths), ckpt.context_len)
    if stray := [t for t in focus if t not in lengths or t == min(lengths)]:
        raise ValueError(
            f"focus_lengths {stray} must be among lengths {sorted(lengths)} and above the shortest "
            "(a focus length keeps the best methods of the length below it)."
        )
    return OmegaConf.merge(cfg, {"lengths": lengths, "focus_lengths": focus})


def check_focus(cfg: DictConfig) -> None:
    """focus_lengths (integers or "4x", checked against lengths once the checkpoint is known) and
    focus_count, before the load."""
    focus = option_list(cfg, "focus_lengths", "[4x]")
    if focus:
        check_lengths("focus_lengths", focus, relative=True)
    check_number("focus_count", cfg.focus_count, minimum=1, integer=True)


def method_names(requested, ckpt: LoadedCheckpoint) -> list[str]:
    """The requested methods, plus `ckpt` when the checkpoint was trained with a RoPE scaling or an
    extension."""
    names = list(dict.fromkeys(str(m) for m in requested))  # de-duplicated, order kept
    trained_with = ckpt.config.rope.scaling != "none" or ckpt.config.extend.method != "none"
    if trained_with and CKPT_METHOD not in names:
        names.append(CKPT_METHOD)
    return names


def extend_options(cfg: DictConfig) -> dict:
    """`extend_options`: the extension fields (ExtendConfig's: window, group, shift, local_window, chunk,
    leak) set for every method that names an extension; a null one keeps the checkpoint's value (or the
    default derived from the training length); group `matched` is resolved per length."""
    options = OmegaConf.to_container(cfg.extend_options, resolve=True)
    return {k: v for k, v in options.items() if v is not None}


class MethodCell(NamedTuple):
    """What one method runs with at one evaluation length."""

    rope: RopeConfig
    extend: ExtendConfig
    factor: float  # the RoPE's factor, as the results tables report it


def method_grid(
    cfg: DictConfig, ckpt: LoadedCheckpoint, methods: list[str], length: int
) -> dict[str, MethodCell]:
    """{method: MethodCell} for one evaluation length, each resolved from the checkpoint's own frozen config
    alone, so a cell never depends on which method ran before it. factor `matched` = T / context length;
    extend_options.group `matched` = the least group whose reach at that length stays within 3/4 of the
    context length (model/extend.py's matched_group)."""
    context_len = ckpt.context_len
    factor = matched_factor(length, context_len) if cfg.factor == MATCHED else float(cfg.factor)
    rope_options = OmegaConf.to_container(cfg.rope_options, resolve=True)
    options = extend_options(cfg)
    if options.get("group") == MATCHED:
        options["group"] = matched_group(
            length, options.get("window", ckpt.config.extend.window), context_len
        )
    cells = {}
    for method in methods:
        rope, extend = method_positions(ckpt.config, method, factor, rope_options, options)
        cells[method] = MethodCell(rope, extend, rope.factor)
    return cells


def print_matched_groups(cfg: DictConfig, ckpt: LoadedCheckpoint, methods: list[str]) -> None:
    """Name the Self-Extend group each length gets when extend_options.group is `matched`."""
    if extend_options(cfg).get("group") != MATCHED:
        return
    groups = {}
    for length in sorted(cfg.lengths):
        extends = [c.extend for c in method_grid(cfg, ckpt, methods, length).values() if c.extend.self_extend]
        if extends:
            groups[length] = extends[0].group
    if groups:
        print(f"Self-Extend groups (matched to context length {ckpt.context_len}): {groups}")


def with_largest_cache(model, cells: dict[str, MethodCell]) -> None:
    """Give `model` the extension of `cells` whose KV cache is the largest (a remap's keeps slot positions,
    and a second key buffer unless its far keys are the true ones), so a memory check made before the grid
    counts the most any method allocates."""
    extends = (c.extend for c in cells.values())
    model.use_positions(extend=max(extends, key=lambda e: (e.remap is not None) + e.remaps_keys))


def datamodule_for(cfg: DictConfig, ckpt: LoadedCheckpoint):
    """The data module of the checkpoint's training run (runs/<run>/.hydra/config.yaml), or the
    `data=<group>` given on the command line; the tokenizer must be the checkpoint's."""
    if cfg.get("data") is not None:
        data_cfg = cfg.data.copy()
        if data_cfg.get("tokenizer_path") is None:  # tokenize with the checkpoint's own tokenizer
            data_cfg.tokenizer_path = str(ckpt.tokenizer_file())
    else:
        saved = ckpt.path.parent.parent / ".hydra" / "config.yaml"
        if not saved.is_file():
            raise ValueError(
                f"Cannot find the training config {saved} to rebuild the data; pass data=<group> "
                "(e.g. data=shakespeare) to say which data the checkpoint was trained on."
            )
        data_cfg = OmegaConf.load(saved).data
    datamodule = build(data_cfg)
    if ckpt.tokenizer_sha256 and datamodule.tokenizer.sha256 != ckpt.tokenizer_sha256:
        raise ValueError(
            f"The data's tokenizer ({datamodule.tokenizer.path}) is not the one {ckpt.path} was trained "
            f"with; pass data.tokenizer_path={ckpt.tokenizer_file()}."
        )
    return datamodule


def long_documents(cfg: DictConfig, ckpt: LoadedCheckpoint, min_tokens: int) -> list[np.ndarray]:
    """Held-out documents of `cfg.split` with at least `min_tokens` tokens; fails if there are none."""
    documents = datamodule_for(cfg, ckpt).documents(cfg.split)
    long = [d for d in documents if len(d) >= min_tokens]
    if not long:
        longest = max((len(d) for d in documents), default=0)
        raise ValueError(
            f"No {cfg.split} document has the {min_tokens} tokens the longest length needs (the longest has "
            f"{longest}); lower lengths or use data with longer documents."
        )
    print(
        f"{len(long)} of {len(documents)} {cfg.split} documents have >= {min_tokens} tokens "
        f"({', '.join(str(len(d)) for d in long)} tokens)."
    )
    return long
