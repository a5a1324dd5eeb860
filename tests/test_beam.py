"""prepare and build as Apache Beam pipelines (DirectRunner) produce what the single-machine path does."""

import json
import shutil
from pathlib import Path

import pytest

from polyalign.beam.build import build_beam
from polyalign.beam.prepare import prepare_beam
from polyalign.cli import main
from polyalign.data.prepare import PrepareError, prepare
from polyalign.inputs.build import BuildOptions, dataset_dir
from tests.conftest import DEMO_DATA, REPO, read_jsonl, write_config

RUN_DEPENDENT = ("created", "timings_s", "engine")


def comparable(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in RUN_DEPENDENT}


def lines(data: Path, name: str) -> list[str]:
    """A prepare output's rows, from one file or the shards of a Beam run, in a canonical order."""
    paths = sorted(data.glob(f"{name}.jsonl")) or sorted(data.glob(f"{name}-*-of-*.jsonl"))
    assert paths, f"{data}: no {name} output"
    return sorted(line for path in paths for line in path.read_text(encoding="utf-8").splitlines() if line)


def dataset_rows(run: Path, split: str) -> list[bytes]:
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    files = sorted(str(p) for p in dataset_dir(run).glob(f"*-{split}.array_record-*"))
    source = ArrayRecordDataSource(files)
    return [source[i] for i in range(len(source))]


@pytest.mark.slow
def test_beam_prepare_and_build_equal_the_single_machine_path_on_the_demo_data(demo_run, built_run, tmp_path):
    local_run, local_manifest, _ = demo_run
    beam_run = tmp_path / "beam"
    assert main(["prepare", "--config", str(REPO / "configs/data/demo.yaml"), "--out", str(beam_run),
                 "--beam", "--beam-options=--runner=DirectRunner --direct_num_workers=1", "--num-shards", "2"]) == 0
    beam_manifest = json.loads((beam_run / "data/manifest.json").read_text())
    assert beam_manifest["engine"] == {"name": "beam", "runner": "DirectRunner", "num_shards": 2}
    assert comparable(beam_manifest) == comparable(local_manifest)
    assert beam_manifest["totals"]["kept"] > 15000 and beam_manifest["dedup"]["near_duplicates"]["pairs"] > 100
    for name in ("train", "val", "test", "near_duplicates"):
        assert lines(beam_run / "data", name) == lines(local_run / "data", name), name
    assert len(list((beam_run / "data").glob("train-*-of-00002.jsonl"))) == 2

    # build from the Beam prepare's shards, with Beam, equals the single-machine build of the local prepare
    local_built, local_build_manifest = built_run
    options = BuildOptions(**{**local_build_manifest["options"], "weights": BuildOptions().weights})
    beam_build_manifest = build_beam(beam_run, options)
    assert beam_build_manifest["engine"]["name"] == "beam"
    for key in ("buckets", "bucket_weights", "train_bucket_counts", "splits", "vocab_size", "template"):
        assert beam_build_manifest[key] == local_build_manifest[key], key
    for split in ("train", "val"):
        local_rows = dataset_rows(local_built, split)
        assert len(local_rows) == local_build_manifest["splits"][split]["examples"] > 1000
        assert dataset_rows(beam_run, split) == local_rows, split


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
        {"name": "chat", "format": "chat", "path": "chat.jsonl", "split": "val", "language": "en",
         "track": "single", "family": "assistant", "style": "assistant_like"},
    ], dedup=True, near_dedup={"enabled": True, "threshold": 0.8, "remove": True})


def test_beam_prepare_matches_on_quarantine_duplicates_and_removal(tmp_path):
    config = _edge_case_config(tmp_path)
    local = prepare(config, tmp_path / "local", on_error="quarantine", progress=False)
    beam = prepare_beam(config, tmp_path / "beam", on_error="quarantine")
    assert comparable(beam) == comparable(local)
    # the case really covers what it claims
    assert local["quarantine"]["rows"] == 1
    assert local["dedup"]["exact"]["by_kind"] == {"train_vs_test": 1}
    assert local["dedup"]["near_duplicates"]["removed"] >= 1
    assert local["sources"][0]["read"] == 38 + 171 and len(local["sources"][0]["files"]) == 2
    for name in ("train", "val", "test", "near_duplicates", "quarantine"):
        assert lines(tmp_path / "beam/data", name) == lines(tmp_path / "local/data", name), name
    assert read_jsonl(tmp_path / "beam/data/quarantine.jsonl")[0]["location"].endswith("chat.jsonl:3")


def test_beam_prepare_fails_with_the_same_line_as_the_single_machine_path(tmp_path):
    config = _edge_case_config(tmp_path)
    with pytest.raises(PrepareError) as local:
        prepare(config, tmp_path / "local", progress=False)
    with pytest.raises(PrepareError) as beam:
        prepare_beam(config, tmp_path / "beam")
    assert str(beam.value) == str(local.value)
    assert "chat.jsonl:3: invalid JSON" in str(beam.value)
