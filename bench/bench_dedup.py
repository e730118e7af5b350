"""Bench: our dedup job vs Spark 4.3 ``dropDuplicatesWithinWatermark`` (same semantics).

Same generated input as the sessionization bench (`bench.peers.events`: exact copies
in a batch, re-sends one or two days later, late deliveries), local[2], P = 2:

- ours:  ``jobs.dedup`` once per day, ``ttl_days=1`` and ``allowed_lateness_minutes=
  1440`` (an event-time TTL state, purged through its expiry index);
- spark: `bench.peers.spark_dedup` (``withWatermark("1 day")`` +
  ``dropDuplicatesWithinWatermark``: Spark's one delay is both the lateness and the
  TTL), RocksDBStateStoreProvider, one ``availableNow`` query start per day.

Modes (``--modes``, default ``interleaved,warm,process,connect``):

- ``interleaved``: one warm session, the two sides alternate day by day (ours first
  on even days, Spark first on odd ones), so a machine whose load moves during the
  bench weighs on both alike; also prints our run's split (driver: watermark scan;
  tasks: logic, purge, snapshot) per day;
- ``warm``: one warm session, all of our days, then all of Spark's;
- ``process``: a new process per run;
- ``connect``: a new Spark Connect client process per run, one warm server.

Prints events/s, bytes written to checkpoint storage per run, state operations per
second (one lookup per accepted event plus one insert per emitted row, the same count
for both) and the ratios ours/spark. Goals: >= 2x (>= 3x warm with
``--engine spark``: issue 24).

    python bench/bench_dedup.py --quick     # 3 days x 20,000 events
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.bench_sessionization import (  # noqa: E402
    DEFAULT_MODES,
    MASTER,
    P,
    Run,
    bench,
    make_input,
    ours_config,
    output_rows,
    parse,
    report,
    stand_in,
)

DAY_MS = 24 * 60 * 60 * 1000
OPTIONS = {"ttl_days": 1, "allowed_lateness_minutes": 1440}


def interleaved(args, job, peer_run_batches, work: str) -> dict:
    """Both sides in one warm session, alternating per day; see the module docstring."""
    from statebackend.job import run_job
    from statebackend.spark.session import get_spark

    days = make_input(args, work)
    spark = get_spark(MASTER, app_name="bench-dedup-interleaved")
    peer_dir = f"{work}/spark-i"

    def ours(i: int, day: str, root: str) -> Run:
        started = time.perf_counter()
        s = run_job(job, ours_config(job.name, day, i, root, OPTIONS), spark)
        wall = time.perf_counter() - started
        t, logic = s["timings"], s["logic_timings"]
        if root.endswith("ours-i"):
            print(f"  ours day {i}: {wall:.2f}s; tasks (summed over {P} subtasks): logic "
                  f"{logic.get('processing', 0):.2f}s purge {logic.get('purge', 0):.2f}s "
                  f"snapshot {t['snapshotting']:.2f}s restore {t['restoring']:.2f}s; "
                  f"{s['bytes_uploaded']:,} bytes; {s['ttl_purged']:,} purged", flush=True)
        return Run(s["events_read"], output_rows(root, s["run_id"]), wall, s["bytes_uploaded"])

    def peer(i: int, day: str, root: str) -> Run:
        (st,) = peer_run_batches(spark, [day], f"{root}/checkpoint", f"{root}/output",
                                 source_dir=f"{root}/source", shuffle_partitions=P,
                                 start_run=i, ttl_ms=DAY_MS)
        return Run(st.events, st.emitted, st.wall_s, st.checkpoint_bytes)

    # Unmeasured warm-up of both sides (first Python workers, class loading).
    ours(0, days[0], f"{work}/ours-i-warm-up")
    peer(0, days[0], f"{work}/spark-i-warm-up")
    mine, theirs = [], []
    for i, day in enumerate(days):
        if i % 2 == 0:
            mine.append(ours(i, day, f"{work}/ours-i"))
            theirs.append(peer(i, day, peer_dir))
        else:
            theirs.append(peer(i, day, peer_dir))
            mine.append(ours(i, day, f"{work}/ours-i"))
    spark.stop()
    return report("dedup", "warm session, interleaved per day", mine, theirs,
                  warm_goal(args.engine))


def warm_goal(engine: str) -> float:
    """Issue 24 asks 3x of the Spark engine warm; the local engine's goal is 2x."""
    return 3.0 if engine == "spark" else 2.0


def main(argv: list[str] | None = None) -> int:
    from bench.peers import spark_dedup as peer
    from jobs import dedup

    args = parse(argv, __doc__)
    stand_in(args.backend, dedup.JOB)
    modes = args.modes.split(",")
    if args.modes == DEFAULT_MODES:
        modes.insert(0, "interleaved")
    if "interleaved" in modes:
        work = args.work or tempfile.mkdtemp(prefix="bench-dedup-i-")
        load = os.getloadavg()
        print(f"dedup interleaved under {work}; load average {load[0]:.1f} {load[1]:.1f}")
        interleaved(args, dedup.JOB, peer.run_batches, work)
        print(f"  load average at the end {os.getloadavg()[0]:.1f}")
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    rest = [m for m in modes if m != "interleaved"]
    if rest:
        args.modes = ",".join(rest)
        bench(args, "dedup", dedup.JOB, "jobs.dedup", OPTIONS, "bench.peers.spark_dedup",
              peer.run_batches, {"ttl_ms": DAY_MS}, ["--ttl-ms", str(DAY_MS)],
              {"warm": warm_goal(args.engine), "process": 2.0, "connect": 2.0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
