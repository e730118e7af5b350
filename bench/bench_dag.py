"""Bench: the whole scheduled pipeline run (job -> validate -> retain -> gc) against the job alone.

The pipeline DAG's tasks are the functions of `statebackend.airflow.steps`
(`run_pipeline_job`, `validate_step` with ``report="none"`` as the DAG passes it,
`retain_step`, `gc_step`). Two ways to run them, per daily interval:

- ``process``: each task in a new Python process, as an Airflow worker runs a task
  (the job task pays JVM start-up and imports; validate pays its imports);
- ``session``: all tasks in one process with a warm Spark session.

Printed per interval: the wall time of each task, the job alone, the whole run
(sum of the four tasks), and the ratio whole/job. With ``--report`` the validate
task also renders the Great Expectations report (what maintenance does), to show
what the scheduled verdict no longer waits for.

    PYTHONPATH=. .venv/bin/python bench/bench_dag.py [--days 3] [--events 200000]
    PYTHONPATH=. .venv/bin/python bench/bench_dag.py --modes session --report
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
from datetime import UTC, datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = ("job", "validate", "retain", "gc")
MODES = ("process", "session")


def make_spec(spec: dict):
    from statebackend.airflow.config import JobSpec, SparkSettings

    return JobSpec(name="dagbench", input=spec["input"], output=spec["output"],
                   storage=spec["storage"], parallelism=spec["parallelism"],
                   keep=spec["keep"], gc_grace_seconds=0.0,
                   spark=SparkSettings(master=spec["master"]))


def step(name: str, spec: dict, day: str, spark=None) -> float:
    """Run one pipeline task for interval ``day``; return its wall time."""
    from statebackend.airflow import steps

    started = time.perf_counter()
    job_spec = make_spec(spec)
    logical = datetime.fromisoformat(day).replace(tzinfo=UTC)
    key = steps.run_key(logical, f"scheduled__{day}")
    if name == "job":
        steps.run_pipeline_job(job_spec, logical_date=logical, airflow_run_id=f"scheduled__{day}",
                               spark=spark, storage_options={})
    elif name == "validate":
        steps.validate_step(job_spec, run_id=key, storage_options={},
                            report="now" if spec["report"] else "none")
    elif name == "retain":
        steps.retain_step(job_spec, storage_options={})
    else:
        steps.gc_step(job_spec, storage_options={})
    return time.perf_counter() - started


def task_process(name: str, spec: dict, day: str) -> float:
    """One task in a new process (like an Airflow task); wall time seen from outside."""
    code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); from bench.bench_dag import "
            "step; a = json.loads(sys.argv[1]); step(a['name'], a['spec'], a['day'])")
    env = dict(os.environ)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code,
                           json.dumps({"name": name, "spec": spec, "day": day})],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"bench_dag: task {name} of {day} failed:\n{proc.stderr[-3000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--days", type=int, default=3)
    ap.add_argument("--events", type=int, default=200_000, help="events per day")
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--keep", type=int, default=2, help="retention: checkpoints kept")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--report", action="store_true",
                    help="validate also renders the Great Expectations report")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES):
        raise SystemExit(f"bench_dag: --modes must be among {','.join(MODES)}")

    from demo.sample_data import generate_days

    work = tempfile.mkdtemp(prefix="bench-dag-")
    try:
        days = generate_days(os.path.join(work, "input"), args.days,
                             events_per_day=args.events, n_keys=args.keys)
        labels = [os.path.basename(folder).split("=", 1)[1] for folder, _ in days]
        print(f"bench_dag: {args.days} days x {args.events:,} events over {args.keys:,} keys, "
              f"{args.master}, P={args.parallelism}, keep {args.keep}, validate report "
              f"{'now' if args.report else 'none (as the pipeline DAG)'}; load "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        for mode in modes:
            base = os.path.join(work, mode)
            spec = {"input": os.path.join(work, "input", "day={{ ds }}"),
                    "output": os.path.join(base, "out"), "storage": f"file://{base}/store",
                    "parallelism": args.parallelism, "keep": args.keep,
                    "master": args.master, "report": args.report}
            spark = None
            if mode == "session":
                from statebackend.spark.session import get_spark

                spark = get_spark(args.master, app_name="bench-dag")
            print(f"\nmode {mode}")
            print(f"{'day':>10} " + " ".join(f"{s + ' s':>10}" for s in STEPS)
                  + f" {'job s':>8} {'whole s':>8} {'whole/job':>9}")
            totals = {"job": 0.0, "whole": 0.0}
            try:
                for day in labels:
                    walls = {s: (task_process(s, spec, day) if mode == "process"
                                 else step(s, spec, day, spark)) for s in STEPS}
                    whole = sum(walls.values())
                    totals["job"] += walls["job"]
                    totals["whole"] += whole
                    print(f"{day:>10} " + " ".join(f"{walls[s]:>10.2f}" for s in STEPS)
                          + f" {walls['job']:>8.2f} {whole:>8.2f} {whole / walls['job']:>8.2f}x")
            finally:
                if spark is not None:
                    spark.stop()
            print(f"{'all days':>10} job {totals['job']:.2f} s, whole run {totals['whole']:.2f} "
                  f"s: whole/job {totals['whole'] / totals['job']:.2f}x")
        print(f"load at end {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
