"""Text normalisation, length units and script-level helpers shared by every stage.

The rules are those of METHOD.md sections 1 and 2. Every stored record and every feature is computed on
`normalize` output, so a raw model output and a stored record give the same numbers.
"""

from __future__ import annotations

import functools
import re
import unicodedata

# CJK Unified Ideographs, Extension A and the Compatibility Ideographs: the ranges the v2 unit counts
# one by one.
CJK_IDEOGRAPH = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
# CJK symbols and punctuation plus half/full-width forms (，。！？「」 ...).
CJK_PUNCT = "\u3000-\u303f\uff00-\uffef"

_WHITESPACE_RUN = re.compile(r"\s+")

LENGTH_UNIT_PATTERNS = {
    "v2": re.compile(rf"[A-Za-z]+(?:'[A-Za-z]+)?|\d+|[{CJK_IDEOGRAPH}]|[^\w\s]"),
    "v1": re.compile(r"\w+|[^\w\s]"),
}
# What one unit is, for the reports that give lengths in them (docs/data.md, Length units and bins).
LENGTH_UNIT_WORDS = {
    "v2": "an English word, a run of digits, a Chinese character or a punctuation mark",
    "v1": "a run of letters, digits or Chinese characters, or a punctuation mark",
}

_SPACE_NEXT_TO_CJK = re.compile(
    rf"(?<=[{CJK_IDEOGRAPH}{CJK_PUNCT}]) +| +(?=[{CJK_IDEOGRAPH}{CJK_PUNCT}])"
)


def normalize(text: str) -> str:
    """Canonical form of a text: LF line ends, one space for any whitespace run inside a line,
    at most one blank line in a row, no leading or trailing whitespace. No case folding."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
    lines: list[str] = []
    for raw_line in text.split("\n"):
        line = _WHITESPACE_RUN.sub(" ", raw_line.strip())
        if line or (lines and lines[-1]):
            lines.append(line)
    return "\n".join(lines).strip()


@functools.lru_cache(maxsize=4096)  # a conversation's turns recur in the history of each of its later records
def repaired_encoding(text: str) -> str:
    """The text with its mojibake undone: UTF-8 read as Windows-1252 or Latin-1 ("1944â€“46" for "1944–46",
    "fiancÃ©" for "fiancé"), as ftfy.fix_encoding undoes it; any other text unchanged. ftfy changes a text only
    where the bytes decode back to a likelier one, so names in other scripts ("īśā") stay as they are."""
    import ftfy  # 44 ms to import: only where rows are read

    return ftfy.fix_encoding(text)


def remove_cjk_spacing(text: str) -> str:
    """Undo character-level tokenisation (LCCC): a space next to a CJK character carries no information.
    Spaces between two non-CJK characters (English words, numbers) are kept."""
    return _SPACE_NEXT_TO_CJK.sub("", text)


def without_words(text: str) -> bool:
    """Whether a non-empty answer holds only punctuation and spaces ("，，，，"): text, but no word of any
    language; a degenerate model's answer that generate, evaluate and the drift probe count apart."""
    return bool(text) and all(unicodedata.category(c).startswith("P") or c.isspace() for c in text)


def length_units(text: str, unit: str = "v2") -> int:
    """Number of length units in an already normalised text (METHOD.md section 2)."""
    try:
        pattern = LENGTH_UNIT_PATTERNS[unit]
    except KeyError:
        raise ValueError(f"unknown length unit {unit!r}; expected one of {sorted(LENGTH_UNIT_PATTERNS)}") from None
    return sum(1 for _ in pattern.finditer(text))
