"""The record schema (METHOD.md section 1) and what importers hand to the pipeline."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Union

from polyalign.core import jsonl
from polyalign.core.errors import InputError, RowProblem  # noqa: F401 (importers raise it from here)

SPLITS = ("train", "val", "test")
# Group protection and dedup keep a record in the highest-priority split it appears in.
SPLIT_PRIORITY = {"test": 0, "val": 1, "train": 2}
ROLES = ("user", "assistant", "system")
# The opening of polyalign's profile system prompt (chat.py writes it; prepare recognises a source row
# that already carries it).
PROFILE_PREAMBLE = "You are a helpful assistant. Follow the target response profile when answering."
# Split names corpora use for their own splits, mapped to ours.
OFFICIAL_SPLITS = {"train": "train", "valid": "val", "validation": "val", "dev": "val", "val": "val", "test": "test"}
# A history turn marked with this key stood between the question and the reply: a system message
# (`[..., user, system, assistant]`), or an earlier reply that one interrupted (`[..., user, assistant, system,
# assistant]`); such turns come last in a record's history and are rendered after the question, where they
# stood (tokens/chat.record_messages), never before it.
AFTER_QUESTION = "after_question"
RECORD_FIELDS = (
    "id", "dataset", "split", "language", "track", "family", "style", "question", "context", "history",
    "response", "length_tokens", "length_bin", "bucket_id", "meta",
)


@dataclass(frozen=True)
class Location:
    """Where a row lives: a JSONL line, a JSON array element, a SQuAD question or a dialogue."""

    file: str
    line: int | None = None
    element: int | None = None
    question: int | None = None
    dialogue: str | None = None
    # 0-based position of the row in its file; row sources number their records from it.
    row: int | None = field(default=None, compare=False)

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.file}:{self.line}"
        if self.element is not None:
            return f"{self.file}: element {self.element}"
        if self.question is not None:
            return f"{self.file}: question {self.question}"
        if self.dialogue is not None:
            return f"{self.file}: dialogue {self.dialogue}"
        return self.file

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "row"}


@dataclass
class Example:
    """One candidate record as an importer reads it, before normalisation and bucketing.

    `key` is None for row sources (the pipeline numbers rows) and `<dialogue id>-turn-<k>` for
    dialogue sources. `labels` are the row's own track/family/style/language/length_bin/bucket_id.
    `split` is an official split carried by the data itself (ConvLab's data_split, LCCC's JSON keys).
    `derived` holds labels the importer read off the conversation itself (track: multi when earlier
    user/assistant turns exist); they rank below the configuration and the scheme (prepare's
    RecordBuilder.labels). `conversation` is the text of the whole dialogue the record comes from, so
    that its language is decided once per conversation. `opens_conversation`: the first reply of a
    conversation that goes on to later replies (its track is `single` unless a label says otherwise).
    """

    question: str
    response: str
    location: Location
    context: str = ""
    history: list[dict[str, str]] = field(default_factory=list)
    key: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    split: str | None = None
    group: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)
    conversation: str | None = None
    opens_conversation: bool = False
    unread_keys: tuple[str, ...] = ()  # keys of the source row the importer does not read (a misspelt one too)

    def as_read(self) -> str:
        """The reply as its importer read it, as JSON: what a quarantine row holds of a problem found while
        its record is built (a label the scheme lacks), when the source row itself is no longer at hand."""
        read = {"question": self.question, "context": self.context, "history": self.history,
                "response": self.response, "labels": self.labels, "key": self.key}
        return json.dumps({k: v for k, v in read.items() if v not in ("", [], {}, None)}, ensure_ascii=False)


@dataclass
class Notice:
    """Something an importer left out of a row it otherwise read (a non-text content part, a system
    message that is polyalign's own profile prompt): counted by reason in the manifest, not a row."""

    location: Location
    reason: str
    count: int = 1


@dataclass
class Malformed:
    """A row that cannot be read; it stops the run or goes to quarantine with its reason."""

    location: Location
    problem: str
    raw: str | None = None


@dataclass
class Skipped:
    """A well-formed row the format itself excludes (e.g. an LLM-written COIG answer); counted by reason.
    `response`: the reply left out, where the row is a conversation that holds others (dropped.jsonl says
    which of its replies)."""

    location: Location
    reason: str
    key: str | None = None
    response: str | None = None


ImportItem = Union[Example, Malformed, Skipped, Notice]


@dataclass
class Record:
    id: str
    dataset: str
    split: str
    language: str
    track: str
    family: str
    style: str
    question: str
    context: str
    history: list[dict[str, str]]
    response: str
    length_tokens: int
    length_bin: str
    bucket_id: str
    meta: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Record":
        return cls(**{name: obj[name] for name in RECORD_FIELDS})


def before_question(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history turns that precede the question (all but the AFTER_QUESTION ones)."""
    return [turn for turn in history if not turn.get(AFTER_QUESTION)]


def after_question(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns that stood between the question and the reply, in their order: system notes, and an earlier
    reply that a note interrupted (user, reply, note, reply)."""
    return [turn for turn in history if turn.get(AFTER_QUESTION)]


def read_records(path: str | os.PathLike) -> list[Record]:
    """The records of a JSONL file written by `polyalign prepare` (blank lines skipped), or of a pairs file
    (`polyalign pairs`, `pairs import`): each pair holds the record its prompt and chosen answer come from,
    read once per record id, so held-out pairs can be generated from and evaluated on as records are. `path`
    may be an epath (a bucket URI) as well as a local path."""
    records, seen = [], set()
    if not (path.exists() if hasattr(path, "exists") else os.path.exists(path)):
        raise InputError(f"{path}: no such records file (prepare writes RUN/data/{{train,val,test}}.jsonl)")
    with (path.open(encoding="utf-8") if hasattr(path, "open") else open(path, encoding="utf-8")) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = jsonl.parse(line)
            except jsonl.JsonProblem as problem:
                raise InputError(f"{path}:{line_number}: not a JSON record ({problem})") from None
            if isinstance(row, dict) and isinstance(row.get("record"), dict) and {"chosen", "rejected"} <= row.keys():
                row = row["record"]  # a pair: the record it was made from
                if row.get("id") in seen:
                    continue
                seen.add(row.get("id"))
            missing = [name for name in RECORD_FIELDS if name not in row] if isinstance(row, dict) else ["every field"]
            if missing:
                raise InputError(f"{path}:{line_number}: not a polyalign record (missing {', '.join(missing[:3])}"
                                 f"{', ...' if len(missing) > 3 else ''}); records come from `polyalign prepare`")
            problem = record_field_problem(row)
            if problem:
                raise InputError(f"{path}:{line_number}: {problem}; records come from `polyalign prepare` (a file "
                                 "edited since: run prepare again)")
            records.append(Record.from_json(row))
    return records


_TEXT_FIELDS = ("id", "dataset", "split", "language", "track", "family", "style", "question", "context", "response",
                "length_bin", "bucket_id")


def record_field_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with a record's fields, by name: a hand-edited `"response": null` crashed the
    statistics and trained an empty answer in a build."""
    for name in _TEXT_FIELDS:
        if not isinstance(row[name], str):
            return f"{name} is {json.dumps(row[name])[:40]}, not a string"
    for name in ("id", "split", "language", "bucket_id"):
        if not row[name]:
            return f"{name} is empty"
    length = row["length_tokens"]
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        return f"length_tokens is {json.dumps(length)[:40]}, not a count"
    if not isinstance(row["meta"], dict):
        return f"meta is {json.dumps(row['meta'])[:40]}, not an object"
    history = row["history"]
    if not isinstance(history, list) or not all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("text"), str) for t in history):
        return "history is not a list of {role, text} turns"
    return None
