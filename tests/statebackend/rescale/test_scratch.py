"""Where rescale tasks build their scratch instances: tmpfs when the task fits, else the
temp folder; ``CKPT_LOCAL_DIR`` always wins; nothing is left behind (no Spark needed)."""

from __future__ import annotations

import os

import pytest

from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.rescale import scratch
from statebackend.rescale.executor import rescale
from statebackend.storage import open_storage
from tests.statebackend.helpers import close_all, fill, keys, open_backends

M = 128
tmpfs_mounted = pytest.mark.skipif(not scratch._is_tmpfs(scratch.TMPFS_DIR),
                                   reason=f"{scratch.TMPFS_DIR} is not a tmpfs mount here")


@pytest.fixture(autouse=True)
def no_configured_dir(monkeypatch):
    monkeypatch.delenv("CKPT_LOCAL_DIR", raising=False)


def test_the_configured_local_dir_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("CKPT_LOCAL_DIR", str(tmp_path))
    assert scratch.scratch_parent(1000) == str(tmp_path)
    assert scratch.scratch_parent(10 ** 12) == str(tmp_path)


def test_a_folder_that_is_not_tmpfs_is_not_used(monkeypatch, tmp_path):
    if scratch._is_tmpfs(str(tmp_path)):
        pytest.skip("the test's temp folder is itself on tmpfs")
    monkeypatch.setattr(scratch, "TMPFS_DIR", str(tmp_path))
    assert scratch.scratch_parent(1000) is None


@tmpfs_mounted
def test_tmpfs_only_for_tasks_that_fit(monkeypatch):
    assert scratch.scratch_parent(1000) == scratch.TMPFS_DIR
    too_large = scratch.TMPFS_MAX_BYTES // scratch.WRITE_FACTOR + 1
    assert scratch.scratch_parent(too_large) is None
    # tmpfs pages are memory: short of it, the task goes to disk
    monkeypatch.setattr(scratch, "_memory_available",
                        lambda: scratch.TMPFS_FREE_FACTOR * scratch.WRITE_FACTOR * 1000 - 1)
    assert scratch.scratch_parent(1000) is None


def _store(tmp_path, p: int) -> CheckpointStore:
    store = CheckpointStore(open_storage(f"memory://scratch-{os.getpid()}-{tmp_path.name}"), "j")
    backends = open_backends(str(tmp_path / "src"), p, M)
    try:
        fill(backends, keys(600))
        checkpoint_backends(store, backends, parent=None, run_id="r1")
    finally:
        close_all(backends)
    return store


def _rows(store: CheckpointStore) -> list[tuple]:
    return sorted((r["state"], r["key"], r["user_key"] or "", repr(r["value"]))
                  for r in checkpoint_rows(store, store.latest()))


def _leftovers(folder: str) -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith("ckpt-rescale-")]


@tmpfs_mounted
def test_rescale_tasks_work_on_tmpfs_and_leave_nothing_there(tmp_path):
    store = _store(tmp_path, 2)
    before, left_before = _rows(store), _leftovers(scratch.TMPFS_DIR)
    summary = rescale(store, "latest", 3)
    assert [s["scratch"] for s in summary["subtasks"]] == [scratch.TMPFS_DIR] * 3
    assert _rows(store) == before
    assert _leftovers(scratch.TMPFS_DIR) == left_before


def test_rescale_tasks_use_the_configured_dir_and_leave_nothing_there(monkeypatch, tmp_path):
    store = _store(tmp_path, 3)
    before = _rows(store)
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setenv("CKPT_LOCAL_DIR", str(folder))
    summary = rescale(store, "latest", 2)
    assert [s["scratch"] for s in summary["subtasks"]] == [str(folder)] * 2
    assert _rows(store) == before
    assert os.listdir(folder) == []
