"""The keyed-aggregation bench's no-state stand-in (``ours-no-state``, the ceiling any
backend could reach) really keeps no state: it patches the memory backend's private
write path, so a change there (a new table kind, a new write call) must show up here,
not as a ceiling that quietly stores state. In a process of its own (the patch is
global): two runs over the same keys write no state file, and the second run's totals
are its own events only, as pandas counts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd

from demo.sample_data import generate_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = """
import json, sys
from bench.bench_keyed_aggregation import drop_all_state
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
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), str(tmp_path / "in")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and json.loads(proc.stdout) == "done", proc.stderr[-3000:]
    state_files = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".kgs")]
    assert state_files == []
    second = pd.read_parquet(tmp_path / "out" / "run=b").set_index("key")["count"]
    want = events.groupby("key").size()
    assert second.sort_index().tolist() == want.loc[second.sort_index().index].tolist()
    assert len(second) == len(want)
