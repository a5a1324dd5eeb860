"""The Beam environment: apache-beam pins older protobuf, pyarrow and pillow than the rest of polyalign
resolves to, so Beam code runs in an interpreter of its own (the `beam` extra; the README's test command
makes .venv-beam), on this checkout's polyalign. Not a test module."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def beam_python() -> str:
    """An interpreter with apache-beam: POLYALIGN_BEAM_PYTHON, the README's .venv-beam, or this one."""
    candidates = [os.environ.get("POLYALIGN_BEAM_PYTHON"), str(REPO / ".venv-beam" / "bin" / "python")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    if importlib.util.find_spec("apache_beam") is not None:
        return sys.executable
    pytest.fail("the Beam tests need an interpreter with apache-beam: run the README's test command (it makes "
                ".venv-beam with `pip install -e '.[beam,langid]'`) or set POLYALIGN_BEAM_PYTHON")


def in_beam_env(code: str, *args: str) -> subprocess.CompletedProcess:
    """Runs `code` (with sys.argv[1:] = args) in the Beam environment on this checkout's polyalign."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu"}
    return subprocess.run([beam_python(), "-c", code, *args], capture_output=True, text=True, env=env, timeout=1800)
