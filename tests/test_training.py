"""The training engine: the built dataset, the input order, exact global weighting, resume, several
devices and several processes."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from polyalign.data.bucketing import WEIGHT_PRESETS, bucket_weights
from polyalign.data.records import read_records
from polyalign.inputs import pipeline
from polyalign.tokens.chat import encode_conversation, get_template, record_messages, system_prompt
from polyalign.train.metrics import read_metrics
from polyalign.train.run import train as train_sft
from tests.cli_runs import (
    ADAPTIVE_FOUR_DEVICES,
    LONGER,
    UNEVEN_EVAL,
    checkpoint_begun,
    sft_config,
    start_cli,
    start_two_processes,
    train_args,
    wait_ok,
)
from tests.conftest import REPO, TINY_MODEL
from tests.train_checks import first_batch, gradients_of_first_batch

WORKER = REPO / "tests" / "train_worker.py"


def test_build_stores_what_the_template_encodes(built_run, demo_tokenizer):
    run, manifest = built_run
    records = {r.id: r for r in read_records(run / "data" / "train.jsonl")}
    assert manifest["splits"]["train"]["examples"] == len(records)
    source = pipeline.open_split(run, "train")
    assert len(source) == len(records)
    weights = manifest["bucket_weights"]
    counts = manifest["train_bucket_counts"]
    # Bucket-SFT weights: the scheme's (the default preset), from the train counts.
    assert (manifest["weight_options"]["source"].startswith("scheme ")
            and manifest["weight_options"]["temperature"] == 0.5)
    expected = bucket_weights(counts, WEIGHT_PRESETS["default"])
    for bucket in counts:
        assert weights[bucket] == pytest.approx(expected[bucket])
    assert any("absent from val" in line for line in manifest["warnings"])
    for index in (0, 17, len(source) - 1):
        example = source[index]
        record = records[example["id"].decode()]
        expected = encode_conversation(get_template("polyalign"), demo_tokenizer[0], record_messages(record, "context"),
                                       cutoff=64)
        np.testing.assert_array_equal(example["input_ids"], expected.ids)
        np.testing.assert_array_equal(example["loss_mask"].astype(bool), expected.loss_mask)
        assert manifest["buckets"][example["bucket"]] == record.bucket_id
        assert example["weight"] == pytest.approx(weights[record.bucket_id])
    # the examples whose cut took their profile prompt's start (left truncation), counted as they encode
    encoded = [encode_conversation(get_template("polyalign"), demo_tokenizer[0], record_messages(r, "context"),
                                   cutoff=64) for r in records.values()]
    train = manifest["splits"]["train"]
    assert train["system_cut"] == sum(e.system_cut for e in encoded) > 0
    assert train["truncated"] == sum(e.truncated for e in encoded) >= train["system_cut"]
    # left cuts by tokens lose no whole turns only, and each is counted by what its kept ids open with, read off
    # the decoded text: inside a turn unless a turn's header comes first (a cut at the newline between two turns,
    # or of the BOS alone, was counted inside a turn too), its system message lost unless it stands whole
    assert train["mid_turn"] == sum(e.mid_turn for e in encoded) > 0 and train["turns_dropped"] == 0
    tokenizer = demo_tokenizer[0]
    for record, e in zip(records.values(), encoded):
        if e.truncated:
            text = tokenizer.decode(e.ids.tolist())
            assert e.mid_turn == (not text.lstrip().startswith("<|im_start|>")), text[:80]
            assert e.system_cut == (f"<|im_start|>system\n{system_prompt(record, 'context')}<|im_end|>" not in text)
    assert sum(e.truncated and not e.mid_turn for e in encoded) > 0  # cuts that open between turns, the case
    # examples the cut left nothing to train on are counted, and warned about where there are any
    assert train["untrained"] == sum(not e.loss_mask.any() for e in encoded)
    said = [w for w in manifest["warnings"] if "keep no token to train on" in w]
    assert len(said) == sum(split["untrained"] > 0 for split in manifest["splits"].values())
    assert "tensorflow" not in sys.modules  # read and written without TensorFlow


def test_a_build_with_turns_truncation_stores_whole_turn_cuts_and_says_where_cuts_open(demo_run, demo_tokenizer,
                                                                                        tmp_path, capsys):
    """`build --truncation turns`: every example is what encode_conversation gives with it, the counts of
    examples that lost whole turns and of those still cut inside a turn are theirs and said on the split's
    line, and fewer examples lose their profile prompt than with left at the same length."""
    from polyalign.cli import main
    from tests.conftest import first_records

    run = tmp_path / "run"
    first_records(demo_run[0], run / "data", {"train": 400, "val": 60, "test": 60})
    tokenizer = demo_tokenizer[0]
    assert main(["build", str(run), "--tokenizer", str(tokenizer.path.parent), "--max-length", "192",
                 "--truncation", "turns", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    manifest = json.loads((run / "build" / "manifest.json").read_text())
    records = {r.id: r for r in read_records(run / "data" / "train.jsonl")}
    source = pipeline.open_split(run, "train")
    encoded = {}
    for index in range(len(source)):
        example = source[index]
        record = records[example["id"].decode()]
        encoded[record.id] = expected = encode_conversation(get_template("polyalign"), tokenizer,
                                                            record_messages(record, "context"), cutoff=192,
                                                            truncation="turns")
        np.testing.assert_array_equal(example["input_ids"], expected.ids)
        np.testing.assert_array_equal(example["loss_mask"].astype(bool), expected.loss_mask)
    assert sorted(encoded) == sorted(records)
    train = manifest["splits"]["train"]
    dropped = sum(e.turns_dropped > 0 for e in encoded.values())
    inside = sum(e.mid_turn for e in encoded.values())
    replies = sum(e.reply_cut for e in encoded.values())
    assert (train["turns_dropped"], train["mid_turn"], train["reply_cut"]) == (dropped, inside, replies)
    assert dropped > 20 and inside > 0 and replies > 0
    whole = sum(e.system_left_out for e in encoded.values())
    assert train["system_left_out"] == whole
    left_out = f" ({whole} left out whole, rather than keep its last tokens)" if whole else ""
    # where the cut examples open, each one counted once; the replies cut; the system messages cut
    assert (f"train: {len(records)} examples, {train['tokens']} tokens ({train['target_tokens']} trained on), "
            f"{train['truncated']} truncated to 192 ({dropped} lost whole turns; {train['truncated'] - inside} open at "
            f"a turn's start, {inside} inside a turn; {replies} replies cut short, trained without their end-of-turn "
            f"token; {train['system_cut']} lost their opening system message, whole or in part{left_out}, which "
            "holds the "
            "profile prompt: it and the last question together were over the prompt's share") in out
    # over 5% of them: a warning that says why turns did not keep it
    assert train["system_cut"] > 0.05 * len(records)
    assert ("lost their opening system message, whole or in part, the profile prompt Bucket-SFT conditions on: "
            "it and their last question together are over the prompt's share of --max-length, and a cut inside a "
            "turn keeps the system message only within half of the share; raise --max-length") in err
    # the tokenizer polyalign trained on the records alone: the option that learns the prompt too is named
    assert "a tokenizer trained with `tokenizer train --system-prompts` spells the English profile prompt" in err
    left = [encode_conversation(get_template("polyalign"), tokenizer, record_messages(r, "context"), cutoff=192)
            for r in records.values()]
    assert train["system_cut"] < sum(e.system_cut for e in left) / 4
    assert "truncation turns" in out
    # `show` says what the cut took from each example it cut, and nothing of one it left whole, whatever its
    # length: the messages a turns cut dropped are those the example's text no longer holds
    template = get_template("polyalign")
    whole = {i: encode_conversation(template, tokenizer, record_messages(r, "context")) for i, r in records.items()}
    chosen = [next(i for i, e in encoded.items() if e.turns_dropped and not e.mid_turn),
              next(i for i, e in encoded.items() if e.mid_turn),
              next(i for i, e in encoded.items() if not e.truncated and len(e.ids) < 192)]
    chosen += [i for i, e in whole.items() if len(e.ids) == 192][:1]  # exactly as long as the cutoff: not cut
    assert main(["show", str(run), *[f"--id={i}" for i in chosen]]) == 0
    blocks = capsys.readouterr().out.strip().split("\n\n== ")
    assert len(blocks) == len(chosen)
    for record_id, block in zip(chosen, blocks):
        lines = block.split("\n")
        said = lines[1] if lines[1].startswith("   cut to --max-length 192 by --truncation turns: ") else None
        assert (said is not None) == (len(whole[record_id].ids) > 192), (record_id, said)
        if said is None:
            continue
        messages = record_messages(records[record_id], "context")
        if encoded[record_id].mid_turn:  # cut inside the last question: everything before it went
            dropped = max(i for i, m in enumerate(messages) if m.role == "user") - 1
        else:  # the messages left between the system one and the reply
            dropped = len(messages) - 2 - ("\n".join(lines[2:]).count("<|im_start|>") - 2)
        assert (f"lost its {dropped} oldest of {len(messages) - 2} earlier messages" in said) == (dropped > 0)
        assert ("opens inside a turn" in said) == encoded[record_id].mid_turn


def test_build_weights_come_from_the_scheme_unless_overridden(built_run):
    from polyalign.inputs.build import build_weights

    run, _ = built_run
    scheme_weights, source = build_weights(run, {})
    assert scheme_weights == WEIGHT_PRESETS["default"] and source.startswith("scheme ") and "overridden" not in source
    method, source = build_weights(run, {"preset": "method"})
    assert method == WEIGHT_PRESETS["method"] and source == "preset method"
    # a preset with options of its own says so, as the scheme's does (it read "preset method" whatever followed)
    clipped, source = build_weights(run, {"preset": "method", "clip": [0.5, 2.0], "borrow_below": 5})
    assert tuple(clipped.clip) == (0.5, 2.0) and clipped.borrow_below == 5
    assert source == "preset method, overridden: borrow_below, clip"
    hotter, source = build_weights(run, {"temperature": 1.0, "clip": None})
    assert (hotter.temperature, hotter.clip, hotter.borrow_below) == (1.0, None, 20)
    assert source.endswith("overridden: clip, temperature")


def test_batches_shift_targets_and_pad():
    example = {"input_ids": np.array([5, 6, 7, 8]), "loss_mask": np.array([0, 0, 1, 1]), "weight": 2.5, "bucket": 3}
    arrays = pipeline.example_arrays(example, 6, pad_id=0)
    assert arrays["input_ids"].tolist() == [5, 6, 7, 0, 0, 0]
    assert arrays["targets"].tolist() == [6, 7, 8, 0, 0, 0]
    assert arrays["loss_mask"].tolist() == [0, 1, 1, 0, 0, 0]
    assert arrays["weight"] == 2.5 and arrays["bucket"] == 3 and arrays["valid"]
    assert "segment_ids" not in arrays  # one example a row: causal attention alone (packed rows carry them)
    filler = pipeline.example_arrays(None, 6, pad_id=0)
    assert not filler["valid"] and filler["weight"] == 0 and not filler["loss_mask"].any()


def test_processes_split_each_micro_batch_into_contiguous_slices():
    whole = pipeline.Layout(global_batch=8, micro_batches=2)
    halves = [pipeline.Layout(8, 2, process_index=p, process_count=2) for p in range(2)]
    # Micro-batch 0 is positions 0-3: process 0 reads 0, 1 and process 1 reads 2, 3; then 4-7.
    assert [halves[0].global_position(k) for k in range(4)] == [0, 1, 4, 5]
    assert [halves[1].global_position(k) for k in range(4)] == [2, 3, 6, 7]
    assert [whole.global_position(k) for k in range(8)] == list(range(8))


def test_epochs_visit_every_example_once_and_the_iterator_resumes(built_run):
    run, manifest = built_run
    source = pipeline.open_split(run, "val")
    n = len(source)
    order = pipeline._EpochPermutations(n, seed=3)
    assert sorted(order(p) for p in range(n)) == list(range(n))
    assert [order(p) for p in range(n)] != [order(n + p) for p in range(n)]  # reshuffled each epoch
    dataset = pipeline.train_batches(source, pipeline.Layout(4, 2), 5, 64, manifest["pad_id"], seed=3)
    straight = pipeline.iterate(dataset)
    batches = [next(straight) for _ in range(5)]
    assert batches[0]["input_ids"].shape == (2, 2, 64)
    resumed = pipeline.iterate(dataset)
    next(resumed), next(resumed)
    state = resumed.get_state()
    fresh = pipeline.iterate(dataset)
    fresh.set_state(state)
    for expected in batches[2:]:
        np.testing.assert_array_equal(next(fresh)["input_ids"], expected["input_ids"])


def _grads(path):
    arrays = load_file(str(path))
    return {k: v for k, v in arrays.items() if k != "loss"}, float(arrays["loss"][0])


def test_global_weighting_is_exact_across_micro_batches(built_run, tmp_path):
    run, manifest = built_run
    batch, _ = first_batch(run, 8, 1)
    weights = batch["weight"][0]
    assert weights.max() / weights.min() > 2  # bucket weights really differ in this batch
    results = {m: gradients_of_first_batch(run, tmp_path / f"m{m}.safetensors", m, 8) for m in (1, 2, 4)}
    for m in (2, 4):
        assert abs(float(results[m]["loss"][0]) - float(results[1]["loss"][0])) <= 1e-5
        for name, value in results[1].items():
            np.testing.assert_allclose(results[m][name], value, atol=1e-5, err_msg=f"{m} micro-batches: {name}")
    # The reference normalised inside each micro-batch; with unequal weights that objective differs.
    assert _independent_objective(run, batch, manifest) == pytest.approx(float(results[1]["loss"][0]), abs=1e-5)


def _independent_objective(run, batch, manifest):
    """sum_i w_i l_i / sum_i w_i recomputed in NumPy from the model's logits."""
    import jax.numpy as jnp

    from polyalign.model import create_model
    from tests.conftest import tiny_model_config

    model = create_model(tiny_model_config(manifest["vocab_size"]), seed=0)
    ids, targets, mask = batch["input_ids"][0], batch["targets"][0], batch["loss_mask"][0]
    logits = np.asarray(model(jnp.asarray(ids)), np.float64)
    logp = (logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    per_example = (nll * mask).sum(-1) / np.maximum(mask.sum(-1), 1)
    w = batch["weight"][0] * batch["valid"][0]
    return float((w * per_example).sum() / w.sum())


@pytest.mark.slow
def test_eight_devices_give_the_same_gradient_as_one(built_run, tmp_path):
    run, _ = built_run
    one = gradients_of_first_batch(run, tmp_path / "one.safetensors", 2, 16)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for sizes in (("8", "1", "1"), ("2", "2", "2")):
        out = tmp_path / f"eight-{'-'.join(sizes)}.safetensors"
        subprocess.run([sys.executable, str(WORKER), "grads", str(run), str(out), "--devices", "8", "--data", sizes[0],
                        "--fsdp", sizes[1], "--tensor", sizes[2], "--micro", "2", "--global-batch", "16"],
                       check=True, env=env, timeout=300)
        grads, loss = _grads(out)
        assert abs(loss - float(one["loss"][0])) <= 1e-5
        for name, value in grads.items():
            np.testing.assert_allclose(value, one[name], atol=1e-5, err_msg=f"mesh {sizes}: {name}")


def test_adaptive_weights_update_by_hand():
    from polyalign.train.sft import SftObjective

    counts = np.array([10.0, 30.0, 60.0, 0.0])  # the last bucket is val-only
    method = counts.sum() / (3 * np.where(counts > 0, counts, 1))  # N / (K n_b): equal mass, q0 uniform
    objective = SftObjective(4, "adaptive", train_counts=counts, initial_weights=method, step_size=0.5, floor=0.2)
    q0 = objective.initial_state()["bucket_q"]
    np.testing.assert_allclose(q0, [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-6)
    # weights w_b = q_b / p_b start at the build's weights
    np.testing.assert_allclose(np.asarray(objective.adaptive_weights(jnp.asarray(q0)))[:3], method[:3], rtol=1e-6)
    # a batch with buckets 0 and 1 only: mean losses 3 and 1, excess +1 and -1; bucket 2 unchanged
    sums = {"bucket_loss": jnp.array([6.0, 4.0, 0.0, 0.0]), "bucket_examples": jnp.array([2.0, 4.0, 0.0, 0.0])}
    q = np.asarray(objective.update_state({"bucket_q": jnp.asarray(q0)}, sums)["bucket_q"])
    raw = np.array([np.exp(0.5), np.exp(-0.5), 1.0, 0.0]) / 3
    expected = 0.8 * raw / raw.sum() + 0.2 * np.array([1, 1, 1, 0]) / 3
    np.testing.assert_allclose(q, expected, rtol=1e-6)
    assert q[0] > q0[0] > q[1] and q.sum() == pytest.approx(1.0)


def test_adaptive_weights_stay_the_builds_where_losses_do_not_differ():
    """The floor mixes q with the distribution it started from: with equal losses, however many steps, every
    weight stays the build's (a mixture with the uniform distribution would carry a 6-record bucket's weight
    from 1 toward N / (K n_b) = 104); a bucket whose loss stays above the others' rises, and none falls below
    floor times its starting share."""
    from polyalign.train.sft import SftObjective

    counts = np.array([6.0, 400.0, 2000.0, 1959.0])
    build = np.array([1.0, 2.5, 1.0, 0.8])  # clipped Bucket-SFT weights
    objective = SftObjective(4, "adaptive", train_counts=counts, initial_weights=build, step_size=0.1, floor=0.1)
    state = objective.initial_state()
    q0 = np.asarray(state["bucket_q"])
    even = {"bucket_loss": jnp.array([0.0, 4.0, 8.0, 6.0]), "bucket_examples": jnp.array([0.0, 2.0, 4.0, 3.0])}
    for _ in range(50):
        state = objective.update_state(state, even)
    weights = np.asarray(objective.adaptive_weights(jnp.asarray(state["bucket_q"])))
    np.testing.assert_allclose(weights / weights[2], build / build[2], rtol=1e-4)
    hard = {"bucket_loss": jnp.array([0.0, 12.0, 8.0, 6.0]), "bucket_examples": jnp.array([0.0, 2.0, 4.0, 3.0])}
    for _ in range(200):
        state = objective.update_state(state, hard)
        assert np.all(np.asarray(state["bucket_q"]) >= 0.1 * q0 * (1 - 1e-5))
    q = np.asarray(state["bucket_q"])
    assert q[1] > 0.5 and q[1] / q0[1] > 2  # bucket 1's loss stays highest: it takes most of the objective


def test_adaptive_weights_are_exact_under_micro_batching(built_run):
    """Denominators and numerators take the same per-bucket weights from the trainer's state, so the
    gradient of a global batch is the same for 1 and 4 micro-batches with a non-uniform q."""
    from polyalign.mesh import parallel
    from polyalign.model import create_model
    from polyalign.train.config import LoopConfig, OptimizerConfig
    from polyalign.train.sft import SftObjective
    from polyalign.train.trainer import Trainer
    from tests.conftest import tiny_model_config

    run, manifest = built_run
    buckets = manifest["buckets"]
    counts = np.array([manifest["train_bucket_counts"].get(b, 0) for b in buckets], np.float64)
    results = []
    for micro in (1, 4):
        batch, _ = first_batch(run, 8, micro)
        objective = SftObjective(len(buckets), "adaptive", train_counts=counts,
                                 initial_weights=np.linspace(0.5, 3.0, len(buckets)))
        trainer = Trainer(create_model(tiny_model_config(manifest["vocab_size"]), seed=0), objective, OptimizerConfig(),
                          LoopConfig(steps=1, global_batch=8, micro_batches=micro), parallel.make_mesh())
        grads, loss, _ = trainer.gradients(batch)
        results.append((float(loss), jax.tree.leaves(jax.device_get(grads))))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_adaptive_weights_resume_exactly(built_run, tmp_path):
    run, _ = built_run
    adaptive = ["weighting=adaptive", "adaptive.step_size=1.0"]
    train_sft(sft_config(run, 8, *adaptive), tmp_path / "straight", progress=False)
    train_sft(sft_config(run, 8, *adaptive, "train.stop_at=3"), tmp_path / "resumed", progress=False)
    train_sft(sft_config(run, 8, *adaptive), tmp_path / "resumed", progress=False)
    straight = {r["step"]: r for r in read_metrics(tmp_path / "straight") if "loss" in r}
    again = {r["step"]: r for r in read_metrics(tmp_path / "resumed") if "loss" in r}
    first, last = straight[1]["adaptive_weights"], straight[8]["adaptive_weights"]
    assert max(abs(last[b] - first[b]) for b in first) > 0.01  # the weights moved
    for step in range(4, 9):  # after the restart: the same weights (restored from the checkpoint) and losses
        assert again[step]["adaptive_weights"] == pytest.approx(straight[step]["adaptive_weights"], abs=1e-6), step
        assert abs(again[step]["loss"] - straight[step]["loss"]) <= 1e-5, step


def test_resume_continues_exactly(built_run, tmp_path, monkeypatch):
    from tests.transformers_stand_in import stand_in_transformers

    # transformers (dev-only) stood in for: the export's tokenizer check reads OUT/model as it would
    monkeypatch.setitem(sys.modules, "transformers", stand_in_transformers(split_digits=False))
    run, _ = built_run
    train_sft(sft_config(run, 12), tmp_path / "straight", progress=False)
    stopped = train_sft(sft_config(run, 12, "train.stop_at=6"), tmp_path / "resumed", progress=False)
    assert stopped["end_step"] == 6 and stopped["stopped_early"]
    assert not (tmp_path / "resumed" / "model").exists()
    resumed = train_sft(sft_config(run, 12), tmp_path / "resumed", progress=False)
    assert resumed["start_step"] == 6 and resumed["end_step"] == 12
    # the same command once more: nothing left to train, and the summary still says how it ended; the export,
    # already this config's at this step, is kept as it is (it was rewritten, a new checkpoint to its readers)
    exported = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "resumed" / "model").iterdir()}
    again = train_sft(sft_config(run, 12), tmp_path / "resumed", progress=False)
    assert again["start_step"] == again["end_step"] == 12 and again["last"] == resumed["last"]
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "resumed" / "model").iterdir()} == exported
    assert again["model"] == resumed["model"] and again["tokenizer_check"] == resumed["tokenizer_check"]
    straight = {r["step"]: r for r in read_metrics(tmp_path / "straight")}
    again = {r["step"]: r for r in read_metrics(tmp_path / "resumed")}
    assert sorted(again) == list(range(1, 13))
    for step in range(7, 13):
        assert abs(again[step]["loss"] - straight[step]["loss"]) <= 1e-5, step
        assert again[step]["lr"] == pytest.approx(straight[step]["lr"])
    assert again[12]["val_loss"] == pytest.approx(straight[12]["val_loss"], abs=1e-5)
    assert (tmp_path / "resumed" / "model" / "model.safetensors").is_file()
    # the model folder keeps its run's config and invocations: copied out of the run, it still says how it trained
    from polyalign.core.paths import TRAINING_RECORD
    record = json.loads((tmp_path / "resumed" / "model" / TRAINING_RECORD).read_text())
    assert record["config"] == json.loads((tmp_path / "resumed" / "config.json").read_text())
    assert record["segments"][0] == {**record["segments"][0], "start_step": 0, "end_step": 6, "steps": 12}
    # The export names the profile values its training data held (the build counted them), and the card lists them.
    manifest = json.loads((run / "build" / "manifest.json").read_text())
    held = {key: sorted({getattr(r, field) for r in read_records(run / "data" / "train.jsonl")})
            for key, field in (("family", "family"), ("track", "track"), ("style", "style"), ("length", "length_bin"))}
    counted = dict(manifest["train_profile_values"])
    combinations = counted.pop("combinations")
    assert {key: sorted(counts) for key, counts in counted.items()} == held
    assert sum(counted["family"].values()) == manifest["splits"]["train"]["examples"]
    # and the combinations of them it held, counted: the keys are not independent (assistant is single-turn here)
    records = read_records(run / "data" / "train.jsonl")
    together = Counter((r.family, r.track, r.style, r.length_bin) for r in records)
    assert {(c["family"], c["track"], c["style"], c["length"]): c["examples"] for c in combinations} == together
    assert [c["examples"] for c in combinations] == sorted(together.values(), reverse=True)
    config = json.loads((tmp_path / "resumed" / "model" / "tokenizer_config.json").read_text())
    assert config["polyalign_profile_values"] == {key: held[key] for key in ("family", "track", "style")}
    three = Counter()
    for (family, track, style, _), n in together.items():
        three[(family, track, style)] += n
    assert [tuple(c.values()) for c in config["polyalign_profile_combinations"]] == sorted(
        three, key=lambda c: (-three[c], c))
    assert len(three) < len(held["family"]) * len(held["track"]) * len(held["style"])
    # trained from scratch: the longest sequence it ever trained on is the build's length
    assert config["polyalign_max_length"] == manifest["options"]["max_length"] == 64
    card = (tmp_path / "resumed" / "model" / "README.md").read_text()
    assert f"| style | {', '.join(held['style'])} |" in card and "It refuses a profile named in part" in card
    # in how many training examples the profile prompt stood whole: the build's counts (64 tokens cut many)
    train = manifest["splits"]["train"]
    assert train["system_cut"] > 0 and (
        f"The profile prompt was whole in {train['examples'] - train['system_cut']} of {train['examples']} training "
        f"examples; {train['system_cut']} lost it, whole or in part, to --truncation left (long conversations cut to "
        "fit), so the model also read conversations without it; without the variables the template writes "
        "none.") in card
    # the export read back as transformers loads it: polyalign's SentencePiece model as tokenizer.json, the same ids
    check = json.loads((tmp_path / "resumed" / "summary.json").read_text())["tokenizer_check"]
    assert check["checked"] and check["differing"] == 0 and check["probes"] > 100, check
    assert card.endswith(f"reads this folder's tokenizer with the ids training used, on all {check['probes']} probe "
                         "texts of the training data.\n") and card.count("## Tokenizer check") == 1
    # Weighting and per-bucket logging.
    record = straight[12]
    assert record["val_by_bucket"] and record["train_by_bucket"] and record["examples"] == 8  # unpacked: the batch
    untrained = set(record.get("val_untrained_buckets", []))  # the worst is of the buckets training saw
    assert record["val_worst_bucket"] == max(v for b, v in record["val_by_bucket"].items() if b not in untrained)
    assert record["val_by_bucket"][record["val_worst_bucket_id"]] == record["val_worst_bucket"]
    assert list((tmp_path / "straight" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_two_processes_match_one_process_with_four_devices(built_run, tmp_path):
    """12 steps, validation after 6 and 12 in uneven batches; then one of two processes SIGKILLed after
    step 8: the other ends by itself with one line naming it, the last committed checkpoint and the
    command; the checkpoint resumes on one process with four devices to the same losses (two processes
    resuming: test_faults.py)."""
    import re
    import signal
    import time

    run, _ = built_run
    wait_ok([start_cli(train_args(run, tmp_path / "one", "parallel.data=4", *UNEVEN_EVAL, *LONGER), {}, devices=4)])
    wait_ok(start_two_processes(run, tmp_path / "two", *UNEVEN_EVAL, *LONGER))
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == list(range(1, 13))
    print(f"\n2 processes vs 1: max |dloss| {max(abs(a['loss'] - b['loss']) for a, b in zip(one, two)):.2e}")
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
    assert "val_loss" in two[5] and abs(one[5]["val_loss"] - two[5]["val_loss"]) <= 1e-5
    assert abs(one[-1]["val_loss"] - two[-1]["val_loss"]) <= 1e-5
    # the same command again on the finished run: both processes agree that OUT/model is already its export
    exported = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "two" / "model").iterdir()}
    again = wait_ok(start_two_processes(run, tmp_path / "two", *UNEVEN_EVAL, *LONGER))
    assert f"{tmp_path / 'two' / 'model'}: already this run's export at step 12, kept as it is" in again[0]
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "two" / "model").iterdir()} == exported

    lost = tmp_path / "lost"
    workers = start_two_processes(run, lost, *UNEVEN_EVAL, *LONGER, "train.peer_timeout=5")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not checkpoint_begun(lost, 6):  # checkpoint 3 is committed by then
        time.sleep(0.1)
    # start_cli runs the command under timeout(1): the process to kill is its child
    child = int(Path(f"/proc/{workers[1].pid}/task/{workers[1].pid}/children").read_text().split()[0])
    os.kill(child, signal.SIGKILL)
    killed = time.monotonic()
    survivor = workers[0].communicate(timeout=120)[0]
    workers[1].communicate()
    assert workers[0].returncode == 4, survivor[-3000:]
    assert time.monotonic() - killed < 60
    last = survivor.strip().splitlines()[-1]
    assert last.startswith("polyalign: process 0 stops: process 1 of 2 is gone"), survivor[-3000:]
    committed = int(re.search(r"the last committed checkpoint is step (\d+) \(", last).group(1))
    assert committed in (3, 6) and f"({lost / 'checkpoints' / str(committed)})" in last
    assert "resume by running the same command on every process: polyalign train sft" in last
    assert last.endswith("(a host lost for good: on the processes left, their POLYALIGN_NUM_PROCESSES and ids set to "
                         "them; a checkpoint resumes on any number)")
    # the survivor carries on alone (the host lost for good): a checkpoint of two processes resumes on one
    resumed_output = wait_ok([start_cli(train_args(run, lost, "parallel.data=4", *UNEVEN_EVAL, *LONGER,
                                                   "train.peer_timeout=5"), {}, devices=4)])[0]
    assert f"resumed from step {committed}" in resumed_output
    resumed = {r["step"]: r for r in read_metrics(lost)}
    for a in one[committed:]:
        assert abs(resumed[a["step"]]["loss"] - a["loss"]) <= 1e-5, a["step"]
    assert abs(resumed[12]["val_loss"] - one[-1]["val_loss"]) <= 1e-5


@pytest.mark.slow
def test_a_checkpoint_restores_onto_a_different_mesh(built_run, adaptive_four_device_run, tmp_path):
    """With adaptive bucket weights, so that their state is restored onto the new mesh too: stopped
    after step 3 on mesh (4,1,1), resumed on (1,2,2), against the session's straight run on (4,1,1)."""
    run, _ = built_run
    wait_ok([start_cli(train_args(run, tmp_path / "moved", *ADAPTIVE_FOUR_DEVICES, "train.stop_at=3"), {}, devices=4)])
    output = wait_ok([start_cli(train_args(run, tmp_path / "moved", *ADAPTIVE_FOUR_DEVICES, "parallel.data=1",
                                           "parallel.fsdp=2", "parallel.tensor=2"), {}, devices=4)])[0]
    assert "trained to step 6 (3 steps this run)" in output  # the summary's time is the resumed run's
    # what the run is about to do, before it does it: on the new mesh
    assert ("polyalign: training sft for 6 steps, global batch 8 in 1 micro-batch, on 4 cpu devices (data 1, fsdp 2, "
            "tensor 2), computing in float32; learning rate 3.0e-03, 1 warmup step, cosine to 3.0e-04; resuming at "
            f"step 3 (OUT/checkpoints) of a run that started from scratch (model.preset {TINY_MODEL}) -> "
            f"{tmp_path / 'moved'}") in output
    assert "note: the run's length changed" not in output  # stopped by train.stop_at: the same 6-step schedule
    straight, moved = read_metrics(adaptive_four_device_run), read_metrics(tmp_path / "moved")
    assert [r["step"] for r in moved] == list(range(1, 7))
    print(f"\nmesh (4,1,1) -> (1,2,2) resume: max |dloss| "
          f"{max(abs(a['loss'] - b['loss']) for a, b in zip(straight[3:], moved[3:])):.2e}")
    for a, b in zip(straight[3:], moved[3:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4, (a["step"], a["loss"], b["loss"])
        # float32 sums in another order on another mesh: equal to the last few bits
        assert b["adaptive_weights"] == pytest.approx(a["adaptive_weights"], rel=1e-5), a["step"]
    assert straight[-1]["adaptive_weights"] != straight[0]["adaptive_weights"]  # they moved
    summary = json.loads((tmp_path / "moved" / "summary.json").read_text())
    assert summary["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2} and summary["start_step"] == 3


def test_unknown_config_keys_name_the_closest(built_run):
    from polyalign.core.yaml_config import ConfigError

    run, _ = built_run
    with pytest.raises(ConfigError, match="unknown key 'micro_batch'; did you mean 'micro_batches'"):
        sft_config(run, 4, "train.micro_batch=2")
    with pytest.raises(ConfigError, match="weighting must be one of bucket, uniform"):
        sft_config(run, 4, "weighting=square")


def test_the_worst_validation_bucket_is_one_training_saw():
    """Mean loss per bucket from summed metrics; the worst bucket and the spread over the buckets with train
    examples only; a bucket met only in validation is named apart, its loss still in val_by_bucket."""
    from polyalign.train.sft import validation_measures

    buckets = ["a", "b", "c", "d"]
    host = {"bucket_loss": np.array([6.0, 2.0, 9.0, 0.0]), "bucket_examples": np.array([3.0, 1.0, 2.0, 0.0])}
    weights = np.array([1.0, 2.0, 1.0, 1.0])
    out = validation_measures(host, buckets, weights, trained=np.array([True, True, False, True]))
    assert out["val_loss"] == round(17 / 6, 6)
    assert out["val_loss_weighted"] == round((6 + 4 + 9) / (3 + 2 + 2), 6)
    assert out["val_by_bucket"] == {"a": 2.0, "b": 2.0, "c": 4.5}  # d: no val example
    assert (out["val_worst_bucket"], out["val_worst_bucket_id"]) == (2.0, "a")  # not c (4.5): never trained on
    assert out["val_bucket_spread"] == 0.0 and out["val_untrained_buckets"] == ["c"]
    every = validation_measures(host, buckets, weights, trained=np.ones(4, bool))
    assert (every["val_worst_bucket"], every["val_worst_bucket_id"]) == (4.5, "c")
    assert every["val_bucket_spread"] == round(float(np.std([2.0, 2.0, 4.5])), 6)
    assert "val_untrained_buckets" not in every
    # validation on untrained buckets alone (a train split of other buckets): judged over what there is
    alone = validation_measures(host, buckets, weights, trained=np.array([False, False, False, True]))
    assert alone["val_worst_bucket_id"] == "c" and alone["val_untrained_buckets"] == ["a", "b", "c"]


def test_a_capped_validation_takes_every_bucket_in_turn():
    """data.eval_limit's examples: every bucket in turn (a seeded order within each), so that every bucket
    is in while the cap allows, the counts differ by at most one but where a bucket runs out, and a random
    subset of a skewed split no longer leaves its small buckets out."""
    rng = np.random.default_rng(5)
    buckets = rng.choice(16, size=1699, p=np.r_[[0.6, 0.2], np.full(14, 0.2 / 14)])  # skewed, as real splits are
    sizes = np.bincount(buckets, minlength=16)
    for limit in (1, 10, 16, 64, 500, 1698):
        chosen = pipeline.capped_subset(buckets, limit)
        assert len(chosen) == limit == len(set(chosen)) and list(chosen) == sorted(chosen)
        counts = np.bincount(buckets[chosen], minlength=16)
        assert (counts > 0).sum() == min(limit, 16)
        short = counts < sizes  # buckets not taken whole: within one of each other, and none below a whole one
        if short.any():
            assert counts[short].max() - counts[short].min() <= 1, limit
            assert (counts[~short] <= counts[short].min()).all(), limit
        np.testing.assert_array_equal(chosen, pipeline.capped_subset(buckets, limit))  # the same every evaluation
    pairs = [{"bucket_id": f"b{b}", "id": i} for i, b in enumerate(buckets[:200])]
    assert {p["bucket_id"] for p in pipeline.capped_pairs(pairs, 16)} == {p["bucket_id"] for p in pairs}
    assert pipeline.capped_pairs(pairs, None) is pairs and pipeline.capped_pairs(pairs, 500) is pairs


def test_packed_rows_keep_examples_apart():
    first = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "weight": 2.0, "bucket": 1}
    second = {"input_ids": [9, 10, 11], "loss_mask": [0, 1, 1], "weight": 0.5, "bucket": 4}
    row = pipeline.packed_arrays([first, second], 8, pad_id=0)
    np.testing.assert_array_equal(row["input_ids"], [5, 6, 7, 9, 10, 0, 0, 0])
    np.testing.assert_array_equal(row["targets"], [6, 7, 8, 10, 11, 0, 0, 0])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(row["loss_mask"], [0, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(row["token_scale"], [0, 0.5, 0.5, 0.5, 0.5, 0, 0, 0])
    np.testing.assert_allclose(row["token_weight"], [2, 2, 2, 0.5, 0.5, 0, 0, 0])
    np.testing.assert_array_equal(row["token_bucket"][:5], [1, 1, 1, 4, 4])
    np.testing.assert_array_equal(row["example_start"], [1, 0, 0, 1, 0, 0, 0, 0])
    assert (row["weight"], row["examples"], row["length"], bool(row["valid"])) == (2.5, 2.0, 5, True)


def test_packing_visits_every_example_once_per_epoch_in_full_rows(built_run):
    run, manifest = built_run
    source = pipeline.open_split(run, "val")
    lengths = pipeline.example_lengths(source)
    assert lengths.max() <= 64  # built with max_length 64; rows of 256 hold several
    rows = pipeline._PackedRows(lengths, 256, seed=3)
    per_epoch = rows.rows_per_epoch()
    epoch = [rows(r) for r in range(per_epoch)]
    assert sorted(i for row in epoch for i in row) == list(range(len(source)))
    assert all(sum(lengths[i] for i in row) <= 256 for row in epoch)
    assert per_epoch < len(source) / 3
    assert rows(per_epoch) != epoch[0]  # the next epoch is packed from a new permutation
    assert [rows(r) for r in range(per_epoch)] == [pipeline._PackedRows(lengths, 256, 3)(r) for r in range(per_epoch)]
    # a resumed run asks for a later epoch first; going back packs an epoch again, identically
    later = [rows(r) for r in range(3 * per_epoch, 4 * per_epoch)]
    fresh = pipeline._PackedRows(lengths, 256, 3)
    assert [fresh(r) for r in range(3 * per_epoch, 4 * per_epoch)] == later
    assert [fresh(r) for r in range(per_epoch)] == epoch and len(rows._packed) <= 3
    # what a packed run says before its steps: the epoch's rows, and the positions they fill packed and not
    filled = sum(int(lengths[i]) for row in epoch for i in row)
    assert pipeline.packing_note(lengths, 256, seed=3) == (
        f"data.pack: an epoch's {len(source):,} examples fill {per_epoch:,} rows of 256 positions "
        f"({len(source) / per_epoch:.2f} a row; {filled / (per_epoch * 256):.0%} of positions hold tokens, against "
        f"{filled / (len(source) * 256):.0%} unpacked)")
    per_row = len(source) / per_epoch
    assert pipeline.packing_note(lengths, 256, seed=3, global_batch=16).endswith(
        f"unpacked); train.global_batch counts rows: a step of 16 takes about {16 * per_row:.1f} examples where "
        f"unpacked it takes 16 (train.global_batch={round(16 / per_row)} takes about as many packed)")
    full = int((lengths >= 31).sum())  # 32 tokens, 31 positions: cut to the row
    assert 0 < full and pipeline.packing_note(lengths, 32, seed=3).endswith(
        f"; {full:,} examples ({full / len(source):.0%}) fill a row alone (as long as it, or cut to it))")


def test_a_packed_run_says_what_packing_fills_and_trains(built_run, tmp_path, capsys):
    run, manifest = built_run
    result = train_sft(sft_config(run, 2, "data.pack=true"), tmp_path / "packed", progress=False)
    printed = capsys.readouterr().out
    lengths = pipeline.example_lengths(pipeline.open_split(run, "train"))
    note = pipeline.packing_note(lengths, manifest["options"]["max_length"], seed=0, global_batch=8)
    assert note.startswith(f"data.pack: an epoch's {len(lengths):,} examples fill ") and f"\n{note}\n" in printed
    steps = [r for r in read_metrics(tmp_path / "packed") if "loss" in r]
    assert result["end_step"] == 2 and len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
    # each step logs the examples its 8 rows held: the packing order's rows 0-7, then 8-15 (at 64 tokens, with the
    # profile prompt, every example here fills a row alone; the count of a row of several is summed on the device
    # as test_packed_loss_and_gradient_equal_the_unpacked_ones checks)
    rows = pipeline._PackedRows(lengths, manifest["options"]["max_length"], seed=0)
    held = [sum(len(rows(r)) for r in range(8 * s, 8 * s + 8)) for s in range(2)]
    assert [r["examples"] for r in steps] == held
    # and the run says it was packed: the summary, its line and the model card's global batch
    from polyalign.train.sft import summary_line

    assert result["packed"] is True and summary_line(result).startswith("trained 2 steps of packed rows in ")
    card = (tmp_path / "packed" / "model" / "README.md").read_text()
    assert ("| global batch | 8 rows of packed examples (data.pack): a step trained on as many examples as fit its "
            "rows, at least one a row (metrics.jsonl logs how many) |") in card


def test_example_lengths_are_cached_inside_the_built_dataset(built_run, tmp_path):
    import shutil

    run, _ = built_run
    copy = tmp_path / "run"
    shutil.copytree(run / "build", copy / "build")
    source = pipeline.open_split(copy, "val")
    cache = pipeline.lengths_cache(copy, "val")
    assert not cache.exists()
    lengths = pipeline.example_lengths(source, cache)
    assert cache.is_file() and lengths.shape == (len(source),) and lengths.min() > 0
    np.testing.assert_array_equal(lengths, [len(source[i]["input_ids"]) - 1 for i in range(len(source))])
    np.save(cache, np.full(len(source), 7))  # what the cache holds is what is used
    np.testing.assert_array_equal(pipeline.example_lengths(pipeline.open_split(copy, "val"), cache), 7)
    np.save(cache, np.arange(3))  # not one length per example: computed again and replaced
    np.testing.assert_array_equal(pipeline.example_lengths(source, cache), lengths)
    np.testing.assert_array_equal(np.load(cache), lengths)


def test_packed_loss_and_gradient_equal_the_unpacked_ones(built_run):
    """The same examples, one per row or packed several to a row, give the same Bucket-SFT objective
    and gradient: segments never attend across examples and positions restart."""
    import jax

    from polyalign.inputs.built import read_manifest
    from polyalign.mesh import parallel
    from polyalign.model import create_model
    from polyalign.train.sft import SftObjective
    from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer
    from tests.conftest import tiny_model_config

    run, _ = built_run
    manifest = read_manifest(run)
    source = pipeline.open_split(run, "train")
    examples = [source[i] for i in range(12)]
    length = 4 * manifest["options"]["max_length"]  # rows long enough to pack several examples
    pad = manifest["pad_id"]
    unpacked = [pipeline.example_arrays(e, length, pad) for e in examples]
    rows, current, used = [], [], 0
    for e in examples:  # pack in order, as the packer does
        n = min(len(e["input_ids"]) - 1, length)
        if used + n > length and current:
            rows.append(current)
            current, used = [], 0
        current.append(e)
        used += n
    rows.append(current)
    assert len(rows) < len(examples)
    packed = [pipeline.packed_arrays(r, length, pad) for r in rows]
    packed += [pipeline.packed_arrays([], length, pad)] * (len(unpacked) - len(packed))  # same batch size

    def stack(items):
        return {k: np.stack([item[k] for item in items])[None] for k in items[0]}

    results = []
    for batch in (stack(unpacked), stack(packed)):
        trainer = Trainer(create_model(tiny_model_config(manifest["vocab_size"]), seed=0),
                          SftObjective(len(manifest["buckets"])), OptimizerConfig(),
                          LoopConfig(steps=1, global_batch=12), parallel.make_mesh())
        grads, loss, sums = trainer.gradients(batch)
        results.append((float(loss), jax.device_get(grads), jax.device_get(sums)))
    (loss_a, grads_a, sums_a), (loss_b, grads_b, sums_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(b, a, atol=2e-6, rtol=1e-4)
    np.testing.assert_allclose(sums_b["bucket_loss"], sums_a["bucket_loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sums_b["bucket_examples"], sums_a["bucket_examples"])
    assert float(sums_b["examples"]) == 12


def test_an_abstract_trainer_compiles_without_allocating_and_refuses_to_step(built_run):
    import jax

    from polyalign.mesh import parallel
    from polyalign.model import abstract_model
    from polyalign.train.sft import SftObjective
    from polyalign.train.trainer import (
        LoopConfig,
        OptimizerConfig,
        Trainer,
        TrainingError,
    )
    from tests.conftest import tiny_model_config
    from tests.train_checks import first_batch

    run, manifest = built_run
    batch, _ = first_batch(run, 4, 1)
    cfg = tiny_model_config(manifest["vocab_size"])
    trainer = Trainer(abstract_model(cfg), SftObjective(len(manifest["buckets"])), OptimizerConfig(),
                      LoopConfig(steps=1, global_batch=4), parallel.make_mesh())
    assert trainer.abstract
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(trainer.state))
    analysis = trainer.compiled_step(batch).memory_analysis()
    # parameters and both AdamW moments in float32 are arguments of the step
    assert analysis.argument_size_in_bytes >= 3 * 4 * cfg.num_parameters()
    with pytest.raises(TrainingError, match="abstract model"):
        trainer.step(batch)


def test_a_stop_between_checkpoints_saves_the_iterator_where_the_steps_left_it(built_run, tmp_path):
    """The loop reads a step's metrics once the next step is dispatched, and reads the batch after that
    one while both run. A stop (SIGTERM) while step 2 is read, between two checkpoint steps, ends the
    run after step 3 (the one already dispatched) and must checkpoint the data iterator after the three
    batches trained, not after the fourth one read ahead, or the resumed run would skip a batch; with no
    stop the read-ahead batches are the next steps'."""
    import signal

    from polyalign.mesh import parallel
    from polyalign.model import create_model
    from polyalign.train.checkpoint import Checkpointer
    from polyalign.train.sft import SftObjective
    from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer
    from tests.conftest import tiny_model_config

    run, manifest = built_run
    source, length = pipeline.open_split(run, "train"), manifest["options"]["max_length"]

    def batches():
        return pipeline.iterate(pipeline.train_batches(source, pipeline.Layout(8, 1), 4, length, manifest["pad_id"],
                                                       seed=0))

    def trainer():
        return Trainer(create_model(tiny_model_config(manifest["vocab_size"]), seed=0),
                       SftObjective(len(manifest["buckets"])), OptimizerConfig(),
                       LoopConfig(steps=4, global_batch=8, checkpoint_every=100), parallel.make_mesh())

    steps = []

    def stop_after_two(host):
        steps.append(float(host["loss"]))
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler turns it into a stop
        return {}

    stopped = batches()
    result = trainer().fit(stopped, summarize=stop_after_two, checkpointer=Checkpointer(tmp_path / "ckpt", 100, 1),
                           progress=False)
    assert result["interrupted"] and result["end_step"] == 3 and (tmp_path / "ckpt" / "3").is_dir()
    assert len(steps) == 3  # the step in flight is read and logged before the run ends
    three_read = batches()
    next(three_read), next(three_read), next(three_read)
    assert stopped.get_state() == three_read.get_state()
    # Uninterrupted, the batches are the same ones in the same order: the same losses as step by step.
    by_hand, straight = trainer(), batches()
    expected = [float(jax.device_get(by_hand.step(next(straight)))["loss"]) for _ in range(4)]
    steps.clear()
    trainer().fit(batches(), summarize=lambda host: steps.append(float(host["loss"])) or {}, progress=False)
    assert steps == expected


LOOP_ORDER = {
    # one process: step N is read once N + 1 is queued, except the evaluated, checkpointed and last steps
    "pipelined": ["dispatch 1", "dispatch 2", "read 1", "dispatch 3", "read 2", "read 3", "evaluate at state 3",
                  "dispatch 4", "dispatch 5", "read 4", "read 5", "checkpoint 5 at state 5",
                  "dispatch 6", "read 6", "evaluate at state 6",
                  "dispatch 7", "read 7", "evaluate at state 7", "checkpoint 7 at state 7"],
    # several CPU processes, where a call waits for its program anyway: each step is read as it ends
    "in step": ["dispatch 1", "read 1", "dispatch 2", "read 2", "dispatch 3", "read 3", "evaluate at state 3",
                "dispatch 4", "read 4", "dispatch 5", "read 5", "checkpoint 5 at state 5",
                "dispatch 6", "read 6", "evaluate at state 6",
                "dispatch 7", "read 7", "evaluate at state 7", "checkpoint 7 at state 7"],
    # train.stop_at=5 of 7 steps: checkpointed there, but validated only where an unbroken run validates
    "stop_at": ["dispatch 1", "dispatch 2", "read 1", "dispatch 3", "read 2", "read 3", "evaluate at state 3",
                "dispatch 4", "dispatch 5", "read 4", "read 5", "checkpoint 5 at state 5"],
}


@pytest.mark.parametrize("mode", LOOP_ORDER)
def test_the_loop_reads_each_step_after_dispatching_the_next_but_evaluates_and_checkpoints_in_step(
        mode, built_run, tmp_path, monkeypatch):
    """The host never waits for the step it has just dispatched: step N's metrics are read after step
    N + 1 is queued. A step that is evaluated, checkpointed or last is read before anything else is
    dispatched, so evaluation and the checkpoint see that step's state."""
    from polyalign.mesh import parallel
    from polyalign.model import create_model
    from polyalign.train.checkpoint import Checkpointer
    from polyalign.train.metrics import MetricsWriter, read_metrics
    from polyalign.train.sft import SftObjective
    from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer
    from tests.conftest import tiny_model_config

    run, manifest = built_run
    source, length = pipeline.open_split(run, "train"), manifest["options"]["max_length"]
    monkeypatch.setattr(parallel, "orders_programs", lambda: mode == "in step")
    trainer = Trainer(create_model(tiny_model_config(manifest["vocab_size"]), seed=0),
                      SftObjective(len(manifest["buckets"])), OptimizerConfig(),
                      LoopConfig(steps=7, global_batch=8, eval_every=3, checkpoint_every=5,
                                 stop_at=5 if mode == "stop_at" else None), parallel.make_mesh(),
                      metrics=MetricsWriter(tmp_path / "run", report_to=[]))
    events, counts = [], {"dispatch": 0, "read": 0}
    run_step, save = trainer._run_step, Checkpointer.save

    def count(kind):
        counts[kind] += 1
        events.append(f"{kind} {counts[kind]}")

    def saved(checkpointer, step, state, iterator, force=False):
        events.append(f"checkpoint {step} at state {int(state['step'])}")
        return save(checkpointer, step, state, iterator, force)

    def read(host):
        assert int(host["nonfinite_steps"]) == 0
        count("read")
        return {}

    monkeypatch.setattr(trainer, "_run_step", lambda batch: count("dispatch") or run_step(batch))
    monkeypatch.setattr(Checkpointer, "save", saved)
    trainer.fit(pipeline.iterate(pipeline.train_batches(source, pipeline.Layout(8, 1), 7, length, manifest["pad_id"],
                                                        seed=0)),
                evaluate=lambda: events.append(f"evaluate at state {trainer.step_number}") or {},
                summarize=read, checkpointer=Checkpointer(tmp_path / "ckpt", 5, 2), progress=False)
    assert events == LOOP_ORDER[mode]
    # every step logged once, and the evaluated ones say how long validation took
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 6 if mode == "stop_at" else 8))
    evaluated = [int(e.split()[-1]) for e in events if e.startswith("evaluate")]
    assert [r["step"] for r in records if "eval_s" in r] == evaluated and all(r["step_s"] > 0 for r in records)


def test_a_resumed_run_takes_out_the_steps_logged_after_its_checkpoint(tmp_path, monkeypatch, capsys):
    """A run killed after step 14 with checkpoint 10 had logged steps 11-14 (the last line cut short):
    resumed from 10, metrics.jsonl keeps steps 1-10 and says what it took out, and TensorBoard is told to
    drop its events from step 11 on; a run with nothing after its checkpoint is left as it is."""
    import tensorboardX

    from polyalign.train.metrics import MetricsWriter, read_metrics

    purges = []
    real_writer = tensorboardX.SummaryWriter

    def writer(folder, purge_step=None):
        purges.append(purge_step)
        return real_writer(folder, purge_step=purge_step)

    monkeypatch.setattr(tensorboardX, "SummaryWriter", writer)  # metrics.py imports it when a writer opens
    first = MetricsWriter(tmp_path)
    for step in range(1, 15):
        first.write({"step": step, "loss": 10.0 - step / 10})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 15, "lo')
    capsys.readouterr()
    resumed = MetricsWriter(tmp_path)
    resumed.resume_at(14)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 15))
    resumed.resume_at(10)
    resumed.write({"step": 11, "loss": 0.5})
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 12))
    assert read_metrics(tmp_path)[-1]["loss"] == 0.5
    out = capsys.readouterr().out
    assert out.count("note: ") == 2
    assert "held 1 cut line logged after step 14" in out
    assert "held steps 11-14 logged after step 10" in out
    assert purges == [None, None, 15, 11]
    again = MetricsWriter(tmp_path)
    again.resume_at(11)
    again.close()
    assert capsys.readouterr().out == "" and purges[-1] is None


def test_a_step_that_fails_after_taking_the_state_raises_its_own_error(built_run, tmp_path, monkeypatch):
    """A step that fails mid-collective (a peer gone) has been given the donated state, which is then
    deleted: the loop must still raise the step's error, the one the lost-peer report recognises, not
    one from reading the deleted state while it closes the checkpoints."""
    from polyalign.mesh import parallel
    from polyalign.model import create_model
    from polyalign.train.checkpoint import Checkpointer
    from polyalign.train.run import _lost_peer_error
    from polyalign.train.sft import SftObjective
    from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer
    from tests.conftest import tiny_model_config

    run, manifest = built_run
    source, length = pipeline.open_split(run, "train"), manifest["options"]["max_length"]
    trainer = Trainer(create_model(tiny_model_config(manifest["vocab_size"]), seed=0),
                      SftObjective(len(manifest["buckets"])), OptimizerConfig(),
                      LoopConfig(steps=4, global_batch=8, checkpoint_every=2), parallel.make_mesh())
    run_step, calls = trainer._run_step, []

    def fails_at_the_third(batch):
        calls.append(1)
        if len(calls) < 3:
            return run_step(batch)
        for leaf in jax.tree.leaves(trainer.state):  # as a donated state is after the step took it
            leaf.delete()
        raise RuntimeError("UNKNOWN: Gloo all-reduce failed: Read error [127.0.0.1]:14055: Connection reset by peer")

    monkeypatch.setattr(trainer, "_run_step", fails_at_the_third)
    with pytest.raises(RuntimeError, match="Gloo all-reduce failed") as raised:
        trainer.fit(pipeline.iterate(pipeline.train_batches(source, pipeline.Layout(8, 1), 4, length,
                                                            manifest["pad_id"], seed=0)),
                    checkpointer=Checkpointer(tmp_path / "ckpt", 2, 2), progress=False)
    assert _lost_peer_error(raised.value)
    assert (tmp_path / "ckpt" / "2").is_dir()


def test_the_learning_rate_schedule_starts_learning_at_the_first_step():
    """Step k uses the warmup's k-th rung: lr / warmup at step 1 (optax's own schedule gives 0 there, so a
    one-step run would change nothing), lr at the warmup's last step, then cosine down to lr * min_lr_ratio
    at the run's last step."""
    from polyalign.train.config import OptimizerConfig
    from polyalign.train.trainer import make_optimizer

    config = OptimizerConfig(lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1)
    _, schedule = make_optimizer(config, 40)  # 4 warmup steps
    lrs = [float(schedule(step - 1)) for step in range(1, 41)]
    np.testing.assert_allclose(lrs[:4], [2.5e-4, 5e-4, 7.5e-4, 1e-3], rtol=1e-6)
    decay = [1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + np.cos(np.pi * (k - 4) / 36)) for k in range(5, 41)]
    np.testing.assert_allclose(lrs[4:], decay, rtol=1e-5)
    assert lrs[-1] == pytest.approx(1e-4)
    _, one = make_optimizer(config, 1)  # one step: the whole warmup in it
    assert float(one(0)) == pytest.approx(1e-3)
