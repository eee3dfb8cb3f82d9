"""Synthetic recall windows (data/recall.py) and their train-only mixing in the DataModule."""

import pickle
import re

import numpy as np
import pytest
import torch

from rope_llama.data import DataError, TextDataModule
from rope_llama.data.recall import (
    ADJECTIVES,
    EVAL_WORDS,
    NOUNS,
    QUESTIONS,
    TEMPLATES,
    RecallConfig,
    RecallMixer,
    answer_accuracy,
    held_out_windows,
)
from rope_llama.inference import retrieval
from rope_llama.inference.retrieval import FILLER, INTRO, NEEDLE, QUESTION
from rope_llama.training.callbacks import RecallProbe, mean_cosine
from rope_llama.training.optim import OptimConfig
from tests.helpers import compose_train, small_corpus
from tests.test_retrieval import macbeth_bpe

# The evaluation prompts' wording: no sentence of it (nor its distinctive words) may be trained on.
EVAL_TEXTS = (INTRO, FILLER, NEEDLE, *QUESTION, *retrieval.WORDING)
SUITE_WORDS = {"pass", "key", "grass", "sky", "sun", "green", "blue", "yellow", "important", "irrelevant",
              "memorize", "quiz", "remember", "var", "value", "special"}  # fmt: skip


def eval_fragments() -> list[str]:
    """Every sentence of the evaluation wording, split at its {placeholders} (the parts always present)."""
    sentences = [s for text in EVAL_TEXTS for s in re.split(r"(?<=[.?!])\s+", text.strip())]
    return [f.strip() for s in sentences for f in re.split(r"\{\w+\}", s) if len(f.strip()) > 3]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return macbeth_bpe(tmp_path_factory.mktemp("bpe"))


def haystack(tok, n: int) -> np.ndarray:
    """A neutral haystack of n tokens: the line "and so" again and again."""
    ids = tok.encode("and so\n" * n)
    return np.asarray(ids[:n], dtype=np.int64)


def windows(tok, seed: int, count: int = 30, length: int = 257, **options) -> list:
    mixer = RecallMixer(tok, RecallConfig.from_options({"fraction": 1.0, "seed": seed, **options}), length)
    rng = np.random.default_rng(seed)
    return [mixer.window(rng, haystack(tok, length)) for _ in range(count)]


def test_no_evaluation_wording_can_be_generated(tok):
    texts = [re.sub(r"\{\w+\}", "", s) for t in (*TEMPLATES, QUESTIONS) for s in t]  # without {placeholders}
    words = {w.lower() for text in texts for w in re.findall(r"[A-Za-z]+", text)}
    assert not (words | set(ADJECTIVES) | set(NOUNS)) & SUITE_WORDS
    fragments = eval_fragments()
    assert "The grass is green." in fragments and "What is the pass key?" in fragments
    for w in windows(tok, seed=0, count=200, length=513, max_pairs=6, queries=2, min_pairs=2):
        text = tok.decode(w.tokens.tolist())
        assert not [f for f in fragments if f in text]


def test_answers_appear_earlier_and_end_the_window(tok):
    for w in windows(tok, seed=1, count=50, length=513, min_pairs=2, max_pairs=5, queries=2):
        assert w.tokens.shape == (513,) and w.tokens.dtype == np.int64
        assert w.answers[-1][1] == 513  # the last answer's last digit is the window's last token
        first_answer = w.answers[0][0]
        context = tok.decode(w.tokens[:first_answer].tolist())
        tags = [t for t, _ in w.facts]
        assert len(set(tags)) == len(tags) and len({v for _, v in w.facts}) == len(tags)
        for (a, b), i in zip(w.answers, w.asked):
            tag, value = w.facts[i]
            assert tok.decode(w.tokens[a:b].tolist()) == f" {value}"
            # The fact is stated before the questions, and the question names it right before the answer.
            assert re.search(rf"The (number of the )?{tag} is {value}\.", context)
            assert re.search(rf"{tag} is$", tok.decode(w.tokens[:a].tolist()))
        # Facts occur in the window in the listed order.
        positions = [context.index(f"{tag} is {value}") for tag, value in w.facts]
        assert positions == sorted(positions)


def test_questions_continue_the_line_in_midline_share_of_windows(tok):
    """The passkey's question ends a long line: with midline_share 0.5 about half the windows ask mid-line
    (". " between questions), the rest line by line (".\n"); with 0 (the default) all ask line by line."""
    for share, low, high in [(0.5, 30, 70), (0.0, 0, 0)]:
        breaks = []
        for w in windows(tok, seed=2, count=100, length=513, min_pairs=2, queries=2, midline_share=share):
            between = tok.decode(w.tokens[w.answers[0][1] : w.answers[1][0]].tolist())
            assert between.startswith((".\n", ". ")) and "\n" not in between[2:]
            breaks.append(between[:2])
        assert low <= breaks.count(". ") <= high


def test_flat_share_windows_are_one_line_with_facts_after_sentence_ends(tok):
    """flat_share 1: the haystack's lines are joined (the passkey prompt is one long line), each fact
    follows a sentence end as " The <tag> is <value>.", questions continue the line, answers still copy."""
    lines = tok.encode("And so it goes.\nWe came.\n" * 300)
    mixer = RecallMixer(tok, RecallConfig.from_options({"fraction": 1.0, "flat_share": 1.0, "queries": 2,
                                                        "min_pairs": 2}), 513)  # fmt: skip
    rng = np.random.default_rng(5)
    for start in range(0, 200, 10):
        w = mixer.window(rng, np.asarray(lines[start : start + 513], dtype=np.int64))
        text = tok.decode(w.tokens.tolist())
        assert w.tokens.shape == (513,) and "\n" not in text
        for tag, value in w.facts:
            assert re.search(rf"(^|[.]) The (number of the )?{tag} is {value}\.", text)
        for (a, b), i in zip(w.answers, w.asked):
            assert tok.decode(w.tokens[a:b].tolist()) == f" {w.facts[i][1]}"
    plain = windows(tok, seed=6, count=20, length=513, queries=2, min_pairs=2)
    assert all("\n" in tok.decode(w.tokens.tolist()) for w in plain)  # flat_share 0 (the default): lines


def test_deterministic_per_seed_and_different_across_seeds(tok):
    same = [w.tokens for w in windows(tok, seed=3)], [w.tokens for w in windows(tok, seed=3)]
    other = [w.tokens for w in windows(tok, seed=4)]
    assert all(np.array_equal(a, b) for a, b in zip(*same))
    assert not all(np.array_equal(a, b) for a, b in zip(same[0], other))


def test_curriculum_starts_short_and_small(tok):
    options = {"fraction": 1.0, "min_pairs": 1, "max_pairs": 6, "curriculum_batches": 100}
    mixer = RecallMixer(tok, RecallConfig.from_options(options), 513)
    assert (mixer.progress(0), mixer.progress(50), mixer.progress(500)) == (0.0, 0.5, 1.0)
    rng = np.random.default_rng(0)
    early = [mixer.window(rng, haystack(tok, 513), progress=0.0) for _ in range(50)]
    late = [mixer.window(rng, haystack(tok, 513), progress=1.0) for _ in range(50)]
    assert {len(w.facts) for w in early} == {1} and max(len(w.facts) for w in late) > 3
    start = lambda w: tok.decode(w.tokens.tolist()).index(f"{w.facts[0][0]} is")  # noqa: E731
    assert min(start(w) for w in early) > max(start(w) for w in late) / 2  # early facts sit late


def test_full_curriculum_puts_some_facts_a_whole_window_back(tok):
    """far_share of the windows (one fact each here) hold it in the haystack's first tenth, the passkey's
    distance at depth 0; uniform placement alone puts about a tenth there."""

    def share_in_first_tenth(far_share: float) -> float:
        options = {"fraction": 1.0, "min_pairs": 1, "max_pairs": 1, "far_share": far_share}
        mixer = RecallMixer(tok, RecallConfig.from_options(options), 257)
        rng = np.random.default_rng(0)
        found = [mixer.window(rng, haystack(tok, 257)) for _ in range(300)]
        texts = [(tok.decode(w.tokens.tolist()), w.facts[0][0]) for w in found]
        return np.mean([text.index(f"{tag} is") < 0.1 * len(text) for text, tag in texts])

    assert RecallConfig().far_share == 0.3
    shares = [share_in_first_tenth(f) for f in (0.0, 0.3, 0.9)]
    assert shares[0] < 0.2 < 0.3 < shares[1] < 0.5 < 0.8 < shares[2]


def test_shared_noun_windows_tell_facts_apart_only_by_the_adjective(tok):
    """With shared_noun_share 0.5 about half the windows' tags all end in one noun (distinct adjectives); with
    0 (the default) each tag is drawn whole, so a shared noun among 3-4 facts is rare."""
    for share, low, high in [(0.5, 30, 70), (0.0, 0, 10)]:
        shared = []
        for w in windows(tok, seed=5, count=100, min_pairs=3, max_pairs=4, shared_noun_share=share):
            adjectives, nouns = zip(*(tag.split() for tag, _ in w.facts))
            assert len(set(adjectives)) == len(adjectives) or len(set(nouns)) > 1
            shared.append(len(set(nouns)) == 1)
        assert low <= sum(shared) <= high


def test_decoys_repeat_a_never_asked_fact_on_an_asked_facts_noun(tok):
    """decoy_share 1 at full curriculum: a fact with another adjective on the first asked fact's noun and a
    value no fact has, stated 2-8 times (as room allows), never asked; the answers still copy the asked facts.
    At the curriculum's start, and with decoy_share 0 (the default), no window has one, and 0 draws nothing:
    the windows are those of a config without the key."""
    options = {"fraction": 1.0, "min_pairs": 2, "max_pairs": 4, "queries": 2, "shared_noun_share": 0.5}
    mixer = RecallMixer(tok, RecallConfig.from_options({**options, "decoy_share": 1.0}), 513)
    rng, counts = np.random.default_rng(7), []
    for _ in range(60):
        w = mixer.window(rng, haystack(tok, 513), progress=1.0)
        text = tok.decode(w.tokens.tolist())
        counts.append(len(w.decoys))
        if not w.decoys:
            continue
        (tag, value), tags = w.decoys[0], [t for t, _ in w.facts]
        assert set(w.decoys) == {(tag, value)} and tag not in tags
        assert tag.split()[1] == tags[w.asked[0]].split()[1] and value not in {v for _, v in w.facts}
        assert text.count(f"The {tag} is {value}.\n") == len(w.decoys)  # whole lines, each its own
        for (a, b), i in zip(w.answers, w.asked):
            assert tok.decode(w.tokens[a:b].tolist()) == f" {w.facts[i][1]}" and w.facts[i][0] != tag
    assert max(counts) <= 8 and np.mean([c >= 2 for c in counts]) > 0.8
    assert not any(mixer.window(rng, haystack(tok, 513), progress=0.0).decoys for _ in range(20))
    off = [w.tokens for w in windows(tok, seed=8, length=513, **options, decoy_share=0.0)]
    assert all(np.array_equal(a, b.tokens) for a, b in zip(off, windows(tok, seed=8, length=513, **options)))


def test_options_are_checked():
    assert RecallConfig.from_options(None).fraction == 0.0
    with pytest.raises(DataError, match=r"data.recall keys \['fration'\] are unknown"):
        RecallConfig.from_options({"fration": 0.5})
    with pytest.raises(DataError, match=r"data\.recall\.fraction must be a finite number in \[0, 1\]"):
        RecallConfig.from_options({"fraction": 1.5})
    with pytest.raises(DataError, match="queries <= min_pairs <= max_pairs"):
        RecallConfig.from_options({"queries": 3, "min_pairs": 2})
    with pytest.raises(DataError, match=r"data.recall.far_share must be a finite number in \[0, 1\], got 2"):
        RecallConfig.from_options({"far_share": 2})
    with pytest.raises(DataError, match=r"data\.recall\.midline_share must be a finite number in \[0, 1\]"):
        RecallConfig.from_options({"midline_share": -0.1})
    with pytest.raises(DataError, match=r"data\.recall\.flat_share must be a finite number in \[0, 1\]"):
        RecallConfig.from_options({"flat_share": 1.5})
    with pytest.raises(DataError, match="shared_noun_share needs max_pairs <= 30"):
        RecallConfig.from_options({"shared_noun_share": 0.5, "max_pairs": 31})


def test_too_short_windows_fail_before_training(tok):
    config = RecallConfig.from_options({"fraction": 1.0, "min_pairs": 4, "max_pairs": 4})
    with pytest.raises(DataError, match="but training windows have 65; raise data.max_len"):
        RecallMixer(tok, config, 65)
    mixer = RecallMixer(tok, config, 257)
    assert mixer.longest_synthetic() < 257
    with pytest.raises(DataError, match="a haystack of 40 tokens cannot hold"):
        mixer.window(np.random.default_rng(0), haystack(tok, 40))


def test_mixing_touches_only_training_windows(tmp_path):
    corpus = small_corpus(tmp_path / "corpus")
    common = dict(source={"kind": "text_files", "paths": corpus}, max_len=256, batch_size=8, vocab_size=1024,
                  cache_dir=str(tmp_path / "cache"))  # fmt: skip
    plain = TextDataModule(**common)
    mixed = TextDataModule(**common, recall={"fraction": 0.5, "seed": 7, "min_pairs": 2, "max_pairs": 3})
    for dm in (plain, mixed):
        dm.prepare_data()
        dm.setup("fit")
    x0, y0 = plain.train_set.batch(5)
    x1, y1 = mixed.train_set.batch(5)
    assert x1.shape == x0.shape == (8, 256) and bool((x1[:, 1:] == y1[:, :-1]).all())
    changed = (x0 != x1).any(1)
    assert 0 < int(changed.sum()) < 8  # about half the rows became recall windows
    assert (x0[~changed] == x1[~changed]).all()
    for window in torch.cat([x1, y1[:, -1:]], 1)[changed]:  # each ends with a question and its answer
        assert re.search(r" is \d{5}$", mixed.tokenizer.decode(window.tolist()))
    assert np.array_equal(mixed.train_set.batch(5)[0], x1)  # a pure function of (seed, batch index)
    # Validation and test windows are the plain ones, so held-out bpc stays comparable.
    for split in ("val", "test"):
        plain_loader = getattr(plain, f"{split}_dataloader")()
        mixed_loader = getattr(mixed, f"{split}_dataloader")()
        for (a, _), (b, _) in zip(plain_loader, mixed_loader, strict=True):
            assert np.array_equal(a, b)
    pickle.loads(pickle.dumps(mixed.train_set))  # DataLoader workers receive a copy


def test_experiment_composes(tmp_path):
    cfg = compose_train(["experiment=recall_base"], tmp_path / "run")
    assert cfg.data.recall.fraction > 0
    recall = RecallConfig.from_options(dict(cfg.data.recall))
    assert recall.queries == cfg.data.recall.queries
    assert cfg.model.mix_previous_tokens and cfg.optim.name == "muon" and cfg.data.recall.copy_fraction > 0
    # the answers weigh more in the loss (reports/2026-11-27-recall-rounds.md, tenth round)
    assert cfg.data.recall.answer_weight > 1
    assert recall.word_tag_share > 0 and recall.unstated_share > 0  # eighteenth round
    assert cfg.optim.min_lr_ratio > OptimConfig().min_lr_ratio  # the recipe's own floor
    assert cfg.optim.muon_lr == 0.02  # the bases' Muon rate, not optim=muon's default (0.01 since 2026-11-28)
    assert recall.counting_share > 0  # twenty-second round: the digits stay apart, the copy forms by step 650


def test_copy_windows_repeat_text_spans_and_numbers_at_varying_distances(tok):
    mixer = RecallMixer(tok, RecallConfig.from_options({"copy_fraction": 1.0}), 257)
    text = np.arange(500, 757, dtype=np.int64)  # distinct ids, none a digit or a space
    window = mixer.copy_window(np.random.default_rng(0), text)
    assert window.shape == (257,) and window.dtype == np.int64
    numbers = re.findall(r" \d{5}", tok.decode([t for t in window.tolist() if t not in set(text)]))
    assert any(numbers.count(v) == 2 for v in numbers)  # a number and its repeat
    texts = window[np.isin(window, text)]
    distances = set()
    for t in range(1, len(texts)):
        earlier = np.flatnonzero(texts[:t] == texts[t])
        if len(earlier):
            distances.add(t - int(earlier[-1]))
    assert len(distances) >= 3  # text spans repeat at several distances: no fixed offset to learn
    repeated = np.mean([bool((texts[:t] == texts[t]).any()) for t in range(len(texts))])
    assert 0.3 < repeated < 0.7  # about half the text repeats what came before
    assert np.array_equal(mixer.copy_window(np.random.default_rng(0), text), window)


def test_counting_share_makes_copy_windows_numbers_runs_of_consecutive_values(tok):
    """counting_share 1: every number span is 2-4 consecutive 5-digit values, still stated twice; the text
    spans are drawn as before. 0 keeps the windows of a config without the key (no extra draw)."""
    text = np.arange(500, 757, dtype=np.int64)  # distinct ids, none a digit or a space
    plain = RecallMixer(tok, RecallConfig.from_options({"copy_fraction": 1.0}), 257)
    off = RecallMixer(tok, RecallConfig.from_options({"copy_fraction": 1.0, "counting_share": 0.0}), 257)
    assert np.array_equal(
        plain.copy_window(np.random.default_rng(3), text), off.copy_window(np.random.default_rng(3), text)
    )
    mixer = RecallMixer(tok, RecallConfig.from_options({"copy_fraction": 1.0, "counting_share": 1.0}), 257)
    text_ids, bar = set(text.tolist()), tok.encode("|")[0]  # text decodes as "|": numbers stand apart
    runs = []
    for seed in range(20):
        window = mixer.copy_window(np.random.default_rng(seed), text)
        decoded = tok.decode([bar if t in text_ids else t for t in window.tolist()])
        runs += [r.split() for r in re.findall(r"(?: \d{5})+", decoded)[:-1]]  # the last may be cut off
    segments = []  # adjacent spans read as one: split where a number is not its predecessor + 1
    for run in runs:
        values = list(map(int, run))
        cuts = [0] + [i for i in range(1, len(values)) if values[i] != values[i - 1] + 1] + [len(values)]
        segments += [tuple(values[a:b]) for a, b in zip(cuts, cuts[1:])]
    assert len(segments) > 40 and {len(v) for v in segments} == {2, 3, 4}  # never a lone number
    twice = np.mean([segments.count(v) >= 2 for v in segments])
    assert twice > 0.8  # each run is stated twice (unless cut off at the window's end)
    with pytest.raises(DataError, match=r"data\.recall\.counting_share must be a finite number in \[0, 1\]"):
        RecallConfig.from_options({"counting_share": 1.5})


def test_copy_fraction_turns_other_rows_into_copy_windows(tok):
    config = RecallConfig.from_options({"fraction": 0.25, "copy_fraction": 1.0, "seed": 1})
    mixer = RecallMixer(tok, config, 257)
    x = torch.arange(16 * 256).view(16, 256) % (tok.vocab_size - 2) + 2
    y = x + 1
    mixed, _ = mixer.mix(0, x, y)
    recall_rows = [
        r
        for r in range(16)
        if re.search(r" is \d{5}$", tok.decode(torch.cat([mixed[r], _[r, -1:]]).tolist()))
    ]
    others = [r for r in range(16) if r not in recall_rows]
    assert recall_rows and others  # x's rows have no repeated token: a copy window repeats about half
    assert all(len(set(mixed[r].tolist())) < 0.7 * 256 for r in others)
    with pytest.raises(DataError, match=r"data\.recall\.copy_fraction must be a finite number in \[0, 1\]"):
        RecallConfig.from_options({"copy_fraction": -0.1})


def test_unstated_facts_are_asked_but_never_stated(tok):
    """unstated_share 1 at full curriculum: one asked fact's statement is left out (its value occurs only as
    its answer), the other facts are stated as usual; its answer's leading space weighs answer_weight and its
    digits 0. At the curriculum's start no fact is left out, and 0 draws nothing."""
    options = {"fraction": 1.0, "min_pairs": 2, "max_pairs": 4, "queries": 2, "answer_weight": 5.0}
    mixer = RecallMixer(tok, RecallConfig.from_options({**options, "unstated_share": 1.0}), 513)
    rng = np.random.default_rng(3)
    for _ in range(30):
        w = mixer.window(rng, haystack(tok, 513), progress=1.0)
        text = tok.decode(w.tokens.tolist())
        assert w.unstated in w.asked
        for i, (_, value) in enumerate(w.facts):  # a value occurs in its statement and in its answer
            assert (text.count(str(value)) == w.asked.count(i)) == (i == w.unstated)
    assert all(mixer.window(rng, haystack(tok, 513), progress=0.0).unstated is None for _ in range(20))
    off = [w.tokens for w in windows(tok, seed=8, length=513, **options, unstated_share=0.0)]
    assert all(np.array_equal(a, b.tokens) for a, b in zip(off, windows(tok, seed=8, length=513, **options)))

    x = torch.arange(4 * 512).view(4, 512) % (tok.vocab_size - 2) + 2
    inputs, targets, weights = mixer.mix(5, x, x + 1)
    for row in range(4):
        text = tok.decode(torch.cat([inputs[row], targets[row, -1:]]).tolist())
        answers = re.findall(r" is( \d{5})(?=$|\.\n|\. )", text)[-2:]
        trained = targets[row][weights[row] == 5.0].tolist()
        assert (weights[row] == 0).sum() == 5 and (
            weights[row] == 5.0
        ).sum() == 7  # one answer's 5 digits off
        assert tok.decode(trained) in {" " + answers[1], answers[0] + " "}  # the unstated one: its space only
    with pytest.raises(
        DataError, match=r"data.recall.unstated_share must be a finite number in \[0, 1\], got 2"
    ):
        RecallConfig.from_options({"unstated_share": 2})


def test_word_tags_are_two_vocabulary_words_never_the_evaluation_words(tok):
    """word_tag_share 1: every tag is two one-token words of the vocabulary (none of the retrieval suite's
    words), stated and asked as usual; with shared nouns they share the second word. 0 draws nothing."""
    fragments = [re.sub(r"\{\w+\}", "", t) for t in EVAL_TEXTS]
    suite_words = {w.lower() for t in fragments for w in re.findall(r"[A-Za-z]+", t)} | set(retrieval.NAMES)
    assert suite_words <= EVAL_WORDS  # the code's exclusion list covers the suite's wording
    options = {"min_pairs": 2, "max_pairs": 4, "queries": 2}
    for shared in (0.0, 1.0):
        ws = windows(tok, seed=4, length=513, **options, word_tag_share=1.0, shared_noun_share=shared)
        for w in ws:
            text = tok.decode(w.tokens.tolist())
            for tag, value in w.facts:
                first, second = tag.split()
                assert len(tok.encode(f" {first}")) == len(tok.encode(f" {second}")) == 1
                assert not {first, second} & EVAL_WORDS and f"{tag} is {value}" in text
            assert len({t.split()[1] for t, _ in w.facts}) == (1 if shared else len({t for t, _ in w.facts}))
            assert not [f for f in eval_fragments() if f in text]
    off = [w.tokens for w in windows(tok, seed=8, length=513, **options, word_tag_share=0.0)]
    assert all(np.array_equal(a, b.tokens) for a, b in zip(off, windows(tok, seed=8, length=513, **options)))


def test_filler_repeats_word_valued_statements_about_the_asked_tags_last_word(tok):
    """filler_share 1 at full curriculum: a block of 1-3 "The <word> is <word>." statements, the first about the
    first asked fact's last tag word, values one-token vocabulary words (never the suite's), stated 2-8 times
    (as room allows), each block whole on its own line; the answers still copy the asked facts. At the
    curriculum's start and with filler_share 0 (the default) no window has one, and 0 draws nothing."""
    options = {"fraction": 1.0, "min_pairs": 2, "max_pairs": 4, "queries": 2}
    mixer = RecallMixer(tok, RecallConfig.from_options({**options, "filler_share": 1.0}), 513)
    rng, counts = np.random.default_rng(3), []
    for _ in range(60):
        w = mixer.window(rng, haystack(tok, 513), progress=1.0)
        text = tok.decode(w.tokens.tolist())
        counts.append(w.filler_repeats)
        if not w.filler_repeats:
            continue
        assert len(w.filler) in (1, 2, 3) and w.filler[0][0] == w.facts[w.asked[0]][0].split()[-1]
        for subject, value in w.filler:
            assert len(tok.encode(f" {value}")) == 1 and value not in EVAL_WORDS and subject not in EVAL_WORDS
        block = " ".join(f"The {s} is {v}." for s, v in w.filler) + "\n"
        assert text.count(block) == w.filler_repeats
        assert not [f for f in eval_fragments() if f in text]
        for (a, b), i in zip(w.answers, w.asked):
            assert tok.decode(w.tokens[a:b].tolist()) == f" {w.facts[i][1]}"
    assert max(counts) <= 8 and np.mean([c >= 2 for c in counts]) > 0.8
    assert not any(mixer.window(rng, haystack(tok, 513), progress=0.0).filler_repeats for _ in range(20))
    off = [w.tokens for w in windows(tok, seed=8, length=513, **options, filler_share=0.0)]
    assert all(np.array_equal(a, b.tokens) for a, b in zip(off, windows(tok, seed=8, length=513, **options)))


def test_answer_weight_marks_exactly_the_answer_targets(tok):
    """answer_weight w: a third (B, L) tensor weighs each recall answer's targets (the value " 73912", space
    first) by w and every other target by 1; the tokens are those of the unweighted mixer's batch."""
    x = torch.arange(8 * 256).view(8, 256) % (tok.vocab_size - 2) + 2
    y = x + 1
    options = {"fraction": 0.5, "copy_fraction": 0.5, "seed": 3, "min_pairs": 2, "max_pairs": 3, "queries": 2}
    plain = RecallMixer(tok, RecallConfig.from_options(options), 257).mix(4, x, y)
    weighted = RecallMixer(tok, RecallConfig.from_options({**options, "answer_weight": 5.0}), 257).mix(
        4, x, y
    )
    assert len(plain) == 2 and len(weighted) == 3
    assert all(torch.equal(a, b) for a, b in zip(plain, weighted[:2]))
    inputs, targets, weights = weighted
    assert weights.shape == (8, 256) and weights.dtype == torch.float32
    assert set(weights.unique().tolist()) == {1.0, 5.0}
    for row in range(8):
        answers = tok.decode(targets[row][weights[row] == 5.0].tolist())
        text = tok.decode(torch.cat([inputs[row], targets[row, -1:]]).tolist())
        values = re.findall(r" is( \d{5})(?=$|\.\n|\. )", text)  # the answers after the questions
        if re.search(r" is \d{5}$", text):  # a recall window: two answers, each a space and five digits
            assert answers == "".join(values[-2:]) and len(answers) == 12
        else:
            assert answers == ""
    with pytest.raises(
        DataError, match=r"data.recall.answer_weight must be a finite number >= 1 \(1 = off\), got 0.5"
    ):
        RecallConfig.from_options({"answer_weight": 0.5})


def test_weighted_batches_train():
    """A weighted batch goes through LitLlama's loss: the weighted mean, not the plain one."""
    from rope_llama.model.config import ModelConfig
    from rope_llama.training.module import LitLlama

    lit = LitLlama(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1))
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    weights = torch.ones(2, 16)
    weights[0, 3] = 50.0
    plain, same, weighted = (
        lit._loss((x, y)),
        lit._loss((x, y, torch.ones(2, 16))),
        lit._loss((x, y, weights)),
    )
    torch.testing.assert_close(plain, same)
    logits = lit(x).float()
    per_target = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    torch.testing.assert_close(
        weighted, (per_target * weights.flatten()).sum() / weights.sum(), rtol=1e-5, atol=1e-6
    )
    assert not torch.allclose(weighted, plain)


def test_copy_windows_alone_turn_the_mixer_on(tmp_path):
    corpus = small_corpus(tmp_path / "corpus")
    dm = TextDataModule(source={"kind": "text_files", "paths": corpus}, max_len=256, batch_size=8,
                        vocab_size=1024, cache_dir=str(tmp_path / "cache"), recall={"copy_fraction": 1.0})  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    x, _ = dm.train_set.batch(0)
    assert all(len(set(row.tolist())) < 0.8 * 256 for row in x)  # every row repeats about half its tokens


def test_held_out_windows_cut_the_given_text_deterministically_and_state_every_asked_fact(tok):
    text = np.asarray(tok.encode("Upon the heath there stood a crooked tree\n" * 300), dtype=np.int64)
    cfg = RecallConfig.from_options({"fraction": 0.4, "min_pairs": 2, "max_pairs": 3, "queries": 2,
                                     "unstated_share": 1.0})  # fmt: skip
    first, again, other = (held_out_windows(tok, cfg, text, 257, 6, seed) for seed in (0, 0, 1))
    assert len(first) == 6 and all(np.array_equal(a.tokens, b.tokens) for a, b in zip(first, again))
    assert not all(np.array_equal(a.tokens, b.tokens) for a, b in zip(first, other))
    for w in first:
        decoded = tok.decode(w.tokens.tolist())
        assert w.tokens.shape == (257,) and w.unstated is None and "heath" in decoded
        before_questions = tok.decode(w.tokens[: w.answers[0][0]].tolist())
        assert all(str(w.facts[i][1]) in before_questions for i in w.asked)  # stated before any answer
    assert held_out_windows(tok, cfg, text[:200], 257, 6) == []  # too little text for one window


def test_answer_accuracy_scores_the_leading_space_and_every_digit(tok):
    ws = windows(tok, seed=3, count=4, min_pairs=2, max_pairs=2, queries=2)
    perfect = np.stack([w.tokens[1:] for w in ws])  # (B, L): row i predicts windows[i].tokens[1:]
    assert answer_accuracy(perfect, ws) == (1.0, 1.0)
    digits = sum(end - start - 1 for w in ws for start, end in w.answers)
    wrong = perfect.copy()
    start, _ = ws[0].answers[0]
    wrong[0, start - 1] += 1  # the leading space missed: the answer is wrong, its digits are not
    start, _ = ws[1].answers[1]
    wrong[1, start + 1] += 1  # the second digit missed
    assert answer_accuracy(wrong, ws) == (6 / 8, (digits - 1) / digits)


def test_recall_probe_logs_perfect_scores_for_a_model_that_knows_each_next_token(tok, capsys):
    """The probe's wiring: what it feeds the model lines up with what answer_accuracy scores; a late
    validation at chance warns."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    text = np.asarray(tok.encode("Upon the heath there stood a crooked tree\n" * 300), dtype=np.int64)
    cfg = RecallConfig.from_options({"fraction": 0.4, "min_pairs": 1, "max_pairs": 2})
    data = SimpleNamespace(recall=cfg, documents=lambda split: [text], tokenizer=tok, max_len=256)
    trainer = SimpleNamespace(datamodule=data, is_global_zero=True, sanity_checking=False, global_step=10,
                              max_steps=100, precision_plugin=SimpleNamespace(val_step_context=nullcontext))  # fmt: skip
    probe = RecallProbe(windows=5, batch_size=2)
    probe.setup(trainer, None, "fit")
    assert len(probe.windows) == 5

    def scores(shift: int) -> dict:
        """Logged metrics of a model that predicts window.tokens[t + shift] at input position t."""
        following = {tuple(w.tokens[:-1].tolist()): w.tokens for w in probe.windows}

        class Model:
            embed = torch.nn.Embedding(tok.vocab_size, 8)

            def __call__(self, inputs):  # (b, L) -> (b, L, V) one-hot logits
                rows = [following[tuple(row.tolist())][shift : shift + inputs.shape[1]] for row in inputs]
                return torch.nn.functional.one_hot(torch.tensor(np.stack(rows)), tok.vocab_size).float()

        logged = {}
        model = Model()
        module = SimpleNamespace(model=model, device="cpu", log=lambda k, v, **_: logged.update({k: v}))
        probe.on_validation_epoch_end(trainer, module)
        digits = model.embed.weight[[tok.encode(str(d))[0] for d in range(10)]]
        assert logged.pop("val/digit_similarity") == mean_cosine(digits)
        return logged

    assert scores(shift=1) == {"val/recall_digits": 1.0, "val/recall_exact": 1.0}
    assert scores(shift=0)["val/recall_exact"] == 0.0  # one position off: nothing is right
    assert "RecallProbe" not in capsys.readouterr().out  # step 10 of 100: too early to tell
    trainer.global_step = 75
    scores(shift=1)
    assert "RecallProbe" not in capsys.readouterr().out  # late, but it copies
    scores(shift=0)
    assert "at step 75 of 100 the held-out recall digits are at 0.0" in capsys.readouterr().out


def test_mean_cosine_is_the_mean_over_distinct_pairs():
    assert mean_cosine(torch.eye(3)) == pytest.approx(0.0)
    assert mean_cosine(torch.ones(4, 5) * torch.arange(1.0, 5.0)[:, None]) == pytest.approx(1.0)
    pairs = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])  # cosines 1/sqrt(2), 0, 1/sqrt(2)
    assert mean_cosine(pairs) == pytest.approx(2**0.5 / 3)
