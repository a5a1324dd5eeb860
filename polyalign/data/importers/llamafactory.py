"""LLaMA-Factory alpaca format: a JSON array (or JSONL) of {instruction, input, output, system?, history?}.

`history` is a list of [user, assistant] pairs. Bucket fields carried by the rows (the PolyAlign
authors' sample has track, family, style_bucket, length_bin, bucket_id) are kept as the source's own
labels: track, family and style take precedence over configuration; length_bin and bucket_id are
recomputed and compared (manifest `label_agreement`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers._io import (
    iter_json_rows,
    list_field,
    parse_rows,
    require_dict,
    string_labels,
    text_field,
)
from polyalign.data.records import Example, ImportItem, Location, RowProblem

PATTERNS = ("*.json", "*.jsonl")
DEFAULTS: dict[str, str] = {}
ROW_LABELS = {
    "language": "language", "track": "track", "family": "family", "style": "style",
    "style_bucket": "style", "length_bin": "length_bin", "bucket_id": "bucket_id",
}


def _history(row: dict[str, Any]) -> list[dict[str, str]]:
    turns = []
    for i, pair in enumerate(list_field(row, "history", optional=True), start=1):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise RowProblem(f"malformed history: entry {i} must be a [user, assistant] pair of strings")
        turns += [{"role": "user", "text": pair[0]}, {"role": "assistant", "text": pair[1]}]
    return turns


def _parse(row: Any, location: Location) -> Iterator[ImportItem]:
    row = require_dict(row)
    meta = {}
    system = text_field(row, "system", default="")
    if system:
        meta["system"] = system
    group = row.get("conversation_id", row.get("group_id"))
    yield Example(
        question=text_field(row, "instruction"),
        context=text_field(row, "input", default=""),
        response=text_field(row, "output", what="response 'output'"),
        history=_history(row),
        labels=string_labels(row, ROW_LABELS),
        group=str(group) if group is not None else None,
        location=location,
        meta=meta,
    )


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    return parse_rows(iter_json_rows(path), _parse)
