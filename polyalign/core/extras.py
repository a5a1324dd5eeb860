"""Optional dependencies: what only some users need is an extra (`pip install 'polyalign[NAME]'`), and
a feature that needs one says which when it is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from polyalign.core.errors import PolyalignError


class MissingExtra(PolyalignError, ImportError):
    """A feature whose optional dependency is not installed; the message names the extra."""


def require(module: str, extra: str, purpose: str, hint: str = "") -> ModuleType:
    """`module` imported, or MissingExtra naming the extra that installs it and what needs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{purpose} needs the {extra!r} extra: pip install 'polyalign[{extra}]'"
                           + (f" ({hint})" if hint else "")) from None
