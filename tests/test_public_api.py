"""The public job API is enough: the built-in jobs (jobs/) and the examples (examples/)
import nothing of the library but ``statebackend.job`` itself, so a user copying them
copies no internals. Every import counts (module level, inside functions, under
``if __name__ == "__main__"``), and so does a module name given as a string to an
import function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = "statebackend.job"
_IMPORT_FUNCTIONS = ("import_module", "__import__", "find_spec", "run_module")


def library_imports(source: str) -> list[tuple[str, int]]:
    """(module, line) of every import of ``statebackend`` or below in ``source``; ``from
    statebackend import x`` counts as ``statebackend.x``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "statebackend":
                found += [(f"statebackend.{a.name}", node.lineno) for a in node.names]
            else:
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Call) and node.args \
                and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _IMPORT_FUNCTIONS:
                found.append((node.args[0].value, node.lineno))
    return [(m, line) for m, line in found if m.split(".")[0] == "statebackend"]


def offenders(source: str) -> list[str]:
    return [m for m, _ in library_imports(source) if m != PUBLIC]


@pytest.mark.parametrize("snippet, expected", [
    ("from statebackend.job import Job, PerKey", []),
    ("import statebackend.job", []),
    ("from statebackend import job", []),
    ("from statebackend.job.context import group_by_key", ["statebackend.job.context"]),
    ("from statebackend.state.ttl import StateTtl", ["statebackend.state.ttl"]),
    ("from statebackend import errors", ["statebackend.errors"]),
    ("import statebackend.cli.submit as s", ["statebackend.cli.submit"]),
    ("def main():\n    from statebackend.cli.submit import entry_point\n",
     ["statebackend.cli.submit"]),
    ("import importlib\nimportlib.import_module('statebackend.state.codecs')",
     ["statebackend.state.codecs"]),
    ("import pyarrow as pa\nfrom .helpers import x\nfrom jobs import dedup", []),
])
def test_the_checker_finds_every_form(snippet, expected):
    assert offenders(snippet) == expected


def test_jobs_and_examples_import_only_the_public_job_api():
    files = sorted([*(ROOT / "jobs").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])
    assert len(files) >= 5
    bad = {f"{path.relative_to(ROOT)}:{line}": module
           for path in files for module, line in library_imports(path.read_text())
           if module != PUBLIC}
    assert bad == {}, "import these from statebackend.job (add them there if missing)"
    assert all(any(m == PUBLIC for m, _ in library_imports(p.read_text()))
               for p in files if p.name != "__init__.py")  # the walk saw the imports
