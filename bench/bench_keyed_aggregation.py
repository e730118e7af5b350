"""Bench: our keyed aggregation job vs Spark Structured Streaming with its RocksDB state store.

Same workload, same generated input (default 4 daily batches x 250,000 events over
100,000 keys, local[2], same number of state partitions P for both):

- ours:  ``jobs.keyed_aggregation`` once per day (incremental RocksDB checkpoints);
- spark: ``readStream.parquet(dir).groupBy(key).agg(count, sum, min, max)``,
  ``writeStream.outputMode("update").foreachBatch(write parquet)``,
  ``trigger(availableNow=True)``, one query start per daily batch (the day's files are
  linked into the source folder first), RocksDBStateStoreProvider with changelog
  checkpointing on and off.

Before/after the job API port (issue 11): ``before`` runs the same bench worker of
the pre-port code (``--before REV``, default ``fa6e095``) from a temporary ``git
worktree`` (removed afterwards) on the same input, so the ported job (``ours``) is
compared with the release it replaced (goal: no slower).

Three ways a scheduler runs them: a new process per run (like an Airflow task; the
wall time includes JVM start-up), consecutive runs in one session, and a new Spark
Connect client process per run against one warm Connect server on 127.0.0.1 (how the
Airflow provider runs jobs with a ``spark_connect`` connection: no JVM start per run;
the ``before`` variant has no Connect support and is skipped there). As a Connect
client ours opens its session the way ``ckpt run --remote`` does: attached to the
job's session kept on the server (`statebackend.spark.connect_sessions`), whose Python
workers the previous run left idle. Prints per-run
wall time, events/s and bytes written to checkpoint storage (growth of the
checkpoint folder), then the ratios ours/spark. Goal (issue 14): events/s >= 3x
Spark's in every mode, bytes per incremental run <= Spark's.

    python bench/bench_keyed_aggregation.py            # full (several minutes)
    python bench/bench_keyed_aggregation.py --quick    # 3 x 50,000 events, 20,000 keys
    python bench/bench_keyed_aggregation.py --quick --variants ours,before --modes session
    python bench/bench_keyed_aggregation.py --quick --modes connect
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.process_env import child_env  # noqa: E402
from bench.state_stand_ins import drop_all_state  # noqa: E402

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
VARIANTS = ("ours", "ours-spark", "ours-memory", "ours-spark-memory", "ours-no-state",
            "before", "spark-changelog", "spark-no-changelog")
DEFAULT_VARIANTS = ("ours", "ours-spark", "spark-changelog", "spark-no-changelog")
# ours: the default engine choice (auto: the local engine for these inputs, no JVM);
# ours-spark: the same job with --engine spark (statebackend.job.engine); the -memory
# variants keep the state in the memory backend (statebackend.state.memory) instead of
# RocksDB: variant -> (engine, backend)
OURS = {"ours": ("auto", None), "ours-spark": ("spark", None),
        "ours-memory": ("auto", "memory"), "ours-spark-memory": ("spark", "memory"),
        "ours-no-state": ("auto", "memory")}
# ours-no-state: the ceiling of any backend under this engine (issue 25). The memory
# backend patched in the bench's worker so that state costs nothing: every read finds
# nothing, every write is dropped, no key-group file is written. Not a product.
NO_STATE = "ours-no-state"
PRE_PORT = "fa6e095"  # the last commit before the job API port


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


# -- one run of each engine (inside a worker process) -----------------------
def ours_run(spark, spec: dict, day: int, repeat: int = 0) -> dict:
    """One run of the job; ``spark`` None: the run starts Spark only if its engine is Spark.
    ``repeat``: how many runs of this day came before (each run has its own run id)."""
    from jobs.keyed_aggregation import JOB
    from statebackend.job.config import RunConfig
    from statebackend.job.run import run_job

    store = os.path.join(spec["work"], "store")
    before = dir_bytes(store)
    started = time.perf_counter()
    s = run_job(JOB, RunConfig(
        input=spec["days"][day], storage=f"file://{store}", job="bench",
        run_id=f"day-{day}" + (f"-{repeat}" if repeat else ""),
        output=os.path.join(spec["work"], "output"), parallelism=spec["parallelism"],
        master=spec["master"], local_dir=os.path.join(spec["work"], "local"),
        engine=spec.get("engine"), backend=spec.get("backend")), spark)
    wall = time.perf_counter() - started
    return {"wall_s": wall, "events": s["events_read"], "bytes": dir_bytes(store) - before,
            "timings": s["timings"], "engine": s.get("engine", "spark"),
            "time_split": s.get("time_split", {})}


def spark_run(spark, spec: dict, day: int) -> dict:
    from pyspark.sql import functions as F

    from bench.peers import progress_value

    work = spec["work"]
    source, ckpt, out = (os.path.join(work, n) for n in ("source", "checkpoint", "output"))
    os.makedirs(source, exist_ok=True)
    for name in sorted(os.listdir(spec["days"][day])):
        if name.endswith(".parquet"):
            os.link(os.path.join(spec["days"][day], name),
                    os.path.join(source, f"day{day}-{name}"))
    before = dir_bytes(ckpt)
    started = time.perf_counter()
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    spark.conf.set("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                   "true" if spec["changelog"] else "false")
    spark.conf.set("spark.sql.shuffle.partitions", str(spec["parallelism"]))
    events = (spark.readStream.schema("key string, ts long, value double").parquet(source))
    totals = events.groupBy("key").agg(F.count("*").alias("count"), F.sum("value").alias("sum"),
                                       F.min("ts").alias("min_ts"), F.max("ts").alias("max_ts"))

    def write_batch(df, batch_id: int) -> None:
        df.write.mode("overwrite").parquet(os.path.join(out, f"batch={batch_id}"))

    query = (totals.writeStream.outputMode("update").foreachBatch(write_batch)
             .option("checkpointLocation", ckpt).trigger(availableNow=True).start())
    query.awaitTermination()
    wall = time.perf_counter() - started
    progress = query.recentProgress
    # a Connect server may report no (or partial) progress of a terminated query
    rows = sum(int(progress_value(p, "numInputRows") or 0) for p in progress) or spec["events"]
    return {"wall_s": wall, "events": rows, "bytes": dir_bytes(ckpt) - before}


def floor_run(day_dir: str, work: str) -> dict:
    """The floor of one run on this machine: an Arrow read of the day's files, a group-by
    of its rows, one RocksDB write batch of every key's totals (a new instance, flushed),
    and an upload (copy) of the SST files. No state read, no validation, no Spark."""
    import numpy as np
    import pyarrow.parquet as pq
    from rocksdict import Options, Rdict, WriteBatch

    folder = os.path.join(work, "floor")
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    table = pq.read_table(day_dir, columns=["key", "ts", "value"])
    t1 = time.perf_counter()
    agg = table.group_by("key").aggregate([("value", "count"), ("value", "sum"), ("ts", "min"),
                                           ("ts", "max")])
    t2 = time.perf_counter()
    values = np.column_stack([agg[c].to_numpy().astype(np.float64) for c in
                              ("value_count", "value_sum", "ts_min", "ts_max")])
    db = Rdict(os.path.join(folder, "db"), Options(raw_mode=True))
    wb = WriteBatch(raw_mode=True)
    for key, row in zip(agg["key"].to_pylist(), values, strict=True):
        wb.put(key.encode(), row.tobytes())
    db.write(wb)
    db.flush()
    t3 = time.perf_counter()
    upload = os.path.join(folder, "upload")
    os.makedirs(upload)
    for name in os.listdir(os.path.join(folder, "db")):
        if name.endswith(".sst"):
            shutil.copy(os.path.join(folder, "db", name), upload)
    db.close()
    t4 = time.perf_counter()
    return {"read": t1 - t0, "group_by": t2 - t1, "state_writes": t3 - t2, "upload": t4 - t3,
            "total": t4 - t0}


def worker(spec: dict) -> None:
    """Run days ``spec['run_days']`` of one variant in this process; print JSON lines.

    Kept compatible with the pre-port bench: ``before`` runs that file's worker.
    """
    try:
        from statebackend.spark.session import get_spark
    except ImportError:  # the pre-port tree
        from statebackend.spark.session import get_spark

    if spec.get("no_state"):
        drop_all_state()
    t0 = time.perf_counter()
    spark = None
    # The auto engine starts Spark itself if it picks it. So does ours as a Connect
    # client, as `ckpt run --remote` does: it attaches to the job's kept session.
    own_session = spec["variant"] == "ours" and spec["master"].startswith("sc://")
    if spec.get("engine") != "auto" and not own_session:
        spark = get_spark(spec["master"], app_name=f"bench-{spec['variant']}",
                          conf={"spark.sql.shuffle.partitions": str(spec["parallelism"])})
    startup = time.perf_counter() - t0
    fn = ours_run if spec["variant"] == "ours" else spark_run
    for i, day in enumerate(spec["run_days"]):
        repeat = spec["run_days"][:i].count(day)
        result = fn(spark, spec, day, repeat) if repeat else fn(spark, spec, day)
        result.update(day=day, startup_s=startup)
        print("RESULT " + json.dumps(result), flush=True)
        startup = 0.0
    if spark is not None:
        spark.stop()


@contextmanager
def pre_port_tree(rev: str):
    """A temporary ``git worktree`` of ``rev`` (None: no before variant); removed after."""
    if not rev:
        yield None
        return
    path = tempfile.mkdtemp(prefix="bench-before-")
    os.rmdir(path)
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev], check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path],
                       capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def spawn(spec: dict) -> tuple[list[dict], float]:
    started = time.perf_counter()
    script, env, cwd = os.path.abspath(__file__), child_env(), ROOT
    if spec["variant"] == "before":
        # The pre-port tree's own worker runs its own job ("ours" there). Python workers
        # put their cwd first on sys.path: run from the tree so they import its jobs/.
        cwd = spec["before_tree"]
        script = os.path.join(cwd, "bench", "bench_keyed_aggregation.py")
        env["PYTHONPATH"] = cwd
        spec = {**spec, "variant": "ours"}
    elif spec["variant"] in OURS:
        engine, backend = OURS[spec["variant"]]
        spec = {**spec, "variant": "ours", "engine": engine, "backend": backend,
                "no_state": spec["variant"] == NO_STATE}
    proc = subprocess.run([sys.executable, script, "--worker", json.dumps(spec)], env=env,
                          capture_output=True, text=True, cwd=cwd)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{spec['variant']} worker failed:\n{proc.stderr[-4000:]}")
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    return results, wall


# -- orchestration ------------------------------------------------------------
def bench(args: argparse.Namespace, before_tree: str | None) -> dict:
    from demo.sample_data import generate_days

    work = os.path.abspath(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    days = [f for f, _ in generate_days(os.path.join(work, "input"), args.runs,
                                        events_per_day=args.events, n_keys=args.keys, seed=3)]
    days += fixed_cost_days(work, args.runs)
    table: dict[str, dict[str, list[dict]]] = {}

    def spec(mode: str, variant: str) -> dict:
        return {"variant": variant, "days": days, "parallelism": args.parallelism,
                "master": args.master, "events": args.events,
                "changelog": variant == "spark-changelog",
                "work": os.path.join(work, mode, variant), "before_tree": before_tree}

    for mode in args.modes:
        variants = [v for v in args.variants if mode != "connect" or v != "before"]
        runs = table.setdefault(mode, {v: [] for v in variants})
        if mode in ("process", "connect"):
            with connect_server_for(mode, work, args.master) as remote:
                # Interleaved by day, so load changes on a shared machine hit every variant
                # alike.
                for day in range(args.runs):
                    for variant in variants:
                        one = {**spec(mode, variant), "run_days": [day]}
                        results, wall = spawn({**one, "master": remote or one["master"]})
                        res = results[0]
                        res["wall_s"] = wall  # whole process: (JVM) start, query, shutdown
                        runs[variant].append(res)
                        _print_run(mode, variant, res)
        else:
            for variant in args.variants:
                # ours, warm: then an empty day and a one-event day, twice each
                extra = [args.runs + i for i in (0, 1, 0, 1)] if variant in OURS else []
                results, _ = spawn({**spec(mode, variant),
                                    "run_days": list(range(args.runs)) + extra})
                for res in results:
                    if res["day"] >= args.runs:
                        res["kind"] = FIXED_KINDS[res["day"] - args.runs]
                        table.setdefault("fixed", {}).setdefault(variant, []).append(res)
                        continue
                    runs[variant].append(res)
                    _print_run(mode, variant, res)
    return table


FIXED_KINDS = ("empty day", "one-event day")


def fixed_cost_days(work: str, after: int) -> list[str]:
    """Two input folders after the ``after`` generated days that show a warm run's fixed
    cost (issue 24): one Parquet file of the days' schema with no row (the run starts no
    Spark job: nothing to route, nothing due), and one event of an existing key (the
    smallest run the Spark engine schedules)."""
    import pyarrow.parquet as pq

    from demo.sample_data import DAY_MS, DEFAULT_START_TS_MS, generate_days

    root = os.path.join(work, "fixed")
    ((one, _),) = generate_days(root, 1, events_per_day=1, n_keys=1, seed=5,
                                start_ts_ms=DEFAULT_START_TS_MS + after * DAY_MS)
    empty = os.path.join(root, "empty")
    os.makedirs(empty, exist_ok=True)
    pq.write_table(pq.read_table(one).slice(0, 0), os.path.join(empty, "part-0.parquet"))
    return [empty, one]


def report_fixed(table: dict, keys: int) -> None:
    """A warm run's fixed cost per variant: the best of two runs of each kind (goal,
    issue 24: the Spark engine's under 0.5 s)."""
    if not table.get("fixed"):
        return
    print(f"\nfixed cost of a warm run ({keys:,}-key lineage; best of 2; goal for the Spark "
          "engine: under 0.5 s)")
    for variant, runs in table["fixed"].items():
        for kind in FIXED_KINDS:
            best = min((r for r in runs if r["kind"] == kind), key=lambda r: r["wall_s"])
            split = ", ".join(f"{k} {v:.3f}" for k, v in best.get("time_split", {}).items())
            print(f"  {variant:19} {kind:14} {best['wall_s']:.3f} s  engine "
                  f"{best.get('engine')}  ({split})")


@contextmanager
def connect_server_for(mode: str, work: str, master: str):
    """The ``sc://`` URL of a Connect server (``master`` cores) for the connect mode, else
    None; the server runs until the mode is done."""
    if mode != "connect":
        yield None
        return
    from bench.connect_server import connect_server

    with connect_server(os.path.join(work, "connect-server"), master=master) as server:
        yield server.url


def _print_run(mode: str, variant: str, r: dict) -> None:
    where = ""
    if r.get("timings"):
        where = "  (" + ", ".join(f"{k} {v:.2f}" for k, v in r["timings"].items()) + ")"
    engine = f"  engine {r['engine']}" if r.get("engine") else ""
    print(f"{mode:8} {variant:19} day {r['day']}: {r['wall_s']:7.2f} s  "
          f"{r['events'] / r['wall_s']:10.0f} events/s  {r['bytes']:>12,} bytes written"
          f"{engine}{where}", flush=True)
    if r.get("time_split"):  # where the run's wall time went (the summary's time_split)
        print(f"{'':28} wall: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                           r["time_split"].items()), flush=True)


def report(table: dict, args: argparse.Namespace) -> None:
    print(f"\nsummary (incremental = runs after the first), load average {os.getloadavg()[0]:.2f}")
    print(f"{'mode':8} {'variant':19} {'events/s':>10} {'events/s incr':>14} "
          f"{'bytes first':>13} {'bytes/incr run':>15}")
    agg = {}
    for mode, variants in table.items():
        for variant, runs in variants.items():
            incr = runs[1:] or runs
            eps = sum(r["events"] for r in runs) / sum(r["wall_s"] for r in runs)
            eps_incr = sum(r["events"] for r in incr) / sum(r["wall_s"] for r in incr)
            bytes_incr = sum(r["bytes"] for r in incr) / len(incr)
            agg[(mode, variant)] = (eps, eps_incr, bytes_incr)
            print(f"{mode:8} {variant:19} {eps:10.0f} {eps_incr:14.0f} {runs[0]['bytes']:>13,} "
                  f"{bytes_incr:>15,.0f}")
    if "before" in args.variants and "ours" in args.variants:
        print("\nratios after / before the job API port (events/s: goal >= 1.0)")
        for mode in (m for m in table if (m, "before") in agg):
            ours, before = agg[(mode, "ours")], agg[(mode, "before")]
            print(f"{mode:8} ours vs before          events/s x{ours[0] / before[0]:.2f} "
                  f"(incremental runs x{ours[1] / before[1]:.2f}), bytes per incremental run "
                  f"x{ours[2] / before[2]:.2f}")
    report_backends(agg, table)
    peers = [v for v in args.variants if v.startswith("spark")]
    mine = [v for v in args.variants if v in OURS]
    if not peers or not mine:
        return
    print("\nratios ours / spark (events/s: higher is better, goal >= 3 (issue 14); "
          "bytes: lower is better, goal <= 1.0)")
    for mode in table:
        for name in mine:
            ours = agg[(mode, name)]
            for variant in peers:
                sp = agg[(mode, variant)]
                print(f"{mode:8} {name:10} vs {variant:19} events/s x{ours[0] / sp[0]:.2f} "
                      f"(incremental runs x{ours[1] / sp[1]:.2f}), bytes per incremental run "
                      f"x{ours[2] / sp[2]:.2f}")


def report_backends(agg: dict, table: dict) -> None:
    """The memory backend against RocksDB, same engine (issue 25: events/s >= 2x in a
    warm run, bytes per incremental run <= 1.2x)."""
    lines = []
    for mode in table:
        for base in ("ours", "ours-spark"):
            mem = f"{base}-memory"
            if (mode, mem) not in agg or (mode, base) not in agg:
                continue
            m, b = agg[(mode, mem)], agg[(mode, base)]
            lines.append(f"{mode:8} {mem:19} vs {base:10} events/s x{m[0] / b[0]:.2f} "
                         f"(incremental runs x{m[1] / b[1]:.2f}), bytes per incremental run "
                         f"x{m[2] / b[2]:.2f}")
        if (mode, NO_STATE) in agg and (mode, "ours") in agg:
            n, b = agg[(mode, NO_STATE)], agg[(mode, "ours")]
            lines.append(f"{mode:8} {NO_STATE:19} vs ours       events/s x{n[0] / b[0]:.2f} "
                         f"(incremental runs x{n[1] / b[1]:.2f}): the most any backend "
                         "could gain under this engine")
    if lines:
        print("\nratios memory backend / RocksDB (events/s: goal >= 2 in a warm session; "
              "bytes per incremental run: goal <= 1.2)")
        print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--events", type=int, default=250_000, help="events per run")
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--parallelism", type=int, default=4, help="state partitions (both engines)")
    p.add_argument("--master", default="local[2]",
                   help="local[N], a spark:// URL, or 'standalone': start a cluster of two "
                        "1-core workers on 127.0.0.1 for this invocation (bench/standalone.py)")
    p.add_argument("--modes", default="process,session,connect",
                   help="comma-separated subset of %(default)s")
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench", "out", "keyed_aggregation"))
    p.add_argument("--quick", action="store_true", help="3 runs x 50,000 events, 20,000 keys")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default %(default)s)")
    p.add_argument("--before", default=PRE_PORT,
                   help="git revision of the pre-port job for the 'before' variant "
                        "(default %(default)s; '' skips it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.quick:
        args.runs, args.events, args.keys = 3, 50_000, 20_000
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip() in VARIANTS]
    if not args.before and "before" in args.variants:
        args.variants.remove("before")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {load} (run benches alone: load slows the JVM peers more)",
          flush=True)
    print(f"workload: {args.runs} runs x {args.events:,} events over {args.keys:,} keys, "
          f"{args.master}, P={args.parallelism}, variants {args.variants}", flush=True)
    with pre_port_tree(args.before if "before" in args.variants else "") as tree, \
            cluster_for(args):
        table = bench(args, tree)
        report({m: v for m, v in table.items() if m != "fixed"}, args)
        report_fixed(table, args.keys)
    report_floor(table, args)
    return 0


@contextmanager
def cluster_for(args: argparse.Namespace) -> Iterator[None]:
    """With ``--master standalone``: a master and two 1-core workers on 127.0.0.1 for the
    whole invocation (``args.master`` becomes its URL), stopped at the end."""
    if args.master != "standalone":
        yield
        return
    from bench.standalone import standalone_cluster

    base = tempfile.mkdtemp(prefix="bench-cluster-")
    try:
        with standalone_cluster(base, workers=2, cores=1, memory="2g") as cluster:
            args.master = cluster.master_url
            print(f"standalone cluster {cluster.master_url}: 2 workers x 1 core", flush=True)
            yield
    finally:
        shutil.rmtree(base, ignore_errors=True)


def report_floor(table: dict, args: argparse.Namespace) -> None:
    """Each warm-session run of ours beside the floor of the same day (`floor_run`, best of
    3, in this process). Goal (issue 14): within 3x of the floor."""
    mine = [v for v in args.variants if v in OURS and v in table.get("session", {})]
    if not mine:
        return
    work = os.path.abspath(args.workdir)
    inputs = os.path.join(work, "input")
    days = sorted(os.path.join(inputs, d) for d in os.listdir(inputs))
    print("\nwarm run vs the floor (Arrow read + group-by + state writes + upload of the day)")
    for day, runs in enumerate(zip(*(table["session"][v] for v in mine), strict=True)):
        floor = min((floor_run(days[day], work) for _ in range(3)), key=lambda f: f["total"])
        parts = ", ".join(f"{k} {v:.3f}" for k, v in floor.items() if k != "total")
        walls = "; ".join(f"{v} {r['wall_s']:.3f} s = x{r['wall_s'] / floor['total']:.2f}"
                          for v, r in zip(mine, runs, strict=True))
        print(f"day {day}: floor {floor['total']:.3f} s ({parts}); {walls}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
