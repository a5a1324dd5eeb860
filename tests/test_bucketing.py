import json

import pytest

from polyalign.data.bucketing import WeightOptions, bucket_weights, load_scheme
from polyalign.config import ConfigError
from polyalign.data.prepare import prepare
from tests.conftest import DEMO_DATA, SCHEME, read_jsonl, write_config

SAMPLE = json.loads((DEMO_DATA / "en/polyalign-sample/dist_sft_val.json").read_text(encoding="utf-8"))


def test_weights_give_every_bucket_equal_mass():
    weights = bucket_weights({"a": 10, "b": 30, "c": 60})
    # N / (K n_b) = 100 / (3 n_b)
    assert weights == pytest.approx({"a": 100 / 30, "b": 100 / 90, "c": 100 / 180})
    assert 10 * weights["a"] == pytest.approx(30 * weights["b"]) == pytest.approx(60 * weights["c"])
    assert (10 * weights["a"] + 30 * weights["b"] + 60 * weights["c"]) / 100 == pytest.approx(1.0)


def test_weight_options():
    counts = {"a": 10, "b": 30, "c": 60}
    assert bucket_weights(counts, WeightOptions(temperature=0.0)) == pytest.approx({"a": 1.0, "b": 1.0, "c": 1.0})
    half = bucket_weights(counts, WeightOptions(temperature=0.5))
    scale = 100 / (10 * 10 ** -0.5 + 30 * 30 ** -0.5 + 60 * 60 ** -0.5)
    assert half == pytest.approx({b: n ** -0.5 * scale for b, n in counts.items()})
    dropped = bucket_weights(counts, WeightOptions(min_bucket_size=20))
    assert dropped["a"] == 0.0 and dropped["b"] == pytest.approx(90 / (2 * 30))
    clipped = bucket_weights(counts, WeightOptions(clip=[0.8, 2.0]))
    assert clipped == pytest.approx({"a": 2.0, "b": 100 / 90, "c": 0.8})


def test_scheme_lists_buckets_and_rejects_bad_files(tmp_path):
    scheme = load_scheme(SCHEME)
    assert scheme.bucket_id({"language": "zh", "track": "multi", "family": "dialogue", "length_bin": "short"}) == "zh|multi|dialogue|short"
    assert len(scheme.all_buckets()) == 2 * 2 * 3 * 4
    assert scheme.sources["cmrc2018"] == {"track": "single", "family": "qa", "style": "qa_search"}
    bad = tmp_path / "bad.yaml"
    bad.write_text(SCHEME.read_text().replace("length_unit: v2", "length_unit: v9"))
    with pytest.raises(ConfigError, match="length_unit"):
        load_scheme(bad)
    bad.write_text(SCHEME.read_text().replace("  - {name: xlong}\n", ""))
    with pytest.raises(ConfigError, match="open last bin"):
        load_scheme(bad)


def test_label_precedence_row_then_source_then_scheme_then_format(tmp_path):
    rows = SAMPLE[:2]
    plain = [{k: v for k, v in r.items() if k not in ("track", "family", "style_bucket", "length_bin", "bucket_id")} for r in rows]
    (tmp_path / "labelled.json").write_text(json.dumps(rows))
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    sources = [
        # the row's labels beat the source config
        {"name": "labelled", "format": "llamafactory", "path": "labelled.json", "split": "train", "language": "en",
         "track": "multi", "family": "dialogue", "style": "open_chat"},
        # the source config beats the scheme entry (coqa: multi/qa/qa_search)
        {"name": "coqa", "format": "llamafactory", "path": "plain.json", "split": "val", "language": "en",
         "family": "assistant", "style": "assistant_like"},
        # the scheme's entry for the source name fills what the config leaves out
        {"name": "coqa", "format": "llamafactory", "path": "plain.json", "split": "test", "language": "en"},
    ]
    prepare(write_config(tmp_path / "c.yaml", sources, dedup=False), tmp_path / "run", progress=False)
    labelled = read_jsonl(tmp_path / "run/data/train.jsonl")
    assert [(r["track"], r["family"], r["style"]) for r in labelled] == [(r["track"], r["family"], r["style_bucket"]) for r in rows]
    assert {(r["track"], r["family"], r["style"]) for r in read_jsonl(tmp_path / "run/data/val.jsonl")} == {("multi", "assistant", "assistant_like")}
    assert {(r["track"], r["family"], r["style"]) for r in read_jsonl(tmp_path / "run/data/test.jsonl")} == {("multi", "qa", "qa_search")}


def test_format_default_and_missing_labels(tmp_path):
    squad = DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json"
    config = write_config(tmp_path / "c.yaml", [{"name": "mycorpus", "format": "squad", "path": str(squad), "split": "train"}], dedup=False)
    prepare(config, tmp_path / "run", progress=False)
    records = read_jsonl(tmp_path / "run/data/train.jsonl")
    assert {(r["language"], r["track"], r["family"], r["style"]) for r in records} == {("zh", "single", "qa", "qa_search")}
    (tmp_path / "plain.json").write_text(json.dumps([{k: v for k, v in SAMPLE[0].items() if k not in ("track", "family", "style_bucket")}]))
    config = write_config(tmp_path / "d.yaml", [{"name": "mine", "format": "llamafactory", "path": "plain.json", "split": "train"}])
    from polyalign.data.prepare import PrepareError
    with pytest.raises(PrepareError, match="no track for source 'mine'"):
        prepare(config, tmp_path / "run2", progress=False)


def test_track_belongs_to_the_source_not_the_row_shape(demo_run):
    run, _, _ = demo_run
    records = [r for s in ("train", "val", "test") for r in read_jsonl(run / f"data/{s}.jsonl")]
    coqa_first_turns = [r for r in records if r["dataset"] == "polyalign_sample" and r["track"] == "multi" and not r["history"]]
    assert coqa_first_turns, "the sample has multi-track rows without history (first turns)"
    first_dialogue_turns = [r for r in records if r["dataset"] == "kdconv" and r["id"].endswith("-turn-1")]
    assert first_dialogue_turns and all(r["track"] == "multi" and r["history"] == [] for r in first_dialogue_turns)
