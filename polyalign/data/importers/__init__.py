"""Importers, one module per native format. Each module defines

- `read(path, file_tag) -> Iterator[Example | Malformed | Skipped]` for one file,
- `PATTERNS`: the file names it reads when a source points at a directory,
- `DEFAULTS`: the format's track/family/style when neither the rows nor the configuration say.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from polyalign.data.importers import chat, coig, convlab, crosswoz, kdconv, lccc, llamafactory, sharegpt, squad
from polyalign.data.importers.reading import source_files
from polyalign.data.records import ImportItem, InputError

_MODULES: dict[str, ModuleType] = {
    "llamafactory": llamafactory,
    "squad": squad,
    "kdconv": kdconv,
    "crosswoz": crosswoz,
    "lccc": lccc,
    "coig": coig,
    "convlab": convlab,
    "chat": chat,
    "sharegpt": sharegpt,
}
FORMAT_NAMES = tuple(_MODULES)


@dataclass(frozen=True)
class Format:
    name: str
    module: ModuleType

    @property
    def defaults(self) -> dict[str, str]:
        return dict(self.module.DEFAULTS)

    @property
    def summary(self) -> str:
        return (self.module.__doc__ or "").strip().splitlines()[0]


def get_format(name: str) -> Format:
    if name not in _MODULES:
        close = difflib.get_close_matches(name, FORMAT_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InputError(f"unknown format {name!r} (known: {', '.join(FORMAT_NAMES)}){hint}")
    return Format(name, _MODULES[name])


def _file_tag(file: Path, root: Path) -> str:
    """A short, stable name for a file inside a source, used in dialogue ids (`film-dev` for film/dev.json)."""
    base = root if root.is_dir() else file.parent
    try:
        relative = file.relative_to(base)
    except ValueError:
        relative = Path(file.name)
    name = relative.as_posix()
    for suffix in (".zip", ".jsonl", ".json", ".txt"):
        name = name.removesuffix(suffix)
    return name.replace("/", "-")


def read_file(format_name: str, file: Path, root: Path, offset: int = 0) -> Iterator[tuple[str | None, ImportItem]]:
    """The items of one file of a source, as (row key, item). Row keys continue the source's numbering
    from `offset`, the number of rows in the source's earlier files."""
    fmt = get_format(format_name)
    tag = _file_tag(file, root)
    # conversations numbered by their row take the offset themselves (their row number is their id)
    items = (fmt.module.read(file, tag, offset=offset) if getattr(fmt.module, "ROW_NUMBERED", False)
             else fmt.module.read(file, tag))
    for item in items:
        key = getattr(item, "key", None)
        if key is None and item.location.row is not None:
            key = f"{offset + item.location.row:06d}"
        yield key, item


def rows_in_file(format_name: str, file: Path, root: Path) -> int:
    """How far a file advances its source's row numbering (one past its last numbered row)."""
    return max((item.location.row + 1 for _, item in read_file(format_name, file, root)
                if item.location.row is not None), default=0)


def read_source(format_name: str, path: Path) -> Iterator[tuple[str | None, ImportItem]]:
    """All items of a source in source order, as (row key, item). Row sources number their rows across
    files in order (`000123`); dialogue sources carry `<dialogue id>-turn-<k>` on the Example."""
    fmt = get_format(format_name)
    offset = 0
    for file in source_files(path, fmt.module.PATTERNS):
        rows = 0
        for key, item in read_file(format_name, file, path, offset):
            if item.location.row is not None:
                rows = max(rows, item.location.row + 1)
            yield key, item
        offset += rows
