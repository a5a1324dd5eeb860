"""Evaluation reports: one run (EVAL/report.html with plots) and side-by-side comparisons of runs
(`polyalign report`)."""

from __future__ import annotations

import html
import json
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from adjustText import adjust_text  # noqa: E402

from polyalign.core import jsonl  # noqa: E402
from polyalign.core.errors import EvaluationError  # noqa: E402
from polyalign.core.outputs import other_stages_folder, same_path, stage_output  # noqa: E402
from polyalign.core.paths import file_digest  # noqa: E402
from polyalign.core.scores import AGGREGATE_PARTS, combined, interval_text  # noqa: E402
from polyalign.core.wording import listed  # noqa: E402
from polyalign.reports.markdown import table as markdown_table  # noqa: E402
from polyalign.reports.no_model import BASELINE_WORDS, ahead_of_the_model  # noqa: E402
from polyalign.reports.plots import embedded_img, filled_bins, saved_figure  # noqa: E402
from polyalign.reports.reading_notes import notes_for_reader  # noqa: E402


@dataclass(frozen=True)
class OverallRow:
    """A row of the overall tables: where metrics.json keeps the model's number, its interval, and the same
    measure of people's own answers to the same prompts (the human floor), where there is one."""

    name: str
    path: tuple[str, ...]
    interval: tuple[str, ...] | None = None
    human: tuple[str, ...] | None = None
    human_interval: tuple[str, ...] | None = None
    optional: bool = False  # shown only where some evaluation measured it


def _diversity_row(name: str, key: str) -> OverallRow:
    side = ("diversity", "overall")
    return OverallRow(name, (*side, "generated", key), (*side, "generated_interval", key), (*side, "human", key),
                      (*side, "human_interval", key))


def _macro_row(name: str, *metric: str, optional: bool = False) -> OverallRow:
    return OverallRow(name, (*metric, "overall_macro"), (*metric, "macro_interval"), (*metric, "floor_macro"),
                      (*metric, "floor_macro_interval"), optional)


NUF_ROW = "NUF hypervolume: the area under the naturalness-utility frontier of the buckets (higher is better)"
# each name says which way is better: a reader of one number should not need the docs for that. HCR's bands hold
# 90% of the reference pool's people by construction; held-out people land on their own floor, the mark here.
HCR_MACRO = "HCR macro (higher is more human-like; people's floor is the mark)"
OVERALL_ROWS = (
    OverallRow("F1 (higher is better)", ("utility", "overall", "qa_f1"), ("utility", "overall", "qa_f1_interval")),
    OverallRow("ROUGE-L (higher is better)", ("utility", "overall", "rouge_l_f1"),
               ("utility", "overall", "rouge_l_f1_interval")),
    OverallRow("EM (higher is better)", ("utility", "overall", "em"), ("utility", "overall", "em_interval")),
    _diversity_row("Distinct-2 (higher is more diverse; people's own is the mark)", "distinct_2"),
    _diversity_row("Self-BLEU-4 (lower is more diverse; people's own is the mark)", "self_bleu_4"),
    _macro_row("BNG macro (lower is more human-like)", "bng"),
    # each bucket by its test rows: judged where a macro is not (buckets too small for a spread of their own)
    OverallRow("BNG weighted by test rows", ("bng", "overall_weighted"), ("bng", "weighted_interval")),
    _macro_row(HCR_MACRO, "hcr"),
    OverallRow("HCR weighted by test rows", ("hcr", "overall_weighted"), ("hcr", "weighted_interval")),
    _macro_row("Detectability AUC macro (0.5: as people)", "detectability"),
    _macro_row("Detectability AUC macro, hidden states (0.5: as people)", "detectability", "hidden_states",
               optional=True),
    OverallRow("MAUVE (higher is closer to people)", ("mauve", "global")),
    OverallRow("TDM (higher is closer to people's turns; saying nothing gets about half: read it against the no-model "
               "answers')", ("tdm", "overall_macro"),
               ("tdm", "macro_interval")),
    OverallRow(NUF_ROW, ("nuf", "overall", "hypervolume"), ("nuf", "overall", "hypervolume_interval")),
    OverallRow("Aggregate", ("aggregate", "overall"), ("aggregate", "interval")),
)
HUMAN_COLUMN = "human floor (people's own answers)"


def _get(metrics: dict, path: Sequence[str]):
    for key in path:
        if not isinstance(metrics, dict) or key not in metrics:
            return None
        metrics = metrics[key]
    return metrics


def _fmt(value) -> str:
    return "—" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))


def _legend_beside(ax) -> None:
    """The legend right of the axes: bars reach every corner of a per-bucket chart, so a legend inside
    would cover one."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _save(fig, path: Path) -> str:
    return saved_figure(fig, path).name


def _embedded(path: Path) -> str:
    return f"<p>{embedded_img(path)}</p>"


def _interval(values) -> str:
    return "—" if not values else interval_text(values)


def _bucket_label(bucket: str, report: dict) -> str:
    return f"{bucket} (n={report['rows']}{', backed off to ' + report['pool'] if report['backed_off'] else ''})"


def _error_bars(values: Sequence[float | None], intervals: Sequence[Sequence[float] | None]) -> np.ndarray:
    """matplotlib's xerr (2 x n lengths below and above each value) from intervals; NaN where a value has
    no interval (a bucket too small for one), which draws no bar and no cap (a zero length drew a cap, as
    if the interval were exact). A percentile interval need not hold its estimate (few draws, or an AUC at a
    tie-heavy edge): the bar then shows the side that does, not a negative length matplotlib refuses."""
    lengths = [[v - i[0], i[1] - v] if v is not None and i else [np.nan, np.nan] for v, i in zip(values, intervals)]
    return np.clip(np.array(lengths, float).reshape(-1, 2).T, 0.0, None)


RUNAWAY = 3.0  # an interval reaching past this many times the largest bar is cut at that edge


def _keep_bars_readable(ax, drawn: Sequence[tuple[float, float | None, Sequence[float] | None]]) -> list[float]:
    """`drawn`: (row, value, interval) of every bar. An interval reaching past RUNAWAY times the largest bar
    (a bucket of a few rows with one far answer: BNG 0.3 [0.1, 9.6]) would squeeze every bar into a sliver:
    the axis then stops there, and each interval cut at the edge says where it ends. The highs cut."""
    values = [v for _, v, _ in drawn if v is not None and np.isfinite(v)]
    edge = RUNAWAY * max(values, default=0.0)
    cut = [(row, i[1]) for row, v, i in drawn if v is not None and i and i[1] is not None and i[1] > edge]
    if edge <= 0 or not cut:
        return []
    ax.set_xlim(min(ax.get_xlim()[0], 0.0), edge)
    for row, high in cut:
        ax.annotate(f"to {high:.3g} \u2192", (edge, row), xytext=(-2, 0), textcoords="offset points", ha="right",
                    va="center", fontsize=7, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    return [high for _, high in cut]


def _metric_by_bucket(buckets: dict[str, dict], metric: str, title: str, path: Path) -> str:
    """One metric per bucket: the model's value with its interval, the human floor with its interval
    beside it, n and back-off in the labels."""
    names = [b for b, r in buckets.items() if r.get(metric) is not None]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.32 * len(names)))
    y = np.arange(len(names))
    drawn = []

    def bars(key, offset, label, color):
        values = [buckets[b].get(key) for b in names]
        shown = [np.nan if v is None else v for v in values]
        intervals = [buckets[b].get(f"{key}_interval") for b in names]
        errors = _error_bars(values, intervals)
        ax.barh(y + offset, shown, height=0.38, xerr=errors, capsize=2, label=label, color=color)
        drawn.extend(zip(y + offset, values, intervals))

    bars(metric, 0.0, "model", "#4C72B0")
    if any(buckets[b].get(f"{metric}_floor") is not None for b in names):
        bars(f"{metric}_floor", 0.4, "human floor", "#999999")
    _keep_bars_readable(ax, drawn)
    ax.set_yticks(y + 0.2, [_bucket_label(b, buckets[b]) for b in names], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(textwrap.fill(title, 90), fontsize=10)  # a long title wraps rather than run off the figure
    _legend_beside(ax)
    return _save(fig, path)


def _bucket_bars(series: dict[str, dict[str, float]], title: str, path: Path,
                 floor: dict[str, float] | None = None, rows: dict[str, int] | None = None,
                 intervals: dict[str, dict[str, Sequence[float]]] | None = None) -> str:
    """Grouped horizontal bars: one group per bucket, one bar per series (run or metric). A bucket a series
    has no number for reads "n/a" (a bar of 0 is a 0); `floor`: people's own value per bucket, a black mark
    across the group; `rows`: test rows per bucket, in the labels (a 3-row bucket's bar is noise);
    `intervals`: per series, each bucket's interval, drawn as error bars (two runs' bars apart by less
    than them are not told apart)."""
    buckets = sorted({b for values in series.values() for b in values})
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.3 * len(buckets) * max(1, len(series)) ** 0.5))
    height = 0.8 / max(1, len(series))
    drawn = []
    for k, (name, values) in enumerate(series.items()):
        y = np.arange(len(buckets)) + k * height
        shown = [values.get(b) for b in buckets]
        spreads = (intervals or {}).get(name, {})
        ax.barh(y, [np.nan if v is None else v for v in shown], height=height, label=name, capsize=2,
                xerr=_error_bars(shown, [spreads.get(b) for b in buckets]) if spreads else None)
        drawn.extend(zip(y, shown, [spreads.get(b) for b in buckets]))
        for row, value in zip(y, shown):
            if value is None:
                ax.text(0, row, " n/a", va="center", fontsize=6, color="#666666")
    if floor:
        label = "people (human floor)"
        for i, bucket in enumerate(buckets):
            if floor.get(bucket) is not None:
                ax.plot([floor[bucket]] * 2, [i - height / 2, i + 0.8 - height / 2], color="black", linewidth=1.5,
                        label=label)
                label = None  # one legend entry
    _keep_bars_readable(ax, drawn + [(i, floor.get(b), None) for i, b in enumerate(buckets)] if floor else drawn)
    labels = [f"{b} (n={rows[b]})" if rows and b in rows else b for b in buckets]
    ax.set_yticks(np.arange(len(buckets)) + 0.4 - height / 2, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title)
    _legend_beside(ax)
    return _save(fig, path)


def _frontier(runs: dict[str, dict], path: Path, label_points: bool = False,
              components: dict[str, dict] | None = None) -> str:
    """The naturalness-utility frontier of each run (`runs`: name -> its NUF overall section);
    `components`: name -> its NUF section, whose naturalness_components name the axis."""
    components = components or {}
    fig, ax = plt.subplots(figsize=(6, 4.5))
    labels = []
    for k, (name, nuf) in enumerate(runs.items()):
        color = f"C{k}"  # a run's points and its frontier in one colour
        points = nuf.get("points", {})
        if points:
            ax.scatter([p["utility"] for p in points.values()], [p["naturalness"] for p in points.values()], s=14,
                       alpha=0.5, color=color)
        if label_points:
            labels += [ax.text(p["utility"], p["naturalness"], bucket, fontsize=5, alpha=0.8)
                       for bucket, p in points.items()]
        front = sorted(nuf.get("frontier") or [])
        if front:
            # the edge of the area the frontier dominates (its hypervolume): from the naturalness axis across
            # and down each step to the utility axis, so that a one-point frontier draws its box too
            edge = [(0.0, front[0][1])]
            for i, (x, y) in enumerate(front):
                edge += [(x, y)] + ([(x, front[i + 1][1])] if i + 1 < len(front) else [(x, 0.0)])
            ax.plot(*zip(*edge), color=color, label=f"{name} (HV {_fmt(nuf.get('hypervolume'))})")
    ax.set_xlabel("utility (F1, higher is better)")
    # the naturalness axis: 1/(1 + BNG), with C-MAUVE beside it (geometric mean) where a featurizer ran;
    # a bucket too small for C-MAUVE has 1/(1 + BNG) alone
    axes = sorted({" x ".join(nuf.get("naturalness_components") or ["1/(1+BNG)"]) for nuf in components.values()})
    ax.set_ylabel("naturalness (higher is more human-like)\n" + " or ".join(axes)
                  + (", geometric mean" if any(" x " in a for a in axes) else ""), fontsize=8)
    # axes from 0 to a little past the farthest point: small F1s on a fixed 0-1 axis crowd into its corner
    xs = [p["utility"] for nuf in runs.values() for p in (nuf.get("points") or {}).values()] or [1.0]
    ys = [p["naturalness"] for nuf in runs.values() for p in (nuf.get("points") or {}).values()] or [1.0]
    ax.set_xlim(0, min(1.0, max(max(xs) * 1.15, 0.05)))
    ax.set_ylim(0, min(1.0, max(max(ys) * 1.15, 0.05)))
    ax.set_title("Naturalness-utility frontier (one point per bucket)")
    if ax.get_legend_handles_labels()[0]:  # runs without a frontier have nothing to name
        ax.legend(fontsize=7)
    if labels:  # buckets of like F1 and naturalness crowd together: their names moved apart, a line to each point
        adjust_text(labels, x=xs, y=ys, ax=ax, iter_lim=300, arrowprops={"arrowstyle": "-", "color": "grey", "lw": 0.3})
    return _save(fig, path)


def _length_distributions(human_lengths, generated_lengths, buckets, path: Path, tokenize: str = "cjk",
                          limit: int = 12) -> str:
    """Answer lengths of people and the model in the largest buckets, counted as the metrics count them
    (`tokenize`: evaluate's --tokenize), not in a model's tokens or the scheme's length units."""
    names = [b for b, _ in sorted(((b, buckets.count(b)) for b in set(buckets)), key=lambda x: -x[1])][:limit]
    cols = 3
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(10, 2.2 * rows), squeeze=False)
    for ax, bucket in zip(axes.flat, names):
        idx = [i for i, b in enumerate(buckets) if b == bucket]
        h = [human_lengths[i] for i in idx]
        g = [generated_lengths[i] for i in idx]
        top = max(h + g + [1])
        bins = np.linspace(0, top, 20)
        filled_bins(ax, h, bins, alpha=0.6, label="human", color="C0")
        filled_bins(ax, g, bins, alpha=0.6, label="model", color="C1")
        ax.set_title(bucket, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"Answer length in the metrics' words ({tokenize}: "
                 f"{'a word or a Chinese character each' if tokenize == 'cjk' else 'words split on spaces'}), "
                 "people vs model, largest buckets", fontsize=10)
    return _save(fig, path)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> tuple[str, str]:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>", markdown_table(header, rows)


def _page(title: str, sections: list[str]) -> str:
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}img{max-width:100%}"
             # a long cell (the features farthest from people) wraps at its spaces instead of widening the
             # page; a number is never split
             "td{max-width:22em;overflow-wrap:break-word}"
             ".sample{border-left:3px solid #ccc;padding:2px 8px;margin:6px 0;font-size:13px}")
    return f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>" \
           f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>"


def _settings(result: dict) -> str:
    c, a = result["config"], result["alignment"]
    partial = "" if not a["partial"] else (
        f" <b>Partial: the {a['evaluated']} records `{html.escape(a['selected_by'])}` answered.</b>"
        if a.get("selected_by") else " <b>Partial: only the intersection of records and predictions was evaluated.</b>")
    empty = result.get("answers", {}).get("empty", 0)
    kept = result.get("answers", {}).get("in_diversity")
    empty_note = (f" <b>{empty} of {a['evaluated']} answers are empty</b>: scored as answers by F1 and BNG, "
                  + ("kept in Distinct-n and Self-BLEU as the authors' code keeps them (--compat reference)."
                     if kept else "left out of Distinct-n and Self-BLEU (as are people's empty answers).")
                  if empty else "")
    mauve = result["metrics"]["mauve"]
    mauve_note = "".join(f" ({html.escape(mauve[key])})" for key in ("note", "featurizer_note") if mauve.get(key))
    return (f"<p>models {html.escape(', '.join(c['models']))}; profile {html.escape(', '.join(c['profile']))}; "
            f"{a['evaluated']} of {a['records']} test rows; compat {c['compat']}; MAUVE "
            f"{html.escape(str(mauve['status']))}{mauve_note}.{partial}{empty_note}</p>"
            + "".join(_note_html(text, warns) for text, warns in notes_for_reader(result)))


def _note_html(text: str, warns: bool, sentence: bool = True) -> str:
    """A reading note as a paragraph, bold where it warns; `sentence`: it opens one (capitalised), not with a
    run's name (kept as the user wrote it)."""
    text = html.escape(text[0].upper() + text[1:] if sentence else text)
    return f"<p><b>{text}.</b></p>" if warns else f"<p>{text}.</p>"


def _runs_notes(runs: dict[str, dict]) -> list[tuple[str, bool]]:
    """Each run's reading notes named by run; one every run has word for word (the runs read the same rows)
    is said once, for all of them."""
    per_run = {name: notes_for_reader(r) for name, r in runs.items()}
    shared = [note for note in next(iter(per_run.values()), []) if all(note in notes for notes in per_run.values())]
    everyone = [(f"Every run: {text}", warns) for text, warns in shared] if len(runs) > 1 else []
    return everyone + [(f"{name}: {text}", warns) for name, notes in per_run.items() for text, warns in notes
                       if len(runs) == 1 or (text, warns) not in shared]


# Which reason (metrics.json's `not_available`) explains a missing number of the overall table.
REASON_OF = {"utility": "utility", "bng": "bng", "hcr": "hcr", "mauve": "mauve", "tdm": "tdm",
             "aggregate": "aggregate", "detectability": "detectability", "nuf": "nuf"}


def _with_interval(metrics: dict, path: Sequence[str] | None, interval: Sequence[str] | None) -> str | None:
    """A number and its interval where one was measured ("0.0354 [0.025, 0.049]"); None where no number."""
    value = _get(metrics, path) if path else None
    if value is None:
        return None
    return _spread(value, _get(metrics, interval) if interval else None)


def _backed_off(section: dict) -> str:
    """The buckets whose support was too small to stand alone, said apart from the buckets with too few test
    rows for an interval (another set)."""
    count = len(section.get("backed_off", []))
    if not count:
        return "no bucket measured against a parent group"
    return (f"{count} bucket{'s' * (count != 1)} with too few human answers of {'its' if count == 1 else 'their'} "
            f"own measured against {'its' if count == 1 else 'their'} parent group")


def _human_cell(runs: Sequence[dict], row: OverallRow, names: Sequence[str]) -> str:
    """The human floor of a row: one number where every run measured people alike (the same test rows),
    each run's otherwise."""
    cells = [_with_interval(r["metrics"], row.human, row.human_interval) for r in runs]
    if all(c is None for c in cells):
        return "—"
    shared = _same_in_every_run(cells)
    return shared if shared is not None else "; ".join(f"{name}: {cell or '—'}" for name, cell in zip(names, cells))


def _same_in_every_run(values: Sequence[Any]) -> Any:
    """The value every run has alike (one human floor, one row count stands for all of them), else None."""
    return values[0] if values and all(v == values[0] for v in values) else None


def _shown_rows(runs: Sequence[dict]) -> list[OverallRow]:
    return [row for row in OVERALL_ROWS if not row.optional or any(_get(r["metrics"], row.path) is not None
                                                                    for r in runs)]


def _overall_value(result: dict, row: OverallRow) -> str:
    """A number of the overall table with its interval, or n/a with the reason it is missing."""
    path = row.path
    value = _with_interval(result["metrics"], path, row.interval)
    if value is not None:
        return value
    if path[0] == "diversity":
        reason = _get(result["metrics"], ("diversity", "overall", "generated_reason")) or (
            "skipped (--no-diversity)" if result["metrics"]["diversity"].get("status") == "skipped" else None)
    else:
        reason = result.get("not_available", {}).get(REASON_OF.get(path[0], ""))
    return f"n/a ({reason})" if reason else "—"


def _spread(value, interval, small: bool = False) -> str:
    """A number and its interval in one cell ("2.4101 [2.357, 2.480]"), as the overall table shows them;
    `small`: the bucket has too few rows for an interval (TOO_FEW_MARK, said under the table)."""
    if value is None:
        return "—"
    return _fmt(value) + (f" {_interval(interval)}" if interval else TOO_FEW_MARK if small else "")


TOO_FEW_MARK = " *"


def _model_row(name: str, m: dict, unfloored: Sequence[str]) -> tuple[str, ...]:
    """A run's answers in the table of people and no-model answers, measured as they are; `unfloored`: the
    reference rows' keys of the numbers without a human floor that the table shows."""
    detect = m.get("detectability") or {}
    return (name, _spread(m["bng"]["overall_macro"], m["bng"].get("macro_interval")),
            _spread(m["hcr"]["overall_macro"], m["hcr"].get("macro_interval")),
            _spread(detect.get("overall_macro"), detect.get("macro_interval")),
            _spread(m["utility"]["overall"].get("qa_f1"), m["utility"]["overall"].get("qa_f1_interval")),
            *(_spread(_get(m, value), interval and _get(m, interval))
              for value, interval in (UNFLOORED_OF_MODEL[key] for key in unfloored)))


# the numbers without a human floor (people score 1 against themselves), by reference-row key
UNFLOORED_COLUMNS = {"mauve": "MAUVE", "tdm_macro": "TDM", "nuf_hypervolume": "NUF hypervolume",
                     "aggregate": "aggregate"}
# where a model's metrics.json keeps those numbers, and their intervals (MAUVE has none)
UNFLOORED_OF_MODEL = {"mauve": (("mauve", "global"), None),
                      "tdm_macro": (("tdm", "overall_macro"), ("tdm", "macro_interval")),
                      "nuf_hypervolume": (("nuf", "overall", "hypervolume"),
                                          ("nuf", "overall", "hypervolume_interval")),
                      "aggregate": (("aggregate", "overall"), ("aggregate", "interval"))}


def _reference_rows(m: dict, models: Sequence[tuple[str, dict]] | None = None) -> tuple[str, str]:
    """People and the no-model answers, measured as the model is; `models`: (name, metrics) of several
    runs of these test rows (a comparison), instead of this one's. TDM, the NUF hypervolume and the
    aggregate have no human floor (people score 1 against themselves): the no-model answers are what
    they are read against."""
    # no featurizer: a MAUVE column of dashes says nothing
    unfloored = [key for key in UNFLOORED_COLUMNS if key != "mauve" or m["mauve"].get("status") == "computed"]
    rows = [_model_row(name, metrics, unfloored) for name, metrics in (models or [("model", m)])]
    for name, row in m.get("reference_rows", {}).items():
        rows.append((name, *(_spread(row.get(key), row.get(f"{key}_interval"))
                              for key in ("bng_macro", "hcr_macro", "detectability_macro", "f1")),
                     *(_spread(row.get(key), row.get(f"{key}_interval")) for key in unfloored)))
    return _table(["answers", "BNG macro (lower is more human-like)", HCR_MACRO,
                   "detectability AUC macro (people near 0.5)", "F1",
                   *(UNFLOORED_COLUMNS[key] for key in unfloored)], rows)


def _behind_no_model(models: Sequence[tuple[str, dict]]) -> str:
    """A bold paragraph for each model that answers which need no model do better than (reports/no_model.py;
    `models`: (name, metrics), the name left out for a single run's report): the head of its section."""
    said = [(name, ahead_of_the_model(metrics)) for name, metrics in models]
    return "".join(f"<p><b>{html.escape(f'{name}: ' if name else '')}{html.escape(text[0].upper() + text[1:])}.</b></p>"
                   for name, text in said if text)


def _bng_at_or_below_people(m: dict) -> str:
    """A no-model answer that BNG ranks at or below people's own: BNG reads response features (length,
    punctuation, word shapes), which repeating the prompt can match; the other numbers tell it apart."""
    references = m.get("reference_rows") or {}
    people = references.get("human") or {}
    floor = people.get("bng_macro")
    notes = []
    for name, row in references.items():
        if name == "human" or floor is None or row.get("bng_macro") is None or row["bng_macro"] > floor:
            continue
        detect = ("" if row.get("detectability_macro") is None else
                  f"; detectability {_fmt(row['detectability_macro'])} (people "
                  f"{_fmt(people.get('detectability_macro'))}) tells it from people's answers")
        notes.append(f"{name}, a no-model answer, scores BNG {_fmt(row['bng_macro'])}, at or below people's own "
                     f"{_fmt(floor)}: BNG reads the features of an answer (its length, punctuation, word shapes), "
                     f"which repeating the prompt can match{detect}. Read BNG beside the other numbers.")
    return "".join(f"<p>{html.escape(note)}</p>" for note in notes)


DIVERSITY_COLUMNS = (("distinct_1", "Distinct-1"), ("distinct_2", "Distinct-2"), ("distinct_3", "Distinct-3"),
                     ("self_bleu_4", "Self-BLEU-4 (lower is more diverse)"))


def _diversity_table(overall: dict) -> tuple[str, str]:
    """People's answers and the model's side by side, each number with its interval where measured."""
    rows = []
    for side, name in (("human", "people"), ("generated", "model")):
        intervals = overall.get(f"{side}_interval") or {}
        rows.append((name, *(_spread(overall[side][key], intervals.get(key)) for key, _ in DIVERSITY_COLUMNS)))
    return _table(["answers", *(label for _, label in DIVERSITY_COLUMNS)], rows)


def _bucket_table(buckets: dict[str, dict], detect: dict[str, dict]) -> tuple[str, str]:
    """Per bucket: BNG, HCR and detectability (`detect`: its per-bucket reports), each with its interval
    and human floor; a bucket too small for intervals carries TOO_FEW_MARK."""
    rows = []
    for bucket, r in buckets.items():
        d = detect.get(bucket, {})
        support = (r["pool"] + (" (backed off)" if r["backed_off"] else "")
                   + f", {r['pool_rows']} answers, bands: {r['bands']}")
        small = bool(r.get("too_small"))
        rows.append((bucket, str(r["rows"]), support, _spread(r.get("bng"), r.get("bng_interval"), small),
                     _fmt(r.get("bng_floor")), _fmt(r.get("bng_gap")) if r.get("bng_gap") is not None else
                     TOO_FEW_MARK.strip() if small else "—",
                     _spread(r.get("hcr"), r.get("hcr_interval"), small)
                     + (" (above people: too uniform)" if r.get("hcr_above_people") else ""),
                     _fmt(r.get("hcr_floor")),
                     # a small bucket's classifier reads its parent group's answers too (detectability.MIN_PROMPTS)
                     _spread(d.get("auc"), d.get("auc_interval"), small)
                     + (f" (within {d['pool']})" if d.get("backed_off") else ""),
                     _fmt(d.get("auc_floor")), _fmt(r.get("f1")),
                     ", ".join(f"{k} {v:.2f}" for k, v in (r.get("farthest_features") or {}).items())))
    return _table(["bucket", "rows", "support", "BNG [interval]", "BNG human floor", "BNG gap", "HCR [interval]",
                   "HCR human floor", "detectability AUC [interval]", "AUC human floor", "F1",
                   "features farthest from people (W1 / people's std; docs/evaluation.md, Response features)"], rows)


def _samples(samples: dict[str, list[dict]]) -> str:
    parts = []
    for bucket, rows in samples.items():
        parts.append(f"<h3>{html.escape(bucket)}</h3>")
        for row in rows:
            parts.append("<div class='sample'><b>prompt</b> " + html.escape(_excerpt(row["question"], 300))
                         + "<br><b>human</b> " + html.escape(_excerpt(row["human"], 600)) + "<br><b>model</b> "
                         + html.escape(_excerpt(row["model"], 600)) + "</div>")
    return "".join(parts)


def _excerpt(text: str, limit: int) -> str:
    """`text` whole, or its first `limit` characters ending at a space where one is near (English words stay
    whole; Chinese has none to find) and an ellipsis that says the rest is left out."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit - 40 else cut).rstrip() + " …"


def write_evaluation_report(result: dict, human_lengths: Sequence[int], generated_lengths: Sequence[int],
                            buckets: Sequence[str], out: Path, samples: dict[str, list[dict]] | None = None) -> Path:
    """OUT/report.html of one evaluation, self-contained (images inline; the PNGs are kept beside it);
    the lengths (in evaluation tokens) are per row, as `buckets`."""
    m = result["metrics"]
    table, _ = _table(["metric", "value [interval]", HUMAN_COLUMN],
                      [(row.name, _overall_value(result, row), _human_cell([result], row, ["this run"]))
                       for row in _shown_rows([result])])
    sections = [_settings(result), "<h2>Overall</h2>", table]
    images = []
    if m.get("buckets"):
        reference_html, _ = _reference_rows(m)
        detect = m.get("detectability") or {}
        bucket_html, _ = _bucket_table(m["buckets"], detect.get("reports", {}))
        bng = m["bng"]
        summary = (f"<p>BNG {_fmt(bng['overall_macro'])} {_interval(bng.get('macro_interval'))} against a human "
                   f"floor of {_fmt(bng.get('floor_macro'))}: the model's answers are {_fmt(bng.get('gap_macro'))} "
                   "farther from the people of their buckets than people's own answers to the same prompts (macro "
                   f"over {bng['buckets']} buckets, {bng['rows']} rows; {_backed_off(bng)}). Intervals: bootstrap "
                   "over responses, "
                   f"{result['config'].get('intervals', {}).get('draws', '?')} draws. "
                   + (f"{len(bng['small_buckets'])} "
                      f"{'bucket has' if len(bng['small_buckets']) == 1 else 'buckets have'} "
                      f"fewer than {bng.get('min_interval_rows')} test rows "
                      f"({', '.join(bng['small_buckets'])}): no interval or gap of their own, and each still counts "
                      "as much as any other in the macro (the rows column says what each carries)."
                      if bng.get("small_buckets") else "") + "</p>")
        above = m["hcr"].get("above_people") or []
        if above:
            summary += (f"<p>HCR lies above people's own in {len(above)} bucket{'s' * (len(above) != 1)} "
                        f"({html.escape(', '.join(above))}): the answers sit at the typical values more often than "
                        "people's do, which is too uniform, not more human (a typical answer repeated passes every "
                        f"time); BNG{' and detectability' if detect.get('status') == 'computed' else ''} there "
                        "say how far they are.</p>")
        if detect.get("status") == "computed":
            summary += (f"<p>Detectability {_fmt(detect['overall_macro'])} {_interval(detect.get('macro_interval'))}: "
                        "the ROC AUC of a classifier (character n-grams, logistic regression, folds grouped by "
                        "prompt) telling the model's answers from people's answers to the same prompts, against "
                        f"{_fmt(detect.get('floor_macro'))} {_interval(detect.get('floor_macro_interval'))} for "
                        "people against other people" + (
                            f" (the mean of {detect['floor_halvings']} random halvings of the people; one halving "
                            f"alone ranged {_fmt(detect['floor_macro_spread'][0])} to "
                            f"{_fmt(detect['floor_macro_spread'][1])})" if detect.get("floor_macro_spread") else "")
                        + (f", over the {detect['floor_buckets']} of {detect['buckets']} buckets with more than one "
                           f"answer, where the model reads {_fmt(detect.get('macro_floored'))}"
                           if detect.get("floor_buckets") and detect["floor_buckets"] < detect["buckets"] else "")
                        + " (0.5: it cannot tell; 1.0: it always can). It reads none "
                        "of the features behind BNG, HCR and the critic, so training cannot move it by matching "
                        "those.</p>")
        small_note = (f"<p>{TOO_FEW_MARK.strip()} fewer than {bng.get('min_interval_rows')} test rows: no interval "
                      "or gap.</p>" if bng.get("small_buckets") else "")
        sections += ["<h2>Against people and no-model answers</h2>", _behind_no_model([("", m)]), summary,
                     reference_html, _bng_at_or_below_people(m),
                     "<h2>Per bucket</h2>", bucket_html, small_note]
    if m["diversity"].get("overall"):
        diversity_html, _ = _diversity_table(m["diversity"]["overall"])
        measured = any(key.endswith("_interval") for key in m["diversity"]["overall"])
        sections += ["<h2>Diversity</h2>", diversity_html,
                     "<p>Intervals: Distinct-n by the grouped jackknife (20 groups), Self-BLEU by bootstrap over its "
                     "candidates.</p>" if measured else "<p>No intervals (--compat reference computes none).</p>"]
    if m.get("buckets"):  # the default mode's per-bucket reports, with floors and intervals
        images += [_metric_by_bucket(m["buckets"], "bng", "BNG per bucket (lower is more human-like)", out / "bng.png"),
                   _metric_by_bucket(m["buckets"], "hcr", "Calibrated HCR per bucket (higher is more human-like, "
                                     "up to the grey bar: the test's own people; the people the bands come from "
                                     f"land near {m['hcr'].get('coverage', 0.9):g} by construction)", out / "hcr.png"),
                   _metric_by_bucket(m["buckets"], "f1", "F1 per bucket (higher is better)", out / "f1.png")]
        if (m.get("detectability") or {}).get("reports"):
            images.append(_metric_by_bucket(m["detectability"]["reports"], "auc",
                                            "Detectability: classifier AUC, model vs people (0.5: cannot tell)",
                                            out / "detectability.png"))
    else:  # --compat reference: the per-bucket values, without floors or intervals
        per_bucket = {"F1": {b: v["qa_f1"] for b, v in m["utility"]["by_bucket"].items()},
                      "BNG": m["bng"]["by_bucket"], "HCR": m["hcr"]["by_bucket"], "C-MAUVE": m["mauve"]["by_bucket"]}
        images.append(_bucket_bars({k: v for k, v in per_bucket.items() if v}, "Per bucket", out / "buckets.png"))
    images += [_length_distributions(human_lengths, generated_lengths, buckets, out / "lengths.png",
                                     result["config"].get("tokenize") or "cjk"),
               _frontier({"run": m["nuf"]["overall"]}, out / "frontier.png", label_points=True,
                         components={"run": m["nuf"]})]
    sections += [_embedded(out / i) for i in images]
    if samples:
        sections += ["<h2>Sample answers beside a human one</h2>", _samples(samples)]
    path = out / "report.html"
    path.write_text(_page("polyalign evaluation", sections), encoding="utf-8")
    return path


def _separated(a: dict, b: dict, path: Sequence[str]) -> str:
    """Whether two runs' intervals of one number are apart (a difference the resampling supports) or
    overlap (it may be the test sample's noise)."""
    first, second = _get(a, path), _get(b, path)
    if not first or not second:
        return "no interval"
    return "apart" if first[1] < second[0] or second[1] < first[0] else "overlap"


@dataclass(frozen=True)
class IntervalRow:
    """A number of the differences table: where its value and interval are, and whether it is a macro
    over buckets (one that counts a few-row bucket as much as any other)."""

    name: str
    value: tuple[str, ...]
    interval: tuple[str, ...]
    macro: bool = False
    support: bool = False  # measured against the human support (BNG, HCR); the others read the test rows alone
    mauve_fixed: bool = False  # combines MAUVE, whose interval holds MAUVE at its estimate
    people: tuple[str, ...] | None = None  # people's own value, the mark (diversity): a move is toward or away


INTERVAL_ROWS = (
    IntervalRow("BNG macro", ("bng", "overall_macro"), ("bng", "macro_interval"), macro=True, support=True),
    IntervalRow("BNG weighted", ("bng", "overall_weighted"), ("bng", "weighted_interval"), support=True),
    IntervalRow("HCR macro", ("hcr", "overall_macro"), ("hcr", "macro_interval"), macro=True, support=True),
    IntervalRow("HCR weighted", ("hcr", "overall_weighted"), ("hcr", "weighted_interval"), support=True),
    IntervalRow("Detectability AUC macro", ("detectability", "overall_macro"), ("detectability", "macro_interval"),
                macro=True),
    # judged where the macro is not (a bucket of a few rows weighs by its rows here), as BNG's and HCR's are
    IntervalRow("Detectability AUC weighted", ("detectability", "overall_weighted"),
                ("detectability", "weighted_interval")),
    IntervalRow("F1", ("utility", "overall", "qa_f1"), ("utility", "overall", "qa_f1_interval")),
    IntervalRow("Distinct-2 (people's own is the mark)", ("diversity", "overall", "generated", "distinct_2"),
                ("diversity", "overall", "generated_interval", "distinct_2"),
                people=("diversity", "overall", "human", "distinct_2")),
    IntervalRow("Self-BLEU-4 (people's own is the mark)", ("diversity", "overall", "generated", "self_bleu_4"),
                ("diversity", "overall", "generated_interval", "self_bleu_4"),
                people=("diversity", "overall", "human", "self_bleu_4")),
    # TDM measures buckets of 20 rows or more only: never a few-row bucket without spread
    IntervalRow("TDM macro", ("tdm", "overall_macro"), ("tdm", "macro_interval")),
    IntervalRow("NUF hypervolume", ("nuf", "overall", "hypervolume"), ("nuf", "overall", "hypervolume_interval"),
                macro=True, support=True, mauve_fixed=True),
    IntervalRow("Aggregate", ("aggregate", "overall"), ("aggregate", "interval"), macro=True, support=True,
                mauve_fixed=True),
)
NOT_JUDGED = "not judged †"
NOT_JUDGED_MAUVE = "not judged ‡"


# Which way each judged number is better; the diversity rows read against people's own (the table says which
# way a move went) and are left out of the short reading.
HIGHER_IS_BETTER = {"BNG macro": False, "BNG weighted": False, "HCR macro": True, "HCR weighted": True,
                    "Detectability AUC macro": False, "Detectability AUC weighted": False, "F1": True,
                    "TDM macro": True, "NUF hypervolume": True, "Aggregate": True}


def featurizer_in_lineage(runs: dict[str, dict]) -> str | None:
    """The runs of a comparison whose MAUVE featurizer was their own model or one they were trained from
    (metrics.json's mauve.featurizer_note), as a sentence: its hidden states read their answers kindly, so
    MAUVE, hidden-state detectability and the aggregate favour them. None for a single run (its own report
    says it) or where no run's was."""
    own = [name for name, r in runs.items() if (r["metrics"].get("mauve") or {}).get("featurizer_note")]
    if not own or len(runs) < 2:
        return None
    its = "its" if len(own) == 1 else "their"
    return (f"{listed(own)} {'was' if len(own) == 1 else 'were'} measured with {its} own model or a model of {its} "
            "lineage as the MAUVE featurizer")


def in_short(runs: dict[str, dict], verdicts: dict[str, dict]) -> list[str]:
    """The comparison's reading in a few sentences, first on the page: which run the intervals put ahead of
    which and on what (or that they put none ahead), and the runs that answers needing no model do better
    than. A reader met a 20-row settings table first and ranked the runs by the aggregate, whose every
    difference was not judged."""
    names = list(runs)
    ahead: dict[tuple[str, str], list[str]] = {}
    for i, earlier in enumerate(names):
        for later in names[i + 1:]:
            for number, judged in verdicts.get(f"{later} - {earlier}", {}).items():
                if judged["verdict"] != "apart" or number not in HIGHER_IS_BETTER or judged["difference"] is None:
                    continue
                up = (judged["difference"] > 0) == HIGHER_IS_BETTER[number]
                ahead.setdefault((later, earlier) if up else (earlier, later), []).append(number)
    said = []
    if len(runs) > 1 and ahead:
        said.append("The intervals put " + "; ".join(f"{better} ahead of {worse} on {listed(numbers)}"
                                                     for (better, worse), numbers in ahead.items())
                    + "; every other difference overlaps or is not judged (Which differences the intervals support)")
    elif len(runs) > 1:
        said.append("The intervals put no run ahead of another: every difference overlaps or is not judged (Which "
                    "differences the intervals support)")
    behind = [name for name, run in runs.items() if ahead_of_the_model(run["metrics"])]
    if behind:
        who = ("Every run is" if len(behind) == len(runs) > 1 else
               f"{listed(behind)} {'is' if len(behind) == 1 else 'are'}")
        said.append(f"{who} behind answers that need no model (copying the question, say) on the aggregate or BNG: "
                    "not yet better than they are (Against people and no-model answers)")
    if own := featurizer_in_lineage(runs):
        said.append(f"MAUVE, hidden-state detectability and the aggregate favour some runs: {own}")
    return said


def _small_buckets(run: dict) -> list[str]:
    """The buckets with too few test rows for an interval of their own (the same for every macro)."""
    return (run["metrics"].get("bng") or {}).get("small_buckets") or []


def _data_of(run: dict, name: str) -> str | None:
    """The identity of an input file of an evaluation: its digest where recorded, else its path."""
    return (run.get("made_from") or {}).get(name) or run["config"].get(name)


def other_data(first: dict, run: dict) -> list[str]:
    """What makes two evaluations' numbers not comparable as the models' alone: other test records (another
    file, or other rows of it: an `--allow-partial` evaluation of a part), or another human support (the
    floors and distances are measured against it)."""
    records = (_data_of(first, "records"), _evaluated_rows(first)) != (_data_of(run, "records"), _evaluated_rows(run))
    return ["test records"] * records + ["support"] * (_data_of(first, "support") != _data_of(run, "support"))


def _evaluated_rows(run: dict) -> str:
    """Which rows of its records file an evaluation read: all, or the part a partial one names."""
    alignment = run.get("alignment") or {}
    if not alignment.get("partial"):
        return "all"
    # older partial evaluations did not name their rows: their count tells most apart
    return alignment.get("evaluated_ids") or f"{alignment.get('evaluated')} rows"


def _differences(runs: dict[str, dict], allow_different_data: bool) -> tuple[str, str, dict[str, dict]]:
    """Every pair of runs (the later minus the earlier) on the numbers that carry intervals: the
    difference, and whether the two intervals are apart or overlap. A macro is not judged where either
    run has buckets too small for intervals (they count fully in it and carry no spread: its interval
    understates the noise); the weighted value is. Between evaluations of other test records or another
    support the intervals are not compared unless `allow_different_data`: apart intervals there say
    nothing about the models. Returns the table (HTML, Markdown) and the verdicts by pair and number."""
    names = list(runs)
    rows, verdicts = [], {}
    for i, earlier in enumerate(names):
        for later in names[i + 1:]:
            a, b = runs[earlier], runs[later]
            small = bool(_small_buckets(a) or _small_buckets(b))
            mauve = _measured_mauve(a) or _measured_mauve(b)
            cells, pair = [], {}
            for row in INTERVAL_ROWS:
                differs = [d for d in other_data(a, b) if row.support or d != "support"]
                x, y = _get(a["metrics"], row.value), _get(b["metrics"], row.value)
                difference = None if x is None or y is None else y - x
                verdict = _separated(a["metrics"], b["metrics"], row.interval)
                if differs and not allow_different_data:
                    verdict = f"not compared: other {' and '.join(differs)}"
                elif row.macro and small and verdict != "no interval":
                    verdict = NOT_JUDGED
                elif row.mauve_fixed and mauve and verdict != "no interval":
                    verdict = NOT_JUDGED_MAUVE
                elif differs:
                    verdict += f" (other {' and '.join(differs)})"
                pair[row.name] = {"difference": difference, "verdict": verdict}
                toward = _toward_people(row, a["metrics"], b["metrics"], x, y) + _few_worded(row, a, b)
                silent = " §" if _wordless(a) or _wordless(b) else ""
                cells.append("—" if difference is None else f"{difference:+.4f} {verdict}{toward}{silent}")
            verdicts[f"{later} - {earlier}"] = pair
            rows.append((f"{later} - {earlier}", *cells))
    html_table, markdown = _table(["runs", *(row.name for row in INTERVAL_ROWS)], rows)
    return html_table, markdown, verdicts


def _toward_people(row: IntervalRow, a: dict, b: dict, x: float | None, y: float | None) -> str:
    """For a number whose mark is people's own value (diversity): whether the later run moved toward it or
    away, where both runs measured people alike; a higher Distinct-2 than people's is no better."""
    if row.people is None or x is None or y is None or x == y:
        return ""
    mark = _get(a, row.people)
    if mark is None or mark != _get(b, row.people):
        return ""
    if (x - mark) * (y - mark) < 0:  # crossed it: as far past on the other side is no nearer to people
        side = "above" if y > mark else "below"
        return f", past people's {mark:.4f} ({abs(y - mark):.4f} {side} it, from {abs(x - mark):.4f} on the other side)"
    return f", {'toward' if abs(y - mark) < abs(x - mark) else 'away from'} people's {mark:.4f}"


# Diversity reads only answers with a word; where a run kept fewer than this share of its answers, a
# difference says on how many it rests (a model that answers little looks diverse on what it says).
FEW_WORDED_SHARE = 0.75


def _worded(run: dict) -> tuple[int, int] | None:
    """(answers with a word, answers) of a run, as its alignment and diversity section count them (empty
    and punctuation-only answers hold none); None where either is not recorded."""
    evaluated = (run.get("alignment") or {}).get("evaluated")
    empty = _get(run["metrics"], ("diversity", "overall", "generated_empty"))
    if not isinstance(evaluated, int) or not isinstance(empty, int) or not evaluated:
        return None
    return evaluated - empty, evaluated


def _few_worded(row: IntervalRow, a: dict, b: dict) -> str:
    """For a diversity number: on how many answers with a word each run measured it, where either kept
    fewer than FEW_WORDED_SHARE of its answers (empty and punctuation-only ones are left out)."""
    if row.people is None:
        return ""
    kept = [_worded(a), _worded(b)]
    if None in kept or all(worded >= FEW_WORDED_SHARE * total for worded, total in kept):
        return ""
    (first, first_total), (second, second_total) = kept
    return f", on {first} of {first_total} and {second} of {second_total} answers with a word"


# A run of which at least this share of answers hold no word is said to measure silence.
WORDLESS_SHARE = 0.5


def _wordless(run: dict) -> tuple[int, int] | None:
    """(answers without a word, answers) where at least WORDLESS_SHARE of a run's answers hold no word
    (empty or punctuation only), else None: its naturalness numbers then measure silence against people,
    and a BNG below another model's says the other is farther from people, not that this one is near."""
    if (counts := _worded(run)) is None:
        return None
    worded, evaluated = counts
    return (evaluated - worded, evaluated) if evaluated - worded >= WORDLESS_SHARE * evaluated else None


def same_answers(runs: dict[str, dict]) -> list[list[str]]:
    """Groups of runs that evaluated the same predictions (their recorded digests are equal)."""
    groups: dict[str, list[str]] = {}
    for name, run in runs.items():
        digest = (run.get("made_from") or {}).get("predictions")
        if digest:
            groups.setdefault(digest, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _measured_mauve(run: dict) -> bool:
    return _get(run["metrics"], ("mauve", "status")) == "computed"


def _plain(paragraph: str) -> str:
    """A <p> of this module's, as Markdown text."""
    text = re.sub(r"</?b>", "**", re.sub(r"</p>\s*<p>", "\n\n", paragraph))
    return html.unescape(re.sub(r"</?p>", "", text))


def _differences_note(runs: dict[str, dict]) -> str:
    """What the differences table's words mean, and which buckets keep a macro from being judged."""
    levels = {(r["config"].get("intervals") or {}).get("level") for r in runs.values()} - {None}
    level = f"{next(iter(levels)):.0%} " if len(levels) == 1 else ""
    text = (f"Each cell: the later run's number minus the earlier's, and how their {level}bootstrap intervals lie: "
            "apart (they do not overlap: a difference the resampling of the test answers supports) or overlap "
            "(it may be the test sample's noise; overlapping intervals do not show the runs equal). "
            "Macros count every bucket once; weighted numbers weigh each by its test rows.")
    if any(_measured_mauve(r) for r in runs.values()):
        text += (" ‡ not judged: MAUVE is part of the NUF hypervolume and the aggregate, and their intervals hold "
                 "it at its estimate (a MAUVE is a clustering, too costly to redo for every bootstrap draw), so "
                 "they leave MAUVE's own noise out.")
    small = {name: _small_buckets(r) for name, r in runs.items() if _small_buckets(r)}
    if small:
        shared = _same_in_every_run(list(small.values())) if len(small) == len(runs) else None
        which = (", ".join(shared) if shared is not None else
                 "; ".join(f"{name}: {', '.join(b)}" for name, b in small.items()))
        rows = next(iter(runs.values()))["metrics"]["bng"].get("min_interval_rows")
        text += (f" † not judged: the macros count buckets with fewer than {rows} test rows ({which}) as fully as "
                 "any other, and their few answers carry no spread of their own, so a macro's interval understates "
                 "its noise; the weighted columns weigh those buckets by their rows.")
    silent = {name: found for name, r in runs.items() if (found := _wordless(r))}
    if silent:
        which = "; ".join(f"{name}: {k} of {n} answers" for name, (k, n) in silent.items())
        text += (f" § a run whose answers mostly hold no word ({which}): its numbers measure silence against "
                 "people, and a BNG, HCR or detectability better than another run's there says how far the other "
                 "is from people, not that this one is near them (each evaluation's report gives the empty "
                 "answer's own numbers among the answers that need no model).")
    return f"<p>{html.escape(text)}</p>"


COMPARISON_RECORD = "comparison.json"


def compare(evals: Sequence[Path], out: Path, names: Sequence[str] | None = None,
            overwrite: bool = False, allow_different_data: bool = False) -> dict[str, Any]:
    """Side-by-side report of several EVAL folders: CMP/report.html, report.md and PNGs, with the
    folders compared recorded in CMP/comparison.json. A comparison of other folders is not replaced
    unless `overwrite`. Intervals are compared only between evaluations of the same test records and
    support, unless `allow_different_data`."""
    out = Path(out)
    own_input = any(same_path(out, directory) for directory in evals)  # stage_output names that case itself
    if not own_input and (elsewhere := other_stages_folder(out, "the comparison", "comparison",
                                                            also=(("metrics.json", "an evaluation"),))):
        raise EvaluationError(elsewhere)
    settings = {"evals": [str(Path(d).resolve()) for d in evals], "names": list(names) if names else None,
                "allow_different_data": allow_different_data}
    with stage_output(out, out / COMPARISON_RECORD, settings, overwrite, ours=[out / "report.html"],
                      inputs={f"evaluation {i + 1}": directory for i, directory in enumerate(evals)}):
        summary = _compare(evals, out, names, allow_different_data)
        (out / COMPARISON_RECORD).write_text(json.dumps(
            {"settings": settings, "made_from": {str(Path(d) / "metrics.json"): file_digest(Path(d) / "metrics.json")
                                                 for d in evals}, "summary": summary}, indent=2) + "\n")
    return summary


def _shared_floor(runs: dict[str, dict], metric: str) -> dict[str, float] | None:
    """People's own value per bucket, where every run measured it alike (the same test rows and support);
    None otherwise: one mark could not stand for several floors."""
    return _same_in_every_run([(r["metrics"].get(metric) or {}).get("floor_by_bucket") for r in runs.values()]) or None


def _bucket_intervals(runs: dict[str, dict], metric: str) -> dict[str, dict[str, Sequence[float]]]:
    """Each run's per-bucket intervals of a metric (none in evaluations made with --compat reference)."""
    return {n: (r["metrics"].get(metric) or {}).get("interval_by_bucket") or {} for n, r in runs.items()}


def _shared_rows(runs: dict[str, dict]) -> dict[str, int] | None:
    """Test rows per bucket where every run evaluated the same number."""
    return _same_in_every_run([{b: v.get("rows") for b, v in r["metrics"]["utility"]["by_bucket"].items()}
                               for r in runs.values()])


AGGREGATE_PART_NAMES = {"f1": "F1", "bng": "BNG", "mauve": "MAUVE", "nuf": "NUF"}
AGGREGATE_NOTE = ("Aggregate (higher is better): the geometric mean of the parts measured, each on [0, 1] with "
                  "higher better: clip(F1), 1/(1 + BNG macro), MAUVE and the NUF hypervolume; a comparison takes the "
                  "parts every run measured alike. One number for a ranking; the rows above say why. F1 and the "
                  "NUF hypervolume reward agreeing with the reference answer's words, so answers that copy people's "
                  "(even in the wrong language, or with one runaway answer) can rank high here while BNG, HCR "
                  "and detectability call them less human-like: read those for human-likeness.")


def _nuf_axes(runs: dict[str, dict]) -> list[str] | None:
    """Each run's NUF naturalness axis where the runs measured it otherwise, else None: it takes C-MAUVE
    beside 1/(1+BNG) where there is a featurizer, so two hypervolumes of one name are not one measure."""
    axes = [" + ".join(_get(r["metrics"], ("nuf", "naturalness_components")) or ["?"]) for r in runs.values()]
    return None if _same_in_every_run(axes) is not None else axes


def _aggregate_row(runs: dict[str, dict]) -> tuple[str, ...]:
    """The aggregate of each run over the parts every run measured alike: an evaluation with a
    featurizer (MAUVE, and C-MAUVE inside NUF) and one without would otherwise be compared on different
    means. Evaluations written before the parts were recorded show their own aggregate."""
    parts = [_get(r["metrics"], ("aggregate", "parts")) for r in runs.values()]
    if any(p is None for p in parts):
        return ("Aggregate", *(_fmt(_get(r["metrics"], ("aggregate", "overall"))) for r in runs.values()))
    common = [name for name in AGGREGATE_PARTS if all(p.get(name) is not None for p in parts)]
    if _nuf_axes(runs) is not None and "nuf" in common:
        common.remove("nuf")
    measured = [[name for name in AGGREGATE_PARTS if p.get(name) is not None] for p in parts]
    if all(m == common for m in measured):  # each run's own aggregate, with its interval
        return ("Aggregate", *(_spread(_get(r["metrics"], ("aggregate", "overall")),
                                       _get(r["metrics"], ("aggregate", "interval"))) for r in runs.values()))
    # recombined over fewer parts: its draws were not kept, so no interval
    label = f"Aggregate over {', '.join(AGGREGATE_PART_NAMES[n] for n in common)} (the parts every run measured alike)"
    return (label, *(_fmt(combined(p, common)) for p in parts))


def run_names(evals: Sequence[Path]) -> list[str]:
    """A column name per EVAL folder: its name, or as many of its last path parts as tell it from the
    others (runs/a/eval and runs/b/eval: a/eval and b/eval). One folder given twice is refused, since
    its column would silently stand for both."""
    resolved = [Path(d).resolve() for d in evals]
    twice = sorted({str(d) for d in resolved if resolved.count(d) > 1})
    if twice:
        raise EvaluationError(f"{twice[0]}: given more than once; compare each evaluation once")
    depth = [1] * len(resolved)
    while True:
        names = ["/".join(d.parts[-k:]) for d, k in zip(resolved, depth)]
        clashing = [i for i, name in enumerate(names) if names.count(name) > 1]
        if not clashing:
            return names
        for i in clashing:
            depth[i] += 1


EVALUATION_SECTIONS = ("config", "alignment", "metrics")


def read_evaluation(path: Path) -> dict[str, Any]:
    """An EVAL folder's metrics.json, or one line saying why it is none: missing, damaged (not strict
    JSON: a NaN written by hand would pass into the comparison), or not an evaluation's."""
    if not path.parent.exists():  # a mistyped folder is not an evaluation still to run
        raise EvaluationError(f"{path.parent}: no such folder; give the folders `polyalign evaluate --out` wrote")
    if not path.is_file():
        raise EvaluationError(f"{path}: missing; run `polyalign evaluate` first")
    try:
        run = jsonl.parse(path.read_text(encoding="utf-8"))
    except (jsonl.JsonProblem, UnicodeDecodeError) as problem:
        raise EvaluationError(f"{path}: damaged, not JSON ({problem}); run `polyalign evaluate` again") from None
    missing = [key for key in EVALUATION_SECTIONS if not isinstance(run, dict) or not isinstance(run.get(key), dict)]
    if missing:
        raise EvaluationError(f"{path}: not a polyalign evaluation (no {', '.join(missing)} section); run "
                              "`polyalign evaluate` again")
    return run


def _compare(evals: Sequence[Path], out: Path, names: Sequence[str] | None,
             allow_different_data: bool) -> dict[str, Any]:
    names = list(names or run_names(evals))
    # people's answers and the no-model answers have rows of their own beside the runs: a run of one of
    # their names read as two rows of that name
    if taken := [name for name in names if name in {"human", "people", *BASELINE_WORDS}]:
        raise EvaluationError(f"a run named {taken[0]!r}, a name the report gives a row of its own (people's answers, "
                              f"and the no-model answers {', '.join(BASELINE_WORDS)}): name the runs with --names")
    runs = {}
    for name, directory in zip(names, evals):
        runs[name] = read_evaluation(Path(directory) / "metrics.json")
    header = ["metric (value [interval])", *runs, HUMAN_COLUMN]
    # a number no run has says why in each cell, as one evaluation's report does ("n/a (no bucket holds 20
    # multi-turn rows)"), not a bare dash
    rows = [(row.name, *(_overall_value(r, row) for r in runs.values()),
             _human_cell(list(runs.values()), row, list(runs))) for row in _shown_rows(list(runs.values()))
            if row.name != "Aggregate"]
    axes = _nuf_axes(runs)
    if axes is not None:  # each hypervolume says its naturalness axis
        rows = [(name, *(f"{cell} (naturalness: {axis})" if cell != "—" and not cell.startswith("n/a") else cell
                         for cell, axis in zip(cells, axes)), human) if name == NUF_ROW else
                (name, *cells, human) for name, *cells, human in rows]
    rows.append((*_aggregate_row(runs), "—"))
    settings_rows = [("test rows", *(f"{r['alignment']['evaluated']}" + _partial_words(r["alignment"])
                                     for r in runs.values())),
                     # empty answers: scored by F1 and BNG, left out of (or, compat reference, kept in) diversity
                     ("empty answers", *(_empty_words(r.get("answers") or {}) for r in runs.values())),
                     ("featurizer", *("/".join(Path(r["config"]["featurizer"]).parts[-2:])
                                      if r["config"].get("featurizer") else "none" for r in runs.values())),
                     ("profile", *(", ".join(r["config"]["profile"]) for r in runs.values())),
                     ("decoding", *(decoding_text(r["config"].get("decoding")) for r in runs.values())),
                     ("compat", *(r["config"]["compat"] for r in runs.values())),
                     ("MAUVE", *(str(r["metrics"]["mauve"]["status"])
                                 + (" (noisy: few answers)" if r["metrics"]["mauve"].get("note") else "")
                                 + (f" (featurizer: {_featurizer_relation(r)})"
                                    if r["metrics"]["mauve"].get("featurizer_note") else "")
                                 for r in runs.values()))]
    models = differing_models(runs)
    settings_rows += [(f"model: {name}", *values) for name, values in models.items()]
    differing = differing_settings(runs)
    unequal = bool(differing)
    table_html, table_md = _table(header, rows)
    settings_html, settings_md = _table(["setting", *runs], settings_rows)
    differences_html, differences_md, verdicts = _differences(runs, allow_different_data)
    differences_note = _differences_note(runs)
    first = next(iter(runs.values()))
    other = [name for name, run in list(runs.items())[1:] if other_data(first, run)]
    rows = _shared_rows(runs)
    images = [
        _bucket_bars({n: {b: v["qa_f1"] for b, v in r["metrics"]["utility"]["by_bucket"].items()}
                      for n, r in runs.items()}, "F1 per bucket", out / "f1_by_bucket.png", rows=rows,
                     intervals={n: {b: v["f1_interval"] for b, v in (r["metrics"].get("buckets") or {}).items()
                                    if v.get("f1_interval")} for n, r in runs.items()}),
        _bucket_bars({n: r["metrics"]["bng"]["by_bucket"] for n, r in runs.items()},
                     "BNG per bucket (lower is more human-like)", out / "bng_by_bucket.png",
                     _shared_floor(runs, "bng"), rows, _bucket_intervals(runs, "bng")),
        _bucket_bars({n: r["metrics"]["hcr"]["by_bucket"] for n, r in runs.items()},
                     "HCR per bucket (higher is more human-like)", out / "hcr_by_bucket.png",
                     _shared_floor(runs, "hcr"), rows, _bucket_intervals(runs, "hcr")),
        _bucket_bars({n: (r["metrics"].get("detectability") or {}).get("by_bucket", {}) for n, r in runs.items()},
                     "Detectability AUC per bucket (0.5: as people; lower is more human-like)",
                     out / "detectability_by_bucket.png", _shared_floor(runs, "detectability"), rows,
                     _bucket_intervals(runs, "detectability")),
        _frontier({n: r["metrics"]["nuf"]["overall"] for n, r in runs.items()}, out / "frontier.png",
                  components={n: r["metrics"]["nuf"] for n, r in runs.items()}),
    ]
    # what stands under the settings, the same paragraphs in report.html and report.md
    cautions = ([f"<p><b>The runs differ in {html.escape('; '.join(differing))}; compare with care.</b></p>"]
                if unequal else [])
    # what sets the models apart in training (the comparison's point, not a caution): said beside the settings
    # settings two known models differ in ("—": a model polyalign did not train, or a setting it has not)
    trained_apart = [f"{name} ({' | '.join(values)})" for name, values in models.items()
                     if len(set(values) - {"—"}) > 1]
    if trained_apart:
        cautions.append(f"<p>The models were trained differently: {html.escape('; '.join(trained_apart))}.</p>")
    for names in same_answers(runs):
        cautions.append(f"<p><b>{html.escape(' and '.join(names))} evaluated the same answers</b> (one predictions "
                        "file's contents): what differs between them is the evaluation's settings, not a model.</p>")
    own = featurizer_in_lineage(runs)
    if own:
        cautions.append(f"<p><b>{html.escape(own)}</b>, which reads its own answers kindly (and those of models "
                        "trained from it): MAUVE, hidden-state detectability and the aggregate do not compare fairly "
                        "here; a separate checkpoint as --featurizer does.</p>")
    single = _runs_notes(runs)
    # notes every run shares stand with the settings; each run's own come after the overall table, so five
    # runs' notes do not push the numbers down a page (the bold ones are pointed to from here)
    shared = [(text, warns) for text, warns in single if text.startswith("Every run: ")] if len(runs) > 1 else single
    own_notes = [note for note in single if note not in shared]
    warned = list(dict.fromkeys(text.split(": ", 1)[0] for text, warns in own_notes if warns))
    cautions += [_note_html(text, warns, sentence=False) for text, warns in shared]
    if warned:
        has = "has a warning" if len(warned) == 1 else "have warnings"
        cautions.append(f"<p><b>{html.escape(', '.join(warned))} {has}</b> under Notes on each run, below the overall "
                        "table.</p>")
    run_notes = ["<h2>Notes on each run</h2>", "".join(_note_html(text, warns, sentence=False)
                                                        for text, warns in own_notes)] if own_notes else []
    small = {name: _small_buckets(r) for name, r in runs.items() if _small_buckets(r)}
    overall_note = AGGREGATE_NOTE + (
        f" Macros count every bucket once, the ones with fewer than "
        f"{first['metrics']['bng'].get('min_interval_rows')} test rows too "
        f"({'; '.join(f'{n}: {len(b)}' for n, b in small.items())}), whose few answers carry no spread of their "
        "own: those macros' intervals understate their noise (the differences below do not judge them)."
        if small else "")
    aggregate_note = f"<p>{html.escape(overall_note)}</p>"
    answers = []  # people and the no-model answers beside the runs, where all of them share those test rows
    if not other and all(r["metrics"].get("buckets") for r in runs.values()):
        answers_html, answers_md = _reference_rows(first["metrics"], [(n, r["metrics"]) for n, r in runs.items()])
        lead = _behind_no_model([(n, r["metrics"]) for n, r in runs.items()])
        notes = _bng_at_or_below_people(first["metrics"])
        answers = [("<h2>Against people and no-model answers</h2>", lead + answers_html + notes),
                   ("## Against people and no-model answers",
                    (_plain(lead) + "\n\n" if lead else "") + answers_md + "\n" + _plain(notes))]
    else:  # no shared table of no-model answers: a run behind them is still told so, with the settings
        cautions.append(_behind_no_model([(n, r["metrics"]) for n, r in runs.items()]))
    short = in_short(runs, verdicts)
    short_html = ("<h2>In short</h2><ul>" + "".join(f"<li>{html.escape(line)}.</li>" for line in short) + "</ul>"
                  if short else "")
    sections = ([short_html, "<h2>Settings</h2>", settings_html, *cautions, "<h2>Overall</h2>", table_html,
                 aggregate_note,
                 *run_notes, *(answers[0] if answers else ()),
                 "<h2>Which differences the intervals support</h2>", differences_note, differences_html]
                + [_embedded(out / i) for i in images])
    (out / "report.html").write_text(_page("polyalign comparison", sections), encoding="utf-8")
    short_md = ["## In short", "".join(f"- {line}.\n" for line in short)] if short else []
    markdown = ["# polyalign comparison", *short_md, "## Settings", settings_md,
                *(_plain(caution) for caution in cautions if caution),
                "## Overall", table_md, overall_note,
                *(["## Notes on each run", *(f"**{text}.**" if warns else f"{text}." for text, warns in own_notes)]
                  if own_notes else []),
                *(answers[1] if answers else ()),
                "## Which differences the intervals support", _plain(differences_note), differences_md,
                "".join(f"![{i}]({i})\n" for i in images)]
    (out / "report.md").write_text("\n\n".join(part.strip("\n") for part in markdown) + "\n", encoding="utf-8")
    return {"runs": list(runs), "unequal_settings": unequal, "differing": differing, "other_data": other,
            "models_differ_in": trained_apart, "in_short": short,
            "intervals_compared_across_data": allow_different_data, "differences": verdicts, "out": str(out)}


def _empty_words(answers: dict) -> str:
    """"3 (2 where people's is empty too); 18 of punctuation alone": a model's empty answers, how many of them
    answer people who said nothing either, and its answers with text but no word ("，，，，", which the
    row read 0 beside)."""
    empty, as_people = answers.get("empty", 0), answers.get("empty_as_people", 0)
    wordless = answers.get("without_words", 0)
    return (f"{empty}" + (f" ({as_people} where people's is empty too)" if as_people else "")
            + (f"; {wordless} of punctuation alone" if wordless else ""))


def _partial_words(alignment: dict) -> str:
    """" of 2842 (...)": which part of the test records a partial evaluation read; nothing for a whole one."""
    if not alignment.get("partial"):
        return ""
    if alignment.get("common_with"):
        return f" of {alignment['records']} (the ones all {alignment['common_with']} predictions files answer once)"
    chosen = alignment.get("selected_by")
    said = [f"the ones `{chosen}` {'chose' if 'chosen' in alignment else 'answered'}"] if chosen else []
    faults = [f"{alignment[key]} {word}" for key, word in (("missing", "without an answer"),
                                                          ("duplicate", "answered twice differently"))
              if alignment.get(key) and not (chosen and "chosen" not in alignment and key == "missing")]
    said += [f"partial: {', '.join(faults)}" if faults else "partial: the ones with predictions"] \
        if faults or not chosen else []
    return f" of {alignment['records']} ({'; '.join(said)})"


def differing_models(runs: dict[str, dict]) -> dict[str, list[str]]:
    """How the models behind the runs were trained (metrics.json's config.trained, read from each training
    run's config.json): the method, and every setting that differs between them, with each run's value
    ("—" where a run's model has no such setting, was not trained by polyalign, or its run folder is gone)."""
    trained = [r["config"].get("trained") or {} for r in runs.values()]
    if not any(len(t) > 1 for t in trained):
        return {}
    names = [name for name in dict.fromkeys(k for t in trained for k in t) if name not in ("checkpoint", "settings")]
    named = {name: _cells([t.get(name, "—") for t in trained]) for name in names
             if name == "method" or len({json.dumps(t.get(name), default=str) for t in trained}) > 1}
    # the other settings, by key (train.seed): one only some methods have, or that an older evaluation did not
    # record, differs where the runs that have it differ
    others = [t.get("settings") or {} for t in trained]
    for key in dict.fromkeys(k for o in others for k in o):
        if len({json.dumps(o[key], default=str) for o in others if key in o}) > 1:
            named[key] = _cells([o.get(key, "—") for o in others])
    return named


def _cells(values: list[Any]) -> list[str]:
    """A setting's values as table cells: numbers as written; paths by their last two parts, or as many
    more as tell different paths apart (two lineages' round-1/model are hdpo/round-1/model and
    dpo/round-1/model)."""
    paths = {value for value in values if isinstance(value, str) and "/" in value}
    values = [value if isinstance(value, str | int | float) else json.dumps(value, default=str) for value in values]
    depth = 2
    while depth < max((len(Path(p).parts) for p in paths), default=0) and \
            len({"/".join(Path(p).parts[-depth:]) for p in paths}) < len(paths):
        depth += 1
    return ["/".join(Path(value).parts[-depth:]) if value in paths else
            f"{value:g}" if isinstance(value, float) else str(value) for value in values]


def _featurizer_relation(run: dict) -> str:
    """How a run's MAUVE featurizer stands to its model (evaluations before the lineage was read: itself)."""
    return run["metrics"]["mauve"].get("featurizer_relation", "the model itself")


def decoding_text(decoding: dict | None) -> str:
    """How the answers were decoded, in a cell: greedy or the sampling settings, with any penalty; what
    `generate` recorded (metrics.json's config.decoding)."""
    if not decoding:
        return "not recorded (answers not from polyalign generate)"
    # evaluate keeps the penalties and min_p only where they ask for something (decoding_of)
    penalties = [f"{key} {value:g}" for key, value in decoding.items()
                 if key not in ("max_new_tokens", "max_prompt_tokens", "temperature", "top_p", "top_k", "prompts_cut",
                                "prompts", "dtype")]
    said = ["greedy"] if not decoding.get("temperature") else [
        f"{key} {decoding[key]:g}" for key in ("temperature", "top_p", "top_k") if key in decoding]
    # the budgets: a prompt cut shorter, or an answer stopped sooner, is another condition for the same model
    cut = (f" ({decoding['prompts_cut']} of {decoding['prompts']} were longer)" if "prompts_cut" in decoding else "")
    budgets = ([f"prompts cut to {decoding['max_prompt_tokens']} tokens{cut}"] if "max_prompt_tokens" in decoding
               else []) + ([f"answers up to {decoding['max_new_tokens']} tokens" if decoding["max_new_tokens"] != "auto"
                            else "answers up to their bucket's budget"] if "max_new_tokens" in decoding else [])
    computed = [f"computed in {decoding['dtype']}"] if "dtype" in decoding else []
    return ", ".join(said + penalties + budgets + computed)



def differing_settings(runs: dict[str, dict]) -> list[str]:
    """Each setting the evaluations do not share, named with its value in each run (in run order,
    separated by |): what a reader must know before reading a difference as the models'."""
    def input_file(name, absent):
        def value(run):
            path, digest = run["config"].get(name), (run.get("made_from") or {}).get(name)
            return absent if path is None else f"{Path(path).name} ({(digest or 'sha256:?')[7:15]})"
        return value

    checks = [
        ("test rows", lambda r: r["alignment"]["evaluated"]),
        ("profile mode", lambda r: ", ".join(r["config"]["profile"])),
        ("compat", lambda r: r["config"]["compat"]),
        ("test records", input_file("records", "?")),
        ("support", input_file("support", "the test records' own answers")),
        ("references", input_file("references", "none")),
        ("intervals", lambda r: "none" if not r["config"].get("intervals") else
         f"{r['config']['intervals']['draws']} draws, seed {r['config']['intervals']['seed']}"),
        ("MAUVE", lambda r: r["metrics"]["mauve"]["status"]),
        # greedy answers against sampled ones differ by the decoding as much as by the model
        ("decoding", lambda r: decoding_text(r["config"].get("decoding"))),
        # MAUVE, C-MAUVE and hidden-state detectability read this model's hidden states: another featurizer,
        # another measure
        ("featurizer", lambda r: r["config"].get("featurizer") or "none"),
    ]
    out = []
    for name, value_of in checks:
        values = [str(value_of(r)) for r in runs.values()]
        if len(set(values)) > 1:
            out.append(f"{name}: {' | '.join(values)}")
    return out
