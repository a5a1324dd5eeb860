"""Strict JSON for everything polyalign reads: what Python's json module lets through but no other JSON
reader accepts, or what would make polyalign's own output invalid, is refused with the reason.

- NaN and Infinity are not JSON: a row carrying them (or a number too large for a float, which
  becomes Infinity) would be written back out as invalid JSON.
- A repeated key in one object: which value wins differs between readers, so the row is ambiguous.
- Lone UTF-16 surrogates (`"\\ud800"`) cannot be written as UTF-8.
- Nesting deeper than Python's recursion limit, and integers too long to convert, fail inside the
  parser with errors that name nothing; here they are reasons like the others.
JSON Lines are split on "\\n" only: U+2028, U+0085 and a lone "\\r" are characters inside strings.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.core.errors import JsonProblem


def refuse_constant(name: str) -> Any:
    raise JsonProblem(f"{name} is not a JSON number")


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonProblem(f"{text[:20]} does not fit a float (it would be written back as Infinity)")
    return value


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        repeated = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JsonProblem(f"key {repeated!r} appears twice in one object")
    return obj


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


LONE_SURROGATE = "a lone UTF-16 surrogate escape (not a character)"


def holds_lone_surrogate(text: str, value: Any) -> bool:
    """Whether `value`, parsed from `text`, holds a lone surrogate (only an escape in the text can make one)."""
    return "\\ud" in text.lower() and _has_lone_surrogate(value)


def parse(text: str) -> Any:
    """json.loads, strictly (see the module's doc); JsonProblem (or json.JSONDecodeError, a subclass of
    ValueError too) says why not."""
    try:
        value = json.loads(text, parse_constant=refuse_constant, parse_float=finite_float,
                           object_pairs_hook=unique_keys)
    except RecursionError:
        raise JsonProblem("nested too deeply") from None
    except json.JSONDecodeError as err:
        raise JsonProblem(f"{err.msg} (column {err.colno})", line=err.lineno) from None
    except JsonProblem:
        raise
    except ValueError as err:  # an integer of more digits than Python converts
        raise JsonProblem(str(err).split(";")[0]) from None
    if holds_lone_surrogate(text, value):
        raise JsonProblem(LONE_SURROGATE)
    return value


_STRICT = json.JSONDecoder(parse_constant=refuse_constant, parse_float=finite_float, object_pairs_hook=unique_keys)
_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's four, as the json module skips them


class ArrayBreak(JsonProblem):
    """Where a JSON array document stops parsing. `element` (1-based) is the element it breaks in, `start`
    the offset that element starts at (the text's end where text follows the array), `line` the line of
    the problem itself; `kind` is "cut" (the text ends inside the array: a file cut off), "invalid" (a
    syntax error inside it) or "extra" (text after the array's closing bracket)."""

    def __init__(self, message: str, line: int, element: int, start: int, kind: str):
        super().__init__(message, line=line)
        self.element, self.start, self.kind = element, start, kind


class ElementProblem(JsonProblem):
    """An element of a JSON array that is JSON but not strict JSON (NaN, a repeated key, a lone surrogate, an
    integer too long): array_elements yields it in the element's place, text[start:end], and goes on."""

    def __init__(self, message: str, line: int, element: int, start: int, end: int):
        super().__init__(message, line=line)
        self.element, self.start, self.end = element, start, end


# Reads where an element ends without judging its values: no number is converted, a repeated key is kept.
_LENIENT = json.JSONDecoder(parse_int=len, parse_float=len, parse_constant=len)


def _element_problem(text: str, index: int, element: int, message: str, line: int) -> tuple[ElementProblem, int]:
    try:
        _, end = _LENIENT.raw_decode(text, index)
    except RecursionError:
        raise ArrayBreak("nested too deeply", line, element, index, "invalid") from None
    return ElementProblem(message, line, element, index, end), end


def array_elements(text: str) -> Iterator[Any]:
    """The elements of a JSON array document one at a time, each parsed as parse() parses; an element that
    is JSON but not strict JSON comes as an ElementProblem in its place; ArrayBreak after the last element
    where the document breaks off (its syntax). For a file cut off part-way (a download or a write
    interrupted) or broken by a hand edit, whose complete rows are still the user's."""

    def line_at(index: int) -> int:
        return text.count("\n", 0, index) + 1

    def ends_after(index: int) -> bool:
        return _WHITESPACE.match(text, index).end() >= len(text)

    index = _WHITESPACE.match(text).end()
    if text[index:index + 1] != "[":
        raise ArrayBreak("not a JSON array", line_at(index), 1, index, "invalid")
    index = _WHITESPACE.match(text, index + 1).end()
    element = 1
    if text[index:index + 1] == "]":
        index += 1
    else:
        while True:
            try:
                value, end = _STRICT.raw_decode(text, index)
            except json.JSONDecodeError as err:
                # the scanner says "Unterminated string" only where the text ends before the closing quote
                cut = ends_after(err.pos) or err.msg.startswith("Unterminated string")
                raise ArrayBreak(f"{err.msg} (line {err.lineno}, column {err.colno})", err.lineno, element, index,
                                 "cut" if cut else "invalid") from None
            except RecursionError:
                raise ArrayBreak("nested too deeply", line_at(index), element, index, "invalid") from None
            except ValueError as err:  # JsonProblem (NaN, a repeated key) or an integer too long to convert
                value, end = _element_problem(text, index, element, str(err).split(";")[0], line_at(index))
            if holds_lone_surrogate(text[index:end], value):
                value = ElementProblem(LONE_SURROGATE, line_at(index), element, index, end)
            yield value
            after = _WHITESPACE.match(text, end).end()
            separator = text[after:after + 1]
            if separator == "]":
                index = after + 1
                break
            if separator != ",":
                kind = "cut" if not separator else "invalid"
                raise ArrayBreak("the text ends inside the array" if kind == "cut" else
                                 f"expected ',' or ']' after an element (line {line_at(after)})",
                                 line_at(after), element + 1, after, kind)
            index = _WHITESPACE.match(text, after + 1).end()
            element += 1
    if not ends_after(index):
        extra = _WHITESPACE.match(text, index).end()
        raise ArrayBreak(f"text after the array's closing bracket (line {line_at(extra)})", line_at(extra),
                         element + 1, extra, "extra")


# The first bytes of the archives a user might hand over for a JSON file ("export.jsonl.gz", a .zip from
# a web download): said as what they are, not as undecodable bytes on line 1.
COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"PK\x03\x04", "zip"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bzip2"),
              (b"\x28\xb5\x2f\xfd", "zstd"))


def compressed_kind(head: bytes) -> str | None:
    """"gzip", "zip", ... when a file's first bytes are that archive's."""
    return next((kind for magic, kind in COMPRESSED if head.startswith(magic)), None)


def wide_encoding(head: bytes) -> str | None:
    """"utf-16", "utf-32" (with a byte-order mark) or "utf-16-le" ... (without one) when a text file's first
    bytes are UTF-16 or UTF-32, else None. Without a mark the NULs of the first four bytes tell, as JSON's
    encoding detection does (RFC 4627, json.detect_encoding): a file's first characters are ASCII (`{`,
    `[`, a letter), which these encodings pad with NULs, and UTF-8 text holds no NUL. Windows tools write
    UTF-16 with a mark; some exporters without."""
    encoding = json.detect_encoding(head[:4]) if len(head) >= 4 else "utf-8"
    return None if encoding in ("utf-8", "utf-8-sig") else encoding


def read_text_file(path: str | Path, what: str = "file") -> str:
    """A text file's text: UTF-8 (a byte-order mark allowed), or UTF-16/32 (wide_encoding). A missing file,
    a folder, an archive or other bytes are one JsonProblem naming the file (no traceback)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise JsonProblem(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise JsonProblem(f"{path}: a folder, not a {what}") from None
    except OSError as err:
        raise JsonProblem(f"{path}: cannot be read ({err.strerror})") from None
    if kind := compressed_kind(data[:6]):
        raise JsonProblem(f"{path}: {kind}-compressed; decompress it first and give the JSON file itself")
    encoding = wide_encoding(data[:4]) or "utf-8-sig"
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise JsonProblem(f"{path}:{line}: not {encoding.replace('-sig', '').upper()} text ({err.reason}); save it "
                          "as UTF-8") from None


def read_lines(path: str | Path, what: str = "JSON Lines file") -> Iterator[tuple[int, Any]]:
    """(line number, value) for every non-blank line of a JSON Lines file; a line that is not strict
    JSON, or a file that is no such text (read_text_file), raises JsonProblem naming the file and line."""
    path = Path(path)
    text = read_text_file(path, what)
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield number, parse(line)
        except JsonProblem as problem:
            raise JsonProblem(f"{path}:{number}: {problem}", line=number) from None
