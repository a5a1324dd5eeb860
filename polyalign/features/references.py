"""Per-bucket human support statistics (METHOD section 5: docs/method.md) and the support distance they define.

References are built from the human responses of the train split only; buckets with fewer than
`min_bucket_size` responses get none.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyalign.core.errors import StatsError
from polyalign.core.paths import changed_since
from polyalign.features.response import FEATURE_NAMES, FEATURE_SET

QUANTILES = {"q10": 0.10, "q25": 0.25, "q50": 0.50, "q75": 0.75, "q90": 0.90}


def read_references(path: str | os.PathLike) -> dict[str, Any]:
    """RUN/stats/references.json (or a copy elsewhere), refused when the prepare it was made from has been
    replaced since (`polyalign prepare` ran again): its bands would describe other train answers."""
    path = Path(path)
    if not path.is_file():
        raise StatsError(f"{path}: bucket references missing; run `polyalign stats RUN`")
    references = json.loads(path.read_text(encoding="utf-8"))
    run = path.parent.parent if path.parent.name == "stats" else None  # a copy elsewhere cannot be checked
    for name in changed_since(run, references.get("made_from", {})) if run else ():
        raise StatsError(f"{path}: made from another {name} than the one there now (`polyalign prepare` ran "
                         f"again?); rerun `polyalign stats {run}`")
    return references


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
        rates = [per_token_rates(m) for m in members]
        buckets[bucket] = {
            "count": len(members),
            "features": {name: summarize([m[name] for m in members]) for name in feature_names},
            "rates": {name: summarize([r[name] for r in rates]) for name in feature_names if name in rates[0]},
        }
    return {
        "feature_set": FEATURE_SET,
        "split": "train",
        "min_bucket_size": min_bucket_size,
        "features": list(feature_names),
        "buckets": buckets,
        "skipped_buckets": skipped,
    }


# A response's length, and the features that grow with it. Measured in raw units, a long human answer lies
# "far" outside a band whose q90 is half its length on dozens of counts at once, so the support distance
# would punish length for its own sake (and reward a short answer). Per-token rates of the counts keep
# what a count says about style (how often a comma, a digit, a question mark), and the length is measured
# once, by its position in the bucket's own distribution (see support_distance).
LENGTH_FEATURE = "token_count"
COUNT_FEATURES = tuple(name for name in FEATURE_NAMES
                       if (name.endswith("_count") or name == "max_token_frequency") and name != LENGTH_FEATURE)
COUNTS = ("per_token", "raw")

# The knots of a reference's quantile function: (statistic, cumulative probability).
_KNOTS = (("min", 0.0), ("q10", 0.10), ("q25", 0.25), ("q50", 0.50), ("q75", 0.75), ("q90", 0.90), ("max", 1.0))
BAND = (0.10, 0.90)


def per_token_rates(features: Mapping[str, float]) -> dict[str, float]:
    """Each count feature divided by the response's token count (0 for an empty response); none when
    the features have no token count."""
    if LENGTH_FEATURE not in features:
        return {}
    tokens = features[LENGTH_FEATURE]
    return {name: features[name] / tokens if tokens else 0.0 for name in COUNT_FEATURES if name in features}


def quantile_position(x: float, stats: Mapping[str, float]) -> float:
    """Where x falls in a bucket's human distribution of one feature, in [0, 1]: the piecewise-linear
    interpolation of its quantile function through min, q10, q25, q50, q75, q90 and max. A value equal to
    tied knots (a plateau, e.g. most answers have no question mark) takes the middle of their probabilities."""
    values = [stats[name] for name, _ in _KNOTS]
    probabilities = [p for _, p in _KNOTS]
    left, right = bisect_left(values, x), bisect_right(values, x)
    if left < right:
        return (probabilities[left] + probabilities[right - 1]) / 2
    if left == 0:
        return 0.0
    if left == len(values):
        return 1.0
    x0, x1, p0, p1 = values[left - 1], values[left], probabilities[left - 1], probabilities[left]
    return p0 + (p1 - p0) * (x - x0) / (x1 - x0)


def _band_distance(x: float, s: Mapping[str, float]) -> float:
    return max(0.0, s["q10"] - x, x - s["q90"]) / max(s["q90"] - s["q10"], s["std"], 1e-6)


def support_distance(features: Mapping[str, float], reference: Mapping[str, Any],
                     feature_names: Sequence[str] | None = None, skip_constant: bool = False,
                     counts: str = "per_token") -> float:
    """d(x, b) = mean over features of how far x lies outside the bucket's human q10-q90 band; 0 means
    every feature lies inside it.

    A feature's distance (METHOD section 5): max(0, q10 - x, x - q90) / max(q90 - q10, std, 1e-6).
    With counts="per_token" (the default) the count features (COUNT_FEATURES) are taken as per-token
    rates against the bucket's human rates, and the length itself (token_count) by its position u in the
    bucket's human distribution (quantile_position): max(0, 0.1 - u, u - 0.9) / 0.8, the same band in
    probability instead of tokens, so an answer at the bucket's 95th percentile costs 0.0625 and one
    longer than every human answer 0.125, however long. counts="raw" is METHOD's formula on every feature,
    as the reference code computes it.

    With skip_constant, features whose human values never vary in the bucket are left out: any
    deviation from a constant is divided by 1e-6, and a handful of such features (v1 has constant
    POS, stopword and sentiment features) would swamp the distance.
    """
    if counts not in COUNTS:
        raise ValueError(f"counts must be one of {COUNTS}, not {counts!r}")
    stats = reference["features"]
    names = feature_names if feature_names is not None else list(stats)
    if counts == "per_token":
        if "rates" not in reference:
            raise ValueError("these references have no per-token rates (made before they existed): rerun "
                             "`polyalign stats RUN`, or measure counts raw")
        rates, stats = per_token_rates(features), {**stats, **reference["rates"]}
        features = {**features, **rates}
    if skip_constant:
        names = [n for n in names if stats[n]["std"] > 1e-12] or names
    low, high = BAND
    total = 0.0
    for name in names:
        if counts == "per_token" and name == LENGTH_FEATURE:
            u = quantile_position(features[name], stats[name])
            total += max(0.0, low - u, u - high) / (high - low)
        else:
            total += _band_distance(features[name], stats[name])
    return total / len(names)
