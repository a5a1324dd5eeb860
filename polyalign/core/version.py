"""polyalign's version, as the installed distribution says it.

`python -m polyalign` puts the working folder first on sys.path; run from a folder that holds a folder named
polyalign (the parent of a clone), Python takes that folder for a namespace package while an editable
install's finder still serves the modules, so `polyalign.__version__` is missing. The distribution's metadata
is there either way.
"""

from __future__ import annotations

import importlib.metadata


def polyalign_version() -> str:
    try:
        return importlib.metadata.version("polyalign")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        import polyalign  # the package itself: nothing else says its version then

        return getattr(polyalign, "__version__", "unknown")
