"""`polyalign pairs accuracy`: how often a model prefers the chosen answer of held-out pairs.

Two measures, each per bucket and overall with a 95% Wilson interval:
- reward accuracy: the share of pairs whose implicit reward is higher for the chosen answer than for the
  rejected one, a tie counting as wrong, with the mean margin: what preference training logs as
  `val_rewards/accuracy` and `val_rewards/margin`, on any pairs file. The reward is the one the model's own
  method logs: `beta (pi - rho)` (pi the model's summed log-prob of an answer, rho the reference's: DPO and
  the methods with a reference, whose reference is by default the model training started from), or, for
  SimPO and ORPO, which have none, `beta` times the mean log-prob per token.
- log-prob preference: the share whose chosen answer has the higher mean log-prob per token under the model
  alone, with the reference's own share beside it as the baseline (the reference against itself ties on
  every pair of the first reward).
Both sides of a pair are tokenised with the model's tokenizer and template as training tokenised them
(`tokenise_pairs`: truncation and max_length from the training record unless given; the profile prompt by the
rule every command renders a checkpoint's prompts with, tokens/chat.py trained_profile).
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
from scipy.stats import binomtest

from polyalign.core.errors import InputError
from polyalign.core.outputs import stage_output
from polyalign.core.paths import as_path, build_setting, file_digest, recorded_path, training_record
from polyalign.core.scores import interval_text, rounded_outward
from polyalign.core.yaml_config import ConfigError
from polyalign.inputs.pair_rows import tokenise_pairs
from polyalign.mesh import parallel
from polyalign.model import load_hf_checkpoint
from polyalign.model.architecture import checkpoint_family, compute_dtype, longer_than_positions
from polyalign.model.hf import checkpoint_tokenizer
from polyalign.pairs.make import read_pairs
from polyalign.tokens.chat import choose_template, get_template, trained_profile
from polyalign.tokens.profile_template import TRUNCATIONS
from polyalign.tokens.tokenizer import MAX_LENGTH_KEY, trained_length
from polyalign.train.methods import METHODS, method_spec
from polyalign.train.preference import reference_logps

RECORD = "accuracy.json"
PER_PAIR = "per_pair.jsonl"
DEFAULT_MAX_LENGTH = 1024
NO_REFERENCE = "none"  # --reference none: the log-prob preference alone, whatever the record names
# The two implicit rewards of the preference methods (train/preference.py, preference_rewards).
AGAINST_REFERENCE, MEAN_LOGPROB = "against_reference", "mean_logprob"
REWARDS = (AGAINST_REFERENCE, MEAN_LOGPROB)
# A margin this small is a tie: the model and its reference compute the same log-probs in other programs,
# whose sums can differ in their last bits.
TIE = 1e-6


NO_TRAINING_RECORD = "none: the model has no training record naming its init; give --reference INIT"


@dataclass(frozen=True)
class AccuracyOptions:
    reference: str | None = None  # None: the training record's init; NO_REFERENCE: none
    reward: str | None = None  # None: the one the record's method logs, else AGAINST_REFERENCE
    beta: float | None = None  # None: the training record's, else 0.1
    max_length: int | None = None  # None: what the model trained on (trained_max_length), else DEFAULT_MAX_LENGTH
    profile: str | None = None
    truncation: str | None = None
    batch_size: int = 8
    dtype: str = "auto"  # model/architecture.py compute_dtype: bfloat16 on GPU and TPU, float32 on a CPU


def wilson(correct: int, n: int) -> tuple[float, float]:
    """The 95% Wilson interval of correct / n, rounded outward to 4 places (it holds what the exact one holds)."""
    interval = binomtest(correct, n).proportion_ci(confidence_level=0.95, method="wilson")
    return rounded_outward((interval.low, interval.high), 4)


def share(flags: list[bool]) -> dict[str, Any]:
    correct = int(sum(flags))
    return {"share": round(correct / len(flags), 4), "interval": wilson(correct, len(flags))}


def training_config(model: Path) -> dict[str, Any]:
    """The config the model's training record holds (polyalign's own exports); {} for any other checkpoint."""
    return (training_record(model) or {}).get("config") or {}


def resolved(model: Path, options: AccuracyOptions, config: dict[str, Any]) -> tuple[AccuracyOptions, dict[str, str]]:
    """`options` with what was left unsaid read from the model's training `config` (training_config), and
    where each came from; paths as a record keeps them (core/paths.py recorded_path), so that the same
    measurement asked from another folder, or with a value spelt out that the record gave, is the same."""
    trained = {"reference": config.get("init"), "beta": config.get("beta"),
               "max_length": (config.get("data") or {}).get("max_length"), "truncation": config.get("truncation")}
    values, sources = asdict(options), {}
    for key, value in trained.items():
        if values[key] is not None:
            sources[key] = "given"
        elif value is not None:
            values[key], sources[key] = value, "the model's training record"
    if values["reward"] is not None:
        sources["reward"] = "given"
    elif config.get("method") in METHODS and not method_spec(config["method"]).needs_reference:
        values["reward"], sources["reward"] = MEAN_LOGPROB, f"{config['method']}'s, as its training logs it"
    else:
        values["reward"], sources["reward"] = AGAINST_REFERENCE, "the default"
    if values["max_length"] is None:  # SFT takes its length and truncation from the build it trained on
        values["max_length"], sources["max_length"] = trained_max_length(model, config)
    if values["truncation"] is None and (built := trained_truncation(config)) is not None:
        values["truncation"], sources["truncation"] = built
    for key, value in {"beta": 0.1, "truncation": "left"}.items():
        if values[key] is None:
            values[key], sources[key] = value, "the default"
    if values["reference"] is None:  # why there is none, for the line that says so
        sources["reference"] = (NO_TRAINING_RECORD if not config else
                                "none: its training record names no init (trained from scratch)")
    if values["reference"] == NO_REFERENCE:
        values["reference"] = None
    elif values["reference"] is not None:
        values["reference"] = recorded_path(values["reference"])
    return AccuracyOptions(**values), sources


def trained_max_length(model: Path, config: dict[str, Any]) -> tuple[int, str]:
    """The longest sequence the model trained on where it says so, else DEFAULT_MAX_LENGTH: an SFT run's build
    (its data.dir's build manifest), or the length a from-scratch model records in its tokenizer config."""
    if (built := build_setting(config, "max_length")) is not None and isinstance(built[0], int):
        return built
    if (length := trained_length(model)) is not None:
        return length, f"{MAX_LENGTH_KEY} in its tokenizer_config.json"
    return DEFAULT_MAX_LENGTH, "the default"


def trained_truncation(config: dict[str, Any]) -> tuple[str, str] | None:
    """How the build an SFT run trained on cut long examples (`--truncation turns` keeps the system message
    and last question), where its manifest says so: the held-out pairs are cut the same way."""
    built = build_setting(config, "truncation")
    return built if built is not None and built[0] in TRUNCATIONS else None


def answer_logps(checkpoint, examples: list[dict], options: AccuracyOptions, pad_id: int,
                 progress: bool, desc: str) -> tuple[np.ndarray, np.ndarray]:
    """Summed log-probs of every pair's chosen and rejected answer under `checkpoint`."""
    mesh = parallel.make_mesh()
    model = load_hf_checkpoint(checkpoint, dtype=compute_dtype(options.dtype), mesh=mesh)
    with jax.set_mesh(mesh):
        reference_logps(model, examples, options.max_length, pad_id, batch_size=options.batch_size,
                        progress=progress, mesh=mesh, desc=desc)
    return (np.array([e.pop("ref_chosen") for e in examples]), np.array([e.pop("ref_rejected") for e in examples]))


def check_model(checkpoint: str, what: str, hint: str) -> None:
    """A folder polyalign loads a model from, or one line saying what it is not."""
    if not (as_path(checkpoint) / "config.json").is_file():
        raise ConfigError(f"{what} {checkpoint}: no model folder there ({hint})")
    if checkpoint_family(checkpoint) is None:
        raise ConfigError(f"{what} {checkpoint}: not a model polyalign loads (its config.json names no model family "
                          "polyalign builds: a critic's folder, say)")


def same_vocabulary(tokenizer, other) -> bool:
    """Whether two tokenizers give every id the same piece: then the reference's log-probs are of the very
    token ids the model's are."""
    return tokenizer.vocab_size == other.vocab_size and all(
        tokenizer.decode([i]) == other.decode([i]) for i in range(tokenizer.vocab_size))


def check_reference(model: Path, reference: str, source: str, tokenizer) -> None:
    """Before any forward pass: the reference is a model folder whose vocabulary is the model's."""
    check_model(reference, "reference", "the model's training record names it as the model it trained from, and it "
                "is not there from here: give --reference, or --reference none" if source != "given"
                else "give a Hugging Face model folder")
    if not same_vocabulary(tokenizer, checkpoint_tokenizer(reference)):
        raise ConfigError(f"--reference {reference}: its vocabulary is not {model}'s; the implicit reward compares "
                          "the two models on the same token ids (give the model it was trained from)")


def measure(model: Path, pairs_path: Path, options: AccuracyOptions, sources: dict[str, str], tokenizer,
            progress: bool = True) -> dict[str, Any]:
    """Per-pair values and the summary (overall and per bucket) under resolved `options`, with the model's
    `tokenizer`; writes nothing."""
    pairs = read_pairs(pairs_path, "make them with `polyalign pairs` or `polyalign pairs import`")
    if not pairs:
        raise InputError(f"{pairs_path}: no pairs")
    for checkpoint in filter(None, (model, options.reference)):
        if too_long := longer_than_positions(checkpoint, options.max_length, f"max_length {options.max_length} "
                                             f"({sources['max_length']})", "give a smaller --max-length"):
            raise ConfigError(too_long)
    if options.reference is not None:
        check_reference(model, options.reference, sources["reference"], tokenizer)
    template = get_template(choose_template(tokenizer, family=checkpoint_family(model), where=str(model)), tokenizer)
    buckets = sorted({pair["bucket_id"] for pair in pairs})
    examples = tokenise_pairs(pairs, tokenizer, template, options.profile, options.max_length, buckets,
                              options.truncation)
    tokens = {side: [max(int(np.sum(e[f"{side}_mask"])), 1) for e in examples] for side in ("chosen", "rejected")}
    policy = answer_logps(model, examples, options, tokenizer.pad_id, progress, "the model's log-probs")
    reference = None
    if options.reference is not None:
        reference = answer_logps(options.reference, examples, options, tokenizer.pad_id, progress,
                                 "the reference's log-probs")
    rows = [pair_row(pair, example, i, policy, reference, tokens, options)
            for i, (pair, example) in enumerate(zip(pairs, examples, strict=True))]
    groups = defaultdict(list)
    for row in rows:
        groups[row["bucket_id"]].append(row)
    summary = {"model": str(model), "pairs_file": str(pairs_path), "settings_from": sources,
               "overall": summarize(rows),
               "by_bucket": {bucket: summarize(members) for bucket, members in sorted(groups.items())}}
    return {"summary": summary, "rows": rows}


def pair_row(pair: dict, example: dict, i: int, policy, reference, tokens: dict[str, list[int]],
             options: AccuracyOptions) -> dict[str, Any]:
    """One pair's log-probs, margin and verdicts (per_pair.jsonl)."""
    chosen, rejected = float(policy[0][i]), float(policy[1][i])
    n_chosen, n_rejected = tokens["chosen"][i], tokens["rejected"][i]
    row = {"id": pair["id"], "bucket_id": pair["bucket_id"], "chosen_logp": chosen, "rejected_logp": rejected,
           "chosen_tokens": n_chosen, "rejected_tokens": n_rejected, "truncated": bool(example["truncated"]),
           "prefers_chosen": chosen / n_chosen > rejected / n_rejected}
    margin = None
    if reference is not None:
        ref_chosen, ref_rejected = float(reference[0][i]), float(reference[1][i])
        row.update(ref_chosen_logp=ref_chosen, ref_rejected_logp=ref_rejected,
                   reference_prefers_chosen=ref_chosen / n_chosen > ref_rejected / n_rejected)
        if options.reward == AGAINST_REFERENCE:
            margin = options.beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    if options.reward == MEAN_LOGPROB:
        margin = options.beta * (chosen / n_chosen - rejected / n_rejected)
    if margin is not None:  # a tie counts as wrong, as training counts it
        row.update(reward_margin=margin, reward_correct=margin > 0)
    return row


def summarize(rows: list[dict]) -> dict[str, Any]:
    measured = {"pairs": len(rows), "truncated": sum(row["truncated"] for row in rows),
                "logp_preference": share([row["prefers_chosen"] for row in rows])}
    if "reward_margin" in rows[0]:
        margins = [row["reward_margin"] for row in rows]
        measured.update(reward_accuracy=share([row["reward_correct"] for row in rows]),
                        reward_margin=round(float(np.mean(margins)), 4),
                        ties=sum(abs(margin) <= TIE for margin in margins))
    if "reference_prefers_chosen" in rows[0]:
        measured["reference_logp_preference"] = share([row["reference_prefers_chosen"] for row in rows])
    return measured


def pairs_accuracy(model, pairs_path, out, options: AccuracyOptions = AccuracyOptions(), overwrite: bool = False,
                   progress: bool = True) -> dict[str, Any]:
    """Measures (measure) and writes OUT/accuracy.json (the summary, its settings and the inputs' digests) and
    OUT/per_pair.jsonl (each pair's log-probs, margin and verdicts, for paired comparisons between models)."""
    model, pairs_path, out = Path(model), Path(pairs_path), Path(out)
    check_model(str(model), "--model", "give a Hugging Face model folder, e.g. OUT/model")
    options, sources = resolved(model, options, training_config(model))
    tokenizer, notes = checkpoint_tokenizer(model), []
    # the profile as generate and evaluate render this checkpoint's prompts (and another than the trained one said)
    sources["profile"] = ("given" if options.profile else "its export's polyalign_profile" if tokenizer.profile_mode
                          else "the rule for a checkpoint that names none")
    options = replace(options, profile=trained_profile(tokenizer, options.profile, str(model), notes),
                      dtype=compute_dtype(options.dtype))  # the one used, in the settings
    # the settings as measured: a value spelt out that the record gave before is the same measurement
    settings = {"model": recorded_path(model), "pairs": recorded_path(pairs_path), **asdict(options)}
    started = time.perf_counter()
    with stage_output(out, out / RECORD, settings, overwrite, ours=[out / PER_PAIR], inputs={"pairs": pairs_path}):
        measured = measure(model, pairs_path, options, sources, tokenizer, progress)
        with (out / PER_PAIR).open("w", encoding="utf-8") as handle:
            for row in measured["rows"]:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        summary = {**measured["summary"], "settings": settings, "notes": notes,
                   "made_from": {"pairs": file_digest(pairs_path)},
                   "seconds": round(time.perf_counter() - started, 1)}
        (out / RECORD).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return summary


def _cell(measured: dict[str, Any] | None) -> str:
    if measured is None:
        return "-"
    return f"{measured['share']:.3f} {interval_text(measured['interval'])}"


def summary_table(summary: dict[str, Any]) -> str:
    """The printed table: one row per bucket and the overall row, each share with its 95% interval."""
    overall = summary["overall"]
    rewards, baseline = "reward_accuracy" in overall, "reference_logp_preference" in overall
    header = ["bucket", "pairs", *(["reward accuracy", "margin"] if rewards else []), "log-prob pref.",
              *(["reference log-prob pref."] if baseline else [])]
    lines = []
    for name, measured in [*summary["by_bucket"].items(), ("all", overall)]:
        cells = [name, str(measured["pairs"])]
        if rewards:
            cells += [_cell(measured["reward_accuracy"]), f"{measured['reward_margin']:+.4f}"]
        cells.append(_cell(measured["logp_preference"]))
        if baseline:
            cells.append(_cell(measured["reference_logp_preference"]))
        lines.append(cells)
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *lines])


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """What the command prints below the table: what the numbers are against, and where they are."""
    settings, sources = summary["settings"], summary["settings_from"]
    overall = summary["overall"]
    lines = []
    if overall.get("ties") == overall["pairs"]:
        lines.append(f"every pair ties (a margin within {TIE:g} of 0 on each): the reference scores the answers as "
                     "the model does (the same weights?), so reward accuracy is 0 by construction (a tie counts as "
                     "wrong), not a preference against the chosen answers; read the log-prob preference")
    beta = f"beta {settings['beta']} ({sources['beta']})"
    if "reward_accuracy" in overall and settings["reward"] == MEAN_LOGPROB:
        lines.append(f"reward accuracy: the share of pairs whose reward, {beta} times the mean log-prob per token, "
                     f"is higher for the chosen answer (a tie counts as wrong; the reward of {sources['reward']}, "
                     "with no reference); chance is 0.5")
    elif "reward_accuracy" in overall:
        lines.append(f"reward accuracy: the share of pairs whose implicit reward beta (pi - rho) is higher for the "
                     f"chosen answer (a tie counts as wrong), against the reference {settings['reference']} "
                     f"({sources['reference']}), {beta}; chance is 0.5")
    baseline = ("; the reference's own share is its baseline" if "reference_logp_preference" in overall else
                "; no reference, so no baseline (--reference MODEL measures another checkpoint beside it)")
    lines.append(f"log-prob preference: the share whose chosen answer has the higher mean log-prob per token{baseline}")
    if "reward_accuracy" not in overall:
        why = ("--reference none" if sources.get("reference") == "given" else
               sources.get("reference", NO_TRAINING_RECORD).removeprefix("none: "))
        lines.append(f"no reward accuracy: it needs the reference the model was trained against ({why})")
    lines += [f"note: {note}" for note in summary.get("notes", [])]
    if overall["truncated"]:
        lines.append(f"note: {overall['truncated']} of {overall['pairs']} pairs were cut to max_length "
                     f"{settings['max_length']} ({sources['max_length']})")
    if overall["pairs"] < 30:
        lines.append(f"note: {overall['pairs']} pairs: read the intervals, which are wide")
    return lines


def print_summary(summary: dict[str, Any], out: Path) -> None:
    print(summary_table(summary))
    for line in summary_lines(summary):
        print(line, file=sys.stderr if line.startswith("note:") else sys.stdout)
    print(f"accuracy: {out / RECORD} (each pair: {out / PER_PAIR})")

