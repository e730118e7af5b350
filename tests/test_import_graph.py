"""Import rules of the library.

- The library never imports the application: no module under statebackend/ imports
  ``jobs``, ``dags`` or ``plugins`` (import statements, and module names given as strings,
  e.g. to ``importlib.import_module``).
- Its subpackages form layers, lowest first; a subpackage imports only from lower ones
  (`ALLOWED`), so there is no cycle and nothing below imports ``spark/``, ``airflow/`` or
  ``cli/``::

      errors, defaults, settings, progress, formatting, engines, subtasks, run_options,
      fast_json, worker_processes
                                             (top-level modules; they import no subpackage)
      state < storage < checkpoint < lifecycle, validation < spark < rescale, job
      < airflow, cli

  Every import counts: absolute and relative, at module level and inside functions.
- Inside one subpackage (and among the top-level modules) the modules import each other
  without a cycle (`test_no_cycle_inside_a_subpackage`), counting every import, module level
  and inside functions. Imports under ``if TYPE_CHECKING:`` do not count: they never run, so
  they cannot make an import order fail, and they are how a module names the type of a
  collaborator passed in to it (the state backend passes itself to its state kinds).
- A function-local import of our own modules is allowed only to keep a heavy dependency
  (Spark, Great Expectations, Airflow, Flask ...) off a light import path, and says so in a
  comment on its line or on the comment line above it (one comment may head a block of
  consecutive imports): `test_function_local_imports_say_why`.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APPLICATION = ("jobs", "dags", "plugins")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[\w.]+)?$")


def application_imports(source: str) -> list[str]:
    """Every application module ``source`` imports or names as a module string."""
    tree = ast.parse(source)
    called = _names_passed_to_import_functions(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and _MODULE_NAME.match(node.value):
            # "jobs.x", "jobs.x:attr", or a bare "jobs" passed to an import function
            name = node.value.split(":", 1)[0]
            if "." in name or name in called:
                found.append(name)
    return [m for m in found if m.split(".")[0] in APPLICATION]


def _names_passed_to_import_functions(tree: ast.AST) -> set[str]:
    """String first arguments of import functions: a bare "jobs" counts only there."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__", "find_spec", "load_job"):
                names.add(node.args[0].value.split(":", 1)[0])
    return names


@pytest.mark.parametrize("snippet, expected", [
    ("import jobs.keyed_aggregation", ["jobs.keyed_aggregation"]),
    ("from jobs import quarantine", ["jobs"]),
    ("import importlib\nimportlib.import_module('jobs.keyed_aggregation_checks')",
     ["jobs.keyed_aggregation_checks"]),
    ("CHECK_MODULES = ('jobs.keyed_aggregation_checks',)", ["jobs.keyed_aggregation_checks"]),
    ("__import__('dags')", ["dags"]),
    ("load_job('plugins.x:job')", ["plugins.x"]),
    ("from .jobs import x\nimport statebackend.job\n'see jobs/keyed_aggregation.py'", []),
])
def test_the_checker_finds_every_form(snippet, expected):
    assert application_imports(snippet) == expected


def test_statebackend_never_imports_the_application():
    offenders = {}
    files = sorted((ROOT / "statebackend").rglob("*.py"))
    assert len(files) > 30
    for path in files:
        found = application_imports(path.read_text())
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


# Each subpackage (or top-level module) of statebackend/ and what it may import. Written
# out, not derived from a rank, so a new edge is a decision made here.
_BASE = frozenset({"errors", "defaults", "settings", "progress", "formatting", "engines",
                   "subtasks", "run_options", "fast_json", "worker_processes", "python_gc"})
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "defaults": frozenset(),
    "settings": frozenset({"errors", "defaults"}),
    "progress": frozenset({"settings", "errors"}),
    "formatting": frozenset(),
    "fast_json": frozenset(),
    "worker_processes": frozenset({"errors"}),
    "python_gc": frozenset({"errors", "defaults", "settings"}),
    "engines": frozenset({"errors", "defaults", "settings"}),
    "subtasks": frozenset({"errors", "progress"}),
    "run_options": frozenset({"errors", "defaults", "settings"}),
    "state": _BASE,
    "storage": _BASE,
    "checkpoint": _BASE | {"state", "storage"},
    "lifecycle": _BASE | {"state", "storage", "checkpoint"},
    "validation": _BASE | {"state", "storage", "checkpoint"},
    "spark": _BASE | {"state", "storage", "checkpoint"},
    "rescale": _BASE | {"state", "storage", "checkpoint", "lifecycle", "validation", "spark"},
    "job": _BASE | {"state", "storage", "checkpoint", "lifecycle", "validation", "spark"},
    "airflow": _BASE | {"state", "storage", "checkpoint", "lifecycle", "validation", "spark",
                        "rescale", "job"},
    "cli": _BASE | {"state", "storage", "checkpoint", "lifecycle", "validation", "spark",
                    "rescale", "job"},
}


def _module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, is a package ``__init__``) of a file under ROOT."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imported_modules(source: str, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """(absolute module name, line) of every import in ``source``, relative ones resolved
    against ``module``; ``from pkg import name`` also yields ``pkg.name`` (it may be a
    submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, package)
            yield target, node.lineno
            for alias in node.names:
                yield f"{target}.{alias.name}", node.lineno


def _from_target(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from X import ...`` in ``package``, relative resolved."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def subpackage_of(module: str) -> str | None:
    """``statebackend.checkpoint.store`` -> ``checkpoint``; None outside the library or
    for ``statebackend`` itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "statebackend" and len(parts) > 1 else None


def subpackage_graph() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) subpackage -> the importing ``module:line`` places."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted((ROOT / "statebackend").rglob("*.py")):
        module, is_package = _module_name(path)
        source = subpackage_of(module)
        if source is None:
            continue
        for target, line in imported_modules(path.read_text(), module, is_package):
            imported = subpackage_of(target)
            if imported is not None and imported != source and imported in ALLOWED:
                edges.setdefault((source, imported), []).append(f"{module}:{line}")
    return edges


@pytest.mark.parametrize("snippet, module, is_package, expected", [
    ("from ..checkpoint.store import open_store", "statebackend.job.run", False,
     {"statebackend.checkpoint.store", "statebackend.checkpoint.store.open_store"}),
    ("from . import codecs", "statebackend.state", True,
     {"statebackend.state", "statebackend.state.codecs"}),
    ("def f():\n    import statebackend.spark.session", "statebackend.job.run", False,
     {"statebackend.spark.session"}),
    ("from statebackend import errors", "statebackend.cli.app", False,
     {"statebackend", "statebackend.errors"}),
])
def test_imports_are_resolved_in_every_form(snippet, module, is_package, expected):
    assert {m for m, _ in imported_modules(snippet, module, is_package)} == expected


def test_every_subpackage_has_its_layer():
    found = {p.name for p in (ROOT / "statebackend").iterdir()
             if (p / "__init__.py").exists()}
    found |= {p.stem for p in (ROOT / "statebackend").glob("*.py") if p.stem != "__init__"}
    assert found == set(ALLOWED), "a new subpackage needs its entry in ALLOWED"


def test_subpackages_import_only_lower_layers():
    edges = subpackage_graph()
    assert len(edges) > 20  # the graph was built (a broken walk would find nothing)
    violations = [f"{where[0]} imports statebackend.{imported} ({_may_import(importer)})"
                  for (importer, imported), where in sorted(edges.items())
                  if imported not in ALLOWED.get(importer, ())]
    assert violations == [], "\n".join(violations)


def _may_import(importer: str) -> str:
    if importer not in ALLOWED:
        return f"{importer} has no entry in ALLOWED yet"
    return f"{importer} may import only " + (", ".join(sorted(ALLOWED[importer]))
                                             or "nothing of the library")


def test_subpackage_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for importer, imported in subpackage_graph():
        graph.setdefault(importer, set()).add(imported)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import cycle: {' -> '.join(path[path.index(node):] + [node])}"
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


def test_allowed_edges_form_layers():
    """ALLOWED itself is acyclic, so no future pair of allowed edges closes a cycle."""
    order: list[str] = []
    remaining = dict(ALLOWED)
    while remaining:
        ready = sorted(n for n, deps in remaining.items() if deps <= set(order))
        assert ready, f"ALLOWED has a cycle among {sorted(remaining)}"
        order += ready
        for n in ready:
            del remaining[n]
    importers = {top: {n for n, deps in ALLOWED.items() if top in deps}
                 for top in ("spark", "airflow", "cli")}
    assert importers == {"spark": {"rescale", "job", "airflow", "cli"},
                         "airflow": set(), "cli": set()}


# -- modules inside one subpackage ------------------------------------------------------

def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, ast.Import | ast.ImportFrom)}
    return found


def module_edges(source: str, module: str, is_package: bool,
                 known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported module of ``known``, line) of every executed import in ``source``:
    module level and inside functions, not under ``if TYPE_CHECKING:``. ``from pkg import
    name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` itself;
    importing ``pkg.sub`` is an edge to ``pkg.sub`` only (its package's ``__init__`` is
    then already running or done, whichever way the two were reached)."""
    tree = ast.parse(source)
    skipped = _type_checking_only(tree)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, package)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield sub, node.lineno
                elif target in known:
                    yield target, node.lineno


def module_graph() -> dict[str, dict[str, str]]:
    """importing module -> {imported module of the same subpackage: first ``module:line``}.

    The top-level modules (``statebackend.errors`` ...) and the package ``statebackend``
    itself form one group."""
    files = {_module_name(p): p for p in sorted((ROOT / "statebackend").rglob("*.py"))}
    known = {name for name, _ in files}
    graph: dict[str, dict[str, str]] = {}
    for (module, is_package), path in files.items():
        group = subpackage_group(module, is_package)
        edges = graph.setdefault(module, {})
        for target, line in module_edges(path.read_text(), module, is_package, known):
            target_is_package = (ROOT / Path(*target.split(".")) / "__init__.py").exists()
            if target != module and subpackage_group(target, target_is_package) == group:
                edges.setdefault(target, f"{module}:{line}")
    return graph


def subpackage_group(module: str, is_package: bool) -> str:
    """The group whose modules must not import each other in a cycle: the subpackage
    (``statebackend.state.kinds`` and ``statebackend.state`` -> ``state``), or ``""`` for
    the top-level modules and the ``statebackend`` package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and is_package) else ""


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle (its modules in import order, the first repeated at the end) per
    strongly connected component of more than one module; [] for a DAG."""
    return [_cycle_through(graph, set(c), c[0]) for c in import_circles(graph)]


def import_circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (sorted names): each
    is a set of modules that all reach each other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, {})):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def _cycle_through(graph: dict[str, dict[str, str]], members: set[str], start: str) -> list[str]:
    """The shortest cycle from ``start`` back to it inside one component (breadth first)."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                return paths[node] + [start]
            if nxt in members and nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def _describe(component: list[str], graph: dict[str, dict[str, str]]) -> str:
    """The circle's modules, then one cycle through them with the importing lines."""
    cycle = _cycle_through(graph, set(component), component[0])
    steps = ", ".join(graph[a][b] for a, b in zip(cycle, cycle[1:], strict=False))
    return (f"circle of {len(component)} modules: {', '.join(component)}; e.g. "
            f"{' -> '.join(cycle)} ({steps})")


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b": ""}, "b": {"c": ""}, "c": {}}, []),
    ({"a": {"b": ""}, "b": {"a": ""}}, [["a", "b", "a"]]),
    ({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": "", "d": ""}, "d": {"e": ""}, "e": {"d": ""}},
     [["d", "e", "d"], ["a", "b", "c", "a"]]),
])
def test_the_cycle_finder(graph, expected):
    assert sorted(find_cycles(graph)) == sorted(expected)


@pytest.mark.parametrize("snippet, expected", [
    # a function-local import is an edge; one under TYPE_CHECKING is not
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from statebackend.state.backend"
     " import KeyedStateBackend\ndef f():\n    from statebackend.state import ttl",
     {"statebackend.state.ttl"}),
    # `from pkg import name`: the submodule when it is one, else the package
    ("from statebackend.storage import Storage, base", {"statebackend.storage",
                                                        "statebackend.storage.base"}),
    ("from . import codecs\nfrom .kinds import StateDescriptor",
     {"statebackend.state.codecs", "statebackend.state.kinds"}),
])
def test_module_edges(snippet, expected):
    known = {"statebackend.storage", "statebackend.storage.base", "statebackend.state",
             "statebackend.state.codecs", "statebackend.state.kinds", "statebackend.state.ttl",
             "statebackend.state.backend"}
    assert {m for m, _ in module_edges(snippet, "statebackend.state.timers", False, known)} \
        == expected


def test_no_cycle_inside_a_subpackage():
    graph = module_graph()
    assert sum(len(e) for e in graph.values()) > 50  # the graph was built
    circles = [_describe(c, graph) for c in import_circles(graph)]
    assert circles == [], "modules import each other in a circle:\n" + "\n".join(circles)


# -- function-local imports say why -------------------------------------------------------

def local_imports_without_reason(source: str, module: str, is_package: bool) -> list[int]:
    """Lines of the function-local imports of our own modules with no comment on their
    line(s), nor on the comment line right above them (or above the run of imports they
    belong to)."""
    tree = ast.parse(source)
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    import_lines: set[int] = set()
    local: list[ast.Import | ast.ImportFrom] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            import_lines |= set(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            local += [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)]
    missing = []
    for node in local:
        ours = [m for m, _ in imported_modules(ast.unparse(node), module, is_package)
                if m.split(".")[0] == "statebackend"]
        if not ours or comments & set(range(node.lineno, node.end_lineno + 1)):
            continue
        above = node.lineno - 1
        while above in import_lines:  # a run of imports shares the comment above it
            above -= 1
        if not (above in comments and lines[above - 1].lstrip().startswith("#")):
            missing.append(node.lineno)
    return sorted(set(missing))


@pytest.mark.parametrize("snippet, expected", [
    ("def f():\n    from statebackend.spark.session import get_spark\n", [2]),
    ("def f():\n    from statebackend.spark.session import get_spark  # Spark only here\n", []),
    ("def f():\n    # Spark only when a session is needed\n"
     "    from statebackend.spark import session\n    from statebackend.spark import dispatch\n",
     []),
    ("def f():\n    x = 1  # not about the import\n    from ..spark import session\n", [3]),
    ("def f():\n    import json\n    from statebackend import errors  # noqa: F401\n", []),
    ("def f():\n    import json\n", []),
    ("from statebackend.spark import session\n", []),
])
def test_the_local_import_checker(snippet, expected):
    assert local_imports_without_reason(snippet, "statebackend.job.run", False) == expected


def test_function_local_imports_say_why():
    offenders = []
    for path in sorted((ROOT / "statebackend").rglob("*.py")):
        module, is_package = _module_name(path)
        for line in local_imports_without_reason(path.read_text(), module, is_package):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert offenders == [], (
        "function-local imports of statebackend modules without a comment saying which "
        "heavy dependency they keep off a light path (else import at module level):\n"
        + "\n".join(offenders))


if __name__ == "__main__":  # print the graph (for notes): python -m tests.test_import_graph
    for (importer, imported), where in sorted(subpackage_graph().items()):
        print(f"{importer:>10} -> {imported:<10} {len(where):3d}  e.g. {where[0]}")
