"""Ctrl-C that is never lost. Python ignores an exception raised inside a garbage-collector callback
(JAX runs one), so a KeyboardInterrupt that lands there vanishes and the stage runs on. While a command
runs, SIGINT also sets a flag, and long loops call `check_interrupted()`, which raises it again."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_requested = threading.Event()


def _on_sigint(signum, frame) -> None:
    _requested.set()
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_remembered() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt as usual and is remembered for `check_interrupted` (main thread
    only, and only over Python's own handler: a caller's handler is left alone)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    _requested.clear()
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _requested.clear()


def check_interrupted() -> None:
    """Raises KeyboardInterrupt if Ctrl-C came since the command started, even when the first was lost."""
    if _requested.is_set():
        raise KeyboardInterrupt
