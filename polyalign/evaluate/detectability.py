"""Detectability: could a reader tell a model's answers from people's answers to the same prompts?

A two-sample classifier test per bucket. A linear classifier learns to separate the model's answers
(label 1) from the human answers to the same prompts (label 0), and its out-of-fold ROC AUC is the
number: 0.5 means it cannot tell them apart, 1.0 that it always can. The representation shares nothing
with the 134 response features behind BNG, HCR, the support distance and HDPO's critic, so training that
matches those features cannot move it by matching them alone:

- character n-grams (1-3, TF-IDF), which read English and Chinese alike without a tokenizer, or
- mean-pooled hidden states of a featurizer checkpoint (`--featurizer`), when one is given.

Folds are grouped by prompt: the classifier never sees either answer to a prompt it is scored on, so it
cannot win by recognising the prompt's topic. Every group holds one answer of each label, so every fold
is balanced. A bucket with fewer than MIN_PROMPTS prompts is classified within its nearest parent
group (language|track|family, then language|track, then language), and its AUC is read on its own rows'
out-of-fold scores.

The floor is the same test between people and people: one random half of the pool's human answers
against the other half, read on the bucket's rows, averaged over FLOOR_HALVINGS halvings (one halving's
floor moved from 0.31 to 0.60 with the seed on 102 rows; the spread over the halvings is reported). It
is not exactly 0.5: out-of-fold scores are biased against the held-out rows (a text seen with the other
label in training pulls its copies that way), so short, repetitive buckets land below 0.5 even for
people; a model is read against its floor, not against 0.5. The floor holds half as many prompts a side
as the model's test, so its interval is wider: it is the first halving's bootstrap, centred on the mean
of the halvings (the mean's own sampling spread is no wider). Intervals are percentile bootstraps over
prompts (both answers of a drawn prompt go together) of the out-of-fold scores; they carry the sampling
of prompts, not the refitting of the classifier.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import scipy.sparse
import sklearn
from sklearn.feature_extraction.text import HashingVectorizer, TfidfTransformer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from polyalign.evaluate.support import IntervalOptions, choose_pools, interval

MIN_PROMPTS = 20  # fewer prompts than this: the bucket is classified within its parent group
FOLDS = 5
FLOOR_HALVINGS = 8  # people-against-people halvings the floor is averaged over
CHAR_NGRAMS = "char_ngrams"
HIDDEN_STATES = "hidden_states"


def char_ngram_counts(texts: Sequence[str]) -> scipy.sparse.csr_matrix:
    """Counts of character 1-3-grams inside word boundaries (a Chinese run of characters is one
    'word'), hashed into 2^20 columns: learnt from nothing, so every text is read once and the folds
    share the reading without sharing anything they learn."""
    return HashingVectorizer(analyzer="char_wb", ngram_range=(1, 3), n_features=2**20, alternate_sign=False,
                             norm=None, dtype=np.float32).transform(texts)


def char_ngram_classifier() -> Pipeline:
    """TF-IDF (the IDF fitted on the training folds only) and an L2-regularised logistic regression."""
    return make_pipeline(TfidfTransformer(sublinear_tf=True), LogisticRegression(C=1.0, solver="liblinear"))


def hidden_state_classifier() -> Pipeline:
    return make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))


# A representation: how answers become rows of a matrix, and the classifier that reads those rows.
REPRESENTATIONS: dict[str, Callable[[], Pipeline]] = {CHAR_NGRAMS: char_ngram_classifier,
                                                      HIDDEN_STATES: hidden_state_classifier}

Matrix = np.ndarray | scipy.sparse.csr_matrix


def out_of_fold_scores(inputs: Matrix, labels: np.ndarray, groups: np.ndarray,
                       representation: str) -> np.ndarray | None:
    """Each row's decision score from a classifier fitted on the other folds (grouped: a group's rows
    share a fold). None when there are fewer than two groups. An evaluation fits thousands of these
    small classifiers (9 a pool, 5 folds each), so the folds are fitted here, not by cross_val_predict,
    and without scikit-learn's per-call checks of arguments fixed above: that bookkeeping was a third of
    detectability's time, and the scores are the same to the last bit (tests/test_detectability.py)."""
    folds = min(FOLDS, len(np.unique(groups)))
    if folds < 2:
        return None
    scores = np.empty(len(labels))
    with sklearn.config_context(skip_parameter_validation=True, assume_finite=True):
        for train, test in GroupKFold(n_splits=folds).split(inputs, labels, groups):
            classifier = REPRESENTATIONS[representation]().fit(inputs[train], labels[train])
            scores[test] = classifier.decision_function(inputs[test])
    return scores


def _take(inputs: Matrix, rows: Sequence[int]) -> Matrix:
    return inputs[np.asarray(rows, dtype=int)]


def _stack(first: Matrix, second: Matrix) -> Matrix:
    """Both sides in one matrix; hashed n-gram counts keep only the columns these rows use (a solver's
    cost grows with the columns, and 2^20 mostly empty ones cost it seconds a pool)."""
    if not scipy.sparse.issparse(first):
        return np.concatenate([first, second])
    both = scipy.sparse.vstack([first, second], format="csr")
    return both[:, np.unique(both.indices)]


def pair_scores(side0: Matrix, side1: Matrix, representation: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Out-of-fold scores of two equally long sets whose i-th rows belong together (the two answers to
    prompt i): row i of each side shares a group, so a fold holds both or neither."""
    n = side0.shape[0]
    groups = np.concatenate([np.arange(n), np.arange(n)])
    labels = np.concatenate([np.zeros(n, int), np.ones(n, int)])
    scores = out_of_fold_scores(_stack(side0, side1), labels, groups, representation)
    return None if scores is None else (scores[:n], scores[n:])


def _auc_with_draws(scores0: np.ndarray, scores1: np.ndarray, options: IntervalOptions,
                    rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """AUC of side 1 over side 0, where row i of each side is one prompt's pair, and bootstrap draws of
    it over prompts. A draw weighs prompt i by how often it was drawn (c_i, on both sides), so its AUC
    is the weighted Mann-Whitney statistic sum_j c_j (C(< s1_j) + C(= s1_j) / 2) / (sum c)^2, with C the
    draw's weight of side-0 scores below or equal to s1_j: the number roc_auc_score gives with those
    sample weights, for every draw at once from one sort (memory: draws x prompts)."""
    n = len(scores0)
    labels = np.concatenate([np.zeros(n, int), np.ones(n, int)])
    auc = float(roc_auc_score(labels, np.concatenate([scores0, scores1])))
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=options.draws).astype(float)
    order = np.argsort(scores0, kind="stable")
    below = np.concatenate([np.zeros((options.draws, 1)), np.cumsum(counts[:, order], axis=1)], axis=1)
    lower = below[:, np.searchsorted(scores0[order], scores1, side="left")]
    upper = below[:, np.searchsorted(scores0[order], scores1, side="right")]
    draws = (counts * (lower + (upper - lower) / 2)).sum(axis=1) / counts.sum(axis=1) ** 2
    return auc, draws


def _bucket_rng(seed: int, bucket: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(bucket.encode("utf-8")), 7])


def _floor_pairs(pool: str, rows_by_bucket: Mapping[str, Sequence[int]], seed: int, halving: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """People against people for one pool: within each of its buckets, the test rows of one seeded half
    (side 0) and of the other (side 1), paired in order (with an odd count, one row sits out). Halved
    bucket by bucket, so that both sides of a pool that mixes buckets (a parent group, "all") hold
    them in the same proportions: random halves of a mixed pool differ in language and length, which
    the classifier detects (floors of 0.8 on the quick demo's 48 rows). The test's own answers, not the
    train split's: a bucket's train and test answers can come from its sources in other proportions
    (AUC 0.56-0.61 on the demo data's large dialogue buckets), while the model answers exactly the
    test's prompts. `halving`: which of the FLOOR_HALVINGS draws."""
    rng = np.random.default_rng([seed, zlib.crc32(pool.encode("utf-8")), 11, halving])
    side0, side1 = [], []
    for _, rows in sorted(rows_by_bucket.items()):
        order = rng.permutation(np.asarray(rows, dtype=int))
        half = len(order) // 2
        side0.append(order[:half])
        side1.append(order[half:2 * half])
    return np.concatenate(side0), np.concatenate(side1)


def _pool_rows(bucket_rows: Mapping[str, Sequence[int]]) -> tuple[dict[str, tuple[str, list[int]]],
                                                                    dict[str, np.ndarray]]:
    """Each bucket's pool (choose_pools), and each pool's rows."""
    pools = choose_pools(list(bucket_rows), bucket_rows, MIN_PROMPTS)
    return pools, dict(sorted({p: np.asarray(r, dtype=int) for p, r in pools.values()}.items()))


# Each pool's people-against-people scores, one entry a halving.
FloorScores = dict[str, list["Scored | None"]]


def floor_scores(bucket_rows: Mapping[str, Sequence[int]], human: Matrix, options: IntervalOptions,
                 representation: str = CHAR_NGRAMS) -> FloorScores:
    """The classifiers of the floor: in each pool, FLOOR_HALVINGS halvings of people's answers told from
    each other. They depend on the prompts and people's answers only, so every set of answers to the same
    prompts is read against the same ones (`measure`'s `floor`)."""
    _, pool_rows = _pool_rows(bucket_rows)
    bucket_of = {row: bucket for bucket, rows in bucket_rows.items() for row in rows}
    scores = {}
    for pool, rows in pool_rows.items():
        members: dict[str, list[int]] = {}
        for row in rows:
            members.setdefault(bucket_of[row], []).append(row)
        scores[pool] = [_scored(*_floor_pairs(pool, members, options.seed, halving), human, human, representation)
                        for halving in range(FLOOR_HALVINGS)]
    return scores


def measure(bucket_rows: Mapping[str, Sequence[int]], human: Matrix, generated: Matrix, options: IntervalOptions,
            representation: str = CHAR_NGRAMS, floor: bool | FloorScores = True) -> dict[str, Any]:
    """Detectability of `generated` against `human` (row i of each, in `representation`'s matrix form,
    answers prompt i) in every bucket, the human floor beside it, and macro and row-weighted averages with
    intervals. `floor`: True measures the floor here; `floor_scores` of the same rows and human answers
    reads that one (measured once for several sets of answers); False, none (the no-model baselines share
    the model's floor)."""
    pools, pool_rows = _pool_rows(bucket_rows)
    model_scores = {pool: _scored(rows, rows, human, generated, representation) for pool, rows in pool_rows.items()}
    floor_scored: FloorScores = {}
    if floor is True:
        floor_scored = floor_scores(bucket_rows, human, options, representation)
    elif floor:
        floor_scored = floor
    by_bucket, draws = {}, {}
    for bucket, rows in sorted(bucket_rows.items()):
        pool = pools[bucket][0]
        report, draws[bucket] = _bucket(bucket, list(rows), pool, model_scores[pool], floor_scored.get(pool, []),
                                        options)
        by_bucket[bucket] = report
    return {"by_bucket": by_bucket, **summarize(by_bucket, draws, options)}


# One pool's pairs: the rows of side 0 and of side 1 (the same rows for the model against people) and
# their out-of-fold scores.
Scored = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _scored(rows0: np.ndarray, rows1: np.ndarray, side0: Matrix, side1: Matrix, representation: str) -> Scored | None:
    scores = pair_scores(_take(side0, rows0), _take(side1, rows1), representation)
    return None if scores is None else (rows0, rows1, *scores)


def _touching(scored: Scored, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The scores of the pairs that hold one of `rows` (a bucket's own prompts) on either side."""
    rows0, rows1, scores0, scores1 = scored
    held = np.isin(rows0, rows) | np.isin(rows1, rows)
    return scores0[held], scores1[held]


def _bucket(bucket: str, rows: list[int], pool: str, scored: Scored | None, floor_scored: Sequence[Scored | None],
            options: IntervalOptions) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    rng = _bucket_rng(options.seed, bucket)
    report: dict[str, Any] = {"rows": len(rows), "pool": pool, "backed_off": pool != bucket}
    nothing = np.full(options.draws, np.nan)
    halvings = np.full(len(floor_scored), np.nan)  # the floor of each halving (NaN: the bucket sat out of it)
    if scored is None:
        return report | {"auc": None, "reason": "fewer than two prompts, or no text to read"}, \
            {"auc": nothing, "floor": nothing, "floor_halvings": halvings}
    auc, auc_draws = _auc_with_draws(*_touching(scored, rows), options, rng)
    report |= {"auc": auc, "auc_interval": interval(auc_draws, options.level)}
    floor_draws = nothing
    first = None  # the first halving holding the bucket: its pairs
    for halving, one in enumerate(floor_scored):
        scores0, scores1 = _touching(one, rows) if one is not None else ((), ())
        if len(scores0):
            labels = np.repeat([0, 1], len(scores0))
            halvings[halving] = roc_auc_score(labels, np.concatenate([scores0, scores1]))
            first = first or (scores0, scores1)
    if first is not None:
        floor = float(np.nanmean(halvings))
        value, first_draws = _auc_with_draws(*first, options, rng)
        # the sampling spread of the prompts (one halving's bootstrap: the halvings share their rows), about the
        # mean, and how far the halving moves that mean (a random halving's distance from it, over the square
        # root of their number): one pair a halving has no bootstrap spread, but its halvings say 0 or 1
        held = halvings[np.isfinite(halvings)]
        split = (held[rng.integers(len(held), size=options.draws)] - floor) / np.sqrt(len(held))
        floor_draws = np.clip(first_draws - value + floor + split, 0.0, 1.0)  # an AUC, whatever the sum
        report |= {"auc_floor": floor, "auc_floor_interval": interval(floor_draws, options.level),
                   "auc_floor_spread": [float(np.nanmin(halvings)), float(np.nanmax(halvings))],
                   "floor_halvings": int(np.isfinite(halvings).sum()), "floor_pairs": len(first[0]),
                   "auc_gap": auc - floor}
    if len(rows) < options.min_rows:
        report |= {key: None for key in ("auc_interval", "auc_floor_interval", "auc_gap") if key in report}
        report["too_small"] = f"{len(rows)} test rows, fewer than {options.min_rows}: no interval or gap"
    return report, {"auc": auc_draws, "floor": floor_draws, "floor_halvings": halvings}


def summarize(by_bucket: Mapping[str, dict], draws: Mapping[str, Mapping[str, np.ndarray]],
              options: IntervalOptions) -> dict[str, Any]:
    """Macro (every bucket once) and row-weighted AUC with intervals (bootstrap draws combined draw by
    draw), and the floors' macro."""
    measured = [b for b, r in by_bucket.items() if r.get("auc") is not None]
    if not measured:
        return {"macro": None, "weighted": None, "buckets": 0, "rows": 0}
    rows = np.array([by_bucket[b]["rows"] for b in measured], float)
    values = np.array([by_bucket[b]["auc"] for b in measured])
    stacked = np.stack([draws[b]["auc"] for b in measured])
    macro, weighted = float(values.mean()), float(values @ rows / rows.sum())
    summary = {"macro": macro, "macro_interval": _finite_interval(stacked.mean(axis=0), options.level),
               "weighted": weighted, "weighted_interval": _finite_interval(rows @ stacked / rows.sum(), options.level),
               "buckets": len(measured), "rows": int(rows.sum()),
               "backed_off": sorted(b for b in measured if by_bucket[b]["backed_off"])}
    # a one-answer bucket whose answer sat out of its pool's halves has no floor of its own
    floored = [b for b in measured if by_bucket[b].get("auc_floor") is not None]
    if floored:
        floor_macro = float(np.mean([by_bucket[b]["auc_floor"] for b in floored]))
        # the macro of each halving, over the buckets it holds: how far one halving's floor would have moved
        stacked_halvings = np.stack([draws[b]["floor_halvings"] for b in floored])
        by_halving = np.array([column[np.isfinite(column)].mean() for column in stacked_halvings.T
                               if np.isfinite(column).any()])
        # the gap over the buckets the floor has (a one-answer bucket has none): the same buckets on both sides
        macro_floored = float(np.mean([by_bucket[b]["auc"] for b in floored]))
        summary |= {"floor_macro": floor_macro, "floor_buckets": len(floored), "macro_floored": macro_floored,
                    "floor_macro_interval": _finite_interval(np.stack([draws[b]["floor"] for b in floored])
                                                             .mean(axis=0), options.level),
                    "floor_macro_spread": [float(by_halving.min()), float(by_halving.max())],
                    "floor_halvings": FLOOR_HALVINGS, "gap_macro": macro_floored - floor_macro}
    return summary


def _finite_interval(draws: np.ndarray, level: float) -> list[float] | None:
    """A bucket whose draws hit a one-sided resample has NaN draws (roc_auc_score needs both labels;
    it cannot happen with paired rows, but a NaN must not pass silently)."""
    return None if not np.all(np.isfinite(draws)) else interval(draws, level)
