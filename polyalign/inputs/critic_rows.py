"""The critic's batches: encoded responses, not tokens. Each step holds a regression batch (human and
model responses with their support distance as target) and a ranking batch (pairs of human and model
responses to the same record)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from polyalign.inputs.pipeline import Layout


@dataclass
class EncodedPairs:
    """Pairs encoded by the frozen encoder ([N, H] each side), their bucket indices and the support
    distances d(y, b) of each side (NaN where the bucket has no reference)."""

    pooled_human: np.ndarray
    pooled_model: np.ndarray
    bucket: np.ndarray
    target_human: np.ndarray
    target_model: np.ndarray

    @property
    def regression_rows(self) -> int:
        """Responses with a target: the critic's epoch."""
        return int((~np.isnan(np.concatenate([self.target_human, self.target_model]))).sum())


def critic_batches(split: EncodedPairs, steps: int, seed: int, layout: Layout, pair_batch: int, shards: int = 1):
    """Per step: a regression batch of `layout.global_batch` rows (human and model responses with a
    target) and a batch of `pair_batch` pairs, each drawn without replacement from a reshuffled order as it
    runs out. Every process draws the same global batches and keeps its own share of each micro-batch
    (`local_rows`, padded for the `shards` devices the batch axis is split over), so the rows the step
    sees do not depend on how many processes feed it."""
    reg_pooled = np.concatenate([split.pooled_human, split.pooled_model])
    reg_bucket = np.concatenate([split.bucket, split.bucket])
    reg_target = np.concatenate([split.target_human, split.target_model])
    has_target = ~np.isnan(reg_target)
    reg_pooled, reg_bucket, reg_target = reg_pooled[has_target], reg_bucket[has_target], reg_target[has_target]
    rng = np.random.default_rng(seed)
    reg_order, pair_order = np.array([], int), np.array([], int)
    for _ in range(steps):
        if len(reg_order) < layout.global_batch:
            reg_order = np.concatenate([reg_order, rng.permutation(len(reg_target))])
        if len(pair_order) < pair_batch:
            pair_order = np.concatenate([pair_order, rng.permutation(len(split.bucket))])
        r, reg_order = reg_order[:layout.global_batch], reg_order[layout.global_batch:]
        q, pair_order = pair_order[:pair_batch], pair_order[pair_batch:]
        regression = local_rows({"reg_pooled": reg_pooled[r], "reg_bucket": reg_bucket[r],
                                 "reg_target": reg_target[r].astype(np.float32)}, layout, "reg_valid", shards)
        pairs = local_rows({"pair_human": split.pooled_human[q], "pair_model": split.pooled_model[q],
                            "pair_bucket": split.bucket[q]}, layout, "pair_valid", shards)
        yield {**regression, **pairs}


def local_rows(rows: dict[str, np.ndarray], layout: Layout, valid_key: str, shards: int = 1) -> dict[str, np.ndarray]:
    """Global rows [N, ...] -> this process's [micro_batches, per_process, ...] share, padded with rows
    marked invalid (`valid_key` 0, which the critic's sums and denominators leave out) until every
    micro-batch divides over the processes and the `shards` devices of the batch axis; the same cut as
    Layout.global_position."""
    size = len(next(iter(rows.values())))
    pieces = layout.micro_batches * math.lcm(layout.process_count, shards)
    per_process = -(-size // pieces)
    padded = per_process * pieces
    valid = np.zeros(padded, np.float32)
    valid[:size] = 1.0
    out = {}
    for key, value in {**rows, valid_key: valid}.items():
        value = np.concatenate([value, np.zeros((padded - len(value), *value.shape[1:]), value.dtype)])
        shaped = value.reshape(layout.micro_batches, layout.process_count, -1, *value.shape[1:])
        out[key] = shaped[:, layout.process_index]
    return out
