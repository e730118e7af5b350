"""Cheaper garbage collections while subtasks run: the older objects frozen and the raised
threshold hold exactly while one runs, the process gets its own back after the last, and
what the process chose (a higher threshold, collection off, objects it froze,
``CKPT_PYTHON_GC_THRESHOLD=0``) stands."""

from __future__ import annotations

import gc
import threading
import weakref

import pyarrow as pa
import pytest

from statebackend.errors import UsageError
from statebackend.job import BatchContext, Input, Job, RunConfig, Vectorized, run_job
from statebackend.python_gc import fewer_collections
from statebackend.settings import check_environment

DEFAULT = (700, 10, 10)


@pytest.fixture(autouse=True)
def own_collector(monkeypatch):
    monkeypatch.delenv("CKPT_PYTHON_GC_THRESHOLD", raising=False)
    saved, enabled = gc.get_threshold(), gc.isenabled()
    frozen_before = gc.get_freeze_count() > 0  # by a library of this test process
    gc.unfreeze()
    gc.set_threshold(*DEFAULT)
    yield
    gc.unfreeze()
    if frozen_before:
        gc.freeze()
    gc.set_threshold(*saved)
    (gc.enable if enabled else gc.disable)()


def held() -> tuple[int, bool]:
    """(the youngest generation's threshold, whether objects are frozen)."""
    return gc.get_threshold()[0], gc.get_freeze_count() > 0


class Tracked:
    pass


def collected(obj: object) -> bool:
    """Whether collections look at ``obj`` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_held_while_a_subtask_runs_and_given_back():
    before = Tracked()
    with fewer_collections():
        assert held() == (2_000, True)
        made = Tracked()
        assert not collected(before) and collected(made)
    assert held() == (700, False) and gc.get_threshold() == DEFAULT
    assert collected(before) and collected(made)


def test_given_back_by_the_last_of_concurrent_subtasks():
    first_in, second_out, seen = threading.Event(), threading.Event(), []

    def second() -> None:
        first_in.wait()
        with fewer_collections():
            seen.append(held())
        second_out.set()

    thread = threading.Thread(target=second)
    thread.start()
    with fewer_collections():
        first_in.set()
        second_out.wait()
        assert held() == (2_000, True)  # the other subtask left; this one still runs
    thread.join()
    assert seen == [(2_000, True)]
    assert held() == (700, False)


def test_given_back_when_the_subtask_fails():
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("the subtask failed")
    assert held() == (700, False)


def test_a_failed_subtasks_cycles_are_collected_before_the_next_freeze():
    """A failed attempt's reference cycle (here an object that refers to itself; in a
    run, a traceback's frames holding an open state backend) is collected when the next
    subtask starts, not frozen alive while a retry runs."""
    gc.collect()  # a fresh young generation: no collection comes between by chance
    with pytest.raises(RuntimeError), fewer_collections():
        obj = Tracked()
        obj.cycle = obj  # type: ignore[attr-defined]
        ref = weakref.ref(obj)
        del obj
        raise RuntimeError("the subtask failed")
    with fewer_collections():
        assert ref() is None and held() == (2_000, True)
    assert held() == (700, False)


def test_a_higher_threshold_of_the_process_stands():
    gc.set_threshold(50_000, 5, 5)
    with fewer_collections():
        assert held() == (50_000, True)
    assert gc.get_threshold() == (50_000, 5, 5) and held() == (50_000, False)


@pytest.mark.parametrize("off", ["threshold", "disable"])
def test_a_collector_turned_off_stays_off(off):
    if off == "threshold":
        gc.set_threshold(0, 10, 10)
    else:
        gc.disable()
    with fewer_collections():
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == ((0, 10, 10) if off == "threshold" else DEFAULT)
    assert gc.get_threshold()[0] == (0 if off == "threshold" else 700)
    assert gc.isenabled() == (off == "threshold")


def test_objects_the_process_froze_stay_frozen():
    """Nothing more is frozen, and nothing is unfrozen after (the count itself may drop:
    a frozen object that is freed leaves it)."""
    mine = Tracked()
    gc.freeze()
    with fewer_collections():
        assert gc.get_threshold() == (2_000, 10, 10)
        made = Tracked()
        assert not collected(mine) and collected(made)
    assert not collected(mine) and collected(made)
    assert gc.get_threshold() == DEFAULT


def test_the_setting(monkeypatch):
    monkeypatch.setenv("CKPT_PYTHON_GC_THRESHOLD", "0")
    with fewer_collections():
        assert held() == (700, False)
    monkeypatch.setenv("CKPT_PYTHON_GC_THRESHOLD", "5000")
    with fewer_collections():
        assert held() == (5_000, True)
    monkeypatch.setenv("CKPT_PYTHON_GC_THRESHOLD", "lots")
    with pytest.raises(UsageError, match="CKPT_PYTHON_GC_THRESHOLD='lots'"):
        check_environment()


def record_collector(batch: pa.Table, ctx: BatchContext) -> None:
    ctx.count("threshold", gc.get_threshold()[0])
    ctx.count("frozen", int(gc.get_freeze_count() > 0))


@pytest.mark.parametrize("setting", [None, "0"])
def test_a_local_run_processes_with_the_collector_held(tmp_path, monkeypatch, setting):
    """Through the job API: the job's logic sees the settings, the caller gets its own back."""
    if setting is not None:
        monkeypatch.setenv("CKPT_PYTHON_GC_THRESHOLD", setting)
    job = Job(name="gc", input=Input(pa.schema([("key", pa.string())]), "key"),
              logic=Vectorized(record_collector))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "part.jsonl").write_text('{"key": "a"}\n')
    summary = run_job(job, RunConfig(input=str(tmp_path / "in"), storage=str(tmp_path / "ck"),
                                     run_id="r1", parallelism=1, engine="local",
                                     quarantine=str(tmp_path / "quarantine"),
                                     local_dir=str(tmp_path / "local")))
    assert summary["counters"] == (
        {"threshold": 700, "frozen": 0} if setting else {"threshold": 2_000, "frozen": 1})
    assert held() == (700, False)
