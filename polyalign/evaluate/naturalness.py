"""Naturalness of generations against the human responses of their bucket (METHOD section 9): BNG,
HCR, and the frontier and aggregate that combine them with utility."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.stats import wasserstein_distance

from polyalign.core.scores import clip01, geometric_mean
from polyalign.features.references import nearest_rank

MIN_BUCKET_ROWS = 20


def _scale(values: np.ndarray) -> float:
    std = float(values.std())
    return std if std > 1e-12 else 1.0


def usable_features(human: Mapping[str, np.ndarray], keep_constant: bool) -> list[str]:
    """All features (reference compatibility) or those that vary in the bucket's human responses."""
    return [f for f, v in human.items() if keep_constant or float(v.std()) > 1e-12]


def bucket_bng(human: Mapping[str, np.ndarray], generated: Mapping[str, np.ndarray], features: Sequence[str]) -> float:
    """Mean over features of W1(generated, human) / std(human); lower is more human-like."""
    if not features:
        return float("nan")
    return float(np.mean([wasserstein_distance(generated[f], human[f]) / _scale(human[f]) for f in features]))


def bucket_hcr(bands: Mapping[str, tuple[float, float]], generated: Mapping[str, np.ndarray],
               features: Sequence[str]) -> tuple[float, float]:
    """(share of generations with every feature inside its q10-q90 band, mean per-feature inside rate)."""
    if not features:
        return float("nan"), float("nan")
    inside = np.stack([(generated[f] >= bands[f][0]) & (generated[f] <= bands[f][1]) for f in features])
    return float(inside.all(axis=0).mean()), float(inside.mean())


def bands_from_values(human: Mapping[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    out = {}
    for f, v in human.items():
        ordered = sorted(float(x) for x in v)
        out[f] = (nearest_rank(ordered, 0.1), nearest_rank(ordered, 0.9))
    return out


def macro_and_weighted(values: Mapping[str, float], sizes: Mapping[str, int]) -> dict[str, float | None]:
    finite = {b: v for b, v in values.items() if v is not None and math.isfinite(v)}
    if not finite:
        return {"macro": None, "weighted": None}
    total = sum(sizes[b] for b in finite)
    return {"macro": float(np.mean(list(finite.values()))),
            "weighted": float(sum(v * sizes[b] for b, v in finite.items()) / total)}


def naturalness_score(bng: float | None, *others: float | None) -> float | None:
    """Geometric mean of 1/(1 + max(BNG, 0)) and the clipped other components that are available."""
    parts = [] if bng is None or not math.isfinite(bng) else [1.0 / (1.0 + max(bng, 0.0))]
    parts += [c for c in (clip01(o) for o in others) if c is not None]
    return geometric_mean(parts) if parts else None


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (utility, naturalness) sorted by utility descending, keeping those whose naturalness
    strictly rises; returned sorted by utility ascending."""
    frontier, best = [], -math.inf
    for u, n in sorted(points, key=lambda p: (-p[0], -p[1])):
        if n > best:
            frontier.append((u, n))
            best = n
    return sorted(frontier)


def hypervolume(frontier: Sequence[tuple[float, float]]) -> float:
    """Area dominated by the frontier against (0, 0): sum_k (U_k - U_{k-1}) N_k, U ascending."""
    area, previous = 0.0, 0.0
    for u, n in frontier:
        area += (u - previous) * n
        previous = u
    return area


def aggregate_parts(f1: float | None, bng_macro: float | None, mauve: float | None,
                    nuf_hypervolume: float | None) -> dict[str, float | None]:
    """The aggregate's parts (core/scores.py AGGREGATE_PARTS): clip(F1), 1/(1 + BNG macro), clip(MAUVE) and
    clip(NUF hypervolume), None where not measured."""
    return {"f1": clip01(f1), "bng": None if bng_macro is None else 1.0 / (1.0 + max(bng_macro, 0.0)),
            "mauve": clip01(mauve), "nuf": clip01(nuf_hypervolume)}
