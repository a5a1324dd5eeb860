"""What every stage's output folder shares: telling what changed between the settings that made it and
the settings of a new run, and one writer at a time."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Self

from polyalign.config import ConfigError

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


def describe_changes(keys: list[str], saved: dict, current: dict, old: bool = False) -> str:
    a, b = flatten(saved), flatten(current)
    shown = [f"{k}={a.get(k)!r} (now {b.get(k)!r})" if old else f"{k}: {a.get(k)!r} there, {b.get(k)!r} now"
             for k in keys[:4]]
    return ", ".join(shown) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


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
