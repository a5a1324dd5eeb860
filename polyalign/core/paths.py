"""Paths that may be local or in a bucket (gs://, s3://): etils.epath, the file layer Orbax and TFDS use.

pathlib would turn "gs://bucket/run" into "gs:/bucket/run"; everything that writes training outputs or
reads checkpoints goes through `as_path` instead, so a URI reaches the libraries intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

from etils import epath

URI_PREFIXES = ("gs://", "s3://", "az://")


def is_uri(path: str | os.PathLike) -> bool:
    return str(path).startswith(URI_PREFIXES)


def as_path(path: str | os.PathLike) -> epath.Path:
    """An epath.Path: a bucket URI as given, a local path with ~ expanded and made absolute."""
    if is_uri(path):
        return epath.Path(str(path))
    return epath.Path(os.path.abspath(os.path.expanduser(str(path))))


def recorded_path(path: str | os.PathLike | None) -> str | None:
    """A path as a record of settings keeps it: a bucket URI as given, a local path absolute with links
    resolved, so that `run`, `./run` and `/home/me/run` are one setting whichever folder a command is
    started from (a preempted job resubmitted elsewhere still continues its run)."""
    if path is None or is_uri(path):
        return None if path is None else str(path)
    return os.path.realpath(os.path.expanduser(str(path)))


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, local or in a bucket: what a later stage compares to tell whether the
    input it was made from has been replaced."""
    digest = hashlib.sha256()
    with as_path(path).open("rb") as handle:  # in chunks: a large pairs file or shard is never held whole
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def files_digest(files) -> str | dict[str, str]:
    """The digest of what a list of files holds: the one file's, or each shard's by name (a Beam prepare's
    split), as a record's `made_from` keeps it."""
    files = list(files)
    return file_digest(files[0]) if len(files) == 1 else {os.path.basename(str(f)): file_digest(f) for f in files}


def remove_path(path) -> None:
    """A file or folder, local or on a bucket (epath), if it is there."""
    if not path.exists():
        return
    if path.is_dir():
        path.rmtree() if hasattr(path, "rmtree") else shutil.rmtree(path)
    else:
        path.unlink()


def replace_text(path, text: str) -> None:
    """Writes `path` whole or not at all: into a file beside it, then renamed over it, so that a process killed
    while writing leaves the old file (a local path; a bucket's objects are written whole anyway)."""
    path = as_path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def checkpoint_identity(path: str | os.PathLike) -> dict[str, Any]:
    """What tells one checkpoint folder from another without reading its weights: the digest of its
    config and the size and modification time of every weight file. Recorded by the outputs made with
    it, for a reader to tell which model they came from."""
    folder = as_path(path)
    identity: dict[str, Any] = {"path": str(folder)}
    if (folder / "config.json").is_file():
        identity["config"] = file_digest(folder / "config.json")
    if not is_uri(folder) and folder.is_dir():
        stats = {p.name: os.stat(p) for p in sorted(folder.glob("*.safetensors"))}
        identity["weights"] = {name: {"bytes": s.st_size, "modified_ns": s.st_mtime_ns} for name, s in stats.items()}
    return identity


def changed_since(base: str | os.PathLike, made_from: dict[str, str | None]) -> list[str]:
    """The files named in `made_from` (paths relative to `base`, with the digests they had when an
    output was made from them) that differ now. A missing one is not counted: an output copied without
    its inputs (a build alone in a bucket, say) cannot be checked, and is not wrong for that. A digest
    of None records a file absent then: one there now counts as changed."""
    changed = []
    for name, digest in made_from.items():
        path = as_path(base) / name
        if path.is_file() and (digest is None or file_digest(path) != digest):
            changed.append(name)
    return changed


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """Steps whose checkpoint is complete on disk in `directory` (a folder named by its step alone; a write
    in progress or cut short has another name), read from the folder: nothing is created or opened."""
    try:
        return sorted(int(p.name) for p in as_path(directory).iterdir() if p.name.isdigit())
    except OSError:
        return []


def run_segments(out: str | os.PathLike) -> list[dict]:
    """The invocations that trained the run in OUT, oldest first (OUT/summary.json's `segments`): each one's
    start_step, end_step and the train.steps it ran with. A summary written before segments were kept counts
    as one invocation, of unknown length."""
    try:
        summary = json.loads((as_path(out) / "summary.json").read_text())
    except (OSError, ValueError):  # a new run, or one that never finished an invocation
        return []
    if not isinstance(summary, dict):
        return []
    if isinstance(summary.get("segments"), list):
        return summary["segments"]
    if "end_step" in summary:
        return [{"start_step": summary.get("start_step", 0), "end_step": summary["end_step"], "steps": None}]
    return []


def length_history(segments: list[dict], steps: int) -> str | None:
    """How the run's length changed on resume, where it did: `30 (train.steps 20 up to step 20, then 30)`, the
    steps in all and the schedules they followed (a resumed run with another train.steps follows the new
    length's schedule from where it resumed); None where it never changed."""
    changes: list[tuple[int, int]] = []  # (train.steps, the step it took over at)
    for segment in segments:
        if segment.get("steps") is not None and (not changes or changes[-1][0] != segment["steps"]):
            changes.append((segment["steps"], segment["start_step"]))
    if changes and changes[-1][0] != steps:  # the invocation under way, before its segment is written
        changes.append((steps, segments[-1].get("end_step")))
    if len(changes) < 2:
        return None
    earlier = ", ".join(f"{n} up to step {later[1]}" for (n, _), later in zip(changes, changes[1:]))
    return f"{steps} (train.steps {earlier}, then {steps})"


# The file a training export writes into its model folder: the run's config and the invocations that trained
# it, so that a model folder copied out of its run (to a shared drive, a hub) still says how it was trained.
TRAINING_RECORD = "polyalign_training.json"


def _training_config(path) -> dict[str, Any] | None:
    try:
        config = json.loads(as_path(path).read_text())
    except (OSError, ValueError):  # none there, or not JSON: not a training run's
        return None
    return config if isinstance(config, dict) and "method" in config else None


def build_setting(config: dict[str, Any], key: str) -> tuple[Any, str] | None:
    """A setting (max_length, truncation...) of the build an SFT run trained on (its data.dir's build
    manifest, which holds what an SFT config leaves unset) and where it was read; None where the run's data
    moved, was never built there, or the manifest lacks it."""
    data_dir = (config.get("data") or {}).get("dir")
    if not isinstance(data_dir, str) or not data_dir:
        return None
    build = as_path(data_dir) / "build"
    try:
        value = json.loads((build / "manifest.json").read_text())["settings"][key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value, f"the build it trained on, {build}"


def training_record(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """How the model in `checkpoint` was trained, where polyalign trained it: {"config": its run's config,
    "segments": the invocations (run_segments), "run": the run's folder where the model is still in it, else
    None, "round": {"number", "of"} for a round of on-policy rounds, else None}. The model folder's own record
    (TRAINING_RECORD) comes first: it travels with the weights; a model exported before there was one reads
    OUT/config.json beside it. None for any other checkpoint."""
    folder = as_path(checkpoint)
    run = folder.parent if _training_config(folder.parent / "config.json") is not None else None
    try:
        record = json.loads((folder / TRAINING_RECORD).read_text())
    except (OSError, ValueError):  # exported before the record, or not a polyalign export
        record = None
    if isinstance(record, dict) and isinstance(record.get("config"), dict) and "method" in record["config"]:
        segments = record.get("segments")
        round_of = record.get("round")
        return {"config": record["config"], "segments": segments if isinstance(segments, list) else [], "run": run,
                "round": round_of if isinstance(round_of, dict) else None}
    if run is None:
        return None
    return {"config": _training_config(run / "config.json"), "segments": run_segments(run), "run": run, "round": None}

