"""`polyalign build` checks that transformers reads the build's tokenizer with polyalign's ids, on probe
texts of the run's own records, and says so when transformers is not installed. transformers is not in
the core install: its reader is stood in for by a module of the same name whose AutoTokenizer loads the
exported tokenizer.json with the `tokenizers` library, as transformers' fast tokenizers do, optionally
splitting every digit as the Qwen2 tokenizer class's pre-tokenizer does (the case users met: "30"
trained as one token, served as "3" "0")."""

import itertools
import json
import sys
import types
import zipfile

import pytest

from polyalign.cli import main
from polyalign.inputs.tokenizer_check import compare_encoders, probe_texts
from tests.conftest import DEMO_DATA

CAMREST = json.loads(zipfile.ZipFile(DEMO_DATA / "en/camrest676/data.zip").read("data/dialogues.json"))[:40]


def stand_in_transformers(split_digits: bool | str) -> types.ModuleType:
    """`split_digits`: True, or a model type for which the stand-in splits digits only when the folder's
    config.json names it (transformers 5 picks the class by config.json's model_type: Qwen2Tokenizer)."""
    from pathlib import Path

    from tokenizers import Tokenizer, pre_tokenizers

    class Loaded:
        def __init__(self, folder):
            self._tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
            config = Path(folder) / "config.json"
            if isinstance(split_digits, str):
                splits = config.is_file() and json.loads(config.read_text())["model_type"] == split_digits
            else:
                splits = split_digits
            if splits:
                self._tok.pre_tokenizer = pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(individual_digits=True), self._tok.pre_tokenizer])

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return self._tok.encode(text, add_special_tokens=False).ids

    module = types.ModuleType("transformers")
    module.__version__ = "stand-in"
    module.AutoTokenizer = types.SimpleNamespace(from_pretrained=Loaded)
    return module


# Records of each split the builds below read: the check probes 64 records spread over train and val,
# whichever their number, and a build of the whole demo data took ten seconds to check one field.
SAMPLE_RECORDS = 300


@pytest.fixture(scope="module")
def sample_data(demo_run, tmp_path_factory):
    """The first SAMPLE_RECORDS records of each split of the demo run, with its prepare manifest."""
    source, _, _ = demo_run
    data = tmp_path_factory.mktemp("tokenizer_check") / "data"
    data.mkdir()
    (data / "manifest.json").write_bytes((source / "data" / "manifest.json").read_bytes())
    for split in ("train", "val", "test"):
        with (source / "data" / f"{split}.jsonl").open(encoding="utf-8") as rows:
            (data / f"{split}.jsonl").write_text("".join(itertools.islice(rows, SAMPLE_RECORDS)), encoding="utf-8")
    return data


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
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 600}))
    manifest, _, err = build_with(sample_data, json_tokenizer, tmp_path / "b", capsys, monkeypatch, transformers,
                                  checkpoint)
    check = manifest["tokenizer_check"]
    assert check["differing"] > 0 and check["reader"].endswith("(Loaded, chosen for config.json's model_type qwen2)")
    assert "chosen for config.json's model_type qwen2) reads" in err and "pre-tokenizer" in err


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
