"""Users' own chat exports in the shapes they come in (OpenAI chat messages, ShareGPT), made from real
text of the bundled demo data: CamRest676 dialogues (English) and CrossWOZ dialogues (Chinese) as the
conversations, each dialogue's own task description (CamRest's goal, CrossWOZ's `task description`)
as its system messages, CMRC 2018 questions as single-turn Chinese rows.

tools/make_fixtures.py renders the same conversations with transformers for the parity fixtures, so
both build them here.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import re
import zipfile
from pathlib import Path

DEMO_DATA = Path(__file__).resolve().parents[1] / "polyalign" / "demo_data"


@functools.cache
def _zipped_json(archive: str, member: str):
    """A bundled JSON document, parsed once per process (CrossWOZ's takes a third of a second, and the
    engine, serve and chat tests ask for it again and again)."""
    return json.loads(zipfile.ZipFile(DEMO_DATA / archive).read(member))


def camrest_dialogues(n: int, start: int = 0) -> list[dict]:
    return copy.deepcopy(_zipped_json("en/camrest676/data.zip", "data/dialogues.json")[start:start + n])


def crosswoz_dialogues(n: int, start: int = 0) -> list[tuple[str, dict]]:
    document = _zipped_json("zh/crosswoz/val.json.zip", "val.json")
    return copy.deepcopy(list(document.items())[start:start + n])


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?。！？])\s*", text) if s.strip()]


def camrest_goal(dialogue: dict) -> list[str]:
    """The dialogue's goal description without its "Task 11193:" number, as sentences."""
    return sentences(re.sub(r"^Task \d+:\s*", "", dialogue["goal"]["description"]))


def crosswoz_tasks(dialogue: dict) -> list[str]:
    tasks = dialogue["task description"]
    return [t for t in (ast.literal_eval(tasks) if isinstance(tasks, str) else tasks) if t.strip()]


def camrest_messages(dialogue: dict, turns: int | None = None) -> list[dict]:
    return [{"role": "user" if t["speaker"] == "user" else "assistant", "content": t["utterance"]}
            for t in dialogue["turns"][:turns]]


def crosswoz_messages(dialogue: dict, turns: int | None = None) -> list[dict]:
    return [{"role": "user" if m["role"] == "usr" else "assistant", "content": m["content"]}
            for m in dialogue["messages"][:turns]]


def openai_rows() -> list[dict]:
    """An OpenAI chat export: every conversation opens with a system message, no language or track on
    the rows; English and Chinese; single- and multi-turn mixed; one with a mid-conversation system
    message, one with the `developer` role, one with content-part lists."""
    rows = []
    for i, dialogue in enumerate(camrest_dialogues(4)):
        goal = camrest_goal(dialogue)
        messages = [{"role": "system", "content": goal[0]}]
        if i == 0:  # multi-turn, the goal's last sentence given as a system message mid-conversation
            body = camrest_messages(dialogue, 6)
            messages += body[:2] + [{"role": "system", "content": goal[-1]}] + body[2:]
        elif i == 1:  # single-turn
            messages += camrest_messages(dialogue, 2)
        elif i == 2:  # developer role, content-part lists
            messages[0]["role"] = "developer"
            for message in camrest_messages(dialogue, 4):
                words = message["content"].split(". ", 1)
                parts = [{"type": "text", "text": w} for w in words]
                messages.append({**message, "content": parts})
        else:
            messages += camrest_messages(dialogue, 8)
        rows.append({"id": dialogue["dialogue_id"], "messages": messages})
    for i, (dialogue_id, dialogue) in enumerate(crosswoz_dialogues(3)):
        tasks = crosswoz_tasks(dialogue)
        messages = [{"role": "system", "content": tasks[0]}]
        if i == 0:
            body = crosswoz_messages(dialogue, 6)
            messages += body[:4] + [{"role": "system", "content": tasks[1]}] + body[4:]
        elif i == 1:
            messages += crosswoz_messages(dialogue, 2)
        else:
            messages += crosswoz_messages(dialogue, 6)
        rows.append({"id": f"crosswoz-{dialogue_id}", "messages": messages})
    return rows


def tool_row() -> dict:
    """A conversation whose assistant looks the restaurant up with a tool before answering: the tool's
    arguments and answer are the user's dialogue state CamRest records for that turn."""
    dialogue = camrest_dialogues(1, start=5)[0]
    body = camrest_messages(dialogue, 6)
    state = json.dumps(dialogue["turns"][0]["state"]["restaurant"])
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "restaurant_state", "arguments": state}}]}
    tool = {"role": "tool", "tool_call_id": "call_0", "content": state}
    return {"id": dialogue["dialogue_id"], "messages": [
        {"role": "system", "content": camrest_goal(dialogue)[0]}, *body[:2], *body[2:3], call, tool, *body[3:]]}


def sharegpt_rows() -> list[dict]:
    """ShareGPT rows of the same conversations: the system message in the `system` field."""
    rows = []
    for dialogue in camrest_dialogues(2, start=10):
        rows.append({"system": camrest_goal(dialogue)[0], "conversations": [
            {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
            for m in camrest_messages(dialogue, 4)]})
    return rows


def write_jsonl(path: Path, rows: list[dict], newline: str = "\n") -> Path:
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + newline for r in rows).encode("utf-8"))
    return path
