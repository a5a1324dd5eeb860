"""Regenerates the test fixtures that need torch and transformers (development tools only; the tests
read the files this writes and import neither).

    pip install torch==2.13.0 transformers peft   # the local CPU build of torch; never an unpinned torch
    python tools/make_fixtures.py --chat-templates DIR

Writes, under tests/fixtures/:
  hf/{llama,qwen2,qwen3,gemma2,gemma3}/  a tiny random checkpoint (config.json + model.safetensors) that
                             transformers saved, and expected.safetensors: input ids, attention mask
                             and the float32 logits transformers computes for them.
  chat/fixtures.json         real records from the bundled demo data rendered by the official chat
                             templates through transformers' apply_chat_template.
  chat/exports.json          every record of a real-text chat export (tests/chat_exports.py: system
                             messages leading and mid-conversation, developer role, content parts)
                             rendered by the official templates through apply_chat_template.
  chat/jinja.json            real records rendered by the templates in chat/templates/ (Qwen3's reasoning
                             rules; a fine-tuned layout with {% generation %} blocks) through transformers:
                             the string, the generation prompt and the assistant spans.
  losses/trl_dpo.json        DPO, cDPO and IPO losses from TRL's formulas evaluated in torch.
  losses/trl_family.json     robust DPO, SimPO, ORPO, KTO and length-normalised DPO, likewise.
  peft/qwen2/                a LoRA adapter PEFT made on hf/qwen2 (adapter_config.json,
                             adapter_model.safetensors) and expected.safetensors: PEFT's logits.

DIR holds the official templates, copied from each model's tokenizer_config.json ("chat_template"):
qwen.jinja (Qwen2.5 Instruct), llama3.jinja (Llama 3.2 Instruct) and gemma.jinja (Gemma 2 Instruct).
Without --chat-templates the chat fixtures are left as they are.

--check-exports exports tiny models of every family through polyalign's export (polyalign's own
SentencePiece tokenizer with the polyalign template; a BPE tokenizer.json with each family's template)
and prints what transformers makes of each: logits, greedy continuation, apply_chat_template with the
profile variables, and the tokenizer's ids, against polyalign's.

It also checks the other direction: each checkpoint goes through polyalign's loader and
save_hf_checkpoint, transformers loads the export, and the logits difference is printed.

--peft writes the PEFT fixture and loads polyalign's adapter exports (every family, adapters drawn)
with PEFT onto the transformers base, and its merged exports with transformers, printing the logits
differences against polyalign's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SEED = 1234
BATCH, LENGTH, PADDED = 3, 40, 9  # the last row ends in PADDED padding tokens

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, initializer_range=0.1, max_position_embeddings=128, rms_norm_eps=1e-5)
MODELS = {
    # GQA, untied, Llama 3 RoPE scaling with a short original context so that all three frequency
    # bands (kept, interpolated, slowed) occur in 40 positions.
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_hidden_layers=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # Tied embeddings and q/k/v biases.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        num_hidden_layers=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Per-head q/k RMSNorm before RoPE, 6 heads of head_dim 16 (96 wide, not the width 64), untied head.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        num_hidden_layers=2, tie_word_embeddings=False, num_attention_heads=6, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Soft-capping low enough to bend the scores, a sliding window shorter than the sequence,
    # query_pre_attn_scalar unlike head_dim, and three layers: sliding, full, sliding.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        num_hidden_layers=3, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        sliding_window=8, attn_implementation="eager")),
    # Gemma 3: per-head (1 + w) q/k norms, no soft-caps, a sliding window shorter than the sequence,
    # sliding layers on their own RoPE base (10k) and the global layer on 1M with linear scaling.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=8, attn_implementation="eager",
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def make_model(family: str):
    config_cls, model_cls, extra = MODELS[family]
    torch.manual_seed(SEED)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    # Norm weights and biases start at constants; perturb them so a wrong mapping shows in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, COMMON["vocab_size"], size=(BATCH, LENGTH)).astype(np.int32)
    mask = np.ones((BATCH, LENGTH), np.int32)
    mask[-1, -PADDED:] = 0
    return ids, mask


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long())
    return out.logits.float().numpy()


def write_model_fixtures(families=None) -> None:
    from polyalign.model import load_hf_checkpoint, save_hf_checkpoint

    ids, mask = inputs()
    for family in families or MODELS:
        target = FIXTURES / "hf" / family
        model = make_model(family)
        model.save_pretrained(target, safe_serialization=True)
        logits = hf_logits(model, ids, mask)
        save_file({"input_ids": ids, "attention_mask": mask, "logits": logits}, target / "expected.safetensors")
        for stray in target.glob("generation_config.json"):
            stray.unlink()
        ours = load_hf_checkpoint(target)
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_checkpoint(ours, Path(tmp) / "export")
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "export").eval()
            roundtrip = hf_logits(reloaded, ids, mask)
        real = mask.astype(bool)
        diff = np.abs(roundtrip - logits)[real].max()
        print(f"{family:7s} {sum(p.numel() for p in model.parameters()):>7} params  "
              f"max|logit| {np.abs(logits).max():.3f}  polyalign export -> transformers: max|dlogits| {diff:.2e}")
    if families is None or "gemma3" in families:
        check_multimodal_gemma3()


def check_multimodal_gemma3() -> None:
    """A multimodal Gemma 3 checkpoint (as transformers saves Gemma3ForConditionalGeneration): polyalign
    loads its language model, whose logits on text equal transformers'."""
    from polyalign.model import load_hf_checkpoint

    config_cls, _, extra = MODELS["gemma3"]
    text = config_cls(**{**COMMON, **extra}).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=COMMON["vocab_size"] - 1,
                                       boi_token_index=COMMON["vocab_size"] - 3,
                                       eoi_token_index=COMMON["vocab_size"] - 2)
    torch.manual_seed(SEED)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    ids, mask = inputs()
    ids = np.minimum(ids, COMMON["vocab_size"] - 4)  # no image tokens
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        ours = load_hf_checkpoint(tmp)
    logits = np.asarray(ours(ids, attention_mask=mask))
    diff = np.abs(logits - hf_logits(model, ids, mask))[mask.astype(bool)].max()
    print(f"gemma3 multimodal checkpoint, its language model in polyalign: max|dlogits| {diff:.2e}")


CHAT_CASES = [
    # (template, dataset, at least this many history turns, profile): real test records of the demo data
    ("qwen", "kdconv", 2, "oracle"),
    ("qwen", "polyalign_sample", 0, "none"),
    ("llama3", "camrest676", 2, "context"),
    ("llama3", "cmrc2018", 0, "oracle"),
    ("gemma", "crosswoz", 2, "context"),
    ("gemma", "lccc", 0, "none"),
    ("polyalign", "coig_cqia", 0, "context"),
    ("polyalign", "kdconv", 2, "oracle"),
]
SPECIAL = {"qwen": dict(eos_token="<|im_end|>"), "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
           "gemma": dict(bos_token="<bos>", eos_token="<eos>")}


def official_render(template_text: str, name: str, messages: list[dict], fold: bool = True,
                    prompt: bool = False) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                               **SPECIAL[name])
    if fold and name == "gemma" and messages[0]["role"] == "system":
        # Gemma 2's template rejects system messages; polyalign opens the first user turn with it.
        system, first = messages[0], messages[1]
        messages = [{"role": "user", "content": f"{system['content']}\n\n{first['content']}"}, *messages[2:]]
    return tok.apply_chat_template(messages, tokenize=False, chat_template=template_text, date_string="26 Jul 2024",
                                   add_generation_prompt=prompt)


def write_chat_fixtures(template_dir: Path) -> None:
    from polyalign.data.prepare import prepare
    from polyalign.data.records import read_records
    from polyalign.tokens.chat import get_template, record_messages

    with tempfile.TemporaryDirectory() as tmp:
        prepare(REPO / "configs" / "data" / "demo.yaml", Path(tmp), progress=False)
        records = list(read_records(Path(tmp) / "data" / "test.jsonl"))
    cases = []
    for name, dataset, min_history, profile in CHAT_CASES:
        record = next(r for r in records if r.dataset == dataset and r.response and len(r.history) >= min_history)
        messages = record_messages(record, profile)
        as_dicts = [{"role": m.role, "content": m.content} for m in messages]
        if name == "polyalign":
            expected = get_template(name).render(messages)  # polyalign's own template has no other source
        else:
            expected = official_render((template_dir / f"{name}.jinja").read_text(), name, as_dicts)
        as_json = record.to_json()
        as_json["meta"] = {"group": record.meta.get("group")}  # source paths would name this machine's folders
        cases.append({"template": name, "profile": profile, "record": as_json, "expected": expected})
        print(f"chat {name:9s} {dataset:16s} {len(messages)} messages, {len(expected)} chars")
    out = FIXTURES / "chat" / "fixtures.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n")


def export_conversations() -> list[tuple[str, list[dict]]]:
    """Every record of the chat export tests/chat_exports.py makes from real demo text, as (record key,
    the conversation up to its reply as transformers is given it): developer as system, content parts
    joined by a newline, consecutive messages of one role joined by a newline, text normalised as
    prepare normalises it. Tool turns and the records after them are left out, as the importer leaves
    them out."""
    sys.path.insert(0, str(REPO))
    from polyalign.data.text import normalize
    from tests.chat_exports import openai_rows

    cases = []
    for row in openai_rows():
        messages = []
        for position, message in enumerate(row["messages"]):
            role = "system" if message["role"] == "developer" else message["role"]
            content = message["content"]
            if isinstance(content, list):
                content = "\n".join(part["text"] for part in content if part.get("type") == "text")
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += "\n" + content
            else:  # the record key names the source position of a reply's first message
                messages.append({"role": role, "content": content, "position": position})
        for k, message in enumerate(messages):
            if message["role"] == "assistant" and any(m["role"] in ("user", "assistant") for m in messages[:k]):
                conversation = [{"role": m["role"], "content": normalize(m["content"])} for m in messages[:k + 1]]
                cases.append((f"{row['id']}-turn-{message['position']}", conversation))
    return cases


def write_export_fixtures(template_dir: Path) -> None:
    """chat/exports.json: the official templates' renderings (transformers' apply_chat_template) of
    every record of the real-text chat export, with its system messages where the user put them. Gemma
    2's template refuses system messages: it is given the conversation with them folded into user
    turns by polyalign's documented rule (chat.fold_system)."""
    from polyalign.tokens.chat import Message, fold_system

    cases = []
    for key, conversation in export_conversations():
        for name in ("qwen", "llama3", "gemma"):
            given = conversation
            if name == "gemma":
                given = [{"role": m.role, "content": m.content}
                         for _, m in fold_system([Message(c["role"], c["content"]) for c in conversation])]
            template = (template_dir / f"{name}.jinja").read_text()
            cases.append({"template": name, "key": key, "messages": conversation,
                          "expected": official_render(template, name, given, fold=False),
                          "prompt": official_render(template, name, given[:-1], fold=False, prompt=True)})
        print(f"exports {key:28s} {len(conversation)} messages, "
              f"{sum(m['role'] == 'system' for m in conversation)} system")
    out = FIXTURES / "chat" / "exports.json"
    out.write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n")


# template file, template variables, dataset, least history, profile, reasoning put in the history
JINJA_CASES = [
    ("qwen3.jinja", {}, "kdconv", 2, "context", False),
    ("qwen3.jinja", {"enable_thinking": False}, "kdconv", 2, "context", False),
    ("qwen3.jinja", {}, "camrest676", 2, "none", True),
    ("qwen3.jinja", {}, "coig_cqia", 0, "oracle", False),
    ("fine_tuned.jinja", {}, "camrest676", 2, "context", False),
    ("fine_tuned.jinja", {}, "cmrc2018", 0, "oracle", False),
]
JINJA_SPECIAL = {"qwen3.jinja": dict(eos_token="<|im_end|>"), "fine_tuned.jinja": dict(eos_token="</s>")}


def with_reasoning(messages: list[dict]) -> list[dict]:
    """The first assistant turn of the history with a <think> block before its answer (the user's
    question it answers, as its reasoning): Qwen3's template drops it from past turns."""
    messages = [dict(m) for m in messages]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    messages[first]["content"] = f"<think>\n{messages[first - 1]['content']}\n</think>\n\n{messages[first]['content']}"
    return messages


def write_jinja_fixtures() -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers.utils.chat_template_utils import render_jinja_template

    from polyalign.data.prepare import prepare
    from polyalign.data.records import read_records
    from polyalign.tokens.chat import record_messages

    with tempfile.TemporaryDirectory() as tmp:
        prepare(REPO / "configs" / "data" / "demo.yaml", Path(tmp), progress=False)
        records = list(read_records(Path(tmp) / "data" / "test.jsonl"))
    cases = []
    for name, variables, dataset, min_history, profile, reasoning in JINJA_CASES:
        source = (FIXTURES / "chat" / "templates" / name).read_text()
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")), **JINJA_SPECIAL[name])
        record = next(r for r in records if r.dataset == dataset and r.response and len(r.history) >= min_history)
        messages = [{"role": m.role, "content": m.content} for m in record_messages(record, profile)]
        if reasoning:
            messages = with_reasoning(messages)

        def render(chat, prompt=False):
            return tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt, chat_template=source,
                                           **variables)

        expected, prompt = render(messages), render(messages[:-1], prompt=True)
        if re.search(r"\{%-?\s*generation\s*-?%\}", source):
            special = {"eos_token": tok.eos_token}
            rendered, spans = render_jinja_template([messages], chat_template=source, return_assistant_tokens_mask=True,
                                                    **special, **variables)
            assert rendered[0] == expected
            spans = [list(span) for span in spans[0]]
        else:
            spans = [[len(prompt), len(expected)]] if expected.startswith(prompt) else []
        as_json = record.to_json()
        as_json["meta"] = {"group": record.meta.get("group")}
        cases.append({"template": name, "variables": variables, "profile": profile, "reasoning": reasoning,
                      "record": as_json, "messages": messages, "expected": expected, "prompt": prompt,
                      "assistant_spans": spans})
        print(f"jinja {name:17s} {dataset:12s} {variables} {len(messages)} messages, spans {spans}")
    out = FIXTURES / "chat" / "jinja.json"
    out.write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n")


QWEN_PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def check_exports() -> None:
    import dataclasses

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from polyalign.data.prepare import prepare
    from polyalign.data.records import read_records
    from polyalign.model import create_model, load_hf_checkpoint
    from polyalign.model.export import export_checkpoint
    from polyalign.tokens.chat import TEMPLATE_SPECIAL_TOKENS, get_template
    from polyalign.tokens.tokenizer import load_tokenizer
    from polyalign.tokens.tokenizer_training import record_texts, train_from_records

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepare(REPO / "configs" / "data" / "demo.yaml", tmp, progress=False)
        records = [r for r in read_records(tmp / "data" / "test.jsonl") if r.response][:24]
        texts = list(record_texts(read_records(tmp / "data" / "train.jsonl")))
        sentencepiece, _ = train_from_records(tmp / "data" / "train.jsonl", tmp / "sp", 8000)
        # transformers rebuilds a Qwen2 tokenizer's pre-tokenizer as Qwen's (digits one by one), so the
        # Qwen case gets a BPE trained with that pre-tokenizer, as a real Qwen tokenizer.json has.
        for name, split in (("trained-bpe", None), ("trained-bpe-qwen", QWEN_PRETOKENIZE)):
            bpe = Tokenizer(models.BPE())
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
            bpe.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
            bpe.decoder = decoders.ByteLevel()
            bpe.train_from_iterator(texts, trainers.BpeTrainer(
                vocab_size=3000, special_tokens=list(TEMPLATE_SPECIAL_TOKENS), show_progress=False,
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
            (tmp / name).mkdir()
            bpe.save(str(tmp / name / "tokenizer.json"))
        special = {"qwen": (None, "<|im_end|>"), "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
                   "gemma": ("<bos>", "<eos>")}
        cases = [("llama", "polyalign", tmp / "sp")]
        for family, template in (("llama", "llama3"), ("qwen2", "qwen"), ("qwen3", "qwen"), ("gemma2", "gemma"),
                                 ("gemma3", "gemma")):
            folder = tmp / f"bpe-{family}-{template}"
            folder.mkdir()
            bpe_file = tmp / ("trained-bpe-qwen" if template == "qwen" else "trained-bpe") / "tokenizer.json"
            (folder / "tokenizer.json").write_bytes(bpe_file.read_bytes())
            bos, eos = special[template]
            # PreTrainedTokenizerFast: the class named by config.json's model type would rebuild this
            # tokenizer.json's pre-tokenizer as that family's (a real checkpoint's tokenizer is that family's).
            (folder / "tokenizer_config.json").write_text(json.dumps(
                {"bos_token": bos, "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}))
            cases.append((family, template, folder))
        for family, template_name, folder in cases:
            tokenizer = load_tokenizer(folder)
            base = load_hf_checkpoint(FIXTURES / "hf" / family).config
            model = create_model(dataclasses.replace(base, vocab_size=tokenizer.vocab_size,
                                                     bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                                                     pad_token_id=tokenizer.pad_id),
                                 seed=SEED)
            template = get_template(template_name, tokenizer)
            out = tmp / f"export-{family}-{template_name}"
            export_checkpoint(model, tokenizer, out, template=template, profile="context", dtype="float32")
            print(f"export {family:6s} {template_name:9s} ({type(tokenizer).__name__}): "
                  + compare_with_transformers(model, tokenizer, template, out, records, "context"))


def compare_with_transformers(model, tokenizer, template, export, records, profile: str) -> str:
    """What transformers makes of the export in `export`, against polyalign on `records`: the chat
    template's prompt (the profile's system prompt from template variables), the prompt's ids, greedy
    continuation (12 tokens) and the largest logits difference."""
    from polyalign.generate.sampling import Sampler, SamplingConfig
    from polyalign.tokens.chat import encode_prompt, record_messages

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)
    same_prompt, same_greedy, same_ids, logit_diff = 0, 0, 0, 0.0
    sampler = Sampler(model, [tokenizer.special_id(t) for t in template.stop_tokens()] + [tokenizer.eos_id],
                      tokenizer.pad_id, SamplingConfig(max_new_tokens=12))
    for record in records:
        messages = record_messages(record, profile)[:-1]
        ours = encode_prompt(template, tokenizer, messages)
        variables = {"family": record.family, "track": record.track, "style": record.style,
                     **({"length": record.length_bin} if profile == "oracle" else {})}
        text = hf_tok.apply_chat_template([{"role": m.role, "content": m.content}
                                           for m in record_messages(record, "none")[:-1]],
                                          tokenize=False, add_generation_prompt=True,
                                          **(variables if profile != "none" else {}))
        same_prompt += text == template.render(messages, add_generation_prompt=True)
        theirs = hf_tok(text, add_special_tokens=False)["input_ids"]
        same_ids += list(ours) == theirs
        ids = torch.tensor([ours.tolist()])
        with torch.no_grad():
            hf_logits = hf_model(ids).logits[0].numpy()
            generated = hf_model.generate(ids, max_new_tokens=12, do_sample=False)[0, len(ours):].tolist()
        logit_diff = max(logit_diff, float(np.abs(np.asarray(model(ours[None])[0]) - hf_logits).max()))
        tokens, _ = sampler.generate([ours])[0]
        stops = hf_model.generation_config.eos_token_id
        stops = set(stops) if isinstance(stops, list) else {stops}
        generated = generated[:next((i for i, t in enumerate(generated) if t in stops), len(generated))]
        same_greedy += tokens == generated
    n = len(records)
    return (f"apply_chat_template equal {same_prompt}/{n}, ids equal {same_ids}/{n}, greedy equal "
            f"{same_greedy}/{n}, max|dlogits| {logit_diff:.2e}")


def check_trained_export(export: Path, records_path: Path, limit: int = 24) -> None:
    """A model polyalign trained and exported (e.g. the demo's RUN/bucket_sft/model) against
    transformers on the first `limit` records with a response."""
    from polyalign.data.records import read_records
    from polyalign.model import load_hf_checkpoint
    from polyalign.tokens.chat import choose_template, get_template
    from polyalign.tokens.tokenizer import load_tokenizer

    model = load_hf_checkpoint(export)
    tokenizer = load_tokenizer(export)
    template = get_template(choose_template(tokenizer, family=model.config.family, where=str(export)), tokenizer)
    profile = json.loads((export / "tokenizer_config.json").read_text()).get("polyalign_profile", "context")
    records = [r for r in read_records(records_path) if r.response][:limit]
    print(f"{export} ({model.config.family}, {model.config.num_parameters():,} parameters, template "
          f"{template.name}, profile {profile}): " + compare_with_transformers(model, tokenizer, template, export,
                                                                             records, profile))


def write_peft_fixture() -> None:
    """tests/fixtures/peft/qwen2/: a LoRA adapter PEFT made on the qwen2 fixture (r 4, alpha 8, every
    projection, B drawn too so it changes the logits) and expected.safetensors with PEFT's logits."""
    import peft

    from polyalign.model import load_hf_checkpoint
    from polyalign.model.lora import load_adapter

    target = FIXTURES / "peft" / "qwen2"
    base = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "hf" / "qwen2").eval()
    torch.manual_seed(SEED)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    plain = hf_logits(base, *inputs())  # before PEFT wraps (and changes) the base in place
    adapted = peft.get_peft_model(base, config).eval()
    adapted.save_pretrained(target)
    (target / "README.md").unlink(missing_ok=True)
    # PEFT records the base's path as given and its target modules in set order; keep the
    # repository-relative path, not this machine's, and a stable order.
    config_path = target / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = str((FIXTURES / "hf" / "qwen2").relative_to(REPO))
    saved["target_modules"] = sorted(saved["target_modules"])
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    ids, mask = inputs()
    logits = hf_logits(adapted, ids, mask)
    save_file({"input_ids": ids, "attention_mask": mask, "logits": logits}, target / "expected.safetensors")
    ours = load_adapter(load_hf_checkpoint(FIXTURES / "hf" / "qwen2"), target)
    got = np.asarray(ours(ids, attention_mask=mask))
    real = mask.astype(bool)
    print(f"peft {peft.__version__}: PEFT adapter on qwen2 in polyalign: max|dlogits| "
          f"{np.abs(got - logits)[real].max():.2e}"
          f" (adapter moves the logits by {np.abs(logits - plain)[real].max():.3f})")


def check_adapter_export() -> None:
    """polyalign's adapter export (adapters with B drawn) loaded by PEFT onto the transformers base, and
    its merged export loaded by transformers, against polyalign's logits."""
    import jax
    import peft
    from flax import nnx

    from polyalign.model import load_hf_checkpoint, save_hf_checkpoint
    from polyalign.model.architecture import LoraConfig
    from polyalign.model.export import export_adapter
    from polyalign.model.lora import add_adapters, merge_adapters

    ids, mask = inputs()
    real = mask.astype(bool)
    for family in MODELS:
        model = add_adapters(load_hf_checkpoint(FIXTURES / "hf" / family), LoraConfig(rank=4, alpha=8.0), seed=1)
        graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
        keys = iter(jax.random.split(jax.random.key(SEED), 64))
        adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), adapters)
        model = nnx.merge(graphdef, adapters, rest)
        ours = np.asarray(model(ids, attention_mask=mask))
        with tempfile.TemporaryDirectory() as tmp:
            export_adapter(model, Path(tmp) / "adapter", base=str(FIXTURES / "hf" / family))
            save_hf_checkpoint(merge_adapters(model), Path(tmp) / "merged")
            base = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "hf" / family).eval()
            plain = hf_logits(base, ids, mask)  # before PEFT wraps (and changes) the base in place
            with_peft = hf_logits(peft.PeftModel.from_pretrained(base, Path(tmp) / "adapter").eval(), ids, mask)
            merged = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "merged").eval(), ids,
                               mask)
        print(f"{family:7s} adapter export -> peft: max|dlogits| {np.abs(with_peft - ours)[real].max():.2e}; "
              f"merged export -> transformers: {np.abs(merged - ours)[real].max():.2e}; "
              f"adapters move the logits by {np.abs(ours - plain)[real].max():.3f}")


def write_loss_fixtures() -> None:
    """DPO, cDPO and IPO losses from TRL's formulas (trl.DPOTrainer.dpo_loss, loss_type sigmoid / ipo),
    evaluated in torch on fixed log-probs."""
    import torch.nn.functional as F

    rng = np.random.default_rng(SEED)
    logps = {name: (-rng.uniform(5, 60, 16)).round(3) for name in ("pc", "pr", "rc", "rr")}
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in logps.items()}
    logits = (t["pc"] - t["pr"]) - (t["rc"] - t["rr"])
    cases = []
    for beta, smoothing in [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)]:
        losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
        cases.append({"loss_type": "sigmoid", "beta": beta, "label_smoothing": smoothing, "losses": losses.tolist()})
    for beta in (0.1, 0.5):
        cases.append({"loss_type": "ipo", "beta": beta, "losses": ((logits - 1 / (2 * beta)) ** 2).tolist()})
    out = FIXTURES / "losses" / "trl_dpo.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"logps": {k: v.tolist() for k, v in logps.items()}, "cases": cases}, indent=1) + "\n")
    print(f"losses: {len(cases)} TRL formula cases")
    write_loss_family_fixtures(logps)


def write_loss_family_fixtures(logps: dict[str, np.ndarray]) -> None:
    """Robust DPO, SimPO and ORPO as TRL computes them (DPOTrainer loss_type robust, CPOTrainer
    loss_type simpo, ORPOTrainer.odds_ratio_loss plus the chosen NLL), KTO's kto_loss, and DPO on
    length-normalised log-probs, evaluated in torch on the same log-probs with response lengths."""
    import torch.nn.functional as F

    rng = np.random.default_rng(SEED + 1)
    lengths = {"nc": rng.integers(5, 40, 16), "nr": rng.integers(5, 40, 16)}
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in {**logps, **lengths}.items()}
    logits = (t["pc"] - t["pr"]) - (t["rc"] - t["rr"])
    mean_c, mean_r = t["pc"] / t["nc"], t["pr"] / t["nr"]
    cases = []
    for beta, eps in [(0.1, 0.1), (0.5, 0.3)]:
        z = beta * logits
        losses = (-F.logsigmoid(z) * (1 - eps) + F.logsigmoid(-z) * eps) / (1 - 2 * eps)
        cases.append({"loss_type": "robust", "beta": beta, "label_smoothing": eps, "losses": losses.tolist()})
    for beta, gamma, eps in [(2.0, 0.5, 0.0), (2.5, 1.4, 0.1)]:
        z = beta * ((mean_c - mean_r) - gamma / beta)
        losses = -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps
        cases.append({"loss_type": "simpo", "beta": beta, "simpo_gamma": gamma, "label_smoothing": eps,
                      "losses": losses.tolist()})
    for beta in (0.1, 1.0):
        log_odds = (mean_c - mean_r) - (torch.log1p(-torch.exp(mean_c)) - torch.log1p(-torch.exp(mean_r)))
        losses = -mean_c - beta * F.logsigmoid(log_odds)
        cases.append({"loss_type": "orpo", "beta": beta, "losses": losses.tolist()})
    for beta, kl, wd, wu in [(0.1, 0.0, 1.0, 1.0), (0.5, 0.8, 1.0, 1.33)]:
        chosen = 1 - torch.sigmoid(beta * ((t["pc"] - t["rc"]) - kl))
        rejected = 1 - torch.sigmoid(beta * (kl - (t["pr"] - t["rr"])))
        cases.append({"loss_type": "kto", "beta": beta, "kl": kl, "desirable_weight": wd, "undesirable_weight": wu,
                      "chosen_losses": (wd * chosen).tolist(), "rejected_losses": (wu * rejected).tolist()})
    for beta in (0.1, 1.0):
        ln_logits = (mean_c - t["rc"] / t["nc"]) - (mean_r - t["rr"] / t["nr"])
        cases.append({"loss_type": "ln_dpo", "beta": beta, "losses": (-F.logsigmoid(beta * ln_logits)).tolist()})
    out = FIXTURES / "losses" / "trl_family.json"
    out.write_text(json.dumps({"logps": {k: v.tolist() for k, v in {**logps, **lengths}.items()}, "cases": cases},
                              indent=1) + "\n")
    print(f"losses: {len(cases)} preference-family cases")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chat-templates", type=Path, help="directory with qwen.jinja, llama3.jinja, gemma.jinja")
    parser.add_argument("--jinja-only", action="store_true", help="only chat/jinja.json")
    parser.add_argument("--exports-only", action="store_true",
                        help="with --chat-templates: only chat/exports.json (the real-text chat export's records)")
    parser.add_argument("--check-exports", action="store_true", help="only the export checks (writes nothing)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="only these model fixtures")
    parser.add_argument("--check-export", type=Path, metavar="DIR",
                        help="only check this trained export (e.g. runs/demo/bucket_sft/model) against transformers")
    parser.add_argument("--records", type=Path, help="with --check-export: records to prompt with (test.jsonl)")
    parser.add_argument("--peft", action="store_true",
                        help="only the LoRA checks: write tests/fixtures/peft/ and load polyalign's adapter exports "
                             "with peft (needs peft)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    if args.peft:
        write_peft_fixture()
        check_adapter_export()
        return 0
    if args.check_export:
        check_trained_export(args.check_export, args.records)
        return 0
    if args.check_exports:
        check_exports()
        return 0
    if args.models:
        write_model_fixtures(args.models)
        return 0
    if args.exports_only:
        write_export_fixtures(args.chat_templates)
        return 0
    write_jinja_fixtures()
    if args.jinja_only:
        return 0
    write_model_fixtures()
    write_peft_fixture()
    write_loss_fixtures()
    if args.chat_templates:
        write_chat_fixtures(args.chat_templates)
        write_export_fixtures(args.chat_templates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
