"""Issue 20, defect 1: a writer paused past its lease never forks the lineage.

Writer A is a separate process (tests/lineage/paused_writer.py) that stops itself with
SIGSTOP right before one storage write of its commit path (parametrized: the `_metadata`
create, the commit-log entry, the ledger record ...). The test waits until A's lease has
lapsed, runs writer B (it takes the lease over, fences the lineage and commits its own
run), then resumes A. Whatever A does next, the lineage has no fork, A's run is committed
exactly when A says so, and the latest checkpoint equals pandas over the committed runs;
re-running A's run then counts it once. Before the fix, A committed a second child of
checkpoint 1 and day 1 was lost silently.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from demo.sample_data import DAY_MS, DEFAULT_START_TS_MS, expected_totals, generate_events
from jobs.keyed_aggregation import JobConfig, run
from statebackend.lifecycle.doctor import diagnose
from tests.conftest import ROOT, S3_BUCKET
from tests.jobs.helpers import assert_state_equals, dump_latest, store_of

TTL = 2.0
CASES = [("local", "file", k) for k in range(7)] + [
    ("local", "s3", 0), ("local", "s3", 1), ("spark", "file", 0), ("spark", "file", 1)]


def _day(tmp_path, d: int):
    return generate_events(str(tmp_path / f"in{d}"), n_events=400, n_keys=60, seed=500 + d,
                           start_ts_ms=DEFAULT_START_TS_MS + d * DAY_MS)


def _run(tmp_path, storage: str, d: int, run_id: str) -> dict:
    return run(JobConfig(input=str(tmp_path / f"in{d}"), storage=storage, job="agg",
                         run_id=run_id, output=str(tmp_path / "out"), parallelism=2,
                         engine="local"))


def _wait_for_pause(proc: subprocess.Popen, marker: str, timeout: float = 240.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(marker) and os.path.getsize(marker):
            with open(marker) as fh:
                return fh.read()
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"writer A ended (rc {proc.returncode}) without pausing:\n{out}\n{err}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("writer A never reached its pause point")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine, scheme, pause_at", CASES,
                         ids=[f"{e}-{s}-write{k}" for e, s, k in CASES])
def test_a_paused_writer_never_forks_the_lineage(tmp_path, monkeypatch, request, engine,
                                                 scheme, pause_at):
    monkeypatch.setenv("CKPT_LEASE_TTL_SECONDS", str(TTL))
    monkeypatch.delenv("CKPT_LEASE_HEARTBEAT_SECONDS", raising=False)
    if scheme == "s3":
        request.getfixturevalue("s3_server")
        storage = f"s3://{S3_BUCKET}/paused-{os.getpid()}-{pause_at}-{engine}"
    else:
        storage = f"file://{tmp_path}/store"
    days = [_day(tmp_path, d) for d in range(3)]
    _run(tmp_path, storage, 0, "r0")

    marker = str(tmp_path / "paused")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.lineage.paused_writer", str(tmp_path / "in1"), storage,
         str(tmp_path / "out"), "r1", str(pause_at), marker, engine],
        cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        where = _wait_for_pause(proc, marker)
        time.sleep(TTL + 0.5)  # frozen past its lease
        b = _run(tmp_path, storage, 2, "r2")  # takes the lease over, fences, commits
        assert b["skipped"] is False
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    store = store_of(storage, "agg")
    committed = [r for r in ("r0", "r1", "r2") if store.find_run(r) is not None]
    assert "r2" in committed and "r0" in committed
    assert proc.returncode in (0, 3), err
    # A commits exactly when it says so; paused before its `_metadata`, it is fenced off
    assert (proc.returncode == 0) == ("r1" in committed), (where, out, err)
    if pause_at == 0:
        assert proc.returncode == 3 and "r1" not in committed, (where, out, err)
    d = diagnose(store)
    assert [p for p in d.problems if p.blocking] == [], [p.message for p in d.problems]
    metas = [store.load(c) for c in store.checkpoint_ids()]
    assert all(m.parent == prev.checkpoint_id for prev, m in zip(metas, metas[1:],
                                                                 strict=False)), \
        [(m.checkpoint_id, m.parent) for m in metas]
    by_run = {"r0": days[0], "r1": days[1], "r2": days[2]}
    assert_state_equals(dump_latest(storage, "agg"),
                        expected_totals([by_run[r] for r in committed]))
    again = _run(tmp_path, storage, 1, "r1")  # A's run: counted once, whatever happened
    assert again["skipped"] is ("r1" in committed)
    assert_state_equals(dump_latest(storage, "agg"), expected_totals(days))
