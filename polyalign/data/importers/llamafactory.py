"""LLaMA-Factory alpaca format: a JSON array (or JSONL) of {instruction, input, output, system?, history?}.

`history` is a list of [user, assistant] pairs; `system` is the record's system prompt (a history turn
of role system opening the history, as the `chat` format keeps one). The track is derived from the
history (multi when it has turns) unless the row or the data config says otherwise. Bucket fields
carried by the rows (the PolyAlign authors' sample has track, family, style_bucket, length_bin,
bucket_id) are kept as the source's own labels: track, family and style take precedence over
configuration; length_bin and bucket_id are recomputed, and the track read off the history, and compared
(manifest `label_agreement`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers.reading import (
    conversation_track,
    iter_json_rows,
    list_field,
    parse_rows,
    require_dict,
    string_labels,
    text_field,
)
from polyalign.data.records import Example, ImportItem, Location, RowProblem

PATTERNS = ("*.json", "*.jsonl")
DEFAULTS = {"track": "single", "family": "assistant", "style": "assistant_like"}
ROW_LABELS = {
    "language": "language", "track": "track", "family": "family", "style": "style",
    "style_bucket": "style", "length_bin": "length_bin", "bucket_id": "bucket_id",
}


# every key a row may hold that this importer reads, or knowingly passes over (the authors' sample carries its
# own Bucket-SFT weight, `dist_sft_weight`; polyalign computes the weights from the buckets it assigns); any
# other is counted as unread (`outptu` for `output`)
READ_KEYS = frozenset({"instruction", "input", "output", "system", "history", "conversation_id", "group_id",
                       "dist_sft_weight", *ROW_LABELS})


def _history(row: dict[str, Any]) -> list[dict[str, str]]:
    turns = []
    for i, pair in enumerate(list_field(row, "history", optional=True), start=1):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise RowProblem(f"malformed history: entry {i} must be a [user, assistant] pair of strings")
        turns += [{"role": "user", "text": pair[0]}, {"role": "assistant", "text": pair[1]}]
    return turns


def _parse(row: Any, location: Location) -> Iterator[ImportItem]:
    row = require_dict(row)
    system = text_field(row, "system", default="")
    history = _history(row)
    group = row.get("conversation_id", row.get("group_id"))
    question = text_field(row, "instruction")
    response = text_field(row, "output", what="response 'output'")
    context = text_field(row, "input", default="")
    yield Example(
        question=question,
        context=context,
        response=response,
        history=([{"role": "system", "text": system}] if system else []) + history,
        labels=string_labels(row, ROW_LABELS),
        group=str(group) if group is not None else None,
        location=location,
        derived={"track": conversation_track(history)},
        # the passage (`input`) is part of what the row is written in: "Yes" to an English passage is English
        conversation="\n".join(text for text in (context, *(t["text"] for t in history), question, response) if text),
        unread_keys=tuple(sorted(str(key) for key in set(row) - READ_KEYS)),
    )


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    return parse_rows(iter_json_rows(path), _parse)
