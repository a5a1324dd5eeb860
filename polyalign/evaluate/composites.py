"""The numbers that combine buckets and metrics (METHOD section 9): the naturalness-utility frontier
(NUF) with its hypervolume, and the aggregate; with intervals from the same bootstrap draws as BNG's."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from polyalign.core.scores import clip01, combined
from polyalign.evaluate import naturalness as nat
from polyalign.evaluate.support import Resamples, interval


def frontier(f1: Mapping[str, float], bng: Mapping[str, float], mauve_by_bucket: Mapping[str, float],
             tdm_by_bucket: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The frontier of the buckets' (utility, naturalness) points: utility is the bucket's mean F1,
    naturalness the geometric mean of 1/(1+BNG) and, where measured, its C-MAUVE and (given
    `tdm_by_bucket`, for the multi-turn buckets only) its TDM."""
    points = {}
    for b in bng:
        if tdm_by_bucket is not None and b not in tdm_by_bucket:
            continue
        extra = [] if tdm_by_bucket is None else [tdm_by_bucket[b]]
        n = nat.naturalness_score(bng[b], mauve_by_bucket.get(b), *extra)
        if n is not None:
            points[b] = (clip01(f1[b]), n)
    front = nat.pareto_frontier(list(points.values()))
    return {"hypervolume": nat.hypervolume(front) if points else None, "frontier": front,
            "points": {b: {"utility": u, "naturalness": n} for b, (u, n) in points.items()}}


def frontiers(bng: Mapping[str, float], mauve_metrics: dict, tdm: dict, f1: Mapping[str, float],
              featurizer: Path | None) -> dict[str, Any]:
    """The frontier over all buckets and over the multi-turn ones (with TDM); `bng` and `f1` by bucket."""
    tdm_by_bucket = {b: r["tdm"] for b, r in tdm["by_bucket"].items()}
    return {"overall": frontier(f1, bng, mauve_metrics["by_bucket"]),
            "multi_turn": frontier(f1, bng, mauve_metrics["by_bucket"], tdm_by_bucket),
            "naturalness_components": ["1/(1+BNG)"] + (["C-MAUVE"] if featurizer else [])}


def combined_intervals(resamples: Resamples | None, bng: Mapping[str, float], tdm_draws: Mapping[str, np.ndarray],
                       mauve_metrics: dict, estimates: Mapping[str, float | None],
                       level: float) -> dict[str, list[float] | None]:
    """Intervals of TDM's macro, the overall frontier's hypervolume and the aggregate (`estimates` keyed
    tdm_macro, nuf_hypervolume, aggregate), each computed again on every bootstrap draw of `resamples`
    from the draw's F1, BNG and TDM of every bucket. MAUVE stays at its estimate: a MAUVE is a k-means
    clustering of the features, too costly to redo for every draw, so these intervals leave its own
    sampling error out. None where there is no estimate or no draws (--compat reference)."""
    out: dict[str, list[float] | None] = dict.fromkeys(estimates)
    if resamples is None:
        return out
    rows = resamples.rows
    f1_overall = sum(rows[b] * resamples.f1[b] for b in rows) / sum(rows.values())
    hypervolume, aggregate = [], []
    for d in range(len(resamples.weights)):
        bng_d = {b: float(resamples.bng[b][d]) for b in bng}
        hv = frontier({b: float(resamples.f1[b][d]) for b in bng}, bng_d, mauve_metrics["by_bucket"])["hypervolume"]
        parts = nat.aggregate_parts(float(f1_overall[d]), float(np.mean(list(bng_d.values()))) if bng_d else None,
                                    mauve_metrics["global"], hv)
        hypervolume.append(hv)
        aggregate.append(combined(parts))
    tdm_macro = list(np.mean(np.stack(list(tdm_draws.values())), axis=0)) if tdm_draws else []
    for key, draws in (("tdm_macro", tdm_macro), ("nuf_hypervolume", hypervolume), ("aggregate", aggregate)):
        estimate = estimates[key]
        if estimate is not None and draws and all(v is not None and np.isfinite(v) for v in draws):
            out[key] = interval(np.array(draws, float), level, estimate)
    return out


def aggregate_section(f1: float | None, bng_macro: float | None, mauve: float | None,
                      nuf_hypervolume: float | None) -> dict[str, Any]:
    """metrics.aggregate: the geometric mean of the measured parts, and the parts."""
    parts = nat.aggregate_parts(f1, bng_macro, mauve, nuf_hypervolume)
    return {"overall": combined(parts), "parts": parts}
