"""`polyalign prepare`: native corpora -> normalised, bucketed, deduplicated, group-safe splits + manifest.

Every record the rows read make is accounted for: kept in a split, or dropped with a reason (malformed
rows that went to quarantine, rows the format excludes, languages outside the scheme, duplicates). The
manifest states `records = kept + sum(dropped)` per source, and prepare checks it before writing.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import json
import math
import os
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from polyalign.core.errors import PolyalignError, PrepareError
from polyalign.core.outputs import no_empty_folder_left, settings_record, stage_output
from polyalign.core.paths import file_digest
from polyalign.core.progress import progress_bar
from polyalign.core.ranges import SEED
from polyalign.core.version import polyalign_version
from polyalign.core.yaml_config import (
    ConfigError,
    apply_overrides,
    blamed_on_override,
    from_mapping,
    load_yaml,
    out_of_range,
    setting,
)
from polyalign.data.bucketing import LABEL_FIELDS, Scheme, load_scheme
from polyalign.data.dedup import (
    EXACT_DUPLICATES_FILE,
    NearDuplicateOptions,
    count_kinds,
    duplicate_row,
    exact_dedup,
    near_duplicate_problem,
    near_duplicates,
)
from polyalign.data.importers import get_format, read_source
from polyalign.data.importers.reading import source_files, unread_files
from polyalign.data.language import OTHER, LanguageChooser, contradicting_script
from polyalign.data.layout import (
    OUTPUT_STEMS,
    clear_outputs,
    file_label,
    file_names,
    owned_files,
    recorded_files,
    refuse_other_stages_folder,
    refuse_sources_inside,
    stale_note,
)
from polyalign.data.records import (
    AFTER_QUESTION,
    PROFILE_PREAMBLE,
    SPLITS,
    Example,
    InputError,
    Location,
    Malformed,
    Notice,
    Record,
    RowProblem,
    Skipped,
    after_question,
    before_question,
)
from polyalign.data.splits import DEFAULT_SPLIT_WEIGHTS, hash_split, protected_splits
from polyalign.data.text import LENGTH_UNIT_PATTERNS, length_units, normalize, repaired_encoding

ON_ERROR_MODES = ("fail", "quarantine")
SOURCE_SPLITS = (*SPLITS, "auto")
# Families in which an empty response is a real answer (an unanswerable QA question) and is kept.
EMPTY_ANSWER_FAMILIES = ("qa",)
AGREEMENT_FIELDS = ("language", *LABEL_FIELDS, "length_bin", "bucket_id")
# A row's own language label outside the scheme is a language the user keeps out (dropped, counted) when
# it is an ISO 639 code in any case, as BCP 47 tags are (fr, FR, yue, zh-Latn); anything else ("english")
# is a mistake in the row.
LANGUAGE_CODE = re.compile(r"^[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})*$")
# The scripts each scheme language is written in: METHOD counts Traditional Chinese as zh, so zh-Hant and the
# regions written in it (zh-TW, zh-HK) are zh; a tag naming another script (zh-Latn, pinyin; en-Dsrt) is
# another language here.
SCHEME_SCRIPTS = {"zh": {"hans", "hant"}, "en": {"latn"}}


def scheme_language(tag: str, scheme_languages) -> str:
    """A BCP 47 tag, in any case, as the scheme's language it names: zh-CN, zh_SG, zh-Hans-CN, zh-TW, zh-Hant,
    EN and en-US are zh and en (a region, or a script the language is written in, does not make another
    language); zh-Latn or a language the scheme lacks stays as it is, its language subtag in lower case (left
    out as language_not_in_scheme, counted)."""
    primary, *rest = re.split(r"[-_]", tag)
    lowered = primary.lower() + tag[len(primary):]
    if primary.lower() not in scheme_languages or lowered in scheme_languages:
        return lowered
    scripts = SCHEME_SCRIPTS.get(primary.lower(), set())
    if all(re.fullmatch(r"[A-Za-z]{2}|\d{3}", part) or part.lower() in scripts for part in rest):
        return primary.lower()
    return lowered


@dataclass(frozen=True)
class SourceConfig:
    name: str
    format: str
    path: str
    split: str = "auto"
    language: str | None = None
    track: str | None = None
    family: str | None = None
    style: str | None = None
    # mojibake repaired (data/text.py repaired_encoding); unset or false: counted and marked, kept as read
    fix_encoding: bool | None = None


@dataclass(frozen=True)
class SplitOptions:
    seed: int = setting(42, range=SEED)
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SPLIT_WEIGHTS))


@dataclass(frozen=True)
class DataConfig:
    scheme: str
    sources: list[SourceConfig]
    length_unit: str | None = None
    dedup: bool = True
    near_dedup: NearDuplicateOptions = field(default_factory=NearDuplicateOptions)
    split: SplitOptions = field(default_factory=SplitOptions)


def missing_keys(raw: dict[str, Any]) -> list[str]:
    """Every required key an incomplete data config lacks, so that one error names them all, each with
    the key written in its place when one looks like a misspelling of it (`fromat` for `format`)."""
    top = [f.name for f in fields(DataConfig)]
    missing = [] if "scheme" in raw else [
        "scheme (a bucket scheme file, or `polyalign` for the one polyalign ships)" + _misspelt("scheme", raw, top)]
    sources = raw.get("sources")
    if sources is not None and not isinstance(sources, list):  # a mapping or a number: there, but not a list
        return missing + [f"sources as a list of {{name, format, path}} (it is a {type(sources).__name__}: "
                          "write each source as a `- name: ...` item)"]
    if not sources:
        return missing + ["sources (a list of {name, format, path})" + _misspelt("sources", raw, top)]
    known = [f.name for f in fields(SourceConfig)]
    for i, source in enumerate(sources):
        if isinstance(source, dict):
            missing += [f"sources[{i}].{key}{_misspelt(key, source, known)}" for key in ("name", "format", "path")
                        if key not in source]
    return missing


def _misspelt(key: str, given: dict[str, Any], known: Sequence[str]) -> str:
    """` ('fromat' there: a misspelling of format?)` when a key of `given` that is no known key is close to
    `key`; "" otherwise."""
    unknown = [k for k in given if isinstance(k, str) and k not in known]
    close = difflib.get_close_matches(key, unknown, n=1, cutoff=0.7)
    return f" ({close[0]!r} there: a misspelling of {key}?)" if close else ""


PACKAGED_SCHEMES = Path(__file__).resolve().parents[1] / "buckets"


def scheme_path(scheme: str, base: Path) -> Path:
    """A scheme given by name (`polyalign`: the scheme shipped in the package, polyalign/buckets/) or
    as a path, relative to the config's folder."""
    packaged = PACKAGED_SCHEMES / f"{scheme}.yaml"
    named = "/" not in scheme and not scheme.endswith((".yaml", ".yml"))
    if named and packaged.is_file():
        return packaged
    path = resolve(scheme, base)
    if not path.is_file():
        shipped = sorted(p.stem for p in PACKAGED_SCHEMES.glob("*.yaml"))
        close = difflib.get_close_matches(scheme, shipped, n=1) if named else []
        raise ConfigError(f"scheme: {scheme!r} is neither a scheme shipped with polyalign ({', '.join(shipped)}) nor "
                          f"a file ({path} {'is a folder' if path.is_dir() else 'does not exist'})"
                          + (f"; did you mean {close[0]!r}?" if close else ""))
    return path


def load_data_config(path: Path, overrides: Iterable[str] = ()) -> tuple[DataConfig, dict[str, Any]]:
    overrides = list(overrides)
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with 'scheme' and 'sources'")
    apply_overrides(raw, list(overrides), schema=DataConfig)
    if missing := missing_keys(raw):
        raise ConfigError(f"{path}: missing {'; '.join(missing)}")
    try:
        config = from_mapping(DataConfig, raw, str(path))
    except ConfigError as err:  # a key an override set is the override's, not the file's
        raise blamed_on_override(err, str(path), overrides) from None
    if not config.sources:
        raise ConfigError(f"{path}: 'sources' is empty")
    if config.length_unit is not None and config.length_unit not in LENGTH_UNIT_PATTERNS:
        raise ConfigError(f"{path}: length_unit must be one of {sorted(LENGTH_UNIT_PATTERNS)}")
    where = f"{path}{' with the overrides ' + ' '.join(overrides) if overrides else ''}"
    for k, source in enumerate(config.sources):  # "" would read the config's own folder as the source
        if not str(source.path).strip():
            raise ConfigError(f"{where}: sources[{k}] ({source.name}): path is empty")
    lsh = near_duplicate_problem(config.near_dedup) if config.near_dedup.enabled else None
    problem = out_of_range(config, where) or (lsh and f"{where}: {lsh}")
    if problem:  # before any row is read: a bad near_dedup setting failed only after the whole import
        raise ConfigError(problem)
    for name, value in config.split.weights.items():
        if name not in SPLITS:
            raise ConfigError(f"{where}: split.weights.{name}: no such split (train, val, test)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{where}: split.weights.{name} must be a finite number >= 0, got {value!r}")
    total = sum(config.split.weights.values())
    if total <= 0:
        raise ConfigError(f"{where}: split.weights are all 0; give at least one split a positive weight")
    if abs(total - 1.0) > 1e-9:
        shares = ", ".join(f"{name} {config.split.weights.get(name, 0) / total:.1%}" for name in SPLITS)
        # relative weights are fine (docs/data.md): said as the shares they give, an override's effect seen
        print(f"note: split.weights are shares of their sum ({total:g}): {shares}")
    return config, raw


def resolve(path: str, base: Path) -> Path:
    """A config's path, relative to the config file's folder, made absolute and normalised: records name their
    source file alike wherever prepare runs from (`cfg/../data/x.jsonl` from one folder, `data/x.jsonl` from
    another would make other bytes of the same records)."""
    candidate = Path(path).expanduser()
    return Path(os.path.abspath(candidate if candidate.is_absolute() else base / candidate))


@dataclass
class SourceTally:
    config: SourceConfig
    files: list[str] = field(default_factory=list)
    # files in the source's folder its format does not read (paths inside the folder): said, never skipped unseen
    unread_files: list[str] = field(default_factory=list)
    read: int = 0  # source rows: JSONL lines, array elements, dialogues, SQuAD questions
    records: int = 0  # the candidate records those rows became (kept + dropped)
    last_location: Any = field(default=None, repr=False, compare=False)
    dropped: Counter = field(default_factory=Counter)
    kept_by_split: Counter = field(default_factory=Counter)
    dropped_by_split: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    empty_responses: int = 0
    detected_languages: Counter = field(default_factory=Counter)
    language_mismatches: Counter = field(default_factory=Counter)
    system_messages: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)
    # records whose track, family or style is the format's default: no row, config or scheme entry named it
    label_defaults: Counter = field(default_factory=Counter)
    # records that open a multi-turn conversation with track `single` read off it (no label named it)
    opening_replies: int = 0
    # records with mojibake in a text (repaired where the source says fix_encoding), and of those repaired, the
    # ones still holding U+FFFD: characters lost before polyalign read them (decoded with errors="replace")
    mojibake: int = 0
    mojibake_lost: int = 0
    # keys of the source's rows its importer does not read, by how many records' rows held them
    unread_keys: Counter = field(default_factory=Counter)
    # (file, "id" or "record key", its value) -> where the first row that had it is: a later row of the file
    # with it again repeats an id, a problem of that row (quarantined under --on-error quarantine)
    keys_seen: dict[tuple[str, str, str], Location] = field(default_factory=dict, repr=False, compare=False)
    repeating_rows: dict[Location, str] = field(default_factory=dict, repr=False, compare=False)

    def drop(self, reason: str, split: str | None = None) -> None:
        self.dropped[reason] += 1
        if split is not None:
            self.dropped_by_split[split][reason] += 1

    def to_json(self) -> dict[str, Any]:
        kept = sum(self.kept_by_split.values())
        return {
            **{k: v for k, v in asdict(self.config).items() if v is not None},
            "files": self.files,
            **({"unread_files": self.unread_files} if self.unread_files else {}),
            "read": self.read,
            "records": self.records,
            "kept": kept,
            "dropped": dict(sorted(self.dropped.items())),
            "kept_by_split": {s: self.kept_by_split[s] for s in SPLITS},
            "dropped_by_split": {s: dict(sorted(c.items())) for s, c in sorted(self.dropped_by_split.items())},
            "empty_responses": self.empty_responses,
            **({"detected_languages": dict(self.detected_languages)} if self.detected_languages else {}),
            **({"language_mismatches": dict(sorted(self.language_mismatches.items()))}
               if self.language_mismatches else {}),
            **({"system_messages": dict(sorted(self.system_messages.items()))} if self.system_messages else {}),
            **({"left_out": dict(sorted(self.notes.items()))} if self.notes else {}),
            **({"label_defaults": dict(sorted(self.label_defaults.items()))} if self.label_defaults else {}),
            **({"opening_replies": self.opening_replies} if self.opening_replies else {}),
            **({"mojibake": self.mojibake} if self.mojibake else {}),
            **({"mojibake_lost": self.mojibake_lost} if self.mojibake_lost else {}),
            **({"unread_keys": dict(sorted(self.unread_keys.items()))} if self.unread_keys else {}),
        }


def dropped_row(source: str, location: Any, reason: str, response: str | None = None) -> dict[str, Any]:
    """A row of RUN/data/dropped.jsonl: a well-formed row prepare left out, where it is and why; for a reply
    of a conversation (one line, many replies), the start of the reply it left out."""
    row = {"source": source, "location": str(location), "where": location.to_json(), "reason": reason}
    return row if response is None else {**row, "response": response[:DROPPED_RESPONSE_CHARS]}


DROPPED_RESPONSE_CHARS = 80


class DroppedRows:
    """Every well-formed row prepare leaves out (the manifest counts them by reason), one line each in
    dropped.jsonl: where it is and why. Malformed rows go to quarantine.jsonl (or stop the run)."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = path.open("w", encoding="utf-8")

    def __call__(self, row: dict[str, Any]) -> None:
        self.handle.write(json.dumps(row, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.handle.close()


def quarantine_row(source: str, malformed: Malformed) -> dict[str, Any]:
    return {"source": source, "location": str(malformed.location), "where": malformed.location.to_json(),
            "problem": malformed.problem, "raw": malformed.raw}


class ErrorSink:
    """Malformed rows: stop the run (`fail`) or append them to quarantine.jsonl with their reason."""

    def __init__(self, mode: str, path: Path):
        if mode not in ON_ERROR_MODES:
            raise ConfigError(f"--on-error must be one of {', '.join(ON_ERROR_MODES)}, got {mode!r}")
        self.mode, self.path, self.count = mode, path, 0
        self.handle = path.open("w", encoding="utf-8") if mode == "quarantine" else None

    def __call__(self, source: str, malformed: Malformed) -> None:
        if self.handle is None:
            raise PrepareError(f"{malformed.location}: {malformed.problem}")
        self.count += 1
        self.handle.write(json.dumps(quarantine_row(source, malformed), ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


class RecordBuilder:
    """Turns an importer Example into a Record: normalisation, labels by precedence, language, length,
    bucket, split and id."""

    def __init__(self, scheme: Scheme, length_unit: str, split_options: SplitOptions):
        self.scheme, self.length_unit, self.split_options = scheme, length_unit, split_options
        self.languages = LanguageChooser(scheme.values["language"])

    def labels(self, example: Example, source: SourceConfig, tally: SourceTally | None = None) -> dict[str, str]:
        """track/family/style from, in order: the row, the source config, the scheme's entry for the
        source, what the importer read off the conversation (the track), the format's default (counted in
        `tally.label_defaults`: a dialogue corpus imported as `chat` is bucketed as assistant chats unless
        its source says otherwise)."""
        layers = [
            example.labels,
            {k: getattr(source, k) for k in LABEL_FIELDS if getattr(source, k)},
            self.scheme.sources.get(source.name, {}),
            example.derived,
            get_format(source.format).defaults,
        ]
        labels = {}
        for name in LABEL_FIELDS:
            found = next((i for i, layer in enumerate(layers) if layer.get(name)), None)
            value = None if found is None else layers[found][name]
            if found == len(layers) - 1 and tally is not None:
                tally.label_defaults[name] += 1
            if name == "track" and found is not None and layers[found] is example.derived and value == "single" \
                    and example.opens_conversation and tally is not None and "track" in self.scheme.dimensions:
                # read off the conversation: single, though the dialogue goes on (in another bucket, where the
                # scheme's buckets have a track)
                tally.opening_replies += 1
            if value is None:
                raise RowProblem(
                    f"no {name} for source {source.name!r}: set `{name}:` on the source in the data config "
                    "or carry it in the rows"
                )
            if problem := self.scheme.check_value(name, value):
                raise RowProblem(problem)
            labels[name] = value
        return labels

    @staticmethod
    def system_turns(history: list[dict[str, str]], tally: SourceTally) -> list[dict[str, str]]:
        """The history's system turns, counted: the ones that open it are the record's system prompt
        (`system_prompt`); later ones stay where they stand (`system_turn_in_history`, or
        `system_turn_before_reply` for one between the question and the reply). An opening system
        turn that is polyalign's own profile prompt (the PolyAlign authors' sample carries one on every
        row) is left out (`system_is_profile_prompt`): the profile prompt is written from the record's
        labels when it is rendered, never twice."""
        first = history[0] if history else {}
        if first.get("role") == "system" and not first.get(AFTER_QUESTION) and first["text"].startswith(
                PROFILE_PREAMBLE):
            tally.system_messages["system_is_profile_prompt"] += 1
            history = history[1:]
        before = before_question(history)
        opening = next((i for i, t in enumerate(before) if t["role"] != "system"), len(before))
        if opening:
            tally.system_messages["system_prompt"] += 1
        if any(t["role"] == "system" for t in before[opening:]):
            tally.system_messages["system_turn_in_history"] += 1
        if any(t["role"] == "system" for t in after_question(history)):
            tally.system_messages["system_turn_before_reply"] += 1
        return history

    def split_of(self, example: Example, source: SourceConfig, group: str) -> str:
        if source.split != "auto":
            return source.split
        if example.split is not None:
            return example.split
        return hash_split(group, self.split_options.seed, self.split_options.weights)

    def build(self, key: str, example: Example, source: SourceConfig, tally: SourceTally) -> Record | Skipped:
        tally.unread_keys.update(example.unread_keys)
        texts = [example.question, example.context, example.response, *(t["text"] for t in example.history)]
        repaired = [repaired_encoding(text) for text in texts]
        mojibake = None
        if repaired != texts:
            tally.mojibake += 1
            mojibake = "kept"
            if source.fix_encoding:
                # U+FFFD in a text the repair changed: characters lost before polyalign read them (one elsewhere
                # in the record is no part of this)
                lossy = any("\ufffd" in after for after, before in zip(repaired, texts) if after != before)
                mojibake = "partly repaired" if lossy else "repaired"
                texts = repaired
                tally.mojibake_lost += mojibake == "partly repaired"
        question, context, response, *turns = map(normalize, texts)
        # the whole conversation decides its language: repaired too, where the records' texts are
        conversation = example.conversation
        if source.fix_encoding and conversation:
            conversation = repaired_encoding(conversation)
        history = [{**t, "text": text} for t, text in zip(example.history, turns)]
        history = self.system_turns(history, tally)
        labels = self.labels(example, source, tally)
        declared = example.labels.get("language") or source.language
        scheme_languages = self.scheme.values["language"]
        if example.labels.get("language") not in (None, OTHER, *scheme_languages) and \
                not LANGUAGE_CODE.match(example.labels["language"]):
            raise RowProblem(f"language {example.labels['language']!r} is no language code: the scheme's are "
                             f"{', '.join(scheme_languages)} (a row labelled with another one, e.g. fr, is dropped "
                             "as language_not_in_scheme:fr)")
        language = declared if declared is None else scheme_language(declared, scheme_languages)
        if language is None:
            prompt = "\n".join([context, *(t["text"] for t in history if t["role"] != "system"), question])
            language = self.languages.choose(response, prompt, conversation)
            if language == OTHER and OTHER not in scheme_languages:  # named for the drop reason: what it is
                language = self.languages.outside_name(conversation or f"{prompt}\n{response}")
            tally.detected_languages[language] += 1
        if language not in scheme_languages:
            return Skipped(example.location, f"language_not_in_scheme:{language}")
        if declared is not None and (script := contradicting_script(language, response)) is not None:
            # kept under the declared label (it is the user's), but counted: a mislabelled source
            # would otherwise fill a bucket with another language's answers unnoticed
            tally.language_mismatches[f"{language} declared, {script} script"] += 1
        length = length_units(response, self.length_unit)
        values = {"language": language, **labels, "length_bin": self.scheme.length_bin(length)}
        # Rows without a conversation/passage id are their own group; the declared split is part of the
        # key so that one corpus configured as separate val and test sources keeps them apart.
        group = f"{source.name}:{example.group}" if example.group else f"{source.name}:{source.split}:{key}"
        split = self.split_of(example, source, group)
        meta: dict[str, Any] = {"source_file": example.location.file, "source_row": str(example.location),
                                "group": group}
        if example.labels:
            meta["source_labels"] = dict(example.labels)
        if mojibake:  # which records, for a reader of the files: `grep '"mojibake"' RUN/data/train.jsonl`
            meta["mojibake"] = mojibake
        meta.update(example.meta)
        return Record(
            id=f"{source.name}-{split}-{key}", dataset=source.name, split=split, language=language,
            track=labels["track"], family=labels["family"], style=labels["style"], question=question,
            context=context, history=history, response=response, length_tokens=length,
            length_bin=values["length_bin"], bucket_id=self.scheme.bucket_id(values), meta=meta,
        )


def label_votes(record: Record, labels: dict[str, str], derived: dict[str, str]) -> Iterator[tuple[str, int]]:
    """(field, 1 if polyalign's own value equals the source's label else 0) for each labelled field polyalign
    computes on its own: the length bin and bucket from the response, the track from the conversation
    (`derived`, what the importer read off it). A row's language, family and style labels become the
    record's, so comparing them with the record would always agree: they get no vote."""
    computed = {"length_bin": record.length_bin, "bucket_id": record.bucket_id, **derived}
    for name in AGREEMENT_FIELDS:
        if name in labels and name in computed:
            yield name, int(labels[name] == computed[name])


def unit_votes(record: Record, scheme: Scheme) -> Iterator[tuple[str, str, int]]:
    """(length unit, length_bin or bucket_id, agreement) for a record whose source labels its length bin:
    how well each length unit reproduces the source's own labels."""
    labels = record.meta.get("source_labels", {})
    if "length_bin" not in labels:
        return
    for unit in LENGTH_UNIT_PATTERNS:
        length_bin = scheme.length_bin(length_units(record.response, unit))
        bucket = scheme.bucket_id({"language": record.language, "track": record.track,
                                   "family": record.family, "length_bin": length_bin})
        yield unit, "length_bin", int(length_bin == labels["length_bin"])
        yield unit, "bucket_id", int(bucket == labels.get("bucket_id", bucket))


class AgreementCounts:
    """Agreement tallies per corpus name (one corpus may be configured as several sources, one per split,
    and users compare labels per corpus): label agreement at import, length-unit agreement on kept records."""

    def __init__(self):
        self.labels: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self.units: dict[str, dict[str, dict[str, list[int]]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(lambda: [0, 0])))

    def add_label(self, corpus: str, name: str, agree: int, count: int = 1) -> None:
        self.labels[corpus][name][0] += agree * count
        self.labels[corpus][name][1] += count

    def add_unit(self, corpus: str, unit: str, name: str, agree: int, count: int = 1) -> None:
        self.units[corpus][unit][name][0] += agree * count
        self.units[corpus][unit][name][1] += count

    def to_manifest(self) -> dict[str, Any]:
        return {
            "label_agreement": {corpus: {name: round(a / n, 6) for name, (a, n) in sorted(fields.items())}
                                for corpus, fields in self.labels.items()},
            "label_agreement_counts": {corpus: {name: {"agree": a, "total": n}
                                                for name, (a, n) in sorted(fields.items())}
                                       for corpus, fields in self.labels.items()},
            "length_unit_agreement": {
                corpus: {unit: {name: round(a / n, 6) for name, (a, n) in self.units[corpus][unit].items()}
                         for unit in LENGTH_UNIT_PATTERNS if unit in self.units.get(corpus, {})}
                for corpus in self.labels},
        }


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    count = 0
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


@dataclass(frozen=True)
class PrepareContext:
    """A loaded data config with its scheme and the files of every source, checked before reading."""

    config_path: Path
    config: DataConfig
    raw_config: dict[str, Any]
    scheme: Scheme
    length_unit: str
    source_roots: list[Path]
    source_files: list[list[Path]]

    @property
    def builder(self) -> RecordBuilder:
        return RecordBuilder(self.scheme, self.length_unit, self.config.split)


def source_tallies(context: PrepareContext) -> list[SourceTally]:
    """A tally for each source, with its files and the files of its folder that its format does not read."""
    return [SourceTally(source, files=[str(f) for f in files], unread_files=unread_files(root, files))
            for source, root, files in zip(context.config.sources, context.source_roots, context.source_files)]


def load_context(config_path: Path, overrides: Iterable[str] = ()) -> PrepareContext:
    config_path = Path(config_path)
    config, raw_config = load_data_config(config_path, overrides)
    base = config_path.parent
    try:
        scheme = load_scheme(scheme_path(config.scheme, base))
    except ConfigError as err:
        raise ConfigError(f"{config_path}: {err}" if str(err).startswith("scheme:") else str(err)) from None
    roots = [resolve(source.path, base) for source in config.sources]
    files = _checked_sources(config, roots, config_path, scheme)
    return PrepareContext(config_path, config, raw_config, scheme, config.length_unit or scheme.length_unit,
                          roots, files)


def _checked_sources(config: DataConfig, roots: list[Path], config_path: Path, scheme: Scheme) -> list[list[Path]]:
    """Every source's files, before anything is read; every source's problem (its split, a label value
    the scheme does not allow, its format, its missing files) in one error, a line each, so that a first
    config is fixed in one go (a `language: english` would otherwise drop every row after reading them)."""
    problems, files = [], []
    for i, (source, root) in enumerate(zip(config.sources, roots)):
        where = f"{config_path}: sources[{i}] ({source.name})"
        if source.split not in SOURCE_SPLITS:
            problems.append(f"{where}: split must be one of {', '.join(SOURCE_SPLITS)}")
        for label in ("language", *LABEL_FIELDS):
            value = getattr(source, label)
            if label == "language" and value is not None:  # zh-CN names the scheme's zh, as on a row
                value = scheme_language(value, scheme.values["language"])
            if value is not None and (problem := scheme.check_value(label, value)):
                problems.append(f"{where}: {label}: {problem}")
        try:
            patterns = get_format(source.format).module.PATTERNS
            files.append(source_files(root, patterns))
        except InputError as err:
            problems.append(f"{where}: {err}")
    absent = [root for root in roots if not root.exists()]
    if len(absent) > 1 and len(absent) == len(roots):  # one folder the config expects is not where it looks
        common = top = Path(os.path.commonpath([str(root) for root in absent]))
        while top.parent != top and not top.parent.exists():
            top = top.parent  # the first folder of the way that is missing
        problems.append(f"none of the {len(roots)} sources is there: the paths are relative to {config_path}, so "
                        f"they are read under {common}, and {top} does not exist; put that folder there (a link "
                        f"will do: ln -s /path/to/{top.name} {top}) or change the paths")
    if problems:
        raise ConfigError("\n".join(problems))
    return files


def near_duplicate_report(options: NearDuplicateOptions, pairs: list[tuple[str, str, float]],
                          num_shards: int = 1) -> dict[str, Any]:
    flagged = {train_id for train_id, _, _ in pairs}
    return {
        **asdict(options), "pairs": len(pairs), "train_records": len(flagged),
        "removed": len(flagged) if options.remove else 0, "file": file_label("near_duplicates", num_shards),
        "examples": [{"train_id": a, "test_id": b, "jaccard": s} for a, b, s in pairs[:20]],
    }


def assemble_manifest(context: PrepareContext, on_error: str, tallies: list[SourceTally], dedup_report: dict[str, Any],
                      quarantined: int, agreement: AgreementCounts, timings: dict[str, float],
                      engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest both engines write; checks that every row read is accounted for."""
    num_shards = (engine or {}).get("num_shards", 1)
    sources_json = [t.to_json() for t in tallies]
    for entry, tally in zip(sources_json, tallies):
        # labels a source takes from the scheme's entry for its name (camrest, kdconv: the corpora the scheme
        # knows) other than its format's own, unless the source sets them: a team's chat export named after the
        # corpus it came from is bucketed as that corpus (the demo's corpora, read by their own formats, agree)
        defaults = get_format(tally.config.format).defaults
        taken = {k: v for k, v in context.scheme.sources.get(tally.config.name, {}).items()
                 if k in LABEL_FIELDS and not getattr(tally.config, k) and defaults.get(k) != v}
        if taken:
            entry["scheme_entry_labels"] = taken
    for entry in sources_json:
        accounted = entry["kept"] + sum(entry["dropped"].values())
        if accounted != entry["records"]:
            raise AssertionError(f"source {entry['name']}: {entry['records']} records but accounted for {accounted}")
    by_split = {s: sum(e["kept_by_split"][s] for e in sources_json) for s in SPLITS}
    # A source that yields nothing is most often a wrong path pattern or an empty export: say so rather
    # than let its buckets quietly go missing.
    warnings = [f"source {e['name']}: no rows read from {', '.join(e['files']) or 'its files'}"
                for e in sources_json if e["read"] == 0]
    # ... or one whose every record is left out (COIG-CQIA's ruozhiba: every answer written by a model): its
    # line in the table said `kept 0`, and nothing else did
    warnings += [f"source {e['name']}: none of its {e['records']:,} records kept ("
                 + ", ".join(f"{reason} {n:,}" for reason, n in sorted(e["dropped"].items(), key=lambda d: -d[1]))
                 + "); its buckets get nothing from it"
                 for e in sources_json if e["records"] and e["kept"] == 0]
    if sum(by_split.values()):  # none kept at all is an error of its own (the CLI's)
        warnings += [f"split {split}: no records (none from a `split: {split}` source, none from `split: auto` "
                     f"sources by split.weights); "
                     + ("build needs train and val records" if split != "test" else "nothing to evaluate on")
                     for split in SPLITS if by_split[split] == 0]
    return {
        "polyalign_version": polyalign_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config_path": str(context.config_path.resolve()),
        "config": context.raw_config,
        # the scheme as prepare read it: stats and build read this one, whatever the file says later
        "scheme": scheme_block(context),
        "on_error": on_error,
        **({"engine": engine} if engine else {}),
        "totals": {
            "read": sum(e["read"] for e in sources_json),
            "records": sum(e["records"] for e in sources_json),
            "kept": sum(by_split.values()),
            "dropped": sum(sum(e["dropped"].values()) for e in sources_json),
            "by_split": by_split,
            "empty_responses": sum(e["empty_responses"] for e in sources_json),
        },
        "sources": sources_json,
        **({"language_detection": LanguageChooser(context.scheme.values["language"]).note}
           if any(e.get("detected_languages") for e in sources_json) else {}),
        "warnings": warnings,
        "dedup": dedup_report,
        # well-formed rows left out as they were read, one line each (dedup's are in "dedup")
        "dropped_rows": {"file": file_label("dropped", num_shards), "rows": sum(
            sum(t.dropped.values()) - t.dropped["malformed"] - sum(sum(c.values()) for c in t.dropped_by_split.values())
            for t in tallies)},
        # a line a record: a conversation row with a problem is quarantined once for each of its replies; `rows`,
        # the same count under its earlier name, is deprecated (CHANGELOG)
        "quarantine": {"enabled": on_error == "quarantine", "records": quarantined, "rows": quarantined,
                       **({"file": file_label("quarantine", num_shards)} if on_error == "quarantine" else {})},
        **agreement.to_manifest(),
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    }


# What differs between two prepares of the same data: when, and how long each stage took.
VOLATILE_MANIFEST_KEYS = ("created", "timings_s")


def write_manifest(data_dir: Path, manifest: dict[str, Any]) -> None:
    """OUT/data/manifest.json, left as it is when a prepare made the same data again (it differs only in
    VOLATILE_MANIFEST_KEYS): build, stats and evaluations record its digest, and an unchanged prepare rerun
    by a resubmitted job must not make them all stale."""
    path = data_dir / "manifest.json"
    # the written files' digests: data made anew with other content (the same counts) is another manifest;
    # only the names this prepare writes, so that a user's own file in the folder is never taken for its own
    num_shards = (manifest.get("engine") or {}).get("num_shards", 1)
    written = [Path(data_dir) / name for stem in OUTPUT_STEMS for name in file_names(stem, num_shards)]
    manifest["file_digests"] = {p.name: file_digest(p) for p in sorted(written) if p.is_file()}
    text = json.dumps(manifest, ensure_ascii=False, indent=2) + "\n"
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict) and _lasting(old) == _lasting(json.loads(text)):
        return
    path.write_text(text, encoding="utf-8")


def _lasting(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest.items() if k not in VOLATILE_MANIFEST_KEYS}


def scheme_block(context: PrepareContext) -> dict[str, Any]:
    """The manifest's `scheme`: the file and the scheme as prepare read it (stats and build read this one)."""
    return {"path": context.scheme.path, "name": context.scheme.name, "length_unit": context.length_unit,
            "definition": context.scheme.definition}


def prepare_settings(context: PrepareContext, on_error: str) -> dict[str, Any]:
    """What makes OUT/data what it is, as the manifest records it at its top level: prepare is deterministic,
    so the same settings make the same files. The scheme's contents are among them: a scheme file edited
    since (bins 30 -> 50) makes other records from the same config."""
    return {"config": context.raw_config, "on_error": on_error, "scheme": scheme_block(context)}


def prepare_meaning(settings: dict[str, Any]) -> dict[str, Any]:
    """Recorded prepare settings as they take effect: the config with its defaults read in, so that
    `split.seed=42` (the default, written out) matches a config that leaves it; of the scheme, only what
    it defines (the config names its file). A recorded config this version cannot read is compared as
    written."""
    settings = {**settings, "scheme": _scheme_meaning(settings.get("scheme"))}
    try:
        config = from_mapping(DataConfig, copy.deepcopy(settings["config"]), "the recorded config")
    except (PolyalignError, KeyError, TypeError, ValueError):
        return settings
    return {**settings, "config": settings_record(asdict(config))}


def _scheme_meaning(block: Any) -> Any:
    """A recorded scheme block's definition. A manifest of an earlier release recorded only the file: what
    it holds now is all there is to go by (the behaviour of that release)."""
    if not isinstance(block, dict):
        return block
    if block.get("definition") is None:
        try:
            return load_yaml(Path(str(block.get("path") or ""))) if block.get("path") else None
        except ConfigError:
            return None
    return block["definition"]


def prepare(config_path: Path, out: Path, on_error: str = "fail", overrides: Iterable[str] = (),
            progress: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Run the data pipeline on this machine; returns the manifest (also written to OUT/data/manifest.json).
    polyalign.beam.prepare runs the same steps as an Apache Beam pipeline. OUT/data prepared with another
    config is refused unless `overwrite`; a second process preparing into the same OUT is refused."""
    context = load_context(config_path, overrides)
    data_dir = Path(out) / "data"
    # a first prepare stopped by a bad row leaves neither OUT/data nor OUT behind
    refuse_other_stages_folder(Path(out))
    refuse_sources_inside(data_dir, context.source_files)
    recorded = recorded_files(data_dir)  # before --overwrite removes the manifest that lists them
    with no_empty_folder_left(Path(out)), stage_output(
            data_dir, data_dir / "manifest.json", prepare_settings(context, on_error), overwrite,
            ours=owned_files(data_dir), key=None,
            view=prepare_meaning):
        return _prepare(context, data_dir, on_error, progress, recorded)


def _prepare(context: PrepareContext, data_dir: Path, on_error: str, progress: bool,
             recorded: set[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    timings: dict[str, float] = {}
    config, builder = context.config, context.builder
    tallies = source_tallies(context)

    data_dir.mkdir(parents=True, exist_ok=True)
    if note := stale_note(data_dir, clear_outputs(data_dir, 1, recorded)):
        print(note, file=sys.stderr)
    sink = ErrorSink(on_error, data_dir / "quarantine.jsonl")
    dropped = DroppedRows(data_dir / "dropped.jsonl")
    records: list[Record] = []
    tally_of: dict[str, SourceTally] = {}
    agreement = AgreementCounts()
    first_seen: dict[str, str] = {}
    try:
        bar = progress_bar(total=len(tallies), progress=progress, desc="import", unit="source")
        for tally, root in zip(tallies, context.source_roots):
            source = tally.config
            bar.set_postfix_str(source.name, refresh=False)
            for key, item in read_source(source.format, root):
                built = build_item(builder, source, tally, key, item, sink, dropped)
                if built is None:
                    continue
                if built.id in first_seen:
                    raise PrepareError(duplicate_id_message(built.id, [str(item.location), first_seen[built.id]]))
                first_seen[built.id] = str(item.location)
                for name, agree in label_votes(built, item.labels, item.derived):
                    agreement.add_label(source.name, name, agree)
                records.append(built)
                tally_of[built.id] = tally
            bar.update(1)
        bar.close()
    except PolyalignError:  # a problem the user fixes and reruns: no half-written list of this run is left
        for path in (sink.path, dropped.path):
            path.unlink(missing_ok=True)
        raise
    finally:
        sink.close()
        dropped.close()
    timings["import"] = time.perf_counter() - started

    # Group protection: a conversation, dialogue or passage lives in one split only.
    t0 = time.perf_counter()
    target = protected_splits((r.meta["group"], r.split) for r in records)
    moved = Counter()
    for i, record in enumerate(records):
        best = target[record.meta["group"]]
        if best != record.split:
            moved[f"{record.split}_to_{best}"] += 1
            records[i] = replace(record, split=best)

    dedup_report: dict[str, Any] = {"enabled": config.dedup, "group_protection": {"moved": dict(moved)}}
    if config.dedup:
        records, duplicates = exact_dedup(records)
        for duplicate in duplicates:
            tally_of[duplicate.record.id].drop("exact_duplicate", duplicate.record.split)
        _write_jsonl(data_dir / EXACT_DUPLICATES_FILE, (duplicate_row(d) for d in duplicates))
        dedup_report["exact"] = {"removed": len(duplicates), "by_kind": count_kinds(duplicates),
                                 "file": EXACT_DUPLICATES_FILE}
    timings["split_and_dedup"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    near = config.near_dedup
    if config.dedup and near.enabled:
        train = [r for r in records if r.split == "train"]
        test = [r for r in records if r.split == "test"]
        near_pairs = near_duplicates(train, test, near)
        if near.remove:
            flagged = {train_id for train_id, _, _ in near_pairs}
            for record in records:
                if record.id in flagged:
                    tally_of[record.id].drop("near_duplicate_of_test", "train")
            records = [r for r in records if r.id not in flagged]
        _write_jsonl(data_dir / "near_duplicates.jsonl",
                     ({"train_id": a, "test_id": b, "jaccard": s} for a, b, s in near_pairs))
        dedup_report["near_duplicates"] = near_duplicate_report(near, near_pairs)
    else:
        dedup_report["near_duplicates"] = {"enabled": False}
    timings["near_duplicates"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    by_split: dict[str, list[Record]] = {s: [] for s in SPLITS}
    for record in records:
        by_split[record.split].append(record)
        tally_of[record.id].kept_by_split[record.split] += 1
        for unit, name, agree in unit_votes(record, context.scheme):
            agreement.add_unit(record.dataset, unit, name, agree)
    for split, rows in by_split.items():
        _write_jsonl(data_dir / f"{split}.jsonl", (r.to_json() for r in rows))
    timings["write"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - started
    manifest = assemble_manifest(context, on_error, tallies, dedup_report, sink.count, agreement, timings)
    write_manifest(data_dir, manifest)
    return manifest


def repeated_id_problem(what: str, value: str, first: Location) -> str:
    """A row whose id (a conversation's own, or the record key it makes) an earlier row of its file has: the
    row's problem, its file's to fix."""
    where = f"line {first.line}" if first.line is not None else str(first).removeprefix(first.file).lstrip(": ")
    said = f"its id {value!r} is also {where}'s" if what == "id" else \
        f"its id makes the record key {value!r}, as {where} does"
    return (f"{said}: the file's rows' ids repeat; give each row an "
            "id of its own (a row without one is numbered by its place in the file, and 7 and \"7\" are one id)")


def duplicate_id_message(record_id: str, locations: list[str]) -> str:
    """Rows of two files that make one record id: two files of one source that hold the same conversations (a
    re-export beside the first), or sources whose names and splits collide. Either way the files or the config
    are at fault, not a row, so quarantine does not set it aside. Rows of one file whose own ids repeat never
    get here: build_item quarantines or refuses the later row as it is read (repeated_id_problem)."""
    return (f"{locations[0]}: record id {record_id!r} is also produced by {', '.join(locations[1:])}: one "
            "conversation (or row) id read from two files. Two files of one source holding the same conversations "
            "(a re-export beside the first): keep one of them, or give each file a source of its own; two sources "
            "of one name and split: give each source a distinct name or split")


def build_item(builder: RecordBuilder, source: SourceConfig, tally: SourceTally, key: str | None,
               item: Any, sink: Callable[[str, Malformed], None],
               dropped: Callable[[dict[str, Any]], None]) -> Record | None:
    """One imported item through the record builder: a Record, or None after counting why it was dropped
    (malformed rows also go to `sink`, the others to `dropped` as dropped_row). A Notice is counted under
    `left_out` and is no row."""

    def drop(reason: str, response: str | None = None) -> None:
        tally.drop(reason)
        dropped(dropped_row(source.name, item.location, reason, response))

    if item.location != tally.last_location:  # an importer yields a row's items one after another
        tally.read, tally.last_location = tally.read + 1, item.location
    if isinstance(item, Notice):
        tally.notes[item.reason] += item.count
        return None
    tally.records += 1
    if isinstance(item, Malformed):
        sink(source.name, item)
        tally.drop("malformed")
        return None
    if isinstance(item, Skipped):
        drop(item.reason, item.response)
        return None
    # a conversation row's own id (two conversations under one id, however their turns number), else the key
    row_id = item.meta.get("dialogue_id") if isinstance(item, Example) else None
    named = ("id", str(row_id)) if row_id is not None else ("record key", key)
    if named[1] is not None and (first := tally.keys_seen.setdefault((item.location.file, *named), item.location)) \
            != item.location or item.location in tally.repeating_rows:
        # the row's later replies go with the one that repeated an id: a row is kept or quarantined whole
        problem = tally.repeating_rows.setdefault(item.location, repeated_id_problem(*named, first))
        sink(source.name, Malformed(item.location, problem, item.as_read()))
        tally.drop("malformed")
        return None
    try:
        built = builder.build(key, item, source, tally)
    except RowProblem as problem:
        sink(source.name, Malformed(item.location, str(problem), item.as_read()))
        tally.drop("malformed")
        return None
    if isinstance(built, Skipped):
        drop(built.reason, item.response)
        return None
    if built.response == "" and built.family not in EMPTY_ANSWER_FAMILIES:
        # an empty reply would teach a model to answer with nothing; only a QA "no answer" is a real one
        drop("empty_response", "")
        return None
    if not built.question.strip() and not built.context.strip():
        # a reply to an empty user turn (an attachment-only message, a logging gap), or to no user turn at
        # all, answers nothing the model is shown: it would learn to say this unprompted
        drop("empty_question", item.response)
        return None
    tally.empty_responses += int(built.response == "")
    return built
