"""HDPO and DPO on the shared trainer (METHOD section 8).

Chosen and rejected responses of a micro-batch go through one forward pass (stacked on the batch
axis). The reference policy is the initial checkpoint; its log-probabilities are computed once, before
training, and travel with the pairs. HDPO's three terms are normalised over the global batch:
sum w l / sum w (pair weights), lambda_dist * mean R and gamma_ftx * mean anchor (pair counts).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from polyalign import parallel
from polyalign.config import ConfigError, load_config_file
from polyalign.inputs import pipeline
from polyalign.train import losses
from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer, save_config
from polyalign.paths import as_path

METHODS = ("hdpo", "dpo", "ipo")
SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferenceData:
    dir: str | None = None  # the run directory whose critic/ holds the scored pairs
    # Pack whole pairs into rows of 2 x max_length positions, each pair's common prefix (the prompt)
    # computed once and seen by both responses (a tree mask). Exact: every log-prob equals the
    # unpacked one. Needs explicit attention masks (XLA attention); a step takes global_batch rows.
    pack: bool = False


@dataclass(frozen=True)
class PreferenceConfig:
    method: str = "hdpo"
    init: str | None = None  # the SFT checkpoint: the initial policy and the frozen reference
    pairs: str | None = None  # scored train pairs (default RUN/critic/train_pairs.jsonl)
    val_pairs: str | None = None  # scored validation pairs (default RUN/critic/val_pairs.jsonl)
    data: PreferenceData = field(default_factory=lambda: PreferenceData())
    profile: str = "context"
    max_length: int = 256
    beta: float = 0.1
    lambda_dist: float = 0.1
    gamma_ftx: float = 0.05
    label_smoothing: float = 0.0
    dtype: str = "float32"
    remat: str = "none"
    attention_impl: str | None = None  # xla, cudnn, splash; None picks per backend (packed rows use XLA)
    logprob_chunk: int = 0  # > 0: log-probs in sequence blocks, never full [B, T, V] logits
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-7, weight_decay=0.0))
    train: LoopConfig = field(default_factory=lambda: LoopConfig(global_batch=8))
    parallel: parallel.ParallelConfig = field(default_factory=parallel.ParallelConfig)


def load_config(path: Path | None, overrides=()) -> PreferenceConfig:
    config = load_config_file(PreferenceConfig, path, overrides)
    if config.method not in METHODS:
        raise ConfigError(f"{path}: method must be one of {', '.join(METHODS)}, got {config.method!r}")
    if config.init is None:
        raise ConfigError(f"{path}: init is not set; pass init=SFT_CHECKPOINT")
    run = config.data.dir
    defaults = {}
    for key, name in (("pairs", "train_pairs.jsonl"), ("val_pairs", "val_pairs.jsonl")):
        if getattr(config, key) is None:
            if run is None:
                raise ConfigError(f"{path}: set {key}= or data.dir=RUN (whose critic/ holds the scored pairs)")
            defaults[key] = str(Path(run) / "critic" / name)
    return replace(config, **defaults)


# --- data ---------------------------------------------------------------------------------------------

def tokenise_pairs(pairs: list[dict], tokenizer, template, profile: str, max_length: int,
                   buckets: list[str]) -> list[dict]:
    from polyalign.chat import Message, encode_conversation, record_messages
    from polyalign.data.records import Record

    index = {b: i for i, b in enumerate(buckets)}
    examples = []
    for pair in pairs:
        prompt = record_messages(Record.from_json(pair["record"]), profile, with_response=False)
        example = {"id": pair["id"], "bucket": index[pair["bucket_id"]], "weight": float(pair.get("weight", 1.0)),
                   "critic_chosen": float(pair.get("critic_chosen", 0.0)),
                   "critic_rejected": float(pair.get("critic_rejected", 0.0))}
        for side in SIDES:
            encoded = encode_conversation(template, tokenizer, [*prompt, Message("assistant", pair[side])],
                                          cutoff=max_length)
            example[f"{side}_ids"], example[f"{side}_mask"] = encoded.ids, encoded.loss_mask
        examples.append(example)
    return examples


def pair_arrays(example: dict | None, length: int, pad_id: int) -> dict[str, np.ndarray]:
    out = {"weight": np.float32(0.0), "bucket": np.int32(0), "valid": np.bool_(False),
           "critic_chosen": np.float32(0.0), "critic_rejected": np.float32(0.0),
           "ref_chosen": np.float32(0.0), "ref_rejected": np.float32(0.0)}
    for side in SIDES:
        sft_like = None if example is None else {"input_ids": example[f"{side}_ids"], "loss_mask": example[f"{side}_mask"],
                                                 "weight": 0.0, "bucket": 0}
        arrays = pipeline.example_arrays(sft_like, length, pad_id)
        out[f"{side}_inputs"], out[f"{side}_targets"], out[f"{side}_mask"] = (
            arrays["input_ids"], arrays["targets"], arrays["loss_mask"])
    if example is not None:
        out.update(weight=np.float32(example["weight"]), bucket=np.int32(example["bucket"]), valid=np.bool_(True),
                   critic_chosen=np.float32(example["critic_chosen"]),
                   critic_rejected=np.float32(example["critic_rejected"]),
                   ref_chosen=np.float32(example.get("ref_chosen", 0.0)),
                   ref_rejected=np.float32(example.get("ref_rejected", 0.0)))
    return out


PAIR_FIELDS = ("weight", "bucket", "valid", "critic_chosen", "critic_rejected", "ref_chosen", "ref_rejected")


def tree_spans(example: dict, length: int) -> tuple[int, int, int]:
    """(shared, chosen, rejected) next-token positions of a pair laid out as a tree: both sequences
    agree on their first `shared` positions (input and target: the prompt, and any common start of
    the responses), then each side continues on its own. Sequences are cut to `length` positions as
    unpacked."""
    chosen = np.asarray(example["chosen_ids"][: length + 1])
    rejected = np.asarray(example["rejected_ids"][: length + 1])
    n = min(len(chosen), len(rejected))
    differs = np.flatnonzero(chosen[:n] != rejected[:n])
    common = int(differs[0]) if len(differs) else n
    return max(common - 1, 0), max(len(chosen) - 1, 0), max(len(rejected) - 1, 0)


def tree_length(example: dict, length: int) -> int:
    """Positions a pair takes in a packed row: the shared prefix once, then both continuations."""
    shared, chosen, rejected = tree_spans(example, length)
    return chosen + rejected - shared


def _next_token_arrays(example: dict, side: str, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One side's inputs, targets and loss mask, cut to `length` positions as unpacked."""
    ids = np.asarray(example[f"{side}_ids"][: length + 1], np.int32)
    return ids[:-1], ids[1:], np.asarray(example[f"{side}_mask"][1: length + 1], np.float32)


def packed_pair_arrays(examples: list[dict], row_length: int, pad_id: int, slots: int,
                       length: int) -> dict[str, np.ndarray]:
    """One row of `row_length` positions holding `examples` (at most `slots` pairs) as trees: pair k
    is segment k + 1; its shared prefix is branch 0, the chosen continuation branch 1 and the rejected
    one branch 2, each branch with the positions it has unpacked. chosen_mask / rejected_mask mark the
    positions whose log-probs sum to each side's sequence log-prob (a shared labelled position counts
    for both). Per-pair fields are [slots] arrays; empty slots have valid = False."""
    out = {"input_ids": np.full(row_length, pad_id, np.int32), "targets": np.full(row_length, pad_id, np.int32),
           "positions": np.zeros(row_length, np.int32), "segment_ids": np.zeros(row_length, np.int32),
           "branch_ids": np.zeros(row_length, np.int32), "chosen_mask": np.zeros(row_length, np.float32),
           "rejected_mask": np.zeros(row_length, np.float32), "length": np.int32(0)}
    out.update({key: np.zeros(slots, np.float32) for key in PAIR_FIELDS})
    out.update(bucket=np.zeros(slots, np.int32), valid=np.zeros(slots, bool))
    if len(examples) > slots:
        raise ValueError(f"{len(examples)} pairs for a row of {slots} slots")
    start = 0
    for slot, example in enumerate(examples):
        shared, n_chosen, n_rejected = tree_spans(example, length)
        if start + n_chosen + n_rejected - shared > row_length:
            raise ValueError(f"pair {example['id']!r} does not fit a row of {row_length} positions")
        chosen, rejected = (_next_token_arrays(example, side, length) for side in SIDES)
        # (branch, positions, the side whose tokens they are, the sums they count in): the prefix counts
        # for each side as that side labels it
        parts = [(0, slice(0, shared), chosen, {"chosen_mask": chosen[2], "rejected_mask": rejected[2]}),
                 (1, slice(shared, n_chosen), chosen, {"chosen_mask": chosen[2]}),
                 (2, slice(shared, n_rejected), rejected, {"rejected_mask": rejected[2]})]
        for branch, part, (inputs, targets, _), masks in parts:
            span = slice(start, start + part.stop - part.start)
            out["input_ids"][span], out["targets"][span] = inputs[part], targets[part]
            out["positions"][span] = np.arange(part.start, part.stop)
            out["segment_ids"][span], out["branch_ids"][span] = slot + 1, branch
            for key, mask in masks.items():
                out[key][span] = mask[part]
            start = span.stop
        for key in PAIR_FIELDS:
            out[key][slot] = example.get(key, 0.0)
        out["valid"][slot] = True
    out["length"] = np.int32(start)
    return out


MAX_PAIRS_PER_ROW = 64


def pair_slots(lengths: np.ndarray, row_length: int) -> int:
    """Pair slots of a packed row: as many of the shortest pairs as a row holds, at most 64."""
    return int(min(MAX_PAIRS_PER_ROW, max(1, row_length // max(int(lengths.min()), 1))))


def sequence_logps(model, batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Summed response log-probs of chosen and rejected, and the chosen token counts, from one
    forward pass over both sides: [B] for pair arrays (chosen and rejected stacked on the batch axis),
    [B, slots] for packed rows."""
    if "branch_ids" in batch:
        return _packed_sequence_logps(model, batch)
    inputs = jnp.concatenate([batch["chosen_inputs"], batch["rejected_inputs"]])
    targets = jnp.concatenate([batch["chosen_targets"], batch["rejected_targets"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    logps = (model.token_log_probs(inputs, targets) * mask).sum(-1)
    half = batch["chosen_inputs"].shape[0]
    return logps[:half], logps[half:], batch["chosen_mask"].sum(-1)


def _packed_sequence_logps(model, batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    logps = model.token_log_probs(batch["input_ids"], batch["targets"], positions=batch["positions"],
                                  segment_ids=batch["segment_ids"], branch_ids=batch["branch_ids"])
    rows, slots = batch["valid"].shape
    # each position's pair, numbered across the micro-batch; padding (segment 0) carries zero masks
    pair = (jnp.maximum(batch["segment_ids"] - 1, 0) + slots * jnp.arange(rows)[:, None]).reshape(-1)

    def per_pair(values):
        return jax.ops.segment_sum(values.reshape(-1), pair, rows * slots).reshape(rows, slots)

    return (per_pair(logps * batch["chosen_mask"]), per_pair(logps * batch["rejected_mask"]),
            per_pair(batch["chosen_mask"]))


def reference_logps(model, examples: list[dict], length: int, pad_id: int, batch_size: int = 8,
                    progress: bool = True, mesh=None, pack: bool = False) -> None:
    """Adds ref_chosen / ref_rejected (the frozen initial policy's log-probs) to every example, from
    batches of `batch_size` row pairs, or with `pack` of `batch_size` packed rows (as training packs
    them; the values are the same). With a `mesh` (the model sharded over it), every process gets
    every value."""
    from tqdm import tqdm

    graphdef, state = nnx.split(model)
    replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    run = jax.jit(lambda state, batch: sequence_logps(nnx.merge(graphdef, state), batch)[:2], out_shardings=replicated)
    if pack:
        lengths = np.array([tree_length(e, length) for e in examples], np.int64)
        slots = pair_slots(lengths, 2 * length)
        rows = pipeline.first_fit(np.arange(len(examples)), lengths, 2 * length, max_items=slots)

        def arrays_of(row: list[int] | None):
            return packed_pair_arrays([] if row is None else [examples[i] for i in row], 2 * length, pad_id, slots,
                                      length)
    else:
        rows = [[i] for i in range(len(examples))]

        def arrays_of(row: list[int] | None):
            return pair_arrays(None if row is None else examples[row[0]], length, pad_id)

    for start in tqdm(range(0, len(rows), batch_size), desc="reference log-probs", unit="batch",
                      disable=not progress):
        chunk = rows[start:start + batch_size]
        arrays = [arrays_of(row) for row in chunk] + [arrays_of(None)] * (batch_size - len(chunk))
        batch = {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}
        chosen, rejected = (np.asarray(x).reshape(batch_size, -1) for x in jax.device_get(run(state, batch)))
        for r, row in enumerate(chunk):
            for slot, i in enumerate(row):
                examples[i]["ref_chosen"], examples[i]["ref_rejected"] = float(chosen[r, slot]), float(rejected[r, slot])


# --- the method ---------------------------------------------------------------------------------------

class Preference:
    """HDPO (or DPO / IPO) as a trainer method; metric sums include rewards and per-bucket margins."""

    def __init__(self, config: PreferenceConfig, num_buckets: int):
        self.config, self.num_buckets = config, num_buckets
        hdpo = config.method == "hdpo"
        self.coefficients = {"dpo": 1.0, **({"dist": config.lambda_dist, "anchor": config.gamma_ftx} if hdpo else {})}

    def _weights(self, batch):
        weights = batch["weight"] if self.config.method == "hdpo" else jnp.ones_like(batch["weight"])
        return jnp.where(batch["valid"], weights, 0.0)

    def denominators(self, batch):
        def global_sum(x):  # [micro_batches, rows, (slots)] -> the total, once per micro-batch
            return jnp.broadcast_to(x.sum(), x.shape[:1])

        count = global_sum(batch["valid"].astype(jnp.float32))
        return {"dpo": global_sum(self._weights(batch)), "dist": count, "anchor": count}

    def numerators(self, model, mb):
        c = self.config
        pc, pr, n_chosen = (x.reshape(-1) for x in sequence_logps(model, mb))
        tokens = mb["chosen_mask"].sum() + mb["rejected_mask"].sum()
        mb = {key: mb[key].reshape(-1) for key in PAIR_FIELDS}  # one entry per pair (packed: per slot)
        rc, rr = mb["ref_chosen"], mb["ref_rejected"]
        valid = mb["valid"].astype(jnp.float32)
        if c.method == "ipo":
            per_pair = losses.ipo_loss(pc, pr, rc, rr, c.beta)
        else:
            per_pair = losses.dpo_loss(pc, pr, rc, rr, c.beta, c.label_smoothing)
        numerators = {"dpo": (self._weights(mb) * per_pair).sum()}
        dist = losses.distance_regulariser(pc, pr, mb["critic_chosen"], mb["critic_rejected"], c.beta) * valid
        anchor = losses.sft_anchor(pc, n_chosen) * valid
        if c.method == "hdpo":
            numerators.update(dist=dist.sum(), anchor=anchor.sum())
        rewards = losses.preference_rewards(pc, pr, rc, rr, c.beta)
        sums = {f"rewards_{k}": (v * valid).sum() for k, v in rewards.items()}
        sums.update(pairs=valid.sum(), tokens=tokens, dist_reg=dist.sum(), sft_anchor=anchor.sum(),
                    dist_gap=((mb["critic_rejected"] - mb["critic_chosen"]) * valid).sum(),
                    bucket_margin=jax.ops.segment_sum(rewards["margin"] * valid, mb["bucket"], self.num_buckets),
                    bucket_pairs=jax.ops.segment_sum(valid, mb["bucket"], self.num_buckets))
        return numerators, sums


def summarize(host: dict[str, np.ndarray], buckets: list[str], prefix: str = "") -> dict[str, Any]:
    n = max(float(host["pairs"]), 1.0)
    out = {f"{prefix}rewards/{k}": round(float(host[f"rewards_{k}"]) / n, 6)
           for k in ("chosen", "rejected", "margin", "accuracy")}
    out.update({f"{prefix}pairs": int(host["pairs"]),
                f"{prefix}dist_reg": round(float(host["dist_reg"]) / n, 6),
                f"{prefix}sft_anchor": round(float(host["sft_anchor"]) / n, 6),
                f"{prefix}dist_gap": round(float(host["dist_gap"]) / n, 6)})
    margins = {b: round(float(host["bucket_margin"][i] / host["bucket_pairs"][i]), 6)
               for i, b in enumerate(buckets) if host["bucket_pairs"][i] > 0}
    out[f"{prefix}margin_by_bucket"] = margins
    return out


# --- the run ------------------------------------------------------------------------------------------

def train_pair_batches(examples: list[dict], layout: pipeline.Layout, loop: LoopConfig, config: PreferenceConfig,
                       pad_id: int):
    """The training batches: one pair per row pair (chosen and rejected rows of max_length), or with
    data.pack rows of 2 x max_length positions holding whole pairs as trees (a pair always fits)."""
    if not config.data.pack:
        return pipeline.train_batches(examples, layout, loop.steps, config.max_length, pad_id, loop.seed,
                                      convert=pair_arrays)
    row_length = 2 * config.max_length
    lengths = np.array([tree_length(e, config.max_length) for e in examples], np.int64)
    slots = pair_slots(lengths, row_length)

    def convert(row: list[dict], length: int, pad: int):
        return packed_pair_arrays(row, length, pad, slots, config.max_length)

    return pipeline.train_batches(examples, layout, loop.steps, row_length, pad_id, loop.seed, convert=convert,
                                  pack=True, lengths=lengths, max_per_row=slots)

def train_preference(config: PreferenceConfig, out: Path, progress: bool = True) -> dict[str, Any]:
    from polyalign.chat import get_template
    from polyalign.generate import template_for
    from polyalign.model import load_hf_checkpoint
    from polyalign.pairs import read_pairs
    from polyalign.tokenizer import load_tokenizer
    from polyalign.train.checkpoint import Checkpointer
    from polyalign.train.metrics import MetricsWriter
    from polyalign.train.sft import export_model

    started = time.perf_counter()
    out = as_path(out)
    mesh = parallel.make_mesh(config.parallel)
    model = load_hf_checkpoint(config.init, compute_dtype=config.dtype, remat=config.remat,
                               attention_impl=config.attention_impl, logprob_chunk=config.logprob_chunk, mesh=mesh)
    tokenizer = load_tokenizer(config.init)
    template = get_template(template_for(model, tokenizer))
    train_pairs, val_pairs = read_pairs(Path(config.pairs)), read_pairs(Path(config.val_pairs))
    if not train_pairs:
        raise ConfigError(f"{config.pairs}: no pairs")
    buckets = sorted({p["bucket_id"] for p in train_pairs + val_pairs})
    train_examples = tokenise_pairs(train_pairs, tokenizer, template, config.profile, config.max_length, buckets)
    val_examples = tokenise_pairs(val_pairs, tokenizer, template, config.profile, config.max_length, buckets)
    with jax.set_mesh(mesh):
        reference_logps(model, train_examples + val_examples, config.max_length, tokenizer.pad_id,
                        progress=progress, mesh=mesh, pack=config.data.pack)

    save_config(out, config)
    method = Preference(config, len(buckets))
    metrics = MetricsWriter(out)
    trainer = Trainer(model, method, config.optimizer, config.train, mesh, out, metrics=metrics)
    loop = config.train
    layout = pipeline.Layout(loop.global_batch, loop.micro_batches, jax.process_index(), jax.process_count())
    iterator = pipeline.iterate(train_pair_batches(train_examples, layout, loop, config, tokenizer.pad_id))
    eval_size = trainer.eval_batch_size(loop.global_batch)

    def evaluate():
        dataset = pipeline.eval_batches(val_examples, eval_size, config.max_length, tokenizer.pad_id,
                                        jax.process_index(), jax.process_count(), convert=pair_arrays)
        return summarize(trainer.metric_sums(dataset), buckets, prefix="val_")

    checkpointer = Checkpointer(out / "checkpoints", loop.checkpoint_every, loop.keep_checkpoints,
                                meta={"method": config.method})
    result = trainer.fit(iterator, evaluate if val_examples else None, lambda host: summarize(host, buckets),
                         checkpointer, progress=progress)
    checkpointer.close()
    metrics.close()
    if not result["stopped_early"]:
        export_model(trainer, tokenizer, out / "model")
    result.update(out=str(out), method=config.method, train_pairs=len(train_examples), val_pairs=len(val_examples),
                  seconds=round(time.perf_counter() - started, 1))
    if jax.process_index() == 0:
        (out / "summary.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result
