"""`polyalign build --beam`: tokenising prepared records as an Apache Beam pipeline that TFDS runs.

Reads RUN/data/{train,val}.jsonl (or the shards of a Beam prepare), computes the Bucket-SFT weights from
the train bucket counts (a combine, given to the encoder as a side input), encodes every record with the
chat template (a per-record map) and lets TFDS's Beam writer store the array_record dataset. The examples,
their order (record id) and the manifest equal polyalign.inputs.build.build's.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import apache_beam as beam
import tensorflow_datasets as tfds
from apache_beam.metrics.metric import Metrics, MetricsFilter

from polyalign.beam import pipeline_options, runner_errors
from polyalign.core.errors import InputError
from polyalign.data.bucketing import WeightOptions, weight_warnings
from polyalign.data.layout import split_files
from polyalign.data.records import Record
from polyalign.inputs.build import (
    BucketTable,
    build_weights,
    check_options,
    claim_build,
    encode_record,
    kept_build,
    require_records,
    shared_warning,
    split_bucket_counts,
    stale_tokenizer,
    tokenizer_and_template,
    write_dataset,
    write_manifest,
)
from polyalign.inputs.built import SPLITS, BuildOptions, probe_records
from polyalign.model.tokenizer_check import PROBE_RECORDS, check_tokenizer
from polyalign.tokens.chat import get_template
from polyalign.tokens.tokenizer import load_tokenizer

NAMESPACE = "polyalign.build"
SHARED_COUNTER = "shared.val_in_train"  # val records whose ids train has too


class EncodeRecord(beam.DoFn):
    """Record -> (record id, example); counts examples, tokens and buckets in Beam metrics."""

    def __init__(self, tokenizer_path: str, template_name: str, options: BuildOptions, split: str):
        self.tokenizer_path, self.template_name = tokenizer_path, template_name
        self.options, self.split = options, split

    def setup(self):
        self.tokenizer = load_tokenizer(Path(self.tokenizer_path))
        self.template = get_template(self.template_name, self.tokenizer)

    def process(self, record: Record, table: BucketTable):
        key, example, counts = encode_record(record, self.tokenizer, self.template, self.options, table)
        for name, value in counts.items():
            Metrics.counter(NAMESPACE, f"{self.split}.{name}").inc(value)
        Metrics.counter(NAMESPACE, f"bucket.{self.split}.{record.bucket_id}").inc()
        yield key, example


def _check_id(item: tuple[str, Any], names: dict[str, list[str]]) -> list[None]:
    """The Beam side of build.repeated_ids: an id twice in one split is refused, naming its file (a worker
    reads lines unnumbered); one in both splits is counted for the warning. `item`: (id, [(split, index of
    the file in names[split])])."""
    record_id, places = item
    places = sorted(places)
    for split in SPLITS:
        files = [names[split][index] for where, index in places if where == split]
        if len(files) > 1:
            others = f" (of {', '.join(sorted(set(files)))})" if len(set(files)) > 1 else ""
            raise InputError(f"{files[0]}: record id {record_id!r} is in {len(files)} rows{others}; each record is "
                             "one example: remove the copies (an edit by hand?), or run `polyalign prepare` again")
    if len({split for split, _ in places}) > 1:
        Metrics.counter(NAMESPACE, SHARED_COUNTER).inc()
    return []


def _bucket_table(_, train_counts: dict[str, int], buckets: list[str], weights: WeightOptions,
                  checked: list[None]) -> BucketTable:
    """`checked`, the id check's (empty) output, is a side input so that no record is encoded, and no example
    reaches TFDS's writer, before every id was checked."""
    return BucketTable.from_counts(train_counts, set(buckets), weights)


def build_beam(run: Path, options: BuildOptions = BuildOptions(), beam_options: str | None = None,
               overwrite: bool = False) -> dict[str, Any]:
    """Builds RUN/build/sft_examples with a Beam pipeline; returns the manifest (RUN/build/manifest.json).
    A build made with other options is not replaced unless `overwrite`."""
    require_records(run)
    if (kept := kept_build(run, options, overwrite)) is not None:
        return kept
    with claim_build(run, options, overwrite):
        return _build_beam(Path(run), options, beam_options)


def _build_beam(run: Path, options: BuildOptions, beam_options: str | None) -> dict[str, Any]:
    started = time.perf_counter()
    check_options(options)
    tokenizer_path, tokenizer, template_name = tokenizer_and_template(run, options)
    weights, weights_source = build_weights(run, options.weights)
    get_template(template_name, tokenizer)  # unknown template names fail here, not on a worker
    files = {split: [str(f) for f in split_files(run, split)] for split in SPLITS}

    def split_examples(pipeline):
        placed = {
            split: (pipeline | f"{split} files" >> beam.Create(files[split])
                    | f"Read {split}" >> beam.io.ReadAllFromText(with_filename=True)
                    | f"Parse {split}" >> beam.MapTuple(lambda file, line: (file, Record.from_json(json.loads(line)))))
            for split in SPLITS
        }
        index = {split: {name: i for i, name in enumerate(files[split])} for split in SPLITS}
        checked = ([placed[split] | f"{split} ids" >> beam.MapTuple(
                        lambda file, record, split=split: (record.id, (split, index[split][file])))
                    for split in SPLITS]
                   | "All ids" >> beam.Flatten() | "Group ids" >> beam.GroupByKey()
                   | "Check ids" >> beam.FlatMap(_check_id, files))
        records = {split: placed[split] | f"Records {split}" >> beam.Values() for split in SPLITS}
        train_counts = (records["train"] | "Train buckets" >> beam.Map(lambda r: r.bucket_id)
                        | "Count train buckets" >> beam.combiners.Count.PerElement())
        buckets = ((records["train"], records["val"]) | "All records" >> beam.Flatten()
                   | "Buckets" >> beam.Map(lambda r: r.bucket_id) | "Distinct buckets" >> beam.Distinct())
        table = (pipeline | "Table seed" >> beam.Create([None])
                 | "Bucket table" >> beam.Map(_bucket_table, beam.pvalue.AsDict(train_counts),
                                               beam.pvalue.AsList(buckets), weights, beam.pvalue.AsList(checked)))
        return {
            split: records[split] | f"Encode {split}" >> beam.ParDo(
                EncodeRecord(str(tokenizer_path), template_name, options, split), beam.pvalue.AsSingleton(table))
            for split in SPLITS
        }

    counters: dict[str, int] = {}

    def collect_counters(result) -> None:
        for counter in result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]:
            value = counter.committed if counter.committed is not None else counter.attempted
            counters[counter.key.metric.name] = counters.get(counter.key.metric.name, 0) + value

    pipeline = pipeline_options(beam_options)
    with runner_errors():
        write_dataset(run, split_examples, tfds.download.DownloadConfig(beam_options=pipeline),
                      on_pipeline_result=collect_counters)

    stats = {split: Counter() for split in SPLITS}
    bucket_counts: dict[str, Counter] = {split: Counter() for split in SPLITS}
    shared = counters.pop(SHARED_COUNTER, 0)
    for name, value in counters.items():
        kind, rest = name.split(".", 1)
        if kind == "bucket":
            split, bucket = rest.split(".", 1)
            bucket_counts[split][bucket] = value
        else:
            stats[kind][rest] = value
    train_counts = dict(bucket_counts["train"])
    table = BucketTable.from_counts(train_counts, set(bucket_counts["train"]) | set(bucket_counts["val"]), weights,
                                    weights_source)
    # the same warnings as the single-machine build: val's buckets from the pipeline's counters, test's read
    # here (the build encodes no test records)
    warnings = weight_warnings(table.weights, train_counts, bucket_counts["val"], split_bucket_counts(run, "test"),
                               weights.warn_above)
    warnings += [stale] if (stale := stale_tokenizer(run, tokenizer_path)) else []
    warnings += [shared_warning(shared, stats["val"]["examples"])] if shared else []
    runner = pipeline.view_as(beam.options.pipeline_options.StandardOptions).runner
    check, mismatch = check_tokenizer(tokenizer, get_template(template_name, tokenizer), options.profile,
                                      probe_records(run, PROBE_RECORDS), str(tokenizer_path))
    return write_manifest(run, tokenizer_path, tokenizer, template_name, options, table, stats,
                          time.perf_counter() - started, engine={"name": "beam", "runner": str(runner)},
                          warnings=[*warnings, *[mismatch] * bool(mismatch)], tokenizer_check=check)

