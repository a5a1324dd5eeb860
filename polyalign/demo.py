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


def _build(run: Path, quick: bool) -> str:
    from polyalign.inputs.build import BuildOptions, build

    manifest = build(run, BuildOptions(max_length=DEMO_MAX_LENGTH))
    train = manifest["splits"]["train"]
    return (f"{train['examples']} train examples, {train['tokens']} tokens, {train['truncated']} cut to "
            f"{DEMO_MAX_LENGTH} -> {run / 'build'}")


def _sft(run: Path, quick: bool) -> str:
    from polyalign.train.sft import load_config, train_sft

    overrides = [f"data.dir={run}"] + (DEMO_QUICK_SFT if quick else [])
    result = train_sft(load_config(DEMO_SFT_CONFIG, overrides), run / "sft")
    last = result["last"]
    return (f"{result['end_step']} steps, train loss {last['loss']:.3f}, validation loss {last['val_loss']:.3f} "
            f"(worst bucket {last['val_worst_bucket']:.3f}) -> {run / 'sft' / 'model'}")


DEMO_SFT_CONFIG = REPO_ROOT / "configs" / "sft_demo.yaml"
DEMO_QUICK_SFT = ["train.steps=20", "train.eval_every=10", "train.checkpoint_every=10", "data.eval_limit=64"]
DEMO_MAX_LENGTH = 256
DEMO_VOCAB_SIZE = 8000
DEMO_VOCAB_SIZE_QUICK = 6000  # the demo's Chinese needs ~3,700 single-character pieces at 0.9995 coverage
STAGES: dict[str, Callable[[Path, bool], str]] = {
    "prepare": _prepare, "stats": _stats, "tokenizer": _tokenizer, "build": _build, "sft": _sft,
}
# Later stages of the full pipeline, in order; they join STAGES as they land.
PLANNED_STAGES = ("generate", "critic", "hdpo", "evaluate", "report")


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
    if "sft" in stages:
        echo(f"Bucket-SFT metrics: {out / 'sft' / 'metrics.jsonl'} (TensorBoard: {out / 'sft' / 'tensorboard'})")
