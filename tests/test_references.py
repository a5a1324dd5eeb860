import statistics
from collections import Counter

import pytest

from polyalign.features.references import (
    COUNT_FEATURES,
    build_references,
    nearest_rank,
    per_token_rates,
    quantile_position,
    summarize,
    support_distance,
)
from polyalign.features.response import FEATURE_NAMES
from tests.conftest import read_jsonl


def test_nearest_rank_uses_round_half_to_even():
    values = [1, 2, 3, 4]
    assert [nearest_rank(values, p) for p in (0.1, 0.25, 0.5, 0.9)] == [1, 2, 3, 4]
    six = [10, 20, 30, 40, 50, 60]
    assert nearest_rank(six, 0.5) == 30  # (6-1)*0.5 = 2.5 rounds to 2
    assert nearest_rank([1, 2, 3, 4, 5, 6, 7, 8], 0.5) == 5  # 3.5 rounds to 4


def test_summarize_by_hand():
    s = summarize([9, 2, 4, 4, 4, 5, 5, 7])
    assert (s["count"], s["min"], s["max"], s["mean"], s["std"]) == (8, 2.0, 9.0, 5.0, 2.0)
    # sorted: 2 4 4 4 5 5 7 9; index round(7p): 1, 2, 4 (3.5 -> 4), 5, 6
    assert (s["q10"], s["q25"], s["q50"], s["q75"], s["q90"]) == (4.0, 4.0, 5.0, 5.0, 7.0)


def test_support_distance_by_hand():
    reference = {"features": {
        "a": {"q10": 0.0, "q90": 10.0, "std": 1.0},   # scale 10
        "b": {"q10": 5.0, "q90": 5.0, "std": 2.0},    # scale max(0, 2, 1e-6) = 2
    }}
    assert support_distance({"a": 15.0, "b": 4.0}, reference, counts="raw") == pytest.approx((0.5 + 0.5) / 2)
    assert support_distance({"a": 3.0, "b": 5.0}, reference, counts="raw") == 0.0
    assert support_distance({"a": -20.0, "b": 5.0}, reference, ["a"], counts="raw") == pytest.approx(2.0)
    with pytest.raises(ValueError, match="rerun `polyalign stats RUN`"):
        support_distance({"a": 3.0, "b": 5.0}, reference)  # per-token rates need references that have them


def test_quantile_position_interpolates_the_quantile_function_and_splits_plateaus():
    stats = {"min": 0.0, "q10": 10.0, "q25": 20.0, "q50": 40.0, "q75": 60.0, "q90": 100.0, "max": 200.0}
    assert quantile_position(-5.0, stats) == 0.0 and quantile_position(1e9, stats) == 1.0
    assert quantile_position(40.0, stats) == 0.5
    assert quantile_position(15.0, stats) == pytest.approx(0.10 + 0.15 * 0.5)
    assert quantile_position(150.0, stats) == pytest.approx(0.95)
    # 0 is the min, q10, q25 and q50 at once: the middle of 0 .. 0.5
    plateau = {"min": 0.0, "q10": 0.0, "q25": 0.0, "q50": 0.0, "q75": 1.0, "q90": 2.0, "max": 4.0}
    assert quantile_position(0.0, plateau) == 0.25 and quantile_position(3.0, plateau) == pytest.approx(0.95)


def test_per_token_distance_by_hand():
    """Counts as per-token rates against the bucket's rates; the length by its position, bounded."""
    length = {"min": 10.0, "q10": 20.0, "q25": 30.0, "q50": 40.0, "q75": 50.0, "q90": 60.0, "max": 100.0, "std": 5.0}
    reference = {
        "features": {"token_count": length, "comma_count": {"q10": 1.0, "q90": 3.0, "std": 1.0},
                     "type_token_ratio": {"q10": 0.5, "q90": 0.8, "std": 0.1}},
        "rates": {"comma_count": {"q10": 0.02, "q90": 0.06, "std": 0.01}},
    }
    # 80 tokens (u = 0.95), 4 commas (rate 0.05: inside), ttr 0.9 (0.1 / 0.3 above the band)
    x = {"token_count": 80.0, "comma_count": 4.0, "type_token_ratio": 0.9}
    assert support_distance(x, reference) == pytest.approx(((0.95 - 0.9) / 0.8 + 0 + 1 / 3) / 3)
    # 1,000 tokens costs no more than 101: beyond the longest human answer the length term is 0.125
    far = {**x, "token_count": 1000.0, "comma_count": 50.0}
    assert support_distance(far, reference) == pytest.approx((0.125 + 0 + 1 / 3) / 3)
    assert support_distance({**far, "token_count": 101.0, "comma_count": 5.05}, reference) == pytest.approx(
        support_distance(far, reference))
    # raw: METHOD's band on every feature
    assert support_distance(x, reference, counts="raw") == pytest.approx((20 / 40 + 1 / 2 + 1 / 3) / 3)


def test_per_token_rates_of_the_features_of_a_text():
    from polyalign.features.response import text_features

    features = text_features("Well, yes, it is. Is it?")
    rates = per_token_rates(features)
    assert set(rates) == set(COUNT_FEATURES) and "token_count" not in rates
    assert rates["comma_count"] == pytest.approx(2 / features["token_count"])
    assert all(v == 0.0 for v in per_token_rates(text_features("")).values())


def test_small_buckets_get_no_reference():
    rows = [("big", {"x": float(i)}) for i in range(25)] + [("small", {"x": 1.0})] * 3
    refs = build_references(rows, min_bucket_size=20, feature_names=["x"])
    assert list(refs["buckets"]) == ["big"] and refs["skipped_buckets"] == {"small": 3}
    assert refs["buckets"]["big"]["features"]["x"]["q90"] == 22.0  # round(24 * 0.9) = 22


def test_demo_references_come_from_train_only(demo_run):
    run, _, stats = demo_run
    import json
    references = json.loads((run / "stats/references.json").read_text(encoding="utf-8"))
    train = read_jsonl(run / "data/train.jsonl")
    counts = Counter(r["bucket_id"] for r in train)
    assert references["split"] == "train" and references["features"] == list(FEATURE_NAMES)
    for bucket, entry in references["buckets"].items():
        assert entry["count"] == counts[bucket] >= 20
        assert entry["features"]["char_count"]["count"] == counts[bucket]
    assert set(references["skipped_buckets"]) == {b for b, n in counts.items() if n < 20}
    # independent check of one bucket's statistics with the standard library
    bucket = max(references["buckets"], key=lambda b: counts[b])
    lengths = [len(r["response"]) for r in train if r["bucket_id"] == bucket]
    char = references["buckets"][bucket]["features"]["char_count"]
    assert char["mean"] == pytest.approx(statistics.fmean(lengths), abs=1e-6)
    assert char["std"] == pytest.approx(statistics.pstdev(lengths), abs=1e-6)
    assert char["q50"] == sorted(lengths)[round((len(lengths) - 1) * 0.5)]


def _auc_farther(positive, negative) -> float:
    """The chance that a response of `positive` lies farther from the support than one of `negative`."""
    from sklearn.metrics import roc_auc_score

    labels = [1] * len(positive) + [0] * len(negative)
    return roc_auc_score(labels, list(positive) + list(negative))


def test_per_token_distance_does_not_punish_long_human_answers(demo_run):
    """Real text: held-out human answers of the test split against the train references. In raw units
    the longest fifth of each bucket's answers lies farther from its own bucket's support than the rest
    (AUC 0.73 on the demo data); per token the gap mostly closes, and answers no person would give (the
    first clause alone, answers in the other language) are still told apart from people."""
    import json

    import numpy as np

    from polyalign.features.response import text_features
    from tests.real_inputs import answer_sets, bucket_halves

    run, _, _ = demo_run
    references = json.loads((run / "stats" / "references.json").read_text())
    pairs = [(p, o) for p, o in bucket_halves(demo_run) if o.bucket_id in references["buckets"]]
    sets = answer_sets(pairs)
    buckets = np.array([o.bucket_id for _, o in pairs])
    lengths = np.array([text_features(t)["token_count"] for t in sets["human"]])
    longest = np.zeros(len(pairs), bool)
    for bucket in set(buckets):
        rows = buckets == bucket
        longest[rows & (lengths > np.quantile(lengths[rows], 0.8))] = True

    def distances(texts, counts):
        return np.array([support_distance(text_features(t), references["buckets"][b], references["features"], True,
                                          counts)
                         for t, b in zip(texts, buckets)])

    auc = {}
    for counts in ("raw", "per_token"):
        human = distances(sets["human"], counts)
        auc[counts] = {"long": _auc_farther(human[longest], human[~longest])} | {
            name: _auc_farther(distances(sets[name], counts), human)
            for name in ("first_clause", "other_language_answers")}
    assert len(pairs) > 500 and longest.sum() > 80
    assert auc["raw"]["long"] > 0.7 and auc["per_token"]["long"] < 0.62, auc
    assert auc["per_token"]["first_clause"] > auc["raw"]["first_clause"] + 0.03, auc
    assert auc["per_token"]["other_language_answers"] > 0.99, auc
