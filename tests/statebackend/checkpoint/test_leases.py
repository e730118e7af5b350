"""Leases: heartbeat, stale take-over, racing takers, lost leases (leases.py scenarios 1-5).

Issue 10, defects 2 and 3. Runs on every storage backend; no Spark.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from statebackend.checkpoint.layout import CLAIM_PREFIX, LEASES_DIR
from statebackend.checkpoint.leases import (
    DEFAULT_TTL_SECONDS,
    TTL_ENV,
    Lease,
    acquire_writer_lease,
    hold,
    lease_timing,
    list_leases,
    writer_lease,
)
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import LeaseConflictError, LeaseLostError, UsageError
from statebackend.storage import open_storage

WRITER_PATH = f"{LEASES_DIR}/writer.json"


@pytest.fixture
def storage(storage_url):
    return CheckpointStore(open_storage(storage_url), "j").storage


def current(storage) -> Lease:
    return Lease.from_bytes(storage.read_bytes(WRITER_PATH), WRITER_PATH)


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_default_timing_is_short_and_configurable(monkeypatch):
    monkeypatch.delenv(TTL_ENV, raising=False)
    assert lease_timing() == (DEFAULT_TTL_SECONDS, DEFAULT_TTL_SECONDS / 4) == (60.0, 15.0)
    monkeypatch.setenv(TTL_ENV, "120")
    assert lease_timing() == (120.0, 30.0)
    assert lease_timing(2.0, 0.2) == (2.0, 0.2)
    with pytest.raises(UsageError, match="heartbeat"):
        lease_timing(10.0, 6.0)  # two missed beats would let it expire
    monkeypatch.setenv(TTL_ENV, "soon")
    with pytest.raises(UsageError, match=f"{TTL_ENV}='soon'"):
        lease_timing()


def test_heartbeat_renews_past_the_ttl(storage):
    """Scenario 1: the lease outlives its TTL while the holder is alive, then is released."""
    # a 2 s TTL: a renewal (read + write on moto) must not lapse on a loaded machine
    with writer_lease(storage, "long run", ttl_seconds=2.0, heartbeat_seconds=0.2) as held:
        first = current(storage)
        created = datetime.fromisoformat(first.created_at)
        # wait until the lease has been renewed beyond two TTLs after it was taken
        wait_for(lambda: datetime.fromisoformat(current(storage).expires_at)
                 > created + timedelta(seconds=4.0))
        now = current(storage)
        assert now.token == first.token and held.lost is None and held.renewals >= 2
        assert now.expires_at > first.expires_at
    assert list_leases(storage) == []


def test_hold_is_renewed_too(storage):
    with hold(storage, "validation", [3], ttl_seconds=1.0, heartbeat_seconds=0.1) as held:
        wait_for(lambda: held.renewals >= 2)
        (lease,) = list_leases(storage)
        assert lease.checkpoint_ids == (3,) and lease.token == held.token
    assert list_leases(storage) == []


def test_stale_lease_is_taken_over(storage):
    """Scenario 2: a live lease refuses a second writer; a stale one (dead holder) is taken over."""
    live = acquire_writer_lease(storage, "run r1", ttl_seconds=60.0)
    with pytest.raises(LeaseConflictError, match="busy: run r1"):
        acquire_writer_lease(storage, "run r2")
    storage.delete_many([WRITER_PATH])
    dead = acquire_writer_lease(storage, "run r1", ttl_seconds=-1.0)  # killed: never renewed
    with writer_lease(storage, "run r2") as held:
        assert current(storage).token == held.token != dead.token != live.token
        assert current(storage).purpose == "run r2"
    assert storage.list_dir(LEASES_DIR) == []  # no take-over claim left behind


def test_old_lease_files_without_token_parse_and_are_taken_over(storage):
    old = {"format_version": 1, "name": "writer", "holder": "h:1", "purpose": "old run",
           "checkpoint_ids": [], "created_at": "2026-01-01T00:00:00+00:00",
           "expires_at": "2026-01-01T01:00:00+00:00"}
    storage.write_bytes(WRITER_PATH, json.dumps(old).encode())
    assert current(storage).token == "" and current(storage).expired()
    with writer_lease(storage, "new run") as held:
        assert current(storage).token == held.token != ""


class SlowTaker:
    """A storage whose first read of the writer lease returns what it held earlier: a
    taker that read the stale lease, then paused while another taker took over."""

    def __init__(self, storage, stale: bytes) -> None:
        self._storage = storage
        self._stale = stale

    def __getattr__(self, attr):
        return getattr(self._storage, attr)

    def read_bytes_if_exists(self, rel: str):
        if rel == WRITER_PATH and self._stale is not None:
            data, self._stale = self._stale, None
            return data
        return self._storage.read_bytes_if_exists(rel)


def test_slow_taker_does_not_remove_the_winners_lease(storage):
    """Scenario 3: B read the stale lease before A took over; B must lose, A keep its lease."""
    acquire_writer_lease(storage, "dead run", ttl_seconds=-1.0)
    stale = storage.read_bytes(WRITER_PATH)
    a = acquire_writer_lease(storage, "taker A")
    with pytest.raises(LeaseConflictError, match="busy: taker A"):
        acquire_writer_lease(SlowTaker(storage, stale), "taker B")
    assert current(storage).token == a.token


def test_a_taker_in_progress_blocks_a_second_one_and_a_crashed_one_does_not(storage):
    """Scenario 3: one take-over claim per stale lease; a claim older than its limit is void."""
    dead = acquire_writer_lease(storage, "dead run", ttl_seconds=-1.0)
    claim = f"{LEASES_DIR}/{CLAIM_PREFIX}{hashlib.sha256(dead.token.encode()).hexdigest()[:32]}"
    storage.write_bytes(claim, json.dumps(
        {"holder": "other:1", "created_at": datetime.now(UTC).isoformat()}).encode())
    with pytest.raises(LeaseConflictError, match="another writer is taking over"):
        acquire_writer_lease(storage, "taker B")
    assert current(storage).token == dead.token
    storage.write_bytes(claim, json.dumps(
        {"holder": "other:1", "created_at": "2026-01-01T00:00:00+00:00"}).encode())
    won = acquire_writer_lease(storage, "taker C")  # the claimer crashed long ago
    assert current(storage).token == won.token
    assert storage.list_dir(LEASES_DIR) == ["writer.json"]


class KilledTaker:
    """A storage seen by a taker killed right after writing its take-over claim: the
    next read raises and nothing is deleted any more (a dead process cleans nothing)."""

    def __init__(self, storage) -> None:
        self._storage = storage
        self._reads = 0

    def __getattr__(self, attr):
        return getattr(self._storage, attr)

    def read_bytes_if_exists(self, rel: str):
        if rel == WRITER_PATH:
            self._reads += 1
            if self._reads == 2:  # the re-read after the claim
                raise RuntimeError("killed")
        return self._storage.read_bytes_if_exists(rel)

    def delete_many(self, paths) -> None:
        if self._reads >= 2:
            return
        self._storage.delete_many(paths)


def test_a_killed_takers_claim_blocks_for_the_lease_ttl_not_longer(storage):
    """A job tuned to a 1 s TTL waits about 1 s after a killed taker, not CLAIM_STALE_SECONDS."""
    acquire_writer_lease(storage, "dead run", ttl_seconds=-1.0)
    with pytest.raises(RuntimeError, match="killed"):
        acquire_writer_lease(KilledTaker(storage), "taker B", ttl_seconds=1.0)
    assert any(name.startswith(CLAIM_PREFIX) for name in storage.list_dir(LEASES_DIR))
    with pytest.raises(LeaseConflictError, match="another writer is taking over"):
        acquire_writer_lease(storage, "taker C", ttl_seconds=1.0)
    won: list[Lease] = []

    def taken() -> bool:
        try:
            won.append(acquire_writer_lease(storage, "taker C", ttl_seconds=1.0))
        except LeaseConflictError:
            return False
        return True

    wait_for(taken, timeout=10.0)  # far below CLAIM_STALE_SECONDS (30 s)
    assert current(storage).token == won[0].token


def test_racing_takers_exactly_one_wins(storage):
    """Scenario 3 with real threads, repeated: never two winners."""
    for round_ in range(8):
        storage.delete_many([WRITER_PATH])
        acquire_writer_lease(storage, "dead run", ttl_seconds=-1.0)
        barrier = threading.Barrier(3)
        won: list[str] = []
        lost: list[str] = []

        def take(name: str, barrier=barrier, won=won, lost=lost) -> None:
            barrier.wait()
            try:
                won.append(acquire_writer_lease(storage, name).token)
            except LeaseConflictError:
                lost.append(name)

        threads = [threading.Thread(target=take, args=(f"taker {i}",)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == 2, f"round {round_}: {won} {lost}"
        assert current(storage).token == won[0]


def test_taken_over_holder_notices_at_renewal(storage):
    """Scenario 4: a holder whose lease was taken over is lost (commit: see
    test_lifecycle_scenarios.py::test_lost_writer_lease_refuses_the_commit)."""
    with writer_lease(storage, "paused run", ttl_seconds=60.0, heartbeat_seconds=30.0) as held:
        # the holder paused beyond its TTL; another writer took the lease over
        storage.delete_many([WRITER_PATH])
        other = acquire_writer_lease(storage, "next run")
        assert held.renew() is False and "taken over by next run" in held.lost
        with pytest.raises(LeaseLostError, match="writer.json of paused run was lost"):
            held.ensure_held()
    assert current(storage).token == other.token  # the lost holder left it alone


def test_lapsed_lease_is_lost_even_if_nobody_took_it(storage):
    """Scenario 4: a renewal after our own expiry is too late (GC may have acted on it)."""
    with writer_lease(storage, "stalled run", ttl_seconds=60.0, heartbeat_seconds=30.0) as held:
        assert held.renew(datetime.now(UTC) + timedelta(seconds=120)) is False
        assert "not renewed before it expired" in held.lost
        with pytest.raises(LeaseLostError):
            held.ensure_held()
    assert list_leases(storage) != []  # not ours any more: not released by us either
