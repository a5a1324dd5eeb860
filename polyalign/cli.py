"""The `polyalign` command: one entry point, one subcommand per pipeline stage.

Each subcommand parses its arguments and calls its stage; errors that come from the user's input
(configuration, files, rows) are printed as one line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import polyalign

DESCRIPTION = """\
polyalign aligns a language model to the human response distribution of each interaction context
(language, single/multi-turn track, response family, response length), instead of one global style.

Pipeline:
  polyalign prepare --config configs/data/bilingual.yaml --out RUN   import, bucket, dedup, split
  polyalign stats RUN                                                 bucket statistics report
  polyalign tokenizer train --records RUN/data/train.jsonl --vocab-size 8000 --out RUN/tokenizer
  polyalign demo --out RUN                                            everything on the bundled data
"""

PREPARE_EPILOG = """\
The config (YAML) names the bucket scheme and the sources:

  scheme: ../../buckets/polyalign.yaml
  length_unit: v2            # optional override of the scheme's unit (v1 | v2)
  dedup: true                # exact dedup + train/test near-duplicate report
  near_dedup: {threshold: 0.8, remove: false}
  split: {seed: 42, weights: {train: 0.9, val: 0.05, test: 0.05}}
  sources:
    - {name: cmrc2018, format: squad, path: data/cmrc2018_dev.json, split: auto, language: zh}

formats: llamafactory squad kdconv crosswoz lccc coig convlab chat sharegpt
split: train | val | test | auto (a corpus's own splits where its files carry them, else a seeded hash
of the conversation or passage). Paths are relative to the config file. `key=value` arguments override
config fields, e.g. dedup=false or near_dedup.remove=true.

Writes RUN/data/{train,val,test}.jsonl, RUN/data/manifest.json (counts read/kept/dropped by reason per
source, dedup, label agreement, timings), RUN/data/near_duplicates.jsonl and, with --on-error
quarantine, RUN/data/quarantine.jsonl.
"""


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="import corpora, bucket, dedup and split into RUN/data",
                       description="Import native corpora into normalised, bucketed, deduplicated, group-safe splits.",
                       epilog=PREPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path, help="data config (YAML), e.g. configs/data/bilingual.yaml")
    p.add_argument("--out", required=True, type=Path, help="run directory; data goes to OUT/data")
    p.add_argument("--on-error", choices=("fail", "quarantine"), default="fail",
                   help="malformed rows stop the run (fail, default) or go to OUT/data/quarantine.jsonl")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config fields")
    p.set_defaults(handler=_run_prepare)


def _run_prepare(args) -> int:
    from polyalign.data.prepare import prepare

    manifest = prepare(args.config, args.out, on_error=args.on_error, overrides=args.overrides,
                       progress=not args.no_progress)
    totals = manifest["totals"]
    print(f"read {totals['read']}, kept {totals['kept']}, dropped {totals['dropped']} "
          f"(train {totals['by_split']['train']}, val {totals['by_split']['val']}, test {totals['by_split']['test']})")
    for source in manifest["sources"]:
        dropped = ", ".join(f"{k} {v}" for k, v in source["dropped"].items()) or "none dropped"
        print(f"  {source['name']:<20} read {source['read']:>6}  kept {source['kept']:>6}  {dropped}")
    if manifest["quarantine"]["rows"]:
        print(f"quarantined {manifest['quarantine']['rows']} rows -> {args.out / 'data' / 'quarantine.jsonl'}")
    print(f"manifest: {args.out / 'data' / 'manifest.json'}")
    return 0


def _add_stats(sub) -> None:
    p = sub.add_parser("stats", help="bucket statistics report for a prepared run",
                       description="Counts, length quantiles, Bucket-SFT weights, feature summaries and train-only "
                                   "human-support references per bucket. Writes RUN/stats/{stats.json, "
                                   "references.json, report.html, report.md, *.png}.")
    p.add_argument("run", type=Path, help="run directory written by `polyalign prepare`")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=_run_stats)


def _run_stats(args) -> int:
    from polyalign.reports.stats import compute_stats

    stats = compute_stats(args.run, progress=not args.no_progress)
    print(f"{stats['total']} records in {len(stats['counts']['by_bucket'])} buckets; "
          f"references for {stats['references']['buckets']} buckets")
    print(f"report: {args.run / 'stats' / 'report.html'}")
    return 0


TOKENIZER_EPILOG = """\
Trains a bilingual SentencePiece model on every text of the records (questions, contexts, history
turns and responses). Text is kept exactly (no NFKC folding of full-width punctuation, no whitespace
collapsing), characters beyond the coverage fall back to UTF-8 bytes, and the chat template's
special tokens (<|im_start|>, <|im_end|>) are single pieces. Writes OUT/tokenizer.model,
OUT/tokenizer_config.json and OUT/tokenizer_report.json (characters per token by language).

A checkpoint's own tokenizer (tokenizer.json or tokenizer.model) needs no training: pass its
directory wherever a tokenizer is asked for.
"""


def _add_tokenizer(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a bilingual SentencePiece tokenizer",
                       description="Tokenizer tools.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    train = actions.add_parser("train", help="train a SentencePiece model on a records file",
                               description="Train a bilingual SentencePiece tokenizer on prepared records.",
                               epilog=TOKENIZER_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--records", required=True, type=Path, help="records JSONL, e.g. RUN/data/train.jsonl")
    train.add_argument("--vocab-size", required=True, type=int, help="vocabulary size, e.g. 8000")
    train.add_argument("--out", required=True, type=Path, help="output directory")
    train.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram", help="default: unigram")
    train.add_argument("--character-coverage", type=float, default=0.9995,
                       help="share of characters kept as pieces; the rest fall back to bytes (default 0.9995)")
    train.set_defaults(handler=_run_tokenizer_train)


def _run_tokenizer_train(args) -> int:
    from polyalign.tokenizer import train_from_records

    _, report = train_from_records(args.records, args.out, args.vocab_size, model_type=args.model_type,
                                   character_coverage=args.character_coverage)
    rates = ", ".join(f"{lang} {rate}" for lang, rate in report["chars_per_token"].items())
    print(f"trained a {report['vocab_size']}-piece tokenizer on {report['num_records']} records in "
          f"{report['train_seconds']} s; characters per token: {rates}")
    print(f"tokenizer: {args.out / 'tokenizer.model'}")
    return 0


def _add_demo(sub) -> None:
    from polyalign.demo import STAGES

    p = sub.add_parser("demo", help="run the pipeline on the bundled demo data",
                       description="Run the pipeline end to end on the real English and Chinese demo data bundled "
                                   f"with polyalign. Stages available: {', '.join(STAGES)}.")
    p.add_argument("--out", required=True, type=Path, help="run directory")
    p.add_argument("--stages", help=f"comma-separated subset of: {','.join(STAGES)} (default: all)")
    p.add_argument("--quick", action="store_true", help="reduced sizes for a fast check")
    p.set_defaults(handler=_run_demo)


def _run_demo(args) -> int:
    from polyalign.demo import parse_stages, run_demo

    run_demo(args.out, parse_stages(args.stages), quick=args.quick)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyalign", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"polyalign {polyalign.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_prepare(sub)
    _add_stats(sub)
    _add_tokenizer(sub)
    _add_demo(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from polyalign.config import ConfigError
    from polyalign.data.prepare import PrepareError
    from polyalign.data.records import InputError
    from polyalign.reports.stats import StatsError
    from polyalign.tokenizer import TokenizerError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, InputError, PrepareError, StatsError, TokenizerError) as err:
        print(f"polyalign {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"polyalign {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
