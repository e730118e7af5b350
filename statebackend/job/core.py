"""The in-process processing core of one subtask (no Spark, no storage).

`SubtaskProcessor` takes a `Job`, an open `KeyedStateBackend` holding this
subtask's key groups, and Arrow batches of raw input rows; per batch it:

1. **validates** (`split_rows`): casts each input column to the schema (a value
   that does not parse becomes null; string values are trimmed first), applies
   the job's rules in order with NumPy masks (first failing rule wins), then
   quarantines rows whose key is still null as ``missing_<key>``. A reader may
   pass ``_reason`` (a reason it already decided, e.g. ``malformed``), which wins
   over every rule; other raw columns starting with ``_`` (e.g. ``_line``) are
   kept, as text, on rejected rows only;
2. **calls the logic** on the accepted rows: `Vectorized` once per batch, `PerKey`
   once per key of the run (`statebackend.job.context.PerKeyFeed`: a key's rows may
   span batches, so each batch's last key waits for the next batch; the rows must
   arrive sorted by key, as the engines deliver them, or the processor refuses them at
   `finish` rather than call a key twice; `process` takes rows in any order);
3. **collects** what the logic emitted per output.

`finish()` calls the held keys, fires the due timers, purges expired TTL entries and
returns a `ProcessResult`: one schema-checked table per output
(a missing column or a wrong type is a one-line `UsageError` naming the job,
the output and the column), the rejected rows (raw values as strings plus
``reason``), counts and per-phase timings. Routing, restore, snapshot, commit
and writing outputs are the run protocol's job (phase 2), not this module's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend import defaults
from statebackend.errors import UsageError
from statebackend.job.api import RAW, Job, Output, PerKey, Vectorized
from statebackend.job.context import BatchContext, PerKeyFeed, RunInfo, run_per_key_timers
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.timers import fire_due, next_timer_time
from statebackend.state.ttl import next_expiry, purge_expired

REASON_COLUMN = "_reason"
REASON = "reason"
PHASES = ("validating", "processing", "grouping", "prefetch", "write_back", "timers", "purge",
          "outputs")
LATE = "late"
TIMER_BATCH = 10_000  # due timers per call of a vectorized timer handler
# Purge compacts a TTL state (a rewrite of the whole family, so the next checkpoint
# uploads all of it) only once half of it expired in one run, e.g. keys going quiet;
# a steady share expiring each run is left to RocksDB's own compactions.
COMPACT_RATIO = 0.5
_INT_TEXT = r"^[+-]?[0-9]{1,19}$"
_FLOAT_TEXT = (r"^[+-]?(([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|"
               r"[iI][nN][fF]([iI][nN][iI][tT][yY])?|[nN][aA][nN])$")


@dataclass(frozen=True)
class ProcessResult:
    """What one subtask's processing produced (outputs not yet written anywhere)."""

    outputs: dict[str, pa.Table]
    rejected: pa.Table
    events: int  # accepted rows
    rejected_count: int
    reasons: dict[str, int]
    keys_touched: int  # distinct keys among accepted rows
    timings: dict[str, float] = field(default_factory=dict)
    timers_fired: int = 0
    ttl_purged: int = 0  # entries deleted + list elements dropped
    ttl_index_read: int = 0  # index entries purge read (0: purge changed nothing)
    counters: dict[str, int] = field(default_factory=dict)
    next_times: dict[str, int | None] = field(default_factory=dict)  # earliest timer/expiry


# -- validation -----------------------------------------------------------------------
def split_rows(job: Job, raw: pa.Table, watermark: int | None = None
               ) -> tuple[pa.Table, pa.Table, dict[str, int]]:
    """(accepted rows typed per the schema, rejected rows as text + reason, reason counts).

    With an event-time column: a row without event time is ``missing_<column>``, a row
    with ``event time <= watermark`` (the run's starting one) is ``late`` unless the
    job accepts late rows.
    """
    schema = job.input.schema
    n = raw.num_rows
    raw_cols = {f.name: _raw_column(raw, f.name, n) for f in schema}
    typed = pa.table({f.name: try_cast(raw_cols[f.name], _target(job, f)) for f in schema})
    raw_view = pa.table(raw_cols)
    names: list[str] = []
    code = np.full(n, -1, dtype=np.int32)
    bad = np.zeros(n, dtype=bool)

    def mark(reason: str, mask: np.ndarray) -> None:
        new = mask & ~bad
        if new.any():
            if reason not in names:
                names.append(reason)
            code[new] = names.index(reason)
            bad[:] |= new

    if REASON_COLUMN in raw.column_names:
        pre = raw[REASON_COLUMN]
        for reason in pc.unique(pre.drop_null()).to_pylist():
            mark(reason, _np_mask(pc.equal(pre, reason)))
    for rule in job.input.rules:
        mask = rule.check(raw_view if rule.on == RAW else typed)
        mark(rule.reason, _np_mask(mask, job, rule.reason, n))
    mark(f"missing_{job.key}", _np_mask(pc.is_null(typed[job.key])))
    et = job.input.event_time
    if et is not None:
        ts = event_times(typed, et)
        mark(f"missing_{et}", _np_mask(pc.is_null(ts)))
        if watermark is not None and not job.input.accept_late:
            mark(LATE, _np_mask(pc.less_equal(ts, pa.scalar(watermark, pa.int64()))))
    if not bad.any():
        return typed, _rejected_schema_table(job, raw), {}
    accepted = typed.filter(pa.array(~bad))
    rejected = _rejected(job, raw, raw_cols, bad, names, code)
    counts = np.bincount(code[bad], minlength=len(names))
    return accepted, rejected, {r: int(c) for r, c in zip(names, counts, strict=True) if c}


def event_times(table: pa.Table, column: str) -> pa.Array:
    """The event-time column as int64 epoch ms (a timestamp column is converted)."""
    col = table[column]
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_timestamp(col.type):
        col = pc.cast(col, pa.timestamp("ms", col.type.tz))
    return pc.cast(col, pa.int64())


def max_accepted_time(job: Job, raw: pa.Table, watermark: int | None) -> int | None:
    """Max event time of the rows `split_rows` accepts (None: none): the driver's fold."""
    accepted, _, _ = split_rows(job, raw, watermark)
    if not accepted.num_rows:
        return None
    return pc.max(event_times(accepted, event_time_column(job))).as_py()


def event_time_column(job: Job) -> str:
    """The input's event-time column; UsageError for a job without one (asked for its
    event times, e.g. a watermark)."""
    if job.input.event_time is None:
        raise UsageError(f"job {job.name!r} declares no input.event_time")
    return job.input.event_time


def _target(job: Job, f: pa.Field) -> pa.DataType:
    return pa.string() if f.name == job.key else f.type


def _raw_column(raw: pa.Table, name: str, n: int) -> pa.Array | pa.ChunkedArray:
    if name in raw.column_names:
        return raw[name]
    return pa.nulls(n, pa.string())


def _np_mask(mask: Any, job: Job | None = None, reason: str = "", n: int = -1) -> np.ndarray:
    if isinstance(mask, pa.ChunkedArray):
        mask = mask.combine_chunks()
    if not isinstance(mask, pa.Array) or not pa.types.is_boolean(mask.type) or (
            n >= 0 and len(mask) != n):
        where = f"job {job.name!r}: rule {reason!r}" if job else "a reason mask"
        raise UsageError(f"{where} must return a boolean Arrow array of one value per row "
                         f"({n}), got {_describe(mask)}")
    return pc.fill_null(mask, False).to_numpy(zero_copy_only=False)


def _describe(obj: Any) -> str:
    if isinstance(obj, pa.Array):
        return f"{obj.type} array of {len(obj)}"
    return type(obj).__name__


def try_cast(col: pa.Array | pa.ChunkedArray, target: pa.DataType) -> pa.Array:
    """``col`` as ``target``; values that do not convert become null (a try-cast)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if col.type == target:
        return col
    is_text = pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
    if is_text and not (pa.types.is_string(target) or pa.types.is_large_string(target)):
        col = pc.utf8_trim_whitespace(col)
        pattern = _INT_TEXT if pa.types.is_integer(target) else \
            _FLOAT_TEXT if pa.types.is_floating(target) else None
        if pattern is not None:
            # Null out what cannot parse first, so the cast itself never raises.
            ok = pc.match_substring_regex(col, pattern)
            col = pc.if_else(ok, col, pa.scalar(None, col.type))
            col = pc.replace_substring_regex(col, r"^\+", "")  # Arrow refuses "+7"
    try:
        return pc.cast(col, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return _cast_each(col, target)


def _cast_each(col: pa.Array, target: pa.DataType) -> pa.Array:
    # Rare path (e.g. 1.5 -> int64, a 19-digit string beyond int64): one value at a time.
    out = []
    for v in col:
        try:
            out.append(v.cast(target).as_py())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            out.append(None)
    return pa.array(out, target)


def _extra_raw_columns(job: Job, raw: pa.Table) -> list[str]:
    schema_names = set(job.input.schema.names)
    return [c for c in raw.column_names
            if c.startswith("_") and c != REASON_COLUMN and c not in schema_names]


def _rejected_schema(job: Job, raw: pa.Table) -> pa.Schema:
    names = [*job.input.schema.names, REASON, *_extra_raw_columns(job, raw)]
    return pa.schema([(n, pa.string()) for n in names])


def _rejected_schema_table(job: Job, raw: pa.Table) -> pa.Table:
    return _rejected_schema(job, raw).empty_table()


def _rejected(job: Job, raw: pa.Table, raw_cols: dict, bad: np.ndarray, names: list[str],
              code: np.ndarray) -> pa.Table:
    sel = pa.array(bad)
    cols = {name: as_text(col.filter(sel)) for name, col in raw_cols.items()}
    cols[REASON] = pa.array(names, pa.string()).take(pa.array(code[bad]))
    for extra in _extra_raw_columns(job, raw):
        cols[extra] = as_text(raw[extra].filter(sel))
    return pa.table(cols, schema=_rejected_schema(job, raw))


def as_text(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_string(col.type):
        return col
    try:
        return pc.cast(col, pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return pa.array([None if v is None else str(v) for v in col.to_pylist()], pa.string())


# -- outputs --------------------------------------------------------------------------
def conform_output(job: Job, output: Output, items: list) -> pa.Table:
    """Concatenate what the logic emitted to ``output`` as one table of its schema."""
    tables: list[pa.Table] = []
    rows: list[dict] = []
    for item in items:
        if isinstance(item, list) and (not item or isinstance(item[0], dict)):
            rows.extend(item)  # row dicts of many per-key calls: one conversion
            continue
        if rows:
            tables.append(_from_rows(job, output, rows))
            rows = []
        tables.append(_one(job, output, item))
    if rows:
        tables.append(_from_rows(job, output, rows))
    table = pa.concat_tables(tables) if tables else output.schema.empty_table()
    return _last_per(table, output.last_per) if output.last_per else table


def _out_error(job: Job, output: Output, what: str) -> UsageError:
    return UsageError(f"job {job.name!r}: output {output.name!r} {what}")


def _one(job: Job, output: Output, item: Any) -> pa.Table:
    if isinstance(item, pa.RecordBatch):
        item = pa.Table.from_batches([item])
    if isinstance(item, pa.Table):
        return _check_table(job, output, item)
    if isinstance(item, Mapping):
        return _from_columns(job, output, item)
    raise _out_error(job, output, f"got a {type(item).__name__}; emit a pyarrow Table or "
                     "RecordBatch, a dict of columns or a list of row dicts")


def _check_table(job: Job, output: Output, table: pa.Table) -> pa.Table:
    schema = output.schema
    for f in schema:
        if f.name not in table.column_names:
            raise _out_error(job, output, f"has no column {f.name!r} (got {table.column_names})")
        got = table.schema.field(f.name).type
        if got != f.type:
            raise _out_error(job, output, f"column {f.name!r} has type {got}, expected "
                             f"{f.type}; cast it in the logic")
    extra = [c for c in table.column_names if c not in schema.names]
    if extra:
        raise _out_error(job, output, f"has undeclared column {extra[0]!r}; declared: "
                         f"{schema.names}")
    return table.select(schema.names).cast(schema)


def _from_columns(job: Job, output: Output, columns: Mapping[str, Any]) -> pa.Table:
    schema = output.schema
    extra = [c for c in columns if c not in schema.names]
    if extra:
        raise _out_error(job, output, f"has undeclared column {extra[0]!r}; declared: "
                         f"{schema.names}")
    arrays = []
    for f in schema:
        if f.name not in columns:
            raise _out_error(job, output, f"has no column {f.name!r} (got {list(columns)})")
        col = columns[f.name]
        if isinstance(col, pa.Array | pa.ChunkedArray):
            if col.type != f.type:
                raise _out_error(job, output, f"column {f.name!r} has type {col.type}, "
                                 f"expected {f.type}; cast it in the logic")
            arrays.append(col)
            continue
        try:
            arrays.append(pa.array(col, f.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            cause = " ".join(str(exc).split())[:200]
            raise _out_error(job, output, f"column {f.name!r} does not convert to {f.type}: "
                             f"{cause}") from exc
    try:
        return pa.Table.from_arrays(arrays, schema=schema)
    except pa.ArrowInvalid as exc:
        raise _out_error(job, output, f"has columns of different lengths: {exc}") from exc


def _from_rows(job: Job, output: Output, rows: list[dict]) -> pa.Table:
    names = output.schema.names
    extra = [c for c in rows[0] if c not in names]
    if extra:
        raise _out_error(job, output, f"has undeclared column {extra[0]!r}; declared: {names}")
    try:
        columns = {n: [r[n] for r in rows] for n in names}
    except KeyError as exc:
        raise _out_error(job, output, f"has no column {exc.args[0]!r} in an emitted row") \
            from exc
    return _from_columns(job, output, columns)


def _last_per(table: pa.Table, column: str) -> pa.Table:
    """Only the last row per value of ``column``, in the order of those last rows."""
    n = table.num_rows
    if n < 2:
        return table
    codes = pc.dictionary_encode(table[column], null_encoding="encode").combine_chunks()
    idx = codes.indices.to_numpy(zero_copy_only=False)
    _, first_in_reversed = np.unique(idx[::-1], return_index=True)
    keep = np.sort(n - 1 - first_in_reversed)
    return table if len(keep) == n else table.take(pa.array(keep))


# -- the processor --------------------------------------------------------------------
class SubtaskProcessor:
    """Validates and processes the batches of one subtask against an open backend."""

    def __init__(self, job: Job, backend, options: Mapping[str, Any] | None = None,
                 **run: Any) -> None:
        """``run``: the fields of `RunInfo` (``run_id``, ``watermark``, ``processing_time``
        ...); a name that is not one is a TypeError."""
        info = RunInfo(**run)
        missing = [d.name for d in job.descriptors if d.name not in backend.descriptors]
        if missing:
            raise UsageError(f"job {job.name!r}: the backend does not declare state "
                             f"{missing[0]!r}; open it with job.descriptors")
        self.job = job
        self.ctx = BatchContext(job, backend, job.resolve_options(options), info)
        # TTL reads and writes during the logic use the clocks at the start of the run.
        backend.set_time(event_time=info.watermark, processing_time=info.processing_time)
        self.backend = backend
        self.timers_fired = 0
        self.ttl_purged = 0
        self.ttl_index_read = 0
        self._ended = False
        self.timings = dict.fromkeys(PHASES, 0.0)
        self.events = 0
        self.reasons: dict[str, int] = {}
        self._keys: list[pa.Array] = []  # distinct keys per batch (counted at the end)
        self._rejected: list[pa.Table] = []
        self._emitted: dict[str, list] = {o.name: [] for o in job.outputs}
        self._rejected_empty: pa.Table | None = None
        logic = job.logic
        self._per_key = PerKeyFeed(logic.fn, self.ctx, self.timings) \
            if isinstance(logic, PerKey) else None

    def any_key_order(self) -> None:
        """Take the rows in any order (in process): the per-key form then holds every
        accepted row until `finish` and groups them there (one call per key still)."""
        if self._per_key is not None:
            self._per_key.any_order = True

    def process(self, batch: pa.RecordBatch | pa.Table) -> None:
        raw = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
        started = time.perf_counter()
        accepted, rejected, reasons = split_rows(self.job, raw, self.ctx.watermark)
        if self._rejected_empty is None:
            self._rejected_empty = rejected.schema.empty_table()
        if rejected.num_rows:
            self._rejected.append(rejected)
            for r, c in reasons.items():
                self.reasons[r] = self.reasons.get(r, 0) + c
        self.timings["validating"] += time.perf_counter() - started
        if not accepted.num_rows:
            return
        started = time.perf_counter()
        self.events += accepted.num_rows
        self._keys.append(pc.unique(accepted[self.job.key]))
        if self._per_key is not None:
            self._per_key.add(accepted)
        else:
            self.job.logic.fn(accepted, self.ctx)
        self._collect()
        self.timings["processing"] += time.perf_counter() - started

    def _collect(self) -> None:
        self.ctx.keys.clear()
        for name, items in self.ctx.take_emitted().items():
            self._emitted[name].extend(items)

    def _end_rows(self) -> None:
        """Call the per-key logic for the keys still held; check one call per key."""
        if self._per_key is None:
            return
        started = time.perf_counter()
        self._per_key.flush()
        self._collect()
        self.timings["processing"] += time.perf_counter() - started
        keys = self._distinct_keys()
        if self._per_key.calls > keys:
            raise UsageError(
                f"job {self.job.name!r}: the per-key logic ran {self._per_key.calls} times "
                f"for {keys} keys: a subtask's rows must arrive sorted by key "
                "(statebackend.job.task.row_order); in process use statebackend.job.process, "
                "which takes rows in any order")

    def end_of_run(self) -> None:
        """Fire the due timers (event: up to the new watermark, processing: up to the
        logical time; time order), then purge expired TTL entries (once per run)."""
        if self._ended:
            return
        self._ended = True
        self._end_rows()
        ctx, be = self.ctx, self.backend
        be.set_time(event_time=ctx.new_watermark, processing_time=ctx.processing_time)
        started = time.perf_counter()
        handler = self.job.on_timer
        if handler is not None:
            for domain, up_to in (("event", ctx.new_watermark),
                                  ("processing", ctx.processing_time)):
                if up_to is not None:
                    self._fire(handler, domain, up_to)
        self.timings["timers"] += time.perf_counter() - started
        started = time.perf_counter()
        for domain, now in (("event", ctx.new_watermark), ("processing", ctx.processing_time)):
            if now is not None:
                stats = purge_expired(be, domain, now, compact_ratio=COMPACT_RATIO)
                self.ttl_purged += stats.entries_deleted + stats.elements_dropped
                self.ttl_index_read += stats.index_entries_read
        self.timings["purge"] += time.perf_counter() - started

    def _fire(self, handler: Vectorized | PerKey, domain: str, up_to: int) -> None:
        """Hand the due timers to the handler in time-ordered chunks until none is due.

        A pass that ran dry is closed before the handler sees its last chunk, so timers
        the handler registers at or below ``up_to`` then fire in a new pass; in a pass
        still running they join it (`statebackend.state.timers.fire_due`).
        """
        while True:
            firing = fire_due(self.backend, domain, up_to)
            fired = 0
            try:
                while True:
                    chunk = firing.take_table(TIMER_BATCH)
                    if not chunk.num_rows:
                        break
                    fired += chunk.num_rows
                    self._handle_timers(handler, chunk)
                    if chunk.num_rows < TIMER_BATCH:
                        break  # the pass ran dry (and closed itself)
            finally:
                firing.close()
            if not fired:
                return

    def _handle_timers(self, handler: Vectorized | PerKey, table: pa.Table) -> None:
        self.timers_fired += table.num_rows
        if isinstance(handler, PerKey):
            run_per_key_timers(handler.fn, table, self.ctx, self.timings)
        else:
            handler.fn(table.drop_columns(["key_group"]), self.ctx)
        self._collect()

    def _distinct_keys(self) -> int:
        if len(self._keys) < 2:
            return len(self._keys[0]) if self._keys else 0
        return len(pc.unique(pa.chunked_array(self._keys)))

    def next_times(self) -> dict[str, int | None]:
        """Earliest timer and expiry per domain: when this subtask has work without rows."""
        out: dict[str, int | None] = {}
        for domain in ("event", "processing"):
            times = [t for t in (
                next_timer_time(self.backend, domain) if self.job.on_timer else None,
                next_expiry(self.backend, domain)) if t is not None]
            out[domain] = min(times) if times else None
        return out

    def finish(self) -> ProcessResult:
        self.end_of_run()
        started = time.perf_counter()
        outputs = {o.name: conform_output(self.job, o, self._emitted[o.name])
                   for o in self.job.outputs}
        self.timings["outputs"] += time.perf_counter() - started
        if self._rejected:
            rejected = pa.concat_tables(self._rejected, promote_options="default")
        else:
            rejected = self._rejected_empty if self._rejected_empty is not None else \
                _rejected_schema_table(self.job, pa.table({}))
        return ProcessResult(outputs, rejected, self.events, rejected.num_rows,
                             dict(sorted(self.reasons.items())), self._distinct_keys(),
                             dict(self.timings), self.timers_fired, self.ttl_purged,
                             self.ttl_index_read, dict(sorted(self.ctx.counters.items())),
                             self.next_times() if self.job.has_time else {})


def process(job: Job, backend, batches: Iterable[pa.RecordBatch | pa.Table],
            options: Mapping[str, Any] | None = None, **run: Any) -> ProcessResult:
    """Process every batch with a fresh `SubtaskProcessor` (see the module docstring), in
    process: the rows may come in any order; the per-key form still calls each key once,
    with its rows in their order in ``batches``. ``run``: the processor's keyword
    arguments (``run_id``, ``watermark``, ``new_watermark``, ``processing_time`` ...)."""
    proc = SubtaskProcessor(job, backend, options, **run)
    proc.any_key_order()
    for batch in batches:
        proc.process(batch)
    return proc.finish()


def open_state(job: Job, path: str,
               max_parallelism: int = defaults.MAX_PARALLELISM) -> KeyedStateBackend:
    """The state of ``job`` in the local folder ``path``, every key group in one instance,
    for `process` (in process: tests, notebooks). It opens `Job.descriptors`: the states
    and what the job needs beside them (timer families, the TTL index). Close it (or use
    ``with``) before opening the folder again."""
    return KeyedStateBackend(path, job.descriptors, max_parallelism,
                             KeyGroupRange(0, max_parallelism - 1))
