"""What the logic sees: state handles of one vocabulary in both logic forms.

One vocabulary, Flink's names (docs/write-a-job.md, "State operations", has the table).
The per-key form's handles (``state[name]``) act on the current key; the vectorized
form's (``ctx.state(name)``) take a column of keys (a list or an Arrow array) first and
cost one multi-get or one write batch per call:

- value: ``value``, ``update``, ``clear``, ``exists``; vectorized also
  ``insert_absent(keys, values) -> found`` (write only where no live value is; one read
  per key) and, with a record codec, ``value_columns(keys) -> (found, columns)`` and
  ``update_columns(keys, columns)`` (NumPy arrays, no per-row dicts);
- list: ``get``, ``add``, ``update``, ``clear``;
- map: ``get``, ``put``, ``remove``, ``contains``, ``keys``, ``items``, ``clear``;
- reducing / aggregating: ``get``, ``add``, ``clear``.

Writes take ``timestamps=`` (vectorized: a TTL's write times, e.g. the rows' event
times). The old names (vectorized ``get``/``put``/``delete``/``append``/``get_columns``/
``put_columns``, per-key value ``get`` and list ``append``) work for one more release and
warn (`DeprecationWarning`) naming the new one.

Per-key form: ``fn(key, rows, state)`` runs once per key per run (`PerKeyFeed`): a
subtask's rows arrive sorted by key in Arrow batches; each batch's last key is held
back (slices, no copy) and joined with the next batch's rows of that key. The keys
ready after a batch are grouped once (`group_by_key`), each state is read for all of
them with one multi-get the first time the logic touches it, and the changed entries
are written back with one write batch per state. ``state[name]`` handles are valid
during the call only; map handles read single entries directly (an in-process RocksDB
get) and buffer writes. The per-key timer handler, ``fn(key, timers, state)``, runs
once per key per firing chunk with that key's due timers (time order).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.state.codecs import decode_list, encode_list
from statebackend.state.kinds import (
    AggregateFunction,
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    ValueState,
    _State,
    same_length,
)
from statebackend.state.timers import (
    Timer,
    delete_timer,
    delete_timers,
    register_timer,
    register_timers,
    timers_of,
    timers_of_table,
)

if TYPE_CHECKING:  # the backend is passed in; its type only
    from statebackend.state.backend import KeyedStateBackend

Keys: TypeAlias = Sequence[str] | pa.Array | pa.ChunkedArray
S = TypeVar("S", bound=_State)  # the state kind a handle works on
_UNSET = object()


def _key_list(keys: Keys) -> list[str]:
    if isinstance(keys, pa.Array | pa.ChunkedArray):
        return keys.to_pylist()
    return keys if isinstance(keys, list) else list(keys)


def _renamed(old: str, new: str) -> Callable[..., Any]:
    """A deprecated name of a handle method: warns naming ``new``, then calls it."""

    def alias(self, *args: Any, **kwargs: Any) -> Any:
        _warn(self, old, f"{new}()")
        return getattr(self, new)(*args, **kwargs)

    alias.__name__ = old
    alias.__doc__ = f"Deprecated (one release): use `{new}`."
    return alias


def _warn(handle: Any, old: str, instead: str) -> None:
    warnings.warn(f"state {handle.name!r}: {old}() is deprecated and goes in the next "
                  f"release; use {instead}", DeprecationWarning, stacklevel=3)


def _reduce_fn(state: _State) -> Callable[[Any, Any], Any]:
    fn = state.descriptor.reduce_fn
    if fn is None:  # a declared reducing state has one (read-only states have none)
        raise UsageError(f"reducing state {state.descriptor.name!r} needs reduce_fn")
    return fn


def _aggregate_fn(state: _State) -> AggregateFunction:
    fn = state.descriptor.aggregate_fn
    if fn is None:  # a declared aggregating state has one (read-only states have none)
        raise UsageError(f"aggregating state {state.descriptor.name!r} needs aggregate_fn")
    return fn


class _KeyCache:
    """RocksDB keys of the last few key columns, by object identity (kept alive)."""

    def __init__(self, backend: KeyedStateBackend) -> None:
        self.backend = backend
        self._entries: list[tuple[object, list[str], list[bytes]]] = []

    def encode(self, keys: Keys) -> tuple[list[str], list[bytes]]:
        for obj, ks, rks in self._entries:
            if obj is keys:
                return ks, rks
        ks = _key_list(keys)
        # An Arrow column is encoded as is (column-wise), not from its Python list.
        rks = self.backend.rocks_keys(keys if isinstance(keys, pa.Array | pa.ChunkedArray)
                                      else ks)
        self._entries = [(keys, ks, rks), *self._entries[:3]]
        return ks, rks

    def clear(self) -> None:
        self._entries = []


# -- batch handles (vectorized form) ---------------------------------------------------
class _BatchHandle(Generic[S]):
    def __init__(self, state: S, keys: _KeyCache) -> None:
        self.state = state
        self.name = state.descriptor.name
        self.codec = state.codec
        self._keys = keys

    def clear(self, keys: Keys) -> None:
        """Delete the keys' entries."""
        _, rks = self._keys.encode(keys)
        self.state.write_raw((), rks)

    def _read(self, keys: Keys) -> list[Any]:
        _, rks = self._keys.encode(keys)
        decode = self.codec.decode
        return [None if r is None else decode(r) for r in self.state.read_raw(rks)]

    delete = _renamed("delete", "clear")


class ValueBatch(_BatchHandle[ValueState]):
    def value(self, keys: Keys) -> list[Any]:
        """The keys' values (None where absent or expired)."""
        return self._read(keys)

    def exists(self, keys: Keys) -> np.ndarray:
        """True where a key holds a (live) value."""
        _, rks = self._keys.encode(keys)
        raws = self.state.read_raw(rks)
        return np.fromiter((r is not None for r in raws), dtype=bool, count=len(raws))

    def update(self, keys: Keys, values: Sequence[Any], timestamps: Any = None) -> None:
        """Set each key's value (one value per key entry)."""
        _, rks = self._keys.encode(keys)
        encode = self.codec.encode
        same_length(self.name, rks, values)
        self.state.put_raw(rks, (encode(v) for v in values), timestamps=_times(timestamps))

    def insert_absent(self, keys: Keys, values: Sequence[Any],
                      timestamps: Any = None) -> np.ndarray:
        """Remember ``values`` for the keys that hold none yet ("insert if absent"): one
        multi-get and one write batch, with a TTL's index entries in the same batch.
        Returns the found mask (True: the key had a live value, left as it was). Keys
        must be distinct (e.g. `group_by_key`'s)."""
        _, rks = self._keys.encode(keys)
        same_length(self.name, rks, values)
        return self.state.insert_absent_raw(rks, _encode_runs(self.codec.encode, values),
                                            timestamps=_times(timestamps))

    def value_columns(self, keys: Keys) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Record codec: (found mask, one NumPy array per field; zeros where not found)."""
        _, rks = self._keys.encode(keys)
        return self.state.read_record_columns(rks)

    def update_columns(self, keys: Keys, columns: Mapping[str, Any],
                       timestamps: Any = None) -> None:
        """Record codec: set each key's record from one array per field."""
        _, rks = self._keys.encode(keys)
        self.state.write_record_columns(rks, dict(columns), timestamps=_times(timestamps))

    get = _renamed("get", "value")
    put = _renamed("put", "update")
    get_columns = _renamed("get_columns", "value_columns")
    put_columns = _renamed("put_columns", "update_columns")


class ReducingBatch(_BatchHandle[ReducingState | AggregatingState]):
    """Reducing and aggregating states: ``get`` returns the reduced value (aggregating:
    the aggregate's result), ``add`` folds values in."""

    def get(self, keys: Keys) -> list[Any]:
        return self._read(keys)

    def add(self, keys: Keys, values: Sequence[Any]) -> None:
        self.state.add_many(self._keys.encode(keys)[0], values)

    def put(self, keys: Keys, values: Sequence[Any]) -> None:
        """Deprecated (one release): overwrite the stored value (aggregating: accumulator)."""
        _warn(self, "put", "clear(keys) then add(keys, values)")
        _, rks = self._keys.encode(keys)
        encode = self.codec.encode
        self.state.write_raw(zip(rks, (encode(v) for v in values), strict=True))


class AggregatingBatch(ReducingBatch):
    def get(self, keys: Keys) -> list[Any]:
        result = _aggregate_fn(self.state).get_result
        return [None if a is None else result(a) for a in self._read(keys)]


class ListBatch(_BatchHandle[ListState]):
    def get(self, keys: Keys) -> list[list]:
        """Each key's list ([] where absent)."""
        _, rks = self._keys.encode(keys)
        decode = self.codec.decode
        return [[] if r is None else [decode(e) for e in decode_list(r)]
                for r in self.state.read_raw(rks)]

    def add(self, keys: Keys, values: Sequence[Any], timestamps: Any = None) -> None:
        """Append each value to its key's list (one value per key entry)."""
        # add_many keeps every stored element's own expiry (a TTL list state)
        if timestamps is None:
            self.state.add_many(self._keys.encode(keys)[0], values)
        else:
            self.state.add_many(self._keys.encode(keys)[0], values, timestamps=_times(timestamps))

    def update(self, keys: Keys, lists: Sequence[Sequence[Any]]) -> None:
        """Replace each key's list."""
        _, rks = self._keys.encode(keys)
        same_length(self.name, rks, lists)
        encode = self.codec.encode
        self.state.write_raw((rk, encode_list(encode(v) for v in vs))
                             for rk, vs in zip(rks, lists, strict=True))

    append = _renamed("append", "add")
    put = _renamed("put", "update")


class MapBatch(_BatchHandle[MapState]):
    def _rkeys(self, keys: Keys, user_keys: Keys) -> list[bytes]:
        return self.state.rocks_keys(_key_list(keys), _key_list(user_keys))

    def get(self, keys: Keys, user_keys: Keys) -> list[Any]:
        """The entry of each (key, user key) pair (None where absent)."""
        decode = self.codec.decode
        return [None if r is None else decode(r)
                for r in self.state.read_raw(self._rkeys(keys, user_keys))]

    def contains(self, keys: Keys, user_keys: Keys) -> np.ndarray:
        raws = self.state.read_raw(self._rkeys(keys, user_keys))
        return np.fromiter((r is not None for r in raws), dtype=bool, count=len(raws))

    def put(self, keys: Keys, user_keys: Keys, values: Sequence[Any],
            timestamps: Any = None) -> None:
        rks = self._rkeys(keys, user_keys)
        same_length(self.name, rks, values)
        encode = self.codec.encode
        self.state.write_raw(zip(rks, (encode(v) for v in values), strict=True),
                             timestamps=_times(timestamps))

    def remove(self, keys: Keys, user_keys: Keys) -> None:
        self.state.remove_many(_key_list(keys), _key_list(user_keys))

    def items(self, keys: Keys) -> list[dict[str, Any]]:
        """Each key's entries as a dict (one prefix scan per key)."""
        return [dict(self.state.items(k)) for k in _key_list(keys)]

    def keys(self, keys: Keys) -> list[list[str]]:
        """Each key's user keys, sorted (one prefix scan per key)."""
        return [self.state.keys(k) for k in _key_list(keys)]

    def clear(self, keys: Keys) -> None:
        """Remove every entry of each key."""
        owners, user_keys = [], []
        for k in _key_list(keys):
            found = self.state.keys(k)
            owners += [k] * len(found)
            user_keys += found
        if owners:
            self.state.remove_many(owners, user_keys)

    delete = _renamed("delete", "remove")


_BATCH_HANDLES: dict[type[_State], type[_BatchHandle[Any]]] = {
    ValueState: ValueBatch, ReducingState: ReducingBatch, AggregatingState: AggregatingBatch,
    ListState: ListBatch, MapState: MapBatch,
}


def _times(timestamps: Any) -> Any:
    """TTL write times as the backend takes them: an integer column without nulls as an
    int64 NumPy array (encoded in one pass), any other column as a list."""
    if isinstance(timestamps, pa.Array | pa.ChunkedArray):
        if pa.types.is_integer(timestamps.type) and not timestamps.null_count:
            return timestamps.to_numpy().astype(np.int64, copy=False)
        return timestamps.to_pylist()
    if isinstance(timestamps, np.ndarray) and timestamps.dtype.kind not in "iu":
        return timestamps.tolist()
    return timestamps


def _encode_runs(encode: Callable[[Any], bytes], values: Sequence[Any]) -> list[bytes]:
    """``[encode(v) for v in values]``, encoding a run of the same object once (e.g. one
    marker value for every key)."""
    out: list[bytes] = []
    last: Any = _UNSET
    encoded = b""
    for v in values:
        if v is not last:
            encoded, last = encode(v), v
        out.append(encoded)
    return out


class Timers:
    """Batch timer operations of the vectorized form (``ctx.timers``): one write batch each.

    ``domain`` is ``"event"`` (fires once the watermark reaches ``time``) or
    ``"processing"`` (once the run's logical time does); a timer is unique by
    (key, time, domain, tag).
    """

    def __init__(self, backend: KeyedStateBackend) -> None:
        self.backend = backend

    def register(self, keys: Keys, times: Any, tags: Any = None, domain: str = "event") -> None:
        ks = _key_list(keys)
        register_timers(self.backend, ks, _int_list(times, len(ks)), domain,
                        None if tags is None else _key_list(tags))

    def delete(self, keys: Keys, times: Any, tags: Any = None, domain: str = "event") -> None:
        ks = _key_list(keys)
        delete_timers(self.backend, ks, _int_list(times, len(ks)), domain,
                      None if tags is None else _key_list(tags))

    def list(self, key: str, domain: str | None = None) -> list[Timer]:
        """The timers of ``key``, time order per domain."""
        return timers_of(self.backend, key, domain)


def _int_list(times: Any, n: int) -> list[int]:
    if isinstance(times, pa.Array | pa.ChunkedArray | np.ndarray):
        times = times.tolist() if isinstance(times, np.ndarray) else times.to_pylist()
    elif isinstance(times, int):
        return [times] * n
    return [int(t) for t in times]


@dataclass(frozen=True)
class RunInfo:
    """Where one subtask's processing sits in its run (all None in process by default).

    ``watermark``: the watermark at the start of the run (None before any row);
    ``new_watermark``: the one the run ends with (timers fire up to it);
    ``processing_time``: the run's logical time (epoch ms).
    """

    run_id: str | None = None
    checkpoint_id: int | None = None
    subtask: int | None = None
    watermark: int | None = None
    new_watermark: int | None = None
    processing_time: int | None = None


class _RunFields:
    """`RunInfo`'s fields as read-only attributes (``ctx.run_id``, ``state.watermark``
    ...) of both logic forms' contexts."""

    run: RunInfo

    @property
    def run_id(self) -> str | None:
        return self.run.run_id

    @property
    def checkpoint_id(self) -> int | None:
        return self.run.checkpoint_id

    @property
    def subtask(self) -> int | None:
        return self.run.subtask

    @property
    def watermark(self) -> int | None:
        return self.run.watermark

    @property
    def new_watermark(self) -> int | None:
        return self.run.new_watermark

    @property
    def processing_time(self) -> int | None:
        return self.run.processing_time


class BatchContext(_RunFields):
    """The vectorized logic's view of one subtask: states, timers, emit, options, and the
    run (`RunInfo`'s fields as attributes: ``ctx.run_id``, ``ctx.watermark`` ...)."""

    def __init__(self, job: Job, backend: KeyedStateBackend, options: Mapping[str, Any],
                 run: RunInfo = RunInfo()) -> None:
        self.job = job
        self.backend = backend
        self.options = options
        self.run = run
        self.keys = _KeyCache(backend)
        self.timers = Timers(backend)
        self.counters: dict[str, int] = {}
        self._handles: dict[str, _BatchHandle[Any]] = {}
        self._emitted: dict[str, list] = {o.name: [] for o in job.outputs}

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the run counter ``name`` (summed over subtasks into the summary)."""
        self.counters[name] = self.counters.get(name, 0) + int(n)

    def state(self, name: str) -> Any:
        """The batch handle of state ``name`` (`ValueBatch`, `ListBatch`, `MapBatch`,
        `ReducingBatch` or `AggregatingBatch`)."""
        handle = self._handles.get(name)
        if handle is None:
            self.job.state(name)  # one-line error for an undeclared state
            st = self.backend.state(name)
            handle = _BATCH_HANDLES[type(st)](st, self.keys)
            self._handles[name] = handle
        return handle

    def emit(self, output: str, rows: Any) -> None:
        if output not in self._emitted:
            self.job.output(output)  # raises: not declared
        self._emitted[output].append(rows)

    def take_emitted(self) -> dict[str, list]:
        out = self._emitted
        self._emitted = {o.name: [] for o in self.job.outputs}
        return out


# -- per-key handles -------------------------------------------------------------------
class _KeyHandle(Generic[S]):
    """Per-key view of one state for the keys of one group; ``i`` is the current key."""

    def __init__(self, state: S, run: _PerKeyBatch) -> None:
        self.state = state
        self.name = state.descriptor.name
        self.codec = state.codec
        self.run = run
        self.i = 0
        self._values: list | None = None  # decoded, one per key of the group (lazy)
        self._changed: dict[int, Any] = {}  # key index -> new value, None = delete

    def _loaded(self) -> list:
        if self._values is None:
            started = time.perf_counter()
            self._values = self._decode(self.state.read_raw(self.run.rocks_keys))
            self.run.timings["prefetch"] += time.perf_counter() - started
        return self._values

    def _decode(self, raws: list[bytes | None]) -> list:
        decode = self.codec.decode
        return [None if r is None else decode(r) for r in raws]

    def _encode(self, value: Any) -> bytes:
        return self.codec.encode(value)

    def _set(self, value: Any) -> None:
        self._loaded()[self.i] = value
        self._changed[self.i] = value

    def clear(self) -> None:
        self._set(None)

    def flush(self) -> None:
        if not self._changed:
            return
        rks = self.run.rocks_keys
        puts = [(rks[i], self._encode(v)) for i, v in self._changed.items() if v is not None]
        deletes = [rks[i] for i, v in self._changed.items() if v is None]
        self.state.write_raw(puts, deletes)


class ValueHandle(_KeyHandle[ValueState]):
    def value(self, default: Any = None) -> Any:
        v = self._loaded()[self.i]
        return default if v is None else v

    def exists(self) -> bool:
        return self._loaded()[self.i] is not None

    def update(self, value: Any) -> None:
        if value is None:
            raise UsageError(f"state {self.name!r}: update(None) is not allowed; call "
                             "clear() to delete the value")
        self._set(value)

    get = _renamed("get", "value")


class ReducingHandle(_KeyHandle[ReducingState]):
    def get(self, default: Any = None) -> Any:
        v = self._loaded()[self.i]
        return default if v is None else v

    def add(self, value: Any) -> None:
        cur = self._loaded()[self.i]
        self._set(value if cur is None else _reduce_fn(self.state)(cur, value))

    def update(self, value: Any) -> None:
        """Deprecated (one release): overwrite the reduced value."""
        _warn(self, "update", "clear() then add(value)")
        self._set(value)

    def exists(self) -> bool:
        """Deprecated (one release)."""
        _warn(self, "exists", "get() is not None")
        return self._loaded()[self.i] is not None


class AggregatingHandle(_KeyHandle[AggregatingState]):
    """Keeps accumulators; ``get`` returns the aggregate's result."""

    def get(self, default: Any = None) -> Any:
        acc = self._loaded()[self.i]
        return default if acc is None else _aggregate_fn(self.state).get_result(acc)

    def add(self, value: Any) -> None:
        fn = _aggregate_fn(self.state)
        acc = self._loaded()[self.i]
        self._set(fn.add(value, fn.create_accumulator() if acc is None else acc))


class ListHandle(_KeyHandle[ListState]):
    def _decode(self, raws: list[bytes | None]) -> list:
        decode = self.codec.decode
        return [None if r is None else [decode(e) for e in decode_list(r)] for r in raws]

    def _encode(self, values: list) -> bytes:
        encode = self.codec.encode
        return encode_list(encode(v) for v in values)

    def get(self) -> list:
        return list(self._loaded()[self.i] or ())

    def add(self, value: Any) -> None:
        self._set([*(self._loaded()[self.i] or ()), value])

    def update(self, values: Sequence[Any]) -> None:
        self._set(list(values) or None)

    append = _renamed("append", "add")


class MapHandle:
    """Per-key map: reads go to RocksDB (one in-process get), writes are buffered."""

    def __init__(self, state: MapState, run: _PerKeyBatch) -> None:
        self.state = state
        self.name = state.descriptor.name
        self.codec = state.codec
        self.run = run
        self.i = 0
        self._changed: dict[tuple[int, str], Any] = {}  # (key index, user key) -> value|None

    def get(self, user_key: str, default: Any = None) -> Any:
        v = self._changed.get((self.i, user_key), _UNSET)
        if v is _UNSET:
            v = self.state.get(self.run.keys[self.i], user_key)
        return default if v is None else v

    def contains(self, user_key: str) -> bool:
        return self.get(user_key) is not None

    def put(self, user_key: str, value: Any) -> None:
        if value is None:
            raise UsageError(f"state {self.name!r}: put(uk, None) is not allowed; call "
                             "remove(uk) to delete the entry")
        self._changed[(self.i, user_key)] = value

    def remove(self, user_key: str) -> None:
        self._changed[(self.i, user_key)] = None

    def items(self) -> list[tuple[str, Any]]:
        merged = dict(self.state.items(self.run.keys[self.i]))
        for (i, uk), v in self._changed.items():
            if i == self.i:
                if v is None:
                    merged.pop(uk, None)
                else:
                    merged[uk] = v
        return sorted(merged.items())

    def keys(self) -> list[str]:
        return [k for k, _ in self.items()]

    def clear(self) -> None:
        for uk in self.keys():
            self.remove(uk)

    def flush(self) -> None:
        if not self._changed:
            return
        keys = self.run.keys
        pairs = list(self._changed.items())
        rks = self.state.rocks_keys([keys[i] for (i, _), _ in pairs],
                                    [uk for (_, uk), _ in pairs])
        encode = self.codec.encode
        self.state.write_raw([(rk, encode(v)) for rk, (_, v) in zip(rks, pairs, strict=True)
                              if v is not None],
                             [rk for rk, (_, v) in zip(rks, pairs, strict=True) if v is None])


_KEY_HANDLES: dict[type[_State], type[_KeyHandle[Any]] | type[MapHandle]] = {
    ValueState: ValueHandle, ReducingState: ReducingHandle,
    AggregatingState: AggregatingHandle, ListState: ListHandle, MapState: MapHandle,
}


class KeyContext(_RunFields):
    """The per-key logic's ``state``: ``state[name]`` handles of the current key, emit,
    count, options and run info (``run_id``, ``checkpoint_id``, ``subtask``, the
    watermarks and ``processing_time``, as on `BatchContext`)."""

    def __init__(self, run: _PerKeyBatch) -> None:
        ctx = run.ctx
        self._run = run
        self.options = ctx.options
        self.run = ctx.run
        self.key: str | None = None
        self.timers = KeyTimers(self)

    def __getitem__(self, name: str) -> Any:
        return self._run.handle(name)

    def emit(self, output: str, rows: Any) -> None:
        self._run.ctx.emit(output, rows)

    def count(self, name: str, n: int = 1) -> None:
        self._run.ctx.count(name, n)


class KeyTimers:
    """``state.timers`` of the per-key form: the current key's timers (written at once)."""

    def __init__(self, state: KeyContext) -> None:
        self._state = state

    def register(self, time: int, tag: str = "", domain: str = "event") -> None:
        register_timer(self._state._run.ctx.backend, self._key(), int(time), domain, tag)

    def delete(self, time: int, tag: str = "", domain: str = "event") -> None:
        delete_timer(self._state._run.ctx.backend, self._key(), int(time), domain, tag)

    def list(self, domain: str | None = None) -> list[Timer]:
        """The key's stored timers (not those the handler is being called with)."""
        return timers_of(self._state._run.ctx.backend, self._key(), domain)

    def _key(self) -> str:
        if self._state.key is None:
            raise UsageError("state.timers works during a per-key call only")
        return self._state.key


class _PerKeyBatch:
    """The keys of one group of calls, their RocksDB keys and the handles of their states."""

    def __init__(self, ctx: BatchContext, keys: list[str], timings: dict[str, float]) -> None:
        self.ctx = ctx
        self.keys = keys
        self.timings = timings
        self._rocks_keys: list[bytes] | None = None
        self._handles: dict[str, _KeyHandle[Any] | MapHandle] = {}
        self.current = 0

    @property
    def rocks_keys(self) -> list[bytes]:
        if self._rocks_keys is None:
            self._rocks_keys = self.ctx.backend.rocks_keys(self.keys)
        return self._rocks_keys

    def handle(self, name: str) -> _KeyHandle[Any] | MapHandle:
        h = self._handles.get(name)
        if h is None:
            self.ctx.job.state(name)  # one-line error for an undeclared state
            st: Any = self.ctx.backend.state(name)  # _KEY_HANDLES maps each kind to its class
            h = _KEY_HANDLES[type(st)](st, self)
            h.i = self.current
            self._handles[name] = h
        return h

    def at(self, i: int) -> None:
        self.current = i
        for h in self._handles.values():
            h.i = i

    def flush(self) -> None:
        for h in self._handles.values():
            h.flush()
        # Handles point back at this object: drop them so no state (and no RocksDB
        # column family) outlives the group, or closing the backend keeps its lock.
        self._handles.clear()


def group_by_key(table: pa.Table, key: str) -> tuple[list[str], pa.Table, np.ndarray]:
    """(keys in first-seen order, rows grouped by key stably, row offsets per key + end).

    Key ``keys[i]``'s rows are ``rows.slice(offsets[i], offsets[i + 1] - offsets[i])``, in
    their order in ``table``. Rows already grouped (e.g. sorted by key) are not copied.
    """
    enc = pc.dictionary_encode(table[key]).combine_chunks()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    counts = np.bincount(codes, minlength=len(enc.dictionary))
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    # Codes number keys in first-seen order: grouped rows have non-decreasing codes.
    if len(codes) > 1 and (np.diff(codes) < 0).any():
        table = table.take(np.argsort(codes, kind="stable"))
    return enc.dictionary.to_pylist(), table, offsets


def _call_each(fn: Callable[..., Any], ctx: BatchContext, keys: list[str],
               args: Callable[[int], Any], timings: dict[str, float], what: str) -> None:
    """``fn(keys[i], args(i), state)`` for each key, sharing one `_PerKeyBatch` (states
    read once for all keys, written back once); what the calls return is emitted."""
    run = _PerKeyBatch(ctx, keys, timings)
    state = KeyContext(run)
    emitted: list = []
    for i, k in enumerate(keys):
        run.at(i)
        state.key = k
        out = fn(k, args(i), state)
        if out is not None:
            emitted.append(out)
    started = time.perf_counter()
    run.flush()
    timings["write_back"] += time.perf_counter() - started
    if not emitted:
        return
    if len(ctx.job.outputs) != 1:
        raise UsageError(f"job {ctx.job.name!r}: the per-key {what} returned rows but the "
                         f"job has {len(ctx.job.outputs)} outputs; call "
                         "state.emit(output, rows) instead")
    for out in emitted:
        ctx.emit(ctx.job.outputs[0].name, out)


def run_per_key(fn: Callable[..., Any], rows: pa.Table, ctx: BatchContext,
                timings: dict[str, float]) -> int:
    """Call ``fn(key, rows, state)`` once per key of ``rows`` (each key's rows complete);
    emit what it returns. Returns the number of calls."""
    started = time.perf_counter()
    keys, grouped, offsets = group_by_key(rows, ctx.job.key)
    timings["grouping"] += time.perf_counter() - started
    _call_each(fn, ctx, keys,
               lambda i: grouped.slice(offsets[i], offsets[i + 1] - offsets[i]),
               timings, "logic")
    return len(keys)


def run_per_key_timers(fn: Callable[..., Any], timers: pa.Table, ctx: BatchContext,
                       timings: dict[str, float]) -> None:
    """Call ``fn(key, timers, state)`` once per key of the chunk ``timers`` (columns
    `statebackend.state.timer_columns.FIRED_SCHEMA`, time order) with that key's due
    timers, a list of `Timer` in time order; keys in the order of their first due timer."""
    keys, grouped, offsets = group_by_key(timers, "key")
    fired = timers_of_table(grouped)
    _call_each(fn, ctx, keys, lambda i: fired[offsets[i]:offsets[i + 1]], timings,
               "timer handler")


class PerKeyFeed:
    """Calls the per-key function once per key of a run over a subtask's accepted rows.

    `add` takes the next accepted rows. A subtask's rows arrive sorted by key (the
    engines sort them by `statebackend.job.task.row_order`) in Arrow batches, so a key's
    rows may span batches: each batch's last key is held back (slices of the batch, not
    copies) and joined with the next batch's rows of that key; `flush` calls it at the
    end of the rows. ``calls`` counts the calls: one per key unless the rows came
    unsorted (the processor then refuses the run). ``any_order``: hold every row until
    `flush` and group them there (in process, rows in any order; all held in memory).
    """

    def __init__(self, fn: Callable[..., Any], ctx: BatchContext, timings: dict[str, float],
                 any_order: bool = False) -> None:
        self.fn = fn
        self.ctx = ctx
        self.timings = timings
        self.any_order = any_order
        self.calls = 0
        self._held: list[pa.Table] = []
        self._held_key: str | None = None

    def add(self, rows: pa.Table) -> None:
        if not rows.num_rows:
            return
        if self.any_order:
            self._held.append(rows)
            return
        key = self.ctx.job.key
        ready: list[pa.Table] = []
        if self._held_key is not None:  # set exactly while rows are held
            same, rows = split_key(rows, key, self._held_key)
            if same is not None:
                self._held.append(same)
            if not rows.num_rows:
                return  # every row of the batch continues the held key
            ready, self._held = self._held, []
        last = rows[key][-1].as_py()
        tail, rest = split_key(rows, key, last)
        ready.append(rest)
        self._call(ready)
        self._held, self._held_key = [tail], last

    def flush(self) -> None:
        """Call the held rows' keys (the end of the subtask's rows)."""
        held, self._held, self._held_key = self._held, [], None
        self._call(held)

    def _call(self, tables: list[pa.Table]) -> None:
        tables = [t for t in tables if t.num_rows]
        if tables:
            rows = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
            self.calls += run_per_key(self.fn, rows, self.ctx, self.timings)


def split_key(table: pa.Table, column: str, key: str) -> tuple[pa.Table | None, pa.Table]:
    """(``table``'s rows whose ``column`` is ``key`` or None, the other rows), both in
    order: slices when the key's rows are one run at either end (sorted rows), else
    filtered copies."""
    eq = pc.fill_null(pc.equal(table[column], key), False).to_numpy(zero_copy_only=False)
    n, k = len(eq), int(eq.sum())
    if not k:
        return None, table
    if eq[:k].all():
        return table.slice(0, k), table.slice(k)
    if eq[n - k:].all():
        return table.slice(n - k), table.slice(0, n - k)
    mask = pa.array(eq)
    return table.filter(mask), table.filter(pc.invert(mask))
