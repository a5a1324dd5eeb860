"""Progress bars for long work: tqdm's, off when the user asks (--no-progress) and when the output is
not a terminal, so that a log file or a CI transcript holds no bar frames."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm


def progress_bar(iterable: Iterable | None = None, *, progress: bool, **options: Any) -> tqdm:
    """tqdm(iterable, **options), shown only with `progress` and a terminal (tqdm's disable=None)."""
    return tqdm(iterable, disable=None if progress else True, **options)
