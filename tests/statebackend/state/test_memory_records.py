"""The memory backend's record table (statebackend.state.memory_records) against a plain
`MemoryTable` as the reference: after the same random writes, deletes and restores
(records, and values of another layout as a migration meets them) every read, the
accounting, the changed key groups and a snapshot's entries are the same; the columnar
calls agree with decoding the bytes, and step aside while bytes entries are held.
A snapshot's file (its values as byte planes) reads back to the plain table's entries.
Through the job API, a record state on the memory backend is a record table."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from statebackend.state import memory_files
from statebackend.state.codecs import RecordCodec
from statebackend.state.memory_records import RecordTable
from statebackend.state.memory_table import MemoryAccount, MemoryTable

CODEC = RecordCodec((("count", "int64"), ("sum", "float64"), ("flag", "int32")))


def _tables() -> tuple[MemoryTable, RecordTable]:
    return (MemoryTable("t", MemoryAccount(None, "ref")),
            RecordTable("t", MemoryAccount(None, "rec"), CODEC.dtype))


def _key(rng: random.Random) -> bytes:
    return rng.randrange(6).to_bytes(2, "big") + b"k%03d" % rng.randrange(60)


def _value(rng: random.Random, odd: float) -> bytes:
    if rng.random() < odd:  # an older layout (a migration's input) or a damaged record
        return rng.choice([b"\x02short", b"\x07" + bytes(CODEC.dtype.itemsize - 1)])
    return CODEC.encode({"count": rng.randrange(100), "sum": rng.random(),
                         "flag": rng.randrange(-5, 5)})


def _as_bytes(column) -> list[bytes]:
    if isinstance(column, np.ndarray):  # fixed-width values, one row each
        return [row.tobytes() for row in column]
    return column.to_pylist() if isinstance(column, pa.Array) else list(column)


def _decoded(data: bytes) -> list:
    return [(n, k.to_pylist(), v.to_pylist()) for n, k, v in memory_files.decode_arrays(data)]


def _same(ref: MemoryTable, rec: RecordTable, keys: list[bytes]) -> None:
    assert rec.get(keys) == ref.get(keys)
    assert [rec.get(k) for k in keys] == [ref.get(k) for k in keys]
    assert rec.entries() == ref.entries()
    assert list(rec.scan(keys[0], keys[-1])) == list(ref.scan(keys[0], keys[-1]))
    assert rec._account.bytes == ref._account.bytes
    assert rec._account.changed == ref._account.changed
    assert len(rec) == len(ref)
    prefixes = sorted({k[:2] for k in keys})[:3]
    for wanted in (prefixes, ref.key_group_prefixes()):
        want_keys, want_values, want_counts = ref.ordered_entries(wanted)
        got_keys, got_values, got_counts = rec.ordered_entries(wanted)
        assert (_as_bytes(got_keys), _as_bytes(got_values), got_counts) == \
            (want_keys, want_values, want_counts)
        assert _decoded(memory_files.encode([("t", got_keys, got_values)], "zstd")) == \
            _decoded(memory_files.encode([("t", want_keys, want_values)], "zstd"))


@pytest.mark.parametrize("seed, odd", [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.005),
                                       (4, 0.01), (5, 0.05)])
def test_a_record_table_answers_like_a_memory_table(seed, odd):
    rng = random.Random(seed)
    ref, rec = _tables()
    for _ in range(300):
        op = rng.random()
        keys = sorted({_key(rng) for _ in range(rng.randrange(1, 25))})
        if op < 0.3:  # the job API's read-then-write of the same key list
            values = [_value(rng, odd) for _ in keys]
            ref.get(keys)
            read = rec.read_records(keys, CODEC.dtype)
            if read is not None:
                found, records = read
                want_found, want = CODEC.decode_columns(ref.get(keys))
                assert found.tolist() == want_found.tolist()
                for name in CODEC.names:
                    assert records[name].tolist() == want[name].tolist()
            ref.write_columns(keys, values)
            rec.write_columns(keys, values)
        elif op < 0.45:
            records = CODEC.records({"count": [rng.randrange(9) for _ in keys],
                                     "sum": [rng.random() for _ in keys],
                                     "flag": [rng.randrange(3) for _ in keys]})
            if rng.random() < 0.5:  # what a write right after a read may reuse
                rec.read_records(keys, CODEC.dtype) if rng.random() < 0.5 else rec.get(keys)
            done = rec.write_records(keys, records)
            assert done == (rec._odd == 0)
            if done:
                ref.write_columns(keys, records.view(f"V{CODEC.dtype.itemsize}").tolist())
        elif op < 0.65:
            key, value = keys[0], _value(rng, odd)
            ref.put_one(key, value)
            rec.put_one(key, value)
        elif op < 0.8:
            for key in keys[: rng.randrange(1, 4)]:
                ref.delete(key)
                rec.delete(key)
        elif op < 0.87:  # a restore replaces one key group
            prefix = keys[0][:2]
            part = sorted({prefix + b"k%03d" % rng.randrange(60) for _ in range(8)})
            values = [_value(rng, odd) for _ in part]
            ref.load(prefix, part, values)
            rec.load(prefix, part, values)
        else:
            ref._account.changed.clear()
            rec._account.changed.clear()
        _same(ref, rec, keys)
    _same(ref, rec, sorted(ref.data) or [b"\x00\x00"])


def test_columnar_calls_step_aside_while_bytes_entries_are_held():
    _, rec = _tables()
    key, other = b"\x00\x01a", b"\x00\x01b"
    rec.put_one(key, b"\x02old-layout")
    assert rec.read_records([key], CODEC.dtype) is None
    assert rec.write_records([key], CODEC.records({"count": [1], "sum": [1.0],
                                                   "flag": [1]})) is False
    rec.put_one(key, CODEC.encode({"count": 3, "sum": 2.5, "flag": 0}))  # the migration
    rec.put_one(other, CODEC.encode({"count": 1, "sum": 0.5, "flag": 1}))
    found, records = rec.read_records([key, b"\x00\x01c", other], CODEC.dtype)
    assert found.tolist() == [True, False, True]
    assert records["count"].tolist() == [3, 0, 1]
    wider = RecordCodec((*CODEC.fields, ("extra", "int64")))
    assert rec.read_records([key], wider.dtype) is None  # another layout: not its rows


def test_a_record_state_on_the_memory_backend_is_a_record_table(tmp_path):
    from statebackend.state.keygroups import KeyGroupRange
    from statebackend.state.kinds import StateDescriptor
    from statebackend.state.memory import MemoryStateBackend

    totals = StateDescriptor("totals", "value", CODEC)
    backend = MemoryStateBackend(str(tmp_path / "local"), [totals], max_parallelism=128,
                                 key_group_range=KeyGroupRange(0, 127))
    try:
        state = backend.state("totals")
        assert isinstance(state.cf, RecordTable)
        keys = [f"user-{i}" for i in range(50)]
        state.put_columns(keys, {"count": np.arange(50), "sum": np.ones(50),
                                 "flag": np.zeros(50)})
        found, columns = state.get_columns([*keys[:3], "nobody"])
        assert found.tolist() == [True, True, True, False]
        assert columns["count"].tolist() == [0, 1, 2, 0]
        assert state.get("user-7") == {"count": 7, "sum": 1.0, "flag": 0}
    finally:
        backend.close()
