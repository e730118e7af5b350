"""The JVM state reader (`statebackend.spark.jvm_reader`): what it reads equals what the
Python reader and ``ckpt dump`` read, on the checkpoints the direct SST reader must get
right (overlapping sorted runs with overwrites and deletions; a rescale's ingested and
clipped files) and through RocksDB (its fallback); damaged files and what it cannot read
are refused in one line.

The reference of each case is a dict built by the test from what it wrote (pandas-free:
the values are a handful of fields per key), and the Python reader and the dump of the
same checkpoint must agree with it too. `test_state_reader` runs its whole suite (every
state kind, TTL, unicode keys, columns, Connect, GC during a read) with the default
reader, which is this one wherever it can read.
"""

from __future__ import annotations

import pytest

from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
from statebackend.errors import UsageError
from statebackend.job import ReadOptions, read_state
from statebackend.rescale.executor import rescale
from statebackend.spark import jvm_reader
from statebackend.state.codecs import RecordCodec, StrCodec
from statebackend.state.kinds import StateDescriptor
from statebackend.storage import open_storage
from tests.statebackend.helpers import close_all, keys, open_backends, route
from tests.statebackend.spark.readers import uses_jvm

M, P = 128, 3
REC = RecordCodec((("n", "int64"), ("x", "float64"), ("on", "bool")))
STATES = (StateDescriptor("rec", "value", REC), StateDescriptor("name", "value", StrCodec()),
          StateDescriptor("items", "list"))
KEYS = keys(3000) + ["ключ", "キー", "🙂", "", "a/b"]


def rows_of(df, state: str) -> dict[str, tuple]:
    out = {}
    for r in df.collect():
        d = r.asDict()
        value = (d["n"], d["x"], d["on"]) if state == "rec" else d["value"]
        out[d["key"]] = (value, d["key_group"], d["subtask"])
    return out


def write(backends, ks: list[str], version: int) -> None:
    for b, idx in zip(backends, route(ks, M, len(backends)), strict=True):
        mine = [ks[i] for i in idx]
        b.value_state("rec").put_many(mine, [{"n": i + version, "x": i * 0.5, "on": i % 2 == 0}
                                             for i in idx])
        b.value_state("name").put_many(mine, [f"{k}-v{version}" for k in mine])


def delete(backends, ks: list[str]) -> None:
    for b, idx in zip(backends, route(ks, M, len(backends)), strict=True):
        for state in ("rec", "name"):
            b.value_state(state).delete_many([ks[i] for i in idx])


@pytest.fixture(scope="module", params=["rocksdb", "memory"])
def runs(tmp_path_factory, request):
    return written_twice(tmp_path_factory.mktemp("runs"), request.param)


@pytest.fixture(scope="module")
def rocks_runs(tmp_path_factory):
    return written_twice(tmp_path_factory.mktemp("rocks-runs"), "rocksdb")


def written_twice(base, kind: str) -> dict:
    """Checkpoint 2 of a job written twice: the second overwrites a third of the keys and
    deletes another third (RocksDB: two sorted runs per state, no compaction in between;
    memory backend: a second segment of the key groups changed); the expected values of
    checkpoint 2 per state."""
    url = f"file://{base}/store"
    store = CheckpointStore(open_storage(url), "runs")
    backends = open_backends(str(base / "work"), P, M, STATES, kind=kind)
    write(backends, KEYS, 0)
    checkpoint_backends(store, backends, parent=None)
    changed, gone = KEYS[0::3], KEYS[1::3]
    write(backends, changed, 7)
    delete(backends, gone)
    meta = checkpoint_backends(store, backends, parent=1)
    close_all(backends)
    want: dict[str, dict[str, tuple]] = {"rec": {}, "name": {}}
    for version, ks in ((0, KEYS), (7, changed)):
        for i, k in enumerate(ks):
            want["rec"][k] = (i + version, i * 0.5, i % 2 == 0)
            want["name"][k] = f"{k}-v{version}"
    for state in want:
        for k in gone:
            del want[state][k]
    return {"url": url, "store": store, "meta": meta, "want": want, "kind": kind}


def test_the_fixture_has_overlapping_runs(rocks_runs):
    ssts = [f for h in rocks_runs["meta"].subtasks for f in h.files
            if f.local_name.endswith(".sst")]
    assert len(ssts) >= 4 * P  # two runs of two states in every subtask


@pytest.mark.parametrize("state", ["rec", "name"])
def test_overlapping_runs_read_directly_equal_what_was_written(spark, runs, state):
    df = read_state(spark, runs["url"], "runs", state=state)
    assert uses_jvm(df)
    got = rows_of(df, state)
    assert {k: v[0] for k, v in got.items()} == runs["want"][state]
    python = read_state(spark, runs["url"], "runs", state=state,
                        options=ReadOptions(reader="python"))
    assert not uses_jvm(python)
    assert rows_of(python, state) == got


def test_through_rocksdb_equals_the_direct_read(spark, rocks_runs, monkeypatch):
    runs = rocks_runs
    direct = rows_of(read_state(spark, runs["url"], "runs", state="rec"), "rec")
    planned = jvm_reader.plan_json
    monkeypatch.setattr(jvm_reader, "plan_json",
                        lambda *a: planned(*a)[:-1] + ', "direct": false}')
    df = read_state(spark, runs["url"], "runs", state="rec")
    assert uses_jvm(df) and '"direct": false' in jvm_reader.plan_json(
        runs["store"], *_task_and_desc(runs, "rec"))
    assert rows_of(df, "rec") == direct


def _task_and_desc(runs, state):
    from statebackend.spark.read_task import state_descriptor
    from statebackend.spark.state_reader import plan_read

    task = plan_read(runs["store"], "latest", state)
    return task, state_descriptor(task)


@pytest.mark.parametrize("kind", ["rocksdb", "memory"])
def test_after_a_rescale_equals_the_python_reader_and_the_dump(spark, tmp_path, kind):
    """A RocksDB rescale ingests other subtasks' SSTs and clips the bases (range
    deletions); a memory-backend one hands each new subtask some key groups of the old
    segments: out then in, every state read equals the Python reader's and the dump."""
    url = f"file://{tmp_path}/store"
    store = CheckpointStore(open_storage(url), "moved")
    backends = open_backends(str(tmp_path / "work"), P, M, STATES, kind=kind)
    write(backends, KEYS, 0)
    checkpoint_backends(store, backends, parent=None)
    write(backends, KEYS[::2], 3)
    checkpoint_backends(store, backends, parent=1)
    close_all(backends)
    for parallelism in (5, 2):
        rescale(store, "latest", parallelism, spark=spark)
        out = tmp_path / f"dump-{parallelism}.jsonl"
        assert cli.main(["--storage", url, "--job", "moved", "dump", "--out", str(out)]) == 0
        import json

        dumped = [json.loads(line) for line in out.read_text().splitlines()]
        for state in ("rec", "name"):
            df = read_state(spark, url, "moved", state=state)
            assert uses_jvm(df)
            got = rows_of(df, state)
            assert got == rows_of(read_state(spark, url, "moved", state=state,
                                             options=ReadOptions(reader="python")), state)
            want = {r["key"]: r["value"] for r in dumped if r["state"] == state}
            assert {k: (v[0] if state == "name" else dict(zip(("n", "x", "on"), v[0],
                                                               strict=True)))
                    for k, v in got.items()} == want
            assert {v[2] for v in got.values()} == set(range(parallelism))


@pytest.mark.parametrize("kind", ["rocksdb", "memory"])
def test_a_damaged_file_is_refused_in_one_line_naming_it(spark, tmp_path, kind):
    url = f"file://{tmp_path}/store"
    store = CheckpointStore(open_storage(url), "hurt")
    backends = open_backends(str(tmp_path / "work"), 2, M, STATES, kind=kind)
    write(backends, KEYS, 0)
    meta = checkpoint_backends(store, backends, parent=None)
    close_all(backends)
    # each state's SST (or the memory backend's segment): the read opens one of them
    damaged = [f for f in meta.subtasks[0].files if f.size > 1000]
    assert damaged
    for sst in damaged:
        path = store.storage.local_path(sst.path)
        data = bytearray(open(path, "rb").read())
        data[100] ^= 0xFF  # same size, other bytes
        with open(path, "wb") as fh:
            fh.write(bytes(data))
    df = read_state(spark, url, "hurt", state="rec",
                    options=ReadOptions(local_dir=str(tmp_path / "no-local")))
    with pytest.raises(Exception) as err:
        df.collect()
    line = next(x for x in str(err.value).splitlines() if "damaged or replaced" in x)
    assert "state 'rec' of subtask 0" in line, line
    assert any(sst.path.rsplit("/", 1)[-1] in line and sst.checksum in line for sst in damaged)


def test_what_it_cannot_read_is_refused_in_one_line_or_read_by_python(spark, runs,
                                                                      monkeypatch):
    with pytest.raises(UsageError, match=r"reader='jvm' cannot read this: state 'items' is a "
                                         r"list state"):
        read_state(spark, runs["url"], "runs", state="items", options=ReadOptions(reader="jvm"))
    with pytest.raises(UsageError, match="reader='sideways': use one of auto, jvm, python"):
        read_state(spark, runs["url"], "runs", state="rec",
                   options=ReadOptions(reader="sideways"))
    assert not uses_jvm(read_state(spark, runs["url"], "runs", state="items"))
    # a session that cannot load the reader: auto reads through Python, jvm is refused
    monkeypatch.setattr(jvm_reader, "SOURCE", "ckpt.reader.NoSuchSource")
    df = read_state(spark, runs["url"], "runs", state="rec")
    assert not uses_jvm(df) and len(rows_of(df, "rec")) == len(runs["want"]["rec"])
    with pytest.raises(UsageError, match="this Spark session cannot load ckpt.reader.NoSuchSource"):
        read_state(spark, runs["url"], "runs", state="rec", options=ReadOptions(reader="jvm"))
