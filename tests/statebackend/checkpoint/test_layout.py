"""One module owns every storage path name (checkpoint/layout.py).

The scan reads the string constants of every module under statebackend/ and
plugins/ (f-strings with their placeholders as ``{}``) and fails on one that
spells a layout name as a path: a folder or file name of the job root inside a
'/'-path, or one of the distinctive names on its own. Prose (anything with
whitespace: messages, help, docstrings) is not a path and is skipped.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from statebackend.checkpoint import layout

ROOT = pathlib.Path(__file__).resolve().parents[3]
OWNER = ROOT / "statebackend" / "checkpoint" / "layout.py"
FOLDERS = {layout.SHARED_DIR, layout.LEASES_DIR, layout.RUNS_DIR, "history",
           layout.SAVEPOINTS_DIR, layout.REPORTS_DIR, layout.INDEX_DIR, layout.ATTEMPTS_DIR}
DISTINCT = {layout.METADATA_FILE, layout.INDEX_DIR, layout.ATTEMPTS_DIR, "registry.json",
            layout.SUMMARY_FILE, layout.CLAIM_PREFIX, layout.CHK_PREFIX, layout.HISTORY_DIR,
            "chk-*"}
# Web routes of the Checkpoints page and Airflow UI links: URLs, not storage paths.
WEB_ROUTES = {
    ("statebackend/airflow/page/app.py", "/reports/{job}/{path:path}"),
    ("statebackend/airflow/page/data.py", "/dags/{}/runs/{}"),
    ("statebackend/airflow/page/data.py", "{}/reports/{}/{}"),
}


def spells_layout(text: str) -> bool:
    if not text or any(c.isspace() for c in text):
        return False
    if text in DISTINCT:
        return True
    if "/" not in text:
        return False
    return any(seg in FOLDERS or seg in DISTINCT or seg.startswith(layout.CHK_PREFIX)
               for seg in text.split("/"))


def constants(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of each string constant; an f-string is one text with ``{}``."""
    inside_fstring: set[int] = set()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = []
            for value in node.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    parts.append(value.value)
                    inside_fstring.add(id(value))
                else:
                    parts.append("{}")
            out.append((node.lineno, "".join(parts)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in inside_fstring:
            out.append((node.lineno, node.value))
    return out


def test_the_scan_recognises_layout_paths():
    for path in ("chk-{}/_metadata", "shared/{}", "{}/savepoints/{}", "runs/history",
                 "reports/chk-{}", "_metadata", "leases/{}.json", "chk-"):
        assert spells_layout(path), path
    for other in ("savepoints", "leases", "shared_files", "chk-{}", "chk-{} is not committed",
                  "see `ckpt list`", "data_docs/index.html", "checkpoint"):
        assert not spells_layout(other), other


def test_only_layout_spells_storage_path_names():
    found = []
    for folder in ("statebackend", "plugins"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == OWNER:
                continue
            tree = ast.parse(path.read_text(), str(path))
            rel = str(path.relative_to(ROOT))
            found += [f"{rel}:{line}: {text!r}" for line, text in constants(tree)
                      if spells_layout(text) and (rel, text) not in WEB_ROUTES]
    if found:
        pytest.fail("storage path names spelled outside checkpoint/layout.py (build them "
                    "with its functions):\n" + "\n".join(found))
