"""The local engine's worker processes (statebackend.worker_processes): work and its
errors cross the pipe intact, a dead worker fails its work in one line and is replaced,
prints cannot corrupt the pipe, and the workers run a fresh interpreter (not this
process's ``__main__``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from statebackend.errors import CorruptStateError
from statebackend.worker_processes import WorkerDiedError, WorkerPool


class Unrebuildable(Exception):
    """Not one of statebackend.errors: it comes back as a RuntimeError with its text."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}+{b}")


def work(kind: str, value: int) -> tuple[int, int]:
    if kind == "print":
        print("a line on stdout", value)  # must not reach the pipe
    elif kind == "corrupt":
        raise CorruptStateError(f"damaged block {value}")
    elif kind == "unrebuildable":
        raise Unrebuildable(value, 1)
    elif kind == "not json":
        return {1, 2}  # type: ignore[return-value]
    elif kind == "die":
        os._exit(3)
    return value * 2, os.getpid()


@pytest.fixture
def pool():
    pool = WorkerPool(2)
    yield pool
    pool.close()


def test_work_runs_in_other_processes_with_this_import_path(pool):
    results = [f.result(timeout=60) for f in [pool.submit(work, "print", i) for i in range(6)]]
    assert [r[0] for r in results] == [i * 2 for i in range(6)]
    pids = {r[1] for r in results}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    assert pool.started()


def test_an_unguarded_script_runs_once(tmp_path):
    """The workers never run the caller's ``__main__`` again (multiprocessing's spawn and
    forkserver would: a script without a ``__main__`` guard would run in every worker)."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os\n"
        "from statebackend.worker_processes import worker_pool\n"
        "print('script ran', flush=True)\n"
        "print('answer', worker_pool().submit(os.getpid).result(timeout=60) != os.getpid())\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.splitlines() == ["script ran", "answer True"]


def test_errors_come_back_as_their_type_or_as_one_line(pool):
    """Our error types as themselves, any other as a RuntimeError line; nothing is
    unpickled (the pipe carries JSON)."""
    with pytest.raises(CorruptStateError, match="damaged block 7"):
        pool.submit(work, "corrupt", 7).result(timeout=60)
    with pytest.raises(RuntimeError, match=r"^Unrebuildable: 5\+1$"):
        pool.submit(work, "unrebuildable", 5).result(timeout=60)
    with pytest.raises(RuntimeError, match="TypeError: Object of type set is not JSON"):
        pool.submit(work, "not json", 0).result(timeout=60)
    assert pool.submit(work, "ok", 1).result(timeout=60)[0] == 2  # the worker lives on


def test_a_dead_worker_fails_its_work_in_one_line_and_is_replaced():
    pool = WorkerPool(1)
    try:
        first_pid = pool.submit(work, "ok", 1).result(timeout=60)[1]
        with pytest.raises(WorkerDiedError, match=r"exited with code 3 while it ran work$"):
            pool.submit(work, "die", 0).result(timeout=60)
        value, pid = pool.submit(work, "ok", 4).result(timeout=60)
        assert value == 8 and pid != first_pid
    finally:
        pool.close()


def test_cancelled_work_never_runs(pool):
    futures = [pool.submit(work, "ok", i) for i in range(20)]
    cancelled = [f for f in futures[5:] if f.cancel()]
    for f in futures:
        if f not in cancelled:
            assert f.result(timeout=60)[0] % 2 == 0
    assert all(f.cancelled() for f in cancelled)


def _exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_idle_workers_exit_and_the_next_use_starts_them_again():
    """A worker process left without work for ``idle_seconds`` exits (its memory is
    given back); the pool then says it has no worker running, and serves the next
    work with a new one. Work arriving meanwhile is never left unserved."""
    pool = WorkerPool(2, idle_seconds=0.5)
    try:
        pool.start((__name__,))
        assert pool.started()
        first = {pool.submit(work, "ok", i).result(timeout=60)[1] for i in range(4)}
        deadline = time.monotonic() + 30
        while pool.started() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pool.started()
        deadline = time.monotonic() + 30
        while not all(_exited(pid) for pid in first) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_exited(pid) for pid in first)
        # near the idle limit, work keeps arriving: all of it is served
        for _ in range(5):
            futures = [pool.submit(work, "ok", i) for i in range(3)]
            assert [f.result(timeout=60)[0] for f in futures] == [0, 2, 4]
            time.sleep(0.45)
        value, pid = pool.submit(work, "ok", 21).result(timeout=60)
        assert value == 42 and pid not in first and pool.started()
    finally:
        pool.close()
