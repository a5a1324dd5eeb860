"""`polyalign show RUN`: built examples as training reads them, decoded: the rendered conversation with
the trained tokens (the loss mask) marked, the record's bucket and Bucket-SFT weight, and on request the
token ids. What `build` stored is shown, not a second rendering of the record, so that what a user reads
is what the model trains on."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyalign.core.yaml_config import ConfigError
from polyalign.inputs.build import build_tokenizer_path, read_manifest
from polyalign.inputs.pipeline import open_split
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
    SentencePiece span would lose the space its first piece carries, and a split character its bytes."""
    ids = [int(i) for i in ids]
    parts, before = [], ""
    for start, end, trained in spans(mask):
        upto = tokenizer.decode(ids[:end])
        # a prefix that decodes otherwise once more pieces follow (bytes joining into one character): the span alone
        text = upto[len(before):] if upto.startswith(before) else tokenizer.decode(ids[start:end])
        parts.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained else text)
        before = upto
    return "".join(parts)


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
            raise ConfigError(f"{run}: no {split} example of record {missing[0]!r} (build keeps the train and val "
                              "splits; record ids are in RUN/data/SPLIT.jsonl)")
        indices = list(wanted.values())
    else:
        indices = list(range(min(limit, total)))
    buckets, options = manifest["buckets"], manifest.get("options", {})
    for index in indices:
        example = source[index]
        input_ids, mask = np.asarray(example["input_ids"]), np.asarray(example["loss_mask"])
        bucket = buckets[int(example["bucket"])]
        # an example as long as the build's cut was (almost always) longer, and cut as --truncation says
        cut = (f", cut to --max-length by --truncation {options.get('truncation', 'left')}"
               if len(input_ids) >= options.get("max_length", float("inf")) else "")
        head = (f"== {split} example {index + 1} of {total}: {_text(example['id'])} (bucket {bucket}, weight "
                f"{float(example['weight']):.3f}; {len(input_ids)} tokens{cut}, {int(mask.sum())} trained between "
                f"{TRAINED_OPEN} {TRAINED_CLOSE})")
        lines = [head, marked_text(tokenizer, input_ids, mask)]
        if token_ids:
            lines += [f"ids: {' '.join(map(str, input_ids.tolist()))}",
                      f"trained: {''.join('1' if m else '0' for m in mask.tolist())}"]
        yield "\n".join(lines)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
