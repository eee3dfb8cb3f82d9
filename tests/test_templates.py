"""Recall wordings from parts (data/templates.py): the held-out families lie outside training by construction."""

import re

import numpy as np
import pytest
import torch

from rope_llama.data import templates as T
from rope_llama.data.recall import RecallConfig, RecallMixer
from rope_llama.inference.retrieval import HELDOUT_TASKS, build_prompt
from tests.test_recall import eval_fragments, haystack
from tests.test_retrieval import macbeth_bpe


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return macbeth_bpe(tmp_path_factory.mktemp("bpe"))


def texts(template: T.Template) -> tuple[str, str]:
    """(statement, question) of `template` with its tag pattern's placeholder fill, as training renders it."""
    tag = T.TAGS[template.tag].format(qualifier="Q", noun="N", name="P", thing=template.thing)
    rendered = T.render(template, tag, 12345)
    return rendered.statement, rendered.question


def test_the_training_space_is_large_and_no_family_template_is_in_it():
    training = set(T.training_templates())
    assert len(training) > 10_000  # generated, not a hand list
    for family in T.FAMILIES:
        held = T.family_templates(family)
        assert len(held) > 100 and not training & set(held), family
        assert all(T.held_out_parts(t) for t in held)
    # every part is used in training, except the held-out ones
    for name, parts in (("statement", T.STATEMENTS), ("question", T.QUESTIONS), ("layout", T.LAYOUTS)):
        used = {getattr(t, name) for t in training}
        assert used == set(parts) - {T.HELD_OUT.get(name)}, name
    assert {t.thing for t in training} == set(T.THINGS)
    assert ("prose", "which") not in {(t.layout, t.question) for t in training}
    assert "which" in {t.question for t in training if t.layout == "line"}  # the combination, not the part
    assert "direct" in {
        t.question for t in training if t.layout == "prose"
    }  # the passkey's shape, not its words


def test_no_heldout_wording_renders_as_a_training_wording():
    training = {texts(t) for t in T.training_templates()}
    for family in T.FAMILIES:
        assert not training & {texts(t) for t in T.family_templates(family)}, family
    statements = {s for s, _ in training}
    questions = {q for _, q in training}
    assert not [s for s in statements if "was set to" in s]
    assert not [q for q in questions if "Do you know" in q]
    assert not [w for w in T.HELD_OUT["things"] if any(w in s for s in statements)]
    # "Which number is X?" never continues a line of prose in training
    assert not [q for q in questions if q.startswith(" Which number is")]


def test_the_passkey_wording_is_no_part_of_training():
    words = {
        w.lower() for s, q in map(texts, T.training_templates()) for w in re.findall(r"[A-Za-z]+", s + q)
    }
    words |= {w.lower() for part in (T.QUALIFIERS, T.NOUNS, T.NAMES) for w in part}
    assert not words & {"pass", "key", "grass", "sky", "quiz", "memorize"}
    fragments = eval_fragments()
    rendered = [s + q for s, q in map(texts, T.training_templates()[::7])]
    assert not [f for f in fragments for r in rendered if f in r]


def varied_windows(tok, count=300, seed=0, **options):
    config = {
        "fraction": 1.0,
        "varied_share": 1.0,
        "min_pairs": 2,
        "max_pairs": 4,
        "queries": 2,
        "seed": seed,
    }
    mixer = RecallMixer(tok, RecallConfig.from_options(config | options), 513)
    rng = np.random.default_rng(seed)
    return mixer, [mixer.window(rng, haystack(tok, 513)) for _ in range(count)]


def test_training_windows_draw_only_training_templates_and_answer_each_question(tok):
    mixer, windows = varied_windows(tok)
    assert set(mixer.templates) == set(T.training_templates())
    layouts = set()
    for w in windows:
        text = tok.decode(w.tokens.tolist())
        assert len(w.tokens) == 513
        assert "was set to" not in text and "Do you know" not in text
        assert not [thing for thing in T.HELD_OUT["things"] if thing in text]
        for (start, end), i in zip(w.answers, w.asked):
            tag, value = w.facts[i]
            assert tok.decode(w.tokens[start:end].tolist()) == f" {value}"
            assert len(re.findall(rf"\b{value}\b", text)) == 2  # stated once, answered once
            asked = tok.decode(w.tokens[max(0, start - 40) : start].tolist())
            assert tag.lower() in asked.lower() or tag[:1].upper() + tag[1:] in asked
        layouts.add("dialogue" if re.search(r"\n[A-Z]+:\n", text) else "list" if "\n- " in text else "other")
    assert layouts == {"dialogue", "list", "other"}
    digits = {len(str(v)) for w in windows for _, v in w.facts}
    assert digits == set(range(T.DIGITS[0], T.DIGITS[1] + 1))


def test_varied_windows_are_deterministic_and_honour_unstated_facts(tok):
    _, first = varied_windows(tok, count=40, seed=3, unstated_share=1.0)
    _, again = varied_windows(tok, count=40, seed=3, unstated_share=1.0)
    assert all((a.tokens == b.tokens).all() for a, b in zip(first, again))
    unstated = [w for w in first if w.unstated is not None]
    assert unstated
    for w in unstated:
        value = w.facts[w.unstated][1]
        assert len(re.findall(rf"\b{value}\b", tok.decode(w.tokens.tolist()))) == 1  # only the answer


def test_the_suites_families_draw_their_own_templates(tok):
    rng = np.random.default_rng(0)
    for task in HELDOUT_TASKS:
        text = "".join(tok.decode(build_prompt(task, tok, 256, 0.5, rng).tokens) for _ in range(30))
        family = task.removeprefix("heldout_")
        layout, part = T.FAMILIES[family]
        assert T.family_templates(family) and all(
            T.held_out_parts(t) == {part} for t in T.family_templates(family)
        )
        if layout:
            assert all(t.layout == layout for t in T.family_templates(family))
        assert ("Do you know" in text) == (family == "dialogue")
        assert ("was set to" in text) == (family == "list")


def test_tags_numbers_and_errors():
    rng = np.random.default_rng(0)
    template = T.Template("code", "of", "is", "line", "cloze", "restate")
    tags = T.tags(template, rng, 5)
    assert len(set(tags)) == 5 and all(t.startswith("the code of the ") for t in tags)
    mixed = T.tags(template, rng, 16, shared_thing=False)
    assert {t.split()[1] for t in mixed} <= set(T.THINGS)
    held = T.tags(T.Template("locker", "owner", "is", "line", "cloze", "restate"), rng, 4, shared_thing=False)
    assert all(t.split()[-1] in T.HELD_OUT["things"] for t in held)  # a held-out thing stays with its kind
    assert {len(str(T.number(rng))) for _ in range(500)} == {3, 4, 5, 6, 7}
    with pytest.raises(ValueError, match="needs 40 distinct tags; the of pattern has 16"):
        T.tags(template, rng, 40)
    with pytest.raises(ValueError, match="held-out family 'poetry' is unknown"):
        T.family_templates("poetry")
    assert T.render(template, "the code of the inn", 123).statement == "The code of the inn is 123.\n"


def test_varied_answers_and_their_stop_weigh_answer_weight_and_unstated_digits_nothing(tok):
    x = torch.arange(6 * 512).view(6, 512) % (tok.vocab_size - 2) + 2
    options = {"fraction": 1.0, "varied_share": 1.0, "min_pairs": 2, "max_pairs": 3, "queries": 2, "seed": 5}
    mixer = RecallMixer(
        tok, RecallConfig.from_options({**options, "answer_weight": 4.0, "unstated_share": 0.5}), 513
    )
    inputs, targets, weights = mixer.mix(9, x, x + 1)
    windows = [mixer.window(np.random.default_rng(0), haystack(tok, 513)) for _ in range(1)]
    assert windows[0].stops
    rng = np.random.default_rng([5, 9])  # the windows `mix` built, drawn again in its order
    rng.random(6)
    seen_unstated = False
    for row in range(6):
        window = mixer.window(rng, torch.cat([x[row], x[row, -1:] + 1]).numpy())
        assert torch.equal(torch.from_numpy(window.tokens[:-1]), inputs[row])
        expected = np.ones(512, dtype=np.float32)
        for (start, end), fact in zip(window.answers, window.asked):
            assert tok.decode(window.tokens[end : end + 1].tolist()) == T.STOP
            expected[start - 1 : end] = 4.0  # the leading space, every digit and the stop after them
            if fact == window.unstated:
                expected[start:end] = 0.0  # digits and where they end cannot be known
                seen_unstated = True
        assert np.array_equal(weights[row].numpy(), expected)
    assert seen_unstated
