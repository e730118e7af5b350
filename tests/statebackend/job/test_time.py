"""Event time, timers and TTL in the job API: the processor (in process) and one run protocol
case (a subtask without rows whose timer is due runs; one with nothing due carries forward)."""

from __future__ import annotations

import sys
from datetime import timedelta

import pandas as pd
import pyarrow as pa
import pytest

from statebackend.errors import UsageError
from statebackend.job import (
    Input,
    Job,
    Output,
    PerKey,
    RunConfig,
    Vectorized,
    run_job,
    split_rows,
    value_state,
)
from statebackend.job.core import SubtaskProcessor
from statebackend.job.spark_direct import max_event_time_read
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.backend_kinds import new_backend
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.timers import iter_timers
from statebackend.state.ttl import StateTtl

M = 128
SCHEMA = pa.schema([("k", pa.string()), ("ts", pa.int64())])
OUT = Output("fired", pa.schema([("k", pa.string()), ("time", pa.int64()),
                                 ("tag", pa.string()), ("seen", pa.int64())]))


def _logic_register(batch: pa.Table, ctx) -> None:
    # one event timer per row at ts + 10, tagged with the row's ts
    ctx.timers.register(batch["k"], [t + 10 for t in batch["ts"].to_pylist()],
                        tags=[str(t) for t in batch["ts"].to_pylist()])
    ctx.state("n").update(batch["k"], [1] * batch.num_rows)


def _vector_handler(timers: pa.Table, ctx) -> None:
    rows = timers.to_pylist()
    ctx.emit("fired", {"k": [r["key"] for r in rows],
                       "time": [r["time"] for r in rows], "tag": [r["tag"] for r in rows],
                       "seen": [ctx.new_watermark] * len(rows)})
    # a follow-up timer at or below the watermark fires in the same pass
    follow = [r for r in rows if r["tag"] == "5"]
    if follow:
        ctx.timers.register([r["key"] for r in follow], [r["time"] + 1 for r in follow],
                            tags=["again"] * len(follow))


def job_with(handler, **inp) -> Job:
    return Job(name="t", input=Input(SCHEMA, "k", event_time="ts", **inp),
               states=(value_state("n"),), outputs=(OUT,), logic=Vectorized(_logic_register),
               on_timer=handler)


def processor(tmp_path, job: Job, kind: str = "rocksdb", **time
              ) -> tuple[KeyedStateBackend, SubtaskProcessor]:
    be = new_backend(kind, str(tmp_path / "db"), job.descriptors, M, KeyGroupRange(0, M - 1))
    return be, SubtaskProcessor(job, be, **time)


def test_vectorized_handler_fires_due_timers_in_time_order(tmp_path):
    be, proc = processor(tmp_path, job_with(Vectorized(_vector_handler)), new_watermark=20)
    proc.process(pa.table({"k": ["a", "b", "a", "c"], "ts": [9, 5, 1, 30]}, schema=SCHEMA))
    result = proc.finish()
    fired = result.outputs["fired"].to_pylist()
    # due: 11 (a/1), 15 (b/5), 19 (a/9); then b's follow-up at 16; c's 40 stays
    assert [(r["k"], r["time"], r["tag"]) for r in fired] == [
        ("a", 11, "1"), ("b", 15, "5"), ("a", 19, "9"), ("b", 16, "again")]
    assert result.timers_fired == 4
    assert [(t.key, t.time) for t in iter_timers(be)] == [("c", 40)]
    assert result.next_times == {"event": 40, "processing": None}
    be.close()


def _per_key_handler(key: str, timers: list, state) -> list[dict]:
    state.count("calls")
    n = state["n"].value(0)
    if timers[0].tag == "1":  # the first call: the chunk holds both of a's due timers
        assert [t.time for t in state.timers.list()] == [40]  # stored, not handed in
        state.timers.delete(40, tag="30")
        state.timers.register(21, tag="again")  # at or below the watermark: a new chunk
    rows = []
    for timer in timers:
        n += 1
        rows.append({"k": key, "time": timer.time, "tag": timer.tag, "seen": n})
    state["n"].update(n)  # the next call of this key sees it
    return rows


# memory: the handler's list of its timers builds the memory backend's derived reverse
# lookup in the middle of a firing pass (statebackend.state.memory_timer_keys)
@pytest.mark.parametrize("kind", ["rocksdb", "memory"])
def test_per_key_handler_once_per_key_per_chunk(tmp_path, kind):
    job = Job(name="t", input=Input(SCHEMA, "k", event_time="ts"), states=(value_state("n"),),
              outputs=(OUT,), logic=Vectorized(_logic_register),
              on_timer=PerKey(_per_key_handler))
    be, proc = processor(tmp_path, job, kind, new_watermark=25)
    proc.process(pa.table({"k": ["a", "a", "a", "b"], "ts": [9, 1, 30, 2]}, schema=SCHEMA))
    result = proc.finish()
    fired = result.outputs["fired"].to_pylist()
    assert [(r["k"], r["time"], r["tag"], r["seen"]) for r in fired] == [
        ("a", 11, "1", 2), ("a", 19, "9", 3), ("b", 12, "2", 2), ("a", 21, "again", 4)]
    # a: its chunk (11, 19), then the pass its handler started (21); b: once
    assert result.counters == {"calls": 3} and result.timers_fired == 4
    assert list(iter_timers(be)) == []  # 40 deleted by the handler
    assert be.keeps_timer_keys  # memory: the handler's list built the reverse lookup
    be.close()


def test_processing_timers_and_ttl_purge(tmp_path):
    def logic(batch, ctx):
        ctx.timers.register(batch["k"], [ctx.processing_time + 5] * batch.num_rows,
                            domain="processing")
        ctx.state("seen").update(batch["k"], [1] * batch.num_rows)

    def handler(timers, ctx):
        ctx.count("processing_fired", timers.num_rows)

    job = Job(name="t", input=Input(SCHEMA, "k"), logic=Vectorized(logic),
              states=(value_state("seen", ttl=StateTtl(100, "processing")),),
              on_timer=Vectorized(handler))
    be, proc = processor(tmp_path, job, processing_time=1000)
    proc.process(pa.table({"k": ["a", "b"], "ts": [1, 2]}, schema=SCHEMA))
    r = proc.finish()
    assert (r.counters, r.ttl_purged) == ({}, 0)  # 1005 > 1000; expiry 1100 > 1000
    assert r.next_times == {"event": None, "processing": 1005}
    proc2 = SubtaskProcessor(job, be, processing_time=1100)
    r2 = proc2.finish()
    assert (r2.counters, r2.ttl_purged, r2.next_times["processing"]) == (
        {"processing_fired": 2}, 2, None)
    be.close()


def test_late_rows_and_api_checks():
    job = Job(name="t", input=Input(SCHEMA, "k", event_time="ts", allowed_lateness=5),
              logic=Vectorized(lambda b, c: None))
    raw = pa.table({"k": ["a", "b", "c", "d"], "ts": ["10", "11", None, "9"]})
    accepted, rejected, reasons = split_rows(job, raw, watermark=10)
    assert accepted["k"].to_pylist() == ["b"]
    assert reasons == {"late": 2, "missing_ts": 1}
    assert rejected["reason"].to_pylist() == ["late", "missing_ts", "late"]
    keep = Job(name="t", input=Input(SCHEMA, "k", event_time="ts", accept_late=True),
               logic=Vectorized(lambda b, c: None))
    assert split_rows(keep, raw, watermark=10)[0].num_rows == 3
    assert Input(SCHEMA, "k", event_time="ts", allowed_lateness=timedelta(minutes=1)
                 ).lateness_ms == 60_000
    with pytest.raises(UsageError, match="on_timer must be Vectorized"):
        Job(name="t", input=Input(SCHEMA, "k"), logic=Vectorized(print), on_timer=print)
    with pytest.raises(UsageError, match="allowed_lateness -1 must be"):
        Job(name="t", input=Input(SCHEMA, "k", event_time="ts", allowed_lateness=-1),
            logic=Vectorized(print))


# -- the run protocol ------------------------------------------------------------------
def _remind(batch: pa.Table, ctx) -> None:
    ctx.timers.register(batch["k"], [ctx.processing_time + 1000] * batch.num_rows,
                        domain="processing")


def _reminded(timers: pa.Table, ctx) -> None:
    ctx.emit("fired", {"k": timers["key"], "time": timers["time"], "tag": timers["tag"],
                       "seen": [ctx.processing_time] * timers.num_rows})


REMIND = Job(name="remind", input=Input(SCHEMA, "k"), outputs=(OUT,),
             logic=Vectorized(_remind), on_timer=Vectorized(_reminded))


def test_subtask_without_rows_runs_when_its_timer_is_due(spark, tmp_path):
    """On the Spark engine: a run with no input and nothing due starts no Spark job (the
    local engine carries every subtask forward); one with a timer due runs on Spark."""
    from pyspark import cloudpickle

    from statebackend.job.run import IDLE_REASON

    # This test module is not importable on the workers: ship its functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    storage, output = f"file://{tmp_path / 'ckpt'}", str(tmp_path / "out")
    (tmp_path / "in0").mkdir()
    (tmp_path / "empty").mkdir()
    pd.DataFrame({"k": ["a"], "ts": [1]}).to_parquet(tmp_path / "in0" / "p.parquet")

    def run(run_id: str, folder: str, logical: int) -> dict:
        return run_job(REMIND, RunConfig(
            input=str(tmp_path / folder), storage=storage, run_id=run_id, output=output,
            parallelism=2, local_dir=str(tmp_path / "local"), logical_time_ms=logical,
            engine="spark"), spark)

    s0 = run("r0", "in0", 5000)
    assert (s0["timers_fired"], s0["processing_time"], s0["engine"]) == (0, 5000, "spark")
    s1 = run("r1", "empty", 5500)  # not due: nothing opened, both carried forward
    assert (s1["timers_fired"], s1["restore_modes"]) == (0, ["none", "none"])
    assert (s1["engine"], s1["engine_reason"]) == ("local", IDLE_REASON)
    s2 = run("r2", "empty", 6000)  # due: the subtask holding "a" runs without rows
    assert s2["timers_fired"] == 1 and s2["restore_modes"].count("none") == 1
    assert s2["engine"] == "spark"
    fired = pd.read_parquet(tmp_path / "out" / "run=r2")
    assert fired[["k", "time", "seen"]].values.tolist() == [["a", 6000, 6000]]


# -- the new watermark: the latest rows, or a pass over every row ----------------------
def test_max_event_time_from_the_latest_rows_or_every_row(spark, tmp_path, monkeypatch):
    """The rows with the latest event times settle the max accepted time unless they are
    all rejected and not late; then every row is validated. Same answer either way, and
    the local engine's pass over every row agrees."""
    import json

    from statebackend.job import spark_engine as run_mod
    from statebackend.job.input import list_input
    from statebackend.job.local_engine import LocalEngine
    from statebackend.progress import NO_PROGRESS

    rows = ([{"k": f"u{i}", "ts": t} for i, t in enumerate((100, 300, 200))]
            + [{"k": None, "ts": t} for t in (900, 800, 700, 600)]  # missing key: rejected
            + [{"k": "x", "ts": "abc"}, {"k": "y", "ts": "250"}])  # text: comes first
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    files = list_input(str(tmp_path / "in"))
    job = Job(name="t", input=Input(SCHEMA, "k", event_time="ts"),
              logic=Vectorized(lambda b, c: None))
    for limit, wm, want in [(100, None, 300),  # every row is a candidate
                            (3, None, 300),    # 3 latest all rejected: every row
                            (3, 650, None),    # the accepted rows are late
                            (6, 750, None),    # the last candidate (300) is late: settled
                            (7, None, 300)]:   # last (250) before the best (300): settled
        monkeypatch.setattr(run_mod, "WATERMARK_CANDIDATES", limit)
        assert run_mod.max_event_time(spark, job, files, wm) == want, (limit, wm)
        local = LocalEngine(files, job).max_event_time(job, wm, 4, NO_PROGRESS, "scan")
        assert local == want, (limit, wm)
        assert max_event_time_read(job, files, wm) == want, (limit, wm)  # a driver's read
