"""`bench_sessionization.py --backends`: our backends side by side, each in a process of
its own. Small input (``--quick``); checks the tool, not speed: every backend runs the
same days and emits the same sessions per run (the bench refuses otherwise), the free
stand-in too (it keeps the state), the no-state stand-in none, and the medians table
names each backend once with its ratio to RocksDB."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_backends_side_by_side():
    proc = subprocess.run(
        [sys.executable, "bench/bench_sessionization.py", "--backends",
         "rocksdb,memory,free,no-state", "--repeats", "1", "--quick"],
        env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    emitted = dict(re.findall(r"^  (\S+)\s+series 1: .* emitted (\[.*\])$", proc.stdout, re.M))
    assert set(emitted) == {"rocksdb", "memory", "free", "no-state"}, proc.stdout
    assert emitted["rocksdb"] == emitted["memory"] == emitted["free"] != "[0, 0, 0]"
    assert emitted["no-state"] == "[0, 0, 0]"
    table = proc.stdout.split("medians")[1]
    rows = re.findall(r"^  (rocksdb|memory|free|no-state) .* ([\d.]+)x, ([\d.]+)x, ([\d.]+)x$",
                      table, re.M)
    assert [r[0] for r in rows] == ["rocksdb", "memory", "free", "no-state"]
    assert rows[0][1:] == ("1.00", "1.00", "1.00")
    assert float(rows[2][3]) == float(rows[3][3]) == 0.0  # the stand-ins write no bytes
    assert re.search(r"^  per event \(all runs\): rocksdb [\d.]+ us .* free [\d.]+ us "
                     r"\(\+0\.00 over free\), no-state .*$", table, re.M), table
    assert re.search(r"^  ceiling: state that costs nothing \(free\) runs at [\d.]+x "
                     r"RocksDB's events/s; ", table, re.M), table
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
           "(the memory backend's is 0.25 us, 0.33x RocksDB's)" in out
    assert "the ratio stays under 3.00x" in out
    assert "ceiling" not in out  # no-state closes no session: not a ceiling


def test_the_ceiling_of_any_backend(capsys):
    """The free stand-in (state that costs nothing) is the floor when it ran: at 0.625 us
    per event it takes more than the 0.5 us of 2x RocksDB (1 us), so even state kept at
    no cost does not reach 2x; at 0.25 us it leaves a backend 0.25 us."""
    sys.path.insert(0, ROOT)
    from bench.bench_sessionization import print_cost_above_stand_in

    print_cost_above_stand_in({"rocksdb": {"events_per_s": 1e6}, "memory": {
        "events_per_s": 1.25e6}, "free": {"events_per_s": 1.6e6},
        "no-state": {"events_per_s": 4e6}})
    out = capsys.readouterr().out
    assert "memory 0.80 us (+0.18 over free), free 0.62 us (+0.00 over free)" in out
    assert "ceiling: state that costs nothing (free) runs at 1.60x RocksDB's events/s; 2x is " \
           "out of reach even of state kept at no cost: the job's and the engine's work " \
           "beside it take 0.62 us per event, more than the 0.50 us of 2x" in out
    assert "needs 0.50 us per event: less than free's 0.62 us, so no backend's cost fits " \
           "(the memory backend's is 0.18 us, 0.47x RocksDB's)" in out
    print_cost_above_stand_in({"rocksdb": {"events_per_s": 1e6}, "free": {
        "events_per_s": 4e6}})
    assert "runs at 4.00x RocksDB's events/s; 2x leaves a backend 0.25 us per event" in \
        capsys.readouterr().out


def test_backends_refuses_an_unknown_one():
    proc = subprocess.run(
        [sys.executable, "bench/bench_sessionization.py", "--backends", "rocksdb,heap"],
        env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2 and "--backends: ['heap'] not among" in proc.stderr


def test_a_stand_in_refuses_a_job_it_does_not_cover_in_one_line():
    """The dedup job's state has a TTL: `--backend free` stops before any run."""
    proc = subprocess.run(
        [sys.executable, "bench/bench_dedup.py", "--backend", "free", "--modes", "warm",
         "--quick"], env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, capture_output=True,
        text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("--backend free: the free stand-in keeps value states "
                                   "without a TTL only: dedup's state 'seen' is a value "
                                   "state with a TTL"), proc.stderr[-2000:]
