"""Prediction files: JSONL rows {id, prediction, ...} as `polyalign generate` writes them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign import jsonl
from polyalign.data.records import InputError


def iter_predictions(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) for every non-blank line; a line that is not JSON, or a row without string
    id and prediction, is an error naming the file and line."""
    try:
        for number, row in jsonl.read_lines(path):
            if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get("prediction"), str):
                raise InputError(f"{path}:{number}: a prediction row needs string fields id and prediction")
            yield number, row
    except jsonl.JsonProblem as problem:
        raise InputError(f"not JSON: {problem}") from None
