"""Chat templates: records to messages (with the profile system prompt), messages to text exactly as
each model family's official template renders it, and to token ids with a loss mask.

A template renders a conversation as pieces. Special tokens are their own pieces, looked up by id
rather than parsed out of text (SentencePiece never parses its BOS out of text). An assistant turn's
content and its end-of-turn token are the pieces a loss may cover.
"""

from __future__ import annotations

import functools
import re
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import Literal, NamedTuple

import numpy as np

from polyalign.core.errors import ChatTemplateError
from polyalign.data.records import PROFILE_PREAMBLE, Record, after_question, before_question
from polyalign.tokens.profile_template import (
    PROFILE_COMBINATIONS,
    PROFILE_FIELDS,
    PROFILE_KEYS,
    PROFILE_MODE_KEYS,
    PROFILE_MODES,
    SYSTEM_MODES,
    TRUNCATIONS,
    training_source,
)
from polyalign.tokens.tokenizer import BOS, Tokenizer

TRAIN_ON = ("last", "all")


@dataclass(frozen=True)
class Message:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class Piece:
    text: str
    special: bool = False
    # Index of the assistant message this piece completes (its content or end-of-turn token), else None.
    turn: int | None = None


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]: True where the token is a training target
    truncated: bool = False
    # the cut took the start of the system message that opens the prompt (the profile prompt)
    system_cut: bool = False
    # the prompt kept opens inside a turn (a cut by tokens), not at a turn's start
    mid_turn: bool = False
    # the messages before the reply that the prompt lost whole (truncation "turns"), oldest first
    turns_dropped: int = 0
    # the reply lost its end (and its end-of-turn token) to the cut
    reply_cut: bool = False
    # of the messages lost whole, the system messages from inside the conversation (not its opening one)
    system_dropped: int = 0
    # the opening system message, over half the prompt's share, left out whole (not kept as a headless tail)
    system_left_out: bool = False


# --- records to messages --------------------------------------------------------------------------

def profile_prompt(record: Record, mode: str) -> str:
    """The Bucket-SFT/HDPO system prompt (METHOD section 4). `oracle` reveals the gold length bin,
    `context` only what a real request shows, `none` gives no system prompt."""
    if mode not in PROFILE_MODES:
        raise ChatTemplateError(f"profile mode {mode!r} is not one of {', '.join(PROFILE_MODES)}")
    if mode == "none":
        return ""
    return profile_text(record_profile(record, mode)) or PROFILE_PREAMBLE


def record_profile(record: Record, mode: str) -> dict[str, str]:
    """{profile key: the record's value} for the keys profile `mode` names (PROFILE_MODE_KEYS)."""
    return {key: getattr(record, PROFILE_FIELDS[key]) for key in PROFILE_MODE_KEYS[mode]}


def profile_text(parts: dict[str, str]) -> str:
    """The profile prompt naming `parts` (PROFILE_KEYS, in their order; empty ones left out); "" for none."""
    profile = "; ".join(f"{key}={parts[key]}" for key in PROFILE_KEYS if parts.get(key))
    return f"{PROFILE_PREAMBLE} {profile}." if profile else ""


def user_turn(question: str, context: str) -> str:
    """The current user turn: the passage or knowledge first, then the question."""
    return f"{context}\n\n{question}" if context else question


def source_system(record: Record) -> str | None:
    """The conversation's own system prompt: the system turns that open the record's history, joined
    by a newline; None when the history does not open with one."""
    texts = []
    for turn in before_question(record.history):
        if turn["role"] != "system":
            break
        texts.append(turn["text"])
    return "\n".join(texts) if texts else None


def system_prompt(record: Record, profile: str = "context", system: str = "keep") -> str:
    """The system prompt a record is rendered with: the profile prompt composed with the source's own
    system text by `system` (SYSTEM_MODES); "" for none."""
    if system not in SYSTEM_MODES:
        raise ChatTemplateError(f"system mode {system!r} is not one of {', '.join(SYSTEM_MODES)}")
    profile_text = profile_prompt(record, profile)
    source = source_system(record) if system == "keep" else None
    return "\n\n".join(part for part in (source, profile_text) if part)


def with_system_prompt(messages: Sequence[Message], profile: str, system: str = "keep") -> list[Message]:
    """A conversation as a user holds it (its own system messages where they stand) composed with a
    profile prompt by `system`, as record_messages composes a record's: keep: the opening system
    messages joined by a newline, a blank line, the profile prompt; replace: the profile prompt in place
    of the opening ones; drop: no system message of the conversation at all. The exported chat
    template's preamble (model/export.py) is this rule in Jinja; `polyalign serve` calls it."""
    if system not in SYSTEM_MODES:
        raise ChatTemplateError(f"system mode {system!r} is not one of {', '.join(SYSTEM_MODES)}")
    lead = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    own = "\n".join(m.content for m in messages[:lead]) if system == "keep" else ""
    rest = [m for m in messages if m.role != "system"] if system == "drop" else list(messages[lead:])
    prompt = "\n\n".join(part for part in (own, profile) if part)
    return joined_turns(([Message("system", prompt)] if prompt else []) + rest)


def joined_turns(messages: Sequence[Message]) -> list[Message]:
    """Consecutive messages of one role joined with a newline, so that every template sees one message
    per turn (two user messages in a row, or two left adjacent by a dropped system message)."""
    out: list[Message] = []
    for message in messages:
        if out and out[-1].role == message.role:
            out[-1] = Message(message.role, f"{out[-1].content}\n{message.content}")
        else:
            out.append(message)
    return out


def _say(note: str, notes: list[str] | None) -> None:
    """A note in `notes`, a stage's summary (its manifest keeps it, the command prints it), else on stderr."""
    if notes is None:
        print(f"note: {note}", file=sys.stderr)
    else:
        notes.append(note)


def say_unseen_profile_values(tokenizer: Tokenizer, records: Sequence[Record], profile: str, where: str,
                              notes: list[str] | None = None) -> None:
    """A note when records name profile values the checkpoint's training data did not hold (its export's
    polyalign_profile_values): their prompts are ones the model never read (another dataset's styles,
    say). Nothing is said for a checkpoint that lists none."""
    values = tokenizer.profile_values or {}
    combinations = values.get(PROFILE_COMBINATIONS)
    unseen: Counter = Counter()
    affected = apart = 0
    # a combination is judged on the keys training's combinations hold: `oracle` adds length to context's three,
    # and `none` names nothing (no profile prompt, nothing the model did not read)
    combined = {key for combination in combinations or [] for key in combination}
    for record in records:
        named = record_profile(record, profile)
        missing = [(key, value) for key, value in named.items() if values.get(key) and value not in values[key]]
        unseen.update(missing)
        affected += bool(missing)
        together = {key: value for key, value in named.items() if key in combined}
        apart += bool(not missing and together and together not in combinations)
    if affected:
        listed = ", ".join(f"{key} {value!r} {n}" for (key, value), n in unseen.most_common())
        _say(f"{affected} of {len(records)} records name profile values {where}'s training data did not hold "
             f"({listed}): the model never read such profile prompts", notes)
    if apart:  # each value held, never together (polyalign_profile_combinations)
        _say(f"{apart} of {len(records)} records name a profile whose values {where}'s training data held, but "
             "never together: the model never read such profile prompts", notes)


def trained_profile(tokenizer: Tokenizer, asked: str | None, where: str, notes: list[str] | None = None) -> str:
    """The profile a checkpoint's prompts are rendered with: the one asked for, else the one it was trained
    with: its export's polyalign_profile; none for another tool's checkpoint (a base model, which never read
    polyalign's profile prompt: given it by default, a comparison with the models trained from it measured
    the base on prompts it was never trained on), said; context for a polyalign export that does not say.
    Asking for another than the trained one is said (and added to `notes`): the model never read such
    prompts."""
    trained = tokenizer.profile_mode
    if asked is not None and trained is not None and asked != trained:
        _say(f"{where} was trained with profile {trained!r}; rendering with {asked!r} as asked", notes)
    if asked is None and trained is None and not tokenizer.from_polyalign:
        _say(f"{where} was not trained by polyalign (its tokenizer config names no polyalign_profile): prompted "
             "without polyalign's profile prompt, as it was trained (--profile context gives it the one the models "
             "polyalign trains read)", notes)
        return "none"
    return asked or trained or "context"


def record_messages(record: Record, profile: str = "context", with_response: bool = True,
                    system: str = "keep") -> list[Message]:
    """The one rule by which a record becomes chat messages (build, prompts, generate, evaluation and
    preference pairs all call it): the system prompt (`system_prompt`), the history with each turn in
    its own role (a system turn inside the conversation stays a system turn), the question with its
    context, the turns that stood between the question and the reply (AFTER_QUESTION: a system note, and an
    earlier reply it interrupted) after it, and the human response. Consecutive turns of one role are joined
    with a newline so that every template sees one message per turn (joined_turns)."""
    prompt = system_prompt(record, profile, system)
    messages = [Message("system", prompt)] if prompt else []
    history = before_question(record.history)
    opening = 0
    while opening < len(history) and history[opening]["role"] == "system":
        opening += 1  # the source's own system prompt, composed into `prompt` above
    later = [*history[opening:], {"role": "user", "text": user_turn(record.question, record.context)},
             *after_question(record.history)]
    for turn in later:
        role = turn["role"] if turn["role"] in ("user", "assistant", "system") else "assistant"
        if role == "system" and system == "drop":
            continue
        messages.append(Message(role, turn["text"]))
    messages = joined_turns(messages)
    return messages + [Message("assistant", record.response)] if with_response else messages


def fold_system(messages: Sequence[Message]) -> list[tuple[int | None, Message]]:
    """For templates that take no system message (Gemma's): every system message folded into a user
    turn, as (index of the message in `messages`, message) pairs; a folded user turn keeps its own index.
    The rule: a system message opens the next user turn (its text, a blank line, the user's text); one
    directly followed by an assistant turn (or by nothing) closes the user turn before it instead (the
    user's text, a blank line, its text). A system message is never folded into an assistant turn: one with
    no user turn before it to close (between two replies, or before a conversation's opening reply) is a user
    turn of its own, so that user and model turns still alternate."""
    out: list[tuple[int | None, Message]] = []
    pending: list[tuple[int, str]] = []
    for index, message in enumerate(messages):
        if message.role == "system":
            pending.append((index, message.content))
            continue
        if pending and message.role == "user":
            out.append((index, Message("user", "\n\n".join([*(text for _, text in pending), message.content]))))
            pending = []
            continue
        if pending:
            _close_with(out, pending)
            pending = []
        out.append((index, message))
    if pending:
        _close_with(out, pending)
    return out


def _close_with(out: list[tuple[int | None, Message]], pending: list[tuple[int, str]]) -> None:
    texts = [text for _, text in pending]
    if not out or out[-1][1].role != "user":
        out.append((pending[0][0], Message("user", "\n\n".join(texts))))
        return
    index, user = out[-1]
    out[-1] = (index, Message("user", "\n\n".join([user.content, *texts])))


# --- templates ------------------------------------------------------------------------------------

CHECKPOINT_TEMPLATE = "checkpoint"  # the name under which a checkpoint's own Jinja template is chosen


class ChatTemplate:
    """Renders messages to pieces. Subclasses give the turn layout of one family."""

    name: str
    bos: str | None = None
    end_of_turn: str

    def pieces(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[Piece]:
        raise NotImplementedError

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        return "".join(p.text for p in self.pieces(messages, add_generation_prompt))

    def stop_tokens(self) -> tuple[str, ...]:
        return (self.end_of_turn,)

    def special_tokens(self) -> list[str]:
        """The special tokens a rendering uses (every turn kind, the generation prompt): each must be one
        token of the tokenizer."""
        probe = [Message("system", "s"), Message("user", "u"), Message("assistant", "a"), Message("user", "u")]
        pieces = self.pieces(probe, add_generation_prompt=True)
        return list(dict.fromkeys([p.text for p in pieces if p.special] + list(self.stop_tokens())))

    # Whether the template's Jinja renders a system message (the built-in ones do, Gemma's by folding it
    # into a user turn itself); a checkpoint's own template may refuse one (JinjaTemplate.takes_system).
    takes_system = True

    def jinja_source(self) -> str:
        """The template as Jinja, rendering what this class renders (bos_token, eos_token as variables):
        what exports carry as their chat_template."""
        return (files("polyalign.tokens") / "templates" / f"{self.name}.jinja").read_text(encoding="utf-8")

    def _split_system(self, messages: Sequence[Message]) -> tuple[str | None, list[tuple[int, Message]]]:
        """The leading system message's text, and the other messages by index (later system messages
        among them: the template writes them as system turns where they stand)."""
        indexed = list(enumerate(messages))
        if indexed and indexed[0][1].role == "system":
            return indexed[0][1].content, indexed[1:]
        return None, indexed


class ChatML(ChatTemplate):
    """<|im_start|>role\\ncontent<|im_end|>\\n turns. `default_system` is inserted when the
    conversation has none (Qwen2.5 does this with its own identity prompt)."""

    start, end_of_turn = "<|im_start|>", "<|im_end|>"

    def __init__(self, name: str, bos: str | None, default_system: str | None):
        self.name, self.bos, self.default_system = name, bos, default_system

    def pieces(self, messages, add_generation_prompt=False):
        system, rest = self._split_system(messages)
        system = system if system is not None else self.default_system
        out = [Piece(self.bos, special=True)] if self.bos else []
        turns = ([(None, Message("system", system))] if system is not None else []) + rest
        for index, message in turns:
            out += [Piece(self.start, special=True), Piece(f"{message.role}\n")]
            target = index if message.role == "assistant" else None
            out += [Piece(message.content, turn=target), Piece(self.end_of_turn, special=True, turn=target),
                    Piece("\n")]
        if add_generation_prompt:
            out += [Piece(self.start, special=True), Piece("assistant\n")]
        return out


class Llama3(ChatTemplate):
    """Llama 3.1/3.2 Instruct: the system header always carries the knowledge-cutoff lines; contents
    are stripped. The date is fixed (the official template takes today's date, which would make
    training data depend on the day it was built)."""

    name, bos, end_of_turn = "llama3", "<|begin_of_text|>", "<|eot_id|>"
    header_start, header_end = "<|start_header_id|>", "<|end_header_id|>"

    def __init__(self, date_string: str = "26 Jul 2024"):
        self.date_string = date_string

    def _header(self, role: str) -> list[Piece]:
        return [Piece(self.header_start, special=True), Piece(role), Piece(self.header_end, special=True),
                Piece("\n\n")]

    def pieces(self, messages, add_generation_prompt=False):
        system, rest = self._split_system(messages)
        out = [Piece(self.bos, special=True), *self._header("system"),
               Piece(f"Cutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n"
                     f"{(system or '').strip()}"),
               Piece(self.end_of_turn, special=True)]
        for index, message in rest:
            target = index if message.role == "assistant" else None
            out += [*self._header(message.role), Piece(message.content.strip(), turn=target),
                    Piece(self.end_of_turn, special=True, turn=target)]
        if add_generation_prompt:
            out += self._header("assistant")
        return out


class Gemma(ChatTemplate):
    """Gemma 2 Instruct: user/model turns, contents stripped. The official template rejects a system
    message; like Gemma 3's template, the system text opens the first user turn instead, and a later
    system message is folded into a user turn by `fold_system`'s rule."""

    name, bos, end_of_turn = "gemma", "<bos>", "<end_of_turn>"
    start = "<start_of_turn>"

    def pieces(self, messages, add_generation_prompt=False):
        out = [Piece(self.bos, special=True)]
        for position, (index, message) in enumerate(fold_system(messages)):
            if (message.role == "user") != (position % 2 == 0):
                raise ChatTemplateError("gemma: roles must alternate user/assistant, starting with user")
            target = index if message.role == "assistant" else None
            role = "model" if message.role == "assistant" else "user"
            out += [Piece(self.start, special=True), Piece(f"{role}\n"), Piece(message.content.strip(), turn=target),
                    Piece(self.end_of_turn, special=True, turn=target), Piece("\n")]
        if add_generation_prompt:
            out += [Piece(self.start, special=True), Piece("model\n")]
        return out


def as_dicts(messages) -> list[dict[str, str]]:
    """Messages as the role/content mappings a Jinja chat template reads."""
    return [{"role": m.role, "content": m.content} for m in messages]


def split_pieces(text: str, spans: Mapping[int, tuple[int, int]], special_tokens: Sequence[str]):
    """`text` as (piece text, is special, turn) triples: special tokens on their own, assistant spans
    (cut after their last special token) labelled with their turn."""
    pattern = re.compile("|".join(re.escape(t) for t in sorted(set(special_tokens), key=len, reverse=True) if t))
    specials = [(m.start(), m.end()) for m in pattern.finditer(text)] if pattern.pattern else []
    labelled = {}
    for turn, (start, end) in spans.items():
        inside = [e for s, e in specials if start <= s and e <= end]
        labelled[turn] = (start, max(inside) if inside else end)
    cuts = sorted({0, len(text), *(p for span in labelled.values() for p in span), *(p for s in specials for p in s)})
    special_starts = {s: e for s, e in specials}
    pieces = []
    for start, end in zip(cuts, cuts[1:]):
        turn = next((t for t, (s, e) in labelled.items() if s <= start and end <= e), None)
        pieces.append((text[start:end], special_starts.get(start) == end, turn))
    return pieces


class JinjaTemplate(ChatTemplate):
    """A checkpoint's own Jinja chat template (polyalign.tokens.chat_jinja): the string transformers renders,
    with each assistant turn located by rendering. A template that refuses a conversation with a system
    message (Gemma 2's) gets every system message folded into a user turn (`fold_system`), as the
    built-in `gemma` does."""

    name = CHECKPOINT_TEMPLATE

    def __init__(self, source: str, tokenizer: Tokenizer, kwargs: dict | None = None):
        # An export's template composes the profile prompt itself (tokens/profile_template.py); the
        # conversations polyalign renders are composed already, so it renders what training rendered.
        self.source = training_source(source)
        # jinja2 (~0.1 s to import) only for checkpoints that bring their own template
        from polyalign.tokens.chat_jinja import JinjaRenderer

        self.renderer = JinjaRenderer(self.source, tokenizer.template_tokens(), kwargs or {})
        self.added_tokens = tokenizer.added_tokens()
        self.end_of_turn = self._end_of_turn(tokenizer)

    def jinja_source(self) -> str:
        return self.source

    @functools.cached_property
    def takes_system(self) -> bool:  # type: ignore[override]
        """False for a template that refuses a system message (Gemma 2's raises on one): polyalign folds
        system messages into user turns for it (fold_system), and its export's preamble does the same."""
        try:
            self.renderer.render(as_dicts([Message("system", "s"), Message("user", "u")]), True)
        except ChatTemplateError:
            return False
        return True

    def _end_of_turn(self, tokenizer: Tokenizer) -> str:
        """The special token that closes an assistant turn: the first one the template writes after it."""
        text, spans = self.locate_turns([Message("user", "ping"), Message("assistant", "pong")])
        after = text[text.index("pong", spans[1][0]) + len("pong"):] if 1 in spans else ""
        found = [(after.find(t), t) for t in self.added_tokens if t in after]
        if found:
            return min(found)[1]
        if tokenizer.eos_token:
            return tokenizer.eos_token
        raise ChatTemplateError("the chat template ends an assistant turn with no special token, and the tokenizer "
                                "has no EOS token to stop generation with")

    def _as_is(self, messages: Sequence[Message]) -> bool:
        """Whether to render `messages` unfolded: they hold no system message, or the template takes one.
        A template that refuses a system message has every one folded, wherever it stands (Gemma 2's
        accepts one mid-way, as a turn of a role the model never saw), which is what its export does."""
        return self.takes_system or not any(m.role == "system" for m in messages)

    def locate_turns(self, messages: Sequence[Message]) -> tuple[str, dict[int, tuple[int, int]]]:
        """The rendering and the characters of each assistant turn it can locate, by message index."""
        if self._as_is(messages):
            try:
                return self.renderer.turn_spans(as_dicts(messages))
            except ChatTemplateError:
                if not any(m.role == "system" for m in messages):
                    raise
        folded = fold_system(messages)
        text, spans = self.renderer.turn_spans(as_dicts([m for _, m in folded]))
        return text, {folded[k][0]: span for k, span in spans.items()}  # indices of the unfolded messages

    def render(self, messages, add_generation_prompt=False):
        if self._as_is(messages):
            try:
                return self.renderer.render(as_dicts(messages), add_generation_prompt)
            except ChatTemplateError:
                if not any(m.role == "system" for m in messages):
                    raise
        return self.renderer.render(as_dicts([m for _, m in fold_system(messages)]), add_generation_prompt)

    def pieces(self, messages, add_generation_prompt=False):
        if add_generation_prompt:
            text, spans = self.render(messages, add_generation_prompt=True), {}
        else:
            text, spans = self.locate_turns(messages)
        return [Piece(t, special=special, turn=turn)
                for t, special, turn in split_pieces(text, spans, self.added_tokens)]


QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
TEMPLATES: dict[str, ChatTemplate] = {
    # polyalign's own tokenizer: ChatML after a BOS, and no default system prompt.
    "polyalign": ChatML("polyalign", bos=BOS, default_system=None),
    "qwen": ChatML("qwen", bos=None, default_system=QWEN_DEFAULT_SYSTEM),
    "llama3": Llama3(),
    "gemma": Gemma(),
}
# The special tokens a SentencePiece model needs for the polyalign template (BOS is built in).
POLYALIGN_SPECIAL_TOKENS = (ChatML.start, ChatML.end_of_turn)
# Every special token the built-in templates use.
TEMPLATE_SPECIAL_TOKENS = (BOS, ChatML.start, ChatML.end_of_turn, Llama3.bos, Llama3.header_start,
                           Llama3.header_end, Llama3.end_of_turn, Gemma.bos, "<eos>", Gemma.start, Gemma.end_of_turn)


# The official template of each model family, for a tokenizer that names none (Qwen3 checkpoints ship
# their own).
FAMILY_TEMPLATES = {"qwen2": "qwen", "llama": "llama3", "gemma2": "gemma", "gemma3": "gemma"}


TEMPLATE_CHOICES = (CHECKPOINT_TEMPLATE, *TEMPLATES)


def choose_template(tokenizer: Tokenizer, requested: str | None = None, family: str | None = None,
                    where: str = "tokenizer", notes: list[str] | None = None) -> str:
    """The one rule for which chat template renders a conversation: the one asked for; else the
    built-in one a polyalign tokenizer names; else the checkpoint's own Jinja template (so that a
    fine-tuned checkpoint's custom template is never replaced by a built-in one); else the official
    template of the model's family. Asking for another than the one the tokenizer names is said (and
    added to `notes`)."""
    if requested == CHECKPOINT_TEMPLATE and tokenizer.template_source is None:
        raise ChatTemplateError(f"{where}: --template {CHECKPOINT_TEMPLATE} asks for the checkpoint's own chat "
                                "template, and its tokenizer_config.json has none (nor chat_template.jinja)")
    if not requested and tokenizer.chat_template and tokenizer.chat_template not in TEMPLATE_CHOICES:
        raise ChatTemplateError(f"{tokenizer.config_file}: polyalign_chat_template "
                                f"{tokenizer.chat_template!r} is not one of {', '.join(TEMPLATE_CHOICES)}; "
                                "--template renders with another")
    own = tokenizer.chat_template or (CHECKPOINT_TEMPLATE if tokenizer.template_source else None)
    if requested and own and requested != own:
        # as trained_profile says of a profile: the model may never have read such a rendering
        _say(f"{where} names chat template {own!r}; rendering with {requested!r} as asked", notes)
    name = requested or own or FAMILY_TEMPLATES.get(family)
    if name is None:
        unknown = (f"polyalign has no built-in template for the {family} family, whose checkpoints ship their own "
                   "(put it in tokenizer_config.json's chat_template or chat_template.jinja)" if family else
                   "the model family is unknown")
        fitting = _fitting_templates(tokenizer)
        choices = f"one whose tokens it has ({', '.join(fitting)})" if fitting else f"one of {', '.join(TEMPLATES)}"
        raise ChatTemplateError(f"{where}: the tokenizer has no chat template and {unknown}; or pass --template with "
                                f"{choices}")
    missing = _missing_tokens(name, tokenizer)
    if missing:
        why = ("asked for" if requested else f"named by {tokenizer.config_file}" if own else
               f"the {family} family's, since the tokenizer has no chat template of its own")
        fitting = _fitting_templates(tokenizer)
        fix = (f"pass --template with one whose tokens it has ({', '.join(fitting)})" if fitting else
               "give the tokenizer a chat_template (tokenizer_config.json) and pass --template checkpoint")
        raise ChatTemplateError(f"{where}: chat template {name!r} ({why}) needs {', '.join(map(repr, missing))}, "
                                f"which the tokenizer does not have as tokens; {fix}")
    return name


def _fitting_templates(tokenizer: Tokenizer) -> list[str]:
    """The built-in templates whose tokens the tokenizer has, for a refusal to offer. One with its own default
    system prompt (Qwen's "You are Qwen...") says so: the model would read it in every conversation that
    has no system message."""
    return [t + (" (adds its own default system prompt where a conversation has none)"
                 if getattr(TEMPLATES[t], "default_system", None) else "")
            for t in TEMPLATES if not _missing_tokens(t, tokenizer)]


def _missing_tokens(name: str, tokenizer: Tokenizer) -> list[str]:
    """The special tokens built-in template `name` renders that `tokenizer` lacks (none for the
    checkpoint's own template, which its tokenizer defines)."""
    template = TEMPLATES.get(name)
    if template is None:
        return []
    return [token for token in template.special_tokens() if tokenizer.token_to_id(token) is None]


def get_template(name: str, tokenizer: Tokenizer | None = None, kwargs: dict | None = None) -> ChatTemplate:
    """A built-in template by name, or `checkpoint`: the tokenizer's own Jinja template, rendered with
    the extra template variables `kwargs` (enable_thinking, ...)."""
    if name == CHECKPOINT_TEMPLATE:
        if tokenizer is None or tokenizer.template_source is None:
            raise ChatTemplateError("the checkpoint's chat template needs its tokenizer, which has none")
        return JinjaTemplate(tokenizer.template_source, tokenizer, kwargs)
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ChatTemplateError(f"unknown chat template {name!r} (known: {', '.join(TEMPLATE_CHOICES)})") from None


# --- token ids and loss masks ---------------------------------------------------------------------

def truncation_lengths(source_len: int, target_len: int, cutoff: int) -> tuple[int, int]:
    """How many prompt and response tokens survive a cutoff (METHOD section 8): a short response is
    kept whole; else a short prompt is; else both are cut in proportion."""
    if 2 * target_len < cutoff:
        max_target = cutoff
    elif 2 * source_len < cutoff:
        max_target = cutoff - source_len
    else:
        max_target = int(cutoff * target_len / (source_len + target_len))
    new_target = min(max_target, target_len)
    new_source = min(max(cutoff - new_target, 0), source_len)
    return new_source, new_target


def encode_pieces(pieces: Sequence[Piece], tokenizer: Tokenizer,
                  labelled_turns: set[int]) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    mask: list[bool] = []
    texts = [p.text for p in pieces if not p.special and p.text]
    encoded = iter(tokenizer.encode_batch(texts))
    for piece in pieces:
        if piece.special:
            piece_ids = [tokenizer.special_id(piece.text)]
        elif piece.text:
            piece_ids = next(encoded)
        else:
            continue
        ids += piece_ids
        mask += [piece.turn is not None and piece.turn in labelled_turns] * len(piece_ids)
    return ids, mask


def encode_rendered(text: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids of a text that may hold special tokens written out (a rendered chat template, `prompts`'
    `prompt` field): each one read as its id, as transformers and vLLM read such text, and the text between
    them encoded as usual. Nothing is added (no BOS the text does not hold)."""
    pieces = [Piece(t, special=special) for t, special, _ in split_pieces(text, {}, tokenizer.added_tokens())]
    return encode_pieces(pieces, tokenizer, set())[0]


def encode_conversation(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message], *,
                        train_on: str = "last", cutoff: int | None = None,
                        truncation: str = "left") -> Encoded:
    """Token ids and loss mask for a conversation ending with the assistant response to learn.

    The mask covers the final response and its end-of-turn token (train_on="last"), or every
    assistant turn (train_on="all"). Whatever the template puts after the final end-of-turn token
    is left out: nothing would learn from it. A cutoff truncates as `truncation_lengths` says:
    the response loses tokens from its end, the prompt from its start: with `truncation` "left" (METHOD
    section 8's reference recipe) from its very start, with "keep_system" after the system message that
    opens it (the profile prompt Bucket-SFT and HDPO condition on). "turns" drops the prompt's oldest whole
    turns instead, as generation does (`cut_prompt`): the opening system message kept, the conversation
    resuming at a user turn; only a last question still over the prompt's share is cut inside, as keep_system
    cuts it. Both keep the system message within half of the prompt's share; where a cut would open inside a
    longer one, it goes whole (`system_left_out`) rather than leave its tail without a header: the prompt is
    then the conversation as the template renders it with no system message, `turns` fitting its whole turns
    to the share again (not under a template that writes a system turn of its own: system_turn_length). A
    conversation with no system message keeps the system turn the template writes of its own (Qwen's, Llama
    3's) as its head.
    """
    if truncation not in TRUNCATIONS:
        raise ChatTemplateError(f"truncation {truncation!r} is not one of {', '.join(TRUNCATIONS)}")
    if train_on not in TRAIN_ON:
        raise ChatTemplateError(f"train_on {train_on!r} is not one of {', '.join(TRAIN_ON)}")
    if not messages or messages[-1].role != "assistant":
        raise ChatTemplateError("the conversation must end with the assistant response to learn")
    original = list(messages)
    source_ids, source_mask, target_ids, target_mask = _prompt_and_answer(template, tokenizer, messages, train_on)
    truncated = system_cut = mid_turn = reply_cut = system_left_out = False
    dropped = system_dropped = 0
    if cutoff is not None and len(source_ids) + len(target_ids) > cutoff:
        keep_source, keep_target = truncation_lengths(len(source_ids), len(target_ids), cutoff)
        share = keep_source
        if truncation == "turns" and keep_source < len(source_ids):
            # the prompt loses whole turns until it fits its share, as a generation prompt does; the answer,
            # unchanged, takes what is left
            messages, dropped, system_dropped = _drop_turns(template, tokenizer, original, share, train_on)
            if dropped:
                source_ids, source_mask, _, _ = _prompt_and_answer(template, tokenizer, messages, train_on)
                keep_source = min(keep_source, len(source_ids))  # under it, unless the last question is still over
                keep_target = min(len(target_ids), cutoff - keep_source)
        head = opening_head(template, tokenizer, messages, source_ids, keep_source) if truncation != "left" else 0
        start = len(source_ids) - (keep_source - head)
        if truncation != "left" and head == 0 and 0 < start < system_turn_length(template, tokenizer, messages,
                                                                                    source_ids):
            # the opening system message, over half the prompt's share, goes whole rather than leave its tail
            # without a header: the rest is rendered as the template renders a conversation that has none,
            # `turns` fitting its whole turns again
            system_left_out = True
            if truncation == "turns":  # resuming at a user turn, as it did with the system message before it
                messages, dropped, system_dropped = _drop_turns(template, tokenizer, original[1:], share, train_on,
                                                                from_user=True)
            else:
                messages = messages[1:]
            source_ids, source_mask, _, _ = _prompt_and_answer(template, tokenizer, messages, train_on)
            keep_source = min(share, len(source_ids))
            keep_target = min(len(target_ids), cutoff - keep_source)
            head = opening_head(template, tokenizer, messages, source_ids, keep_source)
            start = len(source_ids) - (keep_source - head)
        # an earlier reply the cut opened inside (train_on all) is not trained: it would teach a reply from its middle
        end = start
        while 0 < end < len(source_mask) and source_mask[end] and source_mask[end - 1]:
            end += 1
        source_mask = source_mask[:start] + [False] * (end - start) + source_mask[end:]
        # counted by what the cut took: one that took only the BOS keeps the system message whole, and one at the
        # newline between two turns opens at a turn's header, not inside a turn
        truncated, system_cut = True, system_left_out or (messages[0].role == "system" and head == 0 and start > 0
                                                          and not _text_free(tokenizer, source_ids[:start]))
        mid_turn = start > head and not _opens_at_turn(template, tokenizer, source_ids, start)
        reply_cut = keep_target < len(target_mask)
        source_ids, source_mask = source_ids[:head] + source_ids[start:], source_mask[:head] + source_mask[start:]
        target_ids, target_mask = target_ids[:keep_target], target_mask[:keep_target]
    return Encoded(np.asarray(source_ids + target_ids, np.int32), np.asarray(source_mask + target_mask, bool),
                   truncated, system_cut, mid_turn, dropped, reply_cut, system_dropped, system_left_out)


def _text_free(tokenizer: Tokenizer, ids: Sequence[int]) -> bool:
    """Whether `ids` hold no text: a BOS, the newlines between turns."""
    return all(not tokenizer.decode([token]).strip() for token in ids)


def _opens_at_turn(template: ChatTemplate, tokenizer: Tokenizer, ids: Sequence[int], start: int) -> bool:
    """Whether a prompt cut to begin at `ids[start]` opens between turns: what it dropped since the last
    end-of-turn token (or since the prompt's start) holds no text, so the kept ids begin with a turn's header."""
    end_of_turn = tokenizer.token_to_id(template.end_of_turn)
    for token in reversed(ids[:start]):
        if token == end_of_turn:
            return True
        if tokenizer.decode([token]).strip():
            return False
    return True


def _drop_turns(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message], share: int,
                train_on: str, from_user: bool = False) -> tuple[list[Message], int, int]:
    """A conversation less as few of its oldest whole turns as fit its prompt in `share` tokens (`fit_messages`),
    how many messages before the reply went, and how many of those were system messages from inside it."""
    last = len(messages) - 1
    answer = messages[last]
    kept = fit_messages(template, tokenizer, messages[:last], share, length=lambda prompt: len(
        _prompt_and_answer(template, tokenizer, [*prompt, answer], train_on)[0]), from_user=from_user)
    notes = sum(m.role == "system" for m in messages[:last]) - sum(m.role == "system" for m in kept)
    return [*kept, answer], last - len(kept), notes


def _prompt_and_answer(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message], train_on: str
                       ) -> tuple[list[int], list[bool], list[int], list[bool]]:
    """A conversation's ids and loss mask before its final answer, and the answer's with its end-of-turn token."""
    last = len(messages) - 1
    assistant_turns = {i for i, m in enumerate(messages) if m.role == "assistant"}
    labelled = assistant_turns if train_on == "all" else {last}
    pieces = template.pieces(messages)
    located = {p.turn for p in pieces}
    for turn in sorted(labelled - located):
        raise ChatTemplateError(unlocated_turn(template, messages, turn))
    final = max(i for i, p in enumerate(pieces) if p.turn == last)  # the final end-of-turn piece
    first = min(i for i, p in enumerate(pieces) if p.turn == last)
    return (*encode_pieces(pieces[:first], tokenizer, labelled), *encode_pieces(pieces[first:final + 1], tokenizer,
                                                                                 labelled))


def unlocated_turn(template: ChatTemplate, messages: Sequence[Message], turn: int) -> str:
    """Why a template's rendering does not show where assistant turn `turn` lies (JinjaTemplate locates a
    turn by rendering the conversation up to it after its generation prompt)."""
    if turn == len(messages) - 1:
        prompt = template.render(messages[:turn], add_generation_prompt=True)
        written = template.render(messages)
        at = next((i for i, (a, b) in enumerate(zip(prompt, written)) if a != b), min(len(prompt), len(written)))
        return (f"{template.name}: the conversation written with its final answer does not begin with the prompt the "
                f"template writes for generation (add_generation_prompt=True): after {prompt[max(at - 30, 0):at]!r} "
                f"the prompt goes on with {prompt[at:at + 20]!r}, the written turn with {written[at:at + 20]!r}; a "
                "model trained on the written turns would be prompted with a header it never saw. Make the generation "
                "prompt the opening of the template's assistant turn, or mark answers with {% generation %} blocks")
    return (f"{template.name}: cannot tell where assistant turn {turn} lies (the template writes earlier turns "
            "differently once later ones follow); train on the last turn (build --train-on last), or use a template "
            "with {% generation %} blocks")


def encode_prompt(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message],
                  max_tokens: int | None = None) -> np.ndarray:
    """Token ids of a prompt that ends with the assistant header, ready for generation; one over
    `max_tokens` is cut as `cut_prompt` says."""
    return cut_prompt(template, tokenizer, messages, max_tokens).ids


class CutPrompt(NamedTuple):
    ids: np.ndarray  # int32
    cut: bool  # longer than max_tokens: its oldest turns were dropped (and its ids cut, if still over)
    system_lost: bool  # cut, and its opening system message (the profile prompt) went with them
    messages: list[Message]  # what the ids render: the conversation less the whole turns the cut dropped
    mid_turn: bool = False  # still over with its last question left: its ids open inside a turn


def lost_whole_turns(messages: Sequence[Message], kept: Sequence[Message]) -> bool:
    """Whether a cut prompt (`kept`: CutPrompt.messages of `messages`) lost whole turns, not only its opening
    system message (one over half the budget goes alone): fewer messages after it than there were. generate
    and prompts count their cuts with it, so the same records read the same in both."""
    head = int(bool(messages) and messages[0].role == "system")
    after = len(kept) - int(head and list(kept[:1]) == list(messages[:1]))
    return after < len(messages) - head


def prompt_ids(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message]) -> list[int]:
    """The ids of a generation prompt, whole."""
    return encode_pieces(template.pieces(messages, add_generation_prompt=True), tokenizer, set())[0]


def cut_prompt(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message],
               max_tokens: int | None) -> CutPrompt:
    """encode_prompt's ids, and what a cut took. A prompt over `max_tokens` loses its oldest whole turns
    (`fit_messages`: the opening system message, the profile's instructions, kept; the conversation resuming
    at a user turn), as an engine given messages would be; one still over with only its last question left
    keeps its opening system message (within half of `max_tokens`: system_head; a longer one goes whole
    rather than leave its tail without a header, and the turns are fitted again without it) and its latest
    tokens."""
    ids = prompt_ids(template, tokenizer, messages)
    if max_tokens is None or len(ids) <= max_tokens:
        return CutPrompt(np.asarray(ids, np.int32), False, False, list(messages))
    kept = fit_messages(template, tokenizer, messages, max_tokens)
    ids = prompt_ids(template, tokenizer, kept)
    if len(ids) <= max_tokens:
        return CutPrompt(np.asarray(ids, np.int32), True, False, kept, False)
    head = opening_head(template, tokenizer, kept, ids, max_tokens)
    lost = head == 0 and messages[0].role == "system"
    if head == 0 and len(ids) - max_tokens < system_turn_length(template, tokenizer, kept, ids):
        # over half the budget, the opening system message goes whole, not as a tail without its header: the
        # conversation without it fits its whole turns again (resuming at a user turn)
        kept = fit_messages(template, tokenizer, messages[1:], max_tokens, from_user=True)
        ids = prompt_ids(template, tokenizer, kept)
        head = opening_head(template, tokenizer, kept, ids, max_tokens)
    over = len(ids) > max_tokens
    if over:
        ids = ids[:head] + ids[len(ids) - (max_tokens - head):]
    return CutPrompt(np.asarray(ids, np.int32), True, lost, kept, over)


def fit_messages(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message], max_tokens: int,
                 length: Callable[[list[Message]], int] | None = None, from_user: bool = False) -> list[Message]:
    """`messages` whose rendered prompt fits `max_tokens`: as few of the oldest whole turns dropped as make it
    fit (the opening system message kept, the conversation resuming at a user turn, with the system messages
    just before it), never the last question or what follows it. Messages still over the budget then stay so
    (only cut_prompt's ids cut inside a turn). `length`: how many tokens kept messages take (default: their
    generation prompt's). `from_user`: a conversation with no system message that opens with an assistant turn
    (a greeting) resumes at a user turn even where it would fit whole: what is left once a cut left its system
    message out opens as the conversation did with it."""
    messages = list(messages)
    head = 1 if messages and messages[0].role == "system" else 0
    last_question = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages) - 1)
    starts = [head]
    for i in range(head + 1, last_question + 1):
        if messages[i].role == "user" or i == last_question:
            while i - 1 > starts[-1] and messages[i - 1].role == "system":  # a system message it follows goes with it
                i -= 1
            starts.append(i)
    if from_user and head == 0 and messages and messages[0].role == "assistant" and len(starts) > 1:
        starts = starts[1:]

    measure = length or (lambda kept: len(prompt_ids(template, tokenizer, kept)))

    def fits(start: int) -> bool:
        return measure([*messages[:head], *messages[start:]]) <= max_tokens

    # a later start renders fewer tokens: the earliest that fits by bisection, the last question if none does
    low, high = 0, len(starts) - 1
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(starts[middle]) else (middle + 1, high)
    return [*messages[:head], *messages[starts[low]:]]


def system_turn_length(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message],
                       ids: Sequence[int]) -> int:
    """How many of a conversation's first `ids` are its opening system message, rendered as a turn of its own
    with what the template puts before it (a BOS): a cut that opens inside them leaves the message out instead.
    0 where there is none, where the template folds it into the first user turn (Gemma: a cut there opens
    inside that turn whatever it does), where it writes a system turn of its own for a conversation without
    one (Qwen's identity prompt, Llama 3's date header: leaving the message out would put a system prompt in
    its place that the conversation never had, and lose the profile prompt that closes the message; a user's
    build under Qwen's template at 128 tokens read Qwen's identity prompt in 1,024 of 1,438 examples that way),
    or where the conversation does not go on with a user turn (or a system note before one)."""
    if not messages or messages[0].role != "system" or len(messages) < 2 or messages[1].role == "assistant" \
            or not any(m.role == "user" for m in messages[1:]) or _writes_own_system_turn(template):
        return 0
    try:
        alone, _ = encode_pieces(template.pieces(messages[:1], add_generation_prompt=False), tokenizer, set())
    except ChatTemplateError:
        return 0
    return len(alone) if list(ids[:len(alone)]) == alone else 0


def _writes_own_system_turn(template: ChatTemplate) -> bool:
    """Whether the template renders a system turn for a conversation that has no system message."""
    try:
        # a role name opens a turn's text after its special token ("system\n..." in a checkpoint's Jinja ChatML)
        pieces = template.pieces([Message("user", "?")])
        return any(not p.special and p.text.lstrip().startswith("system") for p in pieces)
    except ChatTemplateError:
        return False


def opening_head(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message], ids: Sequence[int],
                 budget: int) -> int:
    """What a cut keeps before a prompt's latest tokens: its opening system message (system_head), or, for a
    conversation with none, the system turn the template writes of its own (own_system_head)."""
    if messages and messages[0].role == "system":
        return system_head(template, tokenizer, messages, ids, budget)
    return own_system_head(template, tokenizer, ids, budget)


def own_system_head(template: ChatTemplate, tokenizer: Tokenizer, ids: Sequence[int], budget: int) -> int:
    """How many of the first `ids` of a conversation with no system message are the system turn the template
    writes of its own (Qwen's identity prompt, Llama 3's date header): what a cut keeps before its latest
    tokens, as system_head keeps an opening system message. 0 where the template writes none, or where it
    would take more than half of the `budget`."""
    if not _writes_own_system_turn(template):
        return 0
    pieces = template.pieces([Message("user", "?")])
    end = next((i for i, p in enumerate(pieces) if p.special and p.text == template.end_of_turn), None)
    if end is None:
        return 0
    head, _ = encode_pieces(pieces[:end + 1], tokenizer, set())
    return len(head) if list(ids[:len(head)]) == head and len(head) <= budget // 2 else 0


def system_head(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message], ids: Sequence[int],
                budget: int) -> int:
    """How many of a prompt's first `ids` are its opening system message, as the template renders it alone:
    what a cut prompt keeps before its latest turns. A template that folds it into the first user turn
    (Gemma) renders no system message alone: there the head is what the prompt shares with that turn
    holding the system text alone (BOS, the turn's header, the system text). 0 when there is none, or
    when it would take more than half of the `budget` of tokens kept."""
    if not messages or messages[0].role != "system":
        return 0
    try:
        head, _ = encode_pieces(template.pieces(messages[:1], add_generation_prompt=False), tokenizer, set())
    except ChatTemplateError:  # folded into the first user turn: the prefix before the user's own text
        try:
            alone, _ = encode_pieces(template.pieces([messages[0], Message("user", "")]), tokenizer, set())
        except ChatTemplateError:
            return 0
        shared = next((i for i, (a, b) in enumerate(zip(alone, ids)) if a != b), min(len(alone), len(ids)))
        head = list(ids[:shared])
    return len(head) if list(ids[:len(head)]) == head and len(head) <= budget // 2 else 0
