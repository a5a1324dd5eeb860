"""`polyalign build`: prepared records to tokenised training examples, stored as a TFDS dataset in
array_record format (written and read without TensorFlow).

Each example holds the token ids of one rendered conversation, its loss mask (the response and its
end-of-turn token), its Bucket-SFT weight, its bucket index and its record id.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polyalign.bucketing import WeightOptions, bucket_weights
from polyalign.chat import PROFILE_MODES, TRAIN_ON, encode_conversation, get_template, record_messages
from polyalign.config import ConfigError
from polyalign.data.prepare import read_records
from polyalign.tokenizer import load_tokenizer

BUILD_DIR = "build"
DATASET_NAME = "sft_examples"
DATASET_VERSION = "1.0.0"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class BuildOptions:
    tokenizer: str | None = None  # directory or file; default RUN/tokenizer
    template: str | None = None  # default: the tokenizer's own (polyalign for polyalign's tokenizer)
    profile: str = "context"
    max_length: int = 512  # the METHOD section 8 cutoff
    train_on: str = "last"
    weights: WeightOptions = field(default_factory=WeightOptions)


def dataset_dir(run: Path) -> Path:
    return Path(run) / BUILD_DIR / DATASET_NAME / DATASET_VERSION


@functools.cache  # TFDS registers builder classes by name: define it once per process
def _builder_class():
    import tensorflow_datasets as tfds

    class SftExamples(tfds.core.GeneratorBasedBuilder):
        """Tokenised SFT examples of one polyalign run."""

        VERSION = tfds.core.Version(DATASET_VERSION)

        def __init__(self, *, generators, **kwargs):
            self._generators = generators
            super().__init__(**kwargs)

        def _info(self):
            features = tfds.features.FeaturesDict({
                "input_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                "loss_mask": tfds.features.Tensor(shape=(None,), dtype=np.uint8),
                "weight": np.float32,
                "bucket": np.int32,
                "id": tfds.features.Text(),
            })
            # Keep record order: shuffling happens at read time, from the training seed.
            return tfds.core.DatasetInfo(builder=self, features=features, disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(split) for split in self._generators}

        def _generate_examples(self, split):
            yield from self._generators[split]()

    SftExamples.name = DATASET_NAME
    return SftExamples


def build(run: Path, options: BuildOptions = BuildOptions(), progress: bool = True) -> dict[str, Any]:
    """Builds RUN/build/sft_examples from RUN/data/{train,val}.jsonl; returns the manifest (also written
    to RUN/build/manifest.json)."""
    run = Path(run)
    started = time.perf_counter()
    if options.profile not in PROFILE_MODES:
        raise ConfigError(f"profile must be one of {', '.join(PROFILE_MODES)}, got {options.profile!r}")
    if options.train_on not in TRAIN_ON:
        raise ConfigError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {options.train_on!r}")
    if options.max_length < 8:
        raise ConfigError(f"max_length {options.max_length} is too short for a chat template")
    records = {}
    for split in SPLITS:
        path = run / "data" / f"{split}.jsonl"
        if not path.is_file():
            raise ConfigError(f"{path}: missing; run `polyalign prepare` (or the demo's prepare stage) first")
        records[split] = read_records(path)
    tokenizer_path = Path(options.tokenizer) if options.tokenizer else run / "tokenizer"
    tokenizer = load_tokenizer(tokenizer_path)
    template_name = options.template or tokenizer.chat_template
    if template_name is None:
        raise ConfigError(f"{tokenizer_path}: the tokenizer names no chat template; pass one (polyalign, qwen, "
                          "llama3, gemma)")
    template = get_template(template_name)

    counts = Counter(r.bucket_id for r in records["train"])
    weights = bucket_weights(counts, options.weights)
    buckets = sorted({r.bucket_id for split in SPLITS for r in records[split]})
    bucket_index = {b: i for i, b in enumerate(buckets)}
    stats = {split: Counter() for split in SPLITS}

    def examples(split):
        from tqdm import tqdm

        def generate():
            for record in tqdm(records[split], desc=f"build {split}", unit="rec", disable=not progress, leave=False):
                encoded = encode_conversation(template, tokenizer, record_messages(record, options.profile),
                                              train_on=options.train_on, cutoff=options.max_length)
                stats[split]["examples"] += 1
                stats[split]["tokens"] += len(encoded.ids)
                stats[split]["target_tokens"] += int(encoded.loss_mask.sum())
                stats[split]["truncated"] += int(encoded.truncated)
                yield record.id, {
                    "input_ids": encoded.ids,
                    "loss_mask": encoded.loss_mask.astype(np.uint8),
                    # Buckets absent from train (val-only) have no Bucket-SFT weight; they count as 1.
                    "weight": np.float32(weights.get(record.bucket_id, 1.0)),
                    "bucket": np.int32(bucket_index[record.bucket_id]),
                    "id": record.id,
                }

        return generate

    out = run / BUILD_DIR
    if dataset_dir(run).exists():
        shutil.rmtree(dataset_dir(run))  # a rebuild replaces the dataset; TFDS would keep the old one
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()  # ours counts records; TFDS's would count its own phases
    builder = _builder_class()(generators={s: examples(s) for s in SPLITS}, data_dir=str(out),
                               file_format="array_record")
    with contextlib.redirect_stdout(io.StringIO()):  # TFDS prints download notices that do not apply
        builder.download_and_prepare()
    manifest = {
        "dataset": str(dataset_dir(run)),
        "tokenizer": str(tokenizer_path.resolve()),
        "vocab_size": tokenizer.vocab_size,
        "pad_id": tokenizer.pad_id,
        "template": template_name,
        "options": {**asdict(options), "tokenizer": str(tokenizer_path)},
        "buckets": buckets,
        "bucket_weights": {b: weights.get(b, 1.0) for b in buckets},
        "train_bucket_counts": dict(sorted(counts.items())),
        "splits": {split: dict(stats[split]) for split in SPLITS},
        "seconds": round(time.perf_counter() - started, 2),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest


def read_manifest(run: Path) -> dict[str, Any]:
    path = Path(run) / BUILD_DIR / "manifest.json"
    if not path.is_file():
        raise ConfigError(f"{path}: missing; run `polyalign build {run}` (or the demo's build stage) first")
    return json.loads(path.read_text())
