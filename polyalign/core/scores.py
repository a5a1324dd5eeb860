"""Scores on [0, 1] and how the evaluation's aggregate combines them: evaluate computes each part,
and a comparison of several evaluations combines only the parts every one of them measured."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

# The aggregate's parts, each on [0, 1] with higher better: clip(F1), 1/(1 + BNG macro), clip(MAUVE),
# clip(NUF hypervolume).
AGGREGATE_PARTS = ("f1", "bng", "mauve", "nuf")


def geometric_mean(values: Sequence[float]) -> float:
    if any(v <= 0 for v in values):
        return 0.0
    return float(math.exp(sum(math.log(v) for v in values) / len(values)))


def clip01(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else min(max(value, 0.0), 1.0)


def combined(parts: Mapping[str, float | None], over: Sequence[str] = AGGREGATE_PARTS) -> float | None:
    """The geometric mean of the measured parts among `over`; None with fewer than two."""
    values = [parts[name] for name in over if parts.get(name) is not None]
    return geometric_mean(values) if len(values) >= 2 else None
