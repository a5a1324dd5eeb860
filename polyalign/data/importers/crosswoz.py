"""CrossWOZ task dialogues: a zip (or plain JSON) of {dialogue id: {messages: [{role: usr|sys, content}], type}}.

Only the wizard's (`sys`) turns are targets; the goal and dialogue-act annotations are not used.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers.reading import (
    dump_raw,
    labelled_turns,
    list_field,
    load_json,
    load_json_from_zip,
    project_dialogue,
    require_dict,
)
from polyalign.data.records import ImportItem, InputError, Location, Malformed, RowProblem

PATTERNS = ("*.json.zip", "*.json")
DEFAULTS = {"track": "multi", "family": "dialogue", "style": "task_dialogue"}
ROLES = {"usr": "user", "sys": "assistant"}


def _documents(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".zip":
        for member, document in load_json_from_zip(path):
            yield f"{path}!{member}", document
    else:
        yield str(path), load_json(path)


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    for name, document in _documents(path):
        if not isinstance(document, dict):
            raise InputError(f"{name}: expected a JSON object mapping dialogue ids to dialogues")
        for index, (dialogue_id, dialogue) in enumerate(document.items()):
            location = Location(name, dialogue=dialogue_id, row=index)
            try:
                dialogue = require_dict(dialogue, "dialogue")
                turns = labelled_turns(list_field(dialogue, "messages"), ROLES, "role", "content", "message")
                yield from list(project_dialogue(
                    turns, str(dialogue_id), location, meta={"task_type": str(dialogue.get("type", ""))},
                ))
            except RowProblem as problem:
                yield Malformed(location, str(problem), dump_raw(dialogue))
