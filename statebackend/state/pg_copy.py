"""PostgreSQL's binary COPY data, built from Arrow columns a column at a time.

psycopg's ``Copy.write_row`` formats a row in Python, field by field: about 3 us a
row, most of an external-backend snapshot of 200,000 changed entries. `copy_data`
builds the same stream (signature, header, one tuple per row, trailer: the format of
PostgreSQL's ``COPY ... FROM STDIN (FORMAT BINARY)``) with NumPy over whole columns:
each field's big-endian length (``-1``: NULL) and bytes are scattered into one buffer,
no Python step per row. The caller sends it with ``Copy.write``.

Columns are Arrow arrays (``int32`` -> int4, ``int64`` -> int8, ``string`` -> text,
``binary`` -> bytea; nulls are NULL) or `Constant` values repeated on every row (the
job's name, the epoch): encoded once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import pyarrow as pa

SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
TRAILER = b"\xff\xff"
_FIXED = {pa.int32(): ">i4", pa.int64(): ">i8"}
_VARIABLE = (pa.string(), pa.binary())


@dataclass(frozen=True)
class Constant:
    """One value on every row: ``int4`` / ``int8`` (an int), ``text`` (a str) or
    ``bytea`` (bytes)."""

    value: int | str | bytes
    type: str

    def encoded(self) -> bytes:
        value = self.value
        if self.type in ("int4", "int8"):
            if not isinstance(value, int):
                raise TypeError(f"a {self.type} constant must be an int, not {value!r}")
            data = value.to_bytes(4 if self.type == "int4" else 8, "big", signed=True)
        elif self.type == "text" and isinstance(value, str):
            data = value.encode("utf-8")
        elif self.type == "bytea" and isinstance(value, bytes):
            data = value
        else:
            raise TypeError(f"no {self.type} constant of {value!r}")
        return len(data).to_bytes(4, "big") + data


Column: TypeAlias = "pa.Array | pa.ChunkedArray | Constant"


def copy_data(columns: Sequence[Column], rows: int) -> bytes:
    """The binary COPY stream of ``rows`` rows of ``columns`` (each Arrow column has
    ``rows`` values); ValueError for a column of another length or type."""
    fields = [_field(c, rows) for c in columns]
    sizes = np.full(rows, 2, dtype=np.int64)  # each tuple: its field count, then fields
    for field in fields:
        sizes += field.sizes
    starts = len(SIGNATURE) + np.cumsum(sizes) - sizes
    total = len(SIGNATURE) + int(sizes.sum()) + len(TRAILER)
    out = np.empty(total, dtype=np.uint8)
    out[:len(SIGNATURE)] = np.frombuffer(SIGNATURE, np.uint8)
    out[total - len(TRAILER):] = np.frombuffer(TRAILER, np.uint8)
    if rows:
        _scatter_block(out, starts, np.frombuffer(len(fields).to_bytes(2, "big"), np.uint8))
        at = starts + 2
        for field in fields:
            field.write(out, at)
            at += field.sizes
    return out.tobytes()


@dataclass(frozen=True)
class _ConstantField:
    encoded: np.ndarray
    sizes: int

    def write(self, out: np.ndarray, at: np.ndarray) -> None:
        _scatter_block(out, at, self.encoded)


@dataclass(frozen=True)
class _ColumnField:
    lengths: np.ndarray  # int32 per row, -1: NULL
    sizes: np.ndarray  # bytes per row: 4 + the data's
    data: np.ndarray  # uint8: fixed-width values (rows x width) or the variable data
    starts: np.ndarray | None  # variable: where each row's bytes start in ``data``

    def write(self, out: np.ndarray, at: np.ndarray) -> None:
        _scatter_rows(out, at, self.lengths.astype(">i4").view(np.uint8).reshape(-1, 4))
        present = self.lengths > 0
        if not present.any():
            return
        if self.starts is None:
            _scatter_rows(out, (at + 4)[present], self.data[present])
            return
        lengths = self.lengths[present].astype(np.int64)
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(lengths) - lengths, lengths)
        out[np.repeat((at + 4)[present], lengths) + within] = \
            self.data[np.repeat(self.starts[present], lengths) + within]


def _field(column: Column, rows: int) -> _ConstantField | _ColumnField:
    if isinstance(column, Constant):
        encoded = np.frombuffer(column.encoded(), np.uint8)
        return _ConstantField(encoded, len(encoded))
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(array) != rows:
        raise ValueError(f"a COPY column has {len(array)} values, not {rows}")
    nulls = array.is_null().to_numpy(zero_copy_only=False)
    if array.type in _FIXED:
        dtype = np.dtype(_FIXED[array.type])
        values = array.fill_null(0).to_numpy().astype(dtype)
        lengths = np.where(nulls, -1, dtype.itemsize).astype(np.int32)
        return _ColumnField(lengths, 4 + np.maximum(lengths, 0),
                            values.view(np.uint8).reshape(-1, dtype.itemsize), None)
    if array.type not in _VARIABLE:
        raise ValueError(f"no binary COPY of an Arrow {array.type} column")
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int32)[array.offset:array.offset + rows + 1]
    data = np.frombuffer(data_buffer, np.uint8) if data_buffer is not None else \
        np.empty(0, np.uint8)
    lengths = np.where(nulls, -1, np.diff(offsets)).astype(np.int32)
    return _ColumnField(lengths, 4 + np.maximum(lengths, 0), data,
                        offsets[:-1].astype(np.int64))


def _scatter_block(out: np.ndarray, at: np.ndarray, block: np.ndarray) -> None:
    """``block`` (the same bytes) at every offset of ``at``."""
    out[at[:, None] + np.arange(len(block))] = block


def _scatter_rows(out: np.ndarray, at: np.ndarray, blocks: np.ndarray) -> None:
    """Row ``i`` of ``blocks`` (rows x width bytes) at offset ``at[i]``."""
    out[at[:, None] + np.arange(blocks.shape[1])] = blocks
