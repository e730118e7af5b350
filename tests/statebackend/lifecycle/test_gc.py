"""GC: every classification of the pure planner, then collect_garbage on every backend."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from statebackend.checkpoint.leases import acquire_hold, writer_lease
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import MetadataError, UsageError
from statebackend.lifecycle.gc import (
    DEL_SHARED,
    DEL_UNCOMMITTED,
    DEL_UNREFERENCED,
    KEEP_COMMIT_RECORD,
    KEEP_LEASED,
    KEEP_NO_MTIME,
    KEEP_PENDING,
    KEEP_REFERENCED,
    KEEP_WRITER_ACTIVE,
    collect_garbage,
    execute_gc,
    plan_gc,
)
from statebackend.lifecycle.registry import build_registry, make_registry
from statebackend.storage import open_storage
from tests.statebackend.lifecycle.test_registry import NOW, info, lease, meta, write_meta

OLD, YOUNG = 7200.0, 60.0


def classify(files, leases=(), grace=3600.0, checkpoints=None):
    checkpoints = checkpoints if checkpoints is not None else [meta(1, ["shared/a.sst"])]
    reg = make_registry(job="j", now=NOW, files=files, checkpoints=checkpoints, leases=leases)
    plan = plan_gc(reg, grace_seconds=grace)
    reasons = {f.path: f.reason for f in plan.deletions + plan.pending}
    reasons.update({p: KEEP_REFERENCED for p in plan.referenced})
    reasons.update({p: KEEP_COMMIT_RECORD for p in plan.commit_records})
    return reasons, plan


def test_every_reason():
    reasons, plan = classify([
        info("shared/a.sst", OLD), info("chk-1/_metadata", OLD), info("chk-1/0/s/MANIFEST", OLD),
        info("shared/gone.sst", OLD), info("shared/new.sst", YOUNG),
        info("shared/unknown.sst", None),
        info("chk-1/0/other/MANIFEST", OLD),          # overlapping attempt of id 1
        info("chk-2/0/t/MANIFEST", OLD),              # attempt 2 never committed
        info("chk-3/_metadata.tmp", OLD),             # leased attempt
        info("savepoints/s/0/x.sst", OLD), info("reports/chk-1/r.json", OLD),
        info("leases/hold-a.json", OLD), info("README", OLD),
    ], leases=[lease("hold-a", [3])])
    assert reasons == {
        "shared/a.sst": KEEP_REFERENCED, "chk-1/_metadata": KEEP_COMMIT_RECORD,
        "chk-1/0/s/MANIFEST": KEEP_REFERENCED, "shared/gone.sst": DEL_SHARED,
        "shared/new.sst": KEEP_PENDING, "shared/unknown.sst": KEEP_NO_MTIME,
        "chk-1/0/other/MANIFEST": DEL_UNREFERENCED, "chk-2/0/t/MANIFEST": DEL_UNCOMMITTED,
        "chk-3/_metadata.tmp": KEEP_LEASED,
    }  # savepoints/, reports/, leases/ and other files are out of scope
    assert plan.bytes_to_delete == 30
    assert {f.path for f in plan.pending} == {"shared/new.sst", "shared/unknown.sst",
                                              "chk-3/_metadata.tmp"}
    j = plan.to_json()
    assert j["orphans_pending"] == 3 and j["by_reason"][DEL_SHARED]["action"] == "delete"


def test_grace_boundary_and_zero():
    files = [info("shared/x.sst", 100.0)]
    assert classify(files, grace=100.0)[0]["shared/x.sst"] == DEL_SHARED
    assert classify(files, grace=100.5)[0]["shared/x.sst"] == KEEP_PENDING
    assert classify(files, grace=0)[0]["shared/x.sst"] == DEL_SHARED
    with pytest.raises(UsageError):
        classify(files, grace=-1)


def test_live_writer_protects_its_uploads_whatever_the_grace():
    writer = lease("writer", [1], created_ago=120.0)
    files = [info("shared/during.sst", 30.0), info("shared/before.sst", 3 * 3600.0)]
    reasons, _ = classify(files, leases=[writer], grace=0)
    assert reasons == {"shared/during.sst": KEEP_WRITER_ACTIVE, "shared/before.sst": DEL_SHARED}
    expired = lease("writer", [1], ttl=-1, created_ago=120.0)
    assert classify(files, leases=[expired], grace=0)[0]["shared/during.sst"] == DEL_SHARED


def test_live_writer_protects_every_attempt_folder_above_the_newest_checkpoint():
    """Issue 10 defect 2: a live writer's attempt folder (id above every committed one) is
    kept even when its files look older than the lease (clock skew, a reused lease)."""
    writer = lease("writer", [], created_ago=60.0)
    files = [info("chk-1/0/other/MANIFEST", OLD),   # below: an overlapping old attempt
             info("chk-2/0/t/MANIFEST", OLD), info("chk-7/1/t/CURRENT", None)]
    reasons, _ = classify(files, leases=[writer], grace=0)
    assert reasons["chk-1/0/other/MANIFEST"] == DEL_UNREFERENCED
    assert reasons["chk-2/0/t/MANIFEST"] == reasons["chk-7/1/t/CURRENT"] == KEEP_WRITER_ACTIVE
    assert classify(files, grace=0)[0]["chk-2/0/t/MANIFEST"] == DEL_UNCOMMITTED  # no writer


def test_reference_wins_over_folder_and_age():
    """Scenario 4: a file from another chk folder, listed by a committed checkpoint."""
    m = meta(3, ["shared/a.sst"], private=["chk-2/0/s/MANIFEST"])
    reasons, plan = classify([info("chk-2/0/s/MANIFEST", OLD), info("shared/a.sst", OLD)],
                             grace=0, checkpoints=[m])
    assert set(reasons.values()) == {KEEP_REFERENCED} and plan.deletions == ()


@pytest.fixture
def store(storage_url):
    s = CheckpointStore(open_storage(storage_url), "j")
    write_meta(s, meta(1, ["shared/a.sst"]))
    s.storage.write_bytes("shared/orphan.sst", b"x" * 100)
    s.storage.write_bytes("chk-2/0/t/MANIFEST", b"x" * 7)
    s.storage.write_bytes("savepoints/s/0/keep.sst", b"x")
    return s


def test_collect_garbage_on_storage(store):
    young = collect_garbage(store)
    assert young.files_deleted == 0 and young.to_json()["orphans_pending"] == 2
    later = datetime.now(UTC) + timedelta(hours=2)
    dry = collect_garbage(store, now=later, dry_run=True)
    assert dry.files_deleted == 0 and dry.to_json()["files_planned"] == 2
    assert store.storage.exists("shared/orphan.sst")
    report = collect_garbage(store, now=later)
    j = report.to_json()
    assert j["files_deleted"] == 2 and j["bytes_deleted"] == 107
    assert j["by_reason"][DEL_SHARED] == {"action": "delete", "files": 1, "bytes": 100}
    assert not store.storage.exists("shared/orphan.sst")
    assert store.storage.exists("savepoints/s/0/keep.sst")
    assert store.storage.exists("shared/a.sst") and store.checkpoint_ids() == [1]
    assert build_registry(store).missing() == []


def test_writer_lease_on_storage(store):
    with writer_lease(store.storage, "job run"):
        store.storage.write_bytes("shared/uploading.sst", b"u")
        report = collect_garbage(store, grace_seconds=0)
    reasons = {f.path: f.reason for f in report.plan.pending}
    assert reasons["shared/uploading.sst"] == KEEP_WRITER_ACTIVE
    assert store.storage.exists("shared/uploading.sst")


def test_executor_spares_what_a_lease_taken_after_planning_protects(store):
    """Scenario 10: GC planned while no writer ran; a run and a hold start before deleting."""
    store.storage.write_bytes("chk-3/0/t/MANIFEST", b"x" * 3)
    later = datetime.now(UTC) + timedelta(hours=2)
    plan = plan_gc(build_registry(store, now=later), grace_seconds=0)
    planned = {f.path for f in plan.deletions}
    assert planned == {"shared/orphan.sst", "chk-2/0/t/MANIFEST", "chk-3/0/t/MANIFEST"}
    acquire_hold(store.storage, "restore", [3])
    with writer_lease(store.storage, "job run"):
        report = execute_gc(store, plan, known_ids={1})
    assert set(report.spared) == planned and report.files_deleted == 0
    assert all(store.storage.exists(p) for p in planned)
    # once the leases are gone (hold expired), the same plan deletes
    report = execute_gc(store, plan, known_ids={1}, now=later)
    assert {f.path for f in report.deleted} == planned


def test_malformed_lease_refuses_gc(store):
    store.storage.write_bytes("leases/hold-bad.json", b"[]")
    with pytest.raises(MetadataError):
        collect_garbage(store, grace_seconds=0)
    assert store.storage.exists("shared/orphan.sst")
