"""Test a job against its state: `JobTester`, in process (no Spark, no storage).

What Spark 4.2's ``TwsTester`` and Flink's ``KeyedOneInputStreamOperatorTestHarness``
do for a stateful function, for a `Job`: feed it rows with a manual watermark and
processing time, let due timers fire, read its state as Python values, and assert what
it emitted and what it rejected::

    with JobTester(job, options={"gap_minutes": 30}) as tester:
        first = tester.run(rows)               # one run: a list of row dicts, a table ...
        first.rows("sessions"), first.rejected # what it emitted, what it quarantined
        tester.run(watermark=3 * HOUR)         # a run without rows: what is due fires
        tester.state("sessions", "ann")        # one key's state, as the logic reads it
        tester.state_table("sessions")         # every key's (a pandas DataFrame)

A tester run is one scheduled run (``ckpt run``) of one subtask holding every key group,
processed by the code the engines run (`statebackend.job.core.SubtaskProcessor`):

1. **input**: every table given to `run` (Arrow tables or record batches, lists of row
   dicts, dicts of columns, pandas DataFrames), raw as a reader hands rows on: columns
   are cast to the input schema and the rules run, so a value that does not parse is
   rejected as in a real run (a column of mixed Python types is passed on as text);
2. **order**: the rows are sorted as the engines sort a subtask's rows (`row_order`:
   key, event time, the other columns; nulls first) and handed on in batches of
   ``batch_rows``. The vectorized form is called once per batch; the per-key form once
   per key per *tester run*, with all of that key's rows of the run: a key's rows given
   to two `run` calls are two calls, as in two scheduled runs;
3. **clocks**: the watermark at the start of the run decides which rows are late; the
   run ends with the watermark the engines compute (`advance`: the max event time of
   the accepted rows minus the allowed lateness) or with ``watermark=`` (not below that
   one: it stands for input the run did not see). ``processing_time=`` is the run's
   logical time, kept from the run before when not given. Neither clock goes back;
4. **end of the run**: event timers fire up to the new watermark and processing timers
   up to the processing time (time order), then expired TTL entries are purged, as at
   the end of every real run. So a run without rows that moves a clock fires what
   became due and expires what became stale.

Not done, since a real run's logic does not depend on them: routing to subtasks
(parallelism never changes a job's results), checkpoints, output files and
``--max-reject-fraction`` (assert ``rejected`` instead). The state lives in RocksDB in a
temporary folder that `close` removes (use ``with``). A run that raises may leave part
of its writes in the state, which a real run would discard: the tester then refuses
further runs (its state can still be read).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from statebackend.checkpoint.dump import split_body
from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.job.core import (
    ProcessResult,
    SubtaskProcessor,
    as_text,
    max_accepted_time,
    open_state,
)
from statebackend.job.task import BATCH_ROWS, nulls_first_order, row_order
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.codecs import TIME_BYTES, RecordCodec, decode_list, decode_time
from statebackend.state.keygroups import key_group_of_rocks_key
from statebackend.state.kinds import ListState, MapState, StateDescriptor, ValueState
from statebackend.state.timers import Timer, iter_timers, timers_of
from statebackend.state.watermark import advance

if TYPE_CHECKING:
    import pandas as pd

_GONE = object()  # an entry expired at the state's clock


@dataclass(frozen=True)
class TesterRun:
    """What one tester run did.

    ``watermark``: at its start (rows at or before it were late); ``new_watermark``:
    the one it ended with (event timers fired up to it); ``processing_time``: its
    logical time. ``outputs``: per output, the emitted rows as an Arrow table of the
    output's schema; ``rejected``: the quarantined rows (raw values as text plus
    ``reason``); ``reasons``: rejected rows per reason; ``counters``: the logic's
    ``count(...)`` totals; ``events``: accepted rows.
    """

    run_id: str
    watermark: int | None
    new_watermark: int | None
    processing_time: int
    outputs: Mapping[str, pa.Table]
    rejected: pa.Table
    reasons: Mapping[str, int]
    counters: Mapping[str, int]
    events: int
    timers_fired: int
    ttl_purged: int

    def rows(self, output: str | None = None) -> list[dict[str, Any]]:
        """The rows emitted to ``output`` (default: the job's only output), as dicts."""
        if output is None:
            if len(self.outputs) != 1:
                raise UsageError(f"{self.run_id}: the job has outputs {list(self.outputs)}; "
                                 "name one: rows(output)")
            output = next(iter(self.outputs))
        if output not in self.outputs:
            raise UsageError(f"{self.run_id}: the job declares no output {output!r}; "
                             f"declared: {list(self.outputs)}")
        return self.outputs[output].to_pylist()


class JobTester:
    """One job's state in a temporary folder, and runs against it (module docstring).

    ``options``: the job's options (defaults for the others; ``configure`` is applied
    as a run applies it); ``watermark``, ``processing_time``: the clocks before the first
    run (epoch ms); ``batch_rows``: rows per batch handed to the logic.
    """

    def __init__(self, job: Job, options: Mapping[str, Any] | None = None, *,
                 watermark: int | None = None, processing_time: int = 0,
                 batch_rows: int = BATCH_ROWS) -> None:
        self.options = job.resolve_options(options)
        self.job = job.configured(self.options)
        if watermark is not None:
            self._check_watermark_allowed()
        self.watermark = None if watermark is None else _time(watermark, "watermark")
        self.processing_time = _time(processing_time, "processing_time")
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
            raise UsageError(f"batch_rows {batch_rows!r} must be an integer >= 1")
        self.batch_rows = batch_rows
        self.runs = 0  # runs started
        self._failed: str | None = None
        self._folder = tempfile.mkdtemp(prefix=f"ckpt-tester-{self.job.name}-")
        try:
            self._backend: KeyedStateBackend | None = open_state(self.job, self._folder)
        except BaseException:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        self._backend.set_time(event_time=self.watermark, processing_time=self.processing_time)

    # -- runs ---------------------------------------------------------------------------
    def run(self, *inputs: Any, watermark: int | None = None,
            processing_time: int | None = None, run_id: str | None = None) -> TesterRun:
        """One run over the rows of ``inputs`` (none: a run that only moves the clocks);
        see the module docstring for the order, the clocks and what the end fires."""
        backend = self._open()
        if self._failed is not None:
            raise UsageError(f"{self._failed}, so the state may hold part of it; open a new "
                             "JobTester")
        raw = _concat([_as_table(data) for data in inputs])
        run_id = run_id or f"run-{self.runs + 1}"
        new_watermark = self._new_watermark(raw, watermark, run_id)
        now = self._processing_time(processing_time, run_id)
        self.runs += 1
        proc = SubtaskProcessor(self.job, backend, self.options, run_id=run_id,
                                checkpoint_id=self.runs, subtask=0, watermark=self.watermark,
                                new_watermark=new_watermark, processing_time=now)
        proc.any_key_order()  # sorted already; any order keeps one call per key regardless
        try:
            for batch in _sorted_batches(self.job, raw, self.batch_rows):
                proc.process(batch)
            result = proc.finish()
        except BaseException as exc:
            self._failed = f"run {run_id!r} raised {type(exc).__name__}"
            raise
        started = self.watermark
        self.watermark, self.processing_time = new_watermark, now
        return _tester_run(run_id, started, new_watermark, now, result)

    def _check_watermark_allowed(self) -> None:
        if self.job.input.event_time is None:
            raise UsageError(f"job {self.job.name!r} has no event-time column, so no "
                             "watermark: drop watermark= (or declare Input(event_time=...))")

    def _new_watermark(self, raw: pa.Table, given: int | None, run_id: str) -> int | None:
        """The watermark the run ends with: the engines' rule, or ``given`` (not below)."""
        if given is not None:
            self._check_watermark_allowed()
        if self.job.input.event_time is None:
            return None
        newest = max_accepted_time(self.job, raw, self.watermark) if raw.num_rows else None
        floor = advance(self.watermark, newest, self.job.input.lateness_ms)
        if given is None:
            return floor
        given = _time(given, "watermark")
        if floor is not None and given < floor:
            raise UsageError(f"run {run_id!r}: watermark={given} is below {floor}, where the "
                             "run ends anyway (the watermark never goes back, and the run's "
                             "rows move it to their max event time - allowed lateness)")
        return given

    def _processing_time(self, given: int | None, run_id: str) -> int:
        if given is None:
            return self.processing_time
        given = _time(given, "processing_time")
        if given < self.processing_time:
            raise UsageError(f"run {run_id!r}: processing_time={given} is before "
                             f"{self.processing_time}, the time of the run before; it never "
                             "goes back")
        return given

    # -- state ----------------------------------------------------------------------------
    def state(self, name: str, key: str | int, user_key: str | None = None) -> Any:
        """State ``name`` of ``key`` as the logic reads it (an expired entry is absent):
        a value state's value (None when absent), a reducing state's value, an
        aggregating state's result, a list state's list (``[]``), a map state's entries
        as a dict (``{}``) or, with ``user_key``, one entry (None)."""
        self.job.state(name)  # one-line error for an undeclared state
        st = self._open().state(name)
        k = _key(key)
        if isinstance(st, MapState):
            return st.get(k, user_key) if user_key is not None else dict(st.items(k))
        if user_key is not None:
            raise UsageError(f"state {name!r} is a {st.descriptor.kind} state; user_key= is "
                             "for map states")
        if isinstance(st, ValueState | ListState):
            return st.get(k)
        raise UsageError(f"state {name!r} has kind {st.descriptor.kind!r}, which the tester "
                         "cannot read")

    def set_state(self, name: str, key: str | int, value: Any,
                  timestamp: int | None = None) -> None:
        """Write ``key``'s state ``name`` directly, e.g. to seed the state a run starts
        from: a value (an aggregating state: its accumulator), a list, or a map state's
        entries as a dict (replacing the key's entries); None clears the key. A TTL
        state's entry expires its TTL after ``timestamp`` (default: the state's clock,
        the watermark or the processing time)."""
        desc = self.job.state(name)
        backend = self._open()
        if desc.ttl is not None and timestamp is None \
                and backend.current_time(desc.ttl.time) is None:
            raise UsageError(f"state {name!r} has a {desc.ttl.time}-time TTL and the tester "
                             "has no watermark yet: pass timestamp= or "
                             "JobTester(..., watermark=...)")
        st, k = backend.state(name), _key(key)
        if isinstance(st, MapState):
            old = st.keys(k)
            if old:
                st.remove_many([k] * len(old), old)
            if value:
                st.put_many([(k, uk, v) for uk, v in dict(value).items()], timestamp)
        elif value is None or (isinstance(st, ListState) and not value):
            st.delete(k)
        elif isinstance(st, ListState):
            st.update(k, list(value), timestamp)
        elif isinstance(st, ValueState):
            st.put(k, value, timestamp)

    def state_table(self, name: str) -> pd.DataFrame:
        """Every live entry of state ``name``, sorted by key (and user key): columns
        ``key``, ``user_key`` (map states), ``value`` or one column per record field,
        ``key_group``, and for a TTL state ``expires_at`` (epoch ms; a list state: one
        per element). Entries expired at the state's clock are left out, as reads leave
        them out."""
        import pandas as pd  # pandas only when a table is asked for: statebackend.job stays light

        desc = self.job.state(name)
        rows = list(_live_rows(self._open(), desc))
        sort = ["key", "user_key"] if desc.kind == "map" else ["key"]
        frame = pd.DataFrame(rows, columns=_columns(desc))
        return frame.sort_values(sort, kind="stable").reset_index(drop=True)

    def timers(self, key: str | int | None = None) -> list[Timer]:
        """The timers registered and not fired yet, of ``key`` or of every key, ordered by
        domain, time, key and tag (none when the job has no timer handler)."""
        if self.job.on_timer is None:
            return []
        backend = self._open()
        found = timers_of(backend, _key(key)) if key is not None else iter_timers(backend)
        return sorted(found, key=lambda t: (t.domain, t.time, t.key, t.tag))

    # -- lifetime -------------------------------------------------------------------------
    def _open(self) -> KeyedStateBackend:
        if self._backend is None:
            raise UsageError(f"the JobTester of job {self.job.name!r} is closed")
        return self._backend

    def close(self) -> None:
        """Close the state and remove its folder (again: nothing)."""
        backend, self._backend = self._backend, None
        try:
            if backend is not None:
                backend.close()
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> JobTester:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tester_run(run_id: str, watermark: int | None, new_watermark: int | None,
                processing_time: int, result: ProcessResult) -> TesterRun:
    return TesterRun(run_id, watermark, new_watermark, processing_time, dict(result.outputs),
                     result.rejected, dict(result.reasons), dict(result.counters),
                     result.events, result.timers_fired, result.ttl_purged)


def _time(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{what} {value!r} must be an integer of epoch ms")
    return value


def _key(key: Any) -> str:
    """A key as the state holds it: its text (an integer key column's ``5`` is ``"5"``)."""
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    raise UsageError(f"key {key!r} must be a string (or an integer, read as its digits)")


# -- input ----------------------------------------------------------------------------------
def _as_table(data: Any) -> pa.Table:
    """One input of a run as an Arrow table of raw columns."""
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        return data
    if type(data).__module__.startswith("pandas") and hasattr(data, "columns"):
        try:
            return pa.Table.from_pandas(data, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            return pa.table({str(c): _column(data[c].tolist()) for c in data.columns})
    if isinstance(data, Mapping):
        return pa.table({str(n): _column(list(v)) for n, v in data.items()})
    if isinstance(data, Sequence) and not isinstance(data, str | bytes) \
            and all(isinstance(r, Mapping) for r in data):
        names = list(dict.fromkeys(n for r in data for n in r))
        return pa.table({str(n): _column([r.get(n) for r in data]) for n in names})
    raise UsageError(f"a run's input must be an Arrow table or record batch, a list of row "
                     f"dicts, a dict of columns or a pandas DataFrame, got "
                     f"{type(data).__name__}")


def _column(values: list[Any]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        # Mixed types (e.g. a bad value among numbers, to test a rule): text, as a JSON
        # reader hands on a value that does not parse.
        return pa.array([None if v is None else str(v) for v in values], pa.string())


def _concat(tables: list[pa.Table]) -> pa.Table:
    """The inputs of a run as one table; a column typed differently in two inputs as text."""
    tables = [t for t in tables if t.num_columns]
    if len(tables) < 2:
        return tables[0] if tables else pa.table({})
    types: dict[str, set[pa.DataType]] = {}
    for t in tables:
        for f in t.schema:
            if not pa.types.is_null(f.type):
                types.setdefault(f.name, set()).add(f.type)
    mixed = [n for n, found in types.items() if len(found) > 1]
    for i, t in enumerate(tables):
        for n in mixed:
            if n in t.column_names:
                t = t.set_column(t.column_names.index(n), n, as_text(t[n]))
        tables[i] = t
    return pa.concat_tables(tables, promote_options="permissive")


def _sorted_batches(job: Job, raw: pa.Table, batch_rows: int) -> Iterator[pa.Table]:
    """The rows in the engines' order (`row_order`, nulls first), ``batch_rows`` at a time."""
    if not raw.num_rows:
        return
    names = tuple(n for n in row_order(job) if n in raw.column_names
                  and not pa.types.is_nested(raw.schema.field(n).type))
    if names:
        raw = raw.take(nulls_first_order(raw.select(list(names)), names))
    for start in range(0, raw.num_rows, batch_rows):
        yield raw.slice(start, batch_rows)


# -- state tables ---------------------------------------------------------------------------
def _columns(desc: StateDescriptor) -> list[str]:
    codec = desc.codec
    values = list(codec.names) if isinstance(codec, RecordCodec) and _record_columns(desc) \
        else ["value"]
    return ["key", *(["user_key"] if desc.kind == "map" else []), *values, "key_group",
            *(["expires_at"] if desc.ttl is not None else [])]


def _record_columns(desc: StateDescriptor) -> bool:
    return isinstance(desc.codec, RecordCodec) and desc.kind != "list"


def _live_rows(backend: KeyedStateBackend, desc: StateDescriptor) -> Iterator[dict[str, Any]]:
    """One row per live entry of ``desc``'s column family (`state_table`'s columns)."""
    now = backend.current_time(desc.ttl.time) if desc.ttl is not None else None
    for rk, stored in backend.iter_raw(desc.name):
        value, expires = _live_value(desc, stored, now)
        if value is _GONE:
            continue
        key, user_key = split_body(rk[2:], desc.kind)
        row: dict[str, Any] = {"key": key}
        if desc.kind == "map":
            row["user_key"] = user_key
        if _record_columns(desc):
            row.update(value)
        else:
            row["value"] = value
        row["key_group"] = key_group_of_rocks_key(rk)
        if desc.ttl is not None:
            row["expires_at"] = expires
        yield row


def _live_value(desc: StateDescriptor, stored: bytes, now: int | None) -> tuple[Any, Any]:
    """(decoded value or `_GONE` when expired at ``now``, its expiry or None): a TTL entry
    (a list state: each element) carries its expiry before the codec's bytes."""
    decode = desc.codec.decode
    if desc.kind == "list":
        elements = decode_list(stored)
        if desc.ttl is None:
            return [decode(e) for e in elements], None
        live = [e for e in elements if now is None or decode_time(e) > now]
        if not live:
            return _GONE, None
        return [decode(e[TIME_BYTES:]) for e in live], [decode_time(e) for e in live]
    expires = None
    if desc.ttl is not None:
        expires = decode_time(stored)
        if now is not None and expires <= now:
            return _GONE, None
        stored = stored[TIME_BYTES:]
    value = decode(stored)
    if desc.kind == "aggregating" and desc.aggregate_fn is not None:
        value = desc.aggregate_fn.get_result(value)
    return value, expires
