"""`read_state`: a checkpoint's state as a Spark DataFrame, equal to ``ckpt dump``.

The reference is the dump (``ckpt dump --out rows.jsonl``, the CLI) of the same
checkpoint, turned into read_state's shape here. TTL is judged from the data the test
wrote (each TTL entry carries its write time), not from the stored expiries: an entry
written at ``ts`` expires at ``ts + TTL_MS`` and is gone once that is <= the
checkpoint's clock of its domain. The checkpoint is committed with clocks that make
about half of them expired but not purged (a run would have purged them), so the
filter is what is tested.

Also: Spark Connect (a client process), list states one row per element, records as a
struct, local-recovery copies, one-line errors, and GC/retention during a paused read.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from statebackend.checkpoint.attempt import Attempt
from statebackend.checkpoint.leases import list_leases
from statebackend.checkpoint.local_copy import instance_dir
from statebackend.checkpoint.snapshot import checkpoint_backends, snapshot
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.cli import app as cli
from statebackend.errors import CheckpointNotFoundError, JobNotFoundError, UsageError
from statebackend.job import ReadOptions, RunConfig, bootstrap_state, read_state, run_job
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.codecs import BytesCodec, JsonCodec, RecordCodec, StrCodec
from statebackend.state.keygroups import key_group_range_for_subtask
from statebackend.state.kinds import StateDescriptor
from statebackend.state.ttl import StateTtl
from statebackend.storage import open_storage
from tests.jobs.bootstrap_data import KINDS, kinds_tables
from tests.statebackend.helpers import DESCRIPTORS as HELPER_DESCRIPTORS
from tests.statebackend.helpers import Average, close_all, fill, keys, open_backends, route
from tests.statebackend.spark.readers import uses_jvm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
M, P = 128, 3
JOB = "kinds"
TTL_MS = 1_000
WATERMARK = 1_000_000       # the checkpoint's event-time clock
PROCESSING = 5_000_000      # its processing-time clock
KEYS = keys(240) + ["ключ", "キー", "🙂", "e\u0301", "naïve key", "", "a/b"]
REC = RecordCodec((("count", "int64"), ("sum", "float64"), ("flag", "bool"),
                   ("small", "int32"), ("ratio", "float32")))
STAMPED = RecordCodec((("n", "int64"), ("ts", "int64")))
DESCRIPTORS = (
    StateDescriptor("doc", "value"),
    StateDescriptor("totals", "value", REC),
    StateDescriptor("name", "value", StrCodec()),
    StateDescriptor("blob", "value", BytesCodec()),
    StateDescriptor("events", "list"),
    StateDescriptor("points", "list", STAMPED),
    StateDescriptor("attrs", "map"),
    StateDescriptor("maxima", "reducing", reduce_fn=max),
    StateDescriptor("avg", "aggregating", aggregate_fn=Average()),
    StateDescriptor("seen", "value", STAMPED, ttl=StateTtl(TTL_MS, "event")),
    StateDescriptor("recent", "list", ttl=StateTtl(TTL_MS, "event")),
    StateDescriptor("labels", "map", StrCodec(), ttl=StateTtl(TTL_MS, "processing")),
)
BY_NAME = {d.name: d for d in DESCRIPTORS}
# what the JVM reader reads (RocksDB and memory backend): value states of record, str, bytes
JVM_STATES = {"totals", "name", "blob", "seen"}
HELD_TOTALS = HELPER_DESCRIPTORS[0]  # the "totals" record state `fill` writes
STATES = [d.name for d in DESCRIPTORS]


def write_time(clock: int, i: int) -> int:
    """Write times spread over [clock - 2 TTL, clock): about half expired at ``clock``;
    i % 97 == 0 hits the boundary (expiry == clock: expired)."""
    return clock - TTL_MS if i % 97 == 0 else clock - 2 * TTL_MS + (i * 37) % (2 * TTL_MS)


def fill_kinds(backend: KeyedStateBackend, ks: list[str], idx: list[int]) -> None:
    """Every state kind for the keys ``ks`` (their indexes ``idx`` in KEYS)."""
    b = backend
    b.value_state("doc").put_many(ks, [{"name": k, "i": i, "tags": ["x", k][: i % 3]}
                                       for k, i in zip(ks, idx, strict=True)])
    b.value_state("totals").put_many(ks, [
        {"count": i, "sum": i / 4, "flag": i % 2 == 0, "small": -i, "ratio": 0.5 * i}
        for i in idx])
    b.value_state("name").put_many(ks, [f"név-{k}" for k in ks])
    b.value_state("blob").put_many(ks, [bytes([i % 256, 0, 255]) for i in idx])
    for k, i in zip(ks, idx, strict=True):
        for j in range(i % 3 + 1):
            b.list_state("events").add(k, {"k": k, "j": j})
            b.list_state("points").add(k, {"n": j, "ts": i})
        if i % 2:
            b.map_state("attrs").put_many([(k, uk, {"i": i}) for uk in ("α", "b")])
        b.reducing_state("maxima").add_many([k, k], [i, i // 2])
        b.aggregating_state("avg").add_many([k] * (i % 4 + 1), list(range(i % 4 + 1)))
        ts = write_time(WATERMARK, i)
        b.value_state("seen").put(k, {"n": i, "ts": ts}, timestamp=ts)
        for j in range(3):  # elements expire one by one; some lists expire whole
            t = write_time(WATERMARK, i + 40 * j) if i % 5 else WATERMARK - 2 * TTL_MS + j
            b.list_state("recent").add(k, {"j": j, "ts": t}, timestamp=t)
        pt = write_time(PROCESSING, i)
        b.map_state("labels").put(k, "when", str(pt), timestamp=pt)


def commit_with_clocks(store: CheckpointStore, backends: list[KeyedStateBackend]) -> None:
    """Checkpoint 1 whose record carries the clocks (as a job run's does)."""
    results = [snapshot(b, store.storage, checkpoint_id=1, subtask=i).result()
               for i, b in enumerate(backends)]
    attempt = Attempt(store, 1)
    attempt.add_uploaded(p for r in results for p in r.uploaded_paths)
    meta = build_metadata(MetadataParts(
        job=store.job, checkpoint_id=1, parent=None, max_parallelism=M,
        states=[d.to_json() for d in backends[0].descriptors.values()],
        handles=[r.handle for r in results]))
    attempt.commit(meta.with_changes(watermark=WATERMARK, processing_time=PROCESSING))


def cli_dump(url: str, job: str, out: str, checkpoint: str = "latest") -> list[dict]:
    assert cli.main(["--storage", url, "--job", job, "dump", checkpoint, "--out", out]) == 0
    with open(out, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    return kinds_checkpoint(tmp_path_factory.mktemp("kinds"), "rocksdb")


@pytest.fixture(scope="module")
def memory_kinds(tmp_path_factory):
    return kinds_checkpoint(tmp_path_factory.mktemp("memory-kinds"), "memory")


def kinds_checkpoint(base: Path, kind: str) -> dict:
    """Checkpoint 1 of every state kind on state backend ``kind``, and its dump."""
    url = f"file://{base}/store"
    store = CheckpointStore(open_storage(url), JOB)
    backends = open_backends(str(base / "work"), P, M, DESCRIPTORS, kind=kind)
    try:
        for b, idx in zip(backends, route(KEYS, M, P), strict=True):
            fill_kinds(b, [KEYS[i] for i in idx], idx)
        commit_with_clocks(store, backends)
    finally:
        close_all(backends)
    return {"url": url, "base": base, "rows": cli_dump(url, JOB, str(base / "dump.jsonl"))}


# -- the reference: the dump in read_state's shape, expired entries removed --------------

def alive(state: str, value) -> tuple[bool, object, object]:
    """(kept, value without expired list elements, expiry in ms) from the test's own
    write times: expiry = ts + TTL, expired iff expiry <= the domain's clock."""
    if state == "seen":
        return value["ts"] + TTL_MS > WATERMARK, value, value["ts"] + TTL_MS
    if state == "labels":
        return int(value) + TTL_MS > PROCESSING, value, int(value) + TTL_MS
    kept = [e for e in value if e["ts"] + TTL_MS > WATERMARK]
    return bool(kept), kept, [e["ts"] + TTL_MS for e in kept]


def expected(dump: list[dict], state: str, explode: bool = False) -> list[dict]:
    rows = []
    for r in dump:
        if r["state"] != state:
            continue
        row = {"key": r["key"], "user_key": r["user_key"], "value": r["value"],
               "key_group": r["key_group"], "subtask": r["subtask"]}
        if BY_NAME[state].ttl is not None:
            kept, row["value"], row["expires_at"] = alive(state, r["value"])
            if not kept:
                continue
        if explode:
            expiries = row.pop("expires_at", None)
            for pos, element in enumerate(row.pop("value")):
                rows.append({**row, "position": pos, "value": element,
                             **({} if expiries is None else {"expires_at": expiries[pos]})})
        else:
            rows.append(row)
    return canonical(rows)


def as_dump_values(table: pa.Table, desc: StateDescriptor) -> list[dict]:
    """read_state's rows as dump-shaped dicts: record fields back into one value, JSON
    text parsed, bytes as hex (as the dump shows them), timestamps as epoch ms."""
    if "expires_at" in table.column_names:
        col = table["expires_at"]
        ms = pa.list_(pa.int64()) if pa.types.is_list(col.type) else pa.int64()
        table = table.set_column(table.column_names.index("expires_at"), "expires_at",
                                 pc.divide(col.cast(ms), 1000) if ms == pa.int64()
                                 else col.cast(ms))
    fields = desc.codec.names if isinstance(desc.codec, RecordCodec) else ()
    out = []
    for r in table.to_pylist():
        if "value" not in r:
            r["value"] = {f: r.pop(f) for f in fields}
        r["value"] = _plain(desc.codec, r["value"])
        if isinstance(r.get("expires_at"), list):
            r["expires_at"] = [t // 1000 for t in r["expires_at"]]
        r.setdefault("user_key", None)
        out.append(r)
    return canonical(out)


def _plain(codec, value):
    if isinstance(value, list):
        return [_plain(codec, v) for v in value]
    if isinstance(codec, JsonCodec):
        return json.loads(value)
    if isinstance(codec, BytesCodec):
        return value.hex()
    return value


def canonical(rows: list[dict]) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True, ensure_ascii=False) for r in rows)


# -- equality with the dump, every kind ------------------------------------------------

def test_the_fixture_has_live_and_expired_entries_of_every_ttl_state(kinds):
    for state in ("seen", "recent", "labels"):
        rows = [r for r in kinds["rows"] if r["state"] == state]
        kept = [alive(state, r["value"])[0] for r in rows]
        assert len(rows) == len(KEYS) and 0 < sum(kept) < len(rows), state
    # some lists keep part of their elements
    recent = [alive("recent", r["value"])[1] for r in kinds["rows"] if r["state"] == "recent"]
    assert any(0 < len(v) < 3 for v in recent)


@pytest.mark.parametrize("backend", ["kinds", "memory_kinds"])
@pytest.mark.parametrize("state", STATES)
def test_read_state_equals_the_dump(spark, request, backend, state):
    """On RocksDB (a restore) and the memory backend (its key-group files read as they
    are), in one batch and in batches of about 50 entries."""
    checkpoint = request.getfixturevalue(backend)
    for options in (ReadOptions(), ReadOptions(batch_rows=50), ReadOptions(reader="python")):
        df = read_state(spark, checkpoint["url"], JOB, state=state, options=options)
        # the default reads inside the JVM wherever it can (statebackend.spark.jvm_reader)
        assert uses_jvm(df) == (state in JVM_STATES and options.reader == "auto")
        got = as_dump_values(df.toArrow(), BY_NAME[state])
        assert got == expected(checkpoint["rows"], state)
        assert len(got) > 0


def test_columns_are_typed_from_the_codec(spark, kinds):
    def schema(state, **options):
        df = read_state(spark, kinds["url"], JOB, state=state, options=ReadOptions(**options))
        return df.schema.simpleString()

    assert schema("totals") == ("struct<key:string,count:bigint,sum:double,flag:boolean,"
                                "small:int,ratio:float,key_group:int,subtask:int>")
    assert schema("totals", fields_as_columns=False) == (
        "struct<key:string,value:struct<count:bigint,sum:double,flag:boolean,small:int,"
        "ratio:float>,key_group:int,subtask:int>")
    assert schema("doc") == "struct<key:string,value:string,key_group:int,subtask:int>"
    assert schema("blob") == "struct<key:string,value:binary,key_group:int,subtask:int>"
    assert schema("points") == ("struct<key:string,value:array<struct<n:bigint,ts:bigint>>,"
                                "key_group:int,subtask:int>")
    assert schema("points", explode_lists=True) == (
        "struct<key:string,position:int,n:bigint,ts:bigint,key_group:int,subtask:int>")
    assert schema("attrs") == ("struct<key:string,user_key:string,value:string,"
                               "key_group:int,subtask:int>")
    assert schema("seen") == ("struct<key:string,n:bigint,ts:bigint,expires_at:timestamp,"
                              "key_group:int,subtask:int>")
    assert schema("recent") == ("struct<key:string,value:array<string>,"
                                "expires_at:array<timestamp>,key_group:int,subtask:int>")


@pytest.mark.parametrize("backend", ["kinds", "memory_kinds"])
@pytest.mark.parametrize("state", ["events", "points", "recent"])
def test_lists_one_row_per_element_equal_the_dump(spark, request, backend, state):
    checkpoint = request.getfixturevalue(backend)
    df = read_state(spark, checkpoint["url"], JOB, state=state,
                    options=ReadOptions(explode_lists=True))
    assert as_dump_values(df.toArrow(), BY_NAME[state]) == \
        expected(checkpoint["rows"], state, explode=True)


def test_records_as_one_struct_column_equal_the_dump(spark, kinds):
    df = read_state(spark, kinds["url"], JOB, state="totals",
                    options=ReadOptions(fields_as_columns=False, batch_rows=16))
    assert df.rdd.getNumPartitions() == P
    assert as_dump_values(df.toArrow(), BY_NAME["totals"]) == expected(kinds["rows"], "totals")


def test_spark_queries_see_typed_values(spark, kinds):
    """Sums over typed columns equal the dump's, and unicode keys survive the round trip."""
    from pyspark.sql import functions as F

    df = read_state(spark, kinds["url"], JOB, state="totals")
    got = df.agg(F.count("*").alias("n"), F.sum("count").alias("c"),
                 F.sum("small").alias("s")).first()
    values = [r["value"] for r in kinds["rows"] if r["state"] == "totals"]
    assert (got["n"], got["c"], got["s"]) == (len(KEYS), sum(v["count"] for v in values),
                                              sum(v["small"] for v in values))
    unicode = {r["key"] for r in df.where(F.col("key").isin(KEYS[-7:])).collect()}
    assert unicode == set(KEYS[-7:])


@pytest.mark.parametrize("backend", ["kinds", "memory_kinds"])
def test_only_the_columns_asked_for_in_their_order(spark, request, backend):
    """``columns`` gives the full read's rows cut to those columns (an expiring state: its
    expired entries stay out), in the order asked; a wrong list is refused in one line
    before Spark runs anything."""
    checkpoint = request.getfixturevalue(backend)
    for state, columns in (("totals", ("sum", "key")), ("seen", ("expires_at", "n")),
                           ("attrs", ("user_key",))):
        full = read_state(spark, checkpoint["url"], JOB, state=state).toArrow()
        df = read_state(spark, checkpoint["url"], JOB, state=state,
                        options=ReadOptions(columns=columns))
        assert tuple(df.columns) == columns
        got = df.toArrow()
        assert got.num_rows == full.num_rows > 0
        assert sorted(got.to_pylist(), key=repr) == \
            sorted(full.select(list(columns)).to_pylist(), key=repr)
    for columns, message in (
            (("sum", "nope"), "'nope' is not a column of state 'totals'; its columns: key, "
                              "count, sum"),
            (("sum", "sum"), "names a column twice"),
            ((), "give a tuple of column names of state 'totals'"),
            ("sum", "give a tuple of column names")):
        with pytest.raises(UsageError) as err:
            read_state(spark, checkpoint["url"], JOB, state="totals",
                       options=ReadOptions(columns=columns))  # type: ignore[arg-type]
        assert message in _one_line(err)


# -- Spark Connect ------------------------------------------------------------------------

@pytest.mark.slow
def test_read_state_through_spark_connect_equals_the_dump(connect_server, kinds, tmp_path):
    # @jvm: read inside the server's JVM, or fail (the server loads the reader's jar)
    specs = [*STATES, *(f"{s}@jvm" for s in sorted(JVM_STATES)), "events:explode",
             "recent:explode", "totals:sum,key"]
    done = subprocess.run(
        [sys.executable, "-m", "tests.statebackend.spark.read_state_client", connect_server.url,
         kinds["url"], JOB, str(tmp_path), *specs],
        cwd=ROOT, env=connect_server.env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for spec in specs[:-1]:
        state, _, mode = spec.partition(":")
        table = pq.read_table(tmp_path / f"{state}-{mode or 'rows'}.parquet")
        state = state.removesuffix("@jvm")
        assert as_dump_values(table, BY_NAME[state]) == \
            expected(kinds["rows"], state, explode=mode == "explode"), spec
    cut = pq.read_table(tmp_path / "totals-sum,key.parquet")  # columns= through Connect
    assert cut.column_names == ["sum", "key"]
    assert sorted(zip(cut["key"].to_pylist(), cut["sum"].to_pylist(), strict=True)) == \
        sorted((r["key"], r["value"]["sum"]) for r in kinds["rows"] if r["state"] == "totals")


# -- S3: storage options travel with the tasks --------------------------------------------

@pytest.mark.slow
def test_read_state_from_s3_with_the_storages_own_options(spark, s3_server, tmp_path):
    """A `Storage` opened with explicit options (no credentials in the executors'
    environment): the tasks open the same storage with them."""
    import uuid

    from tests.conftest import S3_BUCKET

    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": s3_server}}
    storage = open_storage(f"s3://{S3_BUCKET}/read-{uuid.uuid4().hex[:8]}", **options)
    backends = open_backends(str(tmp_path / "work"), 2, M, DESCRIPTORS)
    for b, idx in zip(backends, route(KEYS, M, 2), strict=True):
        fill_kinds(b, [KEYS[i] for i in idx], idx)
    checkpoint_backends(CheckpointStore(storage, JOB), backends, parent=None)
    close_all(backends)
    dump = _dump_rows(storage)  # the rows `ckpt dump` writes
    for state in ("totals", "events", "attrs"):
        df = read_state(spark, storage, JOB, state=state)
        assert as_dump_values(df.toArrow(), BY_NAME[state]) == expected(dump, state), state


def _dump_rows(storage) -> list[dict]:
    from statebackend.checkpoint.dump import checkpoint_rows

    store = CheckpointStore(storage, JOB)
    return list(checkpoint_rows(store, store.latest()))


# -- one-line errors ----------------------------------------------------------------------

def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


def test_unknown_state_checkpoint_job_and_storage_are_refused_in_one_line(spark, kinds):
    with pytest.raises(UsageError) as err:
        read_state(spark, kinds["url"], JOB, state="nope")
    assert _one_line(err).startswith(
        "state 'nope' is not in checkpoint 1 of job 'kinds'; its states: attrs, avg, blob")
    with pytest.raises(UsageError, match="state '_ttl' is not in checkpoint 1"):
        read_state(spark, kinds["url"], JOB, state="_ttl")  # internal
    with pytest.raises(CheckpointNotFoundError) as err:
        read_state(spark, kinds["url"], JOB, checkpoint=7, state="doc")
    assert "checkpoint 7 of job 'kinds' not found" in _one_line(err)
    with pytest.raises(UsageError) as err:
        read_state(spark, kinds["url"], JOB, checkpoint="banana", state="doc")
    assert "checkpoint 'banana' is not 'latest', an id or chk-<id>" in _one_line(err)
    with pytest.raises(JobNotFoundError) as err:
        read_state(spark, kinds["url"], "other", state="doc")
    assert "job 'other' not found" in _one_line(err)
    with pytest.raises(UsageError) as err:
        read_state(spark, "memory://somewhere", JOB, state="doc")
    assert "Spark tasks cannot read it" in _one_line(err)


def test_a_record_field_named_like_a_column_needs_the_struct_form(spark, tmp_path):
    clash = StateDescriptor("stats", "value", RecordCodec((("subtask", "int64"),)))
    url = f"file://{tmp_path}/store"
    (backend,) = open_backends(str(tmp_path / "work"), 1, M, (clash,))
    backend.value_state("stats").put("a", {"subtask": 7})
    checkpoint_backends(CheckpointStore(open_storage(url), "clash"), [backend], parent=None)
    backend.close()
    with pytest.raises(UsageError) as err:
        read_state(spark, url, "clash", state="stats")
    assert "record field 'subtask' has the name of another column" in _one_line(err)
    df = read_state(spark, url, "clash", state="stats", options=ReadOptions(
        fields_as_columns=False))
    assert [r.asDict(recursive=True) for r in df.collect()] == [
        {"key": "a", "value": {"subtask": 7}, "key_group": df.first()["key_group"],
         "subtask": 0}]


def test_subtasks_and_states_without_entries_read_as_no_rows(spark, tmp_path):
    url = f"file://{tmp_path}/store"
    backends = open_backends(str(tmp_path / "work"), 4, M, DESCRIPTORS[:2])
    (owner,) = [b for b, idx in zip(backends, route(["only"], M, 4), strict=True) if idx]
    owner.value_state("totals").put("only", {"count": 1, "sum": 2.0, "flag": True,
                                             "small": 3, "ratio": 4.0})
    checkpoint_backends(CheckpointStore(open_storage(url), "sparse"), backends, parent=None)
    close_all(backends)
    rows = read_state(spark, url, "sparse", state="totals").collect()
    assert [(r["key"], r["count"], r["small"]) for r in rows] == [("only", 1, 3)]
    assert read_state(spark, url, "sparse", state="doc").count() == 0


# -- local recovery -----------------------------------------------------------------------

@pytest.mark.parametrize("reader", ["auto", "python"])
def test_tasks_use_the_executors_local_snapshot_when_it_holds_the_files(spark, tmp_path,
                                                                      reader):
    """Job-run instances left their snapshots under the local-recovery root: a read with
    that root needs no file from storage (they are gone); with another root it reads
    storage and fails in a line naming the subtask (the JVM reader: and the file)."""
    url = f"file://{tmp_path}/store"
    store = CheckpointStore(open_storage(url), "local")
    local = str(tmp_path / "local")
    backends = [KeyedStateBackend(instance_dir(url, "local", i, local), DESCRIPTORS[:2], M,
                                  key_group_range_for_subtask(M, 2, i)) for i in range(2)]
    for b, idx in zip(backends, route(KEYS, M, 2), strict=True):
        b.value_state("totals").put_many([KEYS[i] for i in idx], [
            {"count": i, "sum": 0.0, "flag": True, "small": 1, "ratio": 1.0} for i in idx])
    meta = checkpoint_backends(store, backends, parent=None)
    close_all(backends)
    want = cli_dump(url, "local", str(tmp_path / "d.jsonl"))
    store.storage.delete_many([f.path for h in meta.subtasks for f in h.shared_files])

    df = read_state(spark, url, "local", state="totals",
                    options=ReadOptions(local_dir=local, reader=reader))
    assert uses_jvm(df) == (reader == "auto")
    assert as_dump_values(df.toArrow(), BY_NAME["totals"]) == expected(want, "totals")
    elsewhere = read_state(spark, url, "local", state="totals",
                           options=ReadOptions(local_dir=str(tmp_path / "elsewhere"),
                                               reader=reader))
    with pytest.raises(Exception) as err:
        elsewhere.collect()
    if reader == "python":
        assert "TaskFailedError: subtask " in str(err.value)
        assert "restore failed" in str(err.value)
    else:
        assert re.search(r"state 'totals' of subtask \d: \S+/shared/\S+\.sst is missing: the "
                         r"checkpoint lost a file", str(err.value))


# -- the hold lease: GC and retention during a read ---------------------------------------

def _retain_and_gc(url: str, job: str) -> None:
    assert cli.main(["--storage", url, "--job", job, "retain", "--keep", "1"]) == 0
    assert cli.main(["--storage", url, "--job", job, "gc", "--grace-seconds", "0"]) == 0


def two_checkpoints_apart(tmp_path) -> tuple[str, CheckpointStore]:
    """Checkpoints 1 and 2 that share no SST (compacted in between): retiring 1 deletes
    every file of it."""
    url = f"file://{tmp_path}/store"
    store = CheckpointStore(open_storage(url), "held")
    backends = open_backends(str(tmp_path / "work"), 2, M)
    fill(backends, keys(500))
    checkpoint_backends(store, backends, parent=None)
    fill(backends, keys(500), version=1)
    for b in backends:
        b.compact()
    checkpoint_backends(store, backends, parent=1)
    close_all(backends)
    return url, store


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["auto", "python"])
def test_gc_and_retention_during_a_read_delete_nothing_it_needs(spark, tmp_path, capsys,
                                                                reader):
    """The JVM reader's tasks hold the checkpoint with leases of the Python format (GC
    parses them strictly), as the Python tasks do."""
    url, store = two_checkpoints_apart(tmp_path)
    want = cli_dump(url, "held", str(tmp_path / "chk1.jsonl"), "1")
    files = [f.path for f in store.load(1).files]
    go = tmp_path / "go"
    df = read_state(spark, url, "held", checkpoint=1, state="totals",
                    options=ReadOptions(pause_file=str(go), reader=reader))
    assert uses_jvm(df) == (reader == "auto")
    result: dict = {}

    def action() -> None:
        try:
            result["table"] = df.toArrow()
        except Exception as exc:  # noqa: BLE001 - reported by the test below
            result["error"] = exc

    reader = threading.Thread(target=action)
    reader.start()
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"go.paused-{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and reader.is_alive(), result
        time.sleep(0.1)
    held = [x for x in list_leases(store.storage) if x.purpose.startswith("read_state")]
    assert sorted(x.checkpoint_ids for x in held) == [(1,), (1,)]
    _retain_and_gc(url, "held")  # while both tasks hold checkpoint 1
    assert store.checkpoint_ids() == [1, 2]
    assert all(store.storage.exists(p) for p in files)
    go.touch()
    reader.join(300)
    assert "error" not in result, result.get("error")
    assert as_dump_values(result["table"], HELD_TOTALS) == expected_plain(want, "totals")
    # the read released its leases: the same commands now retire checkpoint 1 and its files
    assert not [x for x in list_leases(store.storage) if x.purpose.startswith("read_state")]
    _retain_and_gc(url, "held")
    capsys.readouterr()
    assert store.checkpoint_ids() == [2]
    assert not any(store.storage.exists(p) for p in files)


def expected_plain(dump: list[dict], state: str) -> list[str]:
    return canonical([{"key": r["key"], "user_key": None, "value": r["value"],
                       "key_group": r["key_group"], "subtask": r["subtask"]}
                      for r in dump if r["state"] == state])


@pytest.mark.parametrize("reader", ["auto", "python"])
def test_a_checkpoint_retired_before_the_action_fails_the_read_in_one_line(spark, tmp_path,
                                                                         capsys, reader):
    url, store = two_checkpoints_apart(tmp_path)
    df = read_state(spark, url, "held", checkpoint=1, state="totals",
                    options=ReadOptions(reader=reader))
    assert uses_jvm(df) == (reader == "auto")
    _retain_and_gc(url, "held")  # nothing holds checkpoint 1 before the action runs
    capsys.readouterr()
    with pytest.raises(Exception) as err:
        df.count()
    assert ("checkpoint 1 of job 'held' was retired or replaced after read_state planned "
            "the read; read it again") in str(err.value)


# -- the docs' example --------------------------------------------------------------------

def test_the_docs_example_runs_and_matches_pandas(spark, monkeypatch, capsys):
    """The example of docs/state-as-data.md's "Read state", executed as written: its
    per-category sums equal pandas over the same input rows."""
    doc = (Path(ROOT) / "docs" / "state-as-data.md").read_text()
    section = doc.split("## Read state\n", 1)[1].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    monkeypatch.syspath_prepend(ROOT)
    namespace: dict = {}
    exec(compile(snippet, "docs/state-as-data.md", "exec"), namespace)  # noqa: S102 - our doc
    assert "user_key" in capsys.readouterr().out  # the printed schema

    rows = pd.concat([pd.DataFrame(d) for d in namespace["days"]], ignore_index=True)
    want = (rows.assign(category=rows["category"].str.lower())  # the job's normalize_case
            .groupby("category").size())
    got = {r["user_key"]: r["events"] for r in namespace["per_category"].collect()}
    assert got == {k: int(v) for k, v in want.items()}
    assert namespace["counts"].count() == rows.assign(
        category=rows["category"].str.lower())[["user", "category"]].drop_duplicates().shape[0]


def test_the_timers_read_as_a_table_equal_the_dump(spark, tmp_path):
    """``state="_timers"``: key, time, domain, tag per timer, as `ckpt dump` lists them."""
    root = f"file://{tmp_path}/store"
    tables = {n: pa.Table.from_pandas(t, preserve_index=False)
              for n, t in kinds_tables(np.random.default_rng(3)).items()}
    seed = bootstrap_state(KINDS, root, "seed", tables, parallelism=2, max_parallelism=32)
    (tmp_path / "in").mkdir()
    pd.DataFrame({"k": ["u1"], "ts": [50]}).to_parquet(tmp_path / "in" / "part.parquet")
    run_job(KINDS, RunConfig(input=str(tmp_path / "in"), storage=root, job="kinds", run_id="r",
                             output=str(tmp_path / "out"), engine="local", logical_time_ms=0,
                             start_from=seed["start_from"]))
    got = read_state(spark, root, "kinds", state="_timers").toArrow()
    assert got.schema.names == ["key", "time", "domain", "tag", "key_group", "subtask"]
    dump = [r for r in cli_dump(root, "kinds", str(tmp_path / "dump.jsonl"))
            if r["state"] == "_timers"]
    want = sorted((r["key"], r["value"]["time"], r["value"]["kind"], r["user_key"] or "",
                   r["key_group"], r["subtask"]) for r in dump)
    assert len(want) == len(tables["_timers"]) > 0
    assert sorted((r["key"], r["time"].timestamp() * 1000 // 1, r["domain"], r["tag"],
                   r["key_group"], r["subtask"]) for r in got.to_pylist()) == want
