"""`polyalign stats RUN`: the bucket statistics report users read before training.

Writes RUN/stats/stats.json (counts, length quantiles, Bucket-SFT weights, feature summaries),
RUN/stats/references.json (train-only human support per bucket), PNG plots, report.html and report.md.
"""

from __future__ import annotations

import dataclasses
import html
import json
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyalign.core.errors import StatsError
from polyalign.core.outputs import OutputLock
from polyalign.core.paths import file_digest
from polyalign.core.progress import progress_bar
from polyalign.core.version import polyalign_version
from polyalign.core.wording import counted
from polyalign.core.yaml_config import ConfigError
from polyalign.data.bucketing import (
    Scheme,
    bucket_weights,
    prepared_scheme,
    weight_warnings,
)
from polyalign.data.layout import edited_records_files, prepare_manifest, quarantined_records, split_files
from polyalign.data.notes import language_mismatch_warning, mojibake_line
from polyalign.data.records import SPLITS, Record, before_question, read_records
from polyalign.data.text import LENGTH_UNIT_WORDS
from polyalign.features.references import build_references, summarize
from polyalign.features.response import text_features
from polyalign.inputs.built import BUILD_DIR, PREPARE_MANIFEST, WEIGHT_FLAGS, built_manifest
from polyalign.reports import plots
from polyalign.reports.markdown import table as markdown_table

MAIN_FEATURES = (
    "token_count", "sentence_count", "avg_tokens_per_sentence", "type_token_ratio",
    "punctuation_density", "question_sentence_ratio", "shannon_entropy", "newline_count",
)
LENGTH_QUANTILES = ("min", "q10", "q25", "q50", "q75", "q90", "max", "mean")


def _load_run(run: Path) -> tuple[dict[str, Any], dict[str, list[Record]]]:
    data = run / "data"
    if not (data / "manifest.json").is_file():
        raise StatsError(f"{run}: no data/manifest.json; run `polyalign prepare --config CONFIG --out {run}` first")
    try:
        manifest = prepare_manifest(data)
    except ConfigError as err:
        raise StatsError(str(err)) from None
    records = {split: [r for path in split_files(run, split) for r in read_records(path)] for split in SPLITS}
    return manifest, records


SYSTEM_PROMPTS_SHOWN = 3  # the most common opening system prompts the report quotes
SYSTEM_PROMPT_CHARS = 160  # of each, as many characters


def _system_prompts(records: Sequence[Record]) -> dict[str, Any]:
    """The opening system prompts of the records' conversations (a chat export's own): how many records open
    with one, how many different ones there are, and the most common, quoted, so that a team sees its prompt
    was read as a system prompt (and which others came with the data)."""
    # a system note that stood between the question and the reply (after_question) opens no conversation
    opening = Counter(turns[0]["text"] for r in records if (turns := before_question(r.history))
                      and turns[0].get("role") == "system")
    return {"records": sum(opening.values()), "distinct": len(opening),
            "most_common": [{"text": text[:SYSTEM_PROMPT_CHARS] + ("…" if len(text) > SYSTEM_PROMPT_CHARS else ""),
                             "records": n} for text, n in opening.most_common(SYSTEM_PROMPTS_SHOWN)]}


def _system_prompt_lines(prompts: dict[str, Any] | None) -> list[str]:
    if not prompts or not prompts["records"]:
        return []
    quoted = "; ".join(f"{p['records']} records: «{p['text']}»" for p in prompts["most_common"])
    more = prompts["distinct"] - len(prompts["most_common"])
    return [f"opening system prompts: {prompts['records']} records open with one, {prompts['distinct']} different "
            f"({quoted}{f'; and {more} more' if more > 0 else ''}); build keeps each and adds polyalign's "
            "profile prompt after it by default (`build --system`, `--profile`; `polyalign show` renders an example)"]


def _nested_counts(records: Sequence[Record], key) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter] = defaultdict(Counter)
    for record in records:
        counts[key(record)][record.split] += 1
    return {name: {**{s: c[s] for s in SPLITS}, "total": sum(c.values())} for name, c in sorted(counts.items())}


def _scheme_of(manifest: dict[str, Any], run: Path) -> tuple[Scheme, list[str]]:
    """The scheme the run's records were bucketed by (bucketing.prepared_scheme), with its notes."""
    try:
        return prepared_scheme(manifest, run / "data" / "manifest.json")
    except ConfigError as err:
        raise StatsError(str(err)) from None


def compute_stats(run: Path, progress: bool = True) -> dict[str, Any]:
    """RUN/stats from RUN/data. Stats take no settings: running them again after prepare ran again is
    how they are brought up to date, so only a second writer is refused."""
    with OutputLock(Path(run) / "stats"):
        return _compute_stats(Path(run), progress)


def _compute_stats(run: Path, progress: bool) -> dict[str, Any]:
    started = time.perf_counter()
    manifest, by_split = _load_run(run)
    scheme, scheme_notes = _scheme_of(manifest, run)
    written = (manifest.get("totals") or {}).get("by_split") or {}
    counts = [f"{split} {len(by_split[split])} records (prepare wrote {written[split]})" for split in SPLITS
              if split in written and written[split] != len(by_split[split])]
    edited = edited_records_files(run / "data", manifest)
    if counts or edited:  # edited or cut since: the report describes the files as they are, which it says
        scheme_notes.append(
            f"the records files are not as prepare wrote them ({', '.join(edited) or 'their counts'} changed"
            f"{': ' + ', '.join(counts) if counts else ''}); these statistics describe them as they are now (run "
            "`polyalign prepare` again to start over)")
    records = [r for split in SPLITS for r in by_split[split]]
    train = by_split["train"]

    train_features = [
        text_features(r.response)
        for r in progress_bar(train, progress=progress, desc="features (train)", unit="resp", mininterval=1.0)
    ]
    references = build_references(
        ((r.bucket_id, f) for r, f in zip(train, train_features)), min_bucket_size=scheme.reference_min_bucket_size,
    )

    lengths: dict[str, list[int]] = defaultdict(list)
    for record in records:
        lengths[record.bucket_id].append(record.length_tokens)
    length_quantiles = {
        bucket: {k: v for k, v in summarize(values).items() if k in LENGTH_QUANTILES or k == "count"}
        for bucket, values in sorted(lengths.items())
    }

    train_counts = Counter(r.bucket_id for r in train)
    weights = bucket_weights(train_counts, scheme.weights)
    mean_weight = sum(weights[r.bucket_id] for r in train) / len(train) if train else 0.0

    feature_values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record, features in zip(train, train_features):
        for name in MAIN_FEATURES:
            feature_values[record.bucket_id][name].append(features[name])
    feature_summary = {
        bucket: {name: {k: s[k] for k in ("mean", "std", "q10", "q50", "q90")}
                 for name, s in ((n, summarize(v)) for n, v in values.items())}
        for bucket, values in sorted(feature_values.items())
    }

    bucket_counts = _nested_counts(records, lambda r: r.bucket_id)
    stats = {
        "polyalign_version": polyalign_version(),
        "run": str(run.resolve()),
        "scheme": {**manifest["scheme"], "dimensions": list(scheme.dimensions),
                   "length_bins": [dataclasses.asdict(b) for b in scheme.length_bins]},
        "notes": scheme_notes,
        "total": len(records),
        "counts": {
            "by_split": {s: len(by_split[s]) for s in SPLITS},
            "by_language": _nested_counts(records, lambda r: r.language),
            "by_source": _nested_counts(records, lambda r: r.dataset),
            "by_bucket": bucket_counts,
            "by_style": _nested_counts(records, lambda r: r.style),
            "empty_responses": sum(1 for r in records if r.response == ""),
            # answers with text but no length unit (v2 counts no accented, Cyrillic, kana or Hangul letter)
            "unmeasured_responses": sum(1 for r in records if r.response and not r.length_tokens),
            "system_prompts": _system_prompts(records),
        },
        "length_quantiles": length_quantiles,
        "weights": {
            "split": "train",
            "options": dataclasses.asdict(scheme.weights),
            "warnings": weight_warnings(weights, train_counts, Counter(r.bucket_id for r in by_split["val"]),
                                        Counter(r.bucket_id for r in by_split["test"]), scheme.weights.warn_above),
            "train_counts": dict(sorted(train_counts.items())),
            "by_bucket": {b: round(w, 6) for b, w in sorted(weights.items())},
            "mean_weight_per_record": round(mean_weight, 6),
            "build": _build_weights(run, weights),
        },
        "features": {"set": references["feature_set"], "split": "train", "main": list(MAIN_FEATURES),
                     "by_bucket": feature_summary},
        "references": {"buckets": len(references["buckets"]), "skipped_buckets": references["skipped_buckets"],
                       "min_bucket_size": references["min_bucket_size"]},
    }

    out = run / "stats"
    out.mkdir(parents=True, exist_ok=True)
    references["made_from"] = {"data/manifest.json": file_digest(run / "data" / "manifest.json")}
    (out / "references.json").write_text(json.dumps(references, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    figures = {
        "counts": plots.bucket_counts(bucket_counts, scheme.values["language"], out / "counts.png",
                                      scheme.dimensions.index("language") if "language" in scheme.dimensions else None),
        "lengths": plots.length_histograms(lengths, [b.max for b in scheme.length_bins if b.max], out / "lengths.png"),
        "weights": plots.weights(weights, train_counts, out / "weights.png"),
        "features": plots.feature_boxes(feature_values, MAIN_FEATURES, out / "features.png"),
    }
    stats["figures"] = {name: path.name for name, path in figures.items()}
    stats["timings_s"] = {"total": round(time.perf_counter() - started, 3)}
    (out / "stats.json").write_text(json.dumps(stats, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_markdown(stats, manifest), encoding="utf-8")
    (out / "report.html").write_text(render_html(stats, manifest, out), encoding="utf-8")
    return stats


def _build_weights(run: Path, weights: dict[str, float]) -> dict[str, Any] | None:
    """The weights RUN/build trains with where they are not the scheme's (a build made with `--weights`,
    `--weight-temperature` or `--clip-weights`): its manifest's, and the options it names; else None."""
    build = built_manifest(run) or {}
    made = (build.get("made_from") or {}).get(PREPARE_MANIFEST)
    if made and made != file_digest(run / PREPARE_MANIFEST):  # training refuses it too, until it is built again
        return {"stale": True}
    built = build.get("bucket_weights")
    if not isinstance(built, dict) or all(abs(built.get(b, 0.0) - w) < 1e-6 for b, w in weights.items()):
        return None
    return {"by_bucket": {b: round(float(w), 6) for b, w in sorted(built.items())},
            "options": build.get("weight_options", {})}


def _bucket_rows(stats: dict[str, Any]) -> list[list[str]]:
    rows = []
    weights, build = stats["weights"]["by_bucket"], stats["weights"].get("build")
    columns = [weights] + ([build["by_bucket"]] if build and "by_bucket" in build else [])
    for bucket, counts in stats["counts"]["by_bucket"].items():
        q = stats["length_quantiles"][bucket]
        # no train record, no weight: nothing trains on the bucket (a build lists it at 1 for val_loss_weighted)
        shown = [f"{column.get(bucket, 0.0):.3f}" if counts["train"] else NO_WEIGHT for column in columns]
        rows.append([bucket, *(str(counts[s]) for s in SPLITS), str(counts["total"]),
                     f"{q['q10']:g} / {q['q50']:g} / {q['q90']:g}", *shown])
    return rows


NO_WEIGHT = "-"


def _bucket_header(stats: dict[str, Any]) -> list[str]:
    return BUCKET_HEADER + (["build weight"] if "by_bucket" in (stats["weights"].get("build") or {}) else [])


BUCKET_HEADER = ["bucket", "train", "val", "test", "total", "length q10 / q50 / q90 (all splits)", "SFT weight"]


def _weight_lines(stats: dict[str, Any]) -> list[str]:
    """What the SFT weight column is, and the build's own column where it trains with other weights."""
    weights = stats["weights"]
    options = weights["options"]
    untrained = any(not counts["train"] for counts in stats["counts"]["by_bucket"].values())
    clip = f", clipped to [{options['clip'][0]:g}, {options['clip'][1]:g}]" if options.get("clip") else ""
    borrow = (f" (a bucket under {options['borrow_below']} train records takes its parent group's mean size)"
              if options.get("borrow_below") else "")
    power = f"n^-{options['temperature']:g}"
    lines = [f"SFT weight: the scheme's Bucket-SFT weight of a train record in its bucket, {power}"
             f" over the bucket's train count n{borrow}, scaled to mean 1 over train records{clip}"
             + (f" (mean after clipping {weights['mean_weight_per_record']:.3f})"
                if clip and abs(weights.get("mean_weight_per_record", 1) - 1) >= 5e-4 else "")
             + "; a build made "
             f"with {', '.join(WEIGHT_FLAGS.values())} trains with its own (its manifest, `show`)"
             + (f"; {NO_WEIGHT}: no train records, so nothing trains on the bucket" if untrained else "")]
    build = weights.get("build") or {}
    if build.get("stale"):
        lines.append(f"{BUILD_DIR}/ was made before prepare ran again: its weights are not shown (build it again; "
                     "training refuses it until then)")
    elif build:
        made = build["options"]
        named = ", ".join(f"{key} {made[key]}" for key in WEIGHT_FLAGS if key in made)
        lines.append(f"build weight: what {BUILD_DIR}/ trains with ({named}; {made.get('source', 'its manifest')})")
    return lines


def _language_warnings(by_language: dict[str, dict[str, int]]) -> list[str]:
    """A language training has but validation or the test split lacks: no number of that split covers it
    (the bucket warnings below list its buckets one by one, where a reader may miss that they are all of it)."""
    lines = []
    for language, counts in by_language.items():
        missing = [split for split in ("val", "test") if counts["train"] and not counts[split]]
        if missing:
            lines.append(f"language {language}: {counts['train']} train records and none in "
                         f"{' or '.join(missing)}, so no {' or '.join(missing)} number covers {language} (a source's "
                         "`split:` in the data config, or split.weights, gives it some)")
    return lines


def _source_warnings(manifest: dict[str, Any]) -> list[str]:
    """What prepare said of each source's records that shapes the buckets read here (mojibake: a Chinese
    conversation so broken sits in an English bucket; a declared language the text contradicts), as it said it."""
    lines = []
    for source in manifest["sources"]:
        if line := mojibake_line(source):
            lines.append(line)
        if line := language_mismatch_warning(source.get("language_mismatches", {}), f"source {source['name']!r}",
                                             "its `language:` in the data config"):
            lines.append(f"warning: {line}")
    return lines


def _source_rows(manifest: dict[str, Any]) -> list[list[str]]:
    return [[s["name"], s["format"], str(s["read"]), str(s.get("records", "-")), str(s["kept"]),
             ", ".join(f"{k}: {v}" for k, v in s["dropped"].items()) or "-",
             # records whose conversation carries system messages of its own (a chat export's system prompt),
             # which the build composes with the profile prompt (--system)
             ", ".join(f"{SYSTEM_MESSAGE_NAMES.get(k, k)}: {v}" for k, v in s.get("system_messages", {}).items())
             or "-",
             # what kept rows lost without being dropped (an unanswered last question, an image part)
             ", ".join(f"{_left_out_name(k)}: {v}" for k, v in s.get("left_out", {}).items()) or "-"]
            for s in manifest["sources"]]


SOURCE_HEADER = ["source", "format", "rows read", "records", "kept", "dropped",
                 "records with system messages (as read, before dedup)", "left out of kept rows"]
SYSTEM_MESSAGE_NAMES = {"system_prompt": "an opening system prompt",
                        "system_turn_in_history": "a system message later in the conversation",
                        "system_turn_before_reply": "a system message just before the reply",
                        "system_is_profile_prompt": "polyalign's profile prompt (left out)"}
LEFT_OUT_NAMES = {"unanswered_last_user_turn": "a last user turn no one answered",
                  "reply_before_any_question": "a reply before any question (context only)",
                  "content_part_dropped": "a content part that is no text"}


def _left_out_name(key: str) -> str:
    """A `left_out` key in words, its detail after it (content_part_dropped:image_url)."""
    head, _, detail = key.partition(":")
    return LEFT_OUT_NAMES.get(head, head) + (f" ({detail})" if detail else "")


def _scheme_line(scheme: dict[str, Any]) -> list[str]:
    """The scheme the buckets are made by: its name and file, what a bucket id is made of, and the length
    bins' bounds (stats of an earlier release do not record the last two)."""
    if "dimensions" not in scheme:
        return [f"bucket scheme {scheme.get('name')} ({scheme.get('path')})"]
    bins, bounds = scheme["length_bins"], []
    for k, length_bin in enumerate(bins):
        low = bins[k - 1]["max"] if k else None
        bounds.append(f"{length_bin['name']} " + (f"<= {length_bin['max']}" if length_bin["max"] is not None
                                                  else f"> {low}" if low is not None else "any length"))
    return [f"bucket scheme {scheme['name']} ({scheme['path']}): a bucket is {'|'.join(scheme['dimensions'])}; "
            f"length bins {', '.join(bounds)} ({scheme['length_unit']} units)"]


def _summary_lines(stats: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    counts = stats["counts"]
    near = manifest["dedup"].get("near_duplicates", {})
    lines = [
        *(_scheme_line(stats["scheme"]) or []),
        *(f"note: {note}" for note in stats.get("notes", [])),
        f"{stats['total']} records: " + ", ".join(f"{s} {counts['by_split'][s]}" for s in SPLITS),
        "languages: " + ", ".join(f"{lang} {c['total']}" for lang, c in counts["by_language"].items()),
        f"{len(counts['by_bucket'])} buckets; length unit {stats['scheme']['length_unit']} "
        f"({LENGTH_UNIT_WORDS.get(stats['scheme']['length_unit'], 'see docs/data.md')} counts 1); "
        f"{counted(counts['empty_responses'], 'empty response')} (unanswerable QA)"
        + (f"; {counted(counts['unmeasured_responses'], 'non-empty response')} of length 0 (no letter the "
           f"{stats['scheme']['length_unit']} unit counts: it counts ASCII letters, digits, Chinese characters and "
           "punctuation only; binned with the shortest)" if counts.get("unmeasured_responses") else ""),
        f"exact duplicates removed: {manifest['dedup'].get('exact', {}).get('removed', 'dedup off')}; "
        f"train/test near-duplicates: {near.get('pairs', 'off')}"
        + (f" pairs over {near['train_records']} train records" if near.get("enabled") else ""),
        f"quarantined records: {quarantined_records(manifest)}",
        *_system_prompt_lines(counts.get("system_prompts")),
        *_source_warnings(manifest),
    ]
    lines += _weight_lines(stats)
    lines += [f"warning: {warning}" for warning in _language_warnings(counts["by_language"])]
    lines += [f"warning: {warning}" for warning in stats["weights"]["warnings"]]
    if stats["references"]["skipped_buckets"]:
        lines.append("buckets without a reference (< "
                     f"{stats['references']['min_bucket_size']} train responses): "
                     + ", ".join(stats["references"]["skipped_buckets"]))
    return lines


def render_markdown(stats: dict[str, Any], manifest: dict[str, Any]) -> str:
    parts = [f"# Bucket statistics: {Path(stats['run']).name}", ""]
    parts += [f"- {line}" for line in _summary_lines(stats, manifest)]
    parts += ["", "## Buckets", "", markdown_table(_bucket_header(stats), _bucket_rows(stats)), "",
              "## Sources", "", markdown_table(SOURCE_HEADER, _source_rows(manifest)), "",
              "## Plots", ""]
    parts += [f"![{name}]({file})" for name, file in stats["figures"].items()]
    return "\n".join(parts) + "\n"


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# What each figure of stats["figures"] shows, as its caption says it.
FIGURE_CAPTIONS = {
    "counts": "Records per bucket and split, one panel per language where the scheme has that dimension (the "
              "number: all splits).",
    "lengths": "Human response length per bucket, in the scheme's length units (log scale); dashed lines: the "
               "length bins' bounds.",
    "weights": "The scheme's Bucket-SFT weight per train record in each bucket (scaled to a mean of 1 over train "
               "records, then clipped: the summary gives the mean after clipping; n: the bucket's train records).",
    "features": "Main response features of the train split's human answers per bucket (boxes: quartiles).",
}


def render_html(stats: dict[str, Any], manifest: dict[str, Any], folder: Path) -> str:
    """The report as one self-contained page: the plots (`folder`'s PNGs) inline."""
    summary = "".join(f"<li>{html.escape(line)}</li>" for line in _summary_lines(stats, manifest))
    figures = "".join(  # the caption above its figure, so it does not read as the next one's heading
        f"<figure><figcaption>{html.escape(FIGURE_CAPTIONS.get(name, name))} ({html.escape(file)})</figcaption>"
        f"{plots.embedded_img(folder / file, name)}</figure>"
        for name, file in stats["figures"].items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>polyalign bucket statistics</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; font-family: monospace; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }} figcaption {{ font-weight: 600; margin-bottom: 0.4em; }}
</style></head><body>
<h1>Bucket statistics: {html.escape(Path(stats['run']).name)}</h1>
<ul>{summary}</ul>
<h2>Buckets</h2>{_html_table(_bucket_header(stats), _bucket_rows(stats))}
<h2>Sources</h2>{_html_table(SOURCE_HEADER, _source_rows(manifest))}
<h2>Plots</h2>{figures}
<p><small>polyalign {html.escape(stats['polyalign_version'])}; references: train split only, feature set
{html.escape(stats['features']['set'])}.</small></p>
</body></html>
"""
