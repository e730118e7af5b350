"""RocksDB's flush and compaction pools are process-wide: the backend grows them with the
instances open at once, up to the cores (backend.py, `BackgroundPools`). Subtasks
running in threads of one process (the local engine, a local rescale) then flush and
compact at once instead of queueing on one thread each, and a Spark task's worker,
which holds one instance at a time, keeps one thread of each. RocksDB names its pool
threads ``rocksdb:low`` and ``rocksdb:high``; each case runs in a new process, whose
pools nothing else has grown yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
CORES = os.cpu_count() or 1

POOL_THREADS_AFTER = """
import collections, json, os, sys, tempfile
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.kinds import StateDescriptor

def pool_threads():
    names = collections.Counter()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                names[fh.read().strip()] += 1
        except FileNotFoundError:
            continue  # a thread that ended meanwhile (not a pool thread: those stay)
    return {k: v for k, v in names.items() if k.startswith("rocksdb:")}

def subtask():
    b = KeyedStateBackend(tempfile.mkdtemp(), [StateDescriptor("v", "value")], 128,
                          KeyGroupRange(0, 127))
    state = b.value_state("v")
    for j in range(100):
        state.put(f"k{j}", j)
    b.take_local_snapshot()  # flushes the memtable (the high pool)
    return b

at_once, one_after_another = int(sys.argv[1]), int(sys.argv[2])
for _ in range(one_after_another):  # a Spark worker's tasks, one instance at a time
    subtask().close()
held = [subtask() for _ in range(at_once)]  # subtasks in threads of one process
print(json.dumps(pool_threads()))
"""


def pool_threads(at_once: int, one_after_another: int = 0) -> dict[str, int]:
    res = subprocess.run([sys.executable, "-c", POOL_THREADS_AFTER, str(at_once),
                          str(one_after_another)], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_one_instance_at_a_time_keeps_one_thread_of_each():
    assert pool_threads(at_once=1, one_after_another=3) == {"rocksdb:low": 1, "rocksdb:high": 1}


@pytest.mark.parametrize("at_once", [2, 4])
def test_instances_open_at_once_get_a_thread_each_up_to_the_cores(at_once):
    wanted = min(at_once, CORES)
    assert pool_threads(at_once) == {"rocksdb:low": wanted, "rocksdb:high": wanted}
