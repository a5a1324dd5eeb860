"""The `polyalign` command: one entry point, one subcommand per pipeline stage.

Each subcommand parses its arguments and calls its stage; errors that come from the user's input
(configuration, files, rows) are printed as one line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import os
import signal
import sys
import textwrap
from collections import Counter
from pathlib import Path

from polyalign.beam import require_beam
from polyalign.core.errors import ConfigError, GenerationError, Interrupted, LaunchError, PolyalignError, PrepareError
from polyalign.core.interrupts import INTERRUPTED, TERMINATED, Terminated, interrupts_remembered
from polyalign.core.outputs import read_record, sidecar
from polyalign.core.ranges import COUNT, NON_NEGATIVE, SEED, Range
from polyalign.core.scores import interval_text
from polyalign.core.version import polyalign_version
from polyalign.core.wording import counted, listed
from polyalign.data.layout import quarantined_records
from polyalign.data.notes import MOJIBAKE, language_mismatch_warning, mojibake_line
from polyalign.demo import STAGES, parse_stages, run_demo
from polyalign.mesh import supervisor
from polyalign.mesh.launch import (
    DEFAULT_PORT,
    main_command,
    refuse_several_processes,
    run_local,
    run_slurm,
    said_by_another_process,
)
from polyalign.reports.no_model import ahead_of_the_model
from polyalign.reports.reading_notes import notes_for_reader
from polyalign.tokens.profile_template import PROFILE_MODES, SYSTEM_LOST_WHY, SYSTEM_MODES, TRUNCATIONS
from polyalign.train.methods import (
    METHODS,
    config_as_yaml,
    derived_notes,
    load_config,
    method_spec,
    retargeted_note,
    settings_help,
    shared_sections_help,
    unread_settings,
)

DESCRIPTION = """\
polyalign aligns a language model to the human response distribution of each interaction context
(language, single/multi-turn track, response family, response length), instead of one global style.

Pipeline:
  polyalign prepare --config configs/data/bilingual.yaml --out RUN   import, bucket, dedup, split
  polyalign stats RUN                                                 bucket statistics report
  polyalign tokenizer train --records RUN/data/train.jsonl --vocab-size 8000 --out RUN/tokenizer
  polyalign build RUN                                                 tokenised TFDS dataset in RUN/build
  polyalign show RUN                                                  built examples, trained tokens marked
  polyalign train sft --config configs/sft_demo.yaml --out OUT data.dir=RUN   Bucket-Aware SFT
  polyalign generate --checkpoint OUT/model --records RUN/data/test.jsonl --out P.jsonl
  polyalign pairs --records RUN/data/train.jsonl --predictions P.jsonl --out PAIRS.jsonl
  polyalign train critic --config configs/critic_demo.yaml --out CRITIC init=SFT/model ...
  polyalign train hdpo --config configs/hdpo_demo.yaml --out OUT data.dir=RUN init=SFT/model
  polyalign pairs accuracy --model OUT/model --pairs TEST_PAIRS.jsonl --out ACC   on held-out pairs
  polyalign evaluate --records RUN/data/test.jsonl --predictions P.jsonl --out EVAL
  polyalign report EVAL_A EVAL_B --out CMP
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
source, dedup, label agreement, timings), RUN/data/dropped.jsonl (every row left out: file, line,
reason), RUN/data/exact_duplicates.jsonl, RUN/data/near_duplicates.jsonl and, with --on-error
quarantine, RUN/data/quarantine.jsonl.
"""


def _add_beam_arguments(p, what: str) -> None:
    group = p.add_argument_group("Apache Beam (pip install 'polyalign[beam]'; see docs/scale.md)")
    group.add_argument("--beam", action="store_true",
                       help=f"{what} as an Apache Beam pipeline (same output as without --beam)")
    group.add_argument("--beam-options", metavar="FLAGS",
                       help="Beam pipeline flags in one string, e.g. \"--runner=DataflowRunner --project=P "
                            "--region=R --temp_location=gs://B/tmp\" (default: DirectRunner); one flag alone is "
                            "written --beam-options=--runner=X, with =")


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="import corpora, bucket, dedup and split into RUN/data",
                       description="Import native corpora into normalised, bucketed, deduplicated, group-safe splits.",
                       epilog=PREPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path, help="data config (YAML), e.g. configs/data/bilingual.yaml")
    p.add_argument("--out", required=True, type=Path, help="run directory; data goes to OUT/data")
    p.add_argument("--on-error", choices=("fail", "quarantine"), default="fail",
                   help="malformed rows stop the run (fail, default) or go to OUT/data/quarantine.jsonl")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT/data when it was prepared with another config (refused otherwise)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config fields")
    _add_beam_arguments(p, "run prepare")
    p.add_argument("--num-shards", type=int, default=1,
                   help="with --beam: files per split (1, default, writes OUT/data/SPLIT.jsonl; N writes "
                        "OUT/data/SPLIT-0000i-of-0000N.jsonl, which `polyalign build` reads too)")
    p.set_defaults(handler=_run_prepare)


def _share(share: float) -> str:
    """A share above 0 as a percentage that never reads 0% (or 100% short of all)."""
    return "<1%" if share < 0.01 else ">99%" if 0.99 < share < 1 else f"{share:.0%}"


def _label_defaults_note(source: dict) -> str | None:
    """A source whose family or style nobody named (no row, the data config or the scheme) took its format's
    default: said, since a dialogue corpus imported as `chat` is then bucketed as assistant chats."""
    from polyalign.data.importers import get_format  # kept out of --help, as every command keeps its modules

    defaulted = {name: count for name, count in source.get("label_defaults", {}).items() if name != "track"}
    if not defaulted:
        return None
    defaults = get_format(source["format"]).defaults
    named = " and ".join(f"{name} {defaults[name]}" for name in defaulted)
    counts = " and ".join(map(str, dict.fromkeys(defaulted.values())))
    keys = " and ".join(f"`{name}:`" for name in defaulted)
    of = f" of its {source['records']} records" if "records" in source else " of its records"
    are, them = ("is", "it") if len(defaulted) == 1 else ("are", "them")
    return (f"note: source {source['name']!r}: {named} {are} the {source['format']} format's "
            f"default{'s' * (len(defaulted) > 1)}, taken by {counts}{of} as read, before drops and deduplication (no "
            f"row, data config or scheme entry named {them}); set {keys} on the source "
            "where its records are of another kind (docs/data.md: Users' own conversations)")


def _unread_keys_note(source: dict) -> str | None:
    """Keys of a source's rows its format does not read: said, with how many rows held each, since a misspelt
    key (`outptu`) is otherwise left behind without a word."""
    unread = source.get("unread_keys") or {}
    if not unread:
        return None
    said = ", ".join(f"{key} ({counted(n, 'row')})" for key, n in unread.items())
    return (f"note: source {source['name']!r}: keys the {source['format']} format does not read, left unread: {said}; "
            "a misspelt key is one of them (docs/data.md lists each format's keys)")


def _scheme_entry_note(source: dict) -> str | None:
    """A source named as one of the scheme's corpora takes that corpus's labels unless it sets its own: said,
    since a team's export named `camrest` is bucketed as CamRest676's task dialogues without a word."""
    taken = source.get("scheme_entry_labels")
    if not taken:
        return None
    labels = listed([f"{name} {value}" for name, value in taken.items()])
    return (f"note: source {source['name']!r}: {labels} come from the bucket scheme's entry for the name "
            f"{source['name']!r} (a corpus the scheme knows), not from the rows; rename the source, or set "
            f"{listed([f'`{name}:`' for name in taken])} on it, where its rows are not that corpus")


def _opening_replies_note(source: dict) -> str | None:
    """A source of multi-turn conversations whose track nobody named: each conversation's first reply is
    `single` and the later ones `multi`, so one dialogue spans two buckets. Said, with the key that keeps
    it whole."""
    count = source.get("opening_replies")
    if not count:
        return None
    are = "is" if count == 1 else "are"
    return (f"note: source {source['name']!r}: {counted(count, 'record')} {are} the first reply of a multi-turn "
            "conversation: read off the conversation, their track is single (no earlier turn) and the later "
            "replies' multi, so each dialogue spans two buckets; set `track: multi` on the source to bucket whole "
            "conversations as multi-turn, as the scheme does for its dialogue corpora (docs/data.md: Users' own "
            "conversations)")


def _run_prepare(args) -> int:
    if args.num_shards != 1 and not args.beam:  # one machine writes one file a split: it was ignored without a word
        raise ConfigError(f"--num-shards {args.num_shards} shards a Beam prepare's outputs; add --beam, or leave "
                          "--num-shards out")
    if args.beam:
        require_beam()
        from polyalign.beam.prepare import prepare_beam  # optional extra: apache-beam

        manifest = prepare_beam(args.config, args.out, on_error=args.on_error, overrides=args.overrides,
                                beam_options=args.beam_options, num_shards=args.num_shards, overwrite=args.overwrite)
    else:
        from polyalign.data.prepare import prepare  # heavy: numpy, datasketch, kept out of --help

        manifest = prepare(args.config, args.out, on_error=args.on_error, overrides=args.overrides,
                           progress=not args.no_progress, overwrite=args.overwrite)
    totals = manifest["totals"]
    # the split counts beside what they count (after "dropped" they read as the dropped records')
    print(f"read {totals['read']} rows -> {totals['records']} records: kept {totals['kept']} (train "
          f"{totals['by_split']['train']}, val {totals['by_split']['val']}, test {totals['by_split']['test']}), "
          f"dropped {totals['dropped']}")
    for source in manifest["sources"]:
        dropped = ", ".join(f"{k} {v}" for k, v in source["dropped"].items()) or "none dropped"
        left_out = ", ".join(f"{k} {v}" for k, v in source.get("left_out", {}).items())
        print(f"  {source['name']:<20} rows {source['read']:>6}  records {source['records']:>6}  kept "
              f"{source['kept']:>6}  {dropped}{f'; left out of kept rows: {left_out}' if left_out else ''}")
    if quarantined := quarantined_records(manifest):  # the file, or a Beam run's shards, as the manifest names them
        print(f"quarantined {counted(quarantined, 'record')} (the malformed drops above), each with its problem and "
              f"what was read of it -> {args.out / 'data' / manifest['quarantine']['file']}")
    if dropped := manifest["dropped_rows"]["rows"]:
        print(f"{counted(dropped, 'record')} left out as they were read, each with its reason -> "
              f"{args.out / 'data' / manifest['dropped_rows']['file']}")
    near = manifest["dedup"].get("near_duplicates", {})
    if near.get("pairs"):  # a test record a train record nearly repeats: the test numbers then read it as seen
        kept = ("removed from train" if near.get("remove") else
                "kept (near_dedup.remove: true in the data config removes them)")
        print(f"{counted(near['train_records'], 'train record')} nearly repeat{'s' * (near['train_records'] == 1)} "
              f"a test record (MinHash Jaccard >= {near['threshold']:g}, {counted(near['pairs'], 'pair')}), "
              f"{kept} -> {args.out / 'data' / near['file']}")
    for source in manifest["sources"]:
        _warn_language_mismatches(source.get("language_mismatches", {}), f"source {source['name']!r}",
                                  "its `language:` in the data config")
        for line in (_scheme_entry_note(source), _label_defaults_note(source), _opening_replies_note(source),
                     _unread_keys_note(source), mojibake_line(source), _unread_files_note(source)):
            if line:
                print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout)
    for warning in manifest.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    print(f"manifest: {args.out / 'data' / 'manifest.json'}")
    if not totals["kept"]:
        reasons = Counter()
        for source in manifest["sources"]:
            reasons.update(source["dropped"])
        why = ", ".join(f"{reason} {count}" for reason, count in reasons.most_common()) or "no rows read"
        raise PrepareError(f"nothing kept: every one of {totals['records']} records was dropped ({why}); the "
                           "manifest counts them per source")
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
    from polyalign.reports.stats import compute_stats  # heavy: matplotlib, numpy, kept out of --help

    stats = compute_stats(args.run, progress=not args.no_progress)
    print(f"{counted(stats['total'], 'record')} in {counted(len(stats['counts']['by_bucket']), 'bucket')}; "
          f"references for {counted(stats['references']['buckets'], 'bucket')}")
    for note in stats["notes"]:
        print(f"note: {note}")
    for warning in stats["weights"]["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"report: {args.run / 'stats' / 'report.html'}")
    return 0


TOKENIZER_EPILOG = """\
Trains a bilingual SentencePiece model on every text of the records (questions, contexts, history
turns and responses); with --system-prompts on the system prompt a build writes before each too (its
English profile prompt, which a tokenizer of Chinese text alone spells nearly letter by letter). Text
is kept exactly (no NFKC folding of full-width punctuation, no whitespace collapsing), characters beyond
the coverage fall back to UTF-8 bytes, and the chat template's special tokens (<|im_start|>, <|im_end|>)
are single pieces. Writes OUT/tokenizer.model, OUT/tokenizer_config.json and OUT/tokenizer_report.json
(characters per token by language).

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
    train.add_argument("--records", required=True, type=Path,
                       help="records JSONL, e.g. RUN/data/train.jsonl, or a prepared RUN folder (its train split, "
                            "one file or a Beam prepare's shards)")
    train.add_argument("--vocab-size", required=True, type=int, help="vocabulary size, e.g. 8000")
    train.add_argument("--out", required=True, type=Path, help="output directory")
    train.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram", help="default: unigram")
    train.add_argument("--character-coverage", type=float, default=0.9995,
                       help="share of characters kept as pieces; the rest fall back to bytes (default 0.9995)")
    train.add_argument("--threads", type=int, default=None,
                       help="SentencePiece's worker threads (default 2). The pieces depend on this number, not on "
                            "the machine: the same records and threads train the same tokenizer anywhere; more "
                            "threads train faster where there are cores for them, into a slightly different "
                            "vocabulary")
    train.add_argument("--system-prompts", action="store_true",
                       help="learn the system prompt a build writes before each record too (the English profile "
                            "prompt): for a vocabulary of Chinese text alone, it then takes about 46 tokens, not "
                            "116, of each example")
    train.add_argument("--overwrite", action="store_true", help="replace a tokenizer in OUT trained with other "
                                                                "settings (or not by polyalign)")
    train.set_defaults(handler=_run_tokenizer_train)


def _run_tokenizer_train(args) -> int:
    from polyalign.tokens.tokenizer_training import train_from_records  # heavy: numpy, kept out of --help

    threads = {"threads": args.threads} if args.threads is not None else {}
    _, report = train_from_records(args.records, args.out, args.vocab_size, model_type=args.model_type,
                                   character_coverage=args.character_coverage, overwrite=args.overwrite,
                                   system_prompts=args.system_prompts, **threads)
    rates = ", ".join(f"{lang} {rate}" for lang, rate in report["chars_per_token"].items())
    print(f"trained a {report['vocab_size']}-piece tokenizer on {report['num_records']} records in "
          f"{report['train_seconds']} s; characters per token: {rates}")
    print(f"tokenizer: {args.out / 'tokenizer.model'}")
    return 0


BUILD_EPILOG = """\
Renders every train and val record with the chat template (the profile system prompt, history,
context and question, then the response), tokenises it, and stores input ids, the loss mask (the
response and its end-of-turn token), the record's Bucket-SFT weight (computed on the train split),
its bucket index and its id as a TFDS dataset in array_record format: RUN/build/sft_examples/1.0.0.
Sequences over --max-length are cut as docs/model.md says (the prompt from its start, the
response from its end). RUN/build/manifest.json records the tokenizer, template, weights and counts.
Packing several examples into a row happens when training reads the build (`data.pack=true` in
`polyalign train`), not here: one build serves packed and unpacked runs.
"""


# polyalign.tokens.chat.TEMPLATE_CHOICES, spelled out so that --help imports nothing heavy (a test keeps them equal).
TEMPLATE_CHOICES = ("checkpoint", "polyalign", "qwen", "llama3", "gemma")
TEMPLATE_HELP = ("chat template: checkpoint (the checkpoint's own Jinja chat_template, rendered as transformers "
                 "does) or a built-in one. Default: the built-in a polyalign tokenizer names, else the checkpoint's "
                 "own template, else the model family's official one")


def _add_build(sub) -> None:
    p = sub.add_parser("build", help="tokenise a prepared run into a TFDS dataset for training",
                       description="Tokenise RUN/data/{train,val}.jsonl into RUN/build (TFDS, array_record).",
                       epilog=BUILD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="run directory with data/ (and tokenizer/ unless --tokenizer is given)")
    p.add_argument("--tokenizer", help="tokenizer directory or file (default RUN/tokenizer); a Hugging Face "
                                       "checkpoint directory works")
    p.add_argument("--template", choices=TEMPLATE_CHOICES, help=TEMPLATE_HELP)
    p.add_argument("--profile", choices=PROFILE_MODES, default="context",
                   help="profile system prompt: context (family, track, style; default), oracle (+ the gold "
                        "length bin, as the reference trained), none")
    p.add_argument("--system", choices=SYSTEM_MODES, default="keep",
                   help="a record's own system prompt (its source's system message): keep it and add the profile "
                        "prompt after a blank line (default), replace it with the profile prompt, or drop every "
                        "system message of the source (docs/model.md, System messages)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per example, the truncation cutoff (512)")
    p.add_argument("--train-on", choices=("last", "all"), default="last",
                   help="loss on the final response only (default) or on every assistant turn")
    p.add_argument("--truncation", choices=TRUNCATIONS, default="left",
                   help="how a prompt over its share of --max-length is cut: left (default, the paper's reference "
                        "recipe) from its start, the profile prompt with it; keep_system keeps the system message "
                        "that opens it (the profile prompt) and cuts the oldest tokens after it; turns keeps it too "
                        "and drops the oldest whole turns, as generation does (a last question still over is cut "
                        "as keep_system cuts it)")
    weights = p.add_argument_group(
        "Bucket-SFT weights (default: the bucket scheme's `weights:`; each flag replaces one of its keys)")
    weights.add_argument("--weights", choices=("default", "method"), dest="weight_preset",
                         help="start from a preset instead of the scheme: default (t 0.5, clip [0.2, 5], small "
                              "buckets borrow their parent's weight) or method (the paper's N / (K n_b), unclipped)")
    weights.add_argument("--weight-temperature", type=float, metavar="T",
                         help="w_b proportional to n_b^-T, mean 1 (T=1: every bucket gets equal total mass)")
    weights.add_argument("--clip-weights", type=float, nargs=2, metavar=("LOW", "HIGH"), help="clip bucket weights")
    weights.add_argument("--borrow-below", type=int, metavar="N",
                         help="buckets with fewer than N train records take their parent group's weight")
    weights.add_argument("--min-bucket-size", type=int, metavar="N", help="buckets smaller than N get weight 0")
    p.add_argument("--overwrite", action="store_true", help="replace RUN/build when it was built with other options")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_beam_arguments(p, "tokenise")
    p.set_defaults(handler=_run_build)


def build_options(args):
    """The BuildOptions a `polyalign build` command line gives."""
    from polyalign.inputs.built import BuildOptions  # kept out of --help

    given = {"preset": args.weight_preset, "temperature": args.weight_temperature, "borrow_below": args.borrow_below,
             "min_bucket_size": args.min_bucket_size, "clip": list(args.clip_weights) if args.clip_weights else None}
    return BuildOptions(tokenizer=args.tokenizer, template=args.template, profile=args.profile,
                        max_length=args.max_length, train_on=args.train_on, system=args.system,
                        truncation=args.truncation,
                        weights={key: value for key, value in given.items() if value is not None})


def _split_line(split: str, counts: dict, args) -> str:
    """A built split's line: its examples and tokens, and what the cut to --max-length took."""
    line = (f"{split}: {counts['examples']} examples, {counts['tokens']} tokens ({counts['target_tokens']} trained "
            f"on), {counts['truncated']} truncated to {args.max_length}")
    inside, replies = counts.get("mid_turn"), counts.get("reply_cut")
    # where a cut example opens: each one either at a turn's start (it lost whole turns, or nothing but the
    # end of its reply) or inside a turn; manifests before these counts say neither
    said = ([f"{counts['truncated'] - inside} open at a turn's start"] if inside is not None and
            counts["truncated"] > inside else []) + ([f"{inside} inside a turn"] if inside else [])
    notes = counts.get("system_dropped")  # system messages from inside a conversation (operator notes)
    parts = ([f"{counts['turns_dropped']} lost whole turns" + (
        f", {notes} of them a system message from inside the conversation with those turns" if notes else "")]
        if counts.get("turns_dropped") else []) + ([", ".join(said)] if said else [])
    if replies:
        parts.append(f"{replies} replies cut short, trained without their end-of-turn token")
    if counts.get("system_cut"):
        # under keep the message opens with the conversation's own system text, where it has one
        held = ("the profile prompt, after the conversation's own system text where it has one"
                if args.system == "keep" and counts.get("source_system_prompts") else "the profile prompt")
        whole = counts.get("system_left_out")  # over half of the prompt's share: left out, not kept as a tail
        parts.append(f"{counts['system_cut']} lost their opening system message, whole or in part"
                     + (f" ({whole} left out whole, rather than keep its last tokens)" if whole else "")
                     + f", which holds {held}: {SYSTEM_LOST_WHY[args.truncation].format(option='--truncation ')}")
    if parts:
        line += f" ({'; '.join(parts)})"
    if args.train_on != "last" and counts["examples"]:
        per_reply = counts["trained_replies"] / counts["examples"]
        line += (f"; {counts['trained_replies']} replies trained: with --train-on all each record also trains its "
                 f"dialogue's earlier replies, so a reply is a target in {per_reply:.2f} records on average")
    return line


def _run_build(args) -> int:
    from polyalign.inputs.build import build  # heavy: jax, kept out of --help

    options = build_options(args)
    if args.beam:
        require_beam()
        from polyalign.beam.build import build_beam  # optional extra: apache-beam

        manifest = build_beam(args.run, options, beam_options=args.beam_options, overwrite=args.overwrite)
    else:
        manifest = build(args.run, options, progress=not args.no_progress, overwrite=args.overwrite)
    for split, counts in manifest["splits"].items():
        print(_split_line(split, counts, args))
    check = manifest["tokenizer_check"]
    if check["checked"] and not check["differing"]:
        print(f"tokenizer: {check['reader']} gives the same ids as polyalign on {check['probes']} probe texts")
    elif not check["checked"]:
        print(f"tokenizer: {check['reason']}")
    for warning in manifest["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    train = manifest["splits"]["train"]
    if train.get("system_cut", 0) > SYSTEM_CUT_WARNING * max(train["examples"], 1):
        # the split's line says it in passing; this many examples trained without their profile prompt is a warning
        fix = {"left": "--truncation left (the paper's reference recipe, the default; docs/model.md, System "
                       "messages, says why) cuts it first; --truncation turns keeps it where it and an example's "
                       "last question fit the prompt's share (it drops the oldest whole turns instead, as "
                       "generation does), or raise --max-length",
               "keep_system": "it takes over half of the prompt's share of --max-length, which keep_system keeps "
                              "it within; --truncation turns keeps it whatever its length where whole turns fit, "
                              "or raise --max-length",
               "turns": "it and their last question together are over the prompt's share of --max-length, and "
                        "a cut inside a turn keeps the system message only within half of the share; raise "
                        "--max-length"}
        own = (" (--system replace leaves the conversations' own system text out of it)" if args.system == "keep"
               and train.get("source_system_prompts") else "")
        # a tokenizer of one language's text spells the English profile prompt nearly letter by letter
        trained = _tokenizer_settings(manifest)  # {} for a checkpoint's own tokenizer: nothing to retrain
        learnt = ("" if not trained or "system_prompts" in trained else
                  "; a tokenizer trained with `tokenizer train --system-prompts` spells the English profile prompt in "
                  "fewer pieces (a Chinese-only one: 46 tokens, not 116)")
        print(f"warning: {train['system_cut']} of {train['examples']} train examples "
              f"({train['system_cut'] / train['examples']:.0%}) lost their opening system message, whole or in part, "
              f"the profile prompt Bucket-SFT conditions on: {fix[args.truncation]}{own}{learnt}", file=sys.stderr)
    print(f"rendered with chat template {manifest['template']}, profile {options.profile}, system messages "
          f"{options.system}, truncation {options.truncation}")
    print(f"Bucket-SFT weights: {manifest['weight_options']['source']}; dataset: {manifest['dataset']}")
    print(f"read what training reads: polyalign show {args.run}")
    return 0


def _prompts_cut_line(cut: int, records: int, budget: int, dropped: int, inside: int, lost: int, whose: str,
                      kept: str) -> str:
    """What --max-prompt-tokens took from the prompts over it (chat.cut_prompt), as generate and prompts say it."""
    both = dropped + inside - cut  # the two groups overlap: a prompt still over may have lost turns first
    said = ([f"{dropped} {whose}lost their oldest whole turns"] if dropped else []) + (
        [f"{inside} still over with only the last question left: {kept}"
         + (f" ({both} of them after losing their oldest turns)" if both > 0 else "")] if inside else [])
    return (f"{cut} of {records} prompts were longer than --max-prompt-tokens {budget}: {'; '.join(said)}"
            + (f"; {lost} of those lost their opening system message too, since it takes over half of "
               "--max-prompt-tokens (a cut inside a turn keeps it only within half)" if lost else ""))


def _add_show(sub) -> None:
    p = sub.add_parser("show", help="built examples (or preference pairs) as training reads them: the text, the "
                                    "trained tokens",
                       description="Decodes examples of RUN/build as `build` stored them: the rendered conversation "
                                   "with the tokens the loss trains on between ⟦ and ⟧ (the reply and its "
                                   "end-of-turn token), the record's bucket and Bucket-SFT weight, and with --ids "
                                   "the token ids and the loss mask. Given a pairs file and --checkpoint (the "
                                   "preference run's init), each pair's chosen and rejected sides as that run "
                                   "tokenises and cuts them.",
                       epilog="e.g. polyalign show RUN --id chats-train-000123-turn-4 --ids\n"
                              "     polyalign show RUN/pairs/train.jsonl --checkpoint SFT/model --max-length 128 "
                              "--truncation turns",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="run directory built by `polyalign build`, or a pairs file (JSONL from "
                                          "`polyalign pairs` or `pairs import`)")
    p.add_argument("--split", choices=("train", "val"), default=None, help="a run's split (default: train)")
    p.add_argument("--id", action="append", default=[], dest="ids", metavar="ID",
                   help="the example of this record, or the pair of this id (repeatable; record ids are in "
                        "RUN/data/SPLIT.jsonl, pair ids in the pairs file)")
    p.add_argument("--limit", type=int, default=3, help="without --id: the first N examples in stored order "
                                                        "(default 3)")
    p.add_argument("--ids", action="store_true", dest="token_ids", help="also the token ids and the loss mask")
    pairs = p.add_argument_group("a pairs file, read as a preference run reads it (its settings of the same names)")
    pairs.add_argument("--checkpoint", type=Path, help="the run's init: its tokenizer and chat template")
    pairs.add_argument("--max-length", type=int, default=256, help="data.max_length: each side's cutoff (256)")
    pairs.add_argument("--truncation", choices=TRUNCATIONS, default="left", help="truncation (default left)")
    pairs.add_argument("--profile", choices=PROFILE_MODES, default="context", help="profile (default context)")
    p.set_defaults(handler=_run_show, parser=p)


PAIR_SHOW_OPTIONS = ("checkpoint", "max_length", "truncation", "profile")


def _run_show(args) -> int:
    # heavy: tensorflow_datasets, kept out of --help
    from polyalign.inputs.show import show_examples, show_pairs

    if not args.run.exists():
        raise ConfigError(f"{args.run}: no such run folder or pairs file")
    if args.run.is_file():
        if args.checkpoint is None:
            raise ConfigError(f"{args.run} is a file: a pairs file is shown as a preference run reads it, with its "
                              "init's tokenizer and template: give --checkpoint INIT")
        if args.split is not None:
            raise ConfigError("--split is a run's; a pairs file is one split")
        from polyalign.pairs.make import read_pairs  # heavy: etils.epath, kept out of --help

        blocks = show_pairs(read_pairs(args.run), str(args.run), args.checkpoint, max_length=args.max_length,
                            truncation=args.truncation, profile=args.profile, ids=args.ids, limit=args.limit,
                            token_ids=args.token_ids)
    else:
        given = [f"--{name.replace('_', '-')}" for name in PAIR_SHOW_OPTIONS
                 if getattr(args, name) != args.parser.get_default(name)]
        if given:
            raise ConfigError(f"{', '.join(given)}: for a pairs file; a run's examples are shown as its build made "
                              f"them (its settings: {Path(args.run) / 'build' / 'manifest.json'}; `polyalign build "
                              f"{args.run} --max-length N --overwrite` builds them anew)")
        blocks = show_examples(args.run, args.split or "train", args.ids, args.limit, args.token_ids)
    for block in blocks:
        print(block + "\n")
    return 0


SYSTEM_CUT_WARNING = 0.05  # the share of train examples losing their profile prompt that build warns about


def _budget(text: str) -> int | str:
    """--max-new-tokens: a whole number (its range is checked with every other option's), or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1, or auto") from None


def _location(text: str):
    """A local path or a bucket URI (pathlib would turn gs://b into gs:/b)."""
    from polyalign.core.paths import as_path  # heavy: etils.epath (about 0.15 s), kept out of --help

    return as_path(text)


TRAIN_EPILOG = "\n".join(textwrap.wrap(
    f"Every method's config has the same sections: method, init, {shared_sections_help()}, plus the method's "
    "own keys (train.steps or train.epochs sets the length). key=value arguments override any field, e.g. "
    "train.steps=500 model.dtype=bfloat16 parallel.data=4; unknown keys are an error that names the closest "
    "known one.", 104)) + "\n--print-config prints every key of the resolved config with its value and exits.\n"


def _add_train(sub) -> None:
    p = sub.add_parser("train", help=f"train a model ({', '.join(METHODS)})", description="Training.",
                       epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    methods = p.add_subparsers(dest="method", metavar="METHOD", required=True)
    for spec in METHODS.values():
        m = methods.add_parser(spec.name, help=spec.summary, description=spec.description,
                               epilog=spec.epilog + "\n" + settings_help(spec.config) + "\n" + TRAIN_EPILOG,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        m.add_argument("--config", type=Path, help=f"config (YAML), e.g. {spec.example}; without it, every default")
        # the critic keeps no checkpoints: each run trains it from the start (train/run.py trained_files)
        again = ("trained again from the start: the critic keeps no checkpoints" if spec.name == "critic" else
                 "resumed if it has checkpoints")
        m.add_argument("--out", type=_location, help=f"output directory, local or gs:// ({again})")
        m.add_argument("--print-config", action="store_true",
                       help="print the resolved config (every key, with defaults) and exit")
        m.add_argument("--no-progress", action="store_true", help="no progress bars")
        existing = m.add_mutually_exclusive_group()
        existing.add_argument("--resume", action="store_true",
                              help="run into OUT with changed resumable keys (train.steps, eval_every, ...)" +
                              (", trained from the start" if spec.name == "critic" else ", continuing its run"))
        existing.add_argument("--overwrite", action="store_true",
                              help="start over in OUT, removing what an earlier run of another config wrote there")
        if spec.name == "sft":
            m.add_argument("--allow-tokenizer-mismatch", action="store_true",
                           help="train `init` on a build encoded with another tokenizer (refused otherwise; the "
                                "config key allow_tokenizer_mismatch: true says the same)")
        m.add_argument("overrides", nargs="*", metavar="key=value", help="override config fields")
        m.set_defaults(handler=_run_train, parser=m)


def repeated_overrides(overrides: list[str]) -> list[str]:
    """A key given twice or more on the command line, with its values: the last one wins, said (a pasted line
    with `optimizer.lr=1e-3` and a later `optimizer.lr=5e-4` would otherwise train at one of them unremarked)."""
    values: dict[str, list[str]] = {}
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep:
            values.setdefault(key.strip(), []).append(value)
    return [f"{key} is given {len(given)} times ({', then '.join(given)}): the last one, {given[-1]}, is used"
            for key, given in values.items() if len(given) > 1]


def _run_train(args) -> int:
    flags = ["allow_tokenizer_mismatch=true"] if getattr(args, "allow_tokenizer_mismatch", False) else []
    config = load_config(args.config, [*args.overrides, *flags], method=args.method)
    # an override comes last, the subcommand's own method with it (`train hdpo ... method=dpo`): said, not silent
    renamed = (f"note: method={config.method} (an override) trains {config.method}, not the subcommand's "
               f"{args.method}" if args.method and config.method != args.method else None)
    retargeted = None if renamed else retargeted_note(args.config, args.method)
    unread = [*([retargeted] if retargeted else []), *unread_settings(config), *repeated_overrides(args.overrides)]
    if args.print_config:
        print(config_as_yaml(config), end="")
        for note in [*([renamed] if renamed else []), *derived_notes(config), *unread]:  # comments: it reads back
            print(f"# {note}")
        return 0
    # every process of a job reads the same command: its notes are said once, by process 0 (a launched
    # job's stderr is each process's own, so `launch` cannot fold them into one)
    if os.environ.get("POLYALIGN_PROCESS_ID", "0").strip() in ("", "0"):
        if renamed:
            print(renamed, file=sys.stderr)
        for note in unread:
            print(f"note: {note}", file=sys.stderr)
    if args.out is None:
        args.parser.error("--out is required (or --print-config)")
    import jax  # heavy: kept out of --help

    from polyalign.train.run import train  # heavy: jax, kept out of --help

    existing = "resume" if args.resume else "overwrite" if args.overwrite else "continue"
    result = train(config, args.out, progress=not args.no_progress, existing=existing)
    saved = f"checkpoint saved ({result['checkpoint']})" if "checkpoint" in result else "no checkpoint kept"
    if jax.process_index() > 0:  # several processes ran one job: its outcome is said once, by process 0
        if result["interrupted"]:  # but a host's own log says that it stopped, and where
            print(f"process {jax.process_index()}: stopped at step {result['end_step']} with the job; {saved}")
        return 0
    if result["interrupted"]:
        print(f"stopped at step {result['end_step']}; {saved}. Run the same command to resume.")
        return 0
    if result["stopped_early"]:  # train.stop_at: the same command would stop there again
        where = (f"already at step {result['end_step']}, at or past train.stop_at={config.train.stop_at}; nothing "
                 "trained" if result.get("start_step") == result["end_step"] else
                 f"stopped at step {result['end_step']} (train.stop_at); checkpoint saved")
        print(f"{where}. To go on, run the same command with a later train.stop_at, or without it to train to "
              "the end.")
        return 0
    print(method_spec(config.method).implementation().summary_line(result))
    check = result.get("tokenizer_check", {})
    if check.get("checked") and not check["differing"]:
        print(f"tokenizer: {check['reader']} reads {result['model']} with the ids training used on "
              f"{check['probes']} probe texts")
    elif result.get("tokenizer_warning"):
        print(f"warning: {result['tokenizer_warning']}", file=sys.stderr)
    elif check.get("reason"):  # as build says it: a check not made is a line too, not silence
        print(f"tokenizer: {check['reason']}")
    return 0


PAIRS_EPILOG = """\
Pairs from your own preference data (TRL's {"prompt", "chosen", "rejected"}, strings or message lists,
UltraFeedback binarized among them; Anthropic HH-RLHF's "\\n\\nHuman: ... \\n\\nAssistant: ..." text; LLaMA-Factory's
ShareGPT pairs), labelled and bucketed as `polyalign prepare` labels records:
  polyalign pairs import --format trl --input prefs.jsonl --out RUN/pairs/train.jsonl --language en \\
      --val-fraction 0.05 --val-out RUN/pairs/val.jsonl
Then: polyalign train dpo --out runs/dpo init=CHECKPOINT pairs=RUN/pairs/train.jsonl \\
      val_pairs=RUN/pairs/val.jsonl
(docs/preference.md).
"""


def _add_pairs(sub) -> None:
    p = sub.add_parser("pairs", help="preference pairs: human response chosen, the policy's generation rejected; "
                                     "or imported from TRL/HH/ShareGPT files",
                       description="Join records and predictions by id into weighted preference pairs "
                                   "(docs/preference.md). Pairs with an empty side or identical sides are dropped "
                                   "and counted. `pairs import` reads users' own preference files instead.",
                       epilog=PAIRS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=Path, help="records JSONL (the train or val split)")
    p.add_argument("--predictions", type=Path, help="the initial policy's predictions (JSONL)")
    p.add_argument("--out", type=Path, help="pairs JSONL")
    p.add_argument("--training-pairs", type=Path, metavar="TRAIN_PAIRS",
                   help="for held-out (validation) pairs: the training pairs whose bucket and language counts weigh "
                        "them, as METHOD section 7 and the training objective do (without it a file's pairs are "
                        "weighted by their own counts, right for training pairs)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT when it was made from other files "
                                                            "(or not by polyalign)")
    p.set_defaults(handler=_run_pairs, parser=p)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    imported = actions.add_parser("import", help="pairs from a TRL, Anthropic HH or ShareGPT preference file",
                                  description="Read a preference file into the pairs file the preference methods "
                                              "train on: every row labelled, bucketed and validated as prepare does; "
                                              "bad rows stop the import (file and line) or go to "
                                              "OUT.quarantine.jsonl; rows left out (an empty side, identical "
                                              "sides, a language outside the scheme) are counted and listed in "
                                              "OUT.dropped.jsonl. A row's own \"id\" is kept as "
                                              "record.meta.source_id.")
    imported.add_argument("--format", required=True, choices=("trl", "hh", "sharegpt-pairs"),
                          help="trl: {prompt, chosen, rejected} (strings, or message lists: chosen/rejected one "
                               "assistant message or the whole conversation); hh: {chosen, rejected} as Anthropic "
                               "HH text (or a prompt of such turns and the two answers); sharegpt-pairs: "
                               "{conversations, chosen, rejected}")
    imported.add_argument("--input", required=True, type=Path, help="JSON array or JSON Lines file")
    imported.add_argument("--out", required=True, type=Path, help="pairs JSONL")
    imported.add_argument("--dataset", help="name of the data (record ids, the scheme's source labels); "
                                            "default: the input's file name")
    imported.add_argument("--language", help="declared language (en, zh); default: each row's own, else detected")
    imported.add_argument("--track", choices=("single", "multi"),
                          help="default: each row's own, else multi when the prompt has earlier turns")
    imported.add_argument("--family", help="response family of rows that name none: assistant (the default), qa or "
                                           "dialogue (conversations between people)")
    imported.add_argument("--style", help="style label (default: the scheme's usual style for the family)")
    imported.add_argument("--scheme", type=Path, help="bucket scheme (default buckets/polyalign.yaml)")
    imported.add_argument("--on-error", choices=("fail", "quarantine"), default="fail",
                          help="a bad row stops the import (default) or goes to OUT.quarantine.jsonl")
    imported.add_argument("--val-fraction", type=float, metavar="F",
                          help="hold out about this share of the pairs, whole prompts at a time, as validation "
                               "pairs (their ids distinct from the training pairs'); 0 < F < 1")
    imported.add_argument("--val-out", type=Path, help="where the validation pairs go (default: OUT with .val, "
                                                       "e.g. train.val.jsonl)")
    imported.add_argument("--seed", type=int, default=0, help="seed of the --val-fraction split (default 0)")
    imported.add_argument("--overwrite", action="store_true",
                          help="replace OUT when it was made with other settings, or not by polyalign (the same "
                               "command again rewrites it from the input as the input is now; a training run "
                               "started on the old pairs then refuses to continue on them)")
    imported.set_defaults(handler=_run_pairs_import)
    accuracy = actions.add_parser(
        "accuracy", help="how often a model prefers the chosen answer of held-out pairs",
        description="Reward accuracy (the share of pairs whose implicit reward is higher for the chosen answer: "
                    "what preference training logs as val_rewards/accuracy, with the reward of the model's method: "
                    "beta (pi - rho) against a reference model, or for SimPO and ORPO beta times the mean log-prob "
                    "per token) and log-prob preference (the share whose chosen answer has the higher "
                    "mean log-prob per token, with the reference's own share as its baseline), per bucket and "
                    "overall, each with a 95% Wilson interval. Settings left out are read from the model's "
                    "training record (a polyalign export): the reference is the model it was trained from.",
        epilog="Writes OUT/accuracy.json (the table's numbers, the settings and where each came from) and "
               "OUT/per_pair.jsonl (each pair's log-probs, margin and verdicts: join two models' files on `id` "
               "for a paired comparison).")
    accuracy.add_argument("--model", required=True, type=Path, help="the model folder (e.g. OUT/model)")
    accuracy.add_argument("--pairs", required=True, type=Path,
                          help="pairs JSONL (`polyalign pairs` or `pairs import`), e.g. held-out test pairs")
    accuracy.add_argument("--out", required=True, type=Path, help="output folder")
    accuracy.add_argument("--reference", help="the reference model (default: the model's training record's init, "
                                              "the model it was trained from); `none` for none: the log-prob "
                                              "preference alone, without its baseline")
    accuracy.add_argument("--reward", choices=PAIR_REWARDS,
                          help="against_reference: beta (pi - rho), DPO's; mean_logprob: beta times the mean log-prob "
                               "per token, SimPO's and ORPO's, no reference (default: the one the model's method "
                               "logs, else against_reference)")
    accuracy.add_argument("--beta", type=float, help="the implicit reward's inverse temperature (default: the "
                                                     "training record's, else 0.1); it scales the margin, not the "
                                                     "accuracy")
    accuracy.add_argument("--max-length", type=int, help="tokens of a pair's side, prompt and answer (default: the "
                                                         "training record's data.max_length, else 1024)")
    accuracy.add_argument("--profile", choices=PROFILE_MODES,
                          help="the profile system prompt (default: the one the model was trained with, as "
                               "generate renders its prompts)")
    accuracy.add_argument("--truncation", choices=TRUNCATIONS,
                          help="how a prompt over its share is cut (default: the training record's, else left)")
    accuracy.add_argument("--batch-size", type=int, default=8, help="pairs a forward pass (default 8)")
    _dtype_option(accuracy, "the model and its reference")
    accuracy.add_argument("--overwrite", action="store_true",
                          help="replace OUT when it was made with other settings (or not by polyalign)")
    accuracy.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    accuracy.set_defaults(handler=_run_pairs_accuracy)


def _run_pairs_accuracy(args) -> int:
    from polyalign.train.pair_accuracy import AccuracyOptions, pairs_accuracy, print_summary  # heavy: jax

    options = AccuracyOptions(reference=args.reference, reward=args.reward, beta=args.beta, max_length=args.max_length,
                              profile=args.profile, truncation=args.truncation, batch_size=args.batch_size,
                              dtype=args.dtype)
    summary = pairs_accuracy(args.model, args.pairs, args.out, options, overwrite=args.overwrite,
                             progress=args.progress)
    print_summary(summary, args.out)
    return 0


# polyalign.train.pair_accuracy.REWARDS, spelled out so that --help imports nothing heavy (a test keeps them equal).
PAIR_REWARDS = ("against_reference", "mean_logprob")
HELD_OUT_SPLIT_NAMES = ("val", "validation", "dev", "test")  # records files whose pairs are held out


def _run_pairs(args) -> int:
    from polyalign.pairs.make import make_pairs  # heavy: etils.epath, kept out of --help

    missing = [f"--{name}" for name in ("records", "predictions", "out") if getattr(args, name) is None]
    if missing:
        args.parser.error(f"{', '.join(missing)} required (or `pairs import` for a preference file)")
    summary = make_pairs(args.records, args.predictions, args.out, overwrite=args.overwrite,
                         training_pairs=args.training_pairs)
    dropped = ", ".join(f"{k} {v}" for k, v in summary["dropped"].items()) or "none"
    print(f"{summary['pairs']} pairs from {summary['predictions']} predictions; dropped: {dropped}; weighted by "
          f"{summary['weighted_by']}")
    if args.training_pairs is None and args.records.stem.lower() in HELD_OUT_SPLIT_NAMES:
        print(f"note: {args.records} looks like held-out records, and its pairs are weighted by their own bucket and "
              "language counts; validation pairs are weighted as training weighs them with --training-pairs "
              "TRAIN_PAIRS (the training pairs file)", file=sys.stderr)
    # how many records a bucket `generate --per-bucket` answered, where it made the predictions
    per_bucket = ((read_record(args.predictions) or {}).get("settings") or {}).get("per_bucket")
    _note_few_bucket_pairs(summary, args.records, per_bucket)
    print(f"pairs: {args.out}")
    return 0


def _note_few_bucket_pairs(summary: dict, records: Path, per_bucket: int | None = None) -> None:
    """Pairs follow the answered records' mix: a note names the buckets that get few or none, and how to
    answer every bucket where its records allow more (`per_bucket`: what the predictions' generate took)."""
    few = summary["few_pairs"]
    if not few:
        return
    none = sum(1 for paired, *_ in few.values() if paired == 0)
    fewest = sorted(few.items(), key=lambda item: item[1][0])
    listed = ", ".join(f"{bucket} {counts[0]}" for bucket, counts in fewest[:4])
    listed += f" and {len(few) - 4} more" if len(few) > 4 else ""
    # [pairs, records, answered records]; summaries before answered records were counted: as many as paired
    unanswered = any(held > (rest[0] if rest else paired) for paired, held, *rest in few.values())
    more = (f"these predictions answered {per_bucket} records a bucket (`generate --per-bucket {per_bucket}`); a "
            f"larger --per-bucket answers more of every bucket of {records}" if per_bucket else
            f"`polyalign generate --per-bucket N` answers N records of every bucket of {records}")
    hint = (f"; {more}" if unanswered
            else "; every record of those buckets was answered already (an empty answer, or the person's own, makes "
                 "no pair)")
    print(f"note: {len(few)} of {summary['buckets']} buckets of {records} get fewer than {summary['few_below']} "
          f"pairs, {none} of them none (fewest: {listed}): pairs follow the answered records' mix, and a bucket's "
          f"weight lifts its few pairs but cannot stand in for missing ones{hint}", file=sys.stderr)


def _unread_files_note(source: dict) -> str | None:
    """Files in a source's folder that its format does not read (a zip of the same exports, a .csv): read by
    nobody, so said, with what the format reads."""
    from polyalign.data.importers import get_format  # the prepare command's own, loaded by now

    unread = source.get("unread_files")
    if not unread:
        return None
    shown = ", ".join(unread[:5]) + (f" and {len(unread) - 5} more (the manifest lists them)"
                                     if len(unread) > 5 else "")
    patterns = ", ".join(get_format(source["format"]).module.PATTERNS)
    are = "is" if len(unread) == 1 else "are"
    return (f"note: source {source['name']!r}: {counted(len(unread), 'file')} in its folder {are} not read "
            f"({source['format']} reads {patterns}): {shown}; unpack an archive into the folder, and give files of "
            "another format a source of their own")


def _warn_language_mismatches(mismatches: dict[str, int], what: str, declared_by: str, unit: str = "record"
                              ) -> None:
    """A declared language that the text's script contradicts labels records into another language's
    buckets: said on the console, not only in the manifest."""
    if line := language_mismatch_warning(mismatches, what, declared_by, unit):
        print(f"warning: {line}", file=sys.stderr)


def _run_pairs_import(args) -> int:
    from polyalign.pairs.importing import import_pairs  # heavy: numpy, datasketch (data.prepare), kept out of --help

    summary = import_pairs(args.input, args.out, args.format, dataset=args.dataset, language=args.language,
                           track=args.track, family=args.family or "assistant", style=args.style,
                           scheme_path=args.scheme,
                           on_error=args.on_error, overwrite=args.overwrite, val_fraction=args.val_fraction,
                           val_out=args.val_out, seed=args.seed)
    dropped = ", ".join(f"{k} {v}" for k, v in summary["dropped"].items()) or "none"
    # "training" only beside a validation share: a file imported whole may be someone's held-out pairs
    held_out = f" training + {summary['val_pairs']} validation" if "val_pairs" in summary else ""
    print(f"{summary['pairs']}{held_out} pairs from {counted(summary['read'], 'row')} in "
          f"{counted(len(summary['buckets']), 'bucket')}; dropped: {dropped}")
    if "val_pairs" in summary:
        print(f"{summary['val_pairs']} validation pairs (other prompts, seed {summary['seed']}) "
              f"-> {summary['val_out']}")
    outside = {key.partition(":")[2]: n for key, n in summary["dropped"].items()
               if key.startswith("language_not_in_scheme:")}
    if outside:
        said = []
        for language, n in outside.items():
            detected = min(n, summary["languages_detected"].get(language, 0))
            said.append(f"{language} " + ", ".join([f"{n - detected} declared"] * (n > detected)
                                                   + [f"{detected} detected"] * (detected > 0)))
        print(f"note: rows in a language outside the scheme were dropped ({'; '.join(said)}); --language LANG "
              "labels every row of the file instead", file=sys.stderr)
    if summary.get("dropped_rows"):
        print(f"dropped rows, with their lines and reasons -> {summary['dropped_rows']}")
    _warn_language_mismatches(summary.get("language_mismatches", {}), str(args.input), "--language", "pair")
    if summary.get("mojibake"):  # prepare's fix_encoding has no pairs counterpart: the file is the place to mend
        print(f"warning: {args.input}: {counted(summary['mojibake'], 'pair')} held mojibake in the prompt or the "
              f"chosen answer ({MOJIBAKE}), kept as read; repair the file's texts first (ftfy.fix_encoding on each "
              "string; ftfy is installed with polyalign)", file=sys.stderr)
    conversations = summary["multi_turn_families"].get("assistant", 0)
    if args.family is None and conversations:
        print(f"note: {conversations} multi-turn pairs are labelled family assistant, --family's default; "
              "conversations between people (KdConv, MultiWOZ-like dialogues) belong in --family dialogue")
    if summary.get("rejected_chosen_elsewhere"):
        print(f"warning: {summary['rejected_chosen_elsewhere']} of {summary['pairs'] + summary.get('val_pairs', 0)} "
              "pairs reject an answer another pair chooses, word for word: training pushes each such answer up in "
              "one pair and down in the other (rejected answers borrowed from other rows' chosen ones teach little "
              "but that)", file=sys.stderr)
    if summary["system_messages"]:
        print(f"{summary['system_messages']} rows had a system message, kept as their system prompt (training "
              "adds the profile prompt after it; docs/model.md, System messages)")
    if summary.get("system_is_profile_prompt"):
        print(f"{counted(summary['system_is_profile_prompt'], 'row')} opened with polyalign's own profile prompt as "
              "their system message: left out (training writes the profile prompt from each pair's labels, never "
              "twice)")
    if summary["quarantined"]:
        print(f"quarantined {counted(summary['quarantined'], 'row')} -> "
              f"{args.out.with_name(args.out.stem + '.quarantine.jsonl')}")
    print(f"pairs: {args.out}")
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample one response per record with a checkpoint",
                       description="Generate one response per record with the engine (continuous batching over a "
                                   "paged KV cache: a finished answer's slot takes the next record at once). Each "
                                   "record samples from its own seed, made from --seed and its id, so an answer does "
                                   "not depend on which records share the batch. Writes JSONL rows "
                                   "{id, prediction, model, finish_reason, new_tokens, profile} in record order, "
                                   "and its manifest beside it (P.jsonl -> P.manifest.json: settings, budgets, "
                                   "the share of each bucket's answers that hit the length limit).")
    p.add_argument("--checkpoint", required=True, type=_location,
                   help="Hugging Face checkpoint directory with its tokenizer (local or gs://)")
    p.add_argument("--records", required=True, type=Path, help="records JSONL, e.g. RUN/data/test.jsonl (or a "
                                                               "pairs file: each pair's record)")
    p.add_argument("--out", required=True, type=Path, help="predictions JSONL")
    p.add_argument("--profile", choices=PROFILE_MODES,
                   help="profile system prompt (default: the one the checkpoint was trained with; none for a "
                        "checkpoint polyalign did not train, such as a base model. context: what a real request "
                        "reveals; oracle adds the gold length bin and must be labelled as such in reports)")
    p.add_argument("--template", choices=TEMPLATE_CHOICES, help=TEMPLATE_HELP)
    _budget_options(p, 128, "most tokens per answer (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    left = ("; left unset, the checkpoint's generation_config.json value where it sets one, as serve and vLLM "
            "take it, else ")
    p.add_argument("--top-p", type=float, help="nucleus sampling: keep the smallest set of tokens holding this "
                                               f"probability{left}1.0, no cut")
    p.add_argument("--top-k", type=int, help=f"sample among the k most likely tokens{left}0, no cut")
    p.add_argument("--min-p", type=float, help="sample among the tokens at least this share as likely as the "
                                               f"likeliest{left}0, no cut")
    p.add_argument("--repetition-penalty", type=float,
                   help="divide the positive logits of tokens in the prompt or the answer so far by this, multiply "
                        "the negative ones (as transformers and vLLM; Qwen2.5-Instruct's generation_config sets "
                        f"1.05; applies to greedy decoding too){left}1, none")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of each token the answer holds (OpenAI's, -2 to 2; default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times the number of times the answer holds a token (OpenAI's, -2 to 2; "
                        "default 0)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences decoded at once (default 16)")
    _dtype_option(p, "the model")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="a longer prompt loses its oldest whole turns, its opening system message kept; one still over "
                        "with its last question alone keeps its end (default 512; for a model polyalign trained from "
                        "scratch on sequences of L tokens, what L leaves after the answer's budget, at least L/2)")
    p.add_argument("--limit", type=int, help="only the first N records")
    p.add_argument("--sample", type=int, help="a seeded random subset of N records (kept in file order)")
    p.add_argument("--per-bucket", type=int, metavar="N",
                   help="a seeded random N records of each bucket (all of a smaller one's; kept in file order): "
                        "pairs and evaluations for every bucket, not the data's mix")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and of --sample's and --per-bucket's "
                                                       "subsets)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT when it was generated with other settings "
                                                            "(or not by polyalign)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_run_generate)


def _budget_options(parser, default: int | None, what: str) -> None:
    """--max-new-tokens and the per-bucket budget options of `auto`, as generate and prompts take them."""
    parser.add_argument("--max-new-tokens", type=_budget, default=default,
                        help=f"{what}, or auto: each record's bucket's human length (the --budget-quantile of the "
                             "bucket's answers in --budget-records, in this model's tokens, times --budget-margin; at "
                             "most --budget-ceiling)")
    parser.add_argument("--budget-records", type=Path,
                        help="with --max-new-tokens auto: the records whose human answers set each bucket's budget "
                             "(default: train.jsonl beside --records, e.g. RUN/data/train.jsonl)")
    parser.add_argument("--budget-quantile", type=float, default=0.99,
                        help="with auto: the length quantile (default 0.99)")
    parser.add_argument("--budget-margin", type=float, default=1.2, help="with auto: times this (default 1.2)")
    parser.add_argument("--budget-ceiling", type=int, default=None,
                        help="with auto: the most tokens of any bucket (default 1024, or for a model trained from "
                             "scratch what the prompt leaves of its trained length)")


def _budget_records(args) -> Path | None:
    """With --max-new-tokens auto, the records whose answers set the budgets (checked to exist); otherwise
    None, and the budget options refused, since only auto reads them."""
    if args.max_new_tokens != "auto":
        given = [option for option, value, default in (("--budget-records", args.budget_records, None),
                                                        ("--budget-quantile", args.budget_quantile, 0.99),
                                                        ("--budget-margin", args.budget_margin, 1.2),
                                                        ("--budget-ceiling", args.budget_ceiling, None))
                 if value != default]
        if given:
            raise GenerationError(f"{', '.join(given)}: budgets by bucket, which only --max-new-tokens auto sets")
        return None
    budget_records = args.budget_records or args.records.parent / "train.jsonl"
    if not budget_records.is_file():
        raise GenerationError(f"--max-new-tokens auto: {budget_records} does not exist; name the records whose "
                              "human answers set the budgets with --budget-records (e.g. RUN/data/train.jsonl)")
    return budget_records


def _dtype_option(parser, what: str) -> None:
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help=f"weights and computation of {what} (default auto: bfloat16 on GPU and TPU, float32 on "
                             "a CPU)")


def _run_generate(args) -> int:
    from polyalign.generate.run import (  # heavy: jax, kept out of --help
        BUDGET_CEILING,
        GenerateOptions,
        SamplingConfig,
        generate_predictions,
    )
    from polyalign.generate.settings import NEUTRAL_FLAGS, describe_sampling, unset_from_checkpoint  # this command's

    auto = args.max_new_tokens == "auto"
    budget_records = _budget_records(args)
    given = {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty}
    if args.temperature == 0 and (shaping := [f"--{key.replace('_', '-')} {value:g}" for key, value in given.items()
                                              if key != "repetition_penalty" and value is not None
                                              and value != NEUTRAL_FLAGS[key]]):
        # greedy decoding takes the most likely token: top-p, top-k and min-p only choose what sampling draws from
        print(f"note: {' and '.join(shaping)} {'does' if len(shaping) == 1 else 'do'} nothing under greedy decoding "
              "(--temperature 0, the default); give --temperature (e.g. 0.8) to sample from what "
              f"{'it keeps' if len(shaping) == 1 else 'they keep'}")
    chosen, taken = unset_from_checkpoint(given, args.checkpoint)
    if taken:
        print(f"note: {describe_sampling(taken)} from {args.checkpoint}/generation_config.json for the settings not "
              "given, as `polyalign serve` and vLLM take them (give them, e.g. "
              f"{' '.join('--' + k.replace('_', '-') + ' ' + format(NEUTRAL_FLAGS[k], 'g') for k in taken)}, to "
              "decode without)")
    options = GenerateOptions(profile=args.profile, template=args.template,
                              sampling=SamplingConfig((args.budget_ceiling or BUDGET_CEILING) if auto
                                                      else args.max_new_tokens,
                                                      args.temperature, **chosen,
                                                      presence_penalty=args.presence_penalty,
                                                      frequency_penalty=args.frequency_penalty),
                              batch_size=args.batch_size, limit=args.limit,
                              max_prompt_tokens="auto" if args.max_prompt_tokens is None else args.max_prompt_tokens,
                              sample=args.sample, seed=args.seed, per_bucket=args.per_bucket,
                              budget_records=None if budget_records is None else str(budget_records.resolve()),
                              budget_quantile=args.budget_quantile, budget_margin=args.budget_margin, dtype=args.dtype,
                              budget_ceiling_chosen=args.budget_ceiling is None)
    summary = generate_predictions(args.checkpoint, args.records, args.out, options, progress=not args.no_progress,
                                   overwrite=args.overwrite)
    for note in summary["notes"]:
        print(said_as_note(note))
    rate = f" ({summary['tokens_per_s']} tokens/s)" if summary["new_tokens"] else ""
    print(f"{summary['records']} predictions ({summary['finish_reasons']['stop']} stopped, "
          f"{summary['finish_reasons']['length']} hit the length limit): {summary['new_tokens']} new tokens in "
          f"{summary['seconds']} s{rate}")
    if summary["prompts_cut"]:
        print(_prompts_cut_line(summary["prompts_cut"], summary["records"], summary["max_prompt_tokens"],
                                summary["prompts_cut_turns_dropped"], summary["prompts_cut_mid_turn"],
                                summary["prompts_cut_system_lost"], "", "cut inside it, its end kept"))
    if auto:
        budgets = summary["budgets"]["by_bucket"]
        print(f"budgets by bucket ({len(budgets)} buckets of {budget_records}): "
              f"{min(budgets.values())}-{max(budgets.values())} tokens")
    cut = {b: share for b, share in summary["truncated_by_bucket"].items() if share > 0}
    if cut:
        print("hit the length limit, by bucket: " + ", ".join(f"{b} {_share(share)}" for b, share in
                                                              sorted(cut.items(), key=lambda kv: -kv[1])[:6])
              + (" ..." if len(cut) > 6 else "") + f" (all in {sidecar(args.out)})")
    if summary["empty"] or summary.get("without_words"):
        print(empty_answers_warning(summary, greedy=args.temperature == 0))
    print(f"predictions: {args.out}")
    return 0


def said_as_note(line: str) -> str:
    """A stage's note as every command prints one, `note: ...`, unless it says already what it is (a warning,
    a resumption): generate and prompts printed some bare, beside others that began `note:`."""
    return line if line.startswith(("note: ", "warning: ", "resuming: ")) else f"note: {line}"


def empty_answers_warning(summary: dict, greedy: bool) -> str:
    """What `generate` says of answers that are empty once decoded and stripped (how many ended the turn
    at once, how many decoded only whitespace and then ended it, and how many until the token budget), and of
    answers without a word (punctuation only, as evaluate reads them)."""
    at_budget, empty, wordless = summary.get("empty_at_budget", 0), summary["empty"], summary.get("without_words", 0)
    at_once = summary.get("empty_at_once", empty - at_budget)
    ways = [(at_once, "ended the turn at once"), (empty - at_once - at_budget, "decoded only whitespace, then ended "
            "the turn"), (at_budget, "decoded only whitespace until the token budget")]
    how = ", ".join(f"{count} {way}" for count, way in ways if count)
    said = [f"{empty} of {summary['records']} answers are empty after decoding ({how})"] * bool(empty)
    said += [f"{wordless} of {summary['records']} hold no word (punctuation only)"] * bool(wordless)
    return (f"warning: {'; '.join(said)}; evaluate counts them and leaves them out of diversity"
            + ("; greedy decoding of a small model often does this, --temperature 0.8 samples instead"
               if greedy else ""))


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP endpoint over a checkpoint",
                       description="Serve a checkpoint over HTTP as OpenAI's API does: GET /v1/models, POST "
                                   "/v1/chat/completions (messages rendered with the checkpoint's chat template) and "
                                   "POST /v1/completions, through the generation engine (requests join the running "
                                   "batch as they arrive). Any OpenAI client works: base_url=http://HOST:PORT/v1; "
                                   "stream=true streams the answer as it is decoded. Needs the serve extra: pip "
                                   "install 'polyalign[serve]'.")
    p.add_argument("--checkpoint", required=True, type=_location,
                   help="Hugging Face checkpoint directory with its tokenizer, e.g. OUT/model")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--template", choices=TEMPLATE_CHOICES, help=TEMPLATE_HELP)
    p.add_argument("--slots", type=int, default=16,
                   help="sequences decoded at once, and the most samples (n) one request may ask for (default 16)")
    p.add_argument("--max-sequence", type=int, default=None,
                   help="the longest prompt plus answer of one request, in tokens (default: the model's positions, "
                        "at most 2048, and for a model trained from scratch the longest sequence it was trained on)")
    p.add_argument("--max-pending", type=int, default=64,
                   help="requests waiting or running at once; more are answered 429 (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="a request's budget when it names no max_tokens (default 256), cut to what --max-sequence "
                        "leaves after its prompt, as vLLM cuts it (a max_tokens past that is answered 400)")
    p.add_argument("--steps-per-sync", type=int, default=8,
                   help="tokens each sequence decodes between two visits of the scheduler (default 8): a streamed "
                        "answer arrives in pieces of about that many, and a new request joins after at most that "
                        "many; 1 streams token by token, at some cost in throughput")
    p.add_argument("--model-name", help="the model's name in /v1/models and responses (default: the run folder)")
    p.add_argument("--no-request-log", dest="log_requests", action="store_false",
                   help="no line per request (by default: time, method, path, status, seconds, prompt + completion "
                        "tokens, on standard output)")
    p.set_defaults(handler=_run_serve)


def _run_serve(args) -> int:
    from polyalign.generate.serve import ServeOptions, serve  # heavy: jax, kept out of --help

    serve(args.checkpoint, ServeOptions(host=args.host, port=args.port, slots=args.slots,
                                        max_sequence=args.max_sequence, max_pending=args.max_pending,
                                        max_new_tokens=args.max_new_tokens, model_name=args.model_name,
                                        log_requests=args.log_requests, steps_per_sync=args.steps_per_sync),
          template=args.template)
    return 0


def _add_prompts(sub) -> None:
    p = sub.add_parser("prompts", help="the exact prompts of each record, for generating with vLLM or SGLang",
                       description="Write one row per record: {id, messages (the chat messages polyalign renders, "
                                   "profile system prompt included), prompt (the rendered string ending with the "
                                   "assistant header)}. Answers as rows {id, prediction} feed `polyalign pairs` "
                                   "and `polyalign evaluate` (docs/evaluation.md).")
    p.add_argument("--records", required=True, type=Path, help="records JSONL, e.g. RUN/data/test.jsonl")
    p.add_argument("--checkpoint", type=_location,
                   help="checkpoint (or tokenizer) directory whose tokenizer and chat template render the prompts; "
                        "without one, each row holds the messages alone, whole, for a chat API that applies its own "
                        "template (no prompt, ids or cut)")
    p.add_argument("--out", required=True, type=Path, help="prompts JSONL")
    p.add_argument("--profile", choices=PROFILE_MODES,
                   help="profile system prompt (default: the one the checkpoint was trained with; none for a "
                        "checkpoint polyalign did not train)")
    p.add_argument("--template", choices=TEMPLATE_CHOICES, help=TEMPLATE_HELP)
    p.add_argument("--limit", type=int, help="only the first N records")
    p.add_argument("--sample", type=int, help="a seeded random subset of N records (kept in file order): the records "
                                              "`polyalign generate --sample N --seed S` answers")
    p.add_argument("--per-bucket", type=int, metavar="N",
                   help="a seeded random N records of each bucket (kept in file order): the records "
                        "`polyalign generate --per-bucket N --seed S` answers")
    p.add_argument("--seed", type=int, default=0, help="seed of --sample's and --per-bucket's subsets (default 0)")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="with --checkpoint, cut prompts as `polyalign generate --max-prompt-tokens N` does (default: "
                        "generate's, for the --max-new-tokens given here, else for generate's 128): a "
                        "longer conversation's messages and ids lose their oldest whole turns; each row holds "
                        "prompt_token_ids, the ids generate feeds (vLLM's TokensPrompt)")
    _budget_options(p, None, "each row's max_tokens, as `polyalign generate --max-new-tokens` budgets its answer "
                             "(default: none in the rows)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT when it was written with other settings")
    p.set_defaults(handler=_run_prompts, parser=p)


def prompts_budget(args) -> int | str | None:
    """`prompts`' --max-prompt-tokens: generate's default ("auto") with a checkpoint; none without one (whole
    conversations: a cut counts a model's tokens), where asking for one is an error."""
    if args.checkpoint is None:
        if args.max_prompt_tokens is not None:
            raise ConfigError("--max-prompt-tokens counts a model's tokens: give --checkpoint too (without one, the "
                              "rows hold each conversation whole)")
        return None
    return args.max_prompt_tokens if args.max_prompt_tokens is not None else "auto"


def _tokenizer_settings(build: dict) -> dict:
    """The settings a build's tokenizer was trained with (its tokenizer_report.json), or {} for a checkpoint's
    own tokenizer or one polyalign did not train."""
    from polyalign.tokens.tokenizer_training import read_report  # heavy: sentencepiece, kept out of --help

    recorded = Path(str(build.get("tokenizer", "")))  # the tokenizer's folder, or its file
    report = read_report(recorded if recorded.is_dir() else recorded.parent) or {}
    return report.get("settings") or {}


def _run_prompts(args) -> int:
    from polyalign.generate.prompts import write_prompts  # heavy: jax, kept out of --help

    budget = prompts_budget(args)
    summary = write_prompts(args.checkpoint, args.records, args.out, profile=args.profile, template=args.template,
                            limit=args.limit, sample=args.sample, seed=args.seed,
                            per_bucket=args.per_bucket, max_prompt_tokens=budget,
                            max_new_tokens=args.max_new_tokens,
                            budget_records=_budget_records(args), budget_quantile=args.budget_quantile,
                            budget_margin=args.budget_margin, budget_ceiling=args.budget_ceiling,
                            overwrite=args.overwrite)
    for note in summary["notes"]:
        print(said_as_note(note))
    if summary["template"] is None:
        print(f"{summary['records']} conversations written as messages (profile {summary['profile']}, system "
              "messages in place), whole: no --checkpoint, so no rendered prompt or token ids; the engine's chat "
              "template renders them, and a conversation longer than its context is for it to cut")
    else:
        print(f"{summary['records']} prompts rendered with the {summary['template']} template, profile "
              f"{summary['profile']}, system messages {summary['system']}; stop generating at "
              f"{', '.join(summary['stop'])}")
    if summary["prompts_cut"]:
        print(_prompts_cut_line(summary["prompts_cut"], summary["records"], summary["max_prompt_tokens"],
                                summary["messages_turns_dropped"], summary["messages_over_budget"],
                                summary["prompts_cut_system_lost"], "rows' messages and prompt_token_ids (as generate "
                                "cuts them) ", "their messages stay over it and their prompt_token_ids keep its end"))
    if budgets := summary.get("budgets"):
        print(f"max_tokens by bucket ({len(budgets)} buckets of {summary['budget_records']}): "
              f"{min(budgets.values())}-{max(budgets.values())} tokens, as generate --max-new-tokens auto budgets them")
    print(f"prompts: {args.out}")
    return 0


def _halvings(detect: dict) -> str:
    """The floor's range over its people-against-people halvings, where it has them, and the buckets it
    covers when they are fewer than the model's (one-answer buckets have none)."""
    spread = detect.get("floor_macro_spread")
    said = "" if not spread else (f" (mean of {detect['floor_halvings']} halvings of the people, "
                                  f"{spread[0]:.4f} to {spread[1]:.4f})")
    if detect.get("floor_buckets") and detect["floor_buckets"] < detect["buckets"]:
        said += (f"; people have a floor in {detect['floor_buckets']} of the {detect['buckets']} buckets (the others "
                 f"hold too few answers to halve), and in those the model reads {detect['macro_floored']:.4f}")
    return said


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="utility, diversity and naturalness metrics of predictions",
                       description="Evaluate predictions against the test records, joined by id. Writes "
                                   "EVAL/metrics.json (layout in docs/evaluation.md) and EVAL/report.html.")
    p.add_argument("--records", required=True, type=Path, help="test records, e.g. RUN/data/test.jsonl")
    p.add_argument("--predictions", required=True, type=Path, help="JSONL rows {id, prediction, ...}")
    p.add_argument("--out", required=True, type=Path, help="output folder EVAL")
    p.add_argument("--compat", choices=("reference",), help="reproduce the authors' metrics code (tokenisation, "
                                                          "constant features kept); default: CJK-aware")
    p.add_argument("--references", type=Path, help="train-only bucket references (RUN/stats/references.json) "
                                                   "for the HCR bands; default: the support's own q10-q90")
    p.add_argument("--support", type=Path,
                   help="human answers each bucket is measured against (RUN/data/train.jsonl, recommended): the "
                        "test records' own human answers then become the human floor, measured exactly as the "
                        "model's; default: the test records' human answers, floor from held-out halves of them")
    p.add_argument("--bootstrap-draws", type=int, default=200, metavar="N",
                   help="bootstrap draws for the intervals of BNG, HCR, F1 and detectability (default 200, "
                        "at least 20)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the bootstrap and the floor's held-out halves (the support's sample of at most "
                        "1,000 answers a bucket is the same whatever the seed)")
    p.add_argument("--no-diversity", action="store_true",
                   help="skip distinct-n and Self-BLEU (the slowest text metrics on long answers)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the echo-question and first-sentence reference rows")
    p.add_argument("--no-detectability", action="store_true",
                   help="skip detectability: per bucket, the ROC AUC of a classifier telling the model's answers "
                        "from people's answers to the same prompts (character n-grams; 0.5: it cannot tell)")
    p.add_argument("--featurizer", type=_location, help="checkpoint whose mean-pooled hidden states feed MAUVE and a "
                                                   "second detectability; without it MAUVE is reported as skipped")
    p.add_argument("--scorer", type=_location, help="checkpoint for the LM features added to BNG and HCR (not with "
                                                    "--support: the support is then the test records' own answers)")
    _dtype_option(p, "the featurizer and the scorer")
    p.add_argument("--allow-partial", action="store_true",
                   help="evaluate the intersection when ids are missing, duplicated or extra (said in the report); "
                        "not needed for the records `generate --limit/--sample` chose from this file, nor with "
                        "--prompts")
    p.add_argument("--prompts", type=Path, default=None, metavar="PROMPTS.jsonl",
                   help="the file `polyalign prompts` wrote for an external engine (vLLM, SGLang): predictions "
                        "answering the records it chose (--limit, --sample, --per-bucket) from --records are "
                        "evaluated on those, as generate's are")
    p.add_argument("--common-with", nargs="+", type=Path, default=(), metavar="PREDICTIONS",
                   help="other systems' predictions files: evaluate only the records every one of them and this one "
                        "answers once; evaluating each system with the same files gives the same rows, which "
                        "`polyalign report` compares (exports with missing or duplicated ids included)")
    p.add_argument("--overwrite", action="store_true", help="replace EVAL when it was evaluated with other settings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_run_evaluate)


def _run_evaluate(args) -> int:
    from polyalign.evaluate.run import EvaluateOptions, evaluate  # heavy: numpy, scipy, kept out of --help
    from polyalign.evaluate.support import IntervalOptions  # heavy: numpy, scipy, kept out of --help

    options = EvaluateOptions(compat=args.compat or "cjk", references=args.references, support=args.support,
                              featurizer=args.featurizer, scorer=args.scorer, allow_partial=args.allow_partial,
                              prompts=args.prompts, common_with=tuple(args.common_with),
                              intervals=IntervalOptions(draws=args.bootstrap_draws, seed=args.seed),
                              diversity=not args.no_diversity, baselines=not args.no_baselines,
                              detectability=not args.no_detectability, dtype=args.dtype)
    result = evaluate(args.records, args.predictions, args.out, options, overwrite=args.overwrite,
                      progress=not args.no_progress)
    m, reasons = result["metrics"], result.get("not_available", {})

    def show(value, metric=None):
        if value is not None:
            return f"{value:.4f}"
        return f"n/a ({reasons[metric]})" if metric in reasons else "n/a"

    floors = "" if m["bng"].get("floor_macro") is None else (
        f" (human floor: BNG {show(m['bng']['floor_macro'])}{_bracket(m['bng'].get('floor_macro_interval'), ' ')}, "
        f"HCR {show(m['hcr']['floor_macro'])}{_bracket(m['hcr'].get('floor_macro_interval'), ' ')})")
    answers = result.get("answers", {})
    empty = answers.get("empty", 0)
    # --compat reference keeps them in Distinct-n and Self-BLEU, as the authors' code does
    kept = "kept in diversity, as the authors' code does" if answers.get("in_diversity") else "left out of diversity"
    alignment, wordless = result["alignment"], answers.get("without_words", 0)
    said = []
    if alignment.get("common_with"):
        said.append(f"the ones all {alignment['common_with']} predictions files answer once (--common-with)")
        if alignment.get("missing") or alignment.get("duplicate"):  # this file's own, among the others' answers
            said.append("this file left out " + ", ".join(
                f"{alignment[key]} {word}" for key, word in (("missing", "that another file answers"),
                                                            ("duplicate", "answered twice differently"))
                if alignment.get(key)))
    elif alignment.get("selected_by"):
        said.append(f"the ones `{alignment['selected_by']}` {'chose' if 'chosen' in alignment else 'answered'}")
    # generate's own selection leaves the records it did not choose without a prediction: expected, not said
    chosen_by_generate = alignment.get("selected_by") and "chosen" not in alignment
    left = [] if alignment.get("common_with") else [f"{alignment[key]} {word}" for key, word in (
        ("missing", "without a prediction") if not chosen_by_generate else ("", ""),
        ("duplicate", "answered twice or more with different answers (every copy left out)"),
        ("extra", "predictions for ids the records do not hold")) if key and alignment.get(key)]
    if left or (alignment.get("partial") and not alignment.get("selected_by") and not alignment.get("common_with")):
        said.append("partial: the ids with one answer" + (f"; {', '.join(left)}" if left else ""))
    if alignment.get("identical_copies"):
        n = alignment["identical_copies"]
        said.append(f"{counted(n, 'id')} given twice or more with the same answer, kept once")
    as_people = answers.get("empty_as_people", 0)
    where = f" ({as_people} where people's answer is empty too)" if as_people else ""
    unworded = [f"{counted(empty, 'empty answer')}{where}"] * bool(empty) + [
        f"{counted(wordless, 'answer')} without a word (punctuation only)"] * bool(wordless)
    if unworded:
        said.append(f"{' and '.join(unworded)}, {kept}")
    of = f" of {alignment['records']}" if alignment.get("partial") else ""
    rows = f"{alignment['evaluated']}{of} rows" + (f" ({'; '.join(said)})" if said else "")
    mauve = show(m["mauve"]["global"]) if m["mauve"]["status"] == "computed" else \
        f"skipped ({reasons.get('mauve', 'not computed')})"
    print(f"{rows}: F1 {show(m['utility']['overall'].get('qa_f1'), 'utility')}, ROUGE-L "
          f"{show(m['utility']['overall'].get('rouge_l_f1'), 'utility')}, BNG "
          f"{show(m['bng']['overall_macro'], 'bng')}{_bracket(m['bng'].get('macro_interval'), ' ')}, "
          f"HCR {show(m['hcr']['overall_macro'], 'hcr')}{_bracket(m['hcr'].get('macro_interval'), ' ')}{floors}, "
          f"TDM {show(m['tdm']['overall_macro'], 'tdm')}{_bracket(m['tdm'].get('macro_interval'), ' ')}, MAUVE "
          f"{mauve}, aggregate {show(m['aggregate']['overall'], 'aggregate')}"
          f"{_bracket(m['aggregate'].get('interval'), ' ')}{_aggregate_parts(m['aggregate'])}")
    baselines = _baselines_line(m.get("reference_rows") or {}, m)
    if baselines:
        print(baselines)
    if behind := ahead_of_the_model(m):
        print(f"warning: {behind} (docs/evaluation.md, Reference rows)", file=sys.stderr)
    for text, warns in notes_for_reader(result):  # as the report writes them: a warning, or a note
        print(f"{'warning' if warns else 'note'}: {text}", file=sys.stderr if warns else sys.stdout)
    detect = m.get("detectability", {})
    if detect.get("status") == "computed":
        print(f"detectability (classifier AUC, 0.5: cannot tell the model from people): "
              f"{show(detect['overall_macro'])} {_bracket(detect.get('macro_interval'))} over {detect['buckets']} "
              f"buckets, against a human floor of {show(detect.get('floor_macro'))} "
              f"{_bracket(detect.get('floor_macro_interval'))}{_halvings(detect)}")
        if line := _hidden_states_line(detect.get("hidden_states") or {}):
            print(line)
    elif detect.get("reason"):
        print(f"detectability skipped ({detect['reason']})")
    for note in (m["mauve"].get("featurizer_note"), m["mauve"].get("note")):
        if note:
            print(f"note: MAUVE: {note}")
    print(f"metrics: {args.out / 'metrics.json'}; report: {args.out / 'report.html'}")
    return 0


def _hidden_states_line(hidden: dict) -> str | None:
    """Detectability on the featurizer's hidden states (with --featurizer), as the n-gram one is said."""
    if hidden.get("overall_macro") is None:
        return None
    floor = "" if hidden.get("floor_macro") is None else (
        f", against a human floor of {hidden['floor_macro']:.4f}{_bracket(hidden.get('floor_macro_interval'), ' ')}")
    return (f"detectability on the featurizer's hidden states: {hidden['overall_macro']:.4f}"
            f"{_bracket(hidden.get('macro_interval'), ' ')} over {counted(hidden['buckets'], 'bucket')}{floor}")


# the aggregate's parts as METHOD names them, each on [0, 1] with higher better
AGGREGATE_PART_LABELS = {"f1": "F1", "bng": "1/(1+BNG)", "mauve": "MAUVE", "nuf": "NUF"}


def _aggregate_parts(aggregate: dict) -> str:
    """What the aggregate is the geometric mean of: one part near 0 (F1 of a small model) pulls it there. With
    MAUVE among them, that its interval holds MAUVE at its value (composites.py: a MAUVE is a k-means fit,
    measured once, not per bootstrap draw), so the interval is narrower than the aggregate's noise."""
    parts = aggregate.get("parts") or {}
    said = [f"{label} {parts[key]:.4f}" for key, label in AGGREGATE_PART_LABELS.items() if parts.get(key) is not None]
    fixed = ("; its interval holds MAUVE at this value: MAUVE's own noise is not in it"
             if parts.get("mauve") is not None else "")
    return f" (geometric mean of {', '.join(said)}{fixed})" if aggregate.get("overall") is not None and said else ""


def _baselines_line(references: dict, m: dict) -> str:
    """The no-model answers' TDM and aggregate, which have no human floor: what the model's read against."""
    said = []
    shown = (("TDM", "tdm_macro", m["tdm"]["overall_macro"]), ("aggregate", "aggregate", m["aggregate"]["overall"]))
    for name, row in references.items():
        values = [f"{label} {row[key]:.4f}{_bracket(row.get(f'{key}_interval'), ' ')}" for label, key, model in shown
                  if row.get(key) is not None and model is not None]
        if values:
            said.append(f"{name} {', '.join(values)}")
    return f"no-model answers, measured as the model's: {'; '.join(said)}" if said else ""


def _bracket(interval, before: str = "") -> str:
    """An interval as the reports write it, after `before`; nothing where there is none."""
    return "" if not interval else before + interval_text(interval)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="side-by-side comparison of evaluation runs",
                       description="Compare EVAL folders: overall table, per-bucket bars, frontier overlay, "
                                   "and each run's settings (profile mode, test size).")
    p.add_argument("evals", nargs="+", type=Path, help="EVAL folders written by `polyalign evaluate`")
    p.add_argument("--out", required=True, type=Path, help="output folder of the comparison")
    p.add_argument("--names", nargs="+", metavar="NAME",
                   help="a column name for each EVAL folder, in order (default: the folders' names, with as many "
                        "parent folders as tell them apart)")
    p.add_argument("--overwrite", action="store_true", help="replace a comparison of other EVAL folders in OUT")
    p.add_argument("--allow-different-data", action="store_true",
                   help="compare intervals even between evaluations of other test records or another support "
                        "(by default those differences are shown but not called supported)")
    # a script that passes --no-progress to every stage (the demo's commands, a pipeline's Makefile) may pass
    # it here too: the comparison takes seconds and draws no bar
    p.add_argument("--no-progress", action="store_true", help="accepted as every command takes it; report draws "
                                                               "no progress bar")
    p.set_defaults(handler=_run_report, parser=p)


def _run_report(args) -> int:
    from polyalign.reports.evaluation import compare  # heavy: matplotlib, numpy, kept out of --help

    if args.names is not None and (len(args.names) != len(args.evals) or len(set(args.names)) != len(args.names)):
        raise ConfigError(f"--names takes one distinct name per EVAL folder: {len(args.evals)} folders, "
                          f"names {' '.join(args.names)}")
    summary = compare(args.evals, args.out, names=args.names, overwrite=args.overwrite,
                      allow_different_data=args.allow_different_data)
    if summary["models_differ_in"]:
        print(f"the models were trained differently: {'; '.join(summary['models_differ_in'])}")
    if summary["unequal_settings"]:
        print(f"note: the runs differ in {'; '.join(summary['differing'])}")
    if summary["other_data"] and not args.allow_different_data:
        print(f"note: {', '.join(summary['other_data'])} evaluated other test records or another support than "
              f"{summary['runs'][0]}: their intervals are not compared (--allow-different-data compares them; "
              "runs evaluated with --allow-partial on other ids compare once each is evaluated on the records "
              "all of them answered: `polyalign evaluate ... --common-with` and every run's predictions file)")
    for line in summary["in_short"]:  # the report's first section: what the intervals support
        print(f"{line}.")
    print(f"report: {args.out / 'report.html'}")
    return 0


LAUNCH_EPILOG = """\
One node, one process per GPU (each sees one GPU through CUDA_VISIBLE_DEVICES):
  polyalign launch --nproc 8 -- polyalign train sft --config C --out OUT data.dir=RUN parallel.data=8
Several nodes under SLURM (one task per GPU; the first node of the job is the coordinator):
  srun --ntasks-per-node=8 polyalign launch --slurm -- polyalign train sft ...
CPU processes (tests, laptops): --cpu-devices K gives each process K CPU devices.
Each process gets POLYALIGN_COORDINATOR, POLYALIGN_NUM_PROCESSES and POLYALIGN_PROCESS_ID. SIGTERM and
Ctrl-C are forwarded; when one process fails the others are stopped. `generate`, `serve` and `pairs
accuracy` run once, on every device of their host (started as one of several, they stop with one line
saying so). See docs/gpu.md.
"""


def _add_launch(sub) -> None:
    p = sub.add_parser("launch", help="run one process per accelerator (one node, or SLURM nodes)",
                       description="Start a polyalign command as several cooperating processes.",
                       epilog=LAUNCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="processes on this node (default 1)")
    p.add_argument("--cpu-devices", type=int, help="give each process this many CPU devices instead of one GPU")
    p.add_argument("--port", type=int, help="coordinator port (default: a free port; 12355 with --slurm)")
    p.add_argument("--slurm", action="store_true", help="this is one SLURM task: map the SLURM variables")
    p.add_argument("launched", nargs=argparse.REMAINDER, metavar="command", help="-- then the command to run")
    p.set_defaults(handler=_run_launch)


def _run_launch(args) -> int:
    command = main_command(args.launched[1:] if args.launched[:1] == ["--"] else args.launched)
    if args.slurm:
        run_slurm(command, args.port or DEFAULT_PORT)  # becomes the command: never returns
    return run_local(command, args.nproc, args.port, args.cpu_devices)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="parameter count, per-device memory and tokens per step of a config",
                       description="Estimate what a training config costs per device before launching it: "
                                   "parameters, gradients, AdamW moments, activations and logits, and tokens per "
                                   "step, for the config's mesh on --devices devices.")
    p.add_argument("--config", required=True, type=Path, help="an SFT or HDPO/DPO config")
    p.add_argument("--devices", type=int, help="devices the mesh spans (default: the devices JAX sees, and "
                                               "model.dtype auto is read for them; with --devices, as on GPUs: "
                                               "bfloat16)")
    p.add_argument("--device-memory", type=float, help="GiB per device, to say whether it fits (e.g. 16, 95, 141)")
    p.add_argument("--preset", help="plan this model preset instead of the config's model (e.g. qwen2.5-1.5b)")
    p.add_argument("--seq", type=int, help="sequence length (default: the config's, the build's, or 512)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override config fields as training does, e.g. train.global_batch=64 parallel.fsdp=8")
    p.set_defaults(handler=_run_plan)


def _run_plan(args) -> int:
    from polyalign.train.plan import describe, plan_config  # heavy: jax, kept out of --help

    backend = "gpu"  # devices named by --devices: a launch elsewhere, planned as on GPUs
    if args.devices is None:
        import jax  # heavy: jax, kept out of --help

        args.devices, backend = jax.device_count(), jax.default_backend()
    print(describe(plan_config(args.config, args.overrides, args.devices, args.seq, args.preset, backend),
                   args.device_memory))
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="run the pipeline on the bundled demo data",
                       description="Run the pipeline end to end on the real English and Chinese demo data bundled "
                                   f"with polyalign. Stages available: {', '.join(STAGES)}.")
    p.add_argument("--out", required=True, type=Path, help="run directory")
    p.add_argument("--stages", help=f"the stages to run, comma-separated (e.g. sft,generate), of: "
                                    f"{', '.join(STAGES)} (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="reduced sizes for a fast check: 20 SFT steps of 8 sequences and 8 preference steps on pairs "
                        "cut to 128 tokens a side (instead of 120 steps of 16 and 40 of 256), fewer prompts sampled "
                        "and evaluated; about 4 minutes on 2 CPU cores, the full demo several times longer")
    p.add_argument("--overwrite", action="store_true",
                   help="start every stage over (OUT holds a demo run with other settings, e.g. --quick); without "
                        "it the same command resumes where a run stopped")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")
    p.set_defaults(handler=_run_demo)


def _run_demo(args) -> int:
    run_demo(args.out, parse_stages(args.stages), quick=args.quick, overwrite=args.overwrite,
             progress=not args.no_progress)
    return 0


# The option types that read numbers (--max-new-tokens also reads `auto`).
NUMBER_TYPES = (int, float, _budget)

# Every numeric option of every subcommand and the values it admits, checked after parsing and before the
# stage runs: an out-of-range value (zero and negative ones included, NaN and infinities never) is one line
# naming the option. tests/test_faults.py walks the parser so that no numeric option is missing here.
# --max-new-tokens and the budgets of its `auto`, as generate and prompts take them (_budget_options)
# a length a prompt or a sequence is cut to: a chat template's headers alone take several tokens (a prompt cut to
# 4 was the assistant header's tail, with nothing of the conversation)
HEADER_ROOM = Range(8, why="a chat template needs room for its headers")
BUDGET_RANGES = {"--max-new-tokens": COUNT, "--budget-quantile": Range(0.0, 1.0, low_open=True),
                 "--budget-margin": Range(0.0, low_open=True), "--budget-ceiling": COUNT}
NUMBER_RANGES: dict[str, dict[str, Range]] = {
    "prepare": {"--num-shards": COUNT},
    "tokenizer train": {
        "--vocab-size": Range(300, why="the byte fallback alone takes 256 pieces; 8000 suits the demo data"),
        "--character-coverage": Range(0.98, 1.0, why="SentencePiece trains with no less"), "--threads": COUNT},
    "show": {"--limit": COUNT, "--max-length": HEADER_ROOM},
    "build": {"--max-length": HEADER_ROOM,
              "--weight-temperature": Range(0.0), "--clip-weights": Range(0.0),
              "--borrow-below": NON_NEGATIVE, "--min-bucket-size": NON_NEGATIVE},
    "generate": {"--temperature": Range(0.0), **BUDGET_RANGES, "--min-p": Range(0.0, 1.0),
                 "--repetition-penalty": Range(0.0, low_open=True), "--presence-penalty": Range(-2.0, 2.0),
                 "--frequency-penalty": Range(-2.0, 2.0),
                 "--top-p": Range(0.0, 1.0, low_open=True), "--top-k": NON_NEGATIVE, "--batch-size": COUNT,
                 "--max-prompt-tokens": HEADER_ROOM, "--limit": COUNT, "--sample": COUNT,
                 "--per-bucket": COUNT, "--seed": SEED},
    "prompts": {"--limit": COUNT, "--sample": COUNT, "--per-bucket": COUNT, "--seed": SEED,
                "--max-prompt-tokens": HEADER_ROOM, **BUDGET_RANGES},
    "serve": {"--port": Range(1, 65535), "--slots": COUNT, "--max-sequence": Range(2, optional=True),
              "--max-pending": COUNT, "--max-new-tokens": COUNT, "--steps-per-sync": COUNT},
    "pairs import": {"--val-fraction": Range(0.0, 1.0, low_open=True, high_open=True), "--seed": SEED},
    "pairs accuracy": {"--beta": Range(0.0, low_open=True), "--max-length": HEADER_ROOM,
                       "--batch-size": COUNT},
    "evaluate": {"--bootstrap-draws": Range(20, why="an interval's 2.5% and 97.5% points need draws to stand on; "
                                                 "200 is the default"), "--seed": SEED},
    "launch": {"--nproc": COUNT, "--cpu-devices": COUNT, "--port": Range(1, 65535)},
    "plan": {"--devices": COUNT, "--device-memory": Range(0.0, low_open=True),
             "--seq": HEADER_ROOM},
}


def subcommands(parser: argparse.ArgumentParser, path: str = ""):
    """(path, parser) of every subcommand below `parser`, e.g. ("pairs import", <parser>)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                where = f"{path} {name}".strip()
                yield where, sub
                yield from subcommands(sub, where)


def _out_of_range(args, parser: argparse.ArgumentParser) -> str | None:
    """The one line for the first numeric option of the parsed subcommand whose value is out of range."""
    for option, admitted in NUMBER_RANGES.get(args.command_path, {}).items():
        action = next(a for a in parser._actions if option in a.option_strings)
        value = getattr(args, action.dest)
        for one in value if isinstance(value, list) else [value]:
            # a word the option also takes (--max-new-tokens auto) has no range
            if one is not None and not isinstance(one, str) and not admitted.admits(one):
                return admitted.refusal(option, one)
    return None


_GIVEN = "_polyalign_options_given"  # the namespace's record of the options met so far, removed after parsing


class _StoreOnce(argparse._StoreAction):
    """An option that takes a value, refused when it is given twice: argparse keeps the last one, so a second
    --config would replace the first file whole and a second --out would write elsewhere, unsaid."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, _GIVEN, None)
        if given is None:
            given = {}
            setattr(namespace, _GIVEN, given)
        if self.dest in given:
            first, then = (" ".join(map(str, v)) if isinstance(v, list) else str(v) for v in (given[self.dest], values))
            hint = "; one config file a run: change single settings with key=value" \
                if self.dest == "config" and parser.prog.startswith("polyalign train") else ""
            parser.error(f"{option_string} is given twice ({first}, then {then}): give it once{hint}")
        given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    """Options written out in full: argparse would take `--bootstrap-draw` for `--bootstrap-draws`, and an
    abbreviation that is unique today can mean another option once one is added; an option that takes a
    value is given once (_StoreOnce). Every subcommand's parser is of this class (argparse makes subparsers
    of their parent's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        for name in (None, "store"):  # argument groups read the parser's registry too
            self.register("action", name, _StoreOnce)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = super().parse_known_args(args, namespace)
        if hasattr(parsed, _GIVEN):
            delattr(parsed, _GIVEN)
        return parsed, extra

    def error(self, message: str):
        """argparse's refusal, with the option meant where an unknown one is close to a known one."""
        unknown = message.removeprefix("unrecognized arguments: ").split() if message.startswith(
            "unrecognized arguments: ") else []
        known = [option for action in self._actions for option in action.option_strings
                 if option not in ("-h", "--help")]
        for word in (w.split("=")[0] for w in unknown if w.startswith("--")):
            # an abbreviation names every option it begins; a misspelling the closest one, if close at all
            close = sorted(o for o in known if o.startswith(word)) or difflib.get_close_matches(word, known, n=1,
                                                                                                cutoff=0.75)
            if close:
                message += f"; did you mean {' or '.join(close[:3])}?"
                break
            if self.prog.startswith("polyalign train "):  # a config setting written as an option
                message += "; settings are key=value overrides (train.steps=5), not options"
                break
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="polyalign", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"polyalign {polyalign_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_prepare(sub)
    _add_stats(sub)
    _add_tokenizer(sub)
    _add_build(sub)
    _add_show(sub)
    _add_train(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_prompts(sub)
    _add_pairs(sub)
    _add_evaluate(sub)
    _add_report(sub)
    _add_launch(sub)
    _add_plan(sub)
    _add_demo(sub)
    for path, subparser in subcommands(parser):
        subparser.set_defaults(command_path=path)  # the deepest subcommand's path wins
    return parser


def _path_problem(error: OSError) -> str:
    where = error.filename if error.filename is not None else "a path"
    if isinstance(error, IsADirectoryError):
        return f"{where}: is a folder; a file is expected here"
    if isinstance(error, NotADirectoryError):
        return f"{where}: a folder is expected here, and this path is (or goes through) a file"
    if isinstance(error, FileExistsError):
        return f"{where}: exists and is not a folder; give an output folder that is new or a folder"
    return f"{where}: permission denied"


_FULL_OR_READ_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _say(line: str) -> None:
    """How a command ended, on stderr: once for a launched run whose processes all end alike."""
    if not said_by_another_process(line):
        print(line, file=sys.stderr, flush=True)


# The commands that load a model onto every device of their host and answer once: started as one of several
# processes (`launch --nproc N`, tpu_scripts/launch.sh --workers N), each would load it again and write the
# same outputs (or bind the same port), so they stop in one line before they read anything. Training joins
# its processes; the data commands run on each worker's own disk (docs/tpu.md), and two writers of one
# folder are refused by its output lock.
RUN_ONCE = ("generate", "serve", "pairs accuracy")


def main(argv: list[str] | None = None) -> int:
    # transformers, imported by MAUVE and the build's tokenizer check where it is installed, advises on
    # stderr that PyTorch is missing: polyalign never asks it for a model, so the advice is noise.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = dict(subcommands(parser))[args.command_path]
    if extra:
        # argparse takes one run of positionals: key=value overrides written after an option
        # (`--out X a=1 --no-progress b=2`) come back unparsed, and are overrides all the same
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command_path in RUN_ONCE:
            refuse_several_processes(f"polyalign {args.command_path}")
    except LaunchError as err:
        _say(f"polyalign {args.command_path}: error: {err}")
        return 2
    problem = _out_of_range(args, command)
    if problem:
        _say(f"polyalign {args.command_path}: error: {problem}")
        return 2
    try:
        with interrupts_remembered():
            return args.handler(args)
    except Interrupted as stopped:
        _say(f"polyalign {args.command_path}: {stopped}")
        return INTERRUPTED
    except PolyalignError as err:
        _say(f"polyalign {args.command_path}: error: {err}")
        return 2
    except (IsADirectoryError, NotADirectoryError, FileExistsError, PermissionError) as err:
        # a path of the wrong kind (a folder given for a file, an output path that is a file) or one
        # the user may not write: theirs to fix, so one line naming it, not a traceback
        _say(f"polyalign {args.command_path}: error: {_path_problem(err)}")
        return 2
    except Terminated:
        _say(f"polyalign {args.command_path}: stopped by SIGTERM")
        return TERMINATED
    except KeyboardInterrupt:
        _say(f"polyalign {args.command_path}: interrupted")
        return INTERRUPTED
    except BrokenPipeError:
        # standard output's reader is gone (`| head`, a launcher killed outright): whatever the command did
        # stands; there is no one to tell, and the interpreter's own flush at exit must not fail again
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as err:
        if err.errno not in _FULL_OR_READ_ONLY:
            raise
        # a full disk, a quota or a read-only mount: nothing the code can mend; the rerun resumes
        where = f"{err.filename}: " if err.filename else ""
        _say(f"polyalign {args.command_path}: error: {where}{os.strerror(err.errno).lower()}; free space (or choose "
             "another place) and run the same command again")
        return 2


def entry() -> None:
    """The `polyalign` program: `main`'s status as the process's. A command stopped by SIGTERM or Ctrl-C ends at
    once after its line (os._exit; its outputs were closed as main returned), as the signal's default would have
    ended it: stopped while JAX's backend was starting or its threads were running, the interpreter's shutdown
    can crash in a native library (status 139: `generate` stopped by Ctrl-C once in nine tries).
    Training started as one of several processes runs as a child of a parent that names a lost coordinator
    (polyalign/mesh/supervisor.py)."""
    if supervisor.wanted(sys.argv[1:], os.environ):
        code = supervisor.run_as_parent(sys.argv[1:])
        if code < 0:  # the child ended by a signal: so does this process, for the shell or the launcher to see
            with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP take no handler, and need none
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        sys.exit(code)
    code = main()
    if code in (TERMINATED, INTERRUPTED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
