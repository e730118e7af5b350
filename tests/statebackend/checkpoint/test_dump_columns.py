"""`statebackend.checkpoint.dump_columns`: a subtask's dump rows read column-wise equal
the row path's (`dump.backend_rows`), as Parquet tables and as JSON lines, byte for byte:
every codec, map and TTL states (expired entries too), timers, keys and text that JSON
escapes, floats Python writes its own way, on both local backends, in spans of key
groups or in one."""

from __future__ import annotations

import json

import pytest

from statebackend.checkpoint import dump_columns
from statebackend.checkpoint.dump import backend_rows, rows_table
from statebackend.state.codecs import BytesCodec, RecordCodec, StrCodec
from statebackend.state.kinds import StateDescriptor
from statebackend.state.timers import register_timers, with_timers
from statebackend.state.ttl import StateTtl
from tests.statebackend.helpers import keys, open_backends

RECORD = RecordCodec((("i", "int32"), ("big", "int64"), ("f32", "float32"), ("f", "float64"),
                      ("ok", "bool"), ("grüße", "int32")))
EVERY_CODEC = (
    StateDescriptor("rec", "value", RECORD),
    StateDescriptor("rec_ttl", "value", RECORD, ttl=StateTtl(1_000, "event")),
    StateDescriptor("text", "value", StrCodec()),
    StateDescriptor("raw", "value", BytesCodec()),
    StateDescriptor("by_user", "map", RECORD),
    StateDescriptor("doc", "value"),
    StateDescriptor("events", "list", ttl=StateTtl(1_000, "event")),
)
FLOATS = (0.0, -0.0, 1.5, 1e16, 1e-7, 3.141592653589793, float("nan"), float("inf"),
          float("-inf"), 123456789.125, 5e-324)
KEYS = keys(400) + ["ключ", "🙂", 'quo"te\\', "tab\tnew\nline", "bell\x07", ""]
SUBTASK = 4


@pytest.fixture(params=["rocksdb", "memory"])
def backend(request, tmp_path):
    (be,) = open_backends(str(tmp_path), 1, descriptors=with_timers(EVERY_CODEC),
                          kind=request.param)
    records = [{"i": -i, "big": 2**40 + i, "f32": FLOATS[i % len(FLOATS)] / 3,
                "f": FLOATS[i % len(FLOATS)], "ok": i % 3 == 0, "grüße": i}
               for i in range(len(KEYS))]
    be.set_time(event_time=10_000)
    be.value_state("rec").put_many(KEYS, records)
    # half of them written long ago: expired at the clock, still dumped
    be.value_state("rec_ttl").put_many(KEYS, records, timestamps=[
        5_000 + 5_000 * (i % 2) for i in range(len(KEYS))])
    be.value_state("text").put_many(KEYS, [f"{k} é\\ \"{i}\"\n" for i, k in enumerate(KEYS)])
    be.value_state("raw").put_many(KEYS, [k.encode() + bytes([i % 256])
                                          for i, k in enumerate(KEYS)])
    be.map_state("by_user").put_many(
        [(k, u, r) for k, r in zip(KEYS, records, strict=True) for u in ("a", "ü", 'q"')])
    be.value_state("doc").put_many(KEYS, [{"z": i, "a": [k, None, "ß"]}
                                          for i, k in enumerate(KEYS)])
    be.list_state("events").add_many(KEYS, [{"n": i} for i in range(len(KEYS))])
    register_timers(be, KEYS[:50], list(range(50)))
    # (what the rows above have to hold for the test to mean something)
    assert {"NaN", "Infinity", "-Infinity", "1e+16", "1e-07", "-0.0", "5e-324"} <= {
        json.dumps(r["f"]) for r in records}
    yield be
    be.close()


SPANS = pytest.mark.parametrize("batch_rows", [50, 1_000_000])
ROW_COUNTS = {"rec": len(KEYS), "by_user": 3 * len(KEYS)}


@SPANS
def test_the_parquet_table_equals_the_row_paths(backend, batch_rows, monkeypatch):
    monkeypatch.setattr(dump_columns, "BATCH_ROWS", batch_rows)
    want = rows_table(backend_rows(backend, SUBTASK))
    got = dump_columns.dump_table(backend, SUBTASK, ROW_COUNTS)
    assert got.num_rows == want.num_rows > 10 * len(KEYS)
    assert got.equals(want)
    if batch_rows == 50:
        assert len(list(dump_columns.dump_tables(backend, SUBTASK, ROW_COUNTS))) > 8


@SPANS
def test_json_lines_equal_the_row_paths(backend, batch_rows, monkeypatch):
    monkeypatch.setattr(dump_columns, "BATCH_ROWS", batch_rows)
    want = [json.dumps(r, ensure_ascii=False, sort_keys=True)
            for r in backend_rows(backend, SUBTASK)]
    got = [line for table in dump_columns.dump_tables(backend, SUBTASK, ROW_COUNTS,
                                                      ensure_ascii=False)
           for line in dump_columns.json_lines(table)]
    assert len(got) == len(want) > 10 * len(KEYS)
    assert got == want
    assert any("ключ" in line for line in got) and any("grüße" in line for line in got)
