"""Spark 4.3 peer of our dedup job: ``dropDuplicatesWithinWatermark``.

Semantics: tests/reference/dedup.py with ``lateness_ms == ttl_ms`` (Spark has one
duration for both: the ``withWatermark`` delay). Spark pieces:

- ``withWatermark(event_time, ttl)`` with ``event_time = timestamp_millis(ts)``; rows
  with ``event_time <= watermark`` are dropped before dedup (``numRowsDroppedByWatermark``);
- ``dropDuplicatesWithinWatermark(["event_id"])`` keeps the first row of an id in
  arrival order and stores ``expiresAt = event_time + delay``; at the end of each
  batch it evicts ids with ``watermark >= expiresAt``, scanning the WHOLE state
  (``StreamingDeduplicateWithinWatermarkExec``, 4.3 bytecode). The no-data batch that
  ``availableNow`` runs after a run's data applies that run's new watermark, so the
  expiry happens in the same run as in the reference.

    python -m bench.peers.spark_dedup --day DIR [--day DIR ...] --work DIR [--start-run K]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench.peers import RunStats, run_query, session_conf, state_store_conf

DEFAULT_TTL_MS = 7 * 24 * 60 * 60 * 1000


def build(ttl_ms: int):
    from pyspark.sql import functions as F

    def plan(source):
        return (source.withColumn("event_time", F.timestamp_millis("ts"))
                .withWatermark("event_time", f"{ttl_ms} milliseconds")
                .dropDuplicatesWithinWatermark(["event_id"])
                .drop("event_time"))

    return plan


def run_batches(spark, input_dirs: list[str], checkpoint_dir: str, output_dir: str,
                ttl_ms: int = DEFAULT_TTL_MS, lateness_ms: int | None = None,
                source_dir: str | None = None, start_run: int = 0, changelog: bool = True,
                shuffle_partitions: int | None = None) -> list[RunStats]:
    """One availableNow query start per input dir; ``lateness_ms`` must equal ``ttl_ms``."""
    if lateness_ms is not None and lateness_ms != ttl_ms:
        raise ValueError(f"spark dedup peer: lateness_ms {lateness_ms} != ttl_ms {ttl_ms}; "
                         "Spark's dropDuplicatesWithinWatermark uses one delay for both, "
                         "pass the same value")
    source = source_dir or checkpoint_dir.rstrip("/") + "-source"
    plan = build(ttl_ms)
    stats = []
    with session_conf(spark, state_store_conf(changelog, shuffle_partitions)):
        for i, day in enumerate(input_dirs):
            stats.append(run_query(spark, plan, day, source, checkpoint_dir, output_dir,
                                   start_run + i))
    return stats


def main(argv: list[str] | None = None) -> int:
    """New process per run: ``--day`` once (or more), state continues from the checkpoint."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--day", action="append", required=True, help="input folder of one run")
    p.add_argument("--work", required=True, help="holds checkpoint/, source/, output/")
    p.add_argument("--start-run", type=int, default=0)
    p.add_argument("--ttl-ms", type=int, default=DEFAULT_TTL_MS)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--shuffle-partitions", type=int, default=None)
    p.add_argument("--no-changelog", action="store_true")
    args = p.parse_args(argv)
    from statebackend.spark.session import get_spark

    spark = get_spark(args.master, app_name="spark-dedup-peer")
    stats = run_batches(spark, args.day, os.path.join(args.work, "checkpoint"),
                        os.path.join(args.work, "output"), ttl_ms=args.ttl_ms,
                        source_dir=os.path.join(args.work, "source"), start_run=args.start_run,
                        changelog=not args.no_changelog,
                        shuffle_partitions=args.shuffle_partitions)
    spark.stop()
    # Last line of stdout (Python workers may print to it before).
    print(json.dumps([s.to_json() for s in stats]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
