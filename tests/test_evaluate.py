"""Evaluation metrics by hand, against NLTK and scikit-learn, with oracle predictions, and the authors'
published diversity values on their English sample."""

import dataclasses
import html
import json
import math
import random
import re
import shutil
from collections import Counter

import numpy as np
import pytest

from polyalign.core.scores import combined
from polyalign.evaluate import naturalness as nat
from polyalign.evaluate.baselines import first_sentence
from polyalign.evaluate.dynamics import turn_dynamics
from polyalign.evaluate.run import EvaluateOptions, EvaluationError, evaluate
from polyalign.evaluate.support import IntervalOptions
from polyalign.evaluate.text_metrics import (
    distinct_n,
    normalize_answer,
    rouge_l_f1,
    self_bleu,
    sentence_bleu,
    token_f1,
    tokens,
    utility_scores,
)
from tests.conftest import REPO, SHARED_DATA


def test_tokenisation_modes():
    assert normalize_answer("The Cat, a dog!", "reference") == "cat dog"
    assert tokens("北京，是首都。", "reference") == ["北京，是首都。"]  # one token per whitespace run
    assert tokens("北京，是首都。", "cjk") == ["北", "京", "是", "首", "都"]
    assert tokens("An apple (苹果)!", "cjk") == ["apple", "苹", "果"]
    # METHOD section 9: `cjk` is SQuAD's normalisation (ASCII punctuation deleted, not spaced: "don't" is one
    # word, as the paper's numbers count it) plus CJK; a full-width mark parts the words on either side
    assert tokens("I don't know, it's $5.", "cjk") == tokens("I don't know, it's $5.", "reference") == [
        "i", "dont", "know", "its", "5"]
    assert token_f1(tokens("dont know", "cjk"), tokens("I don't know", "cjk")) == pytest.approx(0.8)
    assert tokens("Python，Java和C++。", "cjk") == ["python", "java", "和", "c"]


def test_the_cjk_tokenisation_is_squads_on_every_ascii_answer_and_keeps_no_punctuation(demo_run):
    """Over every human answer of the demo's test split: where an answer is ASCII, `cjk` reads it exactly as
    SQuAD (`reference`) does; no token of any answer holds a punctuation mark or a symbol SQuAD deletes."""
    import string
    import unicodedata

    from polyalign.data.records import read_records

    run, _, _ = demo_run
    answers = [r.response for r in read_records(run / "data" / "test.jsonl")]
    ascii_answers = [a for a in answers if a.isascii()]
    assert len(ascii_answers) > 300 and len(answers) - len(ascii_answers) > 300
    for answer in ascii_answers:
        assert tokens(answer, "cjk") == tokens(answer, "reference"), answer
    for answer in answers:
        for token in tokens(answer, "cjk"):
            assert not any(ch in string.punctuation or unicodedata.category(ch).startswith("P") for ch in token), (
                answer, token)


def test_utility_by_hand():
    assert token_f1(["a", "b", "c"], ["b", "c", "d", "e"]) == pytest.approx(2 * (2 / 3) * (2 / 4) / (2 / 3 + 2 / 4))
    assert token_f1([], []) == 1.0 and token_f1(["x"], []) == 0.0
    # LCS of (a b c d) and (a c d e) is a c d: P = 3/4, R = 3/4.
    assert rouge_l_f1(list("abcd"), list("acde")) == pytest.approx(0.75)
    assert rouge_l_f1([], []) == 1.0 and rouge_l_f1([], ["a"]) == 0.0
    scores = utility_scores("The answer.", "the answer", "cjk")
    assert scores == {"raw_em": 0.0, "em": 1.0, "qa_f1": 1.0, "rouge_l_f1": 1.0}


def test_distinct_by_hand():
    lists = [["a", "b", "a"], ["a", "b"]]
    assert distinct_n(lists, 1) == pytest.approx(2 / 5)
    assert distinct_n(lists, 2) == pytest.approx(2 / 3)  # ab, ba, ab: never across texts
    assert distinct_n([["a"]], 3) == 0.0


def test_jackknife_interval_of_distinct_n_equals_recomputing_each_left_out_group():
    from scipy.stats import norm

    from polyalign.evaluate.text_metrics import _jackknife_interval

    rng = random.Random(1)
    lists = [[rng.choice("abcdefgh") for _ in range(rng.randint(0, 9))] for _ in range(37)]
    for n in (1, 2, 3):
        z = norm.ppf(0.975)
        groups = np.array_split(np.random.default_rng(5).permutation(len(lists)), 6)
        left_out = np.array([distinct_n([t for i, t in enumerate(lists) if i not in set(g)], n) for g in groups])
        se = math.sqrt(5 / 6 * ((left_out - left_out.mean()) ** 2).sum())
        point = distinct_n(lists, n)
        low, high = _jackknife_interval(lists, n, 6, 5, z)
        assert (low, high) == pytest.approx((max(0, point - z * se), min(1, point + z * se)), abs=1e-12)
    assert _jackknife_interval([["a", "b"]], 1, 20, 0, 1.96) is None  # one text: nothing to leave out


def test_diversity_intervals_on_real_answers_match_the_spread_over_fresh_samples(demo_run):
    """Real text: the jackknife's standard error of Distinct-2 at n = 80, and the bootstrap interval of
    Self-BLEU, against the spread of those numbers over disjoint samples of 80 train answers."""
    from polyalign.data.records import read_records
    from polyalign.evaluate.text_metrics import diversity_with_intervals

    run, _, _ = demo_run
    answers = [r.response for r in read_records(run / "data" / "train.jsonl") if r.language == "en"]
    random.Random(0).shuffle(answers)
    samples = [answers[i:i + 80] for i in range(0, 80 * 12, 80)]
    measured = [diversity_with_intervals(sample, "cjk", 200, 0, 0.95) for sample in samples]
    for key in ("distinct_2", "self_bleu_4"):
        values = np.array([v[key] for v, _ in measured])
        half_widths = np.array([(i[key][1] - i[key][0]) / 2 for _, i in measured])
        spread = values.std(ddof=1) * 1.96  # what a 95% interval's half-width should be
        assert 0.5 < half_widths.mean() / spread < 2.0, (key, half_widths.mean(), spread)
        assert all(i[key][0] <= v[key] <= i[key][1] for v, i in measured)
    values, _ = measured[0]
    assert values["self_bleu_4"] == pytest.approx(self_bleu(samples[0], "cjk"))


def test_sentence_bleu_matches_nltk():
    from nltk.translate.bleu_score import SmoothingFunction
    from nltk.translate.bleu_score import sentence_bleu as nltk_bleu

    rng = random.Random(0)
    vocab = "the cat sat on a mat dog ran in park 北 京 天 气".split()
    smooth = SmoothingFunction().method1
    for _ in range(200):
        hyp = [rng.choice(vocab) for _ in range(rng.randint(1, 12))]
        refs = [[rng.choice(vocab) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 5))]
        assert sentence_bleu(refs, hyp) == pytest.approx(nltk_bleu(refs, hyp, smoothing_function=smooth), abs=1e-12)


def test_self_bleu_matches_nltk_under_the_same_sampling(demo_run):
    from nltk.translate.bleu_score import SmoothingFunction
    from nltk.translate.bleu_score import sentence_bleu as nltk_bleu

    from polyalign.data.records import read_records

    run, _, _ = demo_run
    texts = [r.response for r in read_records(run / "data" / "test.jsonl")][:620]
    rng = random.Random(42)
    sample = rng.sample(texts, 500)
    lists = [t for t in (tokens(x, "cjk") for x in sample) if t]
    expected = []
    for i, candidate in enumerate(lists):
        refs = lists[:i] + lists[i + 1:]
        refs = rng.sample(refs, 100) if len(refs) > 100 else refs
        expected.append(nltk_bleu(refs, candidate, smoothing_function=SmoothingFunction().method1))
    assert self_bleu(texts, "cjk") == pytest.approx(float(np.mean(expected)), abs=1e-12)


def test_frontier_and_aggregate_by_hand():
    front = nat.pareto_frontier([(0.9, 0.2), (0.5, 0.6), (0.4, 0.5), (0.1, 0.9), (0.5, 0.3)])
    assert front == [(0.1, 0.9), (0.5, 0.6), (0.9, 0.2)]
    # (0.1 - 0) 0.9 + (0.5 - 0.1) 0.6 + (0.9 - 0.5) 0.2
    assert nat.hypervolume(front) == pytest.approx(0.09 + 0.24 + 0.08)
    assert nat.naturalness_score(1.0, 0.25) == pytest.approx(math.sqrt(0.5 * 0.25))
    assert nat.naturalness_score(1.0, 0.0) == 0.0
    # the geometric mean of the measured parts: F1 0.5 and 1/(1 + 1.0); None with fewer than two parts
    assert combined(nat.aggregate_parts(0.5, 1.0, None, None)) == pytest.approx(0.5)
    assert combined(nat.aggregate_parts(0.5, None, None, None)) is None


def test_intervals_of_combined_numbers_by_hand():
    """One bucket, no MAUVE: the frontier is its single point, so the hypervolume of draw d is
    F1_d / (1 + BNG_d) and the aggregate the geometric mean of F1_d, 1/(1 + BNG_d) and that hypervolume,
    (F1_d / (1 + BNG_d))^(2/3); two buckets of TDM draws give the macro's draws. Each interval is the
    central 95% of its draws moved by their median's bias from the estimate."""
    from polyalign.evaluate.composites import combined_intervals
    from polyalign.evaluate.support import Resamples

    rng = np.random.default_rng(3)
    f1, bng = rng.uniform(0.2, 0.6, 400), rng.uniform(0.5, 2.0, 400)
    tdm = {"x": rng.uniform(0.3, 0.5, 400), "y": rng.uniform(0.6, 0.9, 400)}
    resamples = Resamples(np.ones((400, 7)), {"a": f1}, {"a": bng}, {"a": 7})
    estimates = {"tdm_macro": 0.55, "nuf_hypervolume": 0.3 / 2.0, "aggregate": (0.3 / 2.0) ** (2 / 3)}
    said = combined_intervals(resamples, {"a": 1.0}, tdm, {"by_bucket": {}, "global": None}, estimates, 0.95)

    def expected(draws, estimate):
        shift = np.median(draws) - estimate
        return [np.quantile(draws, 0.025) - shift, np.quantile(draws, 0.975) - shift]

    by_hand = {"tdm_macro": (tdm["x"] + tdm["y"]) / 2, "nuf_hypervolume": f1 / (1 + bng),
               "aggregate": (f1 / (1 + bng)) ** (2 / 3)}
    for key, draws in by_hand.items():
        assert said[key] == pytest.approx(expected(draws, estimates[key]), rel=1e-12), key
    # nothing to draw from (--compat reference), or no estimate: no interval
    assert combined_intervals(None, {"a": 1.0}, tdm, {"by_bucket": {}, "global": None}, estimates, 0.95) == \
        dict.fromkeys(estimates)
    assert combined_intervals(resamples, {"a": 1.0}, {}, {"by_bucket": {}, "global": None},
                              {**estimates, "tdm_macro": None}, 0.95)["tdm_macro"] is None


def test_bng_and_hcr_by_hand():
    human = {"f": np.array([1.0, 2.0, 3.0, 4.0]), "g": np.array([5.0, 5.0, 5.0, 5.0])}
    generated = {"f": np.array([2.0, 3.0, 4.0, 5.0]), "g": np.array([5.0, 5.0, 6.0, 5.0])}
    # W1(f) = 1 (a shift by one), std(f) = sqrt(1.25); W1(g) = 0.25, std(g) = 0 counts as 1.
    features = nat.usable_features(human, keep_constant=True)
    assert nat.bucket_bng(human, generated, features) == pytest.approx((1 / math.sqrt(1.25) + 0.25) / 2)
    assert nat.usable_features(human, keep_constant=False) == ["f"]
    bands = {"f": (1.0, 4.0), "g": (5.0, 5.0)}
    share, per_feature = nat.bucket_hcr(bands, generated, ["f", "g"])
    assert share == pytest.approx(2 / 4) and per_feature == pytest.approx((3 / 4 + 3 / 4) / 2)


@pytest.mark.parametrize("tokenize", ["cjk", "squad"])
def test_tdm_against_a_direct_scikit_learn_computation(demo_run, tokenize):
    """TDM's gaps against scipy and scikit-learn on the rows, and each bootstrap draw's against the same
    computation on the rows the draw takes (repeated as often as it takes them; the TF-IDF and SVD stay
    those of the rows themselves). The default mode's TF-IDF reads every CJK character as a word, as F1
    does; --compat reference's (squad) reads `\\b\\w+\\b`, so a Chinese turn is one or two "words"."""
    from scipy.stats import wasserstein_distance
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    from polyalign.data.records import read_records
    from polyalign.evaluate.dynamics import turn_dynamics_with_draws

    run, _, _ = demo_run
    multi = [r for r in read_records(run / "data" / "test.jsonl") if r.track == "multi"]
    records = [r for r in multi if r.language == "en"][:60] + [r for r in multi if r.language == "zh"][:60]
    questions, human = [r.question for r in records], [r.response for r in records]
    generated = [records[(i + 1) % len(records)].response for i in range(len(records))]  # another row's answer
    bucket = ["b"] * len(records)
    ours = turn_dynamics(questions, human, generated, bucket, tokenize)["by_bucket"]["b"]
    vec = (TfidfVectorizer(tokenizer=lambda text: tokens(text, "cjk"), token_pattern=None, lowercase=False)
           if tokenize == "cjk" else TfidfVectorizer(lowercase=True, token_pattern=r"\b\w+\b"))
    vec.fit(questions + human + generated)
    Q, H, G = (vec.transform(x) for x in (questions, human, generated))
    svd = TruncatedSVD(n_components=min(64, min(len(records) - 1, len(vec.vocabulary_) - 1)), random_state=0).fit(Q)
    lq, lh, lg = (svd.transform(m) for m in (Q, H, G))

    def cos(a, b):
        out = []
        for x, y in zip(a, b):
            nx, ny = np.linalg.norm(x), np.linalg.norm(y)
            out.append(float(x @ y / (nx * ny)) if nx > 1e-12 and ny > 1e-12 else 0.0)
        return np.array(out)

    def gap(g, h):
        return wasserstein_distance(g, h) / (h.std() if h.std() > 1e-12 else 1.0)

    qlen = np.array([max(len(tokens(q, tokenize)), 1) for q in questions])
    ratio = {s: np.array([len(tokens(t, tokenize)) for t in texts]) / qlen
             for s, texts in (("h", human), ("g", generated))}
    lexical = {"h": cos(Q.toarray(), H.toarray()), "g": cos(Q.toarray(), G.toarray())}
    chinese = np.array([r.language == "zh" for r in records])
    assert chinese.sum() >= 20
    # people's Chinese turns share words with what they answer once characters are words
    sharing = (lexical["h"][chinese] > 0).mean()
    assert sharing > 0.5 if tokenize == "cjk" else sharing < 0.2, sharing
    semantic = {"h": cos(lq, lh), "g": cos(lq, lg)}

    def expected_gaps(take):
        out = {name: gap(values["g"][take], values["h"][take])
               for name, values in (("length_ratio", ratio), ("lexical", lexical), ("semantic", semantic))}
        qc, hc, gc = (m[take] - m[take].mean(0) for m in (lq, lh, lg))
        n = len(take)
        out["transition"] = np.linalg.norm(qc.T @ gc / n - qc.T @ hc / n) / np.linalg.norm(qc.T @ hc / n)
        return out

    expected = expected_gaps(np.arange(len(records)))
    for key, value in expected.items():
        assert ours["gaps"][key] == pytest.approx(value, rel=1e-9), key
    assert ours["tdm"] == pytest.approx(np.mean([1 / (1 + v) for v in expected.values()]), rel=1e-9)
    counts = np.random.default_rng(0).multinomial(len(records), np.full(len(records), 1 / len(records)), size=3)
    report, draws = turn_dynamics_with_draws(questions, human, generated, bucket, tokenize,
                                             weights=counts.astype(float))
    assert report["by_bucket"]["b"] == ours and draws["b"].shape == (3,)
    for draw, taken in zip(draws["b"], counts):
        gaps = expected_gaps(np.repeat(np.arange(len(records)), taken))
        assert draw == pytest.approx(np.mean([1 / (1 + v) for v in gaps.values()]), rel=1e-9)
    assert len(set(draws["b"].round(12))) == 3 and ours["tdm"] not in draws["b"]


def _write_predictions(path, records, text_of):
    path.write_text("".join(json.dumps({"id": r.id, "prediction": text_of(r), "model": "m", "profile": "context"})
                            + "\n" for r in records))


def test_oracle_predictions_score_perfectly(demo_run, tmp_path):
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    records_path = run / "data" / "test.jsonl"
    records = read_records(records_path)
    _write_predictions(tmp_path / "oracle.jsonl", records, lambda r: r.response)
    result = evaluate(records_path, tmp_path / "oracle.jsonl", tmp_path / "eval",
                      EvaluateOptions(references=run / "stats" / "references.json",
                                      support=run / "data" / "train.jsonl"))
    m = result["metrics"]
    assert m["utility"]["overall"]["em"] == 1.0 and m["utility"]["overall"]["qa_f1"] == 1.0
    assert m["utility"]["overall"]["em_interval"] == m["utility"]["overall"]["rouge_l_f1_interval"] == [1.0, 1.0]
    # the human answers are the human floor: every bucket measured, each exactly at its floor
    assert len(m["buckets"]) == len({r.bucket_id for r in records}) == m["bng"]["buckets"]
    for bucket, r in m["buckets"].items():
        assert r["bng"] == r["bng_floor"] and r["hcr"] == r["hcr_floor"], bucket
    assert m["bng"]["gap_macro"] == 0.0 and m["bng"]["overall_macro"] > 0.0
    # the floors' macros have intervals from their buckets' draws: people measured as the model is, on other
    # bootstrap draws, so about as wide as the model's
    for metric in ("bng", "hcr"):
        section = m[metric]
        low, high = section["floor_macro_interval"]
        assert low <= section["floor_macro"] <= high
        assert 0.5 < (high - low) / (section["macro_interval"][1] - section["macro_interval"][0]) < 2
        assert m["reference_rows"]["human"][f"{metric}_macro_interval"] == section["floor_macro_interval"]
    assert m["tdm"]["overall_macro"] == pytest.approx(1.0)
    assert m["diversity"]["overall"]["human"] == m["diversity"]["overall"]["generated"]
    assert m["mauve"]["status"] == "skipped" and m["mauve"]["global"] is None
    assert result["alignment"] == {"records": len(records), "predictions": len(records), "missing": 0,
                                   "duplicate": 0, "extra": 0, "identical_copies": 0, "partial": False,
                                   "evaluated": len(records)}
    saved = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert set(saved["metrics"]) == {"utility", "diversity", "bng", "hcr", "buckets", "reference_rows", "mauve", "tdm",
                                     "nuf", "aggregate", "detectability"}
    # People's own answers as the model's: no classifier can tell two copies apart when both answers to a
    # prompt share a fold (folds grouped by prompt), so every bucket reads exactly 0.5
    detect = m["detectability"]
    assert set(detect["by_bucket"]) == set(m["buckets"]) and detect["buckets"] == len(m["buckets"])
    assert all(auc == pytest.approx(0.5, abs=1e-12) for auc in detect["by_bucket"].values()), detect["by_bucket"]
    assert m["reference_rows"]["human"]["detectability_macro"] == detect["floor_macro"]
    assert m["reference_rows"]["echo_question"]["detectability_macro"] > 0.9
    assert (tmp_path / "eval" / "report.html").is_file() and (tmp_path / "eval" / "frontier.png").is_file()


def test_misaligned_predictions_stop_unless_partial(demo_run, tmp_path):
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    records_path = run / "data" / "test.jsonl"
    records = read_records(records_path)[:300]
    subset = tmp_path / "records.jsonl"
    subset.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    rows = [{"id": r.id, "prediction": "ok"} for r in records[2:]] + [{"id": records[5].id, "prediction": "x"},
                                                                      {"id": "nope", "prediction": "y"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(EvaluationError, match=re.escape(
            f"2 missing ({records[0].id}, {records[1].id}), 1 duplicate with different answers ({records[5].id} on "
            f"lines 4, 299), 1 extra ids (nope)")):
        evaluate(subset, path, tmp_path / "eval")
    # answers to a part of the records alone, as an engine answering `polyalign prompts --per-bucket` rows
    # writes them: the error names --prompts before --allow-partial (which would mark the run partial)
    _write_predictions(tmp_path / "part.jsonl", records[:40], lambda r: "ok")
    with pytest.raises(EvaluationError, match=re.escape(
            "if they answer the records `polyalign prompts` chose (--limit, --sample, --per-bucket), pass its file "
            "as --prompts (they are evaluated on those, as generate's are); otherwise pass --allow-partial")):
        evaluate(subset, tmp_path / "part.jsonl", tmp_path / "eval")
    result = evaluate(subset, path, tmp_path / "eval", EvaluateOptions(allow_partial=True, plots=False))
    assert result["alignment"]["evaluated"] == 297 and result["alignment"]["partial"]
    # A comparison names the settings and warns when runs saw different test sets.
    _write_predictions(tmp_path / "full.jsonl", records, lambda r: r.question)
    evaluate(subset, tmp_path / "full.jsonl", tmp_path / "eval_full", EvaluateOptions(plots=False))
    from polyalign.cli import main

    # --no-progress, which a script passes to every stage, is taken here too
    assert main(["report", str(tmp_path / "eval"), str(tmp_path / "eval_full"), "--out", str(tmp_path / "cmp"),
                 "--no-progress"]) == 0
    markdown = (tmp_path / "cmp" / "report.md").read_text()
    assert "| test rows | 297 of 300 (partial: 2 without an answer, 1 answered twice differently) | 300 |" in markdown
    assert "| F1 |" in markdown
    assert "differ in test rows: 297 | 300" in (tmp_path / "cmp" / "report.html").read_text()


def test_the_records_generate_sampled_are_evaluated_without_allow_partial(demo_run, tmp_path, capsys):
    """Predictions whose manifest says `generate --sample` chose them from this very records file are the
    part they answer: evaluated as a partial evaluation that names the selection, with no flag; an extra
    id, or a selection from other records, still stops."""
    from polyalign.cli import main
    from polyalign.core.outputs import sidecar
    from polyalign.core.paths import file_digest
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    records = read_records(run / "data" / "test.jsonl")[:60]
    subset = tmp_path / "records.jsonl"
    subset.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    from polyalign.generate.selection import select_records

    chosen, _ = select_records(records, subset, None, 20, 4)  # what `generate --sample 20 --seed 4` answers
    _write_predictions(tmp_path / "p.jsonl", chosen, lambda r: r.question)
    manifest = {"settings": {"records": str(subset), "limit": None, "sample": len(chosen), "seed": 4},
                "made_from": {"records": file_digest(subset)}}
    sidecar(tmp_path / "p.jsonl").write_text(json.dumps(manifest))
    assert main(["evaluate", "--records", str(subset), "--predictions", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "eval"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{len(chosen)} of 60 rows (the ones `generate --sample {len(chosen)} --seed 4` "
                              "answered): F1 ")
    alignment = json.loads((tmp_path / "eval" / "metrics.json").read_text())["alignment"]
    assert alignment["partial"] and alignment["evaluated"] == len(chosen) and alignment["missing"] == 60 - len(chosen)
    # a file cut short since is no selection of generate's: refused as before
    _write_predictions(tmp_path / "p.jsonl", chosen[:-1], lambda r: r.question)
    with pytest.raises(EvaluationError,
                       match=f"{61 - len(chosen)} missing \\(.*\\), 0 duplicate with different answers, 0 extra ids"):
        evaluate(subset, tmp_path / "p.jsonl", tmp_path / "eval1", EvaluateOptions(plots=False))
    # an id the records do not hold is no selection's doing
    _write_predictions(tmp_path / "p.jsonl", [*chosen, records[1]], lambda r: r.question)
    with open(tmp_path / "p.jsonl", "a") as handle:
        handle.write(json.dumps({"id": "nope", "prediction": "x"}) + "\n")
    with pytest.raises(EvaluationError, match="1 extra ids"):
        evaluate(subset, tmp_path / "p.jsonl", tmp_path / "eval2", EvaluateOptions(plots=False))
    # a selection the manifest does not record (an external engine's subset) needs the flag, as before
    _write_predictions(tmp_path / "q.jsonl", chosen, lambda r: r.question)
    with pytest.raises(EvaluationError,
                       match=f"{60 - len(chosen)} missing \\(.*\\), 0 duplicate with different answers, 0 extra ids"):
        evaluate(subset, tmp_path / "q.jsonl", tmp_path / "eval3", EvaluateOptions(plots=False))
    # `generate --per-bucket 2 --seed 4`'s records: named as that selection
    chosen, _ = select_records(records, subset, per_bucket=2, seed=4)
    _write_predictions(tmp_path / "b.jsonl", chosen, lambda r: r.question)
    manifest["settings"] = {"records": str(subset), "limit": None, "sample": None, "seed": 4, "per_bucket": 2}
    sidecar(tmp_path / "b.jsonl").write_text(json.dumps(manifest))
    assert main(["evaluate", "--records", str(subset), "--predictions", str(tmp_path / "b.jsonl"), "--out",
                 str(tmp_path / "eval4"), "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"{len(chosen)} of 60 rows (the ones `generate --per-bucket 2 --seed 4` "
                                              "answered): F1 ")


def test_predictions_for_the_records_prompts_chose_are_evaluated_with_its_file(demo_run, demo_tokenizer, tmp_path,
                                                                                capsys):
    """An external engine answered the records `polyalign prompts --per-bucket 2` chose: with `--prompts` they
    are evaluated as generate's selection is, named; without it they need --allow-partial (the docs said
    evaluate named such a selection, and it refused: "2592 missing")."""
    from polyalign.cli import main
    from polyalign.core.outputs import sidecar
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    records = read_records(run / "data" / "test.jsonl")[:60]
    subset = tmp_path / "records.jsonl"
    subset.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    prompts = tmp_path / "prompts.jsonl"
    assert main(["prompts", "--records", str(subset), "--checkpoint", str(demo_tokenizer[0].path.parent), "--out",
                 str(prompts), "--per-bucket", "2", "--seed", "4"]) == 0
    asked = {json.loads(line)["id"] for line in prompts.read_text().splitlines()}
    chosen = [r for r in records if r.id in asked]
    assert 0 < len(chosen) < 60
    _write_predictions(tmp_path / "p.jsonl", chosen, lambda r: r.question)  # no manifest: an engine's output
    capsys.readouterr()
    assert main(["evaluate", "--records", str(subset), "--predictions", str(tmp_path / "p.jsonl"), "--prompts",
                 str(prompts), "--out", str(tmp_path / "eval"), "--no-progress", "--no-detectability"]) == 0
    assert capsys.readouterr().out.startswith(f"{len(chosen)} of 60 rows (the ones `prompts --per-bucket 2 --seed 4` "
                                              "chose): F1 ")
    with pytest.raises(EvaluationError, match=f"{60 - len(chosen)} missing \\(.*\\), 0 duplicate with different "
                                              "answers, 0 extra ids"):
        evaluate(subset, tmp_path / "p.jsonl", tmp_path / "eval2", EvaluateOptions(plots=False))
    # an export that wrote a row twice: the same answer twice is one answer, said
    answers = tmp_path / "p.jsonl"
    with open(answers, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"id": chosen[0].id, "prediction": chosen[0].question}, ensure_ascii=False) + "\n")
    command = ["evaluate", "--records", str(subset), "--predictions", str(answers), "--prompts", str(prompts),
               "--no-progress", "--no-detectability"]
    assert main([*command, "--out", str(tmp_path / "eval5")]) == 0
    assert capsys.readouterr().out.startswith(
        f"{len(chosen)} of 60 rows (the ones `prompts --per-bucket 2 --seed 4` chose; 1 id given twice or more with "
        "the same answer, kept once): F1 ")
    # a different answer under the same id, and one the engine left out: counted against the records prompts
    # chose (not the 60), named with their lines; --allow-partial evaluates the rest and says what it left out
    with open(answers, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"id": chosen[1].id, "prediction": chosen[1].response}, ensure_ascii=False) + "\n")
    rows = answers.read_text().splitlines()
    answers.write_text("\n".join(row for row in rows if json.loads(row)["id"] != chosen[2].id) + "\n")
    line = next(i for i, row in enumerate(answers.read_text().splitlines(), 1) if json.loads(row)["id"] == chosen[1].id)
    assert main([*command, "--out", str(tmp_path / "eval6")]) == 2
    assert (f"predictions do not match the {len(chosen)} records `prompts --per-bucket 2 --seed 4` chose: 1 missing "
            f"({chosen[2].id}), 1 duplicate with different answers ({chosen[1].id} on lines {line}, "
            f"{len(answers.read_text().splitlines())}), 0 extra ids; pass --allow-partial") in capsys.readouterr().err
    assert main([*command, "--out", str(tmp_path / "eval6"), "--allow-partial"]) == 0
    assert capsys.readouterr().out.startswith(
        f"{len(chosen) - 2} of 60 rows (the ones `prompts --per-bucket 2 --seed 4` chose; partial: the ids with one "
        "answer; 1 without a prediction, 1 answered twice or more with different answers (every copy left out); 1 id "
        "given twice or more with the same answer, kept once): F1 ")
    alignment = json.loads((tmp_path / "eval6" / "metrics.json").read_text())["alignment"]
    assert (alignment["missing_ids"], alignment["duplicate_ids"]) == ([chosen[2].id], [chosen[1].id])
    empty = tmp_path / "empty.jsonl"  # a prompts file emptied since: said, not "0 records chose"
    empty.write_text("")
    shutil.copy(sidecar(prompts), sidecar(empty))
    with pytest.raises(EvaluationError, match="empty.jsonl holds no prompts: nothing to evaluate"):
        evaluate(subset, answers, tmp_path / "eval7", EvaluateOptions(plots=False, prompts=empty, allow_partial=True))
    with pytest.raises(EvaluationError, match="no manifest beside it"):  # a file prompts did not write
        evaluate(subset, tmp_path / "p.jsonl", tmp_path / "eval3", EvaluateOptions(plots=False,
                                                                                  prompts=tmp_path / "p.jsonl"))


@pytest.mark.slow
def test_reference_mode_reproduces_the_published_sample_values(tmp_path):
    from polyalign.data.prepare import prepare
    from polyalign.data.records import read_records
    from tests.conftest import write_config

    sample = SHARED_DATA / "en" / "polyalign-sample" / "dist_sft_test.json"
    config = write_config(tmp_path / "data.yaml", [{"name": "polyalign_sample", "format": "llamafactory",
                                                    "path": str(sample), "split": "test", "language": "en"}],
                          length_unit="v1", dedup=False)
    prepare(config, tmp_path / "run", progress=False)
    records = read_records(tmp_path / "run" / "data" / "test.jsonl")
    assert len(records) == 2000
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: first_sentence(r.context or r.question))
    result = evaluate(tmp_path / "run" / "data" / "test.jsonl", tmp_path / "p.jsonl", tmp_path / "eval",
                      EvaluateOptions(compat="reference", plots=False))
    human = result["metrics"]["diversity"]["overall"]["human"]
    published = {"distinct_1": 0.13231752307499547, "distinct_2": 0.6982111985322654,
                 "distinct_3": 0.9440411027425648, "self_bleu_4": 0.058781246156817644}
    for key, value in published.items():
        assert human[key] == pytest.approx(value, rel=1e-6), key
    print(f"\nfirst-sentence baseline: F1 {result['metrics']['utility']['overall']['qa_f1']:.4f}, ROUGE-L "
          f"{result['metrics']['utility']['overall']['rouge_l_f1']:.4f}, TDM "
          f"{result['metrics']['tdm']['overall_macro']:.4f}, {result['config']['seconds']} s")


@pytest.mark.slow
def test_featurizer_and_scorer_add_mauve_and_lm_features(demo_run, demo_tokenizer, tmp_path, capfd):
    from polyalign.data.records import read_records
    from polyalign.model import create_model, save_hf_checkpoint
    from tests.conftest import tiny_model_config

    run, _, _ = demo_run
    tokenizer = demo_tokenizer[0]
    directory = tokenizer.path.parent
    save_hf_checkpoint(create_model(tiny_model_config(tokenizer.vocab_size)), tmp_path / "ckpt", extra_files={
        name: (directory / name).read_bytes() for name in ("tokenizer.model", "tokenizer_config.json")})
    records = [r for r in read_records(run / "data" / "test.jsonl") if r.bucket_id == "en|multi|dialogue|short"][:40]
    subset = tmp_path / "records.jsonl"
    subset.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: r.question)
    # as `generate` records them: these answers came from the checkpoint that is also the featurizer below
    (tmp_path / "p.manifest.json").write_text(json.dumps({"settings": {"checkpoint": str(tmp_path / "ckpt")}}))
    plain = evaluate(subset, tmp_path / "p.jsonl", tmp_path / "plain", EvaluateOptions(plots=False))
    full = evaluate(subset, tmp_path / "p.jsonl", tmp_path / "full", EvaluateOptions(featurizer=tmp_path / "ckpt",
                                                                                     scorer=tmp_path / "ckpt",
                                                                                     plots=False))
    mauve = full["metrics"]["mauve"]
    assert mauve["status"] == "computed" and 0 < mauve["global"] <= 1
    assert set(mauve["by_bucket"]) == {"en|multi|dialogue|short"}
    # 40 answers are too few for faiss's k-means: its warnings become one note, not lines on the terminal
    assert "WARNING clustering" not in capfd.readouterr().err
    assert re.match(r"faiss warned (1 time|([2-9]|\d\d+) times) that", mauve["note"]) and "noisy" in mauve["note"]
    # the featurizer is the model that answered: said, since its hidden states favour its own answers
    from polyalign.evaluate.run import FEATURIZER_IS_MODEL

    assert mauve["featurizer_note"] == FEATURIZER_IS_MODEL and "featurizer_note" not in plain["metrics"]["mauve"]
    # Another file of answers to the same records reads the featurizer's vectors of people's and the no-model
    # answers that the evaluation before kept (its own answers are the echo baseline's: read from it, too),
    # and equals the same evaluation with nothing kept
    from polyalign.evaluate import run as evaluation

    _write_predictions(tmp_path / "q.jsonl", records, lambda r: first_sentence(r.context or r.question) + " ok")
    with_featurizer = EvaluateOptions(featurizer=tmp_path / "ckpt", plots=False)
    evaluate(subset, tmp_path / "p.jsonl", tmp_path / "p_kept", with_featurizer)
    kept = evaluate(subset, tmp_path / "q.jsonl", tmp_path / "q_kept", with_featurizer)["metrics"]
    evaluation._human_sides.clear()
    afresh = evaluate(subset, tmp_path / "q.jsonl", tmp_path / "q_afresh", with_featurizer)["metrics"]
    assert kept["mauve"]["global"] is not None and kept["detectability"]["hidden_states"]["overall_macro"] is not None
    assert kept == afresh
    assert full["config"]["trained"] == {"checkpoint": str(tmp_path / "ckpt")}  # no training run around it
    assert full["metrics"]["bng"]["overall_macro"] != plain["metrics"]["bng"]["overall_macro"]  # 43 more features
    assert full["metrics"]["aggregate"]["overall"] is not None
    # these answers are the echo_question baseline's: its reference row's TDM, MAUVE, NUF and aggregate, which
    # have no human floor, are computed as the model's and equal them (with and without a featurizer)
    for result in (plain, full):
        m = result["metrics"]
        echo = m["reference_rows"]["echo_question"]
        assert m["tdm"]["overall_macro"] is not None and m["nuf"]["overall"]["hypervolume"] is not None
        assert (echo["tdm_macro"], echo["nuf_hypervolume"], echo["mauve"]) == (
            m["tdm"]["overall_macro"], m["nuf"]["overall"]["hypervolume"], m["mauve"]["global"])
        # F1 is summed in another order there (a weighted mean over buckets)
        assert echo["aggregate"] == pytest.approx(m["aggregate"]["overall"], rel=1e-12)
        parts = m["aggregate"]["parts"]
        assert {k for k, v in echo["aggregate_parts"].items() if v is not None} == {k for k, v in parts.items()
                                                                                      if v is not None}
        assert all(v == pytest.approx(parts[k], rel=1e-12) for k, v in echo["aggregate_parts"].items() if v)
        # the same answers, the same bootstrap draws: the same intervals, which hold their estimates
        assert echo["tdm_macro_interval"] == m["tdm"]["macro_interval"]
        assert echo["nuf_hypervolume_interval"] == m["nuf"]["overall"]["hypervolume_interval"]
        assert echo["aggregate_interval"] == pytest.approx(m["aggregate"]["interval"], rel=1e-9)
        for value, (low, high) in ((m["tdm"]["overall_macro"], m["tdm"]["macro_interval"]),
                                   (m["nuf"]["overall"]["hypervolume"], m["nuf"]["overall"]["hypervolume_interval"]),
                                   (m["aggregate"]["overall"], m["aggregate"]["interval"])):
            assert low < value < high
        first = m["reference_rows"]["first_sentence"]
        assert first["tdm_macro"] != echo["tdm_macro"] and first["aggregate"] is not None
    # the featurizer's hidden states are a second detectability representation; without it, none
    hidden = full["metrics"]["detectability"]["hidden_states"]
    assert hidden["buckets"] == 1 and 0.0 <= hidden["overall_macro"] <= 1.0 and hidden["floor_macro"] is not None
    from polyalign.cli import _hidden_states_line  # evaluate's console says it, as the n-gram one
    from polyalign.core.scores import interval_text

    assert _hidden_states_line(hidden) == (
        f"detectability on the featurizer's hidden states: {hidden['overall_macro']:.4f}"
        + (f" {interval_text(hidden['macro_interval'])}" if hidden.get("macro_interval") else "")
        + f" over 1 bucket, against a human floor of {hidden['floor_macro']:.4f}"
        + (f" {interval_text(hidden['floor_macro_interval'])}" if hidden.get("floor_macro_interval") else ""))
    assert _hidden_states_line({}) is None
    assert "hidden_states" not in plain["metrics"]["detectability"]


@pytest.mark.parametrize("mode", [
    [],
    ["--support", "{run}/data/train.jsonl", "--references", "{run}/stats/references.json"],
    ["--no-diversity", "--no-baselines", "--no-detectability"],
    ["--compat", "reference"],
    ["--compat", "reference", "--references", "{run}/stats/references.json"],
    ["--compat", "reference", "--no-diversity"],
], ids=["default", "support-references", "no-diversity", "reference", "reference-references", "reference-no-diversity"])
def test_every_evaluate_mode_writes_its_report_from_the_command_line(demo_run, tmp_path, mode, capsys):
    """`polyalign evaluate` as a user runs it, in each mode: exit 0, one summary line, metrics.json and a
    self-contained report.html (the paper's mode, --compat reference, with and without --references)."""
    from polyalign.cli import main
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    records = read_records(run / "data" / "test.jsonl")[:400]
    subset = tmp_path / "test.jsonl"
    subset.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: first_sentence(r.context or r.question))
    out = tmp_path / "eval"
    args = ["evaluate", "--records", str(subset), "--predictions", str(tmp_path / "p.jsonl"), "--out", str(out),
            "--bootstrap-draws", "20", *(a.format(run=run) for a in mode)]
    assert main(args) == 0, capsys.readouterr().err
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err and f"{len(records)} rows: F1 " in printed.out
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["config"]["compat"] == ("reference" if "reference" in mode else "cjk")
    assert saved["alignment"]["evaluated"] == len(records)
    # docs/evaluation.md's layout of metrics.json names every key these sections hold
    layout = (REPO / "docs" / "evaluation.md").read_text(encoding="utf-8").split("## EVAL/metrics.json")[1]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    unnamed = [f"{section}.{key}" for section in ("config", "alignment", "answers", "metrics")
               for key in saved[section] if not re.search(rf"\b{key}\b", layout)]
    assert [key for key in saved if not re.search(rf"\b{key}\b", layout)] + unnamed == []
    page = (out / "report.html").read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page and "<h2>Overall</h2>" in page
    assert ("<h2>Diversity</h2>" in page) == ("--no-diversity" not in mode)
    assert ("<h2>Per bucket</h2>" in page) == ("reference" not in mode)
    detects = "reference" not in mode and "--no-detectability" not in mode
    assert saved["metrics"]["detectability"]["status"] == ("computed" if detects else "skipped")
    assert ("Detectability per bucket" in page or "detectability.png" in page) == detects
    assert ("detectability (classifier AUC" in printed.out) == detects
    references = saved["metrics"]["reference_rows"]
    if "reference" not in mode and "--no-baselines" not in mode:
        # the no-model answers' TDM and aggregate (no human floor for them) in a line and in the report's table;
        # these predictions are the first_sentence baseline's answers, so its row equals the model's numbers
        m, first = saved["metrics"], references["first_sentence"]
        assert first["tdm_macro"] == m["tdm"]["overall_macro"]
        assert first["aggregate"] == pytest.approx(m["aggregate"]["overall"], rel=1e-12)  # F1 summed in another order
        parts = m["aggregate"]["parts"]
        from polyalign.core.scores import interval_text as said

        assert (f"TDM {m['tdm']['overall_macro']:.4f} {said(m['tdm']['macro_interval'])}, MAUVE skipped" in printed.out)
        assert (f"aggregate {m['aggregate']['overall']:.4f} {said(m['aggregate']['interval'])} (geometric mean of F1 "
                f"{parts['f1']:.4f}, 1/(1+BNG) {parts['bng']:.4f}, NUF {parts['nuf']:.4f})") in printed.out
        echo = references["echo_question"]
        silent = references["empty_answer"]
        assert (f"no-model answers, measured as the model's: echo_question TDM {echo['tdm_macro']:.4f} "
                f"{said(echo['tdm_macro_interval'])}, aggregate {echo['aggregate']:.4f} "
                f"{said(echo['aggregate_interval'])}; first_sentence TDM {first['tdm_macro']:.4f} "
                f"{said(first['tdm_macro_interval'])}, aggregate {first['aggregate']:.4f} "
                f"{said(first['aggregate_interval'])}; empty_answer TDM {silent['tdm_macro']:.4f} "
                f"{said(silent['tdm_macro_interval'])}, aggregate {silent['aggregate']:.4f} "
                f"{said(silent['aggregate_interval'])}\n") in printed.out
        # saying nothing: F1 only where people said nothing too, and every answer without a feature of text
        records_by_id = {r.id: r for r in records}
        assert silent["f1"] == pytest.approx(sum(not tokens(r.response, "cjk") for r in records_by_id.values())
                                             / len(records), abs=1e-12)
        # the no-model answers said to do better are exactly those whose interval lies wholly on the better
        # side of the model's, on the aggregate (higher better) or BNG macro (lower better); never its own answers
        ahead = {name for name, row in references.items() if name != "human" and (
            row["aggregate_interval"][0] > m["aggregate"]["interval"][1]
            or row["bng_macro_interval"][1] < m["bng"]["macro_interval"][0])}
        assert "first_sentence" not in ahead
        warned = [line for line in printed.err.splitlines() if "answers that need no model do better" in line]
        assert len(warned) == bool(ahead) and all(f" {name} " in "".join(warned) for name in ahead)
        assert ("Answers that need no model do better" in page) == bool(ahead)
        assert "<th>NUF hypervolume</th><th>aggregate</th>" in page
        assert f"<td>{first['aggregate']:.4f} {said(first['aggregate_interval'])}</td>" in page
        assert (f"<td>Aggregate</td><td>{m['aggregate']['overall']:.4f} {said(m['aggregate']['interval'])}</td>"
                in page)
    else:
        assert "no-model answers" not in printed.out and "tdm_macro" not in str(references)
    bng = saved["metrics"]["bng"]
    if bng.get("macro_interval"):  # the summary line's BNG and HCR with their intervals, as the report writes them
        from polyalign.core.scores import interval_text

        hcr = saved["metrics"]["hcr"]

        def floor(section):  # no interval where a bucket's floor has one held-out outcome (no --support)
            interval = section["floor_macro_interval"]
            return f"{section['floor_macro']:.4f}" + (f" {interval_text(interval)}" if interval else "")

        assert (f"BNG {bng['overall_macro']:.4f} {interval_text(bng['macro_interval'])}, HCR "
                f"{hcr['overall_macro']:.4f} {interval_text(hcr['macro_interval'])} (human floor: BNG "
                f"{floor(bng)}, HCR {floor(hcr)})") in printed.out
        if "--support" in mode:  # the test answers against the support: bootstrap draws, as the model's
            assert bng["floor_macro_interval"][0] <= bng["floor_macro"] <= bng["floor_macro_interval"][1]
    if detects:  # the floor said as the mean of its halvings, with their range, in the summary line and the report
        detect = saved["metrics"]["detectability"]
        low, high = detect["floor_macro_spread"]
        assert low <= detect["floor_macro"] <= high and detect["floor_halvings"] == 8
        assert f"(mean of 8 halvings of the people, {low:.4f} to {high:.4f})" in printed.out
        if detect["floor_buckets"] < detect["buckets"]:  # one-answer buckets: the gap over the floor's buckets
            assert (f"; people have a floor in {detect['floor_buckets']} of the {detect['buckets']} buckets (the "
                    f"others hold too few answers to halve), and in those the model reads "
                    f"{detect['macro_floored']:.4f}") in printed.out
        assert detect["gap_macro"] == pytest.approx(detect["macro_floored"] - detect["floor_macro"])
        assert "(the mean of 8 random halvings of the people; one halving alone ranged" in page


def _subset(run, tmp_path, keep):
    records = [r for r in read_records_of(run / "data" / "test.jsonl") if keep(r)]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    return path, records


def read_records_of(path):
    from polyalign.data.records import read_records

    return read_records(path)


def test_empty_answers_are_counted_and_left_out_of_diversity(demo_run, tmp_path, capsys):
    """Every fifth answer empty: the summary line, metrics.json and the report count them; Distinct-n and
    Self-BLEU are those of the non-empty answers alone (people's empty answers too); with one non-empty
    answer they are undefined; --compat reference keeps them, as the authors' code does."""
    from polyalign.cli import main
    from polyalign.evaluate.text_metrics import diversity

    run, _, _ = demo_run
    records_path, records = _subset(run, tmp_path, lambda r: True)
    records = records[:200]
    records_path.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    # every fifth empty, and every seventh (not fifth) punctuation alone, as a degenerate model writes it
    answer = {r.id: "" if i % 5 == 0 else "，，，" if i % 7 == 3 else first_sentence(r.context or r.question)
              for i, r in enumerate(records)}
    wordless = sum(1 for i in range(200) if i % 5 and i % 7 == 3)
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: answer[r.id])
    assert main(["evaluate", "--records", str(records_path), "--predictions", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "eval"), "--bootstrap-draws", "20", "--no-baselines"]) == 0
    # the empty answers to people who said nothing too are no model's fault: counted apart
    as_people = sum(1 for i, r in enumerate(records) if i % 5 == 0 and not r.response.strip())
    where = f" ({as_people} where people's answer is empty too)" if as_people else ""
    assert (f"200 rows (40 empty answers{where} and {wordless} answers without a word (punctuation only), left out "
            "of diversity)") in capsys.readouterr().out
    saved = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert saved["answers"]["empty"] == 40 and saved["answers"]["empty_ids"][0] == records[0].id
    assert saved["answers"]["without_words"] == wordless and saved["answers"]["empty_as_people"] == as_people
    # ROUGE-L and EM carry intervals, resampled as F1's (they had none: a number with nothing to read it by)
    utility = saved["metrics"]["utility"]["overall"]
    for key in ("rouge_l_f1", "em", "qa_f1"):
        low, high = utility[f"{key}_interval"]
        assert low <= utility[key] <= high and (high > low or utility[key] in (0.0, 1.0)), key
    assert utility["rouge_l_f1_interval"][1] > utility["rouge_l_f1_interval"][0]
    overall = saved["metrics"]["diversity"]["overall"]
    assert overall["generated"] == pytest.approx(diversity([a for a in answer.values() if a and a != "，，，"], "cjk"))
    assert overall["human"] == pytest.approx(diversity([r.response for r in records if r.response.strip()], "cjk"))
    assert overall["generated_empty"] == 40 + wordless
    assert "<b>40 of 200 answers are empty</b>" in (tmp_path / "eval" / "report.html").read_text()
    assert main(["evaluate", "--records", str(records_path), "--predictions", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "eval_ref"), "--compat", "reference"]) == 0
    printed = capsys.readouterr()
    # SQuAD's normalisation there drops ASCII punctuation only: "，，，" is a word to it
    assert f"200 rows (40 empty answers{where}, kept in diversity, as the authors' code does)" in printed.out
    # a progress bar over the evaluation's parts (a log line each off a terminal), none with --no-progress
    assert "evaluate: 8/8" in printed.err and "report" in printed.err.splitlines()[-1]
    # a comparison's "empty answers" row says the punctuation-only answers too (it read 0 beside 18 of them)
    assert main(["report", str(tmp_path / "eval"), str(tmp_path / "eval_ref"), "--out", str(tmp_path / "cmp")]) == 0
    row = next(line for line in (tmp_path / "cmp" / "report.md").read_text().splitlines() if "empty answers" in line)
    assert f"; {wordless} of punctuation alone" in row.split("|")[2], row
    # a model that says nothing, compared: every difference with it is marked, and the note says why
    _write_predictions(tmp_path / "silent.jsonl", records, lambda r: "")
    assert main(["evaluate", "--records", str(records_path), "--predictions", str(tmp_path / "silent.jsonl"),
                 "--out", str(tmp_path / "eval_silent"), "--bootstrap-draws", "20", "--no-baselines",
                 "--no-detectability", "--no-progress"]) == 0
    assert main(["report", str(tmp_path / "eval"), str(tmp_path / "eval_silent"), "--out", str(tmp_path / "cmp2"),
                 "--names", "model", "silent"]) == 0
    said = (tmp_path / "cmp2" / "report.md").read_text()
    pair = next(line for line in said.splitlines() if line.startswith("| silent - model |"))
    assert all(cell.strip() in ("—", "") or cell.strip().endswith("§") for cell in pair.split("|")[2:-1]), pair
    assert "§ a run whose answers mostly hold no word (silent: 200 of 200 answers): its numbers measure silence" in said
    # each run's own notes after the overall table (a note every run shares stays with the settings)
    before, after = said.split("## Overall", 1)
    assert "Every run: TDM is over" in before and "silent: the BNG and HCR macros count" not in before
    assert "\nsilent: the BNG and HCR macros count" in after.split("## Notes on each run")[1]
    capsys.readouterr()
    assert main(["evaluate", "--records", str(records_path), "--predictions", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "eval_ref2"), "--compat", "reference", "--no-progress", "--no-diversity"]) == 0
    assert "evaluate:" not in capsys.readouterr().err
    reference = evaluate(records_path, tmp_path / "p.jsonl", tmp_path / "ref", EvaluateOptions(compat="reference",
                                                                                               plots=False))
    assert reference["metrics"]["diversity"]["overall"]["generated"] == pytest.approx(
        diversity(list(answer.values()), "reference"))
    # one non-empty answer: no diversity to speak of
    _write_predictions(tmp_path / "one.jsonl", records, lambda r: "Yes." if r.id == records[3].id else "")
    result = evaluate(records_path, tmp_path / "one.jsonl", tmp_path / "one",
                      EvaluateOptions(intervals=IntervalOptions(draws=10), baselines=False))
    overall = result["metrics"]["diversity"]["overall"]
    assert overall["generated"]["self_bleu_4"] is None and overall["generated_reason"].startswith("undefined: 1")
    assert "n/a (undefined: 1 answer with a word (needs 2))" in (tmp_path / "one" / "report.html").read_text()


def test_small_buckets_get_no_interval_or_gap_and_every_na_says_why(demo_run, tmp_path, capsys):
    from polyalign.cli import main

    run, _, _ = demo_run
    records_path, records = _subset(run, tmp_path, lambda r: r.track == "single")
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: first_sentence(r.context or r.question))
    result = evaluate(records_path, tmp_path / "p.jsonl", tmp_path / "eval",
                      EvaluateOptions(intervals=IntervalOptions(draws=20)))
    buckets = result["metrics"]["buckets"]
    small = sorted(b for b, r in buckets.items() if r["rows"] < 5)
    assert small and result["metrics"]["bng"]["small_buckets"] == small
    for bucket in small:
        r = buckets[bucket]
        assert r["bng_interval"] is None and r["hcr_interval"] is None and r["bng_gap"] is None
        assert r["too_small"].endswith("fewer than 5: no interval or gap") and r["bng"] is not None
    assert all(r["bng_interval"] for r in buckets.values() if r["rows"] >= 5)
    assert set(small) <= set(result["metrics"]["bng"]["floor_by_bucket"])
    assert not set(small) & set(result["metrics"]["bng"]["gap_by_bucket"])
    page = (tmp_path / "eval" / "report.html").read_text()
    assert f"{len(small)} {'bucket has' if len(small) == 1 else 'buckets have'} fewer than 5 test rows" in page
    # each small bucket's row marks its numbers, and the note under the table says what the mark means
    assert "<p>* fewer than 5 test rows: no interval or gap.</p>" in page
    for bucket in small:
        row = page.split(f"<tr><td>{bucket}</td>")[1].split("</tr>")[0]
        assert f"<td>{buckets[bucket]['bng']:.4f} *</td>" in row and "<td>*</td>" in row, row
    # no multi-turn rows: TDM is n/a and says why; MAUVE says why it was skipped
    assert result["not_available"]["tdm"] == "no multi-turn test rows"
    # a comparison's overall table says so in each run's cell, as one evaluation's report does (it showed a
    # bare dash)
    from polyalign.reports.evaluation import compare

    shutil.copytree(tmp_path / "eval", tmp_path / "again")
    compare([tmp_path / "eval", tmp_path / "again"], tmp_path / "cmp", names=["first", "again"])
    tdm = next(line for line in (tmp_path / "cmp" / "report.md").read_text().splitlines() if line.startswith("| TDM"))
    assert tdm.endswith(" | n/a (no multi-turn test rows) | n/a (no multi-turn test rows) | — |"), tdm
    assert main(["evaluate", "--records", str(records_path), "--predictions", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "ref"), "--compat", "reference"]) == 0
    out = capsys.readouterr().out
    assert "TDM n/a (no multi-turn test rows)" in out and "MAUVE skipped (no --featurizer model was given)" in out
    assert "detectability skipped (--compat reference computes the authors' metrics only)" in out
    # every headline number that is missing says why, the NUF hypervolume too (it showed "— —" alone)
    reference = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    assert (reference["metrics"]["nuf"]["overall"]["hypervolume"] is None) == ("nuf" in reference["not_available"])
    from polyalign.evaluate.run import not_available_reasons
    unmeasured = {"bng": {"overall_macro": None}, "tdm": {"overall_macro": 0.5}, "mauve": {"status": "computed"},
                  "detectability": {"status": "computed", "overall_macro": 0.6}, "utility": {"overall": {"qa_f1": 0.1}},
                  "aggregate": {"overall": None}, "nuf": {"overall": {"hypervolume": None}}}
    assert not_available_reasons(unmeasured, "reference")["nuf"] == (
        "no bucket's BNG is measured (no bucket has 20 test rows, the least --compat reference measures)")


def test_a_scorer_beside_a_support_is_refused_before_any_work(demo_run, tmp_path, capsys):
    from polyalign.cli import main

    run, _, _ = demo_run
    records_path, records = _subset(run, tmp_path, lambda r: r.track == "single")
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: first_sentence(r.context or r.question))
    assert main(["evaluate", "--records", str(records_path), "--predictions", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "eval"), "--support", str(run / "data" / "train.jsonl"), "--scorer",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--scorer and --support cannot be combined" in err and "drop --support" in err and "Traceback" not in err
    assert not (tmp_path / "eval").exists()


def test_report_names_the_settings_that_differ(demo_run, tmp_path, capsys):
    from polyalign.cli import main

    run, _, _ = demo_run
    records_path, records = _subset(run, tmp_path, lambda r: r.track == "single")
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: first_sentence(r.context or r.question))
    for name, extra in (("a", {}), ("b", {"support": run / "data" / "train.jsonl"}),
                        ("c", {"compat": "reference"})):
        evaluate(records_path, tmp_path / "p.jsonl", tmp_path / name, EvaluateOptions(plots=False, **extra))
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"), "--out",
                 str(tmp_path / "cmp")]) == 0
    note = capsys.readouterr().out.splitlines()[0]
    assert note.startswith("note: the runs differ in ")
    assert "compat: cjk | cjk | reference" in note and "support: the test records' own answers | train.jsonl (" in note
    assert "intervals: 200 draws, seed 0 | 200 draws, seed 0 | none" in note and "test rows" not in note
    assert "compat: cjk | cjk | reference" in (tmp_path / "cmp" / "report.html").read_text()
    assert "featurizer" not in note  # none ran in any
    # a run named as one of the rows people and the no-model answers have in the report is refused, given or
    # taken from its folder's name (two rows named "human" read as one)
    shutil.copytree(tmp_path / "a", tmp_path / "human")
    for command in (["--names", "echo_question", "b"], []):
        first = [str(tmp_path / "b"), str(tmp_path / "human")] if not command else [str(tmp_path / "a"),
                                                                                    str(tmp_path / "b")]
        assert main(["report", *first, "--out", str(tmp_path / "cmp2"), *command]) == 2
        err = capsys.readouterr().err
        assert f"a run named {'echo_question' if command else 'human'!r}, a name the report gives a row of its own" \
            in err and "name the runs with --names" in err
    assert not (tmp_path / "cmp2").exists()
    # another featurizer is another measure of MAUVE and hidden-state detectability: said as a setting
    from polyalign.reports.evaluation import differing_settings

    runs = {n: json.loads((tmp_path / n / "metrics.json").read_text()) for n in "ab"}
    runs["b"]["config"]["featurizer"] = "/runs/demo/sft/model"
    assert "featurizer: none | /runs/demo/sft/model" in differing_settings(runs)
    # The overall table: each run's number with its interval, and people's own number (the human floor)
    # beside it, one where every run measured people alike, each run's where they did not.
    metrics = {n: json.loads((tmp_path / n / "metrics.json").read_text())["metrics"] for n in "abc"}
    rows = {line.split(" | ")[0].strip("| "): [c.strip(" |") for c in line.split(" | ")[1:]]
            for line in (tmp_path / "cmp" / "report.md").read_text().splitlines() if line.startswith("| ")}
    assert rows["metric (value [interval])"] == ["a", "b", "c", "human floor (people's own answers)"]

    def shown(value, interval=None):  # intervals rounded outward (interval_text)
        low, high = (math.floor(interval[0] * 1000 + 1e-9) / 1000, math.ceil(interval[1] * 1000 - 1e-9) / 1000) \
            if interval else (None, None)
        return f"{value:.4f}" + (f" [{low:.3f}, {high:.3f}]" if interval else "")

    def human(cells):
        return cells[0] if len(set(cells)) == 1 else "; ".join(f"{n}: {c}" for n, c in zip("abc", cells))

    for name, key in (("BNG macro (lower is more human-like)", "bng"),
                      ("HCR macro (higher is more human-like; people's floor is the mark)", "hcr")):
        assert rows[name][:3] == [shown(metrics[n][key]["overall_macro"], metrics[n][key].get("macro_interval"))
                                  for n in "abc"], name
        # the paper's mode (c) measures no floor; the others' floors have their intervals
        assert rows[name][3] == human([shown(metrics[n][key]["floor_macro"], metrics[n][key]["floor_macro_interval"])
                                       if "floor_macro" in metrics[n][key] else "—" for n in "abc"]), name
    # another support measures people against other answers: their BNG differs, and the table says whose
    assert metrics["a"]["bng"]["floor_macro"] != metrics["b"]["bng"]["floor_macro"]
    people = [metrics[n]["diversity"]["overall"] for n in "abc"]  # c counts words as the paper's code does
    distinct = rows["Distinct-2 (higher is more diverse; people's own is the mark)"]
    assert distinct[3] == human([shown(p["human"]["distinct_2"], (p.get("human_interval") or {}).get("distinct_2"))
                                 for p in people])
    assert rows["F1 (higher is better)"][3] == "—" and rows["Aggregate"][3] == "—"


def test_report_compares_aggregates_over_the_parts_every_run_measured(demo_run, tmp_path, capsys):
    """The aggregate is the geometric mean of the parts measured; an evaluation with MAUVE beside one
    without is compared over the parts both have (the same answers score the same), and runs that
    measured the same parts keep their own aggregate."""
    import shutil

    from polyalign.cli import main
    from polyalign.core.scores import combined, interval_text
    from polyalign.evaluate import naturalness as nat

    run, _, _ = demo_run
    records_path, records = _subset(run, tmp_path, lambda r: r.track == "single")
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: first_sentence(r.context or r.question))
    result = evaluate(records_path, tmp_path / "p.jsonl", tmp_path / "plain", EvaluateOptions(plots=False))
    metrics = result["metrics"]
    parts = nat.aggregate_parts(metrics["utility"]["overall"]["qa_f1"], metrics["bng"]["overall_macro"], None,
                                metrics["nuf"]["overall"]["hypervolume"])
    aggregate = metrics["aggregate"]
    assert (aggregate["overall"], aggregate["parts"]) == (combined(parts), parts) and parts["mauve"] is None
    low, high = aggregate["interval"]
    assert low < aggregate["overall"] < high
    # the same answers evaluated with a featurizer: MAUVE joins the aggregate
    shutil.copytree(tmp_path / "plain", tmp_path / "mauve")
    with_mauve = json.loads((tmp_path / "mauve" / "metrics.json").read_text())
    with_mauve["metrics"]["aggregate"]["parts"]["mauve"] = 0.05
    with_mauve["metrics"]["aggregate"]["overall"] = combined(with_mauve["metrics"]["aggregate"]["parts"])
    with_mauve["metrics"]["nuf"]["naturalness_components"] = ["1/(1+BNG)", "C-MAUVE"]  # NUF measured otherwise
    with_mauve["metrics"]["mauve"]["featurizer_note"] = "the featurizer is the model whose answers are measured"
    (tmp_path / "mauve" / "metrics.json").write_text(json.dumps(with_mauve))
    # the summary line says the interval leaves MAUVE's noise out where MAUVE is a part, and only there
    from polyalign.cli import _aggregate_parts

    assert _aggregate_parts(with_mauve["metrics"]["aggregate"]).endswith(
        f"MAUVE 0.0500, NUF {parts['nuf']:.4f}; its interval holds MAUVE at this value: MAUVE's own noise is not "
        "in it)")
    assert "MAUVE" not in _aggregate_parts(aggregate)
    assert main(["report", str(tmp_path / "plain"), str(tmp_path / "mauve"), "--out", str(tmp_path / "cmp")]) == 0
    row = next(line for line in (tmp_path / "cmp" / "report.md").read_text().splitlines() if "Aggregate" in line)
    value = f"{combined(parts, ['f1', 'bng']):.4f}"
    assert row.split("|")[1:4] == [" Aggregate over F1, BNG (the parts every run measured alike) ", f" {value} ",
                                   f" {value} "], row
    # the hypervolumes, two measures of one name, each say their naturalness axis
    hypervolume = (f"{metrics['nuf']['overall']['hypervolume']:.4f} "
                   f"{interval_text(metrics['nuf']['overall']['hypervolume_interval'])}")
    nuf = next(line for line in (tmp_path / "cmp" / "report.md").read_text().splitlines() if "NUF" in line)
    assert nuf.split("|")[2:4] == [f" {hypervolume} (naturalness: 1/(1+BNG)) ",
                                   f" {hypervolume} (naturalness: 1/(1+BNG) + C-MAUVE) "], nuf
    value = f"{combined(parts):.4f}"
    # the same parts measured: each run's own aggregate, under its own name
    shutil.copytree(tmp_path / "plain", tmp_path / "again")
    assert main(["report", str(tmp_path / "plain"), str(tmp_path / "again"), "--out", str(tmp_path / "same")]) == 0
    row = next(line for line in (tmp_path / "same" / "report.md").read_text().splitlines() if "Aggregate" in line)
    value += f" {interval_text(metrics['aggregate']['interval'])}"  # each run's own aggregate: its own interval
    assert row.split("|")[1:4] == [" Aggregate ", f" {value} ", f" {value} "], row
    assert "(naturalness:" not in (tmp_path / "same" / "report.md").read_text()
    # the same answers evaluated twice: said, so that a row of +0.0000 is not read as two equal models
    assert "<b>plain and again evaluated the same answers</b>" in (tmp_path / "same" / "report.html").read_text()
    # a run whose featurizer was its own model: its MAUVE reads its answers kindly, said first in the comparison
    own = "<b>mauve was measured with its own model or a model of its lineage as the MAUVE featurizer</b>"
    assert own in (tmp_path / "cmp" / "report.html").read_text()
    assert "as the MAUVE featurizer" not in (tmp_path / "same" / "report.html").read_text()
    # ... and it is the comparison's first reading too, where the aggregate it moves is read
    assert ("- MAUVE, hidden-state detectability and the aggregate favour some runs: mauve was measured with its own "
            "model or a model of its lineage as the MAUVE featurizer.") in (tmp_path / "cmp" / "report.md").read_text()
    # report.md says what report.html says: every warning (bold) of either page is in the other (the featurizer
    # and same-answers warnings were in the HTML page alone)
    import html
    import re

    for compared in ("cmp", "same"):
        page, markdown = ((tmp_path / compared / name).read_text() for name in ("report.html", "report.md"))
        warnings = re.findall(r"<b>(.*?)</b>", page, re.S)
        assert warnings and all(html.unescape(text) in markdown for text in warnings), compared


def test_report_does_not_call_differences_supported_between_other_records_or_supports(demo_run, tmp_path, capsys):
    from polyalign.cli import main

    run, _, _ = demo_run
    single, records = _subset(run, tmp_path, lambda r: r.track == "single")
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: first_sentence(r.context or r.question))
    (tmp_path / "fewer").mkdir()
    fewer = tmp_path / "fewer" / "test.jsonl"
    fewer.write_text("".join(line for line in single.read_text().splitlines(keepends=True)[:-20]))
    # The report's verdicts read BNG; detectability's classifiers (about 1 s an evaluation) are not needed.
    options = EvaluateOptions(plots=False, allow_partial=True, detectability=False)
    evaluate(single, tmp_path / "p.jsonl", tmp_path / "a", options)
    evaluate(single, tmp_path / "p.jsonl", tmp_path / "same", options)
    evaluate(single, tmp_path / "p.jsonl", tmp_path / "support",
             dataclasses.replace(options, support=run / "data" / "train.jsonl"))
    evaluate(fewer, tmp_path / "p.jsonl", tmp_path / "records", options)
    folders = [str(tmp_path / n) for n in ("a", "same", "support", "records")]
    assert main(["report", *folders, "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert ("note: support, records evaluated other test records or another support than a: their intervals are "
            "not compared (--allow-different-data compares them; runs evaluated with --allow-partial on other ids "
            "compare once each is evaluated on the records all of them answered: `polyalign evaluate ... "
            "--common-with` and every run's predictions file)") in out
    verdicts = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["summary"]["differences"]
    # every pair, the later run minus the earlier
    assert list(verdicts) == ["same - a", "support - a", "records - a", "support - same", "records - same",
                              "records - support"]
    small = json.loads((tmp_path / "a" / "metrics.json").read_text())["metrics"]["bng"]["small_buckets"]
    assert verdicts["same - a"]["BNG weighted"] == {"difference": 0.0, "verdict": "overlap"}
    assert verdicts["same - a"]["BNG macro"]["verdict"] == ("not judged †" if small else "overlap")
    assert verdicts["support - a"]["BNG weighted"]["verdict"] == "not compared: other support"
    # F1, diversity and detectability read the test rows alone: another support leaves them comparable
    assert verdicts["support - a"]["F1"]["verdict"] in ("overlap", "apart")
    assert verdicts["records - a"]["F1"]["verdict"] == "not compared: other test records"
    assert verdicts["records - a"]["BNG weighted"]["verdict"] == "not compared: other test records"
    assert main(["report", *folders, "--out", str(tmp_path / "cmp2"), "--allow-different-data"]) == 0
    assert "not compared" not in capsys.readouterr().out
    page = (tmp_path / "cmp2" / "report.md").read_text()
    assert "not compared" not in page and re.search(r"(overlap|apart) \(other test records\)", page)
    # two folders of one name get a column each, named by as much of their paths as tells them apart
    (tmp_path / "x").mkdir()
    shutil.copytree(tmp_path / "a", tmp_path / "x" / "a")
    assert main(["report", folders[0], str(tmp_path / "x" / "a"), "--out", str(tmp_path / "cmp3")]) == 0
    summary = json.loads((tmp_path / "cmp3" / "comparison.json").read_text())["summary"]
    assert summary["runs"] == [f"{tmp_path.name}/a", "x/a"]
    capsys.readouterr()
    assert main(["report", folders[0], folders[0] + "/", "--out", str(tmp_path / "cmp4")]) == 2
    assert "given more than once" in capsys.readouterr().err
    # an --allow-partial evaluation of the same file reads other rows of it: not compared with the whole,
    # compared with another partial evaluation of the same rows
    rows = (tmp_path / "p.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "part.jsonl").write_text("".join(rows[:-20]))
    for name in ("part", "part_again"):
        evaluate(single, tmp_path / "part.jsonl", tmp_path / name, options)
    parts = [str(tmp_path / n) for n in ("a", "part", "part_again")]
    assert main(["report", *parts, "--out", str(tmp_path / "cmp5")]) == 0
    verdicts = json.loads((tmp_path / "cmp5" / "comparison.json").read_text())["summary"]["differences"]
    assert verdicts["part - a"]["BNG weighted"]["verdict"] == "not compared: other test records"
    assert verdicts["part_again - part"]["BNG weighted"] == {"difference": 0.0, "verdict": "overlap"}


def test_intervals_are_shown_rounded_outward_so_they_hold_what_they_held():
    """For every interval the text's bounds hold the computed ones, and lie within one unit of the third
    decimal of them: a point estimate inside its interval is inside the interval shown."""
    from polyalign.core.scores import interval_text

    assert interval_text([0.99996, 1.0]) == "[0.999, 1.000]"  # to the nearest: [1.000, 1.000], beside 0.9999
    assert interval_text([0.025, 0.049]) == "[0.025, 0.049]"  # a bound on the grid stays there
    assert interval_text([-0.0004, 0.0004]) == "[-0.001, 0.001]"
    rng = np.random.default_rng(0)
    for low, high in np.sort(rng.uniform(-3, 3, (2000, 2)), axis=1):
        shown_low, shown_high = (float(x) for x in interval_text([low, high]).strip("[]").split(", "))
        assert shown_low <= low <= shown_low + 0.001 + 1e-12 and shown_high - 0.001 - 1e-12 <= high <= shown_high


def test_differences_are_judged_on_intervals_except_macros_over_buckets_without_spread():
    """Two runs' numbers are apart when their intervals do not overlap, overlap otherwise; a macro over
    buckets too small for an interval of their own is not judged (its interval leaves out their noise),
    while the row-weighted value is."""
    from polyalign.reports.evaluation import _differences

    def run(bng, small=()):
        return {"config": {"records": "r.jsonl"}, "made_from": {"records": "sha256:1"},
                "metrics": {"bng": {"overall_macro": bng, "macro_interval": [bng - 0.1, bng + 0.1],
                                    "overall_weighted": bng, "weighted_interval": [bng - 0.3, bng + 0.3],
                                    "small_buckets": list(small)},
                            "utility": {"overall": {}}, "diversity": {"overall": {}}}}

    _, _, verdicts = _differences({"a": run(1.0), "b": run(1.5), "c": run(1.5, ["en|single|qa|short"])}, False)
    assert verdicts["b - a"]["BNG macro"]["verdict"] == "apart"  # [0.9, 1.1] and [1.4, 1.6]
    assert verdicts["b - a"]["BNG weighted"]["verdict"] == "overlap"  # [0.7, 1.3] and [1.2, 1.8]
    assert verdicts["b - a"]["BNG macro"]["difference"] == pytest.approx(0.5)
    assert verdicts["c - a"]["BNG macro"]["verdict"] == "not judged †"
    assert verdicts["c - a"]["BNG weighted"]["verdict"] == "overlap"
    assert verdicts["c - b"]["BNG macro"] == {"difference": 0.0, "verdict": "not judged †"}
    assert verdicts["b - a"]["F1"] == {"difference": None, "verdict": "no interval"}
    # detectability likewise: its macro not judged beside few-row buckets, its row-weighted value judged (A 0.643
    # against B 0.938 on 241 rows had no verdict at all, two buckets of one row each silencing the macro)
    detect = {name: run(1.0, small) | {"metrics": run(1.0, small)["metrics"] | {"detectability": {
        "overall_macro": auc, "macro_interval": [auc - 0.05, auc + 0.05], "overall_weighted": auc,
        "weighted_interval": [auc - 0.03, auc + 0.03]}}} for name, auc, small in
        (("a", 0.643, ["zh|single|qa|long"]), ("b", 0.938, ["zh|single|qa|long"]))}
    _, _, verdicts = _differences(detect, False)
    assert verdicts["b - a"]["Detectability AUC macro"]["verdict"] == "not judged †"
    assert verdicts["b - a"]["Detectability AUC weighted"] == {"difference": pytest.approx(0.295), "verdict": "apart"}

    # the numbers that combine MAUVE hold it fixed in their draws: not judged where a run measured MAUVE;
    # TDM (buckets of 20 rows or more, no MAUVE) is judged beside few-row buckets
    def combining(value, mauve, small=()):
        metrics = run(1.0, small)["metrics"] | {
            "tdm": {"overall_macro": value, "macro_interval": [value - 0.01, value + 0.01]},
            "nuf": {"overall": {"hypervolume": value, "hypervolume_interval": [value - 0.01, value + 0.01]}},
            "aggregate": {"overall": value, "interval": [value - 0.01, value + 0.01]},
            "mauve": {"status": "computed" if mauve else "skipped"}}
        return run(1.0) | {"metrics": metrics}

    _, _, verdicts = _differences({"a": combining(0.2, False), "b": combining(0.3, False),
                                   "c": combining(0.3, True), "d": combining(0.3, False, ["zh|multi|dialogue|long"])},
                                  False)
    for name in ("TDM macro", "NUF hypervolume", "Aggregate"):
        assert verdicts["b - a"][name]["verdict"] == "apart", name
        assert verdicts["b - a"][name]["difference"] == pytest.approx(0.1)
    assert [verdicts["c - a"][name]["verdict"] for name in ("TDM macro", "NUF hypervolume", "Aggregate")] == [
        "apart", "not judged ‡", "not judged ‡"]
    assert [verdicts["d - a"][name]["verdict"] for name in ("TDM macro", "NUF hypervolume", "Aggregate")] == [
        "apart", "not judged †", "not judged †"]


def test_the_frontier_draws_the_area_each_run_dominates_and_names_its_naturalness_axis(tmp_path, monkeypatch):
    """A frontier is the edge of the area its points dominate (its hypervolume), a one-point frontier a
    box; the axis names C-MAUVE where a featurizer ran."""
    import matplotlib.pyplot as plt

    from polyalign.reports import evaluation

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    runs = {"a": {"frontier": [[0.1, 0.8], [0.3, 0.5]], "hypervolume": 0.14, "points": {}},
            "b": {"frontier": [[0.2, 0.6]], "hypervolume": 0.12, "points": {}}}
    evaluation._frontier(runs, tmp_path / "f.png", components={
        "a": {"naturalness_components": ["1/(1+BNG)", "C-MAUVE"]}, "b": {"naturalness_components": ["1/(1+BNG)"]}})
    ax = figures[0].axes[0]
    edges = [list(zip(*line.get_data())) for line in ax.lines]
    assert edges == [[(0.0, 0.8), (0.1, 0.8), (0.1, 0.5), (0.3, 0.5), (0.3, 0.0)],
                     [(0.0, 0.6), (0.2, 0.6), (0.2, 0.0)]]
    assert ax.get_ylabel() == ("naturalness (higher is more human-like)\n1/(1+BNG) or 1/(1+BNG) x C-MAUVE, "
                               "geometric mean")
    close(figures[0])


def test_the_frontiers_bucket_labels_do_not_overlap(tmp_path, monkeypatch):
    """Sixteen buckets of a small model sit within a few hundredths of each other: their names are moved
    apart (adjustText), each still tied to its point by a line."""
    import itertools

    import matplotlib.pyplot as plt

    from polyalign.reports import evaluation

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    rng = np.random.default_rng(0)
    buckets = [f"{lang}|{track}|{family}|{length}" for lang, track, family, length in
               itertools.product(("en", "zh"), ("single", "multi"), ("assistant", "dialogue"), ("short", "long"))]
    points = {b: {"utility": float(u), "naturalness": float(n)}
              for b, u, n in zip(buckets, rng.uniform(0.01, 0.05, 16), rng.uniform(0.35, 0.45, 16))}
    evaluation._frontier({"model": {"frontier": [], "hypervolume": 0.0, "points": points}}, tmp_path / "f.png",
                         label_points=True)
    fig = figures[0]
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in fig.axes[0].texts]
    assert sorted(t.get_text() for t in fig.axes[0].texts) == sorted(buckets)
    overlapping = [(a, b) for a, b in itertools.combinations(range(len(boxes)), 2) if boxes[a].overlaps(boxes[b])]
    assert overlapping == []
    close(fig)


def test_per_bucket_table_says_which_detectability_numbers_come_from_a_parent_group():
    """A bucket with too few prompts is classified within its parent group: its AUC cell names the pool,
    as the support column names a backed-off BNG pool; a bucket classified on its own reads as a number."""
    from polyalign.reports.evaluation import _bucket_table

    bucket = {"rows": 30, "pool": "en|single|qa", "backed_off": True, "pool_rows": 80, "bands": 3, "bng": 1.25}
    detect = {"en|single|qa|long": {"auc": 0.75, "pool": "en|single|qa", "backed_off": True},
              "en|single|qa|short": {"auc": 0.5, "pool": "en|single|qa|short", "backed_off": False}}
    page, _ = _bucket_table({b: bucket for b in detect}, detect)
    long_row, short_row = page.split("<tr>")[2:]
    assert long_row.startswith("<td>en|single|qa|long</td>") and short_row.startswith("<td>en|single|qa|short</td>")
    assert "<td>0.7500 (within en|single|qa)</td>" in long_row, long_row
    assert "<td>0.5000</td>" in short_row and "within" not in short_row, short_row


def test_per_bucket_charts_keep_their_legend_off_the_bars(tmp_path, monkeypatch):
    """Bars of a per-bucket chart reach every corner of its axes (an AUC of 1 in the top bucket, say):
    the legend sits beside the axes, never over a bar."""
    import matplotlib.pyplot as plt

    from polyalign.reports import evaluation

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # kept open to measure, closed below
    buckets = {f"en|single|qa|{size}": {"rows": 30, "auc": 1.0, "auc_interval": [0.98, 1.0], "auc_floor": 0.6,
                                        "auc_floor_interval": [0.5, 0.7], "backed_off": False}
               for size in ("short", "medium", "long")}
    evaluation._metric_by_bucket(buckets, "auc", "AUC", tmp_path / "auc.png")
    evaluation._bucket_bars({"a": {b: 1.0 for b in buckets}, "b": {b: 0.0 for b in buckets}}, "AUC", tmp_path / "b.png")
    assert len(figures) == 2
    for figure in list(figures):
        ax = figure.axes[0]
        renderer = figure.canvas.get_renderer()
        legend, axes = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
        close(figure)
        assert legend.x0 >= axes.x1, (legend, axes)


def test_per_bucket_comparison_charts_mark_the_human_floor_missing_numbers_and_rows(tmp_path, monkeypatch):
    """A comparison's per-bucket chart: people's own value as one black mark per bucket, "n/a" where a run
    has no number (a bar of 0 is a 0), and the test rows in each bucket's label."""
    import matplotlib.pyplot as plt

    from polyalign.reports import evaluation

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    series = {"a": {"x|short": 0.5, "y|long": 0.0}, "b": {"x|short": 0.25}}
    evaluation._bucket_bars(series, "HCR", tmp_path / "hcr.png", floor={"x|short": 0.9, "y|long": 0.8},
                            rows={"x|short": 20, "y|long": 3})
    ax = figures[0].axes[0]
    marks = [line for line in ax.lines if line.get_color() == "black"]
    assert sorted(line.get_xdata()[0] for line in marks) == [0.8, 0.9]
    assert [t.get_text() for t in ax.texts] == [" n/a"]  # b has no y|long; a's 0.0 is drawn as a bar
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x|short (n=20)", "y|long (n=3)"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["people (human floor)", "a", "b"]
    close(figures[0])
    # each run's interval per bucket as an error bar; a run without intervals draws none
    evaluation._bucket_bars(series, "HCR", tmp_path / "hcr2.png", intervals={"a": {"x|short": [0.4, 0.6]}, "b": {}})
    bars = [c for c in figures[1].axes[0].containers if hasattr(c, "errorbar")]
    assert bars[1].errorbar is None
    segments = [s.tolist() for s in bars[0].errorbar.lines[2][0].get_segments()]
    assert segments == [[[0.4, 0.0], [0.6, 0.0]], []]  # y|long: no interval, no bar and no cap
    close(figures[1])


def test_a_runaway_interval_is_cut_at_the_charts_edge_and_says_where_it_ends(tmp_path, monkeypatch):
    """BNG 0.3 [0.1, 9.6] in a bucket of a few rows squeezed every other bar into a sliver: the axis stops at
    three times the largest bar, and the cut interval names its end; charts without one are left alone."""
    import matplotlib.pyplot as plt

    from polyalign.reports import evaluation

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    buckets = {"en|single|qa|short": {"rows": 4, "bng": 0.3, "bng_interval": [0.1, 9.6], "bng_floor": 0.2,
                                      "bng_floor_interval": [0.1, 0.4], "backed_off": False},
               "zh|single|qa|short": {"rows": 40, "bng": 0.5, "bng_interval": [0.4, 0.6], "backed_off": False}}
    evaluation._metric_by_bucket(buckets, "bng", "BNG", tmp_path / "bng.png")
    evaluation._bucket_bars({"a": {"x": 0.3, "y": 0.5}, "b": {"x": 0.2}}, "BNG", tmp_path / "c.png",
                            intervals={"a": {"x": [0.1, 9.6], "y": [0.4, 0.6]}, "b": {"x": [0.1, 2.5]}})
    evaluation._metric_by_bucket({b: {**r, "bng_interval": [0.1, 0.9]} for b, r in buckets.items()}, "bng", "BNG",
                                 tmp_path / "calm.png")
    (first, second, calm) = [figure.axes[0] for figure in figures]
    assert first.get_xlim()[1] == pytest.approx(1.5) and [t.get_text() for t in first.texts] == ["to 9.6 \u2192"]
    assert second.get_xlim()[1] == pytest.approx(1.5)
    assert sorted(t.get_text() for t in second.texts) == [" n/a", "to 2.5 \u2192", "to 9.6 \u2192"]  # b has no y
    assert calm.get_xlim()[1] >= 0.9 and len(calm.texts) == 0
    for figure in figures:
        close(figure)


def test_native_stderr_is_caught_at_the_file_descriptor(capfd):
    import os
    import sys

    from polyalign.core.native_stderr import captured_stderr_lines

    with captured_stderr_lines() as lines:
        os.write(2, b"WARNING from C\n")  # as native code writes, past sys.stderr
    assert lines == ["WARNING from C"]
    assert capfd.readouterr().err == ""
    print("after", file=sys.stderr)
    assert capfd.readouterr().err == "after\n"  # the descriptor is restored


def test_the_model_behind_predictions_is_read_from_its_training_run(tmp_path):
    """Predictions `generate` wrote name their checkpoint; a checkpoint that is a training run's OUT/model
    has the run's config.json beside it: metrics.json keeps how the model was trained, and the comparison
    names what differs between the models (the method always)."""
    from polyalign.core.outputs import sidecar
    from polyalign.evaluate.run import trained_with
    from polyalign.reports.evaluation import differing_models

    def trained_run(name, weighting, **method):
        (tmp_path / name / "model").mkdir(parents=True)
        (tmp_path / name / "config.json").write_text(json.dumps({
            "method": "sft", "weighting": weighting, "init": "/ckpt/Qwen2.5-0.5B-Instruct", "train": {"steps": 300},
            "optimizer": {"lr": 2e-5}, "model": {"preset": "tiny", "lora": {"rank": 0}}, "data": {"dir": "/runs/r"},
            **method}))
        predictions = tmp_path / f"{name}.jsonl"
        predictions.write_text('{"id": "a", "prediction": "b"}\n')
        sidecar(predictions).write_text(json.dumps({"settings": {"checkpoint": str(tmp_path / name / "model")}}))
        return trained_with(predictions)

    bucket, uniform = trained_run("bucket_sft", "bucket"), trained_run("sft", "uniform")
    # the preset the config still names is left out: the architecture was init's
    assert bucket == {"checkpoint": str(tmp_path / "bucket_sft" / "model"), "method": "sft", "weighting": "bucket",
                      "steps": 300, "learning rate": 2e-5, "init": "/ckpt/Qwen2.5-0.5B-Instruct", "LoRA rank": 0,
                      "data": "/runs/r", "settings": {}}
    # lambda_dist and gamma_ftx are HDPO's terms: said for HDPO and for a method with hdpo_terms, not for plain DPO
    for name, method in (("dpo", {"method": "dpo"}), ("hdpo", {"method": "hdpo"}),
                         ("dpo_terms", {"method": "dpo", "hdpo_terms": True})):
        said = trained_run(name, None, beta=0.1, lambda_dist=0.3, gamma_ftx=0.05, truncation="turns", **method)
        assert said["beta"] == 0.1 and said.get("lambda_dist") == (None if name == "dpo" else 0.3), name
        assert said.get("gamma_ftx") == (None if name == "dpo" else 0.05), name
        assert said["truncation"] == "turns" and "max length" not in said  # data.max_length unset in the config
    cut = trained_run("dpo_128", None, method="dpo", data={"dir": "/runs/r", "max_length": 128})
    assert cut["max length"] == 128
    # an SFT run's length and cut are its build's, read there (the report showed "—" for both)
    (tmp_path / "run" / "build").mkdir(parents=True)
    (tmp_path / "run" / "build" / "manifest.json").write_text(json.dumps({"settings": {"max_length": 256,
                                                                                      "truncation": "turns"}}))
    built = trained_run("sft_built", "bucket", data={"dir": str(tmp_path / "run")})
    assert (built["max length"], built["truncation"]) == (256, "turns")
    assert "max length" not in trained_run("dpo_built", None, method="dpo", data={"dir": str(tmp_path / "run")})
    external = tmp_path / "engine.jsonl"
    external.write_text('{"id": "a", "prediction": "b"}\n')
    assert trained_with(external) is None  # an external engine's predictions name no checkpoint
    # a checkpoint in a folder whose config.json is not a training run's (a model zoo's, say): no settings read
    (tmp_path / "zoo" / "qwen").mkdir(parents=True)
    (tmp_path / "zoo" / "config.json").write_text(json.dumps({"model_type": "qwen2", "train": {"steps": 1}}))
    sidecar(external).write_text(json.dumps({"settings": {"checkpoint": str(tmp_path / "zoo" / "qwen")}}))
    assert trained_with(external) == {"checkpoint": str(tmp_path / "zoo" / "qwen")}
    runs = {name: {"config": {"trained": t}} for name, t in (("a", bucket), ("b", uniform), ("c", None))}
    assert differing_models(runs) == {"method": ["sft", "sft", "—"], "weighting": ["bucket", "uniform", "—"],
                                      "steps": ["300", "300", "—"], "learning rate": ["2e-05", "2e-05", "—"],
                                      "init": ["ckpt/Qwen2.5-0.5B-Instruct"] * 2 + ["—"],
                                      "LoRA rank": ["0", "0", "—"], "data": ["runs/r", "runs/r", "—"]}
    assert differing_models({"a": {"config": {"trained": bucket}}, "b": {"config": {"trained": uniform}}}) == {
        "method": ["sft", "sft"], "weighting": ["bucket", "uniform"]}
    # every other setting that shapes the model is named by its key where the runs that have it differ; where
    # a run stopped and what it logged are not, nor a setting only one method has
    seeded = [trained_run(f"seed{seed}", "bucket", train={"steps": 300, "seed": seed, "eval_every": 10 * seed},
                          optimizer={"lr": 2e-5, "min_lr_ratio": 0.1 * seed}) for seed in (0, 1)]
    assert seeded[1]["settings"] == {"train.seed": 1, "optimizer.min_lr_ratio": 0.1}
    preference = trained_run("dpo_seed", None, method="dpo", beta=0.1, label_smoothing=0.0, train={"seed": 1})
    runs = {name: {"config": {"trained": t}} for name, t in zip("abc", [*seeded, preference])}
    assert {k: v for k, v in differing_models(runs).items() if "." in k} == {
        "train.seed": ["0", "1", "1"], "optimizer.min_lr_ratio": ["0", "0.1", "—"]}
    # a run resumed with another train.steps is not a plain run of its last length
    assert trained_run("resumed", "bucket", train={"steps": 30})["steps"] == 30
    (tmp_path / "resumed" / "summary.json").write_text(json.dumps({"segments": [
        {"start_step": 0, "end_step": 20, "steps": 20}, {"start_step": 20, "end_step": 30, "steps": 30}]}))
    assert trained_with(tmp_path / "resumed.jsonl")["steps"] == "30 (train.steps 20 up to step 20, then 30)"
    # a round of on-policy rounds: which round of how many, and the model round 1 started from
    (tmp_path / "hdpo_rounds" / "round-1").mkdir(parents=True)
    (tmp_path / "hdpo_rounds" / "round-1" / "config.json").write_text(json.dumps({"method": "hdpo",
                                                                                 "init": "/runs/sft/model"}))
    (tmp_path / "hdpo_rounds" / "summary.json").write_text(json.dumps({"rounds_planned": 2}))
    second = trained_run("hdpo_rounds/round-2", None, method="hdpo", init=str(tmp_path / "hdpo_rounds/round-1/model"))
    assert (second["round"], second["rounds from"]) == ("2 of 2 (on-policy)", "/runs/sft/model")
    # a round's model moved out of its rounds folder: its own record says which round it was
    moved = tmp_path / "moved" / "model"
    moved.mkdir(parents=True)
    (moved / "polyalign_training.json").write_text(json.dumps({"config": {"method": "hdpo", "rounds": 1}, "round": {
        "number": 2, "of": 3, "from": "/runs/sft/model"}}))
    (tmp_path / "moved.jsonl").write_text('{"id": "a", "prediction": "b"}\n')
    sidecar(tmp_path / "moved.jsonl").write_text(json.dumps({"settings": {"checkpoint": str(moved)}}))
    said = trained_with(tmp_path / "moved.jsonl")
    assert (said["round"], said["rounds from"]) == ("2 of 3 (on-policy)", "/runs/sft/model")
    assert "round" not in bucket
    # an SFT run's profile is its build's, not a key of its config: its export's tokenizer config names it
    assert "profile" not in bucket
    exported = tmp_path / "bucket_sft" / "model" / "tokenizer_config.json"
    exported.write_text(json.dumps({"polyalign_profile": "oracle"}))
    assert trained_with(tmp_path / "bucket_sft.jsonl")["profile"] == "oracle"
    # a model folder copied out of its run keeps how it was trained in its own record (the export writes it)
    from polyalign.core.paths import TRAINING_RECORD
    resumed = tmp_path / "resumed"
    (resumed / "model" / TRAINING_RECORD).write_text(json.dumps({
        "config": json.loads((resumed / "config.json").read_text()),
        "segments": json.loads((resumed / "summary.json").read_text())["segments"]}))
    in_place = trained_with(tmp_path / "resumed.jsonl")
    shutil.copytree(resumed / "model", tmp_path / "shared_drive" / "resumed_model")
    sidecar(tmp_path / "resumed.jsonl").write_text(json.dumps({"settings": {
        "checkpoint": str(tmp_path / "shared_drive" / "resumed_model")}}))
    copied = trained_with(tmp_path / "resumed.jsonl")
    assert copied == {**in_place, "checkpoint": str(tmp_path / "shared_drive" / "resumed_model")}
    assert copied["steps"] == "30 (train.steps 20 up to step 20, then 30)" and copied["weighting"] == "bucket"
    # the record travels with the weights: a folder it was copied into that holds another run says nothing of it
    shutil.copytree(resumed / "model", tmp_path / "sft" / "resumed_model")
    sidecar(tmp_path / "resumed.jsonl").write_text(json.dumps({"settings": {
        "checkpoint": str(tmp_path / "sft" / "resumed_model")}}))
    assert trained_with(tmp_path / "resumed.jsonl")["weighting"] == "bucket"  # the sft run beside it: uniform
    # two lineages of rounds: each init named by as many parts as tell them apart
    lineages = {name: {"config": {"trained": {**bucket, "init": f"/runs/{name}/round-1/model"}}}
                for name in ("hdpo", "dpo")}
    assert differing_models(lineages)["init"] == ["hdpo/round-1/model", "dpo/round-1/model"]


def test_error_bars_draw_nothing_where_a_bucket_has_no_interval():
    """A bucket too small for an interval gets no error bar and no cap; an interval that does not hold its
    estimate shows the side that does."""
    from polyalign.reports.evaluation import _error_bars

    bars = _error_bars([0.5, 0.7, None, 0.9], [[0.4, 0.65], None, None, [0.95, 0.99]])
    np.testing.assert_allclose(bars[:, 0], [0.1, 0.15])
    assert np.isnan(bars[:, 1]).all() and np.isnan(bars[:, 2]).all()
    np.testing.assert_allclose(bars[:, 3], [0.0, 0.09], atol=1e-12)


def test_the_report_says_how_each_runs_answers_were_decoded(tmp_path):
    """Greedy answers against sampled ones of one checkpoint differ by the decoding as much as by the model:
    metrics.json keeps what `generate` recorded, and the comparison names it where runs differ."""
    from polyalign.core.outputs import sidecar
    from polyalign.evaluate.run import decoding_of
    from polyalign.reports.evaluation import decoding_text, differing_settings

    def predictions(name, settings, summary=None):
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"id": "a", "prediction": "b"}\n')
        if settings is not None:
            sidecar(path).write_text(json.dumps({"settings": settings, **({"summary": summary} if summary else {})}))
        return decoding_of(path)

    greedy = predictions("greedy", {"sampling": {"max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                                 "min_p": 0.0}, "budget_records": None})  # min_p 0 asks nothing
    sampled = predictions("sampled", {"sampling": {"max_new_tokens": 512, "temperature": 0.7, "top_p": 0.8,
                                                   "top_k": 20, "repetition_penalty": 1.05},
                                      "budget_records": "/runs/r/data/train.jsonl"})
    assert sampled["max_new_tokens"] == "auto" and greedy["max_new_tokens"] == 128
    assert predictions("external", None) is None
    assert [decoding_text(d) for d in (greedy, sampled, None)] == [
        "greedy, answers up to 128 tokens",
        "temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05, answers up to their bucket's budget",
        "not recorded (answers not from polyalign generate)"]
    assert "min_p" not in greedy
    assert decoding_text({"temperature": 0.0, "frequency_penalty": 0.5}) == "greedy, frequency_penalty 0.5"
    runs = {name: {"config": {"decoding": d, "profile": ["context"], "compat": "cjk"}, "alignment": {"evaluated": 9},
                   "metrics": {"mauve": {"status": "skipped"}}} for name, d in (("a", greedy), ("b", sampled))}
    assert ("decoding: greedy, answers up to 128 tokens | temperature 0.7, top_p 0.8, top_k 20, repetition_penalty "
            "1.05, answers up to their bucket's budget" in differing_settings(runs))
    # one model's answers to prompts cut at 128 and at 512 tokens: another condition, named where they differ
    short, long = (predictions(f"p{n}", {"sampling": {"max_new_tokens": 48, "temperature": 0.0},
                                         "max_prompt_tokens": n}) for n in (128, 512))
    runs = {name: {**run, "config": {**run["config"], "decoding": d}} for (name, run), d in zip(runs.items(),
                                                                                                  (short, long))}
    assert ("decoding: greedy, prompts cut to 128 tokens, answers up to 48 tokens | greedy, prompts cut to 512 "
            "tokens, answers up to 48 tokens" in differing_settings(runs))
    # how many prompts the budget took, where generate counted them ("cut to 192" hid 173 of 210)
    counted = predictions("counted", {"sampling": {"max_new_tokens": 64, "temperature": 0.0}, "max_prompt_tokens": 192},
                          {"records": 210, "prompts_cut": 173})
    assert decoding_text(counted) == ("greedy, prompts cut to 192 tokens (173 of 210 were longer), answers up to 64 "
                                      "tokens")
    # the dtype `generate --dtype` computed in: bfloat16 answers of one checkpoint against float32 ones (it
    # reached no report: both runs' settings read alike)
    half, full = (predictions(f"d{dtype}", {"sampling": {"max_new_tokens": 48, "temperature": 0.0}, "dtype": dtype})
                  for dtype in ("bfloat16", "float32"))
    runs = {name: {**run, "config": {**run["config"], "decoding": d}} for (name, run), d in zip(runs.items(),
                                                                                                  (half, full))}
    assert ("decoding: greedy, answers up to 48 tokens, computed in bfloat16 | greedy, answers up to 48 tokens, "
            "computed in float32" in differing_settings(runs))


def test_a_model_behind_the_no_model_answers_is_told_so_only_where_the_intervals_are_apart():
    from polyalign.reports.evaluation import _behind_no_model
    from polyalign.reports.no_model import ahead_of_the_model

    def metrics(aggregate, bng, rows):
        return {"aggregate": {"overall": aggregate[0], "interval": aggregate[1]},
                "bng": {"overall_macro": bng[0], "macro_interval": bng[1]}, "reference_rows": rows}

    rows = {"human": {"bng_macro": 0.5, "bng_macro_interval": [0.4, 0.6]},
            "echo_question": {"aggregate": 0.21, "aggregate_interval": [0.18, 0.25], "bng_macro": 2.0,
                              "bng_macro_interval": [1.9, 2.1]},
            "first_sentence": {"aggregate": 0.19, "aggregate_interval": [0.17, 0.22], "bng_macro": 2.5,
                               "bng_macro_interval": [2.3, 2.7]},
            "empty_answer": {"aggregate": 0.04, "aggregate_interval": [0.03, 0.05], "bng_macro": 2.2,
                             "bng_macro_interval": [2.1999, 2.2001]}}
    behind = metrics((0.05, [0.03, 0.07]), (2.6, [2.4, 2.8]), rows)
    assert ahead_of_the_model(behind) == (
        "answers that need no model do better than this model, their intervals apart from its: on the aggregate, "
        "echo_question 0.2100 [0.180, 0.250] and first_sentence 0.1900 [0.170, 0.220] against the model's 0.0500 "
        "[0.030, 0.070]; on BNG macro, echo_question 2.0000 [1.900, 2.100] and empty_answer 2.2000 [2.199, 2.201] "
        "against the model's 2.6000 [2.400, 2.800]. It has not yet beaten copying the question, quoting the first "
        "sentence of the context (of the question where there is none) or saying nothing")
    # intervals that touch or cross are not said, whichever way the estimates point; no interval, nothing judged
    assert ahead_of_the_model(metrics((0.15, [0.10, 0.18]), (2.2, [1.8, 2.6]), rows)) is None
    assert ahead_of_the_model(metrics((0.05, None), (2.6, None), rows)) is None
    # the reports lead with it, in bold, per run of a comparison
    page = _behind_no_model([("sft", behind), ("hdpo", metrics((0.3, [0.26, 0.34]), (1.0, [0.9, 1.1]), rows))])
    assert page.startswith("<p><b>sft: Answers that need no model do better than this model") and "hdpo:" not in page


def test_a_model_that_loses_to_copying_the_question_is_told_so_from_the_command_line(demo_run, tmp_path, capsys):
    """One answer for every prompt (a real one, the first record's): evaluate warns, naming the no-model
    answers ahead of it, and its report and a comparison lead their no-model section with it, in bold."""
    from polyalign.cli import main
    from polyalign.data.records import read_records
    from polyalign.reports.no_model import ahead_of_the_model

    run, _, _ = demo_run
    records = read_records(run / "data" / "test.jsonl")[:300]
    subset = tmp_path / "test.jsonl"
    subset.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: records[0].response)
    args = ["--records", str(subset), "--predictions", str(tmp_path / "p.jsonl"), "--bootstrap-draws", "20",
            "--no-detectability", "--no-progress"]
    assert main(["evaluate", *args, "--out", str(tmp_path / "eval")]) == 0
    printed = capsys.readouterr()
    behind = ahead_of_the_model(json.loads((tmp_path / "eval" / "metrics.json").read_text())["metrics"])
    assert behind and "echo_question" in behind and "It has not yet beaten copying the question" in behind
    assert f"warning: {behind} (docs/evaluation.md, Reference rows)\n" in printed.err
    page = (tmp_path / "eval" / "report.html").read_text()
    lead = f"<h2>Against people and no-model answers</h2><p><b>{html.escape(behind[0].upper() + behind[1:])}.</b></p>"
    assert lead in page
    shutil.copytree(tmp_path / "eval", tmp_path / "again")
    assert main(["report", str(tmp_path / "eval"), str(tmp_path / "again"), "--out", str(tmp_path / "cmp2")]) == 0
    markdown = (tmp_path / "cmp2" / "report.md").read_text()
    assert f"**eval: {behind[0].upper() + behind[1:]}.**" in markdown and "**again: " in markdown
    # beside a run of other test rows there is no shared table of no-model answers: still said, with the settings
    _write_predictions(tmp_path / "fewer.jsonl", records[:250], lambda r: r.response)
    assert main(["evaluate", *args[:2], "--predictions", str(tmp_path / "fewer.jsonl"), *args[4:], "--allow-partial",
                 "--out", str(tmp_path / "fewer")]) == 0
    assert main(["report", str(tmp_path / "eval"), str(tmp_path / "fewer"), "--out", str(tmp_path / "cmp3")]) == 0
    markdown = (tmp_path / "cmp3" / "report.md").read_text()
    assert "## Against people and no-model answers" not in markdown
    assert f"**eval: {behind[0].upper() + behind[1:]}.**" in markdown


def test_one_runaway_answer_and_answers_in_the_wrong_language_are_named(demo_run, tmp_path, capsys):
    """People's own answers, but one of them replaced by the answers of a whole bucket run together (real text,
    thousands of characters) and five English answers replaced by Chinese people's: evaluate names the answer
    that makes the BNG macro and counts the answers in another script, beside people's own count, in its
    summary, its report and a comparison."""
    from polyalign.cli import main
    from polyalign.data.language import wrong_script
    from polyalign.data.records import read_records
    from polyalign.reports.reading_notes import (
        one_answer_text,
        small_buckets_text,
        tdm_coverage_text,
        wrong_script_text,
    )

    run, _, _ = demo_run
    everything = read_records(run / "data" / "test.jsonl")
    records = everything[:300]
    subset = tmp_path / "test.jsonl"
    subset.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    sizes = {b: sum(r.bucket_id == b for r in records) for b in {r.bucket_id for r in records}}
    runaway = next(r for r in records if 5 <= sizes[r.bucket_id] <= 30)
    chinese = [r.response for r in everything if r.language == "zh" and wrong_script("en", r.response) == "han"]
    english = [r for r in records if r.language == "en" and r is not runaway and wrong_script("en", r.response) is None]
    swapped = dict(zip((r.id for r in english[:5]), chinese))
    long_text = "\n\n".join(r.response for r in records if r.bucket_id != runaway.bucket_id)[:8000]
    _write_predictions(tmp_path / "p.jsonl", records,
                       lambda r: long_text if r is runaway else swapped.get(r.id, r.response))
    args = ["--records", str(subset), "--predictions", str(tmp_path / "p.jsonl"), "--bootstrap-draws", "20",
            "--no-detectability", "--no-progress", "--out", str(tmp_path / "eval")]
    assert main(["evaluate", *args]) == 0
    printed = capsys.readouterr()
    result = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    found, bng = result["metrics"]["bng"]["one_answer"], result["metrics"]["bng"]
    assert (found["id"], found["bucket"], found["characters"]) == (runaway.id, runaway.bucket_id, len(long_text))
    # the macro without it, computed by hand from the buckets' BNG
    others = [v for b, v in bng["by_bucket"].items() if b != runaway.bucket_id]
    assert found["bng_macro"] == pytest.approx(bng["overall_macro"])
    assert found["bng_macro_without"] == pytest.approx(np.mean(others + [found["bucket_bng_without"]]))
    assert found["bng_macro_without"] < 0.8 * found["bng_macro"]
    assert result["metrics"]["buckets"][runaway.bucket_id]["bng_without_one"]["id"] == runaway.id
    wrong = result["answers"]["wrong_script"]
    assert wrong["answers"] == wrong["people"] + 5 and wrong["by_language"]["en"]["han"] >= 5
    assert set(swapped) <= set(wrong["ids"]) and len(wrong["ids"]) == wrong["answers"]
    for text in (one_answer_text(found), wrong_script_text(wrong)):
        assert f"warning: {text}\n" in printed.err
        assert html.escape(text[0].upper() + text[1:]) in (tmp_path / "eval" / "report.html").read_text()
    assert f"{runaway.id} (8,000 characters where people in {runaway.bucket_id} write a median" in printed.err
    # TDM leaves the multi-turn buckets under 20 rows out, as METHOD says, and says which
    multi = {b: n for b, n in sizes.items() if b.split("|")[1] == "multi"}
    tdm = result["metrics"]["tdm"]
    assert tdm["left_out"] == {b: n for b, n in sorted(multi.items()) if n < 20} != {}
    assert set(tdm["by_bucket"]) == {b for b, n in multi.items() if n >= 20} != set()
    assert f"note: {tdm_coverage_text(tdm)}\n" in printed.out and "multi-turn buckets" in tdm_coverage_text(tdm)
    # the macros count buckets too small for an interval: said, naming each with its rows
    small = {b: n for b, n in sizes.items() if n < bng["min_interval_rows"]}
    assert sorted(bng["small_buckets"]) == sorted(small) != []
    note = small_buckets_text(result["metrics"])
    assert f"note: {note}\n" in printed.out and note.startswith(f"the BNG and HCR macros count {len(small)} of "
                                                                 f"{len(sizes)} buckets with fewer than")
    assert all(f"{b} ({n} row" in note for b, n in small.items())
    assert f"HCR weighted by test rows {result['metrics']['hcr']['overall_weighted']:.4f}" in note
    # people's own answers: no answer makes the macro, and only people's own code-switching is counted
    _write_predictions(tmp_path / "people.jsonl", records, lambda r: r.response)
    assert main(["evaluate", *args[:2], "--predictions", str(tmp_path / "people.jsonl"), *args[4:-1],
                 str(tmp_path / "people")]) == 0
    capsys.readouterr()
    clean = json.loads((tmp_path / "people" / "metrics.json").read_text())
    assert clean["metrics"]["bng"]["one_answer"] is None
    assert clean["answers"]["wrong_script"]["answers"] == clean["answers"]["wrong_script"]["people"] == wrong["people"]
    evals = [str(tmp_path / "eval"), str(tmp_path / "people")]
    assert main(["report", *evals, "--names", "runaway", "humans", "--out", str(tmp_path / "cmp")]) == 0
    markdown = (tmp_path / "cmp" / "report.md").read_text()
    assert f"**runaway: {one_answer_text(found)}.**" in markdown and "**humans: one answer" not in markdown
    assert "| metric (value [interval]) | runaway | humans |" in markdown
    # a name per folder, distinct: one line, not argparse's usage block
    assert main(["report", *evals, "--names", "same", "same", "--out", str(tmp_path / "cmp3")]) == 2
    assert capsys.readouterr().err == ("polyalign report: error: --names takes one distinct name per EVAL folder: 2 "
                                       "folders, names same same\n")


def test_messy_exports_of_three_systems_compare_on_the_rows_all_of_them_answer(demo_run, tmp_path, capsys):
    """Three systems' answers with the faults real exports have (one leaves ids out, one answers an id twice
    differently, one repeats a row word for word): each evaluated with --common-with the three files reads the
    same rows, those every file answers once, and the comparison judges their differences (with
    --allow-partial alone each read other rows, and nothing was compared)."""
    from polyalign.cli import main
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    records = read_records(run / "data" / "test.jsonl")[:120]
    subset = tmp_path / "test.jsonl"
    subset.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    rows = {"a": [{"id": r.id, "prediction": r.response} for r in records[3:]],
            "b": [{"id": r.id, "prediction": first_sentence(r.context or r.question)} for r in records]
            + [{"id": records[10].id, "prediction": records[11].response}],
            "c": [{"id": r.id, "prediction": r.question} for r in records] + [{"id": records[20].id,
                                                                               "prediction": records[20].question}]}
    files = {}
    for name, written in rows.items():
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in written))
    common = [r.id for r in records[3:] if r.id != records[10].id]  # a left 3 out; b answered one twice
    for name in rows:
        assert main(["evaluate", "--records", str(subset), "--predictions", str(files[name]), "--out",
                     str(tmp_path / f"eval_{name}"), "--bootstrap-draws", "20", "--no-detectability", "--no-progress",
                     "--common-with", *(str(f) for f in files.values())]) == 0
        printed = capsys.readouterr().out
        # what this file itself lacks among what the others answer is still said and named
        own = {"a": "; this file left out 3 that another file answers", "b": "; this file left out 1 answered twice "
               "differently", "c": ""}[name]
        assert printed.startswith(f"{len(common)} of 120 rows (the ones all 3 predictions files answer once "
                                  f"(--common-with){own}")
        alignment = json.loads((tmp_path / f"eval_{name}" / "metrics.json").read_text())["alignment"]
        assert alignment["evaluated_ids"] == alignment_digest(common)
        assert (alignment.get("missing_ids"), alignment.get("duplicate_ids")) == {
            "a": ([r.id for r in records[:3]], None), "b": (None, [records[10].id]), "c": (None, None)}[name]
    # naming only itself is no comparison: said
    assert main(["evaluate", "--records", str(subset), "--predictions", str(files["a"]), "--out",
                 str(tmp_path / "alone"), "--common-with", str(files["a"])]) == 2
    assert "--common-with names no other predictions file than --predictions" in capsys.readouterr().err
    assert main(["report", *(str(tmp_path / f"eval_{n}") for n in rows), "--out", str(tmp_path / "cmp")]) == 0
    assert "evaluated other test records" not in capsys.readouterr().out
    verdicts = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["summary"]["differences"]
    assert verdicts["eval_b - eval_a"]["BNG weighted"]["verdict"] != "not compared: other test records"
    markdown = (tmp_path / "cmp" / "report.md").read_text()
    assert f"| test rows | {len(common)} of 120 (the ones all 3 predictions files answer once) |" in markdown
    # the same rows: what TDM leaves out is the same for every run, said once
    assert json.loads((tmp_path / "eval_a" / "metrics.json").read_text())["metrics"]["tdm"]["left_out"]
    assert "\nEvery run: TDM is over " in markdown and "eval_a: TDM" not in markdown


def alignment_digest(ids):
    from polyalign.evaluate.run import evaluated_ids_digest

    return evaluated_ids_digest(ids)


def test_a_diversity_difference_says_whether_it_moved_toward_peoples_own_value():
    """Distinct-2 of 0.863 -> 0.892 against people's 0.630 is a move away from people, though higher; said
    where both runs measured people alike, nothing where they did not or nothing moved."""
    from polyalign.reports.evaluation import INTERVAL_ROWS, _toward_people

    row = next(r for r in INTERVAL_ROWS if r.name.startswith("Distinct-2"))
    bleu = next(r for r in INTERVAL_ROWS if r.name.startswith("Self-BLEU-4"))

    def metrics(people):
        return {"diversity": {"overall": {"human": {"distinct_2": people, "self_bleu_4": 0.18}}}}

    assert _toward_people(row, metrics(0.63), metrics(0.63), 0.863, 0.892) == ", away from people's 0.6300"
    assert _toward_people(row, metrics(0.63), metrics(0.63), 0.892, 0.863) == ", toward people's 0.6300"
    assert _toward_people(bleu, metrics(0.63), metrics(0.63), 0.11, 0.06) == ", away from people's 0.1800"
    # from under people's value to as far over it (0.6362 -> 0.9252 against 0.7843): past it, no nearer
    assert _toward_people(row, metrics(0.7843), metrics(0.7843), 0.6362, 0.9252) == (
        ", past people's 0.7843 (0.1409 above it, from 0.1481 on the other side)")
    assert _toward_people(row, metrics(0.63), metrics(0.64), 0.863, 0.892) == ""  # people measured otherwise
    assert _toward_people(row, metrics(0.63), metrics(0.63), 0.863, 0.863) == ""
    assert _toward_people(next(r for r in INTERVAL_ROWS if r.name == "F1"), metrics(0.63), metrics(0.63), 0.1,
                          0.2) == ""  # F1 has no mark: higher is better
    # a run that kept few answers with a word (the rest empty or punctuation only): said on how many it rests
    from polyalign.reports.evaluation import _few_worded

    def run(empty, evaluated=128):
        return {"alignment": {"evaluated": evaluated},
                "metrics": {"diversity": {"overall": {"generated_empty": empty}}}}

    assert _few_worded(row, run(44), run(92)) == ", on 84 of 128 and 36 of 128 answers with a word"
    assert _few_worded(row, run(10), run(20)) == ""  # both kept over three quarters of their answers
    assert _few_worded(next(r for r in INTERVAL_ROWS if r.name == "F1"), run(44), run(92)) == ""


def test_diversity_of_answers_without_words_or_without_pairs_of_words_is_undefined():
    """Punctuation alone has no word once tokenised: left out like an empty answer, so identical "，，，"
    answers are not read as perfectly diverse; answers of one word each have no 2- or 3-gram, so their
    Distinct-2 and -3 are undefined, not 0."""
    from polyalign.evaluate.run import _diversity
    from polyalign.evaluate.support import IntervalOptions as Options

    human = ["我们 明天 去 公园", "好的 我 也 去", "那 下午 见"]
    one_word = ["，，，"] * 5 + ["oooo"] * 4 + ["嗯"] * 3
    section = _diversity(human, one_word, "cjk", Options(draws=10))
    assert section["generated_empty"] == 5 and section["generated"]["distinct_1"] == pytest.approx(2 / 7)
    assert section["generated"]["distinct_2"] is None and section["generated"]["distinct_3"] is None
    assert section["generated_interval"]["distinct_2"] is None
    only_punctuation = _diversity(human, ["，，，", "...", "！"], "cjk", Options(draws=10))
    assert only_punctuation["generated"] == dict.fromkeys(["distinct_1", "distinct_2", "distinct_3", "self_bleu_4"])
    assert only_punctuation["generated_reason"] == "undefined: 0 answers with a word (needs 2)"


def test_a_featurizer_from_the_models_own_lineage_is_named_as_such(tmp_path):
    """--featurizer against the checkpoint that wrote the predictions, followed back through each training
    run's init: the model itself, its base, a model further back, or none of them."""
    from polyalign.evaluate.run import featurizer_relation

    base = tmp_path / "base"
    base.mkdir()
    for run, init in (("sft", base), ("hdpo", tmp_path / "sft" / "model")):
        (tmp_path / run / "model").mkdir(parents=True)
        (tmp_path / run / "config.json").write_text(json.dumps({"method": run, "init": str(init)}))
    predictions = tmp_path / "p.jsonl"
    predictions.write_text('{"id": "a", "prediction": "b"}\n')
    manifest = {"settings": {"checkpoint": str(tmp_path / "hdpo" / "model")}}
    (tmp_path / "p.manifest.json").write_text(json.dumps(manifest))
    assert featurizer_relation(tmp_path / "hdpo" / "model", predictions) == "the model itself"
    assert featurizer_relation(tmp_path / "sft" / "model", predictions) == (
        "the model's base (the init it was trained from)")
    assert featurizer_relation(base, predictions) == "a model it was trained from, 2 inits back"
    assert featurizer_relation(tmp_path / "elsewhere", predictions) is None
    # the HDPO model copied out of its run: its own record names its init
    from polyalign.core.paths import TRAINING_RECORD
    (tmp_path / "shared" / "hdpo").mkdir(parents=True)
    (tmp_path / "shared" / "hdpo" / TRAINING_RECORD).write_text(json.dumps({
        "config": json.loads((tmp_path / "hdpo" / "config.json").read_text()), "segments": []}))
    manifest = {"settings": {"checkpoint": str(tmp_path / "shared" / "hdpo")}}
    (tmp_path / "p.manifest.json").write_text(json.dumps(manifest))
    assert featurizer_relation(tmp_path / "sft" / "model", predictions) == (
        "the model's base (the init it was trained from)")
    (tmp_path / "p.manifest.json").unlink()  # an external engine's answers name no checkpoint
    assert featurizer_relation(base, predictions) is None


def test_sample_answers_in_the_report_end_at_a_word_and_say_they_go_on():
    """A sample longer than the report shows ends at a space where one is near, then an ellipsis; Chinese,
    which has none, at the limit; a short one is whole (they were cut mid-word: "restricts blood fl")."""
    from polyalign.reports.evaluation import _excerpt
    from tests.chat_exports import camrest_dialogues, camrest_messages, crosswoz_dialogues, crosswoz_messages

    english = " ".join(m["content"].strip() for d in camrest_dialogues(2) for m in camrest_messages(d))
    chinese = "".join(m["content"] for _, d in crosswoz_dialogues(2) for m in crosswoz_messages(d)).replace(" ", "")
    assert len(english) > 300 and len(chinese) > 300
    shown = _excerpt(english, 300)
    assert shown.endswith(" …") and english.startswith(shown[:-2]) and english[len(shown) - 2] == " "
    assert 260 <= len(shown) - 2 <= 300
    assert _excerpt(chinese, 300) == chinese[:300].rstrip() + " …"
    assert _excerpt(english[:120], 300) == english[:120]


def test_report_refuses_a_damaged_evaluation_in_one_line(tmp_path, capsys):
    """metrics.json cut short, holding NaN (not JSON: it passed into comparison.json), without its sections,
    or missing: `report` says which file and why (it raised JSONDecodeError, KeyError, TypeError)."""
    from polyalign.cli import main

    cases = {"cut": '{"config": {"records": "t', "nan": '{"config": {}, "alignment": {}, "metrics": {"f1": NaN}}',
             "list": "[1, 2]", "no_metrics": '{"config": {}, "alignment": {}}'}
    said = {"cut": "damaged, not JSON", "nan": "damaged, not JSON (NaN is not a JSON number)",
            "list": "not a polyalign evaluation (no config, alignment, metrics section)",
            "no_metrics": "not a polyalign evaluation (no metrics section)"}
    for name, text in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(text)
        (tmp_path / f"{name}-2").mkdir()
        (tmp_path / f"{name}-2" / "metrics.json").write_text(text)
        assert main(["report", str(tmp_path / name), str(tmp_path / f"{name}-2"), "--out",
                     str(tmp_path / f"r-{name}")]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / name / 'metrics.json'}: {said[name]}" in err and "Traceback" not in err, err
    (tmp_path / "none").mkdir()
    assert main(["report", str(tmp_path / "none"), str(tmp_path / "cut"), "--out", str(tmp_path / "r")]) == 2
    assert f"{tmp_path / 'none' / 'metrics.json'}: missing; run `polyalign evaluate` first" in capsys.readouterr().err
    # a folder that is not there is a typo, not an evaluation still to run
    assert main(["report", str(tmp_path / "cutt"), str(tmp_path / "cut"), "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"{tmp_path / 'cutt'}: no such folder; give the folders `polyalign evaluate --out` wrote")
    assert not (tmp_path / "r").exists()


def test_an_evaluation_or_comparison_is_not_written_into_another_stages_folder(demo_run, tmp_path, capsys):
    """`evaluate --out RUN` wrote metrics.json and its plots among prepare's files; `report --out EVAL` would
    have put its report.html over the evaluation's: each is refused, with a folder of its own suggested."""
    from polyalign.cli import main
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    records = run / "data" / "test.jsonl"
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": r.id, "prediction": r.response}) + "\n"
                                              for r in read_records(records)))
    assert main(["evaluate", "--records", str(records), "--predictions", str(tmp_path / "p.jsonl"), "--out",
                 str(run)]) == 2
    assert (f"--out {run} is a prepared run (data/manifest.json is there): give the evaluation a "
            f"folder of its own, e.g. {run / 'eval'}") in capsys.readouterr().err
    assert not (run / "metrics.json").exists()
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text("{}")
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c")]) == 2
    assert f"--out {tmp_path / 'c'} is an evaluation (metrics.json is there)" in capsys.readouterr().err
    # one of the evaluations compared: said as that (the command's own input), not as another stage's folder
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "a")]) == 2
    assert "is an evaluation" not in capsys.readouterr().err


def test_the_measures_run_on_one_blas_thread_whatever_the_process_has(demo_run, tmp_path, monkeypatch):
    """Detectability fits thousands of small classifiers and MAUVE a PCA and k-means: on a pool of BLAS threads
    these took 4.3 times as long on 2 cores (more cores, more to wake). evaluate measures on one thread and
    gives the caller's pools back."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from polyalign.evaluate import detectability

    def blas_threads():
        return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}

    seen, measure = [], detectability.measure

    def measured(*args, **kwargs):
        seen.append(blas_threads())
        return measure(*args, **kwargs)

    monkeypatch.setattr(detectability, "measure", measured)
    run, _, _ = demo_run
    records_path, records = _subset(run, tmp_path, lambda r: True)
    records_path.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records[:60]))
    _write_predictions(tmp_path / "p.jsonl", records[:60], lambda r: first_sentence(r.context or r.question))
    with threadpool_limits(limits=2, user_api="blas"):
        assert blas_threads() == {2}
        evaluate(records_path, tmp_path / "p.jsonl", tmp_path / "eval",
                 EvaluateOptions(intervals=IntervalOptions(draws=20), baselines=False, plots=False))
        assert blas_threads() == {2}
    assert seen and all(threads == {1} for threads in seen), seen


def test_another_seed_keeps_the_point_estimates_and_a_support_holding_the_records_is_refused(demo_run, tmp_path,
                                                                                               capsys):
    """`--seed` draws the bootstrap and the floor's halves, not the support's sample of 1,000 answers a bucket:
    another sample moved a bucket's HCR from 0.654 to 0.527 on the same answers, and `report` called two
    seeds of one predictions file apart. And a support that holds the evaluated records (the test split
    given as --support) measured each human answer against itself: refused, naming the file and an id."""
    from polyalign.cli import main

    run, _, _ = demo_run
    support = run / "data" / "train.jsonl"
    large = {b for b, n in Counter(r.bucket_id for r in read_records_of(support)).items() if n > 1000}
    records_path, records = _subset(run, tmp_path, lambda r: r.bucket_id in large)
    assert large and records
    _write_predictions(tmp_path / "p.jsonl", records, lambda r: first_sentence(r.context or r.question))
    def evaluated(support, out, *more):
        return main(["evaluate", "--records", str(records_path), "--predictions", str(tmp_path / "p.jsonl"),
                     "--support", str(support), "--bootstrap-draws", "20", "--no-baselines", "--no-detectability",
                     "--no-diversity", "--out", str(tmp_path / out), *more])

    metrics = []
    for seed in (0, 1):
        assert evaluated(support, f"seed{seed}", "--seed", str(seed)) == 0
        metrics.append(json.loads((tmp_path / f"seed{seed}" / "metrics.json").read_text())["metrics"])
    for bucket in metrics[0]["buckets"]:
        for key in ("bng", "hcr", "bng_floor", "hcr_floor"):
            assert metrics[0]["buckets"][bucket][key] == metrics[1]["buckets"][bucket][key], (bucket, key)
    assert metrics[0]["bng"]["macro_interval"] != metrics[1]["bng"]["macro_interval"]  # the seed still draws
    capsys.readouterr()
    assert evaluated(records_path, "x") == 2
    err = capsys.readouterr().err
    assert f"{records_path}: {len(records)} evaluated records of {len(records)} are in the support " \
           f"too (id {records[0].id})" in err, err
    assert "RUN/data/train.jsonl" in err and "Traceback" not in err


def test_a_comparison_opens_with_what_its_intervals_support_and_who_no_model_answers_beat():
    """The report's first section (and `report`'s output): which run the intervals put ahead of which, on
    what, with the direction each number reads in (lower BNG, higher F1); that none is, where none is; and
    the runs answers needing no model do better than. A reader ranked runs by the aggregate, whose every
    difference was not judged, below a 20-row settings table."""
    from polyalign.reports.evaluation import in_short

    def run(aggregate, echo=None):
        rows = {} if echo is None else {"echo_question": {"aggregate": echo, "aggregate_interval": [echo - 0.02,
                                                                                                     echo + 0.02]}}
        return {"metrics": {"aggregate": {"overall": aggregate, "interval": [aggregate - 0.01, aggregate + 0.01]},
                            "bng": {"overall_macro": 1.0, "macro_interval": [0.9, 1.1]}, "reference_rows": rows}}

    runs = {"sft": run(0.10, echo=0.40), "hdpo": run(0.12)}
    verdicts = {"hdpo - sft": {"BNG weighted": {"difference": -0.3, "verdict": "apart"},
                               "F1": {"difference": 0.01, "verdict": "apart"},
                               "HCR macro": {"difference": 0.2, "verdict": "not judged †"},
                               "Distinct-2 (people's own is the mark)": {"difference": 0.1, "verdict": "apart"},
                               "Aggregate": {"difference": 0.02, "verdict": "overlap"}}}
    assert in_short(runs, verdicts) == [
        "The intervals put hdpo ahead of sft on BNG weighted and F1; every other difference overlaps or is not "
        "judged (Which differences the intervals support)",
        "sft is behind answers that need no model (copying the question, say) on the aggregate or BNG: not yet "
        "better than they are (Against people and no-model answers)"]
    # a higher BNG is worse: the earlier run is ahead; nothing apart: said so; every run behind: said once
    verdicts = {"hdpo - sft": {"BNG weighted": {"difference": 0.3, "verdict": "apart"}}}
    assert in_short(runs, verdicts)[0].startswith("The intervals put sft ahead of hdpo on BNG weighted; ")
    runs = {"sft": run(0.10, echo=0.40), "hdpo": run(0.12, echo=0.40)}
    assert in_short(runs, {"hdpo - sft": {"F1": {"difference": 0.01, "verdict": "overlap"}}}) == [
        "The intervals put no run ahead of another: every difference overlaps or is not judged (Which differences "
        "the intervals support)",
        "Every run is behind answers that need no model (copying the question, say) on the aggregate or BNG: not "
        "yet better than they are (Against people and no-model answers)"]


def test_an_evaluation_reading_the_kept_human_side_equals_one_measured_afresh(demo_run, tmp_path, monkeypatch):
    """An evaluation keeps what it measured of people's answers and the no-model answers for the next
    evaluation of the same records in the process (evaluate/run.py _human_side). In a sequence that changes
    one thing at a time (the predictions, the support file rewritten in place, the references rewritten in
    place, then none, the seed, the records), each result equals the same evaluation with nothing kept, and
    the floors are measured again exactly where an input of theirs changed: nothing is read that was
    measured under other inputs, and what is read was not changed by the evaluation before."""
    from polyalign.evaluate import run as evaluation

    run, _, _ = demo_run
    chosen = {"zh|multi|dialogue|medium", "en|multi|qa|short", "zh|single|qa|short"}
    records_path, records = _subset(run, tmp_path, lambda r: r.bucket_id in chosen)
    assert {r.bucket_id for r in records} == chosen and len(records) < 100
    support = tmp_path / "train.jsonl"
    train = (run / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    support.write_text("".join(train[::8]), encoding="utf-8")
    _write_predictions(tmp_path / "first.jsonl", records, lambda r: first_sentence(r.context or r.question))
    _write_predictions(tmp_path / "echo.jsonl", records, lambda r: r.question)
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records[:-3]))
    floors_measured = []
    measure_floors = evaluation.sp.human_floors
    monkeypatch.setattr(evaluation.sp, "human_floors", lambda *a: floors_measured.append(1) or measure_floors(*a))

    references = tmp_path / "references.json"
    references.write_bytes((run / "stats" / "references.json").read_bytes())

    def options(**changed):
        return EvaluateOptions(**{"support": support, "references": references,
                                  "plots": False, "diversity": False, "allow_partial": True,
                                  "intervals": IntervalOptions(draws=30, floor_repeats=10), **changed})

    seed_1 = IntervalOptions(draws=30, floor_repeats=10, seed=1)
    # each step one change from the step before, whose side is the one kept
    steps = [("first.jsonl", records_path, options()), ("echo.jsonl", records_path, options()),
             ("rewrite", None, None), ("echo.jsonl", records_path, options()),
             ("rewrite references", None, None), ("echo.jsonl", records_path, options()),
             ("echo.jsonl", records_path, options(references=None)),
             ("echo.jsonl", records_path, options(references=None, intervals=seed_1)),
             ("echo.jsonl", fewer, options(references=None, intervals=seed_1))]
    evaluation._human_sides.clear()
    measured_by_kept = []
    for i, (predictions, records_of, settings) in enumerate(steps):
        if predictions == "rewrite":  # the same path, other answers in it
            support.write_text("".join(train[1::8]), encoding="utf-8")
            continue
        if predictions == "rewrite references":  # the same path and bands, written again
            references.write_bytes(references.read_bytes())
            continue
        floors_measured.clear()
        kept = evaluate(records_of, tmp_path / predictions, tmp_path / f"kept{i}", settings)["metrics"]
        measured_by_kept.append(len(floors_measured))
        evaluation._human_sides.clear()
        afresh = evaluate(records_of, tmp_path / predictions, tmp_path / f"afresh{i}", settings)["metrics"]
        assert kept == afresh, (i, predictions, settings)
    assert measured_by_kept == [1, 0, 1, 1, 1, 1, 1]
