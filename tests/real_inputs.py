"""Inputs made from the demo's real records and shared by several test modules: preference pairs and
a tiny initial checkpoint, TRL rows, and human answers split into prompts and stand-in answers. Not a
test module."""

import json
import random
import re
from collections import defaultdict

import numpy as np

from polyalign.data.records import read_records
from polyalign.features.response import FEATURE_NAMES, text_features
from polyalign.model import create_model, save_hf_checkpoint
from polyalign.pairs.make import write_pairs
from tests.conftest import tiny_model_config


def real_pairs(demo_run, count: int) -> list[dict]:
    """Pairs from real records (the shortest of each bucket, so that few are cut): the record's own
    response is chosen, the response of the next record of the same bucket rejected; the first
    pair's rejected side is its chosen response cut short, so the two sides share labelled tokens."""
    run, _, _ = demo_run
    by_bucket = defaultdict(list)
    for record in read_records(run / "data" / "train.jsonl"):
        by_bucket[record.bucket_id].append(record)
    rng = np.random.default_rng(0)
    pairs = []
    for bucket in sorted(by_bucket):
        records = sorted(by_bucket[bucket], key=lambda r: len(json.dumps(r.to_json(), ensure_ascii=False)))
        for record, other in zip(records[:2], records[1:3]):
            pairs.append({"id": record.id, "bucket_id": bucket, "language": record.language, "record": record.to_json(),
                          "chosen": record.response, "rejected": other.response, "weight": float(rng.uniform(0.5, 3.0)),
                          "critic_chosen": float(rng.uniform(0, 1)), "critic_rejected": float(rng.uniform(0, 2))})
    pairs = pairs[:count]
    pairs[0]["rejected"] = pairs[0]["chosen"][: len(pairs[0]["chosen"]) // 2]
    return pairs


def init_checkpoint_and_pair_files(demo_run, tokenizer, directory, train: int, val: int) -> None:
    """DIR/init (a tiny random model with the demo tokenizer), DIR/train.jsonl and DIR/val.jsonl (real pairs)."""
    files = tokenizer.path.parent
    save_hf_checkpoint(create_model(tiny_model_config(tokenizer.vocab_size)), directory / "init", extra_files={
        name: (files / name).read_bytes() for name in ("tokenizer.model", "tokenizer_config.json")})
    pairs = real_pairs(demo_run, train + val)
    write_pairs(pairs[:train], directory / "train.jsonl")
    write_pairs(pairs[train:], directory / "val.jsonl")


def real_trl_rows(demo_run, split="test", n=40):
    """TRL rows from real records: the prompt as messages (history, then the question with its
    context), the person's answer chosen, another answer in the same bucket rejected; each row carries
    the record's labels, as a user's file may."""
    run, _, _ = demo_run
    records = [r for r in read_records(run / "data" / f"{split}.jsonl") if r.response]
    by_bucket = {}
    for record in records:
        by_bucket.setdefault(record.bucket_id, []).append(record)
    rows, sources = [], []
    for bucket, members in sorted(by_bucket.items()):
        for record, other in zip(members, members[1:]):
            if record.response == other.response:
                continue
            prompt = [{"role": t["role"], "content": t["text"]} for t in record.history]
            prompt.append({"role": "user", "content": f"{record.context}\n\n{record.question}" if record.context
                           else record.question})
            rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": record.response}],
                         "rejected": [{"role": "assistant", "content": other.response}],
                         "language": record.language, "track": record.track, "family": record.family,
                         "style": record.style})
            sources.append(record)
            if len(rows) == n:
                return rows, sources
    return rows, sources


def bucket_halves(demo_run):
    """Each test bucket's records shuffled (seeded) and split in two: the first half are the prompts,
    the second half's human answers (of the same bucket) stand in for a model's."""
    run, _, _ = demo_run
    by_bucket = defaultdict(list)
    for record in read_records(run / "data" / "test.jsonl"):
        by_bucket[record.bucket_id].append(record)
    pairs = []
    for bucket, records in sorted(by_bucket.items()):
        random.Random(bucket).shuffle(records)
        half = len(records) // 2
        pairs += zip(records[:half], records[half:2 * half])
    return pairs


def answer_sets(pairs) -> dict[str, list[str]]:
    """The human set and answers built from the same real records that no person would give."""
    fixed = {}
    for _, other in pairs:
        fixed.setdefault(other.bucket_id, other.response)
    by_language = {lang: [o.response for _, o in pairs if o.language == lang] for lang in ("en", "zh")}
    return {
        "human": [other.response for _, other in pairs],
        "first_clause": [re.split(r"[,，.。!?！？;；:\n]", other.response.strip(), maxsplit=1)[0]
                         for _, other in pairs],
        "one_fixed_answer": [fixed[prompt.bucket_id] for prompt, _ in pairs],
        "other_language_answers": [by_language["zh" if prompt.language == "en" else "en"][i % 50]
                                   for i, (prompt, _) in enumerate(pairs)],
        "echo_question": [prompt.question for prompt, _ in pairs],
        "typical_people": typical_answers(pairs),
    }


def typical_answers(pairs) -> list[str]:
    """Real people's answers with an LLM's mode-seeking spread: in each bucket, the tenth of the answers
    nearest the bucket's median on the 134 features (mean |z|), cycled over the bucket's prompts."""
    rows_of = defaultdict(list)
    for i, (prompt, _) in enumerate(pairs):
        rows_of[prompt.bucket_id].append(i)
    answers = [""] * len(pairs)
    for rows in rows_of.values():
        texts = [pairs[i][1].response for i in rows]
        table = np.array([[row[f] for f in FEATURE_NAMES] for row in map(text_features, texts)])
        spread = table.std(axis=0)
        z = (table - np.median(table, axis=0)) / np.where(spread > 0, spread, 1.0)
        typical = [texts[j] for j in np.argsort(np.abs(z).mean(axis=1), kind="stable")[:max(1, len(rows) // 10)]]
        for k, i in enumerate(rows):
            answers[i] = typical[k % len(typical)]
    return answers
