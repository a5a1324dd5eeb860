import hashlib
import json
import zipfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

from polyalign.data.dedup import NearDuplicateOptions, exact_dedup, exact_key, near_duplicates
from polyalign.data.prepare import prepare
from polyalign.data.records import Record
from polyalign.data.splits import hash_split, protected_splits, split_value
from tests.conftest import DEMO_DATA, read_jsonl, write_config

CAMREST = json.loads(zipfile.ZipFile(DEMO_DATA / "en/camrest676/data.zip").read("data/dialogues.json"))


def record(id_, split, question, response, **extra):
    base = dict(id=id_, dataset="camrest676", split=split, language="en", track="multi", family="dialogue",
                style="task_dialogue", question=question, context="", history=[], response=response,
                length_tokens=1, length_bin="short", bucket_id="en|multi|dialogue|short", meta={})
    return Record(**{**base, **extra})


def test_split_value_is_md5_of_seed_and_key():
    digest = hashlib.md5(b"42:kdconv:film-dev-000001").hexdigest()
    assert split_value("kdconv:film-dev-000001", 42) == int(digest[:8], 16) / 0xFFFFFFFF


def test_hash_split_walks_cumulative_weights_and_is_deterministic():
    keys = [f"lccc:{i}" for i in range(20000)]
    first = [hash_split(k, 42) for k in keys]
    assert first == [hash_split(k, 42) for k in keys]
    counts = Counter(first)
    assert abs(counts["train"] / 20000 - 0.90) < 0.01 and abs(counts["test"] / 20000 - 0.05) < 0.006
    for key, split in zip(keys[:200], first[:200]):
        value = split_value(key, 42)
        assert split == ("train" if value < 0.9 else "val" if value < 0.95 else "test")
    assert Counter(hash_split(k, 7) for k in keys) != counts  # the seed matters


def test_group_protection_moves_a_conversation_to_its_highest_priority_split():
    pairs = [("d1", "train"), ("d1", "test"), ("d1", "val"), ("d2", "train"), ("d3", "val"), ("d3", "train")]
    assert protected_splits(pairs) == {"d1": "test", "d2": "train", "d3": "val"}


def test_exact_dedup_prefers_test_then_val_and_ignores_case():
    turn_q, turn_a = CAMREST[0]["turns"][0]["utterance"], CAMREST[0]["turns"][1]["utterance"]
    other_q, other_a = CAMREST[1]["turns"][0]["utterance"], CAMREST[1]["turns"][1]["utterance"]
    records = [
        record("a-train", "train", turn_q, turn_a),
        record("b-test", "test", turn_q.upper(), turn_a),
        record("c-train", "train", other_q, other_a),
        record("d-train", "train", other_q, other_a),
        record("e-val", "val", other_q, other_a, language="zh"),  # another language is another record
    ]
    kept, removed = exact_dedup(records)
    assert [r.id for r in kept] == ["b-test", "c-train", "e-val"]
    assert [(d.record.id, d.kept_id, d.kind) for d in removed] == [
        ("a-train", "b-test", "train_vs_test"), ("d-train", "c-train", "within_train")]
    assert exact_key(records[0]) == exact_key(records[1])
    assert exact_key(records[0]) != exact_key(replace(records[0], history=[{"role": "user", "text": other_q}]))
    # the same system text before the question and after it are two conversations; the key of a record
    # without such a turn is what it always was (an earlier prepare's dedup stands)
    note = CAMREST[0]["goal"]["description"]
    before = replace(records[0], history=[{"role": "system", "text": note}])
    after = replace(records[0], history=[{"role": "system", "text": note, "after_question": True}])
    assert exact_key(before) != exact_key(after)
    content = ["en", "multi", "dialogue", turn_q.lower(), "", turn_a.lower(), [["system", note.lower()]]]
    assert exact_key(before) == hashlib.sha1(json.dumps(content, ensure_ascii=False).encode()).hexdigest()


def test_near_duplicates_flag_light_edits_only():
    test = [record(f"t{i}", "test", d["turns"][0]["utterance"], d["turns"][1]["utterance"])
            for i, d in enumerate(CAMREST[:50])]
    edited = test[3].response.replace(".", "!")
    train = [record("near", "train", test[3].question, edited)] + [
        record(f"x{i}", "train", d["turns"][0]["utterance"], d["turns"][1]["utterance"])
        for i, d in enumerate(CAMREST[300:340])]
    pairs = near_duplicates(train, test, NearDuplicateOptions(threshold=0.8))
    flagged = {(a, b) for a, b, _ in pairs}
    assert ("near", "t3") in flagged
    assert all(a == "near" or a.startswith("x") for a, _ in flagged)
    assert all(s >= 0.8 for _, _, s in pairs)


def test_prepare_is_deterministic_and_leak_free(tmp_path, demo_run):
    run, manifest, _ = demo_run
    again = prepare(DEMO_DATA.parents[1] / "configs/data/demo.yaml", tmp_path / "again", progress=False)
    for split in ("train", "val", "test"):
        assert (run / f"data/{split}.jsonl").read_bytes() == (tmp_path / f"again/data/{split}.jsonl").read_bytes()
    assert again["totals"] == manifest["totals"]
    records = {s: [Record.from_json(r) for r in read_jsonl(run / f"data/{s}.jsonl")] for s in ("train", "val", "test")}
    keys = {s: {exact_key(r) for r in rs} for s, rs in records.items()}
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["val"] and not keys["val"] & keys["test"]
    groups = {s: {r.meta["group"] for r in rs} for s, rs in records.items()}
    assert (not groups["train"] & groups["test"] and not groups["train"] & groups["val"]
            and not groups["val"] & groups["test"])


def test_dedup_false_keeps_duplicates(tmp_path):
    rows = [{"messages": [{"role": "user", "content": t[0]}, {"role": "assistant", "content": t[1]}]}
            for t in [(CAMREST[0]["turns"][0]["utterance"], CAMREST[0]["turns"][1]["utterance"])] * 3]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    source = {"name": "dup", "format": "chat", "path": "c.jsonl", "split": "train", "language": "en",
              "track": "multi", "family": "dialogue", "style": "task_dialogue"}
    on = prepare(write_config(tmp_path / "on.yaml", [source]), tmp_path / "on", progress=False)
    off = prepare(write_config(tmp_path / "off.yaml", [source], dedup=False), tmp_path / "off", progress=False)
    assert on["totals"]["kept"] == 1 and on["sources"][0]["dropped"] == {"exact_duplicate": 2}
    assert on["dedup"]["exact"]["by_kind"] == {"within_train": 2}
    # each removed row is listed by id, beside the one kept in its place
    (kept,) = read_jsonl(tmp_path / "on/data/train.jsonl")
    listed = read_jsonl(tmp_path / "on/data/exact_duplicates.jsonl")
    assert [(r["kept_id"], r["kind"], r["split"], r["dataset"]) for r in listed] == [(kept["id"], "within_train",
                                                                                      "train", "dup")] * 2
    assert len({r["id"] for r in listed} | {kept["id"]}) == 3
    assert off["totals"]["kept"] == 3 and off["dedup"]["near_duplicates"] == {"enabled": False}


def test_near_duplicate_removal_is_optional_and_counted(tmp_path, capsys):
    dialogues = CAMREST[:30]
    def rows(items, punct):
        return "".join(json.dumps({"messages": [{"role": "user", "content": d["turns"][0]["utterance"]},
                                                 {"role": "assistant",
                                                  "content": d["turns"][1]["utterance"].replace(".", punct)}]}) + "\n"
                       for d in items)
    (tmp_path / "test.jsonl").write_text(rows(dialogues, "."), encoding="utf-8")
    (tmp_path / "train.jsonl").write_text(rows(dialogues[:10], "!") + rows(CAMREST[400:420], "."), encoding="utf-8")
    labels = {"language": "en", "track": "multi", "family": "dialogue", "style": "task_dialogue", "format": "chat"}
    sources = [{"name": "a", "path": "train.jsonl", "split": "train", **labels},
               {"name": "b", "path": "test.jsonl", "split": "test", **labels}]
    config = write_config(tmp_path / "c.yaml", sources, near_dedup={"threshold": 0.7, "remove": True})
    manifest = prepare(config, tmp_path / "run", progress=False)
    near = manifest["dedup"]["near_duplicates"]
    assert near["removed"] == near["train_records"] >= 8
    dropped = manifest["sources"][0]["dropped"]
    assert dropped["near_duplicate_of_test"] == near["removed"]
    assert manifest["sources"][0]["kept"] == 30 - sum(dropped.values())
    kept_train = {r["id"] for r in read_jsonl(tmp_path / "run/data/train.jsonl")}
    assert not kept_train & {p["train_id"] for p in read_jsonl(tmp_path / "run/data/near_duplicates.jsonl")}
    # said on the console, removed or kept (it was in the manifest and the stats report only)
    from polyalign.cli import main

    for remove, said in ((True, "removed from train"), (False, "kept (near_dedup.remove: true in the data config "
                                                               "removes them)")):
        config = write_config(tmp_path / f"{remove}.yaml", sources, near_dedup={"threshold": 0.7, "remove": remove})
        out = tmp_path / f"cli-{remove}"
        assert main(["prepare", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
        printed = capsys.readouterr().out
        assert (f"{near['train_records']} train records nearly repeat a test record (MinHash Jaccard >= 0.7, "
                f"{near['pairs']} pairs), {said} -> {out / 'data' / 'near_duplicates.jsonl'}") in printed.splitlines()


def test_an_unchanged_prepare_run_again_from_anywhere_changes_nothing_downstream(tmp_path, monkeypatch):
    """A resubmitted job runs prepare again: the same data from the same config, from another folder and
    with the config named relatively, leaves data/manifest.json byte for byte (build, stats and evaluations
    record its digest) and the records the same (their source_file absolute and normalised). Changed
    content with the same counts is another manifest (the written files' digests)."""
    rows = [{"messages": [{"role": "user", "content": d["turns"][0]["utterance"]},
                          {"role": "assistant", "content": d["turns"][1]["utterance"]}]} for d in CAMREST[:40]]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "cfg").mkdir()
    source = {"name": "mine", "format": "chat", "path": "../data/c.jsonl", "split": "auto", "language": "en"}
    write_config(tmp_path / "cfg" / "data.yaml", [source])
    monkeypatch.chdir(tmp_path)
    prepare(Path("cfg/data.yaml"), Path("run"), progress=False)
    manifest = (tmp_path / "run/data/manifest.json").read_bytes()
    train = (tmp_path / "run/data/train.jsonl").read_bytes()
    assert json.loads(train.splitlines()[0])["meta"]["source_file"] == str(tmp_path / "data" / "c.jsonl")
    monkeypatch.chdir(tmp_path / "cfg")
    prepare(Path("data.yaml"), Path("../run"), progress=False)
    assert (tmp_path / "run/data/manifest.json").read_bytes() == manifest
    assert (tmp_path / "run/data/train.jsonl").read_bytes() == train
    rows[0]["messages"][1]["content"] += " Thanks."  # same rows, same counts, other text
    (tmp_path / "data" / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    prepare(Path("data.yaml"), Path("../run"), progress=False)
    assert (tmp_path / "run/data/manifest.json").read_bytes() != manifest
