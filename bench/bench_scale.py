"""Scale bench: the keyed aggregation job at growing input and state size (issue 14).

For each size N (events per run; keys = N/2, at most 5M) the job runs ``--runs``
times in one warm local[2] session on new input each run (the same key space, so
state grows to the key count on run 1 and stays there): run 1 writes the state,
later runs read and update it. Printed per run: wall time (the cost of a run),
events/s, and the time split by phase from the commit's run metrics
(``_metadata`` extra["metrics"]: restore, process, snapshot, upload, summed over
subtasks, so they exceed the wall time on 2 cores), then how cost grows with N
(seconds per million events against the smallest size: 1.00 is linear).

It also times the two input readers on the same local input (``--readers``, read
and hand every column to Python as Arrow, nothing else): Spark's file sources and
the executor-side pyarrow reader over fsspec (`statebackend.job.arrow_input`), for
Parquet and for JSON lines (``auto`` follows these figures: Spark's for local Parquet,
Arrow's for local JSON lines and any other URL). And it prints the key hashing of
the hot path (key group of every key, the one step per input row before any state
work) column-wise against the per-key loop it replaced, on the same keys.

    PYTHONPATH=. .venv/bin/python bench/bench_scale.py                  # 1M and 4M events
    PYTHONPATH=. .venv/bin/python bench/bench_scale.py --sizes 1M,4M,10M --runs 2

10M events per run takes several minutes per run on a loaded 2-core machine with
2.5 GB of input generation; it is not in the default sizes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MAX_KEYS = 5_000_000
PHASES = ("restore", "process", "snapshot", "upload")


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KM" else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise SystemExit(f"bench_scale: size {text!r} is not a number like 1M, 250K or "
                         "4000000") from None
    if value < 1:
        raise SystemExit(f"bench_scale: size {text!r} must be at least 1 event")
    return value


def key_hashing(keys) -> tuple[float, float]:
    """(column-wise s, per-key loop s) for the key groups of ``keys`` (best of 3)."""
    import mmh3
    import numpy as np

    from statebackend.state.keygroups_bulk import key_groups

    col, loop = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        fast = key_groups(keys, 128)
        col.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        py = keys.to_pylist()
        slow = np.fromiter((mmh3.hash(k.encode("utf-8"), 0, False) % 128 for k in py),
                           dtype=np.int64, count=len(py))
        loop.append(time.perf_counter() - t0)
        assert (fast == slow).all()
    return min(col), min(loop)


def _count_rows(batches):
    import pyarrow as pa

    n = sum(len(b) for b in batches)
    yield pa.RecordBatch.from_pylist([{"n": n}], schema=pa.schema([("n", pa.int64())]))


def compare_readers(spark, work: str, events: int, rounds: int = 3) -> list[tuple]:
    """(format, events, best s spark, best s arrow) for reading the same local input."""
    from demo.sample_data import generate_events
    from jobs.keyed_aggregation import JOB
    from statebackend.job.input import list_input
    from statebackend.job.spark_input import read_input

    out = []
    for fmt, n in (("parquet", events), ("json", min(events, 500_000))):
        folder = os.path.join(work, f"readers-{fmt}")
        generate_events(folder, n_events=n, n_keys=max(1, n // 2), seed=5, fmt=fmt)
        files = list_input(folder)
        best = {"spark": float("inf"), "arrow": float("inf")}
        for _ in range(rounds):
            for reader in best:  # interleaved: the load hits both alike
                t0 = time.perf_counter()
                rows = read_input(spark, files, JOB.input, reader).mapInArrow(
                    _count_rows, "n long").collect()
                best[reader] = min(best[reader], time.perf_counter() - t0)
                assert sum(r["n"] for r in rows) == n
        out.append((fmt, n, best["spark"], best["arrow"]))
        shutil.rmtree(folder, ignore_errors=True)
    return out


def make_input(job_name: str, folder: str, n: int, keys: int, run: int, runs: int) -> None:
    """Run ``run``'s input of ``n`` events over ``keys`` keys (one new day per run)."""
    if job_name == "keyed_aggregation":
        from demo.sample_data import generate_events

        generate_events(folder, n_events=n, n_keys=keys, seed=100 + run,
                        start_ts_ms=1_800_000_000_000 + run * 86_400_000)
        return
    from bench.peers.events import EventsSpec, generate_days, write_days

    # The days are generated together (late rows and repeats cross midnight); this run's
    # day is written. Users = keys: one session state per active user.
    days = generate_days(EventsSpec(days=runs, events_per_day=n, users=keys, seed=100))
    tmp = write_days(days[run:run + 1], folder + ".tmp")[0]
    os.replace(tmp, folder)
    shutil.rmtree(folder + ".tmp", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1M,4M", help="events per run, e.g. 1M,4M,10M")
    ap.add_argument("--runs", type=int, default=2, help="runs per size (1: state writes only)")
    ap.add_argument("--engine", default="spark", choices=("spark", "local", "auto"),
                    help="the runs' engine (statebackend.job.engine; default %(default)s)")
    ap.add_argument("--job", default="keyed_aggregation",
                    choices=("keyed_aggregation", "sessionization"),
                    help="the built-in job to scale (default %(default)s)")
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--work", default=None, help="work folder (default: a temp folder)")
    ap.add_argument("--readers", default="on", choices=("on", "off"),
                    help="also time Spark's and the Arrow input reader")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]

    import pyarrow.parquet as pq

    from jobs import BUILTIN_JOBS
    from statebackend.checkpoint.store import CheckpointStore
    from statebackend.job import RunConfig, load_job, run_job
    from statebackend.spark.session import get_spark
    from statebackend.storage import open_storage

    job = load_job(BUILTIN_JOBS[args.job])
    work = args.work or tempfile.mkdtemp(prefix="bench-scale-")
    spark = get_spark(args.master, app_name="bench-scale")
    print(f"bench_scale: job {args.job}, {args.master}, engine {args.engine}, "
          f"P={args.parallelism}, runs per "
          f"size {args.runs}, "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, work {work}")
    header = (f"{'events':>9} {'keys':>9} {'run':>3} {'wall s':>7} {'events/s':>10} "
              + " ".join(f"{p + ' s':>10}" for p in PHASES) + f" {'state rows':>10}")
    results = []
    try:
        # A small run first: JVM code paths, Python workers and imports are then warm for all.
        warm = os.path.join(work, "warm")
        make_input(args.job, os.path.join(warm, "in"), 10_000, 5_000, 0, 1)
        run_job(job, RunConfig(input=os.path.join(warm, "in"), storage=f"file://{warm}/store",
                               job="warm", run_id="w", output=os.path.join(warm, "out"),
                               parallelism=args.parallelism, master=args.master,
                               local_dir=os.path.join(warm, "local"), engine=args.engine),
                spark)
        shutil.rmtree(warm, ignore_errors=True)
        for n in sizes:
            keys = min(n // 2, MAX_KEYS)
            base = os.path.join(work, f"n{n}")
            store_url = f"file://{base}/store"
            print(f"\n{n:,} events per run over {keys:,} keys")
            print(header)
            for r in range(args.runs):
                inp = os.path.join(base, f"in{r}")
                make_input(args.job, inp, n, keys, r, args.runs)
                started = time.perf_counter()
                s = run_job(job, RunConfig(input=inp, storage=store_url, job="scale",
                                           run_id=f"r{r}", output=os.path.join(base, "out"),
                                           parallelism=args.parallelism, master=args.master,
                                           local_dir=os.path.join(base, "local"),
                                           engine=args.engine), spark)
                wall = time.perf_counter() - started
                meta = CheckpointStore(open_storage(store_url), "scale").load(s["checkpoint_id"])
                run = meta.extra["metrics"]["run"]
                phases = run["phases"]
                results.append((n, r, wall, phases))
                print(f"{n:>9,} {keys:>9,} {r:>3} {wall:>7.2f} {n / wall:>10,.0f} "
                      + " ".join(f"{phases[p]:>10.2f}" for p in PHASES)
                      + f" {run['state_rows']:>10,}  reader {s['input_reader']}, engine "
                      f"{s['engine']}")
                if r:
                    shutil.rmtree(os.path.join(base, f"in{r - 1}"), ignore_errors=True)
            if n == sizes[0]:
                keys_col = pq.read_table(os.path.join(base, f"in{args.runs - 1}"),
                                         columns=[job.input.key])[job.input.key]
                keys_col = keys_col.cast("string").combine_chunks()
                col, loop = key_hashing(keys_col)
                hashing = (len(keys_col), col, loop)
            shutil.rmtree(base, ignore_errors=True)
        readers = compare_readers(spark, work, sizes[0]) if args.readers == "on" else []
    finally:
        spark.stop()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)

    print("\ngrowth: seconds per million events, against the smallest size "
          "(1.00 = linear in input)")
    first = {r: wall / (n / 1e6) for n, r, wall, _ in results if n == sizes[0]}
    for n, r, wall, phases in results:
        per_m = wall / (n / 1e6)
        proc = phases["process"] / (n / 1e6)
        print(f"  {n:>11,} events run {r}: {per_m:6.2f} s/M events, x{per_m / first[r]:.2f} "
              f"of {sizes[0]:,}; process {proc:.2f} s/M")
    n_keys, col, loop = hashing
    print(f"\nkey groups of {n_keys:,} keys: column-wise {col * 1000:.0f} ms, per-key loop "
          f"{loop * 1000:.0f} ms ({loop / col:.1f}x)")
    for fmt, n, t_spark, t_arrow in readers:
        print(f"read {n:,} events of {fmt}: Spark's reader {t_spark:.2f} s, Arrow reader "
              f"{t_arrow:.2f} s (spark/arrow {t_spark / t_arrow:.2f}x)")
    print(f"load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
