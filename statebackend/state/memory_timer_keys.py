"""The memory backend's ``_timer_keys``: the timers' reverse lookup, derived from ``_timers``.

Every timer is one ``_timers`` key and one ``_timer_keys`` key, the same parts in
another order (`statebackend.state.timers`). RocksDB writes both. In memory the second
doubles each timer's hash-table steps (registered, moved, fired): about 16% of a
sessionization run at 100,000 users, for an index that a run reads only to list one
key's timers (`timers_of`, the job API's ``Timers.list``), and that the state's readers
(validation, conversion to another backend) read afterwards; dumps leave it out.

So `TimerKeysIndex` holds nothing until something reads it:

- writes to it are dropped: the ``_timers`` table's own writes, in the same call
  (`KeyedStateBackend.write_keys`), say the same;
- a snapshot derives its entries for the key groups it writes from that table,
  column-wise (`timer_columns.reverse_key_column`, then one sort): files hold the same
  entries as a RocksDB-like index would;
- a restore does not load them (the ``_timers`` entries it loads say the same);
- its length is the ``_timers`` table's.

The first other read (a scan, a point read, a count of a range) builds it from the
``_timers`` table, once; from then on it is an ordinary `MemoryTable`, written as
RocksDB's is. So is an index whose timers carry tags (the column-wise derivation takes
tagless timers only, the rest would cost a Python step per timer at every snapshot).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.state.memory_table import MemoryAccount, MemoryTable
from statebackend.state.timer_columns import reverse_key_column
from statebackend.state.timers import fired_timers


def _empty_values(n: int) -> pa.Array:
    """``n`` empty binary values (the index's), without a Python object each."""
    return pa.BinaryArray.from_buffers(pa.binary(), n, [None, pa.py_buffer(
        np.zeros(n + 1, np.int32)), pa.py_buffer(b"")])


class TimerKeysIndex(MemoryTable):
    """``_timer_keys`` of a memory backend, derived from its ``timers`` table until read
    (module docstring)."""

    def __init__(self, name: str, account: MemoryAccount, timers: MemoryTable) -> None:
        super().__init__(name, account)
        self.timers = timers
        self.built = False

    def _reverse_keys(self, prefixes: Sequence[bytes], *, columns_only: bool
                      ) -> tuple[pa.Array, dict[bytes, int]] | None:
        """The index's keys of key groups ``prefixes`` in key order, and the entries of
        each (the ``_timers`` table's: one index entry per timer); None when
        ``columns_only`` and a timer takes a Python step (a tag)."""
        timer_keys, counts = self.timers.ordered_keys(prefixes)
        keys = reverse_key_column(pa.array(timer_keys, pa.binary()))
        if keys is None:
            if columns_only:
                return None
            # a timer at a time; bytes that do not fit are refused, naming them
            keys = pa.array(fired_timers(list(timer_keys))[1], pa.binary())
        return keys.take(pc.sort_indices(keys)), counts

    def build(self) -> None:
        """Hold the entries from now on (the first read that needs them)."""
        if self.built:
            return
        derived = self._reverse_keys(self.timers.key_group_prefixes(), columns_only=False)
        assert derived is not None  # noqa: S101 - columns_only=False always derives
        keys, counts = derived
        self.built = True
        start, held = 0, keys.to_pylist()
        for prefix, n in counts.items():  # key groups in key order: a restore's loads
            super().load(prefix, held[start:start + n], [b""] * n)
            start += n

    # -- writes: dropped until built (the timers' own writes say the same) ----------
    def put_one(self, key: bytes, value: bytes) -> None:
        if self.built:
            super().put_one(key, value)

    def write_columns(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        if self.built:
            super().write_columns(keys, values)

    def delete_many(self, keys: Sequence[bytes]) -> None:
        if self.built:
            super().delete_many(keys)

    def delete_range(self, lower: bytes, upper: bytes) -> None:
        if self.built:
            super().delete_range(lower, upper)

    def load(self, prefix: bytes, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        if self.built:
            super().load(prefix, keys, values)

    # -- reads ---------------------------------------------------------------------
    def ordered_entries(self, prefixes: Sequence[bytes]) -> tuple[Any, Any, dict[bytes, int]]:
        """A snapshot's entries: derived from the timers while not built (tags: built)."""
        if not self.built:
            derived = self._reverse_keys(prefixes, columns_only=True)
            if derived is not None:
                keys, counts = derived
                return keys, _empty_values(len(keys)), counts
            self.build()
        return super().ordered_entries(prefixes)

    def __len__(self) -> int:
        return super().__len__() if self.built else len(self.timers)

    # Every other read passes through one of these three: a point read, the key groups
    # a scan visits, the ordered key list
    def get(self, key: Any) -> Any:
        self.build()
        return super().get(key)

    def _prefixes(self, lower: bytes | None, upper: bytes | None) -> list[bytes]:
        self.build()
        return super()._prefixes(lower, upper)

    def _ordered(self) -> list[bytes]:
        self.build()
        return super()._ordered()
