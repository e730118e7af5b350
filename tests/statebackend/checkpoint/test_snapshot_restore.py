"""Incremental snapshots and restore, on file:// and s3:// (moto server).

Acceptance of issue 2: round trip of 200,000 keys over the four state kinds,
incremental uploads, asynchronous part, failed uploads, local recovery.
"""

from __future__ import annotations

import os
import threading

import pytest

from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.restore import restore_subtask
from statebackend.checkpoint.snapshot import checkpoint_backends, snapshot, upload_snapshot
from statebackend.checkpoint.store import (
    CheckpointStore,
    MetadataParts,
    build_metadata,
    metadata_path,
)
from statebackend.errors import LeaseConflictError, SnapshotError, StorageError, UsageError
from statebackend.storage import Storage, open_storage
from tests.statebackend.helpers import (
    DESCRIPTORS,
    close_all,
    dump_backends,
    fill,
    keys,
    open_backends,
    restore_all,
)

M = 128


def new_store(url: str, job: str = "orders") -> CheckpointStore:
    return CheckpointStore(open_storage(url), job)


def stored_files(store: CheckpointStore, under: str) -> list[str]:
    return [f.path for f in store.storage.walk_files(under)]


@pytest.mark.slow
def test_round_trip_200k_keys(durable_storage_url, tmp_path):
    store = new_store(durable_storage_url)
    backends = open_backends(str(tmp_path / "work"), 2)
    fill(backends, keys(200_000))
    before = dump_backends(backends)
    kinds = {r["state"] for r in before}
    assert kinds == {"totals", "events", "attrs", "maxima", "avg"}
    assert len({r["key"] for r in before}) == 200_000
    meta = checkpoint_backends(store, backends, parent=None, run_id="run-1")
    close_all(backends)

    loaded = store.load(meta.checkpoint_id)
    assert loaded == meta
    assert store.checkpoint_ids() == [1]
    assert loaded.summary()["rows"] == len(before)
    restored = restore_all(store, loaded, str(tmp_path / "fresh"))
    try:
        assert [b.restore_mode for b in restored] == ["download", "download"]
        assert dump_backends(restored) == before
        row = next(r for r in before if r["state"] == "attrs")
        assert restored[row["subtask"]].map_state("attrs").get(row["key"], row["user_key"]) \
            == row["value"]
    finally:
        close_all(restored)


def test_incremental_uploads_only_new_files(durable_storage_url, tmp_path):
    store = new_store(durable_storage_url)
    backends = open_backends(str(tmp_path / "work"), 2)
    all_keys = keys(60_000)
    fill(backends, all_keys)
    first = checkpoint_backends(store, backends, parent=None)
    fill(backends, all_keys[::100], version=1)  # 1% of the keys
    expected = dump_backends(backends)
    second = checkpoint_backends(store, backends, parent=first.checkpoint_id)
    close_all(backends)

    assert second.parent == first.checkpoint_id
    assert 0 < second.bytes_uploaded <= 0.10 * first.bytes_uploaded
    assert first.bytes_uploaded == first.bytes_referenced  # nothing to reuse the first time
    shared1 = {f.path for s in first.subtasks for f in s.shared_files}
    shared2 = {f.path for s in second.subtasks for f in s.shared_files}
    reused = shared1 & shared2
    assert reused, "the second checkpoint must reference SSTs of the first"
    assert sum(f.size for f in first.files if f.path in reused) > 0.9 * first.bytes_uploaded
    # every shared file exists once in storage: no copy per checkpoint
    in_storage = stored_files(store, "shared")
    assert len(in_storage) == len(set(in_storage)) == len(shared1 | shared2)
    assert set(in_storage) == shared1 | shared2
    # private files are per checkpoint
    for meta in (first, second):
        for s in meta.subtasks:
            assert all(f.path.startswith(f"chk-{meta.checkpoint_id}/{s.index}/")
                       for f in s.private_files)
    # checksums recorded at upload match the stored bytes
    some = sorted(reused)[0]
    ref = next(f for f in second.files if f.path == some)
    assert store.storage.checksum(some) == (ref.size, ref.checksum)

    restored = restore_all(store, store.load(second.checkpoint_id), str(tmp_path / "fresh"))
    try:
        assert dump_backends(restored) == expected
    finally:
        close_all(restored)


def _commit(store, backends, results, checkpoint_id, parent):
    """The driver's part of a checkpoint: build, commit, tell the backends."""
    meta = build_metadata(MetadataParts(job=store.job, checkpoint_id=checkpoint_id, parent=parent,
                          max_parallelism=M,
                          states=[d.to_json() for d in DESCRIPTORS],
                          handles=[r.handle for r in results]))
    store.commit(meta)
    for b, r in zip(backends, results, strict=True):
        b.notify_checkpoint_complete(r.handle)
    return meta


def test_writes_after_synchronous_part_go_to_the_next_snapshot(durable_storage_url, tmp_path,
                                                               monkeypatch):
    store = new_store(durable_storage_url)
    (backend,) = open_backends(str(tmp_path / "work"), 1)
    totals = backend.value_state("totals")
    totals.put("before", {"count": 1, "sum": 1.0, "flag": True})

    # Hold the upload until the writes below are done: they overlap the async part.
    gate = threading.Event()
    scheme_class = type(store.storage)
    real_put = scheme_class.put_file

    def gated_put(self, local_path, rel):
        assert gate.wait(30)
        return real_put(self, local_path, rel)

    monkeypatch.setattr(scheme_class, "put_file", gated_put)
    pending = snapshot(backend, store.storage, checkpoint_id=1, subtask=0)
    assert not pending.done()
    totals.put("after", {"count": 2, "sum": 2.0, "flag": False})
    totals.put("before", {"count": 99, "sum": 9.0, "flag": False})
    backend.list_state("events").add("after", "x")
    gate.set()
    result = pending.result()
    monkeypatch.undo()
    assert result.handle.row_counts["totals"] == 1
    first = _commit(store, [backend], [result], 1, None)

    second = checkpoint_backends(store, [backend], parent=1)
    backend.close()
    with restore_all(store, first, str(tmp_path / "r1"))[0] as r1:
        assert r1.value_state("totals").get("after") is None
        assert r1.value_state("totals").get("before")["count"] == 1
        assert r1.list_state("events").get("after") == []
    with restore_all(store, second, str(tmp_path / "r2"))[0] as r2:
        assert r2.value_state("totals").get("after")["count"] == 2
        assert r2.value_state("totals").get("before")["count"] == 99
        assert r2.list_state("events").get("after") == ["x"]


def _failing_put_file(monkeypatch, storage: Storage, fail_after: int, partial: bool):
    """``storage``'s put_file, failing from the (fail_after+1)-th call on, across threads."""
    real_put = type(storage).put_file
    lock = threading.Lock()
    calls = {"n": 0}

    def put_file(self, local_path, rel):
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n <= fail_after:
            return real_put(self, local_path, rel)
        if partial:  # a transfer that broke half-way leaves a partial object behind
            with open(local_path, "rb") as fh:
                self.write_bytes(rel, fh.read(max(1, os.path.getsize(local_path) // 2)))
        raise StorageError(f"{self.url}: injected failure uploading {rel}")

    monkeypatch.setattr(type(storage), "put_file", put_file)
    return calls


@pytest.mark.parametrize("partial", [False, True], ids=["clean-fault", "partial-write"])
def test_failed_upload_never_commits_and_cleans_up(durable_storage_url, tmp_path, monkeypatch,
                                                   partial):
    store = new_store(durable_storage_url)
    backends = open_backends(str(tmp_path / "work"), 2)
    fill(backends, keys(20_000))
    first = checkpoint_backends(store, backends, parent=None)
    expected = dump_backends(backends)
    before = set(stored_files(store, ""))

    fill(backends, keys(20_000)[::7], version=3)
    _failing_put_file(monkeypatch, store.storage, fail_after=3, partial=partial)
    with pytest.raises(SnapshotError, match="injected failure") as err:
        checkpoint_backends(store, backends, parent=first.checkpoint_id)
    assert "\n" not in str(err.value)
    monkeypatch.undo()

    assert not store.storage.exists(metadata_path(2))
    assert store.checkpoint_ids() == [1]
    assert set(stored_files(store, "")) == before, "the failed attempt left files behind"
    restored = restore_all(store, store.load(1), str(tmp_path / "fresh"))
    try:
        assert dump_backends(restored) == expected
    finally:
        close_all(restored)

    # the job carries on: the next attempt succeeds and references chk-1's SSTs
    retry = checkpoint_backends(store, backends, parent=1)
    assert retry.checkpoint_id >= 2
    assert {f.path for f in first.files if f.path.startswith("shared/")} & \
        {f.path for f in retry.files}
    close_all(backends)


def test_failed_subtask_discards_other_subtasks_uploads(durable_storage_url, tmp_path,
                                                        monkeypatch):
    store = new_store(durable_storage_url)
    backends = open_backends(str(tmp_path / "work"), 2)
    fill(backends, keys(5_000))
    real_upload = upload_snapshot

    def upload(job_storage, snap, *, checkpoint_id, subtask, backend, threads=4):
        if subtask == 1:  # not a SnapshotError: any failure must discard subtask 0's files
            raise StorageError("subtask 1 lost its executor")
        return real_upload(job_storage, snap, checkpoint_id=checkpoint_id, subtask=subtask,
                           backend=backend, threads=threads)

    monkeypatch.setattr("statebackend.checkpoint.snapshot.upload_snapshot", upload)
    with pytest.raises(StorageError, match="lost its executor"):
        checkpoint_backends(store, backends, parent=None)
    assert store.checkpoint_ids() == []
    assert stored_files(store, "") == []
    close_all(backends)


def test_local_recovery_modes(durable_storage_url, tmp_path):
    store = new_store(durable_storage_url)
    work = str(tmp_path / "work")
    backends = open_backends(work, 2)
    fill(backends, keys(10_000))
    meta = checkpoint_backends(store, backends, parent=None)
    expected = dump_backends(backends)
    # subtask 0 closes clean; subtask 1 writes after the snapshot (dirty)
    backends[1].value_state("totals").put(
        next(r["key"] for r in expected if r["subtask"] == 1 and r["state"] == "totals"),
        {"count": -1, "sum": -1.0, "flag": False})
    close_all(backends)

    restored = restore_all(store, meta, work)
    try:
        assert [b.restore_mode for b in restored] == ["local-instance", "local-snapshot"]
        assert dump_backends(restored) == expected
    finally:
        close_all(restored)

    # restored instances continue the lineage: the next checkpoint reuses chk-1's SSTs
    restored = restore_all(store, meta, work)
    try:
        assert [b.restore_mode for b in restored] == ["local-instance", "local-instance"]
        second = checkpoint_backends(store, restored, parent=1)
    finally:
        close_all(restored)
    assert second.bytes_uploaded < 0.2 * meta.bytes_uploaded

    fresh = restore_all(store, meta, str(tmp_path / "fresh"))
    try:
        assert [b.restore_mode for b in fresh] == ["download", "download"]
        assert dump_backends(fresh) == expected
    finally:
        close_all(fresh)

    # a local snapshot that does not match the handle is not trusted
    handle = meta.subtasks[0]
    local_snapshot = os.path.join(work, "sub-0", "snapshots", handle.snapshot_id)
    victim = next(f.local_name for f in handle.shared_files)
    with open(os.path.join(local_snapshot, victim), "ab") as fh:
        fh.write(b"garbage")
    os.unlink(os.path.join(work, "sub-0", "instance.json"))
    with restore_subtask(store.storage, handle, os.path.join(work, "sub-0"), DESCRIPTORS, M) as b:
        assert b.restore_mode == "download"
        assert dump_backends([b]) == [r for r in expected if r["subtask"] == 0]
    no_local = restore_all(store, meta, work, allow_local=False)
    try:
        assert [b.restore_mode for b in no_local] == ["download", "download"]
    finally:
        close_all(no_local)


def test_corrupted_remote_file_fails_restore(durable_storage_url, tmp_path):
    store = new_store(durable_storage_url)
    (backend,) = open_backends(str(tmp_path / "work"), 1)
    fill([backend], keys(2_000))
    meta = checkpoint_backends(store, [backend], parent=None)
    backend.close()
    sst = next(f for f in meta.files if f.path.startswith("shared/"))
    store.storage.write_bytes(sst.path, b"not the sst that was uploaded")
    target = tmp_path / "fresh"
    with pytest.raises(StorageError, match="corrupted or replaced"):
        restore_subtask(store.storage, meta.subtasks[0], str(target), DESCRIPTORS, M)
    assert not (target / "db" / sst.local_name).exists()  # never opened half-restored
    assert not [p for p in os.listdir(target) if p.startswith(".restore-")]


def test_commit_is_exclusive_and_metadata_round_trips(tmp_path):
    store = new_store(f"file://{tmp_path}/store")
    (backend,) = open_backends(str(tmp_path / "work"), 1)
    fill([backend], keys(100))
    meta = checkpoint_backends(store, [backend], parent=None, run_id="r1", inputs=["in/a"],
                               extra={"note": 1})
    backend.close()
    raw = store.storage.read_bytes(metadata_path(1))
    assert CheckpointMetadata.from_bytes(raw, "m") == meta
    assert meta.run_id == "r1" and meta.input == ("in/a",) and meta.extra == {"note": 1}
    with pytest.raises(LeaseConflictError, match="committed by another writer"):
        store.commit(meta)
    assert store.find_by_run_id("r1") == meta and store.find_by_run_id("r2") is None
    assert store.resolve("latest") == store.resolve("chk-1") == store.resolve(1) == meta
    assert store.next_checkpoint_id() == 2
    store.storage.write_bytes("chk-5/0/x/CURRENT", b"x")  # a failed attempt's folder
    # the next id follows the latest (lineage.py: parent + 1), whatever folders exist
    assert store.checkpoint_ids() == [1] and store.next_checkpoint_id() == 2
    handle = meta.subtasks[0]
    with pytest.raises(UsageError, match="expected subtask 0"):
        build_metadata(MetadataParts(job="orders", checkpoint_id=9, parent=None, max_parallelism=M,
                       states=[], handles=[handle, handle]))
