"""Where a prepared run keeps its files: RUN/data/NAME.jsonl, or the shards NAME-SSSSS-of-NNNNN.jsonl of
a Beam prepare with `--num-shards N`. The manifest's `engine.num_shards` says which layout the last
prepare wrote, so that every reader (build, stats, the tokenizer) reads that layout and nothing an
earlier prepare of the other layout left."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from polyalign.core.outputs import other_stages_folder
from polyalign.core.paths import file_digest, remove_path
from polyalign.core.yaml_config import ConfigError

EXACT_DUPLICATES = "exact_duplicates"
# Every file a prepare writes in RUN/data, by stem (data/prepare.py and beam/prepare.py).
OUTPUT_STEMS = ("train", "val", "test", "dropped", "quarantine", EXACT_DUPLICATES, "near_duplicates")
# Where a Beam prepare sums its event counts (the manifest's) before it writes the manifest.
BEAM_EVENTS_DIR = "_beam_events"
# What a Beam run leaves in RUN/data while it writes, or when it is stopped: its temporary shards and
# its event counts.
BEAM_LEFTOVERS = ("beam-temp-*", BEAM_EVENTS_DIR)
_SHARD = re.compile(r"^(?P<stem>[a-z_]+)-\d{5}-of-(?P<count>\d{5})\.jsonl$")


def file_names(stem: str, num_shards: int) -> list[str]:
    """The names a prepare writing `num_shards` shards gives the output `stem`."""
    if num_shards == 1:
        return [f"{stem}.jsonl"]
    return [f"{stem}-{index:05d}-of-{num_shards:05d}.jsonl" for index in range(num_shards)]


def file_label(stem: str, num_shards: int) -> str:
    """How the manifest and the console name an output: its file, or the pattern of its shards."""
    return f"{stem}.jsonl" if num_shards == 1 else f"{stem}-*-of-{num_shards:05d}.jsonl"


def edited_records_files(data_dir: Path, manifest: dict) -> list[str]:
    """The records files (train, val, test, of either layout) whose bytes are not those prepare wrote, by
    the manifest's `file_digests`: an edit that keeps the count of records is one too. A manifest
    without digests has none to tell by."""
    digests = manifest.get("file_digests")
    if not isinstance(digests, dict):
        return []
    edited = []
    for name, digest in sorted(digests.items()):
        shard = _SHARD.match(name)
        stem = shard["stem"] if shard else name.removesuffix(".jsonl")
        path = Path(data_dir) / name
        if stem in ("train", "val", "test") and (not path.is_file() or file_digest(path) != digest):
            edited.append(name)
    return edited


def recorded_shards(data_dir: Path) -> int | None:
    """The shard count the run's manifest records (1 for a single-machine prepare), or None without a
    manifest it can read."""
    try:
        manifest = json.loads((Path(data_dir) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    engine = manifest.get("engine") if isinstance(manifest, dict) else None
    shards = engine.get("num_shards", 1) if isinstance(engine, dict) else 1
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ConfigError(f"{Path(data_dir) / 'manifest.json'}: engine.num_shards is {shards!r}, not a shard count; "
                          "run its `polyalign prepare` again")
    return shards


def split_files(run: Path, split: str) -> list[Path]:
    """A prepared split's files in the layout the manifest records. Without a manifest, whichever layout
    is there; both there is refused, since one of them is an earlier prepare's."""
    data = Path(run) / "data"
    num_shards = recorded_shards(data)
    if num_shards is not None:
        files = [data / name for name in file_names(split, num_shards)]
        missing = [path for path in files if not path.is_file()]
        if missing:
            raise ConfigError(f"{missing[0]}: missing ({data / 'manifest.json'} records "
                              f"{file_label(split, num_shards)}); the run directory is incomplete: run its "
                              "`polyalign prepare` again")
        return files
    single, shards = data / f"{split}.jsonl", sorted(data.glob(f"{split}-*-of-*.jsonl"))
    if single.is_file() and shards:
        raise ConfigError(f"{data}: holds both {single.name} and {len(shards)} shards {shards[0].name}, ... and no "
                          "manifest.json to say which is the prepared split; prepare it again with --overwrite")
    if not single.is_file() and not shards:
        raise ConfigError(f"{single}: missing; run `polyalign prepare` (or the demo's prepare stage) first")
    return [single] if single.is_file() else shards


def owned_files(data_dir: Path) -> list[Path]:
    """What in RUN/data bears a name a prepare writes (either layout) or a Beam run leaves: stage_output's
    `ours`, so that such files without a manifest (a user's own, not known to be polyalign's) are refused,
    never replaced, and what `clear_outputs` removes once a prepare may write."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        return []
    owned = [path for path in sorted(data_dir.glob("*.jsonl")) if path.stem in OUTPUT_STEMS or (
        (shard := _SHARD.match(path.name)) is not None and shard["stem"] in OUTPUT_STEMS)]
    return owned + [path for pattern in BEAM_LEFTOVERS for path in sorted(data_dir.glob(pattern))]


def refuse_sources_inside(data_dir: Path, source_files: list[list[Path]]) -> None:
    """A source file inside RUN/data would be among what a prepare rewrites there: refused, naming it."""
    data_dir = Path(data_dir).resolve()
    for files in source_files:
        for path in files:
            if Path(path).resolve().is_relative_to(data_dir):
                raise ConfigError(f"{path}: a source file inside {data_dir}, the folder prepare writes its splits "
                                  "into; move the source, or give another --out")


def refuse_other_stages_folder(out: Path) -> None:
    """`prepare --out` a training run, a model or an evaluation put data/ among their files without a word:
    refused, suggesting a folder beside it. A prepared (and built) run is prepare's own."""
    if elsewhere := other_stages_folder(out, "prepare", f"../{Path(out).resolve().name}-data",
                                        also=(("metrics.json", "an evaluation"),),
                                        own=("data/manifest.json", "build/manifest.json")):
        raise ConfigError(elsewhere)


def prepare_manifest(data_dir) -> dict:
    """RUN/data/manifest.json, or one line saying it is missing or damaged and what to run: statistics
    and builds read it, and a file cut short raised a JSON traceback."""
    path = Path(str(data_dir)) / "manifest.json"
    if not path.is_file():
        run = Path(str(data_dir)).parent
        raise ConfigError(f"{path}: missing; run `polyalign prepare --config CONFIG --out {run}` first (it writes "
                          "RUN/data with its manifest)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: damaged, not JSON ({err}); run `polyalign prepare` again") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("scheme"), dict):
        raise ConfigError(f"{path}: not a prepare manifest; run `polyalign prepare` again")
    return manifest


def recorded_files(data_dir: Path) -> set[str] | None:
    """The files the folder's manifest says its prepare wrote (`file_digests`), or None without one."""
    try:
        manifest = json.loads((Path(data_dir) / "manifest.json").read_text(encoding="utf-8"))
        return set(manifest["file_digests"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_outputs(data_dir: Path, num_shards: int, recorded: set[str] | None) -> list[str]:
    """Removes what an earlier prepare wrote in RUN/data, of either layout, and a stopped Beam run's
    leftovers, before a prepare writing `num_shards` shards starts (stage_output has allowed it: the
    folder's manifest says a prepare wrote them, or --overwrite): what it does not write again must not stay
    beside what it writes. Where the folder's manifest listed its files (`recorded`, read before
    --overwrite removed it), only those and the names this prepare writes are removed: a user's own file
    named like a shard stays. Returns the removed names this prepare will not write again (another layout's,
    leftovers), for a note."""
    current = {name for stem in OUTPUT_STEMS for name in file_names(stem, num_shards)}
    removed = []
    for path in owned_files(data_dir):
        if recorded is not None and path.is_file() and path.name not in current | recorded:
            continue
        remove_path(path)
        removed += [] if path.name in current else [path.name]
    return removed


def stale_note(data_dir: Path, removed: list[str]) -> str | None:
    """One line naming what `clear_outputs` removed that this prepare does not write again, or None."""
    if not removed:
        return None
    shown = ", ".join(removed[:4]) + (f" and {len(removed) - 4} more" if len(removed) > 4 else "")
    return (f"note: removed {len(removed)} file(s) an earlier prepare left in {data_dir} that this one did not "
            f"write ({shown}), so that nothing reads them as this run's data")


def quarantined_records(manifest: dict[str, Any]) -> int:
    """How many records a prepare quarantined (an earlier manifest named the count `rows`: it counted records)."""
    quarantine = manifest.get("quarantine") or {}
    return int(quarantine.get("records", quarantine.get("rows", 0)))
