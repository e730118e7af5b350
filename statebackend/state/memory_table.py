"""In-memory column families: a hash table with RocksDB's byte-key contract.

A `MemoryTable` stands in for a raw-mode ``Rdict`` column family where the state kinds,
timers and TTL use one (``get`` of a key or a list of keys, ``put``, ``delete``,
``delete_range``, ordered scans), so the same state code runs on either backend. Keys
are the backend's full keys (2-byte key-group prefix first). One ``dict`` holds every
entry, so a multi-get or a batch of updates is the dictionary's own loop, with no
Python step per entry. Writes keep nothing per key beside it: no per-key-group key set
(keeping one cost a set operation per new or deleted key, about 40% of a timer's
write or delete at 100,000 users).

Order is needed only by scans (map state's prefix reads, the time-ordered timer queue
and TTL index, dumps, snapshots): the first one after keys were added or deleted lists
every key in order, once, and a key group is the span of that list its 2-byte prefix
bounds (two bisections). The dictionary itself is put back in key order by each
snapshot (`ordered_entries`), so that list is the dictionary's keys, or their sort
with only the keys added since out of place (a merge for Python's sort), never a full
sort; point reads and writes never pay for order.

Every write charges `MemoryAccount`: the bytes held (keys + values + a fixed per-entry
overhead of Python's objects) against the configured limit, and the key groups changed
since the last snapshot (the ones the next snapshot writes). Past the limit a write
raises `StateMemoryLimitError` at once: the backend never swaps or spills.

`MemoryWriteBatch` has the subset of rocksdict's ``WriteBatch`` the state code uses and
applies in order. This module imports nothing of the state package.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, repeat
from operator import is_, is_not, itemgetter
from typing import Any

from statebackend.errors import UsageError

# Bytes counted per entry beyond its key and value: two bytes objects (33 B each) and a
# dict slot, rounded up. An estimate: the limit guards against runaway state, not bytes.
ENTRY_OVERHEAD = 120
# Keys added since the ordered key list was made that are inserted into it one by one
# (a bisection and a move of the list each); more, and it is made again by one sort
_INSERT_UP_TO = 64
_first, _second = itemgetter(0), itemgetter(1)
key_group_prefix_of = itemgetter(slice(0, 2))  # a key's 2-byte key-group prefix


def _entry_bytes(keys: Sequence[bytes]) -> int:
    """What ``keys`` count beside their values: the keys and `ENTRY_OVERHEAD` each."""
    return sum(map(len, keys)) + ENTRY_OVERHEAD * len(keys)


def _group_bounds(order: list[bytes], prefix: bytes, lower: bytes | None = None,
                  upper: bytes | None = None) -> tuple[int, int]:
    """Where key group ``prefix``'s keys in [lower, upper) lie in sorted ``order``."""
    start = bisect_left(order, lower if lower and lower > prefix else prefix)
    if upper is None or upper[:2] != prefix:
        n = int.from_bytes(prefix, "big") + 1  # up to the next key group's first key
        upper = n.to_bytes(2, "big") if n < 1 << 16 else None
    return start, bisect_left(order, upper, start) if upper is not None else len(order)


def _pieces(items: list[Any], spans: list[tuple[int, int]]) -> list[Any]:
    """``items[a:b]`` of each (a, b) of ``spans``, joined (list slices: no step per item)."""
    out: list[Any] = []
    for start, end in spans:
        out += items[start:end]
    return out


class StateMemoryLimitError(UsageError):
    """The memory backend's state grew past its configured limit."""


class MemoryAccount:
    """Bytes held by every table of one backend, its limit, and the changed key groups."""

    def __init__(self, limit_bytes: int | None, label: str) -> None:
        self.limit_bytes = limit_bytes
        self.label = label
        self.bytes = 0
        self.changed: set[bytes] = set()  # key-group prefixes written since the last snapshot

    def check(self) -> None:
        if self.limit_bytes is not None and self.bytes > self.limit_bytes:
            raise StateMemoryLimitError(
                f"{self.label} holds about {self.bytes / 2**20:.0f} MiB of state, over the "
                f"memory backend's limit of {self.limit_bytes / 2**20:.0f} MiB "
                "(--memory-limit-mb): raise it, add subtasks (rescale), or run this job "
                "with --backend rocksdb")


class MemoryTable:
    """One column family in memory (module docstring)."""

    def __init__(self, name: str, account: MemoryAccount) -> None:
        self.name = name
        self.data: dict[bytes, bytes] = {}  # every entry: key -> value
        # key-group prefixes that have held a key since the last `key_group_prefixes`
        # (a superset of the ones holding keys: a delete does not look)
        self._groups: set[bytes] = set()
        self._account = account
        self._in_order = True  # ``data`` iterates in key order (no key added since sorted)
        # Every key in key order (None: to be made again), and the keys added since; it
        # may still name keys deleted since (``_holes``): its readers skip those.
        self._order: list[bytes] | None = []
        self._added: list[bytes] = []
        self._holes = False
        self._mutations = 0
        # (keys, their values, mutations then) of the last multi-get: a write of the same
        # key list right after it knows what the keys held without looking them up
        self._last_read: tuple[list[bytes], list[bytes | None], int] | None = None

    # -- point access (rocksdict's names) ------------------------------------------
    def get(self, key: Any) -> Any:
        """The value of ``key`` (None: absent), or a list of values for a list of keys."""
        if isinstance(key, list):
            values = list(map(self.data.get, key))
            self._last_read = (key, values[:], self._mutations)
            return values
        return self.data.get(key)

    def put(self, key: bytes, value: bytes) -> None:
        self.put_one(key, value)
        self._account.check()

    def put_one(self, key: bytes, value: bytes) -> None:
        """`put` without the limit check (the caller checks once): one entry in a few
        dictionary steps, for the TTL's write batches of single puts."""
        self._mutations += 1
        self._last_read = None
        data, account = self.data, self._account
        old = data.get(key)
        data[key] = value
        account.changed.add(key[:2])
        if old is None:
            account.bytes += self._added_many((key,)) + len(value)
        else:
            account.bytes += len(value) - self._size(old)

    def _added_many(self, keys: Sequence[bytes]) -> int:
        """Distinct new ``keys`` are out of key order now (the ordered list takes them
        when next read, `_ordered`); their bytes beyond the values'."""
        self._groups.update(map(key_group_prefix_of, keys))
        self._in_order = False
        if self._order is not None:
            if len(self._added) + len(keys) > _INSERT_UP_TO:
                self._order, self._added = None, []
            else:
                self._added += keys
        return _entry_bytes(keys)

    def write_many(self, puts: Iterable[tuple[bytes, bytes]], deletes: Iterable[bytes] = ()
                   ) -> None:
        """`put` of every pair, then `delete` of every key: the state kinds' batch write."""
        pairs = puts if isinstance(puts, list) else list(puts)
        self.write_columns(list(map(_first, pairs)), list(map(_second, pairs)))
        deletes = deletes if isinstance(deletes, list) else list(deletes)
        if deletes:
            self.delete_many(deletes)

    def write_columns(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        """`put` of ``keys[i]`` -> ``values[i]``. Updates of existing keys take no Python
        step per entry (the dictionary's own loops; what the keys held comes from the
        multi-get of this very key list just before, if there was one); a new key puts
        the table out of key order. The limit is checked once."""
        data, account = self.data, self._account
        last = self._last_read
        if last is not None and last[0] is keys and last[2] == self._mutations:
            olds = last[1]
        else:
            olds = list(map(data.get, keys))
        self._mutations += 1
        self._last_read = None
        data.update(zip(keys, values, strict=True))
        account.changed.update(map(key_group_prefix_of, keys))
        # A key written twice in one batch counts its first old value twice: the count
        # is an estimate (ENTRY_OVERHEAD), kept exact for the state kinds' batches,
        # which write each key once.
        grown = sum(map(len, values)) - sum(map(len, filter(None, olds)))
        if None in olds:
            grown += self._added_many(
                list(dict.fromkeys(compress(keys, map(is_, olds, repeat(None))))))
        account.bytes += grown
        account.check()

    def delete(self, key: bytes) -> None:
        self.delete_many([key])

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """`delete` of every key, in the dictionary's own loops (no Python step per key:
        fired timers are deleted a chunk at a time). Only the key groups that lost a key
        count as changed; the ordered key list keeps naming them (``_holes``)."""
        self._mutations += 1
        olds = list(map(self.data.pop, keys, repeat(None)))
        present = list(map(is_not, olds, repeat(None)))
        if not all(present):
            keys, olds = list(compress(keys, present)), list(compress(olds, present))
            if not keys:
                return
        self._account.changed.update(map(key_group_prefix_of, keys))
        self._holes = self._order is not None
        self._forget(keys, olds)

    def _forget(self, keys: Sequence[bytes], olds: Sequence[Any]) -> None:
        """``keys`` and what they held (``olds``) left ``data``: uncounted, released."""
        self._account.bytes -= _entry_bytes(keys) + self._held_size(olds)
        self._released(olds)

    # What ``data`` holds per key: the value here; a subclass may hold something else
    # (`statebackend.state.memory_records`: a row number) and say how big it is. The
    # column forms take no Python step per entry here.
    def _size(self, held: Any) -> int:
        return len(held)

    def _held_size(self, held: Iterable[Any]) -> int:
        return sum(map(len, held))

    def _released(self, held: Iterable[Any]) -> None:
        """``held`` left ``data`` (deleted or replaced by a restore)."""

    def delete_range(self, lower: bytes, upper: bytes) -> None:
        """Delete every key in [lower, upper)."""
        self.delete_many(list(self.scan(lower, upper, values=False)))

    # -- order -------------------------------------------------------------------
    def _ordered(self) -> list[bytes]:
        """Every key in key order, perhaps with keys deleted since (``_holes``): made by
        one sort after keys were added (a merge: ``data`` is in key order but for the
        keys added since the last snapshot), or the few added keys inserted into the
        list. Do not keep it: it changes in place."""
        order = self._order
        if order is None:
            order = self._order = list(self.data) if self._in_order else sorted(self.data)
            self._holes = False
        elif self._added:
            for key in self._added:
                i = bisect_left(order, key)
                if i == len(order) or order[i] != key:  # (deleted and added again: listed)
                    order.insert(i, key)
            self._added = []
        return order

    def _span(self, prefix: bytes, lower: bytes | None, upper: bytes | None) -> list[bytes]:
        """Key group ``prefix``'s keys in [lower, upper), in order (a new list)."""
        order = self._ordered()
        start, end = _group_bounds(order, prefix, lower, upper)
        span = order[start:end]
        return list(filter(self.data.__contains__, span)) if self._holes else span

    def sorted_keys(self, prefix: bytes) -> list[bytes]:
        """Key group ``prefix``'s keys in order."""
        return self._span(prefix, None, None)

    def key_group_prefixes(self) -> list[bytes]:
        """The prefixes of the key groups holding keys, in order."""
        held = [p for p in self._prefixes(None, None) if self.sorted_keys(p)]
        self._groups = set(held)
        return held

    def ordered_entries(self, prefixes: Sequence[bytes]
                        ) -> tuple[list[bytes], list[bytes], dict[bytes, int]]:
        """Keys and values of key groups ``prefixes`` (sorted) in key order, and the
        entries of each non-empty one. ``data`` is kept in key order (sorted again after
        keys were added), so the values come from one pass over it, not a lookup each."""
        keys, spans, counts = self._selected(prefixes)
        values = list(self.data.values())
        if spans is None:
            return keys, values, counts
        return _pieces(keys, spans), _pieces(values, spans), counts

    def ordered_keys(self, prefixes: Sequence[bytes]) -> tuple[list[bytes], dict[bytes, int]]:
        """`ordered_entries` without the values."""
        keys, spans, counts = self._selected(prefixes)
        return (keys if spans is None else _pieces(keys, spans)), counts

    def _selected(self, prefixes: Sequence[bytes]
                  ) -> tuple[list[bytes], list[tuple[int, int]] | None, dict[bytes, int]]:
        """Every key in key order (``data`` put in key order), the spans of it that key
        groups ``prefixes`` hold (None: all of it) and the entries of each non-empty one."""
        keys = list(self._in_key_order())
        bounds = {p: _group_bounds(keys, p) for p in prefixes}
        counts = {p: end - start for p, (start, end) in bounds.items() if end > start}
        if sum(counts.values()) == len(keys):
            return keys, None, counts
        return keys, sorted(bounds[p] for p in counts), counts

    def _in_key_order(self) -> dict[bytes, Any]:
        """``data``, iterating in key order (sorted again if keys were added since)."""
        if not self._in_order:  # (sorting the keys, not the items: 1.5x faster)
            data = self.data
            keys = self._ordered()
            if self._holes:
                keys = list(filter(data.__contains__, keys))
            self.data = {k: data[k] for k in keys}
            self._order, self._holes, self._in_order = keys, False, True
        return self.data

    def _prefixes(self, lower: bytes | None, upper: bytes | None) -> list[bytes]:
        lo = lower[:2] if lower else b""
        return sorted(p for p in self._groups
                      if p >= lo and (upper is None or p < upper))

    def scan(self, lower: bytes | None = None, upper: bytes | None = None, *,
             values: bool = True) -> Iterator[Any]:
        """Entries with lower <= key < upper in key order: (key, value), or keys."""
        for prefix in self._prefixes(lower, upper):
            data = self.data
            for key in self._span(prefix, lower, upper):
                if not values:
                    yield key
                elif (value := data.get(key)) is not None:  # deleted while scanning
                    yield key, value

    def entries(self, lower: bytes | None = None, upper: bytes | None = None
                ) -> tuple[list[bytes], list[bytes]]:
        """`scan`'s keys and values as two lists, a key group at a time (a bulk read
        builds no tuple per entry)."""
        keys: list[bytes] = []
        values: list[bytes] = []
        for prefix in self._prefixes(lower, upper):
            span = self._span(prefix, lower, upper)
            keys += span
            values += map(self.data.__getitem__, span)
        return keys, values

    def count(self, lower: bytes | None = None, upper: bytes | None = None) -> int:
        if lower is None and upper is None:
            return len(self)
        return sum(len(self._span(p, lower, upper)) for p in self._prefixes(lower, upper))

    def edge_keys(self, prefix: bytes | None = None) -> tuple[bytes, bytes] | None:
        """(first, last) key of the table, or of key group ``prefix``; None: empty."""
        if prefix is not None:
            keys = self.sorted_keys(prefix)
            return (keys[0], keys[-1]) if keys else None
        order, data = self._ordered(), self.data
        first = next(filter(data.__contains__, order), None)
        if first is None:
            return None
        return first, next(filter(data.__contains__, reversed(order)))

    def __len__(self) -> int:
        return len(self.data)

    # -- bulk (restore) ------------------------------------------------------------
    def load(self, prefix: bytes, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        """Replace key group ``prefix`` with sorted ``keys`` -> ``values`` (a restore:
        not a change for the next snapshot)."""
        self._load(prefix, keys, values, sum(map(len, values)))

    def _load(self, prefix: bytes, keys: Sequence[bytes], held: Sequence[Any],
              value_bytes: int) -> None:
        """`load` of what ``data`` holds for ``keys``, ``value_bytes`` in all."""
        data, account = self.data, self._account
        self._mutations += 1
        self._last_read = None
        gone = self.sorted_keys(prefix) if prefix in self._groups else []
        if gone:
            self._forget(gone, list(map(data.pop, gone)))
            self._holes = self._order is not None
        if not keys:
            return
        order = self._order
        # key groups restored in key order into a table in order stay in order (a
        # restore sorts nothing)
        if self._in_order and order is not None and not self._holes and not self._added \
                and (not order or order[-1] < keys[0]):
            order += keys
        else:
            self._in_order, self._order, self._added = False, None, []
        data.update(zip(keys, held, strict=True))
        self._groups.add(prefix)
        account.bytes += _entry_bytes(keys) + value_bytes
        account.check()

    def drop_part(self, prefix: bytes) -> None:
        self.load(prefix, (), ())

    # -- RocksDB's maintenance calls: nothing to do in memory ----------------------
    def flush(self, wait: bool = True) -> None:
        del wait

    def compact_range(self, begin: bytes | None, end: bytes | None) -> None:
        del begin, end

    def set_options(self, options: dict[str, str]) -> None:
        del options

    def property_int_value(self, name: str) -> int:
        """RocksDB's key estimate (``rocksdb.estimate-num-keys``): exact here."""
        del name
        return len(self)


class MemoryWriteBatch:
    """Puts, deletes and range deletes over `MemoryTable` handles, applied in order."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, MemoryTable, bytes, bytes]] = []
        self._default: MemoryTable | None = None

    def set_default_column_family(self, handle: MemoryTable) -> None:
        self._default = handle

    def _table(self, handle: MemoryTable | None) -> MemoryTable:
        table = handle if handle is not None else self._default
        if table is None:
            raise UsageError("write batch without a column family")
        return table

    def put(self, key: bytes, value: bytes, handle: MemoryTable | None = None) -> None:
        self.ops.append((0, self._table(handle), key, value))

    def delete(self, key: bytes, handle: MemoryTable | None = None) -> None:
        self.ops.append((1, self._table(handle), key, b""))

    def delete_range(self, lower: bytes, upper: bytes, handle: MemoryTable | None = None
                     ) -> None:
        self.ops.append((2, self._table(handle), lower, upper))

    def __len__(self) -> int:
        return len(self.ops)

    def apply(self, account: MemoryAccount) -> None:
        """Apply in order within each table (tables are independent): a table's run of
        puts, or of deletes, waits until an operation of another kind on that table or
        the end, then goes in as one `write_columns` (one put: `put_one`) or one
        `delete_many`. A batch that alternates between two tables one operation at a
        time (the TTL's: a state entry and its index entry) is then two column writes.
        (Timers skip write batches: `KeyedStateBackend.write_keys`.)"""
        runs: dict[MemoryTable, tuple[int, list[bytes], list[bytes]]] = {}  # (by identity)
        for op, table, a, b in self.ops:
            run = runs.get(table)
            if run is not None and run[0] != op:
                _apply_run(table, *runs.pop(table))
                run = None
            if op == 2:
                table.delete_range(a, b)
                continue
            if run is None:
                run = runs[table] = (op, [], [])
            run[1].append(a)
            run[2].append(b)
        for table, run in runs.items():
            _apply_run(table, *run)
        account.check()


def _apply_run(table: MemoryTable, op: int, keys: list[bytes], values: list[bytes]) -> None:
    if op == 1:
        table.delete_many(keys)
    elif len(keys) == 1:
        table.put_one(keys[0], values[0])
    else:
        table.write_columns(keys, values)

