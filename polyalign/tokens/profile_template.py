"""The profile preamble of an exported chat template: Jinja, written before the template training
used, that composes polyalign's profile system prompt from template variables with the conversation's
own system messages as the build composed them (model/export.py writes it). polyalign's own rendering
composes in Python (chat.record_messages, chat.with_system_prompt) and renders the training template
alone: a checkpoint's template is read without its preamble, or a conversation already composed would
be composed twice (under `replace` and `drop`, the profile prompt dropped as one of its system
messages)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from polyalign.data.records import PROFILE_PREAMBLE

PROFILE_KEYS = ("family", "track", "style", "length")  # the order the profile prompt names them in
# The profile prompts a model can be trained with (chat.profile_prompt), and how a conversation's own
# system messages compose with it (docs/model.md, "System messages"): keep: the source's text, a blank
# line, the profile prompt; replace: the profile prompt alone (the source's leading system text is not
# shown; later system turns stay); drop: every system turn of the source left out, the profile prompt
# alone. A checkpoint's tokenizer config names both (polyalign_profile, polyalign_system).
PROFILE_MODES = ("context", "oracle", "none")  # context: the default
SYSTEM_MODES = ("keep", "replace", "drop")
# How a prompt over its share of a cutoff is cut (chat.encode_conversation): left, from its very start;
# keep_system, after the system message that opens it; turns, by its oldest whole turns (the opening system
# message kept), as generation cuts a prompt. Here, beside the modes, so that the command line
# and the config schema name them without importing the tokenisers.
TRUNCATIONS = ("left", "keep_system", "turns")
# Why a cut example lost its opening system message, by truncation (chat.encode_conversation): what a build's
# line and a preference run's note say; `{option}` is how the command spells the setting.
SYSTEM_LOST_WHY = {"left": "{option}left cuts a prompt from its start, the system message first; {option}turns "
                           "would keep it where it and the last question fit the prompt's share",
                   "keep_system": "it took over half of the prompt's share",
                   "turns": "it and the last question together were over the prompt's share, and a cut inside a "
                            "turn keeps the system message only within half of the share"}
# The template variables each profile names (the oracle profile adds the answer's length bin).
PROFILE_MODE_KEYS = {"context": PROFILE_KEYS[:3], "oracle": PROFILE_KEYS, "none": ()}
# A record's field for each profile key.
PROFILE_FIELDS = {"family": "family", "track": "track", "style": "style", "length": "length_bin"}

# Written before the training template: polyalign's profile system prompt from template variables,
# composed with the conversation's own leading system messages as build composed them (SYSTEM_MODES):
# keep: their text (joined by a newline), a blank line, the profile prompt; replace: the profile prompt
# alone; drop: the profile prompt alone and no system message anywhere. Without profile variables the
# prompt is only the conversation's own (keep) or nothing. Then consecutive messages of one role are
# joined with a newline, as training joined them.
_PREAMBLE_HEAD = (
    "{#- polyalign: the system prompt the model was trained with: the profile prompt from the template variables\n"
    "    family, track, style (and length for the oracle profile), composed with the conversation's own leading\n"
    "    system messages as training composed them (system mode: %s). -#}\n"
    "{%%- set polyalign_profile = namespace(parts=[], lead=0, texts=[]) -%%}\n"
    + "".join(f"{{%%- if {key} is defined and {key} -%%}}"
              f"{{%%- set polyalign_profile.parts = polyalign_profile.parts + ['{key}=' + {key}]"
              " -%%}{%%- endif -%%}\n" for key in PROFILE_KEYS)
    + "{%%- for message in messages -%%}\n"
    "    {%%- if message['role'] == 'system' and polyalign_profile.lead == loop.index0 -%%}\n"
    "        {%%- set polyalign_profile.lead = polyalign_profile.lead + 1 -%%}\n"
    "        {%%- set polyalign_profile.texts = polyalign_profile.texts + [message['content']] -%%}\n"
    "    {%%- endif -%%}\n"
    "{%%- endfor -%%}\n"
    "{%%- set polyalign_system = %s -%%}\n"
    "{%%- if polyalign_profile.parts -%%}\n"
    "    {%%- set polyalign_system = (polyalign_system + '\\n\\n' if polyalign_system else '') + "
    f"'{PROFILE_PREAMBLE} ' + polyalign_profile.parts | join('; ') + '.' -%%}}\n"
    "{%%- endif -%%}\n"
    "{%%- set messages = ([{'role': 'system', 'content': polyalign_system}] if polyalign_system else []) + %s -%%}\n"
    # consecutive messages of one role joined with a newline, as training joined them (chat.joined_turns)
    "{%%- set polyalign_turns = namespace(joined=[]) -%%}\n"
    "{%%- for message in messages -%%}\n"
    "    {%%- set previous = polyalign_turns.joined[-1] if polyalign_turns.joined else none -%%}\n"
    "    {%%- if previous and previous['role'] == message['role'] and previous['content'] is string "
    "and message['content'] is string -%%}\n"
    "        {%%- set polyalign_turns.joined = polyalign_turns.joined[:-1] + [{'role': message['role'], "
    "'content': previous['content'] + '\\n' + message['content']}] -%%}\n"
    "    {%%- else -%%}\n"
    "        {%%- set polyalign_turns.joined = polyalign_turns.joined + [message] -%%}\n"
    "    {%%- endif -%%}\n"
    "{%%- endfor -%%}\n"
    "{%%- set messages = polyalign_turns.joined -%%}\n")
# The preamble of exports before system modes (it wrote the profile only when no system message opened
# the conversation): recognised so that training on from such an export does not keep both.
_LEGACY_PREAMBLE = (
    "{#- polyalign: with no system message, the profile system prompt the model was trained with, from the\n"
    "    template variables family, track, style (and length for the oracle profile). -#}\n"
    "{%- set polyalign_profile = namespace(parts=[]) -%}\n"
    + "".join(f"{{%- if {key} is defined and {key} -%}}"
              f"{{%- set polyalign_profile.parts = polyalign_profile.parts + ['{key}=' + {key}]"
              " -%}{%- endif -%}\n" for key in PROFILE_KEYS)
    + "{%- if polyalign_profile.parts and not (messages and messages[0]['role'] == 'system') -%}\n"
    "    {%- set messages = [{'role': 'system', 'content': "
    f"'{PROFILE_PREAMBLE} ' + polyalign_profile.parts | join('; ') + '.'}}] + messages -%}}\n"
    "{%- endif -%}\n")
PROFILE_PREAMBLES_JINJA = {
    mode: _PREAMBLE_HEAD % (mode, source, rest) for mode, source, rest in (
        ("keep", "polyalign_profile.texts | join('\\n')", "messages[polyalign_profile.lead:]"),
        ("replace", "''", "messages[polyalign_profile.lead:]"),
        ("drop", "''", "messages | rejectattr('role', 'equalto', 'system') | list"))}


# Written first in an export's template (after the profile check): the messages as polyalign reads a
# conversation (data/importers/reading.py, content_text and the roles; data/text.py, normalize; `serve`
# alike): a `developer` message is a system message, a content-part list is its text parts joined by a
# newline (other parts left out), and a text is normalised as training normalised it (data/text.py
# normalize: runs of whitespace inside a line as one space, none at a line's ends, at most one blank line
# in a row). A message that needs none of it is passed on as it is.
READ_MESSAGES_JINJA = (
    "{#- polyalign: messages read as training read them: developer is a system role, text parts joined, "
    "whitespace normalised. -#}\n"
    "{%- set polyalign_read = namespace(out=[]) -%}\n"
    "{%- for message in messages -%}\n"
    "    {%- set polyalign_text = message['content'] -%}\n"
    "    {%- if polyalign_text is not none and polyalign_text is not string and polyalign_text is iterable "
    "and polyalign_text is not mapping -%}\n"
    "        {%- set polyalign_parts = namespace(texts=[]) -%}\n"
    "        {%- for part in polyalign_text -%}\n"
    "            {%- if part is string -%}\n"
    "                {%- set polyalign_parts.texts = polyalign_parts.texts + [part] -%}\n"
    "            {%- elif part['type'] in ['text', 'input_text', 'output_text'] or (part['type'] is not defined "
    "and part['text'] is defined) -%}\n"
    "                {%- set polyalign_parts.texts = polyalign_parts.texts + [part['text']] -%}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "        {%- set polyalign_text = polyalign_parts.texts | join('\\n') -%}\n"
    "    {%- endif -%}\n"
    # data/text.py normalize: CR LF and CR as LF; in each line, every run of whitespace one space and none
    # at the ends (str.split() with no argument splits at any whitespace run); at most one blank line in a row
    "    {%- if polyalign_text is string -%}\n"
    "        {%- set polyalign_lines = namespace(out=[]) -%}\n"
    "        {%- for line in polyalign_text.replace('\\r\\n', '\\n').replace('\\r', '\\n').split('\\n') -%}\n"
    "            {%- set polyalign_line = line.split() | join(' ') -%}\n"
    "            {%- if polyalign_line or (polyalign_lines.out and polyalign_lines.out[-1]) -%}\n"
    "                {%- set polyalign_lines.out = polyalign_lines.out + [polyalign_line] -%}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "        {%- set polyalign_text = polyalign_lines.out | join('\\n') | trim -%}\n"
    "    {%- endif -%}\n"
    "    {%- if message['role'] == 'developer' or polyalign_text != message['content'] -%}\n"
    "        {%- set polyalign_read.out = polyalign_read.out + [dict(message, role='system' if message['role'] == "
    "'developer' else message['role'], content=polyalign_text)] -%}\n"
    "    {%- else -%}\n"
    "        {%- set polyalign_read.out = polyalign_read.out + [message] -%}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set messages = polyalign_read.out -%}\n")


# Written after the preamble for a training template that refuses system messages (Gemma 2's): every
# system message folded into a user turn by chat.fold_system's rule, as training folded them: it opens
# the next user turn (its text, a blank line, the user's), or, directly followed by an assistant turn or
# by nothing, closes the user turn before it; with no user turn to take it, refused as training refuses.
FOLD_SYSTEM_JINJA = (
    "{#- polyalign: this template takes no system message; each one is folded into a user turn, as training "
    "folded them. -#}\n"
    "{%- set polyalign_fold = namespace(out=[], pending=[]) -%}\n"
    "{%- macro polyalign_close() -%}\n"
    "    {%- if not polyalign_fold.out or polyalign_fold.out[-1]['role'] != 'user' -%}\n"
    "        {{- raise_exception('a system message with no user turn beside it to fold into (this template takes "
    "no system message)') -}}\n"
    "    {%- endif -%}\n"
    "    {%- set polyalign_fold.out = polyalign_fold.out[:-1] + [{'role': 'user', 'content': "
    "([polyalign_fold.out[-1]['content']] + polyalign_fold.pending) | join('\\n\\n')}] -%}\n"
    "    {%- set polyalign_fold.pending = [] -%}\n"
    "{%- endmacro -%}\n"
    "{%- for message in messages -%}\n"
    "    {%- if message['role'] == 'system' -%}\n"
    "        {%- set polyalign_fold.pending = polyalign_fold.pending + [message['content']] -%}\n"
    "    {%- elif polyalign_fold.pending and message['role'] == 'user' -%}\n"
    "        {%- set polyalign_fold.out = polyalign_fold.out + [{'role': 'user', 'content': "
    "(polyalign_fold.pending + [message['content']]) | join('\\n\\n')}] -%}\n"
    "        {%- set polyalign_fold.pending = [] -%}\n"
    "    {%- else -%}\n"
    "        {%- if polyalign_fold.pending -%}{{- polyalign_close() -}}{%- endif -%}\n"
    "        {%- set polyalign_fold.out = polyalign_fold.out + [message] -%}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if polyalign_fold.pending -%}{{- polyalign_close() -}}{%- endif -%}\n"
    "{%- set messages = polyalign_fold.out -%}\n")


# Beside each key's values, `values` (seen_profile_values) holds the combinations of the keys the data held,
# most common first ({key: value} each): the keys are not independent (the demo's assistant answers are all
# single-turn), and a prompt made of values each seen but never together is one the model never read. An
# export writes them as polyalign_profile_combinations.
PROFILE_COMBINATIONS = "combinations"


def seen_profile_values(profile: str, *sources: dict[str, Any] | None) -> dict[str, Any] | None:
    """The values of each key `profile` names that any of `sources` held ({key: values}: a build's
    train_profile_values, a checkpoint's polyalign_profile_values, the pairs' records), sorted, and under
    PROFILE_COMBINATIONS the combinations of those keys the sources list ({key: value, "examples": n}
    where counted), most common first; None when no source says (nothing to check against)."""
    known = [source for source in sources if source]
    keys = PROFILE_MODE_KEYS[profile]
    if not known or not keys:
        return None
    values: dict[str, Any] = {key: sorted({value for source in known for value in source.get(key) or ()})
                              for key in keys}
    # combinations only where every source lists its own: one that lists values alone (a build or an export
    # made before combinations were counted) may have held any, and refusing them would be refusing its data
    counts: Counter = Counter()
    for source in known if all(source.get(PROFILE_COMBINATIONS) for source in known) else ():
        for combination in source[PROFILE_COMBINATIONS]:
            if all(key in combination for key in keys):
                counts[tuple(combination[key] for key in keys)] += combination.get("examples", 0)
    if counts:
        values[PROFILE_COMBINATIONS] = [dict(zip(keys, combination)) for combination, _ in
                                        sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
    return values


def profile_example(values: dict[str, Any] | None, keys: Sequence[str]) -> dict[str, str]:
    """Profile values to show as an example: the combination the training data held most often, where its
    combinations are known, else each key's first value ("..." for a key with none known)."""
    combinations = (values or {}).get(PROFILE_COMBINATIONS)
    if combinations and all(key in combinations[0] for key in keys):
        return {key: combinations[0][key] for key in keys}
    return {key: ((values or {}).get(key) or ["..."])[0] for key in keys}


SHOWN_COMBINATIONS = 12  # a scheme's data holds a handful; every one is an answer to "then which?"


def unseen_combination_text(given: dict[str, str] | None, combinations: Sequence[dict[str, str]]) -> str:
    """Why a profile of values each held is refused, after the profile itself (`given`; None: the words
    alone, which the exported template writes after its own rendering of the values)."""
    shown = "; ".join(json.dumps(c, ensure_ascii=False) for c in combinations[:SHOWN_COMBINATIONS])
    more = (f" and {len(combinations) - SHOWN_COMBINATIONS} more, which the model card and tokenizer_config.json "
            "(polyalign_profile_combinations) list" if len(combinations) > SHOWN_COMBINATIONS else "")
    why = f"each value was in this model's training data, but never together (it held {shown}{more})"
    return why if given is None else f"{json.dumps(given, ensure_ascii=False)}: {why}"


def trained_profile_text(profile: str) -> str:
    """How a model's profile is named to whoever prompts it (serve's errors, the template's, the card)."""
    keys = PROFILE_MODE_KEYS[profile]
    return f"this model was trained with profile {profile}: " + (", ".join(keys) if keys else "no variables")


# Messages that already carry the profile prompt (a `polyalign prompts` row's) and name it again.
PROFILE_TWICE = ("the messages already open with polyalign's profile prompt (as `polyalign prompts` writes them): "
                 "send them without the profile variables, or the conversation without that system message")


def opens_with_profile_prompt(messages: Sequence[Any] | None) -> bool:
    """Whether the first message is a system (or developer) message holding polyalign's profile prompt;
    messages as dicts (role, content) or chat.Message."""
    if not messages:
        return False
    first = messages[0]
    role, content = (first.get("role"), first.get("content")) if isinstance(first, dict) else (first.role,
                                                                                                first.content)
    return role in ("system", "developer") and isinstance(content, str) and PROFILE_PREAMBLE in content


def profile_problem(variables: dict[str, str], profile: str | None,
                    values: dict[str, Any] | None = None, messages: Sequence[Any] | None = None) -> str | None:
    """What is wrong with the template variables a caller names for a model trained with `profile`
    (None: not recorded, nothing checked), or None: a profile is named whole or not at all (a partial
    one, or one with a key the model never read, renders a prompt it never saw), and each value is one
    the model's training data held (`values`, its export's polyalign_profile_values; unchecked where
    it has none); and `messages` do not already hold the profile prompt (it would be written twice). The
    exported template checks the same (profile_check_jinja)."""
    given = {key: value for key, value in variables.items() if key in PROFILE_KEYS and value}
    if given and opens_with_profile_prompt(messages):
        return PROFILE_TWICE
    if not given or profile is None:
        return None
    wanted = PROFILE_MODE_KEYS[profile]
    extra = [k for k in PROFILE_KEYS if k in given and k not in wanted]
    missing = [k for k in wanted if k not in given]
    if extra or missing:
        what = "; ".join([*([f"leave out {', '.join(extra)}"] if extra else []),
                          *([f"give {', '.join(missing)} too"] if missing else [])])
        return f"{', '.join(k for k in PROFILE_KEYS if k in given)}: {trained_profile_text(profile)}; {what}"
    for key in wanted:
        seen = (values or {}).get(key)
        if seen and given[key] not in seen:
            return unseen_value_text(key, given[key], seen)
    combinations = (values or {}).get(PROFILE_COMBINATIONS)
    named = {key: given[key] for key in wanted}
    if combinations and named not in combinations:
        return unseen_combination_text(named, combinations)
    return None


def unseen_value_text(key: str, value: str, seen: list[str]) -> str:
    return f"{key} '{value}' was not in this model's training data ({key} there: {', '.join(seen)})"


_CHECK_HEAD = "{#- polyalign: profile check"
_CHECK_END = "{#- polyalign: end of profile check -#}\n"


def _jinja_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def profile_check_jinja(profile: str, values: dict[str, Any] | None = None) -> str:
    """Written first in an exported template: refuses, as `serve` does (profile_problem), template
    variables that name the profile in part or with a key the model never read, and a value its training
    data never held, so that a misspelled style never renders a prompt the model never saw."""
    wanted = PROFILE_MODE_KEYS[profile]
    lines = [f"{_CHECK_HEAD} ({trained_profile_text(profile)}) -#}}\n",
             "{%- set polyalign_given = namespace(keys=[]) -%}\n"]
    lines += [f"{{%- if {key} is defined and {key} -%}}{{%- set polyalign_given.keys = polyalign_given.keys + "
              f"['{key}'] -%}}{{%- endif -%}}\n" for key in PROFILE_KEYS]
    whole = "[" + ", ".join(f"'{key}'" for key in PROFILE_KEYS if key in wanted) + "]"
    refusal = (f"{trained_profile_text(profile)}; name " + (f"all of {', '.join(wanted)} or none" if wanted
                                                             else "no profile variables"))
    lines.append("{%- if polyalign_given.keys and messages and messages[0]['role'] in ['system', 'developer'] and "
                 f"messages[0]['content'] is string and {_jinja_string(PROFILE_PREAMBLE)} in messages[0]['content'] "
                 f"-%}}{{{{- raise_exception({_jinja_string(PROFILE_TWICE)}) -}}}}{{%- endif -%}}\n")
    lines.append(f"{{%- if polyalign_given.keys and polyalign_given.keys != {whole} -%}}"
                 f"{{{{- raise_exception({_jinja_string(refusal)} + ' (given: ' + polyalign_given.keys | join(', ')"
                 " + '; a misspelt name counts as not given)') -}}{%- endif -%}\n")
    for key in wanted:
        seen = sorted((values or {}).get(key) or [])
        if seen:
            listed = "[" + ", ".join(_jinja_string(v) for v in seen) + "]"
            message = "'" + unseen_value_text(key, "", seen).split("''", 1)[1]
            lines.append(f"{{%- if {key} is defined and {key} and {key} not in {listed} -%}}"
                         f"{{{{- raise_exception(\"{key} '\" ~ {key} ~ {_jinja_string(message)}) -}}}}"
                         "{%- endif -%}\n")
    combinations = (values or {}).get(PROFILE_COMBINATIONS)
    if combinations and wanted:  # the keys named whole (checked above): their values held together
        joined = " ~ '|' ~ ".join(wanted)
        held = "[" + ", ".join(_jinja_string("|".join(c[key] for key in wanted)) for c in combinations) + "]"
        text = unseen_combination_text(None, combinations)
        lines.append(f"{{%- if polyalign_given.keys and ({joined}) not in {held} -%}}"
                     f"{{{{- raise_exception({_jinja_string(', '.join(wanted) + ' ')} ~ ({joined}) ~ ': ' ~ "
                     f"{_jinja_string(text)}) -}}}}"
                     "{%- endif -%}\n")
    return "".join(lines) + _CHECK_END


# Llama 3.x templates print today's date unless given one: a fixed date keeps builds reproducible. Here,
# not in chat_jinja.py (which renders with it), so that a training process need not import jinja2.
DEFAULT_TEMPLATE_KWARGS = {"date_string": "26 Jul 2024"}
# The variables polyalign renders every template with where the caller gives none (a Llama 3 template's
# date_string), pinned in the export as training rendered them: transformers and vLLM otherwise print
# today's date into the system turn, and every prompt read other ids than training's (0 of 511 alike).
PINNED_DEFAULTS_JINJA = "".join(f"{{%- if {name} is not defined %}}{{%- set {name} = {json.dumps(value)} %}}"
                                f"{{%- endif %}}\n" for name, value in DEFAULT_TEMPLATE_KWARGS.items())


def training_source(source: str) -> str:
    """A chat template without the profile preambles exports wrote before it (however many chained
    exports wrote, of this release or an earlier one): the template training rendered."""
    stripped = True
    while stripped:
        stripped = False
        if source.startswith(_CHECK_HEAD) and _CHECK_END in source:
            source, stripped = source.split(_CHECK_END, 1)[1], True
        preambles = (PINNED_DEFAULTS_JINJA, READ_MESSAGES_JINJA, *PROFILE_PREAMBLES_JINJA.values(), FOLD_SYSTEM_JINJA,
                     _LEGACY_PREAMBLE)
        for preamble in preambles:
            if source.startswith(preamble):
                source, stripped = source[len(preamble):], True
    return source


def exported_source(source: str, system: str = "keep", fold: bool = False, profile: str | None = None,
                    values: dict[str, Any] | None = None) -> str:
    """The chat_template an export carries: the training template behind the preamble of the build's
    system mode, written once; `fold`: the template takes no system message, which the preamble then
    folds into user turns (FOLD_SYSTEM_JINJA); `profile` (and the `values` training saw): the variables
    are checked first (profile_check_jinja). The messages are read as training read them first
    (READ_MESSAGES_JINJA)."""
    check = profile_check_jinja(profile, values) if profile is not None else ""
    trained = training_source(source)
    pinned = PINNED_DEFAULTS_JINJA if any(name in trained for name in DEFAULT_TEMPLATE_KWARGS) else ""
    return (pinned + check + READ_MESSAGES_JINJA + PROFILE_PREAMBLES_JINJA[system] + (FOLD_SYSTEM_JINJA if fold else "")
            + trained)
