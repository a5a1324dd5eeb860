"""ShareGPT: a JSON array (or JSONL) of {"id"?, "system"?, "conversations": [{"from", "value"}]}.

`from` is human/user, gpt/assistant (and the usual model names) or system. Tool and function turns are
not part of a human response distribution and are reported as unknown roles.
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
    require_dict,
    text_field,
)
from polyalign.data.importers.chat import project
from polyalign.data.records import ImportItem, Location

PATTERNS = ("*.json", "*.jsonl")
DEFAULTS: dict[str, str] = {}
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "system": "system",
}


def _parse(row: Any, location: Location) -> Iterator[ImportItem]:
    row = require_dict(row)
    system = text_field(row, "system", default="")
    turns = [{"role": "system", "text": system}] if system else []
    turns += labelled_turns(list_field(row, "conversations"), ROLES, "from", "value", "turn")
    return project(row, location, turns)


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    return parse_rows(iter_json_rows(path), _parse)
