"""Users' own preference files (TRL, ShareGPT pairs) as pairs: labelled and bucketed as prepare labels
records, every bad row named or quarantined, and trained on by the preference methods."""

import json

import numpy as np
import pytest

from polyalign.cli import main
from polyalign.data.records import InputError, read_records
from tests.chat_exports import write_jsonl
from tests.conftest import DEMO_DATA, REPO
from tests.real_inputs import real_trl_rows


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err.strip()


def test_trl_rows_become_pairs_in_the_buckets_prepare_gave_their_records(demo_run, tmp_path, capsys):
    rows, sources = real_trl_rows(demo_run)
    rows[1] = {**rows[1], "prompt": rows[1]["prompt"][-1]["content"], "chosen": rows[1]["chosen"][0]["content"],
               "rejected": rows[1]["rejected"][0]["content"]}  # the string form (without the history)
    source = write_jsonl(tmp_path / "prefs.jsonl", rows)
    code, out, _ = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                       tmp_path / "pairs.jsonl")
    assert code == 0 and f"{len(rows)} pairs from {len(rows)} rows" in out
    from polyalign.pairs.make import read_pairs

    pairs = read_pairs(tmp_path / "pairs.jsonl")
    assert [p["bucket_id"] for p in pairs] == [r.bucket_id for r in sources]
    assert [p["chosen"] for p in pairs] == [r.response for r in sources]
    assert pairs[0]["record"]["history"] == sources[0].history and pairs[0]["record"]["question"].endswith(
        sources[0].question)
    assert all(0.5 <= p["weight"] <= 3.0 for p in pairs)
    manifest = json.loads((tmp_path / "pairs.manifest.json").read_text())
    assert manifest["summary"]["pairs"] == len(rows) and manifest["made_from"]["input"].startswith("sha256:")


def test_sharegpt_pairs_with_a_system_message_and_detected_language(demo_run, tmp_path, capsys):
    rows, sources = real_trl_rows(demo_run, n=6)
    sharegpt = [{"system": "You answer briefly.",
                 "conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                   for m in row["prompt"]],
                 "chosen": {"from": "gpt", "value": row["chosen"][0]["content"]},
                 "rejected": {"from": "gpt", "value": row["rejected"][0]["content"]}} for row in rows]
    source = tmp_path / "prefs.json"
    source.write_text(json.dumps(sharegpt, ensure_ascii=False), encoding="utf-8")
    code, out, _ = cli(capsys, "pairs", "import", "--format", "sharegpt-pairs", "--input", source,
                       "--out", tmp_path / "pairs.jsonl", "--family", "dialogue")
    assert code == 0 and "6 rows had a system message" in out
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert [p["language"] for p in pairs] == [r.language for r in sources]  # detected: no language declared
    assert {p["record"]["family"] for p in pairs} == {"dialogue"}


def test_a_system_message_after_the_question_is_rendered_after_it(demo_run, tmp_path, capsys):
    """A TRL prompt whose last user message is followed by a system message: imported, and rendered
    with that system message after the question, where it stood (as prepare and serve have it)."""
    from polyalign.data.records import Record
    from polyalign.tokens.chat import Message, record_messages

    rows, _ = real_trl_rows(demo_run, n=2)
    note = {"role": "system", "content": "Answer in one sentence."}
    rows = [{**row, "prompt": [*row["prompt"], note]} for row in rows]
    source = write_jsonl(tmp_path / "prefs.jsonl", rows)
    code, out, _ = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                       tmp_path / "pairs.jsonl")
    assert code == 0 and "2 pairs from 2 rows" in out
    for row, line in zip(rows, (tmp_path / "pairs.jsonl").read_text().splitlines()):
        record = Record.from_json(json.loads(line)["record"])
        messages = record_messages(record, "none", with_response=False)
        assert messages[-2:] == [Message("user", row["prompt"][-2]["content"]), Message("system", note["content"])]
    # an earlier reply that the note interrupted stays where it stood, as prepare keeps it (user, reply, note)
    interrupted = [{**row, "prompt": [*row["prompt"][:-1], *other["chosen"], note]}  # another person's reply
                   for row, other in zip(rows, rows[::-1])]
    code, out, _ = cli(capsys, "pairs", "import", "--format", "trl", "--input",
                       write_jsonl(tmp_path / "interrupted.jsonl", interrupted), "--out", tmp_path / "i.jsonl")
    assert code == 0 and "2 pairs from 2 rows" in out, out
    for line in (tmp_path / "i.jsonl").read_text().splitlines():
        record = Record.from_json(json.loads(line)["record"])
        roles = [m.role for m in record_messages(record, "none", with_response=False)]
        assert roles[-3:] == ["user", "assistant", "system"] and record.track == "multi"


def test_bad_rows_stop_the_import_or_are_quarantined_and_counted(demo_run, tmp_path, capsys):
    rows, _ = real_trl_rows(demo_run, n=5)
    bad = [rows[0], {"prompt": "hi", "chosen": "x"}, rows[1], {"prompt": [{"role": "assistant", "content": "a"}],
                                                               "chosen": "b", "rejected": "c"},
           {**rows[2], "rejected": rows[2]["chosen"]}, rows[3]]
    source = write_jsonl(tmp_path / "prefs.jsonl", bad)
    command = ["pairs", "import", "--format", "trl", "--input", source, "--out", tmp_path / "pairs.jsonl"]
    code, _, err = cli(capsys, *command)
    assert code == 2 and err.endswith(f"{source}:2: missing field 'rejected'")
    assert not (tmp_path / "pairs.jsonl").exists()
    code, out, _ = cli(capsys, *command, "--on-error", "quarantine")
    assert (code == 0 and "3 pairs from 6 rows" in out and "malformed 2" in out
            and "chosen_equals_rejected 1" in out)
    quarantined = [json.loads(line) for line in (tmp_path / "pairs.quarantine.jsonl").read_text().splitlines()]
    assert [q["location"].rsplit(":", 1)[1] for q in quarantined] == ["2", "4"]
    assert "the prompt must end with a user message" in quarantined[1]["problem"]


def _hh_text(messages) -> str:
    return "".join(f"\n\n{'Human' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in messages)


def _forms(row: dict) -> dict[str, tuple[str, dict]]:
    """One TRL row in each form users' preference files come in: (--format, the row)."""
    labels = {k: row[k] for k in ("language", "track", "family", "style")}
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]

    def parts(messages):
        return [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]

    forms = {
        "messages": ("trl", row),
        # UltraFeedback binarized: the prompt a string, each side the whole conversation
        "ultrafeedback": ("trl", {**labels, "prompt": prompt[-1]["content"] if len(prompt) == 1 else prompt,
                                  "chosen": prompt + chosen, "rejected": prompt + rejected}),
        "implicit": ("trl", {**labels, "chosen": prompt + chosen, "rejected": prompt + rejected}),
        "content parts": ("trl", {**labels, "prompt": parts(prompt), "chosen": parts(chosen),
                                  "rejected": parts(rejected)}),
    }
    if all(m["role"] != "system" for m in prompt):  # HH text has no system turn
        forms["hh"] = ("hh", {**labels, "chosen": _hh_text(prompt + chosen), "rejected": _hh_text(prompt + rejected)})
        forms["hh prompt"] = ("hh", {**labels, "prompt": _hh_text(prompt) + "\n\nAssistant:",
                                     "chosen": " " + chosen[0]["content"], "rejected": " " + rejected[0]["content"]})
    return forms


def test_every_form_of_a_preference_file_gives_the_same_pairs(demo_run, tmp_path, capsys):
    """Real rows written in each form users' files come in (TRL message lists, UltraFeedback's whole
    conversations under a string prompt, the implicit prompt, OpenAI content parts, Anthropic HH text with and
    without a prompt field) import to the same pairs: the same prompt, answers, labels and buckets."""
    from polyalign.pairs.make import read_pairs

    rows, _ = real_trl_rows(demo_run, n=24)
    assert sum(len(r["prompt"]) > 1 for r in rows) >= 3  # multi-turn prompts among them

    def seen(pair):
        record = pair["record"]
        return (pair["bucket_id"], pair["chosen"], pair["rejected"], record["question"], record["context"],
                [(t["role"], t["text"]) for t in record["history"]])

    imported = {}
    for name in _forms(rows[0]):
        chosen = [(i, _forms(row)[name]) for i, row in enumerate(rows) if name in _forms(row)]
        source = write_jsonl(tmp_path / f"{name}.jsonl", [form for _, (_, form) in chosen])
        code, out, err = cli(capsys, "pairs", "import", "--format", chosen[0][1][0], "--input", source, "--out",
                             tmp_path / f"{name}.pairs.jsonl")
        assert code == 0 and f"{len(chosen)} pairs from {len(chosen)} rows" in out, (name, err)
        imported[name] = {i: seen(p) for (i, _), p in zip(chosen, read_pairs(tmp_path / f"{name}.pairs.jsonl"),
                                                          strict=True)}
    assert len(imported["hh"]) >= 10
    for name, pairs in imported.items():
        assert pairs == {i: imported["messages"][i] for i in pairs}, name


def test_rejected_answers_that_other_pairs_choose_are_counted(demo_run, tmp_path, capsys):
    """A file whose rejected answers are other rows' chosen ones (real_trl_rows: the next record's answer in the
    bucket) pushes each answer up and down at once; a user's DPO on such a file fell to validation accuracy
    0.25. The import counts them and warns; rejected answers of their own draw no warning."""
    from polyalign.pairs.importing import rejected_chosen_elsewhere

    rows, _ = real_trl_rows(demo_run, n=24)
    borrowed = sum(1 for row in rows if any(row["rejected"] == other["chosen"] for other in rows))
    assert borrowed > 0
    source = write_jsonl(tmp_path / "borrowed.jsonl", rows)
    code, out, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out", tmp_path / "b.jsonl")
    assert code == 0 and (f"warning: {borrowed} of 24 pairs reject an answer another pair chooses, word for word"
                          in err), err
    own = [{**row, "rejected": [{"role": "assistant", "content": "我不知道。" if row["language"] == "zh" else
                                 "I do not know."}]} for row in rows]
    code, out, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", write_jsonl(tmp_path / "own.jsonl",
                                                                                              own),
                         "--out", tmp_path / "o.jsonl")
    assert code == 0 and "another pair chooses" not in err
    assert rejected_chosen_elsewhere([{"chosen": "a ", "rejected": "b"}, {"chosen": "b", "rejected": "c"}]) == 1


def test_rows_a_format_does_not_read_say_which_does_and_dropped_rows_are_listed(demo_run, tmp_path, capsys):
    """HH text given as --format trl names --format hh; a content part a text model cannot train on is a row
    problem; a region tag is its language (zh-CN is zh), another script is not (zh-Latn, left out); every row
    left out is listed with its line and reason; a row's own id is kept."""
    from polyalign.pairs.make import read_pairs

    rows, _ = real_trl_rows(demo_run, n=2000)  # every test bucket's: the English ones first, then the Chinese
    zh = next(i for i, r in enumerate(rows) if r["language"] == "zh")
    hh = _forms(rows[0])["hh"][1] if "hh" in _forms(rows[0]) else None
    image = {**rows[1], "prompt": [{"role": "user", "content": [
        {"type": "text", "text": rows[1]["prompt"][-1]["content"]},
        {"type": "image_url", "image_url": {"url": "file:///photo.png"}}]}]}
    with_prompt = next(_forms(row)["hh prompt"][1] for row in rows if "hh prompt" in _forms(row))
    # a prompt that quotes a chat log after its own question is no HH text: TRL's
    quoting = {**rows[5], "prompt": rows[5]["prompt"][-1]["content"] + _hh_text(rows[6]["prompt"] + rows[6]["chosen"])}
    lines = [hh or _forms(rows[2])["hh"][1], image, {**rows[zh], "language": "zh-CN", "id": 17},
             {**rows[zh], "language": "zh-Latn"}, {**rows[3], "rejected": [{"role": "assistant", "content": " "}]},
             {**rows[4], "id": "my-row-5"}, with_prompt, quoting]
    source = write_jsonl(tmp_path / "prefs.jsonl", lines)
    code, out, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                         tmp_path / "pairs.jsonl", "--on-error", "quarantine")
    assert code == 0 and "3 pairs from 8 rows" in out
    assert "dropped: malformed 3, language_not_in_scheme:zh-Latn 1, empty_side 1" in out
    assert "note: rows in a language outside the scheme were dropped (zh-Latn 1 declared)" in err
    quarantined = [json.loads(line) for line in (tmp_path / "pairs.quarantine.jsonl").read_text().splitlines()]
    assert [q["location"].rsplit(":", 1)[1] for q in quarantined] == ["1", "2", "7"]
    assert quarantined[0]["problem"].endswith("--format hh reads it")
    assert quarantined[2]["problem"].endswith("--format hh reads it")  # HH text in the prompt field too
    assert quarantined[1]["problem"] == ("prompt message 1 holds image_url content, which a text model cannot "
                                         "train on")
    listed = [json.loads(line) for line in (tmp_path / "pairs.dropped.jsonl").read_text().splitlines()]
    assert [(d["where"]["line"], d["reason"]) for d in listed] == [(4, "language_not_in_scheme:zh-Latn"),
                                                                  (5, "empty_side")]
    assert f"dropped rows, with their lines and reasons -> {tmp_path / 'pairs.dropped.jsonl'}" in out
    pairs = read_pairs(tmp_path / "pairs.jsonl")
    assert [p["language"] for p in pairs] == ["zh", rows[4]["language"], rows[5]["language"]]
    assert [p["record"]["meta"].get("source_id") for p in pairs] == ["17", "my-row-5", None]
    assert "\n\nHuman: " in pairs[2]["record"]["question"]  # quoted as the user wrote it
    assert pairs[0]["record"]["meta"]["source_labels"]["language"] == "zh-CN"  # the user's own label, as given


def test_preference_rows_written_a_little_off_say_what_is_off(demo_run, tmp_path, capsys):
    """HH turns after a single newline ("Human: ...\\nAssistant: ...") read "must share every turn"; a
    sharegpt-pairs answer written as a list of turns named "chosen 1"; both now say what is off."""
    rows, _ = real_trl_rows(demo_run, n=2)
    single = [{side: _hh_text(row["prompt"] + row[side]).strip().replace("\n\n", "\n")
               for side in ("chosen", "rejected")} for row in rows]
    code, _, _ = cli(capsys, "pairs", "import", "--format", "hh", "--input", write_jsonl(tmp_path / "hh.jsonl", single),
                     "--out", tmp_path / "hh-pairs.jsonl", "--on-error", "quarantine")
    quarantined = (tmp_path / "hh-pairs.quarantine.jsonl").read_text().splitlines()
    problems = [json.loads(line)["problem"] for line in quarantined]
    assert code == 2 and problems == ["'chosen' does not end with an Assistant turn: its 'Assistant:' follows a single "
                                      "newline, where HH text opens every turn with a blank line ('\\n\\nHuman: "
                                      "...\\n\\nAssistant: ...')"] * 2
    listed = [{"conversations": [{"from": "human", "value": row["prompt"][-1]["content"]}],
               "chosen": [{"from": "gpt", "value": row["chosen"][0]["content"]}],
               "rejected": {"from": "gpt", "value": row["rejected"][0]["content"]}} for row in rows]
    code, _, err = cli(capsys, "pairs", "import", "--format", "sharegpt-pairs", "--input",
                       write_jsonl(tmp_path / "sg.jsonl", listed), "--out", tmp_path / "sg-pairs.jsonl")
    assert code == 2 and err.strip().endswith(
        f"{tmp_path / 'sg.jsonl'}:1: 'chosen' must be one turn, {{\"from\": \"gpt\", \"value\": ...}}, got list")


def test_language_names_the_schemes_language_by_a_region_tag_too(demo_run, tmp_path, capsys):
    """`--language zh-CN` labels every row zh, as a row's own zh-CN does; `--language zh-Latn` is refused."""
    from polyalign.pairs.make import read_pairs

    rows, _ = real_trl_rows(demo_run, n=2000)
    chinese = [{k: v for k, v in r.items() if k != "language"} for r in rows if r["language"] == "zh"][:4]
    source = write_jsonl(tmp_path / "prefs.jsonl", chinese)
    code, out, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                         tmp_path / "pairs.jsonl", "--language", "zh-CN")
    assert code == 0 and "4 pairs from 4 rows" in out, err
    assert {p["language"] for p in read_pairs(tmp_path / "pairs.jsonl")} == {"zh"}
    code, _, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                       tmp_path / "tw.jsonl", "--language", "zh-Latn")
    assert code == 2 and "--language zh-Latn is not one of the scheme's: en, zh" in err


def test_show_reads_a_pairs_file_as_the_preference_run_tokenises_it(demo_run, demo_tokenizer, tmp_path, capsys):
    """`polyalign show PAIRS --checkpoint INIT`: each side decoded from the ids training would read (tokenise_pairs
    with the init's tokenizer and template, the run's max_length, truncation and profile), the trained tokens
    marked, what the cut took said per side; --id picks pairs; a run's options and a pair's are not mixed."""
    from polyalign.inputs.pair_rows import SIDES, tokenise_pairs
    from polyalign.pairs.make import read_pairs
    from polyalign.tokens.chat import get_template
    from polyalign.tokens.tokenizer import load_tokenizer
    from tests.real_inputs import init_checkpoint_and_pair_files

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=6, val=1)
    pairs_file, init = tmp_path / "train.jsonl", tmp_path / "init"
    pairs = read_pairs(pairs_file)
    tokenizer = load_tokenizer(init)
    code, out, _ = cli(capsys, "show", pairs_file, "--checkpoint", init, "--max-length", 64, "--truncation", "turns",
                       "--id", pairs[4]["id"], "--id", pairs[1]["id"], "--ids")
    assert code == 0
    blocks = out.strip().split("\n\n== ")
    assert [b.removeprefix("== ").split(":")[0] for b in blocks] == ["pair 5 of 6", "pair 2 of 6"]
    expected = tokenise_pairs([pairs[4], pairs[1]], tokenizer, get_template("polyalign", tokenizer), "context", 64,
                              sorted({pairs[4]["bucket_id"], pairs[1]["bucket_id"]}), "turns")
    for block, example in zip(blocks, expected):
        lines = block.splitlines()
        for side in SIDES:
            ids = lines[lines.index(next(line for line in lines if line.startswith(f"-- {side} ("))) + 2:]
            shown = next(line for line in ids if line.startswith("ids: "))
            assert shown == "ids: " + " ".join(map(str, example[f"{side}_ids"].tolist()))
            trained = next(line for line in ids if line.startswith("trained: "))
            assert trained == "trained: " + "".join("1" if m else "0" for m in example[f"{side}_mask"].tolist())
            cut = [line for line in lines if line.startswith(f"   {side} cut to max_length 64 by truncation turns: ")]
            assert len(cut) == (side in example.get("cuts", {}))
        assert example.get("cuts"), "64 tokens cut both pairs"
        assert block.count("⟦") >= 2  # each side's answer marked
    # at the shortest length, every side whose answer keeps no token says so, not "cut short" (read as trained
    # in part), and every side said cut short keeps some
    code, out, _ = cli(capsys, "show", pairs_file, "--checkpoint", init, "--max-length", 8, "--limit", 6)
    assert code == 0
    sides = {}
    for block in out.strip().split("\n\n== "):
        lines = block.splitlines()
        for side in SIDES:
            cut = next(line for line in lines if line.startswith(f"   {side} cut to max_length 8"))
            trained = int(next(line for line in lines if line.startswith(f"-- {side} (")).split(", ")[1].split()[0])
            sides[block.split(":")[0], side] = trained
            assert ("its reply cut away whole: no token left to train on" in cut) == (trained == 0), cut
            assert "its reply cut short" not in cut or trained > 0, cut
    assert len(sides) == 12, sides
    from polyalign.inputs.show import cut_phrases  # with this tokenizer every side keeps a token or two: said alike
    from polyalign.tokens.chat import Encoded

    gone = Encoded(np.arange(8), np.zeros(8, bool), truncated=True, reply_cut=True)
    assert cut_phrases(gone, 2, "left") == [
        "its reply cut away whole: no token left to train on (a longer max length keeps it)"]
    kept = Encoded(np.arange(8), np.arange(8) > 5, truncated=True, reply_cut=True)
    assert cut_phrases(kept, 2, "left") == ["its reply cut short (trained without its end-of-turn token)"]
    for args, said in ((["show", pairs_file], "give --checkpoint INIT"),
                       (["show", pairs_file, "--checkpoint", init, "--split", "val"], "--split is a run's"),
                       (["show", tmp_path, "--truncation", "turns"], "--truncation: for a pairs file"),
                       (["show", pairs_file, "--checkpoint", init, "--id", "nope"], "no pair 'nope'"),
                       (["show", tmp_path / "nope.jsonl", "--checkpoint", init], "no such run folder or pairs file"),
                       (["show", pairs_file, "--checkpoint", tmp_path / "nope"], "nope: no such checkpoint folder")):
        code = main([str(a) for a in args])
        err = capsys.readouterr().err
        # one line: argparse's usage block is for options it cannot parse
        assert code == 2 and said in err and len(err.splitlines()) == 1, (args, err)


def test_held_out_pairs_are_records_to_generate_from_and_evaluate_on(demo_run, tmp_path, capsys):
    """A pairs file where records are read: each pair's record, once however many pairs hold it (its prompt,
    the chosen answer as the reference), so imported preference data is evaluated as a prepared split is:
    here its rejected answers as the predictions."""
    from polyalign.pairs.make import read_pairs

    rows, _ = real_trl_rows(demo_run, n=30)
    source = write_jsonl(tmp_path / "prefs.jsonl", rows)
    code, _, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                       tmp_path / "pairs.jsonl")
    assert code == 0, err
    pairs = read_pairs(tmp_path / "pairs.jsonl")
    records = read_records(tmp_path / "pairs.jsonl")
    assert [r.id for r in records] == [p["id"] for p in pairs]  # ids are the records', one pair each here
    assert [r.response for r in records] == [p["chosen"] for p in pairs]
    twice = tmp_path / "twice.jsonl"
    twice.write_text((tmp_path / "pairs.jsonl").read_text() * 2)
    assert [r.id for r in read_records(twice)] == [r.id for r in records]
    predictions = write_jsonl(tmp_path / "rejected.jsonl", [{"id": p["id"], "prediction": p["rejected"]}
                                                            for p in pairs])
    code, out, err = cli(capsys, "evaluate", "--records", tmp_path / "pairs.jsonl", "--predictions", predictions,
                         "--out", tmp_path / "eval", "--no-progress", "--no-diversity", "--no-detectability")
    assert code == 0, err
    alignment = json.loads((tmp_path / "eval" / "metrics.json").read_text())["alignment"]
    assert alignment["records"] == alignment["evaluated"] == len(pairs) and alignment["missing"] == 0


def test_a_trl_file_given_to_training_says_to_import_it(demo_run, tmp_path):
    from polyalign.pairs.make import read_pairs

    rows, _ = real_trl_rows(demo_run, n=2)
    source = write_jsonl(tmp_path / "prefs.jsonl", rows)
    with pytest.raises(InputError, match=r"prefs.jsonl:1: not a polyalign pair \(no string field 'id'\); run "
                                         r"`polyalign pairs import --format trl"):
        read_pairs(source)


@pytest.mark.slow
def test_imported_trl_pairs_train_with_dpo(demo_run, demo_tokenizer, tmp_path, capsys):
    from polyalign.train.metrics import read_metrics
    from tests.real_inputs import init_checkpoint_and_pair_files

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=1, val=1)  # the init checkpoint
    rows, _ = real_trl_rows(demo_run, n=12)
    for name, part in (("train", rows[:8]), ("val", rows[8:])):
        source = write_jsonl(tmp_path / f"{name}_trl.jsonl", part)
        assert cli(capsys, "pairs", "import", "--format", "trl", "--input", source,
                   "--out", tmp_path / f"{name}_pairs.jsonl")[0] == 0
    out = tmp_path / "out"
    code, printed, _ = cli(capsys, "train", "dpo", "--config", REPO / "configs" / "hdpo_demo.yaml", "--out", out,
                           "--no-progress", f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train_pairs.jsonl'}",
                           f"val_pairs={tmp_path / 'val_pairs.jsonl'}", "data.max_length=128", "train.steps=2",
                           "train.global_batch=4", "train.eval_every=2", "train.checkpoint_every=2",
                           f"data.dir={demo_run[0]}", "drift_prompts=0")
    assert code == 0 and "dpo: 2 steps on 8 pairs" in printed
    steps = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-4)  # policy = reference at the first step
    # imported pairs carry no critic scores: the critic's terms are not logged as zeros, the rest is
    logged = [r for r in read_metrics(out) if "loss" in r or "val_pairs" in r]
    assert all("sft_anchor" in r or "val_sft_anchor" in r for r in logged) and logged[-1]["val_pairs"] == 4
    assert not any(key.endswith(("dist_reg", "dist_gap", "dist_reach")) for r in logged for key in r)


def test_prompts_for_an_external_engine_round_trip_through_pairs(demo_run, demo_tokenizer, tmp_path, capsys):
    """`polyalign prompts` writes what `generate` would render; an engine's answers joined by id make
    pairs as polyalign's own predictions do."""
    from polyalign.generate.selection import select_records
    from polyalign.tokens.chat import cut_prompt, get_template, record_messages

    run, _, _ = demo_run
    checkpoint = demo_tokenizer[0].path.parent  # a tokenizer folder is enough: no weights are read
    prompts = tmp_path / "prompts.jsonl"
    code, out, _ = cli(capsys, "prompts", "--records", run / "data" / "val.jsonl", "--checkpoint", checkpoint,
                       "--out", prompts, "--limit", 10)
    assert code == 0 and ("10 prompts rendered with the polyalign template, profile context, system messages keep; "
                          "stop generating at <|im_end|>") in out
    rows = [json.loads(line) for line in prompts.read_text(encoding="utf-8").splitlines()]
    records = read_records(run / "data" / "val.jsonl")[:10]
    template = get_template("polyalign")
    for row, record in zip(rows, records):
        # cut as generate cuts at its default budget (--max-prompt-tokens 512)
        messages = record_messages(record, "context", with_response=False)
        cut = cut_prompt(template, demo_tokenizer[0], messages, 512)
        assert row["id"] == record.id and row["messages"][0]["role"] == "system"
        assert row["messages"] == [{"role": m.role, "content": m.content} for m in cut.messages]
        assert row["prompt"] == template.render(cut.messages, add_generation_prompt=True)
        assert row["prompt"].endswith("<|im_start|>assistant\n")
        assert row["prompt_token_ids"] == cut.ids.tolist() and len(cut.ids) <= 512
    # --sample takes the records `generate --sample` answers; asking for more than there are is said
    val, sampled = run / "data" / "val.jsonl", tmp_path / "sampled.jsonl"
    code, out, _ = cli(capsys, "prompts", "--records", val, "--checkpoint", checkpoint, "--out", sampled,
                       "--sample", 7, "--seed", 3)
    every = read_records(val)
    chosen = select_records(every, val, sample=7, seed=3)[0]
    assert code == 0 and [json.loads(line)["id"] for line in sampled.read_text().splitlines()] == [r.id for r in chosen]
    code, out, _ = cli(capsys, "prompts", "--records", val, "--checkpoint", checkpoint, "--out", tmp_path / "all.jsonl",
                       "--limit", 100000)
    assert code == 0 and f"--limit 100000: {val} holds {len(every)} records; all are taken" in out
    # An engine's answers (here: the next record's human answer) come back as {id, prediction}.
    answers = [{"id": r["id"], "prediction": records[(i + 1) % 10].response} for i, r in enumerate(rows)]
    predictions = write_jsonl(tmp_path / "engine.jsonl", answers)
    code, out, _ = cli(capsys, "pairs", "--records", run / "data" / "val.jsonl", "--predictions", predictions,
                       "--out", tmp_path / "pairs.jsonl")
    assert code == 0 and out.startswith("10 pairs from 10 predictions")


def test_answers_for_every_bucket_make_pairs_for_every_bucket_and_a_mix_says_which_it_misses(demo_run, demo_tokenizer,
                                                                                             tmp_path, capsys):
    """Pairs from the first records (the data's mix) reach few buckets, and `pairs` says which get fewer
    than FEW_BUCKET_PAIRS and how to answer them all; `prompts --per-bucket` (generate's selection)
    reaches every bucket."""
    from collections import Counter

    from polyalign.generate.selection import select_records
    from polyalign.pairs.make import FEW_BUCKET_PAIRS

    run, _, _ = demo_run
    checkpoint, val = demo_tokenizer[0].path.parent, run / "data" / "val.jsonl"
    every = read_records(val)
    held = Counter(r.bucket_id for r in every)

    def pairs_from(selected, name):
        answers = [{"id": r.id, "prediction": selected[(i + 1) % len(selected)].response + " ..."}
                   for i, r in enumerate(selected)]
        predictions = write_jsonl(tmp_path / f"{name}.jsonl", answers)
        code, out, err = cli(capsys, "pairs", "--records", val, "--predictions", predictions, "--out",
                             tmp_path / f"{name}_pairs.jsonl")
        # val.jsonl without --training-pairs: its own-counts weighting is noted first; the bucket notes follow
        held_out, _, rest = err.partition("\n")
        assert held_out.startswith(f"note: {val} looks like held-out records"), err
        return code, out, rest

    code, out, err = pairs_from(every[:20], "first")
    paired = Counter(r.bucket_id for r in every[:20])
    few = {b: paired[b] for b in held if paired[b] < FEW_BUCKET_PAIRS}
    none = sum(1 for b in few if paired[b] == 0)
    assert code == 0 and out.startswith("20 pairs from 20 predictions")
    assert err.strip().startswith(f"note: {len(few)} of {len(held)} buckets of {val} get fewer than {FEW_BUCKET_PAIRS} "
                                  f"pairs, {none} of them none (fewest: ")
    assert err.strip().endswith(f"`polyalign generate --per-bucket N` answers N records of every bucket of {val}")
    assert json.loads((tmp_path / "first_pairs.manifest.json").read_text())["summary"]["few_pairs"] == \
        {b: [paired[b], held[b], paired[b]] for b in sorted(few)}  # [pairs, records, answered records]

    prompts = tmp_path / "per_bucket_prompts.jsonl"
    code, _, _ = cli(capsys, "prompts", "--records", val, "--checkpoint", checkpoint, "--out", prompts,
                     "--per-bucket", FEW_BUCKET_PAIRS, "--seed", 3)
    chosen = select_records(every, val, per_bucket=FEW_BUCKET_PAIRS, seed=3)[0]
    assert code == 0 and [json.loads(line)["id"] for line in prompts.read_text().splitlines()] == [r.id for r in chosen]
    code, out, err = pairs_from(chosen, "per_bucket")
    pairs = [json.loads(line) for line in (tmp_path / "per_bucket_pairs.jsonl").read_text().splitlines()]
    paired = Counter(p["bucket_id"] for p in pairs)
    assert code == 0 and out.startswith(f"{len(pairs)} pairs from {len(chosen)} predictions")
    assert set(paired) == set(held)  # every bucket reached
    few = {b for b in held if paired[b] < FEW_BUCKET_PAIRS}
    # only buckets short of records (or of answerable ones: an empty human answer pairs with nothing) fall short
    assert all(paired[b] == min(held[b], FEW_BUCKET_PAIRS) or paired[b] < min(held[b], FEW_BUCKET_PAIRS) and
               any(not r.response.strip() for r in chosen if r.bucket_id == b) for b in held)
    if few:
        assert err.strip().startswith(f"note: {len(few)} of {len(held)} buckets of {val} get fewer than "
                                      f"{FEW_BUCKET_PAIRS} pairs, 0 of them none")
    else:
        assert "note:" not in err
    # a file of small buckets, every record answered (one answer empty, so no pair): answering more cannot
    # help, and the note says so instead of pointing to --per-bucket
    small = [r for r in every if held[r.bucket_id] < FEW_BUCKET_PAIRS and r.response.strip()][:6]
    source = write_jsonl(tmp_path / "small.jsonl", [r.to_json() for r in small])
    answers = write_jsonl(tmp_path / "small_answers.jsonl", [{"id": r.id, "prediction": f"...{r.response}" if i else ""}
                                                              for i, r in enumerate(small)])
    code, out, err = cli(capsys, "pairs", "--records", source, "--predictions", answers, "--out",
                         tmp_path / "small_pairs.jsonl")
    assert code == 0 and out.startswith(f"{len(small) - 1} pairs from {len(small)} predictions; dropped: empty_side 1")
    assert err.strip().endswith("every record of those buckets was answered already (an empty answer, or the "
                                "person's own, makes no pair)")


def test_prompts_under_a_token_budget_hold_generates_ids_and_whole_turns_that_fit(demo_run, demo_tokenizer,
                                                                                  tmp_path, capsys):
    """`prompts --max-prompt-tokens N`: for every record, prompt_token_ids are the ids `generate` feeds
    (cut_prompt), and messages are the conversation less its oldest whole turns, as few as make it fit
    (the profile's system message kept, a user turn first, the last question kept): the ids are theirs, but
    for messages still over the budget with the last question alone, whose ids keep their end."""
    from polyalign.tokens.chat import Message, cut_prompt, get_template, record_messages

    run, _, _ = demo_run
    checkpoint = demo_tokenizer[0].path.parent
    records = [r for r in read_records(run / "data" / "val.jsonl") if len(r.history) >= 4][:40]
    source = write_jsonl(tmp_path / "long.jsonl", [r.to_json() for r in records])
    budget, prompts = 96, tmp_path / "prompts.jsonl"
    code, out, _ = cli(capsys, "prompts", "--records", source, "--checkpoint", checkpoint, "--out", prompts,
                       "--max-prompt-tokens", budget)
    rows = [json.loads(line) for line in prompts.read_text(encoding="utf-8").splitlines()]
    template, tokenizer = get_template("polyalign"), demo_tokenizer[0]

    def length(messages):
        return len(cut_prompt(template, tokenizer, messages, None).ids)

    cut = dropped = over = 0
    for row, record in zip(rows, records, strict=True):
        whole = record_messages(record, "context", with_response=False)
        assert row["prompt_token_ids"] == cut_prompt(template, tokenizer, whole, budget).ids.tolist()
        sent = [Message(m["role"], m["content"]) for m in row["messages"]]
        assert row["prompt"] == template.render(sent, add_generation_prompt=True)
        if length(whole) <= budget:
            assert sent == whole and len(row["prompt_token_ids"]) == length(whole)
            continue
        cut += 1
        if sent[0] != whole[0]:  # its system message, over half the budget, went whole; the turns fitted again
            assert sent == whole[len(whole) - len(sent):] and sent[0].role == "user"
            rest = cut_prompt(template, tokenizer, sent, None).ids.tolist()
            assert row["prompt_token_ids"] == rest[max(len(rest) - budget, 0):]  # no system turn of its own here
            earlier = [i for i, m in enumerate(whole[:len(whole) - len(sent)]) if m.role == "user"]
            if len(rest) > budget:
                assert [m.role for m in sent].count("user") == 1
            else:  # as few turns dropped as fit without it
                assert not earlier or length(whole[earlier[-1]:]) > budget
            # counted as losing whole turns only where it did (the system message may have gone alone)
            dropped, over = dropped + (len(sent) < len(whole) - 1), over + (len(rest) > budget)
            assert row.get("messages_over_budget", False) == (len(rest) > budget)
            continue
        assert sent[0].role == "system" and whole[len(whole) - len(sent) + 1:] == sent[1:]
        assert sent[1].role == "user" and sent[-1] == whole[-1]
        dropped += sent != whole
        if length(sent) > budget:  # only the last question (and what follows it) is left: the ids keep their end
            over += 1
            assert [m.role for m in sent[1:]].count("user") == 1 and len(row["prompt_token_ids"]) == budget
            assert row["messages_over_budget"] is True
        else:  # the kept turns' ids, whole; as few turns dropped as fit: the one user turn before them would not
            assert row["prompt_token_ids"] == cut_prompt(template, tokenizer, sent, None).ids.tolist()
            assert "messages_over_budget" not in row
            earlier = max(i for i, m in enumerate(whole[:len(whole) - len(sent) + 1]) if m.role == "user" and i > 0)
            assert length([whole[0], *whole[earlier:]]) > budget
    assert cut > 10 and dropped > 5 and over > 0, (cut, dropped, over)
    summary = json.loads((tmp_path / "prompts.manifest.json").read_text())["summary"]
    lost = summary["prompts_cut_system_lost"]
    assert code == 0 and (f"{cut} of {len(records)} prompts were longer than --max-prompt-tokens {budget}: "
                          f"{dropped} rows' messages and prompt_token_ids (as generate cuts them) lost their oldest "
                          "whole turns"
                          + (f"; {over} still over with only the last question left: their messages stay over it and "
                             "their prompt_token_ids keep its end" if over else "")
                          + (f" ({dropped + over - cut} of them after losing their oldest turns)"
                             if over and dropped + over > cut else "")
                          + (f"; {lost} of those lost their opening system message too" if lost else "")) in out
    assert (summary["prompts_cut"], summary["messages_turns_dropped"], summary["messages_over_budget"]) == (
        cut, dropped, over)
    # one record: counts, not flags (an empty Counter's first update kept True: "True of 1 prompts were longer")
    first = next(r for r in records if length(record_messages(r, "context", with_response=False)) > budget)
    code, out, _ = cli(capsys, "prompts", "--records", write_jsonl(tmp_path / "one.jsonl", [first.to_json()]),
                       "--checkpoint", checkpoint, "--out", tmp_path / "one_prompts.jsonl",
                       "--max-prompt-tokens", budget)
    one = json.loads((tmp_path / "one_prompts.manifest.json").read_text())["summary"]
    counts = ("prompts_cut", "prompts_cut_system_lost", "messages_turns_dropped", "messages_over_budget")
    assert code == 0 and one["prompts_cut"] == 1 and all(type(one[key]) is int for key in counts), one
    assert "1 of 1 prompts were longer than --max-prompt-tokens" in out and "True" not in out
    assert all("max_tokens" not in row for row in rows)  # no answer budget asked for: none written
    # each answer's budget as generate gives it: one number, or its bucket's from the train answers (auto)
    from polyalign.generate.budgets import bucket_budgets

    code, out, _ = cli(capsys, "prompts", "--records", source, "--checkpoint", checkpoint, "--out",
                       tmp_path / "fixed.jsonl", "--max-new-tokens", 64)
    assert code == 0 and {json.loads(line)["max_tokens"] for line in (tmp_path / "fixed.jsonl").open()} == {64}
    train = run / "data" / "train.jsonl"
    code, out, _ = cli(capsys, "prompts", "--records", source, "--checkpoint", checkpoint, "--out",
                       tmp_path / "auto.jsonl", "--max-new-tokens", "auto", "--budget-records", train)
    budgets = bucket_budgets(read_records(train), tokenizer.encode)
    auto = [json.loads(line) for line in (tmp_path / "auto.jsonl").open()]
    assert code == 0 and [row["max_tokens"] for row in auto] == [budgets(r.bucket_id) for r in records]
    assert len({row["max_tokens"] for row in auto}) > 1 and "max_tokens by bucket (" in out
    code, _, err = cli(capsys, "prompts", "--records", source, "--checkpoint", checkpoint, "--out",
                       tmp_path / "x.jsonl", "--budget-margin", 2)
    assert code == 2 and "--budget-margin: budgets by bucket, which only --max-new-tokens auto sets" in err


def test_val_fraction_holds_out_whole_prompts_with_distinct_ids(demo_run, tmp_path, capsys):
    """`--val-fraction`: about that share of the pairs goes to the validation file, every pair of one
    prompt on the same side, ids distinct from the training pairs'; the same seed gives the same split."""
    from polyalign.pairs.make import prompt_key, read_pairs

    rows, _ = real_trl_rows(demo_run, n=40)
    # a second pair for ten prompts (another rejected answer): the two must not straddle the split
    rows += [{**row, "rejected": [{"role": "assistant", "content": other["chosen"][0]["content"]}]}
             for row, other in zip(rows[:10], rows[10:20])]
    source = write_jsonl(tmp_path / "prefs.jsonl", rows)

    def run(seed, out):
        code, printed, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                                 out / "train.jsonl", "--val-fraction", "0.25", "--val-out", out / "val.jsonl",
                                 "--seed", seed)
        assert code == 0, err
        return printed, read_pairs(out / "train.jsonl"), read_pairs(out / "val.jsonl")

    printed, train, val = run(3, tmp_path / "a")
    assert len(train) + len(val) == 50 and 10 <= len(val) <= 15
    assert (f"{len(train)} training + {len(val)} validation pairs from 50 rows" in printed
            and f"{len(val)} validation pairs" in printed)
    assert not {p["id"] for p in train} & {p["id"] for p in val}
    assert len({p["id"] for p in val}) == len(val) and all("-val-" in p["id"] for p in val)
    assert all(p["record"]["split"] == "val" and p["record"]["id"] == p["id"] for p in val)
    assert not {prompt_key(p) for p in train} & {prompt_key(p) for p in val}
    assert all(0.5 <= p["weight"] <= 3.0 for p in train + val)
    _, again, again_val = run(3, tmp_path / "b")
    assert [p["id"] for p in again_val] == [p["id"] for p in val] and len(again) == len(train)
    _, _, other_val = run(4, tmp_path / "c")
    assert {p["id"] for p in other_val} != {p["id"] for p in val}
    # without --val-out the held-out pairs lie beside --out, and training that forgets them is told where
    code, _, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                       tmp_path / "d" / "train.jsonl", "--val-fraction", "0.25")
    assert code == 0 and (tmp_path / "d" / "train.val.jsonl").is_file(), err
    (tmp_path / "sft").mkdir()  # the init is looked at before the pairs
    code, _, err = cli(capsys, "train", "dpo", "--out", tmp_path / "dpo", f"init={tmp_path / 'sft'}",
                       f"pairs={tmp_path / 'd' / 'train.jsonl'}")
    assert code == 2 and f"is there: val_pairs={tmp_path / 'd' / 'train.val.jsonl'}" in err
    assert not (tmp_path / "dpo").exists()  # a run refused before it starts leaves no folder behind
    manifest = json.loads((tmp_path / "a" / "val.manifest.json").read_text())
    assert manifest["settings"]["val_fraction"] == 0.25 and manifest["summary"]["val_pairs"] == len(val)
    # each file's manifest counts its own pairs and buckets
    assert manifest["summary"]["pairs"] == len(val) == sum(manifest["summary"]["buckets"].values())
    train_manifest = json.loads((tmp_path / "a" / "train.manifest.json").read_text())
    assert train_manifest["summary"]["pairs"] == len(train) == sum(train_manifest["summary"]["buckets"].values())
    for bad in ("0", "1", "-0.1"):
        code, _, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                           tmp_path / "d.jsonl", "--val-fraction", bad)
        assert code == 2 and "--val-fraction must be in (0, 1)" in err and "\n" not in err
    code, _, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out", tmp_path / "e.jsonl",
                       "--val-fraction", "0.2", "--val-out", tmp_path / "e.jsonl")
    assert code == 2 and f"--val-out {tmp_path / 'e.jsonl'} is the command's own --out" in err, err
    assert not list(tmp_path.glob(".e.*")) and not (tmp_path / "e.jsonl").exists()  # nothing started, nothing left


def test_a_declared_language_the_text_contradicts_is_said_on_the_console(demo_run, tmp_path, capsys):
    """`--language en` over a file holding Chinese rows buckets them as English, as asked, and says so
    where the user reads, not only in the summary."""
    rows, sources = real_trl_rows(demo_run, n=2000)
    english = [i for i, record in enumerate(sources) if record.language == "en"][:10]
    chinese = [i for i, record in enumerate(sources) if record.language == "zh"][:10]
    assert len(english) == len(chinese) == 10
    rows = [rows[i] for i in english + chinese]
    unlabelled = [{k: v for k, v in row.items() if k != "language"} for row in rows]
    source = write_jsonl(tmp_path / "prefs.jsonl", unlabelled)
    code, _, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out", tmp_path / "p.jsonl",
                       "--language", "en")
    assert code == 0
    assert f"warning: {source}: {len(chinese)} pairs en declared, han script; they are bucketed as declared" in err
    # the Chinese rows' chosen answers read as Windows-1252 on the way (a spreadsheet round trip): said, and kept
    broken = [{**row, "chosen": [{**m, "content": m["content"].encode("utf-8").decode("cp1252", errors="replace")}
                                 for m in row["chosen"]]} if i >= 10 else row for i, row in enumerate(rows)]
    broken_file = write_jsonl(tmp_path / "b.jsonl", broken)
    code, _, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", broken_file, "--out", tmp_path / "o")
    assert code == 0 and f"b.jsonl: {len(chinese)} pairs held mojibake in the prompt or the chosen answer" in err


def test_an_export_given_to_training_names_the_format_that_imports_it(demo_run, tmp_path, capsys):
    """A ShareGPT preference export given as pairs= says `--format sharegpt-pairs` (its rows have chosen and
    rejected too, as TRL's), and the pairs file is read before a missing val_pairs is asked for."""
    rows, _ = real_trl_rows(demo_run, n=2)
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": "human", "value": m["content"]} for m in row["prompt"]],
         "chosen": {"from": "gpt", "value": row["chosen"][0]["content"]},
         "rejected": {"from": "gpt", "value": row["rejected"][0]["content"]}} for row in rows])
    trl = write_jsonl(tmp_path / "trl.jsonl", rows)
    for source, form in ((sharegpt, "sharegpt-pairs"), (trl, "trl")):
        assert main(["train", "dpo", "--out", str(tmp_path / "out"), f"init={tmp_path}", f"pairs={source}"]) == 2
        err = capsys.readouterr().err
        assert err.rstrip().endswith(f"{source}:1: not a polyalign pair (no string field 'id'); run `polyalign pairs "
                                     f"import --format {form} --input {source} --out PAIRS` first"), err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value, known", [("--language", "fr", "en, zh"), ("--family", "chat",
                                                                                 "assistant, qa, dialogue")])
def test_a_label_outside_the_scheme_is_refused_before_reading(demo_run, tmp_path, capsys, flag, value, known):
    rows, _ = real_trl_rows(demo_run, n=2)
    source = write_jsonl(tmp_path / "prefs.jsonl", rows)
    code, out, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out",
                         tmp_path / "p.jsonl", flag, value)
    assert code == 2 and f"error: {flag} {value} is not one of the scheme's: {known} (" in err and out == ""
    assert not (tmp_path / "p.jsonl").exists()


def test_conversations_left_to_the_default_family_are_said(demo_run, tmp_path, capsys):
    """Multi-turn rows that name no family get --family's default, assistant: the import says how many, and
    nothing once --family is given."""
    rows, sources = real_trl_rows(demo_run)
    unlabelled = [{k: v for k, v in row.items() if k not in ("family", "style", "track")} for row in rows]
    source = write_jsonl(tmp_path / "prefs.jsonl", unlabelled)
    multi = sum(len(row["prompt"]) > 1 for row in rows)
    assert 0 < multi < len(rows)
    _, out, _ = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out", tmp_path / "a.jsonl")
    assert (f"note: {multi} multi-turn pairs are labelled family assistant, --family's default; conversations "
            "between people (KdConv, MultiWOZ-like dialogues) belong in --family dialogue") in out
    _, out, _ = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out", tmp_path / "b.jsonl",
                    "--family", "dialogue")
    assert "--family's default" not in out


def test_an_import_that_keeps_no_pair_fails_and_an_empty_prompt_is_dropped(demo_run, tmp_path, capsys):
    """An empty or blank preference file wrote an empty pairs file and exit 0 ("0 pairs from 0
    rows"), and a row with an empty prompt was kept, where prepare drops a reply to nothing asked."""
    rows, _ = real_trl_rows(demo_run, n=6)
    (tmp_path / "empty.jsonl").write_text("\n \n")
    code, _, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", tmp_path / "empty.jsonl",
                       "--out", tmp_path / "out" / "empty.jsonl")
    assert code == 2 and err.endswith(f"{tmp_path / 'empty.jsonl'}: holds no rows; nothing written to "
                                      f"{tmp_path / 'out' / 'empty.jsonl'}")
    assert not (tmp_path / "out" / "empty.jsonl").exists()
    asked_nothing = {**rows[0], "prompt": ""}
    source = write_jsonl(tmp_path / "prefs.jsonl", [asked_nothing, *rows[1:]])
    code, out, _ = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out", tmp_path / "p.jsonl")
    assert code == 0 and f"{len(rows) - 1} pairs from {len(rows)} rows" in out and "empty_question 1" in out
    only = write_jsonl(tmp_path / "only.jsonl", [asked_nothing])
    code, _, err = cli(capsys, "pairs", "import", "--format", "trl", "--input", only, "--out", tmp_path / "o.jsonl")
    assert code == 2 and err.endswith(f"{only}: no pair kept of 1 row (empty_question 1); nothing written to "
                                      f"{tmp_path / 'o.jsonl'}")


def test_the_few_pairs_note_names_the_per_bucket_the_predictions_were_made_with(capsys):
    """Predictions `generate --per-bucket 4` made: the note says 4 and asks for a larger one, not for N."""
    from polyalign.cli import _note_few_bucket_pairs

    summary = {"few_pairs": {"en|single|qa|short": [2, 30, 4]}, "buckets": 12, "few_below": 8}
    _note_few_bucket_pairs(summary, "val.jsonl", per_bucket=4)
    assert capsys.readouterr().err.strip().endswith(
        "these predictions answered 4 records a bucket (`generate --per-bucket 4`); a larger --per-bucket answers "
        "more of every bucket of val.jsonl")
    _note_few_bucket_pairs(summary, "val.jsonl")
    assert capsys.readouterr().err.strip().endswith(
        "`polyalign generate --per-bucket N` answers N records of every bucket of val.jsonl")


def test_a_system_message_that_is_polyaligns_profile_prompt_is_left_out_and_said(tmp_path, capsys):
    """The PolyAlign sample's rows carry polyalign's own profile prompt as their system message: prepare leaves
    it out and counts it (`system_is_profile_prompt`); `pairs import` left it out too but said nothing (its
    manifest read `system_messages: 0` for 4 rows that had one)."""
    sample = json.loads((DEMO_DATA / "en/polyalign-sample/dist_sft_val.json").read_text(encoding="utf-8"))[:5]
    rows = [{"prompt": [{"role": "system", "content": row["system"]}, {"role": "user", "content": row["instruction"]}],
             "chosen": row["output"], "rejected": other["output"]} for row, other in zip(sample, sample[1:])]
    source = tmp_path / "prefs.json"
    source.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    code, out, _ = cli(capsys, "pairs", "import", "--format", "trl", "--input", source, "--out", tmp_path / "p.jsonl")
    assert code == 0 and ("4 rows opened with polyalign's own profile prompt as their system message: left out "
                          "(training writes the profile prompt from each pair's labels, never twice)") in out, out
    summary = json.loads((tmp_path / "p.manifest.json").read_text())["summary"]
    assert summary["system_is_profile_prompt"] == 4 and summary["system_messages"] == 0
    pairs = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert all(not any(turn["role"] == "system" for turn in p["record"]["history"]) for p in pairs)
