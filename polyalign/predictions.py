"""Prediction files: JSONL rows {id, prediction, ...} as `polyalign generate` writes them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.records import InputError


def iter_predictions(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) for every non-blank line; a line that is not JSON, or a row without string
    id and prediction, is an error naming the file and line."""
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get("prediction"), str):
                raise InputError(f"{path}:{number}: a prediction row needs string fields id and prediction")
            yield number, row
