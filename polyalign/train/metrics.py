"""Training logs: OUT/metrics.jsonl (one JSON object per logged step) and TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax

from polyalign.paths import as_path


class MetricsWriter:
    """Writes on process 0 only; every other process gets a writer that does nothing."""

    def __init__(self, out: str | os.PathLike, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = as_path(out) / "metrics.jsonl"
        self._tb = None
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(as_path(out) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        if self._tb is not None:
            step = record["step"]
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}/"))
        else:
            out[name] = value
    return out


def read_metrics(out: str | os.PathLike) -> list[dict[str, Any]]:
    path = as_path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
