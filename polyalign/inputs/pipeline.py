"""Feeding built examples to the trainer with grain, without TensorFlow.

The order of examples is global: epoch e visits the examples in a permutation drawn from (seed, e),
and an optimizer step takes the next `global_batch` of them, split into micro-batches. Each process
reads only its own contiguous slice of every micro-batch, so 1 process with 4 devices and 2 processes
with 2 devices each train on exactly the same batches. The iterator's state is one integer
(`next_index`), saved in every checkpoint.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyalign.core.paths import as_path
from polyalign.core.yaml_config import ConfigError


def open_split(run: Path, split: str):
    """The built split as a random-access source (tfds.data_source; no TensorFlow)."""
    import tensorflow_datasets as tfds  # heavy: tensorflow_datasets; the array layouts need only NumPy

    from polyalign.inputs.build import dataset_dir  # heavy: jax (inputs.build); the array layouts need only NumPy

    folder = dataset_dir(run)
    try:
        builder = tfds.builder_from_directory(str(folder))
        # array_record opens a shard at its first read: a missing one is said here, not mid-run
        missing = [path.name for path in builder.info.splits[split].filepaths if not path.exists()]
        if missing:
            raise FileNotFoundError(f"{', '.join(missing)} missing")
        source = builder.as_data_source(split=split)
    except Exception as err:  # TFDS and array_record raise many kinds for a folder missing a file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{folder}: the build is damaged or incomplete ({first[:200]}); run "
                          f"`polyalign build {run} --overwrite`") from None
    return source


def packed_arrays(examples: list[dict], length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Next-token rows of `length` positions holding `examples` one after another (packing), padded on
    the right. Each example keeps its own positions (from 0) and segment id (1, 2, ...; padding is 0),
    so attention never crosses examples and every example's log-probs equal its unpacked ones. Token
    arrays carry what the SFT loss needs per position: the example's Bucket-SFT weight, its bucket, and
    1 / (its labelled tokens) on labelled positions, which turns a sum over tokens into the sum of
    per-example mean NLLs. An empty list gives a filler row (weight 0) for a partial evaluation batch."""
    out = {
        "input_ids": np.full(length, pad_id, np.int32),
        "targets": np.full(length, pad_id, np.int32),
        "loss_mask": np.zeros(length, np.float32),
        "positions": np.zeros(length, np.int32),
        "segment_ids": np.zeros(length, np.int32),
        "token_weight": np.zeros(length, np.float32),
        "token_scale": np.zeros(length, np.float32),
        "token_bucket": np.zeros(length, np.int32),
        "example_start": np.zeros(length, np.float32),
        "weight": np.float32(0.0),  # the row's total Bucket-SFT weight
        "examples": np.float32(0.0),
        "bucket": np.int32(0),  # the first example's bucket (per-row bookkeeping)
        "valid": np.bool_(False),
        "length": np.int32(0),  # real (unpadded) input tokens
    }
    start = 0
    for segment, example in enumerate(examples, start=1):
        ids = np.asarray(example["input_ids"], np.int32)[: length - start + 1]
        n = len(ids) - 1
        if n <= 0:
            continue
        span = slice(start, start + n)
        mask = np.asarray(example["loss_mask"][1: n + 1], np.float32)
        out["input_ids"][span], out["targets"][span], out["loss_mask"][span] = ids[:-1], ids[1:], mask
        out["positions"][span] = np.arange(n)
        out["segment_ids"][span] = segment
        out["token_weight"][span] = example["weight"]
        out["token_scale"][span] = mask / max(mask.sum(), 1.0)
        out["token_bucket"][span] = example["bucket"]
        out["example_start"][start] = 1.0
        if segment == 1:
            out["bucket"] = np.int32(example["bucket"])
        out["weight"] += np.float32(example["weight"])
        out["examples"] += np.float32(1.0)
        start += n
    out["valid"] = np.bool_(out["examples"] > 0)
    out["length"] = np.int32(start)
    return out


def example_arrays(example: dict | None, length: int, pad_id: int) -> dict[str, np.ndarray]:
    """One example per row, padded on the right to `length` (`None`: a filler row). The row carries no
    segment ids: causal attention alone never lets a real token see a later pad, so the model runs the
    fused kernels' plain causal path, with no [T, T] mask."""
    arrays = packed_arrays([] if example is None else [example], length, pad_id)
    del arrays["segment_ids"]
    return arrays


@dataclass(frozen=True)
class Layout:
    """How a global batch is cut: `micro_batches` micro-batches of `micro_batch_size` sequences, each
    split evenly over `process_count` processes."""

    global_batch: int
    micro_batches: int
    process_index: int = 0
    process_count: int = 1

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // self.micro_batches

    @property
    def per_process(self) -> int:
        return self.micro_batch_size // self.process_count

    def global_position(self, local: int) -> int:
        """The position in the global order of this process's `local`-th example."""
        micro, offset = divmod(local, self.per_process)
        return micro * self.micro_batch_size + self.process_index * self.per_process + offset


class _EpochPermutations:
    """position in the endless global order -> example index."""

    def __init__(self, num_examples: int, seed: int):
        self.num_examples, self.seed = num_examples, seed

    @functools.lru_cache(maxsize=4)
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def __call__(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_examples)
        return int(self._permutation(epoch)[offset])


def first_fit(order, lengths: np.ndarray, length: int, window: int = 16,
              max_items: int | None = None) -> list[list[int]]:
    """Rows of at most `length` positions (and `max_items` examples) holding the examples of `order`:
    each joins the first of the open rows it fits in, or opens a new one; when more than `window` rows
    are open the oldest is closed. Lengths are taken as given (cut them to `length` first)."""
    max_items = max_items or len(lengths)
    open_rows: list[list] = []  # [used positions, example indices]
    rows: list[list[int]] = []
    for i in np.asarray(order).tolist():
        n = int(lengths[i])
        for slot, row in enumerate(open_rows):
            if row[0] + n <= length:
                row[0] += n
                row[1].append(i)
                if len(row[1]) == max_items:
                    rows.append(open_rows.pop(slot)[1])
                break
        else:
            open_rows.append([n, [i]])
            if len(open_rows) > window or max_items == 1:
                rows.append(open_rows.pop(0)[1])
    rows.extend(row for _, row in open_rows)
    return rows


class _PackedRows:
    """position in the endless global order of packed rows -> the example indices in that row.

    Epoch e packs the permutation drawn from (seed, e) with `first_fit` over a window of open rows: the
    window keeps the epoch's order local while filling rows far better than closing a row at the first
    example that does not fit. Examples longer than a row are truncated to it, as unpacked. A row holds
    at most `max_items` examples when set (the fixed number of per-row slots a batch format may have).
    Only lengths are needed, so every process computes the same rows."""

    def __init__(self, lengths: np.ndarray, length: int, seed: int, window: int = 16, max_items: int | None = None):
        self.lengths, self.length, self.seed, self.window = np.minimum(lengths, length), length, seed, window
        self.max_items = max_items
        self._packed: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # epoch -> (examples row after row, row starts)
        self._first_row = [0]  # global index of each counted epoch's first row

    def _pack(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
        rows = first_fit(order, self.lengths, self.length, self.window, self.max_items)
        members = np.fromiter((i for row in rows for i in row), np.int64, count=len(order))
        return members, np.cumsum([0] + [len(row) for row in rows])

    def _rows_of(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """An epoch's rows. Epochs before the one just packed and its predecessor are dropped (memory
        stays bounded over many epochs); one asked for again is packed again, identically."""
        if epoch not in self._packed:
            self._packed[epoch] = self._pack(epoch)
            for old in [e for e in self._packed if e < epoch - 1]:
                del self._packed[old]
        return self._packed[epoch]

    def __call__(self, row: int) -> list[int]:
        while row >= self._first_row[-1]:
            starts = self._rows_of(len(self._first_row) - 1)[1]
            self._first_row.append(self._first_row[-1] + len(starts) - 1)
        epoch = int(np.searchsorted(self._first_row, row, side="right")) - 1
        members, starts = self._rows_of(epoch)
        offset = row - self._first_row[epoch]
        return [int(i) for i in members[starts[offset]:starts[offset + 1]]]

    def rows_per_epoch(self) -> int:
        self(0)
        return self._first_row[1]


def packed_rows_per_epoch(lengths: np.ndarray, length: int, seed: int, max_items: int | None = None) -> int:
    """How many rows of `length` positions the first epoch's examples fill, packed as training packs them."""
    return _PackedRows(lengths, length, seed, max_items=max_items).rows_per_epoch()


def packing_note(lengths: np.ndarray, length: int, seed: int, global_batch: int | None = None) -> str:
    """What packing does to the first epoch: how many rows its examples fill, and the share of positions
    that hold tokens packed and unpacked (examples cut to `length` as training cuts them). With most
    examples as long as a row already, packing gains little, and this says so before any step. With
    `global_batch`, how many examples a step of that many rows takes (packed_batch_note)."""
    cut = np.minimum(lengths, length)
    rows = packed_rows_per_epoch(lengths, length, seed)
    packed, unpacked = cut.sum() / (rows * length), cut.sum() / (len(cut) * length)
    # cut to the build's max_length: an example's positions are its tokens less one, so it fills all but one
    full = int((lengths >= length - 1).sum())
    return (f"data.pack: an epoch's {len(cut):,} examples fill {rows:,} row{'s' * (rows != 1)} of {length} positions "
            f"({len(cut) / rows:.2f} a row; {packed:.0%} of positions hold tokens, against {unpacked:.0%} unpacked"
            + (f"; {full:,} examples ({full / len(cut):.0%}) fill a row alone (as long as it, or cut to it)"
               if full else "") + ")" + packed_batch_note(len(cut) / rows, global_batch, "examples"))


def packed_batch_note(per_row: float, global_batch: int | None, what: str) -> str:
    """How much a packed step trains on: train.global_batch counts rows, so a step takes about `per_row`
    times as many `what` as unpacked, a different run (a user's packed HDPO validated at 0.927 against
    0.873); the global batch that takes as many a step as unpacked is said beside it."""
    if global_batch is None or per_row < 1.005:
        return ""
    same = max(1, round(global_batch / per_row))
    closer = f" (train.global_batch={same} takes about as many packed)" if same != global_batch else ""
    return (f"; train.global_batch counts rows: a step of {global_batch} takes about {global_batch * per_row:.1f} "
            f"{what} where unpacked it takes {global_batch}{closer}")


def lengths_cache(run, split: str):
    """Where example_lengths keeps a split's lengths: inside the built dataset, so a rebuild drops them."""
    from polyalign.inputs.build import dataset_dir  # heavy: jax (inputs.build); the array layouts need only NumPy

    return dataset_dir(run) / f"lengths-{split}.npy"


def example_lengths(source, cache=None, write_cache: bool = True) -> np.ndarray:
    """Next-token positions of every stored example (its ids minus one), for packing. Getting them
    means reading every example (about 20k a second on one core: minutes for millions), so with
    `cache` (a .npy path inside the built dataset, which a rebuild removes) they are read from there
    when it holds one length per example, else computed and, with `write_cache`, saved there."""
    if cache is not None:
        cache = as_path(cache)
        if cache.is_file():
            lengths = np.load(io.BytesIO(cache.read_bytes()), allow_pickle=False)
            if lengths.shape == (len(source),):
                return lengths
    lengths = np.array([len(source[i]["input_ids"]) - 1 for i in range(len(source))], np.int64)
    if cache is not None and write_cache:
        buffer = io.BytesIO()
        np.save(buffer, lengths, allow_pickle=False)
        partial = cache.parent / f".{cache.name}.partial"
        partial.write_bytes(buffer.getvalue())
        partial.replace(cache)  # whole or absent, never half-written
    return lengths


def train_batches(source, layout: Layout, steps: int, length: int, pad_id: int, seed: int, convert=None,
                  pack: bool = False, lengths: np.ndarray | None = None, max_per_row: int | None = None):
    """grain dataset of per-process batches {key: [micro_batches, per_process, ...]}, one per step.
    `convert(example, length, pad_id)` turns a stored example into fixed-shape arrays (default: SFT's).
    With `pack`, each of the batch's rows holds as many consecutive examples of the global order as fit
    in `length` positions (at most `max_per_row`) and `convert(examples, length, pad_id)` takes the
    row's list (default: SFT's packed_arrays); `lengths` are the examples' positions (default: SFT's,
    read from `source`). A step then takes `global_batch` rows."""
    per_step = layout.micro_batches * layout.per_process
    if pack:
        convert = convert or packed_arrays
        rows = _PackedRows(example_lengths(source) if lengths is None else lengths, length, seed,
                           max_items=max_per_row)

        def load(k):
            return convert([source[i] for i in rows(layout.global_position(k))], length, pad_id)
    else:
        convert = convert or example_arrays
        order = _EpochPermutations(len(source), seed)

        def load(k):
            return convert(source[order(layout.global_position(k))], length, pad_id)
    import grain  # imported here so that the array layouts above need nothing beyond NumPy

    return (grain.MapDataset.range(0, steps * per_step)
            .map(load)
            .batch(layout.per_process)
            .batch(layout.micro_batches))


def capped_subset(buckets: np.ndarray, limit: int, seed: int = 0) -> np.ndarray:
    """Indices of `limit` examples taken in turn from every bucket (a seeded order within each), in file
    order: a capped validation covers every bucket it can (all of them once `limit` reaches their number),
    where a random subset of a skewed split would leave its small buckets out."""
    rng = np.random.default_rng(seed)
    queues = [rng.permutation(np.flatnonzero(buckets == b)) for b in np.unique(buckets)]
    taken = [queue[k] for k in range(max(map(len, queues), default=0)) for queue in queues if k < len(queue)]
    return np.sort(np.asarray(taken[:limit], np.int64))


def example_buckets(source) -> np.ndarray:
    """Every stored example's bucket index, in order: what capped_subset takes its turns over."""
    return np.array([int(np.asarray(source[i]["bucket"])) for i in range(len(source))])


def capped_pairs(pairs: list[dict], limit: int | None) -> list[dict]:
    """At most `limit` validation pairs, taken in turn from every bucket (capped_subset), in file order."""
    if limit is None or len(pairs) <= limit:
        return pairs
    return [pairs[i] for i in capped_subset(np.array([p["bucket_id"] for p in pairs]), limit)]


def eval_batches(source, batch_size: int, length: int, pad_id: int, process_index: int = 0,
                 process_count: int = 1, limit: int | None = None, convert=None, buckets: np.ndarray | None = None):
    """Every example of `source` once (or, with `limit`, that many: capped_subset over `buckets`, the
    examples' bucket indices, read here when not given, so that a capped evaluation covers every bucket it
    can) as per-process batches {key: [1, per_process, ...]}; the last batch is completed with empty
    examples (valid = False)."""
    convert = convert or example_arrays
    total = len(source) if limit is None else min(limit, len(source))
    chosen = (np.arange(total) if total == len(source)
              else capped_subset(example_buckets(source) if buckets is None else buckets, total))
    layout = Layout(batch_size, 1, process_index, process_count)
    num_batches = -(-total // batch_size)

    def load(k: int):
        position = layout.global_position(k)
        return convert(source[int(chosen[position])] if position < total else None, length, pad_id)

    import grain  # heavy: grain imports jax; the array layouts need only NumPy

    return (grain.MapDataset.range(0, num_batches * layout.per_process)
            .map(load).batch(layout.per_process).batch(1))


def iterate(dataset):
    """A checkpointable iterator (get_state / set_state) over a grain MapDataset, read in-process."""
    return iter(dataset.to_iter_dataset())
