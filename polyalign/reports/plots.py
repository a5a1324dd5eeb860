"""PNG plots for the bucket statistics report (matplotlib, no display needed)."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

SPLIT_COLORS = {"train": "#4C72B0", "val": "#DD8452", "test": "#55A868"}


def embedded_img(path: Path, alt: str | None = None) -> str:
    """An <img> carrying its PNG inline, so that a report.html is one self-contained file (mailed or
    copied alone, it keeps its plots); the PNG stays beside it."""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f"<img alt='{html.escape(alt or Path(path).name)}' src='data:image/png;base64,{data}'>"


def filled_bins(ax, values: Sequence[float], edges: Sequence[float], **style) -> None:
    """A histogram of `values` over `edges` as one filled outline: it looks as `ax.hist`'s bars do, and is
    one artist instead of a rectangle per bin, which a report of dozens of panels draws several times faster."""
    counts, _ = np.histogram(values, bins=edges)
    ax.stairs(counts, edges, fill=True, **style)


def saved_figure(fig, path: Path) -> Path:
    """`fig` laid out, written to `path` as PNG and closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bucket_counts(counts: Mapping[str, Mapping[str, int]], languages: Sequence[str], path: Path,
                  position: int | None = 0) -> Path:
    """Stacked horizontal bars of records per bucket and split, one panel per language: the part of the
    bucket id at `position` (where the scheme lists language among its dimensions); one panel of every
    bucket for a scheme without a language dimension (None)."""
    def panel_of(bucket: str) -> str:
        return "all buckets" if position is None else bucket.split("|")[position]

    panels = ([lang for lang in languages if any(panel_of(b) == lang for b in counts)] if position is not None
              else ["all buckets"]) or ["all buckets"]
    heights = [max(1, sum(1 for b in counts if panel_of(b) == panel)) for panel in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.2 + 0.32 * sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, lang in zip(axes[:, 0], panels):
        buckets = sorted(b for b in counts if panel_of(b) == lang)
        left = [0] * len(buckets)
        for split, color in SPLIT_COLORS.items():
            values = [counts[b].get(split, 0) for b in buckets]
            ax.barh(buckets, values, left=left, color=color, label=split)
            left = [a + b for a, b in zip(left, values)]
        for y, total in enumerate(left):
            ax.text(total, y, f" {total}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"records per bucket ({lang})", fontsize=10, loc="left")
        ax.tick_params(axis="y", labelsize=8)
        # room for the total printed after the longest bar; set outright, since a split with no record ends
        # in a zero-width bar at the longest total, whose sticky edge would cancel a margin
        ax.set_xlim(0, max(max(left, default=0), 1) * 1.1)
        # beside the axes: a bar of any length, at any row, would run under a legend inside them
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return saved_figure(fig, path)


def length_histograms(lengths: Mapping[str, Sequence[int]], bounds: Sequence[int], path: Path) -> Path:
    """Response length (units) histogram per bucket, log-spaced bins, bin boundaries dashed. A length of 0
    (an empty answer, or one of letters the unit does not count) is drawn at 1, and the title says how many."""
    buckets = sorted(lengths)
    columns = 4
    rows = max(1, math.ceil(len(buckets) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(13, 2.3 * rows), squeeze=False)
    for ax, bucket in zip(axes.flat, buckets):
        values = [max(1, v) for v in lengths[bucket]]
        top = max(values + [2])
        edges = [10 ** (i * math.log10(top * 1.05) / 30) for i in range(31)]
        filled_bins(ax, values, edges, color="#4C72B0")
        ax.set_xscale("log")
        if top >= 10:  # a panel this small reads by its decades alone, and spans at least two of them
            ax.xaxis.set_minor_locator(NullLocator())
        for bound in bounds:
            ax.axvline(bound + 0.5, color="#C44E52", linestyle="--", linewidth=0.8)
        # from the first bin to the last bound, empty bins or not, with matplotlib's 5% margin each side (of
        # the log span): a bar at 1 stands clear of the axis line, as the bars of `ax.hist` did
        span = max(edges[-1], max(bounds, default=0) + 0.5)
        ax.set_xlim(span ** -0.05, span ** 1.05)
        zeros = sum(1 for v in lengths[bucket] if v == 0)
        ax.set_title(f"{bucket} (n={len(values)}" + (f"; {zeros} of length 0, drawn at 1" if zeros else "") + ")",
                     fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(buckets):]:
        ax.axis("off")
    fig.suptitle("response length in units (log scale); dashed: bin bounds", fontsize=10)
    return saved_figure(fig, path)


def weights(weights_by_bucket: Mapping[str, float], train_counts: Mapping[str, int], path: Path) -> Path:
    buckets = sorted(weights_by_bucket)
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.28 * len(buckets)))
    values = [weights_by_bucket[b] for b in buckets]
    ax.barh(buckets, values, color="#8172B3")
    for y, (bucket, value) in enumerate(zip(buckets, values)):
        ax.text(value, y, f" {value:.2f} (n={train_counts.get(bucket, 0)})", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("Bucket-SFT weight per record (train; mean over records = 1)")
    ax.tick_params(axis="y", labelsize=8)
    return saved_figure(fig, path)


def feature_boxes(values: Mapping[str, Mapping[str, Sequence[float]]], features: Sequence[str], path: Path) -> Path:
    """One box plot per feature across buckets (train human responses, outliers hidden)."""
    buckets = sorted(values)
    columns = 2
    rows = max(1, math.ceil(len(features) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(14, 0.9 + rows * (0.6 + 0.2 * len(buckets))), squeeze=False)
    for ax, feature in zip(axes.flat, features):
        ax.boxplot([values[b][feature] for b in buckets], orientation="horizontal", showfliers=False, widths=0.6)
        ax.set_yticks(range(1, len(buckets) + 1), buckets, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(feature, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    for ax in list(axes.flat)[len(features):]:
        ax.axis("off")
    return saved_figure(fig, path)
