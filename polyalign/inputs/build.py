"""`polyalign build`: prepared records to tokenised training examples, stored as a TFDS dataset in
array_record format (written and read without TensorFlow).

Each example holds the token ids of one rendered conversation, its loss mask (the response and its
end-of-turn token), its Bucket-SFT weight, its bucket index and its record id.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shlex
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from polyalign.core import jsonl
from polyalign.core.errors import ChatTemplateError, InputError
from polyalign.core.interrupts import check_interrupted
from polyalign.core.outputs import stage_output
from polyalign.core.paths import as_path, changed_since, file_digest, files_digest, is_uri
from polyalign.core.progress import progress_bar
from polyalign.core.yaml_config import ConfigError
from polyalign.data.bucketing import (
    WEIGHT_PRESETS,
    WeightOptions,
    bucket_weights,
    prepared_scheme,
    weight_options,
    weight_warnings,
)
from polyalign.data.layout import prepare_manifest, split_files
from polyalign.data.records import Record, read_records
from polyalign.inputs.built import (
    BUILD_DIR,
    LEGACY_SETTINGS,
    PREPARE_MANIFEST,
    SPLITS,
    BuildOptions,
    probe_records,
    rebuild_command,
)
from polyalign.model.architecture import checkpoint_family
from polyalign.model.tokenizer_check import PROBE_RECORDS, check_tokenizer
from polyalign.tokens.chat import (
    CHECKPOINT_TEMPLATE,
    PROFILE_MODES,
    SYSTEM_MODES,
    TRAIN_ON,
    TRUNCATIONS,
    Encoded,
    choose_template,
    encode_conversation,
    get_template,
    record_messages,
    source_system,
)
from polyalign.tokens.profile_template import PROFILE_COMBINATIONS, PROFILE_FIELDS
from polyalign.tokens.tokenizer import (
    CHAT_TEMPLATE_FILE,
    SENTENCEPIECE_FILE,
    TOKENIZER_CONFIG,
    TOKENIZERS_FILE,
    load_tokenizer,
)
from polyalign.tokens.tokenizer_training import read_report

DATASET_NAME = "sft_examples"
DATASET_VERSION = "1.0.0"
# Examples per profile value, counted beside STAT_KEYS as "profile:family=dialogue": the values a model
# trained on this build read in its profile prompts (the manifest's train_profile_values; the export
# lists them and its chat template refuses others).
PROFILE_COUNT = "profile:"
PROFILE_COMBINATION = "profile combination:"  # + the example's {key: value} of every profile key, as JSON
# Of the truncated examples: mid_turn, those whose prompt opens inside a turn (cut by tokens); turns_dropped,
# those that lost whole turns (--truncation turns), and system_dropped, those of them that lost a system
# message from inside the conversation with those turns; reply_cut, those whose reply lost its end (trained
# without its end-of-turn token); of system_cut, system_left_out, those that left their opening system message
# out whole (over half of the prompt's share: keep_system, turns).
STAT_KEYS = ("examples", "tokens", "target_tokens", "trained_replies", "untrained", "truncated", "system_cut",
             "system_left_out", "mid_turn", "turns_dropped", "system_dropped", "reply_cut", "source_system_prompts",
             "system_turns_in_history")


def build_weights(run: Path, overrides: dict[str, Any]) -> tuple[WeightOptions, str]:
    """The weight options a build uses, and where they came from: the run's bucket scheme (named in
    RUN/data/manifest.json) with `overrides` applied, or a preset when `overrides` names one."""
    if "preset" in overrides:
        others = sorted(set(overrides) - {"preset"})
        return (weight_options(overrides, "build weights"),
                f"preset {overrides['preset']}" + (f", overridden: {', '.join(others)}" if others else ""))
    base, source = WEIGHT_PRESETS["default"], "preset default (the run's scheme file was not found)"
    manifest = Path(run) / "data" / "manifest.json"
    if manifest.is_file():
        recorded = prepare_manifest(manifest.parent)
        # the scheme the records were bucketed by, as prepare read it (the file may have changed since); an
        # earlier release's manifest whose scheme file is gone leaves the default
        with contextlib.suppress(ConfigError):
            base, source = (prepared_scheme(recorded, manifest)[0].weights,
                            f"scheme {recorded['scheme'].get('path')}")
    options = weight_options({**asdict(base), **overrides}, "build weights")
    return options, source + (f", overridden: {', '.join(sorted(overrides))}" if overrides else "")


def dataset_dir(run) -> epath.Path:
    return as_path(run) / BUILD_DIR / DATASET_NAME / DATASET_VERSION


class _RunDatasetInfo(tfds.core.DatasetInfo):
    """A run's dataset is never on TFDS's public bucket: TFDS would look there, which it cannot, after
    making a temporary folder it never removes (one empty /tmp/tmp*tfds a build)."""

    def initialize_from_bucket(self) -> None:
        pass


@functools.cache  # TFDS registers builder classes by name: define it once per process
def _builder_class():
    class SftExamples(tfds.core.GeneratorBasedBuilder):
        """Tokenised SFT examples of one polyalign run. `split_examples` gives each split's examples: a
        generator function on one machine, or a function of the Beam pipeline returning a PCollection."""

        VERSION = tfds.core.Version(DATASET_VERSION)

        def __init__(self, *, split_examples, on_pipeline_result=None, **kwargs):
            self._split_examples = split_examples
            self._on_pipeline_result = on_pipeline_result
            super().__init__(**kwargs)

        def _info(self):
            features = tfds.features.FeaturesDict({
                "input_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                "loss_mask": tfds.features.Tensor(shape=(None,), dtype=np.uint8),
                "weight": np.float32,
                "bucket": np.int32,
                "id": tfds.features.Text(),
            })
            # TFDS stores examples in the order of a salted hash of their key (the record id), on one
            # machine and in Beam alike, so both engines write the same files. Training shuffles again
            # at read time, from the training seed.
            return _RunDatasetInfo(builder=self, features=features)

        def _split_generators(self, dl_manager):
            return {split: examples() for split, examples in self._split_examples.items()}

        def _generate_examples(self):
            raise NotImplementedError  # splits come from _split_generators

        def _process_pipeline_result(self, pipeline_result):
            if self._on_pipeline_result is not None:
                self._on_pipeline_result(pipeline_result)

    SftExamples.name = DATASET_NAME
    return SftExamples


@functools.cache
def _beam_builder_class():
    class BeamSftExamples(_builder_class(), skip_registration=True):
        """The same dataset, its splits made by a Beam pipeline that TFDS runs and writes from."""

        def _split_generators(self, dl_manager, pipeline):
            return self._split_examples(pipeline)

    BeamSftExamples.name = DATASET_NAME
    return BeamSftExamples


def check_options(options: BuildOptions) -> None:
    if options.profile not in PROFILE_MODES:
        raise ConfigError(f"profile must be one of {', '.join(PROFILE_MODES)}, got {options.profile!r}")
    if options.system not in SYSTEM_MODES:
        raise ConfigError(f"system must be one of {', '.join(SYSTEM_MODES)}, got {options.system!r}")
    if options.train_on not in TRAIN_ON:
        raise ConfigError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {options.train_on!r}")
    if options.truncation not in TRUNCATIONS:
        raise ConfigError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {options.truncation!r}")
    if options.max_length < 8:
        raise ConfigError(f"max_length {options.max_length} is too short for a chat template")


def tokenizer_digests(run: Path, tokenizer_path: Path, own_template: bool = False) -> dict[str, str | None]:
    """Digests of the tokenizer files a build encoded with (those of the folder load_tokenizer reads, a
    tokenizer given as its file included), named relative to RUN when they lie inside it, so that training
    refuses a build whose tokenizer was trained again since. With `own_template` (the build rendered with
    the folder's own chat template) the template's files too: chat_template.jinja, which transformers and
    polyalign read before the config's template, is recorded as None when absent, so that one added later
    counts as a change, and one removed (the config's template back) counts too."""
    tokenizer_path = Path(tokenizer_path)
    if is_uri(tokenizer_path):
        return {}
    folder = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    # a folder: whichever of its files are there; a file: it, and the config load_tokenizer reads beside it
    files = ([folder / name for name in (TOKENIZERS_FILE, SENTENCEPIECE_FILE) if (folder / name).is_file()]
             if tokenizer_path.is_dir() else [tokenizer_path])
    files += [folder / TOKENIZER_CONFIG] if (folder / TOKENIZER_CONFIG).is_file() else []
    if own_template:
        files.append(folder / CHAT_TEMPLATE_FILE)
    digests = {}
    for path in files:
        try:
            name = str(path.resolve().relative_to(Path(run).resolve()))
        except ValueError:
            name = str(path.resolve())
        digests[name] = file_digest(path) if path.is_file() else None
    return digests


def tokenizer_and_template(run: Path, options: BuildOptions):
    tokenizer_path = Path(options.tokenizer) if options.tokenizer else Path(run) / "tokenizer"
    tokenizer = load_tokenizer(tokenizer_path)
    template_name = choose_template(tokenizer, options.template, checkpoint_family(tokenizer_path),
                                    str(tokenizer_path))
    return tokenizer_path, tokenizer, template_name


def stale_tokenizer(run: Path, tokenizer_path: Path) -> str | None:
    """A warning when the tokenizer `tokenizer train` made for this run (its tokenizer_report.json) was
    trained on another train split than RUN/data holds now: prepare ran again since. Its ids still encode
    the data; they were fitted to other text."""
    report = read_report(tokenizer_path)
    try:
        made_from, trained_on = report["made_from"]["records"], Path(report["settings"]["records"])
    except (KeyError, TypeError):  # no report: a checkpoint's tokenizer, or one not polyalign's
        return None
    try:
        files = split_files(run, "train")
    except ConfigError:
        return None
    run_paths = {Path(run).resolve(), (Path(run) / "data").resolve(), *(path.resolve() for path in files)}
    if trained_on not in run_paths:  # trained on records of the user's choosing: theirs to keep current
        return None
    now = files_digest(files)
    if made_from == now or type(made_from) is not type(now):  # another layout: its digests do not compare
        return None
    return (f"{tokenizer_path} was trained on another train split than {Path(run) / 'data'} holds now (prepare ran "
            f"again since it was made): its ids still encode the data, fitted to other text; rerun `polyalign "
            f"tokenizer train --records {run} --out {tokenizer_path} --overwrite ...` to fit it to this split")


@dataclass(frozen=True)
class BucketTable:
    """Bucket-SFT weights from train counts and the bucket index over train and val."""

    train_counts: dict[str, int]
    weights: dict[str, float]
    index: dict[str, int]
    options: WeightOptions
    source: str  # where the options came from (the scheme, a preset)

    @classmethod
    def from_counts(cls, train_counts: dict[str, int], buckets: set[str], options: WeightOptions,
                    source: str = "") -> BucketTable:
        return cls(dict(sorted(train_counts.items())), bucket_weights(train_counts, options),
                   {b: i for i, b in enumerate(sorted(buckets))}, options, source)

    def weight(self, bucket: str) -> float:
        return self.weights.get(bucket, 1.0)  # buckets absent from train (val-only) count as 1


def encode_for_build(record: Record, tokenizer, template, options: BuildOptions) -> tuple[list, Encoded]:
    """A record's messages and its example's ids, mask and cut, as `options` build it."""
    messages = record_messages(record, options.profile, system=options.system)
    try:
        return messages, encode_conversation(template, tokenizer, messages, train_on=options.train_on,
                                             cutoff=options.max_length, truncation=options.truncation)
    except ChatTemplateError as error:  # a template problem shows on the first record; say which one
        raise ChatTemplateError(f"record {record.id} ({record.split}): {error}") from None


def encode_record(record: Record, tokenizer, template, options: BuildOptions, table: BucketTable
                  ) -> tuple[str, dict[str, Any], Counter]:
    """(key, example, counts) for one record."""
    messages, encoded = encode_for_build(record, tokenizer, template, options)
    mask = np.asarray(encoded.loss_mask, bool)
    # replies with loss in this example: one with --train-on last, every assistant turn left after the cut with all
    trained_replies = int(mask[0]) + int(np.count_nonzero(mask[1:] & ~mask[:-1])) if mask.size else 0
    counts = Counter(examples=1, tokens=len(encoded.ids), target_tokens=int(encoded.loss_mask.sum()),
                     trained_replies=trained_replies, untrained=int(not mask.any()),
                     truncated=int(encoded.truncated), system_cut=int(encoded.system_cut),
                     mid_turn=int(encoded.mid_turn), turns_dropped=int(encoded.turns_dropped > 0),
                     system_dropped=int(encoded.system_dropped > 0), system_left_out=int(encoded.system_left_out),
                     reply_cut=int(encoded.reply_cut),
                     source_system_prompts=int(source_system(record) is not None),
                     system_turns_in_history=sum(m.role == "system" for m in messages[1:]))
    counts.update(f"{PROFILE_COUNT}{key}={getattr(record, field)}" for key, field in PROFILE_FIELDS.items())
    counts[PROFILE_COMBINATION + json.dumps({key: getattr(record, field) for key, field in PROFILE_FIELDS.items()},
                                            ensure_ascii=False, sort_keys=True)] += 1
    return record.id, {
        "input_ids": encoded.ids,
        "loss_mask": encoded.loss_mask.astype(np.uint8),
        "weight": np.float32(table.weight(record.bucket_id)),
        "bucket": np.int32(table.index[record.bucket_id]),
        "id": record.id,
    }, counts


def write_dataset(run: Path, split_examples, download_config=None, on_pipeline_result=None) -> None:
    """Writes RUN/build/sft_examples; with a download_config, `split_examples` is a function of the Beam
    pipeline that TFDS creates from it."""
    out = Path(run) / BUILD_DIR
    if dataset_dir(run).exists():
        shutil.rmtree(dataset_dir(run))  # a rebuild replaces the dataset; TFDS would keep the old one

    tfds.disable_progress_bar()  # ours counts records; TFDS's would count its own phases
    builder_class = _builder_class() if download_config is None else _beam_builder_class()
    builder = builder_class(split_examples=split_examples, on_pipeline_result=on_pipeline_result,
                               data_dir=str(out), file_format="array_record")
    with contextlib.redirect_stdout(io.StringIO()):  # TFDS prints download notices that do not apply
        builder.download_and_prepare(download_config=download_config)


def write_manifest(run: Path, tokenizer_path: Path, tokenizer, template_name: str, options: BuildOptions,
                   table: BucketTable, stats: dict[str, Counter], seconds: float,
                   engine: dict[str, Any] | None = None, warnings: Sequence[str] = (),
                   tokenizer_check: dict[str, Any] | None = None) -> dict[str, Any]:
    manifest = {
        "dataset": str(dataset_dir(run)),
        "tokenizer": str(tokenizer_path.resolve()),
        # transformers' reading of the tokenizer against polyalign's on probe records (model/tokenizer_check.py)
        "tokenizer_check": tokenizer_check or {"checked": False, "reason": "not checked"},
        "vocab_size": tokenizer.vocab_size,
        "pad_id": tokenizer.pad_id,
        "template": template_name,
        "options": {**asdict(options), "tokenizer": str(tokenizer_path)},
        **({"engine": engine} if engine else {}),
        "buckets": list(table.index),
        "bucket_weights": {b: table.weight(b) for b in table.index},
        "weight_options": {**asdict(table.options), "source": table.source},
        "train_bucket_counts": table.train_counts,
        "warnings": [*warnings, *untrained_warnings(stats, options.max_length)],
        "splits": {split: {k: stats[split][k] for k in STAT_KEYS} for split in SPLITS},
        "train_profile_values": {**profile_value_counts(stats["train"]),
                                 PROFILE_COMBINATIONS: profile_combination_counts(stats["train"])},
        "settings": asdict(options),
        "made_from": {PREPARE_MANIFEST: file_digest(as_path(run) / PREPARE_MANIFEST),
                      **tokenizer_digests(run, tokenizer_path, own_template=template_name == CHECKPOINT_TEMPLATE)},
        "seconds": round(seconds, 2),
    }
    (Path(run) / BUILD_DIR / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def profile_value_counts(counts: Counter) -> dict[str, dict[str, int]]:
    """{profile key: {value: examples}} from a split's PROFILE_COUNT counters."""
    values: dict[str, dict[str, int]] = {key: {} for key in PROFILE_FIELDS}
    for name, count in sorted(counts.items()):
        if name.startswith(PROFILE_COUNT):
            key, value = name[len(PROFILE_COUNT):].split("=", 1)
            values[key][value] = count
    return values


def profile_combination_counts(counts: Counter) -> list[dict[str, Any]]:
    """[{profile key: value, ..., "examples": n}] from a split's PROFILE_COMBINATION counters, most common first."""
    found = [{**json.loads(name[len(PROFILE_COMBINATION):]), "examples": count}
             for name, count in counts.items() if name.startswith(PROFILE_COMBINATION)]
    return sorted(found, key=lambda c: (-c["examples"], [c[key] for key in PROFILE_FIELDS]))


def untrained_warnings(stats: dict[str, Counter], max_length: int) -> list[str]:
    """A split with examples that keep no trained token (at a very short --max-length the prompt's share
    leaves the reply none): they cost a row each and teach nothing."""
    return [f"{stats[split]['untrained']} of {stats[split]['examples']} {split} examples keep no token to train on "
            f"at --max-length {max_length} (their reply was cut away); a longer --max-length keeps them"
            for split in SPLITS if stats[split]["untrained"]]


def split_bucket_counts(run: Path, split: str) -> Counter | None:
    """Records per bucket in a prepared split; None when the split is missing."""
    try:
        files = split_files(run, split)
    except ConfigError:
        return None
    return Counter(r.bucket_id for path in files for r in read_records(path))


def claim_build(run: Path, options: BuildOptions, overwrite: bool):
    """RUN/build may be written when it is new, was built with the same options (a rebuild after
    prepare ran again, or the same command after an interrupted build), or `overwrite`; the context to
    hold while writing it."""
    out = Path(run) / BUILD_DIR
    # a second tokenizer (another base model) on the same prepared data: a RUN of its own that reads the
    # same RUN/data, which build and training only read
    other = Path(f"{Path(run).resolve()}-2")
    # the command with this build's options, its tokenizer named: the new RUN has no tokenizer/ of its own
    tokenizer = options.tokenizer or str(Path(run).resolve() / "tokenizer")
    command = rebuild_command(other, {"settings": {**asdict(options), "tokenizer": tokenizer}})
    elsewhere = (f"build into a RUN of its own beside it: mkdir {shlex.quote(str(other))} && ln -s "
                 f"{shlex.quote(str(Path(run).resolve() / 'data'))} {shlex.quote(str(other / 'data'))}, then "
                 f"{command} (and polyalign stats on it where HDPO needs them)")
    return stage_output(out, out / "manifest.json", asdict(options), overwrite,
                        ours=[out / "manifest.json", out / DATASET_NAME], elsewhere=elsewhere,
                        paths=["tokenizer"], legacy=LEGACY_SETTINGS)


def build(run: Path, options: BuildOptions = BuildOptions(), progress: bool = True,
          overwrite: bool = False) -> dict[str, Any]:
    """Builds RUN/build/sft_examples from RUN/data/{train,val}.jsonl on this machine; returns the manifest
    (also written to RUN/build/manifest.json). polyalign.beam.build does the same as a Beam pipeline.
    A build made with other options is not replaced unless `overwrite`."""
    require_records(run)
    if (kept := kept_build(run, options, overwrite)) is not None:
        return kept
    with claim_build(run, options, overwrite):
        return _build(Path(run), options, progress)


def kept_build(run: Path, options: BuildOptions, overwrite: bool) -> dict[str, Any] | None:
    """The manifest of RUN/build where it already holds this very build (the same options, made from the
    data and the tokenizer as they are now), kept and said so instead of built again (23 s for the same
    examples), unless `overwrite`; else None, saying which of its inputs changed where the options are the
    same (a tokenizer trained again into the same folder was rebuilt from without a word)."""
    try:
        manifest = json.loads((Path(run) / BUILD_DIR / "manifest.json").read_text())
    except (OSError, ValueError):  # no build yet, or an interrupted one
        return None
    made_from = manifest.get("made_from") if isinstance(manifest, dict) else None
    if manifest.get("settings") != asdict(options) or not isinstance(made_from, dict):
        return None
    changed = changed_since(run, made_from)
    if changed:
        print(f"note: {Path(run) / BUILD_DIR} was built with the same options from other contents of "
              f"{', '.join(changed)}; building it again from them as they are now", file=sys.stderr)
        return None
    if overwrite:
        return None
    print(f"note: {Path(run) / BUILD_DIR} already holds this build (the same options, from the data and the tokenizer "
          "as they are now): kept (--overwrite builds it again)", file=sys.stderr)
    return manifest


def _build(run: Path, options: BuildOptions, progress: bool) -> dict[str, Any]:
    started = time.perf_counter()
    check_options(options)
    records = {split: [r for path in split_files(run, split) for r in read_records(path)] for split in SPLITS}
    repeated = repeated_ids(run, records)
    tokenizer_path, tokenizer, template_name = tokenizer_and_template(run, options)
    template = get_template(template_name, tokenizer)
    train_counts = Counter(r.bucket_id for r in records["train"])
    table = BucketTable.from_counts(train_counts, {r.bucket_id for split in SPLITS for r in records[split]},
                                    *build_weights(run, options.weights))
    warnings = weight_warnings(table.weights, train_counts, Counter(r.bucket_id for r in records["val"]),
                               split_bucket_counts(run, "test"), table.options.warn_above)
    warnings += [stale] if (stale := stale_tokenizer(run, tokenizer_path)) else []
    warnings += repeated
    stats = {split: Counter() for split in SPLITS}

    def examples(split):
        def generate():
            bar = progress_bar(records[split], progress=progress, desc=f"build {split}", unit="rec", leave=False)
            for record in bar:
                check_interrupted()
                key, example, counts = encode_record(record, tokenizer, template, options, table)
                stats[split].update(counts)
                yield key, example

        return generate

    check, mismatch = check_tokenizer(tokenizer, template, options.profile, probe_records(run, PROBE_RECORDS),
                                      str(tokenizer_path))
    write_dataset(run, {s: examples(s) for s in SPLITS})
    return write_manifest(run, tokenizer_path, tokenizer, template_name, options, table, stats,
                          time.perf_counter() - started, warnings=[*warnings, *[mismatch] * bool(mismatch)],
                          tokenizer_check=check)


def repeated_ids(run, records: dict[str, list[Record]]) -> list[str]:
    """A record id twice in one split (a row copied by hand) would be two examples of one key, which TFDS
    stops on with a traceback naming no file: refused, naming both lines. One in both splits (val.jsonl made
    from train.jsonl, say) builds, with a warning: validation then measures records training saw."""
    for split in SPLITS:
        ids = Counter(r.id for r in records[split])
        repeated = next((record_id for record_id, n in ids.items() if n > 1), None)
        if repeated is None:
            continue
        where = [f"{path}:{number}" for path in split_files(run, split)
                 for number, line in enumerate(as_path(path).read_text(encoding="utf-8").split("\n"), start=1)
                 if line.strip() and jsonl.parse(line).get("id") == repeated]
        others = sum(n > 1 for n in ids.values()) - 1
        also = " (another id repeats too)" if others == 1 else f" ({others} other ids repeat too)" if others else ""
        raise InputError(f"{where[0]}: record id {repeated!r} again at {', '.join(where[1:])}{also}; each record is "
                         "one example: remove the copies (an edit by hand?), or run `polyalign prepare` again")
    trained = {r.id for r in records["train"]}
    shared = sum(r.id in trained for r in records["val"])
    return [shared_warning(shared, len(records["val"]))] if shared else []


def shared_warning(shared: int, val: int) -> str:
    return f"{shared} of the {val} val records are train records too (the same ids): validation measures them as " \
           "trained on"


def require_records(run) -> None:
    """Training needs examples to train on and to validate on: an empty split is one line naming it,
    before anything is written (TFDS would stop half way with its own assertion)."""
    kept = prepare_manifest(as_path(run) / "data").get("totals", {}).get("by_split", {})
    empty = [split for split in SPLITS if not _has_records(run, split)]
    changed = [f"{split}.jsonl ({kept[split]} then)" for split in empty if kept.get(split)]
    if changed:  # emptied since: prepare's manifest counts what it wrote there
        raise InputError(f"{as_path(run) / 'data'}: no records in {', '.join(changed)}, which prepare wrote with "
                         "records: the files changed since; run `polyalign prepare` again")
    if empty:
        raise InputError(f"{as_path(run) / 'data'}: no {' and no '.join(empty)} records; build makes the training "
                         "and validation examples, and prepare put none there (give it a source with `split: "
                         f"{empty[0]}`, or `split: auto` sources a share: `polyalign prepare ... "
                         f"split.weights.{empty[0]}=0.05`; the manifest there counts every row)")


def _has_records(run, split: str) -> bool:
    for path in split_files(run, split):
        with as_path(path).open(encoding="utf-8") as lines:
            if any(line.strip() for line in lines):
                return True
    return False
