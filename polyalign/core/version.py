"""polyalign's version: the package's own, else the installed distribution's.

`python -m polyalign` puts the working folder first on sys.path; run from a folder that holds a folder named
polyalign (the parent of a clone), Python takes that folder for a namespace package while an editable
install's finder still serves the modules, so `polyalign.__version__` is missing there. The distribution's
metadata says it then.
"""

from __future__ import annotations

import importlib.metadata

import polyalign


def polyalign_version() -> str:
    own = getattr(polyalign, "__version__", None)  # the checkout actually imported, installed or not
    if own is not None:
        return own
    try:
        return importlib.metadata.version("polyalign")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
