"""Faults a user can cause or meet: bad settings, bad input, outputs that belong to another run, and
faults during training (a damaged or unwritable checkpoint, non-finite steps, SIGTERM). Each gets one
clear line naming file, location and problem, or quarantine; never a traceback, a silent wrong result
or a replaced output. docs/reliability.md lists the promises and the test of each."""

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from polyalign.cli import main
from polyalign.core.yaml_config import ConfigError
from polyalign.data.prepare import PrepareError, prepare
from polyalign.data.records import InputError
from polyalign.train.metrics import read_metrics
from polyalign.train.run import train as train_sft
from tests.cli_runs import sft_config, start_cli, start_two_processes, train_args, wait_ok
from tests.conftest import DEMO_DATA, SCHEME, first_records, read_jsonl, write_config
from tests.train_checks import first_batch

SAMPLE = json.loads((DEMO_DATA / "en/polyalign-sample/dist_sft_val.json").read_text(encoding="utf-8"))[:4]
CAMREST = json.loads(zipfile.ZipFile(DEMO_DATA / "en/camrest676/data.zip").read("data/dialogues.json"))[:3]
CMRC_PARAGRAPH = json.loads((DEMO_DATA / "zh/cmrc2018/cmrc2018_trial.json")
                            .read_text(encoding="utf-8"))["data"][0]["paragraphs"][0]
KDCONV_TURNS = [m["message"] for m in json.loads((DEMO_DATA / "zh/kdconv/travel/dev.json")
                                                 .read_text(encoding="utf-8"))[0]["messages"]]
COIG_ROW = json.loads((DEMO_DATA / "zh/coig-cqia/zhihu/zhihu_expansion.jsonl")
                      .read_text(encoding="utf-8").splitlines()[0])
LCCC_LINE = (DEMO_DATA / "zh/lccc-toy/toy_valid.txt").read_text(encoding="utf-8").splitlines()[1]
EN_TURNS = [t["utterance"] for t in CAMREST[0]["turns"]]


def squad_without_second_answer():
    qas = [dict(q) for q in CMRC_PARAGRAPH["qas"][:2]]
    qas[1]["answers"] = []
    return {"data": [{"title": "", "paragraphs": [{**CMRC_PARAGRAPH, "qas": qas}]}]}


def chat_row(dialogue, **extra):
    return {"messages": [{"role": "user" if t["speaker"] == "user" else "assistant", "content": t["utterance"]}
                         for t in dialogue["turns"]], "track": "multi", "family": "dialogue", "style": "task_dialogue",
            **extra}


def sample_rows():
    return [dict(row) for row in SAMPLE]


def run(tmp_path, fmt, filename, content, on_error="fail", **source):
    path = tmp_path / filename
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    config = write_config(tmp_path / "config.yaml", [{"name": "src", "format": fmt, "path": filename,
                                                      "split": "train", "language": "en", **source}], dedup=False)
    return prepare(config, tmp_path / "run", on_error=on_error, progress=False, overwrite=True)  # a fresh run each call


def jsonl(rows):
    return "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows)


def lines_with(bad_line, position=1):
    rows = [json.dumps(chat_row(d)) for d in CAMREST]
    rows.insert(position, bad_line)
    return jsonl(rows)


CASES = [
    # (id, format, file name, content, expected message fragment)
    ("invalid-json-line", "chat", "c.jsonl", lines_with('{"messages": [}'), "c.jsonl:2: invalid JSON"),
    ("undecodable-line", "chat", "c.jsonl",
     jsonl([json.dumps(chat_row(CAMREST[0]))]).encode() + b'{"messages": "\xff\xfe"}\n',
     "c.jsonl:2: undecodable bytes"),
    ("messages-not-a-list", "chat", "c.jsonl", lines_with(json.dumps({"messages": "hello"})),
     "c.jsonl:2: field 'messages' must be a list, got str"),
    ("unknown-role", "chat", "c.jsonl", lines_with(json.dumps({"messages": [
        {"role": "user", "content": CAMREST[0]["turns"][0]["utterance"]},
        {"role": "robot", "content": CAMREST[0]["turns"][1]["utterance"]}]})),
     "c.jsonl:2: message 2: unknown role 'robot'"),
    ("content-wrong-type", "chat", "c.jsonl", lines_with(json.dumps({"messages": [
        {"role": "user", "content": 42}, {"role": "assistant", "content": "Yes."}]})),
     "c.jsonl:2: message 1 content must be a string, a list of content parts or null, got int"),
    ("output-wrong-type", "llamafactory", "a.json", json.dumps(sample_rows()[:1] + [{**SAMPLE[1], "output": 7}]),
     "a.json: element 2: response 'output' must be a string, got int"),
    ("output-null", "llamafactory", "a.json", json.dumps([{**SAMPLE[0], "output": None}]),
     "a.json: element 1: response 'output' is null"),
    ("output-missing", "llamafactory", "a.json", json.dumps([{k: v for k, v in SAMPLE[0].items() if k != "output"}]),
     "a.json: element 1: missing response 'output'"),
    ("instruction-missing", "llamafactory", "a.json",
     json.dumps([SAMPLE[0], {k: v for k, v in SAMPLE[1].items() if k != "instruction"}]),
     "a.json: element 2: missing field 'instruction'"),
    ("malformed-history", "llamafactory", "a.json", json.dumps([{**SAMPLE[0], "history": [["only one turn"]]}]),
     "a.json: element 1: malformed history: entry 1 must be a [user, assistant] pair"),
    ("invalid-json-document", "llamafactory", "a.json", json.dumps(SAMPLE[:2], indent=1)[:-3] + "\n,,]",
     "a.json:"),
    ("undecodable-document", "llamafactory", "a.json", b'[\n{"instruction": "\xc3\x28"}\n]',
     "a.json:2: undecodable bytes"),
    ("not-an-array", "llamafactory", "a.json", json.dumps(SAMPLE[0]), "expected a JSON array of rows"),
    ("unknown-label-value", "llamafactory", "a.json", json.dumps([{**SAMPLE[0], "family": "poetry"}]),
     "a.json: element 1: unknown family 'poetry'"),
    ("squad-missing-answers", "squad", "s.json", json.dumps(squad_without_second_answer()),
     "s.json: question 2: missing answers"),
    ("sharegpt-unknown-role", "sharegpt", "g.json", json.dumps([{"conversations": [
        {"from": "human", "value": EN_TURNS[0]}, {"from": "robot", "value": EN_TURNS[1]}]}]),
     "g.json: element 1: turn 2: unknown role 'robot'"),
    ("coig-instruction-type", "coig", "q.jsonl", jsonl([{**COIG_ROW, "instruction": [COIG_ROW["instruction"]]}]),
     "q.jsonl:1: field 'instruction' must be a string, got list"),
    ("lccc-no-tab", "lccc", "l.txt", LCCC_LINE.split("\t")[0] + "\n",
     "l.txt:1: expected at least two tab-separated utterances"),
    ("kdconv-non-string-message", "kdconv", "k.json",
     json.dumps([{"messages": [{"message": KDCONV_TURNS[0]}, {"message": 3}]}]),
     "k.json: element 1: message 2 'message' must be a string, got int"),
    ("convlab-unknown-speaker", "convlab", "dialogues.json", json.dumps([{"dialogue_id": "d1", "turns": [
        {"speaker": "user", "utterance": EN_TURNS[0]}, {"speaker": "wizard", "utterance": EN_TURNS[1]}]}]),
     "dialogues.json: element 1: turn 2: unknown role 'wizard'"),
    ("crosswoz-unknown-role", "crosswoz", "w.json", json.dumps({"7": {"messages": [
        {"role": "usr", "content": KDCONV_TURNS[0]}, {"role": "bot", "content": KDCONV_TURNS[1]}]}}),
     "w.json: dialogue 7: message 2: unknown role 'bot'"),
]


@pytest.mark.parametrize("name,fmt,filename,content,fragment", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_stops_with_one_clear_line(tmp_path, name, fmt, filename, content, fragment):
    with pytest.raises((PrepareError, InputError)) as info:
        run(tmp_path, fmt, filename, content)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message
    # a first prepare stopped by its input leaves nothing: no OUT, no half-written dropped or quarantine list
    assert not (tmp_path / "run").exists()


def test_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text(lines_with('{"messages": [}'), encoding="utf-8")
    config = write_config(tmp_path / "config.yaml", [{"name": "src", "format": "chat", "path": "c.jsonl",
                                                      "split": "train"}])
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("polyalign prepare: error: ") and "c.jsonl:2: invalid JSON" in err[0]


def test_quarantine_keeps_going_and_accounts_for_every_row(tmp_path):
    content = (lines_with('{"messages": [}', 1) + "\n"
               + json.dumps({"messages": [{"role": "robot", "content": EN_TURNS[0]}]}) + "\n")
    manifest = run(tmp_path, "chat", "c.jsonl", content, on_error="quarantine")
    quarantined = read_jsonl(tmp_path / "run/data/quarantine.jsonl")
    assert [q["location"].rsplit(":", 1)[1] for q in quarantined] == ["2", "6"]
    assert "invalid JSON" in quarantined[0]["problem"] and quarantined[0]["raw"] == '{"messages": [}'
    assert "unknown role 'robot'" in quarantined[1]["problem"]
    source = manifest["sources"][0]
    good = sum(1 for d in CAMREST for t in d["turns"][1:] if t["speaker"] == "system")
    assert source["kept"] == good and source["dropped"] == {"malformed": 2}
    assert source["records"] == source["kept"] + 2  # a malformed row is one record, dropped as malformed
    assert source["read"] == len(CAMREST) + 2  # rows: every dialogue line and the two bad ones
    assert manifest["quarantine"]["records"] == 2
    # the count is of records (a conversation row is quarantined once a reply); an earlier manifest's `rows` too
    from polyalign.data.layout import quarantined_records

    assert quarantined_records(manifest) == 2 and quarantined_records({"quarantine": {"rows": 3}}) == 3
    assert quarantined_records({"quarantine": {"enabled": False}}) == 0


@pytest.mark.parametrize("problem,fragment", [
    ({"format": "sharegtp"}, "did you mean 'sharegpt'"),
    ({"path": "missing.jsonl"}, "missing.jsonl: no such file or directory"),
    ({"path": "link.jsonl"}, "link.jsonl: a link to moved/c.jsonl, which does not exist"),
    ({"split": "dev"}, "split must be one of train, val, test, auto"),
    ({"colour": "blue"}, "unknown key 'colour'"),
    # checked before any row is read (it would drop them all, after reading them)
    ({"language": "english"}, r"sources\[0\] \(src\): language: unknown language 'english' \(the scheme allows "),
    ({"family": "chat"}, r"sources\[0\] \(src\): family: unknown family 'chat'"),
])
def test_config_problems_are_named(tmp_path, problem, fragment):
    (tmp_path / "c.jsonl").write_text(json.dumps(chat_row(CAMREST[0])) + "\n", encoding="utf-8")
    (tmp_path / "link.jsonl").symlink_to("moved/c.jsonl")  # a link left behind when its file moved
    source = {"name": "src", "format": "chat", "path": "c.jsonl", "split": "train", **problem}
    config = write_config(tmp_path / "config.yaml", [source])
    with pytest.raises((ConfigError, InputError), match=fragment):
        prepare(config, tmp_path / "run", progress=False)


def test_every_sources_problem_is_named_at_once_with_its_config_and_source(tmp_path):
    """A first config with several broken sources: one error, a line per problem, each naming the config
    file and the source, so that one run shows everything to fix."""
    (tmp_path / "c.jsonl").write_text(json.dumps(chat_row(CAMREST[0])) + "\n", encoding="utf-8")
    problems = [{"path": "missing.jsonl"}, {"format": "sharegtp"}, {"split": "dev", "path": "gone/"}, {}]
    sources = [{"name": f"s{i}", "format": "chat", "path": "c.jsonl", "split": "train", **p}
               for i, p in enumerate(problems)]
    config = write_config(tmp_path / "config.yaml", sources)
    with pytest.raises(ConfigError) as caught:
        prepare(config, tmp_path / "run", progress=False)
    lines = str(caught.value).splitlines()
    assert len(lines) == 4 and all(line.startswith(f"{config}: sources[") for line in lines)
    assert "sources[0] (s0): " in lines[0] and "missing.jsonl: no such file or directory" in lines[0]
    assert "sources[1] (s1): " in lines[1] and "did you mean 'sharegpt'" in lines[1]
    assert "sources[2] (s2): split must be one of" in lines[2] and "gone: no such file" in lines[3]


def test_bom_crlf_blank_lines_and_very_long_texts_are_valid(tmp_path):
    long_answer = "\n".join(t["utterance"] for d in CAMREST for t in d["turns"]) * 40  # real text, ~100k characters
    assert len(long_answer) > 50_000
    rows = [chat_row(CAMREST[0]), chat_row(CAMREST[1]), {**chat_row(CAMREST[2])}]
    rows[2]["messages"][1]["content"] = long_answer
    body = "\r\n\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n"
    manifest = run(tmp_path, "chat", "c.jsonl", b"\xef\xbb\xbf" + body.encode("utf-8"))
    source = manifest["sources"][0]
    assert source["dropped"] == {} and source["kept"] == source["records"] > source["read"] == len(rows)
    records = read_jsonl(tmp_path / "run/data/train.jsonl")
    longest = max(records, key=lambda r: len(r["response"]))
    assert longest["length_bin"] == "xlong" and "\r" not in longest["response"]


def test_empty_response_is_kept_in_qa_dropped_elsewhere_and_null_is_an_error(tmp_path):
    rows = [{**SAMPLE[0], "output": ""}, SAMPLE[1]]  # QA rows: an empty answer is a real "no answer"
    manifest = run(tmp_path, "llamafactory", "a.json", json.dumps(rows))
    assert manifest["sources"][0]["kept"] == 2 and manifest["totals"]["empty_responses"] == 1
    with pytest.raises(PrepareError, match="is null"):
        run(tmp_path, "llamafactory", "a.json", json.dumps([{**SAMPLE[0], "output": None}]))
    # a dialogue turn answered with nothing is dropped, counted per source
    dialogue = chat_row(CAMREST[0])
    turns = dialogue["messages"]
    turns[1] = {**turns[1], "content": ""}
    manifest = run(tmp_path, "chat", "c.jsonl", jsonl([json.dumps(dialogue)]))
    source = manifest["sources"][0]
    assert source["dropped"] == {"empty_response": 1} and source["empty_responses"] == 0
    assert source["records"] == source["kept"] + 1 and source["read"] == 1  # one dialogue row, a record per reply


def test_a_reply_to_an_empty_user_turn_is_dropped_unless_a_passage_is_its_prompt(tmp_path):
    """A reply to an empty user turn answers nothing the model is shown: dropped as empty_question,
    listed with its reply, counted; the rest of the dialogue is kept. A QA row whose passage is its whole
    prompt (a CMRC question left empty) keeps its record."""
    dialogue = chat_row(CAMREST[0])
    dialogue["messages"][2] = {**dialogue["messages"][2], "content": "  "}
    manifest = run(tmp_path, "chat", "c.jsonl", jsonl([json.dumps(dialogue)]))
    source = manifest["sources"][0]
    replies = sum(m["role"] == "assistant" for m in dialogue["messages"])
    assert source["dropped"] == {"empty_question": 1} and source["kept"] == replies - 1
    dropped = read_jsonl(tmp_path / "run/data/dropped.jsonl")
    assert [(d["reason"], d["response"]) for d in dropped] == [("empty_question",
                                                                dialogue["messages"][3]["content"][:80])]
    row = {**SAMPLE[0], "instruction": "", "input": "Laskowice is a village in north-central Poland."}
    manifest = run(tmp_path, "llamafactory", "a.json", json.dumps([row]))
    assert manifest["sources"][0]["kept"] == 1


def test_a_rows_language_label_that_is_no_code_is_a_row_problem_and_another_code_is_dropped(tmp_path):
    """As a misspelt family is: "english" on a row stops the run naming the line (or is quarantined);
    "fr" is a language the user keeps out, dropped as language_not_in_scheme:fr."""
    rows = [chat_row(CAMREST[0], language="en"), chat_row(CAMREST[1], language="english"),
            chat_row(CAMREST[2], language="fr"), chat_row(CAMREST[2], language="other", id="again")]
    with pytest.raises(PrepareError, match=r"c.jsonl:2: language 'english' is no language code: the scheme's are "
                                           r"en, zh \(a row labelled with another one, e.g. fr, is dropped as "
                                           r"language_not_in_scheme:fr\)"):
        run(tmp_path, "chat", "c.jsonl", jsonl([json.dumps(r) for r in rows]), language=None)
    manifest = run(tmp_path, "chat", "c.jsonl", jsonl([json.dumps(r) for r in rows]), on_error="quarantine",
                   language=None)
    source = manifest["sources"][0]
    french = sum(m["role"] == "assistant" for m in rows[2]["messages"])
    assert source["dropped"] == {"malformed": sum(m["role"] == "assistant" for m in rows[1]["messages"]),
                                 "language_not_in_scheme:fr": french, "language_not_in_scheme:other": french}
    assert manifest["totals"]["by_split"]["train"] == sum(m["role"] == "assistant" for m in rows[0]["messages"])
    # each quarantined reply holds what was read of it (the row's own line is not at hand once its records
    # are built): every reply of the conversation, its question before it, the label that was refused
    quarantined = read_jsonl(tmp_path / "run" / "data" / "quarantine.jsonl")
    replies = [m["content"] for m in rows[1]["messages"] if m["role"] == "assistant"]
    read = [json.loads(q["raw"]) for q in quarantined]
    assert [r["response"] for r in read] == replies and {r["labels"]["language"] for r in read} == {"english"}
    assert all(r["question"] and q["location"].endswith("c.jsonl:2") for r, q in zip(read, quarantined))


@pytest.mark.parametrize("tag, language", [("en", "en"), ("zh-CN", "zh"), ("zh_SG", "zh"), ("zh-Hans-CN", "zh"),
                                           ("en-US", "en"), ("en-GB", "en"), ("zh-419", "zh"), ("zh-Hant", "zh"),
                                           ("zh-Hant-TW", "zh"), ("en-Dsrt", "en-Dsrt"), ("fr-CA", "fr-CA"),
                                           ("zh-TW", "zh"), ("zh_HK", "zh"), ("zh-MO", "zh"), ("zh-Latn", "zh-Latn"),
                                           ("zh-Hans-TW", "zh"), ("other", "other"), ("EN", "en"), ("EN-us", "en"),
                                           ("ZH-hant-tw", "zh"), ("FR", "fr"), ("Fr-CA", "fr-CA")])
def test_a_language_tag_in_any_case_with_a_region_or_a_script_of_the_language_is_the_schemes_language(tag, language):
    """BCP 47 tags are case-insensitive, and METHOD counts Traditional Chinese as zh (zh-Hant, zh-TW)."""
    from polyalign.data.prepare import scheme_language

    assert scheme_language(tag, ("en", "zh")) == language


def test_a_sources_language_tag_with_a_region_is_its_language(tmp_path):
    """A source declared `language: en-US` is the scheme's en, as a row's own label is; `zh-Latn` (pinyin, another
    script) is refused before any row is read, as any language the scheme lacks."""
    rows = [chat_row(CAMREST[0]), chat_row(CAMREST[1])]
    manifest = run(tmp_path, "chat", "c.jsonl", jsonl(rows), language="en-US")
    records = read_jsonl(tmp_path / "run" / "data" / "train.jsonl")
    assert records and {r["language"] for r in records} == {"en"} and manifest["sources"][0]["dropped"] == {}
    from polyalign.core.yaml_config import ConfigError

    with pytest.raises(ConfigError, match=r"language: unknown language 'zh-Latn'"):
        run(tmp_path, "chat", "c.jsonl", jsonl(rows), language="zh-Latn")


def test_prepare_counts_rows_and_records_and_build_says_how_often_train_on_all_trains_a_reply(
        tmp_path, capsys, json_tokenizer):
    dialogues = [chat_row(d) for d in CAMREST]
    replies = [sum(m["role"] == "assistant" for m in d["messages"]) for d in dialogues]
    (tmp_path / "c.jsonl").write_text(jsonl([json.dumps(d) for d in dialogues]), encoding="utf-8")
    config = write_config(tmp_path / "config.yaml", [{"name": "src", "format": "chat", "path": "c.jsonl",
                                                      "split": "train", "language": "en"}], dedup=False)
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"read {len(CAMREST)} rows -> {sum(replies)} records: kept {sum(replies)} (train "), out
    assert out.splitlines()[0].endswith("), dropped 0"), out
    (tmp_path / "run/data/val.jsonl").write_text((tmp_path / "run/data/train.jsonl").read_text(encoding="utf-8"))
    assert main(["build", str(tmp_path / "run"), "--tokenizer", str(json_tokenizer.path.parent), "--template", "qwen",
                 "--train-on", "all", "--max-length", "4096", "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "run/build/manifest.json").read_text())
    train = manifest["splits"]["train"]
    # the k-th reply of a dialogue with n replies is a target in n - k + 1 records
    assert train["truncated"] == 0 and train["trained_replies"] == sum(n * (n + 1) // 2 for n in replies)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("train:"))
    assert f"a reply is a target in {train['trained_replies'] / sum(replies):.2f} records on average" in line


# A folder where a file is expected, a file where an output folder is expected, a bad number: each
# subcommand answers in one line naming the path or option, exit status 2, no traceback.
WRONG_PATHS = [
    ["prepare", "--config", "{folder}", "--out", "{tmp}/o"],
    ["stats", "{file}"],
    ["tokenizer", "train", "--records", "{folder}", "--vocab-size", "100", "--out", "{tmp}/t"],
    ["build", "{file}"],
    ["train", "sft", "--config", "{folder}", "--out", "{tmp}/o"],
    ["train", "sft", "--print-config", "train.steps=0"],
    ["generate", "--checkpoint", "{folder}", "--records", "{file}", "--out", "{tmp}/p.jsonl"],
    ["pairs", "--records", "{folder}", "--predictions", "{file}", "--out", "{tmp}/x.jsonl"],
    ["evaluate", "--records", "{folder}", "--predictions", "{file}", "--out", "{tmp}/e"],
    ["evaluate", "--records", "{file}", "--predictions", "{file}", "--out", "{tmp}/e", "--bootstrap-draws", "0"],
    ["report", "{folder}", "--out", "{tmp}/c"],
    ["plan", "--config", "{folder}"],
    ["demo", "--out", "{file}"],
    ["tokenizer", "train", "--records", "{file}", "--vocab-size", "0", "--out", "{tmp}/t"],
    ["launch", "--nproc", "0", "--", "true"],
    ["launch", "--nproc", "2", "--", "{tmp}/no-such-program"],
]


@pytest.mark.parametrize("argv", WRONG_PATHS, ids=lambda argv: " ".join(argv[:2]))
def test_a_wrong_path_or_number_is_one_line_not_a_traceback(tmp_path, capsys, argv):
    folder, file = tmp_path / "folder", tmp_path / "file.json"
    folder.mkdir()
    file.write_text("{}\n")
    args = [a.format(folder=folder, file=file, tmp=tmp_path) for a in argv]
    usage = False
    try:
        status = main(args)
    except SystemExit as usage_error:  # argparse's own check of an option: its usage, then the one line
        status, usage = usage_error.code, True
    assert status == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith(f"polyalign {_command_path(argv)}: error: "), err
    assert usage or err.count("\n") == 1, err
    named = [a for a in args if a in err or (a.startswith("--") and a in err)]
    assert named or "train.steps" in err, err  # the path or setting at fault is named


def _command_path(argv) -> str:
    """The subcommand argv runs, as errors name it (`train sft`, `tokenizer train`, `prepare`)."""
    from polyalign.cli import build_parser, subcommands

    paths = [path for path, _ in subcommands(build_parser()) if argv[:len(path.split())] == path.split()]
    return max(paths, key=len)


def _required_arguments(parser, but: str | None = None):
    """Placeholder values for a subcommand's required arguments but the option `but` (given once, by the
    caller): the range check runs before any is read."""
    import argparse

    argv = []
    for action in parser._actions:
        if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)) or action.nargs == argparse.REMAINDER:
            continue
        if but in action.option_strings:
            continue
        if action.option_strings and not action.required:
            continue
        value = action.choices[0] if action.choices else 1000 if action.type in (int, float) else "x"
        argv += [*action.option_strings[:1], *[str(value)] * (action.nargs if isinstance(action.nargs, int) else 1)]
    return argv


def test_every_numeric_option_of_every_subcommand_has_a_range_and_is_refused_outside_it(capsys):
    from polyalign.cli import NUMBER_RANGES, NUMBER_TYPES, build_parser, subcommands

    numeric = {(path, option): action for path, sub in subcommands(build_parser()) for action in sub._actions
               if action.type in NUMBER_TYPES for option in action.option_strings[:1]}
    declared = {(path, option) for path, options in NUMBER_RANGES.items() for option in options}
    assert declared == set(numeric), (set(numeric) - declared, declared - set(numeric))
    assert {"generate", "prompts", "evaluate", "pairs import", "build"} <= set(NUMBER_RANGES)  # report has none
    parsers = dict(subcommands(build_parser()))
    for (path, option), action in sorted(numeric.items()):
        admitted = NUMBER_RANGES[path][option]
        candidates = [-1, 0, 1, 2**32]
        if admitted.low is not None:
            candidates += [admitted.low, admitted.low - 1]
        if admitted.high is not None:
            candidates += [admitted.high, admitted.high + 1]
        if action.type is float:
            candidates += [0.5, float("nan"), float("inf")]
        refused = [value for value in candidates if not admitted.admits(value)]
        # every option is bounded; a negative value only where the range says so (OpenAI's penalties, -2 to 2)
        assert refused and (not admitted.admits(-1) or admitted.low < 0), (path, option)
        for value in refused:
            text = str(action.type(value)) if value == value and abs(value) != float("inf") else str(value)
            given = [text] * (action.nargs if isinstance(action.nargs, int) else 1)
            argv = [*path.split(), *_required_arguments(parsers[path], but=option), option, *given]
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err, err
            assert err.startswith(f"polyalign {path}: error: {option} must be "), err


def _takes(action, value: str) -> bool:
    """Whether an option's type reads `value`."""
    import argparse

    try:
        action.type and action.type(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False
    return True


def test_every_option_that_takes_a_value_is_refused_when_given_twice(capsys):
    """argparse keeps an option's last value: a second --config replaced the first file whole, and a second
    --out wrote elsewhere, unsaid. Every option of every subcommand that takes a value is refused the second
    time, in one line naming both values; flags and the options meant to repeat are not."""
    import argparse

    from polyalign.cli import _StoreOnce, build_parser, subcommands

    checked = 0
    for path, parser in subcommands(build_parser()):
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._StoreAction):
                assert isinstance(action, _StoreOnce), (path, action.option_strings)
            if not isinstance(action, _StoreOnce):
                continue
            value = str(action.choices[0]) if action.choices else "x" if _takes(action, "x") else "1"
            given = [value] * (action.nargs if isinstance(action.nargs, int) else 1)
            option = action.option_strings[0]
            with pytest.raises(SystemExit) as stop:
                main([*path.split(), option, *given, option, *given])
            assert stop.value.code == 2, (path, option)
            err = capsys.readouterr().err.splitlines()[-1]
            hint = "; one config file a run: change single settings with key=value" \
                if option == "--config" and path.startswith("train ") else ""
            shown = " ".join(str(action.type(v)) if action.type else v for v in given)
            assert err == f"polyalign {path}: error: {option} is given twice ({shown}, then {shown}): give it once" \
                          f"{hint}"
            checked += 1
    assert checked > 100
    # what a parse returns holds the options, not the record of which were met
    args = build_parser().parse_args(["report", "a", "b", "--out", "o", "--names", "p", "q"])
    assert (str(args.out), args.names) == ("o", ["p", "q"]) and not hasattr(args, "_polyalign_options_given")


def test_markdown_reports_escape_what_they_embed():
    from polyalign.reports.markdown import table

    text = table(["bucket", "n"], [["en|x <script>alert(1)</script>\nnext", 3]])
    assert text.splitlines()[2] == "| en\\|x &lt;script&gt;alert(1)&lt;/script&gt; next | 3 |"
    assert len(text.splitlines()) == 3  # a line break in a cell does not end the row


@pytest.mark.parametrize(("text", "reason"), [
    ('{"a": NaN}', "NaN is not a JSON number"),
    ('{"a": -Infinity}', "-Infinity is not a JSON number"),
    ('{"a": 1, "a": 2}', "key 'a' appears twice"),
    ('{"a": "\\ud800"}', "lone UTF-16 surrogate"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ' + "9" * 5000 + "}", "Exceeds the limit"),
    ('{"a": [}', "Expecting value (column 8)"),
    ('{"a": 1e400}', "1e400 does not fit a float"),
])
def test_strict_json_refuses_what_other_readers_would_not_accept(text, reason):
    from polyalign.core import jsonl

    with pytest.raises(jsonl.JsonProblem, match=re.escape(reason)):
        jsonl.parse(text)
    # a surrogate pair is a character
    assert jsonl.parse('{"a": "\\ud83d\\ude00", "b": 1e300}') == {"a": "😀", "b": 1e300}


def test_bad_json_rows_are_quarantined_with_their_reason(tmp_path):
    good = json.dumps(chat_row(CAMREST[0]))
    content = "\n".join([good, '{"messages": NaN}', good[:-1] + ', "messages": []}', good]) + "\n"
    manifest = run(tmp_path, "chat", "c.jsonl", content, on_error="quarantine")
    quarantined = read_jsonl(tmp_path / "run/data/quarantine.jsonl")
    assert [q["location"].rsplit(":", 1)[1] for q in quarantined] == ["2", "3"]
    assert "NaN is not a JSON number" in quarantined[0]["problem"]
    assert "key 'messages' appears twice" in quarantined[1]["problem"]
    assert manifest["sources"][0]["dropped"] == {"malformed": 2}
    for line in (tmp_path / "run/data/quarantine.jsonl").read_text(encoding="utf-8").splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} written"))  # the output stays JSON


def test_every_cut_of_a_json_array_reads_the_rows_before_it_and_says_where_it_stops():
    """Invariant over every place a download or write could stop: the rows read are exactly the whole rows
    before the cut, and the break names the row it falls in as cut off (never as a syntax error)."""
    from polyalign.core import jsonl
    from tests.chat_exports import openai_rows

    rows = openai_rows()[:3]
    text = json.dumps(rows, indent=2, ensure_ascii=False)
    ends = [text.index("\n  }", text.index(json.dumps(r["id"]))) + 4 for r in rows]  # where each row's "}" ends
    assert list(jsonl.array_elements(text)) == rows == list(jsonl.array_elements(" \n" + text + "\n"))
    for cut in range(1, len(text)):
        read, stop = [], None
        try:
            read.extend(jsonl.array_elements(text[:cut]))
        except jsonl.ArrayBreak as problem:
            stop = problem
        whole = sum(end <= cut for end in ends)
        assert read == rows[:whole], cut
        assert stop is not None and stop.kind == "cut" and stop.element == whole + 1, (cut, stop)


@pytest.mark.parametrize(("text", "kind", "element", "read"), [
    ('[{"a": 1}, {"a": 2} {"a": 3}]', "invalid", 3, 2),  # a comma lost in a hand edit
    ('[{"a": 1}]\n[{"a": 2}]', "extra", 2, 1),  # two dumps appended to one file
    ('{"a": 1}', "invalid", 1, 0),
    ('[{"a": 1},', "cut", 2, 1),  # cut just after a whole row
])
def test_a_json_array_broken_inside_says_which_row_and_keeps_the_ones_before(text, kind, element, read):
    from polyalign.core import jsonl

    rows = []
    with pytest.raises(jsonl.ArrayBreak) as info:
        rows.extend(jsonl.array_elements(text))
    assert (info.value.kind, info.value.element, len(rows)) == (kind, element, read)


def test_a_row_that_is_json_but_not_strict_json_is_that_row_alone(tmp_path):
    """NaN, a repeated key, a lone surrogate or an integer too long are not syntax: where the row ends is known,
    so the rows after it are read (one NaN in row 2 of 10,000 made rows 2-10,000 one quarantine row)."""
    from polyalign.core import jsonl

    text = '[{"a": 1}, {"a": NaN}, {"a": 1, "a": 2}, {"a": "\\ud800"}, {"a": ' + "9" * 5000 + '}, {"a": 3}]'
    elements = list(jsonl.array_elements(text))
    assert elements[0] == {"a": 1} and elements[-1] == {"a": 3} and len(elements) == 6
    problems = elements[1:5]
    assert all(isinstance(p, jsonl.ElementProblem) for p in problems)
    assert [p.element for p in problems] == [2, 3, 4, 5]
    assert [text[p.start:p.end] for p in problems[:3]] == ['{"a": NaN}', '{"a": 1, "a": 2}', '{"a": "\\ud800"}']
    assert "NaN is not a JSON number" in str(problems[0]) and "appears twice" in str(problems[1])
    # through prepare: the row quarantined with its own text, the rows after it kept
    from tests.chat_exports import openai_rows

    rows = openai_rows()[:3]
    export = "[" + ", ".join([json.dumps(rows[0]), '{"messages": NaN}', json.dumps(rows[2])]) + "]"
    manifest = run(tmp_path, "chat", "export.json", export, on_error="quarantine")
    (quarantined,) = read_jsonl(tmp_path / "run/data/quarantine.jsonl")
    assert quarantined["raw"] == '{"messages": NaN}' and "NaN is not a JSON number" in quarantined["problem"]
    assert quarantined["location"].endswith("export.json: element 2") and manifest["sources"][0]["read"] == 3


def test_a_chat_export_cut_off_mid_file_keeps_its_whole_rows_under_quarantine_and_stops_naming_the_line(tmp_path):
    from tests.chat_exports import openai_rows

    rows = openai_rows()
    text = json.dumps(rows, indent=2, ensure_ascii=False)
    fifth = text.index(json.dumps(rows[4]["id"]))
    cut = text[:fifth + 400]  # inside the fifth conversation, as an interrupted download leaves it
    with pytest.raises(PrepareError) as info:
        run(tmp_path, "chat", "export.json", cut)
    start_line = text[:text.rindex("\n  {", 0, fifth)].count("\n") + 2
    assert f"export.json:{start_line}: the file ends inside row 5, at line {cut.count(chr(10)) + 1} (cut off?); " \
           "rows 1-4 were read" in str(info.value)

    # cut just after a whole row: no row is half there, and the message says what is missing
    after_fourth = text[:text.rindex("\n  }", 0, fifth) + 4]
    with pytest.raises(PrepareError) as info:
        run(tmp_path, "chat", "export.json", after_fourth)
    assert "the file ends after row 4, without the array's closing ']' (cut off?); rows 1-4 were read" in \
        str(info.value)

    whole = run(tmp_path, "chat", "export.json", json.dumps(rows[:4], ensure_ascii=False), on_error="quarantine")
    manifest = run(tmp_path, "chat", "export.json", cut, on_error="quarantine")
    (quarantined,) = read_jsonl(tmp_path / "run/data/quarantine.jsonl")
    assert quarantined["location"].endswith(f"export.json:{start_line}")
    assert "cut off" in quarantined["problem"] and quarantined["raw"] == cut[cut.rindex("\n  {") + 3:]
    source, source_whole = manifest["sources"][0], whole["sources"][0]
    assert source["kept"] == source_whole["kept"] > 0 and source["dropped"] == {"malformed": 1}
    assert source["read"] == 5 and manifest["quarantine"]["records"] == 1


def test_own_files_keep_line_separators_inside_strings_and_name_bad_lines(tmp_path):
    from polyalign.data.records import RECORD_FIELDS
    from polyalign.pairs.make import read_pairs, write_pairs

    def pair(key, chosen, rejected):
        record = {**dict.fromkeys(RECORD_FIELDS, ""), "id": key, "history": [], "length_tokens": 1, "meta": {}}
        return {"id": key, "bucket_id": "en|single|assistant|short", "language": "en", "chosen": chosen,
                "rejected": rejected, "record": record}

    pairs = [pair("a", "one\u2028two\u0085three\rfour", "x"), pair("b", "y", "z")]
    write_pairs(pairs, tmp_path / "pairs.jsonl")
    assert read_pairs(tmp_path / "pairs.jsonl") == pairs
    (tmp_path / "pairs.jsonl").write_text('{"id": "a"}\n{"id": "b", "x": Infinity}\n')
    with pytest.raises(InputError, match=r"pairs.jsonl:2: Infinity is not a JSON number"):
        read_pairs(tmp_path / "pairs.jsonl")


def test_python_m_polyalign_works_from_a_folder_holding_a_folder_named_polyalign(tmp_path):
    """`python -m polyalign` from the parent of a clone: the clone's folder on sys.path first makes `polyalign`
    a namespace package with no __version__, while an editable install's finder still serves its modules; the
    version came from there, and every command ended in an AttributeError traceback."""
    (tmp_path / "polyalign").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "polyalign", "--version"], cwd=tmp_path, capture_output=True,
                          text=True, env=env, timeout=120)
    import importlib.metadata

    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"polyalign {importlib.metadata.version('polyalign')}"


def test_a_python_tag_in_a_config_file_is_refused_naming_the_file(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text('scheme: !!python/object/apply:os.system ["echo owned > owned.txt"]\n', encoding="utf-8")
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{config}:1" in err and not (tmp_path / "owned.txt").exists()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-16-be", "utf-16-le (no mark)"])
def test_sources_in_utf16_or_utf32_with_or_without_a_byte_order_mark_read_like_utf8(tmp_path, encoding):
    rows = jsonl([json.dumps(chat_row(d), ensure_ascii=False) for d in CAMREST])
    (tmp_path / "utf8").mkdir()
    (tmp_path / "wide").mkdir()
    expected = run(tmp_path / "utf8", "chat", "c.jsonl", rows)
    data = (("\ufeff" + rows).encode(encoding) if encoding.endswith("-be")
            else rows.encode(encoding.split()[0]))  # utf-16-le writes no mark
    manifest = run(tmp_path / "wide", "chat", "c.jsonl", data)
    assert manifest["totals"] == expected["totals"] and manifest["totals"]["kept"] > 0
    for split in ("train",):
        wide = (tmp_path / "wide/run/data" / f"{split}.jsonl").read_text(encoding="utf-8")
        assert (wide.replace("/wide/", "/utf8/")
                == (tmp_path / "utf8/run/data" / f"{split}.jsonl").read_text(encoding="utf-8"))


def test_an_empty_source_is_a_warning_in_the_manifest_and_on_stderr(tmp_path, capsys):
    (tmp_path / "good.jsonl").write_text(jsonl([json.dumps(chat_row(d)) for d in CAMREST]), encoding="utf-8")
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    config = write_config(tmp_path / "config.yaml", [
        {"name": "good", "format": "chat", "path": "good.jsonl", "split": "train", "language": "en"},
        {"name": "empty", "format": "chat", "path": "empty.jsonl", "split": "train", "language": "en"}])
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "run/data/manifest.json").read_text())
    assert manifest["warnings"] == [f"source empty: no rows read from {tmp_path / 'empty.jsonl'}", *[
        f"split {split}: no records (none from a `split: {split}` source, none from `split: auto` sources by "
        f"split.weights); {then}" for split, then in (("val", "build needs train and val records"),
                                                      ("test", "nothing to evaluate on"))]]
    assert f"warning: source empty: no rows read from {tmp_path / 'empty.jsonl'}" in capsys.readouterr().err
    # a source whose rows are read but whose every record is left out said only `kept 0` in its table line
    unanswered = [{"messages": [m for m in chat_row(d)["messages"] if m["role"] == "user"][:1]} for d in CAMREST]
    (tmp_path / "questions.jsonl").write_text(jsonl(unanswered), encoding="utf-8")
    config = write_config(tmp_path / "config2.yaml", [
        {"name": "good", "format": "chat", "path": "good.jsonl", "split": "auto", "language": "en"},
        {"name": "questions", "format": "chat", "path": "questions.jsonl", "split": "auto", "language": "en"}])
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run2"), "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "run2/data/manifest.json").read_text())
    questions = next(e for e in manifest["sources"] if e["name"] == "questions")
    reasons = ", ".join(f"{reason} {n}" for reason, n in questions["dropped"].items())
    said = f"source questions: none of its {questions['records']} records kept ({reasons}); its buckets get nothing"
    assert questions["records"] == len(CAMREST) and said in manifest["warnings"][0], manifest["warnings"]
    assert f"warning: {said}" in capsys.readouterr().err


def _zip_of(member: str, content: bytes, encrypted: bool = False) -> bytes:
    import io

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(member, content)
    data = bytearray(buffer.getvalue())
    if encrypted:  # zipfile writes no encrypted archives: set the flag bit in both headers, as a tool would
        data[6] |= 0x1  # local file header, general purpose flags
        central = data.rfind(b"PK\x01\x02")
        data[central + 8] |= 0x1
    return bytes(data)


def test_zip_members_that_are_encrypted_or_too_large_are_named(tmp_path, monkeypatch):
    dialogues = json.dumps(CAMREST).encode()
    with pytest.raises(InputError, match=r"data.zip!data/dialogues.json: encrypted"):
        run(tmp_path, "convlab", "data.zip", _zip_of("data/dialogues.json", dialogues, encrypted=True))
    monkeypatch.setenv("POLYALIGN_MAX_ZIP_MEMBER_BYTES", "1000")
    with pytest.raises(InputError, match=r"dialogues.json: decompresses to [\d,]+ bytes, over the limit of 1,000 "
                                         r"\(set POLYALIGN_MAX_ZIP_MEMBER_BYTES to read it\)"):
        run(tmp_path, "convlab", "data.zip", _zip_of("data/dialogues.json", dialogues))
    monkeypatch.delenv("POLYALIGN_MAX_ZIP_MEMBER_BYTES")
    assert run(tmp_path, "convlab", "data.zip", _zip_of("data/dialogues.json", dialogues))["totals"]["kept"] > 0


def test_a_declared_language_the_text_contradicts_is_counted(tmp_path, capsys):
    """Real Chinese answers in a source declared English are kept under the user's label, counted, and
    named on the console."""
    chinese = {"messages": [{"role": "user", "content": KDCONV_TURNS[0]},
                            {"role": "assistant", "content": KDCONV_TURNS[1]}],
               "track": "multi", "family": "dialogue", "style": "task_dialogue"}
    rows = [json.dumps(chat_row(CAMREST[0])), json.dumps(chinese, ensure_ascii=False)]
    manifest = run(tmp_path, "chat", "c.jsonl", jsonl(rows))
    source = manifest["sources"][0]
    assert source["language_mismatches"] == {"en declared, han script": 1}
    assert source["kept"] == source["records"] and source["read"] == 2  # counted, not dropped
    capsys.readouterr()
    assert main(["prepare", "--config", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "cli"),
                 "--no-progress"]) == 0
    assert ("warning: source 'src': 1 record en declared, han script; they are bucketed as declared. Check its "
            "`language:` in the data config") in capsys.readouterr().err


def test_a_source_in_a_language_outside_the_scheme_is_refused_before_any_row_is_read(tmp_path, capsys):
    """A source declared in a language the scheme has no buckets for would have every row dropped: it is
    refused before anything is read or written, in one line naming the source and the scheme's languages,
    and the corrected command then runs (no record of the refused one stands in its way)."""
    chinese = {"messages": [{"role": "user", "content": KDCONV_TURNS[0]},
                            {"role": "assistant", "content": KDCONV_TURNS[1]}],
               "track": "multi", "family": "dialogue", "style": "task_dialogue"}
    with pytest.raises(ConfigError, match=r"sources\[0\] \(src\): language: unknown language 'fr' \(the scheme "
                                          r"allows en, zh\)"):
        run(tmp_path, "chat", "c.jsonl", jsonl([json.dumps(chat_row(CAMREST[0])), chinese]), language="fr")
    assert not (tmp_path / "run").exists()
    capsys.readouterr()
    assert main(["prepare", "--config", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "cli"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "language: unknown language 'fr'" in err[0] and not (tmp_path / "cli").exists()
    write_config(tmp_path / "config.yaml", [{"name": "src", "format": "chat", "path": "c.jsonl", "split": "train"}],
                 dedup=False)
    assert main(["prepare", "--config", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "cli"),
                 "--no-progress"]) == 0


def test_a_conversation_nobody_answered_is_dropped_and_listed_not_a_malformed_row(tmp_path):
    """A chat log's question with no reply (user turns only) has nothing to train on: under the default
    --on-error fail it neither stops the run nor goes to quarantine; it is dropped as `no_reply` and listed."""
    unanswered = {"messages": [{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": CAMREST[0]["turns"][0]["utterance"]}]}
    manifest = run(tmp_path, "chat", "c.jsonl", jsonl([chat_row(CAMREST[1]), unanswered]))
    source = manifest["sources"][0]
    assert source["read"] == 2 and source["dropped"] == {"no_reply": 1} and source["kept"] == source["records"] - 1
    assert [(row["reason"], row["location"]) for row in read_jsonl(tmp_path / "run" / "data" / "dropped.jsonl")] == [
        ("no_reply", f"{tmp_path / 'c.jsonl'}:2")]


@pytest.mark.parametrize("fmt", ["chat", "sharegpt", "kdconv", "lccc"])
def test_an_empty_conversation_is_read_and_dropped_as_no_reply_in_every_dialogue_format(tmp_path, fmt):
    """Every dialogue importer counts a conversation with no turns: KdConv's `messages: []` was missing from
    the rows read (no record, no drop, no word)."""
    turns = [t["utterance"] for t in CAMREST[0]["turns"][:2]]
    name, text = {
        "chat": ("c.jsonl", jsonl([{"messages": [{"role": r, "content": u} for r, u in zip(("user", "assistant"),
                                                                                          turns)]},
                                   {"messages": []}])),
        "sharegpt": ("c.jsonl", jsonl([{"conversations": [{"from": r, "value": u} for r, u in zip(("human", "gpt"),
                                                                                                 turns)]},
                                       {"conversations": []}])),
        "kdconv": ("c.json", json.dumps([{"messages": [{"message": u} for u in turns]}, {"messages": []}])),
        "lccc": ("c.json", json.dumps([turns, []])),
    }[fmt]
    source = run(tmp_path, fmt, name, text)["sources"][0]
    assert (source["read"], source["kept"], source["dropped"]) == (2, 1, {"no_reply": 1}), source


def test_sharegpt_turns_mixing_the_two_key_pairs_say_so(tmp_path):
    """A ShareGPT conversation whose turns are written half with from/value, half with role/content (two
    exports concatenated) read "turn 2: role must be a string, got null"."""
    turns = [t["utterance"] for t in CAMREST[0]["turns"][:2]]
    mixed = {"conversations": [{"from": "human", "value": turns[0]}, {"role": "assistant", "content": turns[1]}]}
    with pytest.raises(PrepareError, match=re.escape(
            "c.jsonl:1: turn 2 is written with 'role'/'content', other turns with 'from'/'value': write every turn "
            "of a conversation with one pair of keys")):
        run(tmp_path, "sharegpt", "c.jsonl", jsonl([mixed]))


def test_a_reply_left_out_of_a_conversation_is_listed_with_its_start(tmp_path):
    """A conversation is one line holding many replies: a dropped reply's row says which, by its start."""
    dialogue = json.loads(json.dumps(CAMREST[0]))
    replies = [t for t in dialogue["turns"] if t["speaker"] != "user"]
    replies[1]["utterance"] = "   "  # nothing to learn: dropped as empty_response
    run(tmp_path, "chat", "c.jsonl", jsonl([chat_row(dialogue)]))
    rows = read_jsonl(tmp_path / "run" / "data" / "dropped.jsonl")
    assert [(r["reason"], r["location"], r["response"]) for r in rows] == [
        ("empty_response", f"{tmp_path / 'c.jsonl'}:1", "")]
    from polyalign.data.prepare import DROPPED_RESPONSE_CHARS, dropped_row
    from polyalign.data.records import Location

    long = dropped_row("src", Location("c.jsonl", line=3), "language_not_in_scheme:ja", replies[0]["utterance"] * 5)
    assert long["response"] == (replies[0]["utterance"] * 5)[:DROPPED_RESPONSE_CHARS]


def test_one_split_weight_from_the_command_line_keeps_the_others_and_an_empty_split_is_named(tmp_path, capsys):
    """`split.weights.test=0.2` on a config without a split section changes that weight of the defaults
    (the others kept, the sum said); a split left with no records is a warning at prepare and one line
    naming it at build, before anything is written."""
    from polyalign.data.prepare import load_data_config
    from polyalign.inputs.build import build
    from polyalign.inputs.built import BuildOptions

    config = write_config(tmp_path / "config.yaml", [{"name": "src", "format": "chat", "path": "c.jsonl",
                                                      "split": "auto", "language": "en"}], dedup=False)
    (tmp_path / "c.jsonl").write_text(jsonl([chat_row(d) for d in CAMREST]), encoding="utf-8")
    loaded, _ = load_data_config(config, ["split.weights.test=0.2"])
    assert loaded.split.weights == {"train": 0.9, "val": 0.05, "test": 0.2}
    assert "note: split.weights are shares of their sum (1.15): train 78.3%, val 4.3%, test 17.4%" in \
        capsys.readouterr().out
    # every setting checked before a row is read: a shingle of 0 characters flagged every train record as a
    # near-duplicate of every test record, a NaN weight sent every record to test, silently
    for override, problem in (("split.weights.val=-0.1", "split.weights.val must be a finite number >= 0, got -0.1"),
                              ("split.weights.val=abc", "split.weights.val must be a finite number >= 0, got 'abc'"),
                              ("split.weights.train=.nan", "split.weights.train must be a finite number >= 0, got nan"),
                              ("split.weights.train=.inf", "split.weights.train must be a finite number >= 0, got inf"),
                              ("near_dedup.shingle_size=0", "near_dedup.shingle_size must be at least 1, got 0"),
                              ("near_dedup.threshold=1.5", "near_dedup.threshold must be in (0, 1), got 1.5"),
                              ("near_dedup.num_perm=1", "near_dedup.num_perm must be at least 2, got 1"),
                              ("near_dedup.threshold=0.99", "near_dedup.threshold 0.99 with near_dedup.num_perm 128: "
                                                            "MinHash LSH cannot be built (The number of bands are too "
                                                            "small (b < 2)); lower the threshold or raise num_perm"),
                              ("split.weights.dev=0.1", "split.weights.dev: no such split (train, val, test)")):
        with pytest.raises(ConfigError) as refused:
            load_data_config(config, [override])
        assert str(refused.value) == f"{config} with the overrides {override}: {problem}"
    # a misspelt key of an override is the override's, as train says it, not the file's
    with pytest.raises(ConfigError) as refused:
        load_data_config(config, ["split.sed=3"])
    assert str(refused.value) == "override split.sed=3: split: unknown key 'sed'; did you mean 'seed'?"
    with pytest.raises(ConfigError, match="split.weights are all 0; give at least one split a positive weight"):
        load_data_config(config, ["split.weights={train: 0, val: 0, test: 0}"])
    manifest = prepare(config, tmp_path / "run", progress=False, overrides=["split.weights.val=0"])
    assert manifest["totals"]["by_split"]["val"] == 0 and manifest["totals"]["kept"] == manifest["totals"]["records"]
    assert ("split val: no records (none from a `split: val` source, none from `split: auto` sources by "
            "split.weights); build needs train and val records") in manifest["warnings"]
    with pytest.raises(InputError, match=r"run/data: no val records; build makes the training and validation "
                                         r"examples, and prepare put none there"):
        build(tmp_path / "run", BuildOptions(tokenizer="unused"), progress=False)
    assert not (tmp_path / "run" / "build").exists()


def test_every_row_prepare_leaves_out_is_listed_with_where_it_is_and_why(demo_run):
    """For every source and reason, the rows in dropped.jsonl are the ones the manifest counts as left
    out while reading (dedup's removals are in its own report), each naming a file that exists."""
    from collections import Counter

    run, manifest, _ = demo_run
    rows = read_jsonl(run / "data" / "dropped.jsonl")
    dedup_reasons = {"exact_duplicate", "near_duplicate_of_test"}
    counted = Counter({(source["name"], reason): count for source in manifest["sources"]
                       for reason, count in source["dropped"].items()
                       if reason not in dedup_reasons | {"malformed"}})
    assert Counter((row["source"], row["reason"]) for row in rows) == counted
    assert len(rows) == manifest["dropped_rows"]["rows"] > 0 and manifest["dropped_rows"]["file"] == "dropped.jsonl"
    assert "answer_not_human_written:llm" in {row["reason"] for row in rows}  # COIG-CQIA's LLM-written answers
    assert all(Path(row["where"]["file"].split("!")[0]).exists() for row in rows)


def test_a_quarantined_row_never_renames_another_record(tmp_path):
    """Record ids come from the row's own position: the rows after a quarantined one keep the ids they
    have when that row is good."""
    good = [json.dumps(chat_row(d)) for d in CAMREST]
    (tmp_path / "clean").mkdir()
    (tmp_path / "broken").mkdir()
    run(tmp_path / "clean", "chat", "c.jsonl", jsonl(good))
    run(tmp_path / "broken", "chat", "c.jsonl", jsonl([good[0], '{"messages": [}', good[2]]), on_error="quarantine")

    def ids(folder):
        return {r["id"]: r["response"] for split in ("train", "val", "test")
                for r in read_jsonl(tmp_path / folder / "run" / "data" / f"{split}.jsonl")}

    clean, broken = ids("clean"), ids("broken")
    assert broken and all(clean.get(i) == response for i, response in broken.items())
    assert len(clean) > len(broken)  # the quarantined dialogue's records are missing, nothing else moved


def test_prepare_into_an_output_of_another_config_is_refused_unless_overwrite(tmp_path, capsys):
    (tmp_path / "c.jsonl").write_text(jsonl([json.dumps(chat_row(d)) for d in CAMREST]), encoding="utf-8")
    source = {"name": "src", "format": "chat", "path": "c.jsonl", "split": "train", "language": "en"}
    config = write_config(tmp_path / "config.yaml", [source])
    argv = ["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 0
    assert main(argv) == 0  # the same config again: the same files
    # defaults written out (in the file, or as overrides) are the same settings
    write_config(tmp_path / "config.yaml", [source], dedup=True)
    assert main([*argv, "split.seed=42", "split.weights.train=0.9"]) == 0
    write_config(tmp_path / "config.yaml", [source], dedup=False)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "made with other settings (config.dedup: true there, false now); pass --overwrite" in err, err
    assert main([*argv, "split.seed=41"]) == 2
    assert "config.dedup: true there, false now, config.split.seed: 42 there, 41 now" in capsys.readouterr().err
    # a source's own key changed: named by its place in the list, not as both whole lists
    write_config(tmp_path / "config.yaml", [{**source, "family": "dialogue"}], dedup=True)
    assert main(argv) == 2
    assert ("made with other settings (config.sources[0].family: not set (the default) there, 'dialogue' now); pass "
            "--overwrite") in capsys.readouterr().err
    write_config(tmp_path / "config.yaml", [source], dedup=False)
    assert main([*argv, "--overwrite"]) == 0
    assert json.loads((tmp_path / "run/data/manifest.json").read_text())["config"]["dedup"] is False


def _as_shards(run: Path, num_shards: int) -> None:
    """A prepared run rewritten as a Beam prepare with --num-shards lays it out: each output's rows dealt
    over NAME-0000i-of-0000N.jsonl, the manifest's engine recording the count (tests/test_beam.py checks
    a real Beam run writes this layout)."""
    data = run / "data"
    for path in sorted(data.glob("*.jsonl")):
        rows = path.read_text(encoding="utf-8").splitlines(keepends=True)
        for index in range(num_shards):
            (data / f"{path.stem}-{index:05d}-of-{num_shards:05d}.jsonl").write_text(
                "".join(rows[index::num_shards]), encoding="utf-8")
        path.unlink()
    from polyalign.core.paths import file_digest

    manifest = json.loads((data / "manifest.json").read_text())
    manifest["engine"] = {"name": "beam", "runner": "DirectRunner", "num_shards": num_shards}
    manifest["file_digests"] = {path.name: file_digest(path) for path in sorted(data.glob("*.jsonl"))}
    (data / "manifest.json").write_text(json.dumps(manifest))


def test_a_run_holds_one_layout_and_every_reader_follows_its_manifest(tmp_path, capsys):
    """Sharded or not, stats and tokenizer train read the split the manifest records; a prepare into a
    folder of the other layout removes every earlier output and says so, so no reader (or a user's glob)
    meets two prepares' splits; a folder holding both layouts and no manifest is refused."""
    from polyalign.data.layout import split_files
    from polyalign.tokens.tokenizer_training import train_from_records

    dialogues = json.loads(zipfile.ZipFile(DEMO_DATA / "en/camrest676/data.zip").read("data/dialogues.json"))[:30]
    (tmp_path / "c.jsonl").write_text(jsonl([json.dumps(chat_row(d)) for d in dialogues]), encoding="utf-8")
    source = {"name": "src", "format": "chat", "path": "c.jsonl", "split": "auto", "language": "en"}
    config = write_config(tmp_path / "config.yaml", [source], split={"weights": {"train": 0.6, "val": 0.2,
                                                                                 "test": 0.2}})
    run = tmp_path / "run"
    assert main(["prepare", "--config", str(config), "--out", str(run), "--no-progress"]) == 0
    single = {split: (run / "data" / f"{split}.jsonl").read_text() for split in ("train", "val", "test")}
    assert all(single.values())
    _as_shards(run, 2)
    assert [p.name for p in split_files(run, "train")] == ["train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl"]
    capsys.readouterr()
    assert main(["stats", str(run), "--no-progress"]) == 0
    counts = {s: len(single[s].splitlines()) for s in single}
    assert json.loads((run / "stats" / "stats.json").read_text())["counts"]["by_split"] == counts
    _, report = train_from_records(run, tmp_path / "tok", 400)
    assert report["num_records"] == counts["train"] and set(report["made_from"]["records"]) == {
        "train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl"}
    _, report = train_from_records(run / "data", tmp_path / "tok_data", 400)  # prepare's own folder given
    assert report["num_records"] == counts["train"]
    with pytest.raises(Exception, match="a sharded prepare wrote train-00000-of-00002.jsonl, ...: give the run folder"):
        train_from_records(run / "data" / "train.jsonl", tmp_path / "tok2", 300)
    # a prepare of one file per output into the sharded folder: the shards go, with a note, and so do a
    # stopped Beam run's temporary folders
    for leftover in ("beam-temp-train-3f2a", "_beam_events"):
        (run / "data" / leftover).mkdir()
        (run / "data" / leftover / "part").write_text("x")
    capsys.readouterr()
    assert main(["prepare", "--config", str(config), "--out", str(run), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert (f"note: removed 14 file(s) an earlier prepare left in {run / 'data'} that this one did not write "
            "(dropped-00000-of-00002.jsonl, dropped-00001-of-00002.jsonl, exact_duplicates-00000-of-00002.jsonl, "
            "exact_duplicates-00001-of-00002.jsonl and 10 more)") in err, err
    assert not (run / "data" / "beam-temp-train-3f2a").exists() and not (run / "data" / "_beam_events").exists()
    assert sorted(p.name for p in (run / "data").glob("*.jsonl")) == [
        "dropped.jsonl", "exact_duplicates.jsonl", "near_duplicates.jsonl", "test.jsonl", "train.jsonl", "val.jsonl"]
    assert {split: (run / "data" / f"{split}.jsonl").read_text() for split in single} == single
    # a file of the user's named like a shard, in a folder whose manifest does not list it: left alone
    (run / "data" / "test-00007-of-00009.jsonl").write_text("mine\n")
    assert main(["prepare", "--config", str(config), "--out", str(run), "--no-progress"]) == 0
    assert (run / "data" / "test-00007-of-00009.jsonl").read_text() == "mine\n"
    assert "note: removed" not in capsys.readouterr().err
    # nor is it taken into the manifest as the prepare's, so the prepare after keeps it too
    digests = json.loads((run / "data" / "manifest.json").read_text())["file_digests"]
    assert "test-00007-of-00009.jsonl" not in digests and "train.jsonl" in digests
    assert main(["prepare", "--config", str(config), "--out", str(run), "--no-progress", "split.seed=9",
                 "--overwrite"]) == 0
    assert (run / "data" / "test-00007-of-00009.jsonl").read_text() == "mine\n"
    (run / "data" / "test-00007-of-00009.jsonl").unlink()
    # RUN/tokenizer trained on this split, then prepare drew the split again: build says the tokenizer is stale
    from polyalign.inputs.build import build
    from polyalign.inputs.built import BuildOptions

    train_from_records(run, run / "tokenizer", 400)
    assert main(["prepare", "--config", str(config), "--out", str(run), "--no-progress", "--overwrite",
                 "split.seed=5"]) == 0
    capsys.readouterr()
    warnings = build(run, BuildOptions(template="qwen", max_length=64), progress=False)["warnings"]
    assert any(w.startswith(f"{run / 'tokenizer'} was trained on another train split than {run / 'data'} holds now")
               for w in warnings), warnings
    # shards beside a split's one file and no manifest to say which is the prepare's: refused
    (run / "data" / "train-00000-of-00002.jsonl").write_text(single["train"])
    (run / "data" / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="holds both train.jsonl and 1 shards train-00000-of-00002.jsonl"):
        split_files(run, "train")
    # files of a prepare's names with no manifest to say a prepare wrote them are a user's: refused, kept
    capsys.readouterr()
    assert main(["prepare", "--config", str(config), "--out", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "exists without manifest.json" in err and err.count(str(run / "data" / "train.jsonl")) == 1, err
    assert (run / "data" / "train-00000-of-00002.jsonl").read_text() == single["train"]
    # a source inside the folder prepare writes: refused before anything is touched
    shutil.copy(tmp_path / "c.jsonl", run / "data" / "c.jsonl")
    inside = write_config(tmp_path / "inside.yaml", [{**source, "path": str(run / "data" / "c.jsonl")}])
    assert main(["prepare", "--config", str(inside), "--out", str(run), "--no-progress", "--overwrite"]) == 2
    assert f"{run / 'data' / 'c.jsonl'}: a source file inside {run / 'data'}" in capsys.readouterr().err
    assert (run / "data" / "c.jsonl").is_file() and (run / "data" / "train.jsonl").is_file()
    # a training run, a model or an evaluation given as prepare's --out: refused, a folder beside it suggested
    for name, marker, what in (("sft", "checkpoints", "a training run"), ("model", "config.json", "a model or "
                               "training run"), ("eval", "metrics.json", "an evaluation")):
        (tmp_path / name).mkdir()
        if marker == "checkpoints":
            (tmp_path / name / marker).mkdir()
        else:
            (tmp_path / name / marker).write_text("{}")
        assert main(["prepare", "--config", str(config), "--out", str(tmp_path / name), "--no-progress"]) == 2
        assert (f"--out {tmp_path / name} is {what} ({marker} is there): give prepare a folder of its own, e.g. "
                f"{tmp_path / (name + '-data')}") in capsys.readouterr().err
        assert not (tmp_path / name / "data").exists()


# Outputs: every stage's output belongs to the settings that made it.

def cli(capsys, *argv) -> tuple[int, str]:
    """A command through the CLI entry point: its exit status and the one line it printed on stderr."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip()


def english_records(demo_run, tmp_path, n=300):
    """The first n English train records of the demo run: a tokenizer trains on them in about a second."""
    run, _, _ = demo_run
    lines = [line for line in (run / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines()
             if json.loads(line)["language"] == "en"][:n]
    path = tmp_path / "en.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_tokenizer_belongs_to_the_settings_that_trained_it(demo_run, tmp_path, capsys):
    records, out = english_records(demo_run, tmp_path), tmp_path / "tok"
    train = ["tokenizer", "train", "--records", records, "--out", out]
    assert cli(capsys, *train, "--vocab-size", 500)[0] == 0
    report = json.loads((out / "tokenizer_report.json").read_text())
    assert report["settings"]["vocab_size"] == 500 and report["made_from"]["records"].startswith("sha256:")
    model = (out / "tokenizer.model").read_bytes()
    assert cli(capsys, *train, "--vocab-size", 500)[0] == 0  # the same command again: the same tokenizer
    assert (out / "tokenizer.model").read_bytes() == model
    code, err = cli(capsys, *train, "--vocab-size", 600)
    assert code == 2 and "vocab_size: 500 there, 600 now" in err and "--overwrite" in err
    assert (out / "tokenizer.model").read_bytes() == model  # nothing replaced
    assert cli(capsys, *train, "--vocab-size", 600, "--overwrite")[0] == 0
    assert json.loads((out / "tokenizer_report.json").read_text())["settings"]["vocab_size"] == 600
    # A folder holding someone else's tokenizer (no report of ours) is not replaced either.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "tokenizer.model").write_bytes(b"their model")
    code, err = cli(capsys, "tokenizer", "train", "--records", records, "--out", theirs, "--vocab-size", 500)
    assert code == 2 and "tokenizer.model exists without tokenizer_report.json" in err
    assert (theirs / "tokenizer.model").read_bytes() == b"their model"
    code, err = cli(capsys, *train, "--vocab-size", 0)
    assert code == 2 and err.endswith("--vocab-size must be at least 300, got 0 (the byte fallback alone takes 256 "
                                      "pieces; 8000 suits the demo data)")


def test_the_same_build_again_is_kept_and_a_changed_input_is_named(built_run, tmp_path, capsys):
    """`build` run again with nothing changed rebuilt the same examples (23 s) without a word: it is kept, said
    so, unless --overwrite; with the same options from changed inputs (data prepared again, a tokenizer trained
    again into the same folder) it builds again, naming the files that changed (it said nothing)."""
    from dataclasses import asdict

    from polyalign.core.paths import file_digest
    from polyalign.inputs.build import BuildOptions, kept_build

    source, manifest = built_run
    run = tmp_path / "run"
    (run / "build").mkdir(parents=True)
    (run / "data").mkdir()
    (run / "data" / "manifest.json").write_bytes((source / "data" / "manifest.json").read_bytes())
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    made_from = {**manifest["made_from"], str(tokenizer): file_digest(tokenizer)}
    (run / "build" / "manifest.json").write_text(json.dumps({**manifest, "made_from": made_from}))
    options = BuildOptions(**manifest["settings"])
    assert asdict(options) == manifest["settings"]
    assert kept_build(run, options, overwrite=False)["made_from"] == made_from
    assert capsys.readouterr().err == (f"note: {run / 'build'} already holds this build (the same options, from the "
                                       "data and the tokenizer as they are now): kept (--overwrite builds it again)\n")
    assert kept_build(run, options, overwrite=True) is None
    assert kept_build(run, BuildOptions(**{**manifest["settings"], "max_length": 32}), overwrite=False) is None
    assert capsys.readouterr().err == ""  # other options: the build's own refusal (or --overwrite) says it
    tokenizer.write_text('{"trained": "again"}')
    (run / "data" / "manifest.json").write_text("{}")  # prepared again since
    assert kept_build(run, options, overwrite=False) is None
    assert capsys.readouterr().err == (f"note: {run / 'build'} was built with the same options from other contents of "
                                       f"data/manifest.json, {tokenizer}; building it again from them as they are "
                                       "now\n")


def test_a_build_belongs_to_its_options_and_to_its_tokenizer(built_run, demo_tokenizer, tmp_path, capsys):
    from polyalign.inputs.build import tokenizer_digests
    from polyalign.inputs.built import read_manifest

    source, manifest = built_run
    assert manifest["settings"]["max_length"] == 64
    run = tmp_path / "run"
    (run / "build").mkdir(parents=True)
    (run / "data").symlink_to(source / "data", target_is_directory=True)
    (run / "build" / "manifest.json").write_text(json.dumps(manifest))
    tokenizer = demo_tokenizer[0].path.parent
    code, err = cli(capsys, "build", run, "--tokenizer", tokenizer, "--max-length", 32, "--no-progress")
    assert code == 2 and "max_length: 64 there, 32 now" in err and "--overwrite" in err
    (run / "build" / "manifest.json").unlink()
    (run / "build" / "sft_examples").mkdir()
    code, err = cli(capsys, "build", run, "--tokenizer", tokenizer, "--no-progress")
    assert code == 2 and "sft_examples exists without manifest.json" in err
    # A build records its tokenizer's digests; training refuses it once the tokenizer is trained again, and,
    # where it rendered with the folder's own chat template, once that template is edited, added as
    # chat_template.jinja (which transformers reads first) or removed.
    (run / "tokenizer").mkdir()
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (run / "tokenizer" / name).write_bytes((tokenizer / name).read_bytes())
    template = run / "tokenizer" / "chat_template.jinja"

    def recorded(own_template):
        made_from = {**manifest["made_from"], **tokenizer_digests(run, run / "tokenizer", own_template)}
        (run / "build" / "manifest.json").write_text(json.dumps({**manifest, "made_from": made_from}))
        assert read_manifest(run)["made_from"] == made_from
        return made_from

    # polyalign's own tokenizer names a built-in template, which no template file changes
    made_from = recorded(own_template=False)
    assert {"tokenizer/tokenizer.model", "tokenizer/tokenizer_config.json"} <= set(made_from)
    assert "tokenizer/chat_template.jinja" not in made_from
    template.write_text("{% for m in messages %}{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}")
    assert read_manifest(run)["made_from"] == made_from
    template.unlink()
    # rendered with the folder's own template: its files are the build's inputs too
    assert recorded(own_template=True)["tokenizer/chat_template.jinja"] is None
    template.write_text("{% for m in messages %}{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ConfigError, match="encoded before tokenizer/chat_template.jinja was there .* rerun `polyalign"):
        read_manifest(run)
    recorded(own_template=True)
    template.write_text(template.read_text().replace(">>", ":"))
    with pytest.raises(ConfigError, match="encoded with another tokenizer/chat_template.jinja than the one there now "
                                          r"\(the tokenizer or its chat template changed since"):
        read_manifest(run)
    recorded(own_template=True)
    template.unlink()
    with pytest.raises(ConfigError, match=r"encoded with tokenizer/chat_template.jinja, which is gone \(the config's "
                                          r"chat template would be exported instead\)"):
        read_manifest(run)
    recorded(own_template=True)
    (run / "tokenizer" / "tokenizer.model").write_bytes(b"trained again")
    with pytest.raises(ConfigError, match="encoded with another tokenizer/tokenizer.model .* rerun `polyalign build"):
        read_manifest(run)
    # a tokenizer given as its file: the config beside it is read too, so it is recorded too
    given = tokenizer_digests(run, run / "tokenizer" / "tokenizer.model")
    assert set(given) == {"tokenizer/tokenizer.model", "tokenizer/tokenizer_config.json"}


def test_stats_refuse_a_second_writer(demo_run, tmp_path, capsys):
    import os

    from polyalign.core.outputs import LOCK

    source, _, _ = demo_run
    run = tmp_path / "run"
    (run / "stats").mkdir(parents=True)
    (run / "data").symlink_to(source / "data", target_is_directory=True)
    (run / "stats" / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "since": "now"}))
    code, err = cli(capsys, "stats", run, "--no-progress")
    assert code == 2 and f"another polyalign process (pid {os.getpid()} on" in err
    assert not (run / "stats" / "stats.json").exists()


@pytest.fixture(scope="module")
def tiny_checkpoint(demo_tokenizer, tmp_path_factory):
    """A 2-layer model with the demo tokenizer, saved as a Hugging Face checkpoint."""
    from polyalign.model import create_model, save_hf_checkpoint
    from polyalign.model.presets import preset

    tokenizer = demo_tokenizer[0]
    model = create_model(preset("tiny", vocab_size=tokenizer.vocab_size, num_layers=2, hidden_size=64, num_heads=4,
                                num_kv_heads=2, head_dim=16, intermediate_size=128))
    directory = tmp_path_factory.mktemp("checkpoint") / "ckpt"
    save_hf_checkpoint(model, directory, extra_files={
        name: (tokenizer.path.parent / name).read_bytes() for name in ("tokenizer.model", "tokenizer_config.json")})
    return directory


@pytest.mark.slow
def test_predictions_pairs_and_evaluations_belong_to_their_settings_and_records(demo_run, tiny_checkpoint, tmp_path,
                                                                                capsys):
    run, _, _ = demo_run
    records = tmp_path / "records.jsonl"  # a copy, so that it can be changed as a second prepare would
    records.write_text((run / "data" / "test.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    predictions = tmp_path / "pred.jsonl"
    generate = ["generate", "--checkpoint", tiny_checkpoint, "--records", records, "--out", predictions,
                "--limit", 24, "--max-new-tokens", 4, "--temperature", 1.0, "--no-progress"]
    assert cli(capsys, *generate)[0] == 0
    record = json.loads((tmp_path / "pred.manifest.json").read_text())
    assert record["settings"]["seed"] == 0 and record["made_from"]["checkpoint"]["weights"]
    first = predictions.read_text()
    assert cli(capsys, *generate)[0] == 0 and predictions.read_text() == first  # the same command, the same rows
    code, err = cli(capsys, *generate, "--seed", 1)
    assert code == 2 and "seed: 0 there, 1 now" in err and predictions.read_text() == first
    at = generate.index("--out")
    code, err = cli(capsys, *generate[:at], "--out", records, *generate[at + 2:])
    assert code == 2 and f"--out {records} is the command's own records" in err

    pairs = ["pairs", "--records", records, "--predictions", predictions, "--out", tmp_path / "pairs.jsonl"]
    assert cli(capsys, *pairs)[0] == 0
    assert json.loads((tmp_path / "pairs.manifest.json").read_text())["summary"]["predictions"] == 24
    code, err = cli(capsys, *pairs[:-1], predictions)
    assert code == 2 and "is the command's own predictions" in err

    evaluate = ["evaluate", "--records", records, "--predictions", predictions, "--out", tmp_path / "eval",
                "--allow-partial", "--no-diversity", "--no-baselines", "--bootstrap-draws", 20]
    assert cli(capsys, *evaluate)[0] == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["settings"]["intervals"]["draws"] == 20 and set(metrics["made_from"]) == {"records", "predictions"}
    code, err = cli(capsys, *evaluate, "--seed", 3)
    assert code == 2 and "intervals.seed: 0 there, 3 now" in err
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == metrics
    assert cli(capsys, *evaluate, "--seed", 3, "--overwrite")[0] == 0

    assert cli(capsys, "report", tmp_path / "eval", "--out", tmp_path / "cmp")[0] == 0
    code, err = cli(capsys, "report", tmp_path / "eval", tmp_path / "eval", "--out", tmp_path / "cmp")
    assert code == 2 and "evals" in err and "--overwrite" in err
    code, err = cli(capsys, "report", tmp_path / "eval", "--out", tmp_path / "eval")
    assert code == 2 and "is the command's own evaluation 1" in err

    # The records change under the predictions (prepare ran again): joining them by id would be wrong.
    lines = records.read_text(encoding="utf-8").splitlines()
    changed = json.loads(lines[0])
    changed["response"] = "A different answer."
    records.write_text("\n".join([json.dumps(changed, ensure_ascii=False), *lines[1:]]) + "\n", encoding="utf-8")
    for command in (evaluate + ["--overwrite"], pairs + ["--overwrite"]):
        code, err = cli(capsys, *command)
        assert code == 2 and "with other contents than" in err and "run `polyalign generate`" in err
    # Predictions from elsewhere (an external engine) carry no record: refused as an output, joined as an input.
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text(first, encoding="utf-8")
    code, err = cli(capsys, *generate[:5], "--out", theirs, *generate[7:])
    assert code == 2 and "theirs.jsonl exists without theirs.manifest.json" in err
    assert cli(capsys, *evaluate[:4], theirs, *evaluate[5:], "--overwrite")[0] == 0


# Faults during training: a damaged or unwritable checkpoint, non-finite steps, SIGTERM, and outputs
# that belong to another run. The runs are tiny SFT runs on the demo build (tests/test_training.py).

def test_a_build_is_refused_once_the_prepare_it_was_made_from_is_replaced(built_run, tmp_path):
    import shutil

    from polyalign.core.paths import file_digest
    from polyalign.core.yaml_config import ConfigError
    from polyalign.inputs.built import read_manifest

    run, manifest = built_run
    assert manifest["made_from"]["data/manifest.json"] == file_digest(run / "data" / "manifest.json")
    tokenizer_files = {name for name in manifest["made_from"] if name.endswith("tokenizer.model")}
    assert len(tokenizer_files) == 1  # the tokenizer lies outside the run: named by its absolute path
    moved = tmp_path / "run"
    (moved / "data").mkdir(parents=True)
    (moved / "build").symlink_to(run / "build", target_is_directory=True)
    shutil.copy(run / "data" / "manifest.json", moved / "data" / "manifest.json")
    assert read_manifest(moved)["buckets"] == manifest["buckets"]  # the same prepare: accepted
    prepared_again = json.loads((moved / "data" / "manifest.json").read_text()) | {"created": "later"}
    (moved / "data" / "manifest.json").write_text(json.dumps(prepared_again))
    with pytest.raises(ConfigError, match="made from another data/manifest.json ") as refused:
        read_manifest(moved)
    # the command it gives is the one that made the build (its tokenizer and cutoff), not bare `build RUN`
    command = shlex.join(["polyalign", "build", str(moved), "--tokenizer", manifest["settings"]["tokenizer"],
                          "--max-length", "64"])
    assert str(refused.value).endswith(f"rerun `{command}`")


def test_a_record_copied_by_hand_into_a_split_file_stops_build_naming_both_lines(demo_run, demo_tokenizer, tmp_path,
                                                                                  capsys):
    """A row pasted twice into train.jsonl ended build in a TFDS traceback about duplicate keys; one pasted
    into val.jsonl is trained on and validated on, which build says."""
    source, _, _ = demo_run
    run = tmp_path / "run"
    first_records(source, run / "data", {"train": 6, "val": 3, "test": 2})
    train = run / "data" / "train.jsonl"
    lines = train.read_text(encoding="utf-8").splitlines(keepends=True)
    train.write_text("".join(lines + [lines[1]]), encoding="utf-8")
    with (run / "data" / "val.jsonl").open("a", encoding="utf-8") as val:
        val.write(lines[4])
    args = ["build", str(run), "--tokenizer", str(demo_tokenizer[0].path.parent), "--max-length", "64",
            "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    record_id = json.loads(lines[1])["id"]
    assert err == [f"polyalign build: error: {train}:2: record id {record_id!r} again at {train}:7; each record "
                   "is one example: remove the copies (an edit by hand?), or run `polyalign prepare` again"]
    assert not (run / "build" / "sft_examples").exists()
    # one in both splits builds, said: validation then measures a record training saw
    train.write_text("".join(lines), encoding="utf-8")
    assert main(args) == 0
    assert "warning: 1 of the 4 val records are train records too (the same ids): validation measures them as " \
           "trained on" in capsys.readouterr().err


@pytest.mark.parametrize("settings", [
    {}, {"tokenizer": "ckpt/tiny qwen2", "max_length": 128},
    {"template": "qwen", "profile": "none", "system": "drop", "train_on": "all", "max_length": 512},
    {"weights": {"preset": "method"}},
    {"weights": {"temperature": 0.7, "clip": [0.1, 4.0], "borrow_below": 20, "min_bucket_size": 3}}])
def test_the_rebuild_command_gives_the_options_the_build_was_made_with(settings):
    """Whatever options a build was made with, the command an error suggests to make it again parses,
    through the CLI's own parser, to those options."""
    from polyalign.cli import build_options, build_parser
    from polyalign.inputs.built import BuildOptions, rebuild_command

    made = dataclasses.replace(BuildOptions(), **settings)
    words = shlex.split(rebuild_command("runs/my run", {"settings": dataclasses.asdict(made)}))
    assert words[:3] == ["polyalign", "build", "runs/my run"]
    assert build_options(build_parser().parse_args(words[1:])) == made


def _damage(checkpoint: Path) -> None:
    """Every byte of the saved arrays overwritten, the files left in place: what a failing disk leaves."""
    for path in (checkpoint / "state").rglob("*"):
        if path.is_file() and path.name != "commit_success.txt":
            path.write_bytes(b"\0" * max(path.stat().st_size, 16))


def test_a_batch_that_does_not_divide_over_the_devices_leaves_nothing_behind(built_run, tmp_path):
    """Refused before config.json is written: the corrected command then starts afresh (it was refused as
    `made by another config (train.global_batch: 6 there, 8 now)`)."""
    run, _ = built_run
    out = tmp_path / "out"
    process = start_cli(train_args(run, out, "parallel.data=4", "train.global_batch=6"), {}, devices=4)
    output = process.communicate()[0]
    assert process.returncode == 2, output[-2000:]
    assert output.splitlines()[-1] == ("polyalign train sft: error: global_batch 6 / micro_batches 1 = 6 sequences per "
                                       "micro-batch must divide over 4 batch shards (data x fsdp)")
    assert not out.exists()


def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_one_resumes(built_run, tmp_path, capsys):
    from polyalign.core.errors import CheckpointError

    run, _ = built_run
    train_sft(sft_config(run, 9), tmp_path / "straight", progress=False)
    train_sft(sft_config(run, 9, "train.stop_at=6"), tmp_path / "resumed", progress=False)  # checkpoints 3 and 6
    checkpoints = tmp_path / "resumed" / "checkpoints"
    _damage(checkpoints / "6")
    resumed = train_sft(sft_config(run, 9), tmp_path / "resumed", progress=False)
    assert "checkpoint 6 cannot be restored" in capsys.readouterr().err
    assert resumed["start_step"] == 3 and resumed["end_step"] == 9
    assert (checkpoints / "6.unreadable" / "state").is_dir()  # kept, never deleted
    straight = {r["step"]: r for r in read_metrics(tmp_path / "straight") if "loss" in r}
    again = {r["step"]: r for r in read_metrics(tmp_path / "resumed") if "loss" in r}
    for step in range(4, 10):  # steps 4-6 trained twice: the second time as the first
        assert abs(again[step]["loss"] - straight[step]["loss"]) <= 1e-5, step
    # a stop before the step the run is already at cannot be honoured: refused, not ignored
    from polyalign.core.yaml_config import ConfigError

    with pytest.raises(ConfigError, match=r"train.stop_at=6: the run in .*resumed is already at step 9; give a later "
                                          r"step \(train.steps is 9\), or leave stop_at out"):
        train_sft(sft_config(run, 9, "train.stop_at=6"), tmp_path / "resumed", progress=False)
    # when no checkpoint restores, nothing is moved: a changed setting is the likelier cause
    train_sft(sft_config(run, 9, "train.stop_at=6"), tmp_path / "broken", progress=False)
    for step in ("3", "6"):
        _damage(tmp_path / "broken" / "checkpoints" / step)
    with pytest.raises(CheckpointError, match="neither checkpoint 6 nor 3 can be restored"):
        train_sft(sft_config(run, 9), tmp_path / "broken", progress=False)
    assert sorted(p.name for p in (tmp_path / "broken" / "checkpoints").iterdir()) == ["3", "6"]


def test_a_stopped_runs_unfinished_checkpoint_writes_are_removed_with_a_note(tmp_path, capsys):
    """A run killed while writing a checkpoint leaves Orbax's temporary folder: the next run's checkpointer
    removes it, saying so, before Orbax meets it again; committed checkpoints and other files stay."""
    from polyalign.train.checkpoint import Checkpointer

    folder = tmp_path / "checkpoints"
    for name in ("100.orbax-checkpoint-tmp", "6.orbax-checkpoint-tmp-1733", "3"):
        (folder / name).mkdir(parents=True)
    (folder / "3" / "kept").write_text("a committed checkpoint's file")
    checkpointer = Checkpointer(folder, every=1, keep=2)
    checkpointer.close()
    assert sorted(p.name for p in folder.iterdir()) == ["3"] and (folder / "3" / "kept").is_file()
    assert capsys.readouterr().err.splitlines() == [
        f"note: {folder / name}: an unfinished checkpoint write of a run that was stopped; removed (the committed "
        "checkpoints stay)" for name in ("100.orbax-checkpoint-tmp", "6.orbax-checkpoint-tmp-1733")]


def test_a_failed_checkpoint_write_stops_at_once_and_keeps_the_committed_ones(built_run, tmp_path, monkeypatch):
    """A full disk at step 6: training stops there with one CheckpointError, the unfinished folder is
    removed, checkpoint 3 stays, and the same command resumes from it once there is room."""
    import errno

    import orbax.checkpoint as ocp

    from polyalign.core.errors import CheckpointError

    run, _ = built_run
    out = tmp_path / "out"
    real_save = ocp.CheckpointManager.save

    def save(manager, step, *args, **kwargs):
        if step == 6:
            (out / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()  # what a write cut short leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(manager, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    with pytest.raises(CheckpointError, match=r"writing checkpoint 6 failed \(OSError: \[Errno 28\] No space left"):
        train_sft(sft_config(run, 9), out, progress=False)
    assert max(r["step"] for r in read_metrics(out)) == 6  # stopped at the step whose save failed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3"]
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
    resumed = train_sft(sft_config(run, 9), out, progress=False)
    assert resumed["start_step"] == 3 and resumed["end_step"] == 9


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(built_run, tmp_path):
    import jax

    from polyalign.mesh import parallel
    from polyalign.model import create_model
    from polyalign.train.sft import SftObjective
    from polyalign.train.trainer import (
        LoopConfig,
        OptimizerConfig,
        Trainer,
        TrainingError,
    )
    from tests.conftest import tiny_model_config

    run, manifest = built_run
    batch, _ = first_batch(run, 8, 1)
    poisoned = {**batch, "weight": batch["weight"].copy()}
    poisoned["weight"][0, 0] = np.nan
    trainer = Trainer(create_model(tiny_model_config(manifest["vocab_size"])), SftObjective(len(manifest["buckets"])),
                      OptimizerConfig(), LoopConfig(steps=5, global_batch=8, max_nonfinite=1),
                      parallel.make_mesh())
    before = jax.device_get((trainer.state["params"], trainer.state["opt_state"]))
    metrics = jax.device_get(trainer.step(poisoned))
    assert not metrics["finite"] and int(trainer.state["nonfinite"]) == 1 and trainer.step_number == 1
    after = jax.device_get((trainer.state["params"], trainer.state["opt_state"]))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):  # parameters and AdamW moments
        np.testing.assert_array_equal(a, b)
    assert jax.device_get(trainer.step(batch))["finite"]  # a good batch still trains
    with pytest.raises(TrainingError, match="more than 1 steps had a non-finite loss"):
        trainer.fit(iter([poisoned] * 3), progress=False)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_same_command_resumes(built_run, tmp_path):
    import signal
    import time

    run, _ = built_run
    out = tmp_path / "preempted"
    args = train_args(run, out, "train.steps=400", "train.checkpoint_every=1000", "train.eval_every=1000")
    process = start_cli(args, {}, devices=1)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output[-2000:]
    stopped = len(read_metrics(out))
    assert f"stopped at step {stopped}; checkpoint saved ({out / 'checkpoints' / str(stopped)})" in output
    assert (out / "checkpoints" / str(stopped)).is_dir()
    output = wait_ok([start_cli(args + [f"train.stop_at={stopped + 2}"], {}, devices=1)])[0]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, stopped + 3))


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_and_a_hung_pair_ends_by_itself(built_run, tmp_path):
    """SIGTERM reaches process 1 only: both stop at the same step and exit 0. Then the same command,
    with process 1 frozen (SIGSTOP) in the middle of training: process 0 waits on it in a collective,
    and its watchdog ends it after train.hang_timeout with one line naming the step, and its stacks."""
    import signal
    import time
    from pathlib import Path

    run, _ = built_run
    out = tmp_path / "pair"
    args = ("train.steps=400", "train.checkpoint_every=1000", "train.eval_every=1000", "train.hang_timeout=8",
            "train.peer_timeout=120")  # the first step may take 4 x 8 s (compiling)
    workers = start_two_processes(run, out, *args)
    metrics = out / "metrics.jsonl"

    def wait_for_steps(n):
        deadline = time.time() + 240
        while time.time() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < n):
            time.sleep(0.2)

    wait_for_steps(3)
    workers[1].send_signal(signal.SIGTERM)  # timeout(1) passes it on to its child
    outputs = wait_ok(workers)
    stopped = len(read_metrics(out))
    assert f"stopped at step {stopped}" in outputs[0]
    assert (out / "checkpoints" / str(stopped)).is_dir()

    workers = start_two_processes(run, out, *args)
    wait_for_steps(stopped + 3)
    # the process doing the work: timeout(1)'s child is the parent over it (polyalign/mesh/supervisor.py)
    child = workers[1].pid
    for _ in range(2):
        child = int(Path(f"/proc/{child}/task/{child}/children").read_text().split()[0])
    os.kill(child, signal.SIGSTOP)
    frozen = time.time()
    try:
        output = workers[0].communicate(timeout=120)[0]
    finally:
        os.kill(child, signal.SIGKILL)
        workers[1].communicate()
    assert workers[0].returncode == 3, output[-3000:]
    assert time.time() - frozen < 60
    line = next(line for line in output.splitlines() if "made no progress" in line)
    assert re.match(r"polyalign: process 0 of 2: (step|evaluation after step|the stop agreement after step) \d+ "
                    r"made no progress for \d+ s \(train.hang_timeout=8\)", line), line
    assert "Thread 0x" in output or "Current thread" in output  # the stacks


def test_a_two_process_job_into_a_folder_another_job_writes_stops_every_process_with_one_line(built_run, tmp_path):
    """OUT's lock held by another live process (this test's own, standing in for a running job): process 0
    refuses, and process 1 stops with the same line instead of going on into a collective and an Orbax
    traceback (it took the lock on process 0 only)."""
    import socket

    run, _ = built_run
    out = tmp_path / "busy"
    out.mkdir()
    (out / ".polyalign.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    workers = start_two_processes(run, out)
    outputs = [w.communicate()[0] for w in workers]
    for index, (worker, output) in enumerate(zip(workers, outputs)):
        assert worker.returncode == 2, (index, output[-3000:])
        assert "Traceback" not in output and f"another polyalign process (pid {os.getpid()}" in output, output[-3000:]
    assert "(process 0 refused it; this process stops with it)" in outputs[1]
    assert not (out / "checkpoints").exists()


def test_an_output_belongs_to_the_config_that_made_it(built_run, tmp_path, capsys, monkeypatch):
    """Another config into the same OUT is refused with the differing keys named; changed resumable
    keys need existing="resume" (--resume); --overwrite starts over; OUT may not be an input. The same
    input spelled another way (relative, from another folder) is the same config."""
    from polyalign.core.yaml_config import ConfigError

    run, _ = built_run
    out = tmp_path / "out"
    first = train_sft(sft_config(run, 3), out, progress=False)
    assert json.loads((out / "config.json").read_text())["data"]["dir"] == str(Path(run).resolve())
    monkeypatch.chdir(Path(run).parent)
    for spelled in (Path(run).name, f"./{Path(run).name}", f"../{Path(run).parent.name}/{Path(run).name}"):
        same = train_sft(sft_config(spelled, 3), out, progress=False)
        assert same["start_step"] == same["end_step"] == 3, spelled
    # a run recorded before paths were made absolute: its relative path read from this folder
    saved = json.loads((out / "config.json").read_text())
    saved["data"]["dir"] = Path(run).name
    (out / "config.json").write_text(json.dumps(saved))
    assert train_sft(sft_config(run, 3), out, progress=False)["end_step"] == 3
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"made by another config \(optimizer.lr: 0.003 there, 0.002 now\)"):
        train_sft(sft_config(run, 3, "optimizer.lr=0.002"), out, progress=False)
    with pytest.raises(ConfigError, match=r"started with train.steps=3 \(now 4\); pass --resume"):
        train_sft(sft_config(run, 4), out, progress=False)
    # another method's run: said first, not as a list of every key the two methods do not share
    from polyalign.train.ownership import claim

    with pytest.raises(ConfigError) as other:
        claim(out, {**json.loads((out / "config.json").read_text()), "method": "dpo", "beta": 0.1}, {})
    assert str(other.value) == f"{out}: holds a run of sft; this command trains dpo. Give another --out, or pass " \
                               "--overwrite to replace that run"
    capsys.readouterr()
    resumed = train_sft(sft_config(run, 4), out, progress=False, existing="resume")
    assert resumed["start_step"] == 3 and resumed["end_step"] == 4
    # the run's history is kept: a reader of its model card, or of a comparison, sees it was resumed longer
    summary = json.loads((out / "summary.json").read_text())
    segments = summary["segments"]
    assert [(s["start_step"], s["end_step"], s["steps"]) for s in segments] == [(0, 3, 3), (3, 4, 4)]
    # `seconds` is the last invocation's; `total_seconds` the run's in all
    assert summary["seconds"] == segments[-1]["seconds"]
    assert summary["total_seconds"] == pytest.approx(segments[0]["seconds"] + segments[1]["seconds"], abs=0.11)
    card = (out / "model" / "README.md").read_text(encoding="utf-8")
    assert "| steps | 4 (train.steps 3 up to step 3, then 4), resumed on the new length's learning-rate " \
           "schedule |" in card
    # the model's own record holds the invocation that exported it too (it held the earlier ones only)
    record = json.loads((out / "model" / "polyalign_training.json").read_text())["segments"]
    assert [(s["start_step"], s["end_step"], s["steps"]) for s in record] == [(0, 3, 3), (3, 4, 4)]
    # fewer steps than the run has trained: refused before anything is moved, removed or exported again
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match=re.escape(f"{out}: already trained to step 4, past the 3 steps this config "
                                                    "asks for; give train.steps of at least 4 to continue it")):
        train_sft(sft_config(run, 3), out, progress=False, existing="resume")
    with pytest.raises(ConfigError, match=re.escape(f"{out}: already trained to step 4, past the 3 steps")):
        train_sft(sft_config(run, 3), out, progress=False)  # said at once: --resume would only lead to it
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept
    assert (out / "model" / "README.md").read_text(encoding="utf-8") == card
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 4
    printed = capsys.readouterr().out
    assert "resumed from step 3" in printed and "; resuming at step 3 (OUT/checkpoints) of a run that started from " \
                                                 "scratch (model.preset " in printed
    # the schedule of the new length from step 4 on, said with the rate step 3 took and the one step 4 takes
    rates = {r["step"]: r["lr"] for r in read_metrics(out) if "lr" in r}
    assert (f"note: the run's length changed on resume, so the learning-rate schedule is the one for 4 steps from "
            f"here: step 4 takes {rates[4]:.2e}, where step 3 took {rates[3]:.2e}") in printed
    # an invocation stopped outright (SIGKILL) after its last checkpoint wrote no summary: the next one, which
    # resumes from that checkpoint, keeps its steps as a segment of unknown time
    before = (out / "summary.json").read_text()
    train_sft(sft_config(run, 6), out, progress=False, existing="resume")
    (out / "summary.json").write_text(before)  # as if 4 -> 6 had been killed before writing its summary
    whole = train_sft(sft_config(run, 6), out, progress=False)
    assert (whole["start_step"], whole["end_step"]) == (6, 6)
    assert [(s["start_step"], s["end_step"], s["steps"], s.get("ended")) for s in whole["segments"]] == [
        (0, 3, 3, None), (3, 4, 4, None), (4, 6, 6, "without a summary (stopped outright)")]
    assert "total_seconds" not in whole  # one invocation's time is unknown
    assert json.loads((out / "model" / "polyalign_training.json").read_text())["segments"] == whole["segments"]
    again = train_sft(sft_config(run, 3, "optimizer.lr=0.002"), out, progress=False, existing="overwrite")
    assert again["start_step"] == 0 and json.loads((out / "config.json").read_text())["optimizer"]["lr"] == 2e-3
    assert len([r for r in read_metrics(out) if "loss" in r]) == 3 and first["end_step"] == 3
    with pytest.raises(ConfigError, match="is the run's own data.dir"):
        train_sft(sft_config(run, 3), run, progress=False)
    # --overwrite with a mistyped input: refused before anything of the earlier run is removed
    kept = sorted(p.name for p in out.iterdir())
    with pytest.raises(ConfigError, match=re.escape(
            f"data.dir={tmp_path / 'nowhere'}: no such file or folder; nothing in --out was removed (a training "
            f"config's relative paths are read from the folder the command runs in, {tmp_path}, not from the config "
            "file's)")):
        train_sft(sft_config("nowhere", 3), out, progress=False, existing="overwrite")
    assert sorted(p.name for p in out.iterdir()) == kept and "checkpoints" in kept


def test_a_second_writer_is_refused_and_a_stale_lock_taken_over(built_run, tmp_path, capsys):
    from polyalign.core.outputs import LOCK
    from polyalign.core.yaml_config import ConfigError

    run, _ = built_run
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "since": "now"}))
    with pytest.raises(ConfigError, match=f"another polyalign process \\(pid {os.getpid()} on"):
        train_sft(sft_config(run, 1), out, progress=False)
    assert not (out / "config.json").exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "since": "then"}))
    assert train_sft(sft_config(run, 1), out, progress=False)["end_step"] == 1
    assert "taking it over" in capsys.readouterr().out and not (out / LOCK).exists()


def test_a_feature_whose_extra_is_missing_names_the_extra(tmp_path, capsys, monkeypatch):
    """lingua (`langid`), mauve-text (`mauve`) and apache-beam (`beam`) are extras: without them, the
    feature that needs one stops with one line naming it, before any work. Language detection for the
    scheme's languages needs none: without lingua, Latin-script rows are the scheme's Latin-script
    language and the manifest says so."""
    from polyalign.data import language

    rows = [chat_row({"turns": [{"speaker": "user", "utterance": r["instruction"]},
                                {"speaker": "assistant", "utterance": r["output"]}]}, track="single",
                     family="assistant", style="assistant_like") for r in sample_rows()[:5]]
    (tmp_path / "c.jsonl").write_text(jsonl(rows), encoding="utf-8")
    config = write_config(tmp_path / "config.yaml", [{"name": "src", "format": "chat", "path": "c.jsonl",
                                                      "split": "train"}])  # no language: detection needed
    for module in ("lingua", "mauve", "apache_beam"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as when not installed
    language._detector.cache_clear()
    try:
        assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    finally:
        language._detector.cache_clear()
    assert {r["language"] for r in read_jsonl(tmp_path / "run" / "data" / "train.jsonl")} == {"en"}
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["language_detection"].startswith("by script; lingua not installed (the langid extra)")
    capsys.readouterr()
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "beam"), "--beam"]) == 2
    assert "needs the 'beam' extra: pip install 'polyalign[beam]'" in capsys.readouterr().err
    # --num-shards is a Beam prepare's: without --beam it was ignored without a word
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "shards"), "--num-shards", "3"]) == 2
    assert capsys.readouterr().err == ("polyalign prepare: error: --num-shards 3 shards a Beam prepare's outputs; add "
                                       "--beam, or leave --num-shards out\n")
    assert not (tmp_path / "shards").exists()
    records = tmp_path / "records.jsonl"
    records.write_text("", encoding="utf-8")
    assert main(["evaluate", "--records", str(records), "--predictions", str(records), "--out", str(tmp_path / "eval"),
                 "--featurizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MAUVE (--featurizer) needs the 'mauve' extra: pip install 'polyalign[mauve]'" in err[0]


def test_a_checkpoints_data_state_is_read_on_any_process_count(tmp_path, monkeypatch):
    """grain writes one file per process and reads back only the current count's: the state (the steps
    taken) is global, so another count reads the writers' common state; files that disagree cannot move."""
    import jax

    from polyalign.core.errors import CheckpointError
    from polyalign.train.checkpoint import restore_data_state

    class Iterator:
        state = None

        def set_state(self, state):
            self.state = state

    def written(count, states):
        folder = tmp_path / f"of-{count}-{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for i, state in enumerate(states):
            (folder / f"process_{i}-of-{count}.json").write_text(json.dumps(state, indent=4))
        return folder

    # one process reads two writers' state, and two processes one writer's (each its own index)
    for me, count in ((0, 1), (1, 2)):
        monkeypatch.setattr(jax, "process_index", lambda: me)
        monkeypatch.setattr(jax, "process_count", lambda: count)
        for writers in ((1, [{"next_index": 7}]), (2, [{"next_index": 7}] * 2), (4, [{"next_index": 7}] * 4)):
            iterator = Iterator()
            restore_data_state(written(*writers), iterator)
            assert iterator.state == {"next_index": 7}, (me, count, writers)
    monkeypatch.setattr(jax, "process_index", lambda: 0)  # another count than the writers': their files must agree
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    with pytest.raises(CheckpointError, match="left their data iterators in different states, so it resumes only on "
                                              "2 processes"):
        restore_data_state(written(2, [{"next_index": 7}, {"next_index": 8}]), Iterator())
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no data iterator state"):
        restore_data_state(empty, Iterator())


def test_prediction_files_users_bring_are_read_or_refused_in_one_line(demo_run, tmp_path, capsys):
    """What an evaluation meets in users' hands: a Windows tool's UTF-16 export is read; a missing file, a
    folder, a gzip archive, an empty file and predictions of another split are one line each (they were
    tracebacks, and --allow-partial, which the mismatch line suggests, crashed on no common id)."""
    import gzip

    run, _, _ = demo_run
    test = run / "data" / "test.jsonl"
    val = [json.loads(line) for line in (run / "data" / "val.jsonl").read_text().splitlines()[:30]]
    rows = [json.loads(line) for line in test.read_text().splitlines()]
    answers = "".join(json.dumps({"id": r["id"], "prediction": r["response"]}, ensure_ascii=False) + "\n" for r in rows)
    (tmp_path / "utf16.jsonl").write_bytes(answers.encode("utf-16"))
    (tmp_path / "utf16le.jsonl").write_bytes(answers.encode("utf-16-le"))  # no byte-order mark
    (tmp_path / "answers.jsonl.gz").write_bytes(gzip.compress(answers.encode()))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"id": r["id"], "prediction": r["response"]},
                                                           ensure_ascii=False) + "\n" for r in val))
    (tmp_path / "folder").mkdir()

    def evaluate(name, *extra):
        code = main(["evaluate", "--records", str(test), "--predictions", str(tmp_path / name), "--out",
                     str(tmp_path / f"eval-{name}"), "--no-detectability", "--no-baselines", "--no-progress",
                     *extra])
        said = capsys.readouterr()
        assert "Traceback" not in said.err
        return code, said.err.strip().splitlines()[-1] if said.err.strip() else ""

    assert evaluate("utf16.jsonl")[0] == 0 and evaluate("utf16le.jsonl")[0] == 0
    for name in ("utf16.jsonl", "utf16le.jsonl"):
        metrics = json.loads((tmp_path / f"eval-{name}/metrics.json").read_text())
        assert metrics["alignment"]["evaluated"] == len(rows), name
    for name, extra, line in [
        ("missing.jsonl", (), f"{tmp_path / 'missing.jsonl'}: no such predictions file"),
        ("folder", (), f"{tmp_path / 'folder'}: a folder, not a predictions file"),
        ("answers.jsonl.gz", (), f"{tmp_path / 'answers.jsonl.gz'}: gzip-compressed; decompress it first"),
        ("empty.jsonl", ("--allow-partial",), f"{tmp_path / 'empty.jsonl'}: holds no predictions"),
        ("val.jsonl", ("--allow-partial",), f"{tmp_path / 'val.jsonl'}: none of its 30 ids is a record of {test}"),
        ("val.jsonl", (), f"{tmp_path / 'val.jsonl'}: none of its 30 ids is a record of {test}"),
    ]:
        code, said = evaluate(name, *extra)
        assert code == 2 and said.startswith(f"polyalign evaluate: error: {line}"), (name, said)
    # pairs reads predictions the same way
    assert main(["pairs", "--records", str(test), "--predictions", str(tmp_path / "missing.jsonl"),
                 "--out", str(tmp_path / "pairs.jsonl")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"{tmp_path / 'missing.jsonl'}: no such predictions file")


def test_a_hand_edited_record_is_refused_naming_its_line_and_field(demo_run, tmp_path):
    """A records file edited after prepare (`"response": null`, a count that is no count): one line naming the
    file, line and field, where statistics crashed and a build trained an empty answer."""
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    lines = (run / "data" / "val.jsonl").read_text(encoding="utf-8").splitlines()[:3]
    for field, value, said in [("response", None, "response is null, not a string"),
                               ("length_tokens", -1, "length_tokens is -1, not a count"),
                               ("history", [{"role": "user"}], "history is not a list of {role, text} turns"),
                               ("bucket_id", "", "bucket_id is empty")]:
        row = json.loads(lines[1])
        row[field] = value
        path = tmp_path / "val.jsonl"
        path.write_text("\n".join([lines[0], json.dumps(row, ensure_ascii=False), lines[2]]) + "\n", encoding="utf-8")
        with pytest.raises(InputError, match=re.escape(f"{path}:2: {said}; records come from `polyalign prepare`")):
            read_records(path)


def test_rows_that_make_one_record_id_are_told_apart_from_sources_that_do(tmp_path, capsys):
    """Rows of one file with the same id (7 and "7" too) need ids of their own: the run stops naming both
    lines, or under --on-error quarantine the later row is quarantined and the run goes on (it stopped the
    run whatever the mode); two sources of one name and split need distinct names: each is told its own fix.
    A repeat whose turns number otherwise (it opens with a greeting: no record key collides) is caught by its
    id all the same (a user's third repeated id went through, two conversations read as one)."""
    for ids, greeting in ((("same", "same"), False), ((7, "7"), False), (("same", "same"), True)):
        second = chat_row(CAMREST[1], id=ids[1])
        if greeting:
            second["messages"] = [{"role": "assistant", "content": CAMREST[2]["turns"][1]["utterance"]},
                                  *second["messages"]]
        rows = [chat_row(CAMREST[0], id=ids[0]), second, chat_row(CAMREST[2], id="other")]
        path = tmp_path / "c.jsonl"
        said = (f"{path}:2: its id '{ids[1]}' is also line 1's: the file's rows' ids repeat; give each row an id of "
                "its own")
        with pytest.raises(PrepareError, match=re.escape(said)):
            run(tmp_path, "chat", "c.jsonl", jsonl(rows))
        manifest = run(tmp_path, "chat", "c.jsonl", jsonl(rows), on_error="quarantine")
        quarantined = read_jsonl(tmp_path / "run" / "data" / "quarantine.jsonl")
        # a greeting before any question is no reply of its own (counted apart)
        replies = [sum(m["role"] == "assistant" for m in row["messages"]) - (row["messages"][0]["role"] == "assistant")
                   for row in rows]
        assert len(quarantined) == replies[1] > 1  # the row whole, a line per reply
        assert all(f"{q['location']}: {q['problem']}".startswith(said) for q in quarantined)
        (source,) = manifest["sources"]
        assert source["dropped"] == {"malformed": replies[1]} and source["kept"] == replies[0] + replies[2]
    # said as records, a line each (a user read "quarantined 14 rows" for 3 rows of several replies)
    assert main(["prepare", "--config", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "said"),
                 "--on-error", "quarantine", "--no-progress"]) == 0
    assert (f"quarantined {replies[1]} records (the malformed drops above), each with its problem and what was read "
            f"of it -> {tmp_path / 'said' / 'data' / 'quarantine.jsonl'}") in capsys.readouterr().out
    (tmp_path / "a.jsonl").write_text(jsonl([chat_row(CAMREST[0], id="x")]))
    (tmp_path / "b.jsonl").write_text(jsonl([chat_row(CAMREST[1], id="x")]))
    config = write_config(tmp_path / "two.yaml", [{"name": "src", "format": "chat", "path": name, "split": "train",
                                                   "language": "en"} for name in ("a.jsonl", "b.jsonl")], dedup=False)
    with pytest.raises(PrepareError, match="give each source a distinct name or split"):
        prepare(config, tmp_path / "two", progress=False)
    # one source whose folder holds a re-export of the same conversation beside the first: named for what it is
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").write_text(jsonl([chat_row(CAMREST[0], id="x")]))
    (tmp_path / "folder" / "a_again.json").write_text(json.dumps([chat_row(CAMREST[0], id="x")]))
    config = write_config(tmp_path / "folder.yaml", [{"name": "src", "format": "chat", "path": "folder",
                                                      "split": "train", "language": "en"}], dedup=False)
    for on_error in ("fail", "quarantine"):  # the files are at fault, not a row
        with pytest.raises(PrepareError, match=r"a_again.json: element 1: record id 'src-train-x-turn-\d+' is also "
                                               r"produced by .*a.jsonl:1: one conversation \(or row\) id read from two "
                                               r"files. Two files of one source holding the same conversations \(a "
                                               r"re-export beside the first\): keep one of them"):
            prepare(config, tmp_path / f"folder-{on_error}", on_error=on_error, progress=False)


def test_a_key_given_twice_in_a_config_file_is_refused_naming_its_line(tmp_path):
    """YAML keeps the last of two equal keys silently: a source written `name: a` ... `name: b` was named b,
    and a second `scheme:` replaced the first. Every config polyalign reads refuses it, naming the line."""
    from polyalign.core.yaml_config import load_yaml
    from polyalign.train.methods import load_config

    data = tmp_path / "data.yaml"
    data.write_text("scheme: polyalign\nsources:\n  - name: a\n    format: chat\n    path: c.jsonl\n    name: b\n")
    with pytest.raises(ConfigError, match=re.escape(f"{data}:6: invalid YAML: key 'name' given twice")):
        load_yaml(data)
    train = tmp_path / "sft.yaml"
    train.write_text("method: sft\noptimizer:\n  lr: 0.001\ntrain:\n  steps: 3\noptimizer:\n  lr: 0.01\n")
    with pytest.raises(ConfigError, match=re.escape(f"{train}:6: invalid YAML: key 'optimizer' given twice")):
        load_config(train)
    data.write_text("a: &base {x: 1}\nb:\n  <<: *base\n  y: 2\n")  # a merge key is no repetition
    assert load_yaml(data) == {"a": {"x": 1}, "b": {"x": 1, "y": 2}}


def test_a_misspelt_scheme_and_an_empty_source_path_are_named_in_the_config(tmp_path):
    """`scheme: polyalignn` was "polyalignn: no such file" (neither the key nor the shipped name said); a
    source's `path: ""` read the config's own folder as the source, silently."""
    from polyalign.data.prepare import load_context, load_data_config

    (tmp_path / "c.jsonl").write_text(jsonl([chat_row(CAMREST[0])]))
    config = write_config(tmp_path / "c.yaml", [{"name": "src", "format": "chat", "path": "c.jsonl"}])
    config.write_text(config.read_text().replace(str(SCHEME), "polyalignn"))
    with pytest.raises(ConfigError, match=re.escape(
            f"{config}: scheme: 'polyalignn' is neither a scheme shipped with polyalign (polyalign) nor a file "
            f"({tmp_path / 'polyalignn'} does not exist); did you mean 'polyalign'?")):
        load_context(config)
    empty = write_config(tmp_path / "e.yaml", [{"name": "src", "format": "chat", "path": ""}])
    with pytest.raises(ConfigError, match=re.escape(f"{empty}: sources[0] (src): path is empty")):
        load_data_config(empty)


def test_a_damaged_run_folder_is_one_line_naming_the_piece_and_the_command(demo_run, built_run, tmp_path, capsys):
    """A prepare manifest cut short, a records file edited or emptied since prepare, a build manifest cut short, a
    build missing its dataset info or a shard: `stats`, `build` and `show` name the file and the command
    that makes it again (they raised JSON, TFDS and array_record tracebacks, or blamed prepare)."""
    source, _, _ = demo_run
    built, _ = built_run
    run = tmp_path / "run"
    shutil.copytree(source / "data", run / "data")
    manifest = run / "data" / "manifest.json"
    text = manifest.read_text()

    def said(*command):
        code = main([*command, "--no-progress"] if command[0] != "show" else list(command))
        err = capsys.readouterr()
        assert "Traceback" not in err.err
        return code, err.err.strip().splitlines()[-1] if err.err.strip() else "", err.out

    manifest.write_text(text[:len(text) // 2])
    for command in (("stats", str(run)), ("build", str(run), "--tokenizer", str(built / "build"))):
        code, line, _ = said(*command)
        assert code == 2 and f"{manifest}: damaged, not JSON" in line and "run `polyalign prepare` again" in line
    manifest.write_text(text)
    # a hand edit that keeps the count of records: told by the digest prepare recorded
    val = run / "data" / "val.jsonl"
    rows = val.read_text().splitlines()
    edited = json.loads(rows[0])
    val.write_text("\n".join([json.dumps({**edited, "response": edited["response"] + " (edited)"}), *rows[1:]]) + "\n")
    code, _, out = said("stats", str(run))
    assert code == 0 and "note: the records files are not as prepare wrote them (val.jsonl changed); these " \
                         "statistics describe them as they are now" in out, out
    (run / "data" / "train.jsonl").write_text("")
    code, line, _ = said("build", str(run), "--tokenizer", str(built / "build"))
    assert code == 2 and "no records in train.jsonl (" in line and "the files changed since" in line, line
    code, _, out = said("stats", str(run))
    written = json.loads(text)["totals"]["by_split"]["train"]
    assert code == 0 and "note: the records files are not as prepare wrote them (train.jsonl, val.jsonl changed: " \
                         f"train 0 records (prepare wrote {written}))" in out, out
    # a build's pieces
    copy = tmp_path / "built"
    shutil.copytree(built / "build", copy / "build")
    (copy / "data").symlink_to(source / "data", target_is_directory=True)
    dataset = next((copy / "build").glob("*/*/dataset_info.json")).parent
    shard = next(dataset.glob("*-train.array_record-*"))
    shard.rename(shard.with_suffix(".gone"))
    code, line, _ = said("show", str(copy))
    assert code == 2 and f"{dataset}: the build is damaged or incomplete ({shard.name} missing); run `polyalign " \
                         f"build {copy} --overwrite`" in line, line
    (dataset / "dataset_info.json").unlink()
    code, line, _ = said("show", str(copy))
    assert code == 2 and "the build is damaged or incomplete (Could not read dataset info" in line, line
    build_manifest = copy / "build" / "manifest.json"
    build_manifest.write_text(build_manifest.read_text()[:100])
    code, line, _ = said("show", str(copy))
    assert code == 2 and f"{build_manifest}: damaged, not JSON" in line, line


def test_a_file_of_the_other_json_form_or_empty_says_what_it_is(tmp_path):
    """JSON Lines in a .json file, a JSON array (indented or on one line) in a .jsonl file, an empty .json
    file and sources written as a mapping: each says what it is and what to do (they read "Extra data",
    "Expecting value", "row must be a JSON object, got list", "missing sources")."""
    from polyalign.data.prepare import load_data_config

    rows = [chat_row(d) for d in CAMREST[:2]]
    for name, text, said in [
        ("rows.json", jsonl(rows), "rows.json:2: invalid JSON: Extra data (column 1); it reads as JSON Lines (one "
                                   "object a line): name it .jsonl"),
        ("rows.jsonl", json.dumps(rows, indent=2),
         "rows.jsonl:1: invalid JSON: Expecting value (column 2); the file looks like one JSON document written over "
         "many lines: name it .json"),
        ("oneline.jsonl", json.dumps(rows),
         "oneline.jsonl:1: a JSON array of 2 rows on one line, where JSON Lines holds one row a line; name the file "
         ".json"),
        ("empty.json", "\n", "empty.json: empty (no JSON in it)")]:
        with pytest.raises((PrepareError, InputError), match=re.escape(said)):
            run(tmp_path, "chat", name, text)
    config = tmp_path / "mapping.yaml"
    config.write_text("scheme: polyalign\nsources:\n  name: a\n  format: chat\n  path: c.jsonl\n")
    with pytest.raises(ConfigError, match=re.escape("sources as a list of {name, format, path} (it is a dict: write "
                                                    "each source as a `- name: ...` item)")):
        load_data_config(config)


def test_a_stopped_round_of_another_config_says_overwrite_trains_every_round(tmp_path):
    """A stopped round (OUT/round-2) of another config: --overwrite on the rounds command trains every round
    again, and the refusal says so (it said "start over there", as for one run)."""
    from polyalign.core.yaml_config import ConfigError
    from polyalign.train.ownership import claim

    config = {"method": "hdpo", "beta": 0.1, "train": {"steps": 4}}
    for name, said in (("round-2", "pass --overwrite to train every round again"),
                       ("single", "pass --overwrite to start over there")):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=re.escape(f"(beta: 0.1 there, 0.2 now); {said}, or give another --out")):
            claim(out, {**config, "beta": 0.2}, {})


def test_a_file_saved_in_a_windows_encoding_is_named_with_how_to_convert_it(demo_run, tmp_path):
    """A Windows "ANSI" export is GBK on a Chinese machine and Windows-1252 on a Western one; its lines are not
    UTF-8 and are refused (or quarantined) by line as before, now saying which encoding they read as and how
    to convert the file: for every real text of the demo data that either encoding can hold."""
    import codecs

    from polyalign.data.importers.reading import encoding_hint
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    records = read_records(run / "data" / "train.jsonl")
    checked = {"GBK": 0, "WINDOWS-1252": 0}
    for record in records[::7]:
        text = json.dumps({"messages": [{"role": "user", "content": record.question},
                                        {"role": "assistant", "content": record.response}]}, ensure_ascii=False)
        if text.isascii():
            continue
        codec, name = ("gbk", "GBK") if record.language == "zh" else ("cp1252", "WINDOWS-1252")
        try:
            raw = codecs.encode(text, codec)
        except UnicodeEncodeError:  # a character the encoding has not (an emoji, a rare ideograph)
            continue
        try:
            raw.decode("utf-8")
            continue  # bytes that are UTF-8 all the same (the sample's mojibake, "Ã®" saved back): read as such
        except UnicodeDecodeError:
            pass
        assert encoding_hint(raw).startswith(f"; read as {name}, "), (record.id, encoding_hint(raw))
        checked[name] += 1
    assert checked["GBK"] > 100 and checked["WINDOWS-1252"] > 10, checked
    # where a guess would be wrong, none: a UTF-8 line with a stray byte (converting the file would double-encode
    # its good lines), a Cyrillic Windows encoding; a Portuguese "ção" (a pair GBK also decodes) stays Western
    assert encoding_hint("Le café est très bon".encode() + b"\xff").startswith("; the rest of it is UTF-8")
    assert encoding_hint("Привет, как дела? Всё хорошо".encode("cp1251")) == ""
    assert encoding_hint("A informação sobre a situação".encode("cp1252")).startswith("; read as WINDOWS-1252, ")
    # as prepare says it, by line, with the quarantine
    from tests.chat_exports import crosswoz_dialogues, crosswoz_messages

    chinese = {"messages": crosswoz_messages(crosswoz_dialogues(1)[0][1], 2)}  # "你好，我想找家人均消费..."
    (tmp_path / "ansi.jsonl").write_bytes(json.dumps(chat_row(CAMREST[0]), ensure_ascii=False).encode() + b"\n"
                                          + json.dumps(chinese, ensure_ascii=False).encode("gbk") + b"\n")
    config = write_config(tmp_path / "c.yaml", [{"name": "s", "format": "chat", "path": "ansi.jsonl"}])
    said = (r"ansi.jsonl:2: undecodable bytes \(not UTF-8\): [^;]+; read as GBK, a Chinese Windows encoding, it says "
            r"\".*你好.*\": if that is the text, save the file as UTF-8 \(iconv -f GBK -t UTF-8 FILE > FILE.utf8\)")
    with pytest.raises((PrepareError, InputError), match=said):
        prepare(config, tmp_path / "run", progress=False)
