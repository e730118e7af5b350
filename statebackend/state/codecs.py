"""Stable, versioned, non-executable serialization of keys and values.

A checkpoint may come from untrusted storage, so nothing here executes data:
no pickle, no eval. Every encoded value starts with one format byte naming its
codec and version; decoding refuses unknown bytes with a SerializationError.
Changes must stay backward-compatible: add new format bytes, never reuse one.

Codecs (declared per state, recorded in `_metadata` as JSON):

- ``json``   b"\\x01" + compact UTF-8 JSON (dict/list/str/int/float/bool/None)
- ``record`` b"\\x02" + little-endian struct of named fixed-width fields
             (int32, int64, float32, float64, bool); decodes to a dict; vectorised
             with NumPy. A field may declare a default (``record(n=("int64", 0))``):
             not part of the stored layout, it fills the field when a lineage's
             stored records lack it (state schema evolution, `statebackend.state.schema`).
- ``bytes``  b"\\x03" + raw bytes
- ``str``    b"\\x04" + UTF-8

Keys are strings; the serialized key is its UTF-8 bytes (the key group is
murmur3 of exactly these bytes). `serialize_keys` does the same for a whole column
at once (an Arrow string array is already its UTF-8 bytes: no per-key step).
Map state appends the user key after a 4-byte big-endian length of the primary
key so that (key, user key) pairs never collide.
List values are a sequence of u32-length-prefixed element encodings, so an
append is a byte concatenation with no decode.

Times (timers, TTL expiries) are 8 bytes big-endian of ``t + 2**63`` (the sign bit
flipped, as Flink does for timer keys), so byte order is time order, negative
times included.
"""

from __future__ import annotations

import json
import operator
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, TypeAlias

import numpy as np
import pyarrow as pa

from statebackend.errors import SerializationError, UsageError
from statebackend.fast_json import compact_json_bytes, fast_loads

JSON_FORMAT = 0x01
RECORD_FORMAT = 0x02
BYTES_FORMAT = 0x03
STR_FORMAT = 0x04

_FIELD_TYPES = {"int64": ("q", "<i8"), "float64": ("d", "<f8"), "bool": ("?", "?"),
                "int32": ("i", "<i4"), "float32": ("f", "<f4")}
_U32 = struct.Struct(">I")
TIME_BYTES = 8
_TIME_OFFSET = 1 << 63
# Time domains of timers and TTL, and their byte in stored keys (never renumber).
TIME_DOMAINS = {"event": b"\x00", "processing": b"\x01"}
DOMAIN_NAMES = {v[0]: k for k, v in TIME_DOMAINS.items()}


def serialize_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise UsageError(f"state keys must be strings, got {type(key).__name__}: {key!r}")
    return key.encode("utf-8")


def serialize_keys(keys: Iterable[str] | pa.Array | pa.ChunkedArray) -> pa.Array:
    """`serialize_key` of every key, as one binary array (no copy for an Arrow string array)."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks() if keys.num_chunks != 1 else keys.chunk(0)
    if not isinstance(keys, pa.Array):
        keys = keys if isinstance(keys, list) else list(keys)
        if not keys:
            return pa.array([], pa.binary())
        try:  # inferred, not forced: bytes or numbers among the keys are refused below
            keys = pa.array(keys)
        except (pa.ArrowTypeError, pa.ArrowInvalid):
            keys = pa.array([], pa.null())
        if not pa.types.is_string(keys.type):
            raise UsageError(f"state keys must be strings, got {keys.type} keys")
    if not (pa.types.is_string(keys.type) or pa.types.is_large_string(keys.type)):
        raise UsageError(f"state keys must be strings, got a column of {keys.type}")
    if keys.null_count:
        serialize_key(None)  # type: ignore[arg-type]  # raises: a key must be a string
    return keys.view(pa.large_binary() if pa.types.is_large_string(keys.type) else pa.binary())


def deserialize_key(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SerializationError(f"stored key {data[:32]!r} is not valid UTF-8") from exc


def as_time(t: object) -> int:
    """``t`` as an int of epoch ms (ints and NumPy integers; bools, floats, strings refused)."""
    value: int | None = None
    if type(t) is int:  # the common case, without the protocol check below
        value = t
    elif not isinstance(t, bool) and isinstance(t, SupportsIndex):
        try:
            value = operator.index(t)
        except TypeError:
            value = None
    if value is None or not -_TIME_OFFSET <= value < _TIME_OFFSET:
        raise UsageError(f"time {t!r} is not a 64-bit integer of epoch milliseconds")
    return value


def encode_time(t: int) -> bytes:
    """8 bytes whose byte order is the order of ``t`` (epoch ms, may be negative)."""
    return (as_time(t) + _TIME_OFFSET).to_bytes(TIME_BYTES, "big")


def time_upper_bound(t: int) -> bytes:
    """Exclusive upper bound of the stored keys ``... + encode_time(x) + suffix`` with x <= t."""
    t = as_time(t)
    return encode_time(t + 1) if t + 1 < _TIME_OFFSET else b"\xff" * (TIME_BYTES + 1)


def domain_byte(domain: str) -> bytes:
    try:
        return TIME_DOMAINS[domain]
    except KeyError:
        raise UsageError(f"time domain {domain!r} is unknown; use one of "
                         f"{sorted(TIME_DOMAINS)}") from None


def decode_time(data: bytes, offset: int = 0) -> int:
    """Inverse of `encode_time` at ``offset``; SerializationError if truncated."""
    if len(data) < offset + TIME_BYTES:
        raise SerializationError(f"stored time {data[offset:offset + 8]!r} is truncated")
    return int.from_bytes(data[offset : offset + TIME_BYTES], "big") - _TIME_OFFSET


def map_key_suffix(key_bytes: bytes, user_key: str) -> bytes:
    return _U32.pack(len(key_bytes)) + key_bytes + user_key.encode("utf-8")


def split_map_key(suffix: bytes) -> tuple[bytes, str]:
    """Inverse of map_key_suffix (input without the key-group prefix)."""
    if len(suffix) < 4:
        raise SerializationError(f"map state key {suffix[:32]!r} is truncated")
    (n,) = _U32.unpack_from(suffix)
    if 4 + n > len(suffix):
        raise SerializationError(f"map state key {suffix[:32]!r} has a bad length prefix")
    return suffix[4 : 4 + n], deserialize_key(suffix[4 + n :])


@dataclass(frozen=True)
class JsonCodec:
    def encode(self, value: Any) -> bytes:
        return b"\x01" + compact_json_bytes(value)

    def decode(self, data: bytes) -> Any:
        _check_format(data, JSON_FORMAT, "json")
        try:  # msgspec's speed; what it refuses (NaN, 1e400, ...), the stdlib decides
            return fast_loads(data[1:])
        except ValueError:
            pass
        try:
            return json.loads(data[1:])
        except ValueError as exc:
            raise SerializationError(f"json value {data[:32]!r} does not decode: {exc}") from exc

    def to_json(self) -> dict[str, Any]:
        return {"type": "json"}


@dataclass(frozen=True)
class BytesCodec:
    def encode(self, value: bytes) -> bytes:
        return b"\x03" + bytes(value)

    def decode(self, data: bytes) -> bytes:
        _check_format(data, BYTES_FORMAT, "bytes")
        return data[1:]

    def to_json(self) -> dict[str, Any]:
        return {"type": "bytes"}


@dataclass(frozen=True)
class StrCodec:
    def encode(self, value: str) -> bytes:
        return b"\x04" + value.encode("utf-8")

    def decode(self, data: bytes) -> str:
        _check_format(data, STR_FORMAT, "str")
        try:
            return data[1:].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SerializationError(f"str value {data[:32]!r} is not UTF-8") from exc

    def to_json(self) -> dict[str, Any]:
        return {"type": "str"}


@dataclass(frozen=True)
class RecordCodec:
    """Fixed-width record of named fields; fast to encode and decode in bulk.

    ``defaults``: (field, value) pairs declared for evolution; they do not change the
    layout, the stored description (`to_json`) or equality."""

    fields: tuple[tuple[str, str], ...]
    defaults: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.fields:
            raise UsageError("a record codec needs at least one field")
        names = [n for n, _ in self.fields]
        if len(set(names)) != len(names):
            raise UsageError(f"record fields {names} name a field twice")
        for name, ftype in self.fields:
            if not isinstance(name, str) or not name.isidentifier():
                raise UsageError(f"record field name {name!r} is not an identifier")
            if ftype not in _FIELD_TYPES:
                raise UsageError(
                    f"record field {name!r} has unknown type {ftype!r}; "
                    f"use one of {sorted(_FIELD_TYPES)}"
                )
        for name, value in self.defaults:
            if name not in names:
                raise UsageError(f"record default for {name!r} names no field of {names}")
            self.check_value(name, value)

    def check_value(self, name: str, value: Any) -> None:
        """UsageError unless ``value`` fits field ``name`` (e.g. a declared default)."""
        ftype = dict(self.fields)[name]
        try:
            struct.pack("<" + _FIELD_TYPES[ftype][0], value)
            ok = not (ftype in ("int32", "int64") and isinstance(value, bool | float))
        except (struct.error, TypeError):
            ok = False
        if not ok:
            raise UsageError(f"record field {name!r} ({ftype}) cannot hold {value!r}")

    @property
    def default_of(self) -> dict[str, Any]:
        return dict(self.defaults)

    @property
    def _struct(self) -> struct.Struct:
        return struct.Struct("<B" + "".join(_FIELD_TYPES[t][0] for _, t in self.fields))

    @property
    def dtype(self) -> np.dtype[np.void]:
        return np.dtype(
            [("_format", "u1")] + [(n, _FIELD_TYPES[t][1]) for n, t in self.fields]
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.fields)

    def encode(self, value: Mapping[str, Any]) -> bytes:
        try:
            return self._struct.pack(RECORD_FORMAT, *(value[n] for n in self.names))
        except (KeyError, struct.error, TypeError) as exc:
            raise UsageError(f"value {value!r} does not fit record {self.names}: {exc}") from exc

    def decode(self, data: bytes) -> dict[str, Any]:
        st = self._struct
        if len(data) != st.size:
            raise SerializationError(
                f"record value of {len(data)} bytes does not match its layout of {st.size} bytes"
            )
        _check_format(data, RECORD_FORMAT, "record")
        return dict(zip(self.names, st.unpack(data)[1:], strict=True))

    def records(self, columns: Mapping[str, Sequence[Any] | np.ndarray]) -> np.ndarray:
        """N records given as one array per field, as one structured array of `dtype`
        (format byte set): what `encode_columns` encodes."""
        n = len(columns[self.names[0]])
        arr = np.empty(n, dtype=self.dtype)
        arr["_format"] = RECORD_FORMAT
        for name in self.names:
            arr[name] = columns[name]
        return arr

    def encode_columns(self, columns: Mapping[str, Sequence[Any] | np.ndarray]) -> list[bytes]:
        """Encode N records given as one array per field (vectorised)."""
        return encode_records(self.records(columns))

    def decode_columns(self, values: Sequence[bytes | None]
                       ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Decode N stored values (None = absent) into (found mask, arrays per field)."""
        dtype = self.dtype
        size = dtype.itemsize
        found = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        present = [v for v in values if v is not None]
        if any(len(v) != size for v in present):
            bad = next(v for v in present if len(v) != size)
            raise SerializationError(
                f"record value of {len(bad)} bytes does not match its layout of {size} bytes"
            )
        arr = np.frombuffer(b"".join(present), dtype=dtype)
        if len(arr) and not (arr["_format"] == RECORD_FORMAT).all():
            raise SerializationError("record value with an unknown format byte")
        out: dict[str, np.ndarray] = {}
        for name in self.names:
            col = np.zeros(len(values), dtype=dtype[name])
            col[found] = arr[name]
            out[name] = col
        return found, out

    def to_json(self) -> dict[str, Any]:
        return {"type": "record", "fields": [list(f) for f in self.fields]}


def encode_records(records: np.ndarray) -> list[bytes]:
    """Each record of a structured array (`RecordCodec.records`) as its stored bytes."""
    # A packed void view turns each record into one bytes object in C
    # (about 3x faster than slicing one big buffer in a Python loop).
    out: list[bytes] = records.view(f"V{records.dtype.itemsize}").tolist()
    return out


Codec: TypeAlias = JsonCodec | RecordCodec | BytesCodec | StrCodec


def codec_from_json(data: Any) -> Codec:
    """Rebuild a codec from its metadata description; unknown types are refused."""
    if not isinstance(data, dict) or "type" not in data:
        raise SerializationError(f"codec description {data!r} is malformed")
    kind = data["type"]
    if kind == "json":
        return JsonCodec()
    if kind == "bytes":
        return BytesCodec()
    if kind == "str":
        return StrCodec()
    if kind == "record":
        fields = data.get("fields")
        if not isinstance(fields, list) or not all(
            isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f)
            for f in fields
        ):
            raise SerializationError(f"record codec fields {fields!r} are malformed")
        return RecordCodec(tuple((f[0], f[1]) for f in fields))
    raise SerializationError(f"unknown codec type {kind!r}")


def encode_list(encoded_elements: Iterable[bytes]) -> bytes:
    return b"".join(_U32.pack(len(e)) + e for e in encoded_elements)


def append_list_bytes(existing: bytes | None, encoded_element: bytes) -> bytes:
    return (existing or b"") + _U32.pack(len(encoded_element)) + encoded_element


def decode_list(data: bytes) -> list[bytes]:
    out, pos, n = [], 0, len(data)
    while pos < n:
        if pos + 4 > n:
            raise SerializationError("list value is truncated (length prefix)")
        (size,) = _U32.unpack_from(data, pos)
        pos += 4
        if pos + size > n:
            raise SerializationError("list value is truncated (element)")
        out.append(data[pos : pos + size])
        pos += size
    return out


def _check_format(data: bytes, expected: int, name: str) -> None:
    if not data or data[0] != expected:
        got = data[0] if data else None
        raise SerializationError(
            f"{name} value has format byte {got!r}, expected {expected}: "
            "written by another codec or a newer version"
        )
