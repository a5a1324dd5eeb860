"""Chat templates against the official renderings, loss masks and truncation."""

import json

import numpy as np
import pytest

from polyalign.chat import (TEMPLATES, ChatTemplateError, Message, encode_conversation, encode_prompt, get_template,
                            profile_prompt, record_messages, truncation_lengths)
from polyalign.data.records import Record
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
    assert profile_prompt(record, "oracle") == f"{preamble} family=dialogue; track=multi; style=open_chat; length=short."
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


def test_cutoff_keeps_the_end_of_the_prompt_and_the_start_of_the_response(demo_tokenizer):
    tokenizer, _ = demo_tokenizer
    template = get_template("polyalign")
    case = next(c for c in CASES if c["template"] == "polyalign" and len(c["record"]["history"]) >= 2)
    messages = record_messages(Record.from_json(case["record"]), case["profile"])
    full = encode_conversation(template, tokenizer, messages)
    source_len = int(np.argmax(full.loss_mask))
    target_len = len(full.ids) - source_len
    cutoff = 2 * target_len + 2  # the whole response fits, the prompt is cut
    cut = encode_conversation(template, tokenizer, messages, cutoff=cutoff)
    assert cut.truncated and len(cut.ids) == cutoff
    np.testing.assert_array_equal(cut.ids, full.ids[-cutoff:])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[-cutoff:])
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
    with pytest.raises(ChatTemplateError, match="a system message may only come first"):
        get_template("qwen").render([Message("user", "hi"), Message("system", "be brief")])
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
