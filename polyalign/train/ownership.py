"""Who owns a training output: the config that made it, and one writer at a time.

OUT/config.json records the config a run was started with. Running into OUT again continues it when
the config is the same; otherwise the keys that differ decide:
- where the run stops and how it is laid out (`train.stop_at`, `train.keep_checkpoints`,
  `data.eval_batch`, `parallel.*`: the same model is computed), it continues;
- keys a run can be continued with (`train.steps`, `train.epochs`, `train.checkpoint_every`,
  `train.eval_every`, `train.log_every`, `train.max_nonfinite`, `data.eval_limit`) need `--resume`,
  because the continued run is no longer the run the folder records (a new step count reshapes the
  learning-rate schedule);
- anything else (the data, the model, the method, the optimiser) is another run: refused unless
  `--overwrite`, which starts over and removes what the earlier run wrote.
OUT/inputs.json records what the files the run trains and validates on held (their digests), and the init
checkpoint it started from (a fingerprint): a file at the same path that holds something else since (pairs
imported again, a run built again, an init trained again) makes it another run too, whatever the flags but
--overwrite, since its checkpoints were trained on the other.
A lock file (polyalign/core/outputs.py) refuses a second process writing the same folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from polyalign.core.errors import CheckpointError
from polyalign.core.outputs import (
    FREE_KEYS,
    REPORTING_KEYS,
    describe_changes,
    differing_keys,
    flatten,
    keys_match,
    same_path,
)
from polyalign.core.paths import as_path, committed_steps, file_digest, recorded_path, remove_path
from polyalign.core.wording import counted
from polyalign.core.yaml_config import ConfigError

EXISTING = ("continue", "resume", "overwrite")
RESUMABLE_KEYS = ("train.steps", "train.epochs", "train.checkpoint_every", "train.eval_every", "train.log_every",
                  "train.max_nonfinite", "data.eval_limit", "train.report_to", "train.tracker_project",
                  "train.peak_tflops", "train.profile_steps")
# What a run writes into OUT, removed by --overwrite; anything else in the folder is left alone.
RUN_FILES = ("config.json", "inputs.json", "metrics.jsonl", "summary.json", "checkpoints", "tensorboard", "profile",
             "wandb", "model", "adapter", "critic.json", "critic.safetensors", "train_pairs.jsonl", "val_pairs.jsonl")


def claim(out: Path, config: dict[str, Any], inputs: dict[str, str | None], existing: str = "continue",
          remove: bool = True, contents: dict[str, dict[str, str]] | None = None) -> str:
    """Checks that OUT may receive the run `config` describes; returns "new", "continue" or "overwrite"
    (after removing what the earlier run wrote, where `remove`: one process of several does that).
    `inputs` are the paths the run reads, by key, none of which may be OUT itself; `contents`, what the files
    it trains on hold now ({key: {"path", "digest"}}, `input_contents`), checked against OUT/inputs.json."""
    if existing not in EXISTING:
        raise ValueError(f"existing must be one of {EXISTING}")
    for key, path in inputs.items():
        if path and same_path(out, path):
            raise ConfigError(f"--out {out} is the run's own {key}; write the output somewhere else")
    rounds = sorted(path.name for path in out.glob("round-*")) if out.is_dir() else []
    if rounds and existing != "overwrite":  # a run of on-policy rounds keeps its rounds apart from its config
        raise ConfigError(f"{out}: holds on-policy rounds ({', '.join(rounds)}), and this is one run (rounds=1) that "
                          "would be written beside them; give the rounds=N that made them to continue them, another "
                          "--out, or --overwrite to replace them")
    saved_path = out / "config.json"
    if not saved_path.is_file():
        ours = [name for name in RUN_FILES if (out / name).exists()]
        if ours and existing != "overwrite":
            raise ConfigError(f"{out}: has {', '.join(ours)} but no config.json of the run that wrote them; give a "
                              "new folder, or --overwrite to replace them")
        if existing == "overwrite" and remove:  # an earlier run of rounds: its summary and rounds go
            for name in [*ours, *rounds]:
                remove_path(out / name)
        return "new"
    saved, current, changed = _compared(saved_path, config, inputs)
    if existing == "overwrite":
        if remove:
            for name in [*RUN_FILES, *rounds]:
                remove_path(out / name)
        return "overwrite"
    moved = _moved_round_keys(out, saved, current, inputs)  # a stopped round of a folder of rounds copied since
    changed = [k for k in changed if k not in moved]
    needs_resume = [k for k in changed if not keys_match(k, FREE_KEYS)]
    other = [k for k in needs_resume if not keys_match(k, RESUMABLE_KEYS)]
    if "method" in other:  # said first: beside another method's keys, the rest of the list is noise
        raise ConfigError(f"{out}: holds a run of {saved.get('method')}; this command trains {current.get('method')}. "
                          "Give another --out, or pass --overwrite to replace that run")
    # --overwrite on a round of on-policy rounds trains every round again, not that round alone
    start_over = ("--overwrite to train every round again" if re.fullmatch(r"round-\d+", out.name)
                  else "--overwrite to start over there")
    if other:
        raise ConfigError(f"{out}: made by another config ({describe_changes(other, saved, current)}); pass "
                          f"{start_over}, or give another --out")
    steps = (current.get("train") or {}).get("steps")
    if "train.steps" in needs_resume and isinstance(steps, int) and (shorter := shorter_than_trained(out, steps)):
        raise ConfigError(shorter)  # said before --resume is suggested: --resume would only lead to it
    if needs_resume and existing != "resume":
        raise ConfigError(f"{out}: started with {describe_changes(needs_resume, saved, current, old=True)}; pass "
                          f"--resume to continue it with the new values, or {start_over}")
    check_contents(out, contents or {})
    return "continue"


def shorter_than_trained(out: Path, steps: int) -> str | None:
    """Why a run of `steps` steps cannot continue OUT's when OUT has trained past them: its checkpoints would
    not restore into the shorter run's data order. None where it has not."""
    done = committed_steps(out / "checkpoints")
    if not done or done[-1] <= steps:
        return None
    return (f"{out}: already trained to step {done[-1]}, past the {counted(steps, 'step')} this config asks for; "
            f"give train.steps of at least {done[-1]} to continue it, or --overwrite to train the shorter run from "
            "the start")


# What a build manifest records of the circumstances, not of the examples: building the same again changes them.
BUILD_CIRCUMSTANCES = ("seconds", "dataset")


def input_contents(files: dict[str, str | None]) -> dict[str, dict[str, str]]:
    """{key: {"path", "digest"}} of each of `files` that is there: what OUT/inputs.json records. A build's
    digest is its manifest's, less how long it took and where its dataset lies (its settings, inputs'
    digests, counts per split: a newer polyalign that cuts otherwise changes them); a checkpoint folder's, its
    fingerprint (polyalign/model/hf.py)."""
    contents = {}
    for key, path in files.items():
        if not path or not as_path(path).exists():
            continue
        if as_path(path).is_dir():  # an init checkpoint
            from polyalign.model.hf import checkpoint_fingerprint  # heavy: jax; ownership is read without it

            try:
                digest = checkpoint_fingerprint(path)
            except CheckpointError:  # no weights there: loading it says so, after the run's own checks
                continue
        elif as_path(path).name == "manifest.json":
            manifest = json.loads(as_path(path).read_text(encoding="utf-8"))
            made = json.dumps({k: v for k, v in manifest.items() if k not in BUILD_CIRCUMSTANCES}, sort_keys=True,
                              default=str)
            digest = "sha256:" + hashlib.sha256(made.encode()).hexdigest()
        else:
            digest = file_digest(path)
        contents[key] = {"path": str(path), "digest": digest}
    return contents


def record_contents(out: Path, contents: dict[str, dict[str, str]]) -> None:
    """OUT/inputs.json, written as the run starts (by one process)."""
    (as_path(out) / "inputs.json").write_text(json.dumps(contents, indent=2) + "\n", encoding="utf-8")


def check_contents(out: Path, contents: dict[str, dict[str, str]]) -> None:
    """Refuses to continue a run whose input files hold something else since it started (OUT/inputs.json).
    A run recorded before inputs.json was written is not checked."""
    recorded_file = out / "inputs.json"
    if not recorded_file.is_file():
        return
    recorded = json.loads(recorded_file.read_text(encoding="utf-8"))
    changed = [key for key in contents if key in recorded and recorded[key]["digest"] != contents[key]["digest"]]
    if "init" in changed:  # the model it started from: its checkpoints went on from weights that are gone
        shown = _changed_inputs(["init"], recorded, contents)
        raise ConfigError(f"{out}: the run started from another model: {shown} holds other weights since (trained "
                          "or exported again); its checkpoints went on from what was there. Pass --overwrite to start "
                          "from the new init, or give another --out")
    if changed:
        shown = _changed_inputs(changed, recorded, contents)
        raise ConfigError(f"{out}: the run started on other data: {shown} {'hold' if len(changed) > 1 else 'holds'} "
                          "something else since (imported or built again); its checkpoints were trained on what was "
                          "there. Pass --overwrite to train on the new data from the start, or give another --out")


def _changed_inputs(keys: list[str], recorded: dict, contents: dict) -> str:
    return ", ".join(f"{key}={contents[key]['path']} ({recorded[key]['digest'][7:19]}… then, "
                     f"{contents[key]['digest'][7:19]}… now)" for key in keys)


def _moved_round_keys(out: Path, saved: dict[str, Any], current: dict[str, Any], keys) -> set[str]:
    """The `keys` whose paths name the same file of a folder of rounds that was moved or copied since: OUT is
    <rounds>/round-<r>, and the recorded path and this command's are that file under the recorded folder of
    rounds and under this one (round 2's init <rounds>/round-1/model, its pairs <rounds>/round-2/pairs/...).
    The recorded folder is where the recorded paths' round-<k> parts sit, all in one; a path under another
    run's rounds is no move and still differs."""
    if not re.fullmatch(r"round-\d+", Path(out).name):
        return set()
    flat_saved, flat_current = flatten(saved), flatten(current)

    def split(path):
        parts = Path(path).parts
        at = max((i for i, part in enumerate(parts) if re.fullmatch(r"round-\d+", part)), default=None)
        return (None, None) if at is None else (Path(*parts[:at]), parts[at:])

    recorded = {split(value)[0] for key in keys if isinstance(value := flat_saved.get(key), str)} - {None}
    here = Path(os.path.realpath(Path(out).parent))  # recorded paths are resolved (core/paths.py recorded_path)
    if len(recorded) != 1 or recorded == {here}:
        return set()
    moved = set()
    for key in keys:
        old, new = flat_saved.get(key), flat_current.get(key)
        if isinstance(old, str) and isinstance(new, str):
            (old_root, old_tail), (new_root, new_tail) = split(old), split(new)
            if old_root in recorded and new_root == here and old_tail == new_tail:
                moved.add(key)
    return moved


def _compared(saved_path: Path, config: dict[str, Any], inputs: dict[str, str | None]
              ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the recorded config, this one as JSON reads it back, the keys where they differ)."""
    saved = json.loads(saved_path.read_text())
    for key in inputs:  # runs recorded before paths were made absolute: read relative to this folder
        section, _, name = key.rpartition(".")
        holder = saved.get(section, {}) if section else saved
        if isinstance(holder, dict) and isinstance(holder.get(name), str):
            holder[name] = recorded_path(holder[name])
    current = json.loads(json.dumps(config, default=str))
    return saved, current, differing_keys(saved, current)


def check_finished_round(out: Path, config: dict[str, Any], inputs: dict[str, str | None],
                         unused: tuple[str, ...] = (), contents: dict[str, dict[str, str]] | None = None) -> None:
    """A finished round of an on-policy run (OUT/round-<r>) is kept only for the config that made it:
    any key but where a run stops, how it is laid out and what it logs (REPORTING_KEYS) differs, and the
    command is refused, as for one run. Later rounds train from this round's model, so a round cannot be
    continued with other values (`--resume`) or trained again alone: --overwrite trains every round again.
    `unused`: keys this round never read (round 1 trains on the given pairs: `on_policy.` is free there)."""
    saved_path = out / "config.json"
    if not saved_path.is_file():
        return
    saved, current, changed = _compared(saved_path, config, inputs)
    moved = _moved_round_keys(out, saved, current, inputs)
    other = [k for k in changed if not keys_match(k, FREE_KEYS + REPORTING_KEYS + unused) and k not in moved]
    if other:
        resumable = [k for k in other if keys_match(k, RESUMABLE_KEYS)]
        why = (f" ({', '.join(resumable)}: --resume continues a stopped round, not a finished one)"
               if resumable else "")
        raise ConfigError(f"{out}: a finished round of another config ({describe_changes(other, saved, current)})"
                          f"{why}; the rounds after it train from its model: pass --overwrite to train every round "
                          "again, or give another --out")
    check_contents(out, contents or {})  # nor one trained on pairs that are other pairs now

