"""Detectability: the classifier two-sample test's statistics, folds and pools (real-text validity is in
tests/test_support.py, beside BNG's)."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from polyalign.evaluate import detectability as dt
from polyalign.evaluate.support import IntervalOptions


def test_bootstrap_draws_are_the_weighted_auc_sklearn_computes():
    """Every draw of the one-product Mann-Whitney form equals roc_auc_score with the draw's counts as
    sample weights (both answers of a drawn prompt weigh the same), ties included."""
    rng = np.random.default_rng(3)
    scores0, scores1 = rng.integers(0, 6, 40).astype(float), rng.integers(1, 7, 40).astype(float)  # many ties
    options = IntervalOptions(draws=25)
    auc, draws = dt._auc_with_draws(scores0, scores1, options, np.random.default_rng(5))
    labels = np.r_[np.zeros(40), np.ones(40)]
    assert auc == pytest.approx(roc_auc_score(labels, np.r_[scores0, scores1]), abs=1e-12)
    counts = np.random.default_rng(5).multinomial(40, np.full(40, 1 / 40), size=25).astype(float)
    expected = [roc_auc_score(labels, np.r_[scores0, scores1], sample_weight=np.r_[c, c]) for c in counts]
    np.testing.assert_allclose(draws, expected, rtol=0, atol=1e-12)


def test_a_bucket_with_few_prompts_is_classified_within_its_parent_group():
    """Five prompts of a bucket are read on the scores of a classifier fitted on its language|track|family
    group; a bucket with enough prompts has its own; row i of each side answers prompt i."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    human = [f"{words[i % 8]} {words[(i * 3) % 8]} said the person" for i in range(45)]
    generated = [f"As an AI model, {words[i % 8]}." for i in range(45)]
    buckets = {"en|single|qa|short": list(range(40)), "en|single|qa|long": list(range(40, 45))}
    measured = dt.measure(buckets, dt.char_ngram_counts(human), dt.char_ngram_counts(generated),
                          IntervalOptions(draws=20))
    short, long = measured["by_bucket"]["en|single|qa|short"], measured["by_bucket"]["en|single|qa|long"]
    assert (short["pool"], short["backed_off"]) == ("en|single|qa|short", False)
    assert (long["pool"], long["backed_off"]) == ("en|single|qa", True)
    assert short["auc"] == long["auc"] == 1.0  # the model's phrase gives it away
    assert short["auc_interval"] == [1.0, 1.0] and long["rows"] == 5
    assert measured["backed_off"] == ["en|single|qa|long"] and measured["buckets"] == 2
    assert measured["macro"] == 1.0 and measured["weighted"] == 1.0


def test_the_floor_is_people_against_people_and_folds_are_grouped_by_prompt():
    """Row i of `generated` is people's answer to prompt i with a marker: the model is caught. The same
    answers unmarked read exactly 0.5 (each copy is scored by the classifier that never saw the
    other), and the floor, people against people, stays near 0.5."""
    rng = np.random.default_rng(0)
    vocabulary = [f"w{i}" for i in range(60)]
    human = [" ".join(rng.choice(vocabulary, 12)) for _ in range(80)]
    buckets = {"zh|multi|dialogue|short": list(range(80))}
    options = IntervalOptions(draws=50)
    marked = dt.measure(buckets, dt.char_ngram_counts(human), dt.char_ngram_counts([h + " 嗯嗯" for h in human]),
                        options)["by_bucket"]["zh|multi|dialogue|short"]
    same = dt.measure(buckets, dt.char_ngram_counts(human), dt.char_ngram_counts(human),
                      options)["by_bucket"]["zh|multi|dialogue|short"]
    assert marked["auc"] == 1.0 and same["auc"] == pytest.approx(0.5, abs=1e-12)
    assert marked["auc_floor"] == same["auc_floor"] and abs(same["auc_floor"] - 0.5) < 0.15
    assert marked["floor_pairs"] == 40 and marked["auc_gap"] == pytest.approx(1.0 - marked["auc_floor"])


def test_the_floor_is_the_mean_over_halvings_and_says_how_far_one_halving_moves():
    """On real answers (CamRest676 and CrossWOZ system turns, a bucket each): each bucket's floor is the
    mean of the AUCs of FLOOR_HALVINGS people-against-people halvings, computed here one by one, with
    their range beside it; the macro's range over halvings holds the macro, and one halving alone would
    have moved it by that much."""
    from tests.chat_exports import camrest_dialogues, camrest_messages, crosswoz_dialogues, crosswoz_messages

    def replies(messages):
        return [m["content"] for m in messages if m["role"] == "assistant"]

    english = [text for d in camrest_dialogues(40) for text in replies(camrest_messages(d))]
    chinese = [text for _, d in crosswoz_dialogues(30) for text in replies(crosswoz_messages(d))]
    human = english[:70] + chinese[:51]
    # and a one-answer bucket: no floor of its own (its answer has no other person's to pair with)
    buckets = {"en|multi|dialogue|short": list(range(70)), "zh|multi|dialogue|short": list(range(70, 120)),
               "zh|multi|dialogue|long": [120]}
    options = IntervalOptions(draws=30, seed=4)
    matrix = dt.char_ngram_counts(human)
    measured = dt.measure(buckets, matrix, matrix, options)
    macro_by_halving = np.zeros(dt.FLOOR_HALVINGS)
    lone = measured["by_bucket"].pop("zh|multi|dialogue|long")
    assert "auc_floor" not in lone and lone["auc"] is not None
    del buckets["zh|multi|dialogue|long"]
    for bucket, rows in buckets.items():
        report = measured["by_bucket"][bucket]
        halvings = []
        for halving in range(dt.FLOOR_HALVINGS):
            rows0, rows1 = dt._floor_pairs(bucket, {bucket: rows}, options.seed, halving)
            scores0, scores1 = dt.pair_scores(matrix[rows0], matrix[rows1], dt.CHAR_NGRAMS)
            halvings.append(roc_auc_score(np.repeat([0, 1], len(rows0)), np.r_[scores0, scores1]))
        assert report["auc_floor"] == pytest.approx(np.mean(halvings), abs=1e-12)
        assert report["auc_floor_spread"] == pytest.approx([min(halvings), max(halvings)], abs=1e-12)
        assert report["floor_halvings"] == dt.FLOOR_HALVINGS and report["floor_pairs"] == len(rows) // 2
        low, high = report["auc_floor_interval"]
        assert low < report["auc_floor"] < high
        macro_by_halving += np.array(halvings) / len(buckets)
    assert measured["floor_macro_spread"] == pytest.approx([macro_by_halving.min(), macro_by_halving.max()])
    assert measured["floor_macro"] == pytest.approx(macro_by_halving.mean())
    # the gap is taken over the two buckets with a floor, on both sides
    assert (measured["buckets"], measured["floor_buckets"]) == (3, 2)
    there = np.mean([measured["by_bucket"][b]["auc"] for b in buckets])
    assert measured["macro_floored"] == pytest.approx(there) and measured["gap_macro"] == pytest.approx(
        there - measured["floor_macro"])
    assert macro_by_halving.max() - macro_by_halving.min() > 0.02  # what a single halving would have left to chance


def test_the_floors_interval_holds_how_far_the_halving_moves_it_on_a_few_answers():
    """Buckets of three real answers hold one pair a halving, whose bootstrap has no spread at all: the
    floor's interval holds how far the halving moves their mean too, never a point at it (an evaluation on
    9 rows once said 0.458 [0.458, 0.459] while its halvings ranged from 0 to 1)."""
    from tests.chat_exports import camrest_dialogues, camrest_messages, crosswoz_dialogues, crosswoz_messages

    english = [m["content"] for d in camrest_dialogues(3) for m in camrest_messages(d) if m["role"] == "assistant"]
    chinese = [m["content"] for _, d in crosswoz_dialogues(3) for m in crosswoz_messages(d) if m["role"] == "assistant"]
    human = english[:3] + chinese[:3]
    buckets = {"en|multi|dialogue|short": [0, 1, 2], "zh|multi|dialogue|short": [3, 4, 5]}
    measured = dt.measure(buckets, dt.char_ngram_counts(human), dt.char_ngram_counts(human),
                          IntervalOptions(draws=400, seed=1))
    low, high = measured["floor_macro_spread"]
    assert high - low >= 0.5  # one pair a halving: each halving's AUC is 0 or 1
    lower, upper = measured["floor_macro_interval"]
    assert lower <= measured["floor_macro"] <= upper, (lower, upper)
    # how far eight halvings leave their mean to chance: a halving's own distance from it over sqrt(8), about
    assert upper - lower >= (high - low) / (2 * np.sqrt(dt.FLOOR_HALVINGS)), (lower, upper, low, high)
    for bucket in buckets:
        report = measured["by_bucket"][bucket]
        assert report["floor_pairs"] == 1 and report["auc_floor_interval"] is None  # under min_rows: none said


def test_every_floor_interval_lies_between_0_and_1():
    """Property: an AUC's floor interval is a range of AUCs, on buckets of any size above the minimum and any
    seed (an evaluation of 320 rows once said auc_floor 0.5 [-0.427, 0.927] for a bucket of 4 rows)."""
    from tests.chat_exports import camrest_dialogues, camrest_messages, crosswoz_dialogues, crosswoz_messages

    english = [m["content"] for d in camrest_dialogues(4) for m in camrest_messages(d) if m["role"] == "assistant"]
    chinese = [m["content"] for _, d in crosswoz_dialogues(4) for m in crosswoz_messages(d) if m["role"] == "assistant"]
    human = english[:7] + chinese[:7]
    matrix = dt.char_ngram_counts(human)
    checked = 0
    for size in (4, 5, 6, 7):
        buckets = {"en|multi|dialogue|short": list(range(size)), "zh|multi|dialogue|short": list(range(7, 7 + size))}
        for seed in range(4):
            measured = dt.measure(buckets, matrix, matrix, IntervalOptions(draws=200, seed=seed, min_rows=4))
            intervals = [r["auc_floor_interval"] for r in measured["by_bucket"].values()]
            intervals.append(measured["floor_macro_interval"])
            for low, high in intervals:
                assert 0.0 <= low <= high <= 1.0, (size, seed, low, high)
                checked += 1
    assert checked == 4 * 4 * 3


def test_a_detectability_below_peoples_own_is_said_to_be_no_win():
    """A user's bot that answered with other people's answers of the same bucket read 0.357 [0.315, 0.399] against
    people's 0.482 [0.418, 0.565]: said, as copies a classifier cannot tell apart; overlapping intervals, or a
    detectability not computed, say nothing."""
    from polyalign.reports.reading_notes import below_people_text

    detect = {"status": "computed", "overall_macro": 0.357, "macro_interval": [0.315, 0.399], "floor_macro": 0.482,
              "floor_macro_interval": [0.418, 0.565]}
    assert below_people_text(detect) == (
        "detectability 0.3570 [0.315, 0.399] lies below people's own 0.4820 [0.418, 0.565]: the classifier tells "
        "these answers from people's less well than people's from each other, as when answers repeat people's own "
        "texts (copied or retrieved answers); read it as that, not as more human than people")
    assert below_people_text({**detect, "macro_interval": [0.33, 0.42]}) is None
    assert below_people_text({**detect, "status": "skipped"}) is None
    assert below_people_text({**detect, "floor_macro_interval": None}) is None


@pytest.mark.parametrize("representation", [dt.CHAR_NGRAMS, dt.HIDDEN_STATES])
def test_out_of_fold_scores_are_scikit_learns_cross_val_predict_exactly(demo_run, representation):
    """The folds are fitted by hand (without scikit-learn's per-call argument checks: a third of the time of
    an evaluation's thousands of small fits): the scores are cross_val_predict's to the last bit, on real
    answers of both languages and on dense hidden-state-like rows."""
    from sklearn.model_selection import GroupKFold, cross_val_predict

    from polyalign.data.records import read_records

    run, _, _ = demo_run
    records = read_records(run / "data" / "val.jsonl")
    for n in (3, 40, 150):
        texts = [r.response for r in records[:2 * n]]
        inputs = (dt._stack(dt.char_ngram_counts(texts[:n]), dt.char_ngram_counts(texts[n:]))
                  if representation == dt.CHAR_NGRAMS
                  else np.random.default_rng(n).normal(size=(2 * n, 16)).astype(np.float32))
        labels = np.r_[np.zeros(n, int), np.ones(n, int)]
        groups = np.r_[np.arange(n), np.arange(n)]
        expected = cross_val_predict(dt.REPRESENTATIONS[representation](), inputs, labels, groups=groups,
                                     cv=GroupKFold(n_splits=min(dt.FOLDS, n)), method="decision_function")
        assert np.array_equal(dt.out_of_fold_scores(inputs, labels, groups, representation), expected), n
    assert dt.out_of_fold_scores(inputs[:2], labels[[0, n]], np.array([0, 0]), representation) is None
