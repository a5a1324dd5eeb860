"""Counts, lists and sentences as a reader writes them: 1 bucket, 2 buckets; a, b and c."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and its noun, singular for exactly one: counted(1, "bucket") -> "1 bucket"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def listed(items: list[str], last: str = "and") -> str:
    """`a`, `a and b`, `a, b and c` (`last`: the word before the last item)."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def continued(sentence: str) -> str:
    """A sentence as the continuation of another (after a semicolon): its first letter lower-cased, unless
    the first word is an acronym or a name written in capitals (MAUVE, BNG, HDPO stay as they are)."""
    first = sentence.split(maxsplit=1)[0].rstrip(",.;:") if sentence.strip() else ""
    return sentence if len(first) > 1 and first.isupper() else sentence[:1].lower() + sentence[1:]
