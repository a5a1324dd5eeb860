"""Which records a generation stage takes: `--limit` (the first N), `--sample` (a seeded random N, in
file order) or `--per-bucket` (a seeded random N of each bucket, in file order), the same for
`polyalign generate` and `polyalign prompts`, so that prompts exported for an external engine are the
records `generate` would answer."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from polyalign.core.errors import GenerationError
from polyalign.data.records import Record


def select_records(records: list[Record], source: Path, limit: int | None = None, sample: int | None = None,
                   seed: int = 0, per_bucket: int | None = None) -> tuple[list[Record], list[str]]:
    """The records taken, and one note per option that asked for more than the file holds (all of them
    are then taken; a user who asked for 5,000 of 1,234 should hear it, not find out by counting)."""
    if sample is not None and per_bucket is not None:
        raise GenerationError("--sample and --per-bucket each choose the records; give one of them")
    notes = []
    if limit is not None and limit > len(records):
        notes.append(f"--limit {limit}: {source} holds {len(records)} records; all are taken")
    records = records[:limit]
    chooser = f"--sample {sample}" if sample is not None else f"--per-bucket {per_bucket}" if per_bucket else None
    if limit is not None and chooser:  # both choose: said, so neither reads as ignored
        notes.append(f"--limit {limit} with {chooser}: chosen from the first {len(records)} records only")
    if sample is not None and sample > len(records):
        notes.append(f"--sample {sample}: {len(records)} records to sample from; all are taken")
    elif sample is not None and sample < len(records):
        keep = np.sort(np.random.default_rng(seed).choice(len(records), sample, replace=False))
        records = [records[i] for i in keep]
    elif per_bucket is not None:
        records, note = _per_bucket(records, per_bucket, seed)
        notes += [note] if note else []
    if not records:
        raise GenerationError(f"{source}: no records")
    return records, notes


def _per_bucket(records: list[Record], per_bucket: int, seed: int) -> tuple[list[Record], str | None]:
    """A seeded random `per_bucket` of each bucket's records (all of a smaller bucket's), in file order:
    pairs and evaluations for every bucket rather than the data's mix, where a few large buckets would
    take nearly every record. Each bucket draws from its own seed, so a bucket's records do not depend
    on which other buckets the file holds. The note names the buckets that hold fewer."""
    positions = defaultdict(list)
    for index, record in enumerate(records):
        positions[record.bucket_id].append(index)
    keep, fewer = [], {}
    for bucket, indices in positions.items():
        if len(indices) <= per_bucket:
            keep += indices
            fewer.update({bucket: len(indices)} if len(indices) < per_bucket else {})
        else:
            rng = np.random.default_rng([seed, *bucket.encode("utf-8")])
            keep += [indices[i] for i in rng.choice(len(indices), per_bucket, replace=False)]
    note = None
    if fewer:
        smallest = ", ".join(f"{bucket} ({count})" for bucket, count in sorted(fewer.items(), key=lambda kv: kv[1])[:3])
        note = (f"--per-bucket {per_bucket}: {len(fewer)} of {len(positions)} buckets hold fewer records; all of "
                f"theirs are taken (fewest: {smallest})")
    return [records[i] for i in sorted(keep)], note
