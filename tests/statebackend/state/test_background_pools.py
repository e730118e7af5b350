"""RocksDB's flush and compaction pools are process-wide: `rocks_options` sizes them to the
cores, so subtasks running in threads of one process (the local engine, a local rescale)
flush and compact at once instead of queueing on one thread each (backend.py,
`background_pools`). RocksDB names its pool threads ``rocksdb:low`` and ``rocksdb:high``;
each check runs in a new process, whose pools nothing else has sized yet."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

THREADS_AFTER = """
import collections, json, os, sys, tempfile, threading
from rocksdict import Rdict, WriteBatch
from statebackend.state.backend import KeyedStateBackend, rocks_options
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

if sys.argv[1] == "plain":  # RocksDB's own sizing, from an instance's options alone
    opts = rocks_options()
    Rdict(tempfile.mkdtemp(), opts).close()
else:  # what the local engine's subtasks do: instances opened in threads, then flushed
    def subtask(i):
        b = KeyedStateBackend(tempfile.mkdtemp(), [StateDescriptor("v", "value")], 128,
                              KeyGroupRange(0, 127))
        state = b.value_state("v")
        for j in range(100):
            state.put(f"k{j}", j)
        b.take_local_snapshot()  # flushes the memtable (the high pool)
        b.close()
    threads = [threading.Thread(target=subtask, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
print(json.dumps(pool_threads()))
"""


def pool_threads(mode: str) -> dict[str, int]:
    res = subprocess.run([sys.executable, "-c", THREADS_AFTER, mode], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_an_instance_sizes_the_pools_to_the_cores():
    cores = os.cpu_count() or 1
    assert pool_threads("plain") == {"rocksdb:low": cores, "rocksdb:high": cores}


def test_subtasks_in_threads_share_pools_of_one_thread_per_core():
    cores = os.cpu_count() or 1
    threads = collections.Counter(pool_threads("subtasks"))
    assert threads == {"rocksdb:low": cores, "rocksdb:high": cores}
