"""KdConv knowledge-grounded chat: a JSON list of dialogues {name?, messages: [{message, attrs?}]}.

Speakers alternate, the first being the user. The knowledge triples a turn is grounded on (`attrs`)
become that record's context, one `entity | attribute | value` line each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers.reading import (
    alternating_turns,
    dump_raw,
    list_field,
    load_json,
    project_dialogue,
    require_dict,
    text_field,
)
from polyalign.data.records import ImportItem, InputError, Location, Malformed, RowProblem

PATTERNS = ("*.json",)
DEFAULTS = {"track": "multi", "family": "dialogue", "style": "open_chat"}


def _knowledge(message: dict[str, Any], where: str) -> str:
    lines = []
    for attr in list_field(message, "attrs", optional=True):
        attr = require_dict(attr, f"{where} attrs entry")
        parts = [text_field(attr, key, default="", what=f"{where} attrs {key!r}")
                 for key in ("name", "attrname", "attrvalue")]
        lines.append(" | ".join(part for part in parts if part))
    return "\n".join(lines)


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    document = load_json(path)
    if not isinstance(document, list):
        raise InputError(f"{path}: expected a JSON list of KdConv dialogues")
    for index, dialogue in enumerate(document):
        location = Location(str(path), element=index + 1, row=index)
        try:
            dialogue = require_dict(dialogue, "dialogue")
            messages = [require_dict(m, f"message {i + 1}") for i, m in enumerate(list_field(dialogue, "messages"))]
            texts = [text_field(m, "message", what=f"message {i + 1} 'message'") for i, m in enumerate(messages)]
            knowledge = [_knowledge(m, f"message {i + 1}") for i, m in enumerate(messages)]
            dialogue_id = f"{file_tag}-{index:06d}"
            yield from list(project_dialogue(
                alternating_turns(texts, "dialogue"), dialogue_id, location,
                context_of=knowledge.__getitem__, meta={"topic": str(dialogue.get("name", ""))},
            ))
        except RowProblem as problem:
            yield Malformed(location, str(problem), dump_raw(dialogue))
