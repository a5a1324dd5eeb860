"""Stages that refuse wrong inputs in one line naming the cause, instead of running on them: HDPO's
distance term on pairs the critic never scored, validation pairs that are the training pairs, and an
SFT init trained on a build encoded with another tokenizer."""

import dataclasses
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from polyalign.cli import main
from polyalign.data.records import read_records
from polyalign.evaluate.baselines import first_sentence
from tests.conftest import first_records


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
    (tmp_path / "no-init").mkdir(exist_ok=True)  # a folder with no checkpoint: the run stops when it loads it
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


def test_hdpo_on_a_critic_that_ranks_backwards_repeats_the_critics_warning(tmp_path):
    """The critic run warned that it ranks held-out pairs worse than chance; HDPO on its scored pairs trained
    without a word. The warning comes back where the distance term is on, and only there; the model card
    names the critic and its held-out ranking wherever the distance term trained on its scores."""
    from polyalign.train.config import PreferenceConfig
    from polyalign.train.preference import backward_critic_note, critic_card_row, scoring_critic

    def said(config):
        return backward_critic_note(config, scoring_critic(config, pairs), pairs)

    pairs = str(tmp_path / "train_pairs.jsonl")
    assert said(PreferenceConfig()) is None and scoring_critic(PreferenceConfig(), pairs) is None  # no critic.json
    assert critic_card_row(None) == {}
    for accuracy, warned in ((0.346, True), (0.5, False), (0.81, False)):
        (tmp_path / "critic.json").write_text(json.dumps({"val": {"ranking_accuracy": accuracy, "auc": 0.389},
                                                          "val_pairs": 26}))
        assert (said(PreferenceConfig()) is not None) is warned
    dpo = PreferenceConfig(method="dpo")
    assert said(dpo) is None and scoring_critic(dpo, pairs) is None
    assert critic_card_row(scoring_critic(PreferenceConfig(), pairs)) == {"critic": (
        f"{tmp_path / 'critic.json'}: ranking accuracy 0.810, AUC 0.389 on 26 held-out pairs (0.5: chance); the "
        "distance term trained on its scores")}
    (tmp_path / "critic.json").write_text(json.dumps({"val": {"ranking_accuracy": 0.346, "auc": 0.389}}))
    assert said(PreferenceConfig(lambda_dist=0.0)) is None and scoring_critic(PreferenceConfig(lambda_dist=0.0),
                                                                               pairs) is None
    assert said(PreferenceConfig()) == (
        f"warning: the critic that scored {pairs} ranks its held-out pairs worse than chance (0.346, "
        f"{tmp_path / 'critic.json'}): HDPO's distance term (lambda_dist 0.1) pushes toward the rejected answers; "
        "train the critic longer, or set lambda_dist=0")
    assert critic_card_row(scoring_critic(PreferenceConfig(), pairs))["critic"].endswith(
        "ranking accuracy 0.346, AUC 0.389 (0.5: chance); the distance term trained on its scores")  # pairs unknown
    # an earlier critic.json, or one whose AUC had an empty side: the accuracy alone warns, and the card has no AUC
    for val in ({"ranking_accuracy": 0.346}, {"ranking_accuracy": 0.346, "auc": None}):
        (tmp_path / "critic.json").write_text(json.dumps({"val": val}))
        assert said(PreferenceConfig()).startswith("warning: the critic that scored ")
        assert critic_card_row(scoring_critic(PreferenceConfig(), pairs))["critic"] == (
            f"{tmp_path / 'critic.json'}: ranking accuracy 0.346 (0.5: chance); the distance term trained on its "
            "scores")
    for other in ({"val": {"ranking_accuracy": "high"}}, {"val": [0.3]}, []):  # of another shape: nothing said
        (tmp_path / "critic.json").write_text(json.dumps(other))
        assert said(PreferenceConfig()) is None


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
    from polyalign.model.architecture import to_hf_config
    from polyalign.model.presets import preset

    run, _ = built_run
    other = tmp_path / "other-init"
    other.mkdir()
    shutil.copy(json_tokenizer.path, other / "tokenizer.json")
    same = tmp_path / "same-init"
    same.mkdir()
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(demo_tokenizer[0].path.parent / name, same / name)
    # each a checkpoint's config.json and tokenizer, without weights
    model = to_hf_config(preset("tiny", vocab_size=demo_tokenizer[0].vocab_size))
    for init in (other, same):
        (init / "config.json").write_text(json.dumps(model))

    def train(init, *flags):
        code = main(["train", "sft", "--out", str(tmp_path / "out"), "--no-progress", "--overwrite", *flags,
                     f"data.dir={run}", f"init={init}"])
        return code, capsys.readouterr().err

    code, err = train(other)
    assert code == 2 and err.count("\n") == 1 and "the ids would stand for other tokens" in err
    assert "--allow-tokenizer-mismatch" in err
    # The suggested rebuild keeps the build's other options (64 tokens), only the tokenizer changes.
    assert f"rebuild with `polyalign build {run} --tokenizer {other} --max-length 64`" in err, err
    for init, flags in ((other, ["--allow-tokenizer-mismatch"]), (same, [])):
        code, err = train(init, *flags)  # past the check: the init has no weights, which is the next refusal
        assert code == 2 and "other tokens" not in err and "no *.safetensors files" in err, err
    assert main(["train", "sft", "--print-config", "--allow-tokenizer-mismatch"]) == 0
    assert "allow_tokenizer_mismatch: true" in capsys.readouterr().out


def test_every_command_refuses_a_checkpoint_whose_vocabulary_its_tokenizer_outruns(built_run, demo_tokenizer,
                                                                                     json_tokenizer, real_pairs,
                                                                                     tmp_path, capsys):
    """A checkpoint with 4,000 embedding rows beside the demo's 8,000-piece tokenizer: ids from 4,000 on read
    no embedding and every logit is NaN. Only SFT refused it; generate wrote "!!!!", preference training
    skipped NaN steps, prompts wrote ids past the vocabulary, each exiting 0. Every command that pairs a
    checkpoint with its tokenizer now stops in one line naming config.json, before loading a weight."""
    from polyalign.model import create_model, save_hf_checkpoint
    from polyalign.model.presets import preset

    run, _ = built_run
    tokenizer = demo_tokenizer[0]
    narrow = tmp_path / "narrow"
    save_hf_checkpoint(create_model(preset("tiny", vocab_size=4000, num_layers=1, hidden_size=32, num_heads=2,
                                           num_kv_heads=1, head_dim=16, intermediate_size=64)), narrow,
                       extra_files={name: (tokenizer.path.parent / name).read_bytes()
                                    for name in ("tokenizer.model", "tokenizer_config.json")})
    records = run / "data" / "test.jsonl"
    commands = {
        "generate": ["generate", "--checkpoint", str(narrow), "--records", str(records), "--out",
                     str(tmp_path / "p.jsonl"), "--limit", "2", "--no-progress"],
        "prompts": ["prompts", "--checkpoint", str(narrow), "--records", str(records), "--out",
                    str(tmp_path / "prompts.jsonl"), "--limit", "2"],
        "show": ["show", str(real_pairs / "train.jsonl"), "--checkpoint", str(narrow), "--limit", "1"],
        "dpo": ["train", "dpo", "--out", str(tmp_path / "dpo"), "--no-progress", f"init={narrow}",
                f"pairs={real_pairs / 'train.jsonl'}", f"val_pairs={real_pairs / 'val.jsonl'}"],
        "sft": ["train", "sft", "--out", str(tmp_path / "sft"), "--no-progress", f"data.dir={run}", f"init={narrow}"],
    }
    for name, argv in commands.items():
        code, err = main(argv), capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (name, err)
        said = f"{narrow / 'config.json'}: the model's vocabulary holds 4000 ids, fewer than the 8000"
        assert said in err and "(every logit would be NaN)" in err, (name, err)
    # an init whose tokenizer file is damaged is named as such (it read as "no tokenizer files" and trained)
    damaged = tmp_path / "damaged"
    shutil.copytree(narrow, damaged)
    (damaged / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    code, err = main(["train", "sft", "--out", str(tmp_path / "sft2"), "--no-progress", f"data.dir={run}",
                      f"init={damaged}"]), capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(damaged / "tokenizer.model") in err and "no tokenizer" not in err
    # an architecture polyalign does not build is said first, before the tokenizer is compared with the build's
    mistral = tmp_path / "mistral"
    shutil.copytree(narrow, mistral)
    (mistral / "tokenizer.model").unlink()
    shutil.copy(json_tokenizer.path, mistral / "tokenizer.json")
    config = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**config, "model_type": "mistral",
                                                     "architectures": ["MistralForCausalLM"]}))
    code, err = main(["train", "sft", "--out", str(tmp_path / "sft3"), "--no-progress", f"data.dir={run}",
                      f"init={mistral}"]), capsys.readouterr().err
    assert code == 2 and "unsupported model_type 'mistral'" in err and "other tokens" not in err, err


def test_validation_pairs_sharing_ids_with_the_training_pairs_are_refused(demo_run, tmp_path, capsys):
    """Two files imported apart under one --dataset number their rows alike: training says so."""
    from tests.chat_exports import write_jsonl
    from tests.real_inputs import real_trl_rows

    rows, _ = real_trl_rows(demo_run, n=12)
    for name, part in (("train", rows[:8]), ("val", rows[8:])):
        source = write_jsonl(tmp_path / f"{name}_trl.jsonl", part)
        assert main(["pairs", "import", "--format", "trl", "--input", str(source), "--out",
                     str(tmp_path / f"{name}.jsonl"), "--dataset", "mine"]) == 0
    capsys.readouterr()
    code, err = _train(capsys, "dpo", tmp_path, tmp_path)
    assert code == 2 and err.count("\n") == 1 and "4 pair ids are also in" in err and "--val-fraction" in err


def test_a_failed_export_leaves_a_run_the_same_command_finishes(built_run, tmp_path, capsys, monkeypatch):
    """The disk fills while OUT/model is written: the run ends in one line, its checkpoint at the last step
    kept; the same command then trains nothing, exports, and reports the loss the last step computed (from
    metrics.jsonl), saying that nothing was trained this time."""
    import errno

    from polyalign.model import export
    from polyalign.train.metrics import read_metrics

    run, _ = built_run
    out = tmp_path / "sft"
    argv = ["train", "sft", "--out", str(out), "--no-progress", f"data.dir={run}", "train.steps=2",
            "train.global_batch=4", "train.eval_every=2", "data.eval_limit=8", "data.eval_batch=8"]
    real = export.export_trained

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "model" / "model.safetensors"))

    monkeypatch.setattr(export, "export_trained", full_disk)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left on device; free space" in err and "run the same command" in err
    assert not (out / "model" / "model.safetensors").exists() and (out / "checkpoints" / "2").is_dir()
    monkeypatch.setattr(export, "export_trained", real)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    loss = next(r["loss"] for r in read_metrics(out) if r["step"] == 2 and "loss" in r)
    assert f"already trained to step 2 (nothing left to train); final loss {loss:.4f}" in printed, printed
    assert "nan" not in printed and (out / "model" / "model.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["last"]["loss"] == loss


def _examples(run):
    import numpy as np
    import tensorflow_datasets as tfds

    from polyalign.inputs.build import dataset_dir

    source = tfds.builder_from_directory(str(dataset_dir(run)))
    out = {}
    for split in ("train", "val"):
        data = source.as_data_source(split=split)
        out[split] = {e["id"]: {k: np.asarray(v).tolist() for k, v in e.items()} for e in map(data.__getitem__,
                                                                                          range(len(data)))}
    return out


def test_an_interrupted_build_restarts_with_the_same_command_and_equals_an_uninterrupted_one(
        demo_run, demo_tokenizer, tmp_path, capsys, monkeypatch):
    """Ctrl-C while the dataset is half written: the same command finishes the build (its own unfinished
    output recognised by the settings it noted when it started), the examples equal a build never
    interrupted, and a command with other settings is refused naming them."""
    from polyalign.inputs import build as build_module

    # the first records of each split: what is checked needs no more
    data = first_records(demo_run[0], tmp_path / "data", {"train": 400, "val": 60, "test": 60})
    runs = {}
    for name in ("cut", "straight"):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        (runs[name] / "data").symlink_to(data, target_is_directory=True)
    tokenizer = str(demo_tokenizer[0].path.parent)

    def build(run, *extra):
        length = [] if "--max-length" in extra else ["--max-length", "64"]
        return main(["build", str(run), "--tokenizer", tokenizer, *length, "--no-progress", *extra])

    real = build_module.write_dataset

    def interrupted(run, *args, **kwargs):
        partial = build_module.dataset_dir(run) / "1.0.0"
        partial.mkdir(parents=True)
        (partial / "sft_examples-train.array_record-00000-of-00001").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "write_dataset", interrupted)
    assert build(runs["cut"]) == 130
    assert not (runs["cut"] / "build" / "manifest.json").exists()
    monkeypatch.setattr(build_module, "write_dataset", real)
    capsys.readouterr()
    assert build(runs["cut"], "--max-length", "32") == 2
    err = capsys.readouterr().err
    assert "an unfinished run with other settings was writing here (max_length: 64 there, 32 now)" in err, err
    # and a build leaves nothing in the temporary folder (TFDS would leave an empty tmp*tfds each)
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    assert build(runs["cut"]) == 0 and build(runs["straight"]) == 0
    assert list(system_tmp.iterdir()) == []
    assert _examples(runs["cut"]) == _examples(runs["straight"])
    assert not list((runs["cut"] / "build").glob(".*.started"))
    # a second tokenizer's build is refused with the recipe these runs follow: a RUN of its own on the same data
    capsys.readouterr()
    assert build(runs["cut"], "--max-length", "32") == 2
    other = f"{runs['cut'].resolve()}-2"
    err = capsys.readouterr().err
    command = f"polyalign build {other} --tokenizer {tokenizer} --max-length 32"
    assert (f"pass --overwrite to replace it, or build into a RUN of its own beside it: mkdir {other} && ln -s "
            f"{runs['cut'].resolve() / 'data'} {other}/data, then {command} (and polyalign stats") in err, err
    # the recipe as given builds (the new RUN has no tokenizer/ of its own: the command names the one used)
    Path(other).mkdir()
    Path(other, "data").symlink_to(runs["cut"].resolve() / "data", target_is_directory=True)
    assert main([*command.split()[1:], "--no-progress"]) == 0
    assert json.loads(Path(other, "build", "manifest.json").read_text())["options"]["max_length"] == 32


def test_a_stage_output_recognises_its_own_unfinished_output_and_nothing_else(tmp_path):
    from polyalign.core.errors import ConfigError
    from polyalign.core.outputs import OutputLock, sidecar, stage_output, started_record, write_record

    out = tmp_path / "predictions.jsonl"
    settings = {"records": "r.jsonl", "seed": 0}

    def stage(settings, fail=False):
        with stage_output(out, sidecar(out), settings, False, ours=[out], inputs={"records": tmp_path / "r.jsonl"},
                          lock=OutputLock.for_file(out)):
            out.write_text('{"id": "a"}\n')  # half the file, then an interruption
            if fail:
                raise KeyboardInterrupt
            write_record(sidecar(out), settings, {})

    with pytest.raises(KeyboardInterrupt):
        stage(settings, fail=True)
    assert started_record(sidecar(out)).is_file() and not sidecar(out).exists()
    with pytest.raises(ConfigError, match=r"an unfinished run with other settings was writing here \(seed: 0 there, "
                                          r"1 now\)"):
        stage({**settings, "seed": 1})
    stage(settings)  # the same command finishes it
    assert sidecar(out).is_file() and not started_record(sidecar(out)).exists()
    with pytest.raises(ConfigError, match="made with other settings"):
        stage({**settings, "seed": 1})
    started_record(sidecar(out)).unlink(missing_ok=True)
    sidecar(out).unlink()  # a file polyalign has no record of is never taken for its own
    with pytest.raises(ConfigError, match="exists without"):
        stage(settings)
    # --overwrite interrupted: the old record no longer claims an output it did not make
    write_record(sidecar(out), {**settings, "seed": 5}, {})
    with pytest.raises(KeyboardInterrupt):
        with stage_output(out, sidecar(out), settings, True, ours=[out], lock=OutputLock.for_file(out)):
            raise KeyboardInterrupt
    assert not sidecar(out).exists()
    stage(settings)  # the same command without --overwrite finishes what the interrupted one began
    with pytest.raises(ConfigError, match="is the command.s own records; write the output somewhere else"):
        with stage_output(out, sidecar(out), settings, True, inputs={"records": out}):
            pass


def test_a_folder_stage_that_fails_before_writing_leaves_no_folder_and_no_marker(tmp_path):
    """A folder output (evaluate's EVAL, build's RUN/build): a first run that fails before writing removes
    the folder it made for its marker and lock; one that wrote something keeps its marker, so the same
    command resumes; a folder the user made is kept, emptied of the marker."""
    from polyalign.core.outputs import stage_output, started_record

    def stage(out, write=False):
        with stage_output(out, out / "metrics.json", {"seed": 0}, False, ours=[out / "metrics.json"]):
            if write:
                (out / "lengths.png").write_bytes(b"png")
            raise ValueError("predictions.jsonl line 3: not JSON")

    for out, made_by_user in ((tmp_path / "eval", False), (tmp_path / "mine", True),
                              (tmp_path / "new" / "runs" / "eval", False)):  # the parents it made go too
        if made_by_user:
            out.mkdir()
        with pytest.raises(ValueError, match="line 3"):
            stage(out)
        assert out.is_dir() == made_by_user and (not made_by_user or not any(out.iterdir()))
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError):
        stage(tmp_path / "half", write=True)
    assert sorted(p.name for p in (tmp_path / "half").iterdir()) == [".metrics.json.started", "lengths.png"]
    assert started_record(tmp_path / "half" / "metrics.json").is_file()


def test_evaluate_on_predictions_it_cannot_read_leaves_nothing_behind(demo_run, tmp_path, capsys):
    from polyalign.cli import main

    run, _, _ = demo_run
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "x", "prediction": "ok"}\nnot json\n')
    code = main(["evaluate", "--records", str(run / "data" / "test.jsonl"), "--predictions", str(bad), "--out",
                 str(tmp_path / "eval")])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}:2: Expecting value" in err and "Traceback" not in err, err
    assert not (tmp_path / "eval").exists()


def test_a_path_setting_is_one_setting_however_it_is_spelled(tmp_path, monkeypatch):
    """build's --tokenizer and generate's --checkpoint are recorded absolute (BuildOptions, recorded_path), so
    the same command from another folder or with ./ matches its record; a record written with a relative
    path (before they were recorded absolute) is read relative to the folder the command runs in."""
    from polyalign.core.outputs import check_settings
    from polyalign.core.yaml_config import ConfigError
    from polyalign.inputs.built import BuildOptions

    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert BuildOptions(tokenizer="ckpt").tokenizer == BuildOptions(tokenizer="./ckpt/").tokenizer == \
        str((tmp_path / "ckpt").resolve())
    record = tmp_path / "out" / "manifest.json"
    record.parent.mkdir()
    for saved in ("ckpt", str(tmp_path / "ckpt")):
        record.write_text(json.dumps({"settings": {"tokenizer": saved, "max_length": 64}}))
        for spelled in ("ckpt", "./ckpt", str(tmp_path / "ckpt"), f"../{tmp_path.name}/ckpt"):
            check_settings(record.parent, record, {"tokenizer": spelled, "max_length": 64}, False,
                           paths=["tokenizer"])
    with pytest.raises(ConfigError, match="made with other settings"):  # without `paths`, compared as text
        check_settings(record.parent, record, {"tokenizer": "./ckpt", "max_length": 64}, False)
    (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError, match="tokenizer: .* there"):
        check_settings(record.parent, record, {"tokenizer": "other", "max_length": 64}, False, paths=["tokenizer"])


@pytest.mark.parametrize("method", ["hdpo", "dpo"])
def test_missing_pairs_say_what_makes_them_for_the_method(tmp_path, capsys, method):
    """HDPO's missing RUN/critic/train_pairs.jsonl points at the critic, which writes scored pairs there
    (`polyalign pairs` alone makes unscored ones HDPO refuses); DPO's at making pairs."""
    run = tmp_path / "run"
    run.mkdir()
    assert main(["train", method, "--out", str(tmp_path / "out"), f"init={tmp_path}", f"data.dir={run}"]) == 2
    err = capsys.readouterr().err
    # the path was a default (pairs unset): said, with where it comes from
    assert (f"{run}/critic/train_pairs.jsonl: no such pairs file; pairs is not set, so the critic's scored pairs in "
            "data.dir's critic/ are read; ") in err and "Traceback" not in err
    if method == "hdpo":
        assert (f"HDPO reads pairs the critic scored: make pairs with `polyalign pairs` or `polyalign pairs "
                f"import`, then `polyalign train critic --out {run}/critic pairs=... val_pairs=...` writes them "
                f"scored to {run}/critic/train_pairs.jsonl") in err
    else:
        assert err.rstrip().endswith("make pairs with `polyalign pairs` or `polyalign pairs import` and set pairs= "
                                     "to the file")
        # a user's own pairs given, val_pairs not: its default is said, and where held-out pairs come from
        (tmp_path / "p.jsonl").write_text("")
        argv = ["train", method, "--out", str(tmp_path / "out"), f"init={tmp_path}", f"data.dir={run}",
                f"pairs={tmp_path / 'p.jsonl'}"]
        assert main([*argv, "--print-config"]) == 0
        assert (f"# val_pairs null reads {run}/critic/val_pairs.jsonl (the critic's scored pairs in data.dir): no "
                "such file; the run refuses it") in capsys.readouterr().out
        assert main(argv) == 2
        assert capsys.readouterr().err.rstrip().endswith(
            f"{run}/critic/val_pairs.jsonl: no such pairs file; val_pairs is not set, so the critic's scored pairs "
            "in data.dir's critic/ are read; make pairs with `polyalign pairs` or `polyalign pairs import` and set "
            "val_pairs= to the file (held-out pairs: `polyalign pairs import ... --val-fraction 0.1` writes "
            "NAME.val.jsonl beside its --out, or `polyalign pairs` on RUN/data/val.jsonl)")


def test_a_critic_without_references_says_where_they_come_from(tmp_path, capsys):
    """No data.dir and no references=: the critic says what to give (it printed `None: bucket references
    missing`)."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")
    assert main(["train", "critic", "--out", str(tmp_path / "out"), f"init={tmp_path}", f"pairs={pairs}",
                 f"val_pairs={pairs}"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith("the critic measures each answer against its bucket's human references: set "
                                 "data.dir=RUN (its stats/references.json, from `polyalign stats RUN`) or "
                                 "references=FILE") and "None" not in err


def test_sequences_past_the_models_positions_are_refused_before_anything_loads(built_run, tmp_path, capsys):
    """A checkpoint made for 32 positions (its config.json's max_position_embeddings): SFT on a build of
    64-token rows, DPO and the critic with data.max_length 64, generate's prompt + answer budget and serve's
    context past 32 are each refused naming the file; serve without --max-sequence takes the model's 32."""
    from polyalign.core.errors import GenerationError
    from polyalign.generate.serve import ServeOptions, with_max_sequence

    run, _ = built_run
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 32}))
    limit = f"is longer than the model's 32 positions (max_position_embeddings in {ckpt / 'config.json'}); "
    runs = {
        "sft": ([], f"{run / 'build'}'s max_length 64 {limit}rebuild with a smaller `polyalign build --max-length`"),
        "dpo": (["data.max_length=64"], f"data.max_length 64 {limit}set a smaller data.max_length"),
        "critic": (["data.max_length=64", f"pairs={ckpt}/config.json", f"val_pairs={ckpt}/config.json"],
                   f"data.max_length 64 {limit}set a smaller data.max_length"),
    }
    for method, (extra, refusal) in runs.items():
        assert main(["train", method, "--out", str(tmp_path / method), f"init={ckpt}", f"data.dir={run}",
                     *extra]) == 2, method
        err = capsys.readouterr().err
        assert refusal in err and "Traceback" not in err, (method, err)
    assert main(["generate", "--checkpoint", str(ckpt), "--records", str(run / "data" / "test.jsonl"), "--out",
                 str(tmp_path / "p.jsonl"), "--max-prompt-tokens", "30", "--max-new-tokens", "8"]) == 2
    assert f"--max-prompt-tokens 30 + --max-new-tokens 8 = 38 {limit}lower --max-prompt-tokens or --max-new-tokens" \
        in capsys.readouterr().err and not (tmp_path / "p.jsonl").exists()
    # prompts for another engine are refused alike, and auto budgets' ceiling comes down as generate's does
    # (prompts reads the checkpoint's tokenizer: the build's, beside its config.json)
    shutil.copytree(ckpt, tmp_path / "with_tokenizer")
    shutil.copytree(Path(json.loads((run / "build" / "manifest.json").read_text())["tokenizer"]),
                    tmp_path / "with_tokenizer", dirs_exist_ok=True)
    prompts = ["prompts", "--checkpoint", str(tmp_path / "with_tokenizer"), "--records",
               str(run / "data" / "test.jsonl"), "--limit", "3"]
    assert main([*prompts, "--out", str(tmp_path / "q.jsonl"), "--max-prompt-tokens", "30",
                 "--max-new-tokens", "8"]) == 2
    assert (f"--max-prompt-tokens 30 + --max-new-tokens 8 = 38 {limit}lower --max-prompt-tokens or --max-new-tokens"
            .replace("/ckpt/", "/with_tokenizer/") in capsys.readouterr().err and not (tmp_path / "q.jsonl").exists())
    assert main([*prompts, "--out", str(tmp_path / "q.jsonl"), "--max-prompt-tokens", "20", "--max-new-tokens",
                 "auto", "--budget-records", str(run / "data" / "train.jsonl")]) == 0
    assert ("--budget-ceiling 1024 lowered to 12: the model has 32 positions and --max-prompt-tokens takes 20"
            in capsys.readouterr().out)
    assert max(json.loads(line)["max_tokens"] for line in (tmp_path / "q.jsonl").open()) <= 12
    # --max-new-tokens auto: the budgets' ceiling comes down to the positions the prompt leaves, said
    from polyalign.generate.run import GenerateOptions, fitted_to_positions
    from polyalign.generate.sampling import SamplingConfig

    auto = GenerateOptions(sampling=SamplingConfig(1024), max_prompt_tokens=20, budget_records="train.jsonl")
    fitted, notes = fitted_to_positions(ckpt, auto)
    assert fitted.sampling.max_new_tokens == 12 and notes == [
        "--budget-ceiling 1024 lowered to 12: the model has 32 positions and --max-prompt-tokens takes 20"]
    with pytest.raises(GenerationError, match="--max-prompt-tokens 40 \\+ --budget-ceiling 1024 = 1064 is longer"):
        fitted_to_positions(ckpt, dataclasses.replace(auto, max_prompt_tokens=40))
    assert fitted_to_positions(ckpt, GenerateOptions(sampling=SamplingConfig(8), max_prompt_tokens=24)) == (
        GenerateOptions(sampling=SamplingConfig(8), max_prompt_tokens=24), [])
    assert with_max_sequence(ServeOptions(), ckpt).max_sequence == 32
    assert with_max_sequence(ServeOptions(max_sequence=24), ckpt).max_sequence == 24
    with pytest.raises(GenerationError, match=f"--max-sequence 64 {re.escape(limit)}give a smaller --max-sequence"):
        with_max_sequence(ServeOptions(max_sequence=64), ckpt)
    assert with_max_sequence(ServeOptions(), tmp_path).max_sequence == 2048  # no config.json says otherwise
    # a model trained from scratch on 24-token sequences (its tokenizer_config.json says): served within them by
    # default, as generate keeps its prompts, and said; a longer --max-sequence is served with a note
    from polyalign.generate.serve import context_note

    (ckpt / "tokenizer_config.json").write_text(json.dumps({"polyalign_max_length": 24}))
    assert with_max_sequence(ServeOptions(), ckpt).max_sequence == 24
    assert context_note(ckpt, 24) == (
        f"context: {ckpt} was never trained on a sequence longer than 24 tokens (polyalign_max_length in its "
        "tokenizer_config.json: polyalign trained it, or the model it was trained from, from scratch), so a request's "
        "prompt and answer get 24 tokens, as `generate` keeps them; a longer one is refused with status 400 "
        "(--max-sequence serves more, in positions it never learned)")
    assert with_max_sequence(ServeOptions(max_sequence=30), ckpt).max_sequence == 30
    assert "note: --max-sequence 30: " in context_note(ckpt, 30) and context_note(ckpt, 16) is None
    assert context_note(tmp_path, 2048) is None  # a model that does not say


def test_a_build_recorded_before_truncation_was_an_option_reads_as_left(tmp_path):
    """Builds made before --truncation cut prompts from the left and did not record it: the same options
    match such a record (left is the default), keep_system does not (the rows would differ), and the
    command that makes it again says --truncation only for keep_system."""
    from polyalign.core.yaml_config import ConfigError
    from polyalign.inputs.build import claim_build
    from polyalign.inputs.built import BuildOptions, rebuild_command

    run = tmp_path / "run"
    (run / "build").mkdir(parents=True)
    old = {k: v for k, v in dataclasses.asdict(BuildOptions(max_length=256)).items() if k != "truncation"}
    (run / "build" / "manifest.json").write_text(json.dumps({"settings": old}))
    with claim_build(run, BuildOptions(max_length=256), overwrite=False):
        pass
    with pytest.raises(ConfigError, match="truncation: 'left' there, 'keep_system' now"):
        with claim_build(run, BuildOptions(max_length=256, truncation="keep_system"), overwrite=False):
            pass
    assert rebuild_command(run, {"settings": old}) == f"polyalign build {run} --max-length 256"
    kept = dataclasses.asdict(BuildOptions(max_length=256, truncation="keep_system"))
    assert rebuild_command(run, {"settings": kept}) == \
        f"polyalign build {run} --max-length 256 --truncation keep_system"


def test_sft_on_an_unbuilt_run_names_the_build_command_that_works(tmp_path, capsys):
    """A run with no build and no tokenizer of its own: the suggested command builds with init's tokenizer
    (`polyalign build RUN` alone would look for RUN/tokenizer); with RUN/tokenizer, the plain command."""
    run, init = tmp_path / "my run", tmp_path / "ckpt"
    (run / "data").mkdir(parents=True)
    init.mkdir()
    assert main(["train", "sft", "--out", str(tmp_path / "out"), f"data.dir={run}", f"init={init}"]) == 2
    assert f"missing; run `polyalign build '{run}' --tokenizer {init}` (or the demo's build stage) first" in \
        capsys.readouterr().err
    (run / "tokenizer").mkdir()
    assert main(["train", "sft", "--out", str(tmp_path / "out"), f"data.dir={run}", f"init={init}"]) == 2
    assert f"missing; run `polyalign build '{run}'` (or the demo's build stage) first" in capsys.readouterr().err
    # RUN/data given for RUN: named as prepare's folder, not a run to build (`polyalign build RUN/data` fails)
    for name in ("manifest.json", "train.jsonl"):
        (run / "data" / name).write_text("{}\n")
    assert main(["train", "sft", "--out", str(tmp_path / "out"), f"data.dir={run / 'data'}", f"init={init}"]) == 2
    assert (f"{run / 'data'}: this is prepare's output folder inside a run; give the run itself, data.dir={run}"
            in capsys.readouterr().err)


def test_a_ctrl_c_swallowed_where_python_ignores_exceptions_still_stops_the_stage():
    """A KeyboardInterrupt raised inside a garbage-collector callback (where JAX runs one) is ignored by
    Python; the flag SIGINT also sets makes the next check raise it again."""
    import signal
    import time

    from polyalign.core.interrupts import check_interrupted, interrupts_remembered

    # The command's own starting point (Python's handler, SIGINT not blocked), whatever an earlier test
    # in this worker process left behind.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        with interrupts_remembered():
            # raise_signal delivers to this (the main) thread, whose next bytecode runs the handler; wait
            # for it all the same (up to 10 s), swallowing its own raise wherever it comes.
            deadline, sent = time.monotonic() + 10, False
            with pytest.raises(KeyboardInterrupt):
                while time.monotonic() < deadline:
                    try:
                        if not sent:
                            sent = True
                            signal.raise_signal(signal.SIGINT)
                        time.sleep(0.01)
                    except KeyboardInterrupt:
                        pass  # the handler's raise, swallowed as a garbage-collector callback would
                    check_interrupted()
        check_interrupted()  # outside a command: nothing remembered
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sigterm_before_a_command_handles_it_stops_in_one_line_with_status_143(monkeypatch, capsys):
    """A scheduler's stop (or `kill`) arriving before the training loop takes SIGTERM over (while the data
    loads or the step compiles) ended the process with status 143 and no word. It now stops the command as
    Ctrl-C does, says so once, exits 143 as a killed process would, and leaves SIGTERM as it found it."""
    import os
    import signal
    import time

    from polyalign import cli
    from polyalign.core.interrupts import Terminated, check_interrupted, interrupts_remembered

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        def stopped_while_loading(args):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # interrupted here
            raise AssertionError("SIGTERM did not stop the command")

        monkeypatch.setattr(cli, "_run_generate", stopped_while_loading)
        assert cli.main(["generate", "--checkpoint", "M", "--records", "R.jsonl", "--out", "P.jsonl"]) == 143
        assert capsys.readouterr().err == "polyalign generate: stopped by SIGTERM\n"
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        # a SIGTERM swallowed where Python ignores exceptions is remembered as Ctrl-C is
        with interrupts_remembered():
            try:
                signal.raise_signal(signal.SIGTERM)
                time.sleep(0.01)
            except Terminated:
                pass
            with pytest.raises(Terminated):
                check_interrupted()
        # a handler of the caller's own is left alone
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with interrupts_remembered():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("name, status, said", [("SIGTERM", 143, "stopped by SIGTERM"), ("SIGINT", 130, "interrupted")])
def test_the_program_stopped_by_a_signal_says_so_and_ends_at_once_with_its_status(name, status, said, tmp_path):
    """As a program (`polyalign ...`, `python -m polyalign.cli`): one line and status 143 (SIGTERM) or 130
    (Ctrl-C), ended at once after it, without the interpreter's shutdown (an atexit handler never runs):
    stopped while JAX's backend was starting or its threads ran, that shutdown crashed (status 139)."""
    import signal
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready"
    program = ("import atexit, signal, sys, time\nfrom pathlib import Path\nfrom polyalign import cli\n"
               "signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts it\n"
               "atexit.register(lambda: print('shutdown ran', file=sys.stderr))\n"
               f"def slow(args):\n    Path({str(ready)!r}).write_text('')\n    time.sleep(30)\n"
               "cli._run_generate = slow\n"
               "sys.argv = ['polyalign', 'generate', '--checkpoint', 'M', '--records', 'R.jsonl', '--out', 'P.jsonl']\n"
               "cli.entry()\n")
    process = subprocess.Popen([sys.executable, "-c", program], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(getattr(signal, name))
    assert process.wait(timeout=30) == status
    assert process.stderr.read() == f"polyalign generate: {said}\n"


def test_show_prints_what_training_reads_with_the_trained_tokens_marked(built_run, demo_tokenizer, capsys):
    """`polyalign show`: each example is the build's stored ids decoded, the loss-masked span between the
    markers, its bucket and weight from the manifest; the text is part of the conversation as the
    template renders its record (the build cut it to 64 tokens), the trained span part of the reply and
    its end-of-turn token; --ids prints the stored ids and mask; an unknown record id is one
    line."""
    import numpy as np

    from polyalign.cli import main
    from polyalign.inputs.pipeline import open_split
    from polyalign.inputs.show import TRAINED_CLOSE, TRAINED_OPEN
    from polyalign.tokens.chat import encode_conversation, get_template, record_messages

    run, manifest = built_run
    tokenizer, template = demo_tokenizer[0], get_template(manifest["template"], demo_tokenizer[0])
    records = {r.id: r for r in read_records(run / "data" / "train.jsonl")}
    source = open_split(run, "train")
    cut = lost = 0
    for index in (0, 1, 2, len(source) - 1):  # every demo example is over 64 tokens whole (a test at 192 shows one
        # that is not: tests/test_training.py)
        example = source[index]
        record_id = _id(example)
        assert main(["show", str(run), "--id", record_id, "--ids"]) == 0
        block = capsys.readouterr().out.strip().split("\n")
        ids, mask = np.asarray(example["input_ids"]), np.asarray(example["loss_mask"])
        assert block[0] == (f"== train example {index + 1} of {len(source)}: {record_id} (bucket "
                            f"{manifest['buckets'][int(example['bucket'])]}, weight {float(example['weight']):.3f}; "
                            f"{len(ids)} tokens, {int(mask.sum())} trained between {TRAINED_OPEN} {TRAINED_CLOSE})")
        assert block[-2:] == [f"ids: {' '.join(map(str, ids.tolist()))}", f"trained: {''.join(map(str, mask))}"]
        # a line under the head says what the cut took: only where the record encodes to more than 64 tokens
        whole = encode_conversation(template, tokenizer, record_messages(records[record_id], "context")).ids
        said = block[1] if block[1].startswith("   cut to --max-length 64 by --truncation left: ") else None
        assert (said is not None) == (len(whole) > 64)
        text = "\n".join(block[1 + (said is not None):-2])
        if said:  # the prompt lost its start where the example is not how the whole one begins; the reply its end
            assert ("opens inside a turn" in said) == (whole[:len(ids)].tolist() != ids.tolist())
            assert ("its reply cut short" in said) == (not text.endswith(f"<|im_end|>{TRAINED_CLOSE}"))
            # a lost system message says why the truncation lost it (keep_system's "over half" read as a mystery)
            if "lost its opening system message" in said:
                lost += 1
                assert ("lost its opening system message, whole or in part (--truncation left cuts a prompt from its "
                        "start, the system message first; --truncation turns would keep it where it and the last "
                        "question fit the prompt's share)") in said, said
            cut += 1
        plain = text.replace(TRAINED_OPEN, "").replace(TRAINED_CLOSE, "")
        bos = "<s>" if ids[0] == tokenizer.bos_id else ""  # shown as its token where the example keeps it
        assert plain == bos + tokenizer.decode(ids.tolist())
        record = records[record_id]
        assert plain.strip() in template.render(record_messages(record, "context"))
        assert text.count(TRAINED_OPEN) == 1 and text.endswith(TRAINED_CLOSE)
        assert text[text.index(TRAINED_OPEN) + 1:-1].strip() in f"{record.response}<|im_end|>"
    assert cut == 4 and lost > 0
    assert main(["show", str(run), "--limit", "2", "--split", "val"]) == 0
    assert capsys.readouterr().out.count("== val example ") == 2
    assert main(["show", str(run), "--id", "no-such-record"]) == 2
    assert ("no train example of record 'no-such-record' (build keeps the train and val splits: --split val reads "
            "the val split") in capsys.readouterr().err


def _id(example) -> str:
    return example["id"].decode() if isinstance(example["id"], bytes) else example["id"]


def test_show_marks_a_span_inside_a_sentence_without_losing_its_space(demo_tokenizer):
    """A trained span that starts mid-sentence (a SentencePiece piece carrying its space): the marked text
    less its markers is the whole example decoded, for every start and end of the span."""
    import numpy as np

    from polyalign.inputs.show import TRAINED_CLOSE, TRAINED_OPEN, marked_text

    tokenizer = demo_tokenizer[0]
    text = "The museum is in Ulus Square. 博物馆位于乌鲁斯广场。"
    ids = np.asarray(tokenizer.encode(text))
    whole = tokenizer.decode(ids.tolist())
    for start in range(1, len(ids) - 1):
        for end in (start + 1, len(ids)):
            mask = np.zeros(len(ids), np.uint8)
            mask[start:end] = 1
            marked = marked_text(tokenizer, ids, mask)
            assert marked.replace(TRAINED_OPEN, "").replace(TRAINED_CLOSE, "") == whole, (start, end, marked)
            assert marked.count(TRAINED_OPEN) == 1
    # a leading BOS (as a template writes it, the first of the stored ids) is shown as its token: decoding drops it
    assert tokenizer.bos_token == "<s>" and not tokenizer.decode([tokenizer.bos_id, *ids.tolist()]).startswith("<s>")
    mask = np.zeros(len(ids) + 1, np.uint8)
    mask[-3:] = 1
    marked = marked_text(tokenizer, np.asarray([tokenizer.bos_id, *ids.tolist()]), mask)
    assert marked.startswith("<s>The museum") and marked.count("<s>") == 1 and marked.endswith(TRAINED_CLOSE)
