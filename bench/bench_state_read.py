"""Benchmark: read a record state into a Spark DataFrame, count it and sum a field.

Same state for everyone: the keyed aggregation's value state ``totals`` (count, sum,
min_ts, max_ts per key) for N keys (default 1,000,000), one event per key, P = 4.

- ours:    ``read_state(spark, storage, job, state="totals")``, then
           ``agg(count(*), sum(sum))``: the JVM reader (`statebackend.spark.jvm_reader`:
           one task per subtask reads the SST files inside the JVM; Spark prunes columns)
- ours-memory: the same over a memory-backend checkpoint of the same state (the JVM
           reader decodes its key-group files)
- ours-python, ours-memory-python: both through Python tasks
           (``ReadOptions(reader="python")``: a read-only restore, or the key-group files,
           decoded column-wise to Arrow, ``mapInArrow``)
- ours-python-cols: the Python tasks with ``ReadOptions(columns=("sum",))``: only the
           column the query needs crosses into the JVM (Spark cannot prune the columns of
           a ``mapInArrow`` DataFrame)
- dump:    ``ckpt dump --format parquet`` (one file per subtask, in parallel, value as
           JSON text) then ``spark.read.parquet`` of it with the same aggregate over
           ``get_json_object(value, '$.sum')``: what a user did before read_state
- spark:   Spark's own state reader, ``spark.read.format("statestore")``, over the
           equivalent Structured Streaming checkpoint (groupBy(key).agg(count, sum,
           min, max) with the RocksDB state store provider, availableNow,
           spark.sql.shuffle.partitions = P; `bench.bench_rescale` builds both), then
           ``agg(count(*), sum(value.sum))``
- empty:   an empty Spark job of P tasks: the scheduling floor every contender pays
- python:  ``spark.range(P, numPartitions=P).mapInArrow(...)`` whose tasks yield one row
           each, then the same aggregate: the floor of any reader that runs Python in
           its tasks, as ``read_state`` must (the Python workers' hand-over, no state)

Every contender returns the same count and sum (checked). Timed after the SparkSession
started and one untimed pass of each (Python workers, JIT); the contenders run in
interleaved rounds (the machine may be shared: drifting load hits them alike), each
figure is the best of ``--repeats`` rounds, beside the fewest CPU seconds a round took
in the driver, the JVM and the Python workers together (less sensitive to a shared
machine than wall time); the load average is printed (figures compare only within one
run). The goal: ours at least 2x Spark's reader; the line after the ratios says whether
half of Spark's time is above the Python-worker floor at all.

    python bench/bench_state_read.py [--keys N] [--repeats R] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_rescale import (  # noqa: E402
    build_our_checkpoint,
    build_streaming_checkpoint,
    empty_job,
    make_events,
)
from statebackend.cli import app as cli  # noqa: E402
from statebackend.job import ReadOptions, read_state  # noqa: E402
from statebackend.spark.session import get_spark  # noqa: E402

JOB = "reads"
MEMORY_JOB = "reads-memory"
SUM_ONLY = ("sum",)  # ReadOptions.columns: what the query needs
P = 4


def count_and_sum(df, total) -> tuple[int, float]:
    """The query every contender answers: its rows and the sum of ``total`` (a column)."""
    from pyspark.sql import functions as F

    row = df.agg(F.count("*").alias("n"), F.sum(total).alias("s")).first()
    return row["n"], row["s"]


def ours(spark, url: str, job: str = JOB, columns: tuple[str, ...] | None = None,
         reader: str = "auto") -> tuple[int, float]:
    df = read_state(spark, url, job, state="totals",
                    options=ReadOptions(columns=columns, reader=reader))
    return count_and_sum(df, "sum")


def dump_then_parquet(spark, url: str, out: str) -> tuple[int, float]:
    from pyspark.sql import functions as F

    code = cli.main(["--storage", url, "--job", JOB, "dump", "--out", out,
                     "--format", "parquet"])
    assert code == 0, code
    df = spark.read.parquet(out).where(F.col("state") == "totals")
    return count_and_sum(df, F.get_json_object("value", "$.sum").cast("double"))


def spark_reader(spark, location: str) -> tuple[int, float]:
    return count_and_sum(spark.read.format("statestore").load(location), "value.sum")


def one_row_per_task(batches):
    """mapInArrow function of the Python-worker floor: one row per task, no state."""
    import pyarrow as pa

    for batch in batches:
        yield pa.RecordBatch.from_pydict({"sum": pa.array([0.0] * batch.num_rows)})


def empty_floor(spark, tasks: int) -> tuple[int, float]:
    empty_job(spark, tasks)
    return tasks, 0.0


def python_floor(spark, tasks: int) -> tuple[int, float]:
    df = spark.range(0, tasks, 1, tasks).mapInArrow(one_row_per_task, "sum double")
    return count_and_sum(df, "sum")


def tree_cpu() -> float:
    """CPU seconds used so far by this process, the JVM and the Python workers."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue  # a worker that exited meanwhile
        total += t.user + t.system
    return total


def timed(fn, *args) -> tuple[float, float, tuple[int, float]]:
    """(wall seconds, CPU seconds of the process tree, result)."""
    cpu, t = tree_cpu(), time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t, tree_cpu() - cpu, result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--quick", action="store_true", help="20,000 keys, one round")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    n_keys, repeats = (20_000, 1) if args.quick else (args.keys, args.repeats)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-state-read-")
    os.makedirs(workdir, exist_ok=True)
    url = f"file://{workdir}/store"

    events = make_events(n_keys)
    events_dir = os.path.join(workdir, "events")
    os.makedirs(events_dir, exist_ok=True)
    events.to_parquet(os.path.join(events_dir, "part-0.parquet"), index=False)
    want = (n_keys, float(events["value"].sum()))

    t = time.perf_counter()
    build_our_checkpoint(workdir, url, JOB, P, events)
    ours_build_s = time.perf_counter() - t
    build_our_checkpoint(workdir, url, MEMORY_JOB, P, events, kind="memory")
    spark = get_spark(args.master, app_name="bench-state-read",
                      conf={"spark.ui.showConsoleProgress": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    location = os.path.join(workdir, "sss")
    t = time.perf_counter()
    build_streaming_checkpoint(spark, events_dir, location, P)
    spark_build_s = time.perf_counter() - t
    dump_out = os.path.join(workdir, "dump")

    contenders = {"ours": (ours, spark, url),
                  "ours-memory": (ours, spark, url, MEMORY_JOB),
                  "ours-python": (ours, spark, url, JOB, None, "python"),
                  "ours-memory-python": (ours, spark, url, MEMORY_JOB, None, "python"),
                  "ours-python-cols": (ours, spark, url, JOB, SUM_ONLY, "python"),
                  "dump": (dump_then_parquet, spark, url, dump_out),
                  "spark": (spark_reader, spark, location)}
    # the floors: one row per task, no state
    floors = {"empty": (empty_floor, spark, P), "python": (python_floor, spark, P)}
    runs = {**contenders, **floors}
    for fn, *fargs in runs.values():  # untimed: workers, imports, JIT
        fn(*fargs)
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpus: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, (fn, *fargs) in runs.items():
            seconds, cpu, (n, s) = timed(fn, *fargs)
            expected = want if name in contenders else (P, 0.0)
            assert n == expected[0] and abs(s - expected[1]) <= 1e-6 * max(
                1.0, abs(expected[1])), (name, n, s, expected)
            times[name].append(seconds)
            cpus[name].append(cpu)
    best = {k: min(v) for k, v in times.items()}
    best_cpu = {k: min(v) for k, v in cpus.items()}
    load = os.getloadavg()
    report = {"keys": n_keys, "parallelism": P, "repeats": repeats, "master": args.master,
              "loadavg": [round(x, 2) for x in load], "best_seconds": best,
              "best_cpu_seconds": best_cpu, "rounds": times, "cpu_rounds": cpus,
              "build_seconds": {"ours": ours_build_s, "spark": spark_build_s},
              "ratios": {"dump/ours": best["dump"] / best["ours"],
                         **{f"spark/{name}": best["spark"] / best[name]
                            for name in contenders if name.startswith("ours")}}}
    print(f"bench_state_read: {n_keys} entries of a record state, P={P}, {args.master}, "
          f"best of {repeats}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for name, label in (("ours", "read_state + count/sum (JVM reader)"),
                        ("ours-memory", "the same, memory backend"),
                        ("ours-python", "Python tasks (reader='python')"),
                        ("ours-memory-python", "Python tasks, memory backend"),
                        ("ours-python-cols", "Python tasks, columns=('sum',)"),
                        ("dump", "ckpt dump --format parquet + spark.read.parquet"),
                        ("spark", "spark.read.format('statestore') + count/sum"),
                        ("empty", "empty Spark job of P tasks (floor)"),
                        ("python", "mapInArrow of P one-row tasks (Python floor)")):
        rate = n_keys / best[name] if name in contenders else 0
        print(f"  {label:52} {best[name]:8.3f} s  cpu {best_cpu[name]:7.3f} s"
              + (f"  {rate:12,.0f} entries/s" if rate else ""))
    print(f"  ratio dump / ours   {report['ratios']['dump/ours']:6.2f}x")
    ratios = report["ratios"]
    print(f"  ratio spark / ours  {ratios['spark/ours']:6.2f}x  (goal >= 2x); memory backend "
          f"{ratios['spark/ours-memory']:6.2f}x")
    print(f"  Python tasks: ratio spark / ours {ratios['spark/ours-python']:6.2f}x, memory "
          f"backend {ratios['spark/ours-memory-python']:6.2f}x, columns=('sum',) "
          f"{ratios['spark/ours-python-cols']:6.2f}x (their floor: {best['python']:.3f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    spark.stop()
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
