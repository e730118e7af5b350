"""A record value state of the memory backend, held as rows of one NumPy array.

A `RecordTable` is a `MemoryTable` (the same byte-key contract, order and accounting)
for a value state whose codec is a fixed-width `RecordCodec` and which has no TTL:
``data`` maps each key to its row in ``rows`` (a structured array of the codec's dtype,
format byte first) instead of to a bytes object. The job API's columnar calls
(`ValueBatch.value_columns` / `update_columns`) then read and write whole columns
(`read_records`, `write_records`): one dictionary lookup per key (none for a write right
after the read of the same keys) and NumPy gathers and scatters; no bytes object per
value, no encoding or decoding, no Python step per changed key group.

A snapshot gets the rows of its key groups in key order (one NumPy gather, written as
byte planes: `memory_files`' layout 1) and the key column from a cache kept while the
key set does not change (keys added since are merged in by Arrow's sort). The file
holds the same entries as a `MemoryTable`'s, so restore, rescale, dump and readers of
the files do not know the difference.

Every other access (point reads and writes, scans, restores) goes through the bytes
interface, one row at a time. A value that is not such a record (another width or
format byte: an older layout restored before its migration rewrites it) is kept as
bytes in ``data`` itself; while any is held, the columnar calls answer None and the
caller takes the bytes path (whose decoding reports what is wrong with it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, repeat
from operator import is_not
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.state.codecs import RECORD_FORMAT
from statebackend.state.keygroups import key_group_of_rocks_key, key_group_prefix
from statebackend.state.memory_table import MemoryAccount, MemoryTable

_FIRST_ROWS = 1024


def _grown(array: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=array.dtype)
    out[:len(array)] = array
    return out


class RecordTable(MemoryTable):
    """One record value state's column family in memory (module docstring)."""

    def __init__(self, name: str, account: MemoryAccount, dtype: np.dtype) -> None:
        super().__init__(name, account)
        self.dtype = dtype  # a RecordCodec's (its format byte first)
        self.width = dtype.itemsize
        self._as_bytes = np.dtype(f"V{self.width}")
        self.rows = np.zeros(_FIRST_ROWS, dtype)
        self._row_key_group = np.zeros(_FIRST_ROWS, np.uint16)
        self._used = 0  # rows[:_used] were handed out; freed ones wait in _free
        self._free: list[int] = []
        self._odd = 0  # entries held as bytes
        self._read_rows: np.ndarray | None = None  # the rows of _last_read's keys, all found
        # (keys as Arrow, their rows, their key groups) in key order, and the keys added
        # since (merged in by the next snapshot); None after a delete or a restore
        self._key_column: tuple[pa.Array, np.ndarray, np.ndarray] | None = None
        self._appended: list[bytes] = []

    # -- rows ----------------------------------------------------------------------
    def _fits(self, value: bytes) -> bool:
        return len(value) == self.width and value[0] == RECORD_FORMAT

    def _as_records(self, values: list[bytes]) -> np.ndarray | None:
        """``values`` as one array of records, or None unless every one is a record."""
        if not values or set(map(len, values)) != {self.width}:
            return None
        records = np.frombuffer(b"".join(values), self.dtype)
        return records if (records["_format"] == RECORD_FORMAT).all() else None

    def _new_row(self, key: bytes, value: bytes) -> int:
        """A row for new ``key`` holding record ``value``."""
        row = int(self._allocate([key])[0])
        self.rows.view(self._as_bytes)[row] = value
        return row

    def _value(self, held: Any) -> bytes:
        return held if held.__class__ is bytes else self.rows[held].tobytes()

    def _size(self, held: Any) -> int:
        return len(held) if held.__class__ is bytes else self.width

    def _held_size(self, held: Iterable[Any]) -> int:
        return sum(map(self._size, held))

    def _allocate(self, keys: Sequence[bytes]) -> np.ndarray:
        """Rows for new ``keys`` (distinct, not held), their key groups set."""
        n, free = len(keys), self._free
        reused = free[max(0, len(free) - n):]
        del free[len(free) - len(reused):]
        fresh = n - len(reused)
        if self._used + fresh > len(self.rows):
            size = max(2 * len(self.rows), self._used + fresh)
            self.rows, self._row_key_group = (_grown(self.rows, size),
                                              _grown(self._row_key_group, size))
        rows = np.concatenate([np.array(reused, np.int64),
                               np.arange(self._used, self._used + fresh, dtype=np.int64)])
        self._used += fresh
        self._row_key_group[rows] = list(map(key_group_of_rocks_key, keys))
        return rows

    def _release(self, held: Any) -> None:
        """``held`` (a row number, or bytes) left ``data``: its row is free again."""
        self._key_column = None
        if held.__class__ is bytes:
            self._odd -= 1
        else:
            self._free.append(held)

    def _released(self, held: Iterable[Any]) -> None:
        deque(map(self._release, held), maxlen=0)

    def _added_many(self, keys: Sequence[bytes]) -> int:
        if self._key_column is not None:
            self._appended.extend(keys)
        return super()._added_many(keys)

    # -- columns (the job API's columnar calls) ------------------------------------
    def read_records(self, keys: list[bytes], dtype: np.dtype
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """(found mask, one record per key: zeros where absent) of ``keys``; None when
        this table does not hold ``dtype``'s records only (take the bytes path)."""
        if self._odd or dtype != self.dtype:
            return None
        held = list(map(self.data.get, keys))
        self._last_read = (keys, held, self._mutations)
        n = len(held)
        if None not in held:
            self._read_rows = np.array(held, np.int64)  # a write of these keys reuses it
            return np.ones(n, bool), self.rows[self._read_rows]
        self._read_rows = None
        found = np.fromiter(map(is_not, held, repeat(None)), bool, n)
        records = np.zeros(n, self.dtype)
        records[found] = self.rows[np.array(list(compress(held, found)), np.int64)]
        return found, records

    def write_records(self, keys: list[bytes], records: np.ndarray) -> bool:
        """Put ``records[i]`` at ``keys[i]`` (the records of this table's dtype); False
        (nothing written) when bytes entries are held (take the bytes path)."""
        if self._odd or records.dtype != self.dtype:
            return False
        data, account = self.data, self._account
        last, rows = self._last_read, None
        if last is not None and last[0] is keys and last[2] == self._mutations:
            held, rows = last[1], self._read_rows
        else:
            held = list(map(data.get, keys))
        self._mutations += 1
        self._last_read = None
        if rows is not None:
            pass  # the read of these keys found them all
        elif None in held:
            found = np.fromiter(map(is_not, held, repeat(None)), bool, len(held))
            rows = np.zeros(len(held), np.int64)
            rows[found] = list(compress(held, found))
            new_at = np.flatnonzero(~found)
            new_keys = [keys[i] for i in new_at.tolist()]
            distinct = list(dict.fromkeys(new_keys))  # a key twice: its last record wins
            given = dict(zip(distinct, self._allocate(distinct).tolist(), strict=True))
            rows[new_at] = [given[k] for k in new_keys]
            data.update(given)
            account.bytes += self._added_many(distinct) + self.width * len(distinct)
        else:
            rows = np.array(held, np.int64)
        self.rows[rows] = records
        written = np.flatnonzero(np.bincount(self._row_key_group[rows])).tolist()
        account.changed.update(map(key_group_prefix, written))
        account.check()
        return True

    # -- the bytes interface ---------------------------------------------------------
    def get(self, key: Any) -> Any:
        held = super().get(key)
        if isinstance(key, list):
            self._read_rows = None  # (_last_read is this read now)
            return [None if h is None else self._value(h) for h in held]
        return None if held is None else self._value(held)

    def put_one(self, key: bytes, value: bytes) -> None:
        data: dict[bytes, Any] = self.data  # a row number, or bytes
        old: Any = data.get(key)
        super().put_one(key, value)  # the accounting and the key's part; holds the bytes
        if old is not None and old.__class__ is not bytes and self._fits(value):
            self.rows.view(self._as_bytes)[old] = value  # the key keeps its row
            data[key] = old
            return
        if old is not None:
            self._release(old)
        if self._fits(value):
            data[key] = self._new_row(key, value)
        else:
            self._odd += 1  # (held as the bytes the base put)

    def write_columns(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        records = self._as_records(values if isinstance(values, list) else list(values))
        if records is not None and self.write_records(
                keys if isinstance(keys, list) else list(keys), records):
            return
        for key, value in zip(keys, values, strict=True):
            self.put_one(key, value)
        self._account.check()

    def scan(self, lower: bytes | None = None, upper: bytes | None = None, *,
             values: bool = True) -> Iterator[Any]:
        entries = super().scan(lower, upper, values=values)
        if not values:
            return entries
        value = self._value
        return ((k, value(h)) for k, h in entries)

    def entries(self, lower: bytes | None = None, upper: bytes | None = None
                ) -> tuple[list[bytes], list[bytes]]:
        keys, held = super().entries(lower, upper)
        return keys, list(map(self._value, held))

    # -- restore and snapshot ---------------------------------------------------------
    def load(self, prefix: bytes, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        self._key_column = None
        values = values if isinstance(values, list) else list(values)
        held: list[Any] = []
        records = self._as_records(values)
        if records is not None:
            rows = self._allocate(keys)
            self.rows[rows] = records
            held = rows.tolist()
        else:  # rare (an older layout): entry by entry, records and bytes apart
            for key, value in zip(keys, values, strict=True):
                if self._fits(value):
                    held.append(self._new_row(key, value))
                else:
                    held.append(value)
                    self._odd += 1
        self._load(prefix, keys, held, sum(map(len, values)))

    def ordered_entries(self, prefixes: Sequence[bytes]
                        ) -> tuple[Any, Any, dict[bytes, int]]:
        """`MemoryTable.ordered_entries` with the keys as an Arrow binary array and the
        values as the gathered rows (an entries x width uint8 array, what the file
        writes as byte planes): no Python object per entry."""
        if self._odd:
            keys, held, counts = super().ordered_entries(prefixes)
            return keys, list(map(self._value, held)), counts
        if self._key_column is None or self._appended:
            self._key_column = self._sorted_key_column()
        key_column, rows, key_groups = self._key_column
        per_group = np.bincount(key_groups, minlength=1 << 16)
        counts = {p: n for p in prefixes if (n := int(per_group[key_group_of_rocks_key(p)]))}
        if sum(counts.values()) != len(rows):
            wanted = np.isin(key_groups, list(map(key_group_of_rocks_key, counts)))
            key_column, rows = key_column.filter(pa.array(wanted)), rows[wanted]
        return key_column, self.rows[rows].view(np.uint8).reshape(len(rows), self.width), \
            counts

    def _sorted_key_column(self) -> tuple[pa.Array, np.ndarray, np.ndarray]:
        """Every key (Arrow) with its row and key group, in key order: the keys added
        since the last one merged into it, or all of them, sorted by Arrow (no Python
        object of a held key touched, no dictionary rebuilt in order)."""
        data, added = self.data, self._appended
        if self._key_column is None:
            keys = pa.array(list(data), pa.binary())
            rows = np.array(list(data.values()), np.int64)
        else:
            keys = pa.concat_arrays([self._key_column[0], pa.array(added, pa.binary())])
            rows = np.concatenate([self._key_column[1], np.array(list(map(data.__getitem__,
                                                                          added)), np.int64)])
        self._appended = []
        order = pc.sort_indices(keys).to_numpy()
        rows = rows[order]
        return keys.take(order), rows, self._row_key_group[rows]
