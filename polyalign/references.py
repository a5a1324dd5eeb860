"""Per-bucket human support statistics (METHOD.md section 5) and the support distance they define.

References are built from the human responses of the train split only; buckets with fewer than
`min_bucket_size` responses get none.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from polyalign.features import FEATURE_NAMES, FEATURE_SET

QUANTILES = {"q10": 0.10, "q25": 0.25, "q50": 0.50, "q75": 0.75, "q90": 0.90}


def nearest_rank(sorted_values: Sequence[float], p: float) -> float:
    """sorted[round((n - 1) p)] with Python's round-half-to-even."""
    return sorted_values[round((len(sorted_values) - 1) * p)]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """count, min, max, mean, population std and the nearest-rank quantiles of one feature."""
    ordered = sorted(values)
    array = np.asarray(ordered, dtype=np.float64)
    summary = {
        "count": len(ordered),
        "min": float(array[0]),
        "max": float(array[-1]),
        "mean": round(float(array.mean()), 6),
        "std": round(float(array.std()), 6),
    }
    summary.update({name: float(nearest_rank(ordered, p)) for name, p in QUANTILES.items()})
    return summary


def build_references(
    rows: Iterable[tuple[str, Mapping[str, float]]],
    min_bucket_size: int = 20,
    feature_names: Sequence[str] = FEATURE_NAMES,
) -> dict[str, Any]:
    """References from (bucket_id, features) pairs of train human responses."""
    by_bucket: dict[str, list[Mapping[str, float]]] = defaultdict(list)
    for bucket, features in rows:
        by_bucket[bucket].append(features)
    buckets, skipped = {}, {}
    for bucket in sorted(by_bucket):
        members = by_bucket[bucket]
        if len(members) < min_bucket_size:
            skipped[bucket] = len(members)
            continue
        buckets[bucket] = {
            "count": len(members),
            "features": {name: summarize([m[name] for m in members]) for name in feature_names},
        }
    return {
        "feature_set": FEATURE_SET,
        "split": "train",
        "min_bucket_size": min_bucket_size,
        "features": list(feature_names),
        "buckets": buckets,
        "skipped_buckets": skipped,
    }


def support_distance(features: Mapping[str, float], reference: Mapping[str, Any],
                     feature_names: Sequence[str] | None = None, skip_constant: bool = False) -> float:
    """d(x, b) = mean over features of max(0, q10 - x, x - q90) / max(q90 - q10, std, 1e-6).
    0 means every feature lies inside the bucket's human q10-q90 band.

    With skip_constant, features whose human values never vary in the bucket are left out: any
    deviation from a constant is divided by 1e-6, and a handful of such features (v1 has constant
    POS, stopword and sentiment features) would swamp the distance.
    """
    stats = reference["features"]
    names = feature_names if feature_names is not None else list(stats)
    if skip_constant:
        names = [n for n in names if stats[n]["std"] > 1e-12] or names
    total = 0.0
    for name in names:
        s = stats[name]
        scale = max(s["q90"] - s["q10"], s["std"], 1e-6)
        x = features[name]
        total += max(0.0, s["q10"] - x, x - s["q90"]) / scale
    return total / len(names)
