"""What prepare says of a source's records that a reader must not miss, in the same words on the console and
in the statistics report: mojibake, and a declared language that the text's script contradicts."""

from __future__ import annotations

from typing import Any

from polyalign.core.wording import counted

MOJIBAKE = "UTF-8 text read as Windows-1252: \"1944â€“46\" for \"1944–46\""  # what mojibake is, by example


def mojibake_line(source: dict[str, Any]) -> str | None:
    """Records whose text was decoded with the wrong encoding somewhere before polyalign read it: a model
    trained on them learns to write "â€“". A warning with the fix, or a note of what the fix did."""
    count = source.get("mojibake")
    if not count:
        return None
    what = f"source {source['name']!r}: {counted(count, 'record')} held mojibake ({MOJIBAKE})"
    if source.get("fix_encoding"):
        lost = source.get("mojibake_lost")
        lost = (f"; {lost} of them still hold U+FFFD (�) where characters were lost before polyalign read them, a "
                "decoding that replaced what it could not read (meta.mojibake \"partly repaired\"): only the original "
                "export has them" if lost else "")
        return f"note: {what}, repaired (fix_encoding; meta.mojibake \"repaired\" marks them){lost}"
    return (f"warning: {what}, kept as read (meta.mojibake \"kept\" marks them); set `fix_encoding: true` on the "
            "source to repair them")


def language_mismatch_warning(mismatches: dict[str, int], what: str, declared_by: str, unit: str = "record"
                              ) -> str | None:
    """A declared language that the text's script contradicts labels `unit`s into another language's buckets
    (without the "warning: " the caller writes)."""
    if not mismatches:
        return None
    counts = ", ".join(f"{counted(count, unit)} {mismatch}" for mismatch, count in mismatches.items())
    return (f"{what}: {counts}; they are bucketed as declared. Check {declared_by}, or leave it out to detect each "
            "conversation's language")
