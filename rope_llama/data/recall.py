"""Synthetic associative-recall training windows: facts spliced into real training text, asked at the end.

A model trained for minutes on plays never learns to copy a number from far back in its context
(passkey accuracy stays at chance), so `data.recall` turns a fraction of the training windows into
recall windows. A recall window keeps the window's own text as the haystack, inserts a few facts
at line starts, and ends with questions about some of them, each followed by its answer:

    And I will make thee think thy swan a crow.
    The silver bell is 73912.
    ROMEO:
    ...
    What is the silver bell? The silver bell is 73912

Design, and why:
- Values are 5-digit numbers: the byte-level BPE trained here has no digit merges, so " 73912" is
  " " plus one token per digit, the same shape as the passkey's key, and recalling it is copying
  five tokens after matching the tag ("silver bell") seen once before.
- Several facts with distinct tags and values, so the answer is not simply the last number.
- The haystack is real training text, so the window still teaches the language model (held-out
  bpc stays comparable), and the windows' validation/test splits are never touched.
- None of the evaluation prompts' sentences (inference/retrieval.py, which scripts/passkey.py uses) can occur:
  the word lists avoid their words (no "pass", "key", "grass", "sky", ...); tests check it.
- Curriculum: over the first `curriculum_batches` batches the largest number of facts grows from
  `min_pairs` to `max_pairs`, and facts move from the window's last quarter (short distance) to
  anywhere in it; then 30% of windows put a fact in the first tenth (`far_share`), the passkey's
  distance at depth 0.

- Shared nouns (`shared_noun_share`): a share of windows whose tags all end in one noun, so a question is
  matched by more than the token before " is" (the passkey's " ke"+"y is" ends like the filler's " sk"+"y is").
- Decoys (`decoy_share`): a share of windows also state one never-asked fact several times, its tag sharing the
  noun of an asked fact ("old bell" beside "iron bell"), so a question's last tokens match a repeated wrong value
  more often than the right one, as the passkey's filler repeats " sk"+"y is blue" a dozen times.
- Unstated facts (`unstated_share`): one asked fact is never stated, and only its answer's leading space is
  trained, so the question alone must predict a number. Word tags (`word_tag_share`): tags of two random
  vocabulary words (never the suite's words, `EVAL_WORDS`), so that prediction is not tied to the word lists.
- Filler (`filler_share`): a block of never-asked "The <word> is <word>." statements repeated through the
  haystack, the first about the asked tag's last word, so the nearest match for a question's " is" is followed
  by a word, never the number, as in the passkey's filler.
- Copy windows (`copy_fraction`, `RecallMixer.copy_window`): spans of text and 5-digit numbers, each
  twice at varying distances, teach the content matching (an induction head) that recall relies on.
- Counting runs (`counting_share`): a copy window's numbers as runs of consecutive values, so the ten digits
  stay apart in the embedding before any copy forms; with random values only they fold together first.

- Generated wordings (`varied_share`): a window worded by a template of data/templates.py's training space
  (thing words, tag patterns, statements, prose / line / list / dialogue layouts, questions, answer leads; 3-7
  digit numbers, each answer followed by a "." weighted as the answer), so retrieval is not bound to one
  wording; the held-out families there are what the retrieval suite asks. `word_thing_share` names a share of
  their things with vocabulary words, so a question about a thing never named in training still asks for a number.

Everything is a pure function of (recall seed, batch index), so batches stay resumable.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from rope_llama.core.schema import check_fields
from rope_llama.data import DataError, templates
from rope_llama.data.tokenizer import Tokenizer

ADJECTIVES = (
    "old", "new", "little", "great", "silver", "golden", "iron", "wooden", "black", "white",
    "red", "broken", "hidden", "second", "third", "northern", "southern", "eastern", "western",
    "stone", "copper", "velvet", "crimson", "bright", "dark", "empty", "heavy", "narrow", "quiet",
    "ancient",
)  # fmt: skip
NOUNS = (
    "crown", "sword", "ring", "letter", "tower", "gate", "ship", "garden", "castle", "bell",
    "lamp", "horse", "cup", "coin", "book", "door", "bridge", "chest", "cloak", "shield",
    "candle", "mirror", "window", "wall", "road", "river", "forest", "mill", "harbour", "chapel",
)  # fmt: skip
# (fact sentence, the words a question repeats before the answer): a query repeats the fact's own
# opening words, so recalling means matching them and copying what followed.
TEMPLATES = (
    ("The {tag} is {value}.", "The {tag} is"),
    ("The number of the {tag} is {value}.", "The number of the {tag} is"),
    ("The {tag} is {value}. Say it once more: {value} is the {tag}.", "The {tag} is"),
)
# Words of the retrieval suite's prompts and its multi-key names (inference/retrieval.py; a test checks the
# set covers them): never drawn as tag words (`word_tag_share`), so no window states "The pass key is ...".
EVAL_WORDS = frozenset(
    "a about again all an and are back blue find go grass green here hidden i important info information inside "
    "irrelevant is it key keys lot memorize of one pass quiz remember sky sun text the there value var we what will "
    "yellow you fox owl bear wolf hare crow deer lynx seal swan mole toad frog goat lark wren".split()
)
TAG_WORD = re.compile(r" [a-z]{3,12}")  # a vocabulary entry that is one whole lowercase word after a space
QUESTIONS = ("What is the {tag}?", "Which number goes with the {tag}?", "Tell me the {tag}.", "")
FORMS = ("{}\n", " {}")  # a fact as its own line, or as a sentence inside a flat haystack (flat_share)
VALUE_RANGE = (10_000, 100_000)  # 5-digit values, like the passkey's keys
START_FRACTION = 0.75  # at the start of the curriculum, facts go into the window's last quarter
# The haystack's first FAR_SPAN is where `far_share` of the windows put their first fact: the
# passkey at depth 0 sits a whole window back, a distance uniform placement seldom trains.
FAR_SPAN = 0.1
# Times a decoy fact or filler block is stated (uniform, inclusive); the passkey's filler repeats ~12 times.
DECOY_REPEATS = (2, 8)
FILLER_STATEMENTS = (1, 3)  # statements per filler block (uniform, inclusive); the passkey's has three
DECOY_TEMPLATE = TEMPLATES[0][0]  # the shortest fact wording, so repeats fit beside the facts
COUNTING_RUN = (2, 4)  # consecutive numbers in one counting span (uniform, inclusive)
MIN_HAYSTACK = 0.25  # decoys are dropped rather than shrink the haystack below this share of the window


def capped_repeats(rng: np.random.Generator, length: int, free: int) -> int:
    """Times to state a `length`-token decoy or filler block: uniform in DECOY_REPEATS, capped to what `free`
    tokens hold."""
    repeats = int(rng.integers(DECOY_REPEATS[0], DECOY_REPEATS[1] + 1))
    return min(repeats, max(0, free // length))


@dataclass(frozen=True)
class RecallConfig:
    """The `data.recall` options (docs/data.md). fraction 0 turns recall windows off. Field metadata: the
    allowed values (core/schema.py), checked by `from_options` and by the command schemas."""

    # probability that a training window becomes a recall window
    fraction: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # seeds the recall windows, independently of data.seed
    seed: int = field(default=0, metadata={"minimum": 0})
    # facts per window, drawn uniformly in [min_pairs, max_pairs]
    min_pairs: int = field(default=1, metadata={"minimum": 1})
    max_pairs: int = field(default=4, metadata={"minimum": 0})
    # questions at the end, each about a different fact (at most min_pairs)
    queries: int = field(default=1, metadata={"minimum": 1})
    # batches over which distance and facts grow to full; 0 = none
    curriculum_batches: int = field(default=0, metadata={"minimum": 0, "means": "0 = none"})
    # probability that another window becomes a copy window (`copy_window`)
    copy_fraction: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # Share of recall windows whose questions continue the haystack's last line instead of starting their
    # own: the passkey's question ends a long line, where a model that saw only line-initial questions
    # ends the line instead of answering.
    midline_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # Share of recall windows whose haystack is one long line (its newlines become spaces), facts sit after
    # sentence ends and questions continue the line: the passkey prompt is a single ~250-token line, where a
    # model that only saw verse (a newline every ~10 tokens) answers "The pass key is" with a newline.
    flat_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # share of windows (at full curriculum) with a fact in the haystack's first tenth
    far_share: float = field(default=0.3, metadata={"minimum": 0, "maximum": 1})
    # Share of recall windows whose tags all end in the same noun ("iron bell", "old bell"), so the token
    # before " is" matches every fact and only the one before it tells them apart: the passkey's " ke"+"y is"
    # shares its last two tokens with the filler's " sk"+"y is" (reports/2026-11-27-recall-rounds.md, seventh round).
    shared_noun_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # Loss weight of the recall answers' tokens (each other token weighs 1; the loss is the weighted mean):
    # the first answer token decides between copying the value and continuing the text, and at weight 1
    # the answers are ~2% of a batch's loss (reports/2026-11-27-recall-rounds.md, tenth round). 1 = off: batches stay (x, y).
    answer_weight: float = field(default=1.0, metadata={"minimum": 1, "means": "1 = off"})
    # Share of recall windows (at full curriculum; scaled by its progress, so the copy forms first) holding a
    # decoy: one never-asked fact stated 2-8 times whose tag shares an asked fact's noun. The passkey's
    # question shares its last tokens with the filler's "The sky is blue.", repeated a dozen times, and the
    # misses of eleven rounds are that filler's " blue" or a newline (reports/2026-11-27-recall-rounds.md, twelfth round).
    decoy_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # Share of recall windows (at full curriculum; scaled by its progress) in which one asked fact is never
    # stated: its question still ends the window, and only its answer's first token (the value's leading
    # space) is trained, its digits weighing 0, so a question must predict a number from its wording alone,
    # as the one base that answers the passkey from the question does (reports/2026-11-27-recall-rounds.md, fifteenth round).
    unstated_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # Share of recall windows whose tags are two random one-token words of the tokenizer's vocabulary ("The
    # dagger honest is 48213.") instead of an adjective and a noun from the lists above: the bases answer a
    # question about a listed tag with a number, with or without the fact, but not one about "the pass key"
    # (reports/2026-11-27-recall-rounds.md, fifteenth round). 0 draws nothing.
    word_tag_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # Share of recall windows (at full curriculum; scaled by its progress) holding a filler block: one to three
    # never-asked statements "The <word> is <word>." with word values, the first about the asked fact's last
    # tag word ("The bell is narrow." beside "The iron bell is 73912."), the block repeated 2-8 times. The
    # passkey's filler "The sky is blue." matches its question "The pass key is" on " y is" and repeats a dozen
    # times; a word value after a matching " is" is never the answer, so only the tag's earlier tokens or a
    # number prior tell the needle apart (reports/2026-11-27-recall-rounds.md, sixteenth round). 0 draws nothing.
    filler_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # Share of copy windows' numbers that are runs of 2-4 consecutive numbers (" 41337 41338 41339"): each
    # number's digits follow from the previous one's, so a digit's identity pays before any induction head
    # forms; elsewhere the values are random, and every base first folds the ten digits' embeddings onto one
    # direction, which the bases that never copy keep (reports/2026-11-27-recall-rounds.md, twenty-first and twenty-second rounds).
    # 0 draws nothing.
    counting_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # Share of recall windows worded by a template drawn from the generated training space (data/templates.py:
    # thing words, tag patterns, statements, layouts including the plays' dialogue, questions, answer leads;
    # numbers of 3-7 digits) instead of TEMPLATES; the held-out families there are never drawn. 0 draws nothing.
    varied_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})
    # Share of those varied windows whose thing words ("code", "ticket", ...) are random one-token vocabulary words
    # instead: a question about a thing never named in training still asks for a number. 0 draws nothing.
    word_thing_share: float = field(default=0.0, metadata={"minimum": 0, "maximum": 1})

    @property
    def weighted(self) -> bool:
        """Whether batches carry per-target loss weights (answer_weight != 1, or unstated facts' digits at 0)."""
        return self.answer_weight != 1 or self.unstated_share > 0

    @classmethod
    def from_options(cls, options: Mapping | None) -> RecallConfig:
        """Check a `data.recall` mapping (None = off) and build the config."""
        options = dict(options or {})
        allowed = [f.name for f in fields(cls)]
        if unknown := sorted(set(options) - set(allowed)):
            raise DataError(f"data.recall keys {unknown} are unknown; allowed keys are {allowed}.")
        cfg = cls(**options)
        check_fields(cfg, "data.recall", DataError)
        if not cfg.queries <= cfg.min_pairs <= cfg.max_pairs <= len(ADJECTIVES) * len(NOUNS):
            raise DataError(
                f"data.recall needs queries <= min_pairs <= max_pairs, got queries={cfg.queries}, "
                f"min_pairs={cfg.min_pairs}, max_pairs={cfg.max_pairs}."
            )
        if cfg.shared_noun_share > 0 and cfg.max_pairs > len(ADJECTIVES):
            raise DataError(
                f"data.recall.shared_noun_share needs max_pairs <= {len(ADJECTIVES)} (one adjective per fact), "
                f"got max_pairs={cfg.max_pairs}."
            )
        return cfg


@dataclass(frozen=True)
class RecallWindow:
    tokens: np.ndarray  # (max_len + 1,) int64: haystack with facts, then question + answer pairs
    facts: list[tuple[str, int]]  # (tag, value) in the order they occur in the window
    asked: list[int]  # indices into `facts`, in the order the questions ask them
    answers: list[tuple[int, int]]  # token span [start, end) of each question's answer in `tokens`
    decoys: list[tuple[str, int]]  # (tag, value) of the never-asked decoy statements, one entry per repeat
    unstated: int | None = None  # index into `facts` of the asked fact never stated (unstated_share)
    filler: tuple[tuple[str, str], ...] = ()  # (subject, word value) of the filler block's statements
    filler_repeats: int = 0  # times the filler block is stated
    stops: bool = False  # each answer is followed by a stop token that weighs as the answer (varied windows)


class RecallMixer:
    """Turns a fraction of each training batch into recall windows; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer, config: RecallConfig, window_len: int):
        """window_len: tokens per training window (max_len + 1); checked here, not mid-training."""
        self.tok, self.config = tokenizer, config
        # Facts go in after a token that ends a line (or a sentence, in a flat haystack) or at the window start.
        texts = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
        self.ends_line = np.array([t.endswith("\n") for t in texts])
        self.ends_sentence = np.array([t.rstrip().endswith((".", "!", "?", ";", ":")) for t in texts])
        never = EVAL_WORDS | set(
            templates.HELD_OUT["things"]
        )  # suite words, held-out things: never tag words
        self.tag_words = sorted({t[1:] for t in texts if TAG_WORD.fullmatch(t)} - never)
        self.templates = templates.training_templates() if config.varied_share > 0 else ()
        words_needed = config.word_tag_share > 0 or config.filler_share > 0 or config.word_thing_share > 0
        if words_needed and len(self.tag_words) < 2 * config.max_pairs:
            raise DataError(
                f"data.recall.word_tag_share, word_thing_share and filler_share need at least "
                f"{2 * config.max_pairs} one-token words in the tokenizer's vocabulary, which has "
                f"{len(self.tag_words)}."
            )
        if (need := self.longest_synthetic()) >= window_len:
            raise DataError(
                f"recall windows of up to {config.max_pairs} facts and {config.queries} question(s) need up "
                f"to {need} tokens of facts and questions, but training windows have {window_len}; raise "
                "data.max_len or lower data.recall.max_pairs / queries."
            )

    def longest_synthetic(self) -> int:
        """Most tokens the facts and questions of one window can take (all tags, wordings; value 99999)."""
        tags = [f"{a} {n}" for a in ADJECTIVES for n in NOUNS]
        if self.config.word_tag_share > 0:
            tags += [f"{w} {w}" for w in self.tag_words]
        value = VALUE_RANGE[1] - 1
        facts = [
            form.format(fact.format(tag=t, value=value))
            for fact, _ in TEMPLATES
            for t in tags
            for form in FORMS
        ]
        queries = [
            brk + (q.format(tag=t) + " " if q else "") + query.format(tag=t) + f" {value}"
            for brk in (".\n", ". ")  # between questions on their own lines, or mid-line (midline_share)
            for _, query in TEMPLATES
            for q in QUESTIONS
            for t in tags
        ]
        if self.templates:
            statements, questions = self.varied_texts()
            facts, queries = facts + statements, queries + questions
        longest = [max(map(len, self.tok.encode_batch(texts))) for texts in (facts, queries)]
        return self.config.max_pairs * longest[0] + self.config.queries * longest[1]

    def varied_texts(self) -> tuple[list[str], list[str]]:
        """(statements, questions with their answers) of every training template's wording, each with its tag
        pattern's longest tag (in tokens; a word tag's one-token word is no longer than a qualifier) and the
        longest number: what `longest_synthetic` bounds."""
        longest_tags = {}
        for pattern, fmt in templates.TAGS.items():
            candidates = [
                fmt.format(qualifier=f, noun=f, name=f, thing=t)
                for f in templates.FILLS[pattern]
                for t in templates.THINGS
            ]
            lengths = list(map(len, self.tok.encode_batch(candidates)))
            longest_tags[pattern] = candidates[int(np.argmax(lengths))]
        value = 10 ** templates.DIGITS[1] - 1
        speaker = max(templates.SPEAKERS, key=lambda name: len(self.tok.encode(name)))
        rendered = {
            (t.tag, t.statement, t.layout, t.question, t.lead): templates.render(
                t, longest_tags[t.tag], value, (speaker, speaker)
            )
            for t in self.templates
        }
        return [r.statement for r in rendered.values()], [
            "." + r.question + r.answer for r in rendered.values()
        ]

    def progress(self, batch_index: int) -> float:
        """Curriculum position in [0, 1] of training batch `batch_index` (1 = full difficulty)."""
        n = self.config.curriculum_batches
        return 1.0 if n == 0 else min(1.0, batch_index / n)

    def mix(self, batch_index: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Training batch `batch_index` as (input, target), each (B, L) int64, with each row replaced by
        a recall window with probability `fraction`, else by a copy window with probability
        `copy_fraction`; a pure function of (recall seed, batch_index). When `config.weighted` a third (B, L)
        float32 tensor follows: each target's loss weight (answer_weight on recall answers, 0 on an unstated
        fact's digits, else 1)."""
        rng = np.random.default_rng([self.config.seed, batch_index])
        windows = torch.cat([x, y[:, -1:]], dim=1).numpy().copy()  # (B, L + 1)
        weights = np.ones(x.shape, dtype=np.float32)  # (B, L), one per target
        progress = self.progress(batch_index)
        draws = rng.random(len(windows))
        for row in np.flatnonzero(draws < self.config.fraction):
            window = self.window(rng, windows[row], progress)
            windows[row] = window.tokens
            for (start, end), fact in zip(window.answers, window.asked):  # token t is the target at t - 1
                weights[row, start - 1 : end - 1 + window.stops] = self.config.answer_weight
                if fact == window.unstated:  # its digits cannot be known: only the leading space is trained
                    weights[row, start : end - 1 + window.stops] = 0.0  # and where it ends
        copy_rows = (draws >= self.config.fraction) & (rng.random(len(windows)) < self.config.copy_fraction)
        for row in np.flatnonzero(copy_rows):
            windows[row] = self.copy_window(rng, windows[row])
        out = torch.from_numpy(windows)
        if not self.config.weighted:
            return out[:, :-1], out[:, 1:]
        return out[:, :-1], out[:, 1:], torch.from_numpy(weights)

    def copy_window(
        self, rng: np.random.Generator, haystack: np.ndarray, span: tuple[int, int] = (8, 24)
    ) -> np.ndarray:
        """A window as long as `haystack` (n,) made of its own text and random numbers: in groups of
        four, consecutive text spans of span[0]..span[1] tokens or (one in two) a random 5-digit value
        like the facts' " 73912", each twice in shuffled order, so a repeat sits at a varying distance
        from its first occurrence. Only content matching (an induction head) predicts a repeat; a fixed
        distance would teach a positional shortcut that does not transfer. Random numbers alone leave the
        digits' embeddings folded together until a copy forms, if it does; counting runs (`counting_share`)
        make a digit's identity pay from the start (reports/2026-11-27-recall-rounds.md, twenty-second round)."""
        n, out, cursor, total = len(haystack), [], 0, 0
        while total < n:
            spans = []
            for _ in range(4):
                if rng.random() < 0.5:
                    spans.append(np.asarray(self.tok.encode(self.numbers(rng)), dtype=np.int64))
                    continue
                length = int(rng.integers(span[0], span[1] + 1))
                spans.append(haystack[cursor : cursor + length])
                cursor = (cursor + length) % max(1, n - span[1])
            out += [spans[i] for i in rng.permutation(np.repeat(np.arange(4), 2))]
            total += 2 * sum(map(len, spans))
        return np.concatenate(out)[:n].astype(np.int64)

    def numbers(self, rng: np.random.Generator) -> str:
        """A copy window's number span: one random 5-digit value (" 73912"), or with probability
        `counting_share` a run of COUNTING_RUN consecutive ones (" 73912 73913 73914")."""
        if not (self.config.counting_share > 0 and rng.random() < self.config.counting_share):
            return f" {rng.integers(*VALUE_RANGE)}"
        count = int(rng.integers(COUNTING_RUN[0], COUNTING_RUN[1] + 1))
        start = int(rng.integers(VALUE_RANGE[0], VALUE_RANGE[1] - count + 1))
        return "".join(f" {start + i}" for i in range(count))

    def flatten(self, haystack: np.ndarray, n: int) -> np.ndarray:
        """The first `n` tokens of `haystack` (n_total,) re-encoded as one line (each run of whitespace with a
        newline becomes one space). Joining lines merges tokens, so a haystack too short for
        `n` stays as it is: the facts and questions still take the flat form."""
        text = re.sub(r"\s*\n\s*", " ", self.tok.decode(haystack.tolist()))
        tokens = self.tok.encode(text)
        return np.asarray(tokens[:n] if len(tokens) >= n else haystack[:n], dtype=np.int64)

    def word_tags(self, rng: np.random.Generator, n: int, shared_second: bool) -> list[str]:
        """`n` tags of two vocabulary words each, their first words distinct; with `shared_second` all end
        in the same word, as shared-noun tags do."""
        words = self.tag_words
        firsts = rng.choice(len(words), size=n, replace=False)
        seconds = np.full(n, rng.integers(len(words))) if shared_second else rng.integers(len(words), size=n)
        return [f"{words[a]} {words[b]}" for a, b in zip(firsts, seconds)]

    def window(self, rng: np.random.Generator, haystack: np.ndarray, progress: float = 1.0) -> RecallWindow:
        """One recall window as long as `haystack` (n,), built from its leading tokens."""
        cfg, n_total = self.config, len(haystack)
        if cfg.varied_share > 0 and rng.random() < cfg.varied_share:  # no draw when off: same windows
            return self.varied_window(rng, haystack, progress)
        most = cfg.min_pairs + round(progress * (cfg.max_pairs - cfg.min_pairs))
        n_facts = int(rng.integers(cfg.min_pairs, most + 1))
        shared_noun = cfg.shared_noun_share > 0 and rng.random() < cfg.shared_noun_share  # off: no draw
        if cfg.word_tag_share > 0 and rng.random() < cfg.word_tag_share:  # no draw when off
            tags = self.word_tags(rng, n_facts, shared_noun)
        else:
            if shared_noun:
                adjectives = rng.choice(len(ADJECTIVES), size=n_facts, replace=False)
                picks = adjectives * len(NOUNS) + rng.integers(len(NOUNS))
            else:
                picks = rng.choice(len(ADJECTIVES) * len(NOUNS), size=n_facts, replace=False)
            tags = [f"{ADJECTIVES[p // len(NOUNS)]} {NOUNS[p % len(NOUNS)]}" for p in picks]
        low, high = VALUE_RANGE
        values = [low + int(v) for v in rng.choice(high - low, size=n_facts, replace=False)]
        fact_text, query_text = TEMPLATES[rng.integers(len(TEMPLATES))]
        asked = [int(i) for i in rng.choice(n_facts, size=cfg.queries, replace=False)]
        questions = [QUESTIONS[rng.integers(len(QUESTIONS))] for _ in asked]
        unstated = None  # no draw when off: the windows stay those of a config without the key
        if cfg.unstated_share > 0 and rng.random() < cfg.unstated_share * progress:
            unstated = int(rng.choice(asked))

        flat = cfg.flat_share > 0 and rng.random() < cfg.flat_share  # no draw when off: same windows
        facts_text = [fact_text.format(tag=t, value=v) for t, v in zip(tags, values)]
        statements = self.tok.encode_batch([FORMS[flat].format(f) for f in facts_text])
        statements = [st for i, st in enumerate(statements) if i != unstated]
        midline = flat or (cfg.midline_share > 0 and rng.random() < cfg.midline_share)  # no draw when off
        breaks = (" ", ". ") if midline else ("\n", ".\n")  # before the first question, between questions
        tail, answers = [], []  # "<break><question> <query> <answer>" per asked fact
        for j, (i, question) in enumerate(zip(asked, questions)):
            opening = breaks[j > 0] + (question.format(tag=tags[i]) + " " if question else "")
            tail += self.tok.encode(opening + query_text.format(tag=tags[i]))
            answers.append((len(tail), len(tail) + len(answer := self.tok.encode(f" {values[i]}"))))
            tail += answer
        free = n_total - int(MIN_HAYSTACK * n_total) - sum(map(len, statements)) - len(tail)
        decoy, decoy_tokens, n_repeats = self.decoy(rng, tags, values, asked[0], flat, progress, free)
        free -= n_repeats * len(decoy_tokens)
        filler, filler_tokens, filler_repeats = self.filler(rng, tags[asked[0]], flat, progress, free)
        n_hay = n_total - sum(map(len, statements)) - len(tail)
        n_hay -= n_repeats * len(decoy_tokens) + filler_repeats * len(filler_tokens)
        if n_hay < 1:  # only for a haystack shorter than the window_len checked in __init__
            raise DataError(
                f"a haystack of {n_total} tokens cannot hold this recall window's {n_total - n_hay}."
            )

        hay = self.flatten(haystack, n_hay) if flat else np.asarray(haystack[:n_hay], dtype=np.int64)
        boundary = self.ends_sentence if flat else self.ends_line  # facts start a line, or follow a sentence
        at, candidates = self.fact_positions(rng, hay, boundary, len(statements), progress)
        inserts = list(zip(at.tolist(), statements))
        if n_repeats:  # at line starts (sentence ends) anywhere, as the filler repeats throughout its prompt
            inserts += [(int(p), decoy_tokens) for p in rng.choice(candidates, size=n_repeats)]
        if filler_repeats:  # likewise
            inserts += [(int(p), filler_tokens) for p in rng.choice(candidates, size=filler_repeats)]
        tokens = splice(hay, inserts, tail)
        offset = n_total - len(tail)
        return RecallWindow(
            tokens,
            list(zip(tags, values)),
            asked,
            [(offset + a, offset + b) for a, b in answers],
            [decoy] * n_repeats,
            unstated,
            filler,
            filler_repeats,
        )

    def varied_window(self, rng: np.random.Generator, haystack: np.ndarray, progress: float) -> RecallWindow:
        """One recall window as long as `haystack` (n,) in a template drawn from `templates.training_templates`:
        its facts share the template (tags distinct, half of the windows also share the thing word), each
        question follows the previous answer, and `unstated_share` and `word_tag_share` act as in `window`."""
        cfg, n_total = self.config, len(haystack)
        template = self.templates[rng.integers(len(self.templates))]
        most = cfg.min_pairs + round(progress * (cfg.max_pairs - cfg.min_pairs))
        n_facts = int(rng.integers(cfg.min_pairs, most + 1))
        word_tags = (
            template.tag == "adjective" and cfg.word_tag_share > 0 and rng.random() < cfg.word_tag_share
        )
        word_things = cfg.word_thing_share > 0 and rng.random() < cfg.word_thing_share  # no draw when off
        words, things = (self.tag_words if word_tags else ()), (self.tag_words if word_things else ())
        tags = templates.tags(template, rng, n_facts, rng.random() < 0.5, words, things)
        values: list[int] = []
        while len(values) < n_facts:
            values += [v] if (v := templates.number(rng)) not in values else []
        speakers = templates.speakers(rng)
        rendered = [templates.render(template, t, v, speakers) for t, v in zip(tags, values)]
        asked = [int(i) for i in rng.choice(n_facts, size=cfg.queries, replace=False)]
        unstated = None
        if cfg.unstated_share > 0 and rng.random() < cfg.unstated_share * progress:
            unstated = int(rng.choice(asked))
        statements = self.tok.encode_batch([r.statement for i, r in enumerate(rendered) if i != unstated])
        tail, answers = [], []
        for i in asked:  # each answer ends with STOP, trained with the answer's weight (`mix`)
            tail += self.tok.encode(rendered[i].question)
            answers.append((len(tail), len(tail) + len(answer := self.tok.encode(rendered[i].answer))))
            tail += answer + self.tok.encode(templates.STOP)
        n_hay = n_total - sum(map(len, statements)) - len(tail)
        if n_hay < 1:  # only for a haystack shorter than the window_len checked in __init__
            raise DataError(
                f"a haystack of {n_total} tokens cannot hold this recall window's {n_total - n_hay}."
            )
        hay = np.asarray(haystack[:n_hay], dtype=np.int64)
        boundary = self.ends_sentence if template.layout == "prose" else self.ends_line
        at, _ = self.fact_positions(rng, hay, boundary, len(statements), progress)
        tokens = splice(hay, list(zip(at.tolist(), statements)), tail)
        spans = [(n_total - len(tail) + a, n_total - len(tail) + b) for a, b in answers]
        return RecallWindow(tokens, list(zip(tags, values)), asked, spans, [], unstated, stops=True)

    def fact_positions(
        self, rng: np.random.Generator, hay: np.ndarray, boundary: np.ndarray, n: int, progress: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(sorted positions in `hay` for `n` facts, every allowed position): after a token `boundary` marks
        (a line end, or a sentence end) or at the start; the curriculum keeps early facts near the end, and
        `far_share` of the windows put one in the haystack's first tenth."""
        n_hay = len(hay)
        lowest = int(START_FRACTION * (1 - progress) * n_hay)  # curriculum: short distances first
        starts = np.arange(lowest, n_hay + 1)
        fact_starts = starts[(starts == 0) | boundary[hay[np.maximum(starts - 1, 0)]]]
        candidates = fact_starts if len(fact_starts) else starts
        at = np.sort(rng.choice(candidates, size=n))  # facts in drawn order
        if rng.random() < self.config.far_share * progress:
            early = candidates[candidates <= FAR_SPAN * n_hay]
            at = np.sort(np.append(at[1:], rng.choice(early) if len(early) else 0))
        return at, candidates

    def decoy(
        self,
        rng: np.random.Generator,
        tags: list[str],
        values: list[int],
        target: int,
        flat: bool,
        progress: float,
        free: int,
    ) -> tuple[tuple[str, int] | None, list[int], int]:
        """With probability decoy_share * progress (no draw when off): ((tag, value), its statement's tokens,
        repeats), the repeats capped to what `free` tokens hold; else (None, [], 0). The tag is another
        adjective on the noun of fact `target` (an asked one), the value a 5-digit number no fact has."""
        share = self.config.decoy_share
        if share == 0 or rng.random() >= share * progress:
            return None, [], 0
        noun = tags[target].split()[-1]
        adjectives = [a for a in ADJECTIVES if f"{a} {noun}" not in tags]
        tag = f"{adjectives[rng.integers(len(adjectives))]} {noun}"
        value = int(rng.integers(*VALUE_RANGE))
        while value in values:
            value = int(rng.integers(*VALUE_RANGE))
        statement = self.tok.encode(FORMS[flat].format(DECOY_TEMPLATE.format(tag=tag, value=value)))
        return (tag, value), statement, capped_repeats(rng, len(statement), free)

    def filler(
        self, rng: np.random.Generator, asked_tag: str, flat: bool, progress: float, free: int
    ) -> tuple[tuple[tuple[str, str], ...], list[int], int]:
        """With probability filler_share * progress (no draw when off): ((subject, value) per statement, the
        block's tokens, repeats), the repeats capped to what `free` tokens hold; else ((), [], 0). The first
        subject is `asked_tag`'s last word, the others and every value one-token vocabulary words (`tag_words`)."""
        share = self.config.filler_share
        if share == 0 or rng.random() >= share * progress:
            return (), [], 0
        words = self.tag_words
        n = int(rng.integers(FILLER_STATEMENTS[0], FILLER_STATEMENTS[1] + 1))
        picks = rng.choice(len(words), size=2 * n - 1, replace=False)
        subjects = [asked_tag.split()[-1]] + [words[i] for i in picks[n:]]
        block = tuple((subject, words[i]) for subject, i in zip(subjects, picks[:n]))
        statement = self.tok.encode(FORMS[flat].format(" ".join(f"The {s} is {v}." for s, v in block)))
        return block, statement, capped_repeats(rng, len(statement), free)


def splice(hay: np.ndarray, inserts: list[tuple[int, list[int]]], tail: list[int]) -> np.ndarray:
    """`hay` (n,) with each (position, tokens) of `inserts` spliced in before that position (equal positions
    keep their list order), then `tail`."""
    pieces, prev = [], 0
    for pos, statement in sorted(inserts, key=lambda item: item[0]):  # stable: facts stay in drawn order
        pieces += [hay[prev:pos], np.asarray(statement, dtype=np.int64)]
        prev = pos
    return np.concatenate([*pieces, hay[prev:], np.asarray(tail, dtype=np.int64)])


def held_out_windows(
    tokenizer: Tokenizer, config: RecallConfig, tokens: np.ndarray, window_len: int, count: int, seed: int = 0
) -> list[RecallWindow]:
    """`count` recall windows of `window_len` tokens at full difficulty, their haystacks cut from held-out
    `tokens` (n,) at random starts: the training format on text never trained on. Every asked fact is stated
    (an unstated fact's digits cannot be known). Empty when `tokens` cannot fill one window."""
    if len(tokens) < window_len:
        return []
    mixer = RecallMixer(tokenizer, replace(config, unstated_share=0.0), window_len)
    rng = np.random.default_rng([seed, len(tokens)])
    starts = rng.integers(0, len(tokens) - window_len + 1, size=count)
    return [mixer.window(rng, np.asarray(tokens[s : s + window_len], dtype=np.int64)) for s in starts]


def answer_accuracy(predictions: np.ndarray, windows: list[RecallWindow]) -> tuple[float, float]:
    """(exact, digits) of teacher-forced answers: `predictions` (B, L) are the argmax next tokens of each
    window's first L tokens (row i predicts windows[i].tokens[1:]). exact: share of answers whose every
    token (the leading space and the digits) is predicted; digits: share of the digits (chance about 0.1)."""
    exact, digits, n_answers, n_digits = 0, 0, 0, 0
    for row, window in zip(predictions, windows):
        for start, end in window.answers:
            hits = row[start - 1 : end - 1] == window.tokens[start:end]
            exact, digits = exact + bool(hits.all()), digits + int(hits[1:].sum())
            n_answers, n_digits = n_answers + 1, n_digits + len(hits) - 1
    return exact / max(1, n_answers), digits / max(1, n_digits)
