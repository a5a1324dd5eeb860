"""Records per second of `polyalign prepare` and `polyalign stats` on a data config.

    python bench/prepare_throughput.py [--config configs/data/bilingual.yaml] [--out /tmp/bench_run]

Prints one table and writes bench JSON to $OUT (or --out) as prepare_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from polyalign.data.prepare import prepare
from polyalign.reports.stats import compute_stats

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs/data/bilingual.yaml")
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: a temporary one)")
    args = parser.parse_args()
    run = args.out or Path(tempfile.mkdtemp(prefix="polyalign_bench_"))

    started = time.perf_counter()
    manifest = prepare(args.config, run, progress=False)
    prepare_s = time.perf_counter() - started
    started = time.perf_counter()
    stats = compute_stats(run, progress=False)
    stats_s = time.perf_counter() - started

    read, kept = manifest["totals"]["read"], manifest["totals"]["kept"]
    train = manifest["totals"]["by_split"]["train"]
    rows = [
        ("prepare", read, prepare_s, read / prepare_s),
        ("  import+normalise+bucket", read, manifest["timings_s"]["import"], read / manifest["timings_s"]["import"]),
        ("  near-duplicate scan", kept, manifest["timings_s"]["near_duplicates"], None),
        ("stats (features on train)", train, stats_s, train / stats_s),
        ("prepare + stats", read, prepare_s + stats_s, read / (prepare_s + stats_s)),
    ]
    print(f"{'stage':<28}{'records':>10}{'seconds':>10}{'records/s':>12}")
    for name, n, seconds, rate in rows:
        print(f"{name:<28}{n:>10}{seconds:>10.2f}{(f'{rate:,.0f}' if rate else '-'):>12}")
    result = {
        "config": str(args.config), "machine": platform.platform(), "cpus": os.cpu_count(),
        "records_read": read, "records_kept": kept, "train_records": train,
        "buckets": len(stats["counts"]["by_bucket"]),
        "prepare_s": round(prepare_s, 3), "stats_s": round(stats_s, 3),
        "records_per_s": round(read / (prepare_s + stats_s), 1), "timings_s": manifest["timings_s"],
    }
    out_dir = Path(os.environ.get("OUT", run))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prepare_throughput.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
