"""Reading helpers shared by the importers and `polyalign pairs import`: file discovery, JSON and JSONL
with precise error locations, typed field access and multi-turn projection."""

from __future__ import annotations

import glob
import json
import os
import re
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from polyalign.core import jsonl
from polyalign.core.jsonl import compressed_kind, wide_encoding
from polyalign.core.wording import counted
from polyalign.data.records import (
    AFTER_QUESTION,
    Example,
    ImportItem,
    InputError,
    Location,
    Malformed,
    Notice,
    RowProblem,
    Skipped,
)

_DOCUMENTATION = re.compile(r"^(readme|provenance|licen[cs]e|notice|copying)\b", re.IGNORECASE)


def source_files(path: Path, patterns: Sequence[str]) -> list[Path]:
    """The files of a source: `path` itself, the data files under a directory matching `patterns`
    (recursively, sorted; README/LICENSE/PROVENANCE files are not data), or the matches of a glob.
    An empty result is an error."""
    if any(ch in str(path) for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    elif path.is_dir():
        files = [f for f in _folder_files(path) if any(f.match(pattern) for pattern in patterns)]
    elif path.is_file():
        files = [path]
    elif path.is_symlink():
        raise InputError(f"{path}: a link to {os.readlink(path)}, which does not exist")
    else:
        raise InputError(f"{path}: no such file or directory")
    if not files:
        raise InputError(f"{path}: no input files (looked for {', '.join(patterns)})")
    return files


def unread_files(path: Path, files: Sequence[Path]) -> list[str]:
    """The files under a source's folder that its format does not read (its PATTERNS match none of them), as
    paths inside the folder: a zip of exports beside them, a .csv, a file saved as .txt. Documentation and
    hidden files aside. [] for a source that names a file or a glob."""
    if any(ch in str(path) for ch in "*?[") or not path.is_dir():
        return []
    read = set(files)
    return [str(f.relative_to(path)) for f in _folder_files(path) if f not in read]


def _folder_files(path: Path) -> list[Path]:
    """Every file under a source's folder that may be data, sorted: documentation (README, LICENSE, ...) aside,
    and what no export meant as data: hidden files (.DS_Store, macOS's "._chats.json" beside each file it copies,
    .ipynb_checkpoints/) and what a Mac's zip adds (__MACOSX/)."""
    return sorted(f for f in path.rglob("*") if f.is_file() and not _DOCUMENTATION.match(f.name)
                  and not any(part.startswith(".") or part == "__MACOSX" for part in f.relative_to(path).parts))


def _line_of_offset(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


# What a Windows "ANSI" export is in, by the language of the machine that saved it: GBK on a Chinese one,
# Windows-1252 on a Western one. Only a guess from the bytes' shape: the hint shows the words it reads, for the
# user to judge, and says nothing where neither shape fits.
_HIGH_RUN = re.compile(rb"[\x80-\xff]+")
_CJK_PAIR = re.compile("[\u3400-\u9fff]{2}")  # a Chinese word; "ção" read as GBK is one ideograph between letters
_HINT_BYTES = 4096  # a document's first bytes are enough to guess from


def encoding_hint(raw: bytes) -> str:
    """For bytes that are not UTF-8: what they most likely are, with the words that reading gives and how to
    convert the file; "" where no guess is safe.
    - Mostly UTF-8 (its multi-byte characters decode, a byte or two do not): a line cut inside a character or
      joined from two files. Converting the file would double-encode its good lines, so no iconv line.
    - GBK: it decodes, into two Chinese characters in a row somewhere (Portuguese "ção" in Windows-1252 also
      decodes as GBK, into one ideograph between Latin letters).
    - Windows-1252: a Western text's accented letters stand alone or in pairs between ASCII letters (a
      Cyrillic or Greek Windows encoding fills whole words with high bytes, and gets no hint)."""
    raw = raw[:_HINT_BYTES]
    runs = _HIGH_RUN.findall(raw)
    if not runs:
        return ""
    utf8 = raw.decode("utf-8", errors="replace")
    bad, good = utf8.count("\ufffd"), sum(ord(c) > 127 for c in utf8) - utf8.count("\ufffd")
    if good >= 2 * bad:
        return ("; the rest of it is UTF-8, so a few bytes are not (a line cut inside a character, or text joined "
                "from two files): mend those lines")
    candidates = [("gbk", "GBK", "a Chinese Windows encoding")]
    if max(map(len, runs)) <= 3:
        candidates.append(("cp1252", "WINDOWS-1252", "a Western Windows encoding"))
    for codec, name, what in candidates:
        try:
            text = raw.decode(codec)
        except UnicodeDecodeError:
            continue
        if codec == "gbk" and not _CJK_PAIR.search(text):
            continue
        at = next((i for i, c in enumerate(text) if ord(c) > 127), 0)
        snippet = " ".join(text[max(at - 12, 0):at + 12].split())  # one line, whatever the file's lines
        return (f"; read as {name}, {what}, it says \"{snippet}\": if that is the text, save the file as UTF-8 "
                f"(iconv -f {name} -t UTF-8 FILE > FILE.utf8)")
    return ""


def decode_document(data: bytes, name: str) -> str:
    if kind := compressed_kind(data[:6]):
        raise InputError(f"{name}: {kind}-compressed; decompress it first and give the file itself")
    encoding = wide_encoding(data[:4])
    if encoding is not None:
        try:
            return data.decode(encoding)
        except UnicodeDecodeError as err:
            raise InputError(f"{name}: undecodable {encoding.upper()} (its first bytes are that encoding's): "
                             f"{err.reason}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{name}:{_line_of_offset(data, err.start)}: undecodable bytes (not UTF-8): {err.reason}"
            f"{encoding_hint(data)}"
        ) from None


def parse_json_document(text: str, name: str) -> Any:
    if not text.strip():
        raise InputError(f"{name}: empty (no JSON in it)")
    try:
        return jsonl.parse(text)
    except jsonl.JsonProblem as problem:
        where = f"{name}:{problem.line}" if problem.line else name
        # a whole object on line 1 and another after it: JSON Lines in a file named .json
        hint = ("; it reads as JSON Lines (one object a line): name it .jsonl" if str(problem).startswith("Extra data")
                and problem.line and problem.line > 1 and _each_line_json(text) else "")
        raise InputError(f"{where}: invalid JSON: {problem}{hint}") from None


def _each_line_json(text: str) -> bool:
    """Whether every non-blank line of `text` is a JSON value of its own (a JSON Lines document)."""
    try:
        return all(jsonl.parse(line) is not None for line in text.splitlines()[:50] if line.strip())
    except jsonl.JsonProblem:
        return False


def load_json(path: Path) -> Any:
    return parse_json_document(decode_document(path.read_bytes(), str(path)), str(path))


# A member is decompressed whole into memory; a few hundred bytes of a zip bomb can claim gigabytes.
MAX_MEMBER_BYTES_ENV = "POLYALIGN_MAX_ZIP_MEMBER_BYTES"
DEFAULT_MAX_MEMBER_BYTES = 2 << 30


def max_member_bytes() -> int:
    raw = os.environ.get(MAX_MEMBER_BYTES_ENV)
    try:
        return int(raw) if raw else DEFAULT_MAX_MEMBER_BYTES
    except ValueError:
        raise InputError(f"{MAX_MEMBER_BYTES_ENV}={raw!r}: expected a number of bytes") from None


def load_json_from_zip(path: Path, member_suffix: str = ".json") -> Iterator[tuple[str, Any]]:
    """Every JSON member of a zip archive, in archive order, as (display name, parsed document). An
    encrypted member, or one that decompresses to more than max_member_bytes(), is an error naming it."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise InputError(f"{path}: not a zip archive") from None
    limit = max_member_bytes()
    with archive:
        members = [m for m in archive.infolist() if m.filename.endswith(member_suffix)
                   and not m.filename.startswith("__MACOSX")]
        if not members:
            raise InputError(f"{path}: the archive holds no *{member_suffix} file")
        for member in members:
            name = f"{path}!{member.filename}"
            if member.flag_bits & 0x1:
                raise InputError(f"{name}: encrypted; polyalign reads unencrypted archives (unzip it first)")
            if member.file_size > limit:
                raise InputError(f"{name}: decompresses to {member.file_size:,} bytes, over the limit of {limit:,} "
                                 f"(set {MAX_MEMBER_BYTES_ENV} to read it)")
            with archive.open(member) as handle:
                data = handle.read(limit + 1)  # the header's size can lie; the stream cannot
            if len(data) > limit:
                raise InputError(f"{name}: decompresses to more than the limit of {limit:,} bytes "
                                 f"(set {MAX_MEMBER_BYTES_ENV} to read it)")
            yield member.filename, parse_json_document(decode_document(data, name), name)


_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def _byte_lines(handle, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a binary file split at LF, CRLF or a lone CR (classic Mac files), without the breaks.
    JSON strings cannot hold a raw CR or LF, so none of these can fall inside a JSON row."""
    pending = b""
    while chunk := handle.read(chunk_size):
        pending += chunk
        parts = _LINE_BREAK.split(pending[:-1] if pending.endswith(b"\r") else pending)
        pending = parts.pop() + (b"\r" if pending.endswith(b"\r") else b"")
        yield from parts
    if pending:
        yield from _LINE_BREAK.split(pending.rstrip(b"\r")) if pending.endswith(b"\r") else [pending]


def iter_text_lines(path: Path) -> Iterator[tuple[Location, str] | Malformed]:
    """Non-blank UTF-8 lines with their 1-based line numbers and 0-based row ordinals. Lines end with LF,
    CRLF or CR; a byte-order mark is valid; an undecodable line is reported as Malformed and reading
    goes on."""
    row = 0
    with path.open("rb") as handle:
        head = handle.read(6)
        if kind := compressed_kind(head):
            yield Malformed(Location(str(path), line=1, row=0), f"{kind}-compressed; decompress it first and give "
                                                                "the file itself", "")
            return
        if wide_encoding(head[:4]) is not None:
            yield from _wide_text_lines(path)
            return
        handle.seek(0)
        for number, raw in enumerate(_byte_lines(handle), start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            location = Location(str(path), line=number, row=row)
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                row += 1
                yield Malformed(location, f"undecodable bytes (not UTF-8): {err.reason}{encoding_hint(raw)}",
                                raw.decode("utf-8", "replace"))
                continue
            if line.strip():
                row += 1
                yield location, line


def _wide_text_lines(path: Path) -> Iterator[tuple[Location, str]]:
    """iter_text_lines for a UTF-16 or UTF-32 file: decoded whole (its lines are not byte lines)."""
    row = 0
    for number, line in enumerate(re.split(r"\r\n|\r|\n", decode_document(path.read_bytes(), str(path))), start=1):
        if line.strip():
            yield Location(str(path), line=number, row=row), line
            row += 1


def iter_json_lines(path: Path) -> Iterator[tuple[Location, Any] | Malformed]:
    """JSONL rows (see iter_text_lines); a line that does not parse is reported as Malformed."""
    for item in iter_text_lines(path):
        if isinstance(item, Malformed):
            yield item
            continue
        location, line = item
        try:
            value = jsonl.parse(line)
        except jsonl.JsonProblem as problem:
            # an indented JSON array (json.dump(rows, indent=2)) in a file named .jsonl
            hint = ("; the file looks like one JSON document written over many lines: name it .json"
                    if location.line == 1 and line.strip() in ("[", "{") else "")
            yield Malformed(location, f"invalid JSON: {problem}{hint}", line)
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            # json.dump(rows) without indent in a file named .jsonl: every row on line 1, no row would be read
            yield Malformed(location, f"a JSON array of {len(value)} rows on one line, where JSON Lines holds one "
                                      "row a line" + ("; name the file .json" if location.line == 1 else ""), line)
            continue
        yield location, value


def iter_json_rows(path: Path) -> Iterator[tuple[Location, Any] | Malformed]:
    """Rows of a JSON array file (1-based element numbers) or, for *.jsonl, of a JSON Lines file."""
    if path.suffix == ".jsonl":
        yield from iter_json_lines(path)
        return
    text = decode_document(path.read_bytes(), str(path))
    try:
        document = parse_json_document(text, str(path))
    except InputError:
        if not text.lstrip(" \t\r\n").startswith("["):
            raise
        yield from _rows_up_to_break(text, path)
        return
    if not isinstance(document, list):
        raise InputError(f"{path}: expected a JSON array of rows, got {type(document).__name__}")
    for number, row in enumerate(document, start=1):
        yield Location(str(path), element=number, row=number - 1), row


# What a quarantine row keeps of an array's unreadable rest: enough to recognise it, not the file again.
BROKEN_TAIL_CHARS = 2000


def _rows_up_to_break(text: str, path: Path) -> Iterator[tuple[Location, Any] | Malformed]:
    """The rows of a JSON array file that stops parsing part-way, up to where it breaks, then one Malformed
    for the rest: quarantine keeps the rows that are whole and says what was lost; fail mode stops there,
    naming the line. The rows after a syntax error cannot be told apart, so they are one quarantine row; a row
    that is JSON but not strict JSON (NaN, a repeated key) is quarantined alone."""
    try:
        for number, row in enumerate(jsonl.array_elements(text), start=1):
            location = Location(str(path), element=number, row=number - 1)
            if isinstance(row, jsonl.ElementProblem):  # JSON, not strict JSON: this row alone
                yield Malformed(location, f"invalid JSON: {row}", text[row.start:row.end])
            else:
                yield location, row
    except jsonl.ArrayBreak as stop:
        read = stop.element - 1
        before = f"rows 1-{read} were read" if read > 1 else "row 1 was read" if read == 1 else "no row was read"
        lines = counted(text.count("\n", stop.start) + 1, "line")
        last_line = text.count("\n") + 1
        after = f"after row {read}" if read else "after its opening '['"
        problem = {
            "cut": f"the file ends inside row {stop.element}, at line {last_line:,} (cut off?); {before}"
                   if text[stop.start:].strip(" \t\r\n,") else
                   f"the file ends {after}, without the array's closing ']' (cut off?); {before}",
            "invalid": f"invalid JSON in row {stop.element} ({stop}); {before}, and the {lines} from this row to the "
                       "end cannot be split into rows",
            "extra": f"{stop}; {before}; what follows ({lines}) is not part of the array",
        }[stop.kind]
        tail = text[stop.start:]
        raw = tail if len(tail) <= BROKEN_TAIL_CHARS else f"{tail[:BROKEN_TAIL_CHARS]}... ({len(tail):,} characters)"
        line = text.count("\n", 0, stop.start) + 1
        yield Malformed(Location(str(path), line=line, element=stop.element, row=stop.element - 1), problem, raw)


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def require_dict(value: Any, what: str = "row") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RowProblem(f"{what} must be a JSON object, got {type_name(value)}")
    return value


def text_field(obj: dict[str, Any], key: str, *, default: str | None = None, what: str | None = None) -> str:
    """A string field. Missing uses `default` when given; null or a non-string is always an error."""
    label = what or f"field {key!r}"
    if key not in obj:
        if default is not None:
            return default
        raise RowProblem(f"missing {label}")
    value = obj[key]
    if value is None:
        if default is not None:
            return default
        raise RowProblem(f"{label} is null")
    if not isinstance(value, str):
        raise RowProblem(f"{label} must be a string, got {type_name(value)}")
    return value


def list_field(obj: dict[str, Any], key: str, *, optional: bool = False) -> list[Any]:
    if key not in obj or (optional and obj[key] is None):
        if optional:
            return []
        raise RowProblem(f"missing field {key!r}")
    value = obj[key]
    if not isinstance(value, list):
        raise RowProblem(f"field {key!r} must be a list, got {type_name(value)}")
    return value


def string_labels(obj: dict[str, Any], names: dict[str, str]) -> dict[str, str]:
    """The row's own bucket labels, renamed to record field names (e.g. style_bucket -> style)."""
    labels: dict[str, str] = {}
    for source_name, field_name in names.items():
        value = obj.get(source_name)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise RowProblem(f"label {source_name!r} must be a string, got {type_name(value)}")
        labels[field_name] = value
    return labels


def map_role(role: Any, roles: dict[str, str], where: str) -> str:
    if not isinstance(role, str):
        raise RowProblem(f"{where}: role must be a string, got {type_name(role)}")
    try:
        return roles[role.strip().lower()]
    except KeyError:
        raise RowProblem(f"{where}: unknown role {role!r} (expected one of {', '.join(sorted(roles))})") from None


def dump_raw(row: Any) -> str:
    try:
        return json.dumps(row, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(row)


def parse_rows(
    rows: Iterator[tuple[Location, Any] | Malformed],
    parse: Callable[[Any, Location], Iterator[ImportItem]],
) -> Iterator[ImportItem]:
    """Apply a row parser; a RowProblem anywhere in a row (or a dialogue) makes the whole row Malformed."""
    for item in rows:
        if isinstance(item, Malformed):
            yield item
            continue
        location, row = item
        try:
            parsed = list(parse(row, location))
        except RowProblem as problem:
            yield Malformed(location, str(problem), dump_raw(row))
            continue
        yield from parsed


Turn = dict[str, str]


def labelled_turns(messages: list[Any], roles: dict[str, str], role_key: str, text_key: str,
                   what: str = "message") -> list[Turn]:
    """Turns of a dialogue whose messages name their speaker, e.g. {"role": "usr", "content": ...}."""
    turns = []
    for i, message in enumerate(messages, start=1):
        message = require_dict(message, f"{what} {i}")
        turns.append({
            "role": map_role(message.get(role_key), roles, f"{what} {i}"),
            "text": text_field(message, text_key, what=f"{what} {i} {text_key!r}"),
        })
    return turns


def conversation_track(history: Sequence[Turn]) -> str:
    """`multi` when the record has earlier user or assistant turns, else `single` (system turns do not count)."""
    return "multi" if any(t["role"] in ("user", "assistant") for t in history) else "single"


def join_runs(turns: Sequence[Turn]) -> list[Turn]:
    """Consecutive turns of one role as one turn, texts joined by a newline: two assistant messages in a
    row are one reply (a record's context never loses the first). System turns are never joined with
    a neighbour of another role. A joined turn keeps the source position (`index`) of its first message."""
    out: list[Turn] = []
    for k, turn in enumerate(turns):
        turn = {"index": k, **turn}
        if out and out[-1]["role"] == turn["role"] and not out[-1].get("tool") and not turn.get("tool"):
            joined = {**out[-1], "text": f"{out[-1]['text']}\n{turn['text']}"}
            if not turn.get("untrained"):  # one reply: trained unless every part of it is marked weight 0
                joined.pop("untrained", None)
            out[-1] = joined
        else:
            out.append(turn)
    return out


# OpenAI content parts that carry text (chat completions: text; the Responses API: input_text, output_text).
TEXT_PARTS = ("text", "input_text", "output_text")


def content_text(value: Any, where: str) -> tuple[str, list[str]]:
    """A message's content as text, and the kinds of the non-text parts left out: a string is itself;
    a list of content parts gives its text parts joined by a newline (an image, audio or file part
    is left out and named); null is empty (an assistant turn that only calls a tool)."""
    if value is None:
        return "", []
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise RowProblem(f"{where} content must be a string, a list of content parts or null, got {type_name(value)}")
    texts, dropped = [], []
    for i, part in enumerate(value, start=1):
        if isinstance(part, str):
            texts.append(part)
            continue
        part = require_dict(part, f"{where} content part {i}")
        kind = part.get("type")
        if kind in TEXT_PARTS or (kind is None and "text" in part):
            texts.append(text_field(part, "text", what=f"{where} content part {i} 'text'"))
        else:
            dropped.append(str(kind) if isinstance(kind, str) and kind else "untyped")
    return "\n".join(texts), dropped


def message_turns(messages: list[Any], roles: dict[str, str], role_key: str, text_key: str, what: str,
                  location: Location, tool_roles: Sequence[str] = ("tool",),
                  call_roles: Sequence[str] = ()) -> tuple[list[Turn], list[Notice]]:
    """Turns of an exported conversation (OpenAI chat messages, ShareGPT turns): roles mapped by `roles`
    (`developer` is a system role), content as `content_text` reads it. A tool's answer (a role in
    `tool_roles`) and an assistant turn that calls a tool (`tool_calls` or `function_call`, or a role in
    `call_roles`) are kept as turns marked `tool`, which project_dialogue never renders. The notices
    count the content parts left out, by kind."""
    turns: list[Turn] = []
    dropped: Counter = Counter()
    for i, message in enumerate(messages, start=1):
        message = require_dict(message, f"{what} {i}")
        role = map_role(message.get(role_key), roles, f"{what} {i}")
        if text_key not in message:
            raise RowProblem(f"missing {what} {i} {text_key!r}")
        text, left_out = content_text(message[text_key], f"{what} {i}")
        dropped.update(left_out)
        raw_role = str(message.get(role_key)).strip().lower()
        calls = bool(message.get("tool_calls") or message.get("function_call")) or raw_role in call_roles
        weight = message.get("weight", 1)  # OpenAI's fine-tuning files: 0 marks an assistant turn not to learn
        if role == "assistant" and (isinstance(weight, bool) or weight not in (0, 1)):
            raise RowProblem(f"{what} {i} 'weight' must be 0 or 1 (0: not trained on), got {weight!r}")
        if role in tool_roles:
            turns.append({"role": "tool", "text": text, "tool": True})
        elif calls:
            turns.append({"role": "assistant", "text": text, "tool": True})
        elif message[text_key] is None:
            raise RowProblem(f"{what} {i} {text_key!r} is null")
        else:
            turns.append({"role": role, "text": text, **({"untrained": True} if role == "assistant" and weight == 0
                                                          else {})})
    notices = [Notice(location, f"content_part_dropped:{kind}", n) for kind, n in sorted(dropped.items())]
    return turns, notices


def project_dialogue(
    turns: Sequence[Turn],
    dialogue_id: str,
    location: Location,
    *,
    group: str | None = None,
    split: str | None = None,
    labels: dict[str, str] | None = None,
    meta: dict[str, Any] | None = None,
    context_of: Callable[[int], str] | None = None,
) -> Iterator[Example | Skipped | Notice]:
    """Multi-turn projection (METHOD.md section 1): every assistant turn with at least one earlier user
    or assistant turn becomes a record; question = the latest user turn before it; history = every
    turn before that user turn, then the turns standing between the question and the reply (system notes,
    and an earlier reply a note interrupted), marked AFTER_QUESTION (rendered after the question, where they
    stood). Consecutive turns of one role
    are joined first (`join_runs`). Task-dialogue importers map the system agent to `assistant`, so
    only its turns are targets.

    The record's key is `<dialogue id>-turn-<k>` with k the source position of the reply's first
    message: it names the turn itself, not how many records came before it. Its derived track is
    `multi` when its history holds a user or assistant turn. A turn marked `tool` (a tool call, a tool's
    answer) is never rendered: a record whose reply is one is skipped as `tool_call`, and a record with
    one before its reply as `after_tool_call`; a reply marked `untrained` (OpenAI's `"weight": 0`) is skipped
    as `weight_0`, and stays in the history of the replies after it. A conversation that ends with user turns after its
    last reply has nothing to learn from them: they are counted as a Notice (`unanswered_last_user_turn`),
    never lost without a word, and so is a reply that opens the conversation before anyone asked
    (`reply_before_any_question`: no record trains it, the later ones keep it as context); one with no
    reply at all is skipped as `no_reply`."""
    turns = join_runs(turns)
    replies = [k for k, turn in enumerate(turns)
               if turn["role"] == "assistant" and any(t["role"] in ("user", "assistant") for t in turns[:k])]
    if not replies:
        # well-formed, and common in real chat logs (a question nobody answered, `messages: []`): nothing to
        # learn from, so dropped with its reason and listed, rather than stopping the run as malformed
        yield Skipped(location, "no_reply", dialogue_id)
        return
    targets = [k for k, t in enumerate(turns) if t["role"] == "assistant"]
    if any(t["role"] == "user" for t in turns[targets[-1] + 1:]):
        yield Notice(location, "unanswered_last_user_turn")
    if targets[0] not in replies:  # a greeting before the user speaks: context of the replies after it
        yield Notice(location, "reply_before_any_question")
    conversation = "\n".join(t["text"] for t in turns if t["role"] in ("user", "assistant") and not t.get("tool"))
    for k, turn in enumerate(turns):
        if k not in replies:
            continue
        key = f"{dialogue_id}-turn-{turn['index']}"
        if turn.get("tool"):
            yield Skipped(location, "tool_call", key=key, response=turn["text"])
            continue
        if any(t.get("tool") for t in turns[:k]):
            yield Skipped(location, "after_tool_call", key=key, response=turn["text"])
            continue
        if turn.get("untrained"):  # weight 0: kept as the history of later replies, never a target itself
            yield Skipped(location, "weight_0", key=key, response=turn["text"])
            continue
        user_index = next((i for i in range(k - 1, -1, -1) if turns[i]["role"] == "user"), None)
        question = turns[user_index]["text"] if user_index is not None else ""
        before = turns[: user_index if user_index is not None else k]
        # what stood between the question and the reply: system notes, and an earlier reply that a note
        # interrupted (user, reply, note, reply: the second reply goes on from the first, which it keeps)
        between = turns[user_index + 1:k] if user_index is not None else []
        history = [{"role": t["role"], "text": t["text"]} for t in before]
        history += [{"role": t["role"], "text": t["text"], AFTER_QUESTION: True} for t in between]
        yield Example(
            question=question,
            response=turn["text"],
            context=context_of(turn["index"]) if context_of else "",
            history=history,
            key=key,
            location=location,
            labels=dict(labels or {}),
            split=split,
            group=group if group is not None else dialogue_id,
            meta={**(meta or {}), "dialogue_id": dialogue_id, "turn": turn["index"]},
            derived={"track": conversation_track(history)},
            conversation=conversation,
            opens_conversation=k == replies[0] and len(replies) > 1,
        )


def alternating_turns(utterances: Sequence[Any], where: str) -> list[Turn]:
    """Human-human chat without speaker labels: the first speaker is the user, then turns alternate."""
    turns = []
    for i, utterance in enumerate(utterances):
        if not isinstance(utterance, str):
            raise RowProblem(f"{where}: utterance {i + 1} must be a string, got {type_name(utterance)}")
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "text": utterance})
    return turns
