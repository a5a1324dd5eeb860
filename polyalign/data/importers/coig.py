"""COIG-CQIA JSONL: {instruction, input, output, task_type, domain, answer_from, human_verified, copyright}.

Only human-written answers are kept (answer_from `human` or `expert`); rows answered by an LLM, or
with no answer_from, are skipped and counted by reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers.reading import iter_json_lines, parse_rows, require_dict, text_field
from polyalign.data.records import Example, ImportItem, Location, Skipped

PATTERNS = ("*.jsonl",)
DEFAULTS = {"track": "single", "family": "assistant", "style": "assistant_like"}
HUMAN_SOURCES = ("human", "expert")


def _parse(row: Any, location: Location) -> Iterator[ImportItem]:
    row = require_dict(row)
    question = text_field(row, "instruction")
    context = text_field(row, "input", default="")
    response = text_field(row, "output", what="response 'output'")
    answer_from = row.get("answer_from")
    if answer_from not in HUMAN_SOURCES:
        yield Skipped(location, f"answer_not_human_written:{answer_from or 'unknown'}")
        return
    meta = {key: row[key] for key in ("task_type", "domain", "human_verified", "copyright", "answer_from")
            if key in row}
    yield Example(question=question, context=context, response=response, location=location, meta=meta)


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    return parse_rows(iter_json_lines(path), _parse)
