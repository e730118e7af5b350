"""The benches' stand-ins for a state backend (bench/state_stand_ins.py), each in a
process of its own (the patches are global).

- ``no-state`` (the ceiling of the keyed-aggregation bench's input side) really keeps no
  state: it patches the memory backend's private write path, so a change there (a new
  table kind, a new write call) must show up here, not as a ceiling that quietly
  stores state. Two runs over the same keys write no state file, and the second run's
  totals are its own events only, as pandas counts them.
- ``free`` (the ceiling of the backends measured on sessionization) keeps the state,
  correctly:
  runs over generated days (late rows, merges, sessions across midnight) emit what the
  pandas reference does, run by run, and write no state file. It refuses the jobs it
  does not cover.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from bench.peers.events import EventsSpec, generate_days, write_days
from bench.state_stand_ins import keep_state_free
from demo.sample_data import generate_events
from jobs import sessionization
from statebackend.job import PerKey, StateTtl, list_state, value_state
from tests.reference.sessions import canonical, sessionize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_driver(script: str, *args: object) -> subprocess.CompletedProcess:
    """``script`` in a Python process of its own (a stand-in patches its process)."""
    return subprocess.run([sys.executable, "-c", script, *map(str, args)],
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def state_files(root) -> list[str]:
    return [f for _, _, files in os.walk(root) for f in files if f.endswith(".kgs")]


DRIVER = """
import json, sys
from bench.state_stand_ins import drop_all_state
from jobs.keyed_aggregation import JOB
from statebackend.job import RunConfig, run_job
drop_all_state()
work, inp = sys.argv[1], sys.argv[2]
for run_id in ("a", "b"):
    run_job(JOB, RunConfig(input=inp, storage=f"file://{work}/store", job="nostate",
                           run_id=run_id, output=f"{work}/out", parallelism=2,
                           local_dir=f"{work}/local", engine="local", backend="memory"))
print(json.dumps("done"))
"""


def test_the_no_state_stand_in_stores_nothing(tmp_path):
    events = generate_events(str(tmp_path / "in"), n_events=3000, n_keys=200, seed=3,
                             start_ts_ms=1_800_000_000_000)
    proc = run_driver(DRIVER, tmp_path, tmp_path / "in")
    assert proc.returncode == 0 and json.loads(proc.stdout) == "done", proc.stderr[-3000:]
    assert state_files(tmp_path) == []
    second = pd.read_parquet(tmp_path / "out" / "run=b").set_index("key")["count"]
    want = events.groupby("key").size()
    assert second.sort_index().tolist() == want.loc[second.sort_index().index].tolist()
    assert len(second) == len(want)


FREE_DRIVER = """
import json, sys
from bench.state_stand_ins import keep_state_free
from jobs.sessionization import JOB
from statebackend.job import RunConfig, run_job
keep_state_free(JOB)
work, days = sys.argv[1], sys.argv[2:]
fired = []
for d, day in enumerate(days):
    s = run_job(JOB, RunConfig(input=day, storage=f"file://{work}/store", job="free",
                               run_id=f"d{d}", output=f"{work}/out", parallelism=2,
                               local_dir=f"{work}/local", engine="local", backend="memory",
                               max_reject_fraction=1.0,
                               options={"gap_minutes": 30, "allowed_lateness_minutes": 60}))
    fired.append(s["timers_fired"])
print(json.dumps(fired))
"""


def test_the_free_stand_in_keeps_state_as_the_reference_says(tmp_path):
    days = generate_days(EventsSpec(days=4, events_per_day=1500, users=80, seed=5))
    # a last day whose watermark is exactly one session's close: its timer must fire
    edge = int(max(d["ts"].max() for d in days)) + 24 * 3_600_000
    days.append(pd.DataFrame({"event_id": [-1, -2], "user": ["edge", "far"],
                              "ts": [edge, edge + 30 * 60_000 + 60 * 60_000],
                              "value": [1.0, 1.0]}))
    dirs = write_days(days, str(tmp_path / "in"))
    ref = sessionize([d[["user", "ts", "value"]] for d in days], 30 * 60_000, 60 * 60_000)
    assert sum(len(r.emitted) for r in ref.runs[1:]) > 0 and sum(r.late for r in ref.runs)
    assert "edge" in set(ref.runs[-1].emitted["user"])
    proc = run_driver(FREE_DRIVER, tmp_path, *dirs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fired = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(fired[1:]) > 0  # its timers are kept and fire
    for d, run in enumerate(ref.runs):
        folder = tmp_path / "out" / f"run=d{d}"
        got = pd.read_parquet(folder) if any(folder.glob("*.parquet")) else None
        if got is None:
            assert run.emitted.empty, f"run {d}"
            continue
        pd.testing.assert_frame_equal(canonical(got), run.emitted, check_dtype=False,
                                      obj=f"run {d}")
    assert state_files(tmp_path) == []  # the state stayed in the stand-in's dicts


@pytest.mark.parametrize(("change", "message"), [
    ({"logic": PerKey(lambda key, rows, state: None)}, "sessionization's logic is PerKey"),
    ({"states": (list_state("sessions"),)}, "state 'sessions' is a list state"),
    ({"states": (value_state("sessions", ttl=StateTtl(60_000)),)},
     "state 'sessions' is a value state with a TTL"),
])
def test_the_free_stand_in_refuses_what_it_does_not_cover(change, message):
    from dataclasses import replace

    with pytest.raises(ValueError, match=message):
        keep_state_free(replace(sessionization.JOB, **change))


UNCOVERED_DRIVER = """
import sys
from bench.state_stand_ins import keep_state_free
from jobs.keyed_aggregation import JOB
from statebackend.job import RunConfig, run_job
keep_state_free(JOB)
work, inp = sys.argv[1], sys.argv[2]
run_job(JOB, RunConfig(input=inp, storage=f"file://{work}/store", job="free", run_id="a",
                       output=f"{work}/out", parallelism=1, local_dir=f"{work}/local",
                       engine="local", backend="memory"))
"""


def test_a_call_the_free_stand_in_does_not_cover_fails_the_run(tmp_path):
    """The keyed aggregation's record state is read column-wise (`value_columns`): the
    stand-in keeps no such state, so the run fails instead of using the memory backend."""
    generate_events(str(tmp_path / "in"), n_events=200, n_keys=20, seed=3,
                    start_ts_ms=1_800_000_000_000)
    proc = run_driver(UNCOVERED_DRIVER, tmp_path, tmp_path / "in")
    assert proc.returncode != 0
    assert "the free stand-in does not cover ValueBatch.value_columns" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (tmp_path / "out" / "run=a").exists()
