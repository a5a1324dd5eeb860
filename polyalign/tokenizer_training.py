"""`polyalign tokenizer train`: a bilingual SentencePiece tokenizer trained on prepared records, with a
report of characters per token by language. The tokenizer library itself is polyalign.tokenizer."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

from polyalign.chat import POLYALIGN_SPECIAL_TOKENS
from polyalign.data.records import read_records
from polyalign.errors import TokenizerError
from polyalign.tokenizer import SentencePieceTokenizer, train_sentencepiece


def record_texts(records) -> Iterable[str]:
    """Every text a model reads or writes in a record: question, context, history and response."""
    for record in records:
        yield record.question
        if record.context:
            yield record.context
        for turn in record.history:
            yield turn["text"]
        if record.response:
            yield record.response


def train_from_records(records_path: str | os.PathLike, out_dir: str | os.PathLike, vocab_size: int,
                       **options) -> tuple[SentencePieceTokenizer, dict]:
    """Trains on a records file (e.g. RUN/data/train.jsonl) and reports characters per token by
    language (written to OUT/tokenizer_report.json)."""
    records_path = Path(records_path)
    if not records_path.is_file():
        raise TokenizerError(f"{records_path}: no such records file")
    records = read_records(records_path)
    if not records:
        raise TokenizerError(f"{records_path}: no records to train on")
    started = time.perf_counter()
    options.setdefault("special_tokens", POLYALIGN_SPECIAL_TOKENS)
    tokenizer = train_sentencepiece(record_texts(records), out_dir, vocab_size, **options)
    seconds = time.perf_counter() - started
    chars: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for record in records:
        texts = list(record_texts([record]))
        chars[record.language] = chars.get(record.language, 0) + sum(len(t) for t in texts)
        tokens[record.language] = tokens.get(record.language, 0) + sum(len(ids) for ids in tokenizer.encode_batch(texts))
    report = {"records": str(records_path), "num_records": len(records), "vocab_size": tokenizer.vocab_size,
              "train_seconds": round(seconds, 2),
              "chars_per_token": {lang: round(chars[lang] / max(tokens[lang], 1), 3) for lang in sorted(chars)}}
    (Path(out_dir) / "tokenizer_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return tokenizer, report
