"""What every stage's output shares: the settings that made it, what changed between those and a new
run's, and one writer at a time.

A stage records its settings (the options the user chose, paths included) beside its output. Running
the stage again with the same settings rewrites the output (every stage is deterministic, so that is
how a stage is rerun after its inputs changed); other settings are refused with the differing keys
named unless the user passes --overwrite. The digests of the inputs (`made_from`) are recorded too, for
the stages downstream to check."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Self

from polyalign.core.paths import recorded_path
from polyalign.core.yaml_config import ConfigError

LOCK = ".polyalign.lock"


# A training config's keys that say where a run stops and how it is laid out: the same model is computed
# under any of them (a run continues when only they changed).
FREE_KEYS = ("train.stop_at", "train.keep_checkpoints", "data.eval_batch", "parallel.", "train.hang_timeout",
             "train.peer_timeout")
# Keys that change what a run logs, checks or keeps, never the model it trains: a finished round of
# on-policy rounds is the same round under any of them.
REPORTING_KEYS = ("train.checkpoint_every", "train.eval_every", "train.log_every", "train.max_nonfinite",
                  "data.eval_limit", "train.report_to", "train.tracker_project", "train.peak_tflops",
                  "train.profile_steps")


def keys_match(key: str, patterns: tuple[str, ...]) -> bool:
    """Whether a dotted key is one of `patterns`, or inside one ending in a dot (a section)."""
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted keys; a list of mappings (a data config's sources) by index, so that a change
    names `config.sources[2].family`, not the whole list twice."""
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            for i, item in enumerate(value):
                flat.update(flatten(item, f"{prefix}{key}[{i}]."))
        else:
            flat[prefix + key] = value
    return flat


def differing_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    a, b = flatten(saved), flatten(current)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _shown(value: Any) -> str:
    """A setting's value as the config and command line write it: null, true, 0.8, 'text'."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def _setting(value: Any) -> str:
    """A recorded setting's value; None is a setting left unset (an option not given, a key an older run
    did not record), which "null" would not tell a user."""
    return "not set (the default)" if value is None else _shown(value)


def describe_changes(keys: list[str], saved: dict, current: dict, old: bool = False) -> str:
    a, b = flatten(saved), flatten(current)
    shown = [f"{k}={_shown(a.get(k))} (now {_shown(b.get(k))})" if old
             else f"{k}: {_setting(a.get(k))} there, {_setting(b.get(k))} now" for k in keys[:4]]
    return ", ".join(shown) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def same_path(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, ValueError):
        return False


def refuse_output_as_input(out: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None],
                           option: str = "--out") -> None:
    """An output may not be one of the command's own inputs: writing it would destroy what is read."""
    for name, path in inputs.items():
        if path is not None and same_path(out, path):
            raise ConfigError(f"{option} {out} is the command's own {name}; write the output somewhere else")


# Files that make a folder another stage's: a folder of one's own goes beside them, never into them.
STAGE_FOLDERS = (("data/manifest.json", "a prepared run"), ("build/manifest.json", "a built run"),
                 ("checkpoints", "a training run"), ("model/config.json", "a training run"),
                 ("config.json", "a model or training run"))


def other_stages_folder(out: str | os.PathLike, stage: str, inside: str,
                        also: tuple[tuple[str, str], ...] = (), own: tuple[str, ...] = ()) -> str | None:
    """One line when folder `out` is another stage's (a prepared run, a build, a training run, a model),
    suggesting the folder `inside` it (a path relative to `out`) for `stage`: `evaluate --out RUN` wrote its
    metrics and plots among prepare's files without a word. `own` names the files of STAGE_FOLDERS that are
    the stage's own folder's (prepare's RUN holds data/ and build/)."""
    folder = Path(out)
    for name, what in (*STAGE_FOLDERS, *also):
        if name not in own and (folder / name).exists():
            suggestion = os.path.normpath(folder / inside)
            return f"--out {out} is {what} ({name} is there): give {stage} a folder of its own, e.g. {suggestion}"
    return None


def sidecar(out: str | os.PathLike) -> Path:
    """Where a stage whose output is one file (predictions, pairs) records what made it:
    predictions.jsonl -> predictions.manifest.json."""
    out = Path(out)
    return out.with_name(out.stem + ".manifest.json")


def settings_record(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Settings as they read back from JSON (paths as strings, tuples as lists), so that the settings
    of a new run compare equal to the ones recorded by an identical earlier run."""
    return json.loads(json.dumps(dict(settings), default=str))


def check_settings(output: str | os.PathLike, record: str | os.PathLike, settings: Mapping[str, Any],
                   overwrite: bool, ours: Iterable[str | os.PathLike] = (), key: str | None = "settings",
                   elsewhere: str = "give another --out", paths: Iterable[str] = (),
                   legacy: Mapping[str, Any] | None = None,
                   view: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Refuses to write `output` over what other settings made. `record` is the JSON file holding the
    earlier run's settings under `key`; `ours` are the paths the stage writes (when one exists without
    a record, it is not known to be polyalign's, and is not replaced either). With `key` None the settings
    sit at the record's top level, beside what else it holds (prepare's manifest). `paths` are settings
    that name a file or folder: compared as core/paths.py recorded_path keeps them, so a record written
    with a relative path still matches the same path spelled another way. `legacy`: the value a setting
    had before records kept it (a record without the key was made with that value). `view`: what the
    settings mean, applied to both sides before they are compared (prepare's reads the config's defaults
    in, so a config that writes out a default matches one that leaves it)."""
    if overwrite:
        return
    record = Path(record)
    settings = _with_recorded_paths(settings, paths)
    seen = view or (lambda recorded: recorded)
    if not record.is_file():
        present = [str(p) for p in ours if Path(p).exists()]
        started = _with_legacy(_with_recorded_paths(_saved_settings(started_record(record)), paths), legacy)
        if present and started is not None:  # this stage's own unfinished output: the same command redoes it
            started, current = seen(started), seen(settings_record(settings))
            changed = differing_keys(started, current)
            if changed:
                raise ConfigError(f"{output}: an unfinished run with other settings was writing here "
                                  f"({describe_changes(changed, started, current)}); run that "
                                  "command again to finish it, or pass --overwrite to replace it")
            return
        if present:
            raise ConfigError(f"{output}: {', '.join(present)} exists without {record.name}, the record of the "
                              f"command that made it; pass --overwrite to replace it, or {elsewhere}")
        return
    saved = _with_legacy(_with_recorded_paths(_saved_settings(record, key, settings), paths), legacy)
    if saved is None:
        raise ConfigError(f"{record}: does not record the settings that made {output}; pass --overwrite to "
                          f"replace it, or {elsewhere}")
    saved, current = seen(saved), seen(settings_record(settings))
    changed = differing_keys(saved, current)
    if changed:
        raise ConfigError(f"{output}: made with other settings ({describe_changes(changed, saved, current)}); pass "
                          f"--overwrite to replace it, or {elsewhere}")


def _with_recorded_paths(settings: Mapping[str, Any] | None, paths: Iterable[str]) -> dict[str, Any] | None:
    if settings is None:
        return None
    return {**settings, **{k: recorded_path(settings[k]) for k in paths if isinstance(settings.get(k), str)}}


def _with_legacy(settings: dict[str, Any] | None, legacy: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if settings is None else {**(legacy or {}), **settings}


def started_record(record: str | os.PathLike) -> Path:
    """Where a stage notes the settings it is writing with until its own record is written."""
    return Path(record).parent / f".{Path(record).name}.started"


def _saved_settings(path: Path, key: str | None = "settings", names: Iterable[str] = ()) -> dict[str, Any] | None:
    """The settings a record file holds under `key` (with `key` None: its top-level entries `names`), or
    None when it holds none it can read."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
        saved = record.get(key) if key is not None else {name: record.get(name) for name in names}
    except (OSError, ValueError, AttributeError):
        return None
    return saved if isinstance(saved, dict) else None


def check_output(output: str | os.PathLike, record: str | os.PathLike, settings: Mapping[str, Any],
                 overwrite: bool, ours: Iterable[str | os.PathLike] = (),
                 inputs: Mapping[str, str | os.PathLike | None] | None = None, elsewhere: str = "give another --out",
                 option: str = "--out", key: str | None = "settings", paths: Iterable[str] = (),
                 legacy: Mapping[str, Any] | None = None,
                 view: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """stage_output's refusals alone, for a stage writing several outputs: it checks every one before it
    starts writing any, so a refusal of the second leaves no trace of the first."""
    if inputs:
        refuse_output_as_input(output, inputs, option)
    check_settings(output, record, settings, overwrite, ours, key=key, elsewhere=elsewhere, paths=paths,
                   legacy=legacy, view=view)


@contextlib.contextmanager
def no_empty_folder_left(folder: Path) -> Iterator[None]:
    """A folder the block creates (to hold a marker, a lock, a claim) is removed again when the block fails
    before writing anything into it, and so are the parents it created for it (`--out runs/new/sft` refused
    left runs/new): a refused or failed first run leaves no empty folder behind."""
    missing = []  # the folder and its parents that do not exist yet, innermost first
    for path in (Path(folder), *Path(folder).parents):
        if path.exists():
            break
        missing.append(path)
    try:
        yield
    except BaseException:
        for path in missing:
            if not path.is_dir() or any(path.iterdir()):
                break
            path.rmdir()
        raise


@contextlib.contextmanager
def stage_output(output: str | os.PathLike, record: str | os.PathLike, settings: Mapping[str, Any],
                 overwrite: bool, ours: Iterable[str | os.PathLike] = (),
                 inputs: Mapping[str, str | os.PathLike | None] | None = None,
                 lock: OutputLock | None = None, elsewhere: str = "give another --out",
                 option: str = "--out", key: str | None = "settings", paths: Iterable[str] = (),
                 legacy: Mapping[str, Any] | None = None,
                 view: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Iterator[None]:
    """The prologue and epilogue a stage's output shares: the output is none of its `inputs`, is not written
    over what other settings made (`check_settings`), is held by one writer (`lock`, default OUT's), and
    carries its settings as started while it is written. A run interrupted before its `record` is written
    thus restarts with the same command, which recognises its own unfinished output, while another
    command is refused naming the settings that differ. `option` names the output in refusals; `key` is
    where the record keeps the settings, `paths` which of them name files, `legacy` the values older
    records left unsaid and `view` what they mean (check_settings)."""
    check_output(output, record, settings, overwrite, ours, inputs, elsewhere, option, key, paths, legacy, view)
    started = started_record(record)
    lock = lock if lock is not None else OutputLock(Path(output))
    output = Path(output)
    with no_empty_folder_left(output), lock:
        if overwrite:  # what it recorded is being replaced: an interruption must not leave it claiming it
            Path(record).unlink(missing_ok=True)
        started.parent.mkdir(parents=True, exist_ok=True)
        started.write_text(json.dumps({"settings": settings_record(settings)}, ensure_ascii=False, default=str)
                           + "\n", encoding="utf-8")
        try:
            yield
        except BaseException:
            if not _written(output, {started, lock.path}):  # stopped before writing (a bad input): no resume
                started.unlink(missing_ok=True)
            raise
        started.unlink(missing_ok=True)


def _written(output: Path, own: set[Path]) -> bool:
    """Whether a stage wrote anything of its output: the file, or in the folder something beside the stage's
    own marker and lock."""
    if not output.is_dir():
        return output.exists()
    return any(path not in own for path in output.iterdir())


def write_record(path: str | os.PathLike, settings: Mapping[str, Any], made_from: Mapping[str, Any],
                 **summary: Any) -> None:
    """The record beside a one-file output: the settings that made it, its inputs' digests and a summary."""
    record = {"settings": settings_record(settings), "made_from": dict(made_from), **summary}
    Path(path).write_text(json.dumps(record, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")


def read_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """A one-file output's record, or None for a file polyalign did not write (an external engine's)."""
    try:
        record = json.loads(sidecar(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class OutputLock:
    """OUT/.polyalign.lock for as long as a run writes OUT; a second process is refused with the
    holder's pid and host. A lock left by a process that is gone (same host, pid not running) is taken
    over with a notice."""

    def __init__(self, out: Path, name: str = LOCK):
        self.path = Path(out) / name
        self.held = False

    @classmethod
    def for_file(cls, out: Path) -> OutputLock:
        """The lock of a one-file output: .NAME.lock beside it, so that two outputs in one folder do
        not wait for each other."""
        return cls(Path(out).parent, f".{Path(out).name}.lock")

    def __enter__(self) -> Self:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")})
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._gone(holder):
                    raise ConfigError(f"{self.path.parent}: another polyalign process (pid {holder.get('pid')} on "
                                      f"{holder.get('host')}, since {holder.get('since')}) is writing here; wait for "
                                      f"it, or remove {self.path} if it is gone") from None
                print(f"note: {self.path} was left by a process that is gone; taking it over")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(mine)
            self.held = True
            return self
        raise ConfigError(f"{self.path}: could not take the lock")

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def _holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return None  # unreadable: left half-written by a process that died

    @staticmethod
    def _gone(holder: dict[str, Any]) -> bool:
        if holder.get("host") != socket.gethostname():
            return False  # cannot tell from here
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
        return False
