"""Feeding built examples to the trainer with grain, without TensorFlow.

The order of examples is global: epoch e visits the examples in a permutation drawn from (seed, e),
and an optimizer step takes the next `global_batch` of them, split into micro-batches. Each process
reads only its own contiguous slice of every micro-batch, so 1 process with 4 devices and 2 processes
with 2 devices each train on exactly the same batches. The iterator's state is one integer
(`next_index`), saved in every checkpoint.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from polyalign.inputs.build import dataset_dir


def open_split(run: Path, split: str):
    """The built split as a random-access source (tfds.data_source; no TensorFlow)."""
    import tensorflow_datasets as tfds

    return tfds.builder_from_directory(str(dataset_dir(run))).as_data_source(split=split)


def example_arrays(example: dict | None, length: int, pad_id: int) -> dict[str, np.ndarray]:
    """Next-token inputs and targets padded on the right to `length`. Padding needs no attention
    mask: causal attention never lets a real token see a later pad. `None` gives an empty filler
    example (weight 0) that completes a last, partial evaluation batch."""
    out = {
        "input_ids": np.full(length, pad_id, np.int32),
        "targets": np.full(length, pad_id, np.int32),
        "loss_mask": np.zeros(length, np.float32),
        "weight": np.float32(0.0),
        "bucket": np.int32(0),
        "valid": np.bool_(False),
        "length": np.int32(0),  # real (unpadded) input tokens
    }
    if example is None:
        return out
    ids = np.asarray(example["input_ids"], np.int32)[: length + 1]
    n = len(ids) - 1
    out["input_ids"][:n] = ids[:-1]
    out["targets"][:n] = ids[1:]
    out["loss_mask"][:n] = np.asarray(example["loss_mask"][1 : n + 1], np.float32)
    out["weight"] = np.float32(example["weight"])
    out["bucket"] = np.int32(example["bucket"])
    out["valid"] = np.bool_(True)
    out["length"] = np.int32(n)
    return out


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


def train_batches(source, layout: Layout, steps: int, length: int, pad_id: int, seed: int, convert=None):
    """grain dataset of per-process batches {key: [micro_batches, per_process, ...]}, one per step.
    `convert(example, length, pad_id)` turns a stored example into fixed-shape arrays (default: SFT's)."""
    convert = convert or example_arrays
    order = _EpochPermutations(len(source), seed)
    per_step = layout.micro_batches * layout.per_process
    return (grain.MapDataset.range(0, steps * per_step)
            .map(lambda k: convert(source[order(layout.global_position(k))], length, pad_id))
            .batch(layout.per_process)
            .batch(layout.micro_batches))


def eval_batches(source, batch_size: int, length: int, pad_id: int, process_index: int = 0,
                 process_count: int = 1, limit: int | None = None, convert=None):
    """Every example of `source` once (or a fixed random subset of `limit` examples, so that a capped
    evaluation still covers every bucket) as per-process batches {key: [1, per_process, ...]}; the
    last batch is completed with empty examples (valid = False)."""
    convert = convert or example_arrays
    total = len(source) if limit is None else min(limit, len(source))
    chosen = np.arange(total) if total == len(source) else np.sort(np.random.default_rng(0).permutation(len(source))[:total])
    layout = Layout(batch_size, 1, process_index, process_count)
    num_batches = -(-total // batch_size)

    def load(k: int):
        position = layout.global_position(k)
        return convert(source[int(chosen[position])] if position < total else None, length, pad_id)

    return (grain.MapDataset.range(0, num_batches * layout.per_process)
            .map(load).batch(layout.per_process).batch(1))


def iterate(dataset):
    """A checkpointable iterator (get_state / set_state) over a grain MapDataset, read in-process."""
    return iter(dataset.to_iter_dataset())
