"""The library never imports the application: no module under statebackend/ imports
``jobs``, ``dags`` or ``plugins`` (import statements, and module names given as strings,
e.g. to ``importlib.import_module``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APPLICATION = ("jobs", "dags", "plugins")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[\w.]+)?$")


def application_imports(source: str) -> list[str]:
    """Every application module ``source`` imports or names as a module string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and _MODULE_NAME.match(node.value):
            # "jobs.x", "jobs.x:attr", or a bare "jobs" passed to an import function
            name = node.value.split(":", 1)[0]
            if "." in name or _imported_by_call(source, name):
                found.append(name)
    return [m for m in found if m.split(".")[0] in APPLICATION]


def _imported_by_call(source: str, name: str) -> bool:
    """A bare "jobs" string counts when it is the argument of an import function."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == name:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__", "find_spec", "load_job"):
                return True
    return False


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
