"""Stages that refuse wrong inputs in one line naming the cause, instead of running on them: HDPO's
distance term on pairs the critic never scored, validation pairs that are the training pairs, and an
SFT init trained on a build encoded with another tokenizer."""

import json
import shutil

import pytest

from polyalign.cli import main
from polyalign.data.records import read_records
from polyalign.evaluate.baselines import first_sentence


@pytest.fixture(scope="module")
def real_pairs(demo_run, tmp_path_factory):
    """Unscored pairs from real records: the human answer chosen, the first sentence of the prompt's
    context (or the question) rejected, as `polyalign pairs` makes them."""
    from polyalign.pairs.make import make_pairs

    run, _, _ = demo_run
    directory = tmp_path_factory.mktemp("pairs")
    records = read_records(run / "data" / "train.jsonl")[:60]
    subset = directory / "records.jsonl"
    subset.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    predictions = directory / "predictions.jsonl"
    predictions.write_text("".join(json.dumps({"id": r.id, "prediction": first_sentence(r.context or r.question)},
                                              ensure_ascii=False) + "\n" for r in records))
    make_pairs(subset, predictions, directory / "train.jsonl")
    val = read_records(run / "data" / "val.jsonl")[:20]
    (directory / "val_records.jsonl").write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n"
                                                         for r in val))
    (directory / "val_predictions.jsonl").write_text("".join(json.dumps(
        {"id": r.id, "prediction": first_sentence(r.context or r.question)}, ensure_ascii=False) + "\n" for r in val))
    make_pairs(directory / "val_records.jsonl", directory / "val_predictions.jsonl", directory / "val.jsonl")
    return directory


def _train(capsys, method, pairs_dir, tmp_path, *overrides, val="val.jsonl"):
    code = main(["train", method, "--out", str(tmp_path / "out"), "--no-progress", f"init={tmp_path / 'no-init'}",
                 f"pairs={pairs_dir / 'train.jsonl'}", f"val_pairs={pairs_dir / val}", *overrides])
    return code, capsys.readouterr().err


def test_hdpo_on_unscored_pairs_refuses_unless_the_distance_term_is_off(real_pairs, tmp_path, capsys):
    code, err = _train(capsys, "hdpo", real_pairs, tmp_path)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "pairs carry no critic scores" in err and "lambda_dist=0" in err and "polyalign train critic" in err
    code, err = _train(capsys, "simpo", real_pairs, tmp_path, "hdpo_terms=true")  # the same terms on another loss
    assert code == 2 and "pairs carry no critic scores" in err
    # without the distance term (or without HDPO's terms) the pairs pass; the run then stops at the init
    for method, extra in (("hdpo", ["lambda_dist=0"]), ("dpo", [])):
        code, err = _train(capsys, method, real_pairs, tmp_path, *extra, "--overwrite")
        assert code == 2 and "critic scores" not in err and "no-init" in err, err


def test_hdpo_on_scored_pairs_passes_the_check(real_pairs):
    from polyalign.pairs.make import read_pairs
    from polyalign.train.config import PreferenceConfig
    from polyalign.train.preference import check_pairs, unscored_pairs

    pairs = read_pairs(real_pairs / "train.jsonl")
    assert unscored_pairs(pairs) == len(pairs) > 0
    scored = [{**p, "critic_chosen": 0.5, "critic_rejected": 1.5} for p in pairs]
    files = {"pairs": str(real_pairs / "train.jsonl"), "val_pairs": str(real_pairs / "val.jsonl")}
    check_pairs(PreferenceConfig(), files, scored)
    one_missing = scored[:-1] + [pairs[-1]]
    with pytest.raises(Exception, match=f"1 of {len(pairs)} pairs carry no critic scores"):
        check_pairs(PreferenceConfig(), files, one_missing)


def test_validation_pairs_that_are_the_training_pairs_are_refused(real_pairs, tmp_path, capsys):
    code, err = _train(capsys, "dpo", real_pairs, tmp_path, val="train.jsonl")
    assert code == 2 and err.count("\n") == 1 and "holds the training pairs" in err and "--val-fraction" in err
    shutil.copy(real_pairs / "train.jsonl", tmp_path / "copy.jsonl")  # the same pairs under another name
    code = main(["train", "dpo", "--out", str(tmp_path / "out2"), f"init={tmp_path / 'no-init'}",
                 f"pairs={real_pairs / 'train.jsonl'}", f"val_pairs={tmp_path / 'copy.jsonl'}"])
    assert code == 2 and "holds the training pairs" in capsys.readouterr().err


def test_sft_refuses_an_init_whose_tokenizer_is_not_the_builds(built_run, demo_tokenizer, json_tokenizer, tmp_path,
                                                               capsys):
    """The build was encoded with the demo's SentencePiece model; an init carrying another tokenizer is
    refused before anything loads, unless --allow-tokenizer-mismatch; one carrying the same files passes."""
    run, _ = built_run
    other = tmp_path / "other-init"
    other.mkdir()
    shutil.copy(json_tokenizer.path, other / "tokenizer.json")
    same = tmp_path / "same-init"
    same.mkdir()
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(demo_tokenizer[0].path.parent / name, same / name)

    def train(init, *flags):
        code = main(["train", "sft", "--out", str(tmp_path / "out"), "--no-progress", "--overwrite", *flags,
                     f"data.dir={run}", f"init={init}"])
        return code, capsys.readouterr().err

    code, err = train(other)
    assert code == 2 and err.count("\n") == 1 and "the ids would stand for other tokens" in err
    assert f"--tokenizer {other}" in err and "--allow-tokenizer-mismatch" in err
    for init, flags in ((other, ["--allow-tokenizer-mismatch"]), (same, [])):
        code, err = train(init, *flags)  # past the check: the init has no weights, which is the next refusal
        assert code == 2 and "other tokens" not in err and "config.json" in err, err
    assert main(["train", "sft", "--print-config", "--allow-tokenizer-mismatch"]) == 0
    assert "allow_tokenizer_mismatch: true" in capsys.readouterr().out


def test_validation_pairs_sharing_ids_with_the_training_pairs_are_refused(demo_run, tmp_path, capsys):
    """Two files imported apart under one --dataset number their rows alike: training says so."""
    from tests.test_pairs_import import real_rows, write_jsonl

    rows, _ = real_rows(demo_run, n=12)
    for name, part in (("train", rows[:8]), ("val", rows[8:])):
        source = write_jsonl(tmp_path / f"{name}_trl.jsonl", part)
        assert main(["pairs", "import", "--format", "trl", "--input", str(source), "--out",
                     str(tmp_path / f"{name}.jsonl"), "--dataset", "mine"]) == 0
    capsys.readouterr()
    code, err = _train(capsys, "dpo", tmp_path, tmp_path)
    assert code == 2 and err.count("\n") == 1 and "4 pair ids are also in" in err and "--val-fraction" in err
