"""Deterministic hash splits and group protection (METHOD.md section 3)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from polyalign.data.records import SPLIT_PRIORITY, SPLITS

DEFAULT_SPLIT_WEIGHTS = {"train": 0.9, "val": 0.05, "test": 0.05}


def split_value(key: str, seed: int) -> float:
    """A uniform value in [0, 1] from md5("{seed}:{key}"), identical on every machine and Python."""
    return int(hashlib.md5(f"{seed}:{key}".encode("utf-8")).hexdigest()[:8], 16) / 0xFFFFFFFF


def hash_split(key: str, seed: int = 42, weights: Mapping[str, float] = DEFAULT_SPLIT_WEIGHTS) -> str:
    """The split of a group key: walk the cumulative weights in train, val, test order."""
    total = sum(weights.values())
    value = split_value(key, seed)
    cumulative = 0.0
    for name in SPLITS:
        cumulative += weights.get(name, 0.0) / total
        if value < cumulative:
            return name
    return [name for name in SPLITS if weights.get(name, 0.0) > 0][-1]


def protected_splits(assignments: Iterable[tuple[str, str]]) -> dict[str, str]:
    """For (group, split) pairs, the split every member of a group must live in: the highest-priority
    one it appears in (test > val > train)."""
    best: dict[str, str] = {}
    for group, split in assignments:
        if group not in best or SPLIT_PRIORITY[split] < SPLIT_PRIORITY[best[group]]:
            best[group] = split
    return best
