"""How often a recipe's training windows use each relative distance: STRING's explanation (An et al. 2024) of
why a model's effective context falls short of its training length, measured on this project's windows.

    python tools/distance_frequency.py out=runs/distances                       # experiment=recall_base, 256
    python tools/distance_frequency.py out=runs/distances recipe=null max_len=256 windows=2000

Two counts per distance d in [0, L): the causal (query, key) pairs of a window at distance d, L - d of them
in every window (each training token's loss attends over them), and the distance from each recall window's
asked fact (the first token of its value where it is stated) to the question's answer: the distances the model
was asked to retrieve over. Writes distances.csv, distances.png and a summary line per share (the pairs and
the recall distances that STRING at its defaults never uses: d > L - S + W).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir

from rope_llama import CONFIGS
from rope_llama.cli.instantiate import build
from rope_llama.data.recall import RecallWindow
from rope_llama.model.extend import ExtendConfig, remap_parameters

DEFAULTS = dict(out=None, recipe="recall_base", max_len=256, windows=2000, seed=0)


def parse(argv: list[str]) -> dict:
    args = dict(DEFAULTS) | dict(item.split("=", 1) for item in argv)
    if unknown := set(args) - set(DEFAULTS):
        raise SystemExit(f"error: unknown options {sorted(unknown)}; options are {', '.join(DEFAULTS)}.")
    if not args["out"]:
        raise SystemExit("error: out=<directory> is required.")
    recipe = None if args["recipe"] in (None, "null") else args["recipe"]
    return {**args, "recipe": recipe, **{k: int(args[k]) for k in ("max_len", "windows", "seed")}}


def pair_counts(length: int) -> np.ndarray:
    """(length,) causal (query, key) pairs at distance d = 0 .. length - 1 in one window: length - d."""
    return np.arange(length, 0, -1, dtype=np.int64)


def find_last(tokens: np.ndarray, pattern: list[int], before: int) -> int | None:
    """Start of the last occurrence of `pattern` in tokens[:before], or None."""
    n = len(pattern)
    for start in range(before - n, -1, -1):
        if tokens[start : start + n].tolist() == pattern:
            return start
    return None


def answer_distances(window: RecallWindow, spellings: dict[int, list[list[int]]]) -> list[int]:
    """Distance from each stated, asked fact's value to its answer's first token in `window` (the value's
    last occurrence before the answer, under any of its `spellings`: value -> token sequences)."""
    distances = []
    for (start, _), fact in zip(window.answers, window.asked):
        if fact == window.unstated:
            continue
        value = window.facts[fact][1]
        found = [at for s in spellings[value] if (at := find_last(window.tokens, s, start)) is not None]
        if found:
            distances.append(start - max(found))
    return distances


def main(argv: list[str]) -> None:
    args = parse(argv)
    L = args["max_len"]
    overrides = [f"data.max_len={L}"] + ([f"experiment={args['recipe']}"] if args["recipe"] else [])
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    data = build(cfg.data)
    data.setup("fit")
    mixer, tokens = data.train_set.recall, data.train_set.data
    rng = np.random.default_rng(args["seed"])
    recall = np.zeros(L + 1, dtype=np.int64)
    asked = 0
    if mixer is not None and mixer.config.fraction > 0:
        for _ in range(args["windows"]):
            start = int(rng.integers(tokens.n - L - 1))
            window = mixer.window(rng, tokens.read(start, L + 1).astype(np.int64), progress=1.0)
            spellings = {v: [mixer.tok.encode(f" {v}"), mixer.tok.encode(str(v))] for _, v in window.facts}
            found = answer_distances(window, spellings)
            asked += sum(f != window.unstated for f in window.asked)
            np.add.at(recall, found, 1)
    pairs = pair_counts(L)
    folder = Path(args["out"])
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["distance,pair_share,recall_count"] + [
        f"{d},{pairs[d] / pairs.sum():.6g},{recall[d]}" for d in range(L)
    ]
    (folder / "distances.csv").write_text("\n".join(rows) + "\n")
    string = remap_parameters(ExtendConfig(method="string", original_max_len=L))
    far = L - string["shift"] + string["window"] + 1  # STRING's largest distance is L - 1 - S + W
    found_total = int(recall.sum())
    print(f"windows of {L}; STRING S={string['shift']} W={string['window']} uses distances below {far}")
    print(f"pairs at d >= {far}: {pairs[far:].sum() / pairs.sum():.1%}")
    if asked:
        print(f"recall answers located {found_total} of {asked} asked stated facts; at d >= {far}: "
              f"{recall[far:].sum() / max(found_total, 1):.1%}; median distance {median(recall):.0f}")  # fmt: skip
    plot(pairs, recall, L, far, folder / "distances.png")


def median(counts: np.ndarray) -> float:
    cumulative = np.cumsum(counts)
    return float(np.searchsorted(cumulative, cumulative[-1] / 2)) if cumulative[-1] else float("nan")


def plot(pairs: np.ndarray, recall: np.ndarray, L: int, far: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = max(1, L // 32)  # bins: the recall counts are a few per distance
    edges = np.arange(0, L + width, width)
    binned = lambda counts: np.add.reduceat(counts[:L], edges[:-1]) / max(counts[:L].sum(), 1)  # noqa: E731
    ax.stairs(binned(pairs), edges, label="(query, key) pairs per window")
    if recall.sum():
        ax.stairs(binned(recall), edges, label="recall windows: asked fact to answer")
    ax.axvline(far, color="grey", ls="--", lw=1, label="STRING (defaults) uses no distance past this")
    ax.set_xlabel("relative distance d (tokens)")
    ax.set_ylabel(f"share per {width} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
