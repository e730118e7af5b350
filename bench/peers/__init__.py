"""Spark Structured Streaming peers of our event-time jobs, run like a scheduled batch job.

Shared mechanics of the peers (``spark_sessionization``, ``spark_dedup``):

- input: one folder of Parquet files per daily batch (``events.write_days``);
- per run, the day's files are hard-linked into one streaming source folder, then
  ONE query start with ``Trigger(availableNow=True)`` over it, with the same
  checkpoint location every run (Spark remembers which files it read);
- RocksDBStateStoreProvider, changelog checkpointing on by default;
- a ``foreachBatch`` sink writes each micro-batch's rows as Parquet under
  ``output/run=NNN/`` so outputs compare run by run;
- per-run stats from the query's progress reports plus the checkpoint folder.

One run = one ``availableNow`` query start = one data micro-batch (the file source
has no ``maxFilesPerTrigger``) plus, when the watermark moved, the no-data batch
that Spark runs before stopping (it evicts state / fires timers with the new
watermark; checked on 4.3, see the peers' tests).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
INPUT_DDL = "event_id LONG, user STRING, ts LONG, value DOUBLE"


@dataclass(frozen=True)
class RunStats:
    """One run of a peer (one ``availableNow`` query start)."""

    run: int
    events: int             # input rows read by the run
    late: int               # rows dropped by the watermark (Spark's numRowsDroppedByWatermark)
    emitted: int            # rows written by the sink
    wall_s: float           # query start to termination (session already warm)
    batches: int            # micro-batches of this run (data + no-data)
    checkpoint_bytes: int   # bytes of files new or changed in the checkpoint folder
    state_rows: int | None  # numRowsTotal as Spark reports it (for TWS: not the open sessions)
    watermark_ms: int | None

    def to_json(self) -> dict:
        return asdict(self)


def file_snapshot(root: str) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file under root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            out[path] = (st.st_size, st.st_mtime_ns)
    return out


def bytes_written(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> int:
    """Bytes of the files that appeared or changed (what a run wrote to checkpoint storage)."""
    return sum(size for path, (size, mtime) in after.items() if before.get(path) != (size, mtime))


def link_day(day_dir: str, source_dir: str, run: int) -> int:
    """Make one day's files visible to the file source (hard links; copies across devices)."""
    os.makedirs(source_dir, exist_ok=True)
    count = 0
    for name in sorted(os.listdir(day_dir)):
        if not name.endswith(".parquet"):
            continue
        target = os.path.join(source_dir, f"run{run:04d}-{name}")
        if os.path.exists(target):
            continue
        try:
            os.link(os.path.join(day_dir, name), target)
        except OSError:
            shutil.copyfile(os.path.join(day_dir, name), target)
        count += 1
    return count


@contextmanager
def session_conf(spark, settings: dict[str, str]) -> Iterator[None]:
    """Set SQL confs for the peer's queries and restore the previous values after."""
    saved = {k: spark.conf.get(k, None) for k in settings}
    for k, v in settings.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


def state_store_conf(changelog: bool, shuffle_partitions: int | None) -> dict[str, str]:
    conf = {"spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled":
                str(changelog).lower()}
    if shuffle_partitions:
        # Fixed by the first run: Spark keeps the checkpoint's partition count afterwards.
        conf["spark.sql.shuffle.partitions"] = str(shuffle_partitions)
    return conf


def parquet_batch_writer(output_dir: str, run: int) -> Callable:
    """foreachBatch function: append the micro-batch's rows under output/run=NNN/."""
    target = os.path.join(output_dir, f"run={run:03d}")

    def write(batch_df, batch_id: int) -> None:
        batch_df.write.mode("append").parquet(os.path.join(target, f"batch={batch_id}"))

    return write


def progress_value(progress, name: str):
    # Progress objects in classic PySpark, plain dicts from their JSON form.
    return progress.get(name) if isinstance(progress, dict) else getattr(progress, name, None)


def run_stats(run: int, progresses: list, wall_s: float, checkpoint_bytes: int,
              emitted: int) -> RunStats:
    """Sum one query start's progress reports into a RunStats."""
    events = late = 0
    state_rows = watermark = None
    for p in progresses:
        events += int(progress_value(p, "numInputRows") or 0)
        for op in progress_value(p, "stateOperators") or []:
            late += int(progress_value(op, "numRowsDroppedByWatermark") or 0)
            state_rows = progress_value(op, "numRowsTotal")
        wm = (progress_value(p, "eventTime") or {}).get("watermark")
        if wm:
            watermark = iso_to_ms(wm)
    return RunStats(run=run, events=events, late=late, emitted=emitted, wall_s=wall_s,
                    batches=len(progresses), checkpoint_bytes=checkpoint_bytes,
                    state_rows=state_rows, watermark_ms=watermark)


def iso_to_ms(text: str) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def count_rows(output_dir: str, run: int) -> int:
    import pyarrow.parquet as pq

    target = os.path.join(output_dir, f"run={run:03d}")
    total = 0
    for dirpath, _, files in os.walk(target):
        for name in files:
            if name.endswith(".parquet"):
                total += pq.ParquetFile(os.path.join(dirpath, name)).metadata.num_rows
    return total


def read_run_output(output_dir: str, run: int):
    """All rows a run emitted, as one pandas DataFrame (empty if none)."""
    import pandas as pd

    target = os.path.join(output_dir, f"run={run:03d}")
    parts = []
    for dirpath, _, files in os.walk(target):
        for name in sorted(files):
            if name.endswith(".parquet"):
                parts.append(pd.read_parquet(os.path.join(dirpath, name)))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def run_query(spark, build: Callable, day_dir: str, source_dir: str, checkpoint_dir: str,
              output_dir: str, run: int, timeout_s: float = 3600) -> RunStats:
    """One scheduled run: link the day's files, one availableNow query start, stats."""
    link_day(day_dir, source_dir, run)
    before = file_snapshot(checkpoint_dir)
    started = time.perf_counter()
    stream = build(spark.readStream.schema(INPUT_DDL).parquet(source_dir))
    query = (stream.writeStream.foreachBatch(parquet_batch_writer(output_dir, run))
             .option("checkpointLocation", checkpoint_dir)
             .trigger(availableNow=True).start())
    query.awaitTermination(timeout_s)
    wall = time.perf_counter() - started
    if query.exception() is not None:
        raise RuntimeError(f"spark peer run {run} over {day_dir} failed: {query.exception()}")
    progresses = list(query.recentProgress)
    stats = run_stats(run, progresses, wall, bytes_written(before, file_snapshot(checkpoint_dir)),
                      count_rows(output_dir, run))
    if not stats.events:
        # A Connect client may get no (or empty) progress of a terminated query: count
        # the day's input instead.
        stats = replace(stats, events=input_rows(day_dir))
    return stats


def input_rows(day_dir: str) -> int:
    """Rows of a day's Parquet files (from their footers)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(os.path.join(day_dir, n)).metadata.num_rows
               for n in sorted(os.listdir(day_dir)) if n.endswith(".parquet"))


def run_days(spark, plan: Callable, input_dirs: list[str], checkpoint_dir: str,
             output_dir: str, source_dir: str | None = None, start_run: int = 0,
             changelog: bool = True, shuffle_partitions: int | None = None) -> list[RunStats]:
    """The driver loop of every peer: one ``availableNow`` query start per input dir
    (a daily batch), same checkpoint, RocksDB state store; stats per run."""
    source = source_dir or checkpoint_dir.rstrip("/") + "-source"
    with session_conf(spark, state_store_conf(changelog, shuffle_partitions)):
        return [run_query(spark, plan, day, source, checkpoint_dir, output_dir, start_run + i)
                for i, day in enumerate(input_dirs)]


def peer_main(argv: list[str] | None, doc: str, app_name: str, run_batches: Callable,
              options: dict[str, int]) -> int:
    """A peer as a new process per run: ``--day`` once (or more), state continues from the
    checkpoint under ``--work``; ``options``: the peer's own int flags and defaults
    (``{"gap_ms": ...}`` -> ``--gap-ms``), passed to ``run_batches``. Prints the runs'
    stats as JSON on the last line of stdout (Python workers may print to it before)."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--day", action="append", required=True, help="input folder of one run")
    p.add_argument("--work", required=True, help="holds checkpoint/, source/, output/")
    p.add_argument("--start-run", type=int, default=0)
    for name, default in options.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--shuffle-partitions", type=int, default=None)
    p.add_argument("--no-changelog", action="store_true")
    args = p.parse_args(argv)
    from statebackend.spark.session import get_spark

    spark = get_spark(args.master, app_name=app_name)
    stats = run_batches(spark, args.day, os.path.join(args.work, "checkpoint"),
                        os.path.join(args.work, "output"),
                        source_dir=os.path.join(args.work, "source"), start_run=args.start_run,
                        changelog=not args.no_changelog,
                        shuffle_partitions=args.shuffle_partitions,
                        **{name: getattr(args, name) for name in options})
    spark.stop()
    print(json.dumps([s.to_json() for s in stats]))
    return 0
