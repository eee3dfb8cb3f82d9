"""Statistics for comparing methods: Wilson intervals for accuracies, paired cluster bootstrap.

    low, high = wilson_interval(successes=47, trials=50)                  # 95% interval of 47/50
    d = paired_bootstrap(nll_yarn, nll_ntk, clusters=np.stack([doc, seed], 1))
    d.mean, d.low, d.high, d.significant                                   # mean(a - b) and its interval
    rows = pairwise_table({"ntk": nll_ntk, "yarn": nll_yarn, ...}, clusters, higher_is_better=False)
    print(pairwise_markdown(rows))                                         # all pairs, significant marked

Paired: every method is scored on the same units (windows, prompts), so the comparison works on the
per-unit differences, which removes the between-unit variance both methods share. Units of one
cluster (windows of one document, prompts of one seed's model) are correlated, so the bootstrap
resamples whole clusters, never single units. Everything is deterministic for a given seed.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from rope_llama.core.checks import check_number
from rope_llama.inference.evaluation import bootstrap_mean


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval (low, high) for a binomial proportion successes / trials.

    Unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or `trials`
    successes (0/10 at 95% -> (0, 0.278)), which matters for accuracies near chance or near 100%.
    """
    check_number("trials", trials, minimum=1, integer=True, allowed="a positive integer")
    check_number("successes", successes, minimum=0, maximum=trials, integer=True,
                 allowed=f"an integer in [0, trials={trials}]")  # fmt: skip
    _check_confidence(confidence)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    center = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * np.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    # The exact ends at 0 and n successes (center == half) can come out a rounding error off.
    low = 0.0 if successes == 0 else max(0.0, float(center - half))
    high = 1.0 if successes == trials else min(1.0, float(center + half))
    return low, high


@dataclass(frozen=True)
class PairedDifference:
    """mean(a - b) over all units, its percentile-bootstrap interval, and whether it excludes 0."""

    mean: float
    low: float
    high: float
    significant: bool  # the interval lies entirely above or entirely below 0
    units: int
    clusters: int


def cluster_labels(clusters: Sequence | np.ndarray) -> np.ndarray:
    """(U,) labels, or (U, k) rows of labels (e.g. [document, seed] per unit) -> (U,) int cluster ids.

    Two units share a cluster when all their k labels are equal.
    """
    keys = np.asarray(clusters)
    if keys.ndim not in (1, 2) or len(keys) == 0:
        raise ValueError(
            f"clusters must be a non-empty (U,) or (U, k) array of labels, got shape {keys.shape}."
        )
    return np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)


def paired_bootstrap(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    clusters: Sequence | np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> PairedDifference:
    """Mean of the paired differences a - b and its percentile interval over resampled clusters.

    a, b: (U,) per-unit values of two methods on the same units, e.g. mean NLL per window (nats)
    or 0/1 correctness per prompt. clusters: (U,) or (U, k) labels (see `cluster_labels`); each
    bootstrap replicate draws as many clusters as there are, with replacement, and takes the mean
    difference over all their units. significant: the interval excludes 0, i.e. the ordering of
    a and b holds at `confidence`. With a single cluster the interval collapses to the mean.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(
            f"a and b must be (U,) arrays of the same length, got shapes {a.shape} and {b.shape}."
        )
    if not np.isfinite(a).all() or not np.isfinite(b).all():
        raise ValueError("a and b must hold finite values only (a NaN or inf would poison every replicate).")
    ids = cluster_labels(clusters)
    if len(ids) != len(a):
        raise ValueError(f"clusters must label every unit: got {len(ids)} labels for {len(a)} units.")
    check_number("n_boot", n_boot, minimum=1, integer=True, allowed="a positive integer")
    _check_confidence(confidence)
    mean, low, high = bootstrap_mean(a - b, groups=ids, n_boot=n_boot, seed=seed, confidence=confidence)
    return PairedDifference(mean, low, high, low > 0 or high < 0, len(a), int(ids.max()) + 1)


def pairwise_table(
    values: Mapping[str, Sequence[float] | np.ndarray],
    clusters: Sequence | np.ndarray,
    higher_is_better: bool,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> list[dict]:
    """Every pair of methods compared with `paired_bootstrap`, in the mapping's order.

    values: {method: (U,) per-unit values}, all on the same units in the same order. One row per
    unordered pair (a before b in the mapping): a, b, diff = mean(a - b), ci_low, ci_high,
    significant, and better: the method that is better at `confidence` ("" when not significant).
    Every pair uses the same `seed`, so the replicates resample the same clusters for every pair.
    """
    if len(values) < 2:
        raise ValueError(f"pairwise_table needs at least two methods, got {list(values)}.")
    rows = []
    for name_a, name_b in itertools.combinations(values, 2):
        d = paired_bootstrap(values[name_a], values[name_b], clusters, n_boot, seed, confidence)
        a_better = (d.mean > 0) == higher_is_better
        rows.append(
            {
                "a": name_a,
                "b": name_b,
                "diff": d.mean,
                "ci_low": d.low,
                "ci_high": d.high,
                "significant": d.significant,
                "better": (name_a if a_better else name_b) if d.significant else "",
                "units": d.units,
                "clusters": d.clusters,
            }
        )
    return rows


def pairwise_markdown(rows: list[dict], digits: int = 3) -> str:
    """A markdown matrix of `pairwise_table` rows: cell (row a, column b) = mean(a - b) [low, high],
    bold with a trailing * where the ordering is significant. The lower triangle is the mirror
    image (b - a), so each row reads "this method minus that one"."""
    methods = list(dict.fromkeys([r["a"] for r in rows] + [r["b"] for r in rows]))
    cells = {}
    for r in rows:
        for x, y, sign in ((r["a"], r["b"], 1), (r["b"], r["a"], -1)):
            low, high = sorted((sign * r["ci_low"], sign * r["ci_high"]))
            text = f"{sign * r['diff']:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"
            cells[x, y] = f"**{text}** *" if r["significant"] else text
    lines = ["| a \\ b | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for x in methods:
        lines.append(f"| {x} | " + " | ".join(cells.get((x, y), "—") for y in methods) + " |")
    return "\n".join(lines)


def _check_confidence(confidence: float) -> None:
    if isinstance(confidence, bool) or not isinstance(confidence, int | float) or not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}.")
