"""Evaluation reports: one run (EVAL/report.html with plots) and side-by-side comparisons of runs
(`polyalign report`)."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from polyalign.errors import EvaluationError  # noqa: E402

OVERALL_ROWS = (
    ("F1", ("utility", "overall", "qa_f1")),
    ("ROUGE-L", ("utility", "overall", "rouge_l_f1")),
    ("EM", ("utility", "overall", "em")),
    ("Distinct-2 (generated)", ("diversity", "overall", "generated", "distinct_2")),
    ("Self-BLEU-4 (generated)", ("diversity", "overall", "generated", "self_bleu_4")),
    ("BNG macro (lower is better)", ("bng", "overall_macro")),
    ("HCR macro", ("hcr", "overall_macro")),
    ("MAUVE", ("mauve", "global")),
    ("TDM", ("tdm", "overall_macro")),
    ("NUF hypervolume", ("nuf", "overall", "hypervolume")),
    ("Aggregate", ("aggregate", "overall")),
)


def _get(metrics: dict, path: Sequence[str]):
    for key in path:
        if not isinstance(metrics, dict) or key not in metrics:
            return None
        metrics = metrics[key]
    return metrics


def _fmt(value) -> str:
    return "—" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _bucket_bars(series: dict[str, dict[str, float]], title: str, path: Path) -> str:
    """Grouped horizontal bars: one group per bucket, one bar per series (run or metric)."""
    buckets = sorted({b for values in series.values() for b in values})
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.3 * len(buckets) * max(1, len(series)) ** 0.5))
    height = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        y = np.arange(len(buckets)) + k * height
        ax.barh(y, [values.get(b, np.nan) for b in buckets], height=height, label=name)
    ax.set_yticks(np.arange(len(buckets)) + 0.4 - height / 2, buckets, fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _frontier(runs: dict[str, dict], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, nuf in runs.items():
        points = list(nuf.get("points", {}).values())
        if points:
            ax.scatter([p["utility"] for p in points], [p["naturalness"] for p in points], s=14, alpha=0.5)
        front = nuf.get("frontier") or []
        if front:
            ax.step([p[0] for p in front], [p[1] for p in front], where="post",
                    label=f"{name} (HV {_fmt(nuf.get('hypervolume'))})")
    ax.set_xlabel("utility (F1)")
    ax.set_ylabel("naturalness")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("Naturalness-utility frontier (one point per bucket)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _length_distributions(human_lengths, generated_lengths, buckets, path: Path, limit: int = 12) -> str:
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
        ax.hist(h, bins=bins, alpha=0.6, label="human")
        ax.hist(g, bins=bins, alpha=0.6, label="model")
        ax.set_title(bucket, fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("Response length (tokens), human vs model, largest buckets")
    return _save(fig, path)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> tuple[str, str]:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    markdown = "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n" + \
        "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"
    return f"<table><tr>{head}</tr>{body}</table>", markdown


def _page(title: str, sections: list[str]) -> str:
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}img{max-width:100%}")
    return f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style>" \
           f"</head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>"


def _settings(result: dict) -> str:
    c, a = result["config"], result["alignment"]
    partial = " <b>Partial: only the intersection of records and predictions was evaluated.</b>" if a["partial"] else ""
    return (f"<p>models {html.escape(', '.join(c['models']))}; profile {html.escape(', '.join(c['profile']))}; "
            f"{a['evaluated']} of {a['records']} test rows; compat {c['compat']}; MAUVE "
            f"{html.escape(str(result['metrics']['mauve']['status']))}.{partial}</p>")


def write_evaluation_report(result: dict, human_lengths: Sequence[int], generated_lengths: Sequence[int],
                            buckets: Sequence[str], out: Path) -> Path:
    """OUT/report.html of one evaluation; the lengths (in evaluation tokens) are per row, as `buckets`."""
    m = result["metrics"]
    table, _ = _table(["metric", "value"], [(name, _fmt(_get(m, path))) for name, path in OVERALL_ROWS])
    per_bucket = {"F1": {b: v["qa_f1"] for b, v in m["utility"]["by_bucket"].items()},
                  "BNG": m["bng"]["by_bucket"], "HCR": m["hcr"]["by_bucket"], "C-MAUVE": m["mauve"]["by_bucket"]}
    images = [_bucket_bars({k: v for k, v in per_bucket.items() if v}, "Per bucket", out / "buckets.png"),
              _length_distributions(human_lengths, generated_lengths, buckets, out / "lengths.png"),
              _frontier({"run": m["nuf"]["overall"]}, out / "frontier.png")]
    sections = [_settings(result), "<h2>Overall</h2>", table] + [f"<p><img src='{i}'></p>" for i in images]
    path = out / "report.html"
    path.write_text(_page("polyalign evaluation", sections), encoding="utf-8")
    return path


def compare(evals: Sequence[Path], out: Path, names: Sequence[str] | None = None) -> dict[str, Any]:
    """Side-by-side report of several EVAL folders: CMP/report.html, report.md and PNGs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for i, directory in enumerate(evals):
        path = Path(directory) / "metrics.json"
        if not path.is_file():
            raise EvaluationError(f"{path}: missing; run `polyalign evaluate` first")
        runs[names[i] if names else Path(directory).name] = json.loads(path.read_text())
    header = ["metric", *runs]
    rows = [(name, *(_fmt(_get(r["metrics"], p)) for r in runs.values())) for name, p in OVERALL_ROWS]
    settings_rows = [("test rows", *(str(r["alignment"]["evaluated"]) for r in runs.values())),
                     ("profile", *(", ".join(r["config"]["profile"]) for r in runs.values())),
                     ("compat", *(r["config"]["compat"] for r in runs.values())),
                     ("MAUVE", *(str(r["metrics"]["mauve"]["status"]) for r in runs.values()))]
    unequal = len({(r["alignment"]["evaluated"], tuple(r["config"]["profile"])) for r in runs.values()}) > 1
    table_html, table_md = _table(header, rows)
    settings_html, settings_md = _table(["setting", *runs], settings_rows)
    images = [
        _bucket_bars({n: {b: v["qa_f1"] for b, v in r["metrics"]["utility"]["by_bucket"].items()}
                      for n, r in runs.items()}, "F1 per bucket", out / "f1_by_bucket.png"),
        _bucket_bars({n: r["metrics"]["bng"]["by_bucket"] for n, r in runs.items()},
                     "BNG per bucket (lower is more human-like)", out / "bng_by_bucket.png"),
        _bucket_bars({n: r["metrics"]["hcr"]["by_bucket"] for n, r in runs.items()}, "HCR per bucket",
                     out / "hcr_by_bucket.png"),
        _frontier({n: r["metrics"]["nuf"]["overall"] for n, r in runs.items()}, out / "frontier.png"),
    ]
    warning = "<p><b>The runs differ in test size or profile mode; compare with care.</b></p>" if unequal else ""
    sections = ["<h2>Settings</h2>", settings_html, warning, "<h2>Overall</h2>", table_html] + \
        [f"<p><img src='{i}'></p>" for i in images]
    (out / "report.html").write_text(_page("polyalign comparison", sections), encoding="utf-8")
    (out / "report.md").write_text("# polyalign comparison\n\n" + settings_md + "\n" + table_md + "\n" +
                                   "".join(f"![{i}]({i})\n" for i in images), encoding="utf-8")
    return {"runs": list(runs), "unequal_settings": unequal, "out": str(out)}
