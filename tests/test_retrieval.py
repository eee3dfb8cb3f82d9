"""Retrieval-suite prompts (inference/retrieval.py) with a real byte-level BPE, and the scorer."""

import glob
import re
from difflib import SequenceMatcher

import numpy as np
import pytest

from rope_llama.data.templates import HELD_OUT
from rope_llama.data.tokenizer import Tokenizer, train_tokenizer
from rope_llama.inference.reporting import miss_column
from rope_llama.inference.retrieval import (
    FILLER,
    GREEDY_MISSES,
    HELDOUT_TASKS,
    INTRO,
    MULTIKEY_NEEDLE,
    NAMES,
    NEEDLE,
    QUESTION,
    TASKS,
    VAR_VALUE,
    answer_correct,
    build_prompt,
    greedy_miss,
    random_keys,
)
from rope_llama.study import tables
from tests.helpers import small_corpus

LENGTHS = (512, 1024, 2048)  # the shortest fits two chains of four assignments (vartrack)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def macbeth_bpe(folder) -> Tokenizer:
    """A real byte-level BPE trained on a few pages of Macbeth (no digit merges, like the default one)."""
    texts = [open(p).read() for p in sorted(glob.glob(small_corpus(folder / "corpus")))]
    return train_tokenizer(texts, 1024, str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return macbeth_bpe(tmp_path_factory.mktemp("bpe"))


def longest_filler_sentence(tok) -> int:
    return max(len(tok.encode(s)) for s in re.findall(r" [^.?!]*[.?!]", FILLER))


def prompts(tok, task, seed=0, lengths=LENGTHS, depths=DEPTHS):
    rng = np.random.default_rng(seed)
    return [(n, d, build_prompt(task, tok, n, d, rng)) for n in lengths for d in depths]


@pytest.mark.parametrize("task", TASKS)
def test_lengths_are_hit(tok, task):
    slack = longest_filler_sentence(tok)  # 8 tokens with this 1024-token BPE; 6 with the default 4096 one
    for length, _, p in prompts(tok, task):
        assert length - slack < len(p.tokens) <= length
        assert p.tokens[0] == tok.bos_id and p.task == task


@pytest.mark.parametrize("task", ("passkey", "multikey", "vartrack"))
def test_depth_is_realised(tok, task):
    for length, depth, p in prompts(tok, task):
        text = tok.decode(p.tokens)
        assert abs(p.depth - depth) <= (0.05 if length == 512 else 0.03)
        # The asked needle starts where the prompt says; its position follows the depth.
        asked = tok.decode(p.tokens[p.needle_start :])
        opening = {"passkey": " The pass key is", "multikey": " The pass key of the", "vartrack": " VAR "}
        assert asked.startswith(opening[task])
        intro_end = len(tok.decode(p.tokens[: 1 + len(tok.encode(INTRO))]))
        question_start = text.rindex(" What is")
        where = len(tok.decode(p.tokens[: p.needle_start]))
        assert intro_end <= where <= question_start
        if depth == 0.0:
            assert where == intro_end
    ordered = [p.needle_start for _, _, p in prompts(tok, task, lengths=(2048,))]
    assert ordered == sorted(ordered)  # deeper asked needles sit later


@pytest.mark.parametrize("task", HELDOUT_TASKS)
def test_heldout_prompts_state_the_answer_once_in_their_familys_wording_at_the_depth(tok, task):
    family = task.removeprefix("heldout_")
    for length, depth, p in prompts(tok, task):
        text = tok.decode(p.tokens)
        assert abs(p.depth - depth) <= (0.05 if length == 512 else 0.03)
        assert text.count(str(p.answer)) == 1 and text.startswith("<|bos|>" + INTRO)
        needle = tok.decode(p.tokens[p.needle_start :]).lstrip("\n").split("\n")
        spoken = re.fullmatch(r"[A-Z]+:", needle[0]) is not None  # a dialogue needle opens with its speaker
        assert spoken == (family == "dialogue") or family in ("prose", "things")
        rest = "\n".join(needle[1:] if spoken else needle)
        statement = rest[: rest.index(".", rest.index(str(p.answer))) + 1]  # up to the sentence end after it
        assert "\n" not in statement.strip()
        question = text[
            text.rindex(statement) + len(statement) :
        ]  # after the needle: filler, then the question
        common = SequenceMatcher(
            None, statement.lower(), question.lower(), autojunk=False
        ).find_longest_match()
        assert common.size >= len("the pin of"), (statement, question)  # it asks about the stated tag
        assert not text.endswith((str(p.answer), "."))  # the answer comes next
        if family == "prose":
            assert "Which number is" in question and "\n" not in text
        if family == "dialogue":
            assert re.search(r"\n\n[A-Z]+:\nDo you know [^\n]+\?\n[A-Z]+:\n[^\n]+$", text)
            assert needle[0].endswith(":") and needle[0] in text[-40:]  # the fact's speaker answers
        if family == "list":
            assert statement.startswith("- ") and "was set to" in statement
        if family == "things":
            assert any(thing in statement for thing in HELD_OUT["things"])


def test_passkey_uses_the_passkey_wording_and_its_key_only_in_the_needle(tok):
    for _, _, p in prompts(tok, "passkey"):
        text = tok.decode(p.tokens)
        needle = NEEDLE.format(key=p.answer)
        assert text.startswith("<|bos|>" + INTRO) and text.endswith("".join(QUESTION))
        assert text.count(needle) == 1 and str(p.answer) not in text.replace(needle, "")
        assert p.distractors == ()
        assert (
            text.replace(needle, "").replace(INTRO, "").replace("".join(QUESTION), "").replace("<|bos|>", "")
            in FILLER * 100
        )


def test_multikey_asks_one_of_several_distinct_needles(tok):
    for _, _, p in prompts(tok, "multikey"):
        text = tok.decode(p.tokens)
        found = re.findall(r"The pass key of the (\w+) is (\d+)\. Remember", text)
        assert len(found) == 4 and len({n for n, _ in found}) == 4 and len({k for _, k in found}) == 4
        asked = re.search(r"What is the pass key of the (\w+)\? The pass key of the \1 is$", text).group(1)
        assert asked in NAMES and dict(found)[asked] == str(p.answer)
        # the distractors: the other animals' keys
        assert sorted(p.distractors) == sorted(int(k) for n, k in found if n != asked)
        needle = MULTIKEY_NEEDLE.format(name=asked, key=p.answer)
        assert text.count(needle) == 1 and str(p.answer) not in text.replace(needle, "")
        assert tok.decode(p.tokens[p.needle_start :]).startswith(needle)


def test_vartrack_answer_needs_every_hop(tok):
    for _, _, p in prompts(tok, "vartrack"):
        text = tok.decode(p.tokens)
        values = dict(re.findall(r"VAR ([A-Z]+) = (\d+)\.", text))
        copies = dict(re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)\.", text))
        assert len(values) == 2 and len(set(values.values())) == 2 and len(copies) == 6
        name = re.search(r"What is the value of VAR ([A-Z]+)\? The value of VAR \1 is$", text).group(1)
        hops = 0
        while name in copies:
            assert text.index(f"VAR {copies[name]} =") < text.index(f"VAR {name} =")  # assigned before use
            name, hops = copies[name], hops + 1
        assert hops == 3 and values[name] == str(p.answer)
        assert p.distractors == tuple(int(v) for v in values.values() if v != str(p.answer))  # other chain
        assert text.count(str(p.answer)) == 1
        value = VAR_VALUE.format(name=name, value=p.answer)
        assert tok.decode(p.tokens[p.needle_start :]).startswith(value)


def test_multiquery_and_multivalue_distractors_are_the_needles_not_asked_for(tok):
    """multiquery asks for 2 of 4 animals: the other 2 keys are the distractors; multivalue asks for every key."""
    rng = np.random.default_rng(0)
    p = build_prompt("multiquery", tok, 1024, 0.5, rng, keys=4, queries=2)
    keys = [int(k) for k in re.findall(r"The pass key of the \w+ is (\d+)\.", tok.decode(p.tokens))]
    assert len(p.answers) == 2 and sorted([*p.answers, *p.distractors]) == sorted(keys)
    assert build_prompt("multivalue", tok, 1024, 0.5, rng).distractors == ()


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_per_rng_seed(tok, task):
    assert prompts(tok, task, seed=1) == prompts(tok, task, seed=1)
    assert prompts(tok, task, seed=1) != prompts(tok, task, seed=2)


def test_task_options_and_errors(tok):
    rng = np.random.default_rng(0)
    text = tok.decode(build_prompt("multikey", tok, 512, 0.5, rng, keys=7).tokens)
    assert text.count(". Remember it.") == 7
    text = tok.decode(build_prompt("vartrack", tok, 512, 0.5, rng, chains=3, hops=0).tokens)
    assert len(re.findall(r"VAR [A-Z]+ = \d+\.", text)) == 3 and "= VAR" not in text
    with pytest.raises(ValueError, match="retrieval task 'needle' is unknown"):
        build_prompt("needle", tok, 512, 0.5, rng)
    with pytest.raises(ValueError, match=r"depth must lie in \[0, 1\]"):
        build_prompt("passkey", tok, 512, 1.5, rng)
    with pytest.raises(ValueError, match="length 128 is too short for a vartrack prompt"):
        build_prompt("vartrack", tok, 128, 0.5, rng)
    with pytest.raises(ValueError, match="keys must be an integer in"):
        build_prompt("multikey", tok, 512, 0.5, rng, keys=0)
    with pytest.raises(ValueError, match=r"passkey takes the options \[\], not \['keys'\]"):
        build_prompt("passkey", tok, 512, 0.5, rng, keys=2)
    with pytest.raises(ValueError, match="hops must be an integer >= 0"):
        build_prompt("vartrack", tok, 512, 0.5, rng, hops=-1)


@pytest.mark.parametrize(
    "generated, answer, correct",
    [
        (" 71432.", 71432, True),
        (" 71432 is the pass key", 71432, True),
        ("The key: 71432, then 5", 71432, True),
        (" 7143", 71432, False),
        (" 12 71432", 71432, False),  # the first integer counts
        (" 714325", 71432, False),
        (" none", 71432, False),
    ],
)
def test_greedy_scorer(generated, answer, correct):
    assert answer_correct(generated, answer) is correct


@pytest.mark.parametrize(
    "generated, kind",
    [
        (" 24676.", "another needle"),  # the key of a needle the question did not ask for
        (" 24676, 71432", "another needle"),  # the first integer decides
        (" 246761", "wrong digits"),  # a distractor's digits and more are not that needle's value
        (" 71432.", ""),
        ("The key: 71432, then 5", ""),  # correct by the scorer: the first integer is the key
        (" 714322.", "overrun"),  # the key, then one digit more
        ("\n714321", "overrun"),
        (" 7143", "wrong digits"),  # a prefix of the key is not an overrun
        (" 12 71432", "wrong digits"),
        (" the dark road is 71", "prose first"),
        ("", "prose first"),
    ],
)
def test_greedy_miss_classes_every_wrong_answer(generated, kind):
    assert greedy_miss(generated, 71432, distractors=(24676, 38251)) == kind
    assert (kind == "") == answer_correct(generated, 71432)


@pytest.mark.parametrize(
    "generated, kind",
    [
        (" 55555. The pass keys of the hare are 10388.", "incomplete"),  # 2 of the 4 asked values
        (" 10388", "incomplete"),
        (" 77777, 66666, 55555, 10388", ""),  # every asked value, in any order
        (" 12 10388 55555 66666 77777", ""),  # several values: every one among the integers, not the first
        (" 555551", "overrun"),  # any asked value's digits, then more
        (" 24676, 10388", "another needle"),
        (" 12 10388", "wrong digits"),
        (" the keys are 10388", "prose first"),
    ],
)
def test_greedy_miss_classes_answers_of_several_values(generated, kind):
    values = (10388, 55555, 66666, 77777)
    assert greedy_miss(generated, values, distractors=(24676,)) == kind
    assert (kind == "") == answer_correct(generated, values)


def test_study_tables_class_several_values_by_all_of_them():
    """Multi-value trials as the study reads trials.csv (`answers` space-separated): the answer listing all four
    in another order is correct, not a miss whose first integer is not the first value; the one giving two of
    them is incomplete. The key alone (`answers` absent: an older trials.csv) still classes single answers."""
    values = "10388 55555 66666 77777"
    given = {" 77777, 66666, 55555, 10388": 1, " 55555. The pass keys of the hare are 10388.": 0}
    trials = [{"task": "multivalue", "model": "base", "seed": 0, "method": "yarn", "length": 512, "depth": 0.5,
               "trial": i, "greedy_correct": correct, "rank_correct": 1, "key": 10388, "answers": values,
               "answer": answer} for i, (answer, correct) in enumerate(given.items())]  # fmt: skip
    passkey = {"task": "passkey", "model": "base", "seed": 0, "method": "yarn", "length": 512, "depth": 0.5,
               "trial": 0, "greedy_correct": 0, "rank_correct": 1, "key": 10388, "answer": 103881}  # fmt: skip
    accuracy, _, text = tables.retrieval_tables([*trials, passkey])
    by_task = {r["task"]: r for r in accuracy}
    shares = {kind: by_task["multivalue"][miss_column(kind)] for kind in GREEDY_MISSES}
    assert by_task["multivalue"]["greedy_acc"] == 0.5
    assert shares == {kind: 0.5 if kind == "incomplete" else 0.0 for kind in GREEDY_MISSES}
    assert by_task["passkey"][miss_column("overrun")] == 1.0
    assert (
        "### multivalue: greedy misses by kind (prose first / overrun / another needle / incomplete /" in text
    )


def test_more_keys_than_exist_are_refused_instead_of_drawn_forever():
    """passkey.py candidates=100000 asks for 99,999 decoys of 90,000 five-digit keys: the draw never
    ended. Up to every key but the answer is drawn, each once."""
    with pytest.raises(ValueError, match=r"^99,999 distinct 5-digit keys cannot be drawn: only 90,000 exist"):
        random_keys(np.random.default_rng(0), 99_999, exclude=12345)
    with pytest.raises(ValueError, match="candidates .* may be at most 90,000"):
        random_keys(np.random.default_rng(0), 90_000, exclude=12345)
    keys = random_keys(np.random.default_rng(0), 89_999, exclude=12345)
    assert sorted(keys) == [k for k in range(10_000, 100_000) if k != 12345]
