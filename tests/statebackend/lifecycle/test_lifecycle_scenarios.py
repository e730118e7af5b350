"""Named lifecycle scenarios (gc.py failure scenarios), on file:// and s3://.

`Job` below is a tiny in-process job (P RocksDB backends, one value state) that
the other lifecycle test modules import.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

import pytest

from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.layout import INDEX_DIR, INDEX_FILE
from statebackend.checkpoint.leases import acquire_writer_lease, writer_lease
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.snapshot import checkpoint_backends, upload_snapshot
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.errors import (
    LeaseConflictError,
    LeaseLostError,
    MissingFilesError,
    UsageError,
)
from statebackend.lifecycle.gc import (
    DEL_UNREFERENCED,
    KEEP_PENDING,
    KEEP_WRITER_ACTIVE,
    collect_garbage,
    execute_gc,
    plan_gc,
)
from statebackend.lifecycle.registry import build_registry
from statebackend.lifecycle.retention import DEL_RELEASED_SHARED, KEEP_LAST_RESTORABLE, retain
from statebackend.lifecycle.savepoint import create_savepoint, import_start_point
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import key_group_for_bytes, key_group_range_for_subtask
from statebackend.state.kinds import StateDescriptor
from statebackend.storage import open_storage

DESC = (StateDescriptor("v", "value"),)
M = 16
LATER = datetime.now(UTC) + timedelta(hours=2)


class Job:
    """In-process job with ``parallelism`` backends; ``model`` is its current state."""

    def __init__(self, storage, name: str, base_dir: str, parallelism: int = 2) -> None:
        self.storage = storage
        self.store = CheckpointStore(storage, name)
        self.base_dir = base_dir
        self.parallelism = parallelism
        self.backends = [
            KeyedStateBackend(os.path.join(base_dir, name, f"sub-{i}"), DESC, M,
                              key_group_range_for_subtask(M, parallelism, i))
            for i in range(parallelism)]
        self.model: dict[str, object] = {}
        self.expected: dict[int, dict] = {}
        self.parent: int | None = None

    def write(self, keys, value) -> None:
        for k in keys:
            kg = key_group_for_bytes(k.encode(), M)
            self.backends[kg * self.parallelism // M].value_state("v").put(k, value)
            self.model[k] = value

    def checkpoint(self, **kwargs) -> CheckpointMetadata:
        meta = checkpoint_backends(self.store, self.backends, parent=self.parent, **kwargs)
        self.expected[meta.checkpoint_id] = dict(self.model)
        self.parent = meta.checkpoint_id
        return meta

    def compact(self) -> None:
        for b in self.backends:
            b.compact()

    def restore_from(self, meta: CheckpointMetadata, state: dict) -> None:
        from statebackend.checkpoint.restore import FROM_STORAGE, restore_subtask

        self.close()
        self.backends = [restore_subtask(self.store.storage, h,
                                         os.path.join(self.base_dir, self.store.job,
                                                      f"r{meta.checkpoint_id}-{h.index}"),
                                         DESC, M, FROM_STORAGE) for h in meta.subtasks]
        self.model = dict(state)
        self.parent = meta.checkpoint_id

    def close(self) -> None:
        for b in self.backends:
            b.close()


def state(store: CheckpointStore, meta: CheckpointMetadata) -> dict:
    return {r["key"]: r["value"] for r in checkpoint_rows(store, meta)}


def assert_all_restore(job: Job) -> None:
    assert job.store.checkpoint_ids() == sorted(job.expected)
    for cid, want in job.expected.items():
        assert state(job.store, job.store.load(cid)) == want, f"chk-{cid}"
    assert build_registry(job.store).missing() == []


@pytest.fixture
def job(durable_storage_url, tmp_path):
    j = Job(open_storage(durable_storage_url), "orders", str(tmp_path / "local"))
    yield j
    j.close()


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_aborted_checkpoint_files_referenced_by_later_checkpoint(job):
    """Scenario 4: attempt 2 aborts; its retry (checkpoint 2 again: a checkpoint's id is its
    parent's + 1) lists the files the aborted attempt uploaded."""
    job.write(keys(40), 1)
    job.checkpoint()
    job.write(keys(20), 2)
    results = [upload_snapshot(job.store.storage, b.take_local_snapshot(), checkpoint_id=2,
                               subtask=i, backend=b) for i, b in enumerate(job.backends)]
    aborted = {p for r in results for p in r.uploaded_paths}
    stray = "chk-2/0/stray-upload.tmp"
    job.storage.write_bytes(f"orders/{stray}", b"half an upload")
    # a later checkpoint (a retry of the same snapshot) commits those very files
    meta = build_metadata(MetadataParts(job="orders", checkpoint_id=2, parent=1, max_parallelism=M,
                          states=[d.to_json() for d in DESC], handles=[r.handle for r in results]))
    job.store.commit(meta)
    job.expected[2] = dict(job.model)
    assert aborted <= {f.path for f in meta.files}

    plan = plan_gc(build_registry(job.store, now=LATER), grace_seconds=0)
    assert aborted <= set(plan.referenced)
    assert [f.path for f in plan.deletions] == [stray]
    report = collect_garbage(job.store, grace_seconds=0, now=LATER)
    assert report.files_deleted == 1
    retain(job.store, 1)
    del job.expected[1]
    collect_garbage(job.store, grace_seconds=0, now=LATER)
    assert_all_restore(job)


def test_job_started_from_another_jobs_checkpoint(job, tmp_path):
    job.write(keys(50), 1)
    job.checkpoint()
    job.write(keys(30), 2)
    job.checkpoint()
    first = import_start_point(job.storage, "orders-v2", "orders:latest")
    assert first.checkpoint_id == 1 and first.parent is None
    assert first.source == {"job": "orders", "checkpoint": 2, "savepoint": None}
    assert all(not f.path.startswith("..") for f in first.files)
    other = Job(job.storage, "orders-v2", str(tmp_path / "local2"))
    try:
        other.expected[1] = dict(job.expected[2])
        other.restore_from(first, job.expected[2])
        other.write(keys(10, "n"), 3)
        other.checkpoint()
        # the source job moves on and collects everything it can
        job.write(keys(50), 4)
        job.compact()
        job.checkpoint()
        retain(job.store, 1)
        job.expected = {max(job.expected): job.expected[max(job.expected)]}
        collect_garbage(job.store, grace_seconds=0, now=LATER)
        retain(other.store, 1)
        del other.expected[1]
        collect_garbage(other.store, grace_seconds=0, now=LATER)
        assert_all_restore(job)
        assert_all_restore(other)
        with pytest.raises(UsageError, match="already has checkpoints"):
            import_start_point(job.storage, "orders-v2", "orders:latest")
    finally:
        other.close()


def test_job_started_from_a_savepoint(job, tmp_path):
    job.write(keys(30), 1)
    cid = job.checkpoint().checkpoint_id
    sp = create_savepoint(job.store, cid, "before-migration")
    assert all(f.path.startswith("savepoints/before-migration/") for f in sp.files)
    job.write(keys(30), 2)
    job.compact()
    job.checkpoint()
    retain(job.store, 1)
    collect_garbage(job.store, grace_seconds=0, now=LATER)
    for target, spec in (("v2", "orders/savepoints/before-migration"),
                         ("v3", "before-migration")):
        meta = import_start_point(job.storage, target, spec)
        assert meta.source == {"job": "orders", "checkpoint": cid,
                               "savepoint": "before-migration"}
        assert state(CheckpointStore(job.storage, target), meta) == job.expected[cid]


def test_two_overlapping_attempts_same_id(job):
    """Scenario 5: the second commit of an id fails; its files become orphans."""
    job.write(keys(40), 1)
    job.checkpoint()
    job.write(keys(40), 2)
    loser_results = [upload_snapshot(job.store.storage, b.take_local_snapshot(), checkpoint_id=2,
                                     subtask=i, backend=b) for i, b in enumerate(job.backends)]
    winner = job.checkpoint()  # checkpoint 2
    loser = build_metadata(MetadataParts(job="orders", checkpoint_id=2, parent=1, max_parallelism=M,
                           states=[d.to_json() for d in DESC],
                           handles=[r.handle for r in loser_results]))
    with pytest.raises(LeaseConflictError):
        job.store.commit(loser)
    # the built-in driver path cleans up after itself
    with pytest.raises(LeaseConflictError):
        checkpoint_backends(job.store, job.backends, parent=1)  # checkpoint 2
    orphans = {p for r in loser_results for p in r.uploaded_paths}
    assert orphans.isdisjoint(f.path for f in winner.files)
    pending = collect_garbage(job.store)  # default grace: all young
    assert pending.files_deleted == 0
    assert {f.path for f in pending.plan.pending} == orphans
    report = collect_garbage(job.store, now=LATER)
    assert {f.path for f in report.deleted} == orphans
    assert {f.reason for f in report.deleted if f.path.startswith("chk-2/")} == {DEL_UNREFERENCED}
    assert_all_restore(job)


def test_gc_racing_an_in_progress_upload(job):
    """Scenarios 1 and 3: young orphans survive; a commit after planning is spared."""
    job.write(keys(40), 1)
    job.checkpoint()
    job.write(keys(40), 2)
    results = [upload_snapshot(job.store.storage, b.take_local_snapshot(), checkpoint_id=2,
                               subtask=i, backend=b) for i, b in enumerate(job.backends)]
    uploading = {p for r in results for p in r.uploaded_paths}
    report = collect_garbage(job.store, grace_seconds=3600)
    assert report.files_deleted == 0
    assert {f.path for f in report.plan.pending} == uploading
    assert {f.reason for f in report.plan.pending} == {KEEP_PENDING}
    with writer_lease(job.store.storage, "job run"):
        report = collect_garbage(job.store, grace_seconds=0)
        assert report.files_deleted == 0
        assert {f.reason for f in report.plan.pending} == {KEEP_WRITER_ACTIVE}
    # GC plans while the files look old, then the attempt commits before GC deletes
    plan = plan_gc(build_registry(job.store, now=LATER), grace_seconds=3600)
    assert {f.path for f in plan.deletions} == uploading
    meta = build_metadata(MetadataParts(job="orders", checkpoint_id=2, parent=1, max_parallelism=M,
                          states=[d.to_json() for d in DESC], handles=[r.handle for r in results]))
    job.store.commit(meta)
    job.expected[2] = dict(job.model)
    report = execute_gc(job.store, plan, known_ids={1})
    assert report.files_deleted == 0 and set(report.spared) == uploading
    assert_all_restore(job)


def upload_attempt(job: Job, checkpoint_id: int) -> list:
    return [upload_snapshot(job.store.storage, b.take_local_snapshot(),
                            checkpoint_id=checkpoint_id, subtask=i, backend=b)
            for i, b in enumerate(job.backends)]


def attempt_metadata(job: Job, checkpoint_id: int, results) -> CheckpointMetadata:
    return build_metadata(MetadataParts(
        job="orders", checkpoint_id=checkpoint_id, parent=job.parent,
                          max_parallelism=M, states=[d.to_json() for d in DESC],
                          handles=[r.handle for r in results]))


def test_run_longer_than_the_lease_ttl_stays_protected(job):
    """Issue 10 defect 2: the run outlives its lease TTL; the heartbeat keeps GC (grace 0)
    off its in-flight files, the commit succeeds and every checkpoint restores."""
    job.write(keys(40), 1)
    job.checkpoint()
    with writer_lease(job.store.storage, "long run", ttl_seconds=1.0,
                      heartbeat_seconds=0.1) as held:
        job.write(keys(40), 2)
        results = upload_attempt(job, 2)
        in_flight = {p for r in results for p in r.uploaded_paths}
        taken = time.time()
        deadline = time.monotonic() + 30
        # past two TTLs after the lease was taken, and the heartbeat kept it alive
        while datetime.fromisoformat(held.lease.expires_at).timestamp() < taken + 2.0:
            assert time.monotonic() < deadline and held.lost is None
            time.sleep(0.05)
        report = collect_garbage(job.store, grace_seconds=0)
        assert report.files_deleted == 0
        assert in_flight <= {f.path for f in report.plan.pending}
        job.store.commit(attempt_metadata(job, 2, results))
    job.expected[2] = dict(job.model)
    assert_all_restore(job)


def test_lost_writer_lease_refuses_the_commit(job):
    """Issue 10 defect 3 (safe take-over): the old holder's commit raises LeaseLostError."""
    job.write(keys(40), 1)
    job.checkpoint()
    with writer_lease(job.store.storage, "paused run", heartbeat_seconds=10.0):
        job.write(keys(40), 2)
        # the holder stalled past its TTL and a new run took the lease over
        job.store.storage.delete_many(["leases/writer.json"])
        acquire_writer_lease(job.store.storage, "next run")
        with pytest.raises(LeaseLostError, match="taken over by next run"):
            job.checkpoint()
    assert job.store.checkpoint_ids() == [1]
    assert [o.path for o in build_registry(job.store).orphans()] == []  # uploads discarded


def test_commit_refuses_missing_or_resized_files(job):
    """Issue 10 defect 2: a commit must not reference files GC (or anyone) removed."""
    job.write(keys(40), 1)
    job.checkpoint()
    job.write(keys(40), 2)
    results = upload_attempt(job, 2)
    meta = attempt_metadata(job, 2, results)
    private = sorted(f.path for f in meta.files if f.path.startswith("chk-2/"))
    job.store.storage.delete_many([private[0]])
    job.store.storage.write_bytes(private[1], b"truncated")
    with pytest.raises(MissingFilesError, match=rf"checkpoint 2 of job 'orders' not committed: "
                       rf"2 referenced file\(s\) .*{private[0]} \(missing\), {private[1]} "
                       rf"\(size 9, recorded \d+\)"):
        job.store.commit(meta)
    assert not job.store.storage.exists("chk-2/_metadata")
    assert job.store.checkpoint_ids() == [1]


def test_retention_keeps_the_newest_checkpoint_that_restores(job):
    """Issue 10 defect 2: chk-2 and chk-3 lost files (committed by an older release); keep 1
    must keep chk-1, which restores, instead of retiring it."""
    job.write(keys(40), 1)
    job.checkpoint()
    for v in (2, 3):
        job.write(keys(40, f"n{v}-"), v)
        meta = attempt_metadata(job, v, upload_attempt(job, v))
        lost = sorted(f.path for f in meta.files if f.path.startswith(f"chk-{v}/"))[0]
        job.store.storage.delete_many([lost])
        job.store.storage.write_exclusive(f"chk-{v}/_metadata", meta.to_bytes())  # no checks
        job.parent = v
    dry = retain(job.store, 1, dry_run=True).to_json()
    assert {d["id"]: d["reason"] for d in dry["checkpoints"]} == {
        1: KEEP_LAST_RESTORABLE, 2: "keep-above-restorable", 3: "newest"}
    report = retain(job.store, 1)
    assert report.plan.retired == () and job.store.checkpoint_ids() == [1, 2, 3]
    assert state(job.store, job.store.load(1)) == job.expected[1]


def test_job_and_savepoint_names_with_trailing_newline_are_refused(job):
    """Issue 10 defect 11: `$` matched before a trailing newline."""
    job.write(keys(5), 1)
    cid = job.checkpoint().checkpoint_id
    for bad in ("sp\n", "sp ", "sp\r", "sp\n\n", "s\np"):
        with pytest.raises(UsageError, match="invalid"):
            create_savepoint(job.store, cid, bad)
        with pytest.raises(UsageError, match="invalid"):
            CheckpointStore(job.storage, bad)
    assert not job.store.storage.list_dir("savepoints")


def test_compaction_then_retention_reclaims_replaced_ssts(job):
    for v in range(3):
        job.write(keys(60), v)
        job.checkpoint()
    before = {f.path for cid in job.expected for f in job.store.load(cid).files
              if f.path.startswith("shared/")}
    job.compact()
    job.write(keys(5), 9)
    last = job.checkpoint()
    kept_shared = {f.path for f in last.files if f.path.startswith("shared/")}
    assert before.isdisjoint(kept_shared)  # compaction replaced every SST
    report = retain(job.store, 1)
    released = {a.path for a in report.deleted if a.reason == DEL_RELEASED_SHARED}
    assert released == before
    job.expected = {last.checkpoint_id: job.expected[last.checkpoint_id]}
    listed = {f.path for f in job.store.storage.walk_files("shared")}
    assert listed == kept_shared
    assert report.bytes_deleted > 0
    assert_all_restore(job)


def test_storage_stays_bounded_over_50_runs(tmp_path, capsys):
    """50 runs, --keep 3 and GC after each: referenced bytes stay bounded.

    300 of 3000 keys get new incompressible values per run; RocksDB compacts on
    its own and we compact explicitly (a full rewrite) every 10 runs. Right after a
    full rewrite the three retained checkpoints may each hold their own full copy:
    the ratio of referenced bytes to the live state (the newest checkpoint) then
    peaks near ``keep`` and falls back once older checkpoints retire. We assert the
    end (the issue's criterion) and the typical (median) ratio are within 2x, the
    peak within keep (+ private files), and that the stored bytes do not grow.
    """
    import statistics
    import uuid

    j = Job(open_storage(f"file://{tmp_path}/store"), "bounded", str(tmp_path / "local"))
    ratios, stored_per_run, index_sizes = [], [], []
    try:
        for i in range(3000):
            j.write([f"user{i}"], uuid.uuid4().hex * 3)
        for run in range(50):
            for i in range(300):  # distinct incompressible values: SSTs dominate the bytes
                j.write([f"user{(run * 300 + i) % 3000}"], uuid.uuid4().hex * 3)
            if run % 10 == 4:
                j.compact()
            j.checkpoint()
            retain(j.store, 3)
            collect_garbage(j.store, grace_seconds=0)
            registry = build_registry(j.store)
            ratios.append(registry.bytes_referenced() / j.store.latest().bytes_referenced)
            # the registry index (_index/) is a cache, bounded on its own below; runs/ is
            # the ledger and the commit log: one small record per run, by design
            stored_per_run.append(sum(f.size for p, f in registry.files.items()
                                      if not p.startswith((INDEX_DIR + "/", "runs/"))))
            index_sizes.append(registry.size_of(INDEX_FILE))
        live = j.store.latest().bytes_referenced
        referenced = registry.bytes_referenced()
        median = statistics.median(ratios)
        with capsys.disabled():
            print(f"\n[bounded storage] 50 runs, keep 3: end: referenced {referenced} B, stored "
                  f"{stored_per_run[-1]} B, live (newest checkpoint) {live} B, ratio "
                  f"{referenced / live:.2f}; ratio over runs: median {median:.2f}, "
                  f"min {min(ratios):.2f}, max {max(ratios):.2f}; peak stored "
                  f"{max(stored_per_run)} B")
        assert referenced <= 2.0 * live
        assert median <= 2.0
        assert max(ratios) <= 3.75  # keep=3 full copies right after compactions + private files
        # No growth. RocksDB's background compactions land at slightly different runs
        # from one execution to the next, so compare windows with slack, not run by run.
        assert max(stored_per_run[-10:]) <= 1.5 * max(stored_per_run[10:20])
        assert stored_per_run[-1] <= referenced + 3 * 4096  # plus the commit records
        assert 0 < index_sizes[-1] and max(index_sizes) <= 64 * 1024  # compacted, not growing
        assert registry.orphans() == []
        j.expected = {cid: j.expected[cid] for cid in j.store.checkpoint_ids()}
        assert len(j.expected) == 3
        assert_all_restore(j)
    finally:
        j.close()
