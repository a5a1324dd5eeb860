"""Pairs, the critic and the HDPO/DPO method on the shared trainer."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from polyalign.data.records import InputError
from polyalign.pairs import assign_weights, build_pairs, imbalance_gains, pair_weight, read_predictions
from polyalign.train import losses


def _records(demo_run, n=40):
    from polyalign.data.prepare import read_records

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


def test_pair_weights_by_hand():
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


def test_prediction_files_are_checked(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prediction": "x"}\n{"id": "a", "prediction": "y"}\n')
    with pytest.raises(InputError, match="p.jsonl:2: duplicate id 'a'"):
        read_predictions(path)
    path.write_text('{"id": "a"}\n')
    with pytest.raises(InputError, match="p.jsonl:1: a prediction row needs string fields id and prediction"):
        read_predictions(path)


def test_critic_loss_and_collapse_guard():
    from polyalign import parallel
    from polyalign.train.critic import MARGIN, Critic, CriticMethod

    with parallel.unsharded():
        from flax import nnx

        critic = Critic(8, 3, 0.0, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batch = {"reg_pooled": rng.normal(size=(4, 8)).astype(np.float32), "reg_bucket": np.array([0, 1, 2, 3]),
             "reg_target": np.array([0.0, 0.5, 1.0, 2.0], np.float32), "reg_valid": np.ones(4, np.float32),
             "pair_human": rng.normal(size=(2, 8)).astype(np.float32),
             "pair_model": rng.normal(size=(2, 8)).astype(np.float32), "pair_bucket": np.array([0, 3]),
             "pair_valid": np.ones(2, np.float32), "seed": np.zeros(4, np.int32)}
    numerators, _ = CriticMethod().numerators(critic, batch)
    c = np.asarray(critic(batch["reg_pooled"], batch["reg_bucket"]))
    assert float(numerators["l1"]) == pytest.approx(np.abs(c - batch["reg_target"]).sum(), rel=1e-5)
    h, m = (np.asarray(critic(batch[k], batch["pair_bucket"])) for k in ("pair_human", "pair_model"))
    assert float(numerators["rank"]) == pytest.approx(np.maximum(0, MARGIN - m + h).sum(), rel=1e-5)


def test_a_constant_critic_is_refused():
    from polyalign.train.critic import CriticCollapse, check_not_collapsed

    with pytest.raises(CriticCollapse, match="all 3 pairs the same"):
        check_not_collapsed(np.full(3, 0.25), np.full(3, 0.25))
    check_not_collapsed(np.array([0.1, 0.2, 0.3]), np.array([0.1, 0.2, 0.4]))  # one differing pair is enough


def test_support_targets_skip_constant_features(demo_run):
    from polyalign.features import text_features
    from polyalign.references import support_distance
    from polyalign.train.critic import support_targets

    run, _, _ = demo_run
    references = json.loads((run / "stats" / "references.json").read_text())
    bucket, reference = next(iter(references["buckets"].items()))
    text = "A short answer."
    everything = support_distance(text_features(text), reference, references["features"])
    nonconstant = [n for n in references["features"] if reference["features"][n]["std"] > 1e-12]
    targets = support_targets([text, text], [bucket, "xx|none"], references)
    assert targets[0] == pytest.approx(support_distance(text_features(text), reference, nonconstant), rel=1e-6)
    assert np.isnan(targets[1])  # no reference for that bucket
    assert len(nonconstant) < len(references["features"]) and everything >= 0


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
    return batch


@pytest.mark.parametrize("method", ["hdpo", "dpo"])
def test_preference_objective_equals_the_pure_loss_for_any_micro_batching(method, tmp_path):
    from polyalign import parallel
    from polyalign.model import create_model
    from polyalign.train.hdpo import PreferenceConfig, Preference, sequence_logps
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
        trainer = Trainer(create_model(tiny_model_config(64), seed=0), Preference(config, 3), OptimizerConfig(),
                          LoopConfig(steps=1, global_batch=8, micro_batches=micro), parallel.make_mesh(), tmp_path)
        local = {k: v.reshape(micro, 8 // micro, *v.shape[1:]) for k, v in batch.items()}
        grads, loss, _ = trainer.gradients(local)
        results.append((float(loss), jax.tree.leaves(jax.device_get(grads))))
        assert float(loss) == pytest.approx(float(expected), abs=1e-5), micro
    for loss, grads in results[1:]:
        for a, b in zip(grads, results[0][1]):
            np.testing.assert_allclose(a, b, atol=1e-6)
