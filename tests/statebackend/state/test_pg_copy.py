"""`statebackend.state.pg_copy`: binary COPY data built column-wise loads into a real
PostgreSQL (Debian's package, on 127.0.0.1) exactly the rows psycopg's own row-by-row
``write_row`` loads: NULLs, empty values, multi-byte text, negative and wide integers,
sliced and chunked Arrow columns, constants, and no rows at all."""

from __future__ import annotations

import pyarrow as pa
import pytest

from statebackend.state.pg_copy import Constant, copy_data

COLUMNS = "job text, kg int4, state text, key bytea, user_key bytea, value bytea, epoch int8"
TYPES = ["text", "int4", "text", "bytea", "bytea", "bytea", "int8"]


def _load(conn, name: str, data: bytes | None, rows: list[tuple]) -> list[tuple]:
    """Rows of a new temporary table ``name`` filled by ``data`` (ours) or, if None, by
    psycopg's ``write_row`` of ``rows`` (the reference)."""
    conn.execute(f"CREATE TEMP TABLE {name} (n serial, {COLUMNS})")
    cols = "job, kg, state, key, user_key, value, epoch"
    with conn.cursor() as cur, cur.copy(f"COPY {name} ({cols}) FROM STDIN (FORMAT BINARY)") \
            as copy:
        if data is None:
            copy.set_types(TYPES)
            for row in rows:
                copy.write_row(row)
        else:
            copy.write(data)
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
            for row in conn.execute(f"SELECT {cols} FROM {name} ORDER BY n").fetchall()]


def test_column_wise_copy_data_loads_the_rows_psycopg_loads_row_by_row(postgres_server):
    import psycopg

    kg = pa.array([0, 127, None, -5, 2**31 - 1, 7], pa.int32())
    state = pa.chunked_array([pa.array(["totals", "ünïcode ✓"], pa.string()),
                              pa.array(["", None, "s", "totals"], pa.string())])
    # a slice: its offsets do not start at 0
    key = pa.array([b"zz", b"a", b"\x00\xff", b"", b"k" * 300, None, b"b"], pa.binary())[1:]
    user_key = pa.array([b""] * 5 + [b"u"], pa.binary())
    value = pa.array([b"\x01{}", None, b"", b"v" * 70_000, None, b"\x00"], pa.binary())
    columns = [Constant("job-ä", "text"), kg, state, key, user_key, value,
               Constant(-(2**40), "int8")]
    want = [("job-ä", *row, -(2**40)) for row in zip(
        kg.to_pylist(), state.to_pylist(), key.to_pylist(), user_key.to_pylist(),
        value.to_pylist(), strict=True)]

    with psycopg.connect(postgres_server.url) as conn:
        ours = _load(conn, "ours", copy_data(columns, 6), want)
        reference = _load(conn, "reference", None, want)
        assert ours == reference == want
        empty = [Constant("j", "text"), *(c[:0] for c in columns[1:6]), Constant(1, "int8")]
        assert _load(conn, "none", copy_data(empty, 0), []) == []


def test_bad_columns_are_refused_by_name():
    with pytest.raises(ValueError, match="has 2 values, not 3"):
        copy_data([pa.array([1, 2], pa.int32())], 3)
    with pytest.raises(ValueError, match="no binary COPY of an Arrow double column"):
        copy_data([pa.array([1.5])], 1)
    with pytest.raises(TypeError, match="int4 constant must be an int"):
        copy_data([Constant("1", "int4")], 1)
