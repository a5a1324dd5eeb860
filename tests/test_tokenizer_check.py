"""`polyalign build` checks that transformers reads the build's tokenizer with polyalign's ids, on probe
texts of the run's own records, and says so when transformers is not installed. transformers is not in
the core install: its reader is stood in for by a module of the same name whose AutoTokenizer loads the
exported tokenizer.json with the `tokenizers` library, as transformers' fast tokenizers do, optionally
splitting every digit as the Qwen2 tokenizer class's pre-tokenizer does (the case users met: "30"
trained as one token, served as "3" "0")."""

import json
import sys
import zipfile

import pytest

from polyalign.cli import main
from polyalign.model.tokenizer_check import compare_encoders, probe_texts
from tests.conftest import DEMO_DATA, first_records
from tests.transformers_stand_in import stand_in_transformers

CAMREST = json.loads(zipfile.ZipFile(DEMO_DATA / "en/camrest676/data.zip").read("data/dialogues.json"))[:40]


# Records of each split the builds below read: the check probes 64 records spread over train and val,
# whichever their number, and a build of the whole demo data took ten seconds to check one field.
SAMPLE_RECORDS = 300


@pytest.fixture(scope="module")
def sample_data(demo_run, tmp_path_factory):
    """The first SAMPLE_RECORDS records of each split of the demo run, with its prepare manifest."""
    return first_records(demo_run[0], tmp_path_factory.mktemp("tokenizer_check") / "data",
                         dict.fromkeys(("train", "val", "test"), SAMPLE_RECORDS))


def build_with(sample_data, json_tokenizer, tmp_path, capsys, monkeypatch, transformers, tokenizer_dir=None):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "data").symlink_to(sample_data, target_is_directory=True)
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    status = main(["build", str(run), "--tokenizer", str(tokenizer_dir or json_tokenizer.path.parent), "--template",
                   "qwen", "--max-length", "64", "--no-progress"])
    assert status == 0
    out, err = capsys.readouterr()
    return json.loads((run / "build/manifest.json").read_text()), out, err


def test_build_says_when_transformers_is_not_installed(sample_data, json_tokenizer, tmp_path, capsys, monkeypatch):
    manifest, out, _ = build_with(sample_data, json_tokenizer, tmp_path, capsys, monkeypatch, None)  # import fails
    check = manifest["tokenizer_check"]
    assert check["checked"] is False and "transformers is not installed" in check["reason"]
    assert f"tokenizer: {check['reason']}" in out.splitlines()


def test_build_compares_transformers_ids_on_the_records(sample_data, json_tokenizer, tmp_path, capsys, monkeypatch):
    manifest, out, err = build_with(sample_data, json_tokenizer, tmp_path, capsys, monkeypatch,
                                    stand_in_transformers(split_digits=False))
    check = manifest["tokenizer_check"]
    assert check["checked"] and check["differing"] == 0 and check["probes"] >= 64, check
    assert f"gives the same ids as polyalign on {check['probes']} probe texts" in out and "probe texts" not in err
    # at --max-length 64 most examples lost their profile prompt to left truncation: a warning, not an aside
    train = manifest["splits"]["train"]
    assert train["system_cut"] > 0.05 * train["examples"]
    assert (f"warning: {train['system_cut']} of {train['examples']} train examples "
            f"({train['system_cut'] / train['examples']:.0%}) lost their opening system message, whole or in "
            "part") in err
    # what the examples were rendered with, as chosen (the tokenizer names no template: its family's, polyalign)
    assert (f"rendered with chat template {manifest['template']}, profile context, system messages keep, "
            "truncation left") in out


def test_build_warns_when_transformers_reads_other_ids(sample_data, json_tokenizer, tmp_path, capsys, monkeypatch):
    manifest, _, err = build_with(sample_data, json_tokenizer, tmp_path, capsys, monkeypatch,
                                  stand_in_transformers(split_digits=True))
    check = manifest["tokenizer_check"]
    assert check["checked"] and 0 < check["differing"] < check["probes"], check
    first = check["examples"][0]
    assert any(c.isdigit() for c in first["text"]) and first["polyalign"] != first["transformers"]
    warning = next(line for line in err.splitlines() if "probe texts" in line)
    assert warning.startswith("warning: transformers stand-in") and f"on {check['differing']} of" in warning
    assert manifest["warnings"][-1] in warning


def test_the_check_reads_a_checkpoint_as_its_model_type_makes_transformers_read_it(sample_data, json_tokenizer,
                                                                                      tmp_path, capsys, monkeypatch):
    """A checkpoint of the user's own (a BPE tokenizer.json and a config.json of model_type qwen2, as
    save_pretrained writes them): transformers reads it through the class the model type names, which
    splits digits; the check loads it so too, with the checkpoint's config.json, and warns."""
    import shutil

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(json_tokenizer.path.parent, checkpoint)
    transformers = stand_in_transformers(split_digits="qwen2")
    manifest, _, _ = build_with(sample_data, json_tokenizer, tmp_path / "a", capsys, monkeypatch, transformers,
                                checkpoint)
    assert manifest["tokenizer_check"]["differing"] == 0  # no config.json: the tokenizer.json as it is
    config = {"model_type": "qwen2", "vocab_size": json_tokenizer.vocab_size}
    (checkpoint / "config.json").write_text(json.dumps(config))
    manifest, _, err = build_with(sample_data, json_tokenizer, tmp_path / "b", capsys, monkeypatch, transformers,
                                  checkpoint)
    check = manifest["tokenizer_check"]
    assert check["differing"] > 0 and check["reader"].endswith("(Loaded, loaded with config.json's model_type qwen2)")
    assert "loaded with config.json's model_type qwen2) reads" in err and "save_pretrained(D)` with D = " in err
    # transformers not installed (the README's install): transformers 5's Qwen2Tokenizer is emulated with the
    # tokenizers library, so the same warning comes; a tokenizer.json with Qwen2's own pre-tokenizer reads alike
    emulated = ("transformers 5's Qwen2Tokenizer (chosen by config.json's model_type qwen2; emulated, since "
                "transformers is not installed)")
    manifest, _, err = build_with(sample_data, json_tokenizer, tmp_path / "c", capsys, monkeypatch, None, checkpoint)
    check = manifest["tokenizer_check"]
    assert check["checked"] and check["differing"] > 0 and check["reader"].startswith(emulated), check
    assert any(c.isdigit() for c in check["examples"][0]["text"]) and f"warning: {emulated} reads " in err
    # the prompts made from that checkpoint for an engine say it too, where an engine would read them
    prompts = ["prompts", "--checkpoint", str(checkpoint), "--records", str(sample_data / "test.jsonl")]
    assert main([*prompts, "--out", str(tmp_path / "p.jsonl")]) == 0
    out = capsys.readouterr().out
    assert f"warning: {emulated} reads {checkpoint} with other ids than polyalign on " in out
    assert ("an engine given these rows' `prompt` or `messages` reads other ids than their prompt_token_ids "
            "(polyalign's, training's): give it prompt_token_ids") in out
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

    from polyalign.model.tokenizer_check import QWEN2_PRETOKENIZE

    qwen_like = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    qwen_like.normalizer = normalizers.NFC()
    qwen_like.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    qwen_like.save(str(checkpoint / "tokenizer.json"))
    manifest, out, _ = build_with(sample_data, json_tokenizer, tmp_path / "d", capsys, monkeypatch, None, checkpoint)
    assert manifest["tokenizer_check"]["differing"] == 0 and f"tokenizer: {emulated} gives the same ids" in out
    assert main([*prompts, "--out", str(tmp_path / "q.jsonl")]) == 0
    assert "warning" not in capsys.readouterr().out


def test_compare_encoders_names_the_first_difference():
    turns = [t["utterance"] for dialogue in CAMREST for t in dialogue["turns"]]
    texts = [next(t for t in turns if "01223 " in t), turns[0]]  # a phone number, then a turn without digits
    ours = lambda text: [ord(c) for c in text]  # noqa: E731
    theirs = lambda text: [ord(c) for c in text.replace("0", "o")]  # noqa: E731
    entry, warning = compare_encoders(ours, theirs, "reader", texts, "TOK")
    at = texts[0].index("0")
    assert entry["differing"] == 1 and entry["examples"][0]["first_difference"] == at
    assert entry["examples"][0]["polyalign"][2] == ord("0") and "on 1 of 2 probe texts" in warning
    assert compare_encoders(ours, ours, "reader", texts, "TOK") == (
        {"checked": True, "reader": "reader", "probes": 2, "differing": 0, "examples": []}, None)
    assert compare_encoders(ours, None, "not checked: why", texts, "TOK") == (
        {"checked": False, "reason": "not checked: why"}, None)
    assert probe_texts([]) == []


def test_training_checks_its_export_as_transformers_loads_it(json_tokenizer, tmp_path, monkeypatch):
    """The build cannot know the config.json an export of a model trained from a preset carries (its
    model_type picks transformers' tokenizer class); training checks the exported folder itself."""
    from polyalign.model import create_model
    from polyalign.model.export import export_checkpoint
    from polyalign.model.tokenizer_check import EXPORT_CONSEQUENCE, check_export
    from polyalign.tokens.chat import get_template
    from tests.conftest import tiny_model_config

    folder = tmp_path / "model"
    export_checkpoint(create_model(tiny_model_config(json_tokenizer.vocab_size), seed=0), json_tokenizer, folder,
                      template=get_template("qwen"), profile="context")
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    card = (folder / "README.md").read_text()
    texts = [t["utterance"] for dialogue in CAMREST for t in dialogue["turns"]]

    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    assert check_export(folder, json_tokenizer, texts) == {"tokenizer_check": {
        "checked": False, "reason": "not checked: transformers is not installed"}}
    section = "\n## Tokenizer check\n\nNot checked: transformers is not installed where this model was trained"
    assert (folder / "README.md").read_text().startswith(card + section)

    (folder / "README.md").write_text(card)
    monkeypatch.setitem(sys.modules, "transformers", stand_in_transformers(split_digits=model_type))
    result = check_export(folder, json_tokenizer, texts)
    check = result["tokenizer_check"]
    digits = sum(any(c.isdigit() for c in t) for t in texts)
    assert check["reader"] == f"transformers stand-in AutoTokenizer (Loaded, loaded with config.json's model_type " \
                              f"{model_type})" and 0 < check["differing"] <= digits and check["probes"] == len(texts)
    assert result["tokenizer_warning"].endswith(
        f"{EXPORT_CONSEQUENCE}. To make them agree, save the tokenizer as transformers reads it "
        f"(`AutoTokenizer.from_pretrained(D).save_pretrained(D)` with D = {folder} writes the tokenizer.json it "
        "builds for that class), then build and train on it again")
    assert f"**{check['reader']} reads this folder's tokenizer with other ids than training used**, on " \
           f"{check['differing']} of {len(texts)} probe texts" in (folder / "README.md").read_text()

    (folder / "README.md").write_text(card)
    monkeypatch.setitem(sys.modules, "transformers", stand_in_transformers(split_digits="another_type"))
    assert check_export(folder, json_tokenizer, texts)["tokenizer_check"]["differing"] == 0
    assert (folder / "README.md").read_text().endswith(
        f"reads this folder's tokenizer with the ids training used, on all {len(texts)} probe texts of the "
        "training data.\n")


def test_pair_texts_spread_over_the_pairs_and_hold_both_answers():
    from polyalign.train.preference import pair_texts

    turns = [t["utterance"] for dialogue in CAMREST for t in dialogue["turns"]]
    record = {"id": "r", "dataset": "camrest676", "split": "train", "language": "en", "track": "single",
              "family": "dialogue", "style": "open_chat", "question": turns[0], "context": "", "history": [],
              "response": turns[1], "length_tokens": 9, "length_bin": "short", "bucket_id": "b", "meta": {}}
    pairs = [{"record": {**record, "id": f"r{i}", "question": turns[2 * i]}, "chosen": turns[2 * i + 1],
              "rejected": turns[2 * i + 3]} for i in range(100)]
    texts = pair_texts(pairs, count=10)
    assert turns[0] in texts and turns[20] in texts and turns[2] not in texts  # every 10th pair
    assert turns[23] in texts and len(texts) == len(set(texts))  # a rejected answer; no text twice
    assert pair_texts([], count=10) == []
