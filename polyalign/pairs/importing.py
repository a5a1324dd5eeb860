"""`polyalign pairs import`: users' own preference data as the pairs file the preference methods read.

Formats:
- `trl`: TRL's preference rows, {"prompt", "chosen", "rejected"}, each a string or a list of
  {"role", "content"} messages (content a string or OpenAI content parts; the prompt's last message from
  the user, chosen and rejected one assistant message each, or whole conversations that hold the prompt
  before their answers, as UltraFeedback binarized has them); or, without "prompt", chosen and rejected as
  whole conversations sharing everything but their last message.
- `hh`: Anthropic HH-RLHF rows, {"chosen", "rejected"}: the conversation as "\n\nHuman: ...\n\nAssistant: ..."
  text, the two differing in the last Assistant turn; or with a "prompt" of such turns ending "Assistant:",
  chosen and rejected its answers.
- `sharegpt-pairs`: LLaMA-Factory's ShareGPT preference rows, {"conversations": [{"from", "value"}],
  "chosen": {"from", "value"}, "rejected": {"from", "value"}, "system"?}.

Each row becomes a record exactly as `polyalign prepare` makes one (the same normalisation, labels by
precedence (the row's own language/track/family/style, then the flags, then the scheme's entry for
the dataset name), language detection where none is declared, length bin of the chosen answer,
bucket), with the rejected answer beside it; a row's own "id" is kept as the record's `meta.source_id`. A
row that cannot be read stops the import with its file and line, or goes to OUT.quarantine.jsonl with its
reason under --on-error quarantine; a well-formed row left out (an empty side, chosen equal to rejected, a
language outside the scheme) is counted and listed in OUT.dropped.jsonl with its line. A system message
is kept as prepare keeps one (a history turn of role system: the record's system prompt, composed with
the profile prompt when the pair is rendered; counted as `system_messages`; one after the prompt's last
user message is rendered after it, where it stood; one that is polyalign's own profile prompt is left out and
counted as `system_is_profile_prompt`, as prepare does), and the track is derived
from the conversation as prepare derives it (multi when earlier user/assistant turns exist).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.core.outputs import OutputLock, check_output, sidecar, stage_output, write_record
from polyalign.core.paths import file_digest
from polyalign.core.wording import counted
from polyalign.data.bucketing import load_scheme
from polyalign.data.importers.reading import (
    content_text,
    conversation_track,
    iter_json_rows,
    labelled_turns,
    map_role,
    parse_rows,
    require_dict,
    string_labels,
    type_name,
)
from polyalign.data.importers.sharegpt import ROLES as SHAREGPT_ROLES
from polyalign.data.prepare import (
    DroppedRows,
    ErrorSink,
    RecordBuilder,
    SourceConfig,
    SourceTally,
    SplitOptions,
    dropped_row,
    scheme_language,
)
from polyalign.data.records import (
    AFTER_QUESTION,
    Example,
    ImportItem,
    InputError,
    Location,
    Malformed,
    Record,
    RowProblem,
    Skipped,
)
from polyalign.data.text import normalize
from polyalign.pairs.make import HH_TURN, hh_text, write_pair_split

FORMATS = ("trl", "hh", "sharegpt-pairs")
DEFAULT_SCHEME = Path(__file__).resolve().parents[1] / "buckets" / "polyalign.yaml"  # shipped in the package
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
ROW_LABELS = {"language": "language", "track": "track", "family": "family", "style": "style"}


def _messages(value: Any, what: str) -> list[dict[str, str]]:
    """A TRL field: a string is one message of the side's role, a list is messages (content a string or
    OpenAI content parts, as the chat importer reads them)."""
    if isinstance(value, str):
        return [{"role": "user" if what == "prompt" else "assistant", "text": value}]
    if not isinstance(value, list) or not value:
        raise RowProblem(f"{what!r} must be a string or a non-empty list of messages, got {type_name(value)}")
    turns = []
    for i, message in enumerate(value, start=1):
        where = f"{what} message {i}"
        message = require_dict(message, where)
        if message.get("content") is None:
            raise RowProblem(f"{where} 'content' is {'null' if 'content' in message else 'missing'}")
        text, left_out = content_text(message["content"], where)
        if left_out:
            raise RowProblem(f"{where} holds {', '.join(sorted(set(left_out)))} content, which a text model cannot "
                             "train on")
        turns.append({"role": map_role(message.get("role"), ROLES, where), "text": text})
    return turns


def _answer(turns: list[dict[str, str]], what: str) -> str:
    if len(turns) != 1 or turns[0]["role"] != "assistant":
        raise RowProblem(f"{what!r} must be one assistant message")
    return turns[0]["text"]


def _trl(row: dict[str, Any]) -> tuple[list[dict[str, str]], str, str]:
    for key in ("chosen", "rejected"):
        if key not in row:
            raise RowProblem(f"missing field {key!r}")
    if hh_text(row.get("prompt", row["chosen"])):
        raise RowProblem("the row is Anthropic HH text ('\\n\\nHuman: ... \\n\\nAssistant: ...'): --format hh "
                         "reads it")
    chosen, rejected = _messages(row["chosen"], "chosen"), _messages(row["rejected"], "rejected")
    if "prompt" in row:
        prompt = _messages(row["prompt"], "prompt")
        if len(chosen) == len(rejected) == 1:
            return prompt, _answer(chosen, "chosen"), _answer(rejected, "rejected")
        # whole conversations that repeat the prompt before their answers (UltraFeedback binarized)
        if chosen[:-1] != rejected[:-1] or not _ends_with(chosen[:-1], prompt):
            raise RowProblem("chosen and rejected must be one assistant message each, or whole conversations that "
                             "share every message but their last and hold the prompt before it")
    elif chosen[:-1] != rejected[:-1]:  # implicit prompt: the shared conversation
        raise RowProblem("without 'prompt', chosen and rejected must share every message but their last")
    return chosen[:-1], _answer(chosen[-1:], "chosen"), _answer(rejected[-1:], "rejected")


def _ends_with(conversation: list[dict[str, str]], prompt: list[dict[str, str]]) -> bool:
    """Whether the prompt's messages close the conversation (its system messages may stand before them), texts
    compared without the whitespace around them."""
    def said(turns):
        return [(t["role"], t["text"].strip()) for t in turns]
    return len(prompt) <= len(conversation) and said(conversation[len(conversation) - len(prompt):]) == said(prompt)


HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def _hh_turns(text: Any, what: str) -> list[dict[str, str]]:
    """The turns of Anthropic HH text ("\\n\\nHuman: ...\\n\\nAssistant: ...")."""
    if not isinstance(text, str):
        raise RowProblem(f"{what!r} must be a string of '\\n\\nHuman:' and '\\n\\nAssistant:' turns, got "
                         f"{type_name(text)}")
    marks = list(HH_TURN.finditer(text))
    if not marks or text[:marks[0].start()].strip():
        raise RowProblem(f"{what!r} does not open with a '\\n\\nHuman:' turn: not Anthropic HH text (--format trl "
                         "reads prompt/chosen/rejected rows)")
    ends = [m.start() for m in marks[1:]] + [len(text)]
    return [{"role": HH_ROLES[m.group(1)], "text": text[m.end():end].strip()} for m, end in zip(marks, ends)]


def _hh(row: dict[str, Any]) -> tuple[list[dict[str, str]], str, str]:
    """Anthropic HH rows: chosen and rejected the whole conversation, differing in its last Assistant turn; or
    a "prompt" ending with an empty Assistant turn, chosen and rejected its answers."""
    for key in ("chosen", "rejected"):
        if key not in row:
            raise RowProblem(f"missing field {key!r}")
    if "prompt" in row:
        prompt = _hh_turns(row["prompt"], "prompt")
        if prompt[-1]["role"] == "assistant" and not prompt[-1]["text"]:
            prompt = prompt[:-1]
        answers = []
        for key in ("chosen", "rejected"):
            if not isinstance(row[key], str):
                raise RowProblem(f"{key!r} must be a string (the answer to the prompt), got {type_name(row[key])}")
            answers.append(row[key].strip())
        return prompt, answers[0], answers[1]
    chosen, rejected = _hh_turns(row["chosen"], "chosen"), _hh_turns(row["rejected"], "rejected")
    for key, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[-1]["role"] != "assistant":
            # "Human: ...\nAssistant: ...": one Human turn, its answer inside it
            single = "\nAssistant:" in turns[-1]["text"]
            raise RowProblem(f"{key!r} does not end with an Assistant turn" + (
                ": its 'Assistant:' follows a single newline, where HH text opens every turn with a blank line "
                "('\\n\\nHuman: ...\\n\\nAssistant: ...')" if single else ""))
    if chosen[:-1] != rejected[:-1]:
        raise RowProblem("chosen and rejected must share every turn but their last, an Assistant turn")
    return chosen[:-1], chosen[-1]["text"], rejected[-1]["text"]


def _sharegpt_pairs(row: dict[str, Any]) -> tuple[list[dict[str, str]], str, str]:
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise RowProblem(f"'system' must be a string, got {type_name(system)}")
    prompt = [{"role": "system", "text": system}] if system else []
    conversations = row.get("conversations")
    if not isinstance(conversations, list) or not conversations:
        raise RowProblem("'conversations' must be a non-empty list of turns")
    prompt += labelled_turns(conversations, SHAREGPT_ROLES, "from", "value", "turn")
    answers = []
    for key in ("chosen", "rejected"):
        if key not in row:
            raise RowProblem(f"missing field {key!r}")
        if not isinstance(row[key], dict):  # LLaMA-Factory writes the answer as one turn, not a list of them
            raise RowProblem(f"{key!r} must be one turn, {{\"from\": \"gpt\", \"value\": ...}}, got "
                             f"{type_name(row[key])}")
        answers.append(_answer(labelled_turns([row[key]], SHAREGPT_ROLES, "from", "value", key), key))
    return prompt, answers[0], answers[1]


def _example(row: Any, location: Location, fmt: str) -> Iterator[ImportItem]:
    row = require_dict(row)
    prompt, chosen, rejected = READERS[fmt](row)
    last_user = max((i for i, turn in enumerate(prompt) if turn["role"] == "user"), default=None)
    trailing = prompt[last_user + 1:] if last_user is not None else []
    # after the question: system notes, and an earlier reply a note interrupted, as prepare keeps them
    if last_user is None or any(turn["role"] not in ("system", "assistant") for turn in trailing) or (
            trailing and trailing[-1]["role"] != "system"):
        raise RowProblem("the prompt must end with a user message (system messages may follow it, and an earlier "
                         "reply before such a message)")
    # system turns stay where they stand, as prepare keeps them: those after the question marked so
    history = prompt[:last_user] + [{**turn, AFTER_QUESTION: True} for turn in prompt[last_user + 1:]]
    own_id = row.get("id")  # the user's own key for the row, to find it again
    yield Example(question=prompt[last_user]["text"], response=chosen, location=location, history=history,
                  labels=string_labels(row, ROW_LABELS), derived={"track": conversation_track(history)},
                  meta={"rejected": rejected, **({"source_id": str(own_id)} if isinstance(own_id, (str, int))
                                                 and not isinstance(own_id, bool) else {})})


READERS = {"trl": _trl, "hh": _hh, "sharegpt-pairs": _sharegpt_pairs}


def read_pair_rows(path: Path, fmt: str) -> Iterator[ImportItem]:
    if fmt not in FORMATS:
        raise InputError(f"unknown pairs format {fmt!r} (known: {', '.join(FORMATS)})")
    return parse_rows(iter_json_rows(path), lambda row, location: _example(row, location, fmt))


def import_pairs(input_path: Path, out: Path, fmt: str, *, dataset: str | None = None, language: str | None = None,
                 track: str | None = None, family: str | None = "assistant", style: str | None = None,
                 scheme_path: Path | None = None, on_error: str = "fail", overwrite: bool = False,
                 val_fraction: float | None = None, val_out: Path | None = None, seed: int = 0) -> dict[str, Any]:
    """Reads INPUT, writes the weighted pairs file OUT and OUT.manifest.json; returns the summary. With
    `val_fraction`, about that share of the prompts (all pairs of each) goes to VAL_OUT instead (default
    OUT's name with .val: pairs.jsonl -> pairs.val.jsonl), chosen by a hash seeded with `seed`."""
    out = Path(out)
    if not Path(input_path).is_file():
        raise InputError(f"{input_path}: " + ("a folder; give the preference file in it" if Path(input_path).is_dir()
                                              else "no such file"))
    # each pair's record names its file: the same file however the command spells it, so that the same import
    # writes the same pairs (a training run compares their digest)
    input_path = Path(input_path).resolve()
    if val_fraction is not None and not 0 < val_fraction < 1:
        raise InputError(f"--val-fraction must be in (0, 1), got {val_fraction:g}")
    val_out = None if val_fraction is None else Path(val_out or out.with_name(out.stem + ".val.jsonl"))
    dataset = dataset or input_path.stem.replace(".", "_")
    settings = {"input": str(input_path.resolve()), "format": fmt, "dataset": dataset, "language": language,
                "track": track, "family": family, "style": style, "scheme": str(scheme_path or DEFAULT_SCHEME),
                "on_error": on_error}
    if val_out is not None:
        settings.update(val_fraction=val_fraction, val_out=str(val_out.resolve()), seed=seed)
    if scheme_path is None and not DEFAULT_SCHEME.is_file():
        raise InputError(f"{DEFAULT_SCHEME}: missing (polyalign is not a source checkout); pass --scheme")
    scheme = load_scheme(Path(scheme_path or DEFAULT_SCHEME))
    if language is not None:  # --language zh-CN names the scheme's zh, as a row's own label does
        language = scheme_language(language, scheme.values["language"])
    for dimension, value in (("language", language), ("track", track), ("family", family), ("style", style)):
        known = scheme.values.get(dimension, ())
        if value is not None and value not in known:
            raise InputError(f"--{dimension} {value} is not one of the scheme's: {', '.join(known)} "
                             f"({scheme_path or DEFAULT_SCHEME}); every row that names no {dimension} of its own "
                             "would be dropped")
    source = SourceConfig(name=dataset, format="chat", path=str(input_path), split="train", language=language,
                          track=track, family=family, style=style or _default_style(scheme, family))
    builder = RecordBuilder(scheme, scheme.length_unit, SplitOptions())
    tally = SourceTally(source, files=[str(input_path)])
    quarantine, dropped_file = out.with_name(out.stem + ".quarantine.jsonl"), out.with_name(out.stem + ".dropped.jsonl")
    files = [(out, {"input": input_path}, "--out")]
    if val_out is not None:
        files.append((val_out, {"input": input_path, "--out": out}, "--val-out"))
    for path, inputs, option in files:  # both refused or neither started
        check_output(path, sidecar(path), settings, overwrite, ours=[path], inputs=inputs, option=option)
    with contextlib.ExitStack() as outputs:
        for path, inputs, option in files:
            outputs.enter_context(stage_output(path, sidecar(path), settings, overwrite, ours=[path], inputs=inputs,
                                               lock=OutputLock.for_file(path), option=option))
        sink = ErrorSink(on_error, quarantine)
        pairs, dropped, listed = [], Counter(), []

        def drop(location, reason: str) -> None:
            dropped[reason] += 1
            listed.append(dropped_row(dataset, location, reason))

        try:
            for number, item in enumerate(read_pair_rows(input_path, fmt)):
                tally.read += 1
                if isinstance(item, Malformed):
                    sink(dataset, item)
                    dropped["malformed"] += 1
                    continue
                try:
                    record = builder.build(f"{number:06d}", item, source, tally)
                except RowProblem as problem:
                    sink(dataset, Malformed(item.location, str(problem), item.as_read()))
                    dropped["malformed"] += 1
                    continue
                if isinstance(record, Skipped):
                    drop(record.location, record.reason)
                    continue
                pair, reason = _pair(record, item)
                if pair is None:
                    drop(item.location, reason)
                else:
                    pairs.append(pair)
        finally:
            sink.close()
        if not pairs:  # as prepare refuses to keep nothing: an empty file trains nothing, silently
            read = tally.read
            why = ", ".join(f"{reason} {n}" for reason, n in dropped.items())
            raise InputError(f"{input_path}: " + (f"no pair kept of {counted(read, 'row')} ({why})" if read
                                                 else "holds no rows") + f"; nothing written to {out}")
        split = write_pair_split(pairs, out, val_out, val_fraction, seed)
        if not sink.count:
            quarantine.unlink(missing_ok=True)
        dropped_file.unlink(missing_ok=True)  # an earlier import's list is not this one's
        if listed:  # the well-formed rows left out (malformed ones are in the quarantine file, or stopped the import)
            rows = DroppedRows(dropped_file)
            for row in listed:
                rows(row)
            rows.close()
        summary = {"read": tally.read, "pairs": len(pairs), "dropped": dict(dropped),
                   "system_messages": tally.system_messages["system_prompt"],
                   "system_is_profile_prompt": tally.system_messages["system_is_profile_prompt"],
                   "languages_detected": dict(tally.detected_languages),
                   "language_mismatches": dict(tally.language_mismatches),
                   "mojibake": tally.mojibake,  # pairs whose prompt or chosen answer holds some, kept as read
                   "buckets": dict(sorted(Counter(p["bucket_id"] for p in pairs).items())),
                   # the family of the conversations (earlier turns in the prompt): the default's fit is worth a word
                   "multi_turn_families": dict(Counter(p["record"]["family"] for p in pairs
                                                       if p["record"]["track"] == "multi")),
                   "rejected_chosen_elsewhere": rejected_chosen_elsewhere(pairs),
                   "quarantined": sink.count, "out": str(out),
                   **({"dropped_rows": str(dropped_file)} if listed else {})}
        val_buckets = split.pop("val_buckets", None)
        summary.update(split)
        if val_out is not None:  # each file's manifest counts its own pairs and buckets
            write_record(sidecar(val_out), settings, {"input": file_digest(input_path)},
                         summary={**summary, "pairs": split["val_pairs"], "buckets": val_buckets,
                                  "file": "validation"})
        write_record(sidecar(out), settings, {"input": file_digest(input_path)}, summary=summary)
    return summary


def rejected_chosen_elsewhere(pairs: list[dict]) -> int:
    """Pairs whose rejected answer is, word for word, the chosen answer of another pair: each such answer is
    pushed up by one pair and down by the other (a file whose rejected answers were borrowed from other rows'
    chosen ones: a user's DPO fell to validation accuracy 0.25 on it)."""
    chosen = Counter(p["chosen"].strip() for p in pairs)
    return sum(1 for p in pairs if chosen[p["rejected"].strip()] > 0)


def _default_style(scheme, family: str | None) -> str | None:
    """The style a family's answers most often have in the scheme's sources (assistant -> assistant_like)."""
    styles = Counter(labels.get("style") for labels in scheme.sources.values() if labels.get("family") == family)
    styles.pop(None, None)
    return styles.most_common(1)[0][0] if styles else None


def _pair(record: Record, example: Example) -> tuple[dict[str, Any] | None, str]:
    rejected = normalize(record.meta.pop("rejected"))
    if not record.question.strip() and not record.context.strip():  # as prepare drops it: nothing was asked
        return None, "empty_question"
    if not record.response or not rejected:
        return None, "empty_side"
    if record.response == rejected:
        return None, "chosen_equals_rejected"
    return {"id": record.id, "bucket_id": record.bucket_id, "language": record.language, "chosen": record.response,
            "rejected": rejected, "model": "imported", "record": record.to_json()}, ""
