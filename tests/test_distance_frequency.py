"""tools/distance_frequency.py: the recall distances it counts are where the facts are stated."""

import numpy as np

from rope_llama.data.recall import RecallWindow
from tests.test_recall import tok, windows  # noqa: F401 (tok: the module's tokenizer fixture)
from tools.distance_frequency import answer_distances, find_last, pair_counts


def test_pairs_per_distance_of_a_causal_window():
    assert pair_counts(4).tolist() == [4, 3, 2, 1]  # d = 0 .. 3 of a 4-token window
    assert pair_counts(256).sum() == 256 * 257 // 2


def test_the_last_statement_before_the_answer_is_found_and_unstated_facts_are_skipped():
    # the value 42 = [9, 9] twice before its answer
    tokens = np.array([5, 9, 9, 6, 9, 9, 7, 1, 9, 9, 2, 3, 4])
    window = RecallWindow(tokens, facts=[("red box", 42), ("old cat", 17)], asked=[0, 1],
                          answers=[(8, 10), (11, 13)], decoys=[], unstated=1)  # fmt: skip
    assert find_last(tokens, [9, 9], before=8) == 4 and find_last(tokens, [8], before=13) is None
    assert answer_distances(window, {42: [[9, 9]], 17: [[3, 4]]}) == [4]


def test_each_located_value_is_its_fact_statement(tok):  # noqa: F811
    for w in windows(tok, seed=3, count=40, length=513, min_pairs=2, max_pairs=4, queries=2):
        spellings = {v: [tok.encode(f" {v}"), tok.encode(str(v))] for _, v in w.facts}
        found = answer_distances(w, spellings)
        stated = [(a, f) for (a, _), f in zip(w.answers, w.asked) if f != w.unstated]
        assert len(found) == len(stated)
        for d, (start, fact) in zip(found, stated):
            assert 0 < d < 513
            assert str(w.facts[fact][1]) in tok.decode(w.tokens[start - d : start - d + 8].tolist())
