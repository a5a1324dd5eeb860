"""The lint CI runs before the tests: the repository passes it, and it fails what it is there to catch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True)


def test_the_repository_passes_the_lint():
    done = ruff(".")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


def test_a_long_line_and_an_unused_import_fail_the_lint(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nVALUE = " + repr("x" * 120) + "\n", encoding="utf-8")
    done = ruff("--config", str(ROOT / "pyproject.toml"), "--output-format", "concise", str(bad), cwd=tmp_path)
    assert done.returncode == 1
    assert "bad.py:1:8: F401" in done.stdout and "bad.py:3:121: E501" in done.stdout, done.stdout
    good = tmp_path / "good.py"
    good.write_text("VALUE = " + repr("x" * 100) + "\n", encoding="utf-8")
    assert ruff("--config", str(ROOT / "pyproject.toml"), str(good), cwd=tmp_path).returncode == 0
