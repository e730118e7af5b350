"""The Spark engine's two routes to the subtasks (statebackend.job.spark_direct).

A small input is read by the tasks themselves, one per core, each running its
subtasks (direct: one Spark job, no shuffle); a larger one, or the ``spark`` input
reader, goes through Spark's reader and shuffle. Both, and the local engine, must give
bit-identical state and the pandas reference; the rule itself is a pure decision.
"""

from __future__ import annotations

import gzip

import pytest

from jobs import keyed_aggregation as ka
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import UsageError
from statebackend.job import RunConfig, run_job
from statebackend.job.input import (
    DIRECT_READ_MAX_BYTES_ENV,
    InputFiles,
    list_input,
    reads_directly,
)
from statebackend.storage import open_storage
from tests.jobs.run_reference import (
    assert_totals_equal,
    final_state,
    totals_days,
    totals_reference,
)


def _files(total_bytes: int) -> InputFiles:
    return InputFiles("file:///in", ("/in/a.parquet",), (), total_bytes)


def test_direct_read_rule(monkeypatch):
    assert reads_directly(_files(100), "auto", 4, limit=400)
    assert reads_directly(_files(100), "arrow", 4, limit=400)
    assert not reads_directly(_files(100), "auto", 5, limit=400)  # 500 bytes read in all
    assert not reads_directly(_files(100), "spark", 1, limit=10**9)  # Spark's reader asked
    assert reads_directly(_files(0), "auto", 64, limit=0)  # nothing to read
    monkeypatch.setenv(DIRECT_READ_MAX_BYTES_ENV, "0")
    assert not reads_directly(_files(1), "auto", 1)
    monkeypatch.setenv(DIRECT_READ_MAX_BYTES_ENV, "1024")
    assert reads_directly(_files(256), "auto", 4) and not reads_directly(_files(257), "auto", 4)
    monkeypatch.setenv(DIRECT_READ_MAX_BYTES_ENV, "-1")
    with pytest.raises(UsageError, match=DIRECT_READ_MAX_BYTES_ENV):
        reads_directly(_files(1), "auto", 1)


def test_gzip_input_is_weighed_decompressed(tmp_path):
    """A small .jsonl.gz that expands 100-fold is not parsed P times."""
    line = b'{"key": "k", "ts": 1, "value": 1.0}\n'
    (tmp_path / "in").mkdir()
    with gzip.open(tmp_path / "in" / "a.jsonl.gz", "wb") as fh:
        fh.write(line * 30_000)  # about 1 MiB decompressed
    files = list_input(str(tmp_path / "in"))
    assert files.total_bytes * 100 < len(line) * 30_000
    assert reads_directly(files, "auto", 4, limit=4 * len(line) * 30_000)
    assert not reads_directly(files, "auto", 4, limit=4 * files.total_bytes * 10)


def _jobs_started(spark, fn):
    """(fn's result, the Spark jobs it started) on a classic session."""
    tracker = spark.sparkContext.statusTracker()
    before = set(tracker.getJobIdsForGroup())
    result = fn()
    started = sorted(set(tracker.getJobIdsForGroup()) - before)
    return result, [tracker.getJobInfo(j) for j in started]


def test_direct_shuffle_and_local_routes_hold_the_same_state(spark, tmp_path, monkeypatch):
    """Parquet with bad lines (in a JSON file beside), JSON lines, Parquet: every route
    quarantines the same rows and ends in the same state, to the last bit, equal to
    pandas."""
    days = totals_days(str(tmp_path), 3, seed=510)
    routes = {"direct": ("spark", None), "shuffle": ("spark", "0"), "local": ("local", None)}
    summaries: dict[str, list[dict]] = {r: [] for r in routes}
    for d in range(len(days)):
        for route, (engine, limit) in routes.items():
            if limit is None:
                monkeypatch.delenv(DIRECT_READ_MAX_BYTES_ENV, raising=False)
            else:
                monkeypatch.setenv(DIRECT_READ_MAX_BYTES_ENV, limit)
            config = RunConfig(input=str(tmp_path / f"in{d}"), storage=f"file://{tmp_path}/{route}",
                               run_id=f"d{d}", output=str(tmp_path / f"out-{route}"),
                               local_dir=str(tmp_path / "local"), engine=engine,
                               parallelism=3)
            s, jobs = _jobs_started(spark, lambda c=config: run_job(ka.JOB, c, spark))
            summaries[route].append(s)
            if route == "direct":  # one Spark job, one stage: no shuffle, no extra pass;
                # one task per core (local[2]) running the 3 subtasks
                assert [len(j.stageIds) for j in jobs] == [1], d
                stage = spark.sparkContext.statusTracker().getStageInfo(jobs[0].stageIds[0])
                assert stage.numTasks == 2, d
            if route == "shuffle":
                assert len(jobs) >= 1 and sum(len(j.stageIds) for j in jobs) >= 2, d
    assert [s["input_reader"] for s in summaries["direct"]] == ["arrow"] * 3
    assert [s["input_reader"] for s in summaries["shuffle"]] == ["spark+arrow", "arrow", "spark"]
    assert sum(s["events_rejected"] for s in summaries["direct"]) > 0  # the bad lines
    for route in ("shuffle", "local"):
        for got, want in zip(summaries[route], summaries["direct"], strict=True):
            for k in ("events_read", "events_rejected", "keys_touched", "rejects_by_reason"):
                assert got[k] == want[k], (route, k)
    state = final_state(f"file://{tmp_path}/direct", "keyed_aggregation")
    for route in ("shuffle", "local"):
        assert final_state(f"file://{tmp_path}/{route}", "keyed_aggregation") == state, route
    assert_totals_equal(state["totals"], totals_reference(days)[1]["totals"])
    meta = CheckpointStore(open_storage(f"file://{tmp_path}/direct"), ka.JOB.name).latest()
    assert (meta.extra["engine"], meta.extra["input_reader"]) == ("spark", "arrow")
