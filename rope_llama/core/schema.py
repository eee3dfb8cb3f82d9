"""Option schemas: what a command line may say for each key of a composed config, checked before a command
builds or writes anything. A `Schema` maps dotted keys to `Option`s; `check_config` refuses the first bad
value in one sentence naming the key, the value and what is allowed.

The options of a config dataclass come from the dataclass itself (`dataclass_options`): the annotation
gives the type (`int`, `float`, `bool`, `str`, `X | None`, a `StrEnum`, a tuple of numbers) and the field's
metadata its range, with the keyword arguments of `check_number` (`field(default=1, metadata={"minimum":
1})`). The keys of the YAML-only groups are declared with these same `Option`s by the command's schema
(cli/schema.py). `probe_values` are the bad values every test throws at every key (tests/test_schema.py).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from rope_llama.core.checks import check_number, describe

NUMBER_BOUNDS = ("minimum", "maximum", "above", "below")


class OptionError(ValueError):
    """A value the schema does not allow: one sentence naming the key, the value and what is allowed."""


@dataclass(frozen=True)
class Option:
    """One key's allowed values.

    kind:      number | flag (true/false only: no string or 0/1 truthiness) | choice | text | list |
               either (one of `options`) | free (anything: a mapping of extra fields)
    integer, minimum, maximum, above, below, means:  a number's, as `check_number`'s
    choices:   a choice's allowed values
    item:      a list's item option; nonempty / unique: a list's rules
    allow_none, none_means:  null is allowed, and what it means
    max_chars: a text's longest length (a run name is a directory name)
    """

    kind: str
    integer: bool = False
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    below: float | None = None
    means: str = ""
    choices: tuple = ()
    item: Option | None = None
    nonempty: bool = False
    unique: bool = False
    allow_none: bool = False
    none_means: str = ""
    max_chars: int | None = None
    options: tuple[Option, ...] = ()

    def allowed(self) -> str:
        """The allowed values in words."""
        if self.kind == "number":
            words = describe(self.minimum, self.maximum, self.above, self.below, self.integer)
            words += f" ({self.means})" if self.means else ""
        elif self.kind == "flag":
            words = "true or false"
        elif self.kind == "choice":
            words = (
                str(self.choices[0])
                if len(self.choices) == 1
                else "one of " + ", ".join(map(str, self.choices))
            )
        elif self.kind == "text":
            words = f"a {'non-empty ' if self.nonempty else ''}string"
            words += f" of at most {self.max_chars} characters" if self.max_chars else ""
        elif self.kind == "either":  # "true, false or auto", "an integer >= 1 or matched"
            parts = [
                w for o in self.options for w in (("true", "false") if o.kind == "flag" else (o.allowed(),))
            ]
            words = ", ".join(parts[:-1]) + " or " + parts[-1]
        elif self.kind == "list":
            quals = " ".join(
                q for q, on in (("non-empty", self.nonempty), ("duplicate-free", self.unique)) if on
            )
            words = f"a {quals + ' ' if quals else ''}list"
            words += f", each {self.item.allowed()}" if self.item else ""
        else:
            words = "any value"
        return words + (
            f" or null{f' ({self.none_means})' if self.none_means else ''}" if self.allow_none else ""
        )

    def check(self, key: str, value) -> None:
        """Raise OptionError unless `value` is allowed for `key`."""
        if value is None and self.allow_none or self.kind == "free":
            return
        if not self.accepts(value):
            raise OptionError(f"{key} must be {self.allowed()}, got {shown(value)}.")

    def accepts(self, value) -> bool:
        if value is None:
            return self.allow_none
        if self.kind == "number":
            bounds = {b: getattr(self, b) for b in NUMBER_BOUNDS}
            try:
                check_number("", value, integer=self.integer, **bounds)
            except ValueError:
                return False
            return True
        if self.kind == "flag":
            return isinstance(value, bool)
        if self.kind == "choice":
            return not isinstance(value, bool) and value in self.choices
        if self.kind == "text":
            fits = self.max_chars is None or len(value) <= self.max_chars if isinstance(value, str) else False
            return isinstance(value, str) and fits and not (self.nonempty and not value)
        if self.kind == "list":
            if not isinstance(value, list | tuple | ListConfig):
                return False
            items = list(value)
            if self.nonempty and not items or self.unique and len(set(map(repr, items))) < len(items):
                return False
            return self.item is None or all(self.item.accepts(i) for i in items)
        if self.kind == "either":
            return any(o.accepts(value) for o in self.options)
        return True


def shown(value) -> str:
    """A value as the user typed it, cut short when it is long."""
    text = repr(list(value) if isinstance(value, ListConfig) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def number(**bounds) -> Option:
    return Option("number", **bounds)


def integer(**bounds) -> Option:
    return Option("number", integer=True, **bounds)


FLAG = Option("flag")
TEXT = Option("text")
FREE = Option("free")


def choice(*values, **kw) -> Option:
    return Option("choice", choices=tuple(values), **kw)


def items(item: Option | None = None, **kw) -> Option:
    return Option("list", item=item, **kw)


def either(*options: Option, **kw) -> Option:
    return Option("either", options=options, **kw)


Schema = Mapping[str, Option]


def annotation_option(hint, metadata: Mapping) -> Option:
    """The option of a dataclass field from its type hint and metadata."""
    allow_none = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        allow_none = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else str  # `RopeScaling | str`: the enum's values, below
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        hint = enums[0] if enums else hint
    extra = {k: metadata[k] for k in (*NUMBER_BOUNDS, "means", "none_means") if k in metadata}
    kw = dict(allow_none=allow_none, **extra)
    if "choices" in metadata:
        return Option("choice", choices=tuple(metadata["choices"]), **kw)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return Option("choice", choices=tuple(m.value for m in hint), **kw)
    if hint is bool:
        return Option("flag", **kw)
    if hint is int:
        return Option("number", integer=True, **kw)
    if hint is float:
        return Option("number", **kw)
    if hint is str:
        return Option("text", **kw)
    if typing.get_origin(hint) in (tuple, list):
        (first, *_) = typing.get_args(hint) or (None,)
        item = Option("number", **{k: v for k, v in extra.items() if k in NUMBER_BOUNDS})
        return Option("list", item=item if first in (int, float) else None, allow_none=allow_none)
    return FREE


def dataclass_options(cls: type, prefix: str, skip: tuple[str, ...] = ()) -> dict[str, Option]:
    """`prefix.<field>` (`<field>` for prefix "") -> Option for every field of the dataclass `cls` (but `skip`)."""
    hints = typing.get_type_hints(cls)
    return {
        f"{prefix}.{f.name}" if prefix else f.name: annotation_option(hints[f.name], f.metadata)
        for f in dataclasses.fields(cls)
        if f.name not in skip
    }


def check_fields(obj, prefix: str, error: type[ValueError] = ValueError) -> None:
    """Check every field of the dataclass instance `obj` against its own option (a constructor's check:
    the one place its ranges are declared, also read by the command schemas)."""
    for key, option in dataclass_options(type(obj), prefix).items():
        try:
            option.check(key, getattr(obj, key.rsplit(".", 1)[-1]))
        except OptionError as e:
            raise error(str(e)) from None


def value_at(cfg: DictConfig, key: str):
    """(present, value) of a dotted key, interpolations resolved; a value that refers to Hydra's runtime
    (a run directory) is the command's own, not the user's: absent here."""
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False, None
        if OmegaConf.is_missing(node, part):
            return False, None  # `???`: `require` names it
        try:
            node = node[part]
        except InterpolationResolutionError:
            return False, None
    return True, node


def check_config(cfg: DictConfig, schema: Schema, error: type[ValueError] = OptionError) -> None:
    """Refuse the first value of `cfg` that its key's option does not allow, as `error`."""
    for key, option in schema.items():
        present, value = value_at(cfg, key)
        if present:
            try:
                option.check(key, value)
            except OptionError as e:
                raise error(str(e)) from None


def leaf_keys(cfg: DictConfig, prefix: str = "") -> Iterator[str]:
    """Every dotted key of a value in `cfg` (a list is one value), but Hydra's and `_target_`-like ones."""
    for key in cfg.keys():
        if str(key).startswith("_") or (not prefix and key == "hydra"):
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            yield from leaf_keys(node, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def unlisted_keys(cfg: DictConfig, schema: Schema) -> list[str]:
    """The keys of `cfg` that `schema` says nothing of: a test keeps this empty for every composed config.
    A group set to null (logger=none, ~callbacks.x) is covered by its keys' options."""
    free = free_prefixes(schema)
    return [
        k
        for k in leaf_keys(cfg)
        if k not in schema
        and not any(k.startswith(p + ".") for p in free)
        and not (
            OmegaConf.select(cfg, k, throw_on_resolution_failure=False) is None
            and any(s.startswith(k + ".") for s in schema)
        )
    ]


def free_prefixes(schema: Schema) -> list[str]:
    """Keys whose option is `free`: everything below them is theirs (a mapping of extra fields)."""
    return [k for k, o in schema.items() if o.kind == "free"]


# The values every test throws at every key: the schema says which of them the key allows.
PROBES: dict[str, object] = {
    "zero": 0,
    "minus one": -1,
    "nan": math.nan,
    "inf": math.inf,
    "huge": 1e30,
    "a string": "bogus",
    "a fraction": 1.5,
    "maybe": "maybe",
    "true": True,
}


def probe_values(option: Option) -> dict[str, object]:
    """The probes `option` refuses (those a key must refuse in one sentence)."""
    return {name: v for name, v in PROBES.items() if not option.accepts(v) and option.kind != "free"}
