"""Bench: our dedup job vs Spark 4.3 ``dropDuplicatesWithinWatermark`` (same semantics).

Same generated input as the sessionization bench (`bench.peers.events`: exact copies
in a batch, re-sends one or two days later, late deliveries), local[2], P = 2:

- ours:  ``jobs.dedup`` once per day, ``ttl_days=1`` and ``allowed_lateness_minutes=
  1440`` (an event-time TTL state, purged through its expiry index);
- spark: `bench.peers.spark_dedup` (``withWatermark("1 day")`` +
  ``dropDuplicatesWithinWatermark``: Spark's one delay is both the lateness and the
  TTL), RocksDBStateStoreProvider, one ``availableNow`` query start per day.

Runs in one warm session and as a new process per run; prints events/s, bytes
written to checkpoint storage per run, state operations per second (one lookup per
accepted event plus one insert per emitted row, the same count for both) and the
ratios ours/spark. Goal: >= 2x.

    python bench/bench_dedup.py --quick     # 3 days x 20,000 events
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.bench_sessionization import bench, parse  # noqa: E402

DAY_MS = 24 * 60 * 60 * 1000


def main(argv: list[str] | None = None) -> int:
    from bench.peers import spark_dedup as peer
    from jobs import dedup

    args = parse(argv, __doc__)
    bench(args, "dedup", dedup.JOB, "jobs.dedup",
          {"ttl_days": 1, "allowed_lateness_minutes": 1440}, "bench.peers.spark_dedup",
          peer.run_batches, {"ttl_ms": DAY_MS}, ["--ttl-ms", str(DAY_MS)],
          {"warm": 2.0, "process": 2.0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
