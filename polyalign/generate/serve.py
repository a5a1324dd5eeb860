"""`polyalign serve`: an OpenAI-compatible HTTP endpoint over the generation engine.

GET /v1/models, POST /v1/chat/completions (messages rendered with the checkpoint's own chat template,
as `generate` renders records) and POST /v1/completions (the prompt's own tokens). Requests join the
engine's running batch as they arrive (EngineLoop). FastAPI parses and validates each request; anything
malformed is answered 400 in OpenAI's error shape, an unknown model 404, and a request beyond the
bounded queue 429; none of them reaches the engine. `stream: true` answers as OpenAI's API streams
(server-sent events of chunks, then `data: [DONE]`): the text arrives as the engine decodes it, and the
chunks of a choice join into the answer the same request gets unstreamed.
"""
# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at run time.

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import difflib
import functools
import json
import os
import queue
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from polyalign.core.errors import GenerationError, PolyalignError
from polyalign.core.extras import require
from polyalign.core.paths import is_uri
from polyalign.data.text import normalize
from polyalign.generate.engine import Completion, Engine, EngineConfig, EngineLoop, Request, request_seed
from polyalign.generate.run import open_checkpoint, run_name
from polyalign.generate.sampling import SamplingConfig
from polyalign.generate.settings import (
    CHECKPOINT_KEYS,
    NEUTRAL,
    OPENAI_SAMPLING,
    checkpoint_greedy,
    checkpoint_sampling,
    describe_sampling,
)
from polyalign.model.architecture import longer_than_positions, position_limit
from polyalign.tokens.chat import Message, encode_prompt, encode_rendered, profile_text, with_system_prompt
from polyalign.tokens.profile_template import (
    PROFILE_KEYS,
    PROFILE_MODE_KEYS,
    profile_example,
    profile_problem,
    trained_profile_text,
)
from polyalign.tokens.tokenizer import never_trained_past, trained_length

DEFAULT_PORT = 8000
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
STOP_ANSWER_S = 5  # after Ctrl-C or SIGTERM, how long running requests may still finish before a 503
CONTINUATION_CONTEXT = 6  # prompt tokens a completion is decoded after, for its leading space (vLLM's start 5 back)


@dataclass(frozen=True)
class ServeOptions:
    """host, port; slots and max_sequence of the engine; max_pending: requests waiting or running at
    once (more are answered 429); max_new_tokens: a request's budget when it names none; model_name:
    what /v1/models lists (default: the checkpoint's run folder); log_requests: a line per request on
    standard output (time, method, path, status, seconds, prompt + completion tokens); steps_per_sync: tokens
    each sequence decodes between two visits of the scheduler (EngineConfig), so the size of a streamed piece."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    slots: int = 16
    max_sequence: int | None = None  # None: the model's positions, at most DEFAULT_MAX_SEQUENCE
    max_pending: int = 64
    max_new_tokens: int = 256
    model_name: str | None = None
    log_requests: bool = True
    steps_per_sync: int = 8  # the engine's decoding steps between scheduler visits: a stream's piece size


class _ApiError(PolyalignError):
    """A request the endpoint answers with an HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def _models():
    """The request bodies, as pydantic models (FastAPI validates against them)."""
    from pydantic import BaseModel, ConfigDict, Field  # installed with fastapi, the serve extra

    class ContentPart(BaseModel):  # text is read; any other kind is refused by name (_text)
        model_config = ConfigDict(extra="allow")
        type: str
        text: str | None = None

    class ChatMessage(BaseModel):
        role: Literal["system", "developer", "user", "assistant"]
        content: str | list[ContentPart]

    class StreamOptions(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        include_usage: bool = False  # a last chunk with the request's usage, as OpenAI sends it
        # OpenAI pads chunks against length side channels; on this server's own machine there is none to close
        include_obfuscation: bool | None = None

    class Sampling(BaseModel):
        # strict: "10" is not a number and true is not 1; fields polyalign cannot honour are refused below
        model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # NaN is no temperature
        model: str | None = None
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        # unset: the checkpoint's generation_config.json, else OpenAI's (Service.sampling_defaults)
        temperature: float | None = Field(None, ge=0.0, le=2.0)
        top_p: float | None = Field(None, gt=0.0, le=1.0)
        top_k: int | None = Field(None, ge=-1)  # vLLM's -1 or 0: no cut
        # vLLM's extra sampling parameters, then OpenAI's penalties (sampling.SamplingConfig says what they do)
        min_p: float | None = Field(None, ge=0.0, le=1.0)
        repetition_penalty: float | None = Field(None, gt=0.0)
        presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
        frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
        n: int = Field(1, ge=1, le=16)
        seed: int | None = None
        # one string or up to four (the limit is the list's, not the string's length)
        stop: str | Annotated[list[str], Field(max_length=4)] | None = None
        stream: bool = False
        stream_options: StreamOptions | None = None

    class ChatRequest(Sampling):
        messages: list[ChatMessage] = Field(min_length=1)
        # vLLM's name for template variables: polyalign's profile (family, track, style, length)
        chat_template_kwargs: dict[str, Any] | None = None  # keys checked before value types (below)

    class CompletionRequest(Sampling):
        # text (special tokens written out are read as such), or token ids as OpenAI's API takes them
        # (`polyalign prompts --max-prompt-tokens` writes each row's prompt_token_ids)
        prompt: str | list[str] | list[int] | list[list[int]]

    return ChatRequest, CompletionRequest


def _text(content) -> str:
    for part in [] if isinstance(content, str) else content:
        if part.type != "text" or part.text is None:
            what = f"a content part of type {part.type!r}" if part.type != "text" else "a text part without text"
            raise _ApiError(400, f"{what}: polyalign serve reads text only", param="messages")
    # text parts joined by a newline, as prepare read them in training (and the exported template reads them)
    text = content if isinstance(content, str) else "\n".join(part.text for part in content)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate such as "\ud800" (valid JSON, not text)
        raise _ApiError(400, f"the text is not valid Unicode ({error.reason} at character {error.start})") from None
    return text


# OpenAI's and vLLM's parameters the engine cannot honour, with the values that ask for nothing; any other
# value is refused rather than silently dropped.
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "tools": (None, []),
               "tool_choice": (None, "none"), "functions": (None, []), "response_format": (None, {"type": "text"}),
               "logit_bias": (None, {}), "echo": (None, False), "suffix": (None,), "best_of": (None, 1),
               "parallel_tool_calls": (None, True, False), "modalities": (None, ["text"]),
               "reasoning_effort": (None,), "min_tokens": (None, 0), "ignore_eos": (None, False),
               "stop_token_ids": (None, []), "skip_special_tokens": (None, True), "use_beam_search": (None, False),
               "spaces_between_special_tokens": (None, True), "include_stop_str_in_output": (None, False),
               "length_penalty": (None, 1, 1.0), "truncate_prompt_tokens": (None,), "add_special_tokens": (None, False),
               "add_generation_prompt": (None, True), "continue_final_message": (None, False),
               "prompt_logprobs": (None, 0), "prediction": (None,), "audio": (None,), "web_search_options": (None,)}
# A completion's logprobs is a count, and 0 asks for each sampled token's own (a chat request's is true/false)
COMPLETION_UNSUPPORTED = {**UNSUPPORTED, "logprobs": (None,)}
# The fields a request may give in several forms, as said where none of the forms fits (pydantic says why
# each form does not, "stop.str: ...; stop.list[str]: ...", which reads as the type checker's, not the API's).
UNION_SHAPES = {"stop": "a string or a list of at most 4 strings",
                "prompt": "a string, a list of strings, a list of token ids, or a list of token id lists",
                "content": 'a string or a list of content parts ({"type": "text", "text": "..."})'}
# OpenAI's parameters that do not change an answer (who asked, what to keep of the exchange): taken as given
NO_EFFECT = ("user", "metadata", "store", "service_tier")


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text up to the first stop string, and whether one was found."""
    ends = [text.index(s) for s in stops if s and s in text]
    return (text[:min(ends)], True) if ends else (text, False)


def _event(body: dict) -> str:
    """One server-sent event, as OpenAI's API streams a chunk."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _StreamedText:
    """What a streamed choice has sent of its text. An update sends only what later tokens cannot change:
    not the last characters that may begin a stop string (the answer is cut before it), not a character
    whose bytes are still arriving (decoded as U+FFFD), not trailing whitespace (a tokenizer may join it to
    what follows). The finished answer, as an unstreamed request gets it, sends the rest."""

    def __init__(self, text_of: Callable[[list[int]], str], stops: list[str]):
        self.text_of, self.stops, self.sent = text_of, stops, ""
        self.hold = max((len(stop) for stop in stops), default=1) - 1

    def update(self, tokens: list[int]) -> str:
        text, stopped = _cut_at_stop(self.text_of(tokens), self.stops)
        if not stopped:
            # a character still arriving is only ever at the end (a U+FFFD inside is the model's own); the stop
            # string's possible beginning is held back from what is left, real characters
            text = text.rstrip("\ufffd")
            text = text[:max(len(text) - self.hold, 0)]
        return self._send(text.rstrip())

    def finish(self, answer: str) -> str:
        # what was sent is the answer's beginning (update sends nothing later tokens change), so the rest follows;
        # were it not, the rest after what they share, rather than repeating text the client has
        shared = len(self.sent) if answer.startswith(self.sent) else len(os.path.commonprefix([answer, self.sent]))
        return answer[shared:]

    def _send(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


@dataclass(frozen=True)
class Streamed:
    """A streamed answer: its server-sent events, and what drops its requests from the engine."""

    events: Any
    cancel: Callable[[], None]


class Service:
    """What the endpoints do, without HTTP: turn a parsed request into engine requests and the
    engine's completions into OpenAI's response objects."""

    def __init__(self, engine: Engine, tokenizer, chat, model_name: str, options: ServeOptions, created: int = 0,
                 system: str = "keep", sampling: dict[str, float | int] | None = None):
        """`created`: when the model was made (unix seconds; /v1/models says it); `system`: how its training
        composed a conversation's own system messages with the profile prompt (its export's polyalign_system);
        `sampling`: what its generation_config.json sets (checkpoint_sampling), for requests that set none."""
        self.tokenizer, self.chat, self.model_name, self.options = tokenizer, chat, model_name, options
        self.system = system
        self.checkpoint_sampling = dict(sampling or {})
        # a request's unset temperature, top_p, top_k: the checkpoint's, as vLLM takes them, else OpenAI's
        self.sampling_defaults = {**OPENAI_SAMPLING, **self.checkpoint_sampling}
        self.created = created
        self.stopping_since: float | None = None  # set when the server is told to stop
        self.engine = engine
        self.loop = EngineLoop(engine, max_pending=options.max_pending)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "polyalign"}]}

    def _sampling(self, body, prompt: list[int], prompt_param: str = "messages") -> tuple[SamplingConfig, int]:
        """The request's sampling settings and seed. A given seed is mixed with the prompt's tokens: the
        same request draws the same answer, and other prompts (a list of them in one request) do not
        share its random draws."""
        prompt_tokens = len(prompt)
        extra = body.model_extra or {}
        chat = prompt_param == "messages"
        for name, harmless in (UNSUPPORTED if chat else COMPLETION_UNSUPPORTED).items():
            if name in extra and extra[name] not in harmless:
                raise _ApiError(400, f"polyalign serve does not support {name}; send the request without it",
                                param=name)
        unknown = [key for key in extra if key not in UNSUPPORTED and key not in NO_EFFECT and key not in PROFILE_KEYS]
        if not chat and "chat_template_kwargs" in unknown:
            raise _ApiError(400, "chat_template_kwargs fills a chat template, which /v1/completions does not apply "
                                 "(its prompt is read as written): send it to /v1/chat/completions",
                            param="chat_template_kwargs")
        if unknown:  # a misspelt setting would otherwise decode with the default, unnoticed
            known = [*type(body).model_fields, *UNSUPPORTED, *NO_EFFECT]
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise _ApiError(400, f"unknown parameter {unknown[0]!r}{hint} (polyalign serve takes the OpenAI "
                                 "parameters it can honour and vLLM's top_k, min_p, repetition_penalty"
                                 f"{' and chat_template_kwargs' if chat else ''})", param=unknown[0])
        misplaced = [key for key in PROFILE_KEYS if key in extra]
        if misplaced:  # ignored there, the request would run without the profile the client meant to give
            raise _ApiError(400, f"{', '.join(misplaced)}: profile variables go in chat_template_kwargs "
                                 f"({{\"chat_template_kwargs\": {{\"{misplaced[0]}\": ...}}}}), not at the top "
                                 "of the request", param=misplaced[0])
        if body.stream_options is not None and not body.stream:
            raise _ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if body.model is not None and body.model != self.model_name:
            raise _ApiError(404, f"The model {body.model!r} does not exist; this server has {self.model_name!r}",
                            kind="not_found_error", param="model")
        budget = body.max_completion_tokens or body.max_tokens or min(
            self.options.max_new_tokens, self.engine.config.max_sequence - prompt_tokens)
        if budget < 1 or prompt_tokens + budget > self.engine.config.max_sequence:
            too_long = prompt_tokens >= self.engine.config.max_sequence
            asked = f"{prompt_tokens} prompt tokens + {budget} new tokens exceed" if budget >= 1 else (
                f"{prompt_tokens} prompt tokens leave no room for an answer in")  # no max_tokens: what is left
            room = self.engine.config.max_sequence - prompt_tokens
            fix = (f" (max_tokens {room} at most with this prompt; left unset, the server's --max-new-tokens, cut to "
                   "what is left)"
                   if budget >= 1 and room >= 1 else "")
            raise _ApiError(400, f"{asked} this server's {self.engine.config.max_sequence}-token context{fix}",
                            param=prompt_param if too_long else "max_tokens")
        seed = (request_seed(uuid.uuid4().hex) if body.seed is None
                else request_seed(",".join(map(str, prompt)), body.seed))
        given = {key: getattr(body, key) for key in (*OPENAI_SAMPLING, *NEUTRAL) if getattr(body, key) is not None}
        if given.get("top_k") == -1:
            given["top_k"] = 0
        return SamplingConfig(budget, **{**self.sampling_defaults, **given}), seed % 2 ** 32

    def _submit(self, jobs: list[tuple[list[int], SamplingConfig, int, Callable[[list[int]], str]]], n: int,
                stops: list[str], told: Callable[[int, int, list[int] | Completion], None] | None = None
                ) -> list[concurrent.futures.Future]:
        """Each job (prompt, sampling, seed, `text_of`) into the engine as a request of `n` samples. A sample ends
        once its text (`text_of` its tokens) holds one of `stops` (the answer is cut there afterwards);
        `told(job, sample, tokens or completion)` hears of its tokens as they are made and of its end (a streamed
        answer). Nothing stays in the engine when one cannot be taken."""
        futures = []
        try:
            for job, (prompt, sampling, seed, text_of) in enumerate(jobs):
                stop_when = functools.partial(self._stopped, stops=stops, text_of=text_of) if stops else None
                heard = None if told is None else functools.partial(told, job)
                futures.append(self.loop.submit(Request(prompt, sampling, seed=seed, n=n, stop_when=stop_when,
                                                        on_tokens=heard, on_finish=heard)))
        except (queue.Full, GenerationError) as error:
            self._cancel(futures)
            if isinstance(error, queue.Full):
                raise _ApiError(429, f"too many requests at once ({error}); retry later",
                                kind="rate_limit_error") from None
            raise _ApiError(400, str(error)) from None
        return futures

    def _cancel(self, futures) -> None:
        for future in futures:
            if not future.done():
                self.loop.cancel(future)

    def _check_stopping(self, futures) -> None:
        """A request still running STOP_ANSWER_S after the server was told to stop is dropped (503)."""
        if self.stopping_since is not None and time.monotonic() - self.stopping_since > STOP_ANSWER_S:
            self._cancel(futures)
            raise _ApiError(503, "the server is stopping; send the request again once it is back", kind="server_error")

    async def _wait(self, futures, client) -> list[list[Completion]]:
        """The completions of each submitted job; dropped from the engine when `client` (the HTTP request)
        disconnects first, so an abandoned request does not hold slots others wait for."""
        answers = [asyncio.wrap_future(future) for future in futures]
        try:
            while True:
                self._check_stopping(futures)
                _, pending = await asyncio.wait(answers, timeout=DISCONNECT_POLL_S)
                if not pending:
                    return [answer.result() for answer in answers]
                if client is not None and await client.is_disconnected():
                    self._cancel(futures)
                    raise _ApiError(499, "the client closed the connection")
        except asyncio.CancelledError:
            self._cancel(futures)
            raise

    def _stream(self, jobs, n: int, stops: list[str], client, chat: bool, include_usage: bool):
        """The jobs submitted now (a request the engine cannot take is refused before the answer starts) and
        the events that stream their answers."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def told(job: int, sample: int, news: list[int] | Completion) -> None:  # on the engine's thread
            with contextlib.suppress(RuntimeError):  # the event loop closed (the server stopped): nobody listens
                loop.call_soon_threadsafe(updates.put_nowait, (job * n + sample, news))

        futures = self._submit(jobs, n, stops, told)
        return Streamed(self._events(futures, updates, jobs, n, stops, client, chat, include_usage),
                        functools.partial(self._cancel, futures))

    async def _events(self, futures, updates: asyncio.Queue, jobs, n: int, stops: list[str], client, chat: bool,
                      include_usage: bool):
        """Server-sent events of OpenAI's chunks: a chat choice opens with its role; each choice's text as it is
        decoded, then its finish reason; the usage when asked; `data: [DONE]`. However they end, the response
        (EventStream) drops the request from the engine, and the request log says 499 of a stream cut short."""
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name}

        def chunk(index: int, text: str, reason: str | None = None, opening: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if opening else {"content": text} if text else {}
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
            return _event({**head, "choices": [choice], **({"usage": None} if include_usage else {})})

        texts = [_StreamedText(text_of, stops) for *_, text_of in jobs for _ in range(n)]
        answers = [asyncio.wrap_future(future) for future in futures]
        finished: set[int] = set()  # the choices whose last chunk went
        made, getter = 0, None
        try:
            if chat:
                for index in range(len(texts)):
                    yield chunk(index, "", opening=True)
            while len(finished) < len(texts):
                try:
                    self._check_stopping(futures)
                    failed = next((a for a in answers if a.done() and not a.cancelled() and a.exception()), None)
                    if failed is not None:  # the engine stopped; every choice still open would wait forever
                        raise _ApiError(503, str(failed.exception()), kind="server_error")
                except _ApiError as error:
                    _set_state(client, status=error.status)
                    yield _event(error.body())  # then [DONE], as vLLM ends a stream that failed
                    yield "data: [DONE]\n\n"
                    return
                getter = getter or asyncio.ensure_future(updates.get())
                # an answer's end comes after its choices' last news (both leave the engine's thread in that order)
                await asyncio.wait([getter, *(a for a in answers if not a.done())], timeout=DISCONNECT_POLL_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    continue
                index, news = getter.result()
                getter = None
                if index in finished:
                    continue
                if isinstance(news, Completion):  # this choice's end, at its own time (the others may go on)
                    finished.add(index)
                    [(text, reason)], count = self._choices([news], stops, jobs[index // n][3])
                    made += count
                    yield chunk(index, texts[index].finish(text), reason)
                elif delta := texts[index].update(news):
                    yield chunk(index, delta)
            prompt_tokens = sum(len(prompt) for prompt, *_ in jobs)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": made, "total_tokens": prompt_tokens + made}
            _set_state(client, usage=usage)
            if include_usage:
                yield _event({**head, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        except Exception:  # a fault of the server's own: the log says 500, not that the client left
            _set_state(client, status=500)
            raise
        finally:
            if getter is not None:
                getter.cancel()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids: ids as given (each checked against the vocabulary), or the text's
        with its special tokens (`<s>`, `<|im_start|>`) read as tokens, as a chat request's rendering is."""
        if isinstance(prompt, list):
            outside = [t for t in prompt if not 0 <= t < self.tokenizer.vocab_size]
            if outside:
                raise _ApiError(400, f"prompt token id {outside[0]} is outside this model's vocabulary of "
                                     f"{self.tokenizer.vocab_size}", param="prompt")
            return list(prompt)
        return encode_rendered(_text(prompt), self.tokenizer)

    def _choices(self, completions, stops: list[str], text_of: Callable[[list[int]], str]
                 ) -> tuple[list[tuple[str, str]], int]:
        """(text, finish reason) of each completion, and the completion tokens they count: a stopped one
        counts up to the token that completed its stop string, as vLLM counts (decoding runs in calls of
        several tokens, so a few past it were made)."""
        out, made = [], 0
        for completion in completions:
            text, stopped = self._cut(completion.tokens, stops, text_of)
            out.append((text, "stop" if stopped else completion.finish_reason))
            made += self._tokens_to_stop(completion.tokens, stops, text_of) if stopped else len(completion.tokens)
        return out, made

    def _answer(self, tokens) -> str:
        """A chat answer's text, its leading whitespace left out, as chat APIs return an answer and `generate`
        writes a prediction (the answer is the message's whole content, not a continuation of text)."""
        return self.tokenizer.decode(list(tokens), skip_special=True).lstrip()

    def _continuation(self, prompt: list[int], tokens) -> str:
        """A completion's text as it continues its prompt, leading space included: "The sky is" + " blue",
        so that prompt + text is the whole (OpenAI's and vLLM's completions). Decoded after the prompt's
        last tokens, as vLLM's detokenizer does: SentencePiece and Metaspace drop the space of a sequence's
        first piece, which decoding the completion alone would lose."""
        context = list(prompt[-CONTINUATION_CONTEXT:])
        before = self.tokenizer.decode(context, skip_special=True)
        whole = self.tokenizer.decode(context + list(tokens), skip_special=True)
        if whole.startswith(before):
            return whole[len(before):]
        return self.tokenizer.decode(list(tokens), skip_special=True)  # a piece merged across the boundary

    def _stopped(self, tokens: list[int], stops: list[str], text_of: Callable[[list[int]], str]) -> bool:
        return self._cut(tokens, stops, text_of)[1]

    def _cut(self, tokens, stops: list[str], text_of: Callable[[list[int]], str]) -> tuple[str, bool]:
        """The text of `tokens` as `text_of` reads it (a chat answer, a completion), cut at the first stop string,
        and whether one was there."""
        return _cut_at_stop(text_of(tokens), stops)

    def _tokens_to_stop(self, tokens, stops: list[str], text_of: Callable[[list[int]], str]) -> int:
        """The fewest leading tokens whose text holds a stop string (bisection: a prefix that holds one,
        every longer prefix holds it too)."""
        low, high = 1, len(tokens)
        while low < high:
            middle = (low + high) // 2
            if self._cut(tokens[:middle], stops, text_of)[1]:
                high = middle
            else:
                low = middle + 1
        return low

    def _profile_said(self) -> str:
        trained = self.tokenizer.profile_mode
        return "the profile it was trained with is not recorded" if trained is None else trained_profile_text(trained)

    async def chat_completion(self, body, client=None):
        """The answer (OpenAI's chat.completion), or with `stream` the events that stream it."""
        # read as prepare read the training conversations: developer is a system role, whitespace normalised
        messages = [Message("system" if m.role == "developer" else m.role, normalize(_text(m.content)))
                    for m in body.messages]
        variables = body.chat_template_kwargs or {}
        trained = self.tokenizer.profile_mode
        taken = PROFILE_MODE_KEYS[trained] if trained is not None else PROFILE_KEYS
        unknown = [k for k in variables if k not in PROFILE_KEYS]
        if unknown:
            raise _ApiError(400, f"chat_template_kwargs {', '.join(unknown)}: this model's template takes "
                                 f"{', '.join(taken) or 'none'} ({self._profile_said()})",
                            param="chat_template_kwargs")
        for key, value in variables.items():
            if not isinstance(value, str):
                raise _ApiError(400, f"chat_template_kwargs.{key} must be a string, got {json.dumps(value)}",
                                param=f"chat_template_kwargs.{key}")
        # a partial profile, or a value the training data never held, renders a prompt the model never saw
        if problem := profile_problem(variables, trained, self.tokenizer.profile_values, messages):
            raise _ApiError(400, f"chat_template_kwargs {problem}", param="chat_template_kwargs")
        # the profile prompt, composed with the client's own system messages as training composed them
        messages = with_system_prompt(messages, profile_text(variables), self.system)
        prompt = encode_prompt(self.chat, self.tokenizer, messages).tolist()
        sampling, seed = self._sampling(body, prompt)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        jobs = [(prompt, sampling, seed, self._answer)]
        if body.stream:
            return self._stream(jobs, body.n, stops, client, chat=True, include_usage=_include_usage(body))
        [completions] = await self._wait(self._submit(jobs, body.n, stops), client)
        choices, made = self._choices(completions, stops, self._answer)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                             "logprobs": None} for i, (text, reason) in enumerate(choices)],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": made, "total_tokens": len(prompt) + made}}

    async def completion(self, body, client=None):
        """The answer (OpenAI's text_completion), or with `stream` the events that stream it."""
        single = isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int))
        prompts = [body.prompt] if single else body.prompt
        if not prompts or not all(prompts):
            raise _ApiError(400, "prompt must be a non-empty string or token id list, or a list of them",
                            param="prompt")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        encoded = [self._prompt_ids(p) for p in prompts]
        jobs = [(ids, *self._sampling(body, ids, "prompt"), functools.partial(self._continuation, ids))
                for ids in encoded]
        if body.stream:
            return self._stream(jobs, body.n, stops, client, chat=False, include_usage=_include_usage(body))
        results = await self._wait(self._submit(jobs, body.n, stops), client)
        choices, made = [], 0
        for completions, (*_, text_of) in zip(results, jobs):
            texts, count = self._choices(completions, stops, text_of)
            choices += texts
            made += count
        prompt_tokens = sum(len(ids) for ids in encoded)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": i, "text": text, "finish_reason": reason, "logprobs": None}
                            for i, (text, reason) in enumerate(choices)],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": made,
                          "total_tokens": prompt_tokens + made}}


def build_app(service: Service, log: Callable[[str], None] | None = None) -> Any:
    """The FastAPI application over `service`; `log` takes a line per request (time, method, path, status,
    seconds, prompt + completion tokens of an answered one), None: no request log."""
    fastapi = require("fastapi", "serve", "polyalign serve")
    from fastapi.exceptions import RequestValidationError  # the serve extra, present once `require` passed
    from fastapi.responses import JSONResponse, StreamingResponse  # the serve extra
    from starlette.exceptions import HTTPException  # installed with fastapi

    chat_request, completion_request = _models()
    app = fastapi.FastAPI(title="polyalign", docs_url=None, redoc_url=None)

    @app.exception_handler(_ApiError)
    async def api_error(_, error: _ApiError):
        # a full queue: clients that honour Retry-After (the openai client does) wait a second before trying again
        return JSONResponse(error.body(), status_code=error.status,
                            headers={"Retry-After": "1"} if error.status == 429 else None)

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):  # unknown paths, wrong methods, unreadable bodies
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(_ApiError(error.status_code, str(error.detail), kind).body(), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    def problem(e: dict) -> str:
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})"
        where = [str(p) for p in e["loc"][1:]]
        union = next((i for i, p in enumerate(where) if p in UNION_SHAPES), None)
        if union is not None and len(where) > union + 1:  # one of a union's forms: said as the field's shapes
            return f"{'.'.join(where[:union + 1])} must be {UNION_SHAPES[where[union]]}"
        if where == ["n"] and e.get("type") == "less_than_equal":  # a bound of the API's, and the server's slots
            return f"n: at most {e['ctx']['le']} samples a request, and no more than this server's --slots"
        return f"{'.'.join(where) or 'body'}: {e['msg']}"

    @app.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        errors = error.errors()
        problems = "; ".join(dict.fromkeys(problem(e) for e in errors))  # a union's forms say it once
        if "json" not in request.headers.get("content-type", ""):  # curl -d sends form data unless told
            problems = f"send the body as JSON, with the header Content-Type: application/json ({problems})"
        # ("body", field, ...); a body that is no JSON at all has a character offset there, not a field
        fields = [e["loc"][1] for e in errors if len(e.get("loc", ())) > 1 and isinstance(e["loc"][1], str)]
        return JSONResponse(_ApiError(400, problems or "malformed request", param=fields[0] if fields else None).body(),
                            status_code=400)

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name != service.model_name:
            raise _ApiError(404, f"The model {name!r} does not exist; this server has {service.model_name!r}",
                            kind="not_found_error", param="model")
        return service.models()["data"][0]

    class EventStream(StreamingResponse):
        """A stream whose requests leave the engine however the response ends: finished, failed, cut short by
        the client, or left before its first event (which never starts the events at all)."""

        def __init__(self, streamed: Streamed):
            super().__init__(streamed.events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.cancel = streamed.cancel

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.cancel()

    def answered(answer):
        # a stream's events set the usage (or the status of one cut short) as they end
        return EventStream(answer) if isinstance(answer, Streamed) else answer

    @app.post("/v1/chat/completions")
    async def chat_completions(body: chat_request, client: fastapi.Request):
        answer = await service.chat_completion(body, client)
        _set_state(client, usage=answer.get("usage") if isinstance(answer, dict) else None)
        return answered(answer)

    @app.post("/v1/completions")
    async def completions(body: completion_request, client: fastapi.Request):
        answer = await service.completion(body, client)
        _set_state(client, usage=answer.get("usage") if isinstance(answer, dict) else None)
        return answered(answer)

    if log is not None:
        app.add_middleware(RequestLog, log=log)
    return app


class RequestLog:
    """A line per HTTP request (time, method, path, status, seconds, prompt + completion tokens of an answered
    one), as plain ASGI middleware that passes the request's messages through untouched. Starlette's
    BaseHTTPMiddleware (`@app.middleware("http")`) reads them itself: behind it an endpoint never saw its
    client hang up, so an abandoned request ran to its end, holding its slots, and was logged 200."""

    def __init__(self, app, log: Callable[[str], None]):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status, whole = time.monotonic(), 500, False  # 500: the app ended without answering
        state = scope.setdefault("state", {})  # request.state: the endpoints leave the usage there

        async def sending(message):
            nonlocal status, whole
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                whole = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # a stream cut short: its start said 200 before the server stopped it or the client hung up
            status = state.get("status", status if whole or status != 200 else 499)
            usage = state.get("usage")
            tokens = f" {usage['prompt_tokens']}+{usage['completion_tokens']} tokens" if usage else ""
            self.log(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {scope['method']} {scope['path']} {status} "
                     f"{time.monotonic() - started:.2f} s{tokens}")


def _include_usage(body) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _set_state(client, **values) -> None:
    """What the request log reads of a request (its usage; a status its response's start could not say)."""
    if client is not None:
        for key, value in values.items():
            setattr(client.state, key, value)


DEFAULT_MAX_SEQUENCE = 2048


def with_max_sequence(options: ServeOptions, checkpoint) -> ServeOptions:
    """`options` with the context the engine holds: --max-sequence as given (refused past the model's
    positions), else the model's positions up to DEFAULT_MAX_SEQUENCE, and no further than the longest
    sequence a model trained from scratch learned (its tokenizer_config.json says): past it a request runs
    in positions the model never learned, where `generate` and `prompts` cut prompts to keep within it."""
    limit = position_limit(str(checkpoint))
    if options.max_sequence is None:
        trained = None if is_uri(checkpoint) else trained_length(checkpoint)
        return dataclasses.replace(options, max_sequence=min(DEFAULT_MAX_SEQUENCE, limit or DEFAULT_MAX_SEQUENCE,
                                                             trained or DEFAULT_MAX_SEQUENCE))
    problem = longer_than_positions(str(checkpoint), options.max_sequence, f"--max-sequence {options.max_sequence}",
                                    "give a smaller --max-sequence, or leave it out to use the model's positions")
    if problem:
        raise GenerationError(problem)
    return options


def context_note(checkpoint, context: int) -> str | None:
    """What the context has to do with the longest sequence a from-scratch model was trained on, where its
    tokenizer_config.json says: the same, or longer (given by --max-sequence), into positions it never learned."""
    trained = None if is_uri(checkpoint) else trained_length(checkpoint)
    if trained is None or context < trained:
        return None
    where = never_trained_past(checkpoint, trained)
    if context == trained:
        return (f"context: {where}, so a request's prompt and answer get {trained} tokens, as `generate` keeps them; "
                "a longer one is refused with status 400 (--max-sequence serves more, in positions it never learned)")
    return (f"note: --max-sequence {context}: {where}; a request past {trained} tokens runs in positions it never "
            "learned, where `generate` cuts prompts to keep within them")


def load_service(checkpoint, options: ServeOptions, template: str | None = None) -> Service:
    """The engine over `checkpoint` (sharded when there are several devices) with its tokenizer and chat
    template; a context longer than the model's positions is refused before the weights load."""
    options = with_max_sequence(options, checkpoint)
    engine, tokenizer, chat = open_checkpoint(checkpoint, template,
                                              EngineConfig(slots=options.slots, max_sequence=options.max_sequence,
                                                           steps_per_sync=options.steps_per_sync))
    weights = sorted(Path(str(checkpoint)).glob("*.safetensors"))  # a local folder; 0 where it cannot be told
    created = int(max(w.stat().st_mtime for w in weights)) if weights else 0
    return Service(engine, tokenizer, chat, options.model_name or run_name(checkpoint), options, created,
                   tokenizer.system_mode, checkpoint_sampling(checkpoint))


def _check_port(host: str, port: int) -> None:
    """A taken port is one line, before the model loads. Bound as uvicorn binds it (SO_REUSEADDR, the
    host's own address family), so a port a stopped server left in TIME_WAIT is free, as it is to uvicorn."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as error:
        raise GenerationError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def sampling_line(service: Service, checkpoint) -> str:
    """What a request decodes with for the settings it leaves unset, and where that comes from."""
    chosen = describe_sampling(service.sampling_defaults)
    greedy_file = checkpoint_greedy(checkpoint)
    where = (f"{Path(str(checkpoint)) / 'generation_config.json'} sets {describe_sampling(service.checkpoint_sampling)}"
             ", which vLLM takes too" if service.checkpoint_sampling else
             "OpenAI's defaults, as vLLM's: the checkpoint's generation_config.json sets do_sample false, which "
             "transformers' generate() follows (greedy) and vLLM does not" if greedy_file else
             "OpenAI's defaults (the checkpoint's generation_config.json sets none of them)")
    greedy = "; send temperature 0 for greedy answers" if service.sampling_defaults["temperature"] > 0 else ""
    return f"sampling: a request that leaves {', '.join(CHECKPOINT_KEYS)} unset gets {chosen}: {where}{greedy}"


def profile_line(tokenizer) -> str | None:
    """What a client must send for the prompts this model was trained on, at start-up; None for a model
    trained without the profile prompt. The most common slip: a client that names no profile gets a prompt
    the model read only where truncation had cut the profile away."""
    keys = PROFILE_MODE_KEYS.get(tokenizer.profile_mode or "none")
    if not keys:
        return None
    held = tokenizer.profile_values or {}
    example = json.dumps(profile_example(held, keys), ensure_ascii=False)
    return (f"profile: this model was trained with the {tokenizer.profile_mode} profile prompt; name "
            f"{', '.join(keys[:-1])} and {keys[-1]} in each request's chat_template_kwargs, e.g. {example}"
            f"{' (the values its training data held are in its model card)' if held else ''}. A request without "
            "them gets no profile prompt, which the model read only in the training examples whose profile prompt "
            "truncation cut (its model card says how many)")


def serve(checkpoint, options: ServeOptions, template: str | None = None) -> None:
    """Runs the endpoint until interrupted."""
    uvicorn = require("uvicorn", "serve", "polyalign serve")
    require("fastapi", "serve", "polyalign serve")
    if not is_uri(checkpoint) and not Path(str(checkpoint)).is_dir():  # a missing model before a taken port
        raise GenerationError(f"{checkpoint}: no such checkpoint folder (a training run writes OUT/model)")
    _check_port(options.host, options.port)
    service = load_service(checkpoint, options, template)
    options = service.options
    print(f"serving {service.model_name} at http://{options.host}:{options.port}/v1 "
          f"({options.slots} sequences at once, {options.max_sequence}-token context)", flush=True)
    if note := context_note(checkpoint, options.max_sequence):
        print(note, flush=True)
    print(sampling_line(service, checkpoint), flush=True)
    if line := profile_line(service.tokenizer):
        print(line, flush=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # Ctrl-C, SIGTERM: running requests get STOP_ANSWER_S to finish
            if service.stopping_since is None:
                service.stopping_since = time.monotonic()
            super().handle_exit(sig, frame)

    try:
        # requests still running after STOP_ANSWER_S are answered 503, before uvicorn's own deadline
        log = (lambda line: print(line, flush=True)) if options.log_requests else None
        Server(uvicorn.Config(build_app(service, log), host=options.host, port=options.port, log_level="warning",
                              timeout_graceful_shutdown=STOP_ANSWER_S + 2)).run()
    finally:
        service.loop.close()
