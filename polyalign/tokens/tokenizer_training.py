"""`polyalign tokenizer train`: a bilingual SentencePiece tokenizer trained on prepared records, with a
report of characters per token by language. The tokenizer library itself is polyalign.tokens.tokenizer."""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

from polyalign.core.errors import TokenizerError
from polyalign.core.outputs import stage_output
from polyalign.core.paths import files_digest
from polyalign.data.layout import split_files
from polyalign.data.records import read_records
from polyalign.tokens.chat import POLYALIGN_SPECIAL_TOKENS, system_prompt
from polyalign.tokens.tokenizer import SentencePieceTokenizer, train_sentencepiece


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


def training_texts(records, system_prompts: bool = False) -> Iterable[str]:
    """What the tokenizer learns from: each record's texts, and with `system_prompts` the system prompt a
    build writes before it (the profile prompt of the default `context` profile, after the source's own
    system message). That prompt stands in every example; learnt from a Chinese-only team's records alone,
    its English words took nearly a piece a letter (116 tokens of a 256-token example; 46 learnt with it).
    Off by default: on the bilingual demo, where English pieces are learnt anyway, it only moves the
    vocabulary (the quick demo's critic then ranked its model's answers at chance)."""
    for record in records:
        yield from record_texts([record])
        if system_prompts:
            yield system_prompt(record, "context")


REPORT = "tokenizer_report.json"
# What training writes into OUT; a folder holding one of these that polyalign did not make is not replaced.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json", REPORT)
# SentencePiece needs room for its control pieces, the chat template's specials and the byte fallback.
MIN_VOCAB_SIZE = 300


def read_report(folder) -> dict | None:
    """A tokenizer folder's tokenizer_report.json (its settings, digests and rates), or None for a
    checkpoint's own tokenizer or one polyalign did not train."""
    try:
        report = json.loads((Path(folder) / REPORT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def train_from_records(records_path: str | os.PathLike, out_dir: str | os.PathLike, vocab_size: int,
                       overwrite: bool = False, system_prompts: bool = False,
                       **options) -> tuple[SentencePieceTokenizer, dict]:
    """Trains on a records file (e.g. RUN/data/train.jsonl), or a prepared run folder's train split in
    either layout (one file, or a Beam prepare's shards), and reports characters per token by language
    (written to OUT/tokenizer_report.json, with the settings and the records' digests). A tokenizer made
    with other settings is not replaced unless `overwrite`."""
    records_path, out_dir = Path(records_path), Path(out_dir)
    if not records_path.exists():
        shards = sorted(records_path.parent.glob(f"{records_path.stem}-*-of-*.jsonl"))
        beside = (f"; a sharded prepare wrote {shards[0].name}, ...: give the run folder "
                  f"{records_path.parent.parent} to train on its {records_path.stem} split" if shards else "")
        raise TokenizerError(f"{records_path}: no such records file{beside}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"vocab size {vocab_size} is too small: at least {MIN_VOCAB_SIZE} (the byte fallback "
                             "alone takes 256 pieces); 8000 suits the demo data")
    for key, value in DEFAULT_OPTIONS.items():  # said in every report, however the call spelt them
        options.setdefault(key, value)
    files = train_files(records_path)
    settings = {"records": records_setting(records_path, files), "vocab_size": vocab_size,
                **{k: v for k, v in sorted(options.items())},
                # only when asked: tokenizers trained before the option keep their settings
                **({"system_prompts": True} if system_prompts else {})}
    # A report from before these were recorded reads as made with the defaults (its thread count was then the
    # machine's cores: the same command trains it again with the default, as it retrains any tokenizer), and
    # one that named a run folder of one train file as made from that file.
    with stage_output(out_dir, out_dir / REPORT, settings, overwrite, ours=[out_dir / f for f in TOKENIZER_FILES],
                      inputs={"records": records_path}, legacy=DEFAULT_OPTIONS, view=_same_records):
        return _train(records_path, files, out_dir, vocab_size, settings, options, system_prompts)


def records_setting(records_path: Path, files: list) -> str:
    """The records as the settings keep them: a run folder of one train file is that file (the same records)."""
    return str(Path(files[0] if records_path.is_dir() and len(files) == 1 else records_path).resolve())


def _same_records(settings: dict) -> dict:
    """A recorded setting read as records_setting writes it now (a report from before kept the run folder)."""
    records = settings.get("records")
    if records is None or not Path(records).is_dir():
        return settings
    return {**settings, "records": records_setting(Path(records), train_files(Path(records)))}


# What train_sentencepiece trains with when a call leaves them out, recorded in every report.
DEFAULT_OPTIONS = {key: inspect.signature(train_sentencepiece).parameters[key].default
                   for key in ("threads", "model_type", "character_coverage")}


def train_files(records_path: Path) -> list:
    """The records files a records path names: itself, or a run folder's (or its data folder's) train split in
    either layout."""
    if not records_path.is_dir():
        return [records_path]
    # a run folder, or its data folder (prepare's output, whose manifest sits beside the splits)
    run = records_path.parent if (records_path / "manifest.json").is_file() else records_path
    return split_files(run, "train")


def _train(records_path: Path, files: list, out_dir: Path, vocab_size: int, settings: dict,
           options: dict, system_prompts: bool = False) -> tuple[SentencePieceTokenizer, dict]:
    # in id order: SentencePiece's pieces depend on the order it reads, and the files' order is the layout's (a
    # Beam prepare's shards hold the same records in another), so the same records train the same tokenizer
    records = sorted((record for path in files for record in read_records(path)), key=lambda record: record.id)
    if not records:
        raise TokenizerError(f"{records_path}: no records to train on")
    started = time.perf_counter()
    options.setdefault("special_tokens", POLYALIGN_SPECIAL_TOKENS)
    tokenizer = train_sentencepiece(training_texts(records, system_prompts), out_dir, vocab_size, **options)
    seconds = time.perf_counter() - started
    chars: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for record in records:
        texts = list(record_texts([record]))
        chars[record.language] = chars.get(record.language, 0) + sum(len(t) for t in texts)
        tokens[record.language] = (tokens.get(record.language, 0)
                                   + sum(len(ids) for ids in tokenizer.encode_batch(texts)))
    report = {"records": str(records_path), "num_records": len(records), "vocab_size": tokenizer.vocab_size,
              "train_seconds": round(seconds, 2), "threads": options["threads"],
              "chars_per_token": {lang: round(chars[lang] / max(tokens[lang], 1), 3) for lang in sorted(chars)},
              "settings": settings,
              "made_from": {"records": files_digest(files)}}
    (out_dir / REPORT).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return tokenizer, report
