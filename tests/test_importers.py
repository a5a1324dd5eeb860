"""Each importer on the real files bundled in polyalign/demo_data, checked against the raw documents."""

import json
import re
import zipfile
from collections import Counter

import pytest

from polyalign.data.importers import get_format, read_source
from polyalign.data.records import Example, InputError, Skipped
from tests.conftest import DEMO_DATA


def examples(fmt, path):
    return [(key, item) for key, item in read_source(fmt, path) if isinstance(item, Example)]


def test_llamafactory_reads_every_row_with_history_and_labels():
    path = DEMO_DATA / "en/polyalign-sample/dist_sft_val.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    items = examples("llamafactory", path)
    assert len(items) == len(raw) == 2000
    assert [k for k, _ in items[:3]] == ["000000", "000001", "000002"]
    for (key, example), row in zip(items, raw):
        assert example.question == row["instruction"] and example.response == row["output"]
        assert example.context == row["input"]
        # the row's system message opens the history as a system turn (prepare recognises these, the
        # authors' own profile prompts, and leaves them out: tests/test_chat_exports.py)
        assert example.history[0] == {"role": "system", "text": row["system"]}
        assert len(example.history) == 1 + 2 * len(row.get("history") or [])
        assert example.derived["track"] == ("multi" if row.get("history") else "single")
        assert example.labels["style"] == row["style_bucket"] and example.labels["bucket_id"] == row["bucket_id"]
    with_history = next(e for _, e in items if len(e.history) > 1)
    assert [t["role"] for t in with_history.history[:3]] == ["system", "user", "assistant"]
    # every key of the authors' rows is read (or knowingly passed over): none is unread
    assert all(example.unread_keys == () for _, example in items)


def test_a_misspelt_key_of_an_alpaca_row_is_counted_as_unread_not_dropped_silently(tmp_path, capsys):
    """A user's row with `outptu` beside its keys: prepare keeps the row and says which keys its format does
    not read, with how many rows held each (the manifest's `unread_keys` too)."""
    from polyalign.cli import main
    from tests.conftest import write_config

    rows = json.loads((DEMO_DATA / "en/polyalign-sample/dist_sft_val.json").read_text(encoding="utf-8"))[:20]
    rows[3] = {**rows[3], "outptu": rows[3]["output"]}
    rows[7] = {**rows[7], "category": "chat"}
    (tmp_path / "mine.json").write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    config = write_config(tmp_path / "data.yaml", [{"name": "mine", "format": "llamafactory", "path": "mine.json",
                                                    "language": "en"}], dedup=False)
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert ("note: source 'mine': keys the llamafactory format does not read, left unread: category (1 row), outptu "
            "(1 row); a misspelt key is one of them") in capsys.readouterr().out
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert manifest["sources"][0]["unread_keys"] == {"category": 1, "outptu": 1}
    assert manifest["sources"][0]["kept"] == 20


def test_squad_one_record_per_question_with_all_answers():
    path = DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json"
    document = json.loads(path.read_text(encoding="utf-8"))
    questions = [qa for article in document["data"] for p in article["paragraphs"] for qa in p["qas"]]
    items = examples("squad", path)
    assert len(items) == len(questions) == 1002
    key, first = items[0]
    assert key == questions[0]["id"]
    assert first.question == questions[0]["question"]
    assert first.response == questions[0]["answers"][0]["text"]
    assert first.meta["answers"] == list(dict.fromkeys(a["text"] for a in questions[0]["answers"]))
    assert first.group == document["data"][0]["paragraphs"][0]["id"]


def test_kdconv_projects_every_second_turn_with_its_knowledge():
    path = DEMO_DATA / "zh/kdconv/travel/dev.json"
    dialogues = json.loads(path.read_text(encoding="utf-8"))
    items = examples("kdconv", path)
    assert len(items) == sum(len(d["messages"]) // 2 for d in dialogues)
    key, first = items[0]
    messages = dialogues[0]["messages"]
    assert key == "dev-000000-turn-1"
    assert first.question == messages[0]["message"] and first.response == messages[1]["message"]
    assert first.history == []
    third = items[2][1]  # turn 5: history is turns 0..3
    assert third.key == "dev-000000-turn-5" and len(third.history) == 4
    attrs = messages[1].get("attrs", [])
    assert first.context == "\n".join(" | ".join(v for v in (a["name"], a["attrname"], a["attrvalue"]) if v)
                                      for a in attrs)


def test_crosswoz_targets_only_system_turns():
    path = DEMO_DATA / "zh/crosswoz/val.json.zip"
    document = json.loads(zipfile.ZipFile(path).read("val.json"))
    items = examples("crosswoz", path)
    expected = sum(1 for d in document.values() for k, m in enumerate(d["messages"]) if m["role"] == "sys" and k > 0)
    assert len(items) == expected
    dialogue_id, dialogue = next(iter(document.items()))
    key, first = items[0]
    assert key == f"{dialogue_id}-turn-1"
    assert first.question == dialogue["messages"][0]["content"] and first.response == dialogue["messages"][1]["content"]
    assert all(t["role"] in ("user", "assistant") for _, e in items for t in e.history)


def test_lccc_pairs_are_despaced_and_json_keys_are_official_splits():
    pairs = examples("lccc", DEMO_DATA / "zh/lccc-toy/toy_valid.txt")
    assert len(pairs) == 2000
    raw_line = (DEMO_DATA / "zh/lccc-toy/toy_valid.txt").read_text(encoding="utf-8").splitlines()[0]
    context, response = raw_line.split("\t")
    assert pairs[0][1].question == context.replace(" ", "")
    assert pairs[0][1].response == response.replace(" ", "")
    spaced_cjk = re.compile(r"[\u4e00-\u9fff] [\u4e00-\u9fff]")
    assert not any(spaced_cjk.search(e.question + e.response) for _, e in pairs)
    dialogues = examples("lccc", DEMO_DATA / "zh/lccc-toy/toy_data.json")
    document = json.loads((DEMO_DATA / "zh/lccc-toy/toy_data.json").read_text(encoding="utf-8"))
    expected = Counter()
    for split, items in document.items():
        expected[{"train": "train", "valid": "val", "test": "test"}[split]] += sum(len(d) // 2 for d in items)
    assert Counter(e.split for _, e in dialogues) == expected
    first_valid = document["valid"][0]
    key, first = next((k, e) for k, e in dialogues if e.split == "val")
    assert key == "toy_data-valid-000000-turn-1"
    assert first.question == first_valid[0].replace(" ", "")


def test_coig_keeps_human_answers_and_counts_llm_answers():
    items = list(read_source("coig", DEMO_DATA / "zh/coig-cqia"))
    skipped = Counter(item.reason for _, item in items if isinstance(item, Skipped))
    kept = [item for _, item in items if isinstance(item, Example)]
    rows = [json.loads(line) for f in sorted((DEMO_DATA / "zh/coig-cqia").rglob("*.jsonl"))
            for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(items) == len(rows)
    assert skipped == Counter(f"answer_not_human_written:{r['answer_from']}" for r in rows
                              if r["answer_from"] not in ("human", "expert"))
    assert skipped["answer_not_human_written:llm"] == 240
    assert len(kept) == sum(1 for r in rows if r["answer_from"] in ("human", "expert"))
    assert all(e.meta["answer_from"] in ("human", "expert") for e in kept)


def test_convlab_uses_system_turns_and_official_splits():
    path = DEMO_DATA / "en/camrest676/data.zip"
    dialogues = json.loads(zipfile.ZipFile(path).read("data/dialogues.json"))
    items = examples("convlab", path)
    assert len(items) == sum(1 for d in dialogues for t in d["turns"][1:] if t["speaker"] == "system")
    by_split = Counter(e.split for _, e in items)
    assert set(by_split) == {"train", "val", "test"}
    key, first = items[0]
    assert key == f"{dialogues[0]['dialogue_id']}-turn-1"
    assert first.response == dialogues[0]["turns"][1]["utterance"]


def _camrest_dialogues(n):
    dialogues = json.loads(zipfile.ZipFile(DEMO_DATA / "en/camrest676/data.zip").read("data/dialogues.json"))
    return dialogues[:n]


def test_chat_and_sharegpt_read_real_conversations(tmp_path):
    dialogues = _camrest_dialogues(3)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"id": d["dialogue_id"], "messages": [
        {"role": "user" if t["speaker"] == "user" else "assistant", "content": t["utterance"]} for t in d["turns"]]})
        + "\n" for d in dialogues), encoding="utf-8")
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [
        {"from": "human" if t["speaker"] == "user" else "gpt", "value": t["utterance"]} for t in d["turns"]]}
        for d in dialogues]), encoding="utf-8")
    expected = sum(1 for d in dialogues for t in d["turns"][1:] if t["speaker"] == "system")
    chat_items = examples("chat", chat)
    share_items = examples("sharegpt", sharegpt)
    assert len(chat_items) == len(share_items) == expected
    assert chat_items[0][0] == f"{dialogues[0]['dialogue_id']}-turn-1"
    assert share_items[0][0] == "000000-turn-1"
    assert [e.response for _, e in chat_items] == [e.response for _, e in share_items]
    second = chat_items[1][1]
    assert second.question == dialogues[0]["turns"][2]["utterance"]
    assert [t["text"] for t in second.history] == [t["utterance"] for t in dialogues[0]["turns"][:2]]


def test_multi_file_row_sources_number_rows_in_source_order():
    items = list(read_source("coig", DEMO_DATA / "zh/coig-cqia"))
    keys = [key for key, _ in items]
    assert keys == [f"{i:06d}" for i in range(len(items))]
    files = [item.location.file for _, item in items]
    assert files == sorted(files)


def test_a_folder_of_chat_exports_without_ids_numbers_conversations_across_its_files(tmp_path):
    """Two monthly exports in one source folder, conversations without ids: numbered by row across the files
    (2026-01's 0-2, 2026-02's 3-5), as row sources number theirs; each file's first row made 000000, and prepare refused
    the folder ("also produced by 2026-02.jsonl:1") though the rows were other conversations."""
    dialogues = _camrest_dialogues(6)

    def row(d, fmt):
        if fmt == "chat":
            return {"messages": [{"role": "user" if t["speaker"] == "user" else "assistant",
                                  "content": t["utterance"]} for t in d["turns"]]}
        return {"conversations": [{"from": "human" if t["speaker"] == "user" else "gpt", "value": t["utterance"]}
                                  for t in d["turns"]]}

    for fmt, write in (("chat", lambda rows: "".join(json.dumps(r) + "\n" for r in rows)), ("sharegpt", json.dumps)):
        folder = tmp_path / fmt
        folder.mkdir()
        suffix = ".jsonl" if fmt == "chat" else ".json"
        (folder / f"2026-01{suffix}").write_text(write([row(d, fmt) for d in dialogues[:3]]), encoding="utf-8")
        (folder / f"2026-02{suffix}").write_text(write([row(d, fmt) for d in dialogues[3:]]), encoding="utf-8")
        items = examples(fmt, folder)
        numbers = [key.split("-turn-")[0] for key, _ in items]
        assert sorted(set(numbers)) == [f"{i:06d}" for i in range(6)], fmt  # 2026-02's first row is 000003
        assert len({key for key, _ in items}) == len(items)
        second = [item for key, item in items if item.location.file.endswith(f"2026-02{suffix}")]
        assert second[0].meta["dialogue_id"] == "000003" and second[0].response == examples(
            fmt, folder / f"2026-02{suffix}")[0][1].response
    # one file alone keeps its numbers (the first file of a folder too)
    assert examples("chat", tmp_path / "chat" / "2026-02.jsonl")[0][0].startswith("000000-turn-")


def test_unknown_format_suggests_the_closest_name():
    with pytest.raises(InputError, match="did you mean 'sharegpt'"):
        get_format("sharegtp")


# --- stable keys: a record's key names the row itself, never how many rows came before it ----------

def _json(path, document):
    path.write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
                    encoding="utf-8")


def _camrest(n=5):
    return json.loads(zipfile.ZipFile(DEMO_DATA / "en/camrest676/data.zip").read("data/dialogues.json"))[:n]


def _sources():
    """(format, file name, writer of the real rows, writer of the same rows with the first one broken)."""
    sample = json.loads((DEMO_DATA / "en/polyalign-sample/dist_sft_val.json").read_text(encoding="utf-8"))[:6]
    cmrc = json.loads((DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json").read_text(encoding="utf-8"))
    cmrc = {"data": cmrc["data"][:3]}
    kdconv = json.loads((DEMO_DATA / "zh/kdconv/travel/dev.json").read_text(encoding="utf-8"))[:4]
    crosswoz = dict(list(json.loads(zipfile.ZipFile(DEMO_DATA / "zh/crosswoz/val.json.zip")
                                    .read("val.json")).items())[:4])
    lccc_lines = (DEMO_DATA / "zh/lccc-toy/toy_valid.txt").read_text(encoding="utf-8").splitlines()[:6]
    lccc_json = json.loads((DEMO_DATA / "zh/lccc-toy/toy_data.json").read_text(encoding="utf-8"))["train"][:4]
    coig = (DEMO_DATA / "zh/coig-cqia/douban/movie_recommendation.jsonl").read_text(encoding="utf-8").splitlines()[:6]
    chats = [{"messages": [{"role": "user" if t["speaker"] == "user" else "assistant", "content": t["utterance"]}
                           for t in d["turns"]]} for d in _camrest()]
    share = [{"conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                for m in c["messages"]]} for c in chats]

    def broken_paragraph(doc):
        doc = json.loads(json.dumps(doc))
        del doc["data"][0]["paragraphs"][0]["context"]
        return doc

    return [
        ("llamafactory", "rows.json", lambda p: _json(p, sample),
         lambda p: _json(p, [{"instruction": "x"}, *sample[1:]])),
        ("squad", "cmrc.json", lambda p: _json(p, cmrc), lambda p: _json(p, broken_paragraph(cmrc))),
        ("kdconv", "dev.json", lambda p: _json(p, kdconv),
         lambda p: _json(p, [{"messages": "not a list"}, *kdconv[1:]])),
        ("crosswoz", "val.json", lambda p: _json(p, crosswoz),
         lambda p: _json(p, {k: ({"messages": None} if i == 0 else v) for i, (k, v) in enumerate(crosswoz.items())})),
        ("lccc", "pairs.txt", lambda p: _jsonl(p, lccc_lines), lambda p: _jsonl(p, ["no tab here", *lccc_lines[1:]])),
        ("lccc", "dialogues.json", lambda p: _json(p, lccc_json), lambda p: _json(p, [7, *lccc_json[1:]])),
        ("coig", "rows.jsonl", lambda p: _jsonl(p, coig), lambda p: _jsonl(p, ["{not json", *coig[1:]])),
        ("convlab", "dialogues.json", lambda p: _json(p, _camrest()),
         lambda p: _json(p, [{**_camrest()[0], "turns": "broken"}, *_camrest()[1:]])),
        ("chat", "chats.jsonl", lambda p: _jsonl(p, chats), lambda p: _jsonl(p, ["{not json", *chats[1:]])),
        ("sharegpt", "share.json", lambda p: _json(p, share), lambda p: _json(p, [{"conversations": 3}, *share[1:]])),
    ]


@pytest.mark.parametrize("fmt,name,write,write_broken", _sources(), ids=lambda v: v if isinstance(v, str) else "")
def test_keys_are_unchanged_when_an_earlier_row_is_quarantined(tmp_path, fmt, name, write, write_broken):
    path = tmp_path / name
    write(path)
    before = {key: item for key, item in read_source(fmt, path) if isinstance(item, Example)}
    write_broken(path)
    items = list(read_source(fmt, path))
    after = {key: item for key, item in items if isinstance(item, Example)}
    assert any(not isinstance(item, (Example, Skipped)) for _, item in items)  # the broken row is reported
    assert after and len(after) < len(before)
    for key, example in after.items():  # every later record keeps its key, and the key its record
        assert key in before and before[key].response == example.response and before[key].question == example.question


def test_squad_keys_are_the_questions_own_ids():
    items = examples("squad", DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json")
    document = json.loads((DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json").read_text(encoding="utf-8"))
    assert [k for k, _ in items[:2]] == [qa["id"] for qa in document["data"][0]["paragraphs"][0]["qas"][:2]]


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_jsonl_reads_with_lf_crlf_and_cr_line_endings(tmp_path, newline):
    rows = (DEMO_DATA / "zh/coig-cqia/douban/movie_recommendation.jsonl").read_text(encoding="utf-8").splitlines()[:6]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(newline.join(rows).encode("utf-8") + newline.encode())
    items = list(read_source("coig", path))
    assert len(items) == 6 and [i.location.line for _, i in items] == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(i, (Example, Skipped)) for _, i in items)
