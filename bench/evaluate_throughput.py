"""Time `polyalign evaluate` (text metrics, no featurizer or scorer) on N rows.

    python bench/evaluate_throughput.py [--rows 50000] [--compat reference] [--no-diversity]
                                        [--no-detectability]

The default mode includes every bucket's human floor (held-out halves, the test answers being the
support), 200 bootstrap draws, the two no-model baselines and detectability (with its floor and the
baselines').

Rows are the authors' English sample (../shared/data/en/polyalign-sample/dist_sft_test.json, 2,000
records) repeated under new ids until N, with the first sentence of the context (or question) as the
prediction. Prints the time per stage of the run and writes JSON to $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from result_file import write_result

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO.parent / "shared" / "data" / "en" / "polyalign-sample" / "dist_sft_test.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--compat", choices=("cjk", "reference"), default="cjk")
    parser.add_argument("--no-diversity", action="store_true")
    parser.add_argument("--no-detectability", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from polyalign.data.prepare import prepare
    from polyalign.data.records import read_records
    from polyalign.evaluate.baselines import first_sentence
    from polyalign.evaluate.run import EvaluateOptions, evaluate
    from tests.conftest import write_config

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = write_config(tmp / "data.yaml", [{"name": "polyalign_sample", "format": "llamafactory",
                                                   "path": str(SAMPLE), "split": "test", "language": "en"}],
                              length_unit="v1", dedup=False)
        prepare(config, tmp / "run", progress=False)
        base = read_records(tmp / "run" / "data" / "test.jsonl")
        with (tmp / "records.jsonl").open("w") as records, (tmp / "pred.jsonl").open("w") as predictions:
            for i in range(args.rows):
                record = base[i % len(base)].to_json()
                record["id"] = f"{record['id']}-copy{i // len(base)}"
                records.write(json.dumps(record, ensure_ascii=False) + "\n")
                prediction = first_sentence(record["context"] or record["question"])
                predictions.write(json.dumps({"id": record["id"], "prediction": prediction}) + "\n")
        started = time.perf_counter()
        evaluate(tmp / "records.jsonl", tmp / "pred.jsonl", tmp / "eval",
                 EvaluateOptions(compat=args.compat, plots=False, diversity=not args.no_diversity,
                                 detectability=not args.no_detectability))
        seconds = time.perf_counter() - started
    result = {"rows": args.rows, "compat": args.compat, "diversity": not args.no_diversity,
              "detectability": not args.no_detectability, "seconds": round(seconds, 1),
              "rows_per_s": round(args.rows / seconds, 1)}
    print(f"evaluate, {args.rows} rows (text metrics, compat {args.compat}, diversity "
          f"{'off' if args.no_diversity else 'on'}, detectability {'off' if args.no_detectability else 'on'}): "
          f"{seconds:.1f} s, {args.rows / seconds:.0f} rows/s")
    write_result("evaluate_throughput", result)


if __name__ == "__main__":
    main()
