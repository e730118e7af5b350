"""Serialization: round trips, stable bytes, refusal of unknown formats, no pickle."""

from __future__ import annotations

import json
import math
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import statebackend
from statebackend.errors import SerializationError, UsageError
from statebackend.fast_json import compact_json
from statebackend.state.codecs import (
    BytesCodec,
    JsonCodec,
    RecordCodec,
    StrCodec,
    append_list_bytes,
    codec_from_json,
    decode_list,
    deserialize_key,
    encode_list,
    map_key_suffix,
    serialize_key,
    serialize_keys,
    split_map_key,
)

REC = RecordCodec((("count", "int64"), ("sum", "float64"), ("ok", "bool")))

def _json_values(scalars: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        scalars, lambda children: st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=12)


json_values = _json_values(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text())
# what JSON can hold beyond that: NaN, infinities, ints beyond 64 bits
any_json_values = _json_values(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text())


@settings(max_examples=150, deadline=None)
@given(json_values)
def test_json_round_trip(value):
    codec = JsonCodec()
    assert codec.decode(codec.encode(value)) == value


@settings(max_examples=300, deadline=None)
@given(any_json_values)
def test_json_decodes_what_the_stdlib_decodes(value):
    """The fast decoder (msgspec) and its stdlib fallback give the stdlib's values for
    everything the codec stores, NaN, infinities and ints beyond 64 bits included."""
    try:
        data = JsonCodec().encode(value)
    except UnicodeEncodeError:  # a lone surrogate cannot be stored (UTF-8)
        return
    assert repr(JsonCodec().decode(data)) == repr(json.loads(data[1:]))


# what the stdlib's encoder turns into other JSON types, or refuses
_other_python = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text()
    | st.binary(max_size=4) | st.frozensets(st.integers(), max_size=3),
    lambda children: st.lists(children, max_size=4) | st.tuples(children, children)
    | st.dictionaries(st.integers() | st.floats() | st.none() | st.booleans() | st.text(
        max_size=4), children, max_size=4), max_leaves=10)


@settings(max_examples=400, deadline=None)
@given(any_json_values | _other_python)
def test_json_encodes_what_the_stdlib_encodes(value):
    """The fast encoder (msgspec, where it gives the same value back) stores what the
    stdlib's encoder stores, or refuses what it refuses: NaN and infinities stay NaN and
    infinities, tuples and non-string keys are converted as the stdlib converts them,
    bytes and sets are refused."""
    try:
        want = compact_json(value)
    except (TypeError, ValueError) as exc:
        with pytest.raises(type(exc)):
            JsonCodec().encode(value)
        return
    try:
        data = JsonCodec().encode(value)
    except UnicodeEncodeError:  # a lone surrogate cannot be stored (UTF-8)
        return
    assert data[:1] == b"\x01"
    assert repr(json.loads(data[1:])) == repr(json.loads(want))
    assert repr(JsonCodec().decode(data)) == repr(json.loads(want))


@settings(max_examples=100, deadline=None)
@given(st.text(), st.binary())
def test_str_bytes_key_round_trip(text, data):
    assert StrCodec().decode(StrCodec().encode(text)) == text
    assert BytesCodec().decode(BytesCodec().encode(data)) == data
    assert deserialize_key(serialize_key(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.text(), st.text())
def test_map_key_never_collides(key, user_key):
    kb = serialize_key(key)
    assert split_map_key(map_key_suffix(kb, user_key)) == (kb, user_key)


def test_map_key_pairs_that_concatenate_equally_stay_distinct():
    a = map_key_suffix(serialize_key("ab"), "c")
    b = map_key_suffix(serialize_key("a"), "bc")
    assert a != b


def test_stable_bytes():
    # Stored checkpoints depend on these exact encodings.
    assert JsonCodec().encode({"a": [1, 2.5, None, True]}) == b'\x01{"a":[1,2.5,null,true]}'
    assert JsonCodec().encode("\u00e9") == b'\x01"\xc3\xa9"'
    assert StrCodec().encode("hi") == b"\x04hi"
    assert BytesCodec().encode(b"\x00\xff") == b"\x03\x00\xff"
    assert REC.encode({"count": 1, "sum": 2.0, "ok": True}) == (
        b"\x02" + (1).to_bytes(8, "little") + np.float64(2.0).tobytes() + b"\x01")
    assert map_key_suffix(b"k", "u") == b"\x00\x00\x00\x01ku"
    assert encode_list([b"\x01a", b"\x01bc"]) == b"\x00\x00\x00\x02\x01a\x00\x00\x00\x03\x01bc"


def test_record_round_trip_single_and_columns():
    value = {"count": -(2**63), "sum": -1.5e300, "ok": False}
    assert REC.decode(REC.encode(value)) == value
    cols = {"count": np.arange(5, dtype=np.int64) - 2,
            "sum": np.linspace(0, 1, 5), "ok": np.array([True, False] * 2 + [True])}
    encoded = REC.encode_columns(cols)
    assert len(encoded) == 5
    assert [REC.decode(e) for e in encoded] == [
        {"count": int(c), "sum": float(s), "ok": bool(o)}
        for c, s, o in zip(cols["count"], cols["sum"], cols["ok"], strict=True)]
    # per-row and columnar encodings are the same bytes
    assert encoded[3] == REC.encode({"count": 1, "sum": 0.75, "ok": False})
    found, out = REC.decode_columns([encoded[0], None, encoded[4]])
    assert found.tolist() == [True, False, True]
    assert out["count"].tolist() == [-2, 0, 2]
    assert out["ok"].tolist() == [True, False, True]
    assert math.isclose(out["sum"][2], 1.0)


def test_record_decode_columns_empty_and_all_absent():
    found, out = REC.decode_columns([None, None])
    assert found.tolist() == [False, False] and out["count"].tolist() == [0, 0]
    found, out = REC.decode_columns([])
    assert len(found) == 0 and len(out["sum"]) == 0


def test_record_refuses_bad_layouts_and_values():
    with pytest.raises(SerializationError, match="does not match its layout"):
        REC.decode(b"\x02\x00")
    with pytest.raises(SerializationError, match="does not match its layout"):
        REC.decode_columns([b"\x02" * 3])
    good = REC.encode({"count": 1, "sum": 1.0, "ok": True})
    with pytest.raises(SerializationError, match="format byte"):
        REC.decode(b"\x07" + good[1:])
    with pytest.raises(SerializationError, match="unknown format byte"):
        REC.decode_columns([b"\x07" + good[1:]])
    with pytest.raises(UsageError, match="does not fit record"):
        REC.encode({"count": 1})
    with pytest.raises(UsageError, match="unknown type 'int8'"):
        RecordCodec((("x", "int8"),))
    with pytest.raises(UsageError, match="at least one field"):
        RecordCodec(())


@pytest.mark.parametrize("codec", [JsonCodec(), StrCodec(), BytesCodec(), REC])
@pytest.mark.parametrize("data", [b"", b"\x00abc", b"\x09xyz", b"\x80" * 18])
def test_unknown_format_bytes_are_refused(codec, data):
    with pytest.raises(SerializationError):
        codec.decode(data)


def test_codecs_refuse_each_others_bytes():
    codecs = [JsonCodec(), StrCodec(), BytesCodec()]
    for writer in codecs:
        blob = writer.encode("x" if not isinstance(writer, BytesCodec) else b"x")
        for reader in codecs:
            if reader is not writer:
                with pytest.raises(SerializationError, match="format byte"):
                    reader.decode(blob)


def test_pickle_bytes_are_not_executed():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('executed')",))

    blob = pickle.dumps(Boom())
    for codec in (JsonCodec(), StrCodec(), REC):
        with pytest.raises(SerializationError):
            codec.decode(blob)
    # BytesCodec hands raw bytes back, never interprets them
    with pytest.raises(SerializationError):
        BytesCodec().decode(blob)
    assert BytesCodec().decode(b"\x03" + blob) == blob


def test_library_never_imports_pickle_or_eval():
    package = Path(statebackend.__file__).parent
    for source in package.glob("*.py"):
        text = source.read_text()
        found = re.findall(r"\bimport (?:c?pickle|marshal|dill|shelve)\b|\b(?:eval|exec)\(", text)
        assert not found, f"{source.name} uses {found}"


def test_json_refuses_malformed():
    with pytest.raises(SerializationError, match="does not decode"):
        JsonCodec().decode(b"\x01{not json")


def test_list_encoding():
    elements = [JsonCodec().encode(v) for v in (1, "two", [3])]
    blob = encode_list(elements)
    assert decode_list(blob) == elements
    assert decode_list(b"") == []
    acc = None
    for e in elements:
        acc = append_list_bytes(acc, e)
    assert acc == blob
    with pytest.raises(SerializationError, match="truncated"):
        decode_list(blob[:-1])
    with pytest.raises(SerializationError, match="truncated"):
        decode_list(blob[:2])


def test_keys_must_be_strings_and_valid_utf8():
    with pytest.raises(UsageError, match="must be strings"):
        serialize_key(42)
    with pytest.raises(SerializationError, match="not valid UTF-8"):
        deserialize_key(b"\xff\xfe")
    with pytest.raises(SerializationError, match="truncated"):
        split_map_key(b"\x00\x00")
    with pytest.raises(SerializationError, match="bad length prefix"):
        split_map_key(b"\x00\x00\x00\x09ab")


def test_codec_descriptions_round_trip_and_refuse_unknown():
    for codec in (JsonCodec(), StrCodec(), BytesCodec(), REC):
        assert codec_from_json(codec.to_json()) == codec
    with pytest.raises(SerializationError, match="unknown codec type 'pickle'"):
        codec_from_json({"type": "pickle"})
    with pytest.raises(SerializationError, match="malformed"):
        codec_from_json("json")
    with pytest.raises(SerializationError, match="fields"):
        codec_from_json({"type": "record", "fields": [["a"]]})
    with pytest.raises(UsageError, match="unknown type"):
        codec_from_json({"type": "record", "fields": [["a", "object"]]})


def test_serialize_keys_equals_serialize_key_on_random_keys():
    rng = random.Random(7)
    keys = ["".join(rng.choice("az\u00e9\u4e2d\U0001f600") for _ in range(rng.randint(0, 20)))
            for _ in range(2000)]
    expected = [serialize_key(k) for k in keys]
    for given_as in (keys, iter(keys), pa.array(keys), pa.array(keys, pa.large_string()),
                     pa.chunked_array([pa.array(keys[:7]), pa.array(keys[7:])])):
        assert serialize_keys(given_as).to_pylist() == expected
    assert serialize_keys([]).to_pylist() == []


@pytest.mark.parametrize("keys", [["a", None], [b"a", b"b"], ["a", 1], [1, 2],
                                  pa.array([1, 2]), pa.array(["a", None])])
def test_serialize_keys_refuses_what_serialize_key_refuses(keys):
    with pytest.raises(UsageError, match="must be strings"):
        serialize_keys(keys)
