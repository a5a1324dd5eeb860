"""Tokenizers: SentencePiece trained on the demo data and a tokenizer.json, behind one interface."""

import json
import re
import shutil

import pytest

from polyalign.cli import main
from polyalign.tokens.chat import ChatTemplateError, choose_template
from polyalign.tokens.tokenizer import JsonTokenizer, SentencePieceTokenizer, TokenizerError, load_tokenizer

ROUND_TRIP = {
    "simplified": "你好，世界！今天北京的天气怎么样？请问去颐和园要多久：大约两小时。",
    "traditional": "這是繁體中文的句子，臺灣與香港常用；「引號」與『書名號』。",
    "english": "Don't stop -- it's 2024! The café's naïve  double  spaces stay.",
    "emoji": "🤖👍🏽 family 👨‍👩‍👧 flags 🇨🇳🇬🇧 ✔️",
    "code": "def square(x):\n\treturn x ** 2  # 平方\n\n\nprint({'a': [1, 2]})\r\n",
    "full_width": "ＡＢＣ１２３，：；！？　全角空格",
}


@pytest.mark.parametrize("kind", sorted(ROUND_TRIP))
def test_sentencepiece_round_trip(demo_tokenizer, kind):
    tokenizer, _ = demo_tokenizer
    text = ROUND_TRIP[kind]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.special_id("<unk>") not in ids  # byte fallback, never <unk>


@pytest.mark.parametrize("kind", sorted(ROUND_TRIP))
def test_tokenizer_json_round_trip(json_tokenizer, kind):
    text = ROUND_TRIP[kind]
    assert json_tokenizer.decode(json_tokenizer.encode(text)) == text


def test_sentencepiece_interface(demo_tokenizer):
    tokenizer, report = demo_tokenizer
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert tokenizer.vocab_size == 8000 == report["vocab_size"]
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 2, 3)
    assert tokenizer.chat_template == "polyalign"
    for token in ("<|im_start|>", "<|im_end|>"):
        assert tokenizer.encode(token) == [tokenizer.special_id(token)]
    assert tokenizer.token_to_id("<|not_a_token|>") is None
    # Chinese costs more tokens per character than English, and both compress.
    rates = report["chars_per_token"]
    assert 1.0 < rates["zh"] < rates["en"]
    # Batched and single encoding agree.
    texts = list(ROUND_TRIP.values())
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]


def test_tokenizer_json_interface(json_tokenizer):
    assert isinstance(json_tokenizer, JsonTokenizer)
    assert json_tokenizer.bos_token == "<bos>" and json_tokenizer.eos_token == "<eos>"
    assert json_tokenizer.bos_id == json_tokenizer.special_id("<bos>")
    assert json_tokenizer.pad_id == json_tokenizer.eos_id  # no pad token: padding uses EOS
    ids = json_tokenizer.encode("<|im_start|>user\n你好<|im_end|>")
    assert ids[0] == json_tokenizer.special_id("<|im_start|>") and ids[-1] == json_tokenizer.special_id("<|im_end|>")


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(TokenizerError, match=f"{tmp_path}: no tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="tokenizer.model: not a SentencePiece model"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{")
    with pytest.raises(TokenizerError, match="tokenizer.json: not a tokenizer.json"):
        load_tokenizer(tmp_path)


def test_cli_trains_and_explains_a_too_small_vocabulary(demo_run, tmp_path, capsys):
    run, _, _ = demo_run
    records = str(run / "data" / "train.jsonl")
    # every eighth record, English and Chinese: the size the refusal names is then trained quickly
    some = tmp_path / "some.jsonl"
    some.write_text("".join((run / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[::8]),
                    encoding="utf-8")
    assert main(["tokenizer", "train", "--records", str(some), "--vocab-size", "500", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    needed = re.search(r"vocab size 500 cannot hold the (\d+) pieces .* give a vocab size of \1 or more, or a lower "
                       r"--character-coverage", err)
    assert needed, err
    # the size it names is enough
    assert main(["tokenizer", "train", "--records", str(some), "--vocab-size", needed[1], "--out",
                 str(tmp_path / "named")]) == 0, capsys.readouterr().err
    # below 0.98 SentencePiece refuses after reading every record: refused before, with the range
    assert main(["tokenizer", "train", "--records", records, "--vocab-size", "500", "--character-coverage", "0.97",
                 "--out", str(tmp_path)]) == 2
    assert "--character-coverage must be in [0.98, 1], got 0.97" in capsys.readouterr().err
    code = main(["tokenizer", "train", "--records", records, "--vocab-size", "2200", "--character-coverage", "0.98",
                 "--model-type", "bpe", "--out", str(tmp_path)])
    assert code == 0
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.vocab_size == 2200
    assert tokenizer.decode(tokenizer.encode(ROUND_TRIP["simplified"])) == ROUND_TRIP["simplified"]
    assert "characters per token" in capsys.readouterr().out


def test_a_vocabulary_larger_than_the_records_can_fill_says_the_most_they_can(demo_run, tmp_path, capsys):
    run, _, _ = demo_run
    few = tmp_path / "few.jsonl"
    few.write_text("".join((run / "data" / "train.jsonl").read_text(encoding="utf-8").splitlines(True)[:40]),
                   encoding="utf-8")
    assert main(["tokenizer", "train", "--records", str(few), "--vocab-size", "8000", "--out",
                 str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "vocab size 8000 is more than these records can fill: at most" in err and "--vocab-size" in err
    assert "INTERNAL" not in err



def _checkpoint_with(tokenizer, folder, **entries):
    """A copy of `tokenizer`'s folder whose tokenizer_config.json also holds `entries`."""
    shutil.copytree(tokenizer.path.parent, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **entries}))
    return folder


@pytest.mark.parametrize(("key", "value", "modes"), [("polyalign_system", "merge", "keep, replace, drop"),
                                                      ("polyalign_profile", "full", "context, oracle, none")])
def test_a_checkpoint_naming_an_unknown_profile_or_system_mode_is_refused_with_the_modes(
        json_tokenizer, tmp_path, key, value, modes):
    folder = _checkpoint_with(json_tokenizer, tmp_path / "checkpoint", **{key: value})
    with pytest.raises(TokenizerError) as error:
        load_tokenizer(folder)
    assert str(error.value) == f"{folder / 'tokenizer_config.json'}: {key} {value!r} is not one of {modes}"


@pytest.mark.parametrize(("key", "hint"), [
    ("polyalign_profle", "; did you mean 'polyalign_profile'?"),
    ("polyalign_seed", " (known: polyalign_tokenizer, polyalign_chat_template, polyalign_profile, polyalign_system, "
                       "polyalign_profile_values, polyalign_profile_combinations, polyalign_max_length)")])
def test_a_checkpoint_with_an_unknown_polyalign_key_is_refused_naming_the_nearest_one(json_tokenizer, tmp_path, key,
                                                                                      hint):
    folder = _checkpoint_with(json_tokenizer, tmp_path / "checkpoint", **{key: "oracle"})
    with pytest.raises(TokenizerError) as error:
        load_tokenizer(folder)
    assert str(error.value) == f"{folder / 'tokenizer_config.json'}: unknown key {key!r}{hint}"


@pytest.mark.parametrize("values", [{"family": "dialogue"}, {"colour": ["red"]}, ["dialogue"]])
def test_a_checkpoint_with_malformed_profile_values_is_refused_naming_its_config(json_tokenizer, tmp_path, values):
    folder = _checkpoint_with(json_tokenizer, tmp_path / "checkpoint", polyalign_profile_values=values)
    with pytest.raises(TokenizerError) as error:
        load_tokenizer(folder)
    assert str(error.value).startswith(f"{folder / 'tokenizer_config.json'}: polyalign_profile_values must map "
                                       "profile keys (family, track, style, length) to lists of strings, got ")
    held = {"family": ["dialogue", "qa"], "style": ["open_chat"]}
    good = _checkpoint_with(json_tokenizer, tmp_path / "good", polyalign_profile_values=held)
    assert load_tokenizer(good).profile_values == held


def test_a_checkpoint_naming_an_unknown_chat_template_is_refused_naming_its_config(json_tokenizer, tmp_path):
    folder = _checkpoint_with(json_tokenizer, tmp_path / "checkpoint", polyalign_chat_template="polyalgin")
    tokenizer = load_tokenizer(folder)
    with pytest.raises(ChatTemplateError) as error:
        choose_template(tokenizer)
    assert str(error.value).startswith(f"{folder / 'tokenizer_config.json'}: polyalign_chat_template 'polyalgin' "
                                       "is not one of checkpoint, polyalign, ")
    assert choose_template(tokenizer, requested="qwen") == "qwen"  # --template still renders


def test_a_template_other_than_the_checkpoints_own_is_rendered_with_a_note(json_tokenizer, tmp_path, capsys):
    named = load_tokenizer(_checkpoint_with(json_tokenizer, tmp_path / "named", polyalign_chat_template="polyalign"))
    assert choose_template(named, requested="qwen", where="CKPT") == "qwen"
    assert capsys.readouterr().err == "note: CKPT names chat template 'polyalign'; rendering with 'qwen' as asked\n"
    assert choose_template(named, requested="polyalign", where="CKPT") == "polyalign"
    assert choose_template(named, where="CKPT") == "polyalign"
    assert capsys.readouterr().err == ""  # asked for its own, or for none: nothing to say
    own = load_tokenizer(_checkpoint_with(json_tokenizer, tmp_path / "own", chat_template="{{ messages }}"))
    assert choose_template(own, requested="llama3", where="CKPT") == "llama3"
    assert capsys.readouterr().err == "note: CKPT names chat template 'checkpoint'; rendering with 'llama3' as asked\n"


def test_a_generated_answer_is_decoded_without_chat_markers(demo_tokenizer, json_tokenizer):
    """Both tokenizer kinds: skip_special leaves out the chat template's markers and the special tokens a
    model may emit inside an answer (as vLLM shows answers), and keeps the text around them whole; the
    default keeps them (what a rendered prompt needs)."""
    from polyalign.tokens.chat import TEMPLATE_SPECIAL_TOKENS

    text = ROUND_TRIP["simplified"]
    for tokenizer in (demo_tokenizer[0], json_tokenizer):
        markers = [t for t in TEMPLATE_SPECIAL_TOKENS if tokenizer.token_to_id(t) is not None]
        assert "<|im_start|>" in markers and "<|im_end|>" in markers
        ids = [tokenizer.token_to_id("<|im_start|>"), *tokenizer.encode(text), tokenizer.token_to_id("<|im_end|>")]
        assert tokenizer.decode(ids, skip_special=True) == text
        assert tokenizer.decode(ids) == f"<|im_start|>{text}<|im_end|>"


def test_the_profile_prompt_every_example_opens_with_is_learnt_with_the_records(demo_run, tmp_path):
    """A Chinese-only team's tokenizer learnt from the records alone spelt the English profile prompt nearly a
    piece a letter (116 tokens of 133 characters: half a 256-token example); learnt with it, a third fewer."""
    from polyalign.data.records import read_records
    from polyalign.tokens.chat import POLYALIGN_SPECIAL_TOKENS, system_prompt
    from polyalign.tokens.tokenizer import train_sentencepiece
    from polyalign.tokens.tokenizer_training import record_texts, train_from_records

    run, _, _ = demo_run
    chinese = [r for r in read_records(run / "data" / "train.jsonl") if r.language == "zh"][:1500]
    records = tmp_path / "zh.jsonl"
    records.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in chinese), encoding="utf-8")
    learnt, report = train_from_records(records, tmp_path / "tok", 3000, character_coverage=0.98, system_prompts=True)
    assert report["settings"]["system_prompts"] is True
    alone = train_sentencepiece(record_texts(chinese), tmp_path / "alone", 3000, character_coverage=0.98,
                                special_tokens=POLYALIGN_SPECIAL_TOKENS)
    for prompt in {system_prompt(r, "context") for r in chinese}:
        with_it, without = len(learnt.encode(prompt)), len(alone.encode(prompt))
        assert with_it < 0.7 * without and without > 0.7 * len(prompt), (len(prompt), with_it, without)


def test_the_same_records_in_another_order_train_the_same_tokenizer(demo_run, tmp_path):
    """A Beam prepare's shards hold the same records as one machine's train.jsonl in another order, and
    SentencePiece's pieces depend on the order it reads (14 of 4,000 pieces, 3,460 ids moved): the records are
    read in id order, so the two give one vocabulary, piece for piece and score for score. The test can fail:
    read as given, the reversed file trains other pieces (checked below with SentencePiece directly)."""
    import sentencepiece as spm

    from polyalign.data.records import read_records
    from polyalign.tokens.chat import POLYALIGN_SPECIAL_TOKENS
    from polyalign.tokens.tokenizer import train_sentencepiece
    from polyalign.tokens.tokenizer_training import record_texts, train_from_records

    def vocabulary(model: bytes) -> list[tuple[str, float]]:  # the file also holds the folder it was trained into
        processor = spm.SentencePieceProcessor(model_proto=model)
        return [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())]

    run, _, _ = demo_run
    english = [r for r in read_records(run / "data" / "train.jsonl") if r.language == "en"][:1200]
    trained, plain = {}, {}
    for name, order in (("forward", english), ("reversed", english[::-1])):
        records = tmp_path / f"{name}.jsonl"
        records.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in order),
                           encoding="utf-8")
        trained[name] = vocabulary(train_from_records(records, tmp_path / name, 1000)[0].path.read_bytes())
        plain[name] = vocabulary(train_sentencepiece(record_texts(order), tmp_path / f"plain-{name}", 1000,
                                                     special_tokens=POLYALIGN_SPECIAL_TOKENS).path.read_bytes())
    assert trained["forward"] == trained["reversed"]
    assert plain["forward"] != plain["reversed"]  # what reading in id order takes away


def test_the_same_records_train_the_same_tokenizer_on_a_machine_of_any_core_count(demo_run, tmp_path, monkeypatch,
                                                                                   capsys):
    """SentencePiece's pieces depend on how many threads train it (it sums their statistics in their split of
    the sentences), and the thread count was the machine's core count: a laptop and a pod's host trained other
    tokenizers from one train.jsonl. The count is now fixed; `--threads` changes it, recorded. The test can
    fail: the same records under 4 threads train other pieces."""
    import os

    import sentencepiece as spm

    from polyalign.data.records import read_records

    def vocabulary(folder) -> list[tuple[str, float]]:
        processor = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        return [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())]

    run, _, _ = demo_run
    english = [r for r in read_records(run / "data" / "train.jsonl") if r.language == "en"][:400]
    records = tmp_path / "en.jsonl"
    records.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in english), encoding="utf-8")
    for cores in (1, 64):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert main(["tokenizer", "train", "--records", str(records), "--vocab-size", "500",
                     "--out", str(tmp_path / f"cores-{cores}")]) == 0
    assert main(["tokenizer", "train", "--records", str(records), "--vocab-size", "500", "--threads", "4",
                 "--out", str(tmp_path / "threads-4")]) == 0
    assert vocabulary(tmp_path / "cores-1") == vocabulary(tmp_path / "cores-64")
    assert vocabulary(tmp_path / "threads-4") != vocabulary(tmp_path / "cores-1")
    reports = {name: json.loads((tmp_path / name / "tokenizer_report.json").read_text())
               for name in ("cores-1", "threads-4")}
    assert reports["cores-1"]["threads"] == 2 == reports["cores-1"]["settings"]["threads"]
    assert reports["threads-4"]["threads"] == 4 == reports["threads-4"]["settings"]["threads"]
    # the default spelt out is the same settings; so is a report from before the count was recorded
    assert main(["tokenizer", "train", "--records", str(records), "--vocab-size", "500", "--threads", "2",
                 "--out", str(tmp_path / "cores-1")]) == 0
    report = tmp_path / "cores-1" / "tokenizer_report.json"
    older = json.loads(report.read_text())
    del older["settings"]["threads"]
    report.write_text(json.dumps(older))
    assert main(["tokenizer", "train", "--records", str(records), "--vocab-size", "500",
                 "--out", str(tmp_path / "cores-1")]) == 0
    assert main(["tokenizer", "train", "--records", str(records), "--vocab-size", "500", "--threads", "4",
                 "--out", str(tmp_path / "cores-1")]) == 2
    assert "threads: 2 there, 4 now" in capsys.readouterr().err
    # a run folder and its one train file are the same records (the one was refused as other settings)
    (tmp_path / "run" / "data").mkdir(parents=True)
    (tmp_path / "run" / "data" / "manifest.json").write_bytes((run / "data" / "manifest.json").read_bytes())
    (tmp_path / "run" / "data" / "train.jsonl").write_bytes(records.read_bytes())
    for given in (tmp_path / "run", tmp_path / "run" / "data" / "train.jsonl"):
        assert main(["tokenizer", "train", "--records", str(given), "--vocab-size", "500",
                     "--out", str(tmp_path / "from-run")]) == 0, capsys.readouterr().err
    report = tmp_path / "from-run" / "tokenizer_report.json"  # ... in a report from before, which kept the folder
    older = json.loads(report.read_text())
    older["settings"]["records"] = str(tmp_path / "run")
    report.write_text(json.dumps(older))
    assert main(["tokenizer", "train", "--records", str(tmp_path / "run" / "data" / "train.jsonl"), "--vocab-size",
                 "500", "--out", str(tmp_path / "from-run")]) == 0, capsys.readouterr().err
