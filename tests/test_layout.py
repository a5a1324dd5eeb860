"""The package's shape: every module imports, every module lives in a named home, no import circle
(module or home level, function-local imports included), and one layering rule per home."""

import ast
import importlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "polyalign"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the polyalign modules it imports anywhere in its text (top level or in a function).
    `from a import b` counts as importing a.b when that is a module, else a."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(parent[:len(parent) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges.update(t for t in map(resolve, (t for t in targets if t.startswith("polyalign"))) if t and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _unit(module: str) -> str:
    """The room a module belongs to: its subpackage of polyalign, or itself when top level."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = import_graph(_modules())
    assert len(graph) > 60
    assert cycles(graph) == []
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        units.setdefault(_unit(module), set()).update(_unit(t) for t in targets if _unit(t) != _unit(module))
    assert cycles(units) == []


# What each home may import besides itself (and the package's own __init__, for the version): lower homes
# never reach higher ones. A new folder under polyalign/ needs a line here before the suite passes.
HOME_IMPORTS = {
    "core": set(),
    "mesh": {"core"},
    "data": {"core"},
    "tokens": {"core", "data"},
    "model": {"core", "mesh", "tokens"},
    "features": {"core", "data", "model"},
    "generate": {"core", "data", "mesh", "model", "tokens"},
    "inputs": {"core", "data", "model", "tokens"},
    "pairs": {"core", "data", "generate"},
    "reports": {"core", "data", "features", "inputs"},  # the stats report says what weights RUN/build trains with
    "evaluate": {"core", "data", "features", "generate", "model", "reports", "tokens"},
    "train": {"core", "data", "features", "generate", "inputs", "mesh", "model", "pairs", "tokens"},
    "beam": {"core", "data", "inputs", "model", "tokens"},
}
# The face: the only modules outside a home, free to import any.
FACE = {"polyalign", "polyalign.__main__", "polyalign.cli", "polyalign.demo"}


def home_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) for every import HOME_IMPORTS does not allow."""
    def home(module: str) -> str:
        return module.split(".")[1] if module.count(".") else ""

    found = []
    for module, targets in graph.items():
        if module in FACE:
            continue
        allowed = HOME_IMPORTS[home(module)] | {home(module)}
        found += [(module, t) for t in sorted(targets) if t != "polyalign" and home(t) not in allowed]
    return found


def test_every_module_lives_in_a_named_home():
    modules = _modules()
    homes = {name.split(".")[1] for name, path in modules.items() if name not in FACE and path.parent != PACKAGE}
    assert homes == set(HOME_IMPORTS)
    assert sorted(m for m in modules if m.count(".") == 1 and (PACKAGE / f"{m.split('.')[1]}.py").exists()) \
        == sorted(FACE - {"polyalign"})
    # No two modules whose names would be confused for each other (config.py, text.py twice). Stage entry
    # points share their verb across homes; importers are named by the format a source config names.
    stems = [path.stem for path in modules.values() if path.stem != "__init__" and path.parent.name != "importers"]
    assert sorted({s for s in stems if stems.count(s) > 1} - {"run", "build", "prepare"}) == []


def test_the_layering_rules_catch_a_planted_upward_import():
    graph = {"polyalign.core.paths": {"polyalign.train.run"}, "polyalign.mesh.parallel": {"polyalign.core.errors"},
             "polyalign.cli": {"polyalign.train.run"}, "polyalign.tokens.chat": {"polyalign"}}
    assert home_violations(graph) == [("polyalign.core.paths", "polyalign.train.run")]


def test_layering():
    graph = import_graph(_modules())
    assert home_violations(graph) == []
    # losses are pure functions of arrays
    assert graph["polyalign.train.losses"] == set()


def test_test_modules_share_helpers_only_through_helper_modules():
    """A test module imports what tests share from conftest.py or a helper module (tests/cli_runs.py,
    train_checks.py, ...), never another test module's private helpers."""
    tests = Path(__file__).resolve().parent
    imported = {}
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.test_"):
                imported.setdefault(path.name, []).append(node.module)
    assert imported == {}


# Modules that import apache-beam at the top: they load in the Beam environment (the `beam` extra,
# .venv-beam), which tests/test_beam.py runs them in, not in the suite's own.
BEAM_MODULES = ("polyalign.beam.build", "polyalign.beam.prepare")

# Defines foreign_errors(modules): the exception classes those modules define that are not a
# PolyalignError. Source text, so that the Beam environment (without pytest) can run it too.
_FOREIGN_ERRORS = """
import importlib
import re
from polyalign.core.errors import PolyalignError

def foreign_errors(modules):
    return [f"{module}.{name}" for module in modules
            for name, value in vars(importlib.import_module(module)).items()
            if isinstance(value, type) and issubclass(value, Exception)
            and value.__module__.startswith("polyalign") and not issubclass(value, PolyalignError)]
"""


@pytest.mark.parametrize("module", sorted(_modules()))
def test_every_module_imports(module):
    if module in BEAM_MODULES:
        from tests.beam_env import in_beam_env

        done = in_beam_env(f"import {module}")
        assert done.returncode == 0, done.stderr[-2000:]
        return
    importlib.import_module(module)


def test_every_error_derives_from_the_base():
    from polyalign.core import errors
    from tests.beam_env import in_beam_env

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert len(classes) >= 15
    assert all(issubclass(c, errors.PolyalignError) for c in classes)
    namespace: dict = {}
    exec(_FOREIGN_ERRORS, namespace)
    assert namespace["foreign_errors"](m for m in _modules() if m not in BEAM_MODULES) == []
    beam = in_beam_env(_FOREIGN_ERRORS + "import sys\nprint('\\n'.join(foreign_errors(sys.argv[1:])))",
                       *BEAM_MODULES)
    assert beam.returncode == 0 and beam.stdout.strip() == "", beam.stdout + beam.stderr[-2000:]


# docs/ARCHITECTURE.md against the layout enforced above
def _homes_table() -> dict[str, str]:
    """ARCHITECTURE.md's Homes table: home folder -> its modules cell."""
    rows = {}
    for line in (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+/`", cells[0]):
            rows.setdefault(cells[0].strip("`/"), cells[2])
    return rows


def test_the_homes_table_names_every_module_of_each_home():
    """reports/ and beam/ are described by what they hold, not module by module; every other home's row
    names each of its modules (a subpackage by its folder)."""
    table = _homes_table()
    assert set(table) == set(HOME_IMPORTS)
    unnamed = []
    for home, cell in table.items():
        if home in ("reports", "beam"):
            continue
        for path in sorted((PACKAGE / home).iterdir()):
            name = path.name if path.suffix == ".py" else f"{path.name}/"
            if path.name == "__init__.py" or path.name.startswith((".", "__")) or \
                    (path.is_dir() and not (path / "__init__.py").is_file() and path.name != "templates"):
                continue
            if path.suffix not in (".py", "") or f"`{name}`" not in cell:
                unnamed += [f"{home}/{name}"] if path.suffix in (".py", "") else []
    assert not unnamed, f"docs/ARCHITECTURE.md's Homes table does not name {unnamed}"


def test_the_layering_table_is_the_one_the_layout_test_enforces():
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text[text.index("## Layering"):]
    section = section[:section.index("\n## ", 3)]
    layers = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            for home in re.findall(r"`(\w+)/`", cells[0]):
                layers[home] = set(re.findall(r"`(\w+)`", cells[1]))
    # train's row says it in words: everything above but the homes it names
    layers["train"] = {h for h in HOME_IMPORTS if h not in ("train", "evaluate", "reports", "beam")}
    assert layers == HOME_IMPORTS
