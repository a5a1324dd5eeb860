"""`polyalign show RUN`: built examples as training reads them, decoded: the rendered conversation with
the trained tokens (the loss mask) marked, the record's bucket and Bucket-SFT weight, and on request the
token ids. What `build` stored is shown, not a second rendering of the record, so that what a user reads
is what the model trains on; only what a cut took is read off the record encoded again.
`polyalign show PAIRS.jsonl --checkpoint INIT`: preference pairs as a preference run reads them, each side
tokenised as training tokenises it (inputs/pair_rows.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from polyalign.core.yaml_config import ConfigError
from polyalign.data.layout import split_files
from polyalign.data.records import Record, read_records
from polyalign.inputs.build import encode_for_build
from polyalign.inputs.built import LEGACY_SETTINGS, BuildOptions, build_tokenizer_path, read_manifest
from polyalign.inputs.pair_rows import SIDES, tokenise_pairs
from polyalign.inputs.pipeline import open_split
from polyalign.model.architecture import checkpoint_family
from polyalign.model.hf import checkpoint_tokenizer
from polyalign.tokens.chat import Encoded, choose_template, get_template, record_messages
from polyalign.tokens.profile_template import SYSTEM_LOST_WHY
from polyalign.tokens.tokenizer import load_tokenizer

# Around each trained span: characters no chat template or corpus text here uses.
TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"


def spans(mask: np.ndarray) -> Iterator[tuple[int, int, bool]]:
    """(start, end, trained) for each run of equal loss-mask values."""
    start = 0
    for end in range(1, len(mask) + 1):
        if end == len(mask) or bool(mask[end]) != bool(mask[start]):
            yield start, end, bool(mask[start])
            start = end


def marked_text(tokenizer, ids: np.ndarray, mask: np.ndarray) -> str:
    """The decoded example, each trained span between TRAINED_OPEN and TRAINED_CLOSE. A span's text is
    what decoding the example up to its end adds to decoding it up to its start: decoded alone, a
    SentencePiece span would lose the space its first piece carries, and a split character its bytes. A
    leading BOS, which decoding drops as a control token, is written as its token, as the ids hold it."""
    ids = [int(i) for i in ids]
    parts, before = [], ""
    for start, end, trained in spans(mask):
        upto = tokenizer.decode(ids[:end])
        # a prefix that decodes otherwise once more pieces follow (bytes joining into one character): the span alone
        text = upto[len(before):] if upto.startswith(before) else tokenizer.decode(ids[start:end])
        parts.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained else text)
        before = upto
    text = "".join(parts)
    bos = tokenizer.bos_token
    if ids and ids[0] == tokenizer.bos_id and bos and not text.startswith(bos):
        return bos + text
    return text


def show_examples(run: Path, split: str = "train", ids: Sequence[str] = (), limit: int = 3,
                  token_ids: bool = False) -> Iterator[str]:
    """Text blocks for the built examples of `split`: those of the record `ids` (in the order given), or
    the first `limit` in stored order."""
    manifest = read_manifest(run)  # checked to be the build of the prepare RUN/data holds now
    if split not in manifest["splits"]:
        raise ConfigError(f"{run}: the build has no {split} split (it has {', '.join(manifest['splits'])})")
    tokenizer = load_tokenizer(build_tokenizer_path(run, manifest))  # RUN/tokenizer where the run was moved
    source = open_split(Path(run), split)
    total = len(source)
    if ids:
        wanted = {record_id: None for record_id in ids}
        for index in range(total):
            example = source[index]
            record_id = _text(example["id"])
            if record_id in wanted:
                wanted[record_id] = index
        missing = [record_id for record_id, index in wanted.items() if index is None]
        if missing:
            other = "val" if split == "train" else "train"
            raise ConfigError(f"{run}: no {split} example of record {missing[0]!r} (build keeps the train and val "
                              f"splits: --split {other} reads the {other} split; record ids are in "
                              "RUN/data/SPLIT.jsonl)")
        indices = list(wanted.values())
    else:
        indices = list(range(min(limit, total)))
    buckets = manifest["buckets"]
    examples = [source[index] for index in indices]
    cuts = _cuts(run, split, manifest, tokenizer, examples)
    for index, example in zip(indices, examples):
        input_ids, mask = np.asarray(example["input_ids"]), np.asarray(example["loss_mask"])
        bucket = buckets[int(example["bucket"])]
        head = (f"== {split} example {index + 1} of {total}: {_text(example['id'])} (bucket {bucket}, weight "
                f"{float(example['weight']):.3f}; {len(input_ids)} tokens, {int(mask.sum())} trained between "
                f"{TRAINED_OPEN} {TRAINED_CLOSE})")
        lines = [head, *cuts.get(_text(example["id"]), []), marked_text(tokenizer, input_ids, mask)]
        if token_ids:
            lines += [f"ids: {' '.join(map(str, input_ids.tolist()))}",
                      f"trained: {''.join('1' if m else '0' for m in mask.tolist())}"]
        yield "\n".join(lines)


def _cuts(run: Path, split: str, manifest: dict[str, Any], tokenizer, examples: list[dict]) -> dict[str, list[str]]:
    """What the build's cut took from each example that it cut, by record id: its record encoded again with
    the build's options (the stored ids alone cannot tell a conversation that lost whole turns from one that
    had no more). An example whose record encodes otherwise now gets no line (the build is checked to be
    the current prepare's, so only an edited template would do that)."""
    recorded = {**LEGACY_SETTINGS, **manifest["options"]}
    options = BuildOptions(**{f.name: recorded[f.name] for f in fields(BuildOptions) if f.name in recorded})
    template = get_template(manifest["template"], tokenizer)
    wanted = {_text(example["id"]): example for example in examples}
    records = {r.id: r for path in split_files(run, split) for r in read_records(path) if r.id in wanted}
    said: dict[str, list[str]] = {}
    for record_id, example in wanted.items():
        if record_id not in records:
            continue
        messages, encoded = encode_for_build(records[record_id], tokenizer, template, options)
        if not encoded.truncated or not np.array_equal(encoded.ids, np.asarray(example["input_ids"])):
            continue
        before = len(messages) - 1 - (messages[0].role == "system")  # the messages before the reply, system aside
        said[record_id] = [f"   cut to --max-length {options.max_length} by --truncation {options.truncation}: "
                           f"{', '.join(cut_phrases(encoded, before, options.truncation))}"]
    return said


def cut_phrases(encoded: Encoded, before: int, truncation: str) -> list[str]:
    """What a cut took from an example (`before`: the messages before its reply, the opening system message
    aside), in words; a lost system message with why `truncation` lost it, as `show --truncation` spells it."""
    notes = (f" ({encoded.system_dropped} of them system messages from inside the conversation)"
             if encoded.system_dropped else "")
    why = f" ({SYSTEM_LOST_WHY[truncation].format(option='--truncation ')})" if truncation in SYSTEM_LOST_WHY else ""
    return ([f"lost its {encoded.turns_dropped} oldest of {before} earlier messages{notes}"]
            if encoded.turns_dropped else []) + (["opens inside a turn"] if encoded.mid_turn else []) + \
        (["left out its opening system message whole (over half of the prompt's share)"] if encoded.system_left_out
         else [f"lost its opening system message, whole or in part{why}"] if encoded.system_cut else []) + \
        (["its reply cut away whole: no token left to train on (a longer max length keeps it)"]
         if encoded.reply_cut and not encoded.loss_mask.any() else
         ["its reply cut short (trained without its end-of-turn token)"] if encoded.reply_cut else [])


def show_pairs(pairs: Sequence[dict], where: str, checkpoint: Path, *, max_length: int = 256,
               truncation: str = "left", profile: str = "context", ids: Sequence[str] = (), limit: int = 3,
               token_ids: bool = False) -> Iterator[str]:
    """Text blocks for preference pairs as a preference run whose init is `checkpoint` reads them (its
    tokenizer and template; `max_length`, `truncation` and `profile` as data.max_length, truncation and
    profile): each side's rendered conversation with its trained tokens marked, and what a cut took. The pairs
    of `ids` (in the order given), or the first `limit`."""
    if ids:
        by_id = {pair["id"]: pair for pair in pairs}
        missing = [pair_id for pair_id in ids if pair_id not in by_id]
        if missing:
            raise ConfigError(f"{where}: no pair {missing[0]!r} (pair ids are each row's \"id\")")
        chosen = [by_id[pair_id] for pair_id in ids]
    else:
        chosen = list(pairs[:limit])
    tokenizer = checkpoint_tokenizer(checkpoint, model_required=False)
    template = get_template(choose_template(tokenizer, family=checkpoint_family(checkpoint), where=str(checkpoint)),
                            tokenizer)
    buckets = sorted({pair["bucket_id"] for pair in chosen})
    examples = tokenise_pairs(list(chosen), tokenizer, template, profile, max_length, buckets, truncation)
    position = {pair["id"]: number for number, pair in enumerate(pairs, start=1)}
    for pair, example in zip(chosen, examples):
        prompt = record_messages(Record.from_json(pair["record"]), profile, with_response=False,
                                 system=tokenizer.system_mode)
        before = len(prompt) - (bool(prompt) and prompt[0].role == "system")
        lines = [f"== pair {position[pair['id']]} of {len(pairs)}: {pair['id']} (bucket {pair['bucket_id']}, weight "
                 f"{float(pair.get('weight', 1.0)):.3f})"]
        for side, encoded in example.get("cuts", {}).items():
            lines.append(f"   {side} cut to max_length {max_length} by truncation {truncation}: "
                         f"{', '.join(cut_phrases(encoded, before, truncation))}")
        for side in SIDES:
            side_ids, mask = np.asarray(example[f"{side}_ids"]), np.asarray(example[f"{side}_mask"])
            lines += [f"-- {side} ({len(side_ids)} tokens, {int(mask.sum())} trained between {TRAINED_OPEN} "
                      f"{TRAINED_CLOSE})", marked_text(tokenizer, side_ids, mask)]
            if token_ids:
                lines += [f"ids: {' '.join(map(str, side_ids.tolist()))}",
                          f"trained: {''.join('1' if m else '0' for m in mask.tolist())}"]
        yield "\n".join(lines)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
