"""Import rules of the library.

- The library never imports the application: no module under statebackend/ imports
  ``jobs``, ``dags`` or ``plugins`` (import statements, and module names given as strings,
  e.g. to ``importlib.import_module``).
- Its subpackages form layers, lowest first; a subpackage imports only from lower ones
  (`ALLOWED`), so there is no cycle and nothing below imports ``spark/``, ``airflow/`` or
  ``cli/``::

      errors, defaults, settings, progress   (top-level modules; they import no subpackage)
      state < storage < checkpoint < lifecycle, validation < spark < rescale, job
      < airflow, cli

  Every import counts: absolute and relative, at module level and inside functions.
"""

from __future__ import annotations

import ast
import re
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
_BASE = frozenset({"errors", "defaults", "settings", "progress"})
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "defaults": frozenset(),
    "settings": frozenset({"errors", "defaults"}),
    "progress": frozenset({"settings", "errors"}),
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
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:
                yield f"{target}.{alias.name}", node.lineno


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
    violations = [f"{where[0]} imports statebackend.{imported} ({importer}/ may import only "
                  f"{', '.join(sorted(ALLOWED[importer])) or 'nothing of the library'})"
                  for (importer, imported), where in sorted(edges.items())
                  if imported not in ALLOWED[importer]]
    assert violations == [], "\n".join(violations)


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


if __name__ == "__main__":  # print the graph (for notes): python -m tests.test_import_graph
    for (importer, imported), where in sorted(subpackage_graph().items()):
        print(f"{importer:>10} -> {imported:<10} {len(where):3d}  e.g. {where[0]}")
