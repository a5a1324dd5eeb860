"""`polyalign serve` with the real `openai` client against a server started here: answers equal the
engine's, malformed requests get 4xx answers and never stop the server, a flood of requests is bounded."""

import concurrent.futures
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import uvicorn

from polyalign.core.errors import GenerationError
from polyalign.generate.engine import Engine, EngineConfig, Request
from polyalign.generate.run import stop_ids_of
from polyalign.generate.sampling import SamplingConfig
from polyalign.generate.serve import ServeOptions, _check_port, build_app, load_service
from polyalign.model import create_model, load_hf_checkpoint, save_hf_checkpoint
from polyalign.model.presets import preset
from polyalign.tokens.chat import Message, encode_prompt, profile_text
from tests.chat_exports import crosswoz_dialogues, crosswoz_messages, crosswoz_tasks


@pytest.fixture(scope="module")
def checkpoint(demo_tokenizer, tmp_path_factory):
    """A tiny random model with the demo's SentencePiece tokenizer, saved as transformers would load it."""
    tokenizer = demo_tokenizer[0]
    model = create_model(preset("tiny", vocab_size=tokenizer.vocab_size, num_layers=2, hidden_size=64, num_heads=4,
                                num_kv_heads=2, head_dim=16, intermediate_size=128), seed=3)
    folder = tmp_path_factory.mktemp("serve") / "sft" / "model"  # served as "sft", its run folder
    directory = tokenizer.path.parent
    save_hf_checkpoint(model, folder, extra_files={
        name: (directory / name).read_bytes() for name in ("tokenizer.model", "tokenizer_config.json")})
    return folder


def call(url: str, method: str = "POST", body=None) -> tuple[int, dict | None]:
    """One HTTP request, as any client would send it: (status, JSON body or None)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, text = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The endpoint in a thread of this process, as `polyalign serve` runs it."""

    def __init__(self, checkpoint, **options):
        self.options = ServeOptions(port=_free_port(), **options)
        self.service = load_service(checkpoint, self.options)
        self.log: list[str] = []  # the request log, a line per request
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.service, self.log.append), host="127.0.0.1",
                                                    port=self.options.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started
        self.url = f"http://127.0.0.1:{self.options.port}/v1"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.service.loop.close()


def test_the_openai_client_gets_the_engines_answers(checkpoint):
    # A CrossWOZ dialogue's first three turns, its task description as the system message.
    dialogue = crosswoz_dialogues(1)[0][1]
    messages = [{"role": "system", "content": " ".join(crosswoz_tasks(dialogue))}] + crosswoz_messages(dialogue, 3)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    with Server(checkpoint, slots=4, max_sequence=512) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused")
        assert [m.id for m in client.models.list()] == ["sft"]
        # created: when the weights were written
        assert client.models.list().data[0].created == int((checkpoint / "model.safetensors").stat().st_mtime)
        greedy = client.chat.completions.create(model="sft", messages=messages, max_tokens=12, temperature=0)
        sampled = [client.chat.completions.create(model="sft", messages=messages, max_tokens=12, temperature=1.0,
                                                  n=3, seed=5) for _ in range(2)]
        text = client.completions.create(model="sft", prompt="The hotel is in the centre", max_tokens=6,
                                         temperature=0)
        assert client.models.retrieve("sft").id == "sft"
        # the chat request's rendering sent as text (its special tokens written out, as `prompts` writes a
        # row's prompt) or as token ids (a row's prompt_token_ids) is the same prompt
        own = [Message(m["role"], m["content"]) for m in messages]
        rendered = server.service.chat.render(own, add_generation_prompt=True)
        as_text = client.completions.create(model="sft", prompt=rendered, max_tokens=12, temperature=0)
        as_ids = client.completions.create(model="sft", max_tokens=12, temperature=0, prompt=encode_prompt(
            server.service.chat, server.service.tokenizer, own).tolist())
        with pytest.raises(openai.BadRequestError, match="prompt token id 99999 is outside this model's vocabulary"):
            client.completions.create(model="sft", prompt=[5, 99999], max_tokens=2)
        # a stop string ends decoding (within one decoding call of 8 steps) and cuts the text there
        long = client.chat.completions.create(model="sft", messages=messages, max_tokens=60, temperature=0)
        content = long.choices[0].message.content
        stop = next(c for c in content[3:] if not c.isspace())
        stopped = client.chat.completions.create(model="sft", messages=messages, max_tokens=60, temperature=0,
                                                 stop=[stop])
        # one string, as OpenAI takes it, of any length (the four-item limit is a list's)
        word = content[content.index(stop):][:6]
        stopped_at_word = client.chat.completions.create(model="sft", messages=messages, max_tokens=60, temperature=0,
                                                         stop=word)
        # the profile the model was trained with, named as vLLM names template variables
        profile = {"family": "dialogue", "track": "multi", "style": "task"}
        profiled = client.chat.completions.create(model="sft", messages=messages, max_tokens=2, temperature=0,
                                                  extra_body={"chat_template_kwargs": profile})
        # an unknown key is named as such whatever its value (vLLM clients send enable_thinking: false)
        for unknown in ({"colour": "red"}, {"colour": False}):
            with pytest.raises(openai.BadRequestError, match="chat_template_kwargs colour: this model's template"):
                client.chat.completions.create(model="sft", messages=messages, max_tokens=2,
                                               extra_body={"chat_template_kwargs": unknown})
        # the profile put at the top of the request would be ignored there: refused, saying where it goes
        with pytest.raises(openai.BadRequestError, match="family, track, style: profile variables go in "
                                                         "chat_template_kwargs"):
            client.chat.completions.create(model="sft", messages=messages, max_tokens=2, extra_body=profile)
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.family must be a string, got 3"):
            client.chat.completions.create(model="sft", messages=messages, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"family": 3}})
        service = server.service
    # the client's system message, a blank line, the profile prompt: as training composes them (keep)
    composed = [Message("system", f"{messages[0]['content']}\n\n{profile_text(profile)}")]
    composed += [Message(m["role"], m["content"]) for m in messages[1:]]
    assert profiled.usage.prompt_tokens == len(encode_prompt(service.chat, service.tokenizer, composed))
    # The same request made with the engine directly, with the checkpoint's template.
    model = load_hf_checkpoint(checkpoint)
    tokenizer, chat = service.tokenizer, service.chat
    prompt = encode_prompt(chat, tokenizer, [Message(m["role"], m["content"]) for m in messages])
    engine = Engine(model, stop_ids_of(tokenizer, chat), EngineConfig(slots=2, max_sequence=512))
    expected = engine.generate([Request(prompt, SamplingConfig(max_new_tokens=12))])[0][0]
    # decoded as vLLM decodes an answer, special tokens left out (a small model can sample <unk>, " ⁇ ")
    assert greedy.choices[0].message.content == tokenizer.decode(expected.tokens, skip_special=True).lstrip()
    assert greedy.choices[0].finish_reason == expected.finish_reason
    assert greedy.usage.prompt_tokens == len(prompt) and greedy.usage.completion_tokens == len(expected.tokens)
    for completion in (as_text, as_ids):  # a chat answer leaves out the space its first piece opens with
        assert completion.usage.prompt_tokens == len(prompt)
        assert completion.choices[0].text.lstrip() == greedy.choices[0].message.content
        assert completion.choices[0].text == service._continuation(prompt.tolist(), expected.tokens)
    # a seed gives the same three samples twice; the three differ from one another
    contents = [[c.message.content for c in response.choices] for response in sampled]
    assert contents[0] == contents[1] and len(set(contents[0])) == 3
    ids = list(tokenizer.encode("The hotel is in the centre"))
    raw = engine.generate([Request(np.asarray(ids), SamplingConfig(max_new_tokens=6))])[0][0]
    # a completion continues its prompt, as OpenAI's and vLLM's do: prompt + text is the whole text, the
    # space a word piece opens with included (it was stripped: "...centre" + "of" for " of")
    assert tokenizer.decode(ids + list(raw.tokens), skip_special=True) == tokenizer.decode(ids) + text.choices[0].text
    words = list(tokenizer.encode(" of the city"))
    assert service._continuation(ids, words) == " of the city"
    assert service._answer(words) == "of the city"  # a chat answer's opening space is the piece's, not the model's
    assert stopped.choices[0].message.content == content[:content.index(stop)]
    assert len(word) == 6 and stopped_at_word.choices[0].message.content == content[:content.index(word)]
    assert stopped.choices[0].finish_reason == "stop" and long.usage.completion_tokens == 60
    # counted up to the token that completed the stop string (as vLLM counts), not the decoding call's end
    made = engine.generate([Request(prompt, SamplingConfig(max_new_tokens=60))])[0][0].tokens
    assert tokenizer.decode(made, skip_special=True).lstrip() == content
    upto = next(k for k in range(1, 61) if stop in tokenizer.decode(made[:k]).lstrip())
    assert stopped.usage.completion_tokens == upto
    # a line per request: when, what, the answer's status, seconds, and the tokens of an answered one
    lines = server.log
    line_form = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (GET|POST) (/v1/\S+) (\d{3}) \d+\.\d\d s( \d+\+\d+ tokens)?"
    logged = [re.fullmatch(line_form, line) for line in lines]
    assert all(logged), lines
    assert [m.group(1, 2, 3) for m in logged].count(("POST", "/v1/chat/completions", "400")) == 4
    assert sum(m.group(2) == "/v1/models" for m in logged) == 2 and len(logged) == 18
    assert " 200 " in lines[2] and lines[2].endswith(f" s {len(prompt)}+{len(expected.tokens)} tokens"), lines[2]


def test_malformed_requests_get_4xx_answers_and_the_server_keeps_serving(checkpoint):
    chat = [{"role": "user", "content": "Is there a cheap hotel nearby?"}]
    bad = [
        ("post", "/chat/completions", b"{not json", 400, "not valid JSON"),
        ("post", "/chat/completions", {"messages": []}, 400, "messages"),
        ("post", "/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("post", "/chat/completions", {"messages": chat, "temperature": 5}, 400, "temperature"),
        ("post", "/chat/completions", {"messages": chat, "n": 0}, 400, "n"),
        ("post", "/chat/completions", {"messages": chat, "n": 17}, 400,
         "n: at most 16 samples a request, and no more than this server's --slots"),
        ("post", "/chat/completions", {"messages": chat, "max_tokens": 0}, 400, "max_tokens"),
        ("post", "/chat/completions", {"messages": chat, "max_tokens": 10_000}, 400, "context"),
        ("post", "/chat/completions", {"messages": chat, "stream_options": {"include_usage": True}}, 400,
         "stream_options is only allowed when stream is true"),
        ("post", "/chat/completions", {"messages": chat, "stream": True, "stream_options": {"usage": True}}, 400,
         "stream_options.usage: Extra inputs are not permitted"),
        # a streamed request the server cannot take is refused before its answer starts, as JSON
        ("post", "/chat/completions", {"messages": chat, "stream": True, "max_tokens": 10_000}, 400,
         "-token context (max_tokens 2"),  # the most it may ask, with this prompt
        ("post", "/chat/completions", {"model": "gpt-4o", "messages": chat}, 404, "does not exist"),
        ("post", "/completions", {"prompt": ""}, 400, "prompt"),
        ("post", "/completions", {"prompt": 7}, 400, "prompt"),
        # a field of several forms is said by its forms, once, not by why each form failed ("stop.str: ...;
        # stop.list[str]: ...")
        ("post", "/chat/completions", {"messages": chat, "stop": ["a", "b", "c", "d", "e"]}, 400,
         "stop must be a string or a list of at most 4 strings"),
        ("post", "/completions", {"prompt": ["Hi", [1, 2, 3]]}, 400,
         "prompt must be a string, a list of strings, a list of token ids, or a list of token id lists"),
        ("post", "/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
         'messages.0.content must be a string or a list of content parts ({"type": "text", "text": "..."})'),
        ("get", "/chat/completions", None, 405, "Method Not Allowed"),
        ("get", "/embeddings", None, 404, "Not Found"),
        ("post", "/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
         "not valid Unicode"),
        ("post", "/chat/completions", {"messages": chat, "max_tokens": "10"}, 400, "max_tokens"),
        ("post", "/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
         400, "a content part of type 'image_url': polyalign serve reads text only"),
        ("post", "/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
         "a text part without text"),
        ("post", "/chat/completions", {"messages": chat, "stream": "yes"}, 400, "stream"),
        ("post", "/chat/completions", {"messages": chat, "logprobs": True}, 400, "does not support logprobs"),
        ("post", "/chat/completions", {"messages": chat, "presence_penalty": 2.5}, 400, "presence_penalty"),
        # a misspelt or unknown setting is refused, not decoded with the default; vLLM's extras it cannot honour too
        ("post", "/chat/completions", {"messages": chat, "tempreature": 0}, 400,
         "unknown parameter 'tempreature'; did you mean 'temperature'?"),
        ("post", "/completions", {"prompt": "x", "foo": 1}, 400, "unknown parameter 'foo'"),
        ("post", "/chat/completions", {"messages": chat, "min_tokens": 20}, 400, "does not support min_tokens"),
        ("post", "/chat/completions", {"messages": chat, "ignore_eos": True}, 400, "does not support ignore_eos"),
        ("post", "/chat/completions", {"messages": chat, "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("post", "/completions", {"prompt": "x", "echo": True}, 400, "does not support echo"),
        # OpenAI's own parameters are named as unsupported, not unknown (web_search_options read as a misspelt
        # stream_options)
        ("post", "/chat/completions", {"messages": chat, "web_search_options": {}}, 400,
         "does not support web_search_options"),
        ("post", "/chat/completions", {"messages": chat, "prediction": {"type": "content", "content": "x"}}, 400,
         "does not support prediction"),
        ("post", "/completions", {"prompt": "A hotel near the station. " * 60}, 400,
         "prompt tokens leave no room for an answer in this server's 256-token context"),  # read "+ 0 new tokens"
        # a completion's logprobs 0 asks for the sampled tokens' own (it came back null); a chat's false asks nothing
        ("post", "/completions", {"prompt": "x", "logprobs": 0}, 400, "does not support logprobs"),
        ("post", "/completions", {"prompt": "x", "chat_template_kwargs": {"family": "qa"}}, 400,
         "which /v1/completions does not apply (its prompt is read as written): send it to /v1/chat/completions"),
        ("post", "/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
         "temperature: Input should be a finite number"),
    ]
    with Server(checkpoint, slots=2, max_sequence=256) as server:
        for method, path, body, status, words in bad:
            code, answer = call(server.url + path, method.upper(), body)
            assert code == status, (path, body, answer)
            if words:
                assert words in answer["error"]["message"], answer
            assert ".str:" not in answer["error"]["message"], answer  # no union form named
        # the field at fault is named, as OpenAI names it
        assert [call(server.url + "/chat/completions", body={"messages": chat, **extra})[1]["error"]["param"]
                for extra in ({"max_tokens": "10"}, {"temperature": 5}, {"stream": "yes"})] == [
                    "max_tokens", "temperature", "stream"]
        assert call(server.url + "/completions", body={"prompt": "A hotel near the station. " * 60}
                    )[1]["error"]["param"] == "prompt"
        assert call(server.url + "/chat/completions", body=b"{not json")[1]["error"]["param"] is None  # no field
        # `curl -d` without a Content-Type sends form data: said, not "Input should be a valid dictionary"
        unlabelled = urllib.request.Request(server.url + "/chat/completions",
                                            data=json.dumps({"messages": chat}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(unlabelled, timeout=60)
        assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["message"].startswith(
            "send the body as JSON, with the header Content-Type: application/json (")
        quiet = {"messages": chat, "max_tokens": 4, "logprobs": False}  # a chat's false asks for nothing
        assert call(server.url + "/chat/completions", body=quiet)[0] == 200
        assert call(server.url + "/chat/completions", body={"messages": chat, "max_tokens": 4})[0] == 200
        # OpenAI's penalties and vLLM's extras are taken (they were refused), greedy with a penalty too
        penalised = {"messages": chat, "max_tokens": 4, "temperature": 0, "presence_penalty": 0.5,
                     "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.05}
        assert call(server.url + "/chat/completions", body=penalised)[0] == 200
        # what changes no answer is taken as given (user, metadata), and vLLM's top_k -1 means no cut as 0 does
        assert call(server.url + "/chat/completions", body={"messages": chat, "max_tokens": 4, "user": "u-17",
                                                            "metadata": {"run": "a"}, "top_k": -1,
                                                            "min_tokens": 0})[0] == 200
        # told to stop, a request still running after the grace gets a 503 in OpenAI's shape, not a bare 500
        server.service.stopping_since = time.monotonic() - 60
        code, answer = call(server.url + "/chat/completions", body={"messages": chat, "max_tokens": 100})
        assert code == 503 and "the server is stopping" in answer["error"]["message"], answer
        server.service.stopping_since = None
        deadline = time.monotonic() + 30  # the engine's thread drops the cancelled request at its next step
        while server.service.loop._pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.service.loop._pending == 0
        assert call(server.url + "/chat/completions", body={"messages": chat, "max_tokens": 4})[0] == 200


def test_a_port_a_stopped_server_left_in_time_wait_is_free_and_a_taken_one_is_named():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's listening socket has it
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    connection, _ = listener.accept()
    with pytest.raises(GenerationError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
        _check_port("127.0.0.1", port)
    connection.close()  # the server's side closes first, as a stopped server's does: its port is in TIME_WAIT
    listener.close()
    client.close()
    _check_port("127.0.0.1", port)


@pytest.mark.parametrize("trained, good", [("context", {"family": "dialogue", "track": "multi", "style": "task"}),
                                           ("none", None)])
def test_a_profile_is_the_one_the_model_was_trained_with_and_whole(trained, good, checkpoint, tmp_path):
    """An export says which profile its model read (polyalign_profile) and the values its data held
    (polyalign_profile_values): a partial profile, a key it never read, a value its data never held, or
    any profile for a model trained without one is answered 400 naming them."""
    import shutil

    copy = tmp_path / "sft" / "model"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    held = {"family": ["dialogue", "qa"], "track": ["multi", "single"], "style": ["open_chat", "task"]}
    together = [good, {"family": "qa", "track": "single", "style": "open_chat"}] if good else None
    (copy / "tokenizer_config.json").write_text(json.dumps({
        **config, "polyalign_profile": trained,
        **({"polyalign_profile_values": held, "polyalign_profile_combinations": together} if good else {})}))
    chat = [{"role": "user", "content": "Is there a cheap hotel nearby?"}]
    with Server(copy, slots=2, max_sequence=256) as server:
        if good is not None:
            assert call(server.url + "/chat/completions", body={"messages": chat, "max_tokens": 2,
                                                                "chat_template_kwargs": good})[0] == 200
            # read as prepare read the training data: developer is system, text parts joined by a newline,
            # whitespace at the ends of a text dropped
            sent = [{"role": "developer", "content": " Is there a cheap hotel nearby? "},
                    {"role": "user", "content": [{"type": "text", "text": "Is there a cheap "},
                                                 {"type": "text", "text": "hotel nearby?"}]}]
            read = [{"role": "system", "content": "Is there a cheap hotel nearby?"},
                    {"role": "user", "content": "Is there a cheap\nhotel nearby?"}]
            tokens = [call(server.url + "/chat/completions", body={"messages": m, "max_tokens": 1, "temperature": 0,
                                                                   "chat_template_kwargs": good})[1]["usage"]
                      for m in (sent, read)]
            assert tokens[0] == tokens[1]
            # messages that already hold the profile prompt, with the profile named again: it would be written twice
            profiled = [{"role": "system", "content": profile_text(good)}, *chat]
            code, answer = call(server.url + "/chat/completions",
                                body={"messages": profiled, "chat_template_kwargs": good})
            assert code == 400 and "already open with polyalign's profile prompt" in answer["error"]["message"]
            assert call(server.url + "/chat/completions", body={"messages": profiled, "max_tokens": 1})[0] == 200
            # a value the training data never held (a misspelling) renders a prompt the model never saw
            code, answer = call(server.url + "/chat/completions",
                                body={"messages": chat, "chat_template_kwargs": {**good, "style": "tsak"}})
            said = "style 'tsak' was not in this model's training data (style there: open_chat, task)"
            assert code == 400 and answer["error"]["message"] == f"chat_template_kwargs {said}"
            # values each held, never together (the demo's assistant answers are all single-turn): refused too
            code, answer = call(server.url + "/chat/completions",
                                body={"messages": chat, "chat_template_kwargs": {**good, "track": "single"}})
            assert code == 400 and answer["error"]["message"] == (
                'chat_template_kwargs {"family": "dialogue", "track": "single", "style": "task"}: each value was in '
                'this model\'s training data, but never together (it held {"family": "dialogue", "track": "multi", '
                '"style": "task"}; {"family": "qa", "track": "single", "style": "open_chat"})')
            # the exported template refuses it alike (it renders what serve renders)
            from polyalign.core.errors import ChatTemplateError
            from polyalign.tokens.chat_jinja import JinjaRenderer
            from polyalign.tokens.profile_template import exported_source

            source = exported_source("{{ messages[0]['content'] }}", profile="context",
                                     values={**held, "combinations": together})
            assert JinjaRenderer(source, {}, good).render(chat).endswith("family=dialogue; track=multi; style=task.")
            with pytest.raises(ChatTemplateError, match=re.escape("family, track, style dialogue|single|task: each "
                                                                  "value was in this model's training data")):
                JinjaRenderer(source, {}, {**good, "track": "single"}).render(chat)
        partial = {"family": "dialogue"}
        code, answer = call(server.url + "/chat/completions", body={"messages": chat, "chat_template_kwargs": partial})
        said = ("this model was trained with profile context: family, track, style; give track, style too"
                if trained == "context" else "this model was trained with profile none: no variables; leave out family")
        assert code == 400 and answer["error"] == {
            "message": f"chat_template_kwargs family: {said}",
            "type": "invalid_request_error", "param": "chat_template_kwargs", "code": None}
        code, answer = call(server.url + "/chat/completions",
                            body={"messages": chat, "chat_template_kwargs": {"enable_thinking": "yes"}})
        taken = "family, track, style" if trained == "context" else "none"
        assert code == 400 and answer["error"]["message"] == (
            f"chat_template_kwargs enable_thinking: this model's template takes {taken} (this model was trained "
            f"with profile {trained}: {'family, track, style' if trained == 'context' else 'no variables'})")
        if good is not None:  # the key this model never read is the one named
            code, answer = call(server.url + "/chat/completions",
                                body={"messages": chat, "chat_template_kwargs": {**good, "length": "long"}})
            assert code == 400 and answer["error"]["message"] == (
                "chat_template_kwargs family, track, style, length: this model was trained with profile context: "
                "family, track, style; leave out length")
        assert call(server.url + "/chat/completions", body={"messages": chat, "max_tokens": 2})[0] == 200


def test_a_flood_of_requests_is_refused_beyond_the_queue(checkpoint):
    with Server(checkpoint, slots=1, max_sequence=256, max_pending=2) as server:
        def ask(_):
            body = json.dumps({"prompt": "A room for two nights", "max_tokens": 24}).encode()
            request = urllib.request.Request(server.url + "/completions", data=body,
                                             headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    return response.status
            except urllib.error.HTTPError as error:  # a refusal says when to try again, as OpenAI's does
                assert error.code != 429 or error.headers["Retry-After"] == "1"
                return error.code

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(ask, range(40)))
        assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
        assert server.service.loop._pending == 0
        assert ask(0) == 200


def test_a_request_nobody_waits_for_gives_its_slot_back(checkpoint):
    from polyalign.generate.engine import EngineLoop

    engine = Engine(load_hf_checkpoint(checkpoint), [], EngineConfig(slots=1, max_sequence=512))
    loop = EngineLoop(engine, max_pending=4)
    try:
        long = loop.submit(Request([5, 6, 7], SamplingConfig(max_new_tokens=500)))
        loop.cancel(long)
        short = loop.submit(Request([5, 6, 7], SamplingConfig(max_new_tokens=4)))
        assert len(short.result(timeout=60)[0].tokens) == 4
        assert long.cancelled() and loop._pending == 0
    finally:
        loop.close()


def test_each_sample_of_a_request_is_told_of_its_end_when_it_ends(checkpoint):
    """A streamed choice ends at its own time: the engine tells each sample's end the moment it comes (a UI shows
    that alternative done), with the completion the request's result then holds, not once all n have ended."""
    engine = Engine(load_hf_checkpoint(checkpoint), [], EngineConfig(slots=4, max_sequence=256, steps_per_sync=4))

    def stop_when(tokens):  # a sample whose first token is odd stops after 8 tokens, the others run 40
        return len(tokens) >= (8 if tokens[0] % 2 else 40)

    for seed in range(20):  # a seed whose four samples open with both parities
        events = []
        request = Request([5, 6, 7], SamplingConfig(max_new_tokens=40, temperature=1.0), seed=seed, n=4,
                          stop_when=stop_when, on_tokens=lambda sample, tokens: events.append(("tokens", sample)),
                          on_finish=lambda sample, completion: events.append(("finish", sample, completion)))
        [result] = engine.generate([request])
        if len({len(c.tokens) >= 40 for c in result}) == 2:
            break
    else:
        raise AssertionError("no seed of 20 gave samples of both lengths")
    ends = {event[1]: (position, event[2]) for position, event in enumerate(events) if event[0] == "finish"}
    assert sorted(ends) == [0, 1, 2, 3] and [ends[s][1] for s in range(4)] == result
    short = [s for s in range(4) if len(result[s].tokens) < 40]
    last_news_of_long = max(i for i, e in enumerate(events) if e[0] == "tokens" and e[1] not in short)
    assert all(ends[s][0] < last_news_of_long for s in short), events


def test_a_streamed_sample_is_never_shown_the_stop_token_that_ends_it(checkpoint):
    """The tokens a stream is told of leave out the stop token that ended the sample, as its completion does: a
    stop token that is no special token (a template's end of turn added as a plain piece) would otherwise be
    streamed, and the joined text would be longer than the answer."""
    engine = Engine(load_hf_checkpoint(checkpoint), list(range(0, 4000, 2)), EngineConfig(slots=4, max_sequence=256))
    told: dict[int, list[list[int]]] = {}
    request = Request([5, 6, 7], SamplingConfig(max_new_tokens=60, temperature=1.0), seed=1, n=4,
                      on_tokens=lambda sample, tokens: told.setdefault(sample, []).append(tokens))
    [result] = engine.generate([request])
    assert any(c.finish_reason == "stop" for c in result)  # half the vocabulary ends a sample
    for sample, completion in enumerate(result):
        assert all(not tokens or tokens[-1] not in engine.stop_ids for tokens in told[sample])
        assert told[sample][-1] == completion.tokens


OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


@pytest.mark.parametrize("config, expected", [
    (None, OPENAI),  # OpenAI's defaults
    ({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
     {**OPENAI, "temperature": 0.7, "top_p": 0.8, "top_k": 20}),
    ({"temperature": 0.6, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.05},
     {**OPENAI, "temperature": 0.6, "repetition_penalty": 1.05, "min_p": 0.05}),
    ({"do_sample": False}, OPENAI),  # polyalign's own export from a preset
])
def test_a_request_that_sets_no_sampling_takes_the_checkpoints_generation_config(config, expected, checkpoint,
                                                                                 tmp_path):
    """As vLLM's server does (generation_config auto): unset temperature, top_p, top_k, min_p and
    repetition_penalty come from the checkpoint's generation_config.json, else OpenAI's defaults; what the
    request sets wins, key by key. `generate` stays greedy by default and says when the checkpoint's
    settings sample."""
    import shutil

    from polyalign.generate.run import say_checkpoint_sampling
    from polyalign.generate.serve import _models, sampling_line

    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    if config is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **config}))
    service = load_service(folder, ServeOptions(slots=1, max_sequence=128))
    chat_request, _ = _models()
    messages = [{"role": "user", "content": crosswoz_messages(crosswoz_dialogues(1)[0][1], 1)[0]["content"]}]

    def sampling(**fields):
        body = chat_request.model_validate({"messages": messages, "max_tokens": 4, **fields})
        config, _ = service._sampling(body, [5, 6, 7])
        assert (config.presence_penalty, config.frequency_penalty) == (fields.get("presence_penalty", 0.0),
                                                                     fields.get("frequency_penalty", 0.0))
        return {key: getattr(config, key) for key in OPENAI}

    try:
        assert sampling() == expected
        assert sampling(temperature=0) == {**expected, "temperature": 0}
        assert sampling(top_p=0.5, top_k=3) == {**expected, "top_p": 0.5, "top_k": 3}
        assert sampling(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.25) == {
            **expected, "repetition_penalty": 1.2}
        assert sampling(min_p=0.0) == {**expected, "min_p": 0.0}
        line = sampling_line(service, folder)
        notes = []
        say_checkpoint_sampling(folder, SamplingConfig(temperature=0.0), notes)
        say_checkpoint_sampling(folder, SamplingConfig(temperature=0.9), notes)  # sampling already: nothing to say
        if config is None:
            assert line == ("sampling: a request that leaves temperature, top_p, top_k, min_p, repetition_penalty "
                            "unset gets temperature 1, top_p 1, top_k 0: OpenAI's defaults (the checkpoint's "
                            "generation_config.json sets none of them); send temperature 0 for greedy answers"
                            ) and notes == []
        elif "temperature" not in config:  # do_sample false: transformers decodes greedily, vLLM reads no such key
            assert ("OpenAI's defaults, as vLLM's: the checkpoint's generation_config.json sets do_sample false, "
                    "which transformers' generate() follows (greedy) and vLLM does not") in line and notes == []
        else:
            # top_k 50 is transformers' default, no setting; repetition_penalty and min_p are applied too
            given = {k: v for k, v in config.items() if k in OPENAI and v != 50}
            said = ", ".join(f"{k} {v:g}" for k, v in given.items())
            assert f"sets {said}, which vLLM takes too" in line
            assert f"gets {said.replace('temperature 0.6', 'temperature 0.6, top_p 1, top_k 0')}:" in line
            assert len(notes) == 1 and notes[0].endswith(
                "these answers are greedy (--temperature 0, the default): give --temperature "
                f"{config['temperature']:g} to decode as they do (`generate` takes the file's other settings that are "
                "not given)")
            # generate takes the file's settings that are not given (not its temperature), as serve does
            from polyalign.generate.settings import unset_from_checkpoint

            chosen, taken = unset_from_checkpoint({"top_p": None, "top_k": 5, "min_p": None,
                                                   "repetition_penalty": None}, folder)
            assert taken == {k: v for k, v in given.items() if k not in ("temperature", "top_k")}
            assert chosen == {"top_p": config.get("top_p", 1.0), "top_k": 5, "min_p": config.get("min_p", 0.0),
                              "repetition_penalty": config.get("repetition_penalty", 1.0)}
    finally:
        service.loop.close()


def test_the_start_up_line_says_what_a_client_sends_for_the_prompts_the_model_was_trained_on():
    """A model trained with the profile prompt answers requests that name no profile without one, which it
    read only where truncation had cut it: start-up says which keys to send, with an example of the values its
    training data held; a model trained without it gets no line."""
    from types import SimpleNamespace

    from polyalign.generate.serve import profile_line

    held = {"family": ["assistant", "dialogue"], "track": ["multi", "single"], "style": ["casual", "formal"],
            "length": ["long", "short"]}
    line = profile_line(SimpleNamespace(profile_mode="context", profile_values=held))
    assert line == ('profile: this model was trained with the context profile prompt; name family, track and style '
                    'in each request\'s chat_template_kwargs, e.g. {"family": "assistant", "track": "multi", '
                    '"style": "casual"} (the values its training data held are in its model card). A request '
                    "without them gets no profile prompt, which the model read only in the training examples whose "
                    "profile prompt truncation cut (its model card says how many)")
    # where the export lists the combinations its data held, the example is the most common one: each key's
    # first value made a combination the data never held (assistant answers are single-turn)
    together = {**held, "combinations": [{"family": "dialogue", "track": "multi", "style": "casual"},
                                         {"family": "assistant", "track": "single", "style": "formal"}]}
    line = profile_line(SimpleNamespace(profile_mode="context", profile_values=together))
    assert 'e.g. {"family": "dialogue", "track": "multi", "style": "casual"} (the values' in line
    oracle = profile_line(SimpleNamespace(profile_mode="oracle", profile_values=None))
    assert "name family, track, style and length in" in oracle and '"length": "..."}. A request' in oracle
    assert profile_line(SimpleNamespace(profile_mode="none", profile_values=held)) is None
    assert profile_line(SimpleNamespace(profile_mode=None, profile_values=None)) is None


def test_a_client_that_hangs_up_has_its_request_dropped_from_the_engine(checkpoint):
    """A request whose client disconnects is dropped from the engine at once and logged as 499 (docs/
    preference.md). Behind the request log's middleware it ran to its end and was logged 200: an abandoned
    request (an openai client's timeout, retried twice by default) held its slots until it finished."""
    long = {"prompt": "A room for two nights", "max_tokens": 1000, "n": 4, "temperature": 1.0, "seed": 5}
    with Server(checkpoint, slots=4, max_sequence=1024) as server:
        assert call(server.url + "/completions", body={**long, "max_tokens": 4})[0] == 200  # compiled
        started = time.monotonic()
        status, whole = call(server.url + "/completions", body=long)
        taken = time.monotonic() - started
        assert status == 200 and whole["usage"]["completion_tokens"] > 2000
        body = json.dumps(long).encode()
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.options.port)) as hanging_up:
            hanging_up.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.3)
        while len(server.log) < 3 and time.monotonic() - started < 60:
            time.sleep(0.02)
        dropped_after = time.monotonic() - started
        assert " POST /v1/completions 499 " in server.log[-1], server.log
        assert dropped_after < 0.3 + max(0.25 * taken, 0.5), (dropped_after, taken)  # not the whole request's time
        while server.service.loop._pending and time.monotonic() - started < 0.3 + taken / 2:
            time.sleep(0.02)  # the engine drops it at its next call
        assert server.service.loop._pending == 0
        assert call(server.url + "/completions", body={**long, "max_tokens": 4})[0] == 200


def _streamed(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str], list]:
    """The text of each choice joined from its chunks, each choice's finish reason, and the usage chunk's."""
    texts, reasons, usages = {}, {}, []
    for chunk in chunks:
        usages.append(chunk.usage)
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                assert choice.index not in reasons  # a choice finishes once
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usages


def test_a_streamed_answer_joins_into_the_answer_the_same_request_gets_unstreamed(checkpoint):
    """For every request form (chat, completion, a list of prompts; greedy, seeded samples; stop strings; short
    and long budgets), the chunks of each choice join into the unstreamed answer, with its finish reason and
    usage, and the text arrives in pieces as it is decoded, not at the end."""
    dialogue = crosswoz_dialogues(1)[0][1]
    messages = crosswoz_messages(dialogue, 3)
    prompts = ["The hotel is in the centre", "A room for two nights"]
    with Server(checkpoint, slots=6, max_sequence=512) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused")
        long = client.chat.completions.create(model="sft", messages=messages, max_tokens=80, temperature=0)
        content = long.choices[0].message.content
        stop = content[10:13]  # three characters of the answer, met mid-answer
        forms = [{"max_tokens": 80, "temperature": 0}, {"max_tokens": 80, "temperature": 0, "stop": [stop, "zz"]},
                 {"max_tokens": 40, "temperature": 1.0, "n": 3, "seed": 7}, {"max_tokens": 1, "temperature": 0},
                 {"max_tokens": 60, "temperature": 1.0, "seed": 2, "stop": "。"}]
        for form in forms:
            for chat in (True, False):
                if chat:
                    create, request = client.chat.completions.create, {"messages": messages, **form}
                else:
                    create, request = client.completions.create, {"prompt": prompts, **form}
                whole = create(model="sft", **request)
                chunks = list(create(model="sft", stream=True, stream_options={"include_usage": True}, **request))
                texts, reasons, usages = _streamed(chunks, chat)
                answers = [c.message.content if chat else c.text for c in whole.choices]
                assert [texts[i] for i in range(len(answers))] == answers, (form, chat)
                assert [reasons[i] for i in range(len(answers))] == [c.finish_reason for c in whole.choices]
                # the usage comes once, in a last chunk without choices, as OpenAI sends it
                assert usages[:-1] == [None] * (len(chunks) - 1) and not chunks[-1].choices
                assert usages[-1].model_dump() == whole.usage.model_dump(), (form, chat)
                if chat:  # a chat choice opens with its role
                    assert {c.choices[0].index for c in chunks[:len(answers)]} == set(range(len(answers)))
                    assert all(c.choices[0].delta.role == "assistant" for c in chunks[:len(answers)])
                    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
        assert long.choices[0].finish_reason == "length" and stop in content
        # the text arrives as it is decoded: an 80-token answer in many pieces (a decoding call makes 8 tokens)
        pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
            model="sft", messages=messages, max_tokens=80, temperature=0, stream=True) if c.choices[0].delta.content]
        assert "".join(pieces) == content and len(pieces) >= 5, pieces
        # served with --steps-per-sync 1, the same answer streams token by token: in several times the pieces
        fine = Server(checkpoint, slots=6, max_sequence=512, steps_per_sync=1)
        with fine:
            finer = [c.choices[0].delta.content for c in openai.OpenAI(base_url=fine.url, api_key="unused")
                     .chat.completions.create(model="sft", messages=messages, max_tokens=80, temperature=0,
                                              stream=True) if c.choices[0].delta.content]
        assert "".join(finer) == content and len(finer) >= 3 * len(pieces), (len(finer), len(pieces))
        # without stream_options, no usage anywhere and no usage chunk
        plain = list(client.completions.create(model="sft", prompt=prompts[0], max_tokens=5, stream=True))
        assert all(c.usage is None and c.choices for c in plain)
    logged = [line for line in server.log if "/completions" in line]
    assert all(" 200 " in line and line.endswith(" tokens") for line in logged), logged


def test_a_streamed_choice_never_sends_what_later_tokens_change():
    """What `_StreamedText` holds back: a stop string's possible beginning, a character whose bytes are still
    arriving (U+FFFD), trailing whitespace; the finished answer sends the rest."""
    from polyalign.generate.serve import _StreamedText

    decoded = ["Hel", "Hello wo", "Hello world. St", "Hello world. STOP", "Hello world. STOP and more"]
    streamed = _StreamedText(lambda tokens: decoded[len(tokens) - 1], ["STOP"])
    sent = [streamed.update([0] * k) for k in range(1, 6)]
    # "STOP" is 4 characters: the last 3 of a text may begin it; once it is there the text ends before it
    assert sent == ["", "Hello", " world.", "", ""]
    assert streamed.finish("Hello world. ") == " "
    chinese = ["你", "你\ufffd", "你好\ufffd\ufffd", "你好世界 "]
    streamed = _StreamedText(lambda tokens: chinese[len(tokens) - 1], [])
    assert [streamed.update([0] * k) for k in range(1, 5)] == ["你", "", "好", "世界"]
    assert streamed.finish("你好世界 ") == " "
    # a character still arriving does not use up the hold-back: "用" may begin the stop string "用户"
    stopping = ["你好用", "你好用\ufffd", "你好用户：再见"]
    streamed = _StreamedText(lambda tokens: stopping[len(tokens) - 1], ["用户"])
    assert [streamed.update([0] * k) for k in range(1, 4)] == ["你好", "", ""] and streamed.finish("你好") == ""
    # a U+FFFD inside the text is the model's own: what follows it streams
    inside = ["ab\ufffd", "ab\ufffd and then a long answer goes on"]
    streamed = _StreamedText(lambda tokens: inside[len(tokens) - 1], [])
    assert [streamed.update([0] * k) for k in range(1, 3)] == ["ab", "\ufffd and then a long answer goes on"]


def test_a_streaming_client_that_hangs_up_has_its_request_dropped(checkpoint):
    """A client that closes a streamed answer midway drops the request from the engine; the log says 499."""
    long = {"prompt": "A room for two nights", "max_tokens": 1000, "n": 4, "temperature": 1.0, "seed": 5}
    with Server(checkpoint, slots=4, max_sequence=1024) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused")
        started = time.monotonic()
        assert client.completions.create(model="sft", **long).usage.completion_tokens > 2000
        taken = time.monotonic() - started
        started = time.monotonic()
        stream = client.completions.create(model="sft", stream=True, **long)
        assert next(iter(stream)).choices[0].finish_reason is None
        stream.close()
        while (server.service.loop._pending or len(server.log) < 2) and time.monotonic() - started < taken:
            time.sleep(0.02)
        assert server.service.loop._pending == 0 and time.monotonic() - started < max(0.5 * taken, 1.0), taken
        assert " POST /v1/completions 499 " in server.log[-1], server.log
        deadline = time.monotonic() + 30
        # the server stopping while a stream runs ends it with an error event, and the log says 503
        server.service.stopping_since = time.monotonic() - 60
        with pytest.raises(openai.APIError, match="the server is stopping"):
            list(client.completions.create(model="sft", prompt="A room", max_tokens=900, stream=True))
        server.service.stopping_since = None
        while not server.log[-1].startswith(time.strftime("%Y")) or " 503 " not in server.log[-1]:
            assert time.monotonic() < deadline, server.log
            time.sleep(0.02)
