"""Finished units of an evaluation (a scored window, an answered prompt), kept as they finish in
out/units.jsonl and keyed by what determines their result: the model's weights, the positions it runs
with, the tokens. A killed run, or one with more windows, prompts, methods or lengths, computes only
what is new; two methods that compute the same thing (YaRN at factor 1 and plain RoPE) share a unit.

    store = UnitStore(out / "units.jsonl")              # the units of earlier runs into this out
    key = unit_key(model=fingerprint, positions=positions_key(model, seq_len), tokens=token_digest(ids))
    if (value := store.get(key)) is None:
        store.put(key, value := {"loss": ...})           # one appended line, flushed to disk

The key does not name the code: after a change to the model's arithmetic, start over with reuse=false.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from rope_llama.model.llama import Llama
from rope_llama.model.rope import rope_frequencies

UNITS_FILE = "units.jsonl"


def _digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def unit_key(**parts) -> str:
    """One key of `parts` (JSON-able values; their order does not matter)."""
    return _digest(json.dumps(parts, sort_keys=True, default=str))


def token_digest(tokens) -> str:
    """The digest of a token sequence (a list or an integer tensor)."""
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return _digest(",".join(map(str, ids)))


def model_fingerprint(model: Llama) -> str:
    """The digest of the weights (names, dtypes, shapes, bytes) and the architecture, without the RoPE
    and extension a run may swap in (`positions_key` covers those)."""
    h = hashlib.sha256()
    architecture = {k: v for k, v in asdict(model.config).items() if k not in ("rope", "extend")}
    h.update(json.dumps(architecture, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def positions_key(model: Llama, seq_len: int) -> dict:
    """What the model's positions compute at total length `seq_len`: the RoPE's inverse frequencies and
    attention factor (whatever scaling names them: YaRN at factor 1 is plain RoPE) and the extension."""
    rope = model.config.rope
    inv_freq, attention_factor = rope_frequencies(rope, model.config.head_dim, seq_len=seq_len)
    extend = model.config.extend
    return {
        "inv_freq": _digest(inv_freq.numpy().tobytes()),
        "attention_factor": attention_factor,
        "layout": rope.layout,
        "extend": "none" if extend.method == "none" else asdict(extend),
    }


class UnitStore:
    """The units of `path` (JSON lines {"key", "value"}); a line torn by a kill is ignored. `reuse=False`
    ignores the file's units (new ones still go to it, each key's last line wins)."""

    def __init__(self, path: Path, reuse: bool = True) -> None:
        self.path, self.units = path, {}
        # a run killed mid-line left no newline: the next unit starts a line of its own
        self.torn = path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        if reuse and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    unit = json.loads(line)
                    self.units[unit["key"]] = unit["value"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # the last line of a killed run, cut short
        self.reused = len(self.units)

    def get(self, key: str) -> dict | None:
        return self.units.get(key)

    def put(self, key: str, value: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n" * self.torn + json.dumps({"key": key, "value": value}) + "\n")
            f.flush()
            os.fsync(f.fileno())  # a unit counts once it is on disk
        self.torn = False
        self.units[key] = value
