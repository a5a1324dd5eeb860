"""Ctrl-C and SIGTERM that are never lost. Python ignores an exception raised inside a garbage-collector
callback (JAX runs one), so a KeyboardInterrupt that lands there vanishes and the stage runs on. While a
command runs, SIGINT also sets a flag, and long loops call `check_interrupted()`, which raises it again.
SIGTERM (a scheduler's stop, `kill`, `polyalign launch` stopping its other processes) is taken the same
way as `Terminated`, so that a command stopped before its own handler (the training loop's checkpoint on
SIGTERM) says so in one line instead of vanishing with status 143 and no word."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_requested: dict[int, threading.Event] = {signal.SIGINT: threading.Event(), signal.SIGTERM: threading.Event()}


TERMINATED = 128 + signal.SIGTERM  # the shell's status of a process SIGTERM ended; polyalign's after one
INTERRUPTED = 128 + signal.SIGINT  # the same for Ctrl-C (130)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the command stops as after Ctrl-C, and exits 143 as a process killed by it would."""


def _on_sigint(signum, frame) -> None:
    _requested[signal.SIGINT].set()
    raise KeyboardInterrupt


def _on_sigterm(signum, frame) -> None:
    # One stop, however many times it is asked for: a scheduler signalling every process of a job step
    # reaches a training process both directly and through its parent (mesh/supervisor.py), and a second
    # Terminated raised while the first unwinds would end the command with a traceback.
    if _requested[signal.SIGTERM].is_set():
        return
    _requested[signal.SIGTERM].set()
    raise Terminated


@contextlib.contextmanager
def interrupts_remembered() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt as usual and SIGTERM `Terminated`, each remembered for
    `check_interrupted` (main thread only, and only over Python's own handlers: a caller's handler is
    left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = {sig: handler for sig, handler, python_default in ((signal.SIGINT, _on_sigint, signal.default_int_handler),
                                                              (signal.SIGTERM, _on_sigterm, signal.SIG_DFL))
            if signal.getsignal(sig) is python_default}
    previous = {}
    for sig, handler in ours.items():
        _requested[sig].clear()
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
            _requested[sig].clear()


def check_interrupted() -> None:
    """Raises KeyboardInterrupt (Terminated for SIGTERM) if either came since the command started, even
    when the first was lost."""
    if _requested[signal.SIGTERM].is_set():
        raise Terminated
    if _requested[signal.SIGINT].is_set():
        raise KeyboardInterrupt
