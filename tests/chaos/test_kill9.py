"""Real ``kill -9`` of whole job processes (issue 10, slow): recovery is exact and quick.

Each trial starts ``python -m jobs.keyed_aggregation ... --json`` on a big interval,
SIGKILLs its process group at a seeded random moment, then re-runs the same run id and
the next interval, and checks the points below. One trial runs on Spark (its own JVM;
killed 3-25 s after start: JVM start-up, reading, tasks, upload or commit), two on the
local engine (killed 0.5-3 s after start: imports, reading, subtask threads, upload or
commit, all in the one process):

- a stale writer lease left by the kill expires at most one TTL after the kill
  (``CKPT_LEASE_TTL_SECONDS``), and a re-run is refused only until then;
- the final state equals a pandas reference over both intervals;
- every file of every committed checkpoint exists with its recorded size; both runs
  have ``_SUCCESS``; GC with zero grace then removes every orphan of the killed
  attempt and nothing the state needs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest

from demo.sample_data import DAY_MS, DEFAULT_START_TS_MS, expected_totals, generate_events
from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.leases import list_leases
from statebackend.checkpoint.store import CheckpointStore
from statebackend.lifecycle.gc import collect_garbage
from statebackend.storage import open_storage
from tests.chaos.harness import compare_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TTL_SECONDS = 5.0
SLACK_SECONDS = 2.0  # clock reads, process start-up of the refused attempt
JOB = "k9"
# (seed, engine, kill window in seconds after start: the engine's whole run)
TRIALS = ((7, "spark", (3.0, 25.0)), (8, "local", (0.5, 3.0)), (9, "local", (0.5, 3.0)))


def _env(local_dir: str) -> dict:
    env = dict(os.environ)
    env.update({"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
                "PYSPARK_DRIVER_PYTHON": sys.executable, "PYTHONPATH": ROOT,
                "CKPT_LEASE_TTL_SECONDS": str(TTL_SECONDS), "CKPT_LOCAL_DIR": local_dir})
    env.pop("CKPT_LEASE_HEARTBEAT_SECONDS", None)
    return env


def _cmd(input_dir: str, storage: str, output: str, run_id: str, engine: str) -> list[str]:
    return [sys.executable, "-m", "jobs.keyed_aggregation", "--input", input_dir,
            "--storage", storage, "--job", JOB, "--run-id", run_id, "--output", output,
            "--parallelism", "2", "--master", "local[2]", "--engine", engine, "--json"]


def _run_until_admitted(cmd: list[str], env: dict, killed_at: float) -> dict:
    """Run to completion; a refusal (stale lease) is allowed only within TTL of the kill."""
    while True:
        started = time.time()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode == 0:
            return json.loads(proc.stdout.strip().splitlines()[-1])
        assert "busy" in proc.stderr, proc.stderr[-3000:]
        waited = started - killed_at
        assert waited < TTL_SECONDS + SLACK_SECONDS, \
            f"still refused {waited:.1f} s after the kill (TTL {TTL_SECONDS} s): {proc.stderr}"
        time.sleep(0.5)


def _check_store(store: CheckpointStore, expected) -> None:
    latest = store.latest()
    rows = {r["key"]: r["value"] for r in checkpoint_rows(store, latest)
            if r["state"] == "totals"}
    assert compare_state(rows, expected) == []
    stored = {f.path: f.size for f in store.storage.walk_files("")}
    bad = [(f.path, f.size, stored.get(f.path)) for m in store.load_all() for f in m.files
           if stored.get(f.path) != f.size]
    assert bad == [], f"referenced files missing or resized: {bad[:5]}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed, engine, window", TRIALS)
def test_kill9_then_rerun_is_exact(tmp_path, seed, engine, window):
    rng = random.Random(seed)
    days = [generate_events(str(tmp_path / f"in{d}"), n_events=400_000, n_keys=50_000,
                            seed=seed * 10 + d, start_ts_ms=DEFAULT_START_TS_MS + d * DAY_MS,
                            fmt="parquet" if d == 0 else "json")
            for d in range(2)]
    storage, output = f"file://{tmp_path}/store", str(tmp_path / "out")
    env = _env(str(tmp_path / "local"))
    store = CheckpointStore(open_storage(storage), JOB)

    delay = rng.uniform(*window)
    proc = subprocess.Popen(_cmd(str(tmp_path / "in0"), storage, output, "day-0", engine),
                            env=env,
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.wait(timeout=delay)
        finished_first = True  # the run beat the kill: the trial still checks recovery
    except subprocess.TimeoutExpired:
        finished_first = False
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    killed_at = time.time()
    print(f"\nkill -9 trial seed {seed} ({engine}): killed after {delay:.1f} s "
          f"(finished first: {finished_first}); leases left: "
          f"{[(x.purpose, x.expires_at) for x in list_leases(store.storage)]}")

    for lease in list_leases(store.storage):  # a dead writer's lease lapses within one TTL
        lapse = datetime.fromisoformat(lease.expires_at).timestamp() - killed_at
        assert lapse <= TTL_SECONDS + SLACK_SECONDS, (lease, lapse)

    again = _run_until_admitted(_cmd(str(tmp_path / "in0"), storage, output, "day-0", engine),
                                env, killed_at)
    nxt = _run_until_admitted(_cmd(str(tmp_path / "in1"), storage, output, "day-1", engine),
                              env, killed_at)
    assert (again.get("engine", engine), nxt["engine"]) == (engine, engine)
    assert nxt["skipped"] is False and again["checkpoint_id"] < nxt["checkpoint_id"]
    expected = expected_totals(days)
    _check_store(store, expected)
    out = open_storage(output)
    assert out.exists("run=day-0/_SUCCESS") and out.exists("run=day-1/_SUCCESS")

    collect_garbage(store, grace_seconds=0)  # the dead attempt's orphans go, the state stays
    referenced = {f.path for m in store.load_all() for f in m.files}
    leftovers = {f.path for f in store.storage.walk_files("shared")} - referenced
    assert leftovers == set()
    _check_store(store, expected)
    assert list_leases(store.storage) == []
