"""What the logic sees: batch state operations (vectorized) and per-key handles.

Vectorized form: ``fn(batch, ctx)`` gets a `BatchContext`. ``ctx.state(name)``
returns a batch handle whose every call takes a column of keys (a list or an
Arrow array) and costs one multi-get or one write batch:

- value / reducing / aggregating: ``get(keys)``, ``put(keys, values)``,
  ``delete(keys)``, ``insert_absent(keys, values) -> found`` (write only where no
  live value is; one read per key); record codecs also ``get_columns(keys) -> (found, columns)``
  and ``put_columns(keys, columns)`` (NumPy arrays, no per-row dicts);
  reducing/aggregating ``add(keys, values)``;
- list: ``get(keys) -> [list]``, ``append(keys, values)`` (one value per key
  entry), ``put(keys, lists)``, ``delete(keys)``;
- map: ``get(keys, user_keys)``, ``put(keys, user_keys, values)``,
  ``delete(keys, user_keys)``, ``items(keys) -> [dict]`` (one prefix scan per key).

``ctx.emit(output, table | record batch | dict of columns)`` adds rows to an output.
The RocksDB keys of a key column are computed once (memoized on the column object),
so a ``get`` then ``put`` of the same keys hashes the key groups once.

Per-key form: ``fn(key, rows, state)`` is run by `run_per_key` on top of the
batch handles: the batch is grouped by key once (Arrow dictionary encoding and a
stable NumPy argsort, so each key's rows keep their input order), each state is
read for all keys of the batch with one multi-get the first time the logic
touches it, and the changed entries are written back with one write batch per
state at the end of the batch. ``state[name]`` handles are valid during the
call only. Map handles read single entries directly (an in-process RocksDB get)
and buffer writes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.state.codecs import decode_list, encode_list
from statebackend.state.kinds import (
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    ValueState,
    _State,
)

Keys = Sequence[str] | pa.Array | pa.ChunkedArray


def _key_list(keys: Keys) -> list[str]:
    if isinstance(keys, pa.Array | pa.ChunkedArray):
        return keys.to_pylist()
    return keys if isinstance(keys, list) else list(keys)


class _KeyCache:
    """RocksDB keys of the last few key columns, by object identity (kept alive)."""

    def __init__(self, backend) -> None:
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
class _BatchHandle:
    def __init__(self, state: _State, keys: _KeyCache) -> None:
        self.state = state
        self.name = state.descriptor.name
        self.codec = state.codec
        self._keys = keys

    def delete(self, keys: Keys) -> None:
        _, rks = self._keys.encode(keys)
        self.state.write_raw((), rks)


class ValueBatch(_BatchHandle):
    def get(self, keys: Keys) -> list[Any]:
        _, rks = self._keys.encode(keys)
        decode = self.codec.decode
        return [None if r is None else decode(r) for r in self.state.read_raw(rks)]

    def put(self, keys: Keys, values: Sequence[Any], timestamps: Any = None) -> None:
        _, rks = self._keys.encode(keys)
        encode = self.codec.encode
        _same_length(self.name, rks, values)
        self.state.write_raw(zip(rks, (encode(v) for v in values), strict=True),
                             timestamps=_times(timestamps))

    def insert_absent(self, keys: Keys, values: Sequence[Any],
                      timestamps: Any = None) -> np.ndarray:
        """Remember ``values`` for the keys that hold none yet ("insert if absent"): one
        multi-get and one write batch, with a TTL's index entries in the same batch.
        Returns the found mask (True: the key had a live value, left as it was). Keys
        must be distinct (e.g. `group_by_key`'s)."""
        _, rks = self._keys.encode(keys)
        _same_length(self.name, rks, values)
        return self.state.insert_absent_raw(rks, _encode_runs(self.codec.encode, values),
                                            timestamps=_times(timestamps))

    def get_columns(self, keys: Keys) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        _, rks = self._keys.encode(keys)
        return self.state._record_codec().decode_columns(self.state.read_raw(rks))

    def put_columns(self, keys: Keys, columns: Mapping[str, Any],
                    timestamps: Any = None) -> None:
        _, rks = self._keys.encode(keys)
        encoded = self.state._record_codec().encode_columns(dict(columns))
        _same_length(self.name, rks, encoded)
        self.state.write_raw(zip(rks, encoded, strict=True), timestamps=_times(timestamps))


class ReducingBatch(ValueBatch):
    def add(self, keys: Keys, values: Sequence[Any]) -> None:
        self.state.add_many(self._keys.encode(keys)[0], values)


class AggregatingBatch(ValueBatch):
    def get(self, keys: Keys) -> list[Any]:
        result = self.state.descriptor.aggregate_fn.get_result
        return [None if a is None else result(a) for a in super().get(keys)]

    def add(self, keys: Keys, values: Sequence[Any]) -> None:
        self.state.add_many(self._keys.encode(keys)[0], values)


class ListBatch(_BatchHandle):
    def get(self, keys: Keys) -> list[list]:
        _, rks = self._keys.encode(keys)
        decode = self.codec.decode
        return [[] if r is None else [decode(e) for e in decode_list(r)]
                for r in self.state.read_raw(rks)]

    def append(self, keys: Keys, values: Sequence[Any], timestamps: Any = None) -> None:
        # add_many keeps every stored element's own expiry (a TTL list state)
        if timestamps is None:
            self.state.add_many(self._keys.encode(keys)[0], values)
        else:
            self.state.add_many(self._keys.encode(keys)[0], values, timestamps=_times(timestamps))

    def put(self, keys: Keys, lists: Sequence[Sequence[Any]]) -> None:
        _, rks = self._keys.encode(keys)
        _same_length(self.name, rks, lists)
        encode = self.codec.encode
        self.state.write_raw((rk, encode_list(encode(v) for v in vs))
                             for rk, vs in zip(rks, lists, strict=True))


class MapBatch(_BatchHandle):
    def _rkeys(self, keys: Keys, user_keys: Keys) -> list[bytes]:
        return self.state.rocks_keys(_key_list(keys), _key_list(user_keys))

    def get(self, keys: Keys, user_keys: Keys) -> list[Any]:
        decode = self.codec.decode
        return [None if r is None else decode(r)
                for r in self.state.read_raw(self._rkeys(keys, user_keys))]

    def put(self, keys: Keys, user_keys: Keys, values: Sequence[Any],
            timestamps: Any = None) -> None:
        rks = self._rkeys(keys, user_keys)
        _same_length(self.name, rks, values)
        encode = self.codec.encode
        self.state.write_raw(zip(rks, (encode(v) for v in values), strict=True),
                             timestamps=_times(timestamps))

    def delete(self, keys: Keys, user_keys: Keys) -> None:  # type: ignore[override]
        self.state.remove_many(_key_list(keys), _key_list(user_keys))

    def items(self, keys: Keys) -> list[dict[str, Any]]:
        return [dict(self.state.items(k)) for k in _key_list(keys)]


_BATCH_HANDLES: dict[type, type[_BatchHandle]] = {
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


def _encode_runs(encode, values: Sequence[Any]) -> list[bytes]:
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


def _same_length(name: str, keys: Sequence, values: Sequence) -> None:
    if len(keys) != len(values):
        raise UsageError(f"state {name!r}: {len(keys)} keys but {len(values)} values; "
                         "pass one value per key")


class Timers:
    """Batch timer operations of the vectorized form (``ctx.timers``): one write batch each.

    ``domain`` is ``"event"`` (fires once the watermark reaches ``time``) or
    ``"processing"`` (once the run's logical time does); a timer is unique by
    (key, time, domain, tag).
    """

    def __init__(self, backend) -> None:
        self.backend = backend

    def register(self, keys: Keys, times: Any, tags: Any = None, domain: str = "event") -> None:
        from statebackend.state.timers import register_timers

        ks = _key_list(keys)
        register_timers(self.backend, ks, _int_list(times, len(ks)), domain,
                        None if tags is None else _key_list(tags))

    def delete(self, keys: Keys, times: Any, tags: Any = None, domain: str = "event") -> None:
        from statebackend.state.timers import delete_timers

        ks = _key_list(keys)
        delete_timers(self.backend, ks, _int_list(times, len(ks)), domain,
                      None if tags is None else _key_list(tags))

    def list(self, key: str, domain: str | None = None) -> list:
        """The timers of ``key`` (`statebackend.state.timers.Timer`), time order per domain."""
        from statebackend.state.timers import timers_of

        return timers_of(self.backend, key, domain)


def _int_list(times: Any, n: int) -> list[int]:
    if isinstance(times, pa.Array | pa.ChunkedArray | np.ndarray):
        times = times.tolist() if isinstance(times, np.ndarray) else times.to_pylist()
    elif isinstance(times, int):
        return [times] * n
    return [int(t) for t in times]


class BatchContext:
    """The vectorized logic's view of one subtask: states, timers, emit, options, time.

    ``watermark``: the watermark at the start of the run (None before any row);
    ``new_watermark``: the one the run ends with (timers fire up to it);
    ``processing_time``: the run's logical time (epoch ms).
    """

    def __init__(self, job: Job, backend, options: Mapping[str, Any],
                 run_id: str | None = None, checkpoint_id: int | None = None,
                 subtask: int | None = None, watermark: int | None = None,
                 new_watermark: int | None = None,
                 processing_time: int | None = None) -> None:
        self.job = job
        self.backend = backend
        self.options = options
        self.run_id = run_id
        self.checkpoint_id = checkpoint_id
        self.subtask = subtask
        self.watermark = watermark
        self.new_watermark = new_watermark
        self.processing_time = processing_time
        self.keys = _KeyCache(backend)
        self.timers = Timers(backend)
        self.counters: dict[str, int] = {}
        self._handles: dict[str, _BatchHandle] = {}
        self._emitted: dict[str, list] = {o.name: [] for o in job.outputs}

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the run counter ``name`` (summed over subtasks into the summary)."""
        self.counters[name] = self.counters.get(name, 0) + int(n)

    def state(self, name: str) -> Any:
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


# -- per-key form ----------------------------------------------------------------------
_UNSET = object()


class _KeyHandle:
    """Per-key view of one state for the keys of one batch; ``i`` is the current key."""

    def __init__(self, state: _State, run: _PerKeyBatch) -> None:
        self.state = state
        self.codec = state.codec
        self.run = run
        self.i = 0
        self._values: list | None = None  # decoded, one per key of the batch (lazy)
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


class ValueHandle(_KeyHandle):
    def get(self, default: Any = None) -> Any:
        v = self._loaded()[self.i]
        return default if v is None else v

    def exists(self) -> bool:
        return self._loaded()[self.i] is not None

    def update(self, value: Any) -> None:
        if value is None:
            raise UsageError(f"state {self.state.descriptor.name!r}: update(None) is not "
                             "allowed; call clear() to delete the value")
        self._set(value)


class ReducingHandle(ValueHandle):
    def add(self, value: Any) -> None:
        cur = self._loaded()[self.i]
        self._set(value if cur is None else self.state.descriptor.reduce_fn(cur, value))


class AggregatingHandle(_KeyHandle):
    """Keeps accumulators; ``get`` returns the aggregate's result."""

    def get(self, default: Any = None) -> Any:
        acc = self._loaded()[self.i]
        return default if acc is None else self.state.descriptor.aggregate_fn.get_result(acc)

    def add(self, value: Any) -> None:
        fn = self.state.descriptor.aggregate_fn
        acc = self._loaded()[self.i]
        self._set(fn.add(value, fn.create_accumulator() if acc is None else acc))


class ListHandle(_KeyHandle):
    def _decode(self, raws: list[bytes | None]) -> list:
        decode = self.codec.decode
        return [None if r is None else [decode(e) for e in decode_list(r)] for r in raws]

    def _encode(self, values: list) -> bytes:
        encode = self.codec.encode
        return encode_list(encode(v) for v in values)

    def get(self) -> list:
        return list(self._loaded()[self.i] or ())

    def append(self, value: Any) -> None:
        self._set([*(self._loaded()[self.i] or ()), value])

    def update(self, values: Sequence[Any]) -> None:
        self._set(list(values) or None)


class MapHandle:
    """Per-key map: reads go to RocksDB (one in-process get), writes are buffered."""

    def __init__(self, state: MapState, run: _PerKeyBatch) -> None:
        self.state = state
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
            raise UsageError(f"state {self.state.descriptor.name!r}: put(uk, None) is not "
                             "allowed; call remove(uk) to delete the entry")
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


_KEY_HANDLES: dict[type, type] = {
    ValueState: ValueHandle, ReducingState: ReducingHandle,
    AggregatingState: AggregatingHandle, ListState: ListHandle, MapState: MapHandle,
}


class KeyContext:
    """The per-key logic's ``state``: ``state[name]`` handles, emit, options, run info."""

    def __init__(self, run: _PerKeyBatch) -> None:
        self._run = run
        self.options = run.ctx.options
        self.run_id = run.ctx.run_id
        self.checkpoint_id = run.ctx.checkpoint_id
        self.watermark = run.ctx.watermark
        self.new_watermark = run.ctx.new_watermark
        self.processing_time = run.ctx.processing_time
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
        from statebackend.state.timers import register_timer

        register_timer(self._state._run.ctx.backend, self._state.key, int(time), domain, tag)

    def delete(self, time: int, tag: str = "", domain: str = "event") -> None:
        from statebackend.state.timers import delete_timer

        run = self._state._run
        delete_timer(run.ctx.backend, self._state.key, int(time), domain, tag)
        run.deleted_timers.add((self._state.key, int(time), tag, domain))

    def list(self, domain: str | None = None) -> list:
        """The key's timers, including those of the current firing chunk not yet handled."""
        from statebackend.state.timers import timers_of

        run = self._state._run
        found = timers_of(run.ctx.backend, self._state.key, domain)
        found += [t for t in run.pending_timers.get(self._state.key, ())
                  if (domain is None or t.domain == domain)
                  and (t.key, t.time, t.tag, t.domain) not in run.deleted_timers]
        return sorted(found, key=lambda t: (t.domain, t.time, t.tag))


class _PerKeyBatch:
    """State of one batch of the per-key form: its keys, their RocksDB keys, handles."""

    def __init__(self, ctx: BatchContext, keys: list[str], timings: dict[str, float]) -> None:
        self.ctx = ctx
        self.keys = keys
        self.timings = timings
        self._rocks_keys: list[bytes] | None = None
        self._handles: dict[str, Any] = {}
        self.current = 0
        # Timer handler only: the chunk's timers not yet handled (already out of the
        # queue) and the ones the handler deleted meanwhile (they must not fire).
        self.pending_timers: dict[str, list] = {}
        self.deleted_timers: set[tuple] = set()

    @property
    def rocks_keys(self) -> list[bytes]:
        if self._rocks_keys is None:
            self._rocks_keys = self.ctx.backend.rocks_keys(self.keys)
        return self._rocks_keys

    def handle(self, name: str) -> Any:
        h = self._handles.get(name)
        if h is None:
            self.ctx.job.state(name)  # one-line error for an undeclared state
            st = self.ctx.backend.state(name)
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
        # column family) outlives the batch, or closing the backend keeps its lock.
        self._handles.clear()


def group_by_key(table: pa.Table, key: str) -> tuple[list[str], pa.Table, np.ndarray]:
    """(keys in first-seen order, rows sorted by key stably, row offsets per key + end)."""
    enc = pc.dictionary_encode(table[key]).combine_chunks()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes, minlength=len(enc.dictionary))
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return enc.dictionary.to_pylist(), table.take(order), offsets


def run_per_key(fn, batch: pa.Table, ctx: BatchContext, timings: dict[str, float]) -> None:
    """Call ``fn(key, rows, state)`` once per key of ``batch``; emit what it returns."""
    started = time.perf_counter()
    keys, rows, offsets = group_by_key(batch, ctx.job.key)
    run = _PerKeyBatch(ctx, keys, timings)
    state = KeyContext(run)
    single = ctx.job.outputs[0].name if len(ctx.job.outputs) == 1 else None
    timings["grouping"] += time.perf_counter() - started
    emitted: list = []
    for i, k in enumerate(keys):
        run.at(i)
        state.key = k
        lo = offsets[i]
        out = fn(k, rows.slice(lo, offsets[i + 1] - lo), state)
        if out is not None:
            emitted.append(out)
    started = time.perf_counter()
    run.flush()
    timings["write_back"] += time.perf_counter() - started
    if emitted:
        if single is None:
            raise UsageError(f"job {ctx.job.name!r}: the per-key logic returned rows but the "
                             f"job has {len(ctx.job.outputs)} outputs; call "
                             "state.emit(output, rows) instead")
        for out in emitted:
            ctx.emit(single, out)


def run_per_key_timers(fn, timers: pa.Table, ctx: BatchContext,
                       timings: dict[str, float]) -> None:
    """Call ``fn(key, timer, state)`` once per row of ``timers`` (time order), emit its rows.

    The keys of the batch share one `_PerKeyBatch`: a key with several timers sees
    the state its earlier calls left (handles keep the changed values), and the
    changes are written back once at the end, like `run_per_key`.
    """
    from statebackend.state.timers import Timer

    keys = pc.unique(timers["key"]).to_pylist()
    index = {k: i for i, k in enumerate(keys)}
    run = _PerKeyBatch(ctx, keys, timings)
    state = KeyContext(run)
    single = ctx.job.outputs[0].name if len(ctx.job.outputs) == 1 else None
    emitted: list = []
    cols = [timers[c].to_pylist() for c in ("key", "time", "tag", "domain", "key_group")]
    chunk = [Timer(t, kg, k, tag, dom) for k, t, tag, dom, kg in zip(*cols, strict=True)]
    for timer in chunk:
        run.pending_timers.setdefault(timer.key, []).append(timer)
    for timer in chunk:
        k = timer.key
        run.pending_timers[k].remove(timer)
        if (k, timer.time, timer.tag, timer.domain) in run.deleted_timers:
            continue  # deleted by an earlier call: a deleted timer never fires
        run.at(index[k])
        state.key = k
        out = fn(k, timer, state)
        if out is not None:
            emitted.append(out)
    run.flush()
    if emitted:
        if single is None:
            raise UsageError(f"job {ctx.job.name!r}: the per-key timer handler returned rows "
                             f"but the job has {len(ctx.job.outputs)} outputs; call "
                             "state.emit(output, rows) instead")
        for out in emitted:
            ctx.emit(single, out)
