"""A subtask's changed entries of the external backend as one Arrow table, and its COPY.

`ROWS_SCHEMA` is what a pre-commit writes (`statebackend.state.external_store.write_epoch`)
and a WAL file holds (`statebackend.state.external_wal`): one row per entry written since
the last snapshot, ``value`` null for a delete. `copy_rows` sends such a table to
PostgreSQL as one binary COPY stream built a column at a time
(`statebackend.state.pg_copy`). Apart from `external_store` so that the modules DAG files
import (the connection, the hook) load no Arrow or NumPy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from statebackend.state.pg_copy import Constant, copy_data

# One row per entry written since the last snapshot; ``value`` null: deleted
ROWS_SCHEMA = pa.schema([("key_group", pa.int32()), ("state", pa.string()),
                         ("key", pa.binary()), ("user_key", pa.binary()),
                         ("value", pa.binary())])


def copy_rows(conn: Any, sql: str, rows: pa.Table, *,
              before: Iterable[Constant] = (), after: Iterable[Constant] = ()) -> None:
    """``COPY ... FROM STDIN (FORMAT BINARY)`` (``sql``) of ``rows`` (`ROWS_SCHEMA`),
    with ``before`` and ``after`` as columns of the same value on every row: built a
    column at a time, sent in one write."""
    data = copy_data([*before, *rows.columns, *after], rows.num_rows)
    with conn.cursor() as cur, cur.copy(sql) as copy:
        copy.write(data)
