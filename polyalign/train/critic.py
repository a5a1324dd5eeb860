"""The support-distance critic (METHOD section 6): c(y, b) estimates how far response y lies from the
human support of bucket b.

The encoder is the frozen SFT policy: the response's final hidden states, mean-pooled over its tokens.
Because the encoder is frozen, every response is encoded once; the critic head (a learned bucket
embedding and an MLP) then trains on the shared trainer. Regression targets d(y, b) come from the
train-only bucket references for human *and* model responses, so the critic is calibrated off the
human support too; a hinge term ranks human responses below model ones.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save
from sklearn.metrics import roc_auc_score

from polyalign.core.errors import CriticCollapse
from polyalign.core.yaml_config import ConfigError
from polyalign.features.references import read_references
from polyalign.inputs.critic_rows import EncodedPairs, critic_batches
from polyalign.inputs.pipeline import capped_pairs
from polyalign.mesh import parallel
from polyalign.model.architecture import longer_than_positions
from polyalign.model.hf import checkpoint_tokenizer
from polyalign.model.pooling import encode_responses
from polyalign.pairs.make import assign_weights, read_pairs, write_pairs
from polyalign.tokens.tokenizer import past_trained_note
from polyalign.train.config import CriticConfig, LoopConfig
from polyalign.train.critic_model import (  # noqa: F401 (MARGIN, CriticScorer: part of this module's face)
    MARGIN,
    Critic,
    CriticScorer,
    score,
    set_scores,
    support_targets,
)
from polyalign.train.methods import require
from polyalign.train.run import Job, load_init, steps_per_epoch
from polyalign.train.trainer import Trainer


class CriticObjective:
    """mean |c - d| over regression rows + mean max(0, margin - c(model) + c(human)) over pairs."""

    coefficients = {"l1": 1.0, "rank": 1.0}

    def denominators(self, batch):
        return {"l1": jnp.broadcast_to(batch["reg_valid"].sum(), batch["reg_valid"].shape[:1]),
                "rank": jnp.broadcast_to(batch["pair_valid"].sum(), batch["pair_valid"].shape[:1])}

    def numerators(self, model, mb, key=None):
        # dropout draws from the trainer's key for this micro-batch; none when evaluating
        k1, k2, k3 = jax.random.split(key, 3) if key is not None else (None, None, None)
        predicted = model(mb["reg_pooled"], mb["reg_bucket"], k1)
        l1 = jnp.abs(predicted - mb["reg_target"]) * mb["reg_valid"]
        human = model(mb["pair_human"], mb["pair_bucket"], k2)
        generated = model(mb["pair_model"], mb["pair_bucket"], k3)
        hinge = jnp.maximum(0.0, MARGIN - generated + human) * mb["pair_valid"]
        return {"l1": l1.sum(), "rank": hinge.sum()}, {"l1_sum": l1.sum(), "rank_sum": hinge.sum()}


def encode_pairs(pairs, model, tokenizer, references, bucket_index, config, progress) -> EncodedPairs:
    """Both sides of every pair encoded once by the frozen encoder, with their support distances."""
    human = [p["chosen"] for p in pairs]
    generated = [p["rejected"] for p in pairs]
    names = [p["bucket_id"] for p in pairs]
    pooled = encode_responses(model, tokenizer, human + generated, config.data.max_length, config.data.eval_batch,
                              progress)
    unknown = len(bucket_index)
    skip = config.distance_features == "nonconstant"

    def targets(texts):
        return support_targets(texts, names, references, skip, config.distance_counts)

    return EncodedPairs(pooled[:len(pairs)], pooled[len(pairs):],
                        np.array([bucket_index.get(b, unknown) for b in names], np.int32),
                        targets(human), targets(generated))


def check_not_collapsed(human: np.ndarray, generated: np.ndarray, tolerance: float = 1e-6) -> None:
    """Raises CriticCollapse when every pair ties: such scores would only add noise to HDPO."""
    if len(human) and np.abs(np.asarray(human) - np.asarray(generated)).max() < tolerance:
        raise CriticCollapse(f"the critic scores both sides of all {len(human)} pairs the same (a constant "
                             "critic); refusing to write scores onto the pairs")


def human_model_auc(human: np.ndarray, generated: np.ndarray) -> float | None:
    """ROC AUC of telling people from the model by a lower critic score: the chance that a random human
    response scores below a random model response (ties count half), over all responses, not just the
    pairs. 0.5 is chance."""
    if not len(human) or not len(generated):
        return None
    labels = np.concatenate([np.ones(len(human)), np.zeros(len(generated))])
    return float(roc_auc_score(labels, -np.concatenate([human, generated])))


def evaluate_split(critic: Critic, split: EncodedPairs, buckets: list[str]) -> dict[str, Any]:
    human, generated = score(critic, split.pooled_human, split.bucket), score(critic, split.pooled_model, split.bucket)
    predicted = np.concatenate([human, generated])
    target = np.concatenate([split.target_human, split.target_model])
    has = ~np.isnan(target)
    aucs, counts = bucket_aucs(human, generated, split.bucket, buckets)
    return {"l1": float(np.abs(predicted[has] - target[has]).mean()) if has.any() else float("nan"),
            "ranking_accuracy": float((human < generated).mean()),
            "auc": human_model_auc(human, generated),
            "hinge": float(np.maximum(0.0, MARGIN - generated + human).mean()),
            "human_mean": float(human.mean()), "model_mean": float(generated.mean()),
            "auc_by_bucket": aucs, "pairs_by_bucket": counts}


def bucket_aucs(human: np.ndarray, generated: np.ndarray, bucket: np.ndarray,
                buckets: list[str]) -> tuple[dict[str, float], dict[str, int]]:
    """human_model_auc within each bucket of the pairs (`bucket`: each pair's index into `buckets`; the unknown
    bucket's index past them is left out), and beside it the pairs it rests on: one pair's AUC reads 1.0 or
    0.0 and was printed alone."""
    aucs, counts = {}, {}
    for b in np.unique(bucket):
        if b < len(buckets):
            inside = bucket == b
            auc = human_model_auc(human[inside], generated[inside])
            if auc is not None:
                aucs[buckets[b]], counts[buckets[b]] = round(auc, 4), int(inside.sum())
    return dict(sorted(aucs.items())), dict(sorted(counts.items()))


def pairs_without_references(pairs: list[dict], references: dict) -> dict[str, int]:
    """Pairs by bucket whose bucket has no human-support reference (too few train answers, or a bucket the
    prepared data lacks): they give the critic no distance target, only the ranking term."""
    counts = Counter(p["bucket_id"] for p in pairs if p["bucket_id"] not in references["buckets"])
    return dict(sorted(counts.items()))


def unreferenced_note(unreferenced: dict[str, int], total: int, references_path: Path) -> str:
    shown = ", ".join(f"{bucket} ({n})" for bucket, n in unreferenced.items())
    return (f"note: {sum(unreferenced.values())} of {total} train pairs are in buckets {references_path} has no "
            f"reference for: {shown}. They train the critic's ranking only (no support-distance target); a "
            "bucket gets a reference from enough train answers (`polyalign stats` lists the buckets without one)")


def setup(config: CriticConfig, mesh, progress: bool = True) -> Job:
    """Encodes every pair with the frozen encoder, then trains the head on the encodings; `finish`
    writes OUT/critic.safetensors, OUT/critic.json and the scored pairs (OUT/train_pairs.jsonl,
    OUT/val_pairs.jsonl, reweighted with the critic term)."""
    started = time.perf_counter()
    require(config, "init", "pairs", "val_pairs")
    too_long = longer_than_positions(config.init, config.data.max_length, f"data.max_length {config.data.max_length}",
                                     "set a smaller data.max_length")
    if too_long:
        raise ConfigError(too_long)
    past = past_trained_note(config.init, config.data.max_length, "the critic encode responses at")
    if past and jax.process_index() == 0:  # the longest responses read where the encoder never learned
        print(past, flush=True)
    run = Path(config.data.dir) if config.data.dir else None
    references_path = (Path(config.references) if config.references
                       else (run / "stats" / "references.json" if run else None))
    if references_path is None:
        raise ConfigError("the critic measures each answer against its bucket's human references: set data.dir=RUN "
                          "(its stats/references.json, from `polyalign stats RUN`) or references=FILE")
    if not references_path.is_file():
        raise ConfigError(f"{references_path}: bucket references missing; run `polyalign stats RUN` "
                          "or pass references=")
    references = read_references(references_path)
    if config.distance_counts == "per_token" and not all("rates" in r for r in references["buckets"].values()):
        raise ConfigError(f"{references_path}: made before references had per-token rates; rerun "
                          "`polyalign stats RUN`, or set distance_counts=raw")
    train_pairs, val_pairs = read_pairs(Path(config.pairs)), read_pairs(Path(config.val_pairs))
    val_pairs = capped_pairs(val_pairs, config.data.eval_limit)
    if not train_pairs or not val_pairs:
        raise ConfigError("the critic needs train and validation pairs; one of the pair files is empty")
    unreferenced = pairs_without_references(train_pairs, references)
    if unreferenced and jax.process_index() == 0:
        print(unreferenced_note(unreferenced, len(train_pairs), references_path), flush=True)
    tokenizer = checkpoint_tokenizer(config.init)
    encoder = load_init(config)
    buckets = sorted({p["bucket_id"] for p in train_pairs} | set(references["buckets"]))
    bucket_index = {b: i for i, b in enumerate(buckets)}
    train = encode_pairs(train_pairs, encoder, tokenizer, references, bucket_index, config, progress)
    val = encode_pairs(val_pairs, encoder, tokenizer, references, bucket_index, config, progress)
    with parallel.unsharded():
        critic = Critic(encoder.config.hidden_size, len(buckets), config.dropout, nnx.Rngs(config.model.seed))
    regression_rows = train.regression_rows
    epoch_steps = steps_per_epoch(regression_rows, config.train.global_batch)
    best: dict[str, Any] = {"loss": float("inf")}

    def batches(layout, loop: LoopConfig):
        return critic_batches(train, loop.steps, loop.seed, layout, config.pair_batch,
                              shards=mesh.shape["data"] * mesh.shape["fsdp"])

    def evaluate(trainer: Trainer) -> dict[str, Any]:
        model = trainer.model(jax.device_get(trainer.state["params"]))
        report = evaluate_split(model, val, buckets)
        loss = report["l1"] + report["hinge"] if np.isfinite(report["l1"]) else report["hinge"]
        if loss < best["loss"]:  # keep the epoch with the best validation loss
            best.update(loss=loss, epoch=trainer.step_number // epoch_steps, report=report,
                        params=jax.device_get(trainer.state["params"]))
        return {f"val_{k}": round(v, 6) if isinstance(v, float) else v for k, v in report.items()}

    def finish(trainer: Trainer, out: Path, segments: list[dict]) -> dict[str, Any]:  # the critic keeps no record
        critic = trainer.model(best["params"])
        train_report = evaluate_split(critic, train, buckets)
        for split, pairs in ((train, train_pairs), (val, val_pairs)):
            human, generated = (score(critic, split.pooled_human, split.bucket),
                                score(critic, split.pooled_model, split.bucket))
            check_not_collapsed(human, generated)
            set_scores(pairs, human, generated)
        assign_weights(train_pairs)
        assign_weights(val_pairs, training=train_pairs)
        flat = nnx.to_flat_state(nnx.state(critic, nnx.Param))
        report = {
            "best_epoch": best["epoch"], "val": best["report"], "train": train_report,
            "train_pairs": len(train_pairs), "val_pairs": len(val_pairs), "regression_rows": regression_rows,
            "buckets": buckets, "hidden_size": encoder.config.hidden_size, "encoder": str(config.init),
            "max_tokens": config.data.max_length, "config": asdict(config),
            "train_pairs_without_references": unreferenced,
            "seconds": round(time.perf_counter() - started, 1),
        }
        if jax.process_index() == 0:  # every process scored the same pairs; one writes them, as export does
            write_pairs(train_pairs, out / "train_pairs.jsonl")
            write_pairs(val_pairs, out / "val_pairs.jsonl")
            (out / "critic.safetensors").write_bytes(save({".".join(map(str, path)): np.asarray(v[...])
                                                           for path, v in flat}))
            (out / "critic.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        return report

    return Job(critic, CriticObjective(), batches, epoch_size=regression_rows, evaluate=evaluate, finish=finish)


def summary_line(result: dict[str, Any]) -> str:
    val = result["val"]
    line = (f"critic: best epoch {result['best_epoch']}, validation L1 {val['l1']:.4f} (its support distances' "
            f"mean error), ranking accuracy {val['ranking_accuracy']:.3f} on {result['val_pairs']} held-out pairs "
            f"(the chosen answer put nearer people than the rejected one), chosen-vs-rejected AUC {val['auc']:.3f} "
            "(0.5 is chance)\n"
            f"scored pairs: {result['out']}/train_pairs.jsonl, {result['out']}/val_pairs.jsonl")
    if val["ranking_accuracy"] < 0.5:
        # HDPO's distance term follows the critic: one that ranks held-out pairs backwards pushes the wrong way
        line += (f"\nwarning: the critic ranks held-out pairs worse than chance ({val['ranking_accuracy']:.3f}): "
                 "HDPO's distance term would push toward the rejected answers. Check that `chosen` is the human "
                 "answer of each pair, train longer (train.epochs), or set lambda_dist=0 in HDPO")
    return line
