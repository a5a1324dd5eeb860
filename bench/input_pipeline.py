"""How fast the input pipeline delivers training batches (grain over the TFDS array_record build), one
example per row and packed, against what a training step consumes.

    python bench/input_pipeline.py                         # the bundled demo data, built at 512
    python bench/input_pipeline.py --run RUN --batch 64 --steps 50

The rate counts row positions (what the step computes on) per second of batch production on one
process. Prints a table and writes JSON to $OUT/input_pipeline.json when OUT is set.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_file import write_result  # noqa: E402

from polyalign.inputs import pipeline  # noqa: E402
from polyalign.inputs.built import read_manifest  # noqa: E402

# Steps that a batch stream must outpace: the plain JAX DPO step of the accelerator issue on one H200
# (tokens/s, 2026-11-29), the bar being 10x.
H200_STEP_TOKENS_PER_S = {"qwen2.5-0.5b": 84_100, "qwen2.5-1.5b": 33_700}


def rate(run: Path, batch: int, steps: int, pack: bool) -> dict:
    manifest = read_manifest(run)
    length = manifest["options"]["max_length"]
    source = pipeline.open_split(run, "train")
    started = time.perf_counter()
    batches = pipeline.iterate(pipeline.train_batches(source, pipeline.Layout(batch, 1), steps, length,
                                                      manifest["pad_id"], seed=0, pack=pack))
    first = next(batches)
    setup_s = time.perf_counter() - started
    started = time.perf_counter()
    real = int(first["length"].sum())
    for _ in range(steps - 1):
        real += int(next(batches)["length"].sum())
    seconds = time.perf_counter() - started
    positions = (steps - 1) * batch * length
    return {"pack": pack, "setup_s": round(setup_s, 2), "batches_per_s": round((steps - 1) / seconds, 1),
            "positions_per_s": round(positions / seconds), "real_tokens": real}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a built run (default: build the demo data in a temporary folder)")
    parser.add_argument("--length", type=int, default=512, help="max_length when building the demo data")
    parser.add_argument("--batch", type=int, default=64, help="rows per step")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        if args.run is None:
            sys.path.insert(0, str(Path(__file__).parent))
            from packing import demo_run

            run = demo_run(Path(scratch), args.length)
        else:
            run = args.run
        rows = [rate(run, args.batch, args.steps, pack) for pack in (False, True)]
    print(f"{'rows':10s} {'setup s':>8s} {'batches/s':>10s} {'positions/s':>12s}")
    for r in rows:
        print(f"{'packed' if r['pack'] else 'one each':10s} {r['setup_s']:8.2f} {r['batches_per_s']:10.1f} "
              f"{r['positions_per_s']:12,}")
    slowest = min(r["positions_per_s"] for r in rows)
    for name, consumed in H200_STEP_TOKENS_PER_S.items():
        print(f"{name} step on one H200 ({consumed:,} tokens/s): the pipeline delivers {slowest / consumed:.1f}x")
    write_result("input_pipeline",
                 {"batch": args.batch, "rows": rows, "h200_step_tokens_per_s": H200_STEP_TOKENS_PER_S})


if __name__ == "__main__":
    main()
