"""Prediction files: JSONL rows {id, prediction, ...} as `polyalign generate` writes them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.core import jsonl
from polyalign.core.outputs import read_record
from polyalign.core.paths import file_digest
from polyalign.data.records import InputError


def iter_predictions(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) for every non-blank line; a line that is not JSON, or a row without string
    id and prediction, is an error naming the file and line."""
    try:
        for number, row in jsonl.read_lines(path, "predictions file"):
            if isinstance(row, list):  # a JSON array of rows (one written whole with json.dump)
                raise InputError(f"{path}:{number}: {JSON_ARRAY}")
            if not isinstance(row, dict):
                raise InputError(f"{path}:{number}: a prediction row is an object with string fields id and "
                                 f"prediction (this one is a {type(row).__name__})")
            absent = [key for key in ("id", "prediction") if key not in row]
            if absent:
                raise InputError(f"{path}:{number}: a prediction row needs string fields id and prediction (it has "
                                 f"{', '.join(map(str, row)) or 'no keys'})")
            for key in ("id", "prediction"):
                if not isinstance(row[key], str):  # a number id ("7" is the record's), null, a message object
                    shown = json.dumps(row[key], ensure_ascii=False)
                    shown = shown if len(shown) <= 60 else shown[:57] + "..."
                    hint = (f' (write it as "{row[key]}")' if key == "id" and isinstance(row[key], int)
                            and not isinstance(row[key], bool) else
                            " (the answer's text goes there, not a message)" if isinstance(row[key], dict) else "")
                    raise InputError(f"{path}:{number}: {key} is {shown}, not a string{hint}")
            yield number, row
    except jsonl.JsonProblem as problem:
        if problem.line is None:  # the file itself: missing, a folder, compressed, not UTF-8/16 text
            raise InputError(str(problem)) from None
        with open(path, encoding="utf-8", errors="replace") as handle:
            if handle.read(4096).lstrip().startswith("["):  # an array written over several lines (indent=...)
                raise InputError(f"{path}: {JSON_ARRAY}") from None
        raise InputError(f"not JSON: {problem}") from None


JSON_ARRAY = 'a JSON array; predictions are JSONL, one {"id", "prediction"} object a line'


def check_generated_from(predictions_path: Path, records_path: Path) -> None:
    """Predictions `polyalign generate` wrote record the digest of the records they answer; joined with
    records whose contents differ (prepare ran again, or another split), the ids could still match and
    every metric would be silently wrong. Predictions from elsewhere (an external engine) carry no
    record and are joined by id alone."""
    record = read_record(predictions_path)
    made_from = record.get("made_from", {}) if record else {}
    digest = made_from.get("records") if isinstance(made_from, dict) else None
    if digest and digest != file_digest(records_path):
        source = record.get("settings", {}).get("records", "other records")
        raise InputError(f"{predictions_path}: generated from {source} with other contents than {records_path} "
                         "has now (prepare ran again, or another split?); run `polyalign generate` on "
                         f"{records_path} again")
