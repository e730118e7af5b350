"""The ledger of committed runs (statebackend/checkpoint/runs.py): run ids outlive retention."""

from __future__ import annotations

import pytest

from statebackend.checkpoint.runs import RunRecord, run_record_path, safe_run_name
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import MetadataError, StorageError
from statebackend.lifecycle.retention import retain
from statebackend.storage import open_storage


def _store(tmp_path) -> CheckpointStore:
    return CheckpointStore(open_storage(f"file://{tmp_path}/store"), "j")


def _commit_runs(store: CheckpointStore, run_ids: list[str]) -> None:
    from statebackend.checkpoint.snapshot import checkpoint_backends
    from statebackend.state.backend import KeyedStateBackend
    from statebackend.state.keygroups import KeyGroupRange
    from statebackend.state.kinds import StateDescriptor

    desc = StateDescriptor("v")
    backend = KeyedStateBackend(str(store.storage.root) + "-local", [desc], 16,
                                KeyGroupRange(0, 15))
    try:
        parent = None
        for i, run_id in enumerate(run_ids):
            backend.value_state("v").put(f"k{i}", i)
            meta = checkpoint_backends(store, [backend], parent=parent, run_id=run_id)
            parent = meta.checkpoint_id
    finally:
        backend.close()


def test_retention_records_retired_runs_and_find_run_still_sees_them(tmp_path):
    store = _store(tmp_path)
    _commit_runs(store, ["day-0", "day/1", "day-2"])
    assert store.find_by_run_id("day-0") is not None
    report = retain(store, keep=1)
    assert sorted(d.checkpoint_id for d in report.plan.decisions if d.action == "retire") == [1, 2]
    assert store.find_by_run_id("day-0") is None  # its commit record is gone ...
    for run_id, cid in (("day-0", 1), ("day/1", 2), ("day-2", 3)):
        found = store.find_run(run_id)  # ... the ledger still knows it
        assert found is not None and (found.run_id, found.checkpoint_id) == (run_id, cid)
    assert store.find_run("day-3") is None


def test_find_run_repairs_a_missing_record(tmp_path):
    """A crash between the commit and the ledger write: the record is written on demand."""
    store = _store(tmp_path)
    _commit_runs(store, ["a"])
    store.storage.delete_many([run_record_path("a")])
    assert not store.storage.exists(run_record_path("a"))
    assert store.find_run("a").checkpoint_id == 1
    assert store.storage.exists(run_record_path("a"))


def test_retention_keeps_a_checkpoint_whose_run_cannot_be_recorded(tmp_path, monkeypatch):
    store = _store(tmp_path)
    _commit_runs(store, ["a", "b"])

    def refuse(meta):
        raise StorageError("disk full")
    monkeypatch.setattr(CheckpointStore, "record_run", lambda self, meta: refuse(meta))
    retain(store, keep=1)
    assert store.checkpoint_ids() == [1, 2]  # nothing retired: "a" would be forgotten
    assert store.find_by_run_id("a") is not None


def test_safe_names_and_strict_records():
    assert safe_run_name("2027-01-01") == "2027-01-01"
    assert "/" not in safe_run_name("a/b") and safe_run_name("a/b") != safe_run_name("a_b")
    rec = RunRecord("r", 3, 2, "2027-01-01T00:00:00+00:00", {"keys_touched": 4})
    assert RunRecord.from_bytes(rec.to_bytes(), "x") == rec
    for bad in (b"{", b"[]", b'{"format_version": 1, "run_id": "r", "checkpoint_id": 0, '
                             b'"parallelism": 1}', b'{"format_version": 9}'):
        with pytest.raises(MetadataError, match="malformed run record x"):
            RunRecord.from_bytes(bad, "x")
