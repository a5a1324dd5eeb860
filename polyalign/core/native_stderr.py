"""What native code (C, C++) writes to the process's standard error, caught at the file descriptor:
Python's sys.stderr never sees it, so it can only be filtered there."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def captured_stderr_lines() -> Iterator[list[str]]:
    """Standard error of the block (native and Python writes alike) in a file instead of the terminal;
    the yielded list holds its lines once the block ends, for the caller to count, drop or pass on."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines.extend(capture.read().decode("utf-8", errors="replace").splitlines())
