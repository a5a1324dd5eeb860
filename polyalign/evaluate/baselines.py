"""Answers that need no model, reported beside every model as reference rows: a reader sees at once
whether a model beats echoing the question, quoting the first sentence of the context (of the question
where there is none), or saying nothing
(several numbers read an empty answer kindly: F1 gives it 1 against an empty human answer, TDM about
half marks; a model below the empty answer's aggregate has not yet beaten silence)."""

from __future__ import annotations

import re

from polyalign.data.records import Record

_FIRST_SENTENCE = re.compile(r"(?<=[.!?。！？])\s+|\n+")


def first_sentence(text: str) -> str:
    return _FIRST_SENTENCE.split(text.strip(), maxsplit=1)[0].strip()


BASELINES = {
    "echo_question": lambda record: record.question,
    "first_sentence": lambda record: first_sentence(record.context or record.question),
    "empty_answer": lambda record: "",
}


def baseline_answers(name: str, records: list[Record]) -> list[str]:
    return [BASELINES[name](r) for r in records]
