"""Bucket-Aware SFT (METHOD section 4): sum_i w_i l_i / sum_i w_i over the global batch, where l_i is
example i's mean token NLL over its response and w_i its bucket's weight (`weighting: bucket`), or
plain SFT (`weighting: uniform`, every w_i = 1)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from polyalign import parallel
from polyalign.config import ConfigError, load_config_file
from polyalign.inputs import pipeline
from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer, save_config
from polyalign.paths import as_path

WEIGHTINGS = ("bucket", "uniform")
NORMALIZATIONS = ("global", "microbatch")


@dataclass(frozen=True)
class ModelSection:
    preset: str = "tiny"  # architecture for a model trained from scratch (ignored with `init`)
    dtype: str = "float32"  # compute dtype; parameters stay float32
    scan_layers: bool = True
    remat: str = "none"
    attention_impl: str | None = None
    logprob_chunk: int = 0  # > 0: log-probs in sequence blocks, never full [B, T, V] logits
    seed: int = 0


@dataclass(frozen=True)
class DataSection:
    dir: str | None = None  # the run directory holding build/ (from `polyalign build`)
    eval_batch: int = 32
    eval_limit: int | None = None  # evaluate on at most this many validation examples
    # Pack several examples of the global order into each max_length row (first-fit over a window;
    # exact: segments never attend across examples); a step then takes global_batch rows. Evaluation
    # stays unpacked.
    pack: bool = False


@dataclass(frozen=True)
class SftConfig:
    method: str = "sft"
    init: str | None = None  # a Hugging Face checkpoint directory; None trains model.preset from scratch
    weighting: str = "bucket"
    # `microbatch` normalises inside each micro-batch, as the reference code did; only for comparison.
    weight_normalization: str = "global"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    parallel: parallel.ParallelConfig = field(default_factory=parallel.ParallelConfig)


def load_config(path: Path | None, overrides: list[str] = ()) -> SftConfig:
    config = load_config_file(SftConfig, path, overrides)
    if config.weighting not in WEIGHTINGS:
        raise ConfigError(f"{path}: weighting must be one of {', '.join(WEIGHTINGS)}, got {config.weighting!r}")
    if config.weight_normalization not in NORMALIZATIONS:
        raise ConfigError(f"{path}: weight_normalization must be one of {', '.join(NORMALIZATIONS)}")
    if config.method != "sft":
        raise ConfigError(f"{path}: method {config.method!r}: `polyalign train sft` trains method sft")
    if config.data.dir is None:
        raise ConfigError(f"{path}: data.dir is not set; pass data.dir=RUN (a run with a build/ folder)")
    return config


class SFT:
    """The Bucket-SFT objective as a trainer method; metric sums include per-bucket losses."""

    def __init__(self, num_buckets: int, weighting: str = "bucket", normalization: str = "global"):
        self.num_buckets, self.weighting, self.normalization = num_buckets, weighting, normalization
        self.coefficients = {"sft": 1.0}

    def example_weights(self, batch) -> jax.Array:
        """Per row: the total weight of its examples (Bucket-SFT) or their number (uniform)."""
        return batch["weight"] if self.weighting == "bucket" else batch["examples"]

    def denominators(self, batch):
        per_micro = self.example_weights(batch).sum(axis=1)  # [micro_batches]
        if self.normalization == "global":
            return {"sft": jnp.broadcast_to(per_micro.sum(), per_micro.shape)}
        # Reference behaviour: each micro-batch normalised on its own, the micro-batches averaged.
        return {"sft": per_micro * per_micro.shape[0]}

    def numerators(self, model, micro_batch):
        """sum_i w_i l_i as a sum over positions: token_scale is 1 / (labelled tokens of the position's
        example) on labelled positions, so the NLL summed over an example's positions is its mean NLL
        l_i. The same code serves one example per row and packed rows."""
        log_probs = model.token_log_probs(micro_batch["input_ids"], micro_batch["targets"],
                                          positions=micro_batch["positions"], segment_ids=micro_batch["segment_ids"])
        example_nll = -log_probs * micro_batch["token_scale"]  # sums to l_i over example i's positions
        weights = micro_batch["token_weight"] if self.weighting == "bucket" else 1.0
        buckets = micro_batch["token_bucket"].reshape(-1)
        sums = {
            "bucket_loss": jax.ops.segment_sum(example_nll.reshape(-1), buckets, self.num_buckets),
            "bucket_examples": jax.ops.segment_sum(micro_batch["example_start"].reshape(-1), buckets, self.num_buckets),
            "tokens": micro_batch["length"].sum().astype(jnp.float32),
            "target_tokens": micro_batch["loss_mask"].sum(),
            "examples": micro_batch["examples"].sum(),
        }
        return {"sft": (weights * example_nll).sum()}, sums


def per_bucket(sums: dict[str, np.ndarray], buckets: list[str], prefix: str) -> dict[str, Any]:
    """Mean NLL per bucket (unweighted over examples) from summed metrics."""
    out = {}
    for i, name in enumerate(buckets):
        if sums["bucket_examples"][i] > 0:
            out[name] = round(float(sums["bucket_loss"][i] / sums["bucket_examples"][i]), 6)
    return {prefix: out} if out else {}


def make_evaluator(trainer: Trainer, run: Path, buckets: list[str], weights: np.ndarray, length: int,
                   pad_id: int, data: DataSection):
    """Validation loss overall (mean over examples), weighted by the bucket weights, and per bucket."""
    source = pipeline.open_split(run, "val")
    batch_size = trainer.eval_batch_size(data.eval_batch)

    def evaluate() -> dict[str, Any]:
        host = trainer.metric_sums(pipeline.eval_batches(source, batch_size, length, pad_id, jax.process_index(),
                                                         jax.process_count(), data.eval_limit))
        examples = host["bucket_examples"]
        mean_by_bucket = np.divide(host["bucket_loss"], examples, out=np.zeros_like(examples), where=examples > 0)
        present = examples > 0
        return {
            "val_loss": round(float(host["bucket_loss"].sum() / examples.sum()), 6),
            "val_loss_weighted": round(float((weights * host["bucket_loss"]).sum() / (weights * examples).sum()), 6),
            "val_worst_bucket": round(float(mean_by_bucket[present].max()), 6),
            "val_bucket_spread": round(float(mean_by_bucket[present].std()), 6),
            **per_bucket(host, buckets, "val_by_bucket"),
        }

    return evaluate


def build_model(config: SftConfig, vocab_size: int, tokenizer_ids: dict[str, int | None], mesh=None):
    """The model to train, from `init` or initialised from the preset; placed in its shardings over
    `mesh` from the start when given."""
    from polyalign.model import create_model, load_hf_checkpoint
    from polyalign.model.presets import preset

    policy = dict(scan_layers=config.model.scan_layers, remat=config.model.remat,
                  attention_impl=config.model.attention_impl, logprob_chunk=config.model.logprob_chunk)
    if config.init:
        model = load_hf_checkpoint(config.init, compute_dtype=config.model.dtype, mesh=mesh, **policy)
        if model.config.vocab_size < vocab_size:
            raise ConfigError(f"init {config.init}: vocabulary {model.config.vocab_size} is smaller than the "
                              f"build's tokenizer ({vocab_size}); build with the checkpoint's own tokenizer")
        return model
    cfg = preset(config.model.preset, vocab_size=vocab_size, dtype=config.model.dtype, **policy, **tokenizer_ids)
    return create_model(cfg, seed=config.model.seed, mesh=mesh)


def train_sft(config: SftConfig, out: Path, progress: bool = True) -> dict[str, Any]:
    """Runs (or resumes) SFT into OUT; returns a summary. OUT/model holds the final checkpoint."""
    from polyalign.inputs.build import build_tokenizer_path, read_manifest
    from polyalign.tokenizer import load_tokenizer
    from polyalign.train.checkpoint import Checkpointer
    from polyalign.train.metrics import MetricsWriter

    started = time.perf_counter()
    out = as_path(out)
    run = as_path(config.data.dir)
    manifest = read_manifest(run)
    buckets = manifest["buckets"]
    weights = np.array([manifest["bucket_weights"][b] for b in buckets], np.float32)
    length = manifest["options"]["max_length"]
    pad_id = manifest["pad_id"]
    tokenizer = load_tokenizer(build_tokenizer_path(run, manifest))
    mesh = parallel.make_mesh(config.parallel)
    model = build_model(config, manifest["vocab_size"],
                        {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                         "pad_token_id": tokenizer.pad_id}, mesh)
    save_config(out, config)
    method = SFT(len(buckets), config.weighting, config.weight_normalization)
    metrics = MetricsWriter(out)
    trainer = Trainer(model, method, config.optimizer, config.train, mesh, out, metrics=metrics)
    loop = config.train
    layout = pipeline.Layout(loop.global_batch, loop.micro_batches, jax.process_index(), jax.process_count())
    train_source = pipeline.open_split(run, "train")
    lengths = None
    if config.data.pack:
        lengths = pipeline.example_lengths(train_source, pipeline.lengths_cache(run, "train"),
                                           write_cache=jax.process_index() == 0)
    iterator = pipeline.iterate(pipeline.train_batches(train_source, layout, loop.steps, length, pad_id, loop.seed,
                                                       pack=config.data.pack, lengths=lengths))
    evaluate = make_evaluator(trainer, run, buckets, weights, length, pad_id, config.data)
    checkpointer = Checkpointer(out / "checkpoints", loop.checkpoint_every, loop.keep_checkpoints,
                                meta={"method": "sft", "weighting": config.weighting})

    def summarize(host):
        return {"tokens": int(host["tokens"]), "target_tokens": int(host["target_tokens"]),
                **per_bucket(host, buckets, "train_by_bucket")}

    result = trainer.fit(iterator, evaluate, summarize, checkpointer, progress=progress)
    checkpointer.close()
    metrics.close()
    if not result["stopped_early"]:
        export_model(trainer, tokenizer, out / "model")
    result.update(out=str(out), seconds=round(time.perf_counter() - started, 1), mesh=dict(mesh.shape))
    if jax.process_index() == 0:
        (out / "summary.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def export_model(trainer: Trainer, tokenizer, path: Path) -> None:
    """The trained weights as a Hugging Face checkpoint with the tokenizer's files beside them."""
    from polyalign.model import save_hf_checkpoint

    with jax.set_mesh(trainer.mesh):
        params = parallel.to_host(trainer.state["params"])
    if jax.process_index() != 0:
        return
    model = trainer.model(params)
    save_hf_checkpoint(model, path, overwrite=True)
    source = as_path(tokenizer.path)
    directory = source if source.is_dir() else source.parent
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        if (directory / name).is_file():
            (directory / name).copy(as_path(path) / name, overwrite=True)
