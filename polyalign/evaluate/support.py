"""What a model's answers in one bucket are measured against in the default evaluation mode: the human
support of the bucket (its held-out human answers, or its parent group's when it has too few), the
human floor (what held-out human answers score at the same sample size) and bootstrap intervals.

BNG is read against its floor: a W1 distance between two finite samples is positive even when both come
from the same people, and that part shrinks as the sample grows, so BNG - floor (the *gap*) is what
compares across buckets and sample sizes. HCR here is calibrated: a response counts as human-like when
the share of informative features inside the human q10-q90 band is at least what `coverage` of human
answers reach, so held-out humans land near `coverage` by construction and a model below it is
measurably less human-like. docs/EVALUATION.md gives the reasoning and the numbers.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import rankdata

from polyalign.core.scores import MIN_INTERVAL_ROWS
from polyalign.core.wording import counted
from polyalign.data.bucketing import parent_groups


@dataclass(frozen=True)
class IntervalOptions:
    draws: int = 200  # bootstrap draws over a bucket's responses
    floor_repeats: int = 50  # held-out human halves drawn for the floor
    seed: int = 0
    level: float = 0.95  # the central interval reported
    coverage: float = 0.9  # calibrated HCR: the share of human answers that pass, by construction
    near_constant: float = 0.95  # a feature whose most common value covers this share of humans says little
    max_rank_correlation: float = 0.95  # of two features this rank-correlated in the humans, keep the first
    min_rows: int = MIN_INTERVAL_ROWS  # fewer test rows: no interval and no gap of the bucket's own


# The feature that tells an answer without a word (words, digit runs, CJK characters: features/response.py).
WORDS_FEATURE = "word_token_count"


def signed_w1(values: np.ndarray, masses: np.ndarray) -> np.ndarray:
    """W1 between P and Q that put their mass on the same points `values` (n,), for every row of
    `masses` (D, n) = p - q at once: the integral of |F_P - F_Q|, as scipy.stats.wasserstein_distance
    computes it. One sort serves the point estimate, every bootstrap draw and every floor repeat."""
    order = np.argsort(values, kind="stable")
    gaps = np.diff(values[order])
    cdf_gap = np.cumsum(masses[:, order], axis=1)[:, :-1]
    return np.abs(cdf_gap) @ gaps


def informative_features(values: np.ndarray, near_constant: float, max_rank_correlation: float) -> list[int]:
    """Rows of `values` (features x human answers) worth measuring: not near-constant in the humans
    (the most common value under `near_constant` of them), and not a near-duplicate of an earlier kept
    feature (|Spearman rho| under `max_rank_correlation`). With all 134 features, a response must sit
    inside ~130 bands at once and correlated features count the same trait many times over."""
    n = values.shape[1]
    candidates = []
    for f, row in enumerate(values):
        _, counts = np.unique(row, return_counts=True)
        if counts.max() < near_constant * n:
            candidates.append(f)
    if len(candidates) < 2:
        return candidates
    ranks = rankdata(values[candidates], axis=1)
    correlation = np.abs(np.corrcoef(ranks))
    kept: list[int] = []
    for i in range(len(candidates)):
        if all(correlation[i, j] < max_rank_correlation for j in kept):
            kept.append(i)
    return [candidates[i] for i in kept]


@dataclass(frozen=True)
class Support:
    """The human answers one bucket is measured against, on the features chosen for it."""

    values: np.ndarray  # (features, human answers)
    indices: tuple[int, ...]  # the chosen features' rows in the full feature table
    features: tuple[str, ...]
    low: np.ndarray  # per-feature band
    high: np.ndarray
    threshold: float  # calibrated HCR: the inside share `coverage` of these humans reach
    pool: str  # the bucket itself, or the parent group whose answers stand in for it
    own: tuple[int, ...]  # the bucket's own answers among the pool's (all of them unless backed off)
    bands: str  # "references" (train split) or "pool" (these answers' own q10-q90)
    # the full table's row of WORDS_FEATURE, where people in the pool never answer without a word: a
    # wordless answer (empty, or punctuation only) is then never human-like, whatever its other features
    wordless_unlike_people: int | None = None

    @property
    def scale(self) -> np.ndarray:
        std = self.values.std(axis=1)
        return np.where(std > 1e-12, std, 1.0)

    def inside_share(self, values: np.ndarray) -> np.ndarray:
        """Per response (columns of `values`), the share of features inside their band."""
        return ((values >= self.low[:, None]) & (values <= self.high[:, None])).mean(axis=0)

    def could_be_people(self, table: np.ndarray) -> np.ndarray:
        """Per response (columns of `table`, every feature), whether it may count as human-like at all: an
        answer without a word, where no person in the pool gave one, may not. Bands read an empty answer
        kindly (a count of 0 sits inside many of them): in a pool of mixed lengths an empty reply passed
        calibrated HCR while people never reply with nothing."""
        if self.wordless_unlike_people is None:
            return np.ones(table.shape[1], bool)
        return table[self.wordless_unlike_people] > 0


def nearest_rank_band(values: np.ndarray, low: float = 0.1, high: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """q10 and q90 of each row by nearest rank, as the references compute them."""
    ordered = np.sort(values, axis=1)
    n = values.shape[1]
    return ordered[:, round((n - 1) * low)], ordered[:, round((n - 1) * high)]


def calibrated_threshold(shares: np.ndarray, coverage: float) -> float:
    """The inside share that `coverage` of these answers reach (a value some answer attains)."""
    return float(np.quantile(shares, 1.0 - coverage, method="lower"))


def make_support(values: np.ndarray, names: Sequence[str], pool: str, own: Sequence[int], reference: Mapping | None,
                 options: IntervalOptions) -> Support:
    """The support of a bucket from its human pool `values` (all features x answers): informative
    features, bands from the bucket's train references where it has them (else the pool's own), and
    the calibrated HCR threshold."""
    words = list(names).index(WORDS_FEATURE) if WORDS_FEATURE in names else None
    wordless_unlike_people = words if words is not None and bool((values[words] > 0).all()) else None
    chosen = informative_features(values, options.near_constant, options.max_rank_correlation)
    values = values[chosen]
    features = tuple(names[f] for f in chosen)
    if reference is not None and all(f in reference["features"] for f in features):
        low = np.array([reference["features"][f]["q10"] for f in features], float)
        high = np.array([reference["features"][f]["q90"] for f in features], float)
        bands = "references"
    else:
        low, high = nearest_rank_band(values)
        bands = "pool"
    support = Support(values, tuple(chosen), features, low, high, 0.0, pool, tuple(own), bands, wordless_unlike_people)
    threshold = calibrated_threshold(support.inside_share(values), options.coverage) if features else 0.0
    return dataclasses.replace(support, threshold=threshold)


def feature_distances(support: Support, generated: np.ndarray, masses: np.ndarray) -> np.ndarray:
    """W1 / human std per chosen feature (rows) of weighted generated samples (columns): `generated`
    holds the chosen features' values (features, n_g) and each row of `masses` (D, n_g) sums to 1 over
    the generated answers; the human pool keeps equal weights. BNG is the mean over features."""
    n_h = support.values.shape[1]
    signed = np.concatenate([masses, np.full((masses.shape[0], n_h), -1.0 / n_h)], axis=1)
    return np.stack([signed_w1(np.concatenate([generated[f], support.values[f]]), signed) / scale
                     for f, scale in enumerate(support.scale)])


def leave_one_out(support: Support, generated: np.ndarray, chunk: int = 256) -> tuple[int, float] | None:
    """The answer (a column of `generated`: the chosen features x n answers) whose removal lowers the
    bucket's BNG most, and the BNG without it; None for fewer than two answers. W1 weighs an answer by
    1/n however far it lies, so in a small bucket one runaway answer (8,000 characters where people
    write 80) can make the whole bucket's BNG, and with it the macro. Rows of the leave-one-out masses
    are evaluated `chunk` at a time: the masses are (n, n + people)."""
    n = generated.shape[1]
    if n < 2 or not support.features:
        return None
    without = np.empty(n)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        masses = np.full((stop - start, n), 1.0 / (n - 1))
        masses[np.arange(stop - start), np.arange(start, stop)] = 0.0
        without[start:stop] = feature_distances(support, generated, masses).mean(axis=0)
    row = int(np.argmin(without))
    return row, float(without[row])


def interval(draws: np.ndarray, level: float, estimate: float | None = None) -> list[float]:
    """The central `level` interval of the draws. Given the estimate, the interval is moved by the
    bootstrap's own bias (median of the draws - estimate): resampling with replacement duplicates
    responses, which inflates a distance such as W1, so uncorrected percentiles of BNG can miss the
    estimate itself."""
    tail = (1.0 - level) / 2
    shift = 0.0 if estimate is None else float(np.median(draws)) - estimate
    return [float(np.quantile(draws, tail)) - shift, float(np.quantile(draws, 1.0 - tail)) - shift]


def bootstrap_counts(n: int, options: IntervalOptions, rng: np.random.Generator) -> np.ndarray:
    """(draws, n) multinomial counts: each row resamples the n responses with replacement."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=options.draws).astype(float)


def human_floor(support: Support, n: int, options: IntervalOptions, rng: np.random.Generator) -> dict:
    """BNG and calibrated HCR of held-out human answers of the bucket itself. Each repeat holds out
    k = min(n, pool / 2) of the bucket's own answers in the pool (all of them when the bucket backed
    off to a larger parent pool) and measures them against the rest, HCR's threshold from the rest
    too. A W1 between samples of m1 and m2 points from one distribution grows as sqrt(1/m1 + 1/m2),
    so the BNG floor is rescaled from (k vs rest) to (n responses vs the whole pool): the BNG that n
    human answers would get in the model's place."""
    n_h = support.values.shape[1]
    own = np.asarray(support.own)
    k = min(n, len(own), n_h // 2)
    if k < 1 or not support.features:
        return {"bng": None, "bng_interval": None, "hcr": None, "hcr_interval": None, "k": k}
    repeats = options.floor_repeats if k < len(own) else 1  # holding out all of them has one outcome
    held = np.zeros((repeats, n_h), bool)
    for r in range(repeats):
        held[r, rng.choice(own, size=k, replace=False)] = True
    masses = held / k - ~held / (n_h - k)
    bng = np.mean([signed_w1(support.values[f], masses) / scale for f, scale in enumerate(support.scale)], axis=0)
    bng *= math.sqrt((1 / n + 1 / n_h) / (1 / k + 1 / (n_h - k)))
    shares = support.inside_share(support.values)
    hcr = np.array([(shares[mask] >= calibrated_threshold(shares[~mask], options.coverage)).mean() for mask in held])
    return {"bng": float(bng.mean()), "bng_interval": interval(bng, options.level),
            "hcr": float(hcr.mean()), "hcr_interval": interval(hcr, options.level), "k": k,
            "draws": {"bng": bng, "hcr": hcr}}


def choose_pools(buckets: Sequence[str], support_rows: Mapping[str, Sequence[int]],
                 min_rows: int) -> dict[str, tuple[str, list[int]]]:
    """For every bucket, the rows of the human support (`support_rows`, by bucket) that stand for it:
    its own when it has at least `min_rows`, else those of its nearest parent group
    (bucketing.parent_groups: language|track|family, then language|track, then language) that has, else
    all rows. Nothing disappears from the
    report for being small."""
    groups: dict[str, list[int]] = {}
    for bucket, rows in support_rows.items():
        for group in parent_groups(bucket):
            groups.setdefault(group, []).extend(rows)
    everything = sorted(i for rows in support_rows.values() for i in rows)
    pools = {}
    for bucket in sorted(buckets):
        rows = support_rows.get(bucket, [])
        if len(rows) >= min_rows:
            pools[bucket] = (bucket, list(rows))
            continue
        pools[bucket] = ("all", everything)
        for group in parent_groups(bucket):
            if len(groups.get(group, [])) >= min_rows:
                pools[bucket] = (group, sorted(groups[group]))
                break
    return pools


@dataclass(frozen=True)
class Resamples:
    """One set of answers' bootstrap draws, for the intervals of the numbers that combine buckets or
    metrics (TDM's macro, the frontier's hypervolume, the aggregate). Draw d resamples every bucket at
    once, each bucket from its own stream, and a combined number is computed draw by draw on that one
    stratified resample, so that its parts move together as they would in another test sample."""

    weights: np.ndarray  # (draws, test rows): how often draw d takes each row
    f1: Mapping[str, np.ndarray]  # bucket -> (draws,) its mean F1
    bng: Mapping[str, np.ndarray]  # bucket -> (draws,) its BNG (NaN where it has no feature to measure)
    rows: Mapping[str, int]  # bucket -> its test rows


def _bucket_rng(seed: int, bucket: str) -> np.random.Generator:
    """Each bucket draws from its own stream: its intervals do not change when other buckets come or go."""
    return np.random.default_rng([seed, zlib.crc32(bucket.encode("utf-8"))])


def _measure_sample(support: Support, generated: np.ndarray, f1: np.ndarray, options: IntervalOptions,
                    rng: np.random.Generator, one_answer: bool = False) -> tuple[dict, dict[str, np.ndarray]]:
    """BNG, calibrated HCR and F1 of one bucket's responses (`generated`: all features x responses)
    with bootstrap intervals over the responses, and the draws themselves; with `one_answer`, the answer
    that moves BNG most (`leave_one_out`: `bng_without_one`, its column and the BNG without it)."""
    n = generated.shape[1]
    counts = bootstrap_counts(n, options, rng)
    masses = np.concatenate([np.full((1, n), 1.0 / n), counts / n])
    f1_draws = masses @ f1
    report = {"f1": float(f1_draws[0]), "f1_interval": interval(f1_draws[1:], options.level, f1_draws[0])}
    if not support.features:  # every feature constant in the pool: nothing to measure
        nothing = np.full(options.draws, np.nan)
        return report | {"bng": None, "hcr": None}, {"bng": nothing, "hcr": nothing, "f1": f1_draws[1:],
                                                     "counts": counts}
    chosen = generated[list(support.indices)]
    distances = feature_distances(support, chosen, masses)
    bng = distances.mean(axis=0)
    shares = support.inside_share(chosen)
    possible = support.could_be_people(generated)
    hcr = masses @ ((shares >= support.threshold) & possible).astype(float)
    farthest = np.argsort(-distances[:, 0])[:3]
    report |= {
        "bng": float(bng[0]), "bng_interval": interval(bng[1:], options.level, bng[0]),
        "hcr": float(hcr[0]), "hcr_interval": interval(hcr[1:], options.level, hcr[0]),
        "hcr_strict": float(((shares == 1.0) & possible).mean()), "feature_inside": float(shares.mean()),
        "farthest_features": {support.features[f]: round(float(distances[f, 0]), 4) for f in farthest},
    }
    if one_answer and (found := leave_one_out(support, chosen)) is not None:
        report["bng_without_one"] = {"column": found[0], "bng": found[1]}
    return report, {"bng": bng[1:], "hcr": hcr[1:], "f1": f1_draws[1:], "counts": counts}


# One bucket's human floor: its BNG, HCR and their intervals, and its draws (None: one outcome only).
Floor = tuple[dict[str, Any], dict[str, np.ndarray] | None]


def bucket_floor(bucket: str, support: Support, rows: int, options: IntervalOptions,
                 human: np.ndarray | None = None) -> Floor:
    """The human floor of a bucket of `rows` answers. With `human` (features x rows), the human answers to
    the same prompts, when the support is a separate set of human answers (the train split), the floor is
    those answers measured exactly as the model's; without, the support is these human answers themselves
    and the floor comes from held-out halves of them (`human_floor`). It draws from a stream of its own,
    so it is the same beside any answers to these prompts."""
    if human is not None:
        floor, floor_draws = _measure_sample(support, human, np.zeros(human.shape[1]), options,
                                             _bucket_rng(options.seed + 1, bucket))
        return {k: floor[k] for k in ("bng", "bng_interval", "hcr", "hcr_interval")}, floor_draws
    floor = human_floor(support, rows, options, _bucket_rng(options.seed + 1, bucket))
    return floor, floor.pop("draws", None)


def human_floors(bucket_rows: Mapping[str, Sequence[int]], supports: Mapping[str, Support], options: IntervalOptions,
                 human: np.ndarray | None = None) -> dict[str, Floor]:
    """Every measured bucket's floor (`bucket_floor`; none where every feature of the pool is constant):
    what `measure` reads beside each set of answers to these prompts, the model's and the no-model ones."""
    return {bucket: bucket_floor(bucket, supports[bucket], len(rows), options,
                                 None if human is None else human[:, list(rows)])
            for bucket, rows in sorted(bucket_rows.items()) if supports[bucket].features}


def measure_bucket(bucket: str, support: Support, generated: np.ndarray, f1: np.ndarray, options: IntervalOptions,
                   human: np.ndarray | None = None, one_answer: bool = False,
                   floor: Floor | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """One bucket's BNG, calibrated HCR and F1 with bootstrap intervals, beside the human floor, and the
    bootstrap draws (macro averages combine them draw by draw). `generated` holds all features (rows)
    of the bucket's responses (columns); `human`: as `bucket_floor` takes it. `floor`: the bucket's floor
    already measured (`human_floors`), else measured here."""
    rng = _bucket_rng(options.seed, bucket)
    report, draws = _measure_sample(support, generated, f1, options, rng, one_answer)
    report = {"rows": generated.shape[1], "pool": support.pool, "pool_rows": int(support.values.shape[1]),
              "backed_off": support.pool != bucket, "bands": support.bands, "features": len(support.features)} | report
    if report["bng"] is None:
        return report, draws
    floor, floor_draws = floor or bucket_floor(bucket, support, generated.shape[1], options, human)
    if floor_draws is not None:  # the floor's bootstrap draws (or held-out repeats), for the macro's interval
        draws = {**draws, "bng_floor": floor_draws["bng"], "hcr_floor": floor_draws["hcr"]}
    report |= {"bng_floor": floor["bng"], "bng_floor_interval": floor["bng_interval"],
               "bng_gap": None if floor["bng"] is None else report["bng"] - floor["bng"],
               "hcr_floor": floor["hcr"], "hcr_floor_interval": floor["hcr_interval"]}
    if report["rows"] < options.min_rows:
        report |= {key: None for key in ("bng_interval", "hcr_interval", "f1_interval", "bng_floor_interval",
                                         "hcr_floor_interval", "bng_gap")}
        report["too_small"] = (f"{counted(report['rows'], 'test row')}, fewer than "
                               f"{options.min_rows}: no interval or gap")
    # HCR counts answers inside people's bands, so answers that all sit at the typical values (an LLM's
    # mode-seeking style, one answer repeated) pass more often than people themselves: above the floor
    # is too uniform, not more human. BNG sees the missing spread; this flag says which buckets to read so.
    report["hcr_above_people"] = bool(report.get("hcr_interval") and report.get("hcr_floor_interval")
                                      and report["hcr_interval"][0] > report["hcr_floor_interval"][1])
    return report, draws


def summarize(by_bucket: Mapping[str, dict], draws: Mapping[str, Mapping[str, np.ndarray]],
              options: IntervalOptions) -> dict:
    """Macro (every bucket counts once) and row-weighted averages with their intervals, the floors'
    macro and the gap, and what they cover."""
    summary = {}
    for metric in ("bng", "hcr", "f1"):
        measured = [b for b, r in by_bucket.items() if r.get(metric) is not None]
        if not measured:
            summary[metric] = {"macro": None, "weighted": None, "buckets": 0, "rows": 0}
            continue
        rows = np.array([by_bucket[b]["rows"] for b in measured], float)
        values = np.array([by_bucket[b][metric] for b in measured])
        stacked = np.stack([draws[b][metric] for b in measured])
        macro, weighted = float(values.mean()), float(values @ rows / rows.sum())
        entry = {"macro": macro, "macro_interval": interval(stacked.mean(axis=0), options.level, macro),
                 "weighted": weighted,
                 "weighted_interval": interval(rows @ stacked / rows.sum(), options.level, weighted),
                 "buckets": len(measured), "rows": int(rows.sum()),
                 "small_buckets": sorted(b for b in measured if by_bucket[b]["rows"] < options.min_rows),
                 "backed_off": sorted(b for b in measured if by_bucket[b]["backed_off"])}
        floors = [by_bucket[b].get(f"{metric}_floor") for b in measured]
        if metric != "f1" and all(f is not None for f in floors):
            entry["floor_macro"] = float(np.mean(floors))
            floor_draws = _floor_draws([draws[b].get(f"{metric}_floor") for b in measured])
            if floor_draws is not None:
                entry["floor_macro_interval"] = interval(floor_draws.mean(axis=0), options.level, entry["floor_macro"])
            if metric == "bng":
                entry["gap_macro"] = entry["macro"] - entry["floor_macro"]
                entry["gap_macro_interval"] = _gap_interval(stacked.mean(axis=0), floor_draws, entry, options)
        summary[metric] = entry
    return summary


def _gap_interval(model_draws: np.ndarray, floor_draws: np.ndarray | None, entry: dict,
                  options: IntervalOptions) -> list[float]:
    """The interval of BNG macro - floor macro. The model's draws and the floor's are independent (the
    floor resamples people's answers, or holds out halves of them), so the gap's draws are the model's
    minus the floor's drawn beside them (resampled with replacement to as many, a seeded stream): both
    noises count. Where the floor has no draws (one held-out outcome), the floor is taken as it is."""
    if floor_draws is None:
        return [v - entry["floor_macro"] for v in entry["macro_interval"]]
    floor_macro = floor_draws.mean(axis=0)
    if len(floor_macro) != len(model_draws):
        floor_macro = np.random.default_rng([options.seed, 2]).choice(floor_macro, size=len(model_draws))
    return interval(model_draws - floor_macro, options.level, entry["gap_macro"])


def _floor_draws(per_bucket: Sequence[np.ndarray | None]) -> np.ndarray | None:
    """The buckets' floor draws stacked [buckets, draws]: bootstrap draws against a separate support, or
    held-out repeats without one. None where a bucket has none, or one outcome only (every answer held
    out, a bucket backed off to a parent pool): a constant there would narrow the macro's interval
    exactly where a small bucket is least sure."""
    if any(d is None or len(d) < 2 for d in per_bucket) or len({len(d) for d in per_bucket}) != 1:
        return None
    return np.stack(per_bucket)


def measure(bucket_rows: Mapping[str, Sequence[int]], supports: Mapping[str, Support], generated: np.ndarray,
            f1: np.ndarray, options: IntervalOptions, human: np.ndarray | None = None,
            one_answer: bool = False, floors: Mapping[str, Floor] | None = None) -> dict:
    """Every bucket of one set of responses (`generated`: features x rows, `f1`: per row) and the
    averages over buckets; `human` (features x rows) when the supports are a separate human set. With
    `one_answer`, each bucket's `bng_without_one` names its row (an index of `generated`'s columns).
    `floors`: `human_floors` of the same rows, supports and human answers, measured once for several sets
    of answers; else each bucket's is measured here."""
    by_bucket, draws = {}, {}
    weights = np.zeros((options.draws, generated.shape[1]))
    for bucket, rows in sorted(bucket_rows.items()):
        rows = list(rows)
        by_bucket[bucket], draws[bucket] = measure_bucket(bucket, supports[bucket], generated[:, rows], f1[rows],
                                                          options, None if human is None else human[:, rows],
                                                          one_answer, (floors or {}).get(bucket))
        if (found := by_bucket[bucket].pop("bng_without_one", None)) is not None:
            by_bucket[bucket]["bng_without_one"] = {"row": rows[found["column"]], "bng": found["bng"]}
        weights[:, rows] = draws[bucket]["counts"]
    resamples = Resamples(weights, {b: d["f1"] for b, d in draws.items()}, {b: d["bng"] for b, d in draws.items()},
                          {b: r["rows"] for b, r in by_bucket.items()})
    return {"by_bucket": by_bucket, "summary": summarize(by_bucket, draws, options), "resamples": resamples}
