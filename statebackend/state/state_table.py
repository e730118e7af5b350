"""One state of an open backend as typed Arrow batches: the columns `read_state` returns.

Columns (`state_schema`), in this order:

- ``key`` (string);
- map state: ``user_key`` (string);
- list state read one row per element (``explode``): ``position`` (int32, the element's
  place among the list's live elements, from 0);
- the value: a record codec's fields as columns (``fields_as_columns``), else one
  ``value`` column: record -> struct of its fields, ``json`` -> string (the value as
  JSON text, keys sorted, compact), ``str`` -> string, ``bytes`` -> binary; a list
  state not exploded has one ``value`` column, an array of those;
- TTL states: ``expires_at`` (timestamp, UTC; for a list not exploded, an array
  aligned with ``value``: list elements expire one by one);
- ``key_group`` (int32), ``subtask`` (int32).

A JSON value's field carries the metadata `JSON_TEXT`: a bootstrap table (and a
transform's output) that keeps it hands the text back as the JSON it holds.
The timers (``_timers``, `TIMER_SCHEMA`): ``key``, ``time`` (timestamp, UTC),
``domain`` (``event`` or ``processing``), ``tag``, ``key_group``, ``subtask``.

Record field types map one to one: int32, int64, float32, float64, bool. Reducing
states show their stored value, aggregating states their accumulator (the result
function is code, not state), as ``ckpt dump`` does.

Expired entries are left out: an entry (a list element) is returned only while its
expiry is after ``now``, the clock of its TTL's time domain (the checkpoint's
watermark or processing time): what a job restoring the checkpoint would see, purged
or not. ``now`` None (the clock was never set): nothing has expired. A list whose
elements all expired is left out; an empty one is not.

Entries come in RocksDB key order, a span of whole key groups at a time (about
``batch_rows`` entries, from the subtask's recorded row count). Keys, key groups,
records, ``str``/``bytes`` values and expiries decode column-wise (NumPy over the
Arrow buffers, no Python step per entry); JSON values, map keys and list framing take
one Python step per entry. Bytes that do not decode raise SerializationError naming
the state (the message of `ckpt dump` for the same bytes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import SerializationError, UsageError
from statebackend.state.codecs import (
    BYTES_FORMAT,
    RECORD_FORMAT,
    STR_FORMAT,
    TIME_BYTES,
    BytesCodec,
    Codec,
    JsonCodec,
    RecordCodec,
    StrCodec,
    decode_list,
    deserialize_key,
    split_map_key,
)
from statebackend.state.families import TIMERS
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.kinds import STATE_KINDS, StateDescriptor
from statebackend.state.timers import fired_timers

# Stored keys or values: Python bytes (a backend's scan) or an Arrow binary array (read
# from a memory-backend key-group file without a Python object per entry).
RawColumn: TypeAlias = "Sequence[bytes] | pa.Array"

if TYPE_CHECKING:
    from statebackend.state.backend import KeyedStateBackend

TIMESTAMP = pa.timestamp("us", tz="UTC")
RESERVED_COLUMNS = ("key", "user_key", "position", "value", "expires_at", "key_group",
                    "subtask")
_FIELD_TYPES = {"int32": pa.int32(), "int64": pa.int64(), "float32": pa.float32(),
                "float64": pa.float64(), "bool": pa.bool_()}
_TIME_OFFSET = np.uint64(1 << 63)
_MAX_MS = np.int64((2**63 - 1) // 1000)  # the widest epoch ms a timestamp[us] holds
BATCH_ROWS = 65_536
JSON_TEXT = {b"ckpt.encoding": b"json-text"}  # a string field of values as JSON text
TIMER_SCHEMA = pa.schema([pa.field("key", pa.string()), pa.field("time", TIMESTAMP),
                          pa.field("domain", pa.string()), pa.field("tag", pa.string()),
                          pa.field("key_group", pa.int32()), pa.field("subtask", pa.int32())])


@dataclass(frozen=True)
class TableShape:
    """How a state becomes columns: ``explode`` a list state to one row per element;
    a record's fields as columns (``fields_as_columns``) or as one struct ``value``;
    ``batch_rows``: about how many entries one batch holds."""

    explode: bool = False
    fields_as_columns: bool = True
    batch_rows: int = BATCH_ROWS


def value_type(codec: Codec) -> pa.DataType:
    """The Arrow type of one decoded value of ``codec``."""
    if isinstance(codec, RecordCodec):
        return pa.struct([pa.field(n, _FIELD_TYPES[t]) for n, t in codec.fields])
    return pa.binary() if isinstance(codec, BytesCodec) else pa.string()


def _array_mode(desc: StateDescriptor, shape: TableShape) -> bool:
    return desc.kind == "list" and not shape.explode


def _spread(desc: StateDescriptor, shape: TableShape) -> bool:
    """Whether the record's fields become columns of their own."""
    return isinstance(desc.codec, RecordCodec) and shape.fields_as_columns \
        and not _array_mode(desc, shape)


def readable(descriptors: Iterable[StateDescriptor]) -> tuple[StateDescriptor, ...]:
    """The states a table can be read of: the job's own, and the timers (not the TTL
    index or the timers' reverse family)."""
    return tuple(d for d in descriptors if d.kind in STATE_KINDS or d.name == TIMERS)


def state_schema(desc: StateDescriptor, shape: TableShape = TableShape()) -> pa.Schema:
    """The columns of ``desc``'s table (module doc); UsageError for an internal state or a
    record field named like another column. The timers: `TIMER_SCHEMA`."""
    if desc.name == TIMERS:
        return TIMER_SCHEMA
    if desc.kind not in STATE_KINDS:
        raise UsageError(f"state {desc.name!r} is internal ({desc.kind}); read one of the "
                         "job's own states")
    fields = [pa.field("key", pa.string())]
    if desc.kind == "map":
        fields.append(pa.field("user_key", pa.string()))
    if desc.kind == "list" and shape.explode:
        fields.append(pa.field("position", pa.int32()))
    vtype = value_type(desc.codec)
    meta = JSON_TEXT if isinstance(desc.codec, JsonCodec) else None
    if _spread(desc, shape):
        assert isinstance(desc.codec, RecordCodec)
        clash = [n for n in desc.codec.names if n in RESERVED_COLUMNS]
        if clash:
            raise UsageError(f"state {desc.name!r}: record field {clash[0]!r} has the name of "
                             "another column; read the record as one struct column "
                             "(fields_as_columns=False)")
        fields += list(vtype)
    elif _array_mode(desc, shape):
        fields.append(pa.field("value", pa.list_(vtype), metadata=meta))
    else:
        fields.append(pa.field("value", vtype, metadata=meta))
    if desc.ttl is not None:
        fields.append(pa.field("expires_at", pa.list_(TIMESTAMP) if _array_mode(desc, shape)
                               else TIMESTAMP))
    fields += [pa.field("key_group", pa.int32()), pa.field("subtask", pa.int32())]
    return pa.schema(fields)


@dataclass(frozen=True)
class StateRead:
    """What to read: ``desc`` of ``subtask``, entries live at ``now`` (None: all)."""

    desc: StateDescriptor
    subtask: int
    now: int | None = None
    shape: TableShape = TableShape()


def state_batches(backend: KeyedStateBackend, read: StateRead,
                  expected_rows: int | None = None) -> Iterator[pa.RecordBatch]:
    """The live entries of one state of ``backend`` as batches of `state_schema`.

    ``expected_rows``: the state's entry count in this subtask (metadata), which sizes
    the key-group spans read at once; None reads the whole range at once.
    """
    for span in key_group_spans(backend.key_group_range, expected_rows, read.shape.batch_rows):
        batch = read_span(backend, read, span)
        if batch is not None:
            yield batch


def read_span(backend: KeyedStateBackend, read: StateRead, span: KeyGroupRange
              ) -> pa.RecordBatch | None:
    """The live entries of ``read``'s state in key groups ``span`` (None: none); the
    timers when the state is ``_timers``."""
    if read.desc.name == TIMERS:
        return _timer_batch(backend, read.subtask, span)
    keys, values = backend.read_raw(read.desc.name, span)
    if not keys:
        return None
    try:
        batch = decode_entries(keys, values, read)
    except SerializationError as exc:
        raise SerializationError(f"state {read.desc.name!r} of {backend.label}: "
                                 f"{exc}") from exc
    return batch if batch.num_rows else None


def _timer_batch(backend: KeyedStateBackend, subtask: int, span: KeyGroupRange
                 ) -> pa.RecordBatch | None:
    """The timers of key groups ``span`` (`TIMER_SCHEMA`), in firing order per domain."""
    if TIMERS not in backend.column_families:
        return None
    keys, _ = backend.read_raw(TIMERS, span, values=False)
    if not keys:
        return None
    try:
        fired, _ = fired_timers(keys, reverse=False)  # column-wise (tags: one at a time)
    except SerializationError as exc:
        raise SerializationError(f"timers of {backend.label}: {exc}") from exc
    return pa.RecordBatch.from_arrays([
        fired.column("key").combine_chunks(),
        _timestamps(fired.column("time").to_numpy()),
        fired.column("domain").combine_chunks(), fired.column("tag").combine_chunks(),
        fired.column("key_group").combine_chunks(),
        pa.array(np.full(fired.num_rows, subtask, np.int32))], schema=TIMER_SCHEMA)


def key_group_spans(whole: KeyGroupRange, expected_rows: int | None,
                    batch_rows: int) -> list[KeyGroupRange]:
    """``whole`` cut into consecutive spans of about ``batch_rows`` entries each, taking
    entries as spread evenly over the key groups."""
    groups = whole.end - whole.start + 1
    if not expected_rows or expected_rows <= batch_rows:
        return [whole]
    step = max(1, math.floor(groups * batch_rows / expected_rows))
    return [KeyGroupRange(s, min(s + step - 1, whole.end))
            for s in range(whole.start, whole.end + 1, step)]


# -- decoding ---------------------------------------------------------------------------

def decode_entries(keys: RawColumn, values: RawColumn, read: StateRead
                   ) -> pa.RecordBatch:
    """Stored entries of ``read``'s state (RocksDB keys, values) as a batch of
    `state_schema`, expired entries left out; SerializationError if they do not decode."""
    desc = read.desc
    schema = state_schema(desc, read.shape)
    rocks = _binary(keys)
    offsets, data = binary_buffers(rocks)
    if (np.diff(offsets) < 2).any():
        raise SerializationError("a stored key is shorter than its key-group prefix")
    key_groups = (data[offsets[:-1]].astype(np.int32) << 8) | data[offsets[:-1] + 1]
    columns: dict[str, pa.Array] = {}
    if desc.kind == "map":
        pairs = [split_map_key(k[2:]) for k in _pylist(keys)]
        columns["key"] = pa.array([deserialize_key(k) for k, _ in pairs], pa.string())
        columns["user_key"] = pa.array([u for _, u in pairs], pa.string())
    else:
        columns["key"] = strip_prefix(rocks, 2, pa.string(), "stored key")
    if desc.kind == "list":
        return _list_batch(_pylist(values), read, schema, columns, key_groups)
    decoded, expiry = decode_values(desc.codec, values, desc.ttl is not None)
    live = _live(expiry, read.now)
    _value_columns(columns, decoded, desc, read.shape)
    if expiry is not None:
        columns["expires_at"] = _timestamps(expiry)
    columns["key_group"] = pa.array(key_groups, pa.int32())
    batch = _batch(columns, schema, read.subtask)
    return batch if live is None else batch.filter(pa.array(live))


def _list_batch(values: Sequence[bytes], read: StateRead, schema: pa.Schema,
                columns: dict[str, pa.Array], key_groups: np.ndarray) -> pa.RecordBatch:
    """One row per list (an array of its live elements), or per live element."""
    desc = read.desc
    framed = [decode_list(v) for v in values]
    counts = np.fromiter(map(len, framed), np.int64, len(framed))
    elements = [e for f in framed for e in f]
    decoded, expiry = decode_values(desc.codec, elements, desc.ttl is not None)
    owner = np.repeat(np.arange(len(framed)), counts)  # the entry of each element
    live = _live(expiry, read.now)
    if live is not None:
        decoded, owner = decoded.filter(pa.array(live)), owner[live]
        expiry = expiry[live] if expiry is not None else None
    kept = np.bincount(owner, minlength=len(framed))
    if read.shape.explode:
        starts = np.concatenate([[0], np.cumsum(kept)[:-1]])
        take = pa.array(owner)
        columns = {name: col.take(take) for name, col in columns.items()}
        columns["position"] = pa.array(np.arange(len(owner)) - starts[owner], pa.int32())
        _value_columns(columns, decoded, desc, read.shape)
        if expiry is not None:
            columns["expires_at"] = _timestamps(expiry)
        columns["key_group"] = pa.array(key_groups[owner], pa.int32())
        return _batch(columns, schema, read.subtask)
    rows = (kept > 0) | (counts == 0)  # a list whose elements all expired is gone
    ends = np.cumsum(kept)[rows]
    list_offsets = pa.array(np.concatenate([[0], ends]).astype(np.int32))
    columns = {name: col.filter(pa.array(rows)) for name, col in columns.items()}
    columns["value"] = pa.ListArray.from_arrays(list_offsets, decoded)
    if expiry is not None:
        columns["expires_at"] = pa.ListArray.from_arrays(list_offsets, _timestamps(expiry))
    columns["key_group"] = pa.array(key_groups[rows], pa.int32())
    return _batch(columns, schema, read.subtask)


def _value_columns(columns: dict[str, pa.Array], decoded: pa.Array, desc: StateDescriptor,
                   shape: TableShape) -> None:
    if _spread(desc, shape):
        assert isinstance(decoded, pa.StructArray)
        for i, f in enumerate(decoded.type):
            columns[f.name] = decoded.field(i)
    else:
        columns["value"] = decoded


def _batch(columns: dict[str, pa.Array], schema: pa.Schema, subtask: int) -> pa.RecordBatch:
    n = len(columns["key"])
    columns["subtask"] = pa.array(np.full(n, subtask, np.int32))
    return pa.RecordBatch.from_arrays([columns[f.name] for f in schema], schema=schema)


def _live(expiry: np.ndarray | None, now: int | None) -> np.ndarray | None:
    """Mask of the entries not expired at ``now`` (expiry <= now is expired); None: all."""
    if expiry is None or now is None:
        return None
    return expiry > now


def decode_values(codec: Codec, raws: RawColumn, ttl: bool
                  ) -> tuple[pa.Array, np.ndarray | None]:
    """(values as an Arrow array of `value_type`, expiries in epoch ms or None) of stored
    values; with ``ttl`` each starts with its 8-byte expiry."""
    strip = TIME_BYTES if ttl else 0
    if isinstance(codec, RecordCodec):
        return _records(codec, raws, strip)
    binary = _binary(raws)
    expiry = _expiries(binary) if ttl else None
    if isinstance(codec, JsonCodec):
        return pa.array([_json_text(codec, r[strip:]) for r in _pylist(raws)],
                        pa.string()), expiry
    fmt, name, arrow = ((STR_FORMAT, "str", pa.string()) if isinstance(codec, StrCodec)
                        else (BYTES_FORMAT, "bytes", pa.binary()))
    offsets, data = binary_buffers(binary)
    firsts = offsets[:-1] + strip
    bad = np.flatnonzero((offsets[1:] <= firsts) | (data[np.minimum(firsts, len(data) - 1)]
                                                    != fmt)) if len(data) else \
        np.arange(len(raws))
    if len(bad):
        codec.decode(binary[int(bad[0])].as_py()[strip:])  # raises the codec's own message
    return strip_prefix(binary, strip + 1, arrow, f"{name} value"), expiry


def _json_text(codec: JsonCodec, data: bytes) -> str:
    return json.dumps(codec.decode(data), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False)


def _records(codec: RecordCodec, raws: RawColumn, strip: int
             ) -> tuple[pa.Array, np.ndarray | None]:
    layout = codec.dtype
    dtype = np.dtype([("_expiry", ">u8"), *layout.descr]) if strip else layout
    binary = _binary(raws)
    offsets, data = binary_buffers(binary)
    lengths = np.diff(offsets)
    if len(lengths) and (lengths != dtype.itemsize).any():
        wrong = int(lengths[np.argmax(lengths != dtype.itemsize)])
        raise SerializationError(f"record value of {wrong - strip} bytes does not match its "
                                 f"layout of {layout.itemsize} bytes")
    rec = np.frombuffer(data, dtype, count=len(raws), offset=int(offsets[0])) \
        if len(raws) else np.zeros(0, dtype)
    if len(rec) and not (rec["_format"] == RECORD_FORMAT).all():
        raise SerializationError("record value with an unknown format byte")
    children = [pa.array(np.ascontiguousarray(rec[n])) for n in codec.names]
    struct = pa.StructArray.from_arrays(children, fields=list(value_type(codec)))
    expiry = _ms(rec["_expiry"]) if strip else None
    return struct, expiry


def _expiries(binary: pa.Array) -> np.ndarray:
    offsets, data = binary_buffers(binary)
    short = np.flatnonzero(np.diff(offsets) < TIME_BYTES)
    if len(short):
        raise SerializationError(f"stored time {binary[int(short[0])].as_py()[:TIME_BYTES]!r}"
                                 " is truncated")
    at = offsets[:-1, None] + np.arange(TIME_BYTES)
    return _ms(np.ascontiguousarray(data[at]).view(">u8").ravel())


def _ms(encoded: np.ndarray) -> np.ndarray:
    """Epoch ms of `statebackend.state.codecs.encode_time` values (uint64, sign bit flipped)."""
    return (encoded.astype(np.uint64) - _TIME_OFFSET).view(np.int64)


def _timestamps(ms: np.ndarray) -> pa.Array:
    """Epoch ms as timestamps (beyond what microseconds hold, clamped: +-292,000 years)."""
    return pa.array(np.clip(ms, -_MAX_MS, _MAX_MS) * 1000, TIMESTAMP)


def _binary(raws: RawColumn) -> pa.Array:
    """Stored bytes as an Arrow binary array at offset 0 (as `binary_buffers` reads it)."""
    if not isinstance(raws, pa.Array):
        return pa.array(raws, pa.binary())
    return raws if raws.offset == 0 else pa.concat_arrays([raws])


def _pylist(raws: RawColumn) -> Sequence[bytes]:
    if isinstance(raws, pa.Array):
        return cast("list[bytes]", raws.to_pylist())
    return raws


def binary_buffers(binary: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64, data uint8) of a binary or large binary array built from Python
    bytes (offset 0): value i is ``data[offsets[i]:offsets[i + 1]]``, and ``data`` ends
    at the last value (Arrow may pad its buffer)."""
    n = len(binary)
    buffers = binary.buffers()
    wide = pa.types.is_large_binary(binary.type)
    offsets = np.frombuffer(buffers[1], np.int64 if wide else np.int32, count=n + 1)
    size = int(offsets[-1])
    data = np.frombuffer(buffers[2], np.uint8, count=size) if size \
        else np.zeros(0, np.uint8)
    return offsets if wide else offsets.astype(np.int64), data


def strip_prefix(binary: pa.Array, prefix: int, arrow: pa.DataType, what: str) -> pa.Array:
    """Every value of ``binary`` without its first ``prefix`` bytes (at least that long),
    as ``arrow`` (a string type: checked to be UTF-8 by the cast); SerializationError
    naming the first value too short or not UTF-8."""
    lengths = np.diff(binary_buffers(binary)[0])
    short = np.flatnonzero(lengths < prefix)
    if len(short):
        raise SerializationError(f"{what} {binary[int(short[0])].as_py()!r} is truncated")
    # (an explicit stop: pyarrow's binary_slice without one fails on large arrays)
    sliced = pc.binary_slice(binary, prefix, int(lengths.max()) if len(lengths) else prefix)
    try:
        return sliced.cast(arrow)
    except pa.ArrowInvalid:
        return _first_bad_utf8(binary, prefix, what)


def _first_bad_utf8(binary: pa.Array, prefix: int, what: str) -> Any:
    for value in binary.to_pylist():
        try:
            value[prefix:].decode("utf-8")
        except UnicodeDecodeError:
            raise SerializationError(f"{what} {value[:32]!r} is not valid UTF-8") from None
    raise SerializationError(f"a {what} is not valid UTF-8")
