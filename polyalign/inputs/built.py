"""What a run's build recorded (RUN/build/manifest.json), read without the build's own dependencies
(TensorFlow Datasets, JAX): for the config checks, `--print-config`, `plan` and a preference run's notes,
which only read its options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def built_manifest(data_dir) -> dict[str, Any] | None:
    """The build manifest of the run `data_dir` names, or None where it has none (yet) or it cannot be read:
    the run says why when it opens the build (inputs/build.py read_manifest)."""
    if data_dir is None:
        return None
    try:
        manifest = json.loads((Path(str(data_dir)) / "build" / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("options"), dict) else None
