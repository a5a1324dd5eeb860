"""prepare and build as Apache Beam pipelines (DirectRunner) produce what the single-machine path does.

apache-beam pins older protobuf, pyarrow and pillow than the rest of polyalign resolves to, so it lives
in its own environment (the `beam` extra; the README's test command makes .venv-beam) and the Beam
side of each comparison runs there, on this checkout's code, while the single-machine side runs here.
"""

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from polyalign.data.prepare import PrepareError, prepare
from polyalign.data.records import InputError
from polyalign.inputs.built import BuildOptions
from tests.beam_env import in_beam_env
from tests.conftest import DEMO_DATA, REPO, first_records, read_jsonl, write_config

# file_digests: each engine writes its own files (one train.jsonl, or shards of it)
RUN_DEPENDENT = ("created", "timings_s", "engine", "file_digests")


def beam_cli(*argv: str) -> subprocess.CompletedProcess:
    return in_beam_env("import sys; from polyalign.cli import main; sys.exit(main(sys.argv[1:]))", *argv)


def beam_build(run: Path, options: BuildOptions) -> dict:
    code = ("import json, sys; from pathlib import Path; from polyalign.beam.build import build_beam; "
            "from polyalign.inputs.built import BuildOptions; "
            "print(json.dumps(build_beam(Path(sys.argv[1]), BuildOptions(**json.loads(sys.argv[2])))))")
    done = in_beam_env(code, str(run), json.dumps(dataclasses.asdict(options)))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def comparable(manifest: dict) -> dict:
    """A manifest less what differs by engine and layout: the files it names (one file, or shards)."""
    kept = json.loads(json.dumps({k: v for k, v in manifest.items() if k not in RUN_DEPENDENT}))
    for entry in (kept["dropped_rows"], kept["quarantine"], kept["dedup"].get("exact", {}),
                  kept["dedup"]["near_duplicates"]):
        entry.pop("file", None)
    return kept


def lines(data: Path, name: str) -> list[str]:
    """A prepare output's rows, from one file or the shards of a Beam run, in a canonical order."""
    paths = sorted(data.glob(f"{name}.jsonl")) or sorted(data.glob(f"{name}-*-of-*.jsonl"))
    assert paths, f"{data}: no {name} output"
    return sorted(line for path in paths for line in path.read_text(encoding="utf-8").splitlines() if line)


def dataset_rows(run: Path, split: str) -> list[tuple]:
    """A built split's examples in stored order, decoded: the serialised bytes may order an example's
    features differently from one process to another (protobuf map order), their content may not."""
    from polyalign.inputs.pipeline import open_split

    source = open_split(run, split)
    return [tuple((key, example[key].tolist() if hasattr(example[key], "tolist") else example[key])
                  for key in sorted(example)) for example in (source[i] for i in range(len(source)))]


def _demo_subset_config(tmp_path: Path) -> Path:
    """Four of the demo's seven sources (4,800 records: English and Chinese, single- and multi-turn, a
    source whose LLM-written rows are dropped), with the demo config's dedup and split settings: the
    whole demo data took DirectRunner 7 minutes in a loaded test session, for nothing these do not cover."""
    import yaml

    demo = yaml.safe_load((REPO / "configs/data/demo.yaml").read_text(encoding="utf-8"))
    keep = {"polyalign_sample", "cmrc2018", "kdconv", "coig_cqia"}
    sources = [{**source, "path": str((REPO / "configs/data" / source["path"]).resolve())}
               for source in demo["sources"] if source["name"] in keep]
    return write_config(tmp_path / "subset.yaml", sources,
                        **{k: v for k, v in demo.items() if k not in ("scheme", "sources")})


@pytest.mark.slow
def test_beam_prepare_and_build_equal_the_single_machine_path_on_the_demo_data(demo_tokenizer, tmp_path):
    from polyalign.inputs.build import build

    config = _demo_subset_config(tmp_path)
    local_run = tmp_path / "local"
    local_manifest = prepare(config, local_run, progress=False)
    beam_run = tmp_path / "beam"
    done = beam_cli("prepare", "--config", str(config), "--out", str(beam_run),
                    "--beam", "--beam-options=--runner=DirectRunner --direct_num_workers=1", "--num-shards", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "apitools not found" not in done.stderr  # Beam's import-time BigQuery line: nothing of this run's
    beam_manifest = json.loads((beam_run / "data/manifest.json").read_text())
    assert beam_manifest["engine"] == {"name": "beam", "runner": "DirectRunner", "num_shards": 2}
    assert comparable(beam_manifest) == comparable(local_manifest)
    assert beam_manifest["totals"]["kept"] > 4500 and beam_manifest["dedup"]["near_duplicates"]["pairs"] > 0
    assert {s["name"] for s in beam_manifest["sources"]} == {"polyalign_sample", "cmrc2018", "kdconv", "coig_cqia"}
    assert next(s for s in beam_manifest["sources"] if s["name"] == "coig_cqia")["dropped"]
    for name in ("train", "val", "test", "near_duplicates", "exact_duplicates", "dropped"):
        assert lines(beam_run / "data", name) == lines(local_run / "data", name), name
    assert len(list((beam_run / "data").glob("train-*-of-00002.jsonl"))) == 2
    assert (beam_manifest["dropped_rows"]["file"], beam_manifest["dedup"]["exact"]["file"]) == (
        "dropped-*-of-00002.jsonl", "exact_duplicates-*-of-00002.jsonl")
    # stats reads the shards (this environment, no Beam) and counts what the single-machine run holds
    from polyalign.reports.stats import compute_stats

    assert compute_stats(beam_run, progress=False)["counts"]["by_split"] == local_manifest["totals"]["by_split"]

    # build from the Beam prepare's shards, with Beam, equals the single-machine build of the local prepare
    options = BuildOptions(tokenizer=str(demo_tokenizer[0].path.parent), max_length=64)
    local_build_manifest = build(local_run, options, progress=False)
    beam_build_manifest = beam_build(beam_run, options)
    assert beam_build_manifest["engine"]["name"] == "beam"
    for key in ("buckets", "bucket_weights", "train_bucket_counts", "splits", "train_profile_values", "vocab_size",
                "template", "warnings"):
        assert beam_build_manifest[key] == local_build_manifest[key], key
    assert any("absent from" in warning for warning in local_build_manifest["warnings"])  # val's and test's buckets
    for split in ("train", "val"):
        local_rows = dataset_rows(local_run, split)
        assert len(local_rows) == local_build_manifest["splits"][split]["examples"] > 200
        assert dataset_rows(beam_run, split) == local_rows, split

    # the single-machine prepare into the Beam run's folder leaves none of its shards for a reader to meet
    prepare(config, beam_run, progress=False)
    assert not list((beam_run / "data").glob("*-of-*.jsonl"))
    for name in ("train", "val", "test", "near_duplicates", "exact_duplicates", "dropped"):
        assert (beam_run / "data" / f"{name}.jsonl").read_bytes() == (local_run / "data" / f"{name}.jsonl").read_bytes()


def _edge_case_config(tmp_path: Path) -> Path:
    """Real rows arranged to exercise every counted path: a multi-file row source (row numbering across
    files), a malformed line, rows outside the scheme's languages, an exact duplicate across splits and a
    near-duplicate of a test row."""
    coig = tmp_path / "coig"
    for sub in ("douban", "zhihu"):
        shutil.copytree(DEMO_DATA / "zh/coig-cqia" / sub, coig / sub)
    sample = json.loads((DEMO_DATA / "en/polyalign-sample/dist_sft_val.json").read_text(encoding="utf-8"))
    train_rows = sample[:40]
    test_rows = [dict(sample[0]), {**sample[1], "output": sample[1]["output"] + " Thanks."}, *sample[40:50]]
    (tmp_path / "train.json").write_text(json.dumps(train_rows, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "test.json").write_text(json.dumps(test_rows, ensure_ascii=False), encoding="utf-8")
    chat = [json.dumps({"messages": [{"role": "user", "content": r["instruction"]},
                                     {"role": "assistant", "content": r["output"]}]}, ensure_ascii=False)
            for r in sample[60:66]]
    chat.insert(2, '{"messages": [}')
    (tmp_path / "chat.jsonl").write_text("\n".join(chat) + "\n", encoding="utf-8")
    return write_config(tmp_path / "config.yaml", [
        {"name": "coig", "format": "coig", "path": "coig", "split": "auto"},
        {"name": "sample", "format": "llamafactory", "path": "train.json", "split": "train", "language": "en"},
        {"name": "sample", "format": "llamafactory", "path": "test.json", "split": "test", "language": "en"},
        # family and style left to the format's defaults (assistant, assistant_like), counted alike by both
        {"name": "chat", "format": "chat", "path": "chat.jsonl", "split": "val", "language": "en", "track": "single"},
    ], dedup=True, near_dedup={"enabled": True, "threshold": 0.8, "remove": True})


def test_beam_prepare_matches_on_quarantine_duplicates_and_removal(tmp_path):
    config = _edge_case_config(tmp_path)
    # the train file cut off inside a 41st row, as an interrupted download leaves it: both keep the 40 before it
    sample = json.loads((DEMO_DATA / "en/polyalign-sample/dist_sft_val.json").read_text(encoding="utf-8"))
    whole = json.dumps(sample[:41], ensure_ascii=False)
    (tmp_path / "train.json").write_text(whole[:-len(json.dumps(sample[40], ensure_ascii=False)) // 2],
                                         encoding="utf-8")
    local = prepare(config, tmp_path / "local", on_error="quarantine", progress=False)
    done = beam_cli("prepare", "--config", str(config), "--out", str(tmp_path / "beam"), "--beam",
                    "--on-error", "quarantine")
    assert done.returncode == 0, done.stderr[-3000:]
    beam = json.loads((tmp_path / "beam/data/manifest.json").read_text())
    assert comparable(beam) == comparable(local)
    # the case really covers what it claims
    assert local["quarantine"]["records"] == 2
    sample_source = next(source for source in local["sources"] if source["path"].endswith("train.json"))
    assert sample_source["read"] == 41 and sample_source["dropped"]["malformed"] == 1
    assert local["dedup"]["exact"]["by_kind"] == {"train_vs_test": 1}
    assert local["dedup"]["near_duplicates"]["removed"] >= 1
    assert local["sources"][0]["read"] == 38 + 171 and len(local["sources"][0]["files"]) == 2
    for name in ("train", "val", "test", "near_duplicates", "exact_duplicates", "quarantine", "dropped"):
        assert lines(tmp_path / "beam/data", name) == lines(tmp_path / "local/data", name), name
    # the removed duplicate is listed beside the test record it repeats
    (duplicate,) = read_jsonl(tmp_path / "local/data/exact_duplicates.jsonl")
    assert duplicate["kind"] == "train_vs_test" and duplicate["split"] == "train"
    assert duplicate["kept_id"] in {r["id"] for r in read_jsonl(tmp_path / "local/data/test.jsonl")}
    assert local["dropped_rows"]["rows"] == len(lines(tmp_path / "local/data", "dropped"))
    chat = next(source for source in local["sources"] if source["name"] == "chat")
    labelled = chat["records"] - chat["dropped"]["malformed"]  # the quarantined row never reaches its labels
    assert chat["label_defaults"] == {"family": labelled, "style": labelled} and labelled == 6
    assert sorted(q["location"].rsplit("/", 1)[1] for q in read_jsonl(tmp_path / "beam/data/quarantine.jsonl")) \
        == ["chat.jsonl:3", "train.json:1"]


def test_beam_prepare_fails_with_the_same_line_as_the_single_machine_path(tmp_path):
    config = _edge_case_config(tmp_path)
    with pytest.raises(PrepareError) as local:
        prepare(config, tmp_path / "local", progress=False)
    beam = beam_cli("prepare", "--config", str(config), "--out", str(tmp_path / "beam"), "--beam")
    assert beam.returncode == 2 and "Traceback" not in beam.stderr
    assert beam.stderr.strip().splitlines()[-1] == f"polyalign prepare: error: {local.value}"
    assert "chat.jsonl:3: invalid JSON" in beam.stderr
    # it leaves what one machine leaves: nothing, so the corrected command (here: quarantine) is not refused as
    # an unfinished run of other settings
    assert not (tmp_path / "beam").exists() and not (tmp_path / "local").exists()
    again = beam_cli("prepare", "--config", str(config), "--out", str(tmp_path / "beam"), "--beam", "--on-error",
                     "quarantine")
    assert again.returncode == 0, again.stderr[-2000:]


def test_what_a_runner_wraps_reaches_the_command_as_the_single_machine_path_raises_it(tmp_path):
    """Ctrl-C inside the DirectRunner came out as a 150-line RuntimeError (exit 1, where one machine says
    `interrupted`, 130); a runner Beam does not know, as a 25-line traceback. A bad row stays a bad row."""
    from polyalign.beam import runner_errors
    from polyalign.core.yaml_config import ConfigError

    with pytest.raises(KeyboardInterrupt), runner_errors():
        raise RuntimeError("KeyboardInterrupt [while running 'By content']")
    with pytest.raises(ConfigError, match=r"^--beam-options: Unexpected pipeline runner: FooRunner\.$"), \
            runner_errors():
        raise ValueError("Unexpected pipeline runner: FooRunner.\nValid values are ...")
    with pytest.raises(PrepareError, match="chat.jsonl:3"), runner_errors():
        raise PrepareError("chat.jsonl:3: invalid JSON")
    with pytest.raises(InputError, match=r"^train.jsonl: record id 'a' is in 2 rows$"), runner_errors():
        raise InputError("train.jsonl: record id 'a' is in 2 rows [while running 'Check ids']")
    from polyalign.core.errors import JsonProblem

    with pytest.raises(JsonProblem, match=r"^bad$") as carried, runner_errors():
        raise JsonProblem("bad [while running 'Parse']", line=7)
    assert carried.value.line == 7  # what it carries besides its message
    with pytest.raises(ValueError, match="other"), runner_errors():
        raise ValueError("other")
    done = beam_cli("prepare", "--config", str(REPO / "configs/data/demo.yaml"), "--out", str(tmp_path / "run"),
                    "--beam", "--beam-options=--runner=FooRunner")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr[-2000:]
    assert done.stderr.startswith("polyalign prepare: error: --beam-options: Unexpected pipeline runner: FooRunner.")


def test_a_record_copied_by_hand_stops_the_beam_build_naming_its_file(demo_run, demo_tokenizer, tmp_path):
    """The Beam side of test_faults' copied-record build: one line naming the file, no TFDS traceback; a
    record in both splits is the same warning."""
    run = tmp_path / "run"
    first_records(demo_run[0], run / "data", {"train": 6, "val": 3, "test": 2})
    train = run / "data" / "train.jsonl"
    lines = train.read_text(encoding="utf-8").splitlines(keepends=True)
    train.write_text("".join(lines + [lines[1]]), encoding="utf-8")
    done = beam_cli("build", str(run), "--beam", "--tokenizer", str(demo_tokenizer[0].path.parent), "--max-length",
                    "64", "--no-progress")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    record_id = json.loads(lines[1])["id"]
    assert done.stderr.strip().splitlines()[-1] == (
        f"polyalign build: error: {train}: record id {record_id!r} is in 2 rows; each record is one example: remove "
        "the copies (an edit by hand?), or run `polyalign prepare` again")
    assert not (run / "build" / "manifest.json").exists()
    # one in both splits builds (over what the stopped pipeline left), with the single-machine build's warning
    train.write_text("".join(lines), encoding="utf-8")
    with (run / "data" / "val.jsonl").open("a", encoding="utf-8") as val:
        val.write(lines[4])
    done = beam_cli("build", str(run), "--beam", "--tokenizer", str(demo_tokenizer[0].path.parent), "--max-length",
                    "64", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning: 1 of the 4 val records are train records too (the same ids): validation measures them as " \
           "trained on" in done.stderr
