"""What packing preference pairs buys on real data: positions per pair and HDPO training throughput with
one pair per row pair (chosen and rejected rows of max_length) against rows of 2 x max_length holding
whole pairs as trees (data.pack=true: the prompt once, both responses seeing it).

The pairs are built from the demo's train records: each record's own response is chosen, the response
of the next record of the same bucket rejected (real text on both sides; a trained policy's
generations would take their place in a real run).

    python bench/pair_packing.py                    # the bundled demo data, max_length 256
    python bench/pair_packing.py --length 512 --batch 8 --steps 6

Prints a table and writes JSON to $OUT/pair_packing.json when OUT is set.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packing import timed_steps  # noqa: E402
from result_file import write_result  # noqa: E402

from polyalign.inputs import pipeline  # noqa: E402
from polyalign.inputs.pair_rows import tokenise_pairs, train_pair_batches, tree_spans  # noqa: E402
from polyalign.mesh import parallel  # noqa: E402
from polyalign.model import create_model  # noqa: E402
from polyalign.model.presets import preset  # noqa: E402
from polyalign.train.config import PreferenceConfig  # noqa: E402
from polyalign.train.preference import PreferenceObjective  # noqa: E402
from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def demo_pairs(directory: Path, length: int):
    """Tokenised pairs from the demo's train records, the tokenizer and the bucket list."""
    from polyalign.data.prepare import prepare
    from polyalign.data.records import read_records
    from polyalign.tokens.chat import get_template
    from polyalign.tokens.tokenizer_training import train_from_records

    prepare(REPO / "configs" / "data" / "demo.yaml", directory, progress=False)
    tokenizer, _ = train_from_records(directory / "data" / "train.jsonl", directory / "tokenizer", 8000)
    by_bucket = defaultdict(list)
    for record in read_records(directory / "data" / "train.jsonl"):
        by_bucket[record.bucket_id].append(record)
    pairs = [{"id": record.id, "bucket_id": bucket, "record": record.to_json(), "chosen": record.response,
              "rejected": other.response}
             for bucket, records in sorted(by_bucket.items()) for record, other in zip(records, records[1:])
             if record.response != other.response]
    buckets = sorted(by_bucket)
    return tokenise_pairs(pairs, tokenizer, get_template("polyalign"), "context", length, buckets), tokenizer, buckets


def measure(examples, tokenizer, buckets, pack: bool, args) -> dict:
    config = PreferenceConfig(method="hdpo", init="unused")
    loop = LoopConfig(steps=args.steps + 1, global_batch=args.batch)
    batches = pipeline.iterate(train_pair_batches(examples, pipeline.Layout(args.batch, 1), loop.steps, loop.seed,
                                                  args.length, tokenizer.pad_id, pack=pack))
    trainer = Trainer(create_model(preset("tiny", vocab_size=tokenizer.vocab_size)),
                      PreferenceObjective(config, len(buckets)), OptimizerConfig(lr=1e-5), loop, parallel.make_mesh())
    step_s, taken = timed_steps(trainer, batches, args.steps)
    pairs, real, positions = 0, 0, 0
    for batch in taken:
        pairs += int(batch["valid"].sum())
        if pack:
            real += int(batch["length"].sum())
            positions += batch["input_ids"].size
        else:
            for side in ("chosen", "rejected"):
                real += int((batch[f"{side}_inputs"] != tokenizer.pad_id).sum())
                positions += batch[f"{side}_inputs"].size
    return {"pack": pack, "step_s": round(step_s, 4), "pairs_per_step": pairs / args.steps,
            "fill": round(real / positions, 4), "pairs_per_s": round(pairs / args.steps / step_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=256, help="max_length of each side (the demo's)")
    parser.add_argument("--batch", type=int, default=8, help="pairs per step unpacked; rows per step packed")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        examples, tokenizer, buckets = demo_pairs(Path(scratch), args.length)
        spans = np.array([tree_spans(e, args.length) for e in examples])
        shared, chosen, rejected = spans.T
        rows = pipeline._PackedRows(chosen + rejected - shared, 2 * args.length, seed=0).rows_per_epoch()
        runs = [measure(examples, tokenizer, buckets, pack, args) for pack in (False, True)]
    print(f"{len(examples):,} pairs (max_length {args.length}): chosen {chosen.mean():.1f}, rejected "
          f"{rejected.mean():.1f} positions on average, {shared.mean():.1f} shared ({(shared > 0).mean():.0%} of pairs "
          f"share a prefix); {2 * args.length} positions per pair unpacked, "
          f"{(chosen + rejected - shared).mean():.1f} as a tree; an epoch is {len(examples):,} row pairs unpacked, "
          f"{rows:,} packed rows; {jax.devices()[0].device_kind}")
    print(f"{'rows':10s} {'step s':>8s} {'pairs/step':>11s} {'fill':>6s} {'pairs/s':>8s}")
    for r in runs:
        print(f"{'packed' if r['pack'] else 'one each':10s} {r['step_s']:8.3f} {r['pairs_per_step']:11.1f} "
              f"{r['fill']:6.2f} {r['pairs_per_s']:8.2f}")
    speedup = runs[1]["pairs_per_s"] / runs[0]["pairs_per_s"]
    print(f"packing pairs: {speedup:.2f}x pairs per second")
    result = {"pairs": len(examples), "max_length": args.length,
              "mean_positions": {"chosen": float(chosen.mean()), "rejected": float(rejected.mean()),
                                 "shared": float(shared.mean())},
              "share_a_prefix": float((shared > 0).mean()),
              "rows_per_epoch": {"unpacked": len(examples), "packed": rows},
              "runs": runs, "speedup": speedup, "device": jax.devices()[0].device_kind}
    write_result("pair_packing", result)


if __name__ == "__main__":
    main()
