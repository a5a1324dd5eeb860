"""What packing buys on real data: row fill and training throughput of Bucket-SFT with one example per
row against packed rows (data.pack=true), on the same model, batch shape and examples.

    python bench/packing.py                       # builds the bundled demo data in a temporary folder
    python bench/packing.py --run RUN --length 512 --steps 6

Prints a table and writes JSON to $OUT/packing.json when OUT is set.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_file import write_result  # noqa: E402

from polyalign.inputs import pipeline  # noqa: E402
from polyalign.inputs.build import build  # noqa: E402
from polyalign.inputs.built import BuildOptions, read_manifest  # noqa: E402
from polyalign.mesh import parallel  # noqa: E402
from polyalign.model import create_model  # noqa: E402
from polyalign.model.presets import preset  # noqa: E402
from polyalign.train.sft import SftObjective  # noqa: E402
from polyalign.train.trainer import LoopConfig, OptimizerConfig, Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def demo_run(directory: Path, length: int) -> Path:
    from polyalign.data.prepare import prepare
    from polyalign.tokens.tokenizer_training import train_from_records

    prepare(REPO / "configs" / "data" / "demo.yaml", directory, progress=False)
    train_from_records(directory / "data" / "train.jsonl", directory / "tokenizer", 8000)
    build(directory, BuildOptions(max_length=length), progress=False)
    return directory


def timed_steps(trainer: Trainer, batches, steps: int) -> tuple[float, list[dict]]:
    """The median seconds of `steps` trainer steps, after one step that compiles, and their batches."""
    jax.block_until_ready(trainer.step(next(batches))["loss"])
    times, taken = [], []
    for _ in range(steps):
        batch = next(batches)
        started = time.perf_counter()
        jax.block_until_ready(trainer.step(batch)["loss"])
        times.append(time.perf_counter() - started)
        taken.append(batch)
    return statistics.median(times), taken


def measure(run: Path, pack: bool, args) -> dict:
    manifest = read_manifest(run)
    length = manifest["options"]["max_length"]
    source = pipeline.open_split(run, "train")
    layout = pipeline.Layout(args.batch, 1)
    batches = pipeline.iterate(pipeline.train_batches(source, layout, args.steps + 1, length, manifest["pad_id"],
                                                      seed=0, pack=pack))
    cfg = preset("tiny", vocab_size=manifest["vocab_size"])
    trainer = Trainer(create_model(cfg), SftObjective(len(manifest["buckets"])), OptimizerConfig(lr=1e-4),
                      LoopConfig(steps=args.steps + 1, global_batch=args.batch), parallel.make_mesh())
    step_s, taken = timed_steps(trainer, batches, args.steps)
    examples, real, target = (sum(int(b[key].sum()) for b in taken) for key in ("examples", "length", "loss_mask"))
    per_step = examples / args.steps
    return {"pack": pack, "step_s": round(step_s, 4), "examples_per_step": per_step,
            "fill": round(real / (args.steps * args.batch * length), 4),
            "examples_per_s": round(per_step / step_s, 1),
            "target_tokens_per_s": round(target / args.steps / step_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a built run (default: build the demo data in a temporary folder)")
    parser.add_argument("--length", type=int, default=512, help="max_length when building the demo data")
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        run = args.run or demo_run(Path(scratch), args.length)
        lengths = pipeline.example_lengths(pipeline.open_split(run, "train"))
        length = read_manifest(run)["options"]["max_length"]
        rows = pipeline._PackedRows(lengths, length, seed=0).rows_per_epoch()
        rows_out = [measure(run, pack, args) for pack in (False, True)]
    print(f"train split: {len(lengths):,} examples, {lengths.mean():.1f} positions on average (max_length "
          f"{length}); an epoch is {len(lengths):,} rows unpacked, {rows:,} packed "
          f"({len(lengths) / rows:.2f} examples per row); {jax.devices()[0].device_kind}")
    print(f"{'rows':10s} {'step s':>8s} {'examples/step':>14s} {'fill':>6s} {'examples/s':>11s} {'target tok/s':>13s}")
    for r in rows_out:
        print(f"{'packed' if r['pack'] else 'one each':10s} {r['step_s']:8.3f} {r['examples_per_step']:14.1f} "
              f"{r['fill']:6.2f} {r['examples_per_s']:11,.1f} {r['target_tokens_per_s']:13,.0f}")
    speedup = rows_out[1]["examples_per_s"] / rows_out[0]["examples_per_s"]
    print(f"packing: {speedup:.2f}x examples per second")
    result = {"examples": len(lengths), "mean_positions": float(np.mean(lengths)), "max_length": length,
              "rows_per_epoch": {"unpacked": len(lengths), "packed": rows}, "runs": rows_out, "speedup": speedup,
              "device": jax.devices()[0].device_kind}
    write_result("packing", result)


if __name__ == "__main__":
    main()
