"""Function shape of the library: no function under statebackend/ takes more than
`MAX_PARAMETERS` parameters or runs more than `MAX_LINES` lines (measured from the AST;
the failure names every offender with its figure).

A parameter is any argument a caller can pass: positional, keyword-only, ``*args`` and
``**kwargs`` count one each; ``self`` and ``cls`` do not. Lines run from the ``def`` (its
decorators excluded) to the function's last line, docstring included. More than this
and the values travel together: give them a frozen dataclass (`RescaleOptions`,
`RestoreOptions`, `RunInfo`), or split the function at its phases.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 6
MAX_LINES = 80


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    a = node.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    positional = a.posonlyargs + a.args
    if in_class and positional and positional[0].arg in ("self", "cls"):
        n -= 1
    return n


def shape_offenders(source: str, where: str) -> list[str]:
    """``where:line name: N parameters`` / ``N lines`` for every function over a limit."""
    found = []
    tree = ast.parse(source)
    in_class = {id(child) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                for child in node.body}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        params = parameter_count(node, id(node) in in_class)
        lines = node.end_lineno - node.lineno + 1
        if params > MAX_PARAMETERS:
            found.append(f"{where}:{node.lineno} {node.name}: {params} parameters")
        if lines > MAX_LINES:
            found.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    return found


@pytest.mark.parametrize("snippet, expected", [
    ("def f(a, b, c, d, e, g): pass", []),
    ("def f(a, b, c, d, e, g, h): pass", ["m.py:1 f: 7 parameters"]),
    ("def f(a, b, c, d, e, *rest, **kw): pass", ["m.py:1 f: 7 parameters"]),
    ("def f(a, b, c, d, *, e, g, h): pass", ["m.py:1 f: 7 parameters"]),
    ("class C:\n    def m(self, a, b, c, d, e, g): pass", []),
    ("def f(self, a, b, c, d, e, g): pass", ["m.py:1 f: 7 parameters"]),  # not a method
    ("def f():\n" + "    x = 1\n" * 79, []),
    ("def f():\n" + "    x = 1\n" * 80, ["m.py:1 f: 81 lines"]),
    ("class C:\n    def m(self):\n" + "        x = 1\n" * 80, ["m.py:2 m: 81 lines"]),
    ("def outer():\n    def inner(a, b, c, d, e, g, h): pass",
     ["m.py:2 inner: 7 parameters"]),
])
def test_the_measure(snippet, expected):
    assert shape_offenders(snippet, "m.py") == expected


def test_no_function_is_too_long_or_takes_too_many_parameters():
    files = sorted((ROOT / "statebackend").rglob("*.py"))
    assert len(files) > 30
    offenders = [o for path in files
                 for o in shape_offenders(path.read_text(), str(path.relative_to(ROOT)))]
    assert offenders == [], (f"over {MAX_PARAMETERS} parameters or {MAX_LINES} lines "
                             "(module docstring):\n" + "\n".join(offenders))
