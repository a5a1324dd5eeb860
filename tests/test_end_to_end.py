"""prepare + stats end to end: the bundled demo data, the authors' sample labels, and all of ../shared/data."""

import base64
import dataclasses
import json
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

from polyalign.cli import main
from polyalign.data.bucketing import bucket_weights, load_scheme, weight_warnings
from polyalign.data.prepare import prepare
from polyalign.data.records import RECORD_FIELDS
from polyalign.reports.stats import compute_stats
from tests.conftest import (
    DEMO_DATA,
    REPO,
    SCHEME,
    SHARED_DATA,
    read_jsonl,
    user_env,
    write_config,
)


def all_records(run):
    return [r for s in ("train", "val", "test") for r in read_jsonl(run / f"data/{s}.jsonl")]


def check_run(run, manifest):
    records = all_records(run)
    assert all(tuple(r) == RECORD_FIELDS for r in records)
    assert len({r["id"] for r in records}) == len(records)
    for source in manifest["sources"]:
        assert source["records"] == source["kept"] + sum(source["dropped"].values())
        assert source["kept"] == sum(source["kept_by_split"].values())
    assert manifest["totals"]["kept"] == len(records)
    assert Counter(r["split"] for r in records) == {s: n for s, n in manifest["totals"]["by_split"].items() if n}
    for r in records:
        assert r["bucket_id"] == "|".join((r["language"], r["track"], r["family"], r["length_bin"]))
    return records


def test_demo_prepare_and_stats(demo_run):
    run, manifest, stats = demo_run
    records = check_run(run, manifest)
    assert {r["language"] for r in records} == {"en", "zh"}
    assert {r["family"] for r in records} == {"assistant", "qa", "dialogue"}
    assert {r["length_bin"] for r in records} == {"short", "medium", "long", "xlong"}
    assert {s["name"] for s in manifest["sources"]} == {"polyalign_sample", "camrest676", "cmrc2018", "kdconv",
                                                        "crosswoz", "lccc", "coig_cqia"}
    coig = next(s for s in manifest["sources"] if s["name"] == "coig_cqia")
    assert coig["dropped"]["answer_not_human_written:llm"] == 240
    assert manifest["totals"]["empty_responses"] == sum(1 for r in records if r["response"] == "") > 0
    # stats agree with the data files
    assert stats["total"] == len(records)
    assert stats["counts"]["by_bucket"] == {
        b: {**{s: sum(1 for r in records if r["bucket_id"] == b and r["split"] == s) for s in ("train", "val", "test")},
            "total": sum(1 for r in records if r["bucket_id"] == b)} for b in sorted({r["bucket_id"] for r in records})}
    train = Counter(r["bucket_id"] for r in records if r["split"] == "train")
    weights = stats["weights"]["by_bucket"]
    expected = bucket_weights(train, load_scheme(SCHEME).weights)  # the scheme's: the default preset
    assert weights == pytest.approx({b: round(w, 6) for b, w in expected.items()}, rel=1e-5)
    assert 0.9 < stats["weights"]["mean_weight_per_record"] < 1.1 and max(weights.values()) <= 5.0
    assert stats["weights"]["warnings"] == weight_warnings(
        expected, train, Counter(r["bucket_id"] for r in records if r["split"] == "val"),
        Counter(r["bucket_id"] for r in records if r["split"] == "test"), 10.0)
    html = (run / "stats/report.html").read_text(encoding="utf-8")
    for png in ("counts.png", "lengths.png", "weights.png", "features.png"):  # inline: the page stands alone
        inline = base64.b64encode((run / "stats" / png).read_bytes()).decode("ascii")
        assert f"src='data:image/png;base64,{inline}'" in html and (run / "stats" / png).stat().st_size > 10_000
        assert f"({png})</figcaption>" in html
    assert "| zh\\|multi\\|dialogue\\|short |" in (run / "stats/report.md").read_text(encoding="utf-8")
    # the unit the lengths are in, in words, and the length of a response in it
    assert ("buckets; length unit v2 (an English word, a run of digits, a Chinese character or a punctuation mark "
            "counts 1); ") in html
    from polyalign.data.text import length_units

    assert length_units("I don't know.") == 4 and length_units("我不知道。") == 5
    assert length_units("我不知道。", "v1") == 2
    # each source's records with system messages of their own, as the manifest counts them
    sample = next(s for s in manifest["sources"] if s["name"] == "polyalign_sample")["system_messages"]
    assert sample["system_is_profile_prompt"] > 0
    assert f"profile prompt (left out): {sample['system_is_profile_prompt']}</td>" in html


def test_every_bucket_total_is_printed_inside_its_counts_panel(demo_run, tmp_path, monkeypatch):
    """The stats report's records-per-bucket chart on the demo's counts, the longest bucket of each language
    left without test rows (its last, zero-width bar sat at the panel's edge and cancelled the margin: the
    total was drawn outside the axes, under the legend)."""
    from polyalign.reports import plots

    _, _, stats = demo_run
    counts = {b: dict(c) for b, c in stats["counts"]["by_bucket"].items()}
    for language in ("en", "zh"):
        longest = max((b for b in counts if b.startswith(f"{language}|")), key=lambda b: counts[b]["total"])
        counts[longest]["test"] = 0
    figures = []
    monkeypatch.setattr(plots, "saved_figure", lambda fig, path: figures.append(fig) or path)
    plots.bucket_counts(counts, ["en", "zh"], tmp_path / "counts.png")
    for ax in figures[0].axes:
        totals = [float(text.get_position()[0]) for text in ax.texts]
        assert totals and max(totals) <= 0.95 * ax.get_xlim()[1], (ax.get_title(), max(totals), ax.get_xlim())


def test_every_record_is_drawn_in_its_buckets_length_histogram(demo_run, tmp_path, monkeypatch):
    """Each panel of the stats report's length histograms holds all of its bucket's records, the empty ones
    at 1, in bins that start at 1 and are drawn a margin before it; every bin bound is in view."""
    from polyalign.reports import plots

    run, _, _ = demo_run
    lengths = {}
    for split in ("train", "val", "test"):
        for row in read_jsonl(run / "data" / f"{split}.jsonl"):
            lengths.setdefault(row["bucket_id"], []).append(row["length_tokens"])
    lengths["en|single|qa|short"] += [0, 0]
    figures = []
    monkeypatch.setattr(plots, "saved_figure", lambda fig, path: figures.append(fig) or path)
    plots.length_histograms(lengths, [40, 120, 256], tmp_path / "lengths.png")
    panels = [ax for ax in figures[0].axes if ax.get_title()]
    assert len(panels) == len(lengths)
    for ax, bucket in zip(panels, sorted(lengths)):
        assert ax.get_title().startswith(f"{bucket} (n={len(lengths[bucket])}")
        (drawn,) = ax.patches
        heights = drawn.get_data().values
        assert heights.sum() == len(lengths[bucket]), bucket
        assert drawn.get_data().edges[0] == 1 and 0.5 < ax.get_xlim()[0] < 1  # a bar at 1 clear of the axis
        assert ax.get_xlim()[1] > max(256.5, drawn.get_data().edges[-1]), (bucket, ax.get_xlim())
    short = next(ax for ax in panels if ax.get_title().startswith("en|single|qa|short"))
    assert short.get_title().endswith(" of length 0, drawn at 1)")

def test_authors_sample_labels_are_reproduced_with_v1(tmp_path):
    """The bundled half of the sample here; the next test checks both files from ../shared/data."""
    sample = DEMO_DATA / "en/polyalign-sample/dist_sft_val.json"
    config = write_config(tmp_path / "c.yaml", [{"name": "polyalign_sample", "format": "llamafactory",
                                                 "path": str(sample), "split": "val", "language": "en"}],
                          length_unit="v1", dedup=False)
    manifest = prepare(config, tmp_path / "run", progress=False)
    # the fields polyalign computes on its own: 69 of the 2,000 rows are labelled multi-turn with no
    # history to show for it (58 dialogue, 11 QA turns cut from their conversation); family and style
    # labels are taken as they are, so there is nothing to agree with
    assert manifest["label_agreement"]["polyalign_sample"] == {"bucket_id": 1.0, "length_bin": 1.0, "track": 0.9655}
    v2 = manifest["length_unit_agreement"]["polyalign_sample"]["v2"]["bucket_id"]
    assert 0.95 < v2 < 1.0


needs_shared = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="../shared/data is not beside this checkout")


@needs_shared
@pytest.mark.slow
def test_shared_sample_both_files_v1_agreement(tmp_path):
    manifest = prepare(REPO / "configs/data/polyalign_sample_v1.yaml", tmp_path / "run", progress=False)
    counts = manifest["label_agreement_counts"]["polyalign_sample"]
    assert counts["bucket_id"] == {"agree": 4000, "total": 4000}
    assert manifest["label_agreement"]["polyalign_sample"]["bucket_id"] == 1.0
    assert manifest["totals"]["by_split"] == {"train": 0, "val": 2000, "test": 2000}
    assert sum(1 for r in read_jsonl(tmp_path / "run/data/test.jsonl") if r["response"] == "") == 53


@needs_shared
@pytest.mark.slow
def test_bilingual_config_acceptance(tmp_path):
    started = time.perf_counter()
    manifest = prepare(REPO / "configs/data/bilingual.yaml", tmp_path / "run", progress=False)
    stats = compute_stats(tmp_path / "run", progress=False)
    elapsed = time.perf_counter() - started
    records = check_run(tmp_path / "run", manifest)
    buckets = Counter(r["bucket_id"].split("|")[0] for r in {r["bucket_id"]: r for r in records}.values())
    assert buckets["en"] >= 10 and buckets["zh"] >= 8
    assert "train_vs_test" not in manifest["dedup"]["exact"]["by_kind"]
    from polyalign.data.dedup import exact_key
    from polyalign.data.records import Record
    train_keys = {exact_key(Record.from_json(r)) for r in records if r["split"] == "train"}
    assert not any(exact_key(Record.from_json(r)) in train_keys for r in records if r["split"] == "test")
    assert stats["total"] == len(records)
    print(f"\nbilingual prepare + stats: {len(records)} records, {elapsed:.1f} s")


def test_the_stats_report_shows_the_weights_its_build_trains_with(built_run, tmp_path):
    """The SFT weight column is the scheme's; a build made with other weights (`--weight-temperature 1`) adds
    the column it trains with, its options said above the table. A build with the scheme's adds nothing."""
    from polyalign.data.bucketing import WeightOptions

    run, manifest = built_run
    mine = tmp_path / "run"
    (mine / "build").mkdir(parents=True)
    (mine / "data").symlink_to((run / "data").resolve(), target_is_directory=True)
    (mine / "build/manifest.json").write_bytes((run / "build/manifest.json").read_bytes())
    stats = compute_stats(mine, progress=False)
    assert stats["weights"]["build"] is None  # the demo's build: the scheme's weights, no second column
    assert "build weight" not in (mine / "stats/report.md").read_text(encoding="utf-8")
    options = WeightOptions(temperature=1.0)
    built = bucket_weights(stats["weights"]["train_counts"], options)
    (mine / "build/manifest.json").write_text(json.dumps(
        {**manifest, "bucket_weights": built, "weight_options": {**dataclasses.asdict(options), "source": "mine"}}))
    stats = compute_stats(mine, progress=False)
    assert stats["weights"]["build"]["by_bucket"] == pytest.approx(built, abs=1e-6)
    assert stats["weights"]["by_bucket"] != pytest.approx(built, abs=1e-3)  # the column stays the scheme's
    report = (mine / "stats/report.md").read_text(encoding="utf-8")
    assert "| SFT weight | build weight |" in report
    assert ("build weight: what build/ trains with (temperature 1.0, clip [0.2, 5.0], borrow_below 20, "
            "min_bucket_size 0; mine)") in report
    bucket = "zh|multi|dialogue|short"
    row = next(line for line in report.splitlines() if line.startswith("| " + bucket.replace("|", "\\|")))
    assert row.endswith(f"| {stats['weights']['by_bucket'][bucket]:.3f} | {built[bucket]:.3f} |")
    assert "build weight</th>" in (mine / "stats/report.html").read_text(encoding="utf-8")
    # a bucket with no train record has no weight in either column (the build lists it at 1, for
    # val_loss_weighted; the scheme's weights leave it out): "-", said once above the table
    from polyalign.reports.stats import render_markdown
    assert "no train records, so nothing trains" not in report
    held_out = {**stats, "counts": {**stats["counts"], "by_bucket": {
        **stats["counts"]["by_bucket"], "en|single|qa|huge": {"train": 0, "val": 2, "test": 1, "total": 3}}},
        "length_quantiles": {**stats["length_quantiles"], "en|single|qa|huge": {"q10": 1, "q50": 2, "q90": 3}}}
    held_out["weights"] = {**stats["weights"], "build": {**stats["weights"]["build"], "by_bucket": {
        **stats["weights"]["build"]["by_bucket"], "en|single|qa|huge": 1.0}}}
    report = render_markdown(held_out, json.loads((run / "data/manifest.json").read_text()))
    assert "| en\\|single\\|qa\\|huge | 0 | 2 | 1 | 3 | 1 / 2 / 3 | - | - |" in report
    assert row in report  # the others as before
    assert "; -: no train records, so nothing trains on the bucket" in report
    # a language training has and the test split lacks is said once, as a language (its buckets are listed too)
    assert "warning: language " not in report
    held_out["counts"]["by_language"] = {**stats["counts"]["by_language"],
                                         "yue": {"train": 7, "val": 1, "test": 0, "total": 8}}
    report = render_markdown(held_out, json.loads((run / "data/manifest.json").read_text()))
    assert report.count("warning: language ") == 1 and (
        "- warning: language yue: 7 train records and none in test, so no test number covers yue (a source's "
        "`split:` in the data config, or split.weights, gives it some)\n") in report
    # a build made before prepare ran again (training refuses it): its weights are not shown as what trains
    made_from = {**manifest["made_from"], "data/manifest.json": "0" * 64}
    (mine / "build/manifest.json").write_text(json.dumps({**manifest, "bucket_weights": built, "made_from": made_from}))
    stats = compute_stats(mine, progress=False)
    report = (mine / "stats/report.md").read_text(encoding="utf-8")
    assert stats["weights"]["build"] == {"stale": True} and "| build weight |" not in report
    assert "build/ was made before prepare ran again: its weights are not shown" in report


def test_cli_prepare_stats_and_demo(tmp_path, capsys, monkeypatch):
    from polyalign.data import prepare as preparing

    real, asked = preparing.prepare, []
    monkeypatch.setattr(preparing, "prepare", lambda *a, **k: asked.append(k["progress"]) or real(*a, **k))
    assert main(["demo", "--out", str(tmp_path / "demo"), "--stages", "prepare", "--no-progress"]) == 0
    assert (tmp_path / "demo/data/manifest.json").is_file() and not (tmp_path / "demo/stats").exists()
    assert asked == [False]  # --no-progress reaches the stage: no bars in a log
    assert main(["stats", str(tmp_path / "demo"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "report: " in out and (tmp_path / "demo/stats/stats.json").is_file()
    assert main(["demo", "--out", str(tmp_path / "x"), "--stages", "prepare,bogus"]) == 2
    assert "unknown demo stage 'bogus'" in capsys.readouterr().err
    assert main(["stats", str(tmp_path / "nothing")]) == 2
    assert "run `polyalign prepare" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_demo_trains_and_its_validation_loss_falls(tmp_path, capsys):
    import math

    from polyalign.train.metrics import read_metrics

    run = tmp_path / "demo"
    # As users run it: a process of its own, compiled at the optimisation users get (user_env)
    demo = subprocess.run([sys.executable, "-m", "polyalign.cli", "demo", "--out", str(run), "--quick"],
                          env=user_env(), capture_output=True, text=True, timeout=1800)
    assert demo.returncode == 0, demo.stderr[-3000:]
    out = demo.stdout
    assert "tokenizer: 6000 pieces" in out and "[5/10] sft: sft 20 steps" in out
    assert (run / "tokenizer/tokenizer.model").is_file() and (run / "build/manifest.json").is_file()
    for name in ("sft", "bucket_sft"):
        assert (run / name / "model/model.safetensors").is_file() and (run / name / "model/tokenizer.model").is_file()
        evals = [r for r in read_metrics(run / name) if "val_loss" in r]
        assert [r["step"] for r in evals] == [10, 20]
        assert evals[1]["val_loss"] < evals[0]["val_loss"] < math.log(6000)
    # The same batches, weighted differently.
    assert json.loads((run / "sft" / "config.json").read_text())["weighting"] == "uniform"
    assert read_metrics(run / "sft")[0]["loss"] != read_metrics(run / "bucket_sft")[0]["loss"]
    from polyalign.model import load_hf_checkpoint

    model = load_hf_checkpoint(run / "bucket_sft" / "model")
    assert model.config.vocab_size == 6000 and model.config.num_layers == 4
    # Generation, pairs, the critic, HDPO and DPO.
    critic = json.loads((run / "critic" / "critic.json").read_text())
    assert critic["val_pairs"] > 10 and 0 <= critic["val"]["ranking_accuracy"] <= 1
    # human-vs-model AUC over all validation responses, and per bucket where both sides exist
    assert 0 <= critic["val"]["auc"] <= 1 and critic["val"]["auc_by_bucket"]
    assert set(critic["val"]["auc_by_bucket"]) <= set(critic["buckets"])
    assert set(critic["val"]["pairs_by_bucket"]) == set(critic["val"]["auc_by_bucket"])  # each AUC with its pairs
    assert sum(critic["val"]["pairs_by_bucket"].values()) <= critic["val_pairs"]
    assert all("critic_chosen" in p for p in read_jsonl(run / "critic" / "train_pairs.jsonl"))
    _critic_ranks_held_out_people_first(run)
    # HDPO's card names the critic its distance term trained on, with its held-out ranking; DPO's has none
    assert (f"critic.json: ranking accuracy {critic['val']['ranking_accuracy']:.3f}, AUC {critic['val']['auc']:.3f} "
            f"on {critic['val_pairs']} held-out pairs (0.5: chance)") in (run / "hdpo/model/README.md").read_text()
    assert "| critic |" not in (run / "dpo/model/README.md").read_text()
    for method in ("hdpo", "dpo"):
        steps = read_metrics(run / method)
        assert [r["step"] for r in steps] == list(range(1, 9))
        assert abs(steps[0]["rewards/margin"]) < 1e-4  # policy = reference at the first step
        assert max(r["rewards/margin"] for r in steps[1:]) > 0
        assert (run / method / "model" / "model.safetensors").is_file()
    comparison = json.loads((run / "hdpo" / "comparison.json").read_text(),
                            parse_constant=lambda c: pytest.fail(f"{c} in comparison.json: not JSON"))
    assert set(comparison["methods"]) == {"bucket_sft", "dpo", "hdpo"}
    for decodings in comparison["methods"].values():
        for v in decodings.values():
            assert v["answers"] == v["empty"] + v["generations"]
            assert (v["support_distance"] is None) == (v["generations"] == 0)
    # Evaluation of every trained method on the same test records: 5 of every test bucket (all of a smaller one)
    from collections import Counter

    from polyalign.reports.no_model import ahead_of_the_model

    test_buckets = Counter(r["bucket_id"] for r in read_jsonl(run / "data" / "test.jsonl"))
    for method in ("sft", "bucket_sft", "dpo", "hdpo"):
        metrics = json.loads((run / "eval" / method / "metrics.json").read_text())
        assert metrics["alignment"]["evaluated"] == sum(min(5, n) for n in test_buckets.values())
        assert set(metrics["metrics"]["buckets"]) == set(test_buckets), method
        # what `polyalign evaluate` warns of reaches the demo's reader too (a reader ranked four models that
        # copying the question beat)
        if behind := ahead_of_the_model(metrics["metrics"]):
            assert f"warning: {method}: {behind}" in demo.stderr
        assert f"{method}: answering and evaluating\n" in demo.stderr  # whose progress bars follow
        assert metrics["metrics"]["mauve"]["status"] == "computed"
        # a classifier tells the 20-step demo models' answers from people's, well above people's own floor
        detect = metrics["metrics"]["detectability"]
        assert detect["overall_macro"] > detect["floor_macro"] + 0.1, (method, detect["overall_macro"])
    assert (f"up to 5 of each of {len(test_buckets)} buckets (sampled: temperature 0.8, top-p 0.9; --quick trains "
            "for seconds: too little to tell the methods apart)") in out
    assert (run / "report" / "report.html").is_file() and (run / "report" / "report.md").is_file()
    # the report says how the models were trained, read from each predictions' checkpoint's run
    summary = json.loads((run / "report" / "comparison.json").read_text())["summary"]
    assert "method (sft | sft | dpo | hdpo)" in summary["models_differ_in"]
    assert "weighting (uniform | bucket | — | —)" in summary["models_differ_in"], summary["models_differ_in"]
    # The same command again redoes a stage from its outputs; the full demo's settings are refused in a
    # quick run's folder, naming the key, until --overwrite.
    capsys.readouterr()
    assert main(["demo", "--out", str(run), "--quick", "--stages", "report"]) == 0
    assert main(["demo", "--out", str(run), "--stages", "tokenizer"]) == 2
    err = capsys.readouterr().err
    assert "vocab_size: 6000 there, 8000 now" in err and "--overwrite" in err


def _critic_ranks_held_out_people_first(run):
    """The demo critic on the test split, which neither it nor its pairs saw: people's answers score
    closer to their bucket's support than the demo model's answers to the same prompts, and closer than
    people's answers in the other language (a set no person would give to those prompts). In the buckets it
    learned: those with at least 5 of its 86 training pairs (53 are in one bucket), 20 test rows of 4 buckets
    where AUC is 0.82 and 0.83; over all 18 (5 rows each, most with 0-2 pairs) it is 0.64 and 0.62."""
    from collections import Counter

    from sklearn.metrics import roc_auc_score

    from polyalign.data.records import read_records
    from polyalign.train.critic_model import CriticScorer

    scorer = CriticScorer(run / "critic")
    learned = Counter(pair["bucket_id"] for pair in read_jsonl(run / "critic" / "train_pairs.jsonl"))
    test = {r.id: r for r in read_records(run / "data" / "test.jsonl")}
    generated = [(test[row["id"]], row["prediction"]) for row in read_jsonl(run / "generate" / "bucket_sft_test.jsonl")
                 if learned[test[row["id"]].bucket_id] >= 5]
    records = [r for r, _ in generated]
    buckets = [r.bucket_id for r in records]
    people = scorer([r.response for r in records], buckets)
    by_language = {lang: [r.response for r in test.values() if r.language == lang] for lang in ("en", "zh")}
    other_language = [by_language["zh" if r.language == "en" else "en"][i] for i, r in enumerate(records)]

    def auc(others):  # the chance that a person's answer scores closer than one of `others`
        return roc_auc_score([1] * len(people) + [0] * len(others), -np.concatenate([people, others]))

    assert len(records) >= 15
    assert auc(scorer([g for _, g in generated], buckets)) > 0.7
    assert auc(scorer(other_language, buckets)) > 0.6


@pytest.mark.parametrize("command", [[], ["prepare"], ["stats"], ["demo"], ["tokenizer", "train"], ["build"],
                                     ["train", "sft"]])
def test_help_teaches(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: polyalign" in text
    if command == ["prepare"]:
        assert "formats: llamafactory squad kdconv crosswoz lccc coig convlab chat sharegpt" in text


def test_an_interrupted_demo_stage_says_where_it_stopped(tmp_path, capsys, monkeypatch):
    """A stage whose training stops early (Ctrl-C, SIGTERM) ends the demo with where it stopped and
    how to resume, exit status 130; it used to fail reading the validation loss the run never reached."""
    import polyalign.train.run

    stopped = {"interrupted": True, "stopped_early": True, "start_step": 0, "end_step": 7, "last": {"loss": 5.0}}
    monkeypatch.setattr(polyalign.train.run, "train", lambda config, out, **options: stopped)
    assert main(["demo", "--out", str(tmp_path / "demo"), "--stages", "sft"]) == 130
    err = capsys.readouterr().err
    assert err == "polyalign demo: sft stopped at step 7 (checkpoint saved); run the same demo command to resume\n"


def test_every_option_of_every_command_says_what_it_does():
    import argparse

    from polyalign.cli import build_parser

    def commands(parser, name="polyalign"):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield from commands(sub, f"{name} {sub_name}")

    missing = [f"{name} {action.option_strings or action.dest}" for name, parser in commands(build_parser())
               for action in parser._actions
               if not isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))
               and not action.help]
    assert not missing, missing


def test_help_imports_nothing_heavy():
    """`polyalign --help` (and every subcommand's) builds its parser without jax, flax, numpy,
    matplotlib or the language detector: about 0.1 s instead of 9 (bench: `time polyalign --help`)."""
    import subprocess
    import sys

    probe = ("import sys; from polyalign.cli import build_parser; build_parser(); "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'numpy', 'matplotlib', "
             "'datasketch', 'lingua', 'tensorflow', 'torch'}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_python_dash_m_polyalign_is_the_program():
    """`python -m polyalign` runs the `polyalign` program, status included, where scripts are not on PATH."""
    import subprocess
    import sys

    from polyalign import __version__

    result = subprocess.run([sys.executable, "-m", "polyalign", "--version"], capture_output=True, text=True)
    assert (result.returncode, result.stdout.strip()) == (0, f"polyalign {__version__}")
    wrong = subprocess.run([sys.executable, "-m", "polyalign", "nosuchcommand"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "invalid choice: 'nosuchcommand'" in wrong.stderr


def test_a_training_process_imports_only_what_training_uses():
    """Every `polyalign train` process (one per host, several per test) starts without the report,
    evaluation and chat-template stacks: jinja2 only loads for a checkpoint's own template."""
    probe = ("import sys; import polyalign.cli; from polyalign.train.run import train; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'jinja2', 'matplotlib', 'sklearn', 'scipy', "
             "'mauve', 'lingua', 'tensorflow', 'torch', 'apache_beam', 'fastapi', 'nltk'}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
