"""Token budgets by bucket: `--max-new-tokens auto`.

polyalign's buckets exist because people answer at different lengths in different contexts: a dialogue
turn is a few dozen tokens, an assistant answer hundreds. One budget for every request either cuts the
long buckets or lets the short ones run on. `auto` gives each request its bucket's human length: a high
quantile of the bucket's reference answers in the model's own tokens, times a margin.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from polyalign.core.errors import GenerationError
from polyalign.data.records import Record

MIN_BUDGET = 8


@dataclass(frozen=True)
class BucketBudgets:
    """Budgets by bucket id, and the one for buckets the reference records do not hold (the largest)."""

    by_bucket: dict[str, int]
    fallback: int

    def __call__(self, bucket_id: str) -> int:
        return self.by_bucket.get(bucket_id, self.fallback)


def bucket_budgets(references: Sequence[Record], encode, quantile: float = 0.99, margin: float = 1.2,
                   ceiling: int = 1024) -> BucketBudgets:
    """Each bucket's budget: ceil(q-quantile of its human answers' token counts x margin), between
    MIN_BUDGET and `ceiling`. `encode` is the model's tokenizer's text -> ids."""
    if not references:
        raise GenerationError("max_new_tokens auto: the reference records hold no answers to take lengths from")
    lengths: dict[str, list[int]] = defaultdict(list)
    for record in references:
        lengths[record.bucket_id].append(len(encode(record.response)))
    budgets = {bucket: int(min(ceiling, max(MIN_BUDGET, math.ceil(np.quantile(counts, quantile) * margin))))
               for bucket, counts in sorted(lengths.items())}
    return BucketBudgets(budgets, max(budgets.values()))


def truncation_by_bucket(buckets: Sequence[str], finish_reasons: Sequence[str]) -> dict[str, float]:
    """The share of each bucket's answers that ran out of budget (finish reason "length")."""
    rows: dict[str, list[bool]] = defaultdict(list)
    for bucket, reason in zip(buckets, finish_reasons):
        rows[bucket].append(reason == "length")
    return {bucket: round(float(np.mean(cut)), 4) for bucket, cut in sorted(rows.items())}
