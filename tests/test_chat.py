"""Chat templates against the official renderings, loss masks and truncation."""

import json

import numpy as np
import pytest

from polyalign.data.records import Record
from polyalign.tokens.chat import (
    TEMPLATES,
    ChatTemplateError,
    Message,
    encode_conversation,
    encode_prompt,
    get_template,
    profile_prompt,
    record_messages,
    truncation_lengths,
)
from tests.conftest import FIXTURES

CASES = json.loads((FIXTURES / "chat" / "fixtures.json").read_text(encoding="utf-8"))
STRIPS = {"polyalign": False, "qwen": False, "llama3": True, "gemma": True}  # llama3 and gemma trim contents


def case_id(case):
    return f"{case['template']}-{case['record']['dataset']}-{case['profile']}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rendering_equals_the_official_template(case):
    record = Record.from_json(case["record"])
    rendered = get_template(case["template"]).render(record_messages(record, case["profile"]))
    assert rendered == case["expected"]


def test_fixtures_cover_every_template_and_profile():
    assert {c["template"] for c in CASES} == set(TEMPLATES)
    assert {c["profile"] for c in CASES} == {"oracle", "context", "none"}
    assert any(len(c["record"]["history"]) >= 2 for c in CASES)
    assert {c["record"]["language"] for c in CASES} == {"en", "zh"}


def test_profile_prompts():
    record = Record.from_json(CASES[0]["record"])  # zh|multi|dialogue|short, open_chat
    preamble = "You are a helpful assistant. Follow the target response profile when answering."
    assert (profile_prompt(record, "oracle")
            == f"{preamble} family=dialogue; track=multi; style=open_chat; length=short.")
    assert profile_prompt(record, "context") == f"{preamble} family=dialogue; track=multi; style=open_chat."
    assert profile_prompt(record, "none") == ""
    assert record_messages(record, "none")[0].role == "user"
    with pytest.raises(ChatTemplateError, match="profile mode 'gold'"):
        profile_prompt(record, "gold")


def test_context_precedes_the_question():
    record = Record.from_json(next(c["record"] for c in CASES if c["record"]["dataset"] == "cmrc2018"))
    user = record_messages(record, "none")[-2]
    assert user.content == f"{record.context}\n\n{record.question}"


def tokenizer_for(template, demo_tokenizer, json_tokenizer):
    return demo_tokenizer[0] if template == "polyalign" else json_tokenizer


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loss_mask_covers_exactly_the_response_and_end_of_turn(case, demo_tokenizer, json_tokenizer):
    template = get_template(case["template"])
    tokenizer = tokenizer_for(case["template"], demo_tokenizer, json_tokenizer)
    record = Record.from_json(case["record"])
    messages = record_messages(record, case["profile"])
    encoded = encode_conversation(template, tokenizer, messages)
    response = record.response.strip() if STRIPS[case["template"]] else record.response
    eot = tokenizer.special_id(template.end_of_turn)
    assert encoded.ids[encoded.loss_mask].tolist() == tokenizer.encode(response) + [eot]
    assert encoded.loss_mask[-1] and encoded.ids[-1] == eot
    # The labelled tokens are one run at the end; everything before is prompt.
    first = int(np.argmax(encoded.loss_mask))
    assert encoded.loss_mask[first:].all() and not encoded.loss_mask[:first].any()
    # The sequence decodes to the official rendering, less what follows the final end-of-turn.
    expected = case["expected"]
    expected = expected[:expected.rindex(template.end_of_turn) + len(template.end_of_turn)]
    ids = encoded.ids.tolist()
    if template.bos:
        # SentencePiece decodes control tokens such as <s> to nothing; check it by id.
        assert ids[0] == tokenizer.special_id(template.bos)
        ids, expected = ids[1:], expected[len(template.bos):]
    assert tokenizer.decode(ids) == expected


def test_training_on_every_assistant_turn(demo_tokenizer):
    tokenizer, _ = demo_tokenizer
    template = get_template("polyalign")
    case = next(c for c in CASES if c["template"] == "polyalign" and len(c["record"]["history"]) >= 2)
    messages = record_messages(Record.from_json(case["record"]), case["profile"])
    encoded = encode_conversation(template, tokenizer, messages, train_on="all")
    eot = tokenizer.special_id("<|im_end|>")
    expected = [i for m in messages if m.role == "assistant" for i in tokenizer.encode(m.content) + [eot]]
    assert encoded.ids[encoded.loss_mask].tolist() == expected
    last_only = encode_conversation(template, tokenizer, messages)
    np.testing.assert_array_equal(encoded.ids, last_only.ids)
    assert encoded.loss_mask.sum() > last_only.loss_mask.sum()


def test_truncation_lengths_by_hand():
    assert truncation_lengths(100, 10, 64) == (54, 10)  # short response: kept whole, the prompt gives way
    assert truncation_lengths(10, 100, 64) == (10, 54)  # short prompt: kept whole
    assert truncation_lengths(100, 100, 64) == (32, 32)  # both long: in proportion
    assert truncation_lengths(300, 100, 64) == (48, 16)  # int(64 * 100 / 400) = 16
    assert truncation_lengths(5, 5, 64) == (5, 5)


def test_a_system_message_over_half_the_prompts_share_goes_whole_not_as_a_headless_tail(demo_tokenizer):
    """keep_system and turns keep the opening system message within half of the prompt's share; where a cut
    would open inside a longer one, it goes whole: the example is the conversation without it, opening with
    the template's BOS and the next turn's header, never with the system text's last tokens and no header
    (a real conversation whose system message holds its own turns' text, so it outweighs the rest)."""
    tokenizer, _ = demo_tokenizer
    template = get_template("polyalign")
    case = next(c for c in CASES if c["template"] == "polyalign" and len(c["record"]["history"]) >= 2)
    messages = record_messages(Record.from_json(case["record"]), case["profile"])
    messages = [Message("system", "\n".join(m.content for m in messages[1:])), *messages[1:]]
    full = encode_conversation(template, tokenizer, messages)
    source_len = int(np.argmax(full.loss_mask))
    target_len = len(full.ids) - source_len
    end_of_turn = int(np.argmax(full.ids == tokenizer.special_id("<|im_end|>")))
    system_len = end_of_turn + 1 + len(tokenizer.encode("\n"))  # BOS and the system turn
    keep_source = source_len - system_len + 3  # a cut by tokens would keep the system turn's last 3 tokens
    assert 2 * system_len > keep_source and 2 * target_len < keep_source + target_len
    for truncation in ("keep_system", "turns"):
        cut = encode_conversation(template, tokenizer, messages, cutoff=keep_source + target_len,
                                  truncation=truncation)
        assert cut.truncated and cut.system_cut and cut.system_left_out and not cut.mid_turn, truncation
        # without it the rest fits whole: `turns`, which had to drop turns to keep it, fits them again
        assert cut.turns_dropped == 0, truncation
        rest = encode_conversation(template, tokenizer, messages[1:])
        assert len(rest.ids) <= keep_source + target_len
        np.testing.assert_array_equal(cut.ids, rest.ids)
        np.testing.assert_array_equal(cut.loss_mask, rest.loss_mask)
        assert cut.ids[0] == full.ids[0] and cut.ids[1] == tokenizer.special_id("<|im_start|>")  # BOS, a header
    left = encode_conversation(template, tokenizer, messages, cutoff=keep_source + target_len)  # METHOD's recipe
    assert left.mid_turn and not left.system_left_out
    np.testing.assert_array_equal(left.ids, full.ids[-(keep_source + target_len):])  # opens in the system text


def test_a_conversation_left_without_its_system_message_still_opens_with_a_user_turn(demo_tokenizer):
    """A conversation whose assistant speaks first (a greeting) after a long system message: where the cut
    leaves the system message out, what is left resumes at a user turn as it did with the system message
    before it (never an example, or a prompt, that opens with the greeting and trains it), in training under
    `turns` and in a generation prompt alike."""
    from polyalign.tokens.chat import cut_prompt, prompt_ids

    tokenizer, _ = demo_tokenizer
    template = get_template("polyalign")
    case = next(c for c in CASES if c["template"] == "polyalign" and len(c["record"]["history"]) >= 2)
    messages = record_messages(Record.from_json(case["record"]), case["profile"])
    greeting = next(m for m in messages if m.role == "assistant")
    question, answer = messages[-2], messages[-1]
    system = Message("system", "\n".join(m.content for m in messages[1:]))
    conversation = [system, greeting, question, answer]
    rest = encode_conversation(template, tokenizer, [question, answer])
    for cutoff in range(len(rest.ids), len(rest.ids) + 60, 4):
        cut = encode_conversation(template, tokenizer, conversation, cutoff=cutoff, truncation="turns", train_on="all")
        if cut.system_left_out:
            assert cut.turns_dropped == 1 and cut.ids.tolist() == rest.ids.tolist(), cutoff  # the greeting went too
            break
    else:
        raise AssertionError("no cutoff left the system message out")
    budget = len(prompt_ids(template, tokenizer, [question])) + 2
    ids, _, lost, kept, _ = cut_prompt(template, tokenizer, conversation[:-1], budget)
    assert kept == [question] and lost and ids.tolist() == prompt_ids(template, tokenizer, [question])


def test_cutoff_keeps_the_end_of_the_prompt_and_the_start_of_the_response(demo_tokenizer):
    tokenizer, _ = demo_tokenizer
    template = get_template("polyalign")
    case = next(c for c in CASES if c["template"] == "polyalign" and len(c["record"]["history"]) >= 2)
    messages = record_messages(Record.from_json(case["record"]), case["profile"])
    full = encode_conversation(template, tokenizer, messages)
    source_len = int(np.argmax(full.loss_mask))
    target_len = len(full.ids) - source_len
    cutoff = 2 * target_len + 2  # the whole response fits, the prompt is cut
    cut = encode_conversation(template, tokenizer, messages, cutoff=cutoff)  # left, METHOD's recipe
    assert cut.truncated and cut.system_cut and len(cut.ids) == cutoff  # the profile prompt's start went
    assert not full.truncated and not full.system_cut
    np.testing.assert_array_equal(cut.ids, full.ids[-cutoff:])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[-cutoff:])
    # keep_system keeps the system message that opens the prompt (the profile prompt), then the latest tokens
    end_of_turn = int(np.argmax(full.ids == tokenizer.special_id("<|im_end|>")))  # the system turn's end
    head = full.ids[:end_of_turn + 1 + len(tokenizer.encode("\n"))]
    budget = 2 * len(head) + target_len + 2  # the whole response, and a head within half of the prompt kept
    assert messages[0].role == "system" and budget < len(full.ids)
    kept = encode_conversation(template, tokenizer, messages, cutoff=budget, truncation="keep_system")
    assert kept.truncated and not kept.system_cut and len(kept.ids) == budget
    np.testing.assert_array_equal(kept.ids, np.concatenate([head, full.ids[-(budget - len(head)):]]))
    np.testing.assert_array_equal(kept.loss_mask, full.loss_mask[-budget:])  # the head carries no loss
    assert messages[0].content.strip() in tokenizer.decode(kept.ids[:len(head)])  # the profile prompt, whole
    # a head over half of what is kept is not kept: the prompt is cut from its start
    headless = encode_conversation(template, tokenizer, messages, cutoff=len(head), truncation="keep_system")
    np.testing.assert_array_equal(headless.ids, full.ids[-len(head):])
    assert headless.system_cut
    tiny = encode_conversation(template, tokenizer, messages, cutoff=8)
    keep_source, keep_target = truncation_lengths(source_len, target_len, 8)
    assert len(tiny.ids) == 8 and tiny.loss_mask.sum() == keep_target
    np.testing.assert_array_equal(tiny.ids[keep_source:], full.ids[source_len:source_len + keep_target])


def test_generation_prompt_ends_with_the_assistant_header(demo_tokenizer, json_tokenizer):
    case = next(c for c in CASES if c["template"] == "llama3")
    messages = record_messages(Record.from_json(case["record"]), case["profile"], with_response=False)
    assert messages[-1].role == "user"
    text = get_template("llama3").render(messages, add_generation_prompt=True)
    assert text.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = encode_prompt(get_template("llama3"), json_tokenizer, messages)
    assert json_tokenizer.decode(ids.tolist()) == text
    assert len(encode_prompt(get_template("llama3"), json_tokenizer, messages, max_tokens=7)) == 7
    polyalign_ids = encode_prompt(get_template("polyalign"), demo_tokenizer[0], messages)
    assert polyalign_ids[0] == demo_tokenizer[0].bos_id


def test_templates_refuse_what_they_cannot_render():
    with pytest.raises(ChatTemplateError, match="gemma: roles must alternate"):
        get_template("gemma").render([Message("assistant", "hi"), Message("user", "hello")])
    # a system message with no user turn to close is a user turn of its own, in the built-in and its Jinja alike
    lone = [Message("system", "be brief"), Message("assistant", "hi")]
    written = "<bos><start_of_turn>user\nbe brief<end_of_turn>\n<start_of_turn>model\nhi<end_of_turn>\n"
    assert get_template("gemma").render(lone) == written
    from polyalign.tokens.chat_jinja import JinjaRenderer
    jinja = JinjaRenderer(get_template("gemma").jinja_source(), {"bos_token": "<bos>"})
    assert jinja.render([{"role": m.role, "content": m.content} for m in lone]) == written
    with pytest.raises(ChatTemplateError, match="unknown chat template 'mistral'"):
        get_template("mistral")
    with pytest.raises(ChatTemplateError, match="must end with the assistant response"):
        encode_conversation(get_template("qwen"), None, [Message("user", "hi")])


def test_consecutive_turns_of_one_speaker_are_joined():
    record = Record.from_json(CASES[0]["record"])
    record.history = [{"role": "user", "text": "a"}, {"role": "user", "text": "b"}, {"role": "assistant", "text": "c"}]
    roles = [m.role for m in record_messages(record, "none")]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert record_messages(record, "none")[0].content == "a\nb"


def test_each_builtin_template_as_jinja_renders_and_masks_like_the_builtin(demo_run, demo_tokenizer, json_tokenizer):
    """The Jinja source of every built-in template (what exports carry) rendered through the checkpoint
    path gives the built-in's string, prompt ids, and ids and loss masks for both train_on modes, on
    real records with and without history and system prompt."""
    from polyalign.data.records import read_records
    from polyalign.tokens.chat import JinjaTemplate

    run, _, _ = demo_run
    records = [r for r in read_records(run / "data" / "test.jsonl") if r.response][:60]
    assert sum(len(r.history) >= 2 for r in records) >= 10
    for name, builtin in TEMPLATES.items():
        tokenizer = tokenizer_for(name, demo_tokenizer, json_tokenizer)
        # One test tokenizer serves three families: give the template the family's BOS, as its own would.
        jinja = JinjaTemplate(builtin.jinja_source(), tokenizer, {"bos_token": builtin.bos} if builtin.bos else {})
        assert jinja.stop_tokens() == builtin.stop_tokens()
        for record in records:
            for profile in ("context", "none"):
                messages = record_messages(record, profile)
                assert jinja.render(messages) == builtin.render(messages), (name, record.id)
                assert jinja.render(messages[:-1], True) == builtin.render(messages[:-1], True)
                assert np.array_equal(encode_prompt(jinja, tokenizer, messages[:-1]),
                                      encode_prompt(builtin, tokenizer, messages[:-1]))
                for train_on in ("last", "all"):
                    ours = encode_conversation(jinja, tokenizer, messages, train_on=train_on)
                    theirs = encode_conversation(builtin, tokenizer, messages, train_on=train_on)
                    assert np.array_equal(ours.ids, theirs.ids), (name, record.id, train_on)
                    assert np.array_equal(ours.loss_mask, theirs.loss_mask), (name, record.id, train_on)


JINJA_CASES = json.loads((FIXTURES / "chat" / "jinja.json").read_text(encoding="utf-8"))
TEMPLATE_DIR = FIXTURES / "chat" / "templates"
EXTRA_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|system|>", "<|user|>", "<|assistant|>", "</s>"]
EOS = {"qwen3.jinja": "<|im_end|>", "fine_tuned.jinja": "</s>"}


@pytest.fixture(scope="module")
def checkpoint_tokenizers(json_tokenizer, tmp_path_factory):
    """The demo BPE tokenizer.json with each template's markers added, in a checkpoint-like folder whose
    tokenizer_config.json carries the template as its chat_template."""
    from tokenizers import Tokenizer

    from polyalign.tokens.tokenizer import load_tokenizer

    folders = {}
    for name, eos in EOS.items():
        folder = tmp_path_factory.mktemp(name.split(".")[0])
        tok = Tokenizer.from_file(str(json_tokenizer.path))
        tok.add_special_tokens(EXTRA_TOKENS)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": eos, "chat_template": (TEMPLATE_DIR / name).read_text(encoding="utf-8")}))
        folders[name] = load_tokenizer(folder)
    return folders


def jinja_case_id(case):
    return (f"{case['template']}-{case['record']['dataset']}-{case['variables']}"
            f"{'-reasoning' if case['reasoning'] else ''}")


@pytest.mark.parametrize("case", JINJA_CASES, ids=jinja_case_id)
def test_a_checkpoint_template_renders_and_locates_turns_as_transformers_does(case, checkpoint_tokenizers):
    from polyalign.tokens.chat import choose_template

    tokenizer = checkpoint_tokenizers[case["template"]]
    assert choose_template(tokenizer) == "checkpoint"  # the checkpoint's own template is the default
    template = get_template("checkpoint", tokenizer, case["variables"])
    assert template.stop_tokens() == (EOS[case["template"]],)
    messages = [Message(m["role"], m["content"]) for m in case["messages"]]
    assert template.render(messages) == case["expected"]
    assert template.render(messages[:-1], add_generation_prompt=True) == case["prompt"]
    text, spans = template.locate_turns(messages)
    assert text == case["expected"]
    expected_spans = case["assistant_spans"]  # transformers' {% generation %} spans, or what the last turn adds
    if template.renderer.has_generation_blocks:
        assert [list(spans[k]) for k in sorted(spans)] == expected_spans
    else:
        assert list(spans[len(messages) - 1]) == expected_spans[-1]
    # The ids are transformers' tokenisation of the whole string (up to the final end-of-turn token);
    # the mask covers the last turn, from what follows the generation prompt to its end-of-turn token.
    encoded = encode_conversation(template, tokenizer, messages)
    whole = tokenizer.encode(case["expected"])
    assert encoded.ids.tolist() == whole[:len(encoded.ids)]
    assert tokenizer.decode(whole[len(encoded.ids):]) == "\n"
    start, end = expected_spans[-1]
    assert tokenizer.decode(encoded.ids[encoded.loss_mask]) == case["expected"][start:end].rstrip("\n")
    response = case["record"]["response"]
    target = tokenizer.decode(encoded.ids[encoded.loss_mask])
    eos = EOS[case["template"]]
    if case["template"] == "qwen3.jinja":  # hand-written: an empty reasoning block unless thinking is off
        thinking_off = case["variables"].get("enable_thinking") is False
        assert target == ("" if thinking_off else "<think>\n\n</think>\n\n") + response + eos
    else:
        assert target == response + eos


def test_train_on_all_needs_every_turn_located(checkpoint_tokenizers):
    """Qwen3 writes past turns without their reasoning, so rendering is not stable under appending
    turns: training on every turn is refused; a template with generation blocks marks them all."""
    case = next(c for c in JINJA_CASES if c["template"] == "qwen3.jinja" and c["reasoning"])
    messages = [Message(m["role"], m["content"]) for m in case["messages"]]
    qwen3 = get_template("checkpoint", checkpoint_tokenizers["qwen3.jinja"])
    with pytest.raises(ChatTemplateError, match="cannot tell where assistant turn 1 lies"):
        encode_conversation(qwen3, checkpoint_tokenizers["qwen3.jinja"], messages, train_on="all")
    tokenizer = checkpoint_tokenizers["fine_tuned.jinja"]
    fine_tuned = get_template("checkpoint", tokenizer)
    both = encode_conversation(fine_tuned, tokenizer, messages, train_on="all")
    assert tokenizer.decode(both.ids[both.loss_mask]) == messages[1].content + "</s>" + messages[3].content + "</s>"


def test_a_generation_prompt_that_does_not_open_the_written_turn_is_refused_saying_where_they_part(
        checkpoint_tokenizers):
    """A template that writes `assistant:` in a turn but prompts generation with `assistant`: the final
    answer cannot be located after the generation prompt, and the error says where the two part."""
    from polyalign.tokens.chat import JinjaTemplate

    case = next(c for c in JINJA_CASES if c["template"] == "fine_tuned.jinja")
    messages = [Message(m["role"], m["content"]) for m in case["messages"]]
    tokenizer = checkpoint_tokenizers["fine_tuned.jinja"]
    source = ("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}</s>\n{% endfor %}"
              "{% if add_generation_prompt %}assistant\n{% endif %}")
    with pytest.raises(ChatTemplateError) as refused:
        encode_conversation(JinjaTemplate(source, tokenizer), tokenizer, messages)
    message = str(refused.value)
    assert "does not begin with the prompt the template writes for generation" in message
    assert "the prompt goes on with '\\n', the written turn with ':\\n" in message, message
    assert message.endswith("or mark answers with {% generation %} blocks")


def test_the_checkpoint_template_is_found_where_transformers_keeps_it(checkpoint_tokenizers, tmp_path):
    from polyalign.tokens.chat import choose_template
    from polyalign.tokens.tokenizer import load_tokenizer

    source = (TEMPLATE_DIR / "fine_tuned.jinja").read_text(encoding="utf-8")
    base = checkpoint_tokenizers["fine_tuned.jinja"].path
    for layout in ("file", "named", "none", "polyalign"):
        folder = tmp_path / layout
        folder.mkdir()
        (folder / "tokenizer.json").write_bytes(base.read_bytes())
        config = {"eos_token": "</s>"}
        if layout == "file":
            (folder / "chat_template.jinja").write_text(source, encoding="utf-8")
        elif layout == "named":
            config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": source}]
        elif layout == "polyalign":  # a polyalign export: the built-in it names wins over its Jinja copy
            config.update(chat_template=source, polyalign_chat_template="qwen")
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        tokenizer = load_tokenizer(folder)
        if layout == "none":
            assert tokenizer.template_source is None and choose_template(tokenizer, family="qwen2") == "qwen"
            with pytest.raises(ChatTemplateError, match="the tokenizer has no chat template and the model family is"):
                choose_template(tokenizer)
            # Qwen3 is a family polyalign knows, with no built-in template: said so, and Qwen2.5's own system
            # prompt named beside the template that would add it (it read "the model family is unknown")
            with pytest.raises(ChatTemplateError) as refused:
                choose_template(tokenizer, family="qwen3", where="ckpt")
            assert str(refused.value).startswith(
                "ckpt: the tokenizer has no chat template and polyalign has no built-in template for the qwen3 "
                "family, whose checkpoints ship their own (put it in tokenizer_config.json's chat_template or "
                "chat_template.jinja); or pass --template with one whose tokens it has (")
            assert "qwen (adds its own default system prompt where a conversation has none)" in str(refused.value)
            with pytest.raises(ChatTemplateError, match="tokenizer_config.json has none"):
                choose_template(tokenizer, "checkpoint")
        elif layout == "polyalign":
            assert choose_template(tokenizer) == "qwen"
        else:
            assert tokenizer.template_source == source and choose_template(tokenizer) == "checkpoint"


def test_template_choices_of_the_cli_are_the_templates():
    from polyalign import cli
    from polyalign.tokens.chat import TEMPLATE_CHOICES

    assert cli.TEMPLATE_CHOICES == TEMPLATE_CHOICES


def test_a_prompt_over_its_budget_loses_its_oldest_turns_and_keeps_its_system_message(json_tokenizer):
    from tests.chat_exports import camrest_dialogues, camrest_messages

    messages = [Message("system", "Answer as the hotel desk would, briefly.")]
    messages += [Message(m["role"], m["content"]) for m in camrest_messages(camrest_dialogues(1)[0])]
    messages = messages[:-1] if messages[-1].role == "assistant" else messages
    budget = len(encode_prompt(get_template("llama3"), json_tokenizer, messages)) // 2
    for name in ("llama3", "gemma"):
        template = get_template(name)
        cut = encode_prompt(template, json_tokenizer, messages, max_tokens=budget).tolist()
        # the conversation resumed at the earliest user turn that fits, after the system message, rendered whole
        fits = [[messages[0], *messages[start:]] for start in range(1, len(messages)) if messages[start].role == "user"
                and len(encode_prompt(template, json_tokenizer, [messages[0], *messages[start:]])) <= budget]
        assert 0 < len(fits) < sum(m.role == "user" for m in messages)  # some turns go, not all
        assert cut == encode_prompt(template, json_tokenizer, fits[0]).tolist() and len(cut) <= budget
        # Gemma folds the system message into the first user turn: the kept one opens with it
        opening = {"llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge",
                   "gemma": "<bos><start_of_turn>user\nAnswer as the hotel desk would, briefly.\n\n"}[name]
        assert json_tokenizer.decode(cut, skip_special=False).startswith(opening)
        assert "Answer as the hotel desk would" in json_tokenizer.decode(cut)


def test_a_template_whose_tokens_the_tokenizer_lacks_is_refused_naming_the_ones_it_can_take(demo_run, tmp_path,
                                                                                             capsys):
    """A checkpoint with no chat template of its own and a tokenizer holding ChatML's tokens only: its
    family's template (llama3) is refused before anything is rendered, naming why it was chosen, the tokens
    it lacks and the templates whose tokens it has; --template qwen renders."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from polyalign.cli import main
    from polyalign.data.records import read_records
    from polyalign.tokens.chat import TEMPLATES, ChatTemplateError, choose_template
    from polyalign.tokens.tokenizer import load_tokenizer

    run, _, _ = demo_run
    records = read_records(run / "data" / "val.jsonl")[:200]
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([r.question + r.response for r in records], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    ckpt = tmp_path / "llama_notmpl"
    ckpt.mkdir()
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tokenizer = load_tokenizer(ckpt)
    vocab = tok.get_vocab()
    fitting = [name + (" (adds its own default system prompt where a conversation has none)" if name == "qwen" else "")
               for name, t in TEMPLATES.items() if all(s in vocab for s in t.special_tokens())]
    assert fitting[-1].startswith("qwen (adds") and not any(f.startswith("llama3") for f in fitting)
    with pytest.raises(ChatTemplateError) as refused:
        choose_template(tokenizer, None, "llama", str(ckpt))
    assert str(refused.value) == (
        f"{ckpt}: chat template 'llama3' (the llama family's, since the tokenizer has no chat template of its own) "
        "needs '<|begin_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>', which the tokenizer "
        f"does not have as tokens; pass --template with one whose tokens it has ({', '.join(fitting)})")
    with pytest.raises(ChatTemplateError, match=r"chat template 'gemma' \(asked for\) needs '<bos>'"):
        choose_template(tokenizer, "gemma", "llama", str(ckpt))
    out = tmp_path / "p.jsonl"
    args = ["prompts", "--records", str(run / "data" / "val.jsonl"), "--checkpoint", str(ckpt), "--limit", "2"]
    assert main([*args, "--out", str(out)]) == 2
    assert "chat template 'llama3' (the llama family's" in capsys.readouterr().err and not out.exists()
    assert main([*args, "--out", str(out), "--template", "qwen"]) == 0
    assert json.loads(out.read_text().splitlines()[0])["prompt"].startswith("<|im_start|>system")


@pytest.mark.parametrize("truncation", ["left", "keep_system"])
def test_a_cut_never_trains_an_earlier_reply_from_its_middle(demo_run, demo_tokenizer, truncation):
    """--train-on all trains every assistant turn kept; a cut by tokens that opens inside an earlier reply
    would train its tail without its start or header. On real multi-turn records at cutoffs that cut inside
    earlier turns, the example is the whole one's head and latest tokens (METHOD's rule), and every trained
    span of it begins where a reply begins in the whole conversation."""
    from polyalign.data.records import read_records
    from polyalign.tokens.chat import system_head

    run, _, _ = demo_run
    tokenizer, template = demo_tokenizer[0], get_template("polyalign")
    records = [r for r in read_records(run / "data" / "val.jsonl") if len(r.history) >= 4][:60]
    opened_inside = 0
    for record in records:
        messages = record_messages(record, "context")
        whole = encode_conversation(template, tokenizer, messages, train_on="all")
        mask = whole.loss_mask
        starts = {i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])}
        source = max(starts)  # the final reply's first token
        for cutoff in (len(whole.ids) // 2, len(whole.ids) // 3):
            keep_source, keep_target = truncation_lengths(source, len(whole.ids) - source, cutoff)
            head = 0 if truncation == "left" else system_head(template, tokenizer, messages,
                                                              whole.ids[:source].tolist(), keep_source)
            start = source - (keep_source - head)
            cut = encode_conversation(template, tokenizer, messages, train_on="all", cutoff=cutoff,
                                      truncation=truncation)
            np.testing.assert_array_equal(cut.ids, np.concatenate(
                [whole.ids[:head], whole.ids[start:source], whole.ids[source:source + keep_target]]))
            opened_inside += bool(mask[start] and start not in starts)
            for i in range(head, len(cut.ids)):
                if cut.loss_mask[i] and (i == head or not cut.loss_mask[i - 1]):
                    assert start + i - head in starts, (record.id, cutoff, i)
                if cut.loss_mask[i]:  # and what is trained is trained in the whole conversation too
                    assert mask[start + i - head]
    assert opened_inside > 5, opened_inside  # the cuts did open inside earlier replies


def test_a_cut_that_took_only_the_system_message_lost_no_turns():
    """generate and prompts count the prompts a cut took whole turns from with one rule: a long system message
    left out alone is no lost turn (generate counted every changed prompt, prompts the turns: the same records
    read "4 lost their oldest whole turns" in one and 3 in the other)."""
    from polyalign.tokens.chat import Message, lost_whole_turns

    system, u1, a1, u2 = (Message("system", "s"), Message("user", "q1"), Message("assistant", "a1"),
                          Message("user", "q2"))
    assert lost_whole_turns([system, u1, a1, u2], [system, u2])
    assert not lost_whole_turns([system, u1, a1, u2], [u1, a1, u2])  # the system message alone
    assert lost_whole_turns([system, u1, a1, u2], [u2])
    assert not lost_whole_turns([system, u1, a1, u2], [system, u1, a1, u2])
    assert lost_whole_turns([u1, a1, u2], [u2]) and not lost_whole_turns([u1, a1, u2], [u1, a1, u2])


def test_the_profile_combinations_an_export_lists_are_every_sources_most_common_first():
    """seen_profile_values: the combinations of a profile's keys, counted over the sources (a build's, a preference
    run's pairs, its init's export), most common first; none where a source lists values alone (made before
    combinations were counted): it may have held any, and refusing them would refuse its own data."""
    from polyalign.tokens.profile_template import seen_profile_values

    def held(family, track, style, length, examples):
        return {"family": family, "track": track, "style": style, "length": length, "examples": examples}

    build = {"family": ["dialogue", "qa"], "track": ["multi", "single"], "style": ["chat", "search"],
             "combinations": [held("qa", "single", "search", "short", 2), held("dialogue", "multi", "chat", "short", 3),
                              held("qa", "single", "search", "long", 2)]}
    init = {"family": ["assistant"], "track": ["single"], "style": ["help"],
            "combinations": [{"family": "assistant", "track": "single", "style": "help"}]}
    values = seen_profile_values("context", build, init)
    assert values["combinations"] == [{"family": "qa", "track": "single", "style": "search"},  # 2 + 2, then 3
                                      {"family": "dialogue", "track": "multi", "style": "chat"},
                                      {"family": "assistant", "track": "single", "style": "help"}]  # no count: last
    assert values["family"] == ["assistant", "dialogue", "qa"]
    assert "combinations" not in seen_profile_values("context", build, {k: v for k, v in init.items()
                                                                        if k != "combinations"})
    assert seen_profile_values("oracle", build)["combinations"][0] == {
        "family": "dialogue", "track": "multi", "style": "chat", "length": "short"}
    assert seen_profile_values("none", build) is None
