"""One source subtask of a transform: its state read span by span, the user's function
applied, the new job's tables out (`statebackend.job.transform`).

`transformed_spans(source, subtask)` restores the subtask read-only
(`statebackend.checkpoint.restore.restored_readonly`: the executor's local-recovery
snapshot when it holds the files, else a download), cuts its key groups into spans of
about `BATCH_ROWS` entries, and for each span reads every state of the source
(`statebackend.state.state_table.read_span`: live entries only, the checkpoint's clocks
judge TTL) and the timers. Every state of a key lies in the same span, so the function
sees a key's whole state at once:

- per batch (`StateTransform(fn, per="batch")`): ``fn({state: pa.Table})`` gets one table
  per source state (`read_state`'s columns; empty when the span holds none of it; the
  timers as ``_timers``) and returns ``{state: table}`` for the new job (an Arrow
  table or batch, or a pandas DataFrame) in the bootstrap table contract
  (`statebackend.job.bootstrap_tables`): the keys it writes are free, so a re-key is
  rows with other keys;
- per key (``per="key"``, the default): ``fn(key, {state: value})`` gets a key's states
  as Python values (value, reducing and aggregating states: the value or accumulator, a
  record as a dict; map: a dict; list: a list; ``_timers``: a list of ``{"time",
  "domain", "tag"}``), states the key does not hold left out; it returns
  ``{state: value}`` in the same forms for the new job's states (a None value writes
  nothing), or None to drop the key. TTL states written per key expire their TTL's
  duration after the source checkpoint's clock of its domain, as if written then (per
  batch, ``expires_at`` says when).

A result naming a state the new job does not declare, or a value its codec cannot hold,
is refused in one line naming the state (and the key, per key).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from statebackend.checkpoint.local_copy import instance_dir
from statebackend.checkpoint.metadata import SubtaskHandle
from statebackend.checkpoint.restore import RestoreOptions, restored_readonly
from statebackend.errors import UsageError
from statebackend.fast_json import compact_json
from statebackend.job.api import Job
from statebackend.state.codecs import BytesCodec, JsonCodec, RecordCodec, StrCodec
from statebackend.state.external_store import ExternalRead
from statebackend.state.families import TIMERS
from statebackend.state.kinds import StateDescriptor
from statebackend.state.state_table import (
    BATCH_ROWS,
    JSON_TEXT,
    StateRead,
    TableShape,
    key_group_spans,
    read_span,
    readable,
    state_schema,
    value_type,
)
from statebackend.storage import StorageOptions, child_storage, open_storage

PER = ("key", "batch")


@dataclass(frozen=True)
class StateTransform:
    """A transform's function and how it is called: ``per="key"`` (default) or
    ``per="batch"`` (module doc)."""

    fn: Callable[..., Any]
    per: str = "key"

    def __post_init__(self) -> None:
        if self.per not in PER:
            raise UsageError(f"StateTransform per={self.per!r}: use 'key' or 'batch'")
        if not callable(self.fn):
            raise UsageError(f"StateTransform fn is a {type(self.fn).__name__}, not a function")

    @property
    def name(self) -> str:
        fn = self.fn
        return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


@dataclass(frozen=True)
class SourceRead:
    """What reading and transforming every source subtask needs (shipped to Spark tasks;
    the storage options' repr shows no secret)."""

    storage_url: str
    storage_options: StorageOptions
    job_dir: str
    checkpoint_id: int
    max_parallelism: int
    descriptors: tuple[StateDescriptor, ...]  # every column family of the source
    handles: tuple[SubtaskHandle, ...]
    clocks: Mapping[str, int | None]  # time domain -> the source's clock
    transform: StateTransform
    target: Job
    local_dir: str | None = None
    batch_rows: int = BATCH_ROWS
    external: ExternalRead | None = None  # an external-backend source's database read

    @property
    def states(self) -> tuple[StateDescriptor, ...]:
        """What the function sees: the job's states, and the timers when there are any."""
        return readable(self.descriptors)


def transformed_spans(source: SourceRead, subtask: int) -> Iterator[dict[str, pa.Table]]:
    """The function's result (``{state: table}`` for the new job) per span of source
    subtask ``subtask`` (module doc)."""
    handle = source.handles[subtask]
    storage = child_storage(open_storage(source.storage_url, **source.storage_options),
                            source.job_dir)
    instance = instance_dir(source.storage_url, source.job_dir, subtask, source.local_dir)
    shape = TableShape(fields_as_columns=source.transform.per == "batch")
    reads = [StateRead(d, subtask, _clock(source, d), shape) for d in source.states]
    expected = max((handle.row_counts.get(d.name, 0) for d in source.states), default=0)
    with restored_readonly(storage, handle, source.descriptors, source.max_parallelism,
                           options=RestoreOptions(
                               label=f"subtask {subtask} of checkpoint {source.checkpoint_id}",
                               external=source.external, local_instance=instance)) as backend:
        for span in key_group_spans(backend.key_group_range, expected, source.batch_rows):
            tables = {}
            for read in reads:
                batch = read_span(backend, read, span)
                tables[read.desc.name] = pa.Table.from_batches(
                    [batch] if batch is not None else [], state_schema(read.desc, shape))
            if any(t.num_rows for t in tables.values()):
                yield apply(source, tables)


def _clock(source: SourceRead, desc: StateDescriptor) -> int | None:
    return source.clocks.get(desc.ttl.time) if desc.ttl is not None else None


def apply(source: SourceRead, tables: Mapping[str, pa.Table]) -> dict[str, pa.Table]:
    """The function over one span's tables: the new job's tables (module doc)."""
    transform = source.transform
    if transform.per == "batch":
        result = transform.fn(dict(tables))
        if not isinstance(result, Mapping):
            raise UsageError(f"transform {transform.name}: returned a {type(result).__name__}; "
                             "return a dict of state name -> table")
        for state in result:
            _declared(source.target, state, transform)
        return {state: _as_table(state, t) for state, t in result.items() if t is not None}
    return _per_key(source, tables)


def _declared(target: Job, state: str, transform: StateTransform) -> None:
    names = [d.name for d in target.states]
    if state != TIMERS and state not in names:
        raise UsageError(f"transform {transform.name}: wrote state {state!r}, which job "
                         f"{target.name!r} does not declare; its states: {names}")


def _as_table(state: str, data: Any) -> pa.Table:
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if type(data).__module__.startswith("pandas"):
        return pa.Table.from_pandas(data, preserve_index=False)
    raise UsageError(f"transform result for state {state!r} is a {type(data).__name__}; give "
                     "a pyarrow Table or a pandas DataFrame")


# -- per key ---------------------------------------------------------------------------

def _per_key(source: SourceRead, tables: Mapping[str, pa.Table]) -> dict[str, pa.Table]:
    """Each key's states as Python values through the function; its results as tables."""
    by_name = {d.name: d for d in source.descriptors}
    keyed: dict[str, dict[str, Any]] = {}
    for name, table in tables.items():
        for key, value in _values(by_name[name], table):
            keyed.setdefault(key, {})[name] = value
    rows: dict[str, list[tuple[str, Any]]] = {}
    fn, name = source.transform.fn, source.transform.name
    for key, states in keyed.items():
        result = fn(key, states)
        if result is None:
            continue
        if not isinstance(result, Mapping):
            raise UsageError(f"transform {name}: returned a {type(result).__name__} for key "
                             f"{key!r}; return a dict of state name -> value, or None to drop "
                             "the key")
        for state, value in result.items():
            if value is not None:
                rows.setdefault(state, []).append((key, value))
    targets = {d.name: d for d in source.target.states}
    out = {}
    for state, pairs in rows.items():
        _declared(source.target, state, source.transform)
        out[state] = _timer_table(pairs) if state == TIMERS else \
            _key_table(source, targets[state], pairs)
    return out


def _values(desc: StateDescriptor, table: pa.Table) -> Iterator[tuple[str, Any]]:
    """(key, Python value) of one state's table: a map's entries gathered per key, a
    list's elements as a list, the timers as a list of dicts per key."""
    keys = table.column("key").to_pylist()
    if desc.name == TIMERS:
        times = table.column("time").cast(pa.int64()).to_numpy() // 1000
        timers: dict[str, list[dict[str, Any]]] = {}
        for key, t, domain, tag in zip(keys, times.tolist(), table.column("domain").to_pylist(),
                                       table.column("tag").to_pylist(), strict=True):
            timers.setdefault(key, []).append({"time": t, "domain": domain, "tag": tag})
        yield from timers.items()
        return
    values = table.column("value").to_pylist()
    if isinstance(desc.codec, JsonCodec):
        values = [[json.loads(e) for e in v] if desc.kind == "list" else json.loads(v)
                  for v in values]
    if desc.kind == "map":
        maps: dict[str, dict[str, Any]] = {}
        for key, user_key, value in zip(keys, table.column("user_key").to_pylist(), values,
                                        strict=True):
            maps.setdefault(key, {})[user_key] = value
        yield from maps.items()
        return
    yield from zip(keys, values, strict=True)


def _key_table(source: SourceRead, desc: StateDescriptor,
               pairs: Sequence[tuple[str, Any]]) -> pa.Table:
    """The rows of one state written per key, as its bootstrap table."""
    keys: list[str] = []
    user_keys: list[str] = []
    values: list[Any] = []
    for key, value in pairs:
        if desc.kind == "map":
            if not isinstance(value, Mapping):
                raise _bad(source, desc, key, value, "a dict (user key -> value)")
            for user_key, v in value.items():
                keys.append(key)
                user_keys.append(user_key)
                values.append(v)
        elif desc.kind == "list" and not isinstance(value, list | tuple):
            raise _bad(source, desc, key, value, "a list")
        else:
            keys.append(key)
            values.append(list(value) if desc.kind == "list" else value)
    columns: dict[str, pa.Array] = {"key": pa.array(keys, pa.string())}
    if desc.kind == "map":
        columns["user_key"] = pa.array(user_keys, pa.string())
    vtype, meta = _written_type(desc)
    if meta is not None:  # JSON values as their text
        values = [json_texts(v) for v in values] if desc.kind == "list" else json_texts(values)
    try:
        columns["value"] = pa.array(values, pa.list_(vtype) if desc.kind == "list" else vtype)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"transform {source.transform.name}: values of state {desc.name!r} "
                         f"do not fit its codec ({desc.codec.to_json()['type']}): "
                         f"{exc}") from None
    fields = [pa.field(n, a.type, metadata=meta if n == "value" else None)
              for n, a in columns.items()]
    if desc.ttl is not None:
        clock = _ttl_clock(source, desc) if keys else 0
        columns["expires_at"] = pa.array(np.full(len(keys), clock + desc.ttl.duration_ms,
                                                 np.int64))
        fields.append(pa.field("expires_at", pa.int64()))
    return pa.Table.from_arrays(list(columns.values()), schema=pa.schema(fields))


def empty_table(source: SourceRead, desc: StateDescriptor) -> pa.Table:
    """A bootstrap table of ``desc`` without rows."""
    return _key_table(source, desc, [])


def _written_type(desc: StateDescriptor) -> tuple[pa.DataType, dict[bytes, bytes] | None]:
    """The Arrow type per-key values are written as (JSON: text tagged `JSON_TEXT`)."""
    if isinstance(desc.codec, JsonCodec):
        return pa.string(), JSON_TEXT
    if isinstance(desc.codec, RecordCodec | StrCodec | BytesCodec):
        return value_type(desc.codec), None
    raise UsageError(f"state {desc.name!r}: codec {desc.codec.to_json()['type']} cannot be "
                     "written per key; write it per batch")


def json_texts(values: Sequence[Any]) -> list[str]:
    """Values as compact JSON text."""
    return list(map(compact_json, values))


def _ttl_clock(source: SourceRead, desc: StateDescriptor) -> int:
    """The time a per-key write of ``desc`` counts its TTL from (module doc)."""
    assert desc.ttl is not None
    clock = source.clocks.get(desc.ttl.time)
    if clock is not None:
        return clock
    if desc.ttl.time == "processing":
        return int(time.time() * 1000)
    raise UsageError(f"state {desc.name!r} has an event-time TTL, and checkpoint "
                     f"{source.checkpoint_id} has no watermark to count it from; write it "
                     "per batch with an expires_at column")


def _bad(source: SourceRead, desc: StateDescriptor, key: str, value: Any,
         wanted: str) -> UsageError:
    return UsageError(f"transform {source.transform.name}: state {desc.name!r} ({desc.kind}) "
                      f"of key {key!r} is a {type(value).__name__}; give {wanted}")


def _timer_table(pairs: Sequence[tuple[str, Any]]) -> pa.Table:
    """Timers written per key (each a dict with ``time``, optional ``domain``, ``tag``)."""
    keys, times, domains, tags = [], [], [], []
    for key, timers in pairs:
        if not isinstance(timers, list | tuple) or \
                not all(isinstance(t, Mapping) and "time" in t for t in timers):
            raise UsageError(f"transform: timers of key {key!r} are not a list of dicts "
                             "with a 'time' (and optional 'domain', 'tag')")
        for t in timers:
            keys.append(key)
            times.append(int(t["time"]))
            domains.append(t.get("domain", "event"))
            tags.append(t.get("tag", ""))
    return pa.table({"key": pa.array(keys, pa.string()), "time": pa.array(times, pa.int64()),
                     "domain": pa.array(domains, pa.string()),
                     "tag": pa.array(tags, pa.string())})

