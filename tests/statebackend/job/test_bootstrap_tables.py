"""Bootstrap's entries are the bytes the state kinds write (issue 23, deliverable 2).

The reference is the state backend itself: the same data written key by key through
the state API (`put_many`, `add_many`, `update`, `register_timers`, with TTL timestamps
``expires_at - duration``) into one instance holding every key group. A bootstrapped
savepoint (P subtasks, Arrow tables in several shapes) restored subtask by subtask must
hold exactly those entries in every column family, TTL index and timers included.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from statebackend.checkpoint.dump import checkpoint_rows, descriptors_of
from statebackend.checkpoint.restore import restored_readonly
from statebackend.checkpoint.store import CheckpointStore
from statebackend.job import (
    BytesCodec,
    Input,
    Job,
    PerKey,
    StateTtl,
    StrCodec,
    Vectorized,
    aggregating_state,
    bootstrap_state,
    list_state,
    map_state,
    record,
    reducing_state,
    value_state,
)
from statebackend.lifecycle.registry import load_savepoint
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.timers import register_timers
from statebackend.storage import open_storage
from tests.statebackend.helpers import Average

M = 16
DAY = 86_400_000
PAIR = record(n="int32", x="float64", ok="bool")
TTL = StateTtl(DAY)


def _noop(batch, ctx):
    return None


JOB = Job(
    name="kinds", input=Input(pa.schema([("k", pa.string()), ("ts", pa.int64())]), key="k"),
    logic=Vectorized(_noop), on_timer=PerKey(lambda key, timers, state: None),
    states=(value_state("rec", PAIR), value_state("rec_struct", PAIR), value_state("doc"),
            value_state("text", StrCodec()), value_state("raw", BytesCodec()),
            map_state("tags", ttl=TTL), list_state("events", ttl=StateTtl(DAY, "event")),
            list_state("names", StrCodec()), list_state("pairs", PAIR),
            reducing_state("total", lambda a, b: a + b),
            aggregating_state("avg", Average())))

KEYS = [f"k{i}" for i in range(40)] + ["ü-ключ-鍵", "", "x" * 300]


def _tables(rng: np.random.Generator) -> dict[str, pa.Table]:
    n = len(KEYS)
    ints = rng.integers(-1000, 1000, n)
    floats = rng.normal(0, 1e6, n)
    flags = rng.integers(0, 2, n).astype(bool)
    expires = 10 * DAY + rng.integers(-DAY, DAY, n)
    rows_per_event = rng.integers(1, 4, n)
    event_keys = np.repeat(KEYS, rows_per_event)
    rng.shuffle(event_keys)  # one key's elements are spread over the table
    m = len(event_keys)
    return {
        "rec": pa.table({"key": KEYS, "n": ints.astype(np.int16), "x": floats, "ok": flags}),
        "rec_struct": pa.table({"key": KEYS, "value": pa.StructArray.from_arrays(
            [pa.array(ints), pa.array(ints), pa.array(flags)], ["n", "x", "ok"])}),
        "doc": pa.table({"k": KEYS, "value": [{"a": int(i), "b": [float(f), None], "s": f"é{i}"}
                                              for i, f in zip(ints, floats, strict=True)]}),
        "text": pa.table({"key": pa.array(KEYS).dictionary_encode(),
                          "value": [f"t{i}" for i in ints]}),
        "raw": pa.table({"key": KEYS, "value": [bytes([i % 256]) * 3 for i in ints]}),
        "tags": pa.table({"key": KEYS * 2, "user_key": ["a"] * n + ["bé"] * n,
                          "value": list(ints) * 2,
                          "expires_at": np.concatenate([expires, expires + 5])}),
        "events": pa.table({"key": event_keys, "value": [float(i) for i in range(m)],
                            "expires_at": 10 * DAY + rng.integers(0, 3, m)}),
        "names": pa.table({"key": KEYS, "value": [[f"n{j}" for j in range(i % 4)]
                                                  for i in range(n)]}),
        "pairs": pa.table({"key": event_keys, "value": pa.StructArray.from_arrays(
            [pa.array(np.arange(m)), pa.array(np.arange(m) / 2),
             pa.array(np.arange(m) % 2 == 0)], ["n", "x", "ok"])}),
        "total": pa.table({"key": KEYS, "value": floats}),
        "avg": pa.table({"key": KEYS, "value": [[float(f), 2] for f in floats]}),
        "_timers": pa.table({"key": list(KEYS) + KEYS[:5], "time": list(expires) + [7] * 5,
                             "domain": ["event"] * n + ["processing"] * 5,
                             "tag": [""] * n + [f"t{i}" for i in range(5)]}),
    }


def _through_the_api(tmp_path, tables: dict[str, pa.Table], key_hash: str
                     ) -> KeyedStateBackend:
    """The same state written key by key through the state API (the reference), keys
    placed by the lineage's ``key_hash``."""
    be = KeyedStateBackend(str(tmp_path / "api"), JOB.descriptors, M, KeyGroupRange(0, M - 1))
    be.place_keys_by(key_hash)
    rows = {name: t.to_pylist() for name, t in tables.items()}
    for name in ("rec", "doc", "text", "raw", "total", "avg"):
        key = "k" if name == "doc" else "key"
        st = be.value_state(name) if name not in ("total", "avg") else \
            (be.reducing_state(name) if name == "total" else be.aggregating_state(name))
        values = [{f: r[f] for f in ("n", "x", "ok")} if name == "rec" else r["value"]
                  for r in rows[name]]
        st.put_many([r[key] for r in rows[name]], values)
    be.value_state("rec_struct").put_many(
        [r["key"] for r in rows["rec_struct"]],
        [{**v, "x": float(v["x"])} for v in (r["value"] for r in rows["rec_struct"])])
    be.map_state("tags").put_many([(r["key"], r["user_key"], r["value"]) for r in rows["tags"]],
                                  [r["expires_at"] - DAY for r in rows["tags"]])
    for r in rows["events"]:  # one element at a time, in row order
        be.list_state("events").add(r["key"], r["value"], r["expires_at"] - DAY)
    for r in rows["names"]:
        if r["value"]:
            be.list_state("names").update(r["key"], r["value"])
    be.list_state("pairs").add_many([r["key"] for r in rows["pairs"]],
                                    [r["value"] for r in rows["pairs"]])
    for domain in ("event", "processing"):
        mine = [r for r in rows["_timers"] if r["domain"] == domain]
        register_timers(be, [r["key"] for r in mine], [r["time"] for r in mine], domain,
                        [r["tag"] for r in mine])
    return be


def _raw(backend: KeyedStateBackend) -> dict[str, list[tuple[bytes, bytes]]]:
    return {name: list(backend.iter_raw(name)) for name in backend.column_families}


@pytest.mark.parametrize("parallelism", [1, 3])
def test_bootstrapped_entries_are_the_state_apis_bytes(tmp_path, parallelism):
    tables = _tables(np.random.default_rng(parallelism))
    summary = bootstrap_state(JOB, f"file://{tmp_path}/store", "seed", tables,
                              parallelism=parallelism, max_parallelism=M)
    store = CheckpointStore(_root(tmp_path), "kinds")
    meta = load_savepoint(store, "seed")
    assert (meta.kind, meta.parallelism, meta.extra["key"]) == ("savepoint", parallelism, "k")
    got: dict[str, list] = {}
    for handle in meta.subtasks:
        with restored_readonly(store.storage, handle, descriptors_of(meta), M) as be:
            for name, entries in _raw(be).items():
                got.setdefault(name, []).extend(entries)
    assert meta.key_hash == "spark"  # a new lineage's (statebackend.defaults.KEY_HASH)
    with _through_the_api(tmp_path, tables, meta.key_hash) as api:
        want = _raw(api)
    assert set(got) == set(want)
    for name in want:
        assert got[name] == want[name], name
    assert summary["entries"] == {n: len(e) for n, e in want.items() if e}
    counts = {}
    for handle in meta.subtasks:
        for name, n in handle.row_counts.items():
            counts[name] = counts.get(name, 0) + n
    assert counts == {n: len(e) for n, e in want.items()}


def _root(tmp_path):
    return open_storage(f"file://{tmp_path}/store")


def _rec(**columns) -> pa.Table:
    base = {"key": ["a", "b", "c"], "n": [1, 2, 3], "x": [0.5, 1.5, 2.5], "ok": [True] * 3}
    base.update(columns)
    return pa.table({k: v for k, v in base.items() if v is not None})


BAD = {
    "missing column": ({"rec": _rec(x=None)}, "state 'rec'", "no column 'x'"),
    "wrong type": ({"rec": _rec(x=["1", "2", "3"])}, "state 'rec'",
                   "column 'x' is string, expected a number"),
    "null key": ({"doc": pa.table({"key": ["a", None], "value": [1, 2]})}, "state 'doc'",
                 "column 'key' holds a null in row 1"),
    "null value": ({"total": pa.table({"key": ["a", "b"], "value": [1.0, None]})},
                   "state 'total'", "column 'value' holds a null in row 1"),
    "value out of range": ({"rec": _rec(n=[1, 2**40, 3])}, "state 'rec'",
                           "column 'n' holds a value the record field (int32) cannot hold"),
    "duplicate key": ({"rec": _rec(key=["a", "b", "a"])}, "state 'rec'",
                      "key 'a' appears in more than one row"),
    "key of another type": ({"text": pa.table({"key": [1.5], "value": ["t"]})},
                            "state 'text'", "column 'key' is double"),
    "unknown state": ({"nope": _rec()}, "'nope'", "declares no state 'nope'"),
    "no expiry": ({"tags": pa.table({"key": ["a"], "user_key": ["u"], "value": [1]})},
                  "state 'tags'", "no column 'expires_at'"),
    "timer domain": ({"_timers": pa.table({"key": ["a"], "time": [1], "domain": ["wall"]})},
                     "state '_timers'", "column 'domain' holds 'wall' in row 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_table_is_refused_in_one_line_and_nothing_is_written(tmp_path, case):
    from statebackend.errors import UsageError

    tables, state, fragment = BAD[case]
    good = {"names": pa.table({"key": ["a"], "value": [["x"]]})}  # refused along with it
    with pytest.raises(UsageError) as info:
        bootstrap_state(JOB, f"file://{tmp_path}/store", "seed", {**good, **tables},
                        parallelism=2, max_parallelism=M)
    message = str(info.value)
    assert "\n" not in message and state in message and fragment in message, message
    assert not (tmp_path / "store" / "kinds" / "savepoints").exists() or \
        not list((tmp_path / "store" / "kinds" / "savepoints").iterdir())


def test_the_cli_writes_a_savepoint_from_parquet_folders_or_refuses_in_one_line(
        tmp_path, capsys, monkeypatch):
    import json

    import pyarrow.parquet as pq

    from statebackend.cli import app as cli

    monkeypatch.setenv("CKPT_PROGRESS", "off")
    for name, table in {"rec": _rec(), "bad": _rec(x=["1", "2", "3"])}.items():
        (tmp_path / name).mkdir()
        pq.write_table(table.slice(0, 2), tmp_path / name / "part-0.parquet")
        pq.write_table(table.slice(2), tmp_path / name / "part-1.parquet")
    args = ["--storage", str(tmp_path / "store"), "bootstrap",
            "tests.statebackend.job.test_bootstrap_tables:JOB", "--parallelism", "2",
            "--max-parallelism", str(M)]
    code = cli.main([*args, "--state", f"rec={tmp_path / 'bad'}", "--savepoint", "s"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "column 'x' is string" in err, err
    assert not (tmp_path / "store" / "kinds" / "savepoints" / "s").exists()
    assert cli.main([*args, "--state", f"rec={tmp_path / 'rec'}", "--savepoint", "s",
                     "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["kind"], summary["entries"]) == ("savepoint", {"rec": 3})
    assert summary["start_from"] == "kinds/savepoints/s"
    store = CheckpointStore(_root(tmp_path), "kinds")
    rows = sorted((r["key"], r["value"])
                  for r in checkpoint_rows(store, load_savepoint(store, "s")))
    assert rows == [(r["key"], {"n": r["n"], "x": r["x"], "ok": r["ok"]})
                    for r in _rec().to_pylist()]


def test_timestamps_are_epoch_milliseconds(tmp_path):
    ms = [10 * DAY + 1, 10 * DAY + 2]
    stamps = pa.array([m * 1000 + 999 for m in ms], pa.timestamp("us", "UTC"))  # truncated
    base = {"key": ["a", "b"], "user_key": ["u", "v"], "value": [1, 2]}
    as_ints = {"tags": pa.table({**base, "expires_at": ms}),
               "_timers": pa.table({"key": ["a", "b"], "time": ms})}
    as_stamps = {"tags": pa.table({**base, "expires_at": stamps}),
                 "_timers": pa.table({"key": ["a", "b"], "time": stamps})}
    got = []
    for i, tables in enumerate((as_ints, as_stamps)):
        bootstrap_state(JOB, f"file://{tmp_path}/s{i}", "seed", tables, parallelism=1,
                        max_parallelism=M)
        store = CheckpointStore(open_storage(f"file://{tmp_path}/s{i}"), "kinds")
        meta = load_savepoint(store, "seed")
        with restored_readonly(store.storage, meta.subtasks[0], descriptors_of(meta), M) as be:
            got.append(_raw(be))
    assert got[0] == got[1] and len(got[0]["_ttl"]) == 2 and len(got[0]["_timers"]) == 2


@pytest.mark.parametrize("presorted", [False, True])
def test_entries_sort_in_rocksdbs_byte_order(presorted):
    from statebackend.job.bootstrap_write import sort_order

    rng = np.random.default_rng(3)
    keys = [bytes(rng.integers(0, 256, rng.integers(0, 5)).astype(np.uint8)) for _ in range(500)]
    keys += [b"", b"\xff", b"\x00", b"a", b"a\x00", b"ab"]
    if presorted:
        keys = sorted(keys)
    array = pa.array(keys, pa.binary())
    assert array.take(pa.array(sort_order(array))).to_pylist() == sorted(keys)
