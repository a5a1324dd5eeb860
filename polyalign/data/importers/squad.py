"""SQuAD-style reading comprehension JSON (CMRC 2018, DRCD, SQuAD v1/v2):
{data: [{title, paragraphs: [{id?, context, qas: [{id, question, answers: [{text}], is_impossible?}]}]}]}.

One record per question; the first answer is the response and every distinct answer is kept in
meta.answers for evaluation. An unanswerable question (is_impossible) has an empty response. Locations
are the question's 1-based number in the file. A record's key is the question's own `id` when the file
gives it to that question alone, else `<file>-a<article>-p<paragraph>-q<question>` (1-based positions
in the document): never a count of the questions before it, so a quarantined paragraph renames
nothing after it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers.reading import dump_raw, list_field, load_json, require_dict, text_field, type_name
from polyalign.data.records import Example, ImportItem, InputError, Location, Malformed, RowProblem

PATTERNS = ("*.json",)
DEFAULTS = {"track": "single", "family": "qa", "style": "qa_search"}


def _answers(qa: dict[str, Any]) -> list[str]:
    impossible = qa.get("is_impossible", False)
    if not isinstance(impossible, bool):
        raise RowProblem(f"'is_impossible' must be true or false, got {type_name(impossible)}")
    answers = list_field(qa, "answers", optional=impossible)
    texts: list[str] = []
    for i, answer in enumerate(answers, start=1):
        text = text_field(require_dict(answer, f"answer {i}"), "text", what=f"answer {i} 'text'")
        if text not in texts:
            texts.append(text)
    if not texts and not impossible:
        raise RowProblem("missing answers (no answer and not marked is_impossible)")
    return [] if impossible else texts


def read(path: Path, file_tag: str) -> Iterator[ImportItem]:
    document = load_json(path)
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        raise InputError(f"{path}: expected a SQuAD document {{'data': [articles]}}")
    ids = Counter(qa.get("id") for article in document["data"] if isinstance(article, dict)
                  for paragraph in (article.get("paragraphs") if isinstance(article.get("paragraphs"), list) else [])
                  if isinstance(paragraph, dict) and isinstance(paragraph.get("qas"), list)
                  for qa in paragraph["qas"] if isinstance(qa, dict) and isinstance(qa.get("id"), str))
    number = 0
    for a, article in enumerate(document["data"], start=1):
        try:
            article = require_dict(article, f"article {a}")
            title = text_field(article, "title", default="")
            paragraphs = list_field(article, "paragraphs")
        except RowProblem as problem:
            yield Malformed(Location(str(path), question=number + 1), f"article {a}: {problem}", dump_raw(article))
            continue
        for p, paragraph in enumerate(paragraphs, start=1):
            try:
                paragraph = require_dict(paragraph, f"paragraph {p}")
                context = text_field(paragraph, "context")
                qas = list_field(paragraph, "qas")
            except RowProblem as problem:
                where = Location(str(path), question=number + 1)
                yield Malformed(where, f"article {a} paragraph {p}: {problem}", dump_raw(paragraph))
                continue
            group = str(paragraph.get("id") or f"article-{a}-paragraph-{p}")
            for q, qa in enumerate(qas, start=1):
                number += 1
                location = Location(str(path), question=number, row=number - 1)
                own = qa.get("id") if isinstance(qa, dict) else None
                key = own.strip() if isinstance(own, str) and own.strip() and ids[own] == 1 \
                    else f"{file_tag}-a{a}-p{p}-q{q}"
                try:
                    qa = require_dict(qa, "question")
                    answers = _answers(qa)
                    yield Example(
                        question=text_field(qa, "question"),
                        context=context,
                        response=answers[0] if answers else "",
                        location=location,
                        key=key,
                        group=group,
                        meta={"answers": answers, "source_question_id": str(qa.get("id", "")), "title": title},
                    )
                except RowProblem as problem:
                    yield Malformed(location, str(problem), dump_raw(qa))
