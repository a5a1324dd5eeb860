"""The critic's batches: encoded responses, not tokens. Each step holds a regression batch (human and
model responses with their support distance as target) and a ranking batch (pairs of human and model
responses to the same record)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


def critic_batches(split: EncodedPairs, steps: int, seed: int, regression_batch: int, pair_batch: int):
    """Per step: a regression batch (human and model responses with a target) and a pair batch, each
    drawn without replacement from a reshuffled order as it runs out."""
    reg_pooled = np.concatenate([split.pooled_human, split.pooled_model])
    reg_bucket = np.concatenate([split.bucket, split.bucket])
    reg_target = np.concatenate([split.target_human, split.target_model])
    has_target = ~np.isnan(reg_target)
    reg_pooled, reg_bucket, reg_target = reg_pooled[has_target], reg_bucket[has_target], reg_target[has_target]
    rng = np.random.default_rng(seed)
    reg_order, pair_order = np.array([], int), np.array([], int)
    for _ in range(steps):
        if len(reg_order) < regression_batch:
            reg_order = np.concatenate([reg_order, rng.permutation(len(reg_target))])
        if len(pair_order) < pair_batch:
            pair_order = np.concatenate([pair_order, rng.permutation(len(split.bucket))])
        r, reg_order = reg_order[:regression_batch], reg_order[regression_batch:]
        q, pair_order = pair_order[:pair_batch], pair_order[pair_batch:]
        yield {
            "reg_pooled": reg_pooled[r][None], "reg_bucket": reg_bucket[r][None],
            "reg_target": reg_target[r][None].astype(np.float32), "reg_valid": np.ones((1, len(r)), np.float32),
            "pair_human": split.pooled_human[q][None], "pair_model": split.pooled_model[q][None],
            "pair_bucket": split.bucket[q][None], "pair_valid": np.ones((1, len(q)), np.float32),
        }
