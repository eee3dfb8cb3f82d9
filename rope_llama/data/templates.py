"""Recall wordings built from parts, split into training and held-out families by construction.

A wording (`Template`) picks one of each part; `{X}` is the tag (what the number belongs to), `{N}` the number:

    thing      the word for what is held: code, number, price, room, ... ("the north code")
    tag        how the thing is named: "the {qualifier} {thing}", "the {thing} of the {noun}", "{Name}'s {thing}"
    statement  how the fact is said: "{X} is {N}.", "{N} is {X}.", "Remember {N} for {X}.", "{X}: {N}.", ...
    layout     where it sits: prose (a sentence inside a line), line, list ("- " entry), dialogue (a speaker's
               lines, as the plays print them: "HELENA:\\n...")
    question   how it is asked: cloze (no question), direct ("What is {X}?"), request, which, ...; in the
               dialogue layout another speaker asks and the fact's speaker answers
    lead       the words right before the answer: "{X} is", "It is", "Answer:", "The number is"

    rendered, e.g. (list layout, "{N} is {X}.", question "Tell me {X}.", lead "It is"):
        - 40213 is the code of the tower.
        ...
        Tell me the code of the tower. It is 40213

Held out by construction (`HELD_OUT`): three thing words, one statement, one question, and one combination
("Which number is X?" in the prose layout) never occur in training (`training_templates`); each held-out
family (`FAMILIES`) is built from them, so every held-out template lies outside the training space
(tests/test_templates.py enumerates both). The retrieval suite (inference/retrieval.py) asks the families;
`data.recall.varied_share` trains on the rest.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import numpy as np

THINGS = ("code", "number", "price", "room", "pin", "ticket", "account", "seat", "order", "badge",
          "combination", "extension", "reference", "serial", "cabin", "berth", "line", "table")  # fmt: skip
TAGS = {
    "adjective": "the {qualifier} {thing}",
    "of": "the {thing} of the {noun}",
    "owner": "{name}'s {thing}",
}
STATEMENTS = {
    "is": "{X} is {N}.",
    "reversed": "{N} is {X}.",
    "remember": "Remember {N} for {X}.",
    "colon": "{X}: {N}.",
    "note": "Note that {X} is {N}.",
    "write": "Write down {X}, it is {N}.",
    "set": "{X} was set to {N}.",
}
LAYOUTS = ("prose", "line", "list", "dialogue")
QUESTIONS = {
    "cloze": "",
    "direct": "What is {X}?",
    "request": "Tell me {X}.",
    "which": "Which number is {X}?",
    "asked": "And {X}?",
    "know": "Do you know {X}?",
}
LEADS = {"restate": "{X} is", "it": "It is", "answer": "Answer:", "number": "The number is"}
QUALIFIERS = ("north", "south", "east", "west", "upper", "lower", "inner", "outer", "first", "last",
              "spare", "night", "morning", "winter", "summer", "river", "garden", "market")  # fmt: skip
NOUNS = ("tower", "inn", "harbour", "chapel", "mill", "bridge", "abbey", "forge", "orchard", "stable",
         "theatre", "library", "kitchen", "cellar", "palace", "camp")  # fmt: skip
NAMES = ("Marcus", "Helena", "Viola", "Lucius", "Portia", "Edmund", "Olivia", "Silvius", "Rosaline",
         "Camillo", "Isabel", "Dromio", "Paulina", "Flavius", "Bianca", "Angelo")  # fmt: skip
FILLS = {"adjective": QUALIFIERS, "of": NOUNS, "owner": NAMES}  # what fills each tag pattern's slot
SPEAKERS = tuple(n.upper() for n in NAMES)  # the plays print a speaker's name in capitals, then a colon
STOP = "."  # what follows an answer in training: numbers have several lengths, so where a copy ends is learnt
DIGITS = (3, 7)  # training numbers have 3..7 digits (uniform); the suite asks 5-digit ones, like the passkey

# Never in training; the held-out families are made of them.
HELD_OUT = {
    "things": ("locker", "voucher", "permit"),
    "statement": "set",
    "question": "know",
    "combination": ("prose", "which"),  # "Which number is X?" is trained in every layout but prose
}


@dataclass(frozen=True)
class Template:
    """One wording: a choice of each part (the keys of TAGS, STATEMENTS, QUESTIONS, LEADS; a layout; a thing)."""

    thing: str
    tag: str
    statement: str
    layout: str
    question: str
    lead: str


@dataclass(frozen=True)
class Rendered:
    """A fact and its question as text. `statement` goes into the haystack as it is (a prose one after a
    sentence end, the others at a line start); `question` ends the prompt, and `answer` (" 40213") follows it."""

    statement: str
    question: str
    answer: str
    lead_start: (
        int  # where in `question` the answer's lead begins: a chat prompt's assistant turn starts there
    )


def valid(t: Template) -> bool:
    """Whether the parts fit together: the cloze question (no question) is only the restated tag."""
    return t.question != "cloze" or t.lead == "restate"


def all_templates(things=THINGS + HELD_OUT["things"]) -> list[Template]:
    """Every valid template over `things`."""
    parts = itertools.product(things, TAGS, STATEMENTS, LAYOUTS, QUESTIONS, LEADS)
    return [t for t in itertools.starmap(Template, parts) if valid(t)]


def held_out_parts(t: Template) -> set[str]:
    """Which of `t`'s parts are held out: a subset of HELD_OUT's keys ("combination" for prose x direct)."""
    used = {
        "things": t.thing in HELD_OUT["things"],
        "statement": t.statement == HELD_OUT["statement"],
        "question": t.question == HELD_OUT["question"],
        "combination": (t.layout, t.question) == HELD_OUT["combination"],
    }
    return {part for part, yes in used.items() if yes}


@functools.cache
def training_templates() -> tuple[Template, ...]:
    """The templates recall windows are drawn from (`data.recall.varied_share`): no held-out part."""
    return tuple(t for t in all_templates() if not held_out_parts(t))


# Held-out families: the layout each is asked in (None: any) and its one held-out part; every other part is
# trained, so a family measures one kind of novelty.
FAMILIES = {
    "prose": (None, "combination"),  # a plain statement and "Which number is X?" inside prose
    "dialogue": ("dialogue", "question"),  # one speaker states the number, another asks "Do you know ...?"
    "list": ("list", "statement"),  # list entries stated with the held-out verb ("... was set to N.")
    "things": (None, "things"),  # held-out thing words (locker, voucher, permit) in trained wordings
}


@functools.cache
def family_templates(family: str) -> tuple[Template, ...]:
    """The templates of one held-out family (a key of FAMILIES)."""
    if family not in FAMILIES:
        raise ValueError(f"held-out family {family!r} is unknown; allowed families are {list(FAMILIES)}.")
    layout, part = FAMILIES[family]
    return tuple(t for t in all_templates() if held_out_parts(t) == {part} and layout in (None, t.layout))


def tags(
    t: Template, rng: np.random.Generator, n: int, shared_thing: bool = True, words=(), things=()
) -> list[str]:
    """`n` distinct tags in `t`'s tag pattern, all with `t.thing` when `shared_thing`, else with random
    things of the same split; `words` (optional) replace the qualifier list and `things` (optional) the thing
    words, e.g. with vocabulary words."""
    if things:
        t = replace(t, thing=things[rng.integers(len(things))])
    things = things or (HELD_OUT["things"] if t.thing in HELD_OUT["things"] else THINGS)
    fills = (words or FILLS[t.tag]) if t.tag == "adjective" else FILLS[t.tag]
    if n > len(fills):
        raise ValueError(
            f"a window of {n} facts needs {n} distinct tags; the {t.tag} pattern has {len(fills)}."
        )
    out = []
    for i in rng.choice(len(fills), size=n, replace=False):
        thing = t.thing if shared_thing else things[rng.integers(len(things))]
        out.append(TAGS[t.tag].format(qualifier=fills[i], noun=fills[i], name=fills[i], thing=thing))
    return out


def speakers(rng: np.random.Generator) -> tuple[str, str]:
    """Two distinct speakers: (who states the fact and answers, who asks), for the dialogue layout."""
    first, second = rng.choice(len(SPEAKERS), 2, replace=False)
    return SPEAKERS[first], SPEAKERS[second]


def number(rng: np.random.Generator, digits: tuple[int, int] = DIGITS) -> int:
    """A number of digits[0]..digits[1] digits (uniform count), no leading zero."""
    n = int(rng.integers(digits[0], digits[1] + 1))
    return int(rng.integers(10 ** (n - 1), 10**n))


def sentence(text: str) -> str:
    """`text` with its first letter in capitals (a tag opens many statements)."""
    return text[:1].upper() + text[1:]


# per layout but dialogue: how a statement sits in the haystack, and what opens the question
LAYOUT_TEXT = {"prose": (" {}", " "), "line": ("{}\n", "\n"), "list": ("- {}\n", "\n")}


def render(t: Template, tag: str, value: int, speakers: tuple[str, str] = ("HELENA", "MARCUS")) -> Rendered:
    """The statement, question and answer of fact (`tag`, `value`) in wording `t`. speakers: (who states
    the fact and answers, who asks) in the dialogue layout. A training window follows each answer with STOP."""
    statement = sentence(STATEMENTS[t.statement].format(X=tag, N=value))
    question = sentence(QUESTIONS[t.question].format(X=tag))
    lead = sentence(LEADS[t.lead].format(X=tag))
    asked = f"{question} {lead}" if question else lead
    if t.layout in LAYOUT_TEXT:
        laid_out, opening = LAYOUT_TEXT[t.layout]
        before_lead = (opening + asked)[: -len(lead)].rstrip(" ")  # the space before the lead is the lead's
        return Rendered(laid_out.format(statement), opening + asked, f" {value}", len(before_lead))
    teller, asker = speakers
    ask = f"{asker}:\n{question}" if question else ""
    answer_turn = f"\n{teller}:\n{lead}" if question else f"{asker}:\n{lead}"
    # a chat's assistant speaks as the teller; a cloze dialogue has no question to ask
    return Rendered(f"\n{teller}:\n{statement}\n", f"\n\n{ask}{answer_turn}", f" {value}", 2 + len(ask))
