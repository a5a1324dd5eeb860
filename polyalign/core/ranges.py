"""The values a numeric setting admits: one Range for a config key (train.steps) and a command-line
option (--top-p) alike, so both are refused in the same words."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """An interval, open or closed at each end (None: unbounded), and null if `optional`. NaN and the
    infinities are never admitted. `why` is said after a refusal."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    why: str = ""

    def admits(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        def show(bound):
            return f"{bound:g}" if isinstance(bound, float) else str(bound)

        if self.high is None:
            text = f"{'above' if self.low_open else 'at least'} {show(self.low)}"
        elif self.low is None:
            text = f"{'below' if self.high_open else 'at most'} {show(self.high)}"
        else:
            text = (f"in {'(' if self.low_open else '['}{show(self.low)}, {show(self.high)}"
                    f"{')' if self.high_open else ']'}")
        return text + " or null" if self.optional else text

    def refusal(self, name: str, value: Any) -> str:
        """`name must be <range>, got <value> (why)`: the one line a value outside the range gets."""
        shown = f"{value:g}" if isinstance(value, float) and math.isfinite(value) else value
        return f"{name} must be {self}, got {shown}" + (f" ({self.why})" if self.why else "")


COUNT, POSITIVE, NON_NEGATIVE = Range(1), Range(0, low_open=True), Range(0)
PROBABILITY, FRACTION = Range(0, 1), Range(0, 1, high_open=True)
SEED = Range(0, 2**32 - 1)
