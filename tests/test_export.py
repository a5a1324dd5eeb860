"""Exports other tools load as they are: weights in the training dtype, sharded with an index, the
generation config, a tokenizer.json equivalent to polyalign's SentencePiece model, and a chat template
that renders what training rendered, profile system prompt included."""

import json

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from polyalign.core.errors import ChatTemplateError
from polyalign.data.records import read_records
from polyalign.model import create_model, load_hf_checkpoint
from polyalign.model.export import export_checkpoint
from polyalign.model.presets import preset
from polyalign.tokens.chat import Message, as_dicts, encode_conversation, get_template, record_messages
from polyalign.tokens.chat_jinja import JinjaRenderer
from polyalign.tokens.tokenizer import JsonTokenizer, load_tokenizer
from polyalign.tokens.tokenizer_training import record_texts
from tests.conftest import FIXTURES


def tiny_model(vocab_size):
    return create_model(preset("tiny", vocab_size=vocab_size, num_layers=2, hidden_size=64, num_heads=4,
                               num_kv_heads=2, head_dim=16, intermediate_size=128))


@pytest.fixture(scope="module")
def sentencepiece_export(demo_tokenizer, tmp_path_factory):
    tokenizer = demo_tokenizer[0]
    model = tiny_model(tokenizer.vocab_size)
    out = tmp_path_factory.mktemp("export") / "model"
    # A shard limit under the model's size: the export is sharded with an index, as a 7B one would be.
    export_checkpoint(model, tokenizer, out, template=get_template("polyalign"), profile="context", dtype="bfloat16",
                      card={"method": "sft", "steps": 2}, max_shard_bytes=600_000)
    return model, tokenizer, out


def test_weights_are_in_the_training_dtype_and_sharded_with_an_index(sentencepiece_export):
    model, _, out = sentencepiece_export
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out / shards[0]), "np") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    loaded = load_hf_checkpoint(out)
    ours = nnx.to_flat_state(nnx.state(model, nnx.Param))
    theirs = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    for path, value in ours:
        expected = np.asarray(value.get_value()).astype(ml_dtypes.bfloat16).astype(np.float32)
        assert np.array_equal(np.asarray(theirs[path].get_value(), np.float32), expected), path


def test_generation_stops_at_end_of_turn_and_eos(sentencepiece_export):
    _, tokenizer, out = sentencepiece_export
    config = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == sorted([tokenizer.special_id("<|im_end|>"), tokenizer.eos_id])
    assert config["bos_token_id"] == tokenizer.bos_id and config["do_sample"] is False


def test_the_exported_tokenizer_json_encodes_as_the_sentencepiece_model(sentencepiece_export, demo_run):
    _, tokenizer, out = sentencepiece_export
    fast = JsonTokenizer(out / "tokenizer.json")
    run, _, _ = demo_run
    texts = list(record_texts(read_records(run / "data" / "test.jsonl")))
    ours, theirs = tokenizer.encode_batch(texts), fast.encode_batch(texts)
    same = sum(a == b for a, b in zip(ours, theirs))
    # Viterbi ties aside (3 of 83,672 train-split texts differ by one split, e.g. c|um vs cu|m), the
    # same ids; decoding gives the text back exactly.
    assert same >= 0.999 * len(texts), f"{len(texts) - same} of {len(texts)} texts tokenised differently"
    assert all(fast.decode(ids) == text for ids, text in zip(theirs[:300], texts[:300]))
    for token in ("<s>", "</s>", "<|im_start|>", "<|im_end|>"):
        assert fast.token_to_id(token) == tokenizer.token_to_id(token)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == "</s>"
    assert (out / "tokenizer.model").read_bytes() == tokenizer.path.read_bytes()


def test_polyalign_reads_the_sentencepiece_model_of_its_own_export(sentencepiece_export):
    """An export holds tokenizer.model and its tokenizer.json conversion; polyalign (training on from
    the export, generating with it) reads the model the run trained with, transformers the JSON."""
    from polyalign.tokens.tokenizer import SentencePieceTokenizer, load_tokenizer

    _, _, out = sentencepiece_export
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["polyalign_tokenizer"] == "tokenizer.model" and (out / "tokenizer.json").is_file()
    assert isinstance(load_tokenizer(out), SentencePieceTokenizer)


@pytest.mark.parametrize("profile", ["context", "oracle", "none"])
def test_the_exported_chat_template_renders_what_training_rendered(sentencepiece_export, demo_run, profile):
    """The template in tokenizer_config.json, rendered as transformers renders it, with the profile's
    variables and no system message, gives polyalign's rendering with the profile system prompt."""
    from polyalign.model import export

    _, tokenizer, out = sentencepiece_export
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["polyalign_chat_template"] == "polyalign" and config["polyalign_profile"] == "context"
    template = get_template("polyalign")
    # the export's own template (context), or the one an export trained with the other profile carries
    source = config["chat_template"] if profile == "context" else export.export_template(template, "keep", profile)
    renderer = JinjaRenderer(source, tokenizer.template_tokens())
    run, _, _ = demo_run
    for record in read_records(run / "data" / "test.jsonl")[:40]:
        variables = {"family": record.family, "track": record.track, "style": record.style}
        if profile == "oracle":
            variables["length"] = record.length_bin
        conversation = as_dicts(record_messages(record, "none"))
        expected = template.render(record_messages(record, profile)[:-1], add_generation_prompt=True)
        given = variables if profile != "none" else {}
        renderer.variables.update(given)
        assert renderer.render(conversation[:-1], add_generation_prompt=True) == expected
        for key in given:
            del renderer.variables[key]
    card = (out / "README.md").read_text()
    assert "profile `context`" in card and 'family="...", track="...", style="..."' in card
    assert "| steps | 2 |" in card


def test_the_card_says_the_one_track_the_training_data_held():
    """A build whose data config set `track: multi` on every source held no `single` example, and the exported
    template refuses a value training never held: the card says to name `multi` for every turn instead of
    how polyalign labels tracks; with both tracks held it says how they are labelled."""
    from polyalign.model.export import model_card

    held = {"family": ["dialogue"], "style": ["task_dialogue"]}
    one = model_card({}, get_template("polyalign"), "context", values={**held, "track": ["multi"]})
    assert ('`track` was `multi` in every training example (a data source set it): pass track="multi" for every '
            "turn, the first question's too") in one and "`single` for its first question" not in one
    both = model_card({}, get_template("polyalign"), "context", values={**held, "track": ["multi", "single"]})
    assert "`track` is `multi` when the conversation has an earlier user or assistant turn" in both


def test_the_card_and_a_refusal_name_every_combination_the_training_data_held():
    """The profile's values are not independent (a dialogue's turns are all multi-turn in the demo): a client
    told "each value held, never together" needs the combinations, so the card lists them all, most common
    first, and a refusal names up to 12, then says where the rest are (it said "and 2 more", no more)."""
    from polyalign.model.export import model_card
    from polyalign.tokens.profile_template import PROFILE_COMBINATIONS, unseen_combination_text

    together = [{"family": "dialogue", "track": "multi", "style": "task_dialogue"},
                {"family": "assistant", "track": "single", "style": "assistant_like"},
                {"family": "qa", "track": "single", "style": "qa_search"},
                {"family": "qa", "track": "multi", "style": "qa_search"},
                {"family": "dialogue", "track": "multi", "style": "open_chat"},
                {"family": "assistant", "track": "multi", "style": "assistant_like"}]
    values = {"family": ["assistant", "dialogue", "qa"], "track": ["multi", "single"],
              "style": ["assistant_like", "open_chat", "qa_search", "task_dialogue"], PROFILE_COMBINATIONS: together}
    card = model_card({}, get_template("polyalign"), "context", values=values)
    table = card[card.index("| family | track | style |"):].splitlines()
    assert table[2:2 + len(together)] == [f"| {c['family']} | {c['track']} | {c['style']} |" for c in together]
    asked = {"family": "dialogue", "track": "single", "style": "task_dialogue"}
    said = unseen_combination_text(asked, together)
    assert all(json.dumps(c) in said for c in together) and "more" not in said
    many = [{"family": f"f{i}", "track": "multi", "style": "s"} for i in range(14)]
    assert unseen_combination_text(asked, many).endswith(
        '{"family": "f11", "track": "multi", "style": "s"} and 2 more, which the model card and tokenizer_config.json '
        "(polyalign_profile_combinations) list)")


@pytest.mark.parametrize("profile", ["context", "oracle", "none"])
def test_the_exported_template_refuses_the_profiles_serve_refuses_and_changes_nothing_else(demo_run, profile):
    """For every set of template variables (each subset of the profile keys, each value one the training
    data held or a misspelling of one): the exported template raises exactly when `serve` refuses
    (profile_problem), naming what serve names, and otherwise renders what the template without the
    check renders. Values from the demo's records, as a build counts them."""
    import itertools

    from polyalign.model.export import export_template
    from polyalign.tokens.profile_template import (
        PROFILE_FIELDS,
        PROFILE_KEYS,
        profile_problem,
        seen_profile_values,
        trained_profile_text,
    )

    run, _, _ = demo_run
    records = read_records(run / "data" / "test.jsonl")[:200]
    held = {key: {getattr(r, field) for r in records} for key, field in PROFILE_FIELDS.items()}
    values = seen_profile_values(profile, held)
    template = get_template("polyalign")
    checked = JinjaRenderer(export_template(template, "keep", profile, values), {})
    unchecked = JinjaRenderer(export_template(template, "keep"), {})
    conversation = as_dicts(record_messages(records[0], "none"))[:-1]
    refused = passed = 0
    for size in range(len(PROFILE_KEYS) + 1):
        for keys in itertools.combinations(PROFILE_KEYS, size):
            # the record's own values, then each key in turn misspelled
            for wrong in (None, *keys):
                variables = {key: getattr(records[0], PROFILE_FIELDS[key]) + ("x" if key == wrong else "")
                             for key in keys}
                problem = profile_problem(variables, profile, values)
                checked.variables.update(variables)
                unchecked.variables.update(variables)
                if problem is None:
                    passed += 1
                    assert checked.render(conversation, True) == unchecked.render(conversation, True)
                else:
                    refused += 1
                    with pytest.raises(ChatTemplateError) as refusal:
                        checked.render(conversation, True)
                    if "training data" in problem:
                        assert problem in str(refusal.value)
                    else:
                        assert trained_profile_text(profile) in str(refusal.value)
                for key in keys:
                    del checked.variables[key], unchecked.variables[key]
    wanted = {"context": 3, "oracle": 4, "none": 0}[profile]
    assert passed == (2 if wanted else 1)  # nothing named, and the whole profile with held values
    # messages that already hold the profile prompt (a `polyalign prompts` row's) naming it again: refused,
    # where the same messages alone render as they are
    from polyalign.tokens.profile_template import PROFILE_TWICE

    written = as_dicts(record_messages(records[0], "oracle" if profile == "oracle" else "context"))[:-1]
    whole = {key: getattr(records[0], PROFILE_FIELDS[key]) for key in PROFILE_KEYS[:wanted]} or {"family": "qa"}
    assert profile_problem(whole, profile, values, written) == PROFILE_TWICE
    checked.variables.update(whole)
    with pytest.raises(ChatTemplateError, match="already open with polyalign's profile prompt"):
        checked.render(written, True)
    for key in whole:
        del checked.variables[key]
    assert checked.render(written, True) == unchecked.render(written, True)
    assert refused == 2 ** len(PROFILE_KEYS) + len(PROFILE_KEYS) * 2 ** (len(PROFILE_KEYS) - 1) - passed


def _with_system_turns(record, other, shape: str):
    """`record` with system turns from `other`'s real text: `shape` none, one or two opening the
    conversation, one in the middle of its history, one between two user turns (`between`), or no
    system turn but two user turns in a row (`doubled`)."""
    import dataclasses

    texts = [other.question, other.response]
    history = list(record.history)
    if shape == "middle":
        history.insert(len(history) // 2, {"role": "system", "text": texts[0]})
        return dataclasses.replace(record, history=history)
    if shape in ("between", "doubled"):
        # the record's question follows: user, (system,) user
        extra = [{"role": "user", "text": texts[0]}]
        if shape == "between":
            extra.append({"role": "system", "text": texts[1]})
        return dataclasses.replace(record, history=history + extra)
    leading = [{"role": "system", "text": t} for t in texts[:{"none": 0, "one": 1, "two": 2}[shape]]]
    return dataclasses.replace(record, history=leading + history)


@pytest.mark.parametrize("name", ["polyalign", "qwen", "llama3", "gemma", "checkpoint gemma2"])
def test_every_system_mode_and_profile_renders_a_users_system_messages_as_training_did(demo_run, demo_tokenizer, name):
    """A user's conversation with its own system messages (none, one or two opening it, one mid-way, one
    between two user turns) or two user turns in a row, rendered by the exported template with the
    profile's variables, is what training rendered from the same conversation, for every system mode
    (keep, replace, drop) and profile. `checkpoint gemma2`: a checkpoint's own template that refuses
    system messages (Gemma 2's official one), whose export folds them into user turns as training did."""
    from polyalign.model.export import export_template
    from polyalign.tokens.chat import (
        PROFILE_MODES,
        SYSTEM_MODES,
        JinjaTemplate,
        profile_text,
        user_turn,
        with_system_prompt,
    )

    tokenizer = demo_tokenizer[0]
    if name == "checkpoint gemma2":
        template = JinjaTemplate((FIXTURES / "chat" / "templates" / "gemma2.jinja").read_text(encoding="utf-8"),
                                 tokenizer)
        assert not template.takes_system
    else:
        template = get_template(name)
    run, _, _ = demo_run
    records = read_records(run / "data" / "test.jsonl")[:24]
    shapes = ("none", "one", "two", "middle", "between", "doubled")
    refused = 0
    for system in SYSTEM_MODES:
        # the template's own BOS (a Llama or Gemma tokenizer's), as that tokenizer's config would give it
        # (a checkpoint's template renders the tokenizer's own)
        bos = {} if isinstance(template, JinjaTemplate) else {"bos_token": template.bos or ""}
        renderer = JinjaRenderer(export_template(template, system), {**tokenizer.template_tokens(), **bos})
        for profile in PROFILE_MODES:
            for i, record in enumerate(records):
                trained = _with_system_turns(record, records[-1 - i], shapes[i % len(shapes)])
                # the conversation as the user holds it: each turn its own message, in its own role
                conversation = [{"role": t["role"], "content": t["text"]} for t in trained.history]
                conversation = [m for m in conversation if m["role"] in ("system", "user", "assistant")]
                conversation.append({"role": "user", "content": user_turn(trained.question, trained.context)})
                variables = {} if profile == "none" else {"family": trained.family, "track": trained.track,
                                                          "style": trained.style}
                if profile == "oracle":
                    variables["length"] = trained.length_bin
                renderer.variables.update(variables)
                held = [Message(m["role"], m["content"]) for m in conversation]
                served = with_system_prompt(held, profile_text(variables), system)  # as `polyalign serve` does
                try:
                    expected = template.render(record_messages(trained, profile, system=system)[:-1],
                                               add_generation_prompt=True)
                except ChatTemplateError:
                    # Gemma folds a system message between two user turns into the second: training refuses
                    # the conversation (roles must alternate), and so do the export and serve
                    assert name in ("gemma", "checkpoint gemma2") and shapes[i % len(shapes)] == "between" \
                        and system != "drop"
                    refused += 1
                    for render in (lambda: renderer.render(conversation, add_generation_prompt=True),
                                   lambda: template.render(served, add_generation_prompt=True)):
                        with pytest.raises(ChatTemplateError, match="alternate"):
                            render()
                else:
                    assert renderer.render(conversation, add_generation_prompt=True) == expected, (system, profile, i)
                    assert template.render(served, add_generation_prompt=True) == expected, (system, profile, i)
                for key in variables:
                    del renderer.variables[key]
    assert refused == (2 * len(PROFILE_MODES) * len(records) // len(shapes) if "gemma" in name else 0)


def test_a_checkpoint_template_is_exported_as_it_trained(json_tokenizer, tmp_path):
    """A fine-tuned checkpoint's own template stays its template (behind the profile preamble), and
    generation stops at the end-of-turn token that template writes."""
    from tokenizers import Tokenizer

    source = (FIXTURES / "chat" / "templates" / "qwen3.jinja").read_text(encoding="utf-8")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    tok = Tokenizer.from_file(str(json_tokenizer.path))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": source}))
    tokenizer = load_tokenizer(folder)
    template = get_template("checkpoint", tokenizer)
    export_checkpoint(tiny_model(tokenizer.vocab_size), tokenizer, tmp_path / "out", template=template,
                      profile="none")
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["chat_template"].endswith(source) and "polyalign_chat_template" not in config
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == sorted(
        [tokenizer.special_id("<|im_end|>"), tokenizer.eos_id])
    exported = load_tokenizer(tmp_path / "out")
    again = get_template("checkpoint", exported)
    messages = [Message("user", "你好，我想去北京语言大学溜达。"), Message("assistant", "大概能玩2小时。")]
    assert again.render(messages) == template.render(messages)
    assert np.array_equal(encode_conversation(again, exported, messages).ids,
                          encode_conversation(template, tokenizer, messages).ids)


def test_an_exported_template_that_prints_the_date_prints_the_one_training_rendered(json_tokenizer, tmp_path):
    """A Llama 3.2 template prints today's date unless given date_string; training renders it with polyalign's
    fixed date, so the export pins that date for transformers and vLLM, which call strftime_now (every prompt
    read other ids than training's: 0 of 511 alike). A date the caller passes still wins."""
    from polyalign.tokens.chat_jinja import _environment

    source = (FIXTURES / "chat" / "templates" / "llama3_2_dated.jinja").read_text(encoding="utf-8")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(json_tokenizer.path.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                              "eos_token": "<|eot_id|>", "chat_template": source}))
    tokenizer = load_tokenizer(folder)
    template = get_template("checkpoint", tokenizer)
    export_checkpoint(tiny_model(tokenizer.vocab_size), tokenizer, tmp_path / "out", template=template,
                      profile="none")
    exported = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"]
    environment = _environment()  # transformers' own: sandboxed, strftime_now a global
    environment.globals["strftime_now"] = lambda format: "01 Jan 2031"
    messages = [Message("user", "今天天气怎么样？"), Message("assistant", "挺好的，出去走走吧。")]
    as_trained = template.render(messages)
    assert "Today Date: 26 Jul 2024" in as_trained
    for given in (source, exported):  # the checkpoint's own source drifts with the calendar; the export does not
        rendered = environment.from_string(given).render(messages=as_dicts(messages), add_generation_prompt=False,
                                                         bos_token="<|begin_of_text|>")
        assert (rendered == as_trained) is (given is exported)
    chosen = environment.from_string(exported).render(messages=as_dicts(messages), bos_token="<|begin_of_text|>",
                                                      date_string="05 May 2025")
    assert chosen == as_trained.replace("26 Jul 2024", "05 May 2025")
    # exported again (a model trained from the export), the pin is written once
    again = get_template("checkpoint", load_tokenizer(tmp_path / "out"))
    export_checkpoint(tiny_model(tokenizer.vocab_size), load_tokenizer(tmp_path / "out"), tmp_path / "out2",
                      template=again, profile="none")
    twice = json.loads((tmp_path / "out2" / "tokenizer_config.json").read_text())["chat_template"]
    assert twice == exported and exported.count("date_string is not defined %}{%- set") == 1


def test_a_full_disk_is_one_line_naming_the_file(monkeypatch, capsys, tmp_path):
    """An export (or any write) that meets a full disk, a quota or a read-only mount: one line naming the
    file, status 2, no traceback; other OS errors still surface as they are."""
    import errno
    import os

    from polyalign import cli

    target = str(tmp_path / "model" / "model-00001-of-00002.safetensors")

    def full_disk(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)

    monkeypatch.setattr(cli, "_run_train", full_disk)
    assert cli.main(["train", "sft", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and target in err and "no space left on device" in err and "run the same command" in err

    def other(args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cli, "_run_train", other)
    with pytest.raises(OSError, match="Input/output error"):
        cli.main(["train", "sft", "--out", str(tmp_path / "out")])


# Qwen2.5-7B-Instruct's generation_config.json sampling settings, as its model repository publishes them.
QWEN_SAMPLING = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def test_chained_exports_keep_the_base_generation_config_and_write_the_preamble_once(json_tokenizer, tmp_path):
    """SFT -> DPO -> DPO, each trained from the previous export: the base's eos list and sampling settings
    survive every export, and the chat template carries the profile preamble once."""
    from tokenizers import Tokenizer

    from polyalign.tokens.profile_template import PROFILE_PREAMBLES_JINJA, READ_MESSAGES_JINJA, profile_check_jinja

    source = (FIXTURES / "chat" / "templates" / "qwen3.jinja").read_text(encoding="utf-8")
    base = tmp_path / "base"
    base.mkdir()
    tok = Tokenizer.from_file(str(json_tokenizer.path))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": source}))
    first = load_tokenizer(base)
    eos = [first.special_id("<|im_end|>"), first.special_id("<eos>")]
    (base / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": first.special_id("<eos>"), "pad_token_id": first.special_id("<eos>"), **QWEN_SAMPLING,
         "eos_token_id": eos, "transformers_version": "4.37.0"}))
    messages = [Message("user", "你好，我想去北京语言大学溜达。"), Message("assistant", "大概能玩2小时。")]
    rendered = get_template("checkpoint", first).render(messages)
    previous = base
    for step in ("sft", "dpo", "dpo-again"):
        tokenizer = load_tokenizer(previous)
        template = get_template("checkpoint", tokenizer)
        export_checkpoint(tiny_model(tokenizer.vocab_size), tokenizer, tmp_path / step, template=template,
                          profile="context", base=str(previous))
        previous = tmp_path / step
        chat_template = json.loads((previous / "tokenizer_config.json").read_text())["chat_template"]
        assert sum(chat_template.count(p) for p in PROFILE_PREAMBLES_JINJA.values()) == 1
        assert chat_template.count("polyalign: profile check") == 1
        assert chat_template.startswith(profile_check_jinja("context") + READ_MESSAGES_JINJA
                                        + PROFILE_PREAMBLES_JINJA["keep"])
        assert chat_template.count("polyalign: messages read as training read them") == 1
        assert chat_template.endswith(source)
        generation = json.loads((previous / "generation_config.json").read_text())
        assert generation["eos_token_id"] == eos and "transformers_version" not in generation
        assert {key: generation[key] for key in QWEN_SAMPLING} == QWEN_SAMPLING
        assert get_template("checkpoint", load_tokenizer(previous)).render(messages) == rendered


def test_an_adapter_names_its_base_so_that_it_loads_from_any_folder(tmp_path, monkeypatch):
    from polyalign.model.architecture import LoraConfig
    from polyalign.model.export import export_adapter
    from polyalign.model.lora import add_adapters

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "sft" / "model").mkdir(parents=True)
    model = add_adapters(tiny_model(97), LoraConfig(rank=2))
    for given, recorded in [("runs/sft/model", str(tmp_path / "runs" / "sft" / "model")),
                            ("./runs/sft/../sft/model", str(tmp_path / "runs" / "sft" / "model")),
                            ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),  # a hub id, as given
                            ("gs://bucket/sft/model", "gs://bucket/sft/model")]:
        export_adapter(model, "out/adapter", base=given)
        config = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == recorded


def test_training_on_from_an_export_made_before_system_modes_keeps_one_preamble():
    """An init exported by an earlier polyalign (its preamble wrote the profile only without a system
    message): the new export replaces that preamble rather than stacking a second one before it."""
    from polyalign.model import export
    from polyalign.tokens import profile_template

    source = get_template("polyalign").jinja_source()

    class EarlierExport:
        name = "checkpoint"
        takes_system = True

        def jinja_source(self):
            return profile_template._LEGACY_PREAMBLE + source

    assert "namespace(parts=[])" in profile_template._LEGACY_PREAMBLE
    exported = export.export_template(EarlierExport(), "keep")
    assert exported == profile_template.READ_MESSAGES_JINJA + profile_template.PROFILE_PREAMBLES_JINJA["keep"] + source


def test_the_card_says_how_many_left_their_system_message_out_whole():
    """The model card's profile line counts, of the examples that lost the profile prompt to truncation, those
    whose cut left it out whole (over half of the prompt's share) rather than keep its last tokens."""
    from polyalign.model.export import profile_coverage

    said = profile_coverage({"examples": 3200, "system_cut": 160, "system_left_out": 160}, "turns")
    assert said == ("whole in 3040 of 3200 training examples; 160 lost it, whole or in part, to --truncation turns "
                    "(long conversations cut to fit; 160 of them left it out whole rather than keep its last tokens), "
                    "so the model also read conversations without it")
    assert "left it out whole" not in profile_coverage({"examples": 10, "system_cut": 2}, "left")
    assert profile_coverage({"examples": 10, "system_cut": 0, "system_left_out": 0}, "turns") == (
        "whole in all 10 training examples")
