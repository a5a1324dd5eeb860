import statistics
from collections import Counter

import pytest

from polyalign.features import FEATURE_NAMES
from polyalign.references import build_references, nearest_rank, summarize, support_distance
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
    assert support_distance({"a": 15.0, "b": 4.0}, reference) == pytest.approx((0.5 + 0.5) / 2)
    assert support_distance({"a": 3.0, "b": 5.0}, reference) == 0.0
    assert support_distance({"a": -20.0, "b": 5.0}, reference, ["a"]) == pytest.approx(2.0)


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
