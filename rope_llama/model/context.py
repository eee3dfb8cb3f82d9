"""The position contract: the lengths a model was trained at, and checkpoint + override -> the RoPE and
attention extension to run.

A model's `TrainedLengths` are written once, by the run that trained its weights (or by an import), and
live in its ModelConfig beside the RoPE and extension configs; every command asks them of the checkpoint.
`resolve_positions` is the one place that turns a checkpoint's (frozen) config and a user's override into
the RopeConfig and ExtendConfig a model runs with: generate.py, the evaluation and retrieval scripts, the
study, and `train.py` (a run from scratch or an `init_from` fine-tune) all call it.

The reference length L0 (`original_max_len`, what a scaling and log-n are relative to) that an override
leaves unset (None) is:
  - at inference (generate.py, evaluation): the checkpoint's context_len: a zero-shot method treats the
    checkpoint as a model of the length it claims;
  - training from scratch: the run's trained_len (the windows' length);
  - training from a checkpoint (init_from) towards a longer context: `reference_len` of that checkpoint, so
    a fine-tune continues its positions (a PI fine-tune of a PI model scales the original frequencies).
A factor left unset (None) in training is the new context_len / L0: a fine-tune at 1024 of a 256-token
base gets 4 without anyone typing it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace

from rope_llama.model.config import ModelConfig, TrainedLengths
from rope_llama.model.extend import ExtendConfig
from rope_llama.model.rope import RopeConfig

# The RoPE fields that describe how the weights were trained, not how they are run: an inference override
# never changes them.
TRAINED_ROPE_FIELDS = ("layout", "rotary_dim")


def reference_len(rope: RopeConfig, lengths: TrainedLengths) -> int:
    """The length a new scaling of these weights is relative to: the original length of a RoPE that is
    already scaled (the frequencies the weights first learned), else the context length they claim."""
    if rope.scaling != "none" and rope.original_max_len is not None:
        return rope.original_max_len
    return lengths.context_len


def _override(own, override: Mapping | None, reference: int, drop: tuple[str, ...] = ()):
    """`own` with the fields of `override` (None = `own` unchanged); an unset original_max_len = `reference`."""
    if override is None:
        return own
    kind = "rope" if isinstance(own, RopeConfig) else "extend"
    known = {f.name for f in fields(own)}
    values = {k: v for k, v in override.items() if not k.startswith("_") and k not in drop}  # no _target_
    if unknown := sorted(set(values) - known):
        raise ValueError(f"Unknown {kind} keys {unknown}; allowed keys are {sorted(known)}.")
    if values.get("original_max_len") is None:
        values["original_max_len"] = reference
    try:
        return replace(own, **values)
    except TypeError as e:  # e.g. a string where a number belongs
        raise ValueError(f"Invalid {kind} override {values}: {e}.") from None


def resolve_positions(
    checkpoint: ModelConfig | None,
    rope: Mapping | None = None,
    extend: Mapping | None = None,
    training: TrainedLengths | None = None,
) -> tuple[RopeConfig, ExtendConfig]:
    """The RoPE and extension to run: a checkpoint's own (`checkpoint` None: a model trained from scratch)
    with the overrides `rope` / `extend` (a configs/rope or configs/extend group's values, field by field;
    None keeps the checkpoint's own). A `factor` of None is derived in training, refused at inference.

    training: the lengths of the run being trained (None = inference, where `layout` and `rotary_dim`
    stay the checkpoint's). L0 as the module docstring says. Returns new configs; the checkpoint's are
    frozen and never change.
    """
    if training is None:  # inference: a zero-shot change of a trained model
        if checkpoint is None or checkpoint.lengths is None:
            raise ValueError("An inference override needs a checkpoint that records its trained lengths.")
        reference = checkpoint.lengths.context_len
        rope_values = None if rope is None else {"factor": checkpoint.rope.factor, **rope}
        if rope_values is not None and rope_values["factor"] is None:
            raise ValueError(
                "rope.factor=null derives the factor from a training length; give a number >= 1."
            )
        return (
            _override(checkpoint.rope, rope_values, reference, drop=TRAINED_ROPE_FIELDS),
            _override(checkpoint.extend, extend, reference),
        )
    if checkpoint is None:  # from scratch: relative to the run's own windows
        reference = training.trained_len
    else:  # init_from: continue the base's positions
        reference = reference_len(checkpoint.rope, checkpoint.lengths)
    values = dict(rope or {})
    if values.get("factor", 1.0) is None:
        l0 = values.get("original_max_len") or reference
        values["factor"] = max(1.0, training.context_len / l0)
    return _override(RopeConfig(), values, reference), _override(
        ExtendConfig(), dict(extend or {}), reference
    )
