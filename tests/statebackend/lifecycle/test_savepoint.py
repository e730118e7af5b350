"""Savepoints and start points: self-contained copies, spec syntax, refusals."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CheckpointNotFoundError, UsageError
from statebackend.lifecycle.gc import collect_garbage
from statebackend.lifecycle.registry import build_registry, load_savepoint
from statebackend.lifecycle.retention import retain
from statebackend.lifecycle.savepoint import create_savepoint, import_start_point, parse_start_spec
from statebackend.storage import open_storage
from tests.statebackend.lifecycle.test_lifecycle_scenarios import Job, keys, state

LATER = datetime.now(UTC) + timedelta(hours=2)


@pytest.fixture
def job(storage_url, tmp_path):
    j = Job(open_storage(storage_url), "orders", str(tmp_path / "local"))
    j.write(keys(30), 1)
    j.checkpoint()
    j.write(keys(10), 2)
    j.checkpoint()
    yield j
    j.close()


def test_savepoint_is_self_contained_and_never_collected(job):
    sp = create_savepoint(job.store, "latest", "nightly")
    assert sp.kind == "savepoint" and sp.parent is None
    assert sp.source == {"job": "orders", "checkpoint": 2, "savepoint": None}
    assert all(f.path.startswith("savepoints/nightly/") for f in sp.files)
    assert load_savepoint(job.store, "nightly") == sp
    # the source checkpoint and every shared file it used may now disappear
    job.write(keys(30), 3)
    job.compact()
    job.checkpoint()
    retain(job.store, 1)
    collect_garbage(job.store, grace_seconds=0, now=LATER)
    assert job.store.checkpoint_ids() == [3]
    assert state(job.store, sp) == job.expected[2]
    assert "nightly" in build_registry(job.store).savepoints


def test_savepoint_name_is_taken_once(job):
    create_savepoint(job.store, 1, "sp")
    with pytest.raises(UsageError, match="already exists"):
        create_savepoint(job.store, 2, "sp")
    with pytest.raises(UsageError):
        create_savepoint(job.store, 2, "../escape")
    with pytest.raises(CheckpointNotFoundError):
        create_savepoint(job.store, 99, "other")
    assert not job.store.storage.list_dir("savepoints/other")


def test_start_spec_syntax(job):
    create_savepoint(job.store, 1, "sp")
    s = job.storage
    assert parse_start_spec(s, "orders/savepoints/sp") == ("savepoint", "orders", "sp")
    assert parse_start_spec(s, "orders/savepoints/sp/_metadata") == ("savepoint", "orders", "sp")
    assert parse_start_spec(s, "sp") == ("savepoint", "orders", "sp")
    assert parse_start_spec(s, "orders:latest") == ("checkpoint", "orders", "latest")
    assert parse_start_spec(s, "orders:chk-2") == ("checkpoint", "orders", "2")
    for bad in ("", "orders:two", "a/b", "../x/savepoints/sp", "orders/savepoints/../sp"):
        with pytest.raises(UsageError):
            parse_start_spec(s, bad)
    with pytest.raises(CheckpointNotFoundError):
        parse_start_spec(s, "nope")


def test_ambiguous_savepoint_name(job, tmp_path):
    create_savepoint(job.store, 1, "sp")
    other = Job(job.storage, "billing", str(tmp_path / "b"))
    try:
        other.write(keys(3), 1)
        other.checkpoint()
        create_savepoint(other.store, 1, "sp")
        with pytest.raises(UsageError, match="several jobs"):
            import_start_point(job.storage, "new", "sp")
        meta = import_start_point(job.storage, "new", "billing/savepoints/sp")
        assert state(CheckpointStore(job.storage, "new"), meta) == other.expected[1]
    finally:
        other.close()


def test_import_refuses_a_job_with_checkpoints_and_itself(job):
    with pytest.raises(UsageError, match="already has checkpoints"):
        import_start_point(job.storage, "orders", "orders:1")
    with pytest.raises(CheckpointNotFoundError):
        import_start_point(job.storage, "fresh", "orders:42")
    assert CheckpointStore(job.storage, "fresh").checkpoint_ids() == []


def test_import_of_checkpoint_copies_with_fresh_names(job):
    meta = import_start_point(job.storage, "copy", "orders:1")
    src = job.store.load(1)
    assert meta.checkpoint_id == 1 and meta.parent is None and meta.kind == "checkpoint"
    shared = {f.path for f in meta.files if f.path.startswith("shared/")}
    assert shared and shared.isdisjoint({f.path for f in src.files})  # fresh unique names
    assert all(f.path.startswith(("shared/", "chk-1/")) for f in meta.files)
    assert [(f.local_name, f.size, f.checksum) for f in meta.files] == \
        [(f.local_name, f.size, f.checksum) for f in src.files]
    # no lease left behind in the source job
    assert build_registry(job.store).leases == ()


def _set_time(store: CheckpointStore, cid: int, watermark: int, processing: int) -> None:
    """Give a committed record a watermark and clock (as a job with event time writes)."""
    import json

    from tests.statebackend.helpers import recommit_record

    obj = json.loads(store.storage.read_bytes(f"chk-{cid}/_metadata"))
    obj.update(watermark=watermark, processing_time=processing)
    recommit_record(store, cid, json.dumps(obj).encode())


def test_savepoint_and_import_keep_the_watermark(job):
    _set_time(job.store, 2, 1_800_000_000_000, 1_800_000_360_000)
    sp = create_savepoint(job.store, "latest", "timed")
    assert (sp.watermark, sp.processing_time) == (1_800_000_000_000, 1_800_000_360_000)
    imported = import_start_point(job.storage, "copy", "orders/savepoints/timed")
    assert (imported.watermark, imported.processing_time) == (1_800_000_000_000,
                                                              1_800_000_360_000)
