"""Which records a generation stage takes: `--limit` (the first N) and `--sample` (a seeded random N, in
file order), the same for `polyalign generate` and `polyalign prompts`, so that prompts exported for an
external engine are the records `generate` would answer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from polyalign.core.errors import GenerationError
from polyalign.data.records import Record


def select_records(records: list[Record], source: Path, limit: int | None = None, sample: int | None = None,
                   seed: int = 0) -> tuple[list[Record], list[str]]:
    """The records taken, and one note per option that asked for more than the file holds (all of them
    are then taken; a user who asked for 5,000 of 1,234 should hear it, not find out by counting)."""
    notes = []
    if limit is not None and limit > len(records):
        notes.append(f"--limit {limit}: {source} holds {len(records)} records; all are taken")
    records = records[:limit]
    if sample is not None and sample > len(records):
        notes.append(f"--sample {sample}: {len(records)} records to sample from; all are taken")
    elif sample is not None and sample < len(records):
        keep = np.sort(np.random.default_rng(seed).choice(len(records), sample, replace=False))
        records = [records[i] for i in keep]
    if not records:
        raise GenerationError(f"{source}: no records")
    return records, notes
