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

import sys
from typing import Any

from bench.peers import RunStats, peer_main, run_days

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
                **run: Any) -> list[RunStats]:
    """One availableNow query start per input dir; ``lateness_ms`` must equal ``ttl_ms``;
    ``run``: `bench.peers.run_days`'s options."""
    if lateness_ms is not None and lateness_ms != ttl_ms:
        raise ValueError(f"spark dedup peer: lateness_ms {lateness_ms} != ttl_ms {ttl_ms}; "
                         "Spark's dropDuplicatesWithinWatermark uses one delay for both, "
                         "pass the same value")
    return run_days(spark, build(ttl_ms), input_dirs, checkpoint_dir, output_dir, **run)


def main(argv: list[str] | None = None) -> int:
    """New process per run (`bench.peers.peer_main`)."""
    return peer_main(argv, __doc__, "spark-dedup-peer", run_batches, {"ttl_ms": DEFAULT_TTL_MS})


if __name__ == "__main__":
    sys.exit(main())
