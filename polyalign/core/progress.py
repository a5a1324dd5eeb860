"""Progress for long work: tqdm's bars on a terminal; where the output is not one (a log file, a job's
captured output, a CI transcript) a plain line now and then instead of bar frames; nothing with
--no-progress."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm.auto import tqdm

# Seconds between two lines in a log: some 120 lines an hour of training, six for a 3-minute stage.
LOG_LINE_SECONDS = 30.0
# A log line says where the work is without drawing a bar: "train: 40/120 [00:38<01:16, 1.05step/s, loss=5.2314]"
LOG_LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
LOG_LINE_FORMAT_UNKNOWN_TOTAL = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


class _Lines:
    """A stream for tqdm that turns its frames ("\\r" + text + padding) into whole lines and drops the
    bare line ends it writes between them."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _LogLineBar(tqdm):
    """tqdm writing lines to a log: a bar left unfinished (an error or a stop ended its loop) writes no
    last line when it is closed or collected, which may be after the error's message."""

    def close(self) -> None:
        if not self.disable and self.total is not None and self.n < self.total:
            self.leave = False
        super().close()


def progress_bar(iterable: Iterable | None = None, *, progress: bool, **options: Any) -> tqdm:
    """tqdm(iterable, **options): a bar on a terminal, a line every LOG_LINE_SECONDS (and at the start and
    the end) elsewhere, nothing without `progress`."""
    if not progress:
        return tqdm(iterable, disable=True, **options)
    stream = options.pop("file", None) or sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        return tqdm(iterable, file=stream, **options)
    known_total = options.get("total") is not None or hasattr(iterable, "__len__")
    options.update(mininterval=LOG_LINE_SECONDS, maxinterval=LOG_LINE_SECONDS, miniters=1, leave=True,
                   bar_format=LOG_LINE_FORMAT if known_total else LOG_LINE_FORMAT_UNKNOWN_TOTAL)
    return _LogLineBar(iterable, file=_Lines(stream), **options)
