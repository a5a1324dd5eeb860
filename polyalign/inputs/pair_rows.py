"""Preference pairs as training batches: each pair tokenised with its prompt, then laid out either as
a row pair (chosen and rejected rows of max_length, stacked on the batch axis by the objective) or,
packed, as trees in rows of 2 x max_length (the prompt once, both continuations after it)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from polyalign.data.records import Record
from polyalign.inputs import pipeline
from polyalign.tokens.chat import Message, encode_conversation, record_messages

SIDES = ("chosen", "rejected")


def tokenise_pairs(pairs: list[dict], tokenizer, template, profile: str, max_length: int,
                   buckets: list[str], truncation: str = "left") -> list[dict]:
    """Each pair's two sides as token ids and loss masks, cut to `max_length` as encode_conversation cuts
    (`truncation`: left from the prompt's start, keep_system after its opening system message, turns by its
    oldest whole turns: as many as the side with the longer answer drops, and its opening system message where
    that side leaves it out, so both answer one conversation)."""
    index = {b: i for i, b in enumerate(buckets)}
    examples = []
    for pair in pairs:
        prompt = record_messages(Record.from_json(pair["record"]), profile, with_response=False,
                                 system=tokenizer.system_mode)
        example = {"id": pair["id"], "bucket": index[pair["bucket_id"]], "weight": float(pair.get("weight", 1.0)),
                   "critic_chosen": float(pair.get("critic_chosen", 0.0)),
                   "critic_rejected": float(pair.get("critic_rejected", 0.0))}
        sides = {side: encode_conversation(template, tokenizer, [*prompt, Message("assistant", pair[side])],
                                           cutoff=max_length, truncation=truncation) for side in SIDES}
        dropped = max(encoded.turns_dropped for encoded in sides.values())
        left_out = any(encoded.system_left_out for encoded in sides.values())
        head = int(bool(prompt) and prompt[0].role == "system")
        for side in SIDES:
            encoded = sides[side]
            if encoded.turns_dropped < dropped or encoded.system_left_out < left_out:
                # the longer answer's smaller prompt share dropped more turns, or its opening system message:
                # both sides answer the same conversation
                kept = [*prompt[:head * (not left_out)], *prompt[head + dropped:]]
                again = encode_conversation(template, tokenizer, [*kept, Message("assistant", pair[side])],
                                            cutoff=max_length, truncation=truncation)
                encoded = replace(again, truncated=True, turns_dropped=dropped, system_left_out=left_out,
                                  system_cut=again.system_cut or left_out,
                                  system_dropped=sum(m.role == "system" for m in prompt[head:head + dropped]))
            example[f"{side}_ids"], example[f"{side}_mask"] = encoded.ids, encoded.loss_mask
            if encoded.truncated:  # what the cut took, for `polyalign show`'s line (the same arrays: no copy)
                example.setdefault("cuts", {})[side] = encoded
            # whether a side was cut to max_length, and whether that cut into its opening system message
            example["truncated"] = example.get("truncated", False) or encoded.truncated
            example["system_cut"] = example.get("system_cut", False) or encoded.system_cut
        examples.append(example)
    return examples


def pair_arrays(example: dict | None, length: int, pad_id: int) -> dict[str, np.ndarray]:
    out = {"weight": np.float32(0.0), "bucket": np.int32(0), "valid": np.bool_(False),
           "critic_chosen": np.float32(0.0), "critic_rejected": np.float32(0.0),
           "ref_chosen": np.float32(0.0), "ref_rejected": np.float32(0.0)}
    for side in SIDES:
        sft_like = None if example is None else {"input_ids": example[f"{side}_ids"],
                                                 "loss_mask": example[f"{side}_mask"], "weight": 0.0, "bucket": 0}
        arrays = pipeline.example_arrays(sft_like, length, pad_id)
        out[f"{side}_inputs"], out[f"{side}_targets"], out[f"{side}_mask"] = (
            arrays["input_ids"], arrays["targets"], arrays["loss_mask"])
        out[f"{side}_length"] = arrays["length"]
    if example is not None:
        out.update(weight=np.float32(example["weight"]), bucket=np.int32(example["bucket"]), valid=np.bool_(True),
                   critic_chosen=np.float32(example["critic_chosen"]),
                   critic_rejected=np.float32(example["critic_rejected"]),
                   ref_chosen=np.float32(example.get("ref_chosen", 0.0)),
                   ref_rejected=np.float32(example.get("ref_rejected", 0.0)))
    return out


PAIR_FIELDS = ("weight", "bucket", "valid", "critic_chosen", "critic_rejected", "ref_chosen", "ref_rejected")
# The two layouts a preference batch comes in, each by the exact fields it carries: row pairs (pair_arrays)
# and rows of tree-packed pairs (packed_pair_arrays).
ROW_PAIRS = frozenset({*PAIR_FIELDS, *(f"{side}_{part}" for side in SIDES
                                       for part in ("inputs", "targets", "mask", "length"))})
TREE_ROWS = frozenset({*PAIR_FIELDS, "input_ids", "targets", "positions", "segment_ids", "branch_ids", "chosen_mask",
                       "rejected_mask", "length"})


def is_packed(batch) -> bool:
    """Whether a preference batch is rows of tree-packed pairs (else row pairs), from its fields, which
    must be exactly one layout's: a batch of neither is refused with what it lacks."""
    keys = set(batch)
    if keys == TREE_ROWS or keys == ROW_PAIRS:
        return keys == TREE_ROWS
    closest = min((ROW_PAIRS, TREE_ROWS), key=lambda fields: len(fields ^ keys))
    raise ValueError(f"not a preference batch layout: missing {sorted(closest - keys)}, unexpected "
                     f"{sorted(keys - closest)}")


def tree_spans(example: dict, length: int) -> tuple[int, int, int]:
    """(shared, chosen, rejected) next-token positions of a pair laid out as a tree: both sequences
    agree on their first `shared` positions (input and target: the prompt, and any common start of
    the responses), then each side continues on its own. Sequences are cut to `length` positions as
    unpacked."""
    chosen = np.asarray(example["chosen_ids"][: length + 1])
    rejected = np.asarray(example["rejected_ids"][: length + 1])
    n = min(len(chosen), len(rejected))
    differs = np.flatnonzero(chosen[:n] != rejected[:n])
    common = int(differs[0]) if len(differs) else n
    return max(common - 1, 0), max(len(chosen) - 1, 0), max(len(rejected) - 1, 0)


def tree_length(example: dict, length: int) -> int:
    """Positions a pair takes in a packed row: the shared prefix once, then both continuations."""
    shared, chosen, rejected = tree_spans(example, length)
    return chosen + rejected - shared


def _next_token_arrays(example: dict, side: str, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One side's inputs, targets and loss mask, cut to `length` positions as unpacked."""
    ids = np.asarray(example[f"{side}_ids"][: length + 1], np.int32)
    return ids[:-1], ids[1:], np.asarray(example[f"{side}_mask"][1: length + 1], np.float32)


def packed_pair_arrays(examples: list[dict], row_length: int, pad_id: int, slots: int,
                       length: int) -> dict[str, np.ndarray]:
    """One row of `row_length` positions holding `examples` (at most `slots` pairs) as trees: pair k
    is segment k + 1; its shared prefix is branch 0, the chosen continuation branch 1 and the rejected
    one branch 2, each branch with the positions it has unpacked. chosen_mask / rejected_mask mark the
    positions whose log-probs sum to each side's sequence log-prob (a shared labelled position counts
    for both). Per-pair fields are [slots] arrays; empty slots have valid = False."""
    out = {"input_ids": np.full(row_length, pad_id, np.int32), "targets": np.full(row_length, pad_id, np.int32),
           "positions": np.zeros(row_length, np.int32), "segment_ids": np.zeros(row_length, np.int32),
           "branch_ids": np.zeros(row_length, np.int32), "chosen_mask": np.zeros(row_length, np.float32),
           "rejected_mask": np.zeros(row_length, np.float32), "length": np.int32(0)}
    out.update({key: np.zeros(slots, np.float32) for key in PAIR_FIELDS})
    out.update(bucket=np.zeros(slots, np.int32), valid=np.zeros(slots, bool))
    if len(examples) > slots:
        raise ValueError(f"{len(examples)} pairs for a row of {slots} slots")
    start = 0
    for slot, example in enumerate(examples):
        shared, n_chosen, n_rejected = tree_spans(example, length)
        if start + n_chosen + n_rejected - shared > row_length:
            raise ValueError(f"pair {example['id']!r} does not fit a row of {row_length} positions")
        chosen, rejected = (_next_token_arrays(example, side, length) for side in SIDES)
        # (branch, positions, the side whose tokens they are, the sums they count in): the prefix counts
        # for each side as that side labels it
        parts = [(0, slice(0, shared), chosen, {"chosen_mask": chosen[2], "rejected_mask": rejected[2]}),
                 (1, slice(shared, n_chosen), chosen, {"chosen_mask": chosen[2]}),
                 (2, slice(shared, n_rejected), rejected, {"rejected_mask": rejected[2]})]
        for branch, part, (inputs, targets, _), masks in parts:
            span = slice(start, start + part.stop - part.start)
            out["input_ids"][span], out["targets"][span] = inputs[part], targets[part]
            out["positions"][span] = np.arange(part.start, part.stop)
            out["segment_ids"][span], out["branch_ids"][span] = slot + 1, branch
            for key, mask in masks.items():
                out[key][span] = mask[part]
            start = span.stop
        for key in PAIR_FIELDS:
            out[key][slot] = example.get(key, 0.0)
        out["valid"][slot] = True
    out["length"] = np.int32(start)
    return out


MAX_PAIRS_PER_ROW = 64


def pair_slots(lengths: np.ndarray, row_length: int) -> int:
    """Pair slots of a packed row: as many of the shortest pairs as a row holds, at most 64."""
    return int(min(MAX_PAIRS_PER_ROW, max(1, row_length // max(int(lengths.min()), 1))))


def ordered_pair_rows(examples: list[dict], length: int, pad_id: int, pack: bool = False):
    """Every pair in rows for a forward-only pass, in the pairs' order: the rows (lists of pair
    indices) and a function making a row's arrays (None makes the empty row that pads a batch).
    Packed, rows are first-fit as training packs them."""
    if pack:
        lengths = np.array([tree_length(e, length) for e in examples], np.int64)
        slots = pair_slots(lengths, 2 * length)
        rows = pipeline.first_fit(np.arange(len(examples)), lengths, 2 * length, max_items=slots)

        def arrays_of(row: list[int] | None) -> dict[str, np.ndarray]:
            return packed_pair_arrays([] if row is None else [examples[i] for i in row], 2 * length, pad_id, slots,
                                      length)
    else:
        rows = [[i] for i in range(len(examples))]

        def arrays_of(row: list[int] | None) -> dict[str, np.ndarray]:
            return pair_arrays(None if row is None else examples[row[0]], length, pad_id)

    return rows, arrays_of


def pair_packing_note(examples: list[dict], max_length: int, seed: int, global_batch: int | None = None) -> str:
    """What `data.pack` does to the first epoch of pairs: the rows of 2 x max_length positions its pairs fill,
    and the share of positions that hold tokens packed (each prompt once) and unpacked (a row of max_length
    for each side, the prompt in both). Each pair's loss and gradient are the same either way; a step of
    `global_batch` rows holds more pairs (pipeline.packed_batch_note)."""
    spans = np.array([tree_spans(e, max_length) for e in examples], np.int64).reshape(-1, 3)
    trees = spans[:, 1] + spans[:, 2] - spans[:, 0]
    slots = pair_slots(trees, 2 * max_length)
    rows = pipeline.packed_rows_per_epoch(trees, 2 * max_length, seed, max_items=slots)
    packed = trees.sum() / (rows * 2 * max_length)
    unpacked = (spans[:, 1] + spans[:, 2]).sum() / (len(spans) * 2 * max_length)
    return (f"data.pack: an epoch's {len(spans):,} pairs fill {rows:,} row{'s' * (rows != 1)} of {2 * max_length} "
            f"positions ({len(spans) / rows:.2f} a row, at most {slots}; each prompt once): {packed:.0%} of positions "
            f"hold tokens, against {unpacked:.0%} unpacked (a row of {max_length} a side); each pair's loss is the "
            "one it has unpacked" + pipeline.packed_batch_note(len(spans) / rows, global_batch, "pairs"))


def train_pair_batches(examples: list[dict], layout: pipeline.Layout, steps: int, seed: int, max_length: int,
                       pad_id: int, pack: bool = False):
    """The training batches: one pair per row pair (chosen and rejected rows of max_length), or packed,
    rows of 2 x max_length positions holding whole pairs as trees (a pair always fits)."""
    if not pack:
        return pipeline.train_batches(examples, layout, steps, max_length, pad_id, seed, convert=pair_arrays)
    row_length = 2 * max_length
    lengths = np.array([tree_length(e, max_length) for e in examples], np.int64)
    slots = pair_slots(lengths, row_length)

    def convert(row: list[dict], length: int, pad: int):
        return packed_pair_arrays(row, length, pad, slots, max_length)

    return pipeline.train_batches(examples, layout, steps, row_length, pad_id, seed, convert=convert,
                                  pack=True, lengths=lengths, max_per_row=slots)
