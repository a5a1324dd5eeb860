"""`polyalign evaluate`: every metric of METHOD section 9 for one predictions file, joined to the test
records by id, written to EVAL/metrics.json and EVAL/report.html."""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
import random
import re
import sys
import threading
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from polyalign.core import jsonl
from polyalign.core.errors import EvaluationError, GenerationError
from polyalign.core.extras import require
from polyalign.core.native_stderr import captured_stderr_lines
from polyalign.core.outputs import (
    FREE_KEYS,
    REPORTING_KEYS,
    flatten,
    keys_match,
    other_stages_folder,
    read_record,
    same_path,
    sidecar,
    stage_output,
)
from polyalign.core.paths import build_setting, file_digest, is_uri, length_history, training_record
from polyalign.core.progress import progress_bar
from polyalign.core.wording import counted
from polyalign.data.language import wrong_script
from polyalign.data.records import read_records
from polyalign.evaluate import detectability as dt
from polyalign.evaluate import naturalness as nat
from polyalign.evaluate import support as sp
from polyalign.evaluate.baselines import BASELINES, baseline_answers
from polyalign.evaluate.composites import aggregate_section, combined_intervals, frontiers
from polyalign.evaluate.dynamics import turn_dynamics_with_draws
from polyalign.evaluate.text_metrics import diversity, diversity_with_intervals, token_f1, tokens, utility_scores
from polyalign.features.lm import LMScorer, record_lm_features
from polyalign.features.references import read_references
from polyalign.features.response import FEATURE_NAMES, text_features
from polyalign.generate.predictions import check_generated_from, iter_predictions
from polyalign.generate.selection import select_records
from polyalign.generate.settings import asked_for
from polyalign.model import load_hf_checkpoint
from polyalign.model.architecture import compute_dtype
from polyalign.model.hf import checkpoint_tokenizer
from polyalign.model.pooling import encode_responses, padded_length
from polyalign.tokens.tokenizer import exported_setting

COMPAT_MODES = ("cjk", "reference")
MAUVE_MAX_TEXTS = 1000
FEATURIZER_TOKENS = 512  # of each text the featurizer reads
SUPPORT_ROWS_PER_BUCKET = 1000  # a bucket's support beyond this is a seeded sample: W1 is settled by then


def load_predictions(path: Path) -> tuple[list[dict], Counter, dict[str, list[int]]]:
    """Every prediction row, how often each id occurs and on which lines (duplicates are counted, not
    refused here)."""
    rows, lines = [], defaultdict(list)
    for number, row in iter_predictions(path):
        rows.append(row)
        lines[row["id"]].append(number)
    return rows, Counter(row["id"] for row in rows), dict(lines)


def align(records, rows: list[dict], seen: Counter, allow_partial: bool, selected_by: str | None = None,
          lines: dict[str, list[int]] | None = None, what: str = "the records") -> tuple[list, list[str], dict]:
    """Records and their predictions joined by id; missing, duplicate or extra ids stop the run
    (with counts, and the ids and lines at fault) unless allow_partial, which keeps the intersection. An id
    given twice or more with the same answer each time (an export that wrote a row twice) is one answer,
    counted. `selected_by`: how `generate` chose the records it answered from this very file
    (generate_selection), whose missing ids are expected. `what`: the records, as the error names them."""
    ids = {r.id for r in records}
    answers = _answers_by_id(rows)
    missing = [r.id for r in records if r.id not in seen]
    copies = sorted(i for i, c in seen.items() if c > 1 and len(answers[i]) == 1)
    duplicate = sorted(i for i, c in seen.items() if c > 1 and len(answers[i]) > 1)
    extra = sorted(set(seen) - ids)
    alignment = {"records": len(records), "predictions": len(rows), "missing": len(missing),
                 "duplicate": len(duplicate), "extra": len(extra), "identical_copies": len(copies), "partial": False}
    if missing and selected_by and not (duplicate or extra):
        alignment["selected_by"] = selected_by
    elif (missing or duplicate or extra) and not allow_partial:
        # answers to a subset alone: most likely the rows `polyalign prompts` chose for an external engine
        subset = (" if they answer the records `polyalign prompts` chose (--limit, --sample, --per-bucket), pass "
                  "its file as --prompts (they are evaluated on those, as generate's are); otherwise"
                  if missing and not (duplicate or extra) and what == "the records" else "")
        raise EvaluationError(f"predictions do not match {what}: {_faults(missing, duplicate, extra, lines or {})};"
                              f"{subset} pass --allow-partial to evaluate the intersection")
    for key, found in (("missing_ids", missing), ("duplicate_ids", duplicate), ("extra_ids", extra)):
        if found:  # which: a partial evaluation says what it left out
            alignment[key] = found[:100]
    first = {}
    for row in rows:
        first.setdefault(row["id"], row["prediction"])
    kept = [r for r in records if r.id in first and (seen[r.id] == 1 or len(answers[r.id]) == 1)]
    alignment["evaluated"] = len(kept)
    alignment["partial"] = len(kept) < len(records)
    if alignment["partial"]:  # which rows: two partial evaluations of one file compare only on the same ones
        alignment["evaluated_ids"] = evaluated_ids_digest(r.id for r in kept)
    return kept, [first[r.id] for r in kept], alignment


def _faults(missing: list[str], duplicate: list[str], extra: list[str], lines: dict[str, list[int]]) -> str:
    """The counts of missing, duplicate and extra ids, each with a few of them named (a duplicate with its
    lines)."""
    def some(found, show=str):
        return f" ({', '.join(show(i) for i in found[:3])}{', ...' if len(found) > 3 else ''})" if found else ""

    def with_lines(i):
        return f"{i} on lines {', '.join(map(str, lines.get(i, [])))}" if lines.get(i) else i

    return (f"{len(missing)} missing{some(missing)}, {len(duplicate)} duplicate with different answers"
            f"{some(duplicate, with_lines)}, {len(extra)} extra ids{some(extra)}")


def evaluated_ids_digest(ids) -> str:
    """The identity of the set of test rows an evaluation read (sorted ids, hashed)."""
    return "sha256:" + hashlib.sha256("\n".join(sorted(ids)).encode("utf-8")).hexdigest()


def _mean_dict(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} if rows else {}


def _feature_matrix(features: dict[str, np.ndarray]) -> np.ndarray:
    return np.stack([features[name] for name in features])


def _features(texts: list[str]) -> dict[str, np.ndarray]:
    table = [text_features(t) for t in texts]
    return {name: np.array([row[name] for row in table], float) for name in FEATURE_NAMES}


def _mauve(human: list[str], generated: list[str], featurize) -> float:
    """MAUVE (mauve-text) on featurizer vectors; NaN with fewer than 20 texts on a side."""
    rng = random.Random(42)
    if len(human) > MAUVE_MAX_TEXTS:
        human = rng.sample(human, MAUVE_MAX_TEXTS)
    if len(generated) > MAUVE_MAX_TEXTS:
        generated = rng.sample(generated, MAUVE_MAX_TEXTS)
    if min(len(human), len(generated)) < nat.MIN_BUCKET_ROWS:
        return float("nan")
    import mauve  # optional extra: mauve

    result = mauve.compute_mauve(p_features=featurize(human), q_features=featurize(generated), verbose=False)
    return float(result.mauve)


@dataclasses.dataclass(frozen=True)
class EvaluateOptions:
    """What `evaluate` measures, against what, and how; metrics.json records each field under `settings`.

    compat: "cjk" (every bucket, human floors, intervals, baselines) or "reference" (the authors' code).
    references: RUN/stats/references.json (the bands of HCR, and of BNG's features with --compat reference).
    support: the records whose human answers are each bucket's support (RUN/data/train.jsonl), else the test
    records' own. featurizer: a checkpoint whose pooled hidden states feed MAUVE. scorer: a checkpoint for
    the LM features. allow_partial: evaluate the intersection of ids. prompts: the file `polyalign prompts` wrote
    for an external engine, whose selection of records (--limit, --per-bucket) the predictions answer.
    common_with: other systems' predictions files; only the records every one of them and this one answer
    (once) are evaluated, so that evaluations of messy exports given the same files read the same rows.
    diversity, baselines: those sections."""

    compat: str = "cjk"
    references: Path | None = None
    support: Path | None = None
    featurizer: Path | None = None
    scorer: Path | None = None
    allow_partial: bool = False
    prompts: Path | None = None
    common_with: tuple[Path, ...] = ()  # other systems' predictions: only the ids every one of them answers
    plots: bool = True
    intervals: sp.IntervalOptions = dataclasses.field(default_factory=sp.IntervalOptions)
    diversity: bool = True
    baselines: bool = True
    detectability: bool = True
    dtype: str = "auto"  # of the featurizer and scorer (model/architecture.py compute_dtype)

    @property
    def tokenize(self) -> str:
        return "reference" if self.compat == "reference" else "cjk"


SCORER_WITH_SUPPORT = ("--scorer and --support cannot be combined: the scorer's LM features are measured on the "
                       "test rows only, and a support file is measured on the text features alone; drop --support "
                       "(each bucket is then measured against the test records' own human answers) or --scorer")


def evaluate(records_path: Path, predictions_path: Path, out: Path, options: EvaluateOptions = EvaluateOptions(),
             overwrite: bool = False, progress: bool = False) -> dict[str, Any]:
    """Every metric of one predictions file. In the default mode every bucket is measured (small ones
    against their parent group's human answers), with its human floor and bootstrap intervals, and the
    no-model baselines are measured the same way; `compat="reference"` reproduces the authors' code.
    EVAL/metrics.json records the settings and the inputs' digests; an evaluation made with other
    settings is not replaced unless `overwrite`. `progress`: a bar over its parts, naming the one running.
    What it measures of people's and the no-model answers is kept for the next evaluation of the same
    records in the process (`_human_side`)."""
    if options.compat not in COMPAT_MODES:
        raise EvaluationError(f"compat must be one of {', '.join(COMPAT_MODES)}")
    if options.featurizer is not None:
        require("mauve", "mauve", "MAUVE (--featurizer)")
    if options.scorer is not None and options.support is not None:  # before any work, not after the first metrics
        raise EvaluationError(SCORER_WITH_SUPPORT)
    inputs = {"records": records_path, "predictions": predictions_path, "references": options.references,
              "support": options.support, "prompts": options.prompts,
              **{f"common_with {i + 1}": path for i, path in enumerate(options.common_with)}}
    settings = {**{k: None if v is None else str(Path(v).resolve()) for k, v in inputs.items()},
                "compat": options.compat, "featurizer": options.featurizer and str(options.featurizer),
                "scorer": options.scorer and str(options.scorer), "allow_partial": options.allow_partial,
                "plots": options.plots, "intervals": dataclasses.asdict(options.intervals),
                "diversity": options.diversity, "baselines": options.baselines,
                "detectability": options.detectability,
                # the dtype a featurizer or scorer ran in, which changes their numbers (none: no model ran)
                **({"dtype": compute_dtype(options.dtype)} if options.featurizer or options.scorer else {})}
    out = Path(out)
    if elsewhere := other_stages_folder(out, "the evaluation", "eval"):
        raise EvaluationError(elsewhere)
    check_generated_from(Path(predictions_path), Path(records_path))
    with stage_output(out, out / "metrics.json", settings, overwrite, ours=[out / "metrics.json", out / "report.html"],
                      inputs=inputs):
        return _evaluate(Path(records_path), Path(predictions_path), out, options, settings, progress)


@dataclasses.dataclass
class Joined:
    """The test records that have exactly one prediction, beside it, in the records' order."""

    records: list
    predictions: list[str]
    alignment: dict[str, Any]
    profiles: list[str]
    models: list[str]

    @functools.cached_property
    def human(self) -> list[str]:
        return [r.response for r in self.records]

    @functools.cached_property
    def by_bucket(self) -> dict[str, list[int]]:
        return _rows_by(r.bucket_id for r in self.records)


# What an evaluation measures of people's answers and of the no-model answers (the buckets' supports and
# floors, the baselines' rows, their texts' featurizer vectors) depends on the evaluated records and the
# settings, not on the predictions: an evaluation of other predictions of the same records in the same
# process (the demo's four models, the methods bench) reads it instead of measuring it again, to the same
# numbers. The last HUMAN_SIDES_KEPT are kept; inputs named by URI are not kept (their state is not read).
HUMAN_SIDES_KEPT = 2
_human_sides: OrderedDict[str, dict[str, Any]] = OrderedDict()
_human_sides_lock = threading.Lock()


def _human_side(joined: Joined, options: EvaluateOptions) -> dict[str, Any]:
    """The human side of `joined`'s records under `options`, which its parts fill as they are first measured
    (`_kept`)."""
    key = _human_side_key(joined, options)
    if key is None:
        return {}
    with _human_sides_lock:
        side = _human_sides.pop(key, {})
        _human_sides[key] = side
        while len(_human_sides) > HUMAN_SIDES_KEPT:
            _human_sides.popitem(last=False)
    return side


def _human_side_key(joined: Joined, options: EvaluateOptions) -> str | None:
    """The records as evaluated (every field, in order), the settings that change what is measured of them,
    and the state of the files they name: the support, the references, the featurizer's and the scorer's
    checkpoints. None where one of those is a URI."""
    paths = (options.support, options.references, options.featurizer, options.scorer)
    if any(path is not None and is_uri(str(path)) for path in paths):
        return None
    digest = hashlib.sha256()
    for record in joined.records:
        digest.update(json.dumps(record.to_json(), sort_keys=True, ensure_ascii=False).encode("utf-8"))
    # which records are joined is in the records themselves; plots and diversity measure nothing of this side
    measured_alike = dataclasses.replace(options, plots=True, diversity=True, allow_partial=False, prompts=None,
                                         common_with=())
    digest.update(repr(measured_alike).encode("utf-8"))
    for path in paths:
        digest.update(repr(_file_state(path)).encode("utf-8"))
    return digest.hexdigest()


def _file_state(path: Path | None) -> tuple | None:
    """A file's, or a checkpoint folder's files' (its top level: a Hugging Face checkpoint's layout), resolved
    path, inode, size, and times of modification and of change (a copy that kept the size and the
    modification time has another inode or time of change)."""
    if path is None or not Path(path).exists():
        return None if path is None else (str(path),)
    path = Path(path).resolve()
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return str(path), tuple((f.name, f.stat().st_ino, f.stat().st_size, f.stat().st_mtime_ns, f.stat().st_ctime_ns)
                            for f in files if f.is_file())


def _kept(side: dict[str, Any], part: str, measure: Callable[[], Any]) -> Any:
    """`part` of the human side: measured by `measure` the first time, then read; a copy, so that nothing
    done with it changes what the next evaluation reads."""
    if part not in side:
        side[part] = measure()
    return copy.deepcopy(side[part])


def _rows_by(keys) -> dict[str, list[int]]:
    rows: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        rows[key].append(i)
    return rows


def _join_common(records_path: Path, records: list, rows: list[dict], seen: Counter, lines: dict[str, list[int]],
                 predictions_path: Path, prompts: Path | None, common_with: tuple[Path, ...]
                 ) -> tuple[list, list[str], dict]:
    """`_join` under --common-with: the records (of the prompts' selection, with --prompts) that this file and
    every other answers once. What this file itself lacks among the records any of them answers (an id it
    left out, one it answered twice differently) is still counted and named in the alignment."""
    here = Path(predictions_path).resolve()
    files = {here, *(Path(other).resolve() for other in common_with)}
    if len(files) < 2:
        raise EvaluationError("--common-with names no other predictions file than --predictions: give every "
                              "system's file, to evaluate the records all of them answer")
    others = [load_predictions(other)[0] for other in sorted(files - {here})]  # this file among them (as users
    once = answered_once(rows)  # list every system's) is read once
    common = once.intersection(*(answered_once(other) for other in others))
    total = len(records)
    if prompts is not None:
        chosen = _prompts_selection(prompts, records_path, records)[0]
        records = [r for r in records if r.id in chosen]
    answered_by_any = set(seen).union(*({row["id"] for row in other} for other in others))
    missing = [r.id for r in records if r.id in answered_by_any and r.id not in seen]
    different = sorted(set(seen) - once)
    records = [r for r in records if r.id in common]
    if not records:
        raise EvaluationError(f"no record is answered once by {predictions_path} and every --common-with file")
    kept = {r.id for r in records}
    rows = [row for row in rows if row["id"] in kept]
    records, predictions, alignment = align(records, rows, Counter(row["id"] for row in rows), True, None, lines)
    alignment.update(common_with=len(files), missing=len(missing), duplicate=len(different),
                     **({"missing_ids": missing[:100]} if missing else {}),
                     **({"duplicate_ids": different[:100]} if different else {}))
    return records, predictions, _of_the_split(alignment, records, total)


def _of_the_split(alignment: dict, records: list, total: int) -> dict:
    """`alignment` of the records a selection kept (`records`) as a part of the whole split of `total`: partial
    where fewer, with the digest of which ones (two partial evaluations compare only on the same rows)."""
    alignment.update(records=total, partial=len(records) < total)
    if alignment["partial"]:
        alignment["evaluated_ids"] = evaluated_ids_digest(r.id for r in records)
    return alignment


def _prompts_selection(prompts: Path, records_path: Path, records: list) -> tuple[set[str], str]:
    """The ids a `polyalign prompts` file holds, and how it chose them ("prompts --per-bucket 20 --seed 1";
    "prompts" where it took every record); refused unless its manifest names these records as they are."""
    manifest = read_record(prompts)
    if manifest is None:
        raise EvaluationError(f"{prompts}: no manifest beside it ({sidecar(prompts)}); --prompts takes the file "
                              "`polyalign prompts --out` wrote")
    recorded = (manifest.get("made_from") or {}).get("records")
    if not is_uri(str(records_path)) and recorded != file_digest(records_path):
        raise EvaluationError(f"{prompts} was written from other records than {records_path} holds now (another "
                              "split, or prepare ran again): write the prompts again from these records")
    chosen = {row["id"] for _, row in jsonl.read_lines(prompts)}
    if not chosen:
        raise EvaluationError(f"{prompts} holds no prompts: nothing to evaluate")
    unknown = chosen - {r.id for r in records}
    if unknown:
        raise EvaluationError(f"{prompts}: {len(unknown)} ids the records do not hold (e.g. {sorted(unknown)[0]})")
    return chosen, selection_words("prompts", manifest.get("settings") or {})


def selection_words(stage: str, settings: dict) -> str:
    """How a stage chose its records, as its command line said it: "generate --per-bucket 2 --seed 4"; the
    stage's name alone where it took them all."""
    chosen = [f"--{key.replace('_', '-')} {settings[key]}" for key in ("limit", "sample", "per_bucket")
              if settings.get(key) is not None]
    seeded = settings.get("sample") is not None or settings.get("per_bucket") is not None
    return " ".join([stage, *chosen]) + (f" --seed {settings['seed']}" if seeded else "")


def generate_selection(predictions_path: Path, records_path: Path, records: list, answered: set[str]) -> str | None:
    """How `polyalign generate` chose the records it answered (--limit, --sample, --per-bucket) when it read
    them from this records file, unchanged since (its manifest's digest), and the predictions answer exactly
    the records that selection takes (generate's own `select_records` again); None otherwise: a file cut
    short or filtered since is no selection of generate's."""
    manifest = read_record(predictions_path) or {}
    settings = manifest.get("settings") or {}
    chose = any(settings.get(key) is not None for key in ("limit", "sample", "per_bucket"))
    recorded = (manifest.get("made_from") or {}).get("records")
    if not chose or not isinstance(recorded, str) or is_uri(str(records_path)) or \
            recorded != file_digest(records_path):
        return None
    try:
        taken, _ = select_records(records, records_path, settings.get("limit"), settings.get("sample"),
                                  int(settings.get("seed") or 0), settings.get("per_bucket"))
    except (GenerationError, TypeError, ValueError):  # settings no generate wrote: no selection of its
        return None
    if {r.id for r in taken} != answered:
        return None
    return selection_words("generate", settings)


def _answers_by_id(rows: list[dict]) -> dict[str, set[str]]:
    """The distinct answers each id is given (one set of texts an id)."""
    answers: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        answers[row["id"]].add(row["prediction"])
    return answers


def answered_once(rows: list[dict]) -> set[str]:
    """The ids a predictions file answers with one answer (given once, or repeated with the same text)."""
    return {i for i, texts in _answers_by_id(rows).items() if len(texts) == 1}


def _join(records_path: Path, predictions_path: Path, allow_partial: bool, prompts: Path | None = None,
          common_with: tuple[Path, ...] = ()) -> Joined:
    rows, seen, lines = load_predictions(predictions_path)
    records = read_records(records_path)
    if not {row["id"] for row in rows} & {r.id for r in records}:  # said as what it is, with or without
        raise EvaluationError(_nothing_in_common(predictions_path, records_path, rows, records))  # --allow-partial
    if common_with:  # the rows every system answered: each evaluation given the same files reads the same ones
        records, predictions, alignment = _join_common(records_path, records, rows, seen, lines, predictions_path,
                                                       prompts, common_with)
    elif prompts is None:
        selection = generate_selection(predictions_path, records_path, records, set(seen))
        records, predictions, alignment = align(records, rows, seen, allow_partial, selection, lines)
    else:  # the records the prompts file holds are the ones to answer: a fault is counted against those
        chosen, label = _prompts_selection(prompts, records_path, records)
        total = len(records)
        records = [r for r in records if r.id in chosen]
        records, predictions, alignment = align(records, rows, seen, allow_partial, None, lines,
                                                f"the {len(records)} records `{label}` chose")
        alignment = _of_the_split({**alignment, "chosen": len(chosen), "selected_by": label}, records, total)
    if not records:  # nothing left to measure (--prompts or --common-with chose none of the answered records)
        raise EvaluationError(f"{predictions_path}: none of the records it answers is among those --prompts or "
                              "--common-with chose: nothing to evaluate")
    # an engine's rows name no profile; the prompts it answered were rendered with one, which its manifest holds
    rendered = ((read_record(prompts) or {}).get("summary") or {}).get("profile") if prompts is not None else None
    return Joined(records, predictions, alignment,
                  profiles=sorted({r.get("profile", rendered or "unknown") for r in rows}),
                  models=sorted({str(r.get("model", "unknown")) for r in rows}))


def _nothing_in_common(predictions_path: Path, records_path: Path, rows: list[dict], records: list) -> str:
    """Why an evaluation has no row: an empty predictions file, or ids of other records (another split's,
    a predictions file of other data), with a few of each side's ids to compare."""
    if not rows:
        return f"{predictions_path}: holds no predictions (no non-blank line)"
    theirs = ", ".join(repr(r["id"]) for r in rows[:2])
    ours = ", ".join(repr(r.id) for r in records[:2])
    return (f"{predictions_path}: none of its {len(rows)} ids is a record of {records_path} (its ids: {theirs}, ...; "
            f"the records': {ours}, ...): predictions of other records (another split, or an earlier prepare?)")


# What the progress bar counts, in the order they run (the featurizer's and scorer's model runs are the
# long parts where there is one).
EVALUATION_PARTS = ("utility", "diversity", "BNG and HCR", "MAUVE", "detectability", "turn dynamics",
                    "no-model answers", "report")


def _evaluate(records_path: Path, predictions_path: Path, out: Path, options: EvaluateOptions,
              settings: dict[str, Any], progress: bool) -> dict[str, Any]:
    started = time.perf_counter()
    # the inputs are read before the bar starts: a bad row is one line, with no bar before it
    joined = _join(records_path, predictions_path, options.allow_partial, options.prompts, options.common_with)
    # One BLAS and OpenMP thread for the measures: they are thousands of small fits (detectability's
    # classifiers, MAUVE's PCA and k-means), for which a pool over every core costs more to wake than the
    # matrices take to compute: one model's evaluation on the quick demo took 69.6 s on 2 cores with the
    # default pools and 16.1 s with one thread, to the same numbers (bench/RESULTS.md). JAX's own threads
    # (the featurizer) are not these pools.
    with progress_bar(total=len(EVALUATION_PARTS), progress=progress, desc="evaluate", unit="part") as bar, \
            threadpool_limits(limits=1):
        return _measure(joined, out, options, settings, bar, started, records_path, predictions_path)


def _measure(joined: Joined, out: Path, options: EvaluateOptions, settings: dict[str, Any], bar, started: float,
             records_path: Path, predictions_path: Path) -> dict[str, Any]:
    """Every metric of the joined rows, counted on `bar` part by part."""

    def running(name: str) -> None:  # the part about to run: the ones before it are done
        bar.update(EVALUATION_PARTS.index(name) - bar.n)
        bar.set_postfix_str(name)

    running("utility")
    scores = [utility_scores(p, g, options.tokenize) for p, g in zip(joined.predictions, joined.human)]
    utility = _utility(scores, joined)
    running("diversity")
    div = _diversity_section(joined, options)
    running("BNG and HCR")
    side = _human_side(joined, options)
    feature_based = _naturalness(joined, scores, utility, options, side)
    bng_metrics, hcr_metrics, reference_rows = feature_based.bng, feature_based.hcr, feature_based.reference_rows
    running("MAUVE")
    featurize = None if options.featurizer is None else \
        _featurizer(options.featurizer, options.dtype, side.setdefault("featurizer's vectors", {}),
                    lasting=_side_texts(joined, options))
    mauve_metrics = _mauve_section(joined, featurize)
    relation = featurizer_relation(options.featurizer, predictions_path) if featurize is not None else None
    if relation == "the model itself":
        mauve_metrics["featurizer_note"] = FEATURIZER_IS_MODEL
    elif relation is not None:
        mauve_metrics["featurizer_note"] = FEATURIZER_IS_BASE.format(relation=relation)
    if relation is not None:
        mauve_metrics["featurizer_relation"] = relation
    running("detectability")
    detect = _detectability_section(joined, options, featurize, side)
    for name, row in detect.get("baselines", {}).items():
        reference_rows.setdefault(name, {}).update(row)
    if "human" in reference_rows and detect["status"] == "computed":
        reference_rows["human"] |= {"detectability_macro": detect["floor_macro"],
                                    "detectability_macro_interval": detect["floor_macro_interval"]}
    running("turn dynamics")
    resamples = feature_based.resamples.get(MODEL_ANSWERS)
    tdm, tdm_draws = _turn_dynamics(joined, joined.predictions, options, resamples)
    f1_by_bucket = {b: row["qa_f1"] for b, row in utility["by_bucket"].items()}
    nuf, aggregate, _, said = _combined(bng_metrics["by_bucket"], f1_by_bucket, utility["overall"].get("qa_f1"),
                                        bng_metrics["overall_macro"], mauve_metrics, (tdm, tdm_draws), resamples,
                                        options)
    tdm["macro_interval"], nuf["overall"]["hypervolume_interval"], aggregate["interval"] = said.values()
    metrics = {"utility": utility, "diversity": div, "bng": bng_metrics, "hcr": hcr_metrics,
               "buckets": feature_based.buckets, "reference_rows": reference_rows, "mauve": mauve_metrics,
               "detectability": detect, "tdm": tdm, "nuf": nuf, "aggregate": aggregate}
    running("no-model answers")  # their TDM, MAUVE, frontier and aggregate, as the model's
    composites = _kept(side, "composites of the baselines", lambda: {
        name: _baseline_composites(joined, baseline_answers(name, joined.records), buckets, reference_rows[name],
                                   featurize, options, feature_based.resamples.get(name))
        for name, buckets in feature_based.baseline_buckets.items()})
    for name, extra in composites.items():
        reference_rows[name] |= extra
    result = _result(joined, metrics, records_path, predictions_path, options, settings)
    result["config"]["seconds"] = round(time.perf_counter() - started, 2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(_finite(result), indent=2, ensure_ascii=False) + "\n")
    running("report")
    if options.plots:
        _write_report(result, joined, options.tokenize, out)
    bar.update(len(EVALUATION_PARTS) - bar.n)
    return result


def _utility(scores: list[dict[str, float]], joined: Joined) -> dict[str, Any]:
    """Utility per row, pooled overall, by bucket and by dataset."""
    def pooled(groups):
        return {key: {**_mean_dict([scores[i] for i in idx]), "rows": len(idx)} for key, idx in sorted(groups.items())}

    return {"overall": _mean_dict(scores), "by_bucket": pooled(joined.by_bucket),
            "by_dataset": pooled(_rows_by(r.dataset for r in joined.records))}


def _diversity_section(joined: Joined, options: EvaluateOptions) -> dict[str, Any]:
    if not options.diversity:
        return {"status": "skipped", "overall": {}, "by_bucket": {}}
    human = joined.human

    def side_by_side(idx):
        return _diversity([human[i] for i in idx], [joined.predictions[i] for i in idx], options.tokenize,
                          None if options.compat == "reference" else options.intervals,
                          drop_empty=options.compat != "reference")

    return {"overall": side_by_side(range(len(human))),
            "by_bucket": {b: side_by_side(idx) for b, idx in sorted(joined.by_bucket.items())}}


MODEL_ANSWERS = "model"  # FeatureBased.resamples' key of the predictions' own draws


@dataclasses.dataclass
class FeatureBased:
    """The feature-based naturalness sections: BNG, HCR, the per-bucket reports, the reference rows
    (human floor and no-model baselines), each baseline's BNG and F1 by bucket (its frontier's points), and
    the bootstrap draws of the model's answers (MODEL_ANSWERS) and each baseline's; no draws under --compat
    reference."""
    bng: dict
    hcr: dict
    buckets: dict = dataclasses.field(default_factory=dict)
    reference_rows: dict = dataclasses.field(default_factory=dict)
    baseline_buckets: dict = dataclasses.field(default_factory=dict)
    resamples: dict[str, sp.Resamples] = dataclasses.field(default_factory=dict)


def _naturalness(joined: Joined, scores: list[dict[str, float]], utility: dict[str, Any],
                 options: EvaluateOptions, side: dict[str, Any]) -> FeatureBased:
    """BNG, HCR and what goes with them (FeatureBased). The default mode also adds F1's intervals to
    `utility`. `side`: the records' human side (`_human_side`)."""
    lm = _lm_scorer(options.scorer, options.dtype) if options.scorer is not None else None
    records, by_bucket = joined.records, joined.by_bucket
    human_features = _kept(side, "human features", lambda: _answer_features(records, None, lm))
    generated_features = _answer_features(records, joined.predictions, lm)
    references = read_references(options.references) if options.references else None
    if options.compat == "reference":
        return FeatureBased(*_paper_naturalness(by_bucket, human_features, generated_features, references))
    intervals = options.intervals
    supports = _kept(side, "supports", lambda: _supports(by_bucket, human_features, options.support, references,
                                                         intervals, [r.id for r in records]))
    f1 = np.array([s["qa_f1"] for s in scores])
    human_table = None if options.support is None else _feature_matrix(human_features)
    floors = _kept(side, "floors", lambda: sp.human_floors(by_bucket, supports, intervals, human_table))
    measured = sp.measure(by_bucket, supports, _feature_matrix(generated_features), f1, intervals, human_table,
                          one_answer=True, floors=floors)
    bng, hcr = _naturalness_metrics(measured, intervals)
    bng["one_answer"] = one_answer_of_macro(measured["by_bucket"], joined)
    for report in measured["by_bucket"].values():  # metrics.json names answers by record id
        if (found := report.get("bng_without_one")) is not None:
            report["bng_without_one"] = {"id": joined.records[found["row"]].id, "bng": found["bng"]}
    utility["overall"]["qa_f1_interval"] = measured["summary"]["f1"]["weighted_interval"]
    # ROUGE-L and EM on the same stratified resamples of the test rows as F1's interval
    weights = measured["resamples"].weights
    for key in ("rouge_l_f1", "em"):
        values = np.array([s[key] for s in scores], float)
        utility["overall"][f"{key}_interval"] = sp.interval(weights @ values / weights.sum(axis=1), intervals.level,
                                                             utility["overall"][key])
    utility["macro"] = {"qa_f1": measured["summary"]["f1"]["macro"],
                        "qa_f1_interval": measured["summary"]["f1"]["macro_interval"]}
    reference_rows = {"human": {**{f"{name}_macro{end}": section.get(f"floor_macro{end}") for name, section in
                                   (("bng", bng), ("hcr", hcr)) for end in ("", "_interval")}, "rows": len(records)}}
    baseline_buckets, resamples = {}, {MODEL_ANSWERS: measured["resamples"]}
    if options.baselines:
        baselines = _kept(side, "baselines", lambda: _baseline_measures(joined, supports, floors, human_table, lm,
                                                                        options))
        for name, (row, buckets, draws) in baselines.items():
            reference_rows[name], baseline_buckets[name], resamples[name] = row, buckets, draws
    return FeatureBased(bng, hcr, measured["by_bucket"], reference_rows, baseline_buckets, resamples)


def _baseline_measures(joined: Joined, supports: dict[str, sp.Support], floors: dict[str, sp.Floor],
                       human_table: np.ndarray | None, lm, options: EvaluateOptions
                       ) -> dict[str, tuple[dict[str, Any], dict[str, dict], sp.Resamples]]:
    """Each no-model baseline's reference row (BNG, HCR and F1 macros with intervals), its BNG and F1 by
    bucket (its frontier's points) and its bootstrap draws, measured as the model's answers are."""
    records, intervals = joined.records, options.intervals
    human_tokens = [tokens(h, options.tokenize) for h in joined.human]
    measured = {}
    for name in BASELINES:
        answers = baseline_answers(name, records)
        answer_f1 = np.array([token_f1(tokens(a, options.tokenize), g) for a, g in zip(answers, human_tokens)])
        baseline = sp.measure(joined.by_bucket, supports, _feature_matrix(_answer_features(records, answers, lm)),
                              answer_f1, intervals, human_table, floors=floors)
        summary = baseline["summary"]
        row = {"bng_macro": summary["bng"]["macro"], "bng_macro_interval": summary["bng"].get("macro_interval"),
               "hcr_macro": summary["hcr"]["macro"], "hcr_macro_interval": summary["hcr"].get("macro_interval"),
               "f1": summary["f1"]["weighted"], "f1_interval": summary["f1"]["weighted_interval"],
               "rows": len(records)}
        buckets = {b: {"bng": r["bng"], "f1": r["f1"]} for b, r in baseline["by_bucket"].items()}
        measured[name] = (row, buckets, baseline["resamples"])
    return measured


def _turn_dynamics(joined: Joined, answers: list[str], options: EvaluateOptions,
                   resamples: sp.Resamples | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """TDM of `answers` (the model's, or a no-model baseline's) on the multi-turn rows, each bucket's with
    its interval, and each bucket's TDM under every draw of `resamples` (none without)."""
    multi = [i for i, r in enumerate(joined.records) if r.track == "multi"]
    tdm, draws = turn_dynamics_with_draws(
        [joined.records[i].question for i in multi], [joined.human[i] for i in multi], [answers[i] for i in multi],
        [joined.records[i].bucket_id for i in multi], options.tokenize,
        None if resamples is None else resamples.weights[:, multi])
    for bucket, report in tdm["by_bucket"].items():
        report["tdm_interval"] = None if bucket not in draws else sp.interval(draws[bucket], options.intervals.level,
                                                                                report["tdm"])
    return tdm, draws


def _baseline_composites(joined: Joined, answers: list[str], buckets: dict[str, dict], row: dict[str, Any],
                         featurize, options: EvaluateOptions, resamples: sp.Resamples | None) -> dict[str, Any]:
    """A no-model baseline's TDM, NUF hypervolume, MAUVE (with a featurizer) and aggregate with their
    intervals, computed as the model's are, so that those numbers too have something beside them to be
    read against."""
    tdm = _turn_dynamics(joined, answers, options, resamples)
    mauve_metrics = _mauve_section(dataclasses.replace(joined, predictions=answers), featurize)
    bng = {b: r["bng"] for b, r in buckets.items() if r["bng"] is not None}
    _, aggregate, estimates, said = _combined(bng, {b: r["f1"] for b, r in buckets.items()}, row["f1"],
                                              row["bng_macro"], mauve_metrics, tdm, resamples, options)
    return {**estimates, **{f"{key}_interval": value for key, value in said.items()}, "mauve": mauve_metrics["global"],
            "aggregate_parts": aggregate["parts"]}


def _combined(bng: dict[str, float], f1: dict[str, float], f1_overall: float | None, bng_macro: float | None,
              mauve_metrics: dict, tdm: tuple[dict, dict], resamples: sp.Resamples | None,
              options: EvaluateOptions) -> tuple[dict, dict, dict, dict]:
    """One set of answers' frontiers, aggregate, and TDM's macro, the hypervolume and the aggregate with
    their intervals (composites.combined_intervals), from their bucket numbers and `tdm` (report, draws)."""
    report, draws = tdm
    nuf = frontiers(bng, mauve_metrics, report, f1, options.featurizer)
    aggregate = aggregate_section(f1_overall, bng_macro, mauve_metrics["global"], nuf["overall"]["hypervolume"])
    estimates = {"tdm_macro": report["overall_macro"], "nuf_hypervolume": nuf["overall"]["hypervolume"],
                 "aggregate": aggregate["overall"]}
    intervals = combined_intervals(resamples, bng, draws, mauve_metrics, estimates, options.intervals.level)
    return nuf, aggregate, estimates, intervals


# faiss's k-means (inside mauve-text) writes this to the native stderr for every clustering of fewer than
# 39 points per cluster, which conditional MAUVE on small buckets always is: counted into the section's
# note instead of a screenful of warnings.
FAISS_FEW_POINTS = re.compile(r"WARNING clustering \d+ points to \d+ centroids: please provide at least \d+ "
                              r"training points")


FEATURIZER_IS_MODEL = ("the featurizer is the model whose answers are measured: its own hidden states read "
                       "its answers as it wrote them, so MAUVE and hidden-state detectability can say 'human' where a "
                       "separate, larger featurizer would not; give another checkpoint as --featurizer")


def predictions_checkpoint(predictions_path: Path) -> str | None:
    """The checkpoint `polyalign generate` wrote the predictions with (their manifest names it); None for an
    external engine's."""
    checkpoint = ((read_record(predictions_path) or {}).get("settings") or {}).get("checkpoint")
    return checkpoint if isinstance(checkpoint, str) else None


def decoding_of(predictions_path: Path) -> dict[str, Any] | None:
    """How `polyalign generate` decoded the predictions (its manifest's sampling settings, `auto` where each
    bucket had its own budget, the prompt budget its prompts were cut to, and the dtype it computed in); None
    for an external engine's."""
    record = read_record(predictions_path) or {}
    settings, summary = record.get("settings") or {}, record.get("summary") or {}
    sampling = settings.get("sampling")
    if not isinstance(sampling, dict):
        return None
    # how many prompts the budget cut, of how many: "cut to 192 tokens" alone hid 173 of 210
    cut = {"prompts_cut": summary["prompts_cut"], "prompts": summary["records"]} if isinstance(
        summary.get("prompts_cut"), int) and isinstance(summary.get("records"), int) else {}
    return {**asked_for(sampling), **({"max_new_tokens": "auto"} if settings.get("budget_records") else {}),
            **({"max_prompt_tokens": settings["max_prompt_tokens"], **cut} if "max_prompt_tokens" in settings else {}),
            # the weights' and computation's dtype (--dtype): bfloat16 answers can differ from float32 ones
            **({"dtype": settings["dtype"]} if isinstance(settings.get("dtype"), str) else {})}


FEATURIZER_IS_BASE = ("the featurizer is {relation}: the measured model's hidden states began as its own, so "
                      "MAUVE and hidden-state detectability read its answers through the model's lineage, not a "
                      "separate reader's; give a checkpoint the model was not trained from as --featurizer")
LINEAGE_DEPTH = 16  # init links followed back (SFT, rounds, a critic's base): more than any pipeline makes


def featurizer_relation(featurizer, predictions_path: Path) -> str | None:
    """How --featurizer stands to the checkpoint that wrote the predictions: "the model itself", "the model's
    base (init)" or "a model it was trained from, k inits back" (each training run's config.json names its
    init), or None when it is none of them or the predictions name no checkpoint."""
    checkpoint = predictions_checkpoint(predictions_path)
    if checkpoint is None or is_uri(str(featurizer)):
        return None
    for depth in range(LINEAGE_DEPTH):
        if is_uri(checkpoint):
            return None
        if same_path(featurizer, checkpoint):
            return ("the model itself", "the model's base (the init it was trained from)")[depth] if depth < 2 else \
                f"a model it was trained from, {depth} inits back"
        record = training_record(checkpoint)
        if record is None:  # a checkpoint no polyalign run made: the lineage ends
            return None
        checkpoint = record["config"].get("init")
        if not isinstance(checkpoint, str):
            return None
    return None


def _mauve_section(joined: Joined, featurize) -> dict[str, Any]:
    """MAUVE over all answers and conditional MAUVE per bucket."""
    if featurize is None:
        return {"status": "skipped", "reason": "no --featurizer model was given", "global": None, "by_bucket": {}}
    human, predictions = joined.human, joined.predictions
    with captured_stderr_lines() as lines:
        by_bucket = {b: _mauve([human[i] for i in idx], [predictions[i] for i in idx], featurize)
                     for b, idx in sorted(joined.by_bucket.items())}
        overall = _mauve(human, predictions, featurize)
    others = [line for line in lines if not FAISS_FEW_POINTS.fullmatch(line.strip())]
    few_points = len(lines) - len(others)
    for line in others:
        print(line, file=sys.stderr)
    section = {"status": "computed", "global": overall,
               "by_bucket": {b: v for b, v in by_bucket.items() if math.isfinite(v)}}
    if few_points:
        section["note"] = (f"faiss warned {counted(few_points, 'time')} that MAUVE's k-means had fewer than the 39 "
                           "points per cluster it asks for (MAUVE makes one cluster per 10 answers): on so few answers "
                           "MAUVE is noisy")
    return section


def _detectability_section(joined: Joined, options: EvaluateOptions, featurize, side: dict[str, Any]) -> dict[str, Any]:
    """Per bucket, how well a classifier tells the model's answers from people's answers to the same
    prompts (ROC AUC, 0.5: not at all), on character n-grams, beside the human floor; the no-model
    baselines measured the same way; with a featurizer, the same on its hidden states. `side`: the
    records' human side (`_human_side`), which holds the floors and the baselines."""
    if not options.detectability:
        return {"status": "skipped", "reason": "--no-detectability"}
    if options.compat == "reference":
        return {"status": "skipped", "reason": "--compat reference computes the authors' metrics only"}
    human = _kept(side, "character n-grams", lambda: dt.char_ngram_counts(joined.human))

    def measured(representation, human_matrix, answers_matrix, floor):
        return dt.measure(joined.by_bucket, human_matrix, answers_matrix, options.intervals, representation, floor)

    def floor_of(representation, human_matrix):
        return _kept(side, f"detectability floor, {representation}",
                     lambda: dt.floor_scores(joined.by_bucket, human_matrix, options.intervals, representation))

    section = _detectability_summary(measured(dt.CHAR_NGRAMS, human, dt.char_ngram_counts(joined.predictions),
                                              floor_of(dt.CHAR_NGRAMS, human)))
    section |= {"status": "computed", "representation": dt.CHAR_NGRAMS, "classifier": "logistic regression",
                "folds": dt.FOLDS, "grouped_by": "prompt", "min_prompts": dt.MIN_PROMPTS}
    if options.baselines:
        def baselines():
            found = {}
            for name in BASELINES:
                summary = measured(dt.CHAR_NGRAMS, human,
                                   dt.char_ngram_counts(baseline_answers(name, joined.records)), floor=False)
                found[name] = {"detectability_macro": summary["macro"],
                               "detectability_macro_interval": summary.get("macro_interval")}
            return found

        section["baselines"] = _kept(side, "detectability of the baselines", baselines)
    if featurize is not None:
        def vectors(texts):
            return np.asarray(featurize(list(texts)), float)

        people = vectors(joined.human)
        section[dt.HIDDEN_STATES] = _detectability_summary(
            measured(dt.HIDDEN_STATES, people, vectors(joined.predictions), floor_of(dt.HIDDEN_STATES, people)))
    return section


def _detectability_summary(measured: dict) -> dict[str, Any]:
    """metrics.json's layout of one detectability measurement, keyed as the BNG and HCR sections are."""
    reports = measured["by_bucket"]

    def per_bucket(key):
        return {b: r[key] for b, r in reports.items() if r.get(key) is not None}

    return {"overall_macro": measured["macro"], "overall_weighted": measured["weighted"],
            "macro_interval": measured.get("macro_interval"), "weighted_interval": measured.get("weighted_interval"),
            "floor_macro": measured.get("floor_macro"), "floor_macro_interval": measured.get("floor_macro_interval"),
            # the floor is a mean over people-against-people halvings: the range of their macros
            "floor_macro_spread": measured.get("floor_macro_spread"), "floor_halvings": measured.get("floor_halvings"),
            "floor_buckets": measured.get("floor_buckets", 0), "macro_floored": measured.get("macro_floored"),
            "gap_macro": measured.get("gap_macro"), "buckets": measured["buckets"], "rows": measured["rows"],
            "backed_off": measured.get("backed_off", []), "by_bucket": per_bucket("auc"),
            "interval_by_bucket": per_bucket("auc_interval"), "floor_by_bucket": per_bucket("auc_floor"),
            "reports": reports}


# What the comparison report shows of the model behind the predictions, from its training run's config
# (predictions -> their manifest's checkpoint OUT/model -> its polyalign_training.json, or OUT/config.json beside
# it), as (name, path in the config)
TRAINING_SETTINGS = (("method", ("method",)), ("weighting", ("weighting",)), ("steps", ("train", "steps")),
                     ("learning rate", ("optimizer", "lr")), ("init", ("init",)), ("preset", ("model", "preset")),
                     ("LoRA rank", ("model", "lora", "rank")), ("data", ("data", "dir")), ("pairs", ("pairs",)),
                     ("beta", ("beta",)), ("lambda_dist", ("lambda_dist",)), ("gamma_ftx", ("gamma_ftx",)),
                     ("profile", ("profile",)),
                     # a preference run's own cut (an SFT run's is its build's, read there: trained_with)
                     ("max length", ("data", "max_length")), ("truncation", ("truncation",)))


def trained_with(predictions_path: Path) -> dict[str, Any] | None:
    """The model the predictions came from and how it was trained, where `polyalign generate` wrote them
    from a training run's OUT/model; None for an external engine's predictions or another checkpoint."""
    checkpoint = predictions_checkpoint(predictions_path)
    if checkpoint is None:
        return None
    record = training_record(checkpoint)
    if record is None:  # a base checkpoint, or a model exported before its folder kept a record and moved since
        return {"checkpoint": checkpoint}
    config = record["config"]
    settings = {}
    for name, keys in TRAINING_SETTINGS:
        value = config
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            settings[name] = value
    lengths = length_history(record["segments"], (config.get("train") or {}).get("steps"))
    if lengths:  # resumed with another train.steps: not a plain run of the last length
        settings["steps"] = lengths
    for name, key in (("max length", "max_length"), ("truncation", "truncation")):
        if config.get("method") == "sft" and (built := build_setting(config, key)) is not None:  # its build's
            settings[name] = built[0]
    if "profile" not in settings and isinstance(exported := exported_setting(checkpoint, "polyalign_profile"), str):
        settings["profile"] = exported  # an SFT run's profile is its build's: the export names it
    if settings.get("init"):  # the architecture is init's: a preset the config still names was not used
        settings.pop("preset", None)
    if config.get("method") != "hdpo" and not config.get("hdpo_terms"):  # HDPO's terms: the others never read them
        settings.pop("lambda_dist", None)
        settings.pop("gamma_ftx", None)
    # Every other setting that shapes the model, by its key (train.seed, optimizer.min_lr_ratio, data.pack...):
    # a comparison names whichever of them differ; where a run stops and what it logs are left out.
    named = {".".join(keys) for _, keys in TRAINING_SETTINGS}
    others = {key: value for key, value in flatten(config).items()
              if key not in named and not keys_match(key, FREE_KEYS + REPORTING_KEYS)}
    rounds = round_of(record["run"]) if record["run"] is not None else {}
    marked = record.get("round") or {}
    if not rounds and marked.get("number"):  # a round's model moved out of its rounds folder: its record says
        rounds = {"round": round_words(marked["number"], marked.get("of", "?")),
                  **({"rounds from": marked["from"]} if marked.get("from") else {})}
    return {"checkpoint": checkpoint, **settings, **rounds, "settings": others}


def round_words(number: int, of: int | str) -> str:
    """A round of on-policy rounds as the comparison report names it: "2 of 3 (on-policy)"."""
    return f"{number} of {of} (on-policy)"


def round_of(run: Path) -> dict[str, Any]:
    """For a round of on-policy rounds (OUT/round-<k>), which round of how many and the model round 1
    started from: its own config names only the round before it as init."""
    found = re.fullmatch(r"round-(\d+)", run.name)
    if found is None:
        return {}
    rounds = run.parent
    try:
        planned = json.loads((rounds / "summary.json").read_text()).get("rounds_planned")
    except (OSError, ValueError, AttributeError):  # stopped inside a later round, or an earlier version's run
        planned = None
    # a later run with fewer rounds leaves this one beyond its plan: it is at least the k-th of k
    planned = max(planned or len(list(rounds.glob("round-*"))), int(found[1]))
    try:
        first = json.loads((rounds / "round-1" / "config.json").read_text()).get("init")
    except (OSError, ValueError, AttributeError):
        first = None
    return {"round": round_words(int(found[1]), planned), **({"rounds from": first} if first else {})}


def _result(joined: Joined, metrics: dict[str, Any], records_path: Path, predictions_path: Path,
            options: EvaluateOptions, settings: dict[str, Any]) -> dict[str, Any]:
    """metrics.json: what was evaluated and how, the alignment, the answers, and the metrics."""
    empty = [r.id for r, p in zip(joined.records, joined.predictions) if not p.strip()]
    references, support = options.references, options.support
    return {
        "config": {"records": str(records_path), "predictions": str(predictions_path), "compat": options.compat,
                   "tokenize": options.tokenize, "references": str(references) if references else None,
                   "support": str(support) if support else None,
                   "featurizer": str(options.featurizer) if options.featurizer else None,
                   "scorer": str(options.scorer) if options.scorer else None,
                   "allow_partial": options.allow_partial, "profile": joined.profiles, "models": joined.models,
                   "trained": trained_with(predictions_path), "decoding": decoding_of(predictions_path),
                   "test_rows": joined.alignment["evaluated"], "min_bucket_rows": nat.MIN_BUCKET_ROWS,
                   "intervals": None if options.compat == "reference" else dataclasses.asdict(options.intervals),
                   "diversity": options.diversity, "seconds": None},
        "alignment": joined.alignment,
        # empty answers: scored as answers by utility and naturalness; left out of diversity but in
        # --compat reference, which keeps them as the authors' code does
        "answers": {"evaluated": len(joined.predictions), "empty": len(empty), "empty_ids": empty[:10],
                    # of those, where the person said nothing too: an answer no model is to blame for
                    "empty_as_people": sum(1 for p, h in zip(joined.predictions, joined.human)
                                           if not p.strip() and not h.strip()),
                    # answers with characters but no word once tokenised ("，，，"): left out of diversity too
                    "without_words": sum(1 for p in joined.predictions
                                         if p.strip() and not tokens(p, options.tokenize)),
                    "in_diversity": options.compat == "reference",
                    "wrong_script": wrong_script_section(joined)},
        "not_available": not_available_reasons(metrics, options.compat),
        "metrics": metrics,
        "settings": settings,
        "made_from": {name: file_digest(path) for name, path in
                      (("records", records_path), ("predictions", predictions_path), ("support", support),
                       ("references", references)) if path is not None},
    }


def wrong_script_section(joined: Joined) -> dict[str, Any]:
    """Answers written in another language's script than their conversation's (an English question
    answered in Chinese): counted by language and script, the first ids, and people's own answers
    counted alike (code-switching in the data itself). Every metric scores such answers as they are."""
    by_language: dict[str, Counter] = defaultdict(Counter)
    ids = []
    for record, answer in zip(joined.records, joined.predictions):
        if (script := wrong_script(record.language, answer)) is not None:
            by_language[record.language][script] += 1
            ids.append(record.id)
    people = sum(wrong_script(r.language, h) is not None for r, h in zip(joined.records, joined.human))
    return {"answers": len(ids), "ids": ids, "by_language": {k: dict(v) for k, v in sorted(by_language.items())},
            "people": people, "rows": len(joined.records)}


def _write_report(result: dict[str, Any], joined: Joined, tokenize: str, out: Path) -> None:
    from polyalign.reports.evaluation import write_evaluation_report  # heavy: matplotlib, only for the report

    records, human, predictions = joined.records, joined.human, joined.predictions
    samples = {b: [{"question": records[i].question, "human": human[i], "model": predictions[i]} for i in idx[:3]]
               for b, idx in sorted(joined.by_bucket.items())}
    write_evaluation_report(result, [len(tokens(t, tokenize)) for t in human],
                            [len(tokens(t, tokenize)) for t in predictions], [r.bucket_id for r in records], out,
                            samples)


DIVERSITY_KEYS = ("distinct_1", "distinct_2", "distinct_3", "self_bleu_4")


def _diversity(human: list[str], generated: list[str], tokenize: str,
               intervals: sp.IntervalOptions | None, drop_empty: bool = True) -> dict[str, Any]:
    """Distinct-n and Self-BLEU of the human answers and the predictions, with intervals unless None.
    An answer without a word (empty, or punctuation only: nothing once tokenised) has no n-grams and no
    BLEU against the others, so it reads as perfectly diverse: with `drop_empty` (the default mode) such
    answers on either side are left out and counted, with fewer than two left the numbers are undefined
    (None, with the reason), and a Distinct-n with no n-gram at all (every answer one word, for n = 2) is
    None too. --compat reference keeps them, as the authors' code does (its published values include
    them)."""
    section: dict[str, Any] = {}
    for side, texts in (("human", human), ("generated", generated)):
        worded = [text for text in texts if tokens(text, tokenize)]
        kept = worded if drop_empty else list(texts)
        section[f"{side}_empty"] = len(texts) - len(worded)
        if len(kept) < 2:
            section[side] = {key: None for key in DIVERSITY_KEYS}
            section[f"{side}_reason"] = (f"undefined: {counted(len(kept), 'answer')} with a word "
                                         "(needs 2)")
            if intervals is not None:
                section[f"{side}_interval"] = {key: None for key in DIVERSITY_KEYS}
            continue
        if intervals is None:
            section[side] = diversity(kept, tokenize)
        else:
            section[side], section[f"{side}_interval"] = diversity_with_intervals(
                kept, tokenize, intervals.draws, intervals.seed, intervals.level)
        longest = max(len(tokens(text, tokenize)) for text in kept)
        for n in (2, 3):  # no n-gram to count: undefined, not "no variety"
            if drop_empty and longest < n:
                section[side][f"distinct_{n}"] = None
                if intervals is not None:
                    section[f"{side}_interval"][f"distinct_{n}"] = None
    return section


def not_available_reasons(metrics: dict[str, Any], compat: str) -> dict[str, str]:
    """Why each headline number that is missing is missing, for the summary line and the report."""
    reasons = {}
    if metrics["bng"]["overall_macro"] is None:
        reasons["bng"] = reasons["hcr"] = (f"no bucket has {nat.MIN_BUCKET_ROWS} test rows, the least --compat "
                                           "reference measures" if compat == "reference" else "no bucket measured")
    if metrics["tdm"]["overall_macro"] is None:
        reasons["tdm"] = "no multi-turn test rows" if not metrics["tdm"].get("rows") else \
            f"no bucket holds {nat.MIN_BUCKET_ROWS} multi-turn rows"
    if metrics["mauve"]["status"] != "computed":
        reasons["mauve"] = metrics["mauve"].get("reason", "not computed")
    detect = metrics.get("detectability", {})
    if detect.get("status") != "computed":
        reasons["detectability"] = detect.get("reason", "not computed")
    elif detect["overall_macro"] is None:
        reasons["detectability"] = "no bucket has two prompts"
    if metrics["utility"]["overall"].get("qa_f1") is None:
        reasons["utility"] = "no rows evaluated"
    if metrics["aggregate"]["overall"] is None:
        reasons["aggregate"] = "its parts (F1, BNG) are not all measured"
    if (metrics.get("nuf") or {}).get("overall", {}).get("hypervolume") is None:
        reasons["nuf"] = (f"no bucket's BNG is measured ({reasons['bng']})" if "bng" in reasons else
                          "no bucket has both F1 and BNG")
    return reasons


def _paper_naturalness(by_bucket_idx, human_features, generated_features, references) -> tuple[dict, dict]:
    """BNG and HCR as the authors' code computes them: buckets with at least MIN_BUCKET_ROWS rows only,
    every feature (constant ones too), HCR as the share with every feature inside its band."""
    bng, hcr, hcr_inside, sizes = {}, {}, {}, {}
    for b, idx in sorted(by_bucket_idx.items()):
        if len(idx) < nat.MIN_BUCKET_ROWS:
            continue
        h = {f: v[idx] for f, v in human_features.items()}
        g = {f: v[idx] for f, v in generated_features.items()}
        features = nat.usable_features(h, keep_constant=True)
        if references and b in references["buckets"]:
            stats = references["buckets"][b]["features"]
            bands = {f: (stats[f]["q10"], stats[f]["q90"]) if f in stats else nat.bands_from_values({f: h[f]})[f]
                     for f in features}
        else:
            bands = nat.bands_from_values(h)
        sizes[b] = len(idx)
        bng[b] = nat.bucket_bng(h, g, features)
        hcr[b], hcr_inside[b] = nat.bucket_hcr(bands, g, features)
    bng_summary, hcr_summary = nat.macro_and_weighted(bng, sizes), nat.macro_and_weighted(hcr, sizes)
    return ({"overall_macro": bng_summary["macro"], "overall_weighted": bng_summary["weighted"], "by_bucket": bng},
            {"overall_macro": hcr_summary["macro"], "overall_weighted": hcr_summary["weighted"], "definition": "paper",
             "feature_inside_macro": nat.macro_and_weighted(hcr_inside, sizes)["macro"], "by_bucket": hcr,
             "feature_inside_by_bucket": hcr_inside})


def _support_sample(path: Path) -> tuple[list[str], dict[str, list[int]], frozenset[str]]:
    """Human answers of a support file (the train split), at most SUPPORT_ROWS_PER_BUCKET per bucket (a
    sample fixed by the bucket's name), their rows by bucket, and every record's id. The sample is the same
    whatever `--seed`: the seed draws the bootstrap and the floor's halves, which the intervals carry, while
    another support sample moves the point estimates themselves (a bucket's HCR read 0.654 on one sample of
    1,000 of its 7,688 train answers and 0.527 on another, both outside the other's interval), so that two
    evaluations of the same answers with other seeds differed as if they were other models. The draw is
    the one seed 0 made before."""
    by_bucket: dict[str, list[str]] = defaultdict(list)
    ids = set()
    for record in read_records(path):
        by_bucket[record.bucket_id].append(record.response)
        ids.add(record.id)
    texts, rows = [], {}
    for bucket, answers in sorted(by_bucket.items()):
        if len(answers) > SUPPORT_ROWS_PER_BUCKET:
            answers = random.Random(f"0:{bucket}").sample(answers, SUPPORT_ROWS_PER_BUCKET)
        rows[bucket] = list(range(len(texts), len(texts) + len(answers)))
        texts += answers
    return texts, rows, frozenset(ids)


@functools.lru_cache(maxsize=2)
def _support_table(path: str, modified_ns: int, size: int
                   ) -> tuple[np.ndarray, dict[str, list[int]], frozenset[str]]:
    """The support's feature table (read-only), rows by bucket and record ids, kept for the next evaluation
    against the same unchanged file: the demo and the methods bench evaluate several models against one
    train split."""
    texts, rows, ids = _support_sample(Path(path))
    table = _feature_matrix(_features(texts))
    table.flags.writeable = False
    return table, rows, ids


def _supports(by_bucket_idx, human_features, support_path: Path | None, references,
              options: sp.IntervalOptions, record_ids: Sequence[str]) -> dict[str, sp.Support]:
    """Each bucket's human support: the human answers of a separate support file (the train split)
    when given, else the test records' own; the bucket's, or its parent group's when it has fewer than
    MIN_BUCKET_ROWS; bands from the bucket's train references when the pool is its own."""
    names = list(human_features)
    if support_path is None:
        table, pool_rows = _feature_matrix(human_features), by_bucket_idx
    else:

        if set(names) != set(FEATURE_NAMES):
            raise EvaluationError(SCORER_WITH_SUPPORT)
        path = Path(support_path).resolve()
        if not path.is_file():
            raise EvaluationError(f"{support_path}: no such support file; pass the train split's records "
                                  "(RUN/data/train.jsonl)")
        stat = path.stat()
        table, pool_rows, support_ids = _support_table(str(path), stat.st_mtime_ns, stat.st_size)
        if shared := [i for i in record_ids if i in support_ids]:
            # a human answer inside its own support: the floor measures people against themselves
            raise EvaluationError(
                f"{support_path}: {counted(len(shared), 'evaluated record')} of {len(record_ids)} "
                f"{'is' if len(shared) == 1 else 'are'} in the support too (id {shared[0]}): each human answer "
                "would be measured against a support that holds it, and the floor and every gap with it; pass a "
                "split the records are not in (RUN/data/train.jsonl), or leave --support out (the records' own human "
                "answers are then the pool, and the floor comes from held-out halves of them)")
    supports = {}
    for bucket, (pool, rows) in sp.choose_pools(list(by_bucket_idx), pool_rows, nat.MIN_BUCKET_ROWS).items():
        position = {row: i for i, row in enumerate(rows)}
        own = [position[i] for i in by_bucket_idx[bucket]] if support_path is None else []
        reference = references["buckets"].get(bucket) if references and pool == bucket else None
        supports[bucket] = sp.make_support(table[:, rows], names, pool, own, reference, options)
    return supports


# One answer is said to make the BNG macro when leaving it out lowers the macro by this share of it and
# by at least ONE_ANSWER_ABSOLUTE: with B buckets of n answers an ordinary answer moves it about 1/(B n).
ONE_ANSWER_SHARE = 0.2
ONE_ANSWER_ABSOLUTE = 0.05


def one_answer_of_macro(by_bucket: dict[str, dict], joined: Joined) -> dict[str, Any] | None:
    """The single answer whose removal lowers the BNG macro most, when that is by ONE_ANSWER_SHARE of it
    or more: its id, its bucket, the macro and the bucket's BNG with and without it, and its length
    beside people's in the bucket. None where no answer weighs that much (the macro stands on many)."""
    measured = {b: r for b, r in by_bucket.items() if r.get("bng") is not None}
    candidates = {b: r for b, r in measured.items() if r.get("bng_without_one")}
    if not candidates:
        return None
    macro = float(np.mean([r["bng"] for r in measured.values()]))
    bucket = max(candidates, key=lambda b: candidates[b]["bng"] - candidates[b]["bng_without_one"]["bng"])
    report, found = candidates[bucket], candidates[bucket]["bng_without_one"]
    without = macro - (report["bng"] - found["bng"]) / len(measured)
    if macro - without < max(ONE_ANSWER_SHARE * macro, ONE_ANSWER_ABSOLUTE):
        return None
    people = sorted(len(joined.human[i]) for i in joined.by_bucket[bucket])
    return {"id": joined.records[found["row"]].id, "bucket": bucket, "bng_macro": macro, "bng_macro_without": without,
            "bucket_bng": report["bng"], "bucket_bng_without": found["bng"], "bucket_rows": report["rows"],
            "characters": len(joined.predictions[found["row"]]), "people_characters_median": people[len(people) // 2]}


def _naturalness_metrics(measured: dict, options: sp.IntervalOptions) -> tuple[dict, dict]:
    """The default mode's BNG and HCR sections of metrics.json: averages with intervals and floors,
    what they cover, and per-bucket maps (the full per-bucket reports are under metrics.buckets)."""
    by_bucket, summary = measured["by_bucket"], measured["summary"]

    def per_bucket(key):
        return {b: r[key] for b, r in by_bucket.items() if r.get(key) is not None}

    def section(metric):
        s = summary[metric]
        return {"overall_macro": s["macro"], "overall_weighted": s["weighted"],
                "macro_interval": s.get("macro_interval"), "weighted_interval": s.get("weighted_interval"),
                "floor_macro": s.get("floor_macro"), "floor_macro_interval": s.get("floor_macro_interval"),
                "buckets": s["buckets"], "rows": s["rows"],
                "backed_off": s.get("backed_off", []), "small_buckets": s.get("small_buckets", []),
                "min_interval_rows": options.min_rows, "by_bucket": per_bucket(metric),
                "interval_by_bucket": per_bucket(f"{metric}_interval"),
                "floor_by_bucket": per_bucket(f"{metric}_floor")}

    bng = section("bng") | {"gap_macro": summary["bng"].get("gap_macro"),
                            "gap_macro_interval": summary["bng"].get("gap_macro_interval"),
                            "gap_by_bucket": per_bucket("bng_gap")}
    inside = per_bucket("feature_inside")
    hcr = section("hcr") | {"definition": "calibrated", "coverage": options.coverage,
                            "above_people": sorted(b for b, r in by_bucket.items() if r.get("hcr_above_people")),
                            "strict_by_bucket": per_bucket("hcr_strict"), "feature_inside_by_bucket": inside,
                            "feature_inside_macro": float(np.mean(list(inside.values()))) if inside else None}
    return bng, hcr


def _finite(value):
    """NaN and infinities become null in JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _featurizer(checkpoint: Path, dtype: str, kept: dict[str, np.ndarray], lasting: set[str]):
    """Texts -> mean-pooled hidden states of the checkpoint. Each distinct text is encoded once, since MAUVE
    (overall and per bucket) and detectability read the same answers again; the vectors of the `lasting`
    texts (people's answers and the no-model answers: `_side_texts`) go to `kept`, the human side's, and are
    read by every later evaluation of the same records, the others are this evaluation's. Each text is
    encoded beside texts of its own padded length, so that its vector is the same whichever texts were
    encoded with it, in this evaluation or an earlier one. The checkpoint loads at the first text to encode."""
    own: dict[str, np.ndarray] = {}

    @functools.cache
    def loaded():
        tokenizer = checkpoint_tokenizer(checkpoint)  # a tokenizer that does not fit says so before the weights load
        return load_hf_checkpoint(checkpoint, dtype=compute_dtype(dtype)), tokenizer

    def featurize(texts):
        texts = list(texts)
        new = list(dict.fromkeys(t for t in texts if t not in kept and t not in own))
        if new:
            model, tokenizer = loaded()
            by_length = defaultdict(list)
            for text in new:
                tokens_read = min(len(tokenizer.encode(text)), FEATURIZER_TOKENS)
                by_length[padded_length(tokens_read, FEATURIZER_TOKENS)].append(text)
            for group in by_length.values():
                vectors = encode_responses(model, tokenizer, group, FEATURIZER_TOKENS, 16, progress=False)
                for text, vector in zip(group, vectors):
                    (kept if text in lasting else own)[text] = vector
        return np.stack([kept[t] if t in kept else own[t] for t in texts])

    return featurize


def _side_texts(joined: Joined, options: EvaluateOptions) -> set[str]:
    """The texts of the human side: people's answers, and the no-model answers where they are measured."""
    texts = set(joined.human)
    if options.baselines:
        for name in BASELINES:
            texts.update(baseline_answers(name, joined.records))
    return texts


def _lm_scorer(scorer: Path, dtype: str):
    tokenizer = checkpoint_tokenizer(scorer)
    return LMScorer(load_hf_checkpoint(scorer, dtype=compute_dtype(dtype)), tokenizer)


def _answer_features(records, answers: list[str] | None, lm) -> dict[str, np.ndarray]:
    """Text features of the answers (the records' own human answers when None), and the LM features
    when a scorer is loaded."""
    features = _features([r.response for r in records] if answers is None else answers)
    if lm is not None:

        rows = record_lm_features(lm, records, answers)
        for name in rows[0]:
            features[name] = np.array([r[name] for r in rows], float)
    return features
