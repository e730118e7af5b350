"""Tables as state entries: the table contract of a bootstrap (docs/state-as-data.md).

One table per state, and ``_timers`` for timers. `plan_table` checks a table's schema
against the job's declaration of that state before anything is read or written (a
one-line `UsageError` naming the state and the column); `encode_batch` turns rows into
the RocksDB entries the state kinds themselves store (`statebackend.state.kinds`,
``.ttl``, ``.timers``): the same key-group prefix, codec bytes, list framing, expiry
prefix, TTL index and timer keys, built over whole Arrow columns (JSON values: one
`JsonCodec.encode` per value). A null key or value, or a value its record field cannot
hold, is refused in one line naming the state, the column and the row.

Columns (the key column is ``key``, or the job's key column when the table has none;
strings, or integers as their decimal text)::

    value, reducing,   ``value``; with a record codec its fields as columns, or a
    aggregating        struct column ``value`` (aggregating: the accumulator); a json
                       state's ``value`` of strings tagged `JSON_TEXT` (what
                       `read_state` gives), or ``value_json``, holds JSON text
    map                ``user_key`` (string) and the value as above
    list               ``value``: one element per row (a key's elements in row order),
                       or a list column: a key's elements in one row
    with a TTL         ``expires_at``: the entry's expiry, epoch ms or a timestamp (a
                       list column's elements: one per row, or a list of expiries
                       aligned with ``value``, as `read_state` gives them)
    _timers            ``time`` (epoch ms or a timestamp), optional ``domain``
                       (``event``, the default, or ``processing``) and ``tag``

An `EntryChunk` holds one column family's entries (keys, values, key groups and the
row each came from). The writer (`statebackend.job.bootstrap_write`) merges a family's
entries by `merge_rule`: keys of value-like and map states are unique (a duplicate is
refused), a list key's entries concatenate in row order, TTL index and timer entries
collapse (a timer is unique by key, time, domain and tag).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.state.codecs import (
    TIME_DOMAINS,
    BytesCodec,
    Codec,
    JsonCodec,
    RecordCodec,
    StrCodec,
)
from statebackend.state.families import TIMER_KEYS, TIMERS, TTL_INDEX
from statebackend.state.keygroups_bulk import key_groups
from statebackend.state.state_table import JSON_TEXT
from statebackend.state.ttl import StateTtl, state_tag

KEY, VALUE, USER_KEY, EXPIRES_AT = "key", "value", "user_key", "expires_at"
VALUE_JSON = "value_json"
TIME, DOMAIN, TAG = "time", "domain", "tag"
TIMER_KIND = "timers"
UNIQUE, APPEND, COLLAPSE = "unique", "append", "collapse"
_FIELD_ARROW = {"int32": pa.int32(), "int64": pa.int64(), "float32": pa.float32(),
                "float64": pa.float64(), "bool": pa.bool_()}
_BINARY = pa.binary()
SPARK_ROW_BITS = 33  # monotonically_increasing_id: partition << 33 | row in the partition
_FORMAT = {JsonCodec: b"\x01", BytesCodec: b"\x03", StrCodec: b"\x04"}


@dataclass(frozen=True)
class TablePlan:
    """How one table becomes one state's entries (checked against the job by `plan_table`).

    ``value``: the value column (None: a record's fields are columns of their own, or
    timers); ``lists``: a list state's table holds a key's whole list per row;
    ``json_text``: the values are JSON text; ``element_expiry``: ``expires_at`` holds a
    list of expiries per row, one per element.
    """

    state: str
    kind: str  # a state kind, or "timers"
    key: str
    codec: Codec | None = None
    value: str | None = None
    lists: bool = False
    ttl: StateTtl | None = None
    columns: tuple[str, ...] = ()  # what is read of the table
    json_text: bool = False
    element_expiry: bool = False


@dataclass(frozen=True)
class EntryChunk:
    """Entries of one column family: RocksDB keys and values (binary), each key's key
    group, and the table row each entry came from (list elements keep that order)."""

    family: str
    keys: pa.Array
    values: pa.Array
    key_groups: np.ndarray
    rows: np.ndarray

    def take(self, indices: np.ndarray) -> EntryChunk:
        picked = pa.array(indices)
        return EntryChunk(self.family, self.keys.take(picked), self.values.take(picked),
                          self.key_groups[indices], self.rows[indices])


def merge_rule(kind: str) -> str:
    """How entries of one key merge in a family of ``kind`` (module doc)."""
    if kind == "list":
        return APPEND
    return COLLAPSE if kind in ("timers", "timer_keys", "ttl_index") else UNIQUE


def _fail(state: str, text: str) -> UsageError:
    return UsageError(f"bootstrap table of state {state!r}: {text}")


# -- schema checks ---------------------------------------------------------------------

def plan_table(job: Job, state: str, schema: pa.Schema) -> TablePlan:
    """The plan of ``state``'s table of ``schema``; UsageError (one line) when the job
    declares no such state or a column is missing or of the wrong type."""
    if state == TIMERS:
        return _timers_plan(job, schema)
    declared = [d.name for d in job.states]
    if state not in declared:
        raise UsageError(f"bootstrap table {state!r}: job {job.name!r} declares no state "
                         f"{state!r}; declared: {declared} (timers: {TIMERS!r})")
    desc = job.state(state)
    key = _key_column(job, state, schema)
    columns = [key]
    if desc.kind == "map":
        _require(state, schema, USER_KEY, _is_key_type, "a string")
        columns.append(USER_KEY)
    value, lists = _value_columns(state, desc.kind, desc.codec, schema, columns)
    element_expiry = False
    if desc.ttl is not None:
        element_expiry = lists and EXPIRES_AT in schema.names and \
            _is_list(schema.field(EXPIRES_AT).type)
        _require(state, schema, EXPIRES_AT,
                 (lambda t: _is_time_type(t.value_type)) if element_expiry else _is_time_type,
                 "epoch ms or a timestamp" + (" per element" if element_expiry else ""))
        columns.append(EXPIRES_AT)
    json_text = value is not None and isinstance(desc.codec, JsonCodec) and (
        value == VALUE_JSON or _tagged_json(schema.field(value)))
    return TablePlan(state, desc.kind, key, desc.codec, value, lists, desc.ttl,
                     tuple(columns), json_text, element_expiry)


def _tagged_json(field: pa.Field) -> bool:
    """A string field tagged as holding JSON text (`JSON_TEXT`; its elements for a list)."""
    t = field.type.value_type if _is_list(field.type) else field.type
    return _is_text(t) and all((field.metadata or {}).get(k) == v
                               for k, v in JSON_TEXT.items())


def _timers_plan(job: Job, schema: pa.Schema) -> TablePlan:
    if job.on_timer is None:
        raise UsageError(f"bootstrap table {TIMERS!r}: job {job.name!r} has no timer handler "
                         "(on_timer), so its timers would never fire")
    key = _key_column(job, TIMERS, schema)
    _require(TIMERS, schema, TIME, _is_time_type, "epoch ms or a timestamp")
    columns = [key, TIME]
    for name in (DOMAIN, TAG):
        if name in schema.names:
            _require(TIMERS, schema, name, _is_key_type, "a string")
            columns.append(name)
    return TablePlan(TIMERS, TIMER_KIND, key, columns=tuple(columns))


def _key_column(job: Job, state: str, schema: pa.Schema) -> str:
    key = KEY if KEY in schema.names or job.key not in schema.names else job.key
    _require(state, schema, key, _is_key_type, "a string or integer key")
    return key


def _value_columns(state: str, kind: str, codec: Codec, schema: pa.Schema,
                   columns: list[str]) -> tuple[str | None, bool]:
    """(value column or None, lists) of a state's table; appends what it reads."""
    names = schema.names
    column = VALUE_JSON if VALUE not in names and VALUE_JSON in names and \
        isinstance(codec, JsonCodec) else VALUE
    if column in names:
        t = schema.field(column).type
        lists = kind == "list" and _is_list(t)
        if lists:
            t = t.value_type
        if column == VALUE_JSON and not _is_text(t):
            raise _fail(state, f"column {VALUE_JSON!r} is {t}, expected a string (JSON text)")
        _check_value_type(state, column, codec, t, whole=not lists)
        columns.append(column)
        return column, lists
    if isinstance(codec, RecordCodec):
        for name, ftype in codec.fields:
            _require(state, schema, name, _field_check(ftype), _field_wanted(ftype))
            columns.append(name)
        return None, False
    raise _fail(state, f"the table has no column {VALUE!r} (columns: {names})")


def _check_value_type(state: str, column: str, codec: Codec, t: pa.DataType,
                      whole: bool) -> None:
    where = f"column {column!r}" + ("" if whole else " (its elements)")
    if isinstance(codec, RecordCodec):
        if not pa.types.is_struct(t):
            raise _fail(state, f"{where} is {t}, expected a struct of the record fields "
                               f"{list(codec.names)} (or the fields as columns)")
        have = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        for name, ftype in codec.fields:
            if name not in have:
                raise _fail(state, f"{where} has no field {name!r} (fields: {list(have)})")
            if not _field_check(ftype)(have[name]):
                raise _fail(state, f"field {name!r} of {where} is {have[name]}, expected "
                                   f"{_field_wanted(ftype)}")
    elif isinstance(codec, StrCodec) and not _is_text(t):
        raise _fail(state, f"{where} is {t}, expected a string (str codec)")
    elif isinstance(codec, BytesCodec) and not (_is_text(t) or _is_binary(t)):
        raise _fail(state, f"{where} is {t}, expected binary (bytes codec)")
    elif isinstance(codec, JsonCodec) and not _json_type(t):
        raise _fail(state, f"{where} is {t}, which JSON cannot hold (cast it to a number, "
                           "a string, a list or a struct)")


def _require(state: str, schema: pa.Schema, column: str,
             check: Callable[[pa.DataType], bool], wanted: str) -> None:
    if column not in schema.names:
        raise _fail(state, f"the table has no column {column!r} (columns: {schema.names})")
    t = schema.field(column).type
    if not check(t):
        raise _fail(state, f"column {column!r} is {t}, expected {wanted}")


def _field_check(ftype: str) -> Callable[[pa.DataType], bool]:
    if ftype in ("int32", "int64"):
        return pa.types.is_integer
    if ftype == "bool":
        return pa.types.is_boolean
    return lambda t: pa.types.is_floating(t) or pa.types.is_integer(t)


def _field_wanted(ftype: str) -> str:
    what = {"int32": "an integer", "int64": "an integer", "bool": "a boolean"}
    return f"{what.get(ftype, 'a number')} (record field of type {ftype})"


def _plain(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_text(t: pa.DataType) -> bool:
    t = _plain(t)
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _is_key_type(t: pa.DataType) -> bool:
    return _is_text(t) or pa.types.is_integer(_plain(t))


def _is_time_type(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_timestamp(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _json_type(t: pa.DataType) -> bool:
    t = _plain(t)
    if pa.types.is_null(t) or pa.types.is_boolean(t) or pa.types.is_integer(t) \
            or pa.types.is_floating(t) or _is_text(t):
        return True
    if _is_list(t) or pa.types.is_fixed_size_list(t):
        return _json_type(t.value_type)
    if pa.types.is_struct(t):
        return all(_json_type(t.field(i).type) for i in range(t.num_fields))
    return False


# -- encoding --------------------------------------------------------------------------

def encode_batch(plan: TablePlan, table: pa.Table, max_parallelism: int,
                 rows: np.ndarray, key_hash: str) -> list[EntryChunk]:
    """The entries of ``table``'s rows (``rows``: each row's number in the whole table,
    named in errors and kept as the order of list elements), keys placed in key groups
    by ``key_hash`` (the lineage's)."""
    if not table.num_rows:
        return []
    key_bytes = _keys(plan, table, plan.key, rows)
    kgs = key_groups(key_bytes, max_parallelism, key_hash)
    prefix = pa.array(kgs.astype(">u2").view("S2"), pa.binary(2)).cast(_BINARY)
    if plan.kind == TIMER_KIND:
        return _timer_entries(plan, table, key_bytes, (kgs, prefix), rows)
    body = key_bytes
    if plan.kind == "map":
        body = _join(_u32_lengths(key_bytes), key_bytes, _keys(plan, table, USER_KEY, rows))
    expiry = _millis(plan, table, EXPIRES_AT, rows) \
        if plan.ttl is not None and not plan.element_expiry else None
    indexed: tuple[np.ndarray, np.ndarray] | None = None  # (entry, expiry) per element
    if plan.lists:
        values, keep, indexed = _list_values(plan, table, expiry, rows)
        if not keep.all():  # an empty list holds no entry
            mask = pa.array(keep)
            body, prefix, values = body.filter(mask), prefix.filter(mask), values.filter(mask)
            renumber = np.cumsum(keep) - 1
            kgs, rows = kgs[keep], rows[keep]
            expiry = expiry[keep] if expiry is not None else None
            indexed = (renumber[indexed[0]], indexed[1]) if indexed is not None else None
    else:
        values = _codec_bytes(plan, _value_source(plan, table), rows)
        if expiry is not None:
            values = _join(_time_bytes(expiry), values)
        if plan.kind == "list":
            values = _framed(values)
    out = [EntryChunk(plan.state, _join(prefix, body), values, kgs, rows)]
    if indexed is not None:  # expiries per element: an index entry each, on its entry
        owner, expiry = indexed
        picked = pa.array(owner)
        prefix, body, kgs, rows = prefix.take(picked), body.take(picked), kgs[owner], rows[owner]
    if plan.ttl is not None and expiry is not None:
        index = _join(prefix, pa.scalar(TIME_DOMAINS[plan.ttl.time], _BINARY),
                      _time_bytes(expiry), pa.scalar(state_tag(plan.state), _BINARY), body)
        out.append(EntryChunk(TTL_INDEX, index, _empty_values(len(index)), kgs, rows))
    return out


def _keys(plan: TablePlan, table: pa.Table, column: str, rows: np.ndarray) -> pa.Array:
    """A key column's UTF-8 bytes (integers as their decimal text); refuses a null."""
    col = _column(plan, table, column, rows)
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    return col.cast(pa.string()).view(_BINARY)


def _column(plan: TablePlan, table: pa.Table, column: str, rows: np.ndarray,
            nulls: bool = False) -> pa.Array:
    col = table.column(column)
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count and not nulls:
        _null_error(plan, column, arr, rows)
    return arr


def row_name(row: int | np.integer) -> str:
    """A row as errors name it: its number, or for a Spark DataFrame (row numbers of
    ``monotonically_increasing_id``: the partition in the upper bits) its partition's."""
    r = int(row)
    if r >> SPARK_ROW_BITS:
        return f"row {r & ((1 << SPARK_ROW_BITS) - 1)} of partition {r >> SPARK_ROW_BITS}"
    return f"row {r}"


def _null_error(plan: TablePlan, column: str, arr: pa.Array, rows: np.ndarray) -> None:
    first = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
    raise _fail(plan.state, f"column {column!r} holds a null in {row_name(rows[first])}; "
                            "every row needs a value there")


def _value_source(plan: TablePlan, table: pa.Table) -> pa.Array | pa.Table:
    """The value column, or (a record's fields as columns) the table itself."""
    if plan.value is None:
        return table
    col = table.column(plan.value)
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _codec_bytes(plan: TablePlan, source: pa.Array | pa.Table, rows: np.ndarray
                 ) -> pa.Array:
    """The codec's bytes of every value (``source``: values, or a record's columns)."""
    codec = plan.codec
    if isinstance(codec, RecordCodec):
        return _record_bytes(plan, codec, source, rows)
    if not isinstance(source, pa.Array):
        raise _fail(plan.state, f"its table needs a {VALUE!r} column")
    if source.null_count:
        _null_error(plan, plan.value or VALUE, source, rows)
    if isinstance(codec, JsonCodec):
        encode = codec.encode
        values = source.to_pylist()
        if plan.json_text:
            values = _parsed_json(plan, values, rows)
        return pa.array([encode(v) for v in values], _BINARY)
    if pa.types.is_dictionary(source.type):
        source = source.cast(source.type.value_type)
    data = source.cast(pa.string()).view(_BINARY) if _is_text(source.type) \
        else source.cast(_BINARY)
    return _join(pa.scalar(_FORMAT[type(codec)], _BINARY), data)


def _parsed_json(plan: TablePlan, texts: list[str], rows: np.ndarray) -> list[object]:
    out = []
    for i, text in enumerate(texts):
        try:
            out.append(json.loads(text))
        except ValueError as exc:
            raise _fail(plan.state, f"column {plan.value!r} holds text that is not JSON in "
                                    f"{row_name(rows[i])}: {exc}") from None
    return out


def _record_bytes(plan: TablePlan, codec: RecordCodec, source: pa.Array | pa.Table,
                  rows: np.ndarray) -> pa.Array:
    """Fixed-width records of the fields (struct fields or columns), packed as the codec
    packs them; a value a field cannot hold is refused."""
    n = len(source) if isinstance(source, pa.Array) else source.num_rows
    if isinstance(source, pa.Array) and source.null_count:
        _null_error(plan, plan.value or VALUE, source, rows)
    packed = np.empty(n, dtype=codec.dtype)
    packed["_format"] = 2
    for name, ftype in codec.fields:
        if isinstance(source, pa.Array):
            col, column = source.field(name), f"{plan.value}.{name}"
            if col.null_count:
                _null_error(plan, column, col, rows)
        else:
            col, column = _column(plan, source, name, rows), name
        try:
            typed = col.cast(_FIELD_ARROW[ftype], safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise _fail(plan.state, f"column {column!r} holds a value the record field "
                                    f"({ftype}) cannot hold: {exc}") from None
        packed[name] = typed.to_numpy(zero_copy_only=False)
    # the packed records are the values' bytes as they are: no copy
    ends = np.arange(0, (n + 1) * codec.dtype.itemsize, codec.dtype.itemsize, dtype=np.int32)
    return pa.BinaryArray.from_buffers(_BINARY, n, [None, pa.py_buffer(ends),
                                                    pa.py_buffer(packed.view(np.uint8))])


def _list_values(plan: TablePlan, table: pa.Table, expiry: np.ndarray | None,
                 rows: np.ndarray
                 ) -> tuple[pa.Array, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """A list per row: (list bytes, rows that hold an element: an empty list stores no
    entry, and with expiries per element each element's (row, expiry) for the TTL index).
    With a row's expiry every element of the row gets it."""
    col = _column(plan, table, plan.value or VALUE, rows)
    offsets = col.offsets.to_numpy().astype(np.int64)
    offsets -= offsets[0]
    lengths = np.diff(offsets)
    elements = _codec_bytes(plan, col.flatten(), np.repeat(rows, lengths))
    indexed = None
    if plan.element_expiry:
        owner = np.repeat(np.arange(len(col)), lengths)
        times = _element_expiries(plan, table, lengths, rows)
        elements = _join(_time_bytes(times), elements)
        indexed = (owner, times)
    elif expiry is not None:
        elements = _join(_time_bytes(np.repeat(expiry, lengths)), elements)
    framed = _framed(elements)
    ends = np.frombuffer(framed.buffers()[1], np.int32, len(framed) + 1, framed.offset)
    data = framed.buffers()[2] or pa.py_buffer(b"")
    lists = pa.BinaryArray.from_buffers(
        _BINARY, len(col), [None, pa.py_buffer(ends[offsets].astype(np.int32).tobytes()),
                            data])
    return lists, lengths > 0, indexed


def _element_expiries(plan: TablePlan, table: pa.Table, lengths: np.ndarray,
                      rows: np.ndarray) -> np.ndarray:
    """A list column's expiries, one per element (``expires_at`` a list per row)."""
    col = _column(plan, table, EXPIRES_AT, rows)
    have = np.diff(col.offsets.to_numpy().astype(np.int64))
    if (have != lengths).any():
        i = int(np.flatnonzero(have != lengths)[0])
        raise _fail(plan.state, f"column {EXPIRES_AT!r} holds {have[i]} expiries in "
                                f"{row_name(rows[i])} for {lengths[i]} elements")
    flat = pa.table({EXPIRES_AT: col.flatten()})
    return _millis(plan, flat, EXPIRES_AT, np.repeat(rows, lengths))


def _millis(plan: TablePlan, table: pa.Table, column: str, rows: np.ndarray) -> np.ndarray:
    """A time column as int64 epoch ms (timestamps converted)."""
    col = _column(plan, table, column, rows)
    if pa.types.is_timestamp(col.type):  # to epoch ms; a finer unit is truncated
        col = col.cast(pa.timestamp("ms", col.type.tz), safe=False).cast(pa.int64())
    try:
        out: np.ndarray = col.cast(pa.int64(), safe=True).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid as exc:
        raise _fail(plan.state, f"column {column!r} holds a time that is not a 64-bit "
                                f"integer of epoch ms: {exc}") from None
    return out


def _time_bytes(millis: np.ndarray) -> pa.Array:
    """Each time as its 8 stored bytes (`codecs.encode_time`: big-endian, sign flipped)."""
    biased = millis.astype(np.int64).view(np.uint64) + np.uint64(1 << 63)
    return pa.array(biased.astype(">u8").view("S8"), pa.binary(8)).cast(_BINARY)


def _timer_entries(plan: TablePlan, table: pa.Table, key_bytes: pa.Array,
                   groups: tuple[np.ndarray, pa.Array], rows: np.ndarray) -> list[EntryChunk]:
    """Both timer families (`statebackend.state.timers` byte layouts)."""
    kgs, prefix = groups
    n = table.num_rows
    times = _time_bytes(_millis(plan, table, TIME, rows))
    domain = pa.array(_domain_codes(plan, table, rows).view("S1"), pa.binary(1)).cast(_BINARY)
    tags = _column(plan, table, TAG, rows, nulls=True).cast(pa.string()).fill_null("") \
        .view(_BINARY) if TAG in plan.columns else _empty_values(n)
    framed_key = _join(_u32_lengths(key_bytes), key_bytes)
    forward = _join(prefix, domain, times, framed_key, tags)
    reverse = _join(prefix, framed_key, domain, times, tags)
    empty = _empty_values(n)
    return [EntryChunk(TIMERS, forward, empty, kgs, rows),
            EntryChunk(TIMER_KEYS, reverse, empty, kgs, rows)]


def _domain_codes(plan: TablePlan, table: pa.Table, rows: np.ndarray) -> np.ndarray:
    """Each timer's domain byte (`codecs.TIME_DOMAINS`; no column: event)."""
    if DOMAIN not in plan.columns:
        return np.full(table.num_rows, TIME_DOMAINS["event"][0], dtype=np.uint8)
    names = list(TIME_DOMAINS)
    domains = _column(plan, table, DOMAIN, rows, nulls=True).cast(pa.string())
    found = pc.index_in(domains, value_set=pa.array(names))
    if found.null_count:
        i = int(np.flatnonzero(found.is_null().to_numpy(zero_copy_only=False))[0])
        raise _fail(TIMERS, f"column {DOMAIN!r} holds {domains[i].as_py()!r} in "
                            f"{row_name(rows[i])}; use one of {sorted(names)}")
    codes = np.frombuffer(b"".join(TIME_DOMAINS[d] for d in names), dtype=np.uint8)
    picked: np.ndarray = codes[found.to_numpy(zero_copy_only=False)]
    return picked


# -- byte helpers ----------------------------------------------------------------------

def _join(*parts: pa.Array | pa.Scalar) -> pa.Array:
    """Element-wise concatenation of binary arrays (and scalars)."""
    # the separator as a scalar made here: pa.scalar imports pandas (keep it off imports)
    return pc.binary_join_element_wise(*parts, pa.scalar(b"", _BINARY))


def _u32_lengths(values: pa.Array) -> pa.Array:
    """Each value's length as 4 bytes big-endian (the framing of map keys and lists)."""
    lengths = pc.binary_length(values).to_numpy(zero_copy_only=False).astype(">u4")
    return pa.array(lengths.view("S4"), pa.binary(4)).cast(_BINARY)


def _framed(values: pa.Array) -> pa.Array:
    """Each value as one list element: u32 length + bytes (`codecs.encode_list`)."""
    return _join(_u32_lengths(values), values)


def _empty_values(n: int) -> pa.Array:
    return pa.BinaryArray.from_buffers(
        _BINARY, n, [None, pa.py_buffer(np.zeros(n + 1, np.int32).tobytes()),
                     pa.py_buffer(b"")])
