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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save

from polyalign import parallel
from polyalign.config import ConfigError, load_config_file
from polyalign.errors import CriticCollapse
from polyalign.model.pooling import encode_responses
from polyalign.paths import as_path
from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer

MARGIN = 0.1
BUCKET_DIM, HIDDEN = 64, 256


@dataclass(frozen=True)
class CriticConfig:
    init: str | None = None  # the SFT checkpoint: the frozen encoder
    pairs: str | None = None  # train pairs (JSONL from `polyalign pairs`)
    val_pairs: str | None = None  # held-out pairs for validation and the ranking accuracy
    references: str | None = None  # default RUN/stats/references.json
    data: dict = field(default_factory=lambda: {"dir": None})
    max_tokens: int = 512
    # nonconstant: the support distance skips features constant in the bucket's human reference
    # (see references.support_distance); all: every feature, as the reference code did.
    distance_features: str = "nonconstant"
    epochs: int = 3
    regression_batch: int = 16
    pair_batch: int = 8
    dropout: float = 0.1
    seed: int = 42
    encode_batch: int = 16
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(
        lr=1e-3, warmup_ratio=0.0, weight_decay=0.0, clip=1.0))
    parallel: parallel.ParallelConfig = field(default_factory=parallel.ParallelConfig)


def load_config(path: Path | None, overrides=()) -> CriticConfig:
    config = load_config_file(CriticConfig, path, overrides)
    if config.distance_features not in ("nonconstant", "all"):
        raise ConfigError(f"{path}: distance_features must be nonconstant or all")
    for key in ("init", "pairs", "val_pairs"):
        if getattr(config, key) is None:
            raise ConfigError(f"{path}: {key} is not set (pass {key}=PATH)")
    return config


class Critic(nnx.Module):
    """c(y, b) = MLP([pooled hidden state of y; embedding of b]); bucket index num_buckets = unknown."""

    def __init__(self, hidden_size: int, num_buckets: int, dropout: float, rngs: nnx.Rngs):
        self.bucket_embedding = nnx.Embed(num_buckets + 1, BUCKET_DIM, rngs=rngs)
        self.layer1 = nnx.Linear(hidden_size + BUCKET_DIM, HIDDEN, rngs=rngs)
        self.layer2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)
        self.dropout = dropout

    def __call__(self, pooled: jax.Array, bucket: jax.Array, key: jax.Array | None = None) -> jax.Array:
        def drop(x, k):
            if key is None or self.dropout == 0:
                return x
            keep = jax.random.bernoulli(k, 1.0 - self.dropout, x.shape)
            return jnp.where(keep, x / (1.0 - self.dropout), 0.0)

        keys = jax.random.split(key) if key is not None else (None, None)
        x = jnp.concatenate([pooled, self.bucket_embedding(bucket)], axis=-1)
        x = drop(jax.nn.gelu(self.layer1(x), approximate=False), keys[0])
        x = drop(jax.nn.gelu(self.layer2(x), approximate=False), keys[1])
        return self.out(x)[..., 0]


class CriticMethod:
    """mean |c - d| over regression rows + mean max(0, margin - c(model) + c(human)) over pairs."""

    coefficients = {"l1": 1.0, "rank": 1.0}

    def denominators(self, batch):
        return {"l1": jnp.broadcast_to(batch["reg_valid"].sum(), batch["reg_valid"].shape[:1]),
                "rank": jnp.broadcast_to(batch["pair_valid"].sum(), batch["pair_valid"].shape[:1])}

    def numerators(self, model, mb):
        key = jax.random.key(mb["seed"][0])
        k1, k2, k3 = jax.random.split(key, 3)
        predicted = model(mb["reg_pooled"], mb["reg_bucket"], k1)
        l1 = jnp.abs(predicted - mb["reg_target"]) * mb["reg_valid"]
        human = model(mb["pair_human"], mb["pair_bucket"], k2)
        generated = model(mb["pair_model"], mb["pair_bucket"], k3)
        hinge = jnp.maximum(0.0, MARGIN - generated + human) * mb["pair_valid"]
        return {"l1": l1.sum(), "rank": hinge.sum()}, {"l1_sum": l1.sum(), "rank_sum": hinge.sum()}


def support_targets(texts: list[str], buckets: list[str], references: dict, skip_constant: bool = True) -> np.ndarray:
    """d(y, b) for each response from its own text features; NaN where the bucket has no reference."""
    from polyalign.features import text_features
    from polyalign.references import support_distance

    names = references["features"]
    targets = np.full(len(texts), np.nan, np.float32)
    for i, (text, bucket) in enumerate(zip(texts, buckets)):
        reference = references["buckets"].get(bucket)
        if reference is not None:
            targets[i] = support_distance(text_features(text), reference, names, skip_constant)
    return targets


@dataclass
class _Split:
    pooled_human: np.ndarray
    pooled_model: np.ndarray
    bucket: np.ndarray
    target_human: np.ndarray
    target_model: np.ndarray


def _prepare(pairs, model, tokenizer, references, bucket_index, config, progress) -> _Split:
    human = [p["chosen"] for p in pairs]
    generated = [p["rejected"] for p in pairs]
    names = [p["bucket_id"] for p in pairs]
    pooled = encode_responses(model, tokenizer, human + generated, config.max_tokens, config.encode_batch, progress)
    unknown = len(bucket_index)
    skip = config.distance_features == "nonconstant"
    return _Split(pooled[:len(pairs)], pooled[len(pairs):],
                  np.array([bucket_index.get(b, unknown) for b in names], np.int32),
                  support_targets(human, names, references, skip), support_targets(generated, names, references, skip))


def _batches(split: _Split, config: CriticConfig, steps: int, seed: int):
    """Per step: a regression batch (human and model responses with a target) and a pair batch."""
    reg_pooled = np.concatenate([split.pooled_human, split.pooled_model])
    reg_bucket = np.concatenate([split.bucket, split.bucket])
    reg_target = np.concatenate([split.target_human, split.target_model])
    has_target = ~np.isnan(reg_target)
    reg_pooled, reg_bucket, reg_target = reg_pooled[has_target], reg_bucket[has_target], reg_target[has_target]
    rng = np.random.default_rng(seed)
    reg_order, pair_order = np.array([], int), np.array([], int)
    for step in range(steps):
        if len(reg_order) < config.regression_batch:
            reg_order = np.concatenate([reg_order, rng.permutation(len(reg_target))])
        if len(pair_order) < config.pair_batch:
            pair_order = np.concatenate([pair_order, rng.permutation(len(split.bucket))])
        r, reg_order = reg_order[:config.regression_batch], reg_order[config.regression_batch:]
        q, pair_order = pair_order[:config.pair_batch], pair_order[config.pair_batch:]
        yield {
            "reg_pooled": reg_pooled[r][None], "reg_bucket": reg_bucket[r][None],
            "reg_target": reg_target[r][None].astype(np.float32), "reg_valid": np.ones((1, len(r)), np.float32),
            "pair_human": split.pooled_human[q][None], "pair_model": split.pooled_model[q][None],
            "pair_bucket": split.bucket[q][None], "pair_valid": np.ones((1, len(q)), np.float32),
            "seed": np.full((1, len(r)), seed * 100_003 + step, np.int32),
        }


def check_not_collapsed(human: np.ndarray, generated: np.ndarray, tolerance: float = 1e-6) -> None:
    """Raises CriticCollapse when every pair ties: such scores would only add noise to HDPO."""
    if len(human) and np.abs(np.asarray(human) - np.asarray(generated)).max() < tolerance:
        raise CriticCollapse(f"the critic scores both sides of all {len(human)} pairs the same (a constant "
                             "critic); refusing to write scores onto the pairs")


def score(critic: Critic, pooled: np.ndarray, bucket: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda p, b: critic(p, b))(pooled, bucket))


def evaluate_split(critic: Critic, split: _Split) -> dict[str, float]:
    human, generated = score(critic, split.pooled_human, split.bucket), score(critic, split.pooled_model, split.bucket)
    predicted = np.concatenate([human, generated])
    target = np.concatenate([split.target_human, split.target_model])
    has = ~np.isnan(target)
    return {"l1": float(np.abs(predicted[has] - target[has]).mean()) if has.any() else float("nan"),
            "ranking_accuracy": float((human < generated).mean()),
            "hinge": float(np.maximum(0.0, MARGIN - generated + human).mean()),
            "human_mean": float(human.mean()), "model_mean": float(generated.mean())}


def train_critic(config: CriticConfig, out: Path, progress: bool = True) -> dict[str, Any]:
    """Trains the critic, writes OUT/critic.safetensors, OUT/critic.json and the scored pairs
    (OUT/train_pairs.jsonl, OUT/val_pairs.jsonl, reweighted with the critic term)."""
    from polyalign.model import load_hf_checkpoint
    from polyalign.pairs import assign_weights, read_pairs, write_pairs
    from polyalign.tokenizer import load_tokenizer

    started = time.perf_counter()
    out = as_path(out)
    out.mkdir(parents=True, exist_ok=True)
    run = Path(config.data["dir"]) if config.data.get("dir") else None
    references_path = Path(config.references) if config.references else (run / "stats" / "references.json" if run else None)
    if references_path is None or not references_path.is_file():
        raise ConfigError(f"{references_path}: bucket references missing; run `polyalign stats RUN` or pass references=")
    references = json.loads(references_path.read_text())
    train_pairs, val_pairs = read_pairs(Path(config.pairs)), read_pairs(Path(config.val_pairs))
    if not train_pairs or not val_pairs:
        raise ConfigError("the critic needs train and validation pairs; one of the pair files is empty")
    encoder = load_hf_checkpoint(config.init)
    tokenizer = load_tokenizer(config.init)
    buckets = sorted({p["bucket_id"] for p in train_pairs} | set(references["buckets"]))
    bucket_index = {b: i for i, b in enumerate(buckets)}
    train = _prepare(train_pairs, encoder, tokenizer, references, bucket_index, config, progress)
    val = _prepare(val_pairs, encoder, tokenizer, references, bucket_index, config, progress)

    regression_rows = int((~np.isnan(np.concatenate([train.target_human, train.target_model]))).sum())
    steps_per_epoch = max(1, -(-regression_rows // config.regression_batch))
    loop = LoopConfig(steps=config.epochs * steps_per_epoch, global_batch=config.regression_batch,
                      seed=config.seed, eval_every=steps_per_epoch, checkpoint_every=10**9, log_every=10)
    with parallel.unsharded():
        critic = Critic(encoder.config.hidden_size, len(buckets), config.dropout, nnx.Rngs(config.seed))
    from polyalign.train.metrics import MetricsWriter

    metrics = MetricsWriter(out)
    trainer = Trainer(critic, CriticMethod(), config.optimizer, loop, parallel.make_mesh(config.parallel), out,
                      metrics=metrics)
    best: dict[str, Any] = {"loss": float("inf")}

    def evaluate():
        model = trainer.model(jax.device_get(trainer.state["params"]))
        report = evaluate_split(model, val)
        loss = report["l1"] + report["hinge"] if np.isfinite(report["l1"]) else report["hinge"]
        if loss < best["loss"]:  # keep the epoch with the best validation loss
            best.update(loss=loss, epoch=trainer.step_number // steps_per_epoch, report=report,
                        params=jax.device_get(trainer.state["params"]))
        return {f"val_{k}": round(v, 6) for k, v in report.items()}

    trainer.fit(_batches(train, config, loop.steps, config.seed), evaluate=evaluate, progress=progress)
    metrics.close()
    critic = trainer.model(best["params"])
    train_report = evaluate_split(critic, train)
    for split, pairs in ((train, train_pairs), (val, val_pairs)):
        human, generated = score(critic, split.pooled_human, split.bucket), score(critic, split.pooled_model, split.bucket)
        check_not_collapsed(human, generated)
        for pair, c_h, c_m in zip(pairs, human, generated):
            pair["critic_chosen"], pair["critic_rejected"] = round(float(c_h), 6), round(float(c_m), 6)
    assign_weights(train_pairs)
    assign_weights(val_pairs)
    write_pairs(train_pairs, out / "train_pairs.jsonl")
    write_pairs(val_pairs, out / "val_pairs.jsonl")
    flat = nnx.to_flat_state(nnx.state(critic, nnx.Param))
    (out / "critic.safetensors").write_bytes(save({".".join(map(str, path)): np.asarray(v[...]) for path, v in flat}))
    report = {
        "best_epoch": best["epoch"], "val": best["report"], "train": train_report,
        "train_pairs": len(train_pairs), "val_pairs": len(val_pairs), "regression_rows": regression_rows,
        "buckets": buckets, "hidden_size": encoder.config.hidden_size, "encoder": str(config.init),
        "config": asdict(config), "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "critic.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


class CriticScorer:
    """A trained critic with its frozen encoder, loaded from the folder `train_critic` wrote."""

    def __init__(self, directory: Path):
        from safetensors.numpy import load

        from polyalign.model import load_hf_checkpoint
        from polyalign.tokenizer import load_tokenizer

        directory = as_path(directory)
        info = json.loads((directory / "critic.json").read_text())
        self.buckets = {b: i for i, b in enumerate(info["buckets"])}
        self.max_tokens = info["config"]["max_tokens"]
        self.encoder = load_hf_checkpoint(info["encoder"])
        self.tokenizer = load_tokenizer(info["encoder"])
        with parallel.unsharded():
            self.critic = Critic(info["hidden_size"], len(self.buckets), 0.0, nnx.Rngs(0))
        tensors = load((directory / "critic.safetensors").read_bytes())
        for path, var in nnx.to_flat_state(nnx.state(self.critic, nnx.Param)):
            var[...] = jnp.asarray(tensors[".".join(map(str, path))])

    def __call__(self, texts: list[str], buckets: list[str], progress: bool = False) -> np.ndarray:
        pooled = encode_responses(self.encoder, self.tokenizer, texts, self.max_tokens, 16, progress)
        unknown = len(self.buckets)
        return score(self.critic, pooled, np.array([self.buckets.get(b, unknown) for b in buckets], np.int32))
