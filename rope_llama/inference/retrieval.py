"""Retrieval suite: prompts for three RULER task families and the greedy-answer scorer.

    rng = np.random.default_rng(0)
    p = build_prompt("multikey", tok, length=1024, depth=0.5, rng=rng, keys=4)
    p.tokens, p.answer, p.depth, p.needle_start   # BOS ... question (ends before the answer); int;
                                                  # realised depth; first token of the asked needle
    answer_correct(" 40213.", p.answer)           # greedy scoring: first integer of the output == answer

Tasks (Hsieh et al. 2024, RULER: single / multi-key needle-in-a-haystack and variable tracking):
  passkey    one 5-digit key in the filler, with the passkey wording of scripts/passkey.py (defined here)
  multikey   `keys` needles with distinct names and keys; the question asks for one of them
  vartrack   `chains` chains VAR A = 12345, VAR B = VAR A, ... (`hops` copies each); the question
             asks for the value of one chain's last variable, so the answer needs every hop
  heldout_<family>  `facts` facts (5-digit numbers) in a wording drawn per prompt from one held-out family of
             data/templates.py (prose, dialogue, list, things): wordings recall training never produces.
             `heldout` in a task list stands for all four; their pooled accuracy is the suite's headline.

Every prompt is the passkey instruction, then its filler repeated, with the needles in
it, then the question. The filler is cut at sentence boundaries, so a prompt has at most
`length` tokens and falls short by less than one filler sentence (a few tokens). The asked
needle (the first assignment of the asked chain) goes after round(depth * n) of the n filler
sentences; `depth` reports the realised value: filler tokens before it / all filler tokens.
Pieces are tokenized separately and concatenated, so needle positions are exact. Prompts are
pure functions of (tokenizer, length, depth, the rng's state).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

import numpy as np

from rope_llama.core.checks import check_number
from rope_llama.data import templates
from rope_llama.data.tokenizer import Tokenizer

HELDOUT = "heldout"  # in a task list: every held-out family; in a table: their pooled trials
HELDOUT_TASKS = tuple(f"{HELDOUT}_{family}" for family in templates.FAMILIES)
TASKS = ("passkey", "multikey", "vartrack", *HELDOUT_TASKS, "multiquery", "multivalue")
# The passkey prompt of Mohtashami & Jaggi (2023), as scripts/passkey.py and the literature use it.
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
# A question is the ask and the lead the answer follows (in a chat prompt the assistant's turn starts at the lead).
QUESTION = (" What is the pass key?", " The pass key is")
MULTIKEY_NEEDLE = " The pass key of the {name} is {key}. Remember it. {key} is the pass key of the {name}."
MULTIKEY_QUESTION = (" What is the pass key of the {name}?", " The pass key of the {name} is")
MULTIQUERY_QUESTION = (" What are the pass keys of {names}?", " The pass keys of {names} are")
MULTIVALUE_NEEDLE = " One of the pass keys of the {name} is {key}. Remember it."
MULTIVALUE_QUESTION = (" What are all the pass keys of the {name}?", " The pass keys of the {name} are")
VAR_VALUE = " VAR {name} = {value}."
VAR_COPY = " VAR {name} = VAR {source}."
VAR_QUESTION = (" What is the value of VAR {name}?", " The value of VAR {name} is")
WORDING = (MULTIKEY_NEEDLE, *MULTIKEY_QUESTION, *MULTIQUERY_QUESTION, MULTIVALUE_NEEDLE, *MULTIVALUE_QUESTION,
           VAR_VALUE, VAR_COPY, *VAR_QUESTION)  # fmt: skip
NAMES = ("fox", "owl", "bear", "wolf", "hare", "crow", "deer", "lynx", "seal", "swan", "mole", "toad",
         "frog", "goat", "lark", "wren")  # fmt: skip
VAR_NAME_LETTERS = 5  # RULER's variable names: 5 random capital letters


def first_integer(text: str) -> int | None:
    """The first run of digits in `text` as an int (" 71432." -> 71432), None if there is none."""
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


KEY_COUNT = 90_000  # the 5-digit keys, 10000..99999


def random_keys(rng: np.random.Generator, n: int, exclude: int | None = None) -> list[int]:
    """`n` distinct 5-digit keys (10000..99999), none equal to `exclude`."""
    available = KEY_COUNT - (exclude is not None)
    if n > available:  # the draws below would never end
        raise ValueError(
            f"{n:,} distinct 5-digit keys cannot be drawn: only {KEY_COUNT:,} exist (10000..99999), so "
            f"candidates (the answer and its decoys) may be at most {KEY_COUNT:,}."
        )
    keys, seen = [], {exclude}  # the draws' order, and a set to test them against (a list's test is O(n))
    while len(keys) < n:
        k = int(rng.integers(10_000, 100_000))
        if k not in seen:
            keys.append(k)
            seen.add(k)
    return keys


@dataclass(frozen=True)
class RetrievalPrompt:
    task: str
    tokens: list[int]  # (BOS,) instruction, filler with needles, question; the answer comes next
    answer: int  # the value of the needle at `depth`
    depth: float  # realised: filler tokens before the asked needle / all filler tokens
    needle_start: int  # token index where the asked needle (first assignment of the asked chain) begins
    answers: tuple[
        int, ...
    ]  # every value the answer lists, in its order: (answer,) but for multiquery, multivalue
    distractors: tuple[int, ...] = ()  # the values of the needles not asked for (other animals' keys)


def answer_text(answers: tuple[int, ...] | list[int]) -> str:
    """How an answer is written after the prompt: " 40213", or " 40213, 77120" for several values."""
    return " " + ", ".join(map(str, answers))


def answer_correct(generated: str, answer: int | tuple[int, ...]) -> bool:
    """Greedy scoring: the first integer in the generated text is the answer (" 40213." -> 40213); for
    several values, every one of them is among the text's integers (in any order, as RULER scores)."""
    return answer_recall(generated, answer) == 1.0


def answer_recall(generated: str, answer: int | tuple[int, ...]) -> float:
    """The share of the answer's values the generated text gives: for one value 1 or 0 (`answer_correct`);
    for several, the share among the text's integers (RULER's string_match_all credit per prompt)."""
    answers = (answer,) if isinstance(answer, int) else tuple(answer)
    if len(answers) == 1:
        return float(first_integer(generated) == answers[0])
    found = {int(n) for n in re.findall(r"\d+", generated)}
    return sum(a in found for a in answers) / len(answers)


# greedy_miss's kinds, in order
GREEDY_MISSES = ("prose first", "overrun", "another needle", "incomplete", "wrong digits")


def greedy_miss(generated: str, answer: int | tuple[int, ...], distractors: tuple[int, ...] = ()) -> str:
    """Why a greedy answer is wrong ("" when `answer_correct`): "prose first" = text before any number (the
    first-token decision, which the first-token margin measures, went to the text); "overrun" = an asked value's
    digits and then more (" 103888." for 10388: the copy found the key but did not stop); "another needle" =
    the value of a needle the question did not ask for (`distractors`: the model found the needles and confused
    them); "incomplete" = one of several asked values, but not every one of them in the text (multi-query,
    multi-value: some needles found); "wrong digits" = any other number first."""
    if answer_correct(generated, answer):
        return ""
    digits = re.match(r"\d+", generated.lstrip())
    if digits is None:
        return "prose first"
    first = int(digits.group())
    if first in distractors:
        return "another needle"
    answers = (answer,) if isinstance(answer, int) else tuple(answer)
    if first in answers:  # one value alone would have been correct: only several values get here
        return "incomplete"
    return "overrun" if any(digits.group().startswith(str(a)) for a in answers) else "wrong digits"


TASK_OPTIONS = {
    "passkey": {},
    "multikey": {"keys": (1, len(NAMES))},
    "multiquery": {"keys": (1, len(NAMES)), "queries": (1, len(NAMES))},
    "multivalue": {"values": (1, None)},
    "vartrack": {"chains": (1, None), "hops": (0, None)},
    **{task: {"facts": (1, len(templates.NOUNS))} for task in HELDOUT_TASKS},
}


def expand_tasks(tasks: list[str]) -> list[str]:
    """`tasks` with `heldout` replaced by every held-out family's task (HELDOUT_TASKS)."""
    return [t for task in tasks for t in (HELDOUT_TASKS if task == HELDOUT else (task,))]


def pooled_heldout(trials: list[dict]) -> list[dict]:
    """The trials of every held-out family relabelled as task `heldout`: the rows of the headline. A trial's
    index becomes "<family task>/<index>", so pooled trials stay distinct units for paired tests."""
    return [
        {**t, "task": HELDOUT, "trial": f"{t['task']}/{t['trial']}"}
        for t in trials
        if t["task"] in HELDOUT_TASKS
    ]


def check_task_options(task: str, **options) -> None:
    """One sentence for an unknown task, an option `task` does not take, or a value out of its range."""
    if task not in TASK_OPTIONS:
        raise ValueError(f"retrieval task {task!r} is unknown; allowed tasks are {list(TASKS)}.")
    allowed = TASK_OPTIONS[task]
    if unknown := sorted(set(options) - set(allowed)):
        raise ValueError(f"{task} takes the options {sorted(allowed)}, not {unknown}.")
    for name, value in options.items():
        low, high = allowed[name]
        check_number(name, value, minimum=low, maximum=high or None, integer=True)


ChatTurns = tuple[
    str, str
]  # the chat template's text before the user's message and after it, to the assistant's turn


def chat_turns(tok: Tokenizer) -> ChatTurns:
    """The tokenizer's chat template around one user message, ending where the assistant's reply begins
    (its own special tokens, its default system turn if it has one); one sentence when it has none."""
    marker = "\x00message\x00"
    before, found, after = tok.apply_chat_template([{"role": "user", "content": marker}]).partition(marker)
    if not found:
        raise ValueError(
            f"The chat template of {tok.path} does not place the user's message; use chat=false."
        )
    return before, after


def build_prompt(
    task: str,
    tok: Tokenizer,
    length: int,
    depth: float,
    rng: np.random.Generator,
    chat: ChatTurns | None = None,
    **options,
) -> RetrievalPrompt:
    """The prompt of `task` (one of TASKS) with the task's options (multikey: keys; multiquery: keys, queries;
    multivalue: values; vartrack: chains, hops; heldout_*: facts); `chat` (`chat_turns`) wraps everything
    before the question's lead in the user's turn and starts the assistant's turn with the lead."""
    check_task_options(task, **options)
    if task in HELDOUT_TASKS:
        parts = heldout_prompt(task, tok, depth, rng, **options)
    else:
        builders = {"passkey": passkey_prompt, "multikey": multikey_prompt, "vartrack": vartrack_prompt,
                    "multiquery": multiquery_prompt, "multivalue": multivalue_prompt}  # fmt: skip
        parts = builders[task](tok, depth, rng, **options)
    return _assemble(task, tok, length, *parts, chat=chat)


Needles = list[tuple[float, list[int]]]  # (place in [0, 1], tokens); the first is the asked one
# needles, (ask, lead), values: needles[0]'s, then (multiquery, multivalue) the answer's list in its order;
# the values of the needles not asked for (RetrievalPrompt.distractors)
Parts = tuple[Needles, tuple[str, str], tuple[int, ...], tuple[int, ...]]


def passkey_prompt(tok: Tokenizer, depth: float, rng: np.random.Generator) -> Parts:
    """One passkey needle at `depth`, scripts/passkey.py's wording."""
    (key,) = random_keys(rng, 1)
    return [(_check_depth(depth), tok.encode(NEEDLE.format(key=key)))], QUESTION, (key,), ()


def multikey_prompt(tok: Tokenizer, depth: float, rng: np.random.Generator, keys: int = 4) -> Parts:
    """`keys` needles, each naming an animal and its own key; the question asks for the first, which
    sits at `depth`; the others go to uniformly random places in the filler."""
    names, values, needles = _named_needles(tok, depth, rng, keys)
    return needles, _format(MULTIKEY_QUESTION, name=names[0]), (values[0],), tuple(values[1:])


def multiquery_prompt(
    tok: Tokenizer, depth: float, rng: np.random.Generator, keys: int = 4, queries: int = 4
) -> Parts:
    """RULER's multi-query needle: `keys` named needles as in multikey; the question asks for the keys of
    the first `queries` of them at once (the first at `depth`), and the answer lists them in that order."""
    if queries > keys:
        raise ValueError(
            f"multiquery asks for queries={queries} of keys={keys} needles; queries must be <= keys."
        )
    names, values, needles = _named_needles(tok, depth, rng, keys)
    asked = [f"the {n}" for n in names[:queries]]
    listed = asked[0] if queries == 1 else ", ".join(asked[:-1]) + " and " + asked[-1]
    answers = (values[0], *values[:queries])
    return needles, _format(MULTIQUERY_QUESTION, names=listed), answers, tuple(values[queries:])


def multivalue_prompt(tok: Tokenizer, depth: float, rng: np.random.Generator, values: int = 4) -> Parts:
    """RULER's multi-value needle: one animal with `values` keys in separate needles (the first at `depth`,
    the others at random places); the answer lists every key, in the order they appear."""
    (name,) = rng.choice(NAMES, size=1)
    keys = random_keys(rng, values)
    places = [_check_depth(depth), *rng.random(values - 1)]
    needles = [(p, tok.encode(MULTIVALUE_NEEDLE.format(name=name, key=k))) for p, k in zip(places, keys)]
    in_order = tuple(k for _, k in sorted(zip(places, keys), key=lambda pk: pk[0]))
    return needles, _format(MULTIVALUE_QUESTION, name=name), (keys[0], *in_order), ()


def vartrack_prompt(
    tok: Tokenizer, depth: float, rng: np.random.Generator, chains: int = 2, hops: int = 3
) -> Parts:
    """`chains` variable chains of `hops` copies each; the question asks for the last variable of the
    first chain, whose value assignment sits at `depth` and whose copies follow it evenly spaced to
    the end. The other chains (distinct values) go to random places, each in its own order."""
    depth = _check_depth(depth)
    names = _var_names(rng, chains * (hops + 1))
    values = random_keys(rng, chains)
    needles = []
    for c, value in enumerate(values):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        statements = [VAR_VALUE.format(name=chain[0], value=value)]
        statements += [VAR_COPY.format(name=b, source=a) for a, b in zip(chain, chain[1:])]
        if c == 0:
            places = [depth + (1 - depth) * j / (hops + 1) for j in range(hops + 1)]
        else:
            places = sorted(rng.random(hops + 1))
        needles += [(p, tok.encode(s)) for p, s in zip(places, statements)]
    return needles, _format(VAR_QUESTION, name=names[hops]), (values[0],), tuple(values[1:])


def heldout_prompt(
    task: str, tok: Tokenizer, depth: float, rng: np.random.Generator, facts: int = 1
) -> Parts:
    """`facts` facts in one template drawn from the family of `task` (heldout_<family>), distinct tags and
    5-digit numbers; the question asks for the first, which sits at `depth`, the others at random places.
    In the dialogue layout two distinct speakers state and ask."""
    family = templates.family_templates(task.removeprefix(f"{HELDOUT}_"))
    template = family[rng.integers(len(family))]
    tags = templates.tags(template, rng, facts)
    keys = random_keys(rng, facts)
    speakers = templates.speakers(rng)
    rendered = [templates.render(template, t, k, speakers) for t, k in zip(tags, keys)]
    places = [_check_depth(depth), *rng.random(facts - 1)]
    # the filler is one line: a statement laid out on its own line starts one there, as in training
    statements = [
        r.statement if template.layout == "prose" else "\n" + r.statement.lstrip("\n") for r in rendered
    ]
    needles = [(p, tok.encode(s)) for p, s in zip(places, statements)]
    question, at = rendered[0].question, rendered[0].lead_start
    return needles, (question[:at], question[at:]), (keys[0],), tuple(keys[1:])


def _named_needles(
    tok: Tokenizer, depth: float, rng: np.random.Generator, keys: int
) -> tuple[list[str], list[int], Needles]:
    """`keys` distinct animals with distinct keys in MULTIKEY_NEEDLE's wording, the first at `depth`."""
    names = [NAMES[i] for i in rng.choice(len(NAMES), size=keys, replace=False)]
    values = random_keys(rng, keys)
    places = [_check_depth(depth), *rng.random(keys - 1)]
    needles = [
        (p, tok.encode(MULTIKEY_NEEDLE.format(name=n, key=k))) for p, n, k in zip(places, names, values)
    ]
    return names, values, needles


def _format(question: tuple[str, str], **fields) -> tuple[str, str]:
    return question[0].format(**fields), question[1].format(**fields)


def _assemble(
    task: str,
    tok: Tokenizer,
    length: int,
    needles: Needles,
    question: tuple[str, str],
    answers: tuple[int, ...],
    distractors: tuple[int, ...],
    chat: ChatTurns | None = None,
) -> RetrievalPrompt:
    """(BOS if the tokenizer's prompts take one) + INTRO + filler sentences with `needles` + the question
    (ask, lead); with `chat`, the user's turn holds everything before the lead, and the lead (without
    its leading space) opens the assistant's turn.

    Needle i goes after round(place * n) of the n filler sentences; needles at the same place keep
    their list order (a chain's assignments stay in order). needles[0] is the one asked about.
    """
    check_number("length", length, minimum=1, integer=True, allowed="a positive integer")
    ask, lead = question
    if chat is None:
        head, tail = [tok.bos_id] * tok.add_bos + tok.encode(INTRO), tok.encode(ask + lead)
    else:
        head = tok.encode(chat[0]) + tok.encode(INTRO)
        tail = tok.encode(ask) + tok.encode(chat[1]) + tok.encode(lead.lstrip(" "))
    fixed = len(head) + sum(len(t) for _, t in needles) + len(tail)
    if fixed > length:
        raise ValueError(
            f"length {length} is too short for a {task} prompt: its fixed parts alone take {fixed} tokens."
        )
    sentences = [tok.encode(s) for s in re.findall(r" [^.?!]*[.?!]", FILLER)]
    filler, budget = [], length - fixed
    while len(nxt := sentences[len(filler) % len(sentences)]) <= budget:
        filler.append(nxt)
        budget -= len(nxt)
    slots = [round(place * len(filler)) for place, _ in needles]
    tokens, emitted, filler_before, asked_start, asked_before = list(head), 0, 0, 0, 0
    for i in sorted(range(len(needles)), key=lambda i: (slots[i], i)):
        for sentence in filler[emitted : slots[i]]:
            tokens += sentence
            filler_before += len(sentence)
        emitted = max(emitted, slots[i])
        if i == 0:
            asked_start, asked_before = len(tokens), filler_before
        tokens += needles[i][1]
    for sentence in filler[emitted:]:
        tokens += sentence
    tokens += tail
    depth = asked_before / max(1, sum(map(len, filler)))
    asked, *listed = answers  # needles[0]'s value, then the answer's list (multiquery, multivalue only)
    return RetrievalPrompt(task, tokens, asked, depth, asked_start, tuple(listed) or (asked,), distractors)


def _var_names(rng: np.random.Generator, n: int) -> list[str]:
    """n distinct names of VAR_NAME_LETTERS random capital letters."""
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice(list(string.ascii_uppercase), size=VAR_NAME_LETTERS))
        if name not in names:
            names.append(name)
    return names


def _check_depth(depth: float) -> float:
    if isinstance(depth, bool) or not isinstance(depth, int | float) or not 0 <= depth <= 1:
        raise ValueError(f"depth must lie in [0, 1] (0 = start, 1 = end), got {depth!r}.")
    return float(depth)
