"""A checkpoint's own Jinja chat template, rendered exactly as transformers' apply_chat_template
renders it, with the assistant turns located by rendering rather than by guessing.

The environment is transformers' (a sandbox, trim_blocks and lstrip_blocks, loop controls, its tojson,
raise_exception and strftime_now), so a template renders the same string in both. Where each
assistant turn lies in that string is found in one of two ways:
- a template with `{% generation %}` blocks marks its assistant text itself (what
  return_assistant_tokens_mask reads);
- otherwise turn k is what rendering messages[:k+1] adds to messages[:k] rendered with the generation
  prompt: exactly what a model is asked to produce after that prompt. This needs the rendering to be
  stable under appending turns, which is checked; a template that rewrites earlier turns (dropping
  the reasoning of past turns, say) has no such span for them, and asking to train on them is an error.
A turn's span ends with its last special token (the end-of-turn): what the template writes after it
(a newline) is no target, as with the built-in templates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from polyalign.core.errors import ChatTemplateError
from polyalign.tokens.profile_template import DEFAULT_TEMPLATE_KWARGS

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _environment():
    class GenerationBlocks(Extension):
        """`{% generation %}...{% endgeneration %}`: records where each block's output lands."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(generation_spans=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            return f"{MARK_OPEN}{text}{MARK_CLOSE}" if self.environment.generation_spans else text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlocks, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment


# Private-use characters around `{% generation %}` output while spans are being located.
MARK_OPEN, MARK_CLOSE = "\U000f0001", "\U000f0002"


class JinjaRenderer:
    """Renders one template source; `special_tokens` are bos_token, eos_token, ... as the template sees
    them, `kwargs` the extra template variables (enable_thinking, date_string, ...)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None], kwargs: Mapping[str, Any] = ()):
        self.source = source
        self.environment = _environment()
        try:
            self.template = self.environment.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"chat template line {err.lineno}: {err.message}") from None
        self.variables = {**{k: v for k, v in special_tokens.items() if v is not None},
                          **DEFAULT_TEMPLATE_KWARGS, **dict(kwargs)}
        self.has_generation_blocks = bool(GENERATION_TAG.search(source))

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.variables)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template refused the conversation: {err}") from None

    @contextmanager
    def _marking(self):
        self.environment.generation_spans = True
        try:
            yield
        finally:
            self.environment.generation_spans = None

    def generation_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendering and the span of each `{% generation %}` block in it."""
        for message in messages:
            if MARK_OPEN in message["content"] or MARK_CLOSE in message["content"]:
                raise ChatTemplateError("a message holds a private-use character polyalign marks turns with")
        with self._marking():
            marked = self.render(messages)
        text, spans, position = [], [], 0
        for part in re.split(f"({MARK_OPEN}|{MARK_CLOSE})", marked):
            if part == MARK_OPEN:
                spans.append([position, None])
            elif part == MARK_CLOSE:
                spans[-1][1] = position
            else:
                text.append(part)
                position += len(part)
        return "".join(text), [(start, end) for start, end in spans]

    def turn_spans(self, messages: Sequence[dict]) -> tuple[str, dict[int, tuple[int, int]]]:
        """The rendering of a whole conversation and, for each assistant message it can locate, the
        characters that turn adds (see the module's docstring)."""
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.has_generation_blocks:
            text, spans = self.generation_spans(messages)
            if len(spans) != len(assistant):
                raise ChatTemplateError(f"the chat template marks {len(spans)} generation blocks in a conversation "
                                        f"with {len(assistant)} assistant turns")
            return text, dict(zip(assistant, spans))
        text = self.render(messages)
        spans = {}
        for k in assistant:
            prompt = self.render(messages[:k], add_generation_prompt=True)
            upto = text if k == len(messages) - 1 else self.render(messages[:k + 1])
            if text.startswith(upto) and upto.startswith(prompt):
                spans[k] = (len(prompt), len(upto))
        return text, spans
