"""Where a benchmark leaves its machine-readable result: OUT/NAME.json when OUT is set (the folder is made
first); its table goes to stdout either way."""

import json
import os
from pathlib import Path


def write_result(name: str, result) -> Path | None:
    """OUT/NAME.json holding `result`, or None when OUT is unset."""
    if not os.environ.get("OUT"):
        return None
    path = Path(os.environ["OUT"]) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
