"""Scores on [0, 1] and how the evaluation's aggregate combines them: evaluate computes each part,
and a comparison of several evaluations combines only the parts every one of them measured."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

# The aggregate's parts, each on [0, 1] with higher better: clip(F1), 1/(1 + BNG macro), clip(MAUVE),
# clip(NUF hypervolume).
AGGREGATE_PARTS = ("f1", "bng", "mauve", "nuf")
# A bucket with fewer test rows gets no interval and no gap of its own (a bootstrap over one or two answers
# has (near) zero width, and one answer against its floor is a draw, not a gap), so a comparison cannot
# judge the macros it counts in: evaluate's IntervalOptions.min_rows, and what stats and build warn of.
MIN_INTERVAL_ROWS = 5


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


def rounded_outward(values: Sequence[float], digits: int) -> tuple[float, float]:
    """(low, high) rounded outward (low down, high up) to `digits` places, so that the interval holds every value
    the computed one holds: rounded to the nearest, a point 0.9999 read as outside its `[1.000, 1.000]`."""
    scale = 10 ** digits
    # the 1e-9 keeps a value already on the grid there (0.025 * 1000 is 25.000000000000004)
    return math.floor(values[0] * scale + 1e-9) / scale, math.ceil(values[1] * scale - 1e-9) / scale


def interval_text(values: Sequence[float], digits: int = 3) -> str:
    """`[low, high]` rounded outward (rounded_outward)."""
    low, high = rounded_outward(values, digits)
    return f"[{low:.{digits}f}, {high:.{digits}f}]"
