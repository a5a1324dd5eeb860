"""`polyalign demo`: the pipeline end to end on the demo data bundled in the package."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from polyalign.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_DATA_CONFIG = REPO_ROOT / "configs" / "data" / "demo.yaml"


def _prepare(run: Path, quick: bool) -> str:
    from polyalign.data.prepare import prepare

    manifest = prepare(DEMO_DATA_CONFIG, run)
    totals = manifest["totals"]
    split_counts = ", ".join(f"{k} {v}" for k, v in totals["by_split"].items())
    return f"{totals['kept']} records ({split_counts}) -> {run / 'data'}"


def _stats(run: Path, quick: bool) -> str:
    from polyalign.reports.stats import compute_stats

    stats = compute_stats(run)
    return f"{len(stats['counts']['by_bucket'])} buckets -> {run / 'stats' / 'report.html'}"


def _tokenizer(run: Path, quick: bool) -> str:
    from polyalign.tokenizer import train_from_records

    tokenizer, report = train_from_records(run / "data" / "train.jsonl", run / "tokenizer",
                                           DEMO_VOCAB_SIZE_QUICK if quick else DEMO_VOCAB_SIZE)
    rates = ", ".join(f"{lang} {rate}" for lang, rate in report["chars_per_token"].items())
    return f"{tokenizer.vocab_size} pieces, characters per token {rates} -> {run / 'tokenizer'}"


DEMO_VOCAB_SIZE = 8000
DEMO_VOCAB_SIZE_QUICK = 6000  # the demo's Chinese needs ~3,700 single-character pieces at 0.9995 coverage
STAGES: dict[str, Callable[[Path, bool], str]] = {"prepare": _prepare, "stats": _stats, "tokenizer": _tokenizer}
# Later stages of the full pipeline, in order; they join STAGES as they land.
PLANNED_STAGES = ("build", "sft", "generate", "critic", "hdpo", "evaluate", "report")


def parse_stages(text: str | None) -> list[str]:
    if not text:
        return list(STAGES)
    stages = [s.strip() for s in text.split(",") if s.strip()]
    for stage in stages:
        if stage in PLANNED_STAGES:
            raise ConfigError(f"demo stage {stage!r} is not available in this version (available: {', '.join(STAGES)})")
        if stage not in STAGES:
            raise ConfigError(f"unknown demo stage {stage!r} (available: {', '.join(STAGES)})")
    return stages


def run_demo(out: Path, stages: Sequence[str], quick: bool = False, echo: Callable[[str], None] = print) -> None:
    if not DEMO_DATA_CONFIG.is_file():
        raise ConfigError(f"{DEMO_DATA_CONFIG}: missing; the demo runs from a source checkout (pip install -e .)")
    out.mkdir(parents=True, exist_ok=True)
    for i, stage in enumerate(stages, start=1):
        started = time.perf_counter()
        echo(f"[{i}/{len(stages)}] {stage} ...")
        summary = STAGES[stage](out, quick)
        echo(f"[{i}/{len(stages)}] {stage}: {summary} ({time.perf_counter() - started:.1f} s)")
    if "stats" in stages:
        echo(f"\nBucket statistics report: {out / 'stats' / 'report.html'}")
