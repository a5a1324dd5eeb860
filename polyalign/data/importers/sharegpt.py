"""ShareGPT: a JSON array (or JSONL) of {"id"?, "system"?, "conversations": [{"from", "value"}]}.

`from` is human/user, gpt/assistant (and the usual model names), system, or LLaMA-Factory's tool roles
(function_call: an assistant turn calling a tool; observation, tool, function: a tool's answer). The
`system` field and system turns that open the conversation are the records' system prompt, as in the
`chat` format, whose rules (content parts, tool turns, derived track, record keys) apply here too;
the turn numbers in keys count `conversations` entries. A row whose turns all carry `role`/`content`
instead of `from`/`value` (as some exports write them) is read by those keys.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyalign.data.importers.chat import project
from polyalign.data.importers.reading import (
    iter_json_rows,
    list_field,
    message_turns,
    parse_rows,
    require_dict,
    text_field,
)
from polyalign.data.records import ImportItem, Location, RowProblem

PATTERNS = ("*.json", "*.jsonl")
DEFAULTS = {"track": "single", "family": "assistant", "style": "assistant_like"}
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "system": "system", "developer": "system",
    "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool",
}


ROW_NUMBERED = True  # as chat's: a conversation without an id is numbered across the source's files


def _parse(row: Any, location: Location, offset: int = 0) -> Iterator[ImportItem]:
    row = require_dict(row)
    system = text_field(row, "system", default="")
    messages = list_field(row, "conversations")
    # some exports write OpenAI's keys inside `conversations` (LLaMA-Factory's role_tag/content_tag): read them
    # where no turn has ShareGPT's own
    openai_keyed = [i for i, m in enumerate(messages, start=1)
                    if isinstance(m, dict) and "role" in m and "from" not in m]
    keys = ("role", "content") if messages and len(openai_keyed) == len(messages) else ("from", "value")
    if openai_keyed and any(isinstance(m, dict) and "from" in m for m in messages):  # two exports' turns in one
        raise RowProblem(f"turn {openai_keyed[0]} is written with 'role'/'content', other turns with "
                         "'from'/'value': write every turn of a conversation with one pair of keys")
    turns, notices = message_turns(messages, ROLES, *keys, "turn", location, tool_roles=("tool",),
                                   call_roles=("function_call",))
    turns = [{**turn, "index": k} for k, turn in enumerate(turns)]
    if system:
        turns.insert(0, {"role": "system", "text": system, "index": -1})
    yield from notices
    yield from project(row, location, turns, offset)


def read(path: Path, file_tag: str, offset: int = 0) -> Iterator[ImportItem]:
    return parse_rows(iter_json_rows(path), functools.partial(_parse, offset=offset))
