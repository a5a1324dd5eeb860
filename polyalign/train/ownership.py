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
A lock file refuses a second process writing the same folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Self

from polyalign.config import ConfigError

EXISTING = ("continue", "resume", "overwrite")
FREE_KEYS = ("train.stop_at", "train.keep_checkpoints", "data.eval_batch", "parallel.")
RESUMABLE_KEYS = ("train.steps", "train.epochs", "train.checkpoint_every", "train.eval_every", "train.log_every",
                  "train.max_nonfinite", "data.eval_limit")
# What a run writes into OUT, removed by --overwrite; anything else in the folder is left alone.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints", "tensorboard", "model",
             "critic.json", "critic.safetensors", "train_pairs.jsonl", "val_pairs.jsonl")
LOCK = ".polyalign.lock"


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def differing_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    a, b = flatten(saved), flatten(current)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def claim(out: Path, config: dict[str, Any], inputs: dict[str, str | None], existing: str = "continue",
          remove: bool = True) -> str:
    """Checks that OUT may receive the run `config` describes; returns "new", "continue" or "overwrite"
    (after removing what the earlier run wrote, where `remove`: one process of several does that).
    `inputs` are the paths the run reads, by key, none of which may be OUT itself."""
    if existing not in EXISTING:
        raise ValueError(f"existing must be one of {EXISTING}")
    for key, path in inputs.items():
        if path and _same_path(out, path):
            raise ConfigError(f"--out {out} is the run's own {key}; write the output somewhere else")
    saved_path = out / "config.json"
    if not saved_path.is_file():
        ours = [name for name in RUN_FILES if (out / name).exists()]
        if ours and existing != "overwrite":
            raise ConfigError(f"{out}: has {', '.join(ours)} but no config.json of the run that wrote them; give a "
                              "new folder, or --overwrite to replace them")
        return "new"
    saved = json.loads(saved_path.read_text())
    current = json.loads(json.dumps(config, default=str))
    changed = differing_keys(saved, current)
    if existing == "overwrite":
        if remove:
            for name in RUN_FILES:
                target = out / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        return "overwrite"
    needs_resume = [k for k in changed if not _matches(k, FREE_KEYS)]
    other = [k for k in needs_resume if not _matches(k, RESUMABLE_KEYS)]
    if other:
        raise ConfigError(f"{out}: made by another config ({_describe(other, saved, current)}); pass --overwrite "
                          "to start over there, or give another --out")
    if needs_resume and existing != "resume":
        raise ConfigError(f"{out}: started with {_describe(needs_resume, saved, current, old=True)}; pass --resume "
                          "to continue it with the new values, or --overwrite to start over")
    return "continue"


def _describe(keys: list[str], saved: dict, current: dict, old: bool = False) -> str:
    a, b = flatten(saved), flatten(current)
    shown = [f"{k}={a.get(k)!r} (now {b.get(k)!r})" if old else f"{k}: {a.get(k)!r} there, {b.get(k)!r} now"
             for k in keys[:4]]
    return ", ".join(shown) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _same_path(out: Path, other: str) -> bool:
    try:
        return Path(out).resolve() == Path(other).resolve()
    except (OSError, ValueError):
        return False


class OutputLock:
    """OUT/.polyalign.lock for as long as a run writes OUT; a second process is refused with the
    holder's pid and host. A lock left by a process that is gone (same host, pid not running) is taken
    over with a notice."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK
        self.held = False

    def __enter__(self) -> Self:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")})
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
