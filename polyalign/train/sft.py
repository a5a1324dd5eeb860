"""Bucket-Aware SFT (METHOD section 4): sum_i w_i l_i / sum_i w_i over the global batch, where l_i is
example i's mean token NLL over its response and w_i its bucket's weight (`weighting: bucket`), or
plain SFT (`weighting: uniform`, every w_i = 1)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from polyalign.core.paths import as_path, file_digest
from polyalign.core.yaml_config import ConfigError
from polyalign.inputs import pipeline
from polyalign.inputs.built import build_tokenizer_path, probe_records, read_manifest, rebuild_command
from polyalign.model import create_model, export
from polyalign.model.architecture import compute_dtype, longer_than_positions
from polyalign.model.flops import flops_per_token
from polyalign.model.hf import check_vocabulary, checkpoint_config
from polyalign.model.presets import preset
from polyalign.model.tokenizer_check import PROBE_RECORDS, check_export, probe_texts
from polyalign.tokens.chat import get_template
from polyalign.tokens.profile_template import seen_profile_values
from polyalign.tokens.tokenizer import has_tokenizer_files, load_tokenizer
from polyalign.train.config import DataSection, LoopConfig, SftConfig
from polyalign.train.methods import built_length_mismatch, require
from polyalign.train.run import Job, load_init, model_policy, steps_phrase, steps_run, with_adapters
from polyalign.train.trainer import Trainer


class SftObjective:
    """The Bucket-SFT objective for the trainer; metric sums include per-bucket losses.

    `weighting: adaptive` (group DRO / DoReMi style) keeps a distribution q over buckets in the
    trainer's state, starting where the build's weights put each bucket's share of the objective
    (q_b proportional to w_b p_b, p_b the bucket's share of train records). A step weights its examples
    with w_b = q_b / p_b, computed from the q it started with, so the global-batch normalisation stays
    exact; after the step q_b <- q_b exp(eta (L_b - mean L)) over the buckets the batch held (L_b their
    mean losses), renormalised and mixed with the distribution it started from (floor): no bucket falls
    below `floor` times its Bucket-SFT share, and where losses do not differ q stays the build's. (Mixing
    with the uniform distribution, as DoReMi does, pulls every bucket toward an equal share of the
    objective whatever its loss: a 6-record bucket's weight then climbs toward N / (K n_b), far past the
    build's clip.)
    """

    def __init__(self, num_buckets: int, weighting: str = "bucket", normalization: str = "global",
                 train_counts: np.ndarray | None = None, initial_weights: np.ndarray | None = None,
                 step_size: float = 0.1, floor: float = 0.1):
        self.num_buckets, self.weighting, self.normalization = num_buckets, weighting, normalization
        self.coefficients = {"sft": 1.0}
        self.step_size, self.floor = step_size, floor
        self.q = None  # adaptive: the bucket distribution of this step (see bind)
        if weighting == "adaptive":
            counts = np.asarray(train_counts, np.float64)
            self.shares = counts / counts.sum()
            self.in_train = counts > 0
            q0 = np.asarray(initial_weights, np.float64) * self.shares
            self.q0 = (q0 / q0.sum()).astype(np.float32)

    def initial_state(self) -> dict[str, np.ndarray]:
        return {"bucket_q": self.q0} if self.weighting == "adaptive" else {}

    def bind(self, state: dict) -> SftObjective:
        bound = copy.copy(self)
        bound.q = state["bucket_q"]
        return bound

    def adaptive_weights(self, q) -> jax.Array:
        """w_b = q_b / p_b (1 for buckets with no train records): mean 1 over train records when q sums to 1."""
        shares = jnp.asarray(self.shares, jnp.float32)
        return jnp.where(jnp.asarray(self.in_train), q / jnp.where(shares > 0, shares, 1.0), 1.0)

    def update_state(self, state: dict, sums: dict) -> dict:
        q, examples = state["bucket_q"], sums["bucket_examples"]
        present = examples > 0
        losses = jnp.where(present, sums["bucket_loss"] / jnp.where(present, examples, 1.0), 0.0)
        excess = jnp.where(present, losses - losses.sum() / jnp.maximum(present.sum(), 1), 0.0)
        q = q * jnp.exp(self.step_size * excess)
        q = (1.0 - self.floor) * q / q.sum() + self.floor * jnp.asarray(self.q0)
        return {"bucket_q": q}

    def _token_weights(self, batch) -> jax.Array | float:
        if self.weighting == "adaptive":
            return self.adaptive_weights(self.q)[batch["token_bucket"]]
        return batch["token_weight"] if self.weighting == "bucket" else 1.0

    def example_weights(self, batch) -> jax.Array:
        """Per row: the total weight of its examples (Bucket-SFT, adaptive) or their number (uniform)."""
        if self.weighting == "adaptive":
            return (batch["example_start"] * self._token_weights(batch)).sum(axis=-1)
        return batch["weight"] if self.weighting == "bucket" else batch["examples"]

    def denominators(self, batch):
        per_micro = self.example_weights(batch).sum(axis=1)  # [micro_batches]
        if self.normalization == "global":
            return {"sft": jnp.broadcast_to(per_micro.sum(), per_micro.shape)}
        # Reference behaviour: each micro-batch normalised on its own, the micro-batches averaged.
        return {"sft": per_micro * per_micro.shape[0]}

    def numerators(self, model, micro_batch, key=None):
        """sum_i w_i l_i as a sum over positions: token_scale is 1 / (labelled tokens of the position's
        example) on labelled positions, so the NLL summed over an example's positions is its mean NLL
        l_i. The same code serves one example per row and packed rows."""
        log_probs = model.token_log_probs(micro_batch["input_ids"], micro_batch["targets"],
                                          positions=micro_batch["positions"],
                                          # packed rows only: a row of one example is causal alone
                                          segment_ids=micro_batch.get("segment_ids"),
                                          dropout_key=key)
        example_nll = -log_probs * micro_batch["token_scale"]  # sums to l_i over example i's positions
        weights = self._token_weights(micro_batch)
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


def validation_measures(host: dict[str, np.ndarray], buckets: list[str], weights: np.ndarray,
                        trained: np.ndarray) -> dict[str, Any]:
    """Validation loss overall (mean over examples), weighted by the bucket weights, and per bucket, from
    summed metrics. The worst bucket and the spread are over the buckets training saw (`trained`, those
    with train examples; all, where validation holds none of them): a bucket met only in validation is named
    apart, its loss in val_by_bucket."""
    examples = host["bucket_examples"]
    mean_by_bucket = np.divide(host["bucket_loss"], examples, out=np.zeros_like(examples), where=examples > 0)
    present = examples > 0
    judged = present & trained if (present & trained).any() else present
    untrained = [b for i, b in enumerate(buckets) if present[i] and not trained[i]]
    return {
        "val_loss": round(float(host["bucket_loss"].sum() / examples.sum()), 6),
        "val_loss_weighted": round(float((weights * host["bucket_loss"]).sum() / (weights * examples).sum()), 6),
        "val_worst_bucket": round(float(mean_by_bucket[judged].max()), 6),  # the loss; its bucket below
        "val_worst_bucket_id": buckets[int(np.argmax(np.where(judged, mean_by_bucket, -np.inf)))],
        "val_bucket_spread": round(float(mean_by_bucket[judged].std()), 6),
        **per_bucket(host, buckets, "val_by_bucket"),
        **({"val_untrained_buckets": untrained} if untrained else {}),
    }


def make_evaluator(run: Path, buckets: list[str], weights: np.ndarray, trained: np.ndarray, length: int,
                   pad_id: int, data: DataSection):
    """validation_measures over the val split, read in batches on every process."""
    source = pipeline.open_split(run, "val")
    # a capped validation takes every bucket in turn: the examples' buckets, read once
    capped = data.eval_limit is not None and data.eval_limit < len(source)
    buckets_of_examples = pipeline.example_buckets(source) if capped else None

    def evaluate(trainer: Trainer) -> dict[str, Any]:
        batch_size = trainer.eval_batch_size(data.eval_batch)
        host = trainer.metric_sums(pipeline.eval_batches(source, batch_size, length, pad_id, jax.process_index(),
                                                         jax.process_count(), data.eval_limit,
                                                         buckets=buckets_of_examples))
        return validation_measures(host, buckets, weights, trained)

    return evaluate


def build_model(config: SftConfig, vocab_size: int, tokenizer_ids: dict[str, int | None], mesh=None):
    """The model to train, from `init` or initialised from the preset; placed in its shardings over
    `mesh` from the start when given."""
    if config.init:
        check_vocabulary(config.init, vocab_size, "the build's tokenizer", "build with the checkpoint's own tokenizer")
        return load_init(config, mesh)
    cfg = preset(config.model.preset, vocab_size=vocab_size, dtype=compute_dtype(config.model.dtype),
                 **model_policy(config.model), **tokenizer_ids)
    return with_adapters(create_model(cfg, seed=config.model.seed, mesh=mesh), config, mesh)


def check_init_tokenizer(config: SftConfig, build_tokenizer, run, manifest: dict[str, Any]) -> None:
    """Refuses to train `init` on a build encoded with another tokenizer: the file each tokenizer is
    read from (tokenizer.json or tokenizer.model) must have the same digest, unless
    allow_tokenizer_mismatch. An init without tokenizer files is trained with a notice. The rebuild it
    suggests keeps every other option the build was made with (template, length, weights)."""
    if not config.init or config.allow_tokenizer_mismatch:
        return
    if not has_tokenizer_files(config.init):
        print(f"polyalign: init {config.init} has no tokenizer files; its ids are taken to be those of the "
              f"build's tokenizer ({build_tokenizer.path})", file=sys.stderr)
        return
    init_tokenizer = load_tokenizer(config.init)  # a damaged one stops here, naming its file
    build_digest, init_digest = file_digest(build_tokenizer.path), file_digest(init_tokenizer.path)
    if build_digest != init_digest:
        rebuild = rebuild_command(run, {**manifest, "settings": {**(manifest.get("settings") or {}),
                                                                 "tokenizer": str(config.init)}})
        raise ConfigError(f"{as_path(run) / 'build'} was encoded with {build_tokenizer.path} ({build_digest[:19]}), "
                          f"not init's tokenizer {init_tokenizer.path} ({init_digest[:19]}): the ids would stand for "
                          f"other tokens; rebuild with `{rebuild}`, or pass "
                          "--allow-tokenizer-mismatch if that is meant")


def setup(config: SftConfig, mesh, progress: bool = True) -> Job:
    require(config, "data.dir", hint="a run with a build/ folder")
    run = as_path(config.data.dir)
    manifest = read_manifest(run, config.init)
    buckets = manifest["buckets"]
    weights = np.array([manifest["bucket_weights"][b] for b in buckets], np.float32)
    length = manifest["options"]["max_length"]
    mismatch = built_length_mismatch(config, length)
    if mismatch:
        raise ConfigError(mismatch)
    too_long = config.init and longer_than_positions(
        config.init, length, f"{run / 'build'}'s max_length {length}",
        "rebuild with a smaller `polyalign build --max-length`")
    if too_long:
        raise ConfigError(too_long)
    pad_id = manifest["pad_id"]
    if config.init:  # an architecture polyalign does not build is said before anything about its tokenizer
        checkpoint_config(config.init)
    tokenizer = load_tokenizer(build_tokenizer_path(run, manifest))
    check_init_tokenizer(config, tokenizer, run, manifest)
    model = build_model(config, manifest["vocab_size"],
                        {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                         "pad_token_id": tokenizer.pad_id}, mesh)
    train_source = pipeline.open_split(run, "train")
    lengths = None
    notes = []
    if config.data.pack:
        lengths = pipeline.example_lengths(train_source, pipeline.lengths_cache(run, "train"),
                                           write_cache=jax.process_index() == 0)
        if jax.process_index() == 0:  # only process 0 prints it, and it packs a whole epoch to count
            notes.append(pipeline.packing_note(lengths, length, config.train.seed, config.train.global_batch))

    def batches(layout: pipeline.Layout, loop: LoopConfig):
        return pipeline.iterate(pipeline.train_batches(train_source, layout, loop.steps, length, pad_id, loop.seed,
                                                       pack=config.data.pack, lengths=lengths))

    train_counts = np.array([manifest["train_bucket_counts"].get(b, 0) for b in buckets], np.float64)
    objective = SftObjective(len(buckets), config.weighting, config.weight_normalization, train_counts, weights,
                             config.adaptive.step_size, config.adaptive.floor)

    def summarize(host):
        record = {"examples": int(host["examples"]), "tokens": int(host["tokens"]),
                  "target_tokens": int(host["target_tokens"]),
                  **per_bucket(host, buckets, "train_by_bucket")}
        if "objective/bucket_q" in host:  # the adaptive weights this step used, per train bucket
            adaptive = np.asarray(objective.adaptive_weights(host["objective/bucket_q"]))
            record["adaptive_weights"] = {b: round(float(adaptive[i]), 6) for i, b in enumerate(buckets)
                                          if train_counts[i] > 0}
        return record

    def finish(trainer: Trainer, out: Path, segments: list[dict]) -> dict[str, Any]:
        options = manifest["options"]
        # the values the data held, and those of the checkpoint trained on from (its own SFT data)
        values = seen_profile_values(options["profile"], manifest.get("train_profile_values"),
                                     tokenizer.profile_values)
        coverage = export.profile_coverage(manifest["splits"]["train"], options.get("truncation", "left"))
        written = export.export_trained(trainer.model(), tokenizer, out, trainer.mesh, config,
                                        get_template(manifest["template"], tokenizer), options["profile"],
                                        options.get("system", "keep"), values,  # builds before system modes: keep
                                        None if options["profile"] == "none" else coverage, max_length=length,
                                        segments=segments)
        return {**written, **check_export(written["model"], tokenizer, probe_texts(probe_records(run, PROBE_RECORDS)))}

    return Job(model, objective, batches,
               epoch_size=None if config.data.pack else len(train_source),
               evaluate=make_evaluator(run, buckets, weights, train_counts > 0, length, pad_id, config.data),
               summarize=summarize,
               checkpoint_meta={"method": "sft", "weighting": config.weighting}, finish=finish,
               summary={"weighting": config.weighting, "packed": config.data.pack},
               flops_per_token=flops_per_token(model.config, length), notes=notes)


def summary_line(result: dict[str, Any]) -> str:
    last = result.get("last", {})
    trained = steps_phrase(result, f"trained {steps_run(result)} in {result['seconds']} s")
    # the training loss is one batch's objective, weighted by bucket under Bucket-SFT and adaptive weighting; the
    # validation loss is the mean over examples under every weighting, the number to compare runs by
    objective = {"bucket": "bucket-weighted ", "adaptive": "adaptively bucket-weighted "}.get(
        result.get("weighting"), "")
    return (f"{trained}; final loss {last.get('loss', float('nan')):.4f} (the last batch's {objective}objective)"
            + (f", validation loss {last['val_loss']:.4f} (mean over examples: compare runs by it)"
               if "val_loss" in last else "")
            + f"\nmodel: {result['model']}")
