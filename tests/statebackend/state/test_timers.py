"""Timers as key-group-prefixed, time-ordered state (the watermark: test_watermark.py).

Every firing sequence is compared with a plain Python reference (a sorted list of
(time, key, tag)); costs are counted (seeks, entries read), never timed.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.restore import FROM_STORAGE, restore_subtask
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
from statebackend.errors import UsageError
from statebackend.state import timers as timers_module
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.backend_kinds import new_backend
from statebackend.state.codecs import decode_time, encode_time
from statebackend.state.keygroups import KeyGroupRange, key_group_for_bytes
from statebackend.state.kinds import StateDescriptor
from statebackend.state.timers import (
    TIMERS,
    Timer,
    _timer_and_reverse,
    delete_timer,
    delete_timers_of,
    fire_due,
    iter_timers,
    parse_reverse_key,
    parse_timer_key,
    register_timer,
    register_timers,
    reverse_key,
    timer_key,
    timers_of,
    with_timers,
)
from statebackend.storage import open_storage
from tests.statebackend.helpers import close_all, open_backends

M = 128
DESCS = with_timers([StateDescriptor("count")])


# The in-process backends: both keep timers in the same two families, through the
# backend's own write path (rocksdict's write batches; the memory backend's column writes).
LOCAL_BACKENDS = ("rocksdb", "memory")


def one_backend(tmp_path, name: str = "b", descriptors=DESCS, kind: str = "rocksdb"
                ) -> KeyedStateBackend:
    return new_backend(kind, str(tmp_path / name), descriptors, M, KeyGroupRange(0, M - 1))


def remaining(backend: KeyedStateBackend, domain: str = "event") -> list[tuple[int, str, str]]:
    return sorted((t.time, t.key, t.tag) for t in iter_timers(backend) if t.domain == domain)


# -- layout ------------------------------------------------------------------------------

def test_time_encoding_orders_bytes_like_times_negative_included():
    times = [-(1 << 63), -5, -1, 0, 1, 1_700_000_000_000, (1 << 63) - 1]
    encoded = [encode_time(t) for t in times]
    assert encoded == sorted(encoded)
    assert [decode_time(e) for e in encoded] == times
    with pytest.raises(UsageError, match="64-bit"):
        encode_time(1 << 63)


def test_timer_keys_round_trip_and_sort_by_time_within_a_key_group():
    kb = b"user-1"
    a = timer_key(7, b"\x00", 20, kb, "s1")
    b = timer_key(7, b"\x00", 3, b"zzz", "")
    assert b < a  # time before key: the queue of one key group is in time order
    assert parse_timer_key(a) == Timer(20, 7, "user-1", "s1", "event")
    rk = reverse_key(7, b"\x01", 20, kb, "s1")
    assert rk.startswith(b"\x00\x07\x00\x00\x00\x06user-1")  # the key's timers: one prefix
    assert parse_reverse_key(rk) == Timer(20, 7, "user-1", "s1", "processing")
    # the firing pass derives the reverse key from the timer key's bytes
    for key, tag in ((kb, "s1"), ("café".encode(), ""), (b"", "t\u00e9")):
        parsed, derived = _timer_and_reverse(timer_key(9, b"\x01", -5, key, tag))
        assert derived == reverse_key(9, b"\x01", -5, key, tag)
        assert parse_reverse_key(derived) == parsed


# -- register / delete / fire ------------------------------------------------------------

@pytest.mark.parametrize("kind", LOCAL_BACKENDS)
def test_fire_due_in_global_time_order_across_key_groups(tmp_path, kind):
    rng = random.Random(12)
    backends = open_backends(str(tmp_path), 2, M, DESCS, kind)
    try:
        ref: dict[int, list[tuple[int, str, str]]] = {0: [], 1: []}
        for i in range(3000):
            key, t, tag = f"u{rng.randrange(500)}", rng.randrange(-50, 1000), f"s{i % 3}"
            sub = key_group_for_bytes(key.encode(), M) * 2 // M
            register_timer(backends[sub], key, t, tag=tag)
            ref[sub].append((t, key, tag))
        for sub, backend in enumerate(backends):
            expected = sorted(set(ref[sub]))
            assert remaining(backend) == expected
            fired = [(t.time, t.key, t.tag) for t in fire_due(backend, "event", 400)]
            due = [e for e in expected if e[0] <= 400]
            times = [f[0] for f in fired]
            assert times == sorted(times)  # global time order across key groups
            assert sorted(fired) == due  # each due timer exactly once
            assert remaining(backend) == [e for e in expected if e[0] > 400]
            # deleted as fired: a second pass finds nothing, the reverse index agrees
            assert list(fire_due(backend, "event", 400)) == []
            some_key = expected[-1][1]
            assert sorted((t.time, t.key, t.tag) for t in timers_of(backend, some_key)) == \
                [e for e in expected if e[1] == some_key and e[0] > 400]
    finally:
        close_all(backends)


@pytest.mark.parametrize("kind", LOCAL_BACKENDS)
def test_register_is_idempotent_and_delete_removes_one_timer(tmp_path, kind):
    with one_backend(tmp_path, kind=kind) as be:
        register_timers(be, ["a", "a", "a", "b"], [10, 10, 20, 10], tags=["x", "x", "", ""])
        assert remaining(be) == [(10, "a", "x"), (10, "b", ""), (20, "a", "")]
        delete_timer(be, "a", 10, tag="x")
        delete_timer(be, "a", 99)  # absent: ignored
        assert [(t.time, t.tag) for t in timers_of(be, "a")] == [(20, "")]
        register_timer(be, "a", 5, "processing")
        assert [(t.domain, t.time) for t in timers_of(be, "a")] == [("event", 20),
                                                                   ("processing", 5)]
        assert [t.time for t in timers_of(be, "a", "processing")] == [5]
        assert delete_timers_of(be, "a") == 2
        assert timers_of(be, "a") == [] and remaining(be) == [(10, "b", "")]
        assert remaining(be, "processing") == []


@pytest.mark.parametrize("kind", LOCAL_BACKENDS)
def test_event_and_processing_timers_fire_separately(tmp_path, kind):
    with one_backend(tmp_path, kind=kind) as be:
        register_timer(be, "a", 10, "event")
        register_timer(be, "a", 10, "processing")
        assert [(t.key, t.domain) for t in fire_due(be, "processing", 100)] == [
            ("a", "processing")]
        assert remaining(be) == [(10, "a", "")]
        assert [t.domain for t in fire_due(be, "event", 10)] == ["event"]  # at or below
        with pytest.raises(UsageError, match="time domain 'wall'"):
            fire_due(be, "wall", 10)


@pytest.mark.parametrize("kind", LOCAL_BACKENDS)
def test_firing_cost_follows_due_timers_not_state_size(tmp_path, kind):
    with one_backend(tmp_path, kind=kind) as be:
        n = 100_000
        keys = [f"k{i}" for i in range(n)]
        register_timers(be, keys, [1_000 + i for i in range(n)])  # none due
        register_timers(be, keys[:50_000], [0] * 50_000, "processing")  # other domain, due
        due = [f"due{i}" for i in range(10)]
        register_timers(be, due, list(range(10)))
        firing = fire_due(be, "event", 500)
        fired = [t.key for t in firing]
        print(f"\n{n + 50_010} timers stored, {len(fired)} due: {firing.stats.seeks} seeks, "
              f"{firing.stats.entries_read} entries read")
        assert fired == due
        assert firing.stats.seeks == M  # one per key group of the subtask
        assert firing.stats.entries_read == 10  # only what is due
        assert firing.stats.fired == 10


@pytest.mark.parametrize("kind", LOCAL_BACKENDS)
def test_timers_registered_while_firing_fire_in_the_same_pass(tmp_path, kind):
    with one_backend(tmp_path, kind=kind) as be:
        register_timers(be, ["a", "b", "c", "d"], [10, 20, 30, 40])
        seen = []
        for t in fire_due(be, "event", 35):
            first = (t.time, t.key) not in seen
            seen.append((t.time, t.key))
            if t.key == "a":
                register_timer(be, "late-a", 25)  # due: fires in this pass, in time order
                register_timer(be, "next-a", 36)  # not due: stays
                delete_timer(be, "c", 30)  # deleted before it fires: never fires
            if t.key == "b" and first:
                register_timer(be, "b", 20)  # re-registered after it fired: fires again
                register_timer(be, "past", 5)  # behind the pass: fires next (Flink)
        assert seen == [(10, "a"), (20, "b"), (5, "past"), (20, "b"), (25, "late-a")]
        assert remaining(be) == [(36, "next-a", ""), (40, "d", "")]


@pytest.mark.parametrize("kind", LOCAL_BACKENDS)
@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_a_pass_fires_the_smallest_due_timer_at_every_step(tmp_path, kind, chunk,
                                                           monkeypatch):
    """Against a model (a set of timers): each timer a pass hands out is the smallest due
    one registered at that moment, while the handler registers timers before, at and
    after the pass's position, re-registers fired ones and deletes others; with key
    groups read one, three or 4,096 timers at a time (several merge rounds)."""
    monkeypatch.setattr(timers_module, "_CHUNK", chunk)
    rng = random.Random(chunk)

    def order(t):  # a timer key's order: time, then the key framed by its length, tag
        return t[0], len(t[1].encode()), t[1].encode(), t[2].encode()

    def any_timer():
        return rng.randrange(0, 60), f"k{rng.randrange(40)}", rng.choice(["", "x"])

    with one_backend(tmp_path, kind=kind) as be:
        store = set()
        for _ in range(400):
            t = any_timer()
            register_timer(be, t[1], t[0], tag=t[2])
            store.add(t)
        fired = 0
        for timer in fire_due(be, "event", 40):
            got = (timer.time, timer.key, timer.tag)
            assert got == min((t for t in store if t[0] <= 40), key=order), fired
            store.discard(got)
            fired += 1
            for _ in range(rng.randrange(3)):  # the handler
                t = rng.choice(sorted(store)) if store and rng.random() < 0.3 else any_timer()
                if t in store:
                    delete_timer(be, t[1], t[0], tag=t[2])
                    store.discard(t)
                else:
                    register_timer(be, t[1], t[0], tag=t[2])
                    store.add(t)
        assert fired > 300
        assert not [t for t in store if t[0] <= 40]
        assert remaining(be) == sorted(store)


@pytest.mark.parametrize("kind", LOCAL_BACKENDS)
def test_stopping_a_pass_early_keeps_the_rest(tmp_path, kind):
    with one_backend(tmp_path, kind=kind) as be:
        register_timers(be, ["a", "b", "c"], [1, 2, 3])
        firing = fire_due(be, "event", 10)
        assert next(firing).key == "a"
        with pytest.raises(UsageError, match="already running"):
            fire_due(be, "event", 10)
        firing.close()
        assert [t.key for t in fire_due(be, "event", 10)] == ["b", "c"]


def test_timers_need_their_column_families(tmp_path):
    with one_backend(tmp_path, descriptors=[StateDescriptor("count")]) as be:
        with pytest.raises(UsageError, match="with_timers"):
            register_timer(be, "a", 1)
    with one_backend(tmp_path, "with") as be, pytest.raises(UsageError, match="internal"):
        be.state(TIMERS)
    with pytest.raises(UsageError, match="reserved"):
        StateDescriptor("_timers", "value")


def test_timers_survive_snapshot_and_restore_and_show_in_dump(tmp_path, capsys):
    url = f"file://{tmp_path}/store"
    store = CheckpointStore(open_storage(url), "sessions")
    backends = open_backends(str(tmp_path / "work"), 2, M, DESCS)
    expected = []
    try:
        for i in range(200):
            key = f"user{i}"
            sub = key_group_for_bytes(key.encode(), M) * 2 // M
            register_timer(backends[sub], key, 1_000 + i, tag=f"s{i % 2}")
            expected.append((key, 1_000 + i, f"s{i % 2}"))
            if i % 10 == 0:
                register_timer(backends[sub], key, 7, "processing")
        meta = checkpoint_backends(store, backends, parent=None, run_id="r1")
    finally:
        close_all(backends)
    assert {s["name"]: s["kind"] for s in meta.states} == {
        "count": "value", "_timers": "timers", "_timer_keys": "timer_keys"}
    for h in meta.subtasks:  # a fresh download, not the local instance
        be = restore_subtask(store.storage, h, str(tmp_path / f"r{h.index}"), DESCS, M,
                             FROM_STORAGE)
        try:
            assert be.restore_mode == "download"
            assert all(h.key_group_start <= t.key_group <= h.key_group_end
                       for t in iter_timers(be))
            fired = [(t.key, t.time, t.tag) for t in fire_due(be, "event", 10_000)]
            assert fired == sorted((e for e in expected
                                    if h.key_group_start <= key_group_for_bytes(
                                        e[0].encode(), M) <= h.key_group_end),
                                   key=lambda e: e[1])
        finally:
            be.close()
    rows = [r for r in checkpoint_rows(store, meta) if r["state"] == "_timers"]
    assert len(rows) == 200 + 20  # the reverse lookup is not dumped again
    assert {(r["key"], r["value"]["time"], r["user_key"]) for r in rows
            if r["value"]["kind"] == "event"} == set(expected)
    out = tmp_path / "dump.jsonl"
    assert cli.main(["--storage", url, "--job", "sessions", "dump", "--out", str(out)]) == 0
    dumped = [json.loads(line) for line in out.read_text().splitlines()]
    timer = next(r for r in dumped if r["state"] == "_timers" and r["key"] == "user0"
                 and r["value"]["kind"] == "processing")
    assert timer["value"] == {"kind": "processing", "time": 7}
    assert timer["key_group"] == key_group_for_bytes(b"user0", M)
    assert not any(r["state"] == "_timer_keys" for r in dumped)
    assert os.path.exists(out)


def test_next_timer_time_per_domain(tmp_path):
    from statebackend.state.timers import next_timer_time

    with one_backend(tmp_path) as be:
        assert next_timer_time(be) is None
        register_timers(be, ["a", "b", "c"], [50, -3, 70])
        register_timer(be, "d", 9, "processing")
        assert next_timer_time(be, "event") == -3
        assert next_timer_time(be, "processing") == 9
        delete_timer(be, "b", -3)
        assert next_timer_time(be, "event") == 50


def test_times_must_be_integers_and_the_largest_time_is_a_valid_bound(tmp_path):
    import numpy as np

    top = (1 << 63) - 1
    with one_backend(tmp_path) as be:
        register_timers(be, ["a", "b"], [np.int64(5), top])
        for bad in (1.5, "7", True):
            with pytest.raises(UsageError, match="64-bit integer"):
                register_timer(be, "c", bad)
        assert [t.time for t in fire_due(be, "event", top)] == [5, top]
