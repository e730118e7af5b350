"""`statebackend.checkpoint.dump`: every entry of a committed checkpoint as plain rows,
checked against the values written (computed here again, independently of the library),
and the dump writer's contract: atomic files, one-line errors for bad targets."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from statebackend.checkpoint.dump import (
    check_dump_target,
    checkpoint_rows,
    decode_entry,
    descriptors_of,
    write_dump,
)
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import UsageError
from statebackend.state.codecs import serialize_key
from statebackend.state.keygroups import key_group_for_bytes, key_group_prefix
from statebackend.storage import open_storage
from tests.statebackend.helpers import close_all, fill, keys, open_backends

M, P, N = 128, 3, 200


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    base = tmp_path_factory.mktemp("dump")
    store = CheckpointStore(open_storage(f"file://{base}/store"), "job")
    backends = open_backends(str(base / "work"), P, M)
    try:
        fill(backends, keys(N), version=2)
        meta = checkpoint_backends(store, backends, parent=None)
    finally:
        close_all(backends)
    return store, meta, list(checkpoint_rows(store, meta))


def expected_rows() -> dict[tuple[str, str, str | None], object]:
    """(state, key, user_key) -> value, from what `fill` is documented to write."""
    out: dict[tuple[str, str, str | None], object] = {}
    v = 2
    for i, k in enumerate(keys(N)):
        out[("totals", k, None)] = {"count": i + v, "sum": i * 0.5 + v, "flag": (i + v) % 2 == 0}
        if i % 4 == 0:
            out[("events", k, None)] = [{"v": v, "k": k}]
        elif i % 4 == 1:
            for uk in ("a", "b"):
                out[("attrs", k, uk)] = {"k": k, "v": v}
        elif i % 4 == 2:
            out[("maxima", k, None)] = len(k) + v
    return out


def test_rows_are_the_values_written(committed):
    _, _, rows = committed
    found = {(r["state"], r["key"], r["user_key"]): r["value"] for r in rows
             if r["state"] != "avg"}
    assert found == expected_rows()
    averages = [r for r in rows if r["state"] == "avg"]
    assert len(averages) == N // 4 and all(r["value"] == [2, 1] for r in averages)


def test_rows_carry_their_key_group_and_subtask_in_order(committed):
    _, meta, rows = committed
    for r in rows:
        kg = key_group_for_bytes(r["key"].encode(), M)
        assert r["key_group"] == kg and r["subtask"] == kg * P // M
    order = [(r["subtask"], r["state"]) for r in rows]
    assert order == sorted(order)
    assert {r["subtask"] for r in rows} == set(range(meta.parallelism))


def test_jsonl_and_parquet_dumps_hold_every_row(committed, tmp_path):
    _, _, rows = committed
    assert write_dump(iter(rows), str(tmp_path / "d.jsonl")) == len(rows)
    lines = (tmp_path / "d.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines] == rows
    assert write_dump(iter(rows), str(tmp_path / "sub" / "d.parquet"), "parquet") == len(rows)
    table = pq.read_table(tmp_path / "sub" / "d.parquet").to_pylist()
    assert [{**t, "value": json.loads(t["value"])} for t in table] == rows


def test_a_dump_failing_half_way_leaves_no_file(committed, tmp_path):
    _, _, rows = committed
    target = tmp_path / "d.jsonl"

    def failing():
        yield from rows[:5]
        raise RuntimeError("scan failed")

    with pytest.raises(RuntimeError, match="scan failed"):
        write_dump(failing(), str(target))
    assert os.listdir(tmp_path) == []  # neither the dump nor its temp file


@pytest.mark.parametrize("out, fmt, message", [
    ("d.csv", "csv", "dump format 'csv' is unknown; use one of ('jsonl', 'parquet')"),
    ("-", "parquet", "dump format 'parquet' cannot be written to stdout (--out -)"),
])
def test_bad_targets_are_refused_before_any_work(out, fmt, message, tmp_path):
    with pytest.raises(UsageError) as err:
        check_dump_target(out, fmt)
    assert str(err.value).startswith(message)
    with pytest.raises(UsageError):
        write_dump(iter(()), str(tmp_path / out) if out != "-" else out, fmt)
    assert os.listdir(tmp_path) == []


def test_decode_entry_of_a_stored_value(committed):
    _, meta, rows = committed
    desc = {d.name: d for d in descriptors_of(meta)}["totals"]
    row = next(r for r in rows if r["state"] == "totals")
    rocks_key = key_group_prefix(row["key_group"]) + serialize_key(row["key"])
    raw = desc.codec.encode(row["value"])
    assert decode_entry(desc, rocks_key, raw) == (row["key"], None, row["value"])
