"""The memory backend's ``_timer_keys``, derived from ``_timers`` until read.

A memory backend and a RocksDB backend take the same random timer calls (registers,
deletes, firing passes whose handler moves timers); the RocksDB backend writes the
reverse lookup as it goes, the memory backend's index holds nothing. At every check:
its snapshot entries, row count and file section equal RocksDB's reverse lookup, and
nothing was built; then a lookup of one key's timers (`timers_of`) builds it, and from
then on it is written as it goes and answers like RocksDB's. A restore from the files
answers the same. Timers with tags build it at the first snapshot.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from statebackend.state import memory_files
from statebackend.state.backend import KeyedStateBackend, StoredInstance
from statebackend.state.backend_kinds import new_backend
from statebackend.state.families import TIMER_KEYS, TIMERS
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.kinds import StateDescriptor
from statebackend.state.memory import MemoryStateBackend
from statebackend.state.memory_timer_keys import TimerKeysIndex
from statebackend.state.timers import (
    delete_timers,
    fire_due,
    register_timers,
    timers_of,
    with_timers,
)

M = 16
DESCS = with_timers([StateDescriptor("count")])
USERS = [f"user-{i}" for i in range(60)]


def _open(tmp_path, kind: str, name: str) -> KeyedStateBackend:
    return new_backend(kind, str(tmp_path / name), DESCS, M, KeyGroupRange(0, M - 1))


def _step(rng: random.Random, backends: list[KeyedStateBackend], tagged: bool) -> None:
    """One random timer call, the same on every backend."""
    op = rng.random()
    keys = rng.sample(USERS, rng.randint(1, 8))
    times = [rng.randrange(0, 200) for _ in keys]
    tags = [rng.choice(["", "a", "b"]) for _ in keys] if tagged else None
    if op < 0.55:
        for b in backends:
            register_timers(b, keys, times, "event", tags)
    elif op < 0.8:
        for b in backends:
            delete_timers(b, keys, times, "event", tags)
    else:  # a pass up to ``up_to`` whose handler moves some fired keys' timers later
        up_to = rng.randrange(0, 200)
        moves = rng.random()
        fired = []
        for b in backends:
            handed = []
            for timer in fire_due(b, "event", up_to):
                handed.append((timer.key, timer.time, timer.tag))
                if hash((timer.key, timer.time, moves)) % 3 == 0:
                    register_timers(b, [timer.key], [timer.time + 150], "event",
                                    [timer.tag] if tagged else None)
            fired.append(handed)
        assert fired[0] == fired[1]


@contextmanager
def _backends(tmp_path, seed: int, steps: int, tagged: bool = False
              ) -> Iterator[tuple[random.Random, KeyedStateBackend, KeyedStateBackend]]:
    """(the calls' random source, a RocksDB and a memory backend after ``steps`` of
    the same random timer calls), closed after."""
    rng = random.Random(seed)
    rocks, memory = _open(tmp_path, "rocksdb", "rocks"), _open(tmp_path, "memory", "mem")
    try:
        for _ in range(steps):
            _step(rng, [rocks, memory], tagged)
        yield rng, rocks, memory
    finally:
        rocks.close()
        memory.close()


def _reverse_entries(backend: KeyedStateBackend) -> list[bytes]:
    return list(backend.iter_raw(TIMER_KEYS, values=False))


def _index(backend: KeyedStateBackend) -> TimerKeysIndex:
    index = backend.column_family_handle(TIMER_KEYS)
    assert isinstance(index, TimerKeysIndex)
    return index


def _snapshot_section(memory: KeyedStateBackend) -> list[bytes]:
    """The ``_timer_keys`` entries of the memory backend's newest snapshot file."""
    snap = memory.take_local_snapshot()
    newest = max((os.path.join(snap.path, n) for n, _ in snap.files),
                 key=os.path.getmtime)
    with open(newest, "rb") as fh:
        families = {name: keys.to_pylist() for name, keys, _ in
                    memory_files.decode_arrays(fh.read())}
    return families.get(TIMER_KEYS, [])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_index_is_derived_until_read_and_answers_like_rocksdb(tmp_path, seed):
    with _backends(tmp_path, seed, 0) as (rng, rocks, memory):
        for step in range(400):
            _step(rng, [rocks, memory], tagged=False)
            if step % 40 == 39:
                everything = _reverse_entries(rocks)
                keys, values, counts = _index(memory).ordered_entries(
                    _index(memory).timers.key_group_prefixes())
                assert keys.to_pylist() == everything
                assert set(values.to_pylist()) <= {b""}
                assert sum(counts.values()) == len(everything)
                assert memory.count_rows()[TIMER_KEYS] == len(everything) == \
                    rocks.count_rows()[TIMER_KEYS]
                # every key group is written here (the first snapshot): the file section
                # is RocksDB's whole reverse lookup
                if step == 39:
                    assert _snapshot_section(memory) == everything
                assert not _index(memory).built
        for user in USERS:  # a lookup of one key's timers: built, then kept as it goes
            assert timers_of(memory, user) == timers_of(rocks, user)
        assert _index(memory).built
        for _ in range(200):
            _step(rng, [rocks, memory], tagged=False)
        assert _reverse_entries(memory) == _reverse_entries(rocks)
        assert [timers_of(memory, u) for u in USERS] == [timers_of(rocks, u) for u in USERS]


def test_a_restored_index_is_derived_from_the_restored_timers(tmp_path):
    with _backends(tmp_path, 9, 300) as (_, rocks, memory):
        snap = memory.take_local_snapshot()
        assert not _index(memory).built
        expected = _reverse_entries(rocks)
    # a restore places the handle's files in the new instance's files/ and names them
    os.makedirs(tmp_path / "restored" / "files")
    for name, _ in snap.files:
        shutil.copy(os.path.join(snap.path, name), tmp_path / "restored" / "files" / name)
    restored = MemoryStateBackend(
        str(tmp_path / "restored"), DESCS, M, KeyGroupRange(0, M - 1),
        origin=StoredInstance(file_paths={n: f"stored/{n}" for n, _ in snap.files},
                              file_key_groups={n: tuple(kg for kg, _ in groups) for n, groups
                                               in snap.file_key_groups.items()}))
    try:
        assert restored.count_rows()[TIMER_KEYS] == len(expected) > 0
        assert not _index(restored).built  # the file's index entries were not loaded
        assert _reverse_entries(restored) == expected
        assert _index(restored).built
    finally:
        restored.close()


def test_tagged_timers_build_the_index_at_the_first_snapshot(tmp_path):
    with _backends(tmp_path, 4, 200, tagged=True) as (rng, rocks, memory):
        assert not _index(memory).built
        assert _snapshot_section(memory) == _reverse_entries(rocks)
        assert _index(memory).built  # a Python step per timer at every snapshot: kept
        for _ in range(200):
            _step(rng, [rocks, memory], tagged=True)
        assert _reverse_entries(memory) == _reverse_entries(rocks)
        assert memory.count_rows()[TIMERS] == rocks.count_rows()[TIMERS]
