"""Users' own conversations (OpenAI chat exports, ShareGPT) imported and rendered as their authors mean
them: a system message is the record's system prompt, never an assistant turn; real text from the
bundled demo data in the shapes exports come in (tests/chat_exports.py)."""

import json

import numpy as np
import pytest

from polyalign.data.prepare import prepare
from polyalign.data.records import read_records
from polyalign.data.text import normalize
from polyalign.tokens.chat import (
    ChatTemplateError,
    JinjaTemplate,
    Message,
    encode_conversation,
    encode_prompt,
    fold_system,
    get_template,
    profile_prompt,
    record_messages,
    system_prompt,
)
from tests.chat_exports import (
    camrest_dialogues,
    camrest_goal,
    camrest_messages,
    crosswoz_dialogues,
    crosswoz_messages,
    crosswoz_tasks,
    openai_rows,
    sharegpt_rows,
    tool_row,
    write_jsonl,
)
from tests.conftest import FIXTURES, write_bpe_tokenizer, write_config

EXPORTS = json.loads((FIXTURES / "chat" / "exports.json").read_text(encoding="utf-8"))


def record_key(record):
    return f"{record.meta['dialogue_id']}-turn-{record.meta['turn']}"


@pytest.fixture(scope="module")
def export_run(tmp_path_factory):
    """The OpenAI export prepared with nothing but `format: chat` and a path."""
    folder = tmp_path_factory.mktemp("export")
    write_jsonl(folder / "chats.jsonl", openai_rows() + [tool_row()])
    config = write_config(folder / "data.yaml", [{"name": "chats", "format": "chat", "path": "chats.jsonl"}])
    manifest = prepare(config, folder / "run", progress=False)
    records = [r for split in ("train", "val", "test")
               for r in read_records(folder / "run" / "data" / f"{split}.jsonl")]
    return manifest, {record_key(r): r for r in records}


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer.json trained on the fixture texts, with every template's special tokens."""
    from polyalign.tokens.tokenizer import load_tokenizer

    texts = [m["content"] for case in EXPORTS for m in case["messages"]]
    return load_tokenizer(write_bpe_tokenizer(texts, 600, tmp_path_factory.mktemp("bpe"), {"eos_token": "<eos>"}))


def test_every_record_of_the_export_is_there(export_run):
    manifest, records = export_run
    assert sorted(records) == sorted({case["key"] for case in EXPORTS} | {"camrest-train-5-turn-2"})
    # nothing named family or style: every record took the chat format's defaults, and the manifest says so
    # (the tool-call records are left out before they are labelled)
    (source,) = manifest["sources"]
    assert source["label_defaults"] == {"family": len(records), "style": len(records)}
    assert {(r.family, r.style) for r in records.values()} == {("assistant", "assistant_like")}


def test_a_reply_weighted_0_is_history_never_a_target(tmp_path):
    """OpenAI's fine-tuning format marks an assistant message not to learn with "weight": 0: its record is
    skipped (counted and listed as weight_0), the replies after it keep it in their history; a weight other
    than 0 or 1 is a row problem naming the message."""
    rows = openai_rows()
    row = next(r for r in rows if sum(m["role"] == "assistant" for m in r["messages"]) >= 3)
    first = next(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
    row["messages"][first] = {**row["messages"][first], "weight": 0}
    write_jsonl(tmp_path / "chats.jsonl", [row])
    config = write_config(tmp_path / "data.yaml", [{"name": "chats", "format": "chat", "path": "chats.jsonl"}])
    manifest = prepare(config, tmp_path / "run", progress=False)
    records = [r for split in ("train", "val", "test")
               for r in read_records(tmp_path / "run" / "data" / f"{split}.jsonl")]
    replies = sum(m["role"] == "assistant" for m in row["messages"])
    assert len(records) == replies - 1 and manifest["sources"][0]["dropped"] == {"weight_0": 1}
    weighted = normalize(row["messages"][first]["content"])
    assert weighted not in {r.response for r in records}
    assert all(weighted in [t["text"] for t in r.history] for r in records)  # every later reply's history holds it
    listed = [json.loads(line) for line in (tmp_path / "run" / "data" / "dropped.jsonl").read_text().splitlines()]
    # which of the line's replies: the one left out, as docs/data.md says of a reply dropped from a conversation
    assert [(d["reason"], d["response"]) for d in listed] == [("weight_0", weighted[:80])]
    row["messages"][first]["weight"] = 0.5
    write_jsonl(tmp_path / "chats.jsonl", [row])
    from polyalign.core.errors import PrepareError

    with pytest.raises(PrepareError, match=f"message {first + 1} 'weight' must be 0 or 1 \\(0: not trained on\\), "
                                        "got 0.5"):
        prepare(config, tmp_path / "run2", progress=False)


def case_id(case):
    return f"{case['template']}-{case['key']}"


@pytest.mark.parametrize("case", EXPORTS, ids=case_id)
def test_rendering_equals_transformers_on_the_source_messages(case, export_run, bpe_tokenizer):
    """With the `none` profile a record renders exactly as transformers' apply_chat_template renders the
    user's own messages (tests/fixtures/chat/exports.json, the official Qwen2.5, Llama 3.2 and Gemma 2
    templates): the system message as the system turn, a mid-conversation one as a system turn where
    it stands (Gemma: folded into a user turn), the ids transformers' tokenisation of that string."""
    _, records = export_run
    record = records[case["key"]]
    messages = record_messages(record, "none")
    assert [{"role": m.role, "content": m.content} for m in messages] == case["messages"]
    builtin = get_template(case["template"])
    jinja = JinjaTemplate(builtin.jinja_source(), bpe_tokenizer, {"bos_token": builtin.bos} if builtin.bos else {})
    for template in (builtin, jinja):
        assert template.render(messages) == case["expected"]
        assert template.render(messages[:-1], add_generation_prompt=True) == case["prompt"]
        encoded = encode_conversation(template, bpe_tokenizer, messages)
        whole = bpe_tokenizer.encode(case["expected"])
        assert encoded.ids.tolist() == whole[:len(encoded.ids)]
        assert bpe_tokenizer.decode(whole[len(encoded.ids):]) in ("", "\n")
        response = record.response.strip() if case["template"] != "qwen" else record.response
        assert bpe_tokenizer.decode(encoded.ids[encoded.loss_mask]) == response + builtin.end_of_turn
        assert encode_prompt(template, bpe_tokenizer, messages[:-1]).tolist() == bpe_tokenizer.encode(case["prompt"])
    both = [encode_conversation(t, bpe_tokenizer, messages, train_on="all") for t in (builtin, jinja)]
    assert np.array_equal(both[0].ids, both[1].ids) and np.array_equal(both[0].loss_mask, both[1].loss_mask)


def resumption(messages, user: int) -> int:
    """Where a conversation resumed at user turn `user` begins: with the system messages just before it
    (a mid-conversation instruction goes with the turn it precedes), after the opening one."""
    while user - 1 > 0 and messages[user - 1].role == "system":
        user -= 1
    return user


@pytest.mark.parametrize("name", ["qwen", "llama3", "gemma"])
def test_a_cut_prompt_loses_whole_turns_and_keeps_its_system_message_in_every_template(name, export_run,
                                                                                      bpe_tokenizer):
    """Every export conversation cut to fewer tokens than it has is the same conversation less as few of its
    oldest whole turns as make it fit (its opening system message, the profile prompt, kept; a user turn
    first), rendered whole: what an engine given the kept messages reads. Only one still over with its last
    question alone is cut inside it: its opening system message (rendered alone where the template writes a
    system turn, at the head of the first user turn where it folds it there: Gemma's BOS, header, text), then
    its latest tokens. Where that cut would open inside a system message over half the budget, the message goes
    whole and the conversation without it is fitted again: under the system turn the template writes of its
    own (Qwen's identity prompt, Llama 3's date header), never a tail without its header."""
    from polyalign.tokens.chat import (
        cut_prompt,
        fit_messages,
        own_system_head,
        prompt_ids,
        system_head,
        system_turn_length,
    )

    _, records = export_run
    template = get_template(name)
    whole_turns = inside = left_out = 0
    for case in (c for c in EXPORTS if c["template"] == name):
        messages = record_messages(records[case["key"]], "context")[:-1]
        whole = prompt_ids(template, bpe_tokenizer, messages)
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        budgets = {len(whole) - 1, len(whole) * 2 // 3, len(whole) // 3, 8}
        # and a budget under which a cut would open inside the system turn, just over twice as long as it
        system_turn = system_turn_length(template, bpe_tokenizer, messages, whole)  # 0 for gemma: folded
        last_alone = prompt_ids(template, bpe_tokenizer, [messages[0], *messages[users[-1]:]])
        if system_turn and 2 * system_turn + 2 < len(last_alone):
            budgets.add(len(last_alone) - system_turn // 2)
        for budget in sorted(budgets):
            ids, cut, lost, kept, mid_turn = cut_prompt(template, bpe_tokenizer, messages, budget)
            assert cut and len(ids) <= budget and kept[-1] == messages[-1]
            went = kept[0] != messages[0]
            if went:  # only a system message over half the budget, the cut opening inside its turn
                with_it = fit_messages(template, bpe_tokenizer, messages, budget)
                alone = prompt_ids(template, bpe_tokenizer, with_it)
                assert name != "gemma" and with_it[1:] == messages[resumption(messages, users[-1]):] and lost
                assert system_head(template, bpe_tokenizer, with_it, alone, budget) == 0
                assert len(alone) - budget < len(prompt_ids(template, bpe_tokenizer, messages[:1]))
                left_out += 1
            first = 0 if went else 1  # the kept turns resume after the system message, or it went too
            start = len(messages) - len(kept) + first
            resumed = next(i for i in range(start, len(messages)) if messages[i].role != "system")
            assert kept == [*messages[:first], *messages[start:]] and messages[resumed].role == "user"
            assert start <= 1 or start == resumption(messages, resumed)  # the system messages before it kept
            if not mid_turn:  # the kept messages rendered whole, and one turn more would not fit
                assert ids.tolist() == prompt_ids(template, bpe_tokenizer, kept) and lost == went
                earlier = [i for i in users if first < i < start]
                assert not earlier or len(prompt_ids(template, bpe_tokenizer, [
                    *messages[:first], *messages[resumption(messages, earlier[-1]):]])) > budget
                whole_turns += not went
                continue
            assert resumed == users[-1]  # over with the last question alone
            alone = prompt_ids(template, bpe_tokenizer, kept)
            head = (own_system_head(template, bpe_tokenizer, alone, budget) if went
                    else system_head(template, bpe_tokenizer, kept, alone, budget))
            assert len(ids) == budget and lost == (went or head == 0)
            assert ids.tolist() == alone[:head] + alone[len(alone) - (budget - head):]  # the head, the latest tokens
            if head and went:  # the template's own system turn, not a word of the message left out
                assert ids[:head].tolist() == prompt_ids(template, bpe_tokenizer, [Message("user", "?")])[:head]
                assert messages[0].content.strip()[:20] not in bpe_tokenizer.decode(ids.tolist())
            elif head:
                assert messages[0].content.strip() in bpe_tokenizer.decode(ids[:head].tolist())
                assert name != "gemma" or template.bos in bpe_tokenizer.decode(ids[:head].tolist(),
                                                                               skip_special=False)
            inside += 1
    assert whole_turns >= 4 and inside >= 2, (whole_turns, inside)
    # qwen and llama3 write a system turn of their own (leaving the message out would put it in its place),
    # gemma folds it into the user turn: never left out here (polyalign's template: tests/test_chat.py)
    assert left_out == 0, left_out


@pytest.mark.parametrize("name", ["qwen", "llama3"])
def test_the_templates_own_system_turn_heads_a_cut_and_never_stands_in_for_a_left_out_message(name, export_run,
                                                                                            bpe_tokenizer):
    """Qwen and Llama 3 write a system turn of their own for a conversation without a system message: a cut
    of such a conversation keeps it as its head (as an opening system message is kept), then the latest
    tokens, in generation and in training (keep_system, turns) alike. A long system message is never left
    out under them (that turn would stand in for it, a system prompt the conversation never had): its cut
    keeps the latest tokens as before."""
    from polyalign.tokens.chat import cut_prompt, own_system_head, prompt_ids

    _, records = export_run
    template = get_template(name)
    cases = [record_messages(records[c["key"]], "context") for c in EXPORTS if c["template"] == name]
    messages = max(cases, key=len)
    # one long question (the conversation's questions at once: longer than the template's own system turn) and
    # the last answer; a system message over half of any share below
    question = Message("user", "\n".join(m.content for m in messages if m.role == "user"))
    answer = messages[-1]
    assert answer.role == "assistant"
    own = prompt_ids(template, bpe_tokenizer, [question])  # the template's own system turn, then the question
    budget = len(own) - 3
    ids, cut, lost, kept, mid_turn = cut_prompt(template, bpe_tokenizer, [question], budget)
    head = own_system_head(template, bpe_tokenizer, own, budget)
    assert 0 < head <= budget // 2 and kept == [question] and cut and not lost and mid_turn
    assert ids.tolist() == own[:head] + own[len(own) - (budget - head):]
    written = {"qwen": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>",
               "llama3": "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"}
    assert bpe_tokenizer.decode(own[:head], skip_special=False).endswith(written[name])
    target = encode_conversation(template, bpe_tokenizer, [question, answer])
    answer_ids = target.ids[int(np.argmax(target.loss_mask)):].tolist()
    assert target.ids[:len(own)].tolist() == own  # the prompt trained on is the generation prompt
    for truncation in ("keep_system", "turns"):
        encoded = encode_conversation(template, bpe_tokenizer, [question, answer], cutoff=budget + len(answer_ids),
                                      truncation=truncation)
        assert encoded.mid_turn and not encoded.system_cut and not encoded.reply_cut, truncation
        assert encoded.ids.tolist() == ids.tolist() + answer_ids, truncation
        assert encoded.loss_mask.tolist() == [False] * budget + [True] * len(answer_ids)
    left = encode_conversation(template, bpe_tokenizer, [question, answer], cutoff=budget + len(answer_ids))
    assert left.ids.tolist() == target.ids[-(budget + len(answer_ids)):].tolist()  # `left`: the latest tokens only
    # a long system message before it: cut inside (its latest tokens), never replaced by the template's own turn
    system = Message("system", "\n".join(m.content for m in messages[1:]) * 2)
    with_system = prompt_ids(template, bpe_tokenizer, [system, question])
    ids, cut, lost, kept, mid_turn = cut_prompt(template, bpe_tokenizer, [system, question], budget)
    assert kept == [system, question] and lost and mid_turn and ids.tolist() == with_system[-budget:]
    for truncation in ("keep_system", "turns"):
        encoded = encode_conversation(template, bpe_tokenizer, [system, question, answer],
                                      cutoff=budget + len(answer_ids), truncation=truncation)
        assert not encoded.system_left_out and encoded.system_cut and encoded.ids.tolist() == ids.tolist() + answer_ids


@pytest.mark.parametrize("name", ["qwen", "llama3", "gemma"])
def test_turns_truncation_drops_as_few_whole_turns_as_fit_the_prompts_share(name, export_run, bpe_tokenizer):
    """`truncation="turns"` on every multi-turn export conversation at cutoffs from just under its length to a
    third of it: the example is the conversation less its oldest whole turns (the system message kept, a user
    turn first) encoded whole, its answer cut at its end to what is left of the cutoff, never less than
    METHOD's rule gives it; as few turns go as fit the prompt's share (one more would not); only a last
    question over the share alone is cut inside, as keep_system cuts it. A system message over half the share
    that such a cut would open inside goes whole, and the turns are fitted to the share without it."""
    from polyalign.tokens.chat import system_turn_length, truncation_lengths

    _, records = export_run
    template = get_template(name)
    whole_turns = inside = notes_dropped = left_out = 0
    for record in records.values():
        messages = record_messages(record, "context")
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        if len(users) < 3:
            continue
        whole = encode_conversation(template, bpe_tokenizer, messages, train_on="all")
        last = encode_conversation(template, bpe_tokenizer, messages)
        source = int(np.argmax(last.loss_mask))
        answer = last.ids[source:]
        for cutoff in sorted({len(whole.ids) - 1, len(whole.ids) * 3 // 4, len(whole.ids) // 2, len(whole.ids) // 3}):
            cut = encode_conversation(template, bpe_tokenizer, messages, train_on="all", cutoff=cutoff,
                                      truncation="turns")
            keep_source, keep_target = truncation_lengths(source, len(answer), cutoff)
            assert cut.truncated and len(cut.ids) <= cutoff
            trained = len(cut.ids) - next(i for i in range(len(cut.ids)) if cut.ids[i:].tolist()
                                          == answer[:len(cut.ids) - i].tolist() and cut.loss_mask[i:].all())
            assert trained >= keep_target
            went = cut.system_left_out
            start, first = 1 + cut.turns_dropped, int(not went)  # turns resume at start; the system message kept?
            kept = [*messages[:first], *messages[start:]]
            # the system messages from inside the conversation that went with the dropped turns are counted
            assert cut.system_dropped == sum(m.role == "system" for m in messages[1:start])
            notes_dropped += cut.system_dropped > 0
            if went:  # over half the share, not in gemma (folded into the first user turn: nothing to leave out)
                assert name != "gemma" and cut.system_cut
                assert system_turn_length(template, bpe_tokenizer, messages, whole.ids) > keep_source // 2
                left_out += 1
            if cut.mid_turn:  # only the last question was left, over the prompt's share
                assert start == resumption(messages, users[-1])
                assert len(encode_conversation(template, bpe_tokenizer, kept).ids) - len(answer) > keep_source
                inside += 1
                continue
            resumed = next(i for i in range(start, len(messages)) if messages[i].role != "system")
            assert cut.turns_dropped == 0 or (messages[resumed].role == "user" and
                                              start == resumption(messages, resumed))
            shorter = encode_conversation(template, bpe_tokenizer, kept, train_on="all")  # whole: no cut inside
            assert cut.ids.tolist() == shorter.ids[:len(cut.ids)].tolist()
            assert cut.loss_mask.tolist() == shorter.loss_mask[:len(cut.ids)].tolist()  # earlier answers trained
            assert len(shorter.ids) - len(answer) <= keep_source
            earlier = [i for i in users if first < i < start]
            if earlier:  # one turn more would not fit the prompt's share
                longer = encode_conversation(template, bpe_tokenizer,
                                             [*messages[:first], *messages[resumption(messages, earlier[-1]):]])
                assert len(longer.ids) - len(answer) > keep_source
            whole_turns += cut.turns_dropped > 0
    assert whole_turns >= 5 and inside >= 1 and notes_dropped >= 1, (whole_turns, inside, notes_dropped)
    assert left_out == 0, left_out  # as in cut_prompt's test: never in these templates


def test_the_fixtures_hold_the_shapes_users_bring():
    keys = {case["key"] for case in EXPORTS}
    assert {case["template"] for case in EXPORTS} == {"qwen", "llama3", "gemma"}
    mid = [c for c in EXPORTS if [m["role"] for m in c["messages"]][1:].count("system")]
    assert {c["key"] for c in mid} >= {"camrest-train-0-turn-5", "crosswoz-11290-turn-7"}
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in c["messages"][-1]["content"]) for c in EXPORTS)
    assert "camrest-train-2-turn-4" in keys  # developer role and content-part lists
    assert all(c["messages"][0]["role"] == "system" for c in EXPORTS)


def test_the_system_message_is_the_system_prompt_and_composes_with_the_profile(export_run):
    _, records = export_run
    record = records["camrest-train-0-turn-5"]  # system, user, assistant, system (mid), user -> assistant
    goal = camrest_goal(camrest_dialogues(1)[0])
    profile = profile_prompt(record, "context")
    keep = record_messages(record, "context")
    assert [m.role for m in keep] == ["system", "user", "assistant", "system", "user", "assistant"]
    assert keep[0].content == f"{goal[0]}\n\n{profile}" == system_prompt(record, "context")
    assert keep[3] == Message("system", goal[-1])
    assert not any(m.role == "assistant" and goal[0] in m.content for m in keep)
    replace = record_messages(record, "context", system="replace")
    assert replace[0].content == profile and replace[3] == Message("system", goal[-1])
    drop = record_messages(record, "context", system="drop")
    assert [m.role for m in drop] == ["system", "user", "assistant", "user", "assistant"] and drop[0].content == profile
    # With no profile and the source's text replaced, a Qwen template writes its own default prompt.
    bare = record_messages(record, "none", system="replace")
    assert bare[0].role == "user"
    assert get_template("qwen").render(bare).startswith("<|im_start|>system\nYou are Qwen")
    with pytest.raises(ChatTemplateError, match="system mode 'merge'"):
        record_messages(record, "context", system="merge")


def test_gemma_folds_system_messages_into_user_turns_never_into_assistant_turns():
    messages = [Message("system", "a"), Message("user", "b"), Message("assistant", "c"), Message("system", "d"),
                Message("user", "e"), Message("system", "f"), Message("assistant", "g")]
    assert fold_system(messages) == [(1, Message("user", "a\n\nb")), (2, Message("assistant", "c")),
                                     (4, Message("user", "d\n\ne\n\nf")), (6, Message("assistant", "g"))]
    text = get_template("gemma").render(messages)
    assert text == ("<bos><start_of_turn>user\na\n\nb<end_of_turn>\n<start_of_turn>model\nc<end_of_turn>\n"
                    "<start_of_turn>user\nd\n\ne\n\nf<end_of_turn>\n<start_of_turn>model\ng<end_of_turn>\n")
    # a note between two replies (prepare's record of the second) has no user turn to close: a user turn of its own
    between = [Message("user", "a"), Message("assistant", "b"), Message("system", "c"), Message("assistant", "d")]
    assert fold_system(between) == [(0, Message("user", "a")), (1, Message("assistant", "b")),
                                    (2, Message("user", "c")), (3, Message("assistant", "d"))]
    assert get_template("gemma").render(between).count("<start_of_turn>user\nc<end_of_turn>") == 1


def test_prepare_reads_the_export_with_format_and_path_only(export_run):
    manifest, records = export_run
    source = manifest["sources"][0]
    assert source["system_messages"] == {"system_prompt": len(records), "system_turn_in_history": 3}
    assert source["dropped"] == {"tool_call": 1, "after_tool_call": 2}
    assert {r.family for r in records.values()} == {"assistant"} and {r.style for r in records.values()} == {
        "assistant_like"}
    tracks = {k: r.track for k, r in records.items()}
    assert tracks["camrest-train-1-turn-2"] == "single" and tracks["camrest-train-3-turn-8"] == "multi"
    assert {k: r.language for k, r in records.items() if k.startswith("crosswoz")} == {
        k: "zh" for k in records if k.startswith("crosswoz")}
    assert {r.language for k, r in records.items() if k.startswith("camrest")} == {"en"}


def test_trl_prompt_completion_rows_read_as_the_conversation_they_hold(tmp_path):
    """TRL's SFT rows, conversational ({"prompt": messages, "completion": [reply]}) and standard (strings),
    make the records the same conversation as `messages` makes: the same ids, histories, system prompts,
    questions and replies."""
    conversations, completions, strings = [], [], []
    for row in openai_rows():
        last = max(k for k, m in enumerate(row["messages"]) if m["role"] == "assistant")
        conversations.append({"id": row["id"], "messages": row["messages"][:last + 1]})
        completions.append({"id": row["id"], "prompt": row["messages"][:last], "completion": [row["messages"][last]]})
        user = next(m for m in row["messages"] if m["role"] == "user")
        reply = next(m for m in row["messages"] if m["role"] == "assistant")
        if isinstance(user["content"], str):  # the standard form holds text, not content parts
            strings.append({"id": f"{row['id']}-first", "prompt": user["content"], "completion": reply["content"]})

    def records(rows, name):
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
        config = write_config(tmp_path / f"{name}.yaml", [{"name": "export", "format": "chat", "path": f"{name}.jsonl",
                                                          "split": "train", "language": None}], dedup=False)
        prepare(config, tmp_path / name, progress=False)
        return [{k: v for k, v in r.to_json().items() if k != "meta"}
                for r in read_records(tmp_path / name / "data" / "train.jsonl")]

    expected = records(conversations, "messages")
    assert len(expected) > len(conversations)  # multi-turn rows make a record per reply
    assert records(completions, "completions") == expected
    firsts = records(strings, "strings")
    assert len(strings) > 4 and [(r["question"], r["response"], r["history"]) for r in firsts] == [
        (normalize(s["prompt"]), normalize(s["completion"]), []) for s in strings]


def test_sharegpt_system_field_is_the_system_prompt(tmp_path):
    path = tmp_path / "share.json"
    path.write_text(json.dumps(sharegpt_rows(), ensure_ascii=False), encoding="utf-8")
    config = write_config(tmp_path / "data.yaml", [{"name": "share", "format": "sharegpt", "path": "share.json"}])
    prepare(config, tmp_path / "run", progress=False)
    records = [r for s in ("train", "val", "test") for r in read_records(tmp_path / "run" / "data" / f"{s}.jsonl")]
    rows = sharegpt_rows()
    assert len(records) == 2 * len(rows)
    for record in records:
        assert record.history[0]["role"] == "system"
        messages = record_messages(record, "context")
        assert messages[0].role == "system" and messages[0].content.startswith(record.history[0]["text"])
        assert [m.role for m in messages[1:]][::2] == ["user"] * (len(messages[1:]) // 2)


def test_sharegpt_rows_with_role_and_content_keys_read_as_with_from_and_value(tmp_path):
    """Some ShareGPT exports write `role`/`content` in `conversations`: the same conversations so written make
    the same records (a row of them was malformed: "turn 1: role must be a string, got null")."""
    rows = sharegpt_rows()
    names = {"human": "user", "gpt": "assistant"}
    renamed = [{**row, "conversations": [{"role": names.get(t["from"], t["from"]), "content": t["value"]}
                                         for t in row["conversations"]]} for row in rows]
    made = []
    for name, written in (("from", rows), ("role", renamed)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "share.json").write_text(json.dumps(written, ensure_ascii=False), encoding="utf-8")
        config = write_config(folder / "data.yaml", [{"name": "share", "format": "sharegpt", "path": "share.json"}])
        assert prepare(config, folder / "run", progress=False)["quarantine"]["records"] == 0
        made.append({r.id: (r.question, r.response, r.history, r.bucket_id) for s in ("train", "val", "test")
                     for r in read_records(folder / "run" / "data" / f"{s}.jsonl")})
    assert made[0] == made[1] and len(made[0]) == 2 * len(rows)


def system_everywhere_rows() -> list[dict]:
    """OpenAI rows with system messages wherever a conversation can hold one: none opening it, one
    between a question and its reply (first turn and later), two in a row, one after a reply; English
    (CamRest676 goals) and Chinese (CrossWOZ task descriptions)."""
    rows = []
    for i, dialogue in enumerate(camrest_dialogues(3, start=20)):
        goal, body = camrest_goal(dialogue), camrest_messages(dialogue, 6)
        system = [{"role": "system", "content": text} for text in goal]
        if i == 0:  # user, system, assistant, ...: no opening system message
            messages = [body[0], system[0], *body[1:]]
        elif i == 2:  # a note between two replies: the second goes on from the first, which it keeps
            messages = [body[0], body[1], system[0], body[3], *body[4:]]
        else:  # opening, two between the second question and its reply, one after a reply
            messages = [system[0], *body[:3], *system[1:3], *body[3:4], system[-1], *body[4:]]
        rows.append({"id": f"everywhere-{dialogue['dialogue_id']}", "messages": messages})
    # one between the first question and its reply, one between the third question and its reply
    dialogue_id, dialogue = next((k, d) for k, d in crosswoz_dialogues(20, start=3) if len(crosswoz_tasks(d)) >= 3)
    tasks, body = crosswoz_tasks(dialogue), crosswoz_messages(dialogue, 6)
    messages = [{"role": "system", "content": tasks[0]}, body[0], {"role": "system", "content": tasks[1]},
                *body[1:5], {"role": "system", "content": tasks[-1]}, body[5]]
    rows.append({"id": f"everywhere-crosswoz-{dialogue_id}", "messages": messages})
    return rows


@pytest.mark.parametrize("system", ["keep", "replace", "drop"])
def test_training_renders_every_reply_as_serving_renders_the_conversation_before_it(tmp_path, system):
    """The invariant between training and serving: for every record prepare makes of an export, its
    messages are what `serve` (and the exported template, test_export.py) makes of the conversation as
    the user holds it up to that reply, with the same profile prompt and system mode, and then the
    reply; and what the exported chat template renders from the messages as sent (a `developer` role,
    content-part lists). System messages anywhere: opening, mid-way, between a question and its reply."""
    from polyalign.data.importers.reading import content_text
    from polyalign.data.text import normalize
    from polyalign.model.export import export_template
    from polyalign.tokens.chat import with_system_prompt
    from polyalign.tokens.chat_jinja import JinjaRenderer

    rows = openai_rows() + system_everywhere_rows()
    write_jsonl(tmp_path / "chats.jsonl", rows)
    config = write_config(tmp_path / "data.yaml", [{"name": "chats", "format": "chat", "path": "chats.jsonl"}])
    manifest = prepare(config, tmp_path / "run", progress=False)
    records = [r for s in ("train", "val", "test") for r in read_records(tmp_path / "run" / "data" / f"{s}.jsonl")]
    assert manifest["sources"][0]["system_messages"]["system_turn_before_reply"] == 5
    by_id = {row["id"]: row["messages"] for row in rows}

    def message(m):  # as the user holds it (`developer` is a system role), with the texts normalised
        role = "system" if m["role"] == "developer" else m["role"]
        return Message(role, normalize(content_text(m["content"], "")[0]))

    def as_sent(m):  # the source message, its role, content parts and whitespace as they are
        return {"role": m["role"], "content": m["content"]}

    from polyalign.data.importers.reading import TEXT_PARTS
    from polyalign.tokens.profile_template import READ_MESSAGES_JINJA

    assert f"part['type'] in {list(TEXT_PARTS)}" in READ_MESSAGES_JINJA  # the parts prepare reads as text
    template = get_template("qwen")
    exported = JinjaRenderer(export_template(template, system, "context"), {})
    before_reply = sent_as_is = 0
    for record in records:
        source = by_id[record.meta["dialogue_id"]]
        held = [message(m) for m in source[:record.meta["turn"]]]
        before_reply += held[-1].role == "system"
        for profile in ("none", "context"):
            trained = record_messages(record, profile, system=system)
            assert trained[:-1] == with_system_prompt(held, profile_prompt(record, profile), system), record.id
            assert trained[-1] == message(source[record.meta["turn"]])
        # the exported template on the messages as sent (a developer role, content-part lists) with the
        # profile's variables renders what training rendered
        variables = {"family": record.family, "track": record.track, "style": record.style}
        exported.variables.update(variables)
        sent = [as_sent(m) for m in source[:record.meta["turn"]]]
        sent_as_is += any(m["role"] == "developer" or not isinstance(m["content"], str) for m in sent)
        expected = template.render(record_messages(record, "context", system=system)[:-1], add_generation_prompt=True)
        assert exported.render(sent, add_generation_prompt=True) == expected, record.id
    assert before_reply == 5 and sent_as_is >= 2
    texts = [m["content"] for row in rows for m in row["messages"] if isinstance(m["content"], str)]
    assert sum(t != t.strip() for t in texts) >= 5  # CamRest's utterances that end with a space
    assert sum("  " in t.strip() for t in texts) >= 1  # and runs of spaces inside them


def test_the_exported_template_normalises_every_text_as_prepare_does():
    """Property: for 2,000 texts of real English and Chinese words joined by random whitespace (spaces,
    tabs, CR LF, CR, blank lines, no-break and ideographic spaces), the exported template's reading of a
    message (READ_MESSAGES_JINJA, rendered as transformers renders it) equals data/text.py's normalize."""
    import random

    from polyalign.data.text import normalize
    from polyalign.tokens.chat_jinja import JinjaRenderer
    from polyalign.tokens.profile_template import READ_MESSAGES_JINJA

    words = [w for d in camrest_dialogues(3) for t in d["turns"] for w in t["utterance"].split()]
    words += [m["content"][:6] for _, d in crosswoz_dialogues(2) for m in d["messages"]]
    gaps = [" ", "  ", "\t", " \t ", "\n", "\r\n", "\r", "\n\n\n", " \n ", "\u00a0", "\u3000", "\n \n"]
    renderer = JinjaRenderer(READ_MESSAGES_JINJA + "{{ messages[0]['content'] }}|{{ messages[1]['content'] }}", {})
    rng = random.Random(0)
    for _ in range(2000):
        pieces = [rng.choice(gaps) if rng.random() < 0.3 else ""]
        for _ in range(rng.randint(0, 8)):
            pieces += [rng.choice(words), rng.choice(gaps)]
        text = "".join(pieces)
        parts = [{"type": "text", "text": text}, {"type": "input_text", "text": text[::-1]}]
        rendered = renderer.render([{"role": "developer", "content": text}, {"role": "user", "content": parts}])
        assert rendered == f"{normalize(text)}|{normalize(text + chr(10) + text[::-1])}", repr(text)


def test_a_first_data_config_names_everything_missing_at_once(tmp_path):
    from polyalign.core.yaml_config import ConfigError

    write_jsonl(tmp_path / "chats.jsonl", openai_rows()[:2])
    config = tmp_path / "data.yaml"
    config.write_text("sources:\n  - {format: chat}\n  - {name: b, path: chats.jsonl}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        prepare(config, tmp_path / "run", progress=False)
    message = str(error.value)
    for key in ("scheme", "sources[0].name", "sources[0].path", "sources[1].format"):
        assert key in message
    # a misspelt required key is named beside the key it stands for
    config.write_text("scheme: polyalign\nsource:\n  - {name: b, fromat: chat, path: chats.jsonl}\n")
    with pytest.raises(ConfigError, match=r"missing sources \(a list of \{name, format, path\}\) \('source' there: "
                                          r"a misspelling of sources\?\)"):
        prepare(config, tmp_path / "run", progress=False)
    config.write_text("scheme: polyalign\nsources:\n  - {name: b, fromat: chat, path: chats.jsonl}\n")
    with pytest.raises(ConfigError, match=r"missing sources\[0\]\.format \('fromat' there: a misspelling of format"):
        prepare(config, tmp_path / "run", progress=False)
    # the scheme shipped in the package, by name; family and style from the format's defaults
    config.write_text("scheme: polyalign\nsources:\n  - {name: chats, format: chat, path: chats.jsonl}\n")
    manifest = prepare(config, tmp_path / "run", progress=False)
    assert manifest["scheme"]["name"] == "polyalign" and manifest["totals"]["kept"] == 4
    assert manifest["scheme"]["path"].endswith("polyalign/buckets/polyalign.yaml")
    # every source under one folder that is not there (a config that expects ../shared beside the checkout):
    # each missing path, then the folder to put in place
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "data.yaml"
    config.write_text("scheme: polyalign\nsources:\n  - {name: a, format: chat, path: ../shared/data/en/a.jsonl}\n"
                      "  - {name: b, format: chat, path: ../shared/data/zh/b.jsonl}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as error:
        prepare(config, tmp_path / "run", progress=False)
    lines = str(error.value).splitlines()
    assert [line.endswith(": no such file or directory") for line in lines] == [True, True, False]
    assert lines[-1] == (f"none of the 2 sources is there: the paths are relative to {config}, so they are read under "
                         f"{tmp_path / 'shared/data'}, and {tmp_path / 'shared'} does not exist; put that folder there "
                         f"(a link will do: ln -s /path/to/shared {tmp_path / 'shared'}) or change the paths")


def _write_export(tmp_path, form: str, conversations: list[list[dict]]):
    """User/assistant conversations as an OpenAI chat export (chats.jsonl) or a ShareGPT file (share.json)."""
    if form == "chat":
        return write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in conversations])
    path = tmp_path / "share.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human" if m["role"] == "user" else "gpt",
                                                    "value": m["content"]} for m in c]} for c in conversations],
                               ensure_ascii=False), encoding="utf-8")
    return path


@pytest.mark.parametrize("form", ["chat", "sharegpt"])
def test_a_reply_before_any_question_is_counted_and_kept_as_context(form, tmp_path):
    """A conversation a bot opens with a greeting (CamRest dialogues less their first user turn): the greeting
    is no record (nothing asked for it) and was counted nowhere; it is counted under left_out and stays in the
    history of the replies after it."""
    from tests.chat_exports import camrest_messages

    dialogues = camrest_dialogues(3, start=30)
    conversations = [camrest_messages(dialogue, 6)[k:] for dialogue, k in zip(dialogues, (1, 0, 1))]
    path = _write_export(tmp_path, form, conversations)
    config = write_config(tmp_path / "data.yaml", [{"name": "mine", "format": form, "path": path.name}], dedup=False)
    prepare(config, tmp_path / "run", progress=False)
    source = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["sources"][0]
    assert source["left_out"] == {"reply_before_any_question": 2}
    asked = sum(sum(m["role"] == "assistant" for m in c) - (c[0]["role"] == "assistant") for c in conversations)
    assert source["kept"] == source["records"] == asked  # the replies after a question, each a record
    records = [r for split in ("train", "val", "test")
               for r in read_records(tmp_path / "run" / "data" / f"{split}.jsonl")]
    greeting = normalize(conversations[0][0]["content"])
    assert greeting not in {r.response for r in records}
    assert any(r.history and r.history[0] == {"role": "assistant", "text": greeting} for r in records)


def test_an_export_named_after_a_corpus_the_scheme_knows_is_told_it_takes_that_corpuss_labels(tmp_path, capsys):
    """A team's chat export of restaurant conversations named `camrest`: the scheme's entry for that name
    (CamRest676: multi-turn task dialogues) labels it, over the chat format's own defaults; prepare said
    nothing of it. It says so now, and a source that sets its labels, or another name, hears nothing."""
    from polyalign.cli import main
    from tests.chat_exports import camrest_messages

    path = _write_export(tmp_path, "chat", [camrest_messages(d, 4) for d in camrest_dialogues(3, start=50)])
    for name, extra, said in (("camrest", {}, True), ("camrest", {"family": "assistant", "style": "assistant_like",
                                                                  "track": "multi"}, False), ("bookings", {}, False)):
        config = write_config(tmp_path / "data.yaml", [{"name": name, "format": "chat", "path": path.name, **extra}])
        out = tmp_path / f"run-{name}-{bool(extra)}"
        assert main(["prepare", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
        source = json.loads((out / "data" / "manifest.json").read_text())["sources"][0]
        printed = capsys.readouterr().out
        assert ("scheme_entry_labels" in source) == said == ("the bucket scheme's entry for the name" in printed)
        if said:
            assert source["scheme_entry_labels"] == {"track": "multi", "family": "dialogue", "style": "task_dialogue"}
            assert ("note: source 'camrest': track multi, family dialogue and style task_dialogue come from the "
                    "bucket scheme's entry for the name 'camrest'") in printed


def test_a_first_reply_after_two_user_turns_is_multi_turn_and_not_said_to_be_single(tmp_path, capsys):
    """A conversation that opens with two user turns a system note stands between (user, system, user, reply,
    ...): its first reply has a user turn in its history, so its track is multi, and prepare's note that first
    replies read as single (and split a dialogue across buckets) does not count it."""
    from polyalign.cli import main
    from tests.chat_exports import camrest_messages

    conversations = []
    for dialogue in camrest_dialogues(3, start=40):
        messages = camrest_messages(dialogue, 4)
        conversations.append([{"role": "user", "content": dialogue["turns"][0]["utterance"]},
                              {"role": "system", "content": "The user may write twice before a reply."}, *messages])
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in conversations])
    config = write_config(tmp_path / "data.yaml", [{"name": "mine", "format": "chat", "path": path.name}], dedup=False)
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    records = [r for split in ("train", "val", "test")
               for r in read_records(tmp_path / "run" / "data" / f"{split}.jsonl")]
    assert len(records) == 2 * len(conversations) and {r.track for r in records} == {"multi"}
    source = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["sources"][0]
    assert "opening_replies" not in source and "first reply of a multi-turn" not in capsys.readouterr().out


@pytest.mark.parametrize("form", ["chat", "sharegpt"])
def test_a_conversation_ending_with_a_user_turn_counts_what_no_record_holds(form, tmp_path, capsys):
    """Every user turn is a record's question, lies in a record's history, or is counted: a conversation
    that ends with a user turn after its last reply says so in the manifest and in prepare's output."""
    from polyalign.cli import main
    from tests.chat_exports import camrest_messages

    conversations = [camrest_messages(dialogue, n) for dialogue, n in zip(camrest_dialogues(4, start=20), (3, 4, 5, 6))]
    path = _write_export(tmp_path, form, conversations)
    config = write_config(tmp_path / "data.yaml", [{"name": "mine", "format": form, "path": path.name}])
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    source = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["sources"][0]
    unanswered = sum(len(c) % 2 for c in conversations)  # user first, so an odd length ends with a user turn
    assert source["left_out"] == {"unanswered_last_user_turn": unanswered} and unanswered == 2
    assert source["kept"] == sum(len(c) // 2 for c in conversations)
    printed = capsys.readouterr().out
    assert f"left out of kept rows: unanswered_last_user_turn {unanswered}" in printed
    # and in the stats report's sources table, in words
    from polyalign.reports.stats import SOURCE_HEADER, _source_rows

    row = dict(zip(SOURCE_HEADER, _source_rows({"sources": [source]})[0]))
    assert row["left out of kept rows"] == f"a last user turn no one answered: {unanswered}"
    # CamRest dialogues, bucketed as assistant chats since nothing named them otherwise: said, with the fix
    assert source["label_defaults"] == {"family": source["records"], "style": source["records"]}
    assert (f"note: source 'mine': family assistant and style assistant_like are the {form} format's defaults, "
            f"taken by {source['records']} of its {source['records']} records as read, before drops and deduplication "
            "(no row, data config or scheme entry named them); set "
            "`family:` and `style:` on the source where its records are of another kind") in printed
    # each dialogue's first reply is single and the later ones multi, read off the conversation: said, with the fix
    opening = sum(len(c) // 2 > 1 for c in conversations)
    assert source["opening_replies"] == opening == 3
    assert (f"note: source 'mine': {opening} records are the first reply of a multi-turn conversation: read off the "
            "conversation, their track is single (no earlier turn) and the later replies' multi, so each dialogue "
            "spans two buckets; set `track: multi` on the source") in printed
    config = write_config(tmp_path / "named.yaml", [{"name": "mine", "format": form, "path": path.name,
                                                     "family": "dialogue", "style": "task_dialogue", "track": "multi"}])
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "named"), "--no-progress"]) == 0
    assert "note: source" not in capsys.readouterr().out
    source = json.loads((tmp_path / "named" / "data" / "manifest.json").read_text())["sources"][0]
    assert "label_defaults" not in source and "opening_replies" not in source
    # a scheme whose buckets have no track: the first reply shares its dialogue's bucket, so nothing to say
    import yaml

    from tests.conftest import SCHEME

    scheme = yaml.safe_load(SCHEME.read_text())
    scheme["dimensions"] = [d for d in scheme["dimensions"] if d != "track"]
    (tmp_path / "no_track.yaml").write_text(yaml.safe_dump(scheme, allow_unicode=True))
    config = write_config(tmp_path / "untracked.yaml", [{"name": "mine", "format": form, "path": path.name}])
    config.write_text(config.read_text().replace(str(SCHEME), str(tmp_path / "no_track.yaml")))
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "untracked"), "--no-progress"]) == 0
    assert "first reply of a multi-turn" not in capsys.readouterr().out


def test_a_turns_build_counts_and_shows_the_system_messages_its_whole_turns_took(tmp_path):
    """Operator notes in the middle of an OpenAI export's conversations: a `--truncation turns` build that
    drops them with their turns counts those examples in the manifest and on its split line, and `show`
    names them in its cut line (only the opening system message was counted before)."""
    import argparse

    from polyalign.cli import _split_line
    from polyalign.inputs.build import build, encode_for_build
    from polyalign.inputs.built import BuildOptions
    from polyalign.inputs.show import show_examples
    from polyalign.tokens.tokenizer import load_tokenizer

    rows = openai_rows()
    write_jsonl(tmp_path / "chats.jsonl", rows[:-1])
    write_jsonl(tmp_path / "held.jsonl", rows[-1:])
    config = write_config(tmp_path / "data.yaml", [
        {"name": "chats", "format": "chat", "path": "chats.jsonl", "split": "train"},
        {"name": "held", "format": "chat", "path": "held.jsonl", "split": "val"}])
    prepare(config, tmp_path / "run", progress=False)
    texts = [m["content"] for case in EXPORTS for m in case["messages"]]
    (tmp_path / "bpe").mkdir()
    tokenizer_dir = write_bpe_tokenizer(texts, 600, tmp_path / "bpe", {"eos_token": "<eos>"})
    options = BuildOptions(tokenizer=str(tokenizer_dir), template="polyalign", max_length=96, truncation="turns")
    manifest = build(tmp_path / "run", options, progress=False)
    tokenizer, template = load_tokenizer(tokenizer_dir), get_template("polyalign")
    train = list(read_records(tmp_path / "run" / "data" / "train.jsonl"))
    encoded = {r.id: encode_for_build(r, tokenizer, template, options)[1] for r in train}
    took_notes = [record_id for record_id, e in encoded.items() if e.system_dropped]
    counts = manifest["splits"]["train"]
    assert counts["system_dropped"] == len(took_notes) >= 1
    line = _split_line("train", counts, argparse.Namespace(max_length=96, system="keep", truncation="turns",
                                                            train_on="last"))
    assert (f"{counts['turns_dropped']} lost whole turns, {len(took_notes)} of them a system message from inside "
            "the conversation with those turns") in line
    (shown,) = show_examples(tmp_path / "run", ids=[took_notes[0]])
    notes = encoded[took_notes[0]].system_dropped
    assert (f"lost its {encoded[took_notes[0]].turns_dropped} oldest of " in shown
            and f"earlier messages ({notes} of them system messages from inside the conversation)" in shown)
    # a system message over half of the prompt's share, left out whole, is counted and said so
    left_out = [record_id for record_id, e in encoded.items() if e.system_left_out]
    assert counts["system_left_out"] == len(left_out) >= 1
    assert f"({len(left_out)} left out whole, rather than keep its last tokens)" in line
    (shown,) = show_examples(tmp_path / "run", ids=left_out[:1])
    assert "left out its opening system message whole (over half of the prompt's share)" in shown



def test_the_stats_report_quotes_the_opening_system_prompts_it_read(tmp_path):
    """A team checks its system prompt was read as one: the statistics count the records that open with a
    system prompt, how many different ones, and quote the most common (it said only "an opening system
    prompt: 1347"). A system note between a question and its reply opens no conversation and is not counted."""
    from polyalign.reports.stats import compute_stats

    rows = openai_rows()
    # a conversation with no opening system prompt, a note before its first reply (given split: test, so it
    # cannot fall out as a duplicate of its source conversation)
    first_reply = next(k for k, m in enumerate(rows[0]["messages"]) if m["role"] == "assistant")
    noted = rows[0]["messages"][1:first_reply] + [{"role": "system", "content": "Answer in one sentence."}] + \
        rows[0]["messages"][first_reply:first_reply + 1]
    write_jsonl(tmp_path / "chats.jsonl", rows)
    write_jsonl(tmp_path / "noted.jsonl", [{"messages": noted}])
    config = write_config(tmp_path / "data.yaml", [{"name": "chats", "format": "chat", "path": "chats.jsonl"},
                                                   {"name": "noted", "format": "chat", "path": "noted.jsonl",
                                                    "split": "test"}], dedup=False)
    prepare(config, tmp_path / "run", progress=False)
    stats = compute_stats(tmp_path / "run", progress=False)
    prompts = stats["counts"]["system_prompts"]
    opening = {row["messages"][0]["content"] for row in rows}  # every conversation opens with its own
    assert prompts["records"] == stats["total"] - 1 and prompts["distinct"] == len(opening) == len(rows)
    assert len(prompts["most_common"]) == 3 and all(p["text"] in opening for p in prompts["most_common"])
    assert sum(p["records"] for p in prompts["most_common"]) <= prompts["records"]
    top = prompts["most_common"][0]
    said = (tmp_path / "run" / "stats" / "report.md").read_text(encoding="utf-8")
    assert (f"- opening system prompts: {prompts['records']} records open with one, {len(rows)} different "
            f"({top['records']} records: «{top['text']}»") in said
    assert f"; and {len(rows) - 3} more); build keeps each and adds polyalign's profile prompt" in said


def test_mojibake_is_counted_marked_and_repaired_on_request(tmp_path, capsys):
    """An export whose Chinese conversations went through a Windows-1252 reading on the way ("ä½ å¥½" for
    "你好", as a spreadsheet round trip leaves them): prepare counts every record holding some, marks it
    (meta.mojibake) and warns with the fix; with `fix_encoding: true` on the source its records are those of
    the export as it was written, mark aside, and its English conversations are never touched."""
    import ftfy.bad_codecs  # noqa: F401  registers sloppy-windows-1252, the codec such readings use

    from polyalign.cli import main

    def mojibake(message: dict) -> dict:
        content = message["content"]
        broken = content.encode("utf-8").decode("sloppy-windows-1252") if isinstance(content, str) else content
        return {**message, "content": broken}

    clean = openai_rows()
    broken = [{**row, "messages": [mojibake(m) for m in row["messages"]]} if row["id"].startswith("crosswoz") else row
              for row in clean]
    assert broken != clean

    def records_of(rows, fix: bool | None, name: str):
        folder = tmp_path / name
        folder.mkdir()
        write_jsonl(folder / "chats.jsonl", rows)
        source = {"name": "chats", "format": "chat", "path": "chats.jsonl", **({"fix_encoding": fix} if fix else {})}
        assert main(["prepare", "--config", str(write_config(folder / "data.yaml", [source])), "--out",
                     str(folder / "run"), "--no-progress"]) == 0
        manifest = json.loads((folder / "run" / "data" / "manifest.json").read_text())
        records = {r.id: r for split in ("train", "val", "test")
                   for r in read_records(folder / "run" / "data" / f"{split}.jsonl")}
        return manifest["sources"][0], records, capsys.readouterr()

    _, expected, _ = records_of(clean, None, "clean")
    kept, as_read, said = records_of(broken, None, "kept")
    chinese = {i for i in expected if "crosswoz" in i}
    assert chinese and kept["mojibake"] == len(chinese)
    assert {i: r.meta.get("mojibake") for i, r in as_read.items()} == {
        i: "kept" if i in chinese else None for i in as_read}
    # read as it was broken, a reply's language is no longer Chinese: one is even dropped from the scheme's
    assert {as_read[i].language for i in chinese & set(as_read)} != {"zh"}
    assert set(expected) - set(as_read) == {next(iter(chinese - set(as_read)))} and any(
        reason.startswith("language_not_in_scheme") for reason in kept["dropped"])
    assert (f"warning: source 'chats': {len(chinese)} records held mojibake (UTF-8 text read as Windows-1252: "
            "\"1944â€“46\" for \"1944–46\"), kept as read (meta.mojibake \"kept\" marks them); set `fix_encoding: "
            "true` on the source to repair them") in said.err.splitlines()
    # the statistics report says it too: the buckets it shows hold those records
    assert main(["stats", str(tmp_path / "kept" / "run"), "--no-progress"]) == 0
    report = (tmp_path / "kept" / "run" / "stats" / "report.md").read_text()
    assert f"- warning: source 'chats': {len(chinese)} records held mojibake (UTF-8 text read as" in report
    capsys.readouterr()
    fixed, repaired, said = records_of(broken, True, "fixed")
    assert fixed["mojibake"] == len(chinese) and fixed["fix_encoding"] is True
    assert "(fix_encoding; meta.mojibake \"repaired\" marks them)" in said.out

    def content(record):
        return (record.language, record.bucket_id, record.question, record.context, record.history, record.response)

    assert {i: content(r) for i, r in repaired.items()} == {i: content(r) for i, r in expected.items()}
    assert {i for i, r in repaired.items() if r.meta.get("mojibake") == "repaired"} == chinese
    # a reading that replaced the bytes it could not decode (errors="replace") lost characters: the repair gets back
    # the rest, and says which records still hold U+FFFD rather than calling them repaired
    lossy = [{**row, "messages": [{**m, "content": m["content"].encode("utf-8").decode("cp1252", errors="replace")}
                                  for m in row["messages"]]} if row["id"].startswith("crosswoz") else row
             for row in clean]
    source, partly, said = records_of(lossy, True, "lossy")
    lost = {i for i, r in partly.items() if r.meta.get("mojibake") == "partly repaired"}
    assert lost and lost <= chinese and source["mojibake_lost"] == len(lost)
    assert all("\ufffd" in partly[i].response + partly[i].question + "".join(t["text"] for t in partly[i].history)
               for i in lost)
    assert (f"; {len(lost)} of them still hold U+FFFD (�) where characters were lost before polyalign read them"
            in said.out)
    # a U+FFFD the export had anyway, in a text the repair did not touch (an English system message), is no loss
    # of the repair's
    english = camrest_goal(camrest_dialogues(1)[0])[0] + " \ufffd"
    marked = [{**row, "messages": [{**m, "content": english} if m["role"] == "system" else m
                                   for m in row["messages"]]} if row["id"].startswith("crosswoz") else row
              for row in broken]
    source, whole, _ = records_of(marked, True, "marked")
    assert "mojibake_lost" not in source and {r.meta.get("mojibake") for i, r in whole.items() if i in chinese} == {
        "repaired"}


def test_a_folder_source_names_the_files_its_format_does_not_read(tmp_path, capsys):
    """A zip of the same exports (or a .csv) beside the files a folder source reads was skipped without a word,
    though the same zip given as the path is refused by name: every file of the folder its format does not read
    is listed in the manifest and said, documentation and hidden files aside."""
    import zipfile

    from polyalign.cli import main

    folder = tmp_path / "exports"
    (folder / "2025").mkdir(parents=True)
    rows = openai_rows()
    write_jsonl(folder / "chats.jsonl", rows[:3])
    write_jsonl(folder / "2025" / "more.jsonl", rows[3:])
    with zipfile.ZipFile(folder / "2025" / "exports.zip", "w") as archive:
        archive.write(folder / "chats.jsonl", "chats.jsonl")
    (folder / "notes.csv").write_text("id,comment\n1,ok\n")
    (folder / "README.md").write_text("what these are")
    (folder / ".DS_Store").write_bytes(b"\0")
    (folder / "__MACOSX").mkdir()  # what a Mac's zip adds: AppleDouble copies, not JSON
    (folder / "__MACOSX" / "._chats.jsonl").write_bytes(b"\0\5\26\7\0\2\0\0Mac OS X")
    (folder / "._chats.jsonl").write_bytes(b"\0\5\26\7\0\2\0\0Mac OS X")
    config = write_config(tmp_path / "data.yaml", [{"name": "chats", "format": "chat", "path": "exports"}])
    assert main(["prepare", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    source = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["sources"][0]
    assert source["unread_files"] == ["2025/exports.zip", "notes.csv"] and len(source["files"]) == 2
    assert ("note: source 'chats': 2 files in its folder are not read (chat reads *.jsonl, *.json): 2025/exports.zip, "
            "notes.csv; unpack an archive into the folder, and give files of another format a source of their own"
            ) in capsys.readouterr().out.splitlines()
