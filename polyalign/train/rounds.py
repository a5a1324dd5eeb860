"""On-policy rounds for the preference methods (`rounds=N`).

One offline round trains against the initial policy's answers, which stop describing the policy as
soon as it moves. With rounds, every round after the first starts by letting the current policy
answer the training prompts again: its answers become the rejected side, the critic (when the pairs
came from a critic folder) rescores both sides, and the pair weights are recomputed. With
`on_policy.refresh_critic`, the critic head is first retrained on those pairs (OUT/round-<r>/critic/,
the first critic's settings), since the answers it was trained to tell from people's were the initial
policy's. Round r trains from round r-1's model, which is also its reference, for `train.steps` steps.

OUT/round-<r>/ is a complete run (pairs, metrics with drift, checkpoints, model). Running the same
command again skips finished rounds and resumes an interrupted one from its checkpoint; the
validation pairs stay fixed, so the drift probe's measures of each round's own answers compare across rounds
(its reward margins do not: each round's reference is the model it started from).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from polyalign.core.paths import TRAINING_RECORD, as_path, remove_path, replace_text
from polyalign.core.yaml_config import ConfigError, from_mapping
from polyalign.data.records import Record
from polyalign.generate.run import GenerateOptions, SamplingConfig, generate_predictions
from polyalign.pairs.make import assign_weights, build_pairs, read_pairs, read_predictions, write_pairs
from polyalign.train.config import CriticConfig
from polyalign.train.critic_model import CriticScorer, set_scores
from polyalign.train.methods import require


def _round_dir(out, r: int):
    return as_path(out) / f"round-{r}"


def _round_number(directory) -> int | None:
    """r of a folder OUT/round-<r>; None for another name."""
    found = re.fullmatch(r"round-(\d+)", directory.name)
    return int(found[1]) if found else None


def _finished(directory) -> dict[str, Any] | None:
    summary = directory / "summary.json"
    if not summary.is_file():
        return None
    result = json.loads(summary.read_text())
    return result if not result.get("stopped_early") and (directory / "model").is_dir() else None


CRITIC_FILES = ("critic.json", "critic.safetensors")
DROP_REASONS = {"empty_side": "with an empty policy answer", "chosen_equals_rejected": "answered as the person did"}


def regenerate_pairs(policy, pairs_path: Path, directory, critic_dir: Path | None, config,
                     progress: bool = True) -> dict[str, Any]:
    """DIR/train_pairs.jsonl: the pairs of `pairs_path` with the rejected side answered anew by
    `policy` (sampled), rescored by the critic in `critic_dir` when it has one, reweighted."""
    directory.mkdir(parents=True, exist_ok=True)
    pairs = read_pairs(Path(pairs_path))
    print(f"{directory.parent.name}: the rejected side of {len(pairs)} pairs answered anew by {policy} (on-policy "
          f"rounds: the rejected answers of {pairs_path} serve the first round only)", flush=True)
    records = [Record.from_json(p["record"]) for p in pairs]
    records_file, predictions_file = directory / "prompts.jsonl", directory / "policy_answers.jsonl"
    records_file.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records))
    sampling = SamplingConfig(config.on_policy.max_new_tokens, config.on_policy.temperature, config.on_policy.top_p)
    generate_predictions(policy, records_file, predictions_file,
                         GenerateOptions(sampling=sampling, seed=config.train.seed), progress=progress)
    fresh, dropped = build_pairs(records, read_predictions(predictions_file))
    reasons = ", ".join(f"{n} {DROP_REASONS.get(reason, reason)}" for reason, n in sorted(dropped.items()))
    if not fresh:  # the round would stop at an empty pairs file, naming neither why nor what to change
        sample = (" sample them (on_policy.temperature above 0; greedy answers of a small model are often empty), or"
                  if config.on_policy.temperature == 0 else "")
        raise ConfigError(f"{directory.parent.name}: the policy {policy} left none of the {len(pairs)} pairs usable "
                          f"({reasons}; its answers: {predictions_file}):{sample} train the round before it "
                          "longer")
    if dropped:  # a pair the round cannot use is said, not silently fewer
        print(f"{directory.parent.name}: {sum(dropped.values())} of {len(pairs)} pairs left out ({reasons})",
              flush=True)
    if critic_dir is not None and (critic_dir / "critic.json").is_file():
        scorer = CriticScorer(critic_dir)
        buckets = [p["bucket_id"] for p in fresh]
        set_scores(fresh, scorer([p["chosen"] for p in fresh], buckets),
                   scorer([p["rejected"] for p in fresh], buckets))
        for name in CRITIC_FILES:  # beside the pairs it scored, where the round's drift probe looks for it
            shutil.copyfile(critic_dir / name, directory / name)
    assign_weights(fresh)
    out = directory / "train_pairs.jsonl"
    write_pairs(fresh, out)
    return {"pairs": len(fresh), "dropped": dropped, "path": str(out)}


def refresh_critic(critic_dir: Path, pairs_path: Path, out: Path, train: Callable[..., dict[str, Any]],
                   progress: bool = True) -> Path:
    """OUT: the critic of `critic_dir` retrained, with its own settings, on the pairs of `pairs_path`
    (validated on its validation pairs); OUT/train_pairs.jsonl are those pairs scored by it. A finished
    OUT is kept."""
    if not (out / "critic.json").is_file():
        settings = json.loads((critic_dir / "critic.json").read_text())["config"]
        config = from_mapping(CriticConfig, settings, str(critic_dir / "critic.json"))
        config = dataclasses.replace(config, pairs=str(pairs_path), val_pairs=str(critic_dir / "val_pairs.jsonl"))
        train(config, out, progress)
    return out


ROUND_CARD_ROW = "| on-policy round |"


def mark_round(model: Path, r: int, rounds: int, first_init: str) -> None:
    """Says in round r's model folder (and its adapter folder, where it has one) that it is round r of
    `rounds`: its training record gets "round" ({number, of, from}: the model round 1 started from) and its
    cards a row. A round trains as a run of its own, so the config it records says rounds 1; a kept round is
    marked again with this run's count. Each file is replaced whole; one that is not as an export writes it
    (edited by hand, say) is left as it is."""
    record_path = model / TRAINING_RECORD
    with contextlib.suppress(OSError, ValueError):  # none there, or not JSON
        record = json.loads(record_path.read_text())
        if isinstance(record, dict):
            replace_text(record_path, json.dumps({**record, "round": {"number": r, "of": rounds, "from": first_init}},
                                                 indent=2) + "\n")
    start = first_init if r == 1 else f"round {r - 1}'s model"
    row = (f"{ROUND_CARD_ROW} {r} of {rounds} (rounds={rounds}: trained from {start} as a run of its own, so its "
           "config records rounds 1) |")
    for card_path in (model / "README.md", model.parent / "adapter" / "README.md"):
        if not card_path.is_file():
            continue
        lines = [line for line in card_path.read_text().split("\n") if not line.startswith(ROUND_CARD_ROW)]
        at = next((i + 1 for i, line in enumerate(lines) if line.startswith("| method |")), None)
        if at is not None:
            replace_text(card_path, "\n".join([*lines[:at], row, *lines[at:]]))


def train_rounds(config, out, train: Callable[..., dict[str, Any]], progress: bool = True,
                 check: Callable[[Any, Path, tuple[str, ...]], None] | None = None,
                 overwrite: bool = False) -> dict[str, Any]:
    """Runs (or resumes) `config.rounds` rounds into OUT/round-<r>, each with `train` (the harness's
    one-run entry point); returns the last round's summary with every round's in `rounds`. A finished
    round is kept when `check` (the harness's) finds it made by this command's config for that round;
    `overwrite` trains every round again, its regenerated pairs and refreshed critic too."""
    require(config, "init", hint="the SFT checkpoint")
    if jax.process_count() > 1:
        raise ConfigError(f"rounds={config.rounds}: on-policy rounds run in one process (the regeneration writes "
                          "local files); run each round as its own command on several hosts")
    out = as_path(out)
    pairs, val_pairs = config.pair_files().values()
    critic_dir = Path(pairs).parent
    refresh = config.on_policy.refresh_critic
    if refresh and not (critic_dir / "critic.json").is_file():
        raise ConfigError(f"on_policy.refresh_critic: {critic_dir} has no critic.json; the pairs must come from "
                          "`polyalign train critic`")
    if overwrite:  # every round, its pairs and critic came from models being replaced; later rounds too
        for made in [out / "summary.json", *(out.glob("round-*") if out.exists() else [])]:
            remove_path(made)
    started = time.perf_counter()
    policy, summaries, kept = config.init, [], []
    for r in range(1, config.rounds + 1):
        directory = _round_dir(out, r)
        result = None if overwrite else _finished(directory)
        kept += [r] if result is not None else []
        round_pairs = pairs
        if r > 1:
            regenerated = directory / "pairs" / "train_pairs.jsonl"
            if result is None and not regenerated.is_file():
                regenerate_pairs(policy, pairs, directory / "pairs", None if refresh else critic_dir, config,
                                 progress)
            round_pairs = str(regenerated)
            if refresh and (result is None or (directory / "critic" / "critic.json").is_file()):
                # a finished round's refreshed critic serves the next
                critic_dir = refresh_critic(critic_dir, regenerated, directory / "critic", train, progress)
                round_pairs = str(critic_dir / "train_pairs.jsonl")
        round_config = dataclasses.replace(config, rounds=1, init=str(policy), pairs=round_pairs, val_pairs=val_pairs)
        if result is not None and check is not None:
            check(round_config, directory, () if r > 1 else ("on_policy.",))  # round 1 samples nothing
        if result is None:
            result = train(round_config, directory, progress)
            if result["stopped_early"]:
                return {**result, "round": r, "rounds": summaries, "rounds_planned": config.rounds}
        mark_round(directory / "model", r, config.rounds, str(config.init))
        summaries.append({"round": r, "end_step": result["end_step"], "train_pairs": result.get("train_pairs"),
                          "last": result.get("last", {}),
                          # a round this command took up where a killed one left it (the last round's line says so
                          # through its own start_step)
                          **({"resumed_from_step": result["start_step"]}
                             if r not in kept and result.get("start_step") else {}),
                          # the round's training in all (its invocations), where each recorded its time
                          **({"seconds": result["total_seconds"]} if "total_seconds" in result else {})})
        policy = directory / "model"
    # rounds an earlier run with a larger `rounds` finished: kept on disk, but not this run's model
    beyond = sorted(r for d in out.glob("round-*") if (r := _round_number(d)) is not None and r > config.rounds
                    and _finished(d))
    final = {**{k: v for k, v in result.items() if k != "total_seconds"},  # the last round's, not the run's
             "round": config.rounds, "rounds": summaries, "rounds_planned": config.rounds,
             "rounds_kept": kept, "rounds_beyond": beyond, "model": str(policy), "out": str(out),
             # this command's time: its rounds' training, their answers and critics
             "seconds": round(time.perf_counter() - started, 1)}
    if len(kept) == config.rounds:  # every round was finished before: nothing trained now
        final["start_step"] = final["end_step"]
    (out / "summary.json").write_text(json.dumps(final, indent=2, default=str) + "\n")
    return final
