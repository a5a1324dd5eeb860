"""Markdown tables whose cells cannot break the table or inject HTML: report.md files embed bucket
names, dataset names and paths that come from users' data."""

from __future__ import annotations

import html
from collections.abc import Sequence


def cell(text: object) -> str:
    """One table cell: HTML escaped (most Markdown renderers pass raw HTML through), the pipe that would
    end the cell escaped, line breaks folded into spaces."""
    return html.escape(" ".join(str(text).splitlines()), quote=False).replace("|", "\\|")


def table(header: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
