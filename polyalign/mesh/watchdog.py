"""A job of several processes that stops making progress ends by itself.

Each process runs a watchdog thread. The training loop names the phase it enters ("step 7",
"evaluation after step 6", "checkpoint 6", "export"); a phase that lasts longer than the timeout
(`train.hang_timeout`) prints one line naming it, this process's Python stacks (every thread), and exits
with HANG_EXIT. A faulthandler timer a little later does the same without needing the interpreter lock,
in case the thread cannot run.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

HANG_EXIT = 3
# train.hang_timeout when it is not set and several processes run.
DEFAULT_MULTIPROCESS_TIMEOUT = 300.0
FIRST_SLACK = 4


def resolve_timeout(configured: float | None, process_count: int) -> float | None:
    """Seconds a phase may last; None: no watchdog (one process and nothing configured, or 0)."""
    if configured is None:
        return DEFAULT_MULTIPROCESS_TIMEOUT if process_count > 1 else None
    return float(configured) if configured > 0 else None


class Watchdog:
    def __init__(self, timeout: float | None, process_index: int = 0, process_count: int = 1,
                 stream=None):
        self.timeout = timeout
        self.process_index, self.process_count = process_index, process_count
        self.stream = stream or sys.stderr
        self._what, self._since, self._limit = "start", time.monotonic(), timeout
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = None

    @property
    def active(self) -> bool:
        return self.timeout is not None

    def phase(self, what: str, kind: str | None = None) -> None:
        """Enters phase `what`: its clock starts now. The first phase of each `kind` (the first step,
        evaluation or checkpoint, which compile or set up what the later ones reuse) may last
        FIRST_SLACK times the timeout."""
        first = kind is not None and kind not in self._seen
        if kind is not None:
            self._seen.add(kind)
        self._what, self._since = what, time.monotonic()
        if self.active:
            self._limit = self.timeout * (FIRST_SLACK if first else 1)
            if self._thread is not None:
                faulthandler.dump_traceback_later(self._limit + 30, exit=True, file=self.stream)

    def __enter__(self):
        if self.active:
            self._since, self._limit = time.monotonic(), self.timeout * FIRST_SLACK  # setup before the first phase
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="polyalign-watchdog", daemon=True)
            self._thread.start()
            faulthandler.dump_traceback_later(self._limit + 30, exit=True, file=self.stream)
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        interval = min(5.0, max(0.2, self.timeout / 20))
        while not self._stop.wait(interval):
            stuck = time.monotonic() - self._since
            if stuck > self._limit:
                self.fire(stuck)

    def fire(self, stuck: float) -> None:
        who = f"process {self.process_index} of {self.process_count}"
        print(f"polyalign: {who}: {self._what} made no progress for {stuck:.0f} s (train.hang_timeout="
              f"{self.timeout:g}{'' if self._limit == self.timeout else f', x{FIRST_SLACK} for a first one'}); "
              "stopping. The processes are out of step or one of them is gone; this "
              "process's stacks follow.", file=self.stream, flush=True)
        try:
            faulthandler.dump_traceback(file=self.stream, all_threads=True)
            self.stream.flush()
        finally:
            os._exit(HANG_EXIT)
