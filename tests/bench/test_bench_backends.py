"""`bench_sessionization.py --backends`: our backends side by side, each in a process of
its own. Small input (``--quick``); checks the tool, not speed: every backend runs the
same days and emits the same sessions per run (the bench refuses otherwise), the
no-state stand-in emits none, and the medians table names each backend once with its
ratio to RocksDB."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_backends_side_by_side():
    proc = subprocess.run(
        [sys.executable, "bench/bench_sessionization.py", "--backends",
         "rocksdb,memory,no-state", "--repeats", "1", "--quick"],
        env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    emitted = dict(re.findall(r"^  (\S+)\s+series 1: .* emitted (\[.*\])$", proc.stdout, re.M))
    assert set(emitted) == {"rocksdb", "memory", "no-state"}, proc.stdout
    assert emitted["rocksdb"] == emitted["memory"] and emitted["rocksdb"] != "[0, 0, 0]"
    assert emitted["no-state"] == "[0, 0, 0]"
    table = proc.stdout.split("medians")[1]
    rows = re.findall(r"^  (rocksdb|memory|no-state) .* ([\d.]+)x, ([\d.]+)x, ([\d.]+)x$",
                      table, re.M)
    assert [r[0] for r in rows] == ["rocksdb", "memory", "no-state"]
    assert rows[0][1:] == ("1.00", "1.00", "1.00")
    assert float(rows[2][3]) == 0.0  # the stand-in writes no checkpoint bytes
    assert re.search(r"^  per event \(all runs\): rocksdb [\d.]+ us .* no-state [\d.]+ us "
                     r"\(\+0\.00 over no-state\)$", table, re.M), table
    assert "2x RocksDB's events/s needs" in table


def test_the_cost_over_the_stand_in_and_the_ratios_limit(capsys):
    """1 us, 0.5 us and 0.25 us per event: 2x RocksDB needs 0.5 us, so at most 0.25 us
    over the stand-in (the memory backend's is 0.25 us); the limit is 0.75 / 0.25."""
    sys.path.insert(0, ROOT)
    from bench.bench_sessionization import print_cost_above_stand_in

    print_cost_above_stand_in({"rocksdb": {"events_per_s": 1e6}, "memory": {
        "events_per_s": 2e6}, "no-state": {"events_per_s": 4e6}})
    out = capsys.readouterr().out
    assert "rocksdb 1.00 us (+0.75 over no-state), memory 0.50 us (+0.25 over no-state)" in out
    assert "needs 0.50 us per event: the memory backend's cost over no-state at most 0.25 us " \
           "(now 0.25 us)" in out
    assert "the ratio stays under 3.00x" in out


def test_backends_refuses_an_unknown_one():
    proc = subprocess.run(
        [sys.executable, "bench/bench_sessionization.py", "--backends", "rocksdb,heap"],
        env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2 and "--backends: ['heap'] not among" in proc.stderr
