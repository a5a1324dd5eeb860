"""Pairs, the critic and the HDPO/DPO method on the shared trainer."""

import json
import math
import re
import shutil
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polyalign.core.paths import file_digest
from polyalign.data.records import InputError
from polyalign.pairs.make import (
    assign_weights,
    build_pairs,
    imbalance_gains,
    pair_weight,
    read_predictions,
    write_pair_split,
)
from polyalign.train import losses
from tests.conftest import REPO
from tests.real_inputs import init_checkpoint_and_pair_files, real_pairs


def _records(demo_run, n=40):
    from polyalign.data.records import read_records

    run, _, _ = demo_run
    return read_records(run / "data" / "val.jsonl")[:n]


def test_pairs_join_by_id_and_drop_unusable_ones(demo_run):
    records = _records(demo_run)
    predictions = {r.id: {"id": r.id, "prediction": records[(i + 1) % len(records)].response, "model": "m"}
                   for i, r in enumerate(records)}
    predictions[records[0].id]["prediction"] = "  "  # empty after normalisation
    predictions[records[1].id]["prediction"] = records[1].response + "\n"  # equal after normalisation
    del predictions[records[2].id]  # not generated: neither a pair nor a drop
    pairs, dropped = build_pairs(records, predictions)
    assert dropped == {"empty_side": 1, "chosen_equals_rejected": 1}
    assert len(pairs) == len(records) - 3 - sum(1 for r in records[3:] if not r.response.strip())
    pair = next(p for p in pairs if p["id"] == records[5].id)
    assert pair["chosen"] == records[5].response and pair["rejected"] == records[6].response
    assert pair["bucket_id"] == records[5].bucket_id and pair["record"]["id"] == records[5].id


def test_pair_weights_by_hand(tmp_path):
    # Counts 6, 3, 1 over K = 3 (N = 10): raw = max(0, 10/(3n) - 1) = 0, 0.111, 2.333; g = raw / max.
    gains = imbalance_gains({"a": 6, "b": 3, "c": 1})
    assert gains["a"] == 0 and gains["b"] == pytest.approx((10 / 9 - 1) / (10 / 3 - 1)) and gains["c"] == 1
    assert pair_weight(1.0, 1.0) == pytest.approx(1 + 0.5 + 0.25)
    assert pair_weight(0.0, 0.0, critic_chosen=0.2, critic_rejected=0.9) == pytest.approx(1.7)
    assert pair_weight(1.0, 1.0, critic_chosen=0.0, critic_rejected=5.0) == 3.0  # clipped
    assert pair_weight(0.0, 0.0, critic_chosen=0.9, critic_rejected=0.2) == 1.0  # no credit for a worse human
    pairs = [{"bucket_id": b, "language": "en"} for b in "aaaaaabbbc"]
    assign_weights(pairs)
    assert [p["weight"] for p in pairs[-2:]] == pytest.approx([1 + 0.5 * gains["b"], 1.5])
    # held-out pairs take the training pairs' gains (METHOD section 7), whatever their own counts: among
    # themselves a and c would be the rare ones; a bucket or language training lacks is the rarest (gain 1)
    held_out = [{"bucket_id": b, "language": lang} for b, lang in [("b", "en")] * 3 + [("a", "en"), ("c", "zh"),
                                                                                         ("d", "en")]]
    assign_weights(held_out, training=pairs)
    assert [p["weight"] for p in held_out] == pytest.approx(
        [1 + 0.5 * gains["b"]] * 3 + [1.0, 1 + 0.5 + 0.25, 1 + 0.5])
    split = write_pair_split([{**p, "id": f"p{i}", "record": {"question": f"q{i}"}} for i, p in enumerate(pairs * 4)],
                             tmp_path / "t.jsonl", tmp_path / "v.jsonl", 0.25, seed=0)
    train, val = ([json.loads(line) for line in (tmp_path / name).open()] for name in ("t.jsonl", "v.jsonl"))
    expected = imbalance_gains(split["buckets"])
    assert split["val_pairs"] and all(p["weight"] == pytest.approx(1 + 0.5 * expected.get(p["bucket_id"], 1.0))
                                      for p in train + val)


def test_held_out_pairs_made_by_the_command_are_weighted_by_the_training_pairs_counts(demo_run, tmp_path, capsys):
    """`polyalign pairs` on validation records weighted them by their own counts, unlike training (3 of the
    quick demo's 22 off by up to 0.387); with --training-pairs each weight is 1 + 0.5 g_b + 0.25 g_lang of the
    training pairs' counts (recomputed here from METHOD section 7), and a val records file without it is noted."""
    from polyalign.cli import main
    from polyalign.data.records import read_records
    from polyalign.evaluate.baselines import first_sentence

    run, _, _ = demo_run
    files = {}
    for split, count in (("train", 120), ("val", 40)):
        records = read_records(run / "data" / f"{split}.jsonl")[::7][:count]
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
        (tmp_path / f"{split}_p.jsonl").write_text("".join(json.dumps(
            {"id": r.id, "prediction": first_sentence(r.context or r.question)}, ensure_ascii=False) + "\n"
            for r in records))
    argv = ["pairs", "--records", str(files["train"]), "--predictions", str(tmp_path / "train_p.jsonl"), "--out"]
    assert main([*argv, str(tmp_path / "train_pairs.jsonl")]) == 0
    assert "weighted by their own counts" in capsys.readouterr().out
    argv = ["pairs", "--records", str(files["val"]), "--predictions", str(tmp_path / "val_p.jsonl"), "--out"]
    assert main([*argv, str(tmp_path / "own.jsonl")]) == 0
    assert f"note: {files['val']} looks like held-out records" in capsys.readouterr().err
    training_pairs = ["--training-pairs", str(tmp_path / "train_pairs.jsonl")]
    assert main([*argv, str(tmp_path / "val_pairs.jsonl"), *training_pairs]) == 0
    printed = capsys.readouterr()
    training = [json.loads(line) for line in (tmp_path / "train_pairs.jsonl").open()]
    assert f"weighted by the counts of {len(training)} training pairs" in printed.out and "held-out" not in printed.err

    def gains(key):
        counts = Counter(p[key] for p in training)
        raw = {k: max(0.0, len(training) / (len(counts) * n) - 1) for k, n in counts.items()}
        top = max(raw.values())
        return {k: r / top if top else 0.0 for k, r in raw.items()}

    by_bucket, by_language = gains("bucket_id"), gains("language")
    held_out = [json.loads(line) for line in (tmp_path / "val_pairs.jsonl").open()]
    expected = [min(3.0, max(0.5, 1 + 0.5 * by_bucket.get(p["bucket_id"], 1.0)
                             + 0.25 * by_language.get(p["language"], 1.0))) for p in held_out]
    assert [p["weight"] for p in held_out] == pytest.approx(expected)
    own = [json.loads(line)["weight"] for line in (tmp_path / "own.jsonl").open()]
    assert own != pytest.approx(expected)  # the case the option exists for: the two weightings differ here


def test_prediction_files_are_checked(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prediction": "x"}\n{"id": "a", "prediction": "y"}\n')
    with pytest.raises(InputError, match="p.jsonl:2: duplicate id 'a'"):
        read_predictions(path)
    path.write_text('{"id": "a", "response": "Paris."}\n')  # the key an engine named otherwise: said which it has
    with pytest.raises(InputError, match=r"p.jsonl:1: a prediction row needs string fields id and prediction \(it "
                                         r"has id, response\)"):
        read_predictions(path)
    # a field of the wrong kind is named with what it holds (and how to write an id)
    for row, said in [({"id": 7, "prediction": "Paris."}, 'id is 7, not a string (write it as "7")'),
                      ({"id": "a", "prediction": None}, "prediction is null, not a string"),
                      ({"id": "a", "prediction": {"role": "assistant", "content": "Paris."}},
                       "prediction is {\"role\": \"assistant\", \"content\": \"Paris.\"}, not a string (the answer's "
                       "text goes there, not a message)")]:
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(InputError, match=re.escape(f"p.jsonl:1: {said}")):
            read_predictions(path)
    # the rows written as one JSON array (json.dump of a list), as a user's script may write them
    path.write_text(json.dumps([{"id": "a", "prediction": "Paris is the capital of France."}]))
    with pytest.raises(InputError, match='p.jsonl:1: a JSON array; predictions are JSONL, one {"id", "prediction"}'):
        read_predictions(path)
    path.write_text(json.dumps([{"id": "a", "prediction": "Paris is the capital of France."}], indent=1))
    with pytest.raises(InputError, match='p.jsonl: a JSON array; predictions are JSONL'):
        read_predictions(path)


EXACTNESS_CASES = [("ipo", False), ("robust_dpo", False), ("ln_dpo", False), ("simpo", False), ("simpo", True),
                   ("orpo", False), ("kto", True)]


def test_the_exactness_tests_cover_every_method_of_the_table():
    from polyalign.train.methods import PREFERENCE_METHODS

    # hdpo and dpo: test_preference_objective_equals_the_pure_loss_for_any_micro_batching
    assert {m for m, _ in EXACTNESS_CASES} | {"hdpo", "dpo"} == set(PREFERENCE_METHODS)


@pytest.mark.parametrize("method, hdpo_terms", EXACTNESS_CASES)
def test_every_preference_loss_is_exact_under_micro_batching(method, hdpo_terms):
    """Each loss of the family, alone or with HDPO's weights, distance term and anchor, gives the pure
    loss of the whole batch (computed here from polyalign.train.losses) for 1 and 4 micro-batches (the
    DPO/HDPO test below also covers 2)."""
    from polyalign.mesh import parallel
    from polyalign.model import create_model
    from polyalign.train.config import PreferenceConfig
    from polyalign.train.preference import PreferenceObjective, sequence_logps
    from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer
    from tests.conftest import tiny_model_config

    batch = _preference_batch(np.random.default_rng(3), 8, 16, 64)
    model = create_model(tiny_model_config(64), seed=0)
    config = PreferenceConfig(method=method, init="unused", hdpo_terms=hdpo_terms, beta=0.5, label_smoothing=0.1,
                              lambda_dist=0.3, gamma_ftx=0.05, kto_undesirable_weight=1.5)
    pc, pr, nc = (np.asarray(x) for x in sequence_logps(model, {k: jnp.asarray(v) for k, v in batch.items()}))
    nr = batch["rejected_mask"].sum(-1)
    rc, rr = batch["ref_chosen"], batch["ref_rejected"]
    per_pair = {"ipo": lambda: losses.ipo_loss(pc, pr, rc, rr, 0.5),
                "robust_dpo": lambda: losses.robust_dpo_loss(pc, pr, rc, rr, 0.5, 0.1),
                "ln_dpo": lambda: losses.length_normalised_dpo_loss(pc, pr, rc, rr, nc, nr, 0.5, 0.1),
                "simpo": lambda: losses.simpo_loss(pc, pr, nc, nr, 0.5, 0.5, 0.1),
                "orpo": lambda: losses.orpo_loss(pc, pr, nc, nr, 0.5),
                "kto": lambda: sum(losses.kto_losses(pc, pr, rc, rr, 0.5, 0.0, 1.0, 1.5)) / 2}[method]()
    weights = batch["weight"] if hdpo_terms else np.ones(8, np.float32)
    expected = float((weights * per_pair).sum() / weights.sum())
    if hdpo_terms:
        expected += 0.3 * float(losses.distance_regulariser(pc, pr, batch["critic_chosen"], batch["critic_rejected"],
                                                            0.5).mean())
        expected += 0.05 * float(losses.sft_anchor(pc, nc).mean())
    # the logged reward margin: against the reference where the method has one; for SimPO and ORPO, beta times
    # each side's mean log-prob per token
    margin = 0.5 * ((pc / nc - pr / nr) if method in ("simpo", "orpo") else ((pc - rc) - (pr - rr)))
    results = []
    for micro in (1, 4):
        trainer = Trainer(create_model(tiny_model_config(64), seed=0), PreferenceObjective(config, 3),
                          OptimizerConfig(), LoopConfig(steps=1, global_batch=8, micro_batches=micro),
                          parallel.make_mesh())
        grads, loss, sums = trainer.gradients({k: v.reshape(micro, 8 // micro, *v.shape[1:])
                                               for k, v in batch.items()})
        assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-5), micro
        assert float(sums["rewards_margin"]) == pytest.approx(float(margin.sum()), rel=1e-5, abs=1e-5), micro
        results.append(jax.tree.leaves(jax.device_get(grads)))
    for grads in results[1:]:
        for a, b in zip(grads, results[0]):
            # float32 rounding of a different summation order, relative to the gradient's scale (IPO's
            # squared loss has gradients of several units where the others' stay below one)
            np.testing.assert_allclose(a, b, atol=1e-6 * max(1.0, float(np.abs(b).max())))


def test_critic_loss_and_collapse_guard():
    from polyalign.mesh import parallel
    from polyalign.train.critic import MARGIN, Critic, CriticObjective

    with parallel.unsharded():
        from flax import nnx

        critic = Critic(8, 3, 0.0, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batch = {"reg_pooled": rng.normal(size=(4, 8)).astype(np.float32), "reg_bucket": np.array([0, 1, 2, 3]),
             "reg_target": np.array([0.0, 0.5, 1.0, 2.0], np.float32), "reg_valid": np.ones(4, np.float32),
             "pair_human": rng.normal(size=(2, 8)).astype(np.float32),
             "pair_model": rng.normal(size=(2, 8)).astype(np.float32), "pair_bucket": np.array([0, 3]),
             "pair_valid": np.ones(2, np.float32)}
    numerators, _ = CriticObjective().numerators(critic, batch, None)
    c = np.asarray(critic(batch["reg_pooled"], batch["reg_bucket"]))
    assert float(numerators["l1"]) == pytest.approx(np.abs(c - batch["reg_target"]).sum(), rel=1e-5)
    h, m = (np.asarray(critic(batch[k], batch["pair_bucket"])) for k in ("pair_human", "pair_model"))
    assert float(numerators["rank"]) == pytest.approx(np.maximum(0, MARGIN - m + h).sum(), rel=1e-5)


def test_critic_dropout_draws_from_the_trainers_key():
    """The critic's dropout comes from the key the trainer hands each micro-batch (no seed in the batch):
    the same key gives the same loss, another key another one, and no key (evaluation) no dropout."""
    from flax import nnx

    from polyalign.mesh import parallel
    from polyalign.train.critic import Critic, CriticObjective

    with parallel.unsharded():
        dropped, plain = Critic(8, 3, 0.5, nnx.Rngs(0)), Critic(8, 3, 0.0, nnx.Rngs(0))
    rng = np.random.default_rng(1)
    batch = {"reg_pooled": rng.normal(size=(6, 8)).astype(np.float32), "reg_bucket": np.array([0, 1, 2, 0, 1, 2]),
             "reg_target": rng.uniform(size=6).astype(np.float32), "reg_valid": np.ones(6, np.float32),
             "pair_human": rng.normal(size=(3, 8)).astype(np.float32),
             "pair_model": rng.normal(size=(3, 8)).astype(np.float32), "pair_bucket": np.array([0, 1, 2]),
             "pair_valid": np.ones(3, np.float32)}
    objective = CriticObjective()

    def l1(critic, key):
        return float(objective.numerators(critic, batch, key)[0]["l1"])

    a, b = jax.random.key(1), jax.random.key(2)
    assert l1(dropped, a) == l1(dropped, a) and l1(dropped, a) != l1(dropped, b)
    assert l1(dropped, None) == pytest.approx(l1(plain, a), rel=1e-6)


def test_human_model_auc_by_hand():
    from polyalign.train.critic import human_model_auc

    # pairs (human, model): 0.1 < 0.3, 0.1 < 0.15, 0.2 < 0.3 rank people first, 0.2 > 0.15 does not
    assert human_model_auc(np.array([0.1, 0.2]), np.array([0.3, 0.15])) == pytest.approx(0.75)
    assert human_model_auc(np.array([0.5]), np.array([0.5])) == pytest.approx(0.5)  # a tie counts half
    assert human_model_auc(np.array([]), np.array([0.5])) is None


def test_a_constant_critic_is_refused():
    from polyalign.train.critic import CriticCollapse, check_not_collapsed

    with pytest.raises(CriticCollapse, match="all 3 pairs the same"):
        check_not_collapsed(np.full(3, 0.25), np.full(3, 0.25))
    check_not_collapsed(np.array([0.1, 0.2, 0.3]), np.array([0.1, 0.2, 0.4]))  # one differing pair is enough


def test_support_targets_skip_constant_features(demo_run):
    from polyalign.features.references import support_distance
    from polyalign.features.response import text_features
    from polyalign.train.critic import support_targets

    run, _, _ = demo_run
    references = json.loads((run / "stats" / "references.json").read_text())
    bucket, reference = next(iter(references["buckets"].items()))
    text = "A short answer."
    features = text_features(text)
    for counts, stats in (("raw", reference["features"]),
                          ("per_token", {**reference["features"], **reference["rates"]})):
        everything = support_distance(features, reference, references["features"], counts=counts)
        nonconstant = [n for n in references["features"] if stats[n]["std"] > 1e-12]
        targets = support_targets([text, text], [bucket, "xx|none"], references, counts=counts)
        assert targets[0] == pytest.approx(support_distance(features, reference, nonconstant, counts=counts), rel=1e-6)
        assert np.isnan(targets[1])  # no reference for that bucket
        assert len(nonconstant) < len(references["features"]) and everything >= 0
    # a count constant in raw units can vary as a rate and the reverse (every token is tagged X in v1)
    assert reference["features"]["pos_x_count"]["std"] > 0 and reference["rates"]["pos_x_count"]["std"] == 0


def _preference_batch(rng, n, length, vocab):
    batch = {"weight": rng.uniform(0.5, 3.0, n).astype(np.float32), "bucket": rng.integers(0, 3, n).astype(np.int32),
             "valid": np.ones(n, bool), "critic_chosen": rng.uniform(0, 1, n).astype(np.float32),
             "critic_rejected": rng.uniform(0, 2, n).astype(np.float32),
             "ref_chosen": -rng.uniform(20, 40, n).astype(np.float32),
             "ref_rejected": -rng.uniform(20, 40, n).astype(np.float32)}
    for side in ("chosen", "rejected"):
        batch[f"{side}_inputs"] = rng.integers(0, vocab, (n, length)).astype(np.int32)
        batch[f"{side}_targets"] = rng.integers(0, vocab, (n, length)).astype(np.int32)
        mask = np.zeros((n, length), np.float32)
        for i in range(n):
            mask[i, rng.integers(1, length // 2):rng.integers(length // 2 + 1, length)] = 1.0
        batch[f"{side}_mask"] = mask
        batch[f"{side}_length"] = np.full(n, length, np.int32)  # every position is a real token
    return batch


@pytest.mark.parametrize("method", ["hdpo", "dpo"])
def test_preference_objective_equals_the_pure_loss_for_any_micro_batching(method, tmp_path):
    from polyalign.mesh import parallel
    from polyalign.model import create_model
    from polyalign.train.config import PreferenceConfig
    from polyalign.train.preference import PreferenceObjective, sequence_logps
    from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer
    from tests.conftest import tiny_model_config

    rng = np.random.default_rng(0)
    batch = _preference_batch(rng, 8, 16, 64)
    model = create_model(tiny_model_config(64), seed=0)
    config = PreferenceConfig(method=method, init="unused", lambda_dist=0.3, gamma_ftx=0.05)
    pc, pr, n = (np.asarray(x) for x in sequence_logps(model, {k: jnp.asarray(v) for k, v in batch.items()}))
    weights = batch["weight"] if method == "hdpo" else np.ones(8, np.float32)
    expected, _ = losses.hdpo_loss(pc, pr, batch["ref_chosen"], batch["ref_rejected"], weights,
                                   batch["critic_chosen"], batch["critic_rejected"], n, beta=0.1,
                                   lambda_dist=0.3 if method == "hdpo" else 0.0,
                                   gamma_ftx=0.05 if method == "hdpo" else 0.0)
    results = []
    for micro in (1, 2, 4):
        trainer = Trainer(create_model(tiny_model_config(64), seed=0), PreferenceObjective(config, 3),
                          OptimizerConfig(), LoopConfig(steps=1, global_batch=8, micro_batches=micro),
                          parallel.make_mesh())
        local = {k: v.reshape(micro, 8 // micro, *v.shape[1:]) for k, v in batch.items()}
        grads, loss, _ = trainer.gradients(local)
        results.append((float(loss), jax.tree.leaves(jax.device_get(grads))))
        assert float(loss) == pytest.approx(float(expected), abs=1e-5), micro
    for loss, grads in results[1:]:
        for a, b in zip(grads, results[0][1]):
            np.testing.assert_allclose(a, b, atol=1e-6)


def _tokenised_real_pairs(demo_run, tokenizer, length: int, count: int):
    from polyalign.inputs.pair_rows import tokenise_pairs
    from polyalign.tokens.chat import get_template

    pairs = real_pairs(demo_run, count)
    buckets = sorted({p["bucket_id"] for p in pairs})
    return tokenise_pairs(pairs, tokenizer, get_template("polyalign"), "context", length, buckets), buckets


def test_reference_log_probs_from_packed_rows_equal_the_unpacked_ones(demo_run, demo_tokenizer):
    from polyalign.model import create_model
    from polyalign.train.preference import reference_logps
    from tests.conftest import tiny_model_config

    tokenizer = demo_tokenizer[0]
    examples, _ = _tokenised_real_pairs(demo_run, tokenizer, 192, 21)
    packed = [dict(e) for e in examples]
    model = create_model(tiny_model_config(tokenizer.vocab_size), seed=2)
    reference_logps(model, examples, 192, tokenizer.pad_id, batch_size=4, progress=False)
    reference_logps(model, packed, 192, tokenizer.pad_id, batch_size=4, progress=False, pack=True)
    for side in ("ref_chosen", "ref_rejected"):
        expected = np.array([e[side] for e in examples])
        assert np.all(expected < 0)
        np.testing.assert_allclose([e[side] for e in packed], expected, rtol=1e-5)


def _packed_pair_layouts(demo_run, tokenizer):
    """24 real pairs cut to 192 tokens a side, with their references' log-probs, one pair per row pair
    and packed as trees (the prompt once, both responses seeing it) into rows of 384 positions, at most
    8 pairs a row: (count, buckets, rows, unpacked batch, packed batch)."""
    from polyalign.inputs import pipeline
    from polyalign.inputs.pair_rows import packed_pair_arrays, pair_arrays, tree_length, tree_spans

    length, count = 192, 24
    examples, buckets = _tokenised_real_pairs(demo_run, tokenizer, length, count)
    rng = np.random.default_rng(1)
    for example in examples:
        example["ref_chosen"], example["ref_rejected"] = (float(x) for x in -rng.uniform(50, 150, 2))
    spans = [tree_spans(e, length) for e in examples]
    # pairs cut to `length` keep different prompt tails (the cut depends on the response) and share nothing
    assert sum(shared > 0 for shared, _, _ in spans) >= count // 2
    assert examples[0]["chosen_mask"][spans[0][0]] == 1  # the first pair shares labelled tokens too
    tree_positions = sum(tree_length(e, length) for e in examples)
    assert tree_positions < sum(c + r for _, c, r in spans)

    row_length, slots = 2 * length, 8
    packer = pipeline._PackedRows(np.array([tree_length(e, length) for e in examples]), row_length, seed=0,
                                  max_items=slots)
    rows = [packer(r) for r in range(packer.rows_per_epoch())]
    assert sorted(i for row in rows for i in row) == list(range(count)) and len(rows) < count
    assert max(len(row) for row in rows) <= slots

    def stack(items):
        return {k: np.stack([item[k] for item in items]) for k in items[0]}

    packed = stack([packed_pair_arrays([examples[i] for i in row], row_length, tokenizer.pad_id, slots, length)
                    for row in rows])
    return count, buckets, rows, stack([pair_arrays(e, length, tokenizer.pad_id) for e in examples]), packed


def test_packed_pairs_give_the_unpacked_sequence_log_probs(demo_run, demo_tokenizer):
    """Every pair's chosen and rejected sequence log-probs, and its response lengths, read from the tree
    rows equal those of one pair per row pair."""
    from flax import nnx

    from polyalign.model import create_model
    from polyalign.train.preference import sequence_logps
    from tests.conftest import tiny_model_config

    tokenizer = demo_tokenizer[0]
    _, _, rows, unpacked, packed = _packed_pair_layouts(demo_run, tokenizer)
    model = create_model(tiny_model_config(tokenizer.vocab_size), seed=0)
    logps = nnx.jit(sequence_logps)  # compiled: op by op, the two layouts took 4-5 s
    pc, pr, n = (np.asarray(x) for x in logps(model, {k: jnp.asarray(v) for k, v in unpacked.items()}))
    qc, qr, m = (np.asarray(x) for x in logps(model, {k: jnp.asarray(v) for k, v in packed.items()}))
    for r, row in enumerate(rows):
        for slot, i in enumerate(row):
            np.testing.assert_allclose([qc[r, slot], qr[r, slot]], [pc[i], pr[i]], rtol=1e-5)
            assert m[r, slot] == n[i]


@pytest.mark.parametrize("method", ["hdpo", "dpo", "orpo"])
def test_packed_pairs_give_the_unpacked_loss_and_gradient(method, demo_run, demo_tokenizer):
    """The objective, its gradient and its metric sums over the tree rows equal those over one pair per
    row pair."""
    from polyalign.mesh import parallel
    from polyalign.model import create_model
    from polyalign.train.config import PreferenceConfig
    from polyalign.train.preference import PreferenceObjective
    from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer
    from tests.conftest import tiny_model_config

    tokenizer = demo_tokenizer[0]
    count, buckets, rows, unpacked, packed = _packed_pair_layouts(demo_run, tokenizer)
    config = PreferenceConfig(method=method, init="unused", lambda_dist=0.3, gamma_ftx=0.05)
    results = []
    for batch, batch_rows in ((unpacked, count), (packed, len(rows))):
        trainer = Trainer(create_model(tiny_model_config(tokenizer.vocab_size), seed=0),
                          PreferenceObjective(config, len(buckets)), OptimizerConfig(),
                          LoopConfig(steps=1, global_batch=batch_rows), parallel.make_mesh())
        grads, loss, sums = trainer.gradients({k: v[None] for k, v in batch.items()})
        results.append((float(loss), jax.tree.leaves(jax.device_get(grads)), jax.device_get(sums)))
    (loss_a, grads_a, sums_a), (loss_b, grads_b, sums_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for a, b in zip(grads_a, grads_b):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-4)
    np.testing.assert_allclose(sums_b["bucket_margin"], sums_a["bucket_margin"], rtol=1e-5, atol=1e-4)
    assert float(sums_b["pairs"]) == count and float(sums_b["tokens"]) == float(sums_a["tokens"])


@pytest.mark.slow
def test_the_packing_note_of_pairs_counts_rows_and_positions_by_hand():
    """Four pairs of a 3-token prompt and 2-token answers (ids cut to max_length 8): a tree takes the prompt's
    2 shared positions once and 2 + 2 of each side's, 6 in all, so a row of 16 holds 2; packed, 24 of 32
    positions hold tokens (75%); unpacked, each side takes a row of 8 with 4 positions each (32 of 64, 50%)."""
    from polyalign.inputs.pair_rows import pair_packing_note

    examples = [{"id": str(i), "chosen_ids": [1, 2, 3, 4 + i, 5], "rejected_ids": [1, 2, 3, 9 + i, 7]}
                for i in range(4)]
    said = ("data.pack: an epoch's 4 pairs fill 2 rows of 16 positions (2.00 a row, at most 2; each prompt once): 75% "
            "of positions hold tokens, against 50% unpacked (a row of 8 a side); each pair's loss is the one it has "
            "unpacked")
    assert pair_packing_note(examples, 8, seed=0) == said
    # a step of global_batch rows then takes twice the pairs: another run than unpacked, said with the batch
    # that takes as many (a user's packed HDPO validated at 0.927 against 0.873 and read "the loss is the same")
    assert pair_packing_note(examples, 8, seed=0, global_batch=8) == said + (
        "; train.global_batch counts rows: a step of 8 takes about 16.0 pairs where unpacked it takes 8 "
        "(train.global_batch=4 takes about as many packed)")


def test_training_on_packed_pairs(demo_run, demo_tokenizer, tmp_path, capsys):
    """`data.pack=true` end to end: rows of whole pairs, several pairs a step, a first step at the
    reference (margin 0), validation on unpacked pairs and an exported model; the run says what packing
    filled (an SFT run says it of its examples)."""
    from polyalign.train.methods import load_config
    from polyalign.train.metrics import read_metrics
    from polyalign.train.run import train as train_preference

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=20, val=4)
    config = load_config(REPO / "configs" / "hdpo_demo.yaml", [
        f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train.jsonl'}", f"val_pairs={tmp_path / 'val.jsonl'}",
        "data.pack=true", "max_length=192", "train.steps=3", "train.global_batch=2", "train.eval_every=1",
        "train.checkpoint_every=3", "attention_impl=xla"])
    capsys.readouterr()
    result = train_preference(config, tmp_path / "out", progress=False)
    steps = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and result["train_pairs"] == 20
    note = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data.pack: "))
    found = re.fullmatch(r"data\.pack: an epoch's 20 pairs fill (\d+) rows of 384 positions \(([\d.]+) a row, at "
                         r"most (\d+); each prompt once\): (\d+)% of positions hold tokens, against (\d+)% unpacked "
                         r"\(a row of 192 a side\); each pair's loss is the one it has unpacked; train\.global_batch "
                         r"counts rows: a step of 2 takes about ([\d.]+) pairs where unpacked it takes 2", note)
    assert found, note
    rows, slots = int(found[1]), int(found[3])
    assert rows < 20 and rows * slots >= 20 and found[2] == f"{20 / rows:.2f}" and found[6] == f"{2 * 20 / rows:.1f}"
    assert abs(steps[0]["rewards/margin"]) < 1e-4
    assert all(r["pairs"] >= 2 for r in steps) and sum(r["pairs"] for r in steps) > 6  # rows hold several pairs
    val = [r for r in read_metrics(tmp_path / "out") if "val_pairs" in r]
    assert val and val[-1]["val_pairs"] == 4
    assert (tmp_path / "out" / "model" / "model.safetensors").is_file()
    from polyalign.train.preference import summary_line

    assert result["packed"] is True and summary_line(result).startswith("hdpo: 3 steps of packed rows on 20 pairs;")
    assert ("| global batch | 2 rows of packed pairs (data.pack): a step trained on as many pairs as fit its rows, at "
            "least one a row (metrics.jsonl logs how many) |") in (
        tmp_path / "out" / "model" / "README.md").read_text()
    # scored pairs: the critic's terms logged, on training and validation pairs (0 < R < 2, the scores' range)
    assert all(0 < r["dist_reg"] < 2 and "dist_gap" in r for r in steps) and 0 < val[-1]["val_dist_reg"] < 2
    assert all(0 < r["dist_reach"] <= 1 for r in steps) and 0 < val[-1]["val_dist_reach"] <= 1
    # the validation pairs' score gap is fixed: logged with the first evaluation, not repeated
    assert len(val) >= 3 and "val_dist_gap" in val[0] and not any("val_dist_gap" in r for r in val[1:])


def test_validation_reports_the_objective_and_every_evaluation_is_logged(demo_run, demo_tokenizer, tmp_path):
    """A preference run's validation gives its loss, as SFT's does: with one validation pair (its weight
    cancels) HDPO's objective is -log sigmoid(margin) + lambda_dist R + gamma_ftx anchor, from the reward
    margin and terms logged beside it. An evaluation at a step `log_every` skips is written too (only SFT's
    were: the check looked for SFT's val_loss)."""
    from polyalign.train.methods import load_config
    from polyalign.train.metrics import read_metrics
    from polyalign.train.run import train as train_preference

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=6, val=2)
    config = load_config(REPO / "configs" / "hdpo_demo.yaml", [
        f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train.jsonl'}", f"val_pairs={tmp_path / 'val.jsonl'}",
        "max_length=128", "train.steps=3", "train.global_batch=2", "train.eval_every=1", "train.log_every=2",
        "data.eval_limit=1", "drift_prompts=0", "attention_impl=xla", "lambda_dist=0.7", "gamma_ftx=0.3",
        "optimizer.lr=1e-2"])
    result = train_preference(config, tmp_path / "out", progress=False)
    val = [r for r in read_metrics(tmp_path / "out") if "val_loss" in r]
    assert [r["step"] for r in val] == [1, 2, 3] and all(r["val_pairs"] == 1 for r in val)
    for r in val:
        margin = r["val_rewards/margin"]
        expected = math.log1p(math.exp(-margin)) + 0.7 * r["val_dist_reg"] + 0.3 * r["val_sft_anchor"]
        assert r["val_loss"] == pytest.approx(expected, abs=2e-5), r
    assert abs(val[-1]["val_rewards/margin"]) > 1e-3  # trained away from the reference: the check has a margin
    from polyalign.train.preference import summary_line

    assert f"validation (1 pair): loss {val[-1]['val_loss']:.4f}, reward margin" in summary_line(result)


@pytest.mark.slow
def test_packed_hdpo_on_two_processes_matches_one_process(demo_run, demo_tokenizer, tmp_path):
    """HDPO with packed pairs, the policy loaded straight into its shardings (data 2 x fsdp 2) and the
    reference log-probs computed under the mesh: two processes of two CPU devices each (jax.distributed,
    gloo) train exactly as one process with four devices, and both export the same model. Five validation
    pairs (a partial last batch on either layout) and the drift probe's greedy samples agree too."""
    from safetensors.numpy import load_file

    from polyalign.mesh.launch import free_port, start_variables
    from polyalign.train.metrics import read_metrics
    from tests.cli_runs import start_cli, wait_ok

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=24, val=5)

    def args(out):
        return ["train", "hdpo", "--config", str(REPO / "configs" / "hdpo_demo.yaml"), "--out", str(out),
                "--no-progress", f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train.jsonl'}",
                f"val_pairs={tmp_path / 'val.jsonl'}", "data.pack=true", "max_length=192", "train.steps=3",
                "train.global_batch=4", "train.eval_every=3", "train.checkpoint_every=3", "parallel.data=2",
                "parallel.fsdp=2", "drift_prompts=3", "drift_new_tokens=8", f"data.dir={demo_run[0]}"]

    wait_ok([start_cli(args(tmp_path / "one"), {}, devices=4)])
    port = free_port()
    wait_ok([start_cli(args(tmp_path / "two"), start_variables(port, 2, i), devices=2) for i in range(2)])
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two if "loss" in r] == [1, 2, 3]
    for a, b in zip(one, two):
        assert a.get("pairs") == b.get("pairs")
        for key in ("loss", "rewards/margin", "val_rewards/margin", "drift/length_ratio", "drift/support_distance"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5, (a["step"], key, a[key], b[key])
    assert one[-1]["val_pairs"] == two[-1]["val_pairs"] == 5 and "drift/length_ratio" in two[-1]
    assert abs(one[0]["rewards/margin"]) < 1e-4  # the reference computed under the mesh equals the policy
    exported = [load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("one", "two")]
    for name, array in exported[0].items():
        np.testing.assert_allclose(exported[1][name], array, atol=1e-6)


@pytest.mark.parametrize("processes, micro_batches, shards, size", [(1, 1, 1, 5), (1, 1, 4, 5), (2, 1, 4, 5),
                                                                    (3, 2, 3, 12), (4, 2, 8, 7)])
def test_critic_rows_cut_per_process_put_back_together_are_the_global_rows(processes, micro_batches, shards, size):
    """Whatever the process, micro-batch and batch-shard counts, the shares of every process, laid side by
    side as the global array lays them, are the global rows in order, then rows marked invalid."""
    from polyalign.inputs.critic_rows import local_rows
    from polyalign.inputs.pipeline import Layout

    rows = {"x": np.arange(size * 2, dtype=np.float32).reshape(size, 2), "b": np.arange(size, dtype=np.int32)}
    shares = [local_rows(rows, Layout(12, micro_batches, p, processes), "valid", shards) for p in range(processes)]
    glued = {k: np.concatenate([s[k] for s in shares], axis=1).reshape(-1, *rows.get(k, rows["b"]).shape[1:])
             for k in ("x", "b", "valid")}
    valid = glued["valid"].astype(bool)
    assert valid.sum() == size and valid[:size].all()  # padding only at the end
    np.testing.assert_array_equal(glued["x"][:size], rows["x"])
    np.testing.assert_array_equal(glued["b"][:size], rows["b"])
    pieces = micro_batches * shards
    assert len(valid) % pieces == 0 and len(valid) - size < pieces


@pytest.mark.slow
def test_the_critic_on_two_processes_matches_one_process(demo_run, demo_tokenizer, tmp_path):
    """The critic on two processes of two CPU devices: 5 pairs a step (padded to 2 per device), 12
    regression rows a step over an epoch that does not divide by 12, and 9 validation pairs: each step's
    loss, the validation metrics, the scores written onto the pairs and the head are those of one process
    with four devices, and only one process writes them."""
    from safetensors.numpy import load_file

    from polyalign.mesh.launch import free_port, start_variables
    from polyalign.pairs.make import read_pairs, write_pairs
    from polyalign.train.metrics import read_metrics
    from tests.cli_runs import start_cli, wait_ok

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=34, val=9)
    # four pairs in a bucket too small for a reference: no distance target, said once, recorded
    references = json.loads((demo_run[0] / "stats" / "references.json").read_text())
    small = next(b for b in references["skipped_buckets"])
    pairs = read_pairs(tmp_path / "train.jsonl")
    for pair in pairs[:4]:
        pair["bucket_id"] = small
    write_pairs(pairs, tmp_path / "train.jsonl")

    def args(out):  # no dropout: its draws follow the batch's padded shape, which the process count sets
        return ["train", "critic", "--config", str(REPO / "configs" / "critic_demo.yaml"), "--out", str(out),
                "--no-progress", f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train.jsonl'}",
                f"val_pairs={tmp_path / 'val.jsonl'}", f"data.dir={demo_run[0]}", "train.epochs=3",
                "train.global_batch=12", "train.log_every=1", "pair_batch=5", "dropout=0", "parallel.data=4"]

    wait_ok([start_cli(args(tmp_path / "one"), {}, devices=4)])
    port = free_port()
    outputs = wait_ok([start_cli(args(tmp_path / "two"), start_variables(port, 2, i), devices=2) for i in range(2)])
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [r["step"] for r in one] and len(one) > 10
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["step"], a["loss"], b["loss"])
        if "val_l1" in a:  # logged to 6 decimals: values a hair apart can round 1e-6 apart
            assert b["val_l1"] == pytest.approx(a["val_l1"], abs=2e-6)
    assert [sum("val_l1" in r for r in m) for m in (one, two)] == [3, 3]  # once per epoch
    for name in ("train_pairs.jsonl", "val_pairs.jsonl"):
        for a, b in zip(read_pairs(tmp_path / "one" / name), read_pairs(tmp_path / "two" / name), strict=True):
            assert b["critic_chosen"] == pytest.approx(a["critic_chosen"], abs=1e-5)
            assert b["critic_rejected"] == pytest.approx(a["critic_rejected"], abs=1e-5)
    heads = [load_file(str(tmp_path / run / "critic.safetensors")) for run in ("one", "two")]
    for name, array in heads[0].items():  # Adam over 24 steps amplifies the last bits of a reduction order
        np.testing.assert_allclose(heads[1][name], array, atol=1e-5, err_msg=name)
    assert "critic: best epoch" in outputs[0]
    unreferenced = Counter(p["bucket_id"] for p in pairs if p["bucket_id"] not in references["buckets"])
    assert unreferenced[small] >= 4
    note = (f"note: {sum(unreferenced.values())} of 34 train pairs are in buckets {demo_run[0] / 'stats'}"
            "/references.json has no reference for: ")
    shown = ", ".join(f"{b} ({n})" for b, n in sorted(unreferenced.items()))
    assert f"{note}{shown}. They train the critic's ranking only" in outputs[0] and note not in outputs[1]
    assert json.loads((tmp_path / "two" / "critic.json").read_text())["train_pairs_without_references"] == \
        dict(sorted(unreferenced.items()))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["kto", "simpo"])
def test_a_new_loss_trains_end_to_end_from_the_cli(method, demo_run, demo_tokenizer, tmp_path, capsys, monkeypatch):
    """`polyalign train kto` / `train simpo` on real pairs: KTO starts at the reference (margin 0),
    SimPO needs no reference pass (its rewards are beta x the policy's own log-probs)."""
    from polyalign.cli import main
    from polyalign.train.metrics import read_metrics
    from tests.transformers_stand_in import stand_in_transformers

    # transformers stood in for: reading as polyalign does (kto), or lowercasing (simpo), which the export's check finds
    monkeypatch.setitem(sys.modules, "transformers", stand_in_transformers(False, lowercase=method == "simpo"))

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=8, val=4)
    # the init as a Hugging Face folder ships it: with the tokenizer.json transformers reads
    from polyalign.model.export import tokenizer_files
    from polyalign.tokens.chat import get_template

    shipped = tokenizer_files(demo_tokenizer[0], get_template("polyalign", demo_tokenizer[0]), "context")
    (tmp_path / "init" / "tokenizer.json").write_text(shipped["tokenizer.json"])
    out = tmp_path / "out"
    assert main(["train", method, "--config", str(REPO / "configs" / "hdpo_demo.yaml"), "--out", str(out),
                 "--no-progress", f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train.jsonl'}",
                 f"val_pairs={tmp_path / 'val.jsonl'}", "data.max_length=128", "train.steps=2",
                 "train.global_batch=4", "train.eval_every=2", "train.checkpoint_every=2", f"data.dir={demo_run[0]}",
                 "drift_prompts=3", "drift_new_tokens=8"]) == 0
    printed, err = capsys.readouterr()
    assert f"{method}: 2 steps on 8 pairs" in printed and "; validation (4 pairs): loss " in printed
    check = json.loads((out / "summary.json").read_text())["tokenizer_check"]
    model_type = json.loads((out / "model" / "config.json").read_text())["model_type"]
    reader = f"transformers stand-in AutoTokenizer (Loaded, loaded with config.json's model_type {model_type})"
    assert check["checked"] and check["reader"] == reader and check["probes"] > 20, check
    if method == "kto":
        # the HDPO config trained as KTO is said (a note), and nothing else is
        assert check["differing"] == 0 and err == (f"note: {REPO / 'configs' / 'hdpo_demo.yaml'} says method: hdpo; "
                                                   "this run trains kto, the subcommand's method\n"), err
        assert f"tokenizer: {reader} reads {out / 'model'} with the ids training used on {check['probes']} probe " \
               "texts" in printed.splitlines()
    else:
        assert 0 < check["differing"] < check["probes"], check
        assert f"warning: {reader} reads {out / 'model'} with other ids than polyalign on {check['differing']} of " \
               f"{check['probes']} probe texts" in err
        # the same check on the init, before any step (the init folder has a config.json too)
        started = f"warning: {reader} reads {tmp_path / 'init'} with other ids than polyalign on "
        assert started in err and err.index(started) < err.index(f"warning: {reader} reads {out / 'model'}")
    steps = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
    if method == "kto":
        assert abs(steps[0]["rewards/margin"]) < 1e-4 and steps[0]["loss"] == pytest.approx(0.5, abs=1e-4)
    else:
        assert steps[0]["rewards/chosen"] < 0 and steps[0]["rewards/rejected"] < 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and summary["val_pairs"] == 4
    assert summary["val_pairs_file"] == str(tmp_path / "val.jsonl")
    assert (out / "model" / "model.safetensors").is_file()
    card = (out / "model" / "README.md").read_text()
    assert f"| pairs | {(tmp_path / 'train.jsonl').resolve()} |" in card and f"| method | {method} |" in card
    # the profile values its pairs held (the init, made on the spot, names none of its own)
    pairs = [json.loads(line)["record"] for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    # and in how many training pairs the profile prompt stood whole, as an SFT card says of its examples
    assert re.search(rf"The profile prompt was whole in (all {len(pairs)}|\d+ of {len(pairs)}) training pairs", card)
    config = json.loads((out / "model" / "tokenizer_config.json").read_text())
    assert config["polyalign_profile_values"] == {key: sorted({p[key] for p in pairs}) for key in ("family", "track",
                                                                                                  "style")}
    assert "polyalign_max_length" not in config  # trained on from a checkpoint that records no length
    # drift of the policy's own greedy samples on the first 3 validation prompts, against their human answers
    val = [json.loads(line) for line in (tmp_path / "val.jsonl").read_text().splitlines()][:3]
    drift = [r for r in read_metrics(out) if "drift/length_ratio" in r][-1]
    assert 0 < drift["drift/length_ratio"] <= (8 * 3 / sum(len(demo_tokenizer[0].encode(p["chosen"])) for p in val)
                                               + 1e-4)
    assert set(drift["drift/length_ratio_by_bucket"]) == {p["bucket_id"] for p in val}
    assert "drift/support_distance" in drift and "drift/critic" not in drift  # references given, no critic


def test_the_drift_probe_measures_only_answers_with_text(demo_run):
    """Empty answers are counted (drift/empty), never scored: all empty gives no distance and no critic score;
    mixed gives the numbers of the answers with text alone, per bucket as overall."""
    from polyalign.data.records import read_records
    from polyalign.train.critic_model import support_targets
    from polyalign.train.drift import answer_scores, load_references

    run = demo_run[0]
    references = load_references(str(run))
    records = [r for r in read_records(run / "data" / "val.jsonl") if r.bucket_id in references["buckets"]][:6]
    texts, buckets = [r.response for r in records], [r.bucket_id for r in records]
    critic_calls = []

    def critic(texts, buckets):
        critic_calls.append(list(texts))
        return np.full(len(texts), 0.25)

    assert answer_scores([""] * len(texts), buckets, references, critic) == {} and critic_calls == []
    mixed = [t if i % 2 else "" for i, t in enumerate(texts)]
    scores = answer_scores(mixed, buckets, references, critic)
    kept = [i for i in range(len(texts)) if i % 2]
    expected = support_targets([texts[i] for i in kept], [buckets[i] for i in kept], references)
    assert scores["drift/support_distance"] == pytest.approx(round(float(np.nanmean(expected)), 4))
    assert set(scores["drift/support_distance_by_bucket"]) == {buckets[i] for i in kept}
    assert critic_calls == [[texts[i] for i in kept]] and scores["drift/critic"] == 0.25


def test_a_drift_probe_whose_answers_are_all_empty_says_so_once(capsys):
    """A probe that measured nothing (every greedy answer empty) is said, once a run, with why nothing but
    drift/empty and a length ratio of 0 is logged: answers of tokens that decode to nothing (special ones) are
    empty and measure 0 tokens (they measured 1.68 times the people's length beside that warning)."""
    from types import SimpleNamespace

    from polyalign.train.drift import DriftProbe

    class Engine:  # the engine's answers: tokens that decode to nothing
        def set_model(self, model):
            pass

        def generate(self, requests):
            return [[SimpleNamespace(tokens=[2, 2, 3])] for _ in requests]

        def release(self):
            pass

    probe = DriftProbe.__new__(DriftProbe)
    probe.engine, probe.requests = Engine(), [None] * 3
    probe.tokenizer = SimpleNamespace(decode=lambda tokens, skip_special: "", encode=lambda text: list(text))
    probe.buckets, probe.human_tokens = ["a", "a", "b"], np.array([4.0, 5.0, 6.0])
    probe.references = probe.critic = None
    probe.said_empty = probe.said_blind = probe.said_wordless = False
    probe.distance_term = True
    probe.people_scores = {"drift/people_support_distance": None, "drift/people_critic": None}
    trainer = SimpleNamespace(model=lambda params: None, state={"params": None}, first_evaluation=lambda: True)
    first, second = probe(trainer), probe(trainer)
    assert first == second and first["drift/empty"] == 1.0 and first["drift/length_ratio"] == 0.0
    assert capsys.readouterr().err.splitlines() == [
        "warning: drift probe: all 3 greedy answers of the policy to the prompts of its validation pairs were empty "
        "(drift/empty 1.0), so drift/length_ratio is 0 and no support distance or critic score is logged; a small "
        "or early model often ends its turn at once under greedy decoding, and sampled answers (generate "
        "--temperature) tell more"]
    # answers of punctuation alone (a Chinese model's "，，，，"): counted and said once, not scored as text only
    answers = iter(["，，，，，，", "，，，", "我们去看电影吧。"] * 2)
    probe.tokenizer = SimpleNamespace(decode=lambda tokens, skip_special: next(answers), encode=lambda text: list(text))
    probe.said_empty = False
    first, second = probe(trainer), probe(trainer)
    assert first["drift/without_words"] == second["drift/without_words"] == 0.6667 and first["drift/empty"] == 0.0
    assert capsys.readouterr().err.splitlines() == [
        "warning: drift probe: 2 of 3 greedy answers of the policy to the prompts of its validation pairs hold no "
        "word, only punctuation (drift/without_words 0.6667): the policy has degenerated, whatever its support "
        "distance and critic score (which measure these answers as text) say; read them (`polyalign generate`), and "
        "lower the learning rate or stop earlier"]


def test_what_a_run_logs_once_goes_with_its_first_scheduled_evaluation():
    """People's drift numbers and the validation pairs' score gap are fixed for a run: logged with its first
    evaluation by the schedule, not with the first a process makes (a run resumed past it logged them again)."""
    from types import SimpleNamespace

    from polyalign.train.trainer import Trainer

    def first(step, eval_every, steps=12):
        return Trainer.first_evaluation(SimpleNamespace(step_number=step, loop=SimpleNamespace(
            eval_every=eval_every, steps=steps)))

    assert first(6, 6) and not first(12, 6)  # resumed at step 8: its first evaluation here, at 12, is the second
    assert first(12, 0) and first(12, 20)  # evaluated at the last step only: that one is the first


def test_the_critics_auc_per_bucket_comes_with_the_pairs_it_rests_on():
    """By hand: bucket a's two pairs rank people below the model once of the four human-model comparisons
    (AUC 0.25, ties half); bucket b's one pair reads 1.0 from one pair, said beside it; the unknown bucket's
    index (past the list) is left out."""
    from polyalign.train.critic import bucket_aucs

    human = np.array([0.2, 0.9, 0.1, 0.5])
    generated = np.array([0.1, 0.3, 0.4, 0.7])
    aucs, counts = bucket_aucs(human, generated, np.array([0, 0, 1, 2]), ["a", "b"])
    # a: humans 0.2, 0.9 vs models 0.1, 0.3; "human lower" in 0.2 < 0.3 only: 1 of 4
    assert aucs == {"a": 0.25, "b": 1.0} and counts == {"a": 2, "b": 1}


def test_a_round_whose_policy_leaves_no_pair_says_why_and_what_to_change(demo_run, tmp_path, monkeypatch):
    """Greedy answers of a small model came back empty for all 86 pairs and the round stopped at
    "train_pairs.jsonl: no pairs": it now names the reasons, the answers' file and the setting to change."""
    from polyalign.core.errors import ConfigError
    from polyalign.pairs.make import write_pairs
    from polyalign.train import rounds
    from polyalign.train.config import OnPolicySection, PreferenceConfig

    pairs = real_pairs(demo_run, 6)
    write_pairs(pairs, tmp_path / "pairs.jsonl")

    def answers_nothing(policy, records, out, options, progress):
        out.write_text("".join(json.dumps({"id": p["id"], "prediction": ""}) + "\n" for p in pairs))

    monkeypatch.setattr(rounds, "generate_predictions", answers_nothing)
    for temperature, advice in ((0.0, "sample them (on_policy.temperature above 0"), (0.8, None)):
        config = PreferenceConfig(on_policy=OnPolicySection(temperature=temperature))
        with pytest.raises(ConfigError) as refused:
            rounds.regenerate_pairs("R/round-1/model", tmp_path / "pairs.jsonl", tmp_path / "round-2" / "pairs", None,
                                    config, progress=False)
        said, answers = str(refused.value), tmp_path / "round-2" / "pairs" / "policy_answers.jsonl"
        assert said.startswith("round-2: the policy R/round-1/model left none of the 6 pairs usable (6 with an empty "
                               f"policy answer; its answers: {answers})")
        assert said.endswith("train the round before it longer")
        assert (advice in said) if advice else "sample" not in said


@pytest.mark.slow
def test_on_policy_rounds_regenerate_rescore_and_resume(demo_run, demo_tokenizer, tmp_path, capsys):
    """rounds=2 end to end on a tiny model: interrupted inside round 1, the same command resumes it from
    its checkpoint; round 2's rejected side is round 1's policy answering the same prompts, the critic is
    retrained on those pairs (refresh_critic) and scores them; a third run of the command trains nothing."""
    from polyalign.cli import main
    from polyalign.pairs.make import read_pairs
    from polyalign.train.metrics import read_metrics

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=8, val=4)
    critic = tmp_path / "critic"
    assert main(["train", "critic", "--config", str(REPO / "configs" / "critic_demo.yaml"), "--out", str(critic),
                 "--no-progress", f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train.jsonl'}",
                 f"val_pairs={tmp_path / 'val.jsonl'}", f"data.dir={demo_run[0]}", "train.epochs=1"]) == 0
    command = ["train", "hdpo", "--config", str(REPO / "configs" / "hdpo_demo.yaml"), "--out", str(tmp_path / "out"),
               "--no-progress", f"init={tmp_path / 'init'}", f"pairs={critic / 'train_pairs.jsonl'}",
               f"val_pairs={critic / 'val_pairs.jsonl'}", "rounds=2", "train.steps=2", "train.global_batch=4",
               "train.eval_every=2", "train.checkpoint_every=1", "data.max_length=96", "drift_prompts=2",
               "drift_new_tokens=4", "on_policy.max_new_tokens=8", "on_policy.refresh_critic=true"]
    out = tmp_path / "out"
    assert main(command + ["train.stop_at=1"]) == 0  # interrupted inside round 1
    assert not (out / "round-2").exists() and not (out / "summary.json").exists()
    assert main(command) == 0
    printed = capsys.readouterr().out
    assert "(round 2 of 2)" in printed
    # the export's tokenizer check not made is said, as build says it (transformers is not installed here)
    assert printed.splitlines()[-1] == "tokenizer: not checked: transformers is not installed", printed
    assert re.search(r"^round 1: to step 2 \(resumed at step 1\) on 8 pairs; ", printed, re.MULTILINE), printed
    assert (f"round-2: the rejected side of 8 pairs answered anew by {out / 'round-1' / 'model'} (on-policy rounds: "
            f"the rejected answers of {critic / 'train_pairs.jsonl'} serve the first round only)") in printed
    for r in (1, 2):  # each round's drift probe reads the critic that scored its pairs
        probes = [m for m in read_metrics(out / f"round-{r}") if "drift/length_ratio" in m]
        assert "drift/critic" in probes[-1]
        # people's own answers, scored by the same critic, logged once with the first probe of a run
        assert "drift/people_critic" in probes[0] and not any("drift/people_critic" in m for m in probes[1:])
    round1 = json.loads((out / "round-1" / "summary.json").read_text())
    assert (round1["start_step"], round1["end_step"]) == (1, 2)  # resumed from its checkpoint
    original = {p["id"]: p for p in read_pairs(critic / "train_pairs.jsonl")}
    regenerated = read_pairs(out / "round-2" / "pairs" / "train_pairs.jsonl")
    answers = {json.loads(line)["id"]: json.loads(line) for line in
               (out / "round-2" / "pairs" / "policy_answers.jsonl").read_text().splitlines()}
    # named with the run above the round: every lineage has a round-1
    assert regenerated and all(answers[p["id"]]["model"] == "out/round-1" for p in regenerated)
    left_out = 8 - len(regenerated)  # empty policy answers, or the person's own answer: said with the reasons
    assert (f"round-2: {left_out} of 8 pairs left out (" in printed) == (left_out > 0), printed
    assert sum(p["rejected"] != original[p["id"]]["rejected"] for p in regenerated) > 0
    # the refreshed critic: trained on round 2's pairs, with the first critic's settings, scoring them
    refreshed = json.loads((out / "round-2" / "critic" / "critic.json").read_text())
    assert refreshed["config"]["pairs"] == str(out / "round-2" / "pairs" / "train_pairs.jsonl")
    assert refreshed["config"]["dropout"] == json.loads((critic / "critic.json").read_text())["config"]["dropout"]
    scored = {p["id"]: p for p in read_pairs(out / "round-2" / "critic" / "train_pairs.jsonl")}
    assert scored.keys() == {p["id"] for p in regenerated}
    for pair in regenerated:
        assert pair["chosen"] == original[pair["id"]]["chosen"]  # the human side stays
        assert scored[pair["id"]]["rejected"] == pair["rejected"] and "critic_rejected" in scored[pair["id"]]
        assert scored[pair["id"]]["weight"] > 0
    round2 = json.loads((out / "round-2" / "config.json").read_text())
    assert round2["init"] == str(out / "round-1" / "model") and round2["rounds"] == 1
    # ... so each round's model folder says which round of how many it is: its record and its card
    for r, start in ((1, str(tmp_path / "init")), (2, "round 1's model")):
        model = out / f"round-{r}" / "model"
        assert json.loads((model / "polyalign_training.json").read_text())["round"] == {
            "number": r, "of": 2, "from": str(tmp_path / "init")}
        card = (model / "README.md").read_text()
        assert card.count("| on-policy round |") == 1 and (
            f"| hdpo |\n| on-policy round | {r} of 2 (rounds=2: trained from {start} as a run of its own, so its "
            "config records rounds 1) |\n") in card
    assert round2["pairs"] == str(out / "round-2" / "critic" / "train_pairs.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2] and summary["model"] == str(out / "round-2" / "model")
    assert summary["rounds"][0]["resumed_from_step"] == 1 and "resumed_from_step" not in summary["rounds"][1]
    # the run's time is this command's (both rounds, round 2's answers and critic), not the last round's
    assert "total_seconds" not in summary and all(r["seconds"] > 0 for r in summary["rounds"])
    assert summary["seconds"] > sum(r["seconds"] for r in summary["rounds"][1:])  # round 1 partly ran before
    before = (out / "round-2" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(command) == 0  # both rounds finished: nothing trains again
    assert (out / "round-2" / "metrics.jsonl").read_text() == before
    assert (out / "round-2" / "model" / "README.md").read_text() == card  # marked again, alike
    # every round's validation is said, not only the last round's
    margin = summary["rounds"][0]["last"]["val_rewards/margin"]
    assert re.search(r"^rounds 1, 2 finished before: kept, not trained again \(--overwrite trains every round "
                     rf"again\)\nround 1: to step 2 on 8 pairs; validation reward margin {margin:.4f}, accuracy "
                     r"[\d.]+\nhdpo: already trained to step 2 \(nothing left to train\) .*\(round 2 of 2\)$",
                     capsys.readouterr().out, re.MULTILINE)
    # a finished round is kept for its own config only: another value is refused, naming the round
    assert main(command + ["lambda_dist=0.25"]) == 2
    err = capsys.readouterr().err
    assert (f"{out / 'round-1'}: a finished round of another config (lambda_dist: 0.1 there, 0.25 now); the rounds "
            "after it train from its model: pass --overwrite to train every round again") in err, err
    assert main(command + ["train.keep_checkpoints=1"]) == 0  # where a run stops and what it keeps: the same run
    assert main(command + ["train.log_every=2", "train.eval_every=1"]) == 0  # what it logs: the same rounds too
    capsys.readouterr()
    # on-policy sampling is round 2's: round 1 (the given pairs) passes, round 2 is refused
    assert main(command + ["on_policy.temperature=0.7"]) == 2
    assert f"{out / 'round-2'}: a finished round of another config (on_policy.temperature" in capsys.readouterr().err
    assert main(command + ["train.steps=3", "--resume"]) == 2
    assert ("(train.steps: --resume continues a stopped round, not a finished one)" in capsys.readouterr().err)
    # one run (rounds=1) into the rounds' folder would sit beside them: refused, naming them
    assert main([arg for arg in command if arg != "rounds=2"]) == 2
    assert f"{out}: holds on-policy rounds (round-1, round-2), and this is one run (rounds=1)" in \
        capsys.readouterr().err
    # the folder of rounds copied elsewhere: its rounds' paths name the original, and still they are its rounds
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    assert main([*command[:5], str(moved), *command[6:]]) == 0
    assert (moved / "round-2" / "metrics.jsonl").read_text() == before
    # without refresh_critic, the first critic scores round 2's pairs, and its files sit beside them for the drift
    kept = tmp_path / "kept"
    assert main([*command[:5], str(kept), *command[6:-1], "on_policy.refresh_critic=false"]) == 0
    copied = kept / "round-2" / "pairs" / "critic.safetensors"
    assert copied.read_bytes() == (critic / "critic.safetensors").read_bytes()
    assert "drift/critic" in [m for m in read_metrics(kept / "round-2") if "drift/length_ratio" in m][-1]
    # --overwrite trains every round again, round 2's pairs answered anew by the new round 1; a later round of
    # an earlier, longer run (trained from the replaced models) goes too
    shutil.copytree(kept / "round-2", kept / "round-3")
    capsys.readouterr()
    assert main([*command[:5], str(kept), *command[6:-1], "on_policy.refresh_critic=false"]) == 0  # rounds=2 again
    assert "round 3, finished by an earlier run with more rounds, is kept on disk but is not this run's model " \
           "(rounds=2: OUT/summary.json names round 2's)" in capsys.readouterr().out
    assert main([*command[:5], str(kept), *command[6:-1], "on_policy.refresh_critic=false", "--overwrite"]) == 0
    printed = capsys.readouterr().out
    assert "round-2: the rejected side of 8 pairs answered anew" in printed and "(round 2 of 2)" in printed
    assert f"from {tmp_path / 'init'} -> {kept / 'round-1'}" in printed  # round 1 trained again, from the start
    assert not (kept / "round-3").exists()


def test_the_critic_and_evaluate_refuse_references_made_from_an_earlier_prepare(demo_run, tmp_path, capsys):
    from polyalign.cli import main
    from polyalign.core.errors import StatsError
    from polyalign.train import critic
    from polyalign.train.methods import load_config

    run, _, _ = demo_run
    references = json.loads((run / "stats" / "references.json").read_text())
    assert references["made_from"] == {"data/manifest.json": file_digest(run / "data" / "manifest.json")}
    moved = tmp_path / "run"
    (moved / "stats").mkdir(parents=True)
    (moved / "data").mkdir()
    shutil.copy(run / "stats" / "references.json", moved / "stats" / "references.json")
    (moved / "data" / "manifest.json").write_text("{}")  # prepare ran again since
    (tmp_path / "pairs.jsonl").write_text("")
    config = load_config(REPO / "configs" / "critic_demo.yaml", [f"data.dir={moved}", "init=unused",
                                                                  f"pairs={tmp_path / 'pairs.jsonl'}",
                                                                  f"val_pairs={tmp_path / 'pairs.jsonl'}"])
    stale = f"made from another data/manifest.json than the one there now .*rerun `polyalign stats {moved}`"
    with pytest.raises(StatsError, match=stale):
        critic.setup(config, None, progress=False)
    test = run / "data" / "test.jsonl"
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": json.loads(line)["id"], "prediction": "Yes."}) + "\n"
                                              for line in test.read_text().splitlines()[:20]))
    assert main(["evaluate", "--records", str(test), "--predictions", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "eval"), "--allow-partial", "--references",
                 str(moved / "stats" / "references.json")]) == 2
    err = capsys.readouterr().err
    assert re.search(stale, err) and "Traceback" not in err, err


def test_a_batch_carries_its_layout_and_one_of_neither_is_refused():
    from polyalign.inputs.pair_rows import is_packed, packed_pair_arrays, pair_arrays

    rows, trees = pair_arrays(None, 8, 0), packed_pair_arrays([], 16, 0, 2, 8)
    assert is_packed(trees) and not is_packed(rows)
    hand_made = {k: v for k, v in rows.items() if k != "chosen_length"}
    with pytest.raises(ValueError, match=r"missing \['chosen_length'\], unexpected \[\]"):
        is_packed(hand_made)
    with pytest.raises(ValueError, match=r"unexpected \['branch_ids'\]"):
        is_packed({**rows, "branch_ids": trees["branch_ids"]})


def test_round_two_says_which_pairs_it_left_out_and_why(demo_run, tmp_path, monkeypatch, capsys):
    """Regenerating the rejected side: a pair whose policy answer is empty, or is the person's own answer,
    cannot be a pair; the round says how many it left out and why instead of training on silently fewer."""
    from polyalign.pairs.make import write_pairs
    from polyalign.train import rounds
    from polyalign.train.methods import load_config

    pairs = real_pairs(demo_run, 6)
    write_pairs(pairs, tmp_path / "pairs.jsonl")

    def answer(policy, records_file, out, options, progress=True):  # the policy's answers, without a model
        answers = ["", pairs[1]["chosen"], *("A fresh answer." for _ in pairs[2:])]
        out.write_text("".join(json.dumps({"id": p["id"], "prediction": a}) + "\n"
                                     for p, a in zip(pairs, answers)))

    monkeypatch.setattr(rounds, "generate_predictions", answer)
    config = load_config(REPO / "configs" / "hdpo_demo.yaml", ["init=unused"], method="hdpo")
    result = rounds.regenerate_pairs("round-1/model", tmp_path / "pairs.jsonl", tmp_path / "round-2" / "pairs", None,
                                     config, progress=False)
    assert result["pairs"] == 4 and result["dropped"] == {"empty_side": 1, "chosen_equals_rejected": 1}
    assert ("round-2: 2 of 6 pairs left out (1 answered as the person did, 1 with an empty policy answer)"
            in capsys.readouterr().out)


def test_both_sides_of_a_pair_cut_by_turns_answer_one_conversation(demo_run, demo_tokenizer):
    """truncation=turns: a long answer leaves its prompt a smaller share than a short one, so cut alone the
    two sides of a pair would keep other turns and DPO would compare answers to two conversations. Both lose
    as many turns as the longer side: on real multi-turn records answered by their own reply and by the
    longest reply of the split, at every cutoff where the sides alone would differ, the prompt tokens agree."""
    from polyalign.data.records import Record, read_records
    from polyalign.inputs.pair_rows import tokenise_pairs
    from polyalign.tokens.chat import Message, encode_conversation, get_template, record_messages

    run, _, _ = demo_run
    tokenizer, template = demo_tokenizer[0], get_template("polyalign")
    records = read_records(run / "data" / "val.jsonl")
    longest = max((r.response for r in records), key=len)
    differed = 0
    for record in [r for r in records if len(r.history) >= 6][:10]:
        pair = {"id": record.id, "bucket_id": record.bucket_id, "record": record.to_json(),
                "chosen": record.response, "rejected": longest}
        prompt = record_messages(Record.from_json(pair["record"]), "context", with_response=False)
        whole = len(encode_conversation(template, tokenizer, [*prompt, Message("assistant", longest)]).ids)
        for cutoff in range(whole - 1, whole // 3, -max(whole // 12, 1)):
            alone = [encode_conversation(template, tokenizer, [*prompt, Message("assistant", pair[side])],
                                         cutoff=cutoff, truncation="turns") for side in ("chosen", "rejected")]
            if alone[0].turns_dropped == alone[1].turns_dropped or any(e.mid_turn for e in alone):
                continue
            differed += 1
            (example,) = tokenise_pairs([pair], tokenizer, template, "context", cutoff, [record.bucket_id], "turns")
            first = [int(np.argmax(example[f"{side}_mask"])) for side in ("chosen", "rejected")]
            assert first[0] == first[1] and list(example["chosen_ids"][:first[0]]) == list(
                example["rejected_ids"][:first[1]]), (record.id, cutoff)
            assert max(len(example["chosen_ids"]), len(example["rejected_ids"])) <= cutoff
    assert differed >= 3, differed


def test_the_critic_notes_responses_read_past_its_encoders_trained_length(tmp_path):
    """An encoder trained from scratch at 256 tokens with the critic reading 512 (its default): said, with
    the length that keeps within them, as generate and the preference methods say it."""
    from polyalign.tokens.tokenizer import past_trained_note

    init = tmp_path / "sft" / "model"
    init.mkdir(parents=True)
    (init / "tokenizer_config.json").write_text(json.dumps({"polyalign_max_length": 256}))
    assert past_trained_note(init, 512, "the critic encode responses at") == (
        f"note: {init} was never trained on a sequence longer than 256 tokens (polyalign_max_length in its "
        "tokenizer_config.json: polyalign trained it, or the model it was trained from, from scratch): "
        "data.max_length 512 lets the critic encode responses at positions it never "
        "learned; data.max_length=256 keeps within them")
    assert past_trained_note(init, 256, "pairs reach") is None
    assert past_trained_note("gs://bucket/model", 512, "pairs reach") is None


def test_a_preference_run_notes_pairs_cut_otherwise_than_its_sft_stage(tmp_path):
    """data.dir's build cut its SFT examples to another length or by another truncation than this run cuts
    pairs: a note naming both and the settings that cut alike; an init trained from scratch on shorter
    sequences than data.max_length: a note naming its length. Nothing where they agree."""
    import dataclasses

    from polyalign.train.config import PreferenceConfig
    from polyalign.train.preference import cut_unlike_sft_notes

    run, init = tmp_path / "run", tmp_path / "sft" / "model"
    (run / "build").mkdir(parents=True)
    init.mkdir(parents=True)
    (run / "build" / "manifest.json").write_text(json.dumps({"options": {"max_length": 192, "truncation": "turns"}}))
    (init / "tokenizer_config.json").write_text(json.dumps({"polyalign_max_length": 192}))
    config = PreferenceConfig(method="dpo", init=str(init))
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, dir=str(run)))
    assert config.data.max_length == 256 and config.truncation == "left"  # the defaults
    assert cut_unlike_sft_notes(config) == [
        f"note: {run}'s build cut its SFT examples to 192 tokens by --truncation turns; this run cuts pairs to "
        "data.max_length 256 by truncation=left: give data.max_length=192 truncation=turns to cut them alike",
        f"note: {init} was never trained on a sequence longer than 192 tokens (polyalign_max_length in its "
        "tokenizer_config.json: polyalign trained it, or the model it was trained from, from scratch): "
        "data.max_length 256 lets pairs reach positions it never learned; "
        "data.max_length=192 keeps within them"]
    alike = dataclasses.replace(config, truncation="turns", data=dataclasses.replace(config.data, max_length=192))
    assert cut_unlike_sft_notes(alike) == []
    # pairs shorter than the SFT examples are no mismatch (the defaults: a build at 512, pairs at 256)
    (run / "build" / "manifest.json").write_text(json.dumps({"options": {"max_length": 512}}))
    (init / "tokenizer_config.json").write_text("{}")
    assert cut_unlike_sft_notes(config) == []


def test_a_preference_run_says_what_it_cut_adds_and_reads_otherwise_before_its_steps(demo_run, demo_tokenizer,
                                                                                      monkeypatch, tmp_path):
    """The notes under a preference run's start line: how many training pairs data.max_length cuts (counted
    against the pairs encoded whole), that an init not trained with polyalign's profile prompt gets one, and
    transformers' reading of the init's tokenizer where it differs from polyalign's."""
    from polyalign.data.records import Record
    from polyalign.inputs.pair_rows import tokenise_pairs
    from polyalign.model import tokenizer_check
    from polyalign.tokens.chat import Message, encode_conversation, get_template, record_messages
    from polyalign.train import preference
    from polyalign.train.config import PreferenceConfig

    tokenizer = demo_tokenizer[0]
    template = get_template("polyalign", tokenizer)
    pairs = real_pairs(demo_run, 12)
    buckets = sorted({p["bucket_id"] for p in pairs})
    whole = tokenise_pairs(pairs, tokenizer, template, "context", 10**6, buckets)
    longest = [max(len(e["chosen_ids"]), len(e["rejected_ids"])) for e in whole]
    limit = sorted(longest)[len(longest) // 2]  # about half are longer
    cut = tokenise_pairs(pairs, tokenizer, template, "context", limit, buckets)
    over = sum(length > limit for length in longest)
    assert 0 < over < len(pairs) and not any(e["truncated"] for e in whole)
    note = preference.truncation_note(cut, "p.jsonl", limit)
    assert note.startswith(f"note: {over} of {len(pairs)} training pairs of p.jsonl ({over / len(pairs):.0%}) are "
                           f"longer than data.max_length {limit} and are cut")
    assert preference.truncation_note(whole, "p.jsonl", 10**6) is None
    assert preference.truncation_note(cut, "p.jsonl", limit, "left", "oracle").endswith(
        f"--max-length {limit} --truncation left --profile oracle` shows them)")  # the run's own profile
    # truncation=keep_system cuts the prompt after its opening system message (the profile prompt), as
    # `build --truncation keep_system` and generation do: the pairs that lost it with left keep it
    kept = tokenise_pairs(pairs, tokenizer, template, "context", limit, buckets, "keep_system")
    lost = sum(e["system_cut"] for e in cut)
    assert lost > 0 and sum(e["system_cut"] for e in kept) < lost
    assert note.endswith(f"; {lost} of them lose their opening system message, whole or in part (truncation=left "
                         "cuts a prompt from its start, the system message first; truncation=turns would keep it "
                         "where it and the last question fit the prompt's share); a larger "
                         f"data.max_length keeps more (`polyalign show p.jsonl --checkpoint INIT --max-length {limit} "
                         "--truncation left` shows them)")
    for before, after in zip(whole, kept):
        if after["truncated"] and not after["system_cut"]:  # the prompt's first tokens are the whole pair's
            assert list(after["chosen_ids"][:16]) == list(before["chosen_ids"][:16])
            assert len(after["chosen_ids"]) <= limit and len(after["rejected_ids"]) <= limit
    assert "the prompt after its opening system message" in preference.truncation_note(kept, "p.jsonl", limit,
                                                                                        "keep_system")
    # truncation=turns drops the oldest whole turns instead, as generation does, as many from both sides as the
    # side with the longer answer (the smaller prompt share) drops: both answer one conversation, whose
    # prompt tokens are the same on both sides wherever neither was cut inside its last question
    turns = tokenise_pairs(pairs, tokenizer, template, "context", limit, buckets, "turns")
    assert sum(e["system_cut"] for e in turns) < lost
    for pair, example in zip(pairs, turns):
        prompt = record_messages(Record.from_json(pair["record"]), "context", with_response=False)
        sides = {side: encode_conversation(template, tokenizer, [*prompt, Message("assistant", pair[side])],
                                           cutoff=limit, truncation="turns") for side in ("chosen", "rejected")}
        dropped = max(e.turns_dropped for e in sides.values())
        # and its opening system message where a side left it out whole (over half of that side's share)
        kept = [*[prompt[0]] * (not any(e.system_left_out for e in sides.values())), *prompt[1 + dropped:]]
        for side in ("chosen", "rejected"):
            alike = encode_conversation(template, tokenizer, [*kept, Message("assistant", pair[side])],
                                        cutoff=limit, truncation="turns")
            assert list(example[f"{side}_ids"]) == alike.ids.tolist() and not alike.turns_dropped
            sides[side] = alike
        if not any(e.mid_turn for e in sides.values()):
            first = [int(np.argmax(example[f"{side}_mask"])) for side in ("chosen", "rejected")]
            assert first[0] == first[1] and list(example["chosen_ids"][:first[0]]) == list(
                example["rejected_ids"][:first[1]])
    turns_note = preference.truncation_note(turns, "p.jsonl", limit, "turns")
    assert "the prompt by its oldest whole turns (its opening system message kept where it fits)" in turns_note
    # the pairs whose cut left the system message out whole, or lost operator notes with their turns, counted
    whole_out = sum(any(e.system_left_out for e in x.get("cuts", {}).values()) for x in turns)
    notes_out = sum(any(e.system_dropped for e in x.get("cuts", {}).values()) for x in turns)
    assert (f"({whole_out} left out whole, over half of the prompt's share" in turns_note) == (whole_out > 0)
    assert (f"; {notes_out} lose system messages from inside" in turns_note) == (notes_out > 0)

    config = PreferenceConfig(method="dpo", init="lab/model")
    assert tokenizer.profile_mode is None  # the demo's tokenizer: trained by polyalign, no model behind it
    said = preference.profile_note(config, tokenizer, pairs[0])
    assert said.startswith("note: lab/model was not trained with a profile prompt; profile=context opens "
                           "every pair's prompt with one (the first pair's: 'You are a helpful assistant.")
    unprofiled = PreferenceConfig(method="dpo", init="x", profile="none")
    assert preference.profile_note(unprofiled, tokenizer, pairs[0]) is None
    monkeypatch.setattr(tokenizer, "profile_mode", "context")
    assert preference.profile_note(config, tokenizer, pairs[0]) is None
    monkeypatch.setattr(tokenizer, "profile_mode", "none")  # an export trained without one: said too
    assert preference.profile_note(config, tokenizer, pairs[0]).startswith("note: lab/model was not trained with")

    # transformers stood in for: one reader drops every text's first id, another reads as polyalign does
    folder = tmp_path / "init"  # a Hugging Face folder: its config.json picks transformers' tokenizer class
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    init_config = PreferenceConfig(method="dpo", init=str(folder))
    for encoder, expected in ((lambda text: tokenizer.encode(text)[1:], "other ids"), (tokenizer.encode, None)):
        monkeypatch.setattr(tokenizer_check, "folder_encoder",
                            lambda path, encoder=encoder: (encoder, "stand-in reader"))
        warning = preference.tokenizer_note(init_config, tokenizer, pairs)
        assert (warning is None) if expected is None else warning.startswith(
            f"warning: stand-in reader reads {folder} with other ids than polyalign on ")
    monkeypatch.setattr(tokenizer_check, "folder_encoder",
                        lambda path: (None, "not checked: transformers is not installed"))
    assert preference.tokenizer_note(init_config, tokenizer, pairs) is None


def test_a_lora_run_says_what_it_trains(demo_tokenizer):
    """The start line's LoRA part: rank, targets and the trained parameters, counted by hand (rank x
    (fan-in + fan-out) for each target of each layer), and every parameter of the unquantised model as the
    whole, also when the base is stored NF4."""
    from polyalign.model import create_model
    from polyalign.model.architecture import LoraConfig
    from polyalign.model.lora import add_adapters, quantize_base
    from polyalign.train.run import trained_parameters
    from tests.conftest import tiny_model_config

    cfg = tiny_model_config(demo_tokenizer[0].vocab_size)
    base = create_model(cfg)
    whole = sum(x.size for x in jax.tree.leaves(__import__("flax").nnx.state(base)))
    assert trained_parameters(base) == ""
    hidden, head = cfg.hidden_size, cfg.head_dim
    fans = {"q": (hidden, cfg.num_heads * head), "k": (hidden, cfg.num_kv_heads * head),
            "v": (hidden, cfg.num_kv_heads * head), "o": (cfg.num_heads * head, hidden)}
    adapted = add_adapters(base, LoraConfig(rank=4, targets=("q", "k", "v", "o")))
    trained = cfg.num_layers * sum(4 * (fan_in + fan_out) for fan_in, fan_out in fans.values())
    expected = (f"LoRA rank 4 (alpha 32) on q, k, v, o over the frozen base: {trained:,} parameters trained "
                f"({trained / (whole + trained):.2%} of {whole + trained:,}); ")
    assert trained_parameters(adapted) == expected
    assert trained_parameters(quantize_base(adapted, "nf4")) == expected.replace("the frozen base",
                                                                                 "the NF4-quantised base")


def test_the_drift_probe_warns_when_the_critic_scores_far_answers_nearer_people_than_people():
    """The critic's score of the policy's answers below people's own, while the support distance puts
    them over 1.5 times further than people's: warned (the collapse a user saw: "庄庄庄" scored -0.35
    against people's 0.12-1.28, at support distance 3.1-5.3); not when either reading agrees."""
    from polyalign.train.drift import critic_blind_warning

    people = {"drift/people_critic": 0.64, "drift/people_support_distance": 1.9}
    warned = critic_blind_warning({"drift/critic": -0.12, "drift/support_distance": 4.2}, people)
    assert warned.startswith("warning: drift probe: the critic scores the policy's answers nearer people (-0.120) "
                             "than people's own answers to the same prompts (0.640), while their support distance "
                             "says they are further (4.200 against people's 1.900)")
    assert "so HDPO's distance term stops pushing back" in warned
    # a run without the distance term (dpo, kto, ...) is not told the term stops working, nor to refresh a critic
    other = critic_blind_warning({"drift/critic": -0.12, "drift/support_distance": 4.2}, people, distance_term=False)
    assert other.startswith(warned[:warned.index("so HDPO")]) and "HDPO's distance term stops" not in other
    assert "though this run has no distance term to follow it" in other and "refresh_critic" not in other
    assert critic_blind_warning({"drift/critic": 0.7, "drift/support_distance": 4.2}, people) is None
    assert critic_blind_warning({"drift/critic": -0.12, "drift/support_distance": 2.5}, people) is None
    assert critic_blind_warning({"drift/critic": -0.12}, people) is None  # no references: no distance to read
    assert critic_blind_warning({"drift/critic": -0.12, "drift/support_distance": 4.2}, {}) is None
    # people's mark is read over the prompts the policy answered: an empty answer's prompt is left out of both
    from polyalign.train.drift import DriftProbe

    probe = DriftProbe.__new__(DriftProbe)
    probe.people_scores = {"drift/people_support_distance": np.array([1.0, np.nan, 3.0, 8.0]),
                           "drift/people_critic": np.array([0.2, 0.4, 0.6, 0.8])}
    assert probe.people_means([0, 2]) == {"drift/people_support_distance": 2.0, "drift/people_critic": 0.4}
    assert probe.people_means([1]) == {"drift/people_critic": 0.4}  # no distance to read for that prompt
    assert probe.people_means([]) == {}


def test_a_rounds_summary_says_every_finished_round_and_the_rounds_planned():
    """A run stopped inside round 2 of 3 lists round 1 and says "round 2 of 3" (the finished rounds alone
    would say "of 1"); the final summary lists every round but the last, whose line it is."""
    from polyalign.train.preference import summary_line

    first = {"round": 1, "end_step": 2, "train_pairs": 8,
             "last": {"val_rewards/margin": 0.1, "val_rewards/accuracy": 0.5}}
    stopped = {"method": "hdpo", "train_pairs": 8, "last": {}, "round": 2, "rounds": [first], "rounds_planned": 3,
               "model": "m", "start_step": 0, "end_step": 1, "stopped_early": True}
    lines = summary_line(stopped).splitlines()
    assert lines[0] == "round 1: to step 2 on 8 pairs; validation reward margin 0.1000, accuracy 0.500"
    assert lines[1].startswith("hdpo: ") and lines[1].endswith("(round 2 of 3)") and len(lines) == 4
    assert lines[2].startswith("the rounds' reward margins are each against the model the round started from")
    final = {**stopped, "round": 2, "rounds": [first, {**first, "round": 2}], "rounds_planned": 2,
             "stopped_early": False}
    lines = summary_line(final).splitlines()
    assert [line.split(":")[0] for line in lines] == ["round 1", "hdpo", lines[2].split(":")[0], "model"]
    assert lines[1].endswith("(round 2 of 2)")
    # the same command again after a run with rounds=3: nothing trains, rounds 1 and 2 are kept, round 3 lies beyond
    again = {**final, "rounds_kept": [1, 2], "rounds_beyond": [3], "start_step": 2, "end_step": 2}
    lines = summary_line(again).splitlines()
    assert lines[0] == "rounds 1, 2 finished before: kept, not trained again (--overwrite trains every round again)"
    assert lines[2].startswith("hdpo: already trained to step 2 (nothing left to train) on 8 pairs")
    assert lines[-2] == ("round 3, finished by an earlier run with more rounds, is kept on disk but is not this run's "
                         "model (rounds=2: OUT/summary.json names round 2's)")
    assert summary_line({**again, "rounds_kept": [1, 2, 3], "rounds_beyond": []}).startswith("rounds 1-3 finished")
    # round 1 killed at step 1 and taken up there by this command: its line says so, as the last round's does
    resumed = {**final, "rounds": [{**first, "resumed_from_step": 1}, {**first, "round": 2}]}
    assert summary_line(resumed).splitlines()[0] == ("round 1: to step 2 (resumed at step 1) on 8 pairs; validation "
                                                     "reward margin 0.1000, accuracy 0.500")


def test_a_round_beyond_the_rounds_a_later_run_planned_is_still_the_kth_of_k(tmp_path):
    """Evaluating OUT/round-3 after the same command ran again with rounds=2 (which names round 2 its model):
    round 3 is not "3 of 2"."""
    from polyalign.evaluate.run import round_of

    for r in (1, 2, 3):
        (tmp_path / f"round-{r}").mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"rounds_planned": 2}))
    assert round_of(tmp_path / "round-3")["round"] == "3 of 3 (on-policy)"
    assert round_of(tmp_path / "round-1")["round"] == "1 of 2 (on-policy)"


def test_a_run_is_not_continued_on_pairs_or_an_init_that_changed_since_it_started(demo_run, demo_tokenizer, tmp_path):
    """OUT/inputs.json records what the pairs files held: the same command after `pairs import --overwrite`
    wrote other pairs at the same path is refused (with --resume too), since the checkpoints were trained on
    the others; the same bytes written again continue it; --overwrite trains on the new pairs. An init
    checkpoint replaced at its path (another SFT run's --overwrite) is refused the same way."""
    from polyalign.core.yaml_config import ConfigError
    from polyalign.train.methods import load_config
    from polyalign.train.run import train as train_preference

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=6, val=2)
    config = load_config(REPO / "configs" / "hdpo_demo.yaml", [
        "method=dpo", f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train.jsonl'}",
        f"val_pairs={tmp_path / 'val.jsonl'}", "max_length=128", "train.steps=1", "train.global_batch=2",
        "train.eval_every=1", "drift_prompts=0", "attention_impl=xla"])
    out = tmp_path / "out"
    assert train_preference(config, out, progress=False)["end_step"] == 1
    recorded = json.loads((out / "inputs.json").read_text())
    assert set(recorded) == {"init", "pairs", "val_pairs"}
    assert recorded["pairs"]["digest"] == file_digest(tmp_path / "train.jsonl")
    pairs = (tmp_path / "train.jsonl").read_bytes()
    (tmp_path / "train.jsonl").write_bytes(pairs)  # written again, the same pairs: the same run
    assert train_preference(config, out, progress=False)["end_step"] == 1
    (tmp_path / "train.jsonl").write_bytes(b"".join(pairs.splitlines(keepends=True)[1:]))  # imported again
    for existing in ("continue", "resume"):
        with pytest.raises(ConfigError, match=rf"{out}: the run started on other data: pairs={tmp_path / 'train.jsonl'}"
                                              rf" \({recorded['pairs']['digest'][7:19]}… then, [0-9a-f]{{12}}… now\)"):
            train_preference(config, out, progress=False, existing=existing)
    again = train_preference(config, out, progress=False, existing="overwrite")
    assert again["start_step"] == 0 and again["train_pairs"] == 5
    assert json.loads((out / "inputs.json").read_text())["pairs"]["digest"] == file_digest(tmp_path / "train.jsonl")
    # The init trained or exported again at the same path: the reference and the starting point are other
    # weights, and the checkpoints went on from the old ones.
    from polyalign.model import create_model, load_hf_checkpoint, save_hf_checkpoint

    init = load_hf_checkpoint(tmp_path / "init")
    save_hf_checkpoint(create_model(init.config, seed=1), tmp_path / "init", overwrite=True, extra_files={
        name: (tmp_path / "init" / name).read_bytes() for name in ("tokenizer.model", "tokenizer_config.json")})
    for existing in ("continue", "resume"):
        with pytest.raises(ConfigError, match=rf"{out}: the run started from another model: init={tmp_path / 'init'} "
                                              r"\([0-9a-f]{12}… then, [0-9a-f]{12}… now\) holds other weights"):
            train_preference(config, out, progress=False, existing=existing)


def test_a_finished_round_and_a_build_are_judged_by_what_they_hold(tmp_path):
    """A finished round of on-policy rounds trained on pairs that hold something else now is refused as a
    stopped run is; a build's digest is its manifest's less how long it took and where its dataset lies."""
    from polyalign.core.yaml_config import ConfigError
    from polyalign.train.ownership import check_finished_round, input_contents, record_contents

    round_dir, pairs = tmp_path / "rounds" / "round-1", tmp_path / "pairs.jsonl"
    round_dir.mkdir(parents=True)
    config = {"method": "hdpo", "init": "/sft/model", "pairs": str(pairs)}
    (round_dir / "config.json").write_text(json.dumps(config))
    pairs.write_text('{"id": "a"}\n')
    record_contents(round_dir, input_contents({"pairs": str(pairs)}))
    check_finished_round(round_dir, config, {"pairs": None}, contents=input_contents({"pairs": str(pairs)}))
    pairs.write_text('{"id": "b"}\n')
    with pytest.raises(ConfigError, match=r"the run started on other data: pairs="):
        check_finished_round(round_dir, config, {"pairs": None}, contents=input_contents({"pairs": str(pairs)}))
    manifest = {"settings": {"max_length": 64}, "made_from": {"data/manifest.json": "sha256:1"},
                "splits": {"train": {"examples": 10, "tokens": 600}}, "seconds": 6.5, "dataset": "/a/build/x"}
    digests = []
    for change in ({}, {"seconds": 9.0, "dataset": "/moved/build/x"}, {"splits": {"train": {"examples": 10,
                                                                                          "tokens": 590}}}):
        (tmp_path / "manifest.json").write_text(json.dumps({**manifest, **change}))
        digests.append(input_contents({"build": str(tmp_path / "manifest.json")})["build"]["digest"])
    assert digests[0] == digests[1] != digests[2]  # built again alike: the same; cut otherwise: another


def test_a_folder_of_rounds_moved_elsewhere_keeps_its_rounds_and_another_runs_model_does_not_pass(tmp_path):
    """A round's recorded init and pairs under the folder of rounds it was made in equal this command's
    under the folder it sits in now (copied or moved), for a finished round and a stopped one alike; the
    same round-1/model of another run's rounds is another init, refused."""
    from polyalign.core.yaml_config import ConfigError
    from polyalign.train.ownership import check_finished_round, claim

    old, new, other = tmp_path / "old", tmp_path / "new", tmp_path / "other"

    def config(rounds):
        return {"method": "hdpo", "init": str(rounds / "round-1" / "model"), "lambda_dist": 0.1,
                "pairs": str(rounds / "round-2" / "pairs" / "train_pairs.jsonl"),
                "val_pairs": str(tmp_path / "critic" / "val_pairs.jsonl")}

    inputs = {"init": None, "pairs": None, "val_pairs": None}
    (new / "round-2").mkdir(parents=True)
    (new / "round-2" / "config.json").write_text(json.dumps(config(old)))  # copied from old, as recorded there
    check_finished_round(new / "round-2", config(new), inputs)  # a finished round: kept
    assert claim(new / "round-2", config(new), inputs) == "continue"  # a stopped one: continued
    with pytest.raises(ConfigError, match=r"a finished round of another config \(init: "):
        check_finished_round(new / "round-2", {**config(new), "init": str(other / "round-1" / "model")}, inputs)
    with pytest.raises(ConfigError, match=r"made by another config \(lambda_dist: 0.1 there, 0.2 now\)"):
        claim(new / "round-2", {**config(new), "lambda_dist": 0.2}, inputs)


def test_pair_sides_leave_a_long_system_message_out_together(demo_run, demo_tokenizer):
    """A pair whose opening system message (the conversation's own, real text, then the profile prompt) is
    over half the prompt's share on the long answer's side only: that side leaves it out whole rather than
    keep its headless tail (keep_system and turns), and the short answer's side leaves it out too, so both
    answer one conversation whose prompt tokens are the same on both sides."""
    from polyalign.data.records import Record
    from polyalign.inputs.pair_rows import tokenise_pairs
    from polyalign.tokens.chat import Message, encode_conversation, get_template, record_messages
    from polyalign.train import preference

    tokenizer = demo_tokenizer[0]
    template = get_template("polyalign", tokenizer)
    pairs = real_pairs(demo_run, 12)
    pair = dict(pairs[1])
    record = dict(pair["record"])
    record["history"] = [{"role": "system", "text": "\n".join(p["chosen"] for p in pairs[2:8])},
                         *record.get("history", [])]
    pair["record"] = record
    pair["chosen"] = pair["chosen"][:40]
    pair["rejected"] = " ".join(p["chosen"] for p in pairs[8:12])
    prompt = record_messages(Record.from_json(record), "context", with_response=False, system=tokenizer.system_mode)
    found = 0
    for truncation in ("keep_system", "turns"):
        for limit in range(64, 400, 8):
            alone = {side: encode_conversation(template, tokenizer, [*prompt, Message("assistant", pair[side])],
                                               cutoff=limit, truncation=truncation) for side in ("chosen", "rejected")}
            if alone["chosen"].system_left_out == alone["rejected"].system_left_out:
                continue
            (example,) = tokenise_pairs([pair], tokenizer, template, "context", limit, [pair["bucket_id"]],
                                        truncation)
            assert example["system_cut"]
            rest = prompt[1:]
            for side in ("chosen", "rejected"):
                expected = encode_conversation(template, tokenizer, [*rest, Message("assistant", pair[side])],
                                               cutoff=limit, truncation=truncation)
                assert list(example[f"{side}_ids"]) == expected.ids.tolist(), (truncation, limit, side)
            first = [int(np.argmax(example[f"{side}_mask"])) for side in ("chosen", "rejected")]
            assert first[0] == first[1] and list(example["chosen_ids"][:first[0]]) == list(
                example["rejected_ids"][:first[1]])
            # the run's note counts the pair once, both sides having left it out
            assert all(example["cuts"][side].system_left_out for side in ("chosen", "rejected"))
            assert "; 1 of them lose their opening system message, whole or in part" in (
                note := preference.truncation_note([example], "p.jsonl", limit, truncation)), note
            assert "(1 left out whole, over half of the prompt's share, rather than keep its last tokens)" in note
            found += 1
    assert found >= 2, found


def test_a_round_is_marked_in_its_record_and_both_cards_whole_and_once(tmp_path):
    """mark_round: the record gets "round", the model's and the adapter's cards a row after the method's (once,
    however often a round is marked; a rerun with another count replaces it); a record that is not an export's
    (not JSON, not a mapping) and a card without a method row are left as they are."""
    from polyalign.train.rounds import mark_round

    model, adapter = tmp_path / "round-2" / "model", tmp_path / "round-2" / "adapter"
    model.mkdir(parents=True)
    adapter.mkdir()
    card = "# m\n\n| key | value |\n|---|---|\n| method | hdpo |\n| steps | 4 |\n"
    for folder in (model, adapter):
        (folder / "README.md").write_text(card)
    (model / "polyalign_training.json").write_text(json.dumps({"config": {"rounds": 1}, "segments": []}))
    for rounds in (2, 3, 3):
        mark_round(model, 2, rounds, "/runs/sft/model")
    row = ("| on-policy round | 2 of 3 (rounds=3: trained from round 1's model as a run of its own, so its config "
           "records rounds 1) |")
    for folder in (model, adapter):
        assert (folder / "README.md").read_text() == card.replace("| hdpo |\n", f"| hdpo |\n{row}\n")
    assert json.loads((model / "polyalign_training.json").read_text()) == {
        "config": {"rounds": 1}, "segments": [], "round": {"number": 2, "of": 3, "from": "/runs/sft/model"}}
    assert not list(tmp_path.rglob("*.partial"))
    (model / "polyalign_training.json").write_text("{truncated")
    (model / "README.md").write_text("a card of one's own\n")
    mark_round(model, 1, 2, "/runs/sft/model")
    assert (model / "polyalign_training.json").read_text() == "{truncated"
    assert (model / "README.md").read_text() == "a card of one's own\n"
    assert "2 of 3" not in (adapter / "README.md").read_text() and "| on-policy round | 1 of 2 (rounds=2: trained " \
        "from /runs/sft/model as a run" in (adapter / "README.md").read_text()


def test_pairs_accuracy_reads_what_training_validated_and_a_model_against_itself_ties(demo_run, demo_tokenizer,
                                                                                       tmp_path, capsys):
    """`pairs accuracy` on a DPO model's validation pairs, with every setting read from its training record,
    gives the reward accuracy and margin training logged on them at its last step (two code paths: the
    trainer's metric sums, and per-pair log-probs here); the model as its own reference ties on every pair
    (margin 0, accuracy 0: a tie counts as wrong); a checkpoint with no training record has no reference,
    so no reward accuracy, only the log-prob preference, recomputed here by hand from the per-pair file."""
    from polyalign.cli import main
    from polyalign.train.metrics import read_metrics

    init_checkpoint_and_pair_files(demo_run, demo_tokenizer[0], tmp_path, train=8, val=12)
    assert main(["train", "dpo", "--config", str(REPO / "configs" / "hdpo_demo.yaml"), "--out", str(tmp_path / "dpo"),
                 "--no-progress", f"init={tmp_path / 'init'}", f"pairs={tmp_path / 'train.jsonl'}",
                 f"val_pairs={tmp_path / 'val.jsonl'}", "train.steps=2", "train.global_batch=4", "train.eval_every=2",
                 "data.max_length=96", "drift_prompts=0", "beta=0.5"]) == 0
    logged = [m for m in read_metrics(tmp_path / "dpo") if "val_rewards/accuracy" in m][-1]
    model = tmp_path / "dpo" / "model"
    capsys.readouterr()
    assert main(["pairs", "accuracy", "--model", str(model), "--pairs", str(tmp_path / "val.jsonl"),
                 "--out", str(tmp_path / "acc"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "acc" / "accuracy.json").read_text())
    overall = summary["overall"]
    assert summary["settings"]["reference"] == str(tmp_path / "init") and summary["settings"]["beta"] == 0.5
    assert summary["settings_from"]["max_length"] == "the model's training record"
    assert overall["pairs"] == len((tmp_path / "val.jsonl").read_text().splitlines())
    assert overall["reward_accuracy"]["share"] == pytest.approx(logged["val_rewards/accuracy"], abs=1e-4)
    assert overall["reward_margin"] == pytest.approx(logged["val_rewards/margin"], abs=2e-4)
    assert re.search(rf"^all +{overall['pairs']} +{overall['reward_accuracy']['share']:.3f} \[", printed, re.MULTILINE)
    assert "against the reference " + str(tmp_path / "init") in printed
    # the first pair's chosen log-prob, from the model's logits here (its own softmax, its own shift)
    from polyalign.inputs.pair_rows import tokenise_pairs
    from polyalign.model import load_hf_checkpoint
    from polyalign.model.hf import checkpoint_tokenizer
    from polyalign.pairs.make import read_pairs
    from polyalign.tokens.chat import get_template

    pair = read_pairs(tmp_path / "val.jsonl")[0]
    tokenizer = checkpoint_tokenizer(model)
    example = tokenise_pairs([pair], tokenizer, get_template("polyalign", tokenizer), "context", 96,
                             [pair["bucket_id"]], "left")[0]
    ids, mask = np.asarray(example["chosen_ids"]), np.asarray(example["chosen_mask"], bool)
    logits = np.asarray(load_hf_checkpoint(model)(jnp.asarray(ids[None])))[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    by_hand = sum(logp[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t])
    first = json.loads((tmp_path / "acc" / "per_pair.jsonl").read_text().splitlines()[0])
    assert first["id"] == pair["id"] and first["chosen_logp"] == pytest.approx(by_hand, abs=1e-3)
    assert first["chosen_tokens"] == mask.sum()
    # what the record gave, spelt out, is the same measurement (it was refused as other settings)
    assert main(["pairs", "accuracy", "--model", str(model), "--pairs", str(tmp_path / "val.jsonl"), "--beta", "0.5",
                 "--reference", str(tmp_path / "init"), "--out", str(tmp_path / "acc"), "--no-progress"]) == 0

    # a reference that is not there is said before any forward pass, and leaves no OUT
    assert main(["pairs", "accuracy", "--model", str(model), "--reference", str(tmp_path / "gone"), "--pairs",
                 str(tmp_path / "val.jsonl"), "--out", str(tmp_path / "none"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"reference {tmp_path / 'gone'}: no model folder there (give a "
                                                    "Hugging Face model folder)")
    assert not (tmp_path / "none").exists()
    assert main(["pairs", "accuracy", "--model", str(model), "--reference", str(model), "--pairs",
                 str(tmp_path / "val.jsonl"), "--out", str(tmp_path / "itself"), "--no-progress"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "itself" / "per_pair.jsonl").read_text().splitlines()]
    assert all(row["reward_margin"] == 0.0 and not row["reward_correct"] for row in rows)
    itself = json.loads((tmp_path / "itself" / "accuracy.json").read_text())["overall"]
    assert itself["reward_accuracy"]["share"] == 0.0 and itself["logp_preference"] == itself[
        "reference_logp_preference"] and itself["ties"] == len(rows)
    assert "every pair ties (a margin within 1e-06 of 0 on each)" in capsys.readouterr().out  # not "below chance"

    assert main(["pairs", "accuracy", "--model", str(tmp_path / "init"), "--pairs", str(tmp_path / "val.jsonl"),
                 "--out", str(tmp_path / "plain"), "--no-progress"]) == 0
    plain = json.loads((tmp_path / "plain" / "accuracy.json").read_text())
    assert "reward_accuracy" not in plain["overall"] and plain["settings_from"]["max_length"] == "the default"
    rows = [json.loads(line) for line in (tmp_path / "plain" / "per_pair.jsonl").read_text().splitlines()]
    prefers = sum(r["chosen_logp"] / r["chosen_tokens"] > r["rejected_logp"] / r["rejected_tokens"] for r in rows)
    assert plain["overall"]["logp_preference"]["share"] == round(prefers / len(rows), 4)
    low, high = plain["overall"]["logp_preference"]["interval"]
    assert low <= prefers / len(rows) <= high and 0 <= low < high <= 1
    assert plain["settings"]["dtype"] == "float32"  # auto, on a CPU
    # --dtype bfloat16: the same pairs read in bfloat16, close to float32's log-probs but not equal to them
    assert main(["pairs", "accuracy", "--model", str(tmp_path / "init"), "--pairs", str(tmp_path / "val.jsonl"),
                 "--out", str(tmp_path / "half"), "--no-progress", "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "half" / "accuracy.json").read_text())["settings"]["dtype"] == "bfloat16"
    half = [json.loads(line) for line in (tmp_path / "half" / "per_pair.jsonl").read_text().splitlines()]
    full, halved = (np.array([r["chosen_logp"] for r in got]) for got in (rows, half))
    assert not np.array_equal(full, halved) and np.allclose(halved, full, rtol=0.05)
    out = capsys.readouterr().out
    assert "no reference, so no baseline (--reference MODEL measures another checkpoint beside it)" in out
    assert ("no reward accuracy: it needs the reference the model was trained against (the model has no training "
            "record naming its init; give --reference INIT)") in out  # a model made elsewhere
    assert main(["pairs", "accuracy", "--model", str(model), "--reference", "none", "--pairs",
                 str(tmp_path / "val.jsonl"), "--out", str(tmp_path / "unreferenced"), "--no-progress"]) == 0
    assert "(--reference none)" in capsys.readouterr().out
    (tmp_path / "scratch").mkdir()  # a model trained from scratch: its record names no init
    for name in (tmp_path / "init").iterdir():
        (tmp_path / "scratch" / name.name).write_bytes(name.read_bytes())
    record = json.loads((model / "polyalign_training.json").read_text())
    (tmp_path / "scratch" / "polyalign_training.json").write_text(json.dumps(
        {**record, "config": {**record["config"], "method": "sft", "init": None}}))
    assert main(["pairs", "accuracy", "--model", str(tmp_path / "scratch"), "--pairs", str(tmp_path / "val.jsonl"),
                 "--out", str(tmp_path / "scratch_acc"), "--no-progress"]) == 0
    assert "(its training record names no init (trained from scratch))" in capsys.readouterr().out

    # SimPO has no reference: its training logs beta times the mean log-prob per token, and so does this
    assert main(["train", "simpo", "--config", str(REPO / "configs" / "hdpo_demo.yaml"), "--out",
                 str(tmp_path / "simpo"), "--no-progress", f"init={tmp_path / 'init'}",
                 f"pairs={tmp_path / 'train.jsonl'}", f"val_pairs={tmp_path / 'val.jsonl'}", "train.steps=2",
                 "train.global_batch=4", "train.eval_every=2", "data.max_length=96", "drift_prompts=0",
                 "beta=2.0"]) == 0
    logged = [m for m in read_metrics(tmp_path / "simpo") if "val_rewards/accuracy" in m][-1]
    capsys.readouterr()
    assert main(["pairs", "accuracy", "--model", str(tmp_path / "simpo" / "model"), "--pairs",
                 str(tmp_path / "val.jsonl"), "--out", str(tmp_path / "acc-simpo"), "--no-progress"]) == 0
    simpo = json.loads((tmp_path / "acc-simpo" / "accuracy.json").read_text())
    assert simpo["settings"]["reward"] == "mean_logprob" and simpo["settings_from"]["reward"].startswith("simpo's")
    assert simpo["overall"]["reward_accuracy"]["share"] == pytest.approx(logged["val_rewards/accuracy"], abs=1e-4)
    assert simpo["overall"]["reward_margin"] == pytest.approx(logged["val_rewards/margin"], abs=2e-4)
    assert simpo["overall"]["reward_accuracy"] == simpo["overall"]["logp_preference"]  # one measure, by definition
    # --reference none: the log-prob preference alone, said
    assert main(["pairs", "accuracy", "--model", str(model), "--reference", "none", "--pairs",
                 str(tmp_path / "val.jsonl"), "--out", str(tmp_path / "alone"), "--no-progress"]) == 0
    alone = json.loads((tmp_path / "alone" / "accuracy.json").read_text())
    assert alone["settings"]["reference"] is None and "reward_accuracy" not in alone["overall"]
    assert "no reward accuracy" in capsys.readouterr().out


def test_the_accuracy_intervals_are_wilsons_by_hand():
    """3 of 4: p = 0.75, z = 1.959964; centre (p + z^2/2n) / (1 + z^2/n) = 0.62753, half-width
    z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n) = 0.32689: [0.30064, 0.95442], rounded outward to 4 places."""
    from polyalign.train.pair_accuracy import share, wilson

    assert wilson(3, 4) == (0.3006, 0.9545)
    assert share([True, False, True, True]) == {"share": 0.75, "interval": (0.3006, 0.9545)}
    assert wilson(0, 5) == (0.0, 0.4345)  # (z^2/n) / (1 + z^2/n) = 0.76829 / 1.76829


def test_pairs_accuracy_measures_an_sft_model_at_the_length_its_build_trained_it(tmp_path):
    """An SFT run's config leaves data.max_length unset (the build sets it): it was measured at the default
    1024, past the 256 tokens it trained on; a from-scratch model's tokenizer config says its own length."""
    from polyalign.train.pair_accuracy import DEFAULT_MAX_LENGTH, trained_max_length

    (tmp_path / "run" / "build").mkdir(parents=True)
    (tmp_path / "run" / "build" / "manifest.json").write_text(json.dumps({"settings": {"max_length": 256}}))
    (tmp_path / "model").mkdir()
    assert trained_max_length(tmp_path / "model", {"data": {"dir": str(tmp_path / "run")}}) == (
        256, f"the build it trained on, {tmp_path / 'run' / 'build'}")
    assert trained_max_length(tmp_path / "model", {"data": {"dir": str(tmp_path / "gone")}}) == (
        DEFAULT_MAX_LENGTH, "the default")
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"polyalign_max_length": 128}))
    assert trained_max_length(tmp_path / "model", {}) == (128, "polyalign_max_length in its tokenizer_config.json")
    # the build's truncation too: a run built with --truncation turns was measured cutting pairs as `left` does
    from polyalign.train.pair_accuracy import AccuracyOptions, resolved

    (tmp_path / "run" / "build" / "manifest.json").write_text(json.dumps({"settings": {"max_length": 256,
                                                                                      "truncation": "turns"}}))
    sft = {"method": "sft", "data": {"dir": str(tmp_path / "run")}}
    options, sources = resolved(tmp_path / "model", AccuracyOptions(), sft)
    built = f"the build it trained on, {tmp_path / 'run' / 'build'}"
    assert (options.max_length, options.truncation) == (256, "turns")
    assert sources["max_length"] == sources["truncation"] == built
    options, sources = resolved(tmp_path / "model", AccuracyOptions(truncation="left"), sft)  # given: kept
    assert (options.truncation, sources["truncation"]) == ("left", "given")
    hdpo = {"method": "hdpo", "truncation": "keep_system", "data": {"dir": str(tmp_path / "run"), "max_length": 64}}
    options, sources = resolved(tmp_path / "model", AccuracyOptions(), hdpo)  # a preference run's own record
    assert (options.max_length, options.truncation) == (64, "keep_system")
    assert sources["truncation"] == "the model's training record"


def test_the_rewards_the_cli_offers_are_the_ones_pairs_accuracy_computes():
    from polyalign import cli
    from polyalign.train.pair_accuracy import REWARDS

    assert cli.PAIR_REWARDS == REWARDS
