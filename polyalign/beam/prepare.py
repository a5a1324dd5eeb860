"""`polyalign prepare --beam`: the prepare pipeline as an Apache Beam pipeline.

Same records, same counts, same manifest as polyalign.data.prepare, computed with Beam transforms:

    source files --map: import, normalise, label, bucket, split--> records
      --group by conversation/passage: group protection--> --group by content key: exact dedup-->
      --MinHash band keys, group by band: train/test near-duplicates--> RUN/data/{train,val,test}.jsonl

Every count that goes into the manifest travels as an (event, count) pair summed per key; the driver
turns the sums into the manifest once the pipeline is done. Output files are written by the runner's
workers, so their rows come in no particular order (records are keyed by id downstream).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import apache_beam as beam
import numpy as np

from polyalign.beam import pipeline_options, runner_errors, without_step
from polyalign.core.outputs import stage_output
from polyalign.core.paths import remove_path
from polyalign.core.yaml_config import ConfigError
from polyalign.data.dedup import (
    Duplicate,
    NearDuplicateOptions,
    band_keys,
    duplicate_row,
    exact_key,
    minhash_signature,
)
from polyalign.data.importers import read_file, rows_in_file
from polyalign.data.layout import (
    BEAM_EVENTS_DIR,
    EXACT_DUPLICATES,
    clear_outputs,
    file_label,
    owned_files,
    recorded_files,
    refuse_other_stages_folder,
    refuse_sources_inside,
    stale_note,
)
from polyalign.data.prepare import (
    ON_ERROR_MODES,
    AgreementCounts,
    PrepareContext,
    PrepareError,
    SourceTally,
    assemble_manifest,
    build_item,
    duplicate_id_message,
    label_votes,
    load_context,
    near_duplicate_report,
    prepare_meaning,
    prepare_settings,
    quarantine_row,
    source_tallies,
    unit_votes,
    write_manifest,
)
from polyalign.data.records import SPLIT_PRIORITY, SPLITS, Malformed, Record

EVENTS = "events"
QUARANTINE = "quarantine"
DROPPED = "dropped"
DUPLICATES = "exact_duplicates"

Order = tuple[int, int, int]  # (source, file, item): the single-machine path's reading order
Keyed = tuple[Order, Record]


def _event(*key: Any, count: int = 1) -> beam.pvalue.TaggedOutput:
    return beam.pvalue.TaggedOutput(EVENTS, (key, count))


class ImportFile(beam.DoFn):
    """One source file -> records (with their reading order), quarantine rows and import counts."""

    def __init__(self, context: PrepareContext, on_error: str):
        self.context, self.on_error = context, on_error

    def process(self, spec: tuple[int, int], offsets: dict[tuple[int, int], int]) -> Iterator[Any]:
        source_index, file_index = spec
        context = self.context
        source = context.config.sources[source_index]
        file, root = context.source_files[source_index][file_index], context.source_roots[source_index]
        offset = sum(offsets.get((source_index, i), 0) for i in range(file_index))
        tally = SourceTally(source)
        quarantined: list[dict[str, Any]] = []
        dropped: list[dict[str, Any]] = []

        def sink(name: str, malformed: Malformed) -> None:
            if self.on_error == "fail":
                raise PrepareError(f"{malformed.location}: {malformed.problem}")
            quarantined.append(quarantine_row(name, malformed))

        builder = context.builder
        for position, (key, item) in enumerate(read_file(source.format, file, root, offset)):
            record = build_item(builder, source, tally, key, item, sink, dropped.append)
            for row in quarantined:
                yield beam.pvalue.TaggedOutput(QUARANTINE, json.dumps(row, ensure_ascii=False))
            for row in dropped:
                yield beam.pvalue.TaggedOutput(DROPPED, json.dumps(row, ensure_ascii=False))
            quarantined.clear()
            dropped.clear()
            if record is None:
                continue
            for name, agree in label_votes(record, item.labels, item.derived):
                yield _event("label", source.name, name, agree)
            yield (source_index, file_index, position), record
        yield _event("read", source_index, count=tally.read)
        yield _event("records", source_index, count=tally.records)
        yield _event("empty", source_index, count=tally.empty_responses)
        for reason, count in tally.dropped.items():
            yield _event("drop", source_index, reason, None, count=count)
        for language, count in tally.detected_languages.items():
            yield _event("detected", source_index, language, count=count)
        for mismatch, count in tally.language_mismatches.items():
            yield _event("mismatch", source_index, mismatch, count=count)
        for what, count in tally.system_messages.items():
            yield _event("system", source_index, what, count=count)
        for reason, count in tally.notes.items():
            yield _event("note", source_index, reason, count=count)
        for name, count in tally.label_defaults.items():
            yield _event("default", source_index, name, count=count)
        yield _event("opening", source_index, count=tally.opening_replies)
        yield _event("mojibake", source_index, count=tally.mojibake)
        yield _event("mojibake_lost", source_index, count=tally.mojibake_lost)
        if self.on_error == "quarantine":
            yield _event("quarantined", count=tally.dropped["malformed"])


def _check_unique_id(item: tuple[str, Iterable[str]]) -> Iterator[None]:
    record_id, locations = item
    locations = sorted(locations)
    if len(locations) > 1:
        raise PrepareError(duplicate_id_message(record_id, locations))
    return iter(())


def _protect_group(item: tuple[str, Iterable[Keyed]]) -> Iterator[Any]:
    """Every member of a conversation/passage moves to the highest-priority split it appears in."""
    members = list(item[1])
    best = min((record.split for _, record in members), key=SPLIT_PRIORITY.__getitem__)
    for order, record in members:
        if record.split != best:
            yield _event("moved", f"{record.split}_to_{best}")
            record = replace(record, split=best)
        yield order, record


def _keep_first(item: tuple[str, Iterable[Keyed]]) -> Iterator[Any]:
    """Exact dedup of one content key: test, then val, then train, each in reading order, keeps the first."""
    members = sorted(item[1], key=lambda m: (SPLIT_PRIORITY[m[1].split], m[0]))
    (kept_order, kept), duplicates = members[0], members[1:]
    yield kept_order, kept
    for order, record in duplicates:
        kind = f"within_{record.split}" if kept.split == record.split else f"{record.split}_vs_{kept.split}"
        yield _event("exact_kind", kind)
        yield _event("drop", order[0], "exact_duplicate", record.split)
        yield beam.pvalue.TaggedOutput(DUPLICATES, json.dumps(duplicate_row(Duplicate(record, kept.id, kind)),
                                                              ensure_ascii=False))


class BandKeys(beam.DoFn):
    """Train and test records -> (MinHash band key, (split, id, signature)), as datasketch's LSH bands them."""

    def __init__(self, options: NearDuplicateOptions):
        self.options = options

    def process(self, keyed: Keyed) -> Iterator[Any]:
        record = keyed[1]
        if record.split not in ("train", "test"):
            return
        signature = minhash_signature(record, self.options)
        for band in band_keys(signature, self.options):
            yield band, (record.split, record.id, signature)


def _candidate_pairs(threshold: float):
    def pairs(item: tuple[Any, Iterable[tuple[str, str, np.ndarray]]]) -> Iterator[tuple[str, str, float]]:
        members = list(item[1])
        tests = [(i, s) for split, i, s in members if split == "test"]
        for split, train_id, signature in members:
            if split != "train":
                continue
            for test_id, other in tests:
                similarity = float(np.mean(signature == other))
                if similarity >= threshold:
                    yield train_id, test_id, round(similarity, 4)
    return pairs


def _drop_flagged(item: tuple[str, dict[str, list[Any]]]) -> Iterator[Any]:
    _, joined = item
    flagged = bool(joined["flagged"])
    for order, record in joined["records"]:
        if flagged:
            yield _event("drop", order[0], "near_duplicate_of_test", "train")
        else:
            yield order, record


def _final_events(keyed: Keyed, context: PrepareContext) -> Iterator[Any]:
    order, record = keyed
    yield _event("kept", order[0], record.split)
    for unit, name, agree in unit_votes(record, context.scheme):
        yield _event("unit", record.dataset, unit, name, agree)


def _write_lines(lines, path: Path, num_shards: int, label: str):
    """Text lines to PATH.jsonl (one shard) or PATH-SSSSS-of-NNNNN.jsonl."""
    sharding = {"num_shards": 1, "shard_name_template": ""} if num_shards == 1 else {"num_shards": num_shards}
    return lines | f"Write {label}" >> beam.io.WriteToText(str(path), file_name_suffix=".jsonl", **sharding)


def prepare_beam(config_path: Path, out: Path, on_error: str = "fail", overrides: Iterable[str] = (),
                 beam_options: str | None = None, num_shards: int = 1, overwrite: bool = False) -> dict[str, Any]:
    """Run prepare as a Beam pipeline; returns the manifest (also written to OUT/data/manifest.json)."""
    started = time.perf_counter()
    if on_error not in ON_ERROR_MODES:
        raise ConfigError(f"--on-error must be one of {', '.join(ON_ERROR_MODES)}, got {on_error!r}")
    if num_shards < 1:
        raise PrepareError(f"--num-shards must be at least 1, got {num_shards}")
    context = load_context(config_path, overrides)
    data_dir = Path(out) / "data"
    refuse_other_stages_folder(Path(out))
    refuse_sources_inside(data_dir, context.source_files)
    recorded = recorded_files(data_dir)  # before --overwrite removes the manifest that lists them
    with stage_output(data_dir, data_dir / "manifest.json", prepare_settings(context, on_error), overwrite,
                      ours=owned_files(data_dir), key=None,
                      view=prepare_meaning):
        return _run_pipeline(context, data_dir, on_error, beam_options, num_shards, started, recorded)


def _run_pipeline(context: PrepareContext, data_dir: Path, on_error: str, beam_options: str | None,
                  num_shards: int, started: float, recorded: set[str] | None = None) -> dict[str, Any]:
    config = context.config
    data_dir.mkdir(parents=True, exist_ok=True)
    if note := stale_note(data_dir, clear_outputs(data_dir, num_shards, recorded)):
        print(note, file=sys.stderr)
    events_dir = data_dir / BEAM_EVENTS_DIR
    options = pipeline_options(beam_options)
    specs = [(s, f) for s, files in enumerate(context.source_files) for f in range(len(files))]
    multi_file = [(s, f) for s, f in specs if len(context.source_files[s]) > 1]

    def count_rows(spec):
        source = config.sources[spec[0]]
        return spec, rows_in_file(source.format, context.source_files[spec[0]][spec[1]], context.source_roots[spec[0]])

    try:
        with runner_errors(), beam.Pipeline(options=options) as pipeline:
            # Row sources number rows across their files, so a file's first key depends on the row counts
            # of the files before it: a first, cheap pass counts them.
            offsets = (pipeline | "Multi-file sources" >> beam.Create(multi_file)
                       | "Count rows" >> beam.Map(count_rows))
            imported = (pipeline | "Files" >> beam.Create(specs) | "Reshuffle files" >> beam.Reshuffle()
                        | "Import" >> beam.ParDo(ImportFile(context, on_error), beam.pvalue.AsDict(offsets))
                        .with_outputs(EVENTS, QUARANTINE, DROPPED, main="records"))
            records = imported.records
            events = [imported[EVENTS]]
            if on_error == "quarantine":
                _write_lines(imported[QUARANTINE], data_dir / "quarantine", num_shards, "quarantine")
            _write_lines(imported[DROPPED], data_dir / "dropped", num_shards, "dropped")

            _ = (records | "Id" >> beam.Map(lambda k: (k[1].id, k[1].meta["source_row"]))
                 | "Group ids" >> beam.GroupByKey() | "Unique ids" >> beam.FlatMap(_check_unique_id))

            protected = (records | "By group" >> beam.Map(lambda k: (k[1].meta["group"], k))
                         | "Group conversations" >> beam.GroupByKey()
                         | "Protect groups" >> beam.FlatMap(_protect_group).with_outputs(EVENTS, main="records"))
            records, events = protected.records, [*events, protected[EVENTS]]

            near = config.near_dedup
            if config.dedup:
                deduped = (records | "By content" >> beam.Map(lambda k: (exact_key(k[1]), k))
                           | "Group content" >> beam.GroupByKey()
                           | "Keep first" >> beam.FlatMap(_keep_first).with_outputs(EVENTS, DUPLICATES,
                                                                                     main="records"))
                records, events = deduped.records, [*events, deduped[EVENTS]]
                _write_lines(deduped[DUPLICATES], data_dir / EXACT_DUPLICATES, num_shards,
                             "exact duplicates")
            if config.dedup and near.enabled:
                pairs = (records | "Band keys" >> beam.ParDo(BandKeys(near))
                         | "Group bands" >> beam.GroupByKey()
                         | "Candidate pairs" >> beam.FlatMap(_candidate_pairs(near.threshold))
                         | "Distinct pairs" >> beam.Distinct())
                pair_lines = pairs | "Pair json" >> beam.Map(
                    lambda p: json.dumps({"train_id": p[0], "test_id": p[1], "jaccard": p[2]}, ensure_ascii=False))
                _write_lines(pair_lines, data_dir / "near_duplicates", num_shards, "near duplicates")
                if near.remove:
                    flagged = pairs | "Flagged" >> beam.Map(lambda p: (p[0], True))
                    by_id = records | "By id" >> beam.Map(lambda k: (k[1].id, k))
                    kept = ({"records": by_id, "flagged": flagged} | "Join flagged" >> beam.CoGroupByKey()
                            | "Drop flagged" >> beam.FlatMap(_drop_flagged).with_outputs(EVENTS, main="records"))
                    records, events = kept.records, [*events, kept[EVENTS]]

            final = records | "Final counts" >> beam.FlatMap(_final_events, context).with_outputs(EVENTS, main="none")
            events.append(final[EVENTS])
            for split in SPLITS:
                lines = (records | f"Only {split}" >> beam.Filter(lambda k, s=split: k[1].split == s)
                         | f"{split} json" >> beam.Map(lambda k: json.dumps(k[1].to_json(), ensure_ascii=False)))
                _write_lines(lines, data_dir / split, num_shards, split)
            summed = (events | "All events" >> beam.Flatten() | "Sum events" >> beam.CombinePerKey(sum)
                      | "Event json" >> beam.Map(lambda kv: json.dumps([list(kv[0]), kv[1]], ensure_ascii=False)))
            _ = summed | "Write events" >> beam.io.WriteToText(str(events_dir / "events"), file_name_suffix=".jsonl")
    except Exception as err:
        if (message := _row_error(err)) is not None:
            # a bad row stops the run as on one machine, which writes nothing before it: what the pipeline
            # wrote so far goes, or its unfinished-run marker would refuse the corrected command as another config
            for path in owned_files(data_dir):
                remove_path(path)
            raise PrepareError(message) from None
        raise

    manifest = _manifest_from_events(context, on_error, data_dir, events_dir, num_shards, options)
    manifest["timings_s"]["total"] = round(time.perf_counter() - started, 3)
    write_manifest(data_dir, manifest)
    shutil.rmtree(events_dir, ignore_errors=True)
    return manifest


def _row_error(err: Exception) -> str | None:
    """The single-machine path's one-line message inside an exception a runner raised: the DirectRunner
    re-raises the PrepareError with the failing step appended, other runners wrap its traceback."""
    if isinstance(err, PrepareError):
        text = str(err)
    else:
        found = [line.split("PrepareError: ", 1)[1] for line in str(err).splitlines() if "PrepareError: " in line]
        if not found:
            return None
        text = found[0]
    return without_step(text)


def _read_events(events_dir: Path) -> list[tuple[tuple[Any, ...], int]]:
    events = []
    for path in sorted(events_dir.glob("events*.jsonl")):
        with path.open(encoding="utf-8") as handle:
            events.extend((tuple(key), count) for key, count in map(json.loads, filter(str.strip, handle)))
    return events


def read_near_duplicates(data_dir: Path) -> list[tuple[str, str, float]]:
    """The near-duplicate pairs written by either engine, in the single-machine path's order."""
    pairs = []
    for path in sorted(data_dir.glob("near_duplicates*.jsonl")):
        with path.open(encoding="utf-8") as handle:
            pairs.extend((p["train_id"], p["test_id"], p["jaccard"])
                         for p in map(json.loads, filter(str.strip, handle)))
    return sorted(pairs, key=lambda p: (p[0], -p[2], p[1]))


def _manifest_from_events(context: PrepareContext, on_error: str, data_dir: Path, events_dir: Path,
                          num_shards: int, options: Any) -> dict[str, Any]:
    config = context.config
    tallies = source_tallies(context)
    agreement = AgreementCounts()
    moved: dict[str, int] = {}
    kinds: dict[str, int] = {}
    quarantined = 0
    for key, count in _read_events(events_dir):
        kind, *fields = key
        if kind == "read":
            tallies[fields[0]].read += count
        elif kind == "records":
            tallies[fields[0]].records += count
        elif kind == "empty":
            tallies[fields[0]].empty_responses += count
        elif kind == "drop":
            source, reason, split = fields
            tallies[source].dropped[reason] += count
            if split is not None:
                tallies[source].dropped_by_split[split][reason] += count
        elif kind == "detected":
            tallies[fields[0]].detected_languages[fields[1]] += count
        elif kind == "mismatch":
            tallies[fields[0]].language_mismatches[fields[1]] += count
        elif kind == "system":
            tallies[fields[0]].system_messages[fields[1]] += count
        elif kind == "note":
            tallies[fields[0]].notes[fields[1]] += count
        elif kind == "default":
            tallies[fields[0]].label_defaults[fields[1]] += count
        elif kind == "opening":
            tallies[fields[0]].opening_replies += count
        elif kind == "mojibake":
            tallies[fields[0]].mojibake += count
        elif kind == "mojibake_lost":
            tallies[fields[0]].mojibake_lost += count
        elif kind == "kept":
            tallies[fields[0]].kept_by_split[fields[1]] += count
        elif kind == "label":
            agreement.add_label(*fields, count=count)
        elif kind == "unit":
            agreement.add_unit(*fields, count=count)
        elif kind == "moved":
            moved[fields[0]] = count
        elif kind == "exact_kind":
            kinds[fields[0]] = count
        elif kind == "quarantined":
            quarantined += count
    dedup_report: dict[str, Any] = {"enabled": config.dedup, "group_protection": {"moved": dict(sorted(moved.items()))}}
    if config.dedup:
        dedup_report["exact"] = {"removed": sum(kinds.values()), "by_kind": dict(sorted(kinds.items())),
                                 "file": file_label(EXACT_DUPLICATES, num_shards)}
    near = config.near_dedup
    if config.dedup and near.enabled:
        dedup_report["near_duplicates"] = near_duplicate_report(near, read_near_duplicates(data_dir), num_shards)
    else:
        dedup_report["near_duplicates"] = {"enabled": False}
    runner = options.view_as(beam.options.pipeline_options.StandardOptions).runner
    engine = {"name": "beam", "runner": str(runner), "num_shards": num_shards}
    return assemble_manifest(context, on_error, tallies, dedup_report, quarantined, agreement, {}, engine)
