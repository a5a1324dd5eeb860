"""Counts as a reader writes them: 1 bucket, 2 buckets."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and its noun, singular for exactly one: counted(1, "bucket") -> "1 bucket"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
