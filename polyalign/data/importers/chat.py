"""Chat JSONL, the common export format: one conversation per line,
{"id"?: str, "messages": [{"role": "system"|"user"|"assistant", "content": str}], "language"?, "track"?, "family"?, "style"?}.

Every assistant message after the first turn is a target; system messages stay in the history.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers._io import (
    iter_json_rows,
    labelled_turns,
    list_field,
    parse_rows,
    project_dialogue,
    require_dict,
    string_labels,
)
from polyalign.data.records import ImportItem, Location, RowProblem

PATTERNS = ("*.jsonl", "*.json")
DEFAULTS: dict[str, str] = {}
ROLES = {"user": "user", "assistant": "assistant", "system": "system"}
ROW_LABELS = {"language": "language", "track": "track", "family": "family", "style": "style"}


def dialogue_id(row: dict[str, Any], location: Location) -> str:
    value = row.get("id")
    if value is None:
        return f"{location.row:06d}"
    if not isinstance(value, (str, int)) or isinstance(value, bool) or not str(value).strip():
        raise RowProblem("'id' must be a non-empty string or an integer")
    return str(value).strip()


def project(row: dict[str, Any], location: Location, turns: list[dict[str, str]]) -> Iterator[ImportItem]:
    if not any(turn["role"] == "assistant" for turn in turns[1:]):
        raise RowProblem("the conversation has no assistant turn after the first message")
    return project_dialogue(turns, dialogue_id(row, location), location, labels=string_labels(row, ROW_LABELS))


def _parse(row: Any, location: Location) -> Iterator[ImportItem]:
    row = require_dict(row)
    turns = labelled_turns(list_field(row, "messages"), ROLES, "role", "content", "message")
    return project(row, location, turns)


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    return parse_rows(iter_json_rows(path), _parse)
