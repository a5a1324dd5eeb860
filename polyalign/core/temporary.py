"""A process's temporary files and folders (the launcher's notices folder, a training process's parent's state
file): removed by the process when it ends, and by the next one on the same host when it was killed outright."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile


def process_temporary(prefix: str, suffix: str = "", folder: bool = False) -> str:
    """A new temporary file (or folder, with `folder`) named for this process and host
    (`PREFIX<pid>@<host>_...`; `_` ends the host, as no host name holds one), made after removing the ones of
    this host's processes that have ended: a process killed outright (a scheduler's SIGKILL at its time limit,
    the OOM killer) cannot remove its own, and every such job left one in /tmp. Another host's (a shared
    /tmp), a live process's and another prefix's are kept."""
    directory = tempfile.gettempdir()
    host = socket.gethostname()
    pattern = re.compile(re.escape(prefix) + r"(\d+)@" + re.escape(host) + "_")
    with contextlib.suppress(OSError):  # a courtesy: an unreadable temporary folder never stops a run
        for entry in os.scandir(directory):
            found = pattern.match(entry.name)
            if found is None or _process_alive(int(found[1])):
                continue
            with contextlib.suppress(OSError):  # another user's (sticky /tmp), or removed meanwhile
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
    name = f"{prefix}{os.getpid()}@{host}_"
    if folder:
        return tempfile.mkdtemp(prefix=name)
    handle, path = tempfile.mkstemp(prefix=name, suffix=suffix)
    os.close(handle)
    return path


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
