import dataclasses
import json
import random
import re

import pytest

from polyalign.core.wording import counted
from polyalign.core.yaml_config import ConfigError
from polyalign.data.bucketing import (
    WEIGHT_PRESETS,
    bucket_weights,
    effective_sizes,
    load_scheme,
    weight_options,
    weight_warnings,
)
from polyalign.data.prepare import prepare
from tests.conftest import DEMO_DATA, SCHEME, read_jsonl, write_config

SAMPLE = json.loads((DEMO_DATA / "en/polyalign-sample/dist_sft_val.json").read_text(encoding="utf-8"))


METHOD = WEIGHT_PRESETS["method"]


def test_weights_give_every_bucket_equal_mass():
    weights = bucket_weights({"a": 10, "b": 30, "c": 60}, METHOD)
    # N / (K n_b) = 100 / (3 n_b)
    assert weights == pytest.approx({"a": 100 / 30, "b": 100 / 90, "c": 100 / 180})
    assert 10 * weights["a"] == pytest.approx(30 * weights["b"]) == pytest.approx(60 * weights["c"])
    assert (10 * weights["a"] + 30 * weights["b"] + 60 * weights["c"]) / 100 == pytest.approx(1.0)


def test_weight_options():
    counts = {"a": 10, "b": 30, "c": 60}
    assert (bucket_weights(counts, dataclasses.replace(METHOD, temperature=0.0))
            == pytest.approx({"a": 1.0, "b": 1.0, "c": 1.0}))
    half = bucket_weights(counts, dataclasses.replace(METHOD, temperature=0.5))
    scale = 100 / (10 * 10 ** -0.5 + 30 * 30 ** -0.5 + 60 * 60 ** -0.5)
    assert half == pytest.approx({b: n ** -0.5 * scale for b, n in counts.items()})
    dropped = bucket_weights(counts, dataclasses.replace(METHOD, min_bucket_size=20))
    assert dropped["a"] == 0.0 and dropped["b"] == pytest.approx(90 / (2 * 30))
    clipped = bucket_weights(counts, dataclasses.replace(METHOD, clip=[0.8, 2.0]))
    assert clipped == pytest.approx({"a": 2.0, "b": 100 / 90, "c": 0.8})


# Real demo-like counts: a 1-record bucket beside large siblings, two tiny buckets of one family.
COUNTS = {"en|multi|dialogue|long": 1, "en|multi|dialogue|medium": 117, "en|multi|dialogue|short": 1877,
          "zh|single|assistant|medium": 3, "zh|single|assistant|long": 6, "zh|single|assistant|xlong": 179,
          "zh|single|qa|short": 700, "zh|multi|qa|long": 2}


def test_small_buckets_borrow_their_parent_groups_mean_size():
    sizes = effective_sizes(COUNTS, borrow_below=20)
    assert sizes["en|multi|dialogue|medium"] == 117 and sizes["zh|single|qa|short"] == 700
    # en|multi|dialogue holds 1 + 117 + 1877 = 1995 records in 3 buckets
    assert sizes["en|multi|dialogue|long"] == pytest.approx(1995 / 3)
    # zh|single|assistant: 3 + 6 + 179 = 188 records in 3 buckets
    assert sizes["zh|single|assistant|medium"] == sizes["zh|single|assistant|long"] == pytest.approx(188 / 3)
    # zh|multi|qa holds only its 2 records, zh|multi only those too: the language's 3 + 6 + 179 + 700 + 2
    # records over its 5 buckets
    assert sizes["zh|multi|qa|long"] == pytest.approx(890 / 5)
    # nothing borrows at borrow_below 0, and a lone tiny bucket falls back to the mean of all buckets
    assert effective_sizes(COUNTS, 0) == {b: float(n) for b, n in COUNTS.items()}
    assert effective_sizes({"a|x": 1, "b|y": 99}, 50)["a|x"] == pytest.approx(50.0)


def test_default_weights_by_hand():
    options = WEIGHT_PRESETS["default"]
    assert (options.temperature, options.clip, options.borrow_below) == (0.5, [0.2, 5.0], 20)
    weights = bucket_weights(COUNTS, options)
    sizes = effective_sizes(COUNTS, 20)
    total = sum(COUNTS.values())
    scale = total / sum(COUNTS[b] * sizes[b] ** -0.5 for b in COUNTS)
    expected = {b: min(max(sizes[b] ** -0.5 * scale, 0.2), 5.0) for b in COUNTS}
    assert weights == pytest.approx(expected)
    assert max(weights.values()) <= 5.0 and min(weights.values()) >= 0.2
    # the METHOD preset gives the 1-record bucket its extreme weight N / (K n_b)
    assert bucket_weights(COUNTS, METHOD)["en|multi|dialogue|long"] == pytest.approx(total / len(COUNTS))
    assert weights["en|multi|dialogue|long"] < 2


def test_weights_do_not_depend_on_the_order_counts_arrive_in():
    # a Beam build collects its counts in shard order; the weights must be bit-identical to the local build's
    counts = {f"b{i}|x|y|z": n for i, n in enumerate([3, 7, 11, 13, 170, 1900, 23, 41, 59, 61, 700, 2])}
    expected = bucket_weights(counts, WEIGHT_PRESETS["default"])
    items = list(counts.items())
    for seed in range(20):
        random.Random(seed).shuffle(items)
        assert bucket_weights(dict(items), WEIGHT_PRESETS["default"]) == expected


def test_weight_options_from_a_scheme_mapping():
    assert weight_options({}, "w") == WEIGHT_PRESETS["default"]
    assert weight_options({"preset": "method"}, "w") == METHOD
    assert weight_options({"preset": "method", "clip": [0.5, 3]}, "w").clip == [0.5, 3.0]
    with pytest.raises(ConfigError, match="unknown weight preset 'equal'"):
        weight_options({"preset": "equal"}, "w")
    with pytest.raises(ConfigError, match="unknown key 'temprature'; did you mean 'temperature'"):
        weight_options({"temprature": 1}, "w")
    for clip in ([3, 1], [0, 0], [0.5, float("inf")], [-1, 2]):
        with pytest.raises(ConfigError, match="clip: expected .* a finite w_max > 0"):
            weight_options({"clip": clip}, "w")


def test_weight_warnings_name_heavy_buckets_and_unmeasured_ones():
    weights = bucket_weights(COUNTS, METHOD)
    lines = weight_warnings(weights, COUNTS, {"en|multi|dialogue|short": 5}, None, warn_above=10)
    heavy = [line for line in lines if "above 10" in line]
    assert len(heavy) == 4 and ("bucket en|multi|dialogue|long: weight 360.6 from 1 train records"
                                in heavy[0])  # 2885 / (8 x 1)
    assert lines[-1].startswith("7 train bucket(s) absent from val")
    assert not any("absent from test" in line for line in lines)  # test counts unknown: nothing said
    many = {b: 5 for b in COUNTS}
    assert weight_warnings(bucket_weights(COUNTS), COUNTS, many, many, warn_above=10) == []
    # test buckets with 1 to 4 rows: no interval of their own, so no judged macro in a comparison
    test = {**many, "en|multi|dialogue|long": 1, "zh|single|assistant|medium": 3, "zh|multi|qa|long": 0}
    assert weight_warnings(bucket_weights(COUNTS), COUNTS, many, test, warn_above=10) == [
        "1 train bucket(s) absent from test, so no test number covers them: zh|multi|qa|long",
        "2 of 7 test buckets have fewer than 5 rows (en|multi|dialogue|long 1, zh|single|assistant|medium 3): "
        "evaluate gives them no interval of their own, so a comparison of models cannot judge the macro numbers "
        "they count in; a larger test share (prepare's split.weights) gives them more rows"]


def test_scheme_lists_buckets_and_rejects_bad_files(tmp_path):
    scheme = load_scheme(SCHEME)
    assert scheme.bucket_id({"language": "zh", "track": "multi", "family": "dialogue",
                             "length_bin": "short"}) == "zh|multi|dialogue|short"
    assert len(scheme.all_buckets()) == 2 * 2 * 3 * 4
    assert scheme.sources["cmrc2018"] == {"track": "single", "family": "qa", "style": "qa_search"}
    bad = tmp_path / "bad.yaml"
    bad.write_text(SCHEME.read_text().replace("length_unit: v2", "length_unit: v9"))
    with pytest.raises(ConfigError, match="length_unit"):
        load_scheme(bad)
    # each problem named where it is, with what to do
    for change, said in [
        (("  - {name: xlong}\n", ""), "length_bins: the last bin 3 ('long') has max 240: the last bin has no max"),
        (("{name: long, max: 240}", "{name: long, max: 100}"),
         "length_bins: bin 3 ('long') has max 100, not above the bin before it (120)"),
        (("{name: medium, max: 120}", "{name: medium}"), "length_bins: bin 2 ('medium') has no max"),
        (("{name: long, max: 240}", "{name: short, max: 240}"), "length_bins: two bins are named 'short'"),
        (("[language, track, family, length_bin]", "[language, track, famliy, length_bin]"),
         "dimensions: unknown dimension 'famliy'; did you mean 'family'?"),
        (("[language, track, family, length_bin]", "[language, family, family]"), "dimensions: family listed twice"),
    ]:
        bad.write_text(SCHEME.read_text().replace(*change))
        with pytest.raises(ConfigError, match=re.escape(f"{bad}: {said}")):
            load_scheme(bad)


def test_label_precedence_row_then_source_then_scheme_then_format(tmp_path):
    rows = SAMPLE[:2]
    plain = [{k: v for k, v in r.items() if k not in ("track", "family", "style_bucket", "length_bin", "bucket_id")}
             for r in rows]
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
    assert ([(r["track"], r["family"], r["style"]) for r in labelled]
            == [(r["track"], r["family"], r["style_bucket"]) for r in rows])
    assert ({(r["track"], r["family"], r["style"]) for r in read_jsonl(tmp_path / "run/data/val.jsonl")}
            == {("multi", "assistant", "assistant_like")})
    assert ({(r["track"], r["family"], r["style"]) for r in read_jsonl(tmp_path / "run/data/test.jsonl")}
            == {("multi", "qa", "qa_search")})


def test_format_default_and_missing_labels(tmp_path):
    squad = DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json"
    config = write_config(tmp_path / "c.yaml", [{"name": "mycorpus", "format": "squad", "path": str(squad),
                                                 "split": "train"}], dedup=False)
    prepare(config, tmp_path / "run", progress=False)
    records = read_jsonl(tmp_path / "run/data/train.jsonl")
    assert ({(r["language"], r["track"], r["family"], r["style"]) for r in records}
            == {("zh", "single", "qa", "qa_search")})
    (tmp_path / "plain.json").write_text(json.dumps([{k: v for k, v in SAMPLE[0].items()
                                                      if k not in ("track", "family", "style_bucket")}]))
    config = write_config(tmp_path / "d.yaml", [{"name": "mine", "format": "llamafactory", "path": "plain.json",
                                                 "split": "train"}])
    # Unlabelled alpaca rows: the track from the conversation, family and style the format's defaults.
    prepare(config, tmp_path / "run2", progress=False)
    (record,) = read_jsonl(tmp_path / "run2/data/train.jsonl")
    track = "multi" if SAMPLE[0].get("history") else "single"
    assert (record["track"], record["family"], record["style"]) == (track, "assistant", "assistant_like")


def test_track_belongs_to_the_source_not_the_row_shape(demo_run):
    run, _, _ = demo_run
    records = [r for s in ("train", "val", "test") for r in read_jsonl(run / f"data/{s}.jsonl")]
    coqa_first_turns = [r for r in records
                        if r["dataset"] == "polyalign_sample" and r["track"] == "multi" and not r["history"]]
    assert coqa_first_turns, "the sample has multi-track rows without history (first turns)"
    first_dialogue_turns = [r for r in records if r["dataset"] == "kdconv" and r["id"].endswith("-turn-1")]
    assert first_dialogue_turns and all(r["track"] == "multi" and r["history"] == [] for r in first_dialogue_turns)


def test_a_scheme_of_ones_own_is_what_stats_reads_and_editing_it_needs_prepare_overwrite(tmp_path, monkeypatch):
    """A team's scheme (language second, no track, three bins of their own): the stats report names it and
    its bins, draws every bucket in its language's panel, and after the file changes keeps reading the
    scheme prepare bucketed the records by, saying so (it drew the new bounds over the old bins, silently)."""
    import yaml

    from polyalign.cli import main
    from polyalign.reports import plots
    from polyalign.reports.stats import compute_stats

    scheme = tmp_path / "team.yaml"
    text = (SCHEME.read_text().replace("dimensions: [language, track, family, length_bin]",
                                       "dimensions: [family, language, length_bin]")
            .replace("name: polyalign", "name: team_v1", 1))
    bins = "length_bins:\n  - {name: brief, max: 20}\n  - {name: mid, max: 80}\n  - {name: long}\n"
    text = text[:text.index("length_bins:")] + bins + text[text.index("\n", text.index("{name: xlong}")) + 1:]
    scheme.write_text(text)
    sources = [{"name": "polyalign_sample", "format": "llamafactory", "language": "en",
                "path": str(DEMO_DATA / "en/polyalign-sample/dist_sft_val.json")},
               {"name": "cmrc2018", "format": "squad", "language": "zh",
                "path": str(DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json")}]
    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump({"scheme": str(scheme), "sources": sources, "dedup": False}))
    prepare(config, tmp_path / "run", progress=False)
    import matplotlib.pyplot as plt

    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # figures kept open to read back
    stats = compute_stats(tmp_path / "run", progress=False)
    buckets = stats["counts"]["by_bucket"]
    assert buckets and all(b.split("|")[1] in ("en", "zh") and b.split("|")[2] in ("brief", "mid", "long")
                           for b in buckets)
    counts = next(fig for fig in drawn if fig.axes[0].get_title(loc="left").startswith("records per bucket"))
    panels = {ax.get_title(loc="left"): [t.get_text() for t in ax.get_yticklabels()] for ax in counts.axes}
    assert panels == {f"records per bucket ({lang})": sorted(b for b in buckets if b.split("|")[1] == lang)
                      for lang in ("en", "zh")}
    said = (tmp_path / "run" / "stats" / "report.md").read_text()
    assert f"bucket scheme team_v1 ({scheme}): a bucket is family|language|length_bin; length bins brief <= 20, " \
           "mid <= 80, long > 80 (v2 units)" in said
    # a non-empty answer v2 gives no unit (the sample's "бояре": Cyrillic) is counted apart from empty ones
    from polyalign.data.records import read_records

    data = tmp_path / "run" / "data"
    records = [r for split in ("train", "val", "test") for r in read_records(data / f"{split}.jsonl")]
    assert any(r.response == "бояре" and r.length_tokens == 0 for r in records)
    unmeasured = sum(1 for r in records if r.response and not r.length_tokens)
    assert stats["counts"]["unmeasured_responses"] == unmeasured >= 1
    assert f"{counted(unmeasured, 'non-empty response')} of length 0 (no letter the v2 unit counts" in said
    # the file changes after prepare: the records keep their bins, and stats keeps the scheme that made them
    scheme.write_text(text.replace("{name: brief, max: 20}", "{name: brief, max: 50}"))
    again = compute_stats(tmp_path / "run", progress=False)
    assert again["counts"]["by_bucket"] == buckets and again["scheme"]["length_bins"][0] == {"name": "brief", "max": 20}
    manifest = tmp_path / "run" / "data" / "manifest.json"
    assert again["notes"] == [
        f"{scheme} has changed since prepare bucketed this run (length_bins[0].max): its records keep the buckets and "
        f"length bins of the scheme as prepare read it (in {manifest}), which is used here; run `polyalign prepare "
        "--overwrite` to bucket them by the file as it is now"]
    assert main(["stats", str(tmp_path / "run"), "--no-progress"]) == 0
    # prepare again with the edited file is another run: refused, naming what changed, until --overwrite
    with pytest.raises(ConfigError, match=r"made with other settings \(scheme\.length_bins\[0\]\.max: 20 there, 50 "
                                          r"now\); pass --overwrite"):
        prepare(config, tmp_path / "run", progress=False)
    prepare(config, tmp_path / "run", progress=False, overwrite=True)
    assert json.loads(manifest.read_text())["scheme"]["definition"]["length_bins"][0] == {"name": "brief", "max": 50}
    prepare(config, tmp_path / "run", progress=False)  # the same file and config again: the same run, allowed
    # a manifest of the release before definitions were recorded goes by the file as it is now
    old = json.loads(manifest.read_text())
    del old["scheme"]["definition"]
    manifest.write_text(json.dumps(old))
    prepare(config, tmp_path / "run", progress=False)
    # a scheme with no language dimension: one panel of every bucket
    plots.bucket_counts(buckets, ["en", "zh"], tmp_path / "one.png", position=None)
    assert [ax.get_title(loc="left") for ax in drawn[-1].axes] == ["records per bucket (all buckets)"]
    assert len(drawn[-1].axes[0].get_yticklabels()) == len(buckets)
