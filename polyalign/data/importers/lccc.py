"""LCCC (Large-scale Cleaned Chinese Conversation) in its two native layouts.

- `*.txt`: one conversation per line, utterances separated by tabs (the toy files hold
  context<TAB>response pairs). Each line is one record: the last utterance is the response.
- `*.json`: a list of dialogues, or {split: [dialogues]}, each a list of utterance strings; every
  second turn is a target. The JSON keys train/valid/test are official splits.

LCCC text is tokenised with a space between every character; those spaces are removed next to CJK
characters and kept between words written in other scripts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers.reading import (
    alternating_turns,
    dump_raw,
    iter_text_lines,
    load_json,
    project_dialogue,
)
from polyalign.data.records import OFFICIAL_SPLITS, Example, ImportItem, InputError, Location, Malformed, RowProblem
from polyalign.data.text import remove_cjk_spacing

PATTERNS = ("*.txt", "*.json")
DEFAULTS = {"track": "multi", "family": "dialogue", "style": "open_chat"}


def _read_pairs(path: Path) -> Iterator[ImportItem]:
    for item in iter_text_lines(path):
        if isinstance(item, Malformed):
            yield item
            continue
        location, line = item
        utterances = [remove_cjk_spacing(u) for u in line.split("\t")]
        if len(utterances) < 2:
            yield Malformed(location, "expected at least two tab-separated utterances (context<TAB>response)", line)
            continue
        earlier = utterances[:-2]
        # Roles alternate backwards from the question, which is always the user's.
        history = [{"role": "assistant" if (len(earlier) - j) % 2 == 1 else "user", "text": u}
                   for j, u in enumerate(earlier)]
        yield Example(question=utterances[-2], response=utterances[-1], history=history, location=location)


def _dialogues(document: Any, path: Path) -> Iterator[tuple[str | None, str, int, Any]]:
    if isinstance(document, list):
        for index, dialogue in enumerate(document):
            yield None, "", index, dialogue
    elif isinstance(document, dict):
        for key, dialogues in document.items():
            if key not in OFFICIAL_SPLITS or not isinstance(dialogues, list):
                raise InputError(f"{path}: expected {{split: [dialogues]}} with splits {sorted(OFFICIAL_SPLITS)}, "
                                 f"got key {key!r}")
            for index, dialogue in enumerate(dialogues):
                yield OFFICIAL_SPLITS[key], f"{key}-", index, dialogue
    else:
        raise InputError(f"{path}: expected a JSON list of dialogues or {{split: [dialogues]}}")


def _read_dialogues(path: Path, file_tag: str) -> Iterator[ImportItem]:
    row = 0
    for split, prefix, index, dialogue in _dialogues(load_json(path), path):
        location = (Location(str(path), dialogue=f"{prefix}{index}", row=row) if prefix
                    else Location(str(path), element=index + 1, row=row))
        row += 1
        try:
            if not isinstance(dialogue, list):
                raise RowProblem(f"dialogue must be a list of utterances, got {type(dialogue).__name__}")
            turns = alternating_turns(dialogue, "dialogue")
            for turn in turns:
                turn["text"] = remove_cjk_spacing(turn["text"])
            yield from list(project_dialogue(turns, f"{file_tag}-{prefix}{index:06d}", location, split=split))
        except RowProblem as problem:
            yield Malformed(location, str(problem), dump_raw(dialogue))


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    if path.suffix == ".json":
        return _read_dialogues(path, file_tag)
    return _read_pairs(path)
