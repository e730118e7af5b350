"""Keyed state kinds over one backend: single-key and batch operations."""

from __future__ import annotations

import numpy as np
import pytest

from statebackend.checkpoint.dump import write_dump
from statebackend.errors import UsageError
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.codecs import BytesCodec, StrCodec
from statebackend.state.keygroups import (
    KeyGroupRange,
    key_group_for_bytes,
    key_group_of_rocks_key,
    key_group_range_for_subtask,
)
from statebackend.state.kinds import StateDescriptor
from tests.statebackend.helpers import DESCRIPTORS, TOTALS, Average, dump_backends, route


@pytest.fixture
def backend(tmp_path):
    b = KeyedStateBackend(str(tmp_path / "b"), DESCRIPTORS, 128, KeyGroupRange(0, 127))
    yield b
    b.close()


def test_value_state_single_and_batch(backend):
    st = backend.value_state("totals")
    assert st.get("a") is None and st.get("a", default=0) == 0
    st.put("a", {"count": 1, "sum": 2.5, "ok": True} | {"flag": False})
    assert st.get("a") == {"count": 1, "sum": 2.5, "flag": False}
    keys = [f"k{i}" for i in range(1000)]
    st.put_many(keys, [{"count": i, "sum": i / 2, "flag": i % 2 == 0} for i in range(1000)])
    assert st.get_many(["k3", "nope", "k999"]) == [
        {"count": 3, "sum": 1.5, "flag": False}, None, {"count": 999, "sum": 499.5, "flag": False}]
    st.delete("k3")
    st.delete_many(["k4", "k5", "never-written"])
    assert st.get_many(["k3", "k4", "k5", "k6"])[:3] == [None, None, None]


def test_value_state_columns(backend):
    st = backend.value_state("totals")
    keys = [f"k{i}" for i in range(500)]
    n = np.arange(500)
    st.put_columns(keys, {"count": n, "sum": n * 1.5, "flag": n % 3 == 0})
    found, cols = st.get_columns(keys[:3] + ["absent"])
    assert found.tolist() == [True, True, True, False]
    assert cols["count"].tolist() == [0, 1, 2, 0]
    assert cols["sum"].tolist() == [0.0, 1.5, 3.0, 0.0]
    assert cols["flag"].tolist() == [True, False, False, False]
    assert st.get("k499") == {"count": 499, "sum": 748.5, "flag": False}


def test_columns_need_a_record_codec(backend):
    with pytest.raises(UsageError, match="does not use a record codec"):
        backend.reducing_state("maxima").put_columns(["a"], {"x": [1]})


def test_list_state(backend):
    st = backend.list_state("events")
    assert st.get("a") == []
    st.add("a", 1)
    st.add_many(["a", "b", "a"], [2, {"x": 1}, 3])
    assert st.get("a") == [1, 2, 3]
    assert st.get_many(["b", "c"]) == [[{"x": 1}], []]
    st.update("a", ["only"])
    assert st.get("a") == ["only"]


def test_map_state(backend):
    st = backend.map_state("attrs")
    st.put("u1", "color", "red")
    st.put_many([("u1", "size", 3), ("u2", "color", "blue"), ("u1", "a", None)])
    assert st.get("u1", "color") == "red" and st.get("u1", "missing", 7) == 7
    assert st.contains("u1", "size") and not st.contains("u2", "size")
    assert list(st.items("u1")) == [("a", None), ("color", "red"), ("size", 3)]
    assert st.keys("u2") == ["color"]
    assert st.get_many([("u1", "size"), ("u2", "x")]) == [3, None]
    st.remove("u1", "color")
    assert st.keys("u1") == ["a", "size"]
    # a key that is a prefix of another key does not see its entries
    st.put("u", "x", 1)
    assert st.keys("u") == ["x"]


def test_reducing_state_pre_combines_batches(backend):
    st = backend.reducing_state("maxima")
    st.add("a", 5)
    st.add_many(["a", "b", "a", "b"], [3, 1, 9, 2])
    assert st.get_many(["a", "b", "c"]) == [9, 2, None]


def test_aggregating_state(backend):
    st = backend.aggregating_state("avg")
    st.add_many(["a", "a", "b"], [1, 3, 10])
    st.add("a", 8)
    assert st.get("a") == 4 and st.get_accumulator("a") == [12, 3]
    assert st.get_many(["a", "b", "none"]) == [4, 10, None]
    assert st.get("none", default="-") == "-"


def test_wrong_kind_and_undeclared_state(backend):
    with pytest.raises(UsageError, match="not declared"):
        backend.value_state("nope")
    with pytest.raises(UsageError, match="is list state, not ValueState"):
        backend.value_state("events")


def test_descriptor_validation():
    with pytest.raises(UsageError, match="unknown kind"):
        StateDescriptor("x", "set")
    with pytest.raises(UsageError, match="needs reduce_fn"):
        StateDescriptor("x", "reducing")
    with pytest.raises(UsageError, match="needs aggregate_fn"):
        StateDescriptor("x", "aggregating")
    with pytest.raises(UsageError, match="not allowed"):
        StateDescriptor("default")
    d = StateDescriptor("avg", "aggregating", aggregate_fn=Average())
    assert StateDescriptor.from_json(d.to_json()).to_json() == d.to_json()
    assert StateDescriptor.from_json(
        {"name": "t", "kind": "value", "codec": TOTALS.to_json()}).codec == TOTALS


def test_keys_outside_the_range_are_refused(tmp_path):
    rng = key_group_range_for_subtask(128, 2, 0)
    b = KeyedStateBackend(str(tmp_path / "b"), DESCRIPTORS, 128, rng)
    try:
        keys = [f"k{i}" for i in range(200)]
        mine, other = route(keys, 128, 2)
        b.value_state("totals").put_many([keys[i] for i in mine],
                                         [{"count": 1, "sum": 1.0, "flag": True}] * len(mine))
        bad = keys[other[0]]
        with pytest.raises(UsageError, match=f"key {bad!r} is in key group"):
            b.value_state("totals").put_many([bad], [{"count": 1, "sum": 1.0, "flag": True}])
        with pytest.raises(UsageError, match="outside this backend's range"):
            b.map_state("attrs").put(bad, "x", 1)
        for row in dump_backends([b]):
            assert row["key_group"] == key_group_for_bytes(row["key"].encode(), 128)
            assert row["key_group"] in rng
    finally:
        b.close()


def test_rocks_keys_layout_and_key_group_iteration(backend):
    rk = backend.rocks_key("hello")
    assert rk == b"\x00\x47hello"  # key group 71 (murmur3 "hello" % 128)
    assert backend.rocks_keys(["hello", "user-1"]) == [rk, (99).to_bytes(2, "big") + b"user-1"]
    keys = [f"k{i}" for i in range(300)]
    backend.value_state("totals").put_many(keys, [{"count": 0, "sum": 0.0, "flag": True}] * 300)
    part = list(backend.iter_raw("totals", KeyGroupRange(10, 20)))
    assert part and all(10 <= key_group_of_rocks_key(k) <= 20 for k, _ in part)
    expected = sum(1 for k in keys if 10 <= key_group_for_bytes(k.encode(), 128) <= 20)
    assert len(part) == expected
    assert backend.count_rows()["totals"] == 300
    backend.delete_key_groups_outside(KeyGroupRange(10, 20))
    assert backend.count_rows()["totals"] == expected


def test_bytes_values_dump_as_hex(tmp_path):
    descriptors = [StateDescriptor("blobs", "list", BytesCodec()),
                   StateDescriptor("raw", "map", BytesCodec())]
    with KeyedStateBackend(str(tmp_path / "b"), descriptors, 128, KeyGroupRange(0, 127)) as b:
        b.list_state("blobs").add_many(["k", "k"], [b"\x00\x01", b"\xff"])
        b.map_state("raw").put("k", "u", b"\xfe")
        rows = dump_backends([b])
    assert [(r["state"], r["value"]) for r in rows] == [("blobs", ["0001", "ff"]),
                                                        ("raw", "fe")]
    assert write_dump(iter(rows), str(tmp_path / "out.jsonl")) == 2


def test_reopen_keeps_data_and_undeclared_column_families(tmp_path):
    path = str(tmp_path / "b")
    with KeyedStateBackend(path, DESCRIPTORS, 128, KeyGroupRange(0, 127)) as b:
        b.list_state("events").add("a", 1)
    # reopened with only one declared state: other column families are still opened
    only = [StateDescriptor("names", "value", StrCodec())]
    with KeyedStateBackend(path, only, 128, KeyGroupRange(0, 127)) as b:
        assert "events" in b.column_families
        b.value_state("names").put("a", "x")
    with KeyedStateBackend(path, DESCRIPTORS + tuple(only), 128, KeyGroupRange(0, 127)) as b:
        assert b.list_state("events").get("a") == [1]
        assert b.value_state("names").get("a") == "x"
