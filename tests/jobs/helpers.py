"""Helpers shared by the job tests: read the final state, compare with pandas."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.store import CheckpointStore
from statebackend.storage import open_storage


def store_of(storage_url: str, job: str) -> CheckpointStore:
    return CheckpointStore(open_storage(storage_url), job)


def dump_latest(storage_url: str, job: str) -> dict[str, dict]:
    """key -> totals of the latest checkpoint (what `ckpt dump latest` writes)."""
    store = store_of(storage_url, job)
    rows = list(checkpoint_rows(store, store.resolve("latest")))
    assert all(r["state"] == "totals" for r in rows)
    return {r["key"]: r["value"] for r in rows}


def assert_state_equals(state: dict[str, dict], expected: pd.DataFrame) -> None:
    assert sorted(state) == sorted(expected.index), "keys differ"
    for key, row in expected.iterrows():
        got = state[key]
        assert got["count"] == row["count"], key
        assert got["min_ts"] == row["min_ts"], key
        assert got["max_ts"] == row["max_ts"], key
        assert math.isclose(got["sum"], row["sum"], rel_tol=1e-9, abs_tol=1e-9), key


def referenced_paths(store: CheckpointStore) -> set[str]:
    return {f.path for m in store.load_all() for f in m.files}


def stored_files(store: CheckpointStore, folder: str) -> set[str]:
    return {i.path for i in store.storage.walk_files(folder)}


def run_docs_example(page: str, section: str) -> dict:
    """Run the first Python block of ``section`` (a ``## `` heading) of docs/``page``;
    its global names."""
    text = (Path(__file__).resolve().parents[2] / "docs" / page).read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    code = body.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(code, f"docs/{page}", "exec"), scope)  # noqa: S102 - our own docs
    return scope
