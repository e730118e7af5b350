"""Fewer garbage collections while subtasks run: the raised threshold holds exactly while
one runs, the process's own comes back after the last, and what the process chose (a
higher threshold, collection off, ``CKPT_PYTHON_GC_THRESHOLD=0``) stands."""

from __future__ import annotations

import gc
import threading

import pyarrow as pa
import pytest

from statebackend.errors import UsageError
from statebackend.job import BatchContext, Input, Job, RunConfig, Vectorized, run_job
from statebackend.python_gc import fewer_collections
from statebackend.settings import check_environment


@pytest.fixture(autouse=True)
def own_threshold(monkeypatch):
    monkeypatch.delenv("CKPT_PYTHON_GC_THRESHOLD", raising=False)
    saved, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)
    (gc.enable if enabled else gc.disable)()


def test_raised_while_a_subtask_runs_and_given_back():
    with fewer_collections():
        assert gc.get_threshold() == (20_000, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_given_back_by_the_last_of_concurrent_subtasks():
    first_in, second_out, seen = threading.Event(), threading.Event(), []

    def second() -> None:
        first_in.wait()
        with fewer_collections():
            seen.append(gc.get_threshold()[0])
        second_out.set()

    thread = threading.Thread(target=second)
    thread.start()
    with fewer_collections():
        first_in.set()
        second_out.wait()
        assert gc.get_threshold()[0] == 20_000  # the other subtask left; this one runs
    thread.join()
    assert seen == [20_000]
    assert gc.get_threshold() == (700, 10, 10)


def test_given_back_when_the_subtask_fails():
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("the subtask failed")
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("threshold", [(50_000, 5, 5), (0, 10, 10)])
def test_the_process_choice_stands(threshold):
    gc.set_threshold(*threshold)
    with fewer_collections():
        assert gc.get_threshold() == threshold
    assert gc.get_threshold() == threshold


def test_collection_turned_off_stays_off():
    gc.disable()
    with fewer_collections():
        assert gc.get_threshold() == (700, 10, 10) and not gc.isenabled()
    assert not gc.isenabled()


def test_the_setting(monkeypatch):
    monkeypatch.setenv("CKPT_PYTHON_GC_THRESHOLD", "0")
    with fewer_collections():
        assert gc.get_threshold() == (700, 10, 10)
    monkeypatch.setenv("CKPT_PYTHON_GC_THRESHOLD", "5000")
    with fewer_collections():
        assert gc.get_threshold() == (5_000, 10, 10)
    monkeypatch.setenv("CKPT_PYTHON_GC_THRESHOLD", "lots")
    with pytest.raises(UsageError, match="CKPT_PYTHON_GC_THRESHOLD='lots'"):
        check_environment()


def record_threshold(batch: pa.Table, ctx: BatchContext) -> None:
    ctx.count("threshold", gc.get_threshold()[0])


@pytest.mark.parametrize("setting", [None, "0"])
def test_a_local_run_processes_with_the_raised_threshold(tmp_path, monkeypatch, setting):
    """Through the job API: the job's logic sees the threshold, the caller gets its own back."""
    if setting is not None:
        monkeypatch.setenv("CKPT_PYTHON_GC_THRESHOLD", setting)
    job = Job(name="gc", input=Input(pa.schema([("key", pa.string())]), "key"),
              logic=Vectorized(record_threshold))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part.jsonl").write_text('{"key": "a"}\n')
    summary = run_job(job, RunConfig(input=str(tmp_path / "in"), storage=str(tmp_path / "ck"),
                                     run_id="r1", parallelism=1, engine="local",
                                     quarantine=str(tmp_path / "quarantine"),
                                     local_dir=str(tmp_path / "local")))
    assert summary["counters"] == {"threshold": 700 if setting else 20_000}
    assert gc.get_threshold() == (700, 10, 10)
