"""The Spark peers of the event-time benches emit what the pandas references say, run by run.

Each peer runs over generated daily batches (late deliveries, repeats, session
splits and merges) with one availableNow query start per day on one checkpoint; its
per-run output must equal the reference's per-run output. Hand-made batches pin the
boundaries (a timer exactly at the watermark fires; a row exactly at the watermark
is late), and one test runs the peer as a new process per run (its ``main``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from bench.peers import read_run_output
from bench.peers import spark_dedup as spark_dedup_peer
from bench.peers import spark_sessionization as spark_sessions_peer
from bench.peers.events import DAY_MS, START_MS, EventsSpec, generate_days, read_day, write_days
from tests.reference import dedup as dedup_ref
from tests.reference import sessions as sessions_ref

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GAP = 30 * 60 * 1000
HOUR = 60 * 60 * 1000


def small_days(tmp_path, seed: int, flush: bool) -> list[str]:
    """3 generated days (+ a far-future event that closes every session, if flush)."""
    days = generate_days(EventsSpec(days=3, events_per_day=1500, users=120, seed=seed, gap_ms=GAP))
    if flush:
        days.append(pd.DataFrame({"event_id": [10**12], "user": ["zz-flush"],
                                  "ts": [START_MS + 30 * DAY_MS], "value": [1.0]}))
    return write_days(days, str(tmp_path / "in"), files_per_day=2)


def spark_sessions(output_dir: str, run: int) -> pd.DataFrame:
    got = read_run_output(output_dir, run)
    return sessions_ref.canonical(got) if len(got) else sessions_ref.empty_sessions()


def assert_same_rows(got: pd.DataFrame, want: pd.DataFrame, run: int) -> None:
    pd.testing.assert_frame_equal(got.astype({"user": object}).reset_index(drop=True),
                                  want.astype({"user": object}).reset_index(drop=True),
                                  check_dtype=False, obj=f"run {run}")


def test_sessionization_peer_equals_reference_run_by_run(spark, tmp_path):
    dirs = small_days(tmp_path, seed=3, flush=True)
    days = [read_day(d) for d in dirs]
    want = sessions_ref.sessionize(days, gap_ms=GAP, lateness_ms=HOUR)
    # The input exercises what matters: late drops, accepted late rows, merges.
    assert all(r.late > 0 for r in want.runs[1:3])
    assert want.open_sessions["user"].tolist() == ["zz-flush"]

    stats = spark_sessions_peer.run_batches(spark, dirs, str(tmp_path / "ckpt"),
                                            str(tmp_path / "out"), gap_ms=GAP, lateness_ms=HOUR)

    for k, (s, r) in enumerate(zip(stats, want.runs, strict=True)):
        assert_same_rows(spark_sessions(str(tmp_path / "out"), k), r.emitted, k)
        assert (s.events, s.late, s.emitted, s.watermark_ms) == \
            (len(days[k]), r.late, len(r.emitted), r.watermark)
        assert s.checkpoint_bytes > 0


def test_sessionization_peer_boundaries(spark, tmp_path):
    t0 = START_MS
    late_probe = t0 + GAP  # == the watermark after run 0
    days = [pd.DataFrame({"event_id": [1, 2, 5, 6], "user": ["a", "b", "d", "d"],
                          "ts": [t0, t0 + GAP + HOUR, t0 + 10, t0 + 10 + GAP],
                          "value": [1.0, 2.0, 16.0, 32.0]}),
            pd.DataFrame({"event_id": [3, 4], "user": ["c", "c"],
                          "ts": [late_probe, late_probe + 1], "value": [4.0, 8.0]}),
            pd.DataFrame({"event_id": [7], "user": ["e"], "ts": [t0 + 9 * DAY_MS],
                          "value": [1.0]})]  # closes everything still open
    dirs = write_days(days, str(tmp_path / "in"), files_per_day=1)
    want = sessions_ref.sessionize(days, gap_ms=GAP, lateness_ms=HOUR)
    # a's timer (t0 + gap) equals the watermark after run 0: it fires in run 0.
    assert want.runs[0].emitted["user"].tolist() == ["a"]
    assert want.runs[1].late == 1
    # d's two events exactly one gap apart are two sessions.
    assert want.runs[2].emitted["user"].tolist() == ["b", "c", "d", "d"]

    stats = spark_sessions_peer.run_batches(spark, dirs, str(tmp_path / "ckpt"),
                                            str(tmp_path / "out"), gap_ms=GAP, lateness_ms=HOUR)

    for k, r in enumerate(want.runs):
        assert_same_rows(spark_sessions(str(tmp_path / "out"), k), r.emitted, k)
    assert [s.late for s in stats] == [0, 1, 0]


def test_dedup_peer_equals_reference_run_by_run(spark, tmp_path):
    ttl = HOUR  # short: ids expire between days, re-sent ones come out again, some rows late
    dirs = small_days(tmp_path, seed=5, flush=False)
    days = [read_day(d) for d in dirs]
    want = dedup_ref.dedup(days, ttl_ms=ttl, lateness_ms=ttl)
    assert all(r.duplicates > 0 and r.expired > 0 for r in want.runs)
    emitted_ids = pd.concat([r.emitted["event_id"] for r in want.runs])
    assert emitted_ids.duplicated().any()  # some id expired and was emitted again
    assert want.runs[1].late > 0

    stats = spark_dedup_peer.run_batches(spark, dirs, str(tmp_path / "ckpt"),
                                         str(tmp_path / "out"), ttl_ms=ttl)

    for k, (s, r) in enumerate(zip(stats, want.runs, strict=True)):
        got = dedup_ref.canonical(read_run_output(str(tmp_path / "out"), k))
        assert_same_rows(got[r.emitted.columns], r.emitted, k)
        assert (s.events, s.late, s.emitted) == (len(days[k]), r.late, len(r.emitted))


def test_dedup_peer_refuses_a_lateness_other_than_the_ttl(tmp_path):
    with pytest.raises(ValueError, match="lateness_ms 5 != ttl_ms 7"):
        spark_dedup_peer.run_batches(None, [], str(tmp_path / "c"), str(tmp_path / "o"),
                                     ttl_ms=7, lateness_ms=5)


def test_sessionization_peer_as_a_new_process_per_run(tmp_path):
    days = generate_days(EventsSpec(days=2, events_per_day=600, users=50, seed=9, gap_ms=GAP))
    dirs = write_days(days, str(tmp_path / "in"), files_per_day=1)
    want = sessions_ref.sessionize([read_day(d) for d in dirs], gap_ms=GAP, lateness_ms=HOUR)
    env = dict(os.environ, PYTHONPATH=ROOT, SPARK_LOCAL_IP="127.0.0.1",
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    work = str(tmp_path / "work")
    for k, day in enumerate(dirs):
        proc = subprocess.run(
            [sys.executable, "-m", "bench.peers.spark_sessionization", "--day", day,
             "--work", work, "--start-run", str(k), "--gap-ms", str(GAP),
             "--lateness-ms", str(HOUR), "--shuffle-partitions", "2"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [stats] = json.loads(proc.stdout.strip().splitlines()[-1])
        assert (stats["run"], stats["events"]) == (k, len(days[k]))
    for k, r in enumerate(want.runs):
        assert_same_rows(spark_sessions(os.path.join(work, "output"), k), r.emitted, k)
