"""Preference pairs (METHOD section 7): the human response is chosen, the initial policy's own
generation for the same record (joined by id) is rejected."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polyalign.core import jsonl
from polyalign.core.outputs import OutputLock, sidecar, stage_output, write_record
from polyalign.core.paths import as_path, file_digest
from polyalign.data.records import RECORD_FIELDS, InputError, Record, read_records
from polyalign.data.text import normalize
from polyalign.generate.predictions import check_generated_from, iter_predictions

PAIR_TEXT_FIELDS = ("id", "bucket_id", "language", "chosen", "rejected")
# Pair weight: clip(1 + B g_b + C max(0, c_rej - c_cho) + L g_lang + T pi_type, LOW, HIGH)
BUCKET_GAIN, CRITIC_GAIN, LANGUAGE_GAIN, TYPE_GAIN, WEIGHT_CLIP = 0.5, 1.0, 0.25, 0.25, (0.5, 3.0)
# A bucket with fewer pairs than this is said: the bucket gain can weight a rare bucket's pairs up
# (at most 1 + BUCKET_GAIN), not give a bucket with one pair or none a say in the preference step.
FEW_BUCKET_PAIRS = 5


def read_predictions(path: Path) -> dict[str, dict[str, Any]]:
    """Prediction rows by id; a duplicate id is an error naming the line."""
    rows: dict[str, dict[str, Any]] = {}
    for line_number, row in iter_predictions(path):
        if row["id"] in rows:
            raise InputError(f"{path}:{line_number}: duplicate id {row['id']!r}")
        rows[row["id"]] = row
    return rows


def imbalance_gains(counts: Mapping[str, int]) -> dict[str, float]:
    """g_k = raw_k / max raw, raw_k = max(0, N / (K n_k) - 1): 0 for groups at or above the mean size,
    up to 1 for the rarest."""
    total, k = sum(counts.values()), len(counts)
    raw = {key: max(0.0, total / (k * n) - 1.0) for key, n in counts.items()}
    top = max(raw.values(), default=0.0)
    return {key: (value / top if top > 0 else 0.0) for key, value in raw.items()}


def pair_weight(bucket_gain: float, language_gain: float, critic_chosen: float | None = None,
                critic_rejected: float | None = None, pair_type: float = 0.0) -> float:
    critic_term = 0.0 if critic_chosen is None else max(0.0, critic_rejected - critic_chosen)
    raw = 1.0 + BUCKET_GAIN * bucket_gain + CRITIC_GAIN * critic_term + LANGUAGE_GAIN * language_gain \
        + TYPE_GAIN * pair_type
    return min(max(raw, WEIGHT_CLIP[0]), WEIGHT_CLIP[1])


def build_pairs(records: Sequence[Record], predictions: Mapping[str, Mapping[str, Any]]) -> tuple[list[dict], dict]:
    """Pairs for every predicted record with a usable prediction, and counts of what was dropped and
    why. Records without a prediction (generation ran on a sample) are not pairs and not drops."""
    pairs, dropped = [], Counter()
    for record in records:
        row = predictions.get(record.id)
        if row is None:
            continue
        chosen, rejected = normalize(record.response), normalize(row["prediction"])
        if not chosen or not rejected:
            dropped["empty_side"] += 1
            continue
        if chosen == rejected:
            dropped["chosen_equals_rejected"] += 1
            continue
        pairs.append({"id": record.id, "bucket_id": record.bucket_id, "language": record.language,
                      "chosen": chosen, "rejected": rejected, "model": row.get("model"), "record": record.to_json()})
    return pairs, dict(dropped)


def assign_weights(pairs: list[dict], training: list[dict] | None = None) -> None:
    """Pair weights from the imbalance of buckets and languages among the training pairs (`training`; these
    pairs themselves when they are the training pairs), and from the critic scores where the pairs carry
    them (`critic_chosen`, `critic_rejected`). Held-out pairs are weighted as the training objective weighs
    their bucket and language (METHOD section 7: "of the training pairs"), so that the weighted validation
    loss measures what training optimises; a group the training pairs lack counts as the rarest (gain 1,
    the limit of N / (K n) as n falls)."""
    counted = pairs if training is None else training
    bucket_gains = imbalance_gains(Counter(p["bucket_id"] for p in counted))
    language_gains = imbalance_gains(Counter(p["language"] for p in counted))
    for pair in pairs:
        pair["weight"] = pair_weight(bucket_gains.get(pair["bucket_id"], 1.0),
                                     language_gains.get(pair["language"], 1.0),
                                     pair.get("critic_chosen"), pair.get("critic_rejected"))


def make_pairs(records_path: Path, predictions_path: Path, out: Path, overwrite: bool = False,
               training_pairs: Path | None = None) -> dict:
    """Joins records and predictions by id into OUT (JSONL), weighted; returns a summary. Held-out pairs
    are weighted by the bucket and language counts of `training_pairs` (assign_weights), others by their
    own. Pairs made from other files are not replaced unless `overwrite`."""
    inputs = {"records": records_path, "predictions": predictions_path,
              **({"training_pairs": training_pairs} if training_pairs is not None else {})}
    settings = {name: str(Path(path).resolve()) for name, path in inputs.items()}
    check_generated_from(Path(predictions_path), Path(records_path))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with stage_output(out, sidecar(out), settings, overwrite, ours=[out], inputs=inputs, lock=OutputLock.for_file(out)):
        training = read_pairs(Path(training_pairs)) if training_pairs is not None else None
        summary = _make_pairs(Path(records_path), Path(predictions_path), out, training)
        write_record(sidecar(out), settings, {name: file_digest(path) for name, path in inputs.items()},
                     summary=summary)
    return summary


def _make_pairs(records_path: Path, predictions_path: Path, out: Path, training: list[dict] | None) -> dict:
    records = read_records(records_path)
    predictions = read_predictions(predictions_path)
    extra = len(set(predictions) - {r.id for r in records})
    if extra:
        raise InputError(f"{predictions_path}: {extra} prediction ids are not records of {records_path}")
    pairs, dropped = build_pairs(records, predictions)
    assign_weights(pairs, training=training)
    write_pairs(pairs, out)
    return {"records": len(records), "predictions": len(predictions), "pairs": len(pairs), "dropped": dropped,
            "records_without_prediction": len(records) - (len(predictions) - extra),
            "predictions_without_record": extra, "out": str(out),
            "weighted_by": "their own counts" if training is None else f"the counts of {len(training)} training pairs",
            **bucket_coverage(records, pairs, set(predictions))}


def bucket_coverage(records: Sequence[Record], pairs: Sequence[dict], answered: set[str]) -> dict:
    """How many of the records' buckets the pairs reach: `buckets` (of the records), `few_pairs` (bucket ->
    [pairs, records, answered records] for each with fewer than FEW_BUCKET_PAIRS pairs), so that a user
    whose pairs follow the data's mix (one large bucket answered, the rest barely) hears it before training
    on them, and whether answering more of a bucket's records could help."""
    held = Counter(r.bucket_id for r in records)
    asked = Counter(r.bucket_id for r in records if r.id in answered)
    paired = Counter(p["bucket_id"] for p in pairs)
    few = {bucket: [paired[bucket], count, asked[bucket]] for bucket, count in sorted(held.items())
           if paired[bucket] < FEW_BUCKET_PAIRS}
    return {"buckets": len(held), "few_pairs": few, "few_below": FEW_BUCKET_PAIRS}


def write_pairs(pairs: Sequence[dict], out) -> None:
    out = as_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for pair in pairs:
            handle.write(json.dumps(pair, ensure_ascii=False) + "\n")


def read_pairs(path: Path, missing: str = "run `polyalign pairs` first") -> list[dict]:
    """The pairs of a pairs file, each checked to be one: a row that is not (a TRL row, a missing field)
    is an error naming the file, the line and what to run. `missing`: what to do when there is no file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such pairs file; {missing}")
    try:
        rows = list(jsonl.read_lines(path))
    except jsonl.JsonProblem as problem:
        raise InputError(f"not JSON: {problem}") from None
    for number, row in rows:
        if problem := pair_problem(row):
            form = export_format(row)
            hint = f"; run `polyalign pairs import --format {form} --input {path} --out PAIRS` first" if form else ""
            raise InputError(f"{path}:{number}: not a polyalign pair ({problem}){hint}")
    return [row for _, row in rows]


# An Anthropic HH turn marker: "\n\nHuman: " or "\n\nAssistant: " (at the start of the text without its newlines)
HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):[ \t]?")


def hh_text(value: Any) -> bool:
    """Whether a field holds Anthropic HH text: it opens with a Human turn (a prompt that only quotes a chat
    log further in is not)."""
    return isinstance(value, str) and re.match(r"\s*Human:", value) is not None


def export_format(row: Any) -> str | None:
    """The `pairs import --format` a row of another tool's preference export reads with: LLaMA-Factory's
    ShareGPT rows keep their prompt in `conversations` and each answer as one turn object; Anthropic HH's
    write the conversation out as "\\n\\nHuman: ..." text; TRL's carry chosen and rejected as text or
    message lists. None for anything else."""
    if not isinstance(row, dict) or not {"chosen", "rejected"} <= set(row):
        return None
    if "conversations" in row or isinstance(row["chosen"], dict):
        return "sharegpt-pairs"
    hh = "prompt" if "prompt" in row else "chosen"  # Anthropic HH: the turns written out in one text
    return "hh" if hh_text(row[hh]) else "trl"


def pair_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return "not a JSON object"
    for key in PAIR_TEXT_FIELDS:
        if not isinstance(row.get(key), str):
            return f"no string field {key!r}"
    record = row.get("record")
    if not isinstance(record, dict) or not set(RECORD_FIELDS) <= set(record):
        return "no 'record' with the fields of a prepared record"
    return None


def prompt_key(pair: Mapping[str, Any]) -> str:
    """What a pair answers: its record's earlier turns, context and question. Pairs with one key are
    one group, kept on one side of a train/val split."""
    record = pair.get("record") or {}
    return json.dumps([record.get("history"), record.get("context"), record.get("question")], ensure_ascii=False,
                      sort_keys=True)


def split_by_prompt(pairs: Sequence[dict], fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, val): about `fraction` of the pairs held out for validation, whole prompts at a time (two
    pairs of one prompt never straddle the split). Prompts are taken in the order of a seeded hash of
    their key, so the same file and seed give the same split, and adding rows moves no other prompt."""
    groups: dict[str, list[int]] = {}
    for i, pair in enumerate(pairs):
        groups.setdefault(prompt_key(pair), []).append(i)
    if len(groups) < 2:
        raise InputError(f"a validation split needs pairs of at least two prompts; these {len(pairs)} pairs answer "
                         f"{len(groups)}")
    order = sorted(groups, key=lambda key: hashlib.sha256(f"{seed}\0{key}".encode()).hexdigest())
    target, held = max(1, round(fraction * len(pairs))), set()
    for key in order[:-1]:  # at least one prompt stays for training
        if len(held) >= target:
            break
        held.update(groups[key])
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


def as_validation(pair: dict) -> dict:
    """A held-out pair: its id and its record's id and split say val (the record keeps its labels)."""
    record = dict(pair.get("record") or {})
    head, sep, tail = pair["id"].rpartition("-train-")  # prepare's ids: DATASET-SPLIT-KEY
    new_id = f"{head}-val-{tail}" if sep else f"{pair['id']}-val"
    if record:
        record.update(id=new_id, split="val")
    return {**pair, "id": new_id, **({"record": record} if record else {})}


def write_pair_split(pairs: list[dict], out, val_out=None, val_fraction: float | None = None,
                     seed: int = 0) -> dict[str, Any]:
    """OUT (and, with `val_fraction`, VAL_OUT: prompts held out, their pair ids distinct from OUT's),
    both weighted by the imbalance of OUT's pairs; returns what the summary says of the split (each file's pairs
    per bucket under `buckets` and `val_buckets`)."""
    if not val_fraction:
        assign_weights(pairs)
        write_pairs(pairs, out)
        return {}
    train, val = split_by_prompt(pairs, val_fraction, seed)
    val = [as_validation(p) for p in val]
    assign_weights(train)
    assign_weights(val, training=train)
    write_pairs(train, out)
    write_pairs(val, val_out)
    return {"pairs": len(train), "val_pairs": len(val), "val_out": str(val_out), "val_fraction": val_fraction,
            "seed": seed, "buckets": _per_bucket(train), "val_buckets": _per_bucket(val)}


def _per_bucket(pairs: list[dict]) -> dict[str, int]:
    return dict(sorted(Counter(p["bucket_id"] for p in pairs).items()))
