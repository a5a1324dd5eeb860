"""The docs against the code they describe: every test a promise cites exists, every example a --help
shows parses, and the lists users read (extras, keys a run may change, range-checked subcommands) name
everything the code has (docs/ARCHITECTURE.md's homes and layering: tests/test_layout.py). A list written by hand goes
stale the day a name is added; these fail that day instead."""

import ast
import re
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


def cited_tests(text: str) -> list[tuple[str, str]]:
    """(test file, test name) for every `test_x.py::test_y` and every `::test_z` after it in `text`: a
    continuation names a test of the last file cited."""
    cited, current = [], None
    for match in re.finditer(r"(test_\w+\.py)?::(test_\w+)", text):
        current = match.group(1) or current
        if current is not None:
            cited.append((current, match.group(2)))
    return cited


def test_citations_read_continuations_as_tests_of_the_last_file():
    assert cited_tests("`test_a.py::test_one`, `::test_two`; `test_b.py::test_three`") == [
        ("test_a.py", "test_one"), ("test_a.py", "test_two"), ("test_b.py", "test_three")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_test_the_docs_cite_exists(doc):
    missing = []
    for file, name in cited_tests(doc.read_text(encoding="utf-8")):
        path = REPO / "tests" / file
        if not path.is_file() or name not in _test_names(path):
            missing.append(f"{file}::{name}")
    assert not missing, f"{doc.name} cites tests that do not exist: {missing}"


def test_the_readme_names_every_extra():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    said = readme[readme.index("The core install leaves out"):][:1500]
    assert [name for name in extras if f"`{name}`" not in said] == []


def test_training_docs_name_every_key_a_run_may_change_without_resume():
    from polyalign.train.ownership import FREE_KEYS

    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    said = text[text.index("An output folder belongs to the config"):][:1200]
    assert [key for key in FREE_KEYS if f"`{key.rstrip('.') + ('.*' if key.endswith('.') else '')}`" not in said] == []


def test_reliability_names_every_subcommand_whose_numbers_are_range_checked():
    from polyalign.cli import NUMBER_RANGES

    line = next(line for line in (REPO / "docs" / "reliability.md").read_text(encoding="utf-8").splitlines()
                if "`NUMBER_RANGES`" in line)
    listed = re.search(r"every subcommand \(([^)]*)\)", line).group(1)
    assert [command for command in NUMBER_RANGES if not re.search(rf"\b{command}\b", listed)] == []


def _parsers(parser, path=()):
    """(command words, parser) for `parser` and every subcommand under it."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def help_commands(text: str) -> list[str]:
    """The `polyalign ...` commands a help text shows as examples (a line of its own, or after "e.g." or
    "Then:"; not a phrase in a sentence), a line ending in a backslash joined to the next."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    # a command ends at its line's end, a backquote, or a gap of two spaces (a table's next column)
    return [re.split(r"\s{2,}", m.group(1).strip())[0]
            for m in re.finditer(r"(?m)^\s*(?:e\.g\.|Then:)?\s*polyalign ((?:[a-z]+ )+[^\n`]*)", joined)]


def test_every_command_a_help_text_shows_parses_and_a_training_one_says_where_it_writes():
    """The examples users copy from --help: each parses, and each `train` example gives --out (or
    --print-config), which a run cannot do without."""
    import shlex

    from polyalign.cli import build_parser

    root = build_parser()
    examples = 0
    for path, parser in _parsers(root):
        for command in help_commands(f"{parser.description or ''}\n{parser.epilog or ''}"):
            # a placeholder for a number (N, K) given as one
            words = [re.sub(r"^[A-Z]$", "1", w) for w in shlex.split(command.replace("...", "x"))]
            if not words or words[0] not in {p[0] for p, _ in _parsers(root) if p}:
                continue
            examples += 1
            try:
                root.parse_args(words)
            except SystemExit:
                pytest.fail(f"`polyalign {' '.join(path)} --help` shows `polyalign {command}`, which does not parse")
            if words[0] == "train" and len(words) > 2:
                assert "--out" in words or "--print-config" in words, (path, command)
    assert examples >= 10


def test_no_help_text_breaks_a_word_across_lines(monkeypatch):
    """argparse wraps help text at spaces, but cuts a run of characters longer than the column in the middle
    (`--stages` listed prepare,stats,...,sft,... and an 80-column terminal showed "sf" / "t"). At 80 columns
    an option's help column is at least 80 - 2 - 24 = 54 wide (argparse's max_help_position), a
    description's 78: no run of characters without a space or hyphen may be longer."""
    import argparse

    from polyalign.cli import build_parser

    monkeypatch.setenv("COLUMNS", "80")
    for path, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        texts = [(78, parser.description or ""), (78, parser.epilog or "")]
        texts += [(54, formatter._expand_help(a)) for a in parser._actions if a.help and a.help != argparse.SUPPRESS]
        for width, text in texts:
            for run in re.split(r"\s+|(?<=-)", text):
                assert len(run) <= width, f"`polyalign {' '.join(path)} --help`: {run!r} is cut across lines"
