"""`polyalign demo`: the pipeline end to end on the demo data bundled in the package."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from polyalign.core.errors import Interrupted
from polyalign.core.wording import continued
from polyalign.core.yaml_config import ConfigError
from polyalign.data.records import read_records
from polyalign.train.methods import load_config

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DemoSettings:
    """quick: the reduced sizes; overwrite: start every stage over; progress: progress bars."""

    quick: bool = False
    overwrite: bool = False
    progress: bool = True

    @property
    def existing(self) -> str:
        """What a training stage does with a run already in its folder (polyalign/train/ownership.py)."""
        return "overwrite" if self.overwrite else "continue"


DEMO_DATA_CONFIG = REPO_ROOT / "configs" / "data" / "demo.yaml"


def _prepare(run: Path, settings: DemoSettings) -> str:
    from polyalign.data.prepare import prepare  # heavy: numpy, datasketch, kept out of --help

    manifest = prepare(DEMO_DATA_CONFIG, run, progress=settings.progress, overwrite=settings.overwrite)
    totals = manifest["totals"]
    split_counts = ", ".join(f"{k} {v}" for k, v in totals["by_split"].items())
    return f"{totals['kept']} records ({split_counts}) -> {run / 'data'}"


def _stats(run: Path, settings: DemoSettings) -> str:
    from polyalign.reports.stats import compute_stats  # heavy: matplotlib, numpy, kept out of --help

    stats = compute_stats(run, progress=settings.progress)
    return f"{len(stats['counts']['by_bucket'])} buckets -> {run / 'stats' / 'report.html'}"


def _tokenizer(run: Path, settings: DemoSettings) -> str:
    from polyalign.tokens.tokenizer_training import train_from_records  # heavy: numpy, kept out of --help

    tokenizer, report = train_from_records(run / "data" / "train.jsonl", run / "tokenizer",
                                           DEMO_VOCAB_SIZE_QUICK if settings.quick else DEMO_VOCAB_SIZE,
                                           overwrite=settings.overwrite)
    rates = ", ".join(f"{lang} {rate}" for lang, rate in report["chars_per_token"].items())
    return f"{tokenizer.vocab_size} pieces, characters per token {rates} -> {run / 'tokenizer'}"


def _build(run: Path, settings: DemoSettings) -> str:
    from polyalign.inputs.build import build  # heavy: jax, kept out of --help
    from polyalign.inputs.built import BuildOptions  # kept out of --help, as build is

    manifest = build(run, BuildOptions(max_length=DEMO_MAX_LENGTH), progress=settings.progress,
                     overwrite=settings.overwrite)
    train = manifest["splits"]["train"]
    # a count alone (47% of the examples) read as a fault: what a cut takes is said
    return (f"{train['examples']} train examples, {train['tokens']} tokens; {train['truncated']} longer than "
            f"{DEMO_MAX_LENGTH} tokens, cut (the prompt from its start, a long answer from its end: docs/model.md) -> "
            f"{run / 'build'}")


def _sft(run: Path, settings: DemoSettings) -> str:
    """Plain SFT (RUN/sft) and Bucket-Aware SFT (RUN/bucket_sft) with the same seed and batches; the
    Bucket-SFT model is the initial policy of everything after."""
    from polyalign.train.run import train  # heavy: jax, kept out of --help

    summaries = []
    for name, weighting in (("sft", "uniform"), ("bucket_sft", "bucket")):
        overrides = [f"data.dir={run}", f"weighting={weighting}"] + (DEMO_QUICK_SFT if settings.quick else [])
        config = load_config(DEMO_SFT_CONFIG, overrides, method="sft")
        result = _finished(train(config, run / name, progress=settings.progress, existing=settings.existing), name)
        last = result["last"]
        summaries.append(f"{name} {result['end_step']} steps, validation loss {last['val_loss']:.3f} "
                         f"(worst bucket {last['val_worst_bucket']:.3f})")
    return "; ".join(summaries)


POLICY = "bucket_sft"  # the initial policy and reference of HDPO and DPO


def _finished(result: dict, name: str) -> dict:
    """A training stage's result, or Interrupted when it stopped before its last step (its checkpoint
    is saved, and the demo's next run resumes it)."""
    if result.get("interrupted") or result.get("stopped_early"):
        raise Interrupted(f"{name} stopped at step {result['end_step']} (checkpoint saved); run the same demo "
                          "command to resume")
    return result


# Generation, pairs, critic and preference training on samples of the demo data: full / --quick. The
# quick critic learns from pairs on 96 training prompts: on 48 its held-out ranking hung on the draw
# (docs/preference.md).
DEMO_PAIR_SAMPLES = {"train": (256, 96), "val": (64, 24)}
DEMO_SAMPLING = {"max_new_tokens": 64, "temperature": 0.8, "top_p": 0.9}
DEMO_QUICK_HDPO = ["train.steps=8", "train.eval_every=8", "train.checkpoint_every=4", "data.max_length=128"]


def _generate(run: Path, settings: DemoSettings) -> str:
    # heavy: jax, kept out of --help
    from polyalign.generate.run import GenerateOptions, SamplingConfig, generate_predictions
    from polyalign.pairs.make import make_pairs  # heavy: etils.epath, kept out of --help

    counts = []
    for split, sizes in DEMO_PAIR_SAMPLES.items():
        predictions = run / "generate" / f"{POLICY}_{split}.jsonl"
        options = GenerateOptions(sampling=SamplingConfig(**DEMO_SAMPLING), sample=sizes[settings.quick], seed=0)
        generate_predictions(run / POLICY / "model", run / "data" / f"{split}.jsonl", predictions, options,
                             progress=settings.progress, overwrite=settings.overwrite)
        # held-out pairs weighed by the training pairs' counts, as training weighs them (made first)
        training = run / "pairs" / "train.jsonl" if split != "train" else None
        summary = make_pairs(run / "data" / f"{split}.jsonl", predictions, run / "pairs" / f"{split}.jsonl",
                             overwrite=settings.overwrite, training_pairs=training)
        counts.append(f"{split} {summary['pairs']}")
    return f"pairs from the Bucket-SFT model's samples: {', '.join(counts)} -> {run / 'pairs'}"


def _critic(run: Path, settings: DemoSettings) -> str:
    from polyalign.train.run import train  # heavy: jax, kept out of --help

    # the encoder reads no further than the demo model learned (DEMO_MAX_LENGTH positions)
    config = load_config(DEMO_CRITIC_CONFIG, [f"data.dir={run}", f"init={run / POLICY / 'model'}",
                                              f"pairs={run / 'pairs' / 'train.jsonl'}",
                                              f"val_pairs={run / 'pairs' / 'val.jsonl'}",
                                              f"data.max_length={DEMO_MAX_LENGTH}"], method="critic")
    report = _finished(train(config, run / "critic", progress=settings.progress, existing=settings.existing), "critic")
    val, pairs = report["val"], report["val_pairs"]
    # said in what the critic does (a distance to people, lower nearer): "human ranked below model" read as worse
    return (f"put the person's answer nearer people than the model's in {round(val['ranking_accuracy'] * pairs)} of "
            f"{pairs} held-out pairs ({val['ranking_accuracy']:.0%}; AUC {val['auc']:.2f} over their answers, "
            f"0.5 is chance); its support distances off by {val['l1']:.3f} on average (validation L1) -> "
            f"{run / 'critic'}")


def _hdpo(run: Path, settings: DemoSettings) -> str:
    from polyalign.train.run import train  # heavy: jax, kept out of --help

    summaries = []
    for method in ("hdpo", "dpo"):
        overrides = [f"data.dir={run}", f"init={run / POLICY / 'model'}"] + (DEMO_QUICK_HDPO if settings.quick else [])
        result = _finished(train(load_config(DEMO_HDPO_CONFIG, overrides, method=method), run / method,
                                 progress=settings.progress, existing=settings.existing), method)
        # the reward margin: how much more the policy prefers the human answer to its own than the reference does
        summaries.append(f"{method} reward margin {result['last']['rewards/margin']:.3f}")
    comparison = compare_generations(run, settings)

    def distance(v):
        if not v["generations"]:
            return f"n/a ({v['empty']} of {v['answers']} answers blank)"
        return f"{v['support_distance']:.2f}" + (f" ({v['empty']} of {v['answers']} blank)" if v["empty"] else "")

    lines = "; ".join(f"{decoding} ({COMPARE_DECODING_LABELS[decoding]}): "
                      + ", ".join(f"{m} {distance(v[decoding])}" for m, v in comparison["methods"].items())
                      for decoding in COMPARE_DECODINGS)
    # a reader took 8 steps' numbers for the methods' verdict (HDPO "doubling" the distance)
    caveat = (f" ({QUICK_CAVEAT}: bench/RESULTS.md compares the methods over seeds)" if settings.quick else "")
    compared = next(iter(comparison["methods"].values()))["sampled"]["answers"]
    return (f"{'; '.join(summaries)}; support distance of each model's answers to {compared} validation records "
            f"(not the drift probe's prompts), {lines}{caveat}")


# The demo compares its preference models' validation answers decoded two ways, labelled: sampled as
# the evaluate stage samples (DEMO_SAMPLING) and greedy as the training drift probe decodes. Under greedy
# decoding the 7M-parameter models often end their turn at once, or repeat the space piece until the token
# budget runs out; such blank answers (empty once stripped, as predictions are) have no distance and are
# counted as `empty`, never averaged in.
COMPARE_DECODINGS = ("sampled", "greedy")
COMPARE_DECODING_LABELS = {"sampled": "as evaluate samples", "greedy": "as the drift probe decodes"}


def compare_generations(run: Path, settings: DemoSettings) -> dict:
    """Generations of SFT, DPO and HDPO on the same validation records, sampled as evaluation samples and
    greedy as the drift probe decodes: per decoding, the answers, how many are empty, the non-empty ones'
    mean support distance to the bucket's human references and the critic's mean score
    (RUN/hdpo/comparison.json)."""
    import numpy as np  # heavy: numpy, kept out of --help

    # heavy: jax, kept out of --help
    from polyalign.generate.run import GenerateOptions, SamplingConfig, generate_predictions
    from polyalign.pairs.make import read_predictions  # heavy: etils.epath, kept out of --help
    from polyalign.train.critic_model import CriticScorer, support_targets  # heavy: jax, kept out of --help

    references = json.loads((run / "stats" / "references.json").read_text())
    scorer = CriticScorer(run / "critic")
    records = {r.id: r for r in read_records(run / "data" / "val.jsonl")}
    decodings = {"sampled": SamplingConfig(**DEMO_SAMPLING), "greedy": SamplingConfig(max_new_tokens=64)}
    methods = {}
    for method in (POLICY, "dpo", "hdpo"):
        methods[method] = {}
        for decoding, sampling in decodings.items():
            path = run / "generate" / f"{method}_compare{'' if decoding == 'greedy' else '_' + decoding}.jsonl"
            generate_predictions(run / method / "model", run / "data" / "val.jsonl", path,
                                 GenerateOptions(sampling=sampling, sample=DEMO_PAIR_SAMPLES["val"][settings.quick],
                                                 seed=1), progress=False, overwrite=settings.overwrite)
            answers = list(read_predictions(path).values())
            rows = [r for r in answers if r["prediction"]]
            texts, buckets = [r["prediction"] for r in rows], [records[r["id"]].bucket_id for r in rows]
            distance = support_targets(texts, buckets, references)
            methods[method][decoding] = {
                "answers": len(answers), "empty": len(answers) - len(rows), "generations": len(rows),
                # null, not NaN (which is no JSON), when every answer is empty; `empty` says so
                "support_distance": float(np.nanmean(distance)) if rows else None,
                "critic_score": float(scorer(texts, buckets).mean()) if rows else None}
    result = {"records": "validation sample, 64 new tokens",
              "decodings": {"sampled": DEMO_SAMPLING, "greedy": {"max_new_tokens": 64, "temperature": 0.0}},
              "methods": methods}
    (run / "hdpo" / "comparison.json").write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    return result


# The test records each model answers: N of every bucket (all of a smaller one), so that every bucket is
# evaluated, the point of the tool; a random 48 covered 6 of the 18 test buckets, 4 of them with one row.
DEMO_TEST_PER_BUCKET = (20, 5)
QUICK_CAVEAT = "--quick trains for seconds: too little to tell the methods apart"
DEMO_METHODS = ("sft", "bucket_sft", "dpo", "hdpo")


def _evaluate(run: Path, settings: DemoSettings) -> str:
    from polyalign.evaluate.run import EvaluateOptions, evaluate  # heavy: numpy, scipy, kept out of --help

    # heavy: jax, kept out of --help
    from polyalign.generate.run import GenerateOptions, SamplingConfig, generate_predictions
    from polyalign.reports.no_model import ahead_of_the_model  # with the evaluation it reads
    from polyalign.reports.reading_notes import notes_for_reader  # heavy: numpy, kept out of --help

    # MAUVE needs the `mauve` extra (the README's demo command installs it); without, every other
    # metric is computed and the report says MAUVE was skipped and why.
    featurizer = run / POLICY / "model" if importlib.util.find_spec("mauve") else None
    if featurizer is None:
        print("demo: MAUVE skipped (pip install 'polyalign[mauve]' to compute it)", flush=True)
    summaries = []
    for method in DEMO_METHODS:
        if settings.progress:  # the bars below say "generate" and "evaluate": this says whose
            print(f"{method}: answering and evaluating", file=sys.stderr, flush=True)
        predictions = run / "generate" / f"{method}_test.jsonl"
        # Sampled, as the pairs are: under greedy decoding the 7M-parameter demo models mostly end
        # their turn at once, and every metric would compare empty strings.
        options = GenerateOptions(sampling=SamplingConfig(**DEMO_SAMPLING),
                                  per_bucket=DEMO_TEST_PER_BUCKET[settings.quick], seed=2)
        generate_predictions(run / method / "model", run / "data" / "test.jsonl", predictions, options,
                             progress=settings.progress, overwrite=settings.overwrite)
        # The predictions answer a selection of the test split, which their manifest names: evaluate reads that
        # part as the whole (no --allow-partial) and says which it is.
        result = evaluate(run / "data" / "test.jsonl", predictions, run / "eval" / method,
                          EvaluateOptions(references=run / "stats" / "references.json",
                                          support=run / "data" / "train.jsonl", featurizer=featurizer),
                          overwrite=settings.overwrite, progress=settings.progress)
        metrics = result["metrics"]
        bng, floor = metrics["bng"]["overall_macro"], metrics["bng"].get("floor_macro")
        summaries.append(f"{method} F1 {metrics['utility']['overall']['qa_f1']:.3f} "
                         f"BNG {'n/a' if bng is None else f'{bng:.2f}'}"
                         + ("" if floor is None else f" (human floor {floor:.2f})"))
        # what `polyalign evaluate` warns of, said here too: without it a reader ranked four models that
        # copying the question beats
        for warning in [ahead_of_the_model(metrics), *(text for text, warns in notes_for_reader(result) if warns)]:
            if warning:
                print(f"warning: {method}: {warning}", file=sys.stderr, flush=True)
    evaluated = result["alignment"]["evaluated"]
    caveat = f"; {QUICK_CAVEAT}" if settings.quick else ""
    return (f"{'; '.join(summaries)} on {evaluated} test records, up to {DEMO_TEST_PER_BUCKET[settings.quick]} of each "
            f"of {len(metrics['buckets'])} buckets (sampled: temperature {DEMO_SAMPLING['temperature']}, "
            f"top-p {DEMO_SAMPLING['top_p']}{caveat}) -> {run / 'eval'}")


def _report(run: Path, settings: DemoSettings) -> str:
    from polyalign.reports.evaluation import compare  # heavy: matplotlib, numpy, kept out of --help

    summary = compare([run / "eval" / m for m in DEMO_METHODS], run / "report", overwrite=settings.overwrite)
    short = "".join(f"; {continued(line)}" for line in summary["in_short"])
    return f"{', '.join(DEMO_METHODS)} side by side{short} -> {run / 'report' / 'report.html'}"


DEMO_SFT_CONFIG = REPO_ROOT / "configs" / "sft_demo.yaml"
DEMO_CRITIC_CONFIG = REPO_ROOT / "configs" / "critic_demo.yaml"
DEMO_HDPO_CONFIG = REPO_ROOT / "configs" / "hdpo_demo.yaml"
# On two CPU cores the tiny model trains at about 1,200-1,600 tokens/s: --quick halves the SFT batch and
# the preference pairs' length (the full demo keeps 16 sequences and 256 tokens a side).
DEMO_QUICK_SFT = ["train.steps=20", "train.eval_every=10", "train.checkpoint_every=10", "data.eval_limit=64",
                  "train.global_batch=8"]
DEMO_MAX_LENGTH = 256
DEMO_VOCAB_SIZE = 8000
DEMO_VOCAB_SIZE_QUICK = 6000  # the demo's Chinese needs ~3,700 single-character pieces at 0.9995 coverage
STAGES: dict[str, Callable[[Path, DemoSettings], str]] = {
    "prepare": _prepare, "stats": _stats, "tokenizer": _tokenizer, "build": _build, "sft": _sft,
    "generate": _generate, "critic": _critic, "hdpo": _hdpo, "evaluate": _evaluate, "report": _report,
}
# Later stages of the full pipeline, in order; they join STAGES as they land.
PLANNED_STAGES: tuple[str, ...] = ()


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


def run_demo(out: Path, stages: Sequence[str], quick: bool = False, echo: Callable[[str], None] = print,
             overwrite: bool = False, progress: bool = True) -> None:
    """Runs `stages` into OUT. Run again, the same command resumes where it stopped (finished stages
    are redone from their outputs, training continues from its checkpoints); `overwrite` starts every
    stage over, as when OUT holds a run made with other settings (--quick, say); `progress` False runs
    every stage without progress bars (a log file stays readable)."""
    if not DEMO_DATA_CONFIG.is_file():
        raise ConfigError(f"{DEMO_DATA_CONFIG}: missing; the demo runs from a source checkout (pip install -e .)")
    out.mkdir(parents=True, exist_ok=True)
    settings = DemoSettings(quick, overwrite, progress)
    for i, stage in enumerate(stages, start=1):
        started = time.perf_counter()
        echo(f"[{i}/{len(stages)}] {stage} ...")
        summary = STAGES[stage](out, settings)
        echo(f"[{i}/{len(stages)}] {stage}: {summary} ({time.perf_counter() - started:.1f} s)")
    if "stats" in stages:
        echo(f"\nBucket statistics report: {out / 'stats' / 'report.html'}")
    if "sft" in stages:
        echo(f"SFT and Bucket-SFT metrics: {out / 'sft' / 'metrics.jsonl'}, {out / 'bucket_sft' / 'metrics.jsonl'}")
    if "hdpo" in stages:
        echo(f"HDPO and DPO: {out / 'hdpo'}, {out / 'dpo'}; generations compared in {out / 'hdpo' / 'comparison.json'}")
    if "report" in stages:
        echo(f"Comparison of SFT, Bucket-SFT, DPO and HDPO: {out / 'report' / 'report.html'}")
