"""Wilson intervals and the paired cluster bootstrap on constructed examples with known answers."""

import numpy as np
import pytest

from rope_llama.inference.stats import (
    cluster_labels,
    paired_bootstrap,
    pairwise_markdown,
    pairwise_table,
    wilson_interval,
)


@pytest.mark.parametrize(
    "successes, trials, low, high",
    [
        (0, 10, 0.0, 0.2775),  # the usual textbook cases at 95%
        (5, 10, 0.2366, 0.7634),
        (10, 10, 0.7225, 1.0),
        (81, 263, 0.2553, 0.3662),  # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ],
)
def test_wilson_matches_published_values(successes, trials, low, high):
    assert wilson_interval(successes, trials) == pytest.approx((low, high), abs=5e-5)


def test_wilson_confidence_and_errors():
    narrow, wide = wilson_interval(30, 50, 0.8), wilson_interval(30, 50, 0.99)
    assert wide[0] < narrow[0] < 0.6 < narrow[1] < wide[1]
    with pytest.raises(ValueError, match="successes must be an integer in"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="trials must be a positive integer"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="confidence must lie strictly between 0 and 1"):
        wilson_interval(1, 2, confidence=1.0)


def test_constant_advantage_is_significant_with_the_exact_difference():
    rng = np.random.default_rng(0)
    b = rng.normal(3.0, 1.0, 120)  # e.g. per-window NLL of method b; a is worse by 0.25 everywhere
    clusters = np.repeat(np.arange(12), 10)
    d = paired_bootstrap(b + 0.25, b, clusters)
    assert (d.mean, d.low, d.high) == pytest.approx((0.25, 0.25, 0.25), abs=1e-12)
    assert d.significant and d.units == 120 and d.clusters == 12
    assert not paired_bootstrap(b, b, clusters).significant  # identical methods: difference 0


def test_symmetric_noise_is_not_significant():
    rng = np.random.default_rng(1)
    noise = rng.normal(0.0, 1.0, 100)
    b = rng.normal(3.0, 1.0, 200)
    a = b + np.concatenate([noise, -noise])  # differences symmetric around 0, mean exactly 0
    d = paired_bootstrap(a, b, rng.integers(0, 20, 200))
    assert d.mean == pytest.approx(0.0, abs=1e-12)
    assert d.low < 0 < d.high and not d.significant


def test_clusters_not_units_are_resampled():
    # 10 documents x 20 windows; each document shifts the difference by its own large offset, so
    # windows of one document are strongly correlated. Resampling windows ignores that and is far
    # too confident: it calls a +0.3 difference significant that resampling documents does not.
    rng = np.random.default_rng(2)
    offsets = np.array([-1.0, 1.0] * 5)
    docs = np.repeat(np.arange(10), 20)
    diff = 0.3 + offsets[docs] + rng.normal(0, 0.05, 200)
    b = rng.normal(3.0, 1.0, 200)
    by_doc = paired_bootstrap(b + diff, b, docs)
    by_window = paired_bootstrap(b + diff, b, np.arange(200))
    assert by_doc.mean == pytest.approx(by_window.mean) == pytest.approx(diff.mean())
    assert by_doc.high - by_doc.low > 3 * (by_window.high - by_window.low)
    assert by_window.significant and not by_doc.significant


def test_two_label_clusters_documents_by_seeds():
    docs, seeds = np.array([0, 0, 1, 1, 0, 0]), np.array([0, 0, 0, 0, 1, 1])
    ids = cluster_labels(np.stack([docs, seeds], 1))
    assert ids.tolist() == [0, 0, 2, 2, 1, 1]  # (doc, seed) pairs, each its own cluster
    assert paired_bootstrap(np.ones(6), np.zeros(6), np.stack([docs, seeds], 1)).clusters == 3


def test_bootstrap_is_deterministic_for_a_seed():
    rng = np.random.default_rng(3)
    a, b, clusters = rng.normal(size=50), rng.normal(size=50), rng.integers(0, 10, 50)
    assert paired_bootstrap(a, b, clusters, seed=5) == paired_bootstrap(a, b, clusters, seed=5)
    assert paired_bootstrap(a, b, clusters, seed=5) != paired_bootstrap(a, b, clusters, seed=6)


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="same length"):
        paired_bootstrap([1.0, 2.0], [1.0], [0, 1])
    with pytest.raises(ValueError, match="clusters must label every unit"):
        paired_bootstrap([1.0, 2.0], [1.0, 2.0], [0])
    with pytest.raises(ValueError, match="finite values only"):
        paired_bootstrap([1.0, np.nan], [1.0, 2.0], [0, 1])


def test_pairwise_table_marks_the_significant_orderings():
    rng = np.random.default_rng(4)
    base = rng.normal(4.0, 0.5, 80)  # per-window NLL: lower is better
    noise = rng.normal(0.0, 0.3, 40)
    values = {"yarn": base, "none": base + 1.0, "ntk": base + np.concatenate([noise, -noise])}
    rows = pairwise_table(values, np.repeat(np.arange(8), 10), higher_is_better=False)
    got = {(r["a"], r["b"]): r for r in rows}
    assert list(got) == [("yarn", "none"), ("yarn", "ntk"), ("none", "ntk")]
    assert got["yarn", "none"]["significant"] and got["yarn", "none"]["better"] == "yarn"
    assert got["yarn", "none"]["diff"] == pytest.approx(-1.0)
    assert not got["yarn", "ntk"]["significant"] and got["yarn", "ntk"]["better"] == ""
    assert got["none", "ntk"]["significant"] and got["none", "ntk"]["better"] == "ntk"
    # Accuracy (higher is better): the same arithmetic, the other winner.
    acc = pairwise_table({"a": np.ones(10), "b": np.zeros(10)}, np.arange(10), higher_is_better=True)
    assert acc[0]["better"] == "a" and acc[0]["diff"] == 1.0

    table = pairwise_markdown(rows).splitlines()
    assert table[0] == "| a \\ b | yarn | none | ntk |"
    assert table[2].startswith("| yarn | — | **-1.000 [-1.000, -1.000]** * |")
    assert table[3].startswith("| none | **+1.000 [+1.000, +1.000]** * | — |")  # mirror: none - yarn
    assert "**" not in table[4].split("|")[2]  # ntk - yarn: not significant, not bold
