"""A RocksDB snapshot's row counts: tracked through the writes that know what they
change (TTL writes and purge, insert_absent), else counted by a scan; always equal to
a scan of the instance, also across restores.

The suite runs with ``CKPT_ROW_COUNTS=verify`` (every snapshot checks its tracked
counts against a scan); here each test also spies on the scan to prove which path ran.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from statebackend.checkpoint.restore import FROM_STORAGE, restore_subtask
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import SnapshotError, UsageError
from statebackend.state.backend import ROW_COUNTS_ENV, KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.kinds import StateDescriptor
from statebackend.state.ttl import TTL_INDEX, StateTtl, purge_expired
from statebackend.storage import open_storage

M = 16
SEEN = StateDescriptor("seen", "value", ttl=StateTtl(1_000, "event"))
FIRST = StateDescriptor("first", "value")  # no TTL: insert_absent's own path
PLAIN = StateDescriptor("plain", "value")
DESCS = (SEEN, FIRST, PLAIN)


@pytest.fixture
def scans(monkeypatch):
    """How many full count scans snapshots ran (the tracked path runs none)."""
    calls = []
    original = KeyedStateBackend.count_rows

    def counting(self):
        calls.append(self.label)
        return original(self)

    monkeypatch.setattr(KeyedStateBackend, "count_rows", counting)
    monkeypatch.setenv(ROW_COUNTS_ENV, "tracked")
    return calls


def scanned(backend: KeyedStateBackend) -> dict[str, int]:
    return {n: backend.count_keys(n) for n in backend.column_families}


def dedup_steps(backend: KeyedStateBackend, rng: random.Random, step: int) -> None:
    """One run's writes as the dedup job makes them: insert_absent of a batch of ids at
    their event times (some repeated, some expired and not purged yet), then a purge."""
    now = step * 400
    backend.set_time(event_time=now)
    seen, first = backend.value_state("seen"), backend.value_state("first")
    ids = sorted({f"id-{rng.randrange(300)}" for _ in range(120)})
    times = np.array([now + rng.randrange(-300, 300) for _ in ids], dtype=np.int64)
    rks = backend.rocks_keys(ids)
    seen.insert_absent_raw(rks, [seen.codec.encode(1)] * len(ids), timestamps=times)
    first.insert_absent_raw(rks, [first.codec.encode(step)] * len(ids))
    seen.delete_many(ids[:5])  # a TTL delete: the entry and its index entry go
    seen.put_many(ids[5:10], [2] * 5, timestamps=now + 50)  # moves index entries
    purge_expired(backend, "event", now - 200)


def test_tracked_counts_follow_ttl_writes_purges_and_insert_absent(tmp_path, scans):
    rng = random.Random(3)
    backend = KeyedStateBackend(str(tmp_path / "b"), DESCS, M, KeyGroupRange(0, M - 1))
    try:
        for step in range(1, 8):
            dedup_steps(backend, rng, step)
            snapshot = backend.take_local_snapshot()
            assert snapshot.row_counts == scanned(backend)
        assert scans == []  # every count came from the writes, none from a scan
        assert snapshot.row_counts["seen"] > 0 and snapshot.row_counts[TTL_INDEX] > 0
        assert snapshot.row_counts[TTL_INDEX] == snapshot.row_counts["seen"]
    finally:
        backend.close()


def test_a_write_that_does_not_say_what_it_changed_falls_back_to_one_scan(tmp_path, scans):
    backend = KeyedStateBackend(str(tmp_path / "b"), DESCS, M, KeyGroupRange(0, M - 1))
    try:
        dedup_steps(backend, random.Random(4), 1)
        backend.value_state("plain").put("k", "blind")  # a put that did not read first
        backend.value_state("plain").put("k", "again")  # an overwrite: still one entry
        first = backend.take_local_snapshot()
        assert len(scans) == 1 and first.row_counts == scanned(backend)
        assert first.row_counts["plain"] == 1
        dedup_steps(backend, random.Random(5), 2)  # known again after that scan
        assert backend.take_local_snapshot().row_counts == scanned(backend)
        assert len(scans) == 1
    finally:
        backend.close()


def test_a_restore_starts_from_the_recorded_counts(tmp_path, scans):
    storage = open_storage(f"file://{tmp_path}/store")
    store = CheckpointStore(storage, "job")
    rng = random.Random(6)
    backend = KeyedStateBackend(str(tmp_path / "w0"), DESCS, M, KeyGroupRange(0, M - 1))
    dedup_steps(backend, rng, 1)
    meta = checkpoint_backends(store, [backend], parent=None)
    backend.close()
    for step in range(2, 5):
        handle = meta.subtasks[0]
        restored = restore_subtask(store.storage, handle, str(tmp_path / f"w{step}"),
                                   list(DESCS), M, FROM_STORAGE)
        dedup_steps(restored, rng, step)
        meta = checkpoint_backends(store, [restored], parent=meta.checkpoint_id)
        assert dict(meta.subtasks[0].row_counts) == scanned(restored)
        restored.close()
    assert scans == []


def test_verify_fails_a_snapshot_whose_tracked_counts_drift(tmp_path, monkeypatch):
    monkeypatch.setenv(ROW_COUNTS_ENV, "verify")
    backend = KeyedStateBackend(str(tmp_path / "b"), DESCS, M, KeyGroupRange(0, M - 1))
    try:
        dedup_steps(backend, random.Random(7), 1)
        backend.take_local_snapshot()
        # a writer that misreports what it changed (as a bug in a tracked path would)
        backend.write_pairs(backend.column_family_handle("plain"), [(b"\x00\x01k", b"v")],
                            changes={"plain": 2})
        with pytest.raises(SnapshotError, match="tracked row counts .* differ from a scan"):
            backend.take_local_snapshot()
    finally:
        backend.close()


def test_scan_mode_always_scans(tmp_path, scans, monkeypatch):
    monkeypatch.setenv(ROW_COUNTS_ENV, "scan")
    backend = KeyedStateBackend(str(tmp_path / "b"), DESCS, M, KeyGroupRange(0, M - 1))
    try:
        dedup_steps(backend, random.Random(8), 1)
        assert backend.take_local_snapshot().row_counts == scanned(backend)
        assert len(scans) == 1
    finally:
        backend.close()


def test_a_put_of_the_keys_just_read_is_tracked_and_any_other_is_not(tmp_path, scans):
    backend = KeyedStateBackend(str(tmp_path / "b"), DESCS, M, KeyGroupRange(0, M - 1))
    plain = backend.value_state("plain")
    try:
        rks = backend.rocks_keys([f"k{i}" for i in range(50)])
        plain.read_raw(rks)
        plain.put_raw(rks, [plain.codec.encode(1)] * 50)  # 50 new entries, known
        plain.read_raw(rks)
        plain.put_raw(rks, [plain.codec.encode(2)] * 50)  # overwrites: none added
        assert backend.take_local_snapshot().row_counts["plain"] == 50 and scans == []
        more = backend.rocks_keys([f"k{i}" for i in range(40, 60)])
        plain.read_raw(more)
        backend.value_state("first").put("x", 1)  # a write between the read and the put
        plain.put_raw(more, [plain.codec.encode(3)] * 20)
        assert backend.take_local_snapshot().row_counts == scanned(backend)
        assert len(scans) == 1 and scanned(backend)["plain"] == 60
        plain.read_raw(more)
        plain.put_raw(list(more), [plain.codec.encode(4)] * 20)  # not the list read
        twice = [more[0], more[0]]
        plain.read_raw(twice)
        plain.put_raw(twice, [plain.codec.encode(5)] * 2)  # a key twice
        assert backend.take_local_snapshot().row_counts == scanned(backend)
        assert len(scans) == 2
    finally:
        backend.close()


def test_keyed_aggregation_runs_record_counts_without_a_scan(tmp_path, scans):
    from demo.sample_data import expected_totals, generate_events
    from jobs.keyed_aggregation import JOB
    from statebackend.job import RunConfig, run_job

    days = [generate_events(str(tmp_path / f"in{d}"), n_events=3000, n_keys=900, seed=d,
                            start_ts_ms=1_800_000_000_000 + d * 86_400_000)
            for d in range(3)]
    store = CheckpointStore(open_storage(f"file://{tmp_path}/store"), JOB.name)
    for d in range(3):
        run_job(JOB, RunConfig(input=str(tmp_path / f"in{d}"), storage=f"file://{tmp_path}/store",
                               run_id=f"d{d}", parallelism=3, engine="local",
                               output=str(tmp_path / "out")))
        counted = sum(h.row_counts["totals"] for h in store.latest().subtasks)
        assert counted == len(expected_totals(days[: d + 1]))  # pandas: the distinct keys
    assert scans == []  # each fold reads its keys, then puts them: counts tracked


def test_reducing_aggregating_and_list_adds_are_tracked(tmp_path, scans):
    from tests.statebackend.helpers import Average

    descs = (StateDescriptor("sum", "reducing", reduce_fn=lambda a, b: a + b),
             StateDescriptor("avg", "aggregating", aggregate_fn=Average()),
             StateDescriptor("seen_at", "list"),
             StateDescriptor("recent", "reducing", reduce_fn=max, ttl=StateTtl(500, "event")))
    backend = KeyedStateBackend(str(tmp_path / "b"), descs, M, KeyGroupRange(0, M - 1))
    rng = random.Random(9)
    try:
        for step in range(1, 6):
            backend.set_time(event_time=step * 300)
            keys = [f"u{rng.randrange(80)}" for _ in range(60)]  # repeats within a call
            values = [rng.randrange(100) for _ in keys]
            backend.reducing_state("sum").add_many(keys, values)
            backend.aggregating_state("avg").add_many(keys, values)
            backend.list_state("seen_at").add_many(keys, values)
            backend.reducing_state("recent").add_many(keys, values)
            backend.reducing_state("sum").add("solo", 1)
            purge_expired(backend, "event", step * 300)
            assert backend.take_local_snapshot().row_counts == scanned(backend)
        assert scans == []
    finally:
        backend.close()


def test_a_bad_setting_is_refused_in_one_line_before_any_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv(ROW_COUNTS_ENV, "sometimes")
    backend = KeyedStateBackend(str(tmp_path / "b"), DESCS, M, KeyGroupRange(0, M - 1))
    try:
        backend.value_state("plain").put("k", 1)
        with pytest.raises(UsageError, match="CKPT_ROW_COUNTS='sometimes' is unknown; use one "
                                             r"of \['tracked', 'scan', 'verify'\]"):
            backend.take_local_snapshot()
    finally:
        backend.close()
