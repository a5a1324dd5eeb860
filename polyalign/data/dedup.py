"""Exact deduplication and train/test near-duplicate detection (METHOD.md section 3)."""

from __future__ import annotations

import functools
import hashlib
import json
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from datasketch import MinHash, MinHashLSH

from polyalign.core.ranges import COUNT, SEED, Range
from polyalign.core.yaml_config import setting
from polyalign.data.layout import EXACT_DUPLICATES
from polyalign.data.records import AFTER_QUESTION, SPLIT_PRIORITY, Record


def exact_key(record: Record) -> str:
    """Identity of a record's content: language, track, family, question, context, response and history,
    lower-cased (the texts are already normalised)."""
    content = [
        record.language, record.track, record.family, record.question.lower(), record.context.lower(),
        record.response.lower(),
        # a system turn after the question is marked, so that it never equals the same text before it
        [[turn["role"], turn["text"].lower(), *[AFTER_QUESTION] * bool(turn.get(AFTER_QUESTION))]
         for turn in record.history],
    ]
    return hashlib.sha1(json.dumps(content, ensure_ascii=False).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Duplicate:
    record: Record
    kept_id: str
    kind: str  # "within_<split>" or "<split>_vs_<split of the kept record>"


def exact_dedup(records: Sequence[Record]) -> tuple[list[Record], list[Duplicate]]:
    """Keep the first occurrence of every content key, visiting test, then val, then train (each in
    source order), so a train row that repeats a test row is the one removed. Source order is kept."""
    order = sorted(range(len(records)), key=lambda i: (SPLIT_PRIORITY[records[i].split], i))
    first: dict[str, Record] = {}
    removed: dict[int, Duplicate] = {}
    for i in order:
        record = records[i]
        key = exact_key(record)
        kept = first.setdefault(key, record)
        if kept is not record:
            kind = f"within_{record.split}" if kept.split == record.split else f"{record.split}_vs_{kept.split}"
            removed[i] = Duplicate(record, kept.id, kind)
    kept_records = [r for i, r in enumerate(records) if i not in removed]
    return kept_records, [removed[i] for i in sorted(removed)]


# Every removed duplicate, one line each, beside the record it repeats: nothing leaves the data unlisted.
EXACT_DUPLICATES_FILE = f"{EXACT_DUPLICATES}.jsonl"


def duplicate_row(duplicate: Duplicate) -> dict[str, str]:
    """A line of exact_duplicates.jsonl: the removed record, the record kept in its place, and how they met."""
    record = duplicate.record
    return {"id": record.id, "kept_id": duplicate.kept_id, "kind": duplicate.kind, "split": record.split,
            "dataset": record.dataset}


def count_kinds(duplicates: Sequence[Duplicate]) -> dict[str, int]:
    return dict(sorted(Counter(d.kind for d in duplicates).items()))


@dataclass(frozen=True)
class NearDuplicateOptions:
    enabled: bool = True
    threshold: float = setting(0.8, range=Range(0, 1, low_open=True, high_open=True),
                               help="estimated Jaccard similarity of character shingles above which a pair is flagged")
    shingle_size: int = setting(5, range=COUNT, help="characters per shingle")
    num_perm: int = setting(128, range=Range(2), help="MinHash permutations")
    remove: bool = False
    seed: int = setting(1, range=SEED)


def near_duplicate_problem(options: NearDuplicateOptions) -> str | None:
    """Why MinHash LSH cannot be built for `options` (ranges aside): too few permutations for a threshold
    this high gives it fewer than two bands; said before any row is read, not after the whole import."""
    try:
        MinHashLSH(threshold=options.threshold, num_perm=options.num_perm)
    except ValueError as err:
        return (f"near_dedup.threshold {options.threshold:g} with near_dedup.num_perm {options.num_perm}: MinHash LSH "
                f"cannot be built ({err}); lower the threshold or raise num_perm")
    return None


def _shingles(text: str, size: int) -> list[bytes]:
    text = " ".join(text.lower().split())
    if len(text) <= size:
        return [text.encode("utf-8")]
    return list({text[i:i + size].encode("utf-8") for i in range(len(text) - size + 1)})


def _signature_text(record: Record) -> str:
    # The response alone would flag every "Yes." pair; the question alone would flag paraphrased answers
    # to a shared prompt. Together they identify one interaction.
    return f"{record.question}\n{record.response}"


def _minhashes(records: Sequence[Record], options: NearDuplicateOptions) -> list[MinHash]:
    return MinHash.bulk(
        (_shingles(_signature_text(r), options.shingle_size) for r in records),
        num_perm=options.num_perm, seed=options.seed, hashfunc=zlib.crc32,
    )


def minhash_signature(record: Record, options: NearDuplicateOptions) -> np.ndarray:
    """One record's MinHash values, equal to what `_minhashes` computes for it in bulk."""
    minhash = MinHash(num_perm=options.num_perm, seed=options.seed, hashfunc=zlib.crc32)
    minhash.update_batch(_shingles(_signature_text(record), options.shingle_size))
    return minhash.hashvalues


@functools.cache
def _band_ranges(threshold: float, num_perm: int) -> tuple[tuple[int, int], ...]:
    return tuple(MinHashLSH(threshold=threshold, num_perm=num_perm).hashranges)


def band_keys(signature: np.ndarray, options: NearDuplicateOptions) -> list[tuple[int, bytes]]:
    """The LSH band keys of a signature, with datasketch's band layout for the threshold: two records
    are near-duplicate candidates exactly when they share a key."""
    return [(band, signature[start:end].tobytes())
            for band, (start, end) in enumerate(_band_ranges(options.threshold, options.num_perm))]


def near_duplicates(
    train: Sequence[Record], test: Sequence[Record], options: NearDuplicateOptions
) -> list[tuple[str, str, float]]:
    """(train id, test id, estimated Jaccard) for every train record whose character-shingle MinHash
    collides with a test record above `threshold` (MinHash LSH from datasketch). Pairs are verified
    against the estimated Jaccard, so LSH false positives are dropped."""
    if not train or not test:
        return []
    lsh = MinHashLSH(threshold=options.threshold, num_perm=options.num_perm)
    test_hashes = _minhashes(test, options)
    for record, minhash in zip(test, test_hashes):
        lsh.insert(record.id, minhash)
    by_id = dict(zip((r.id for r in test), test_hashes))
    pairs = []
    for record, minhash in zip(train, _minhashes(train, options)):
        for test_id in lsh.query(minhash):
            similarity = float(np.mean(minhash.hashvalues == by_id[test_id].hashvalues))
            if similarity >= options.threshold:
                pairs.append((record.id, test_id, round(similarity, 4)))
    return sorted(pairs, key=lambda p: (p[0], -p[2], p[1]))
