"""ConvLab-3 unified datasets (CamRest676, MultiWOZ, WOZ, KVRET, ...): a zip holding data/dialogues.json,
or the JSON itself: [{dialogue_id, data_split, turns: [{speaker: user|system, utterance}]}].

The system agent's turns are the targets. `data_split` is the official split, used with `split: auto`.
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
    text_field,
)
from polyalign.data.records import OFFICIAL_SPLITS, ImportItem, InputError, Location, Malformed, RowProblem

PATTERNS = ("*.zip", "dialogues.json")
DEFAULTS = {"track": "multi", "family": "dialogue", "style": "task_dialogue"}
ROLES = {"user": "user", "system": "assistant"}


def _document(path: Path) -> tuple[str, Any]:
    if path.suffix == ".zip":
        for member, document in load_json_from_zip(path, "dialogues.json"):
            return f"{path}!{member}", document
    return str(path), load_json(path)


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    name, document = _document(path)
    if not isinstance(document, list):
        raise InputError(f"{name}: expected a JSON list of ConvLab dialogues")
    for index, dialogue in enumerate(document):
        location = Location(name, element=index + 1, row=index)
        try:
            dialogue = require_dict(dialogue, "dialogue")
            dialogue_id = text_field(dialogue, "dialogue_id", default=f"{file_tag}-{index:06d}")
            split_name = text_field(dialogue, "data_split", default="")
            if split_name and split_name not in OFFICIAL_SPLITS:
                raise RowProblem(f"unknown data_split {split_name!r}")
            turns = labelled_turns(list_field(dialogue, "turns"), ROLES, "speaker", "utterance", "turn")
            yield from list(project_dialogue(
                turns, dialogue_id, location, split=OFFICIAL_SPLITS.get(split_name),
                meta={"domains": dialogue.get("domains", [])},
            ))
        except RowProblem as problem:
            yield Malformed(location, str(problem), dump_raw(dialogue))
