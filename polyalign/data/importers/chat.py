"""Chat JSONL, the common export format (OpenAI chat messages): one conversation per line,
{"id"?: str, "messages": [{"role", "content"}], "language"?, "track"?, "family"?, "style"?}. TRL's
prompt-completion rows read as the same conversation: {"prompt", "completion"} as message lists (its
conversational form: the prompt's messages, then the completion's) or as strings (a user turn, then an
assistant turn).

Roles: system, developer (a system role), user, assistant, tool. Content is a string, a list of
content parts (text parts joined by a newline; image, audio and file parts left out and counted as
`content_part_dropped:<type>`) or null (an assistant turn that only calls a tool). Every assistant
turn after a user or assistant turn is a target. The system messages that open the conversation are
the records' system prompt (history turns of role system, composed with the profile prompt by
`record_messages`); a later system message stays a system turn where it stands. Assistant turns that
call tools and tool messages are never rendered: their records are skipped as `tool_call`, and the
records after them as `after_tool_call`. Each record's track is derived from its own history
(multi when earlier user/assistant turns exist) unless the row or the data config says otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers.reading import (
    iter_json_rows,
    list_field,
    message_turns,
    parse_rows,
    project_dialogue,
    require_dict,
    string_labels,
    type_name,
)
from polyalign.data.records import ImportItem, Location, RowProblem

PATTERNS = ("*.jsonl", "*.json")
DEFAULTS = {"track": "single", "family": "assistant", "style": "assistant_like"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system", "tool": "tool",
         "function": "tool"}
ROW_LABELS = {"language": "language", "track": "track", "family": "family", "style": "style"}


# A conversation without an id is numbered by its row, across the source's files (read_file passes `offset`, the
# rows of its earlier files), as row sources number theirs: two exports' first rows are other conversations.
ROW_NUMBERED = True


def dialogue_id(row: dict[str, Any], location: Location, offset: int = 0) -> str:
    value = row.get("id")
    if value is None:
        return f"{offset + location.row:06d}"
    if not isinstance(value, (str, int)) or isinstance(value, bool) or not str(value).strip():
        raise RowProblem("'id' must be a non-empty string or an integer")
    return str(value).strip()


def project(row: dict[str, Any], location: Location, turns: list[dict[str, str]], offset: int = 0
            ) -> Iterator[ImportItem]:
    yield from project_dialogue(turns, dialogue_id(row, location, offset), location,
                                labels=string_labels(row, ROW_LABELS))


def _messages(row: dict[str, Any]) -> list[Any]:
    """The row's messages: `messages`, or TRL's prompt and completion (lists of messages, or strings)."""
    if "messages" in row or not {"prompt", "completion"} <= set(row):
        return list_field(row, "messages")
    parts = []
    for key, role in (("prompt", "user"), ("completion", "assistant")):
        value = row[key]
        if isinstance(value, str):
            parts.append({"role": role, "content": value})
        elif isinstance(value, list):
            parts.extend(value)
        else:
            raise RowProblem(f"'{key}' must be a string or a list of messages, got {type_name(value)}")
    return parts


def _parse(row: Any, location: Location, offset: int = 0) -> Iterator[ImportItem]:
    row = require_dict(row)
    turns, notices = message_turns(_messages(row), ROLES, "role", "content", "message", location,
                                   tool_roles=("tool",))
    yield from notices
    yield from project(row, location, turns, offset)


def read(path: Path, file_tag: str, offset: int = 0) -> Iterator[ImportItem]:
    return parse_rows(iter_json_rows(path), functools.partial(_parse, offset=offset))
