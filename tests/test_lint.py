"""The lint CI runs before the tests: the repository passes it, and it fails what it is there to catch."""

import ast
import io
import subprocess
import sys
import tokenize
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


def unexplained_local_imports(source: str, name: str = "<source>") -> list[str]:
    """`name:line: import` for every import inside a function (or a method, or anything nested in one)
    with no comment on its own line(s) and no comment line just above it (CONTRIBUTING.md, "Lint and
    layout")."""
    lines = source.splitlines()
    comments = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                own = comments.intersection(range(child.lineno, child.end_lineno + 1))
                above = child.lineno - 1
                if not own and not (above in comments and lines[above - 1].lstrip().startswith("#")):
                    found.append(f"{name}:{child.lineno}: {ast.unparse(child)}")
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return found


def test_a_function_local_import_without_a_comment_is_found():
    source = """import os


def f():
    import json
    # heavy: numpy, kept out of --help
    import numpy as np
    from polyalign.core import paths  # import cycle: polyalign.core.paths imports this module

    class Inner:
        def method(self):
            from collections import (
                Counter,  # not needed at import time
            )
            # a comment above a statement that is no import

            import re
            return json, np, paths, Counter, re
    return Inner
"""
    assert unexplained_local_imports(source) == ["<source>:5: import json", "<source>:17: import re"]


def test_every_function_local_import_says_why():
    """An import inside a function in polyalign/ carries a comment saying why it is not at the top: on
    its own line, or on the comment line just above it."""
    found = [line for path in sorted((ROOT / "polyalign").rglob("*.py"))
             for line in unexplained_local_imports(path.read_text(encoding="utf-8"),
                                                   str(path.relative_to(ROOT)))]
    assert found == [], (f"{len(found)} function-local imports without a comment saying why (move them to the "
                         "top, or say why they stay: CONTRIBUTING.md, Lint and layout):\n" + "\n".join(found))
