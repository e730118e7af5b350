"""``make demo``: three days of sample events, one job run per day, then ``ckpt list``.

Everything lands under ``.demo/`` (input, checkpoint storage, output). Running the
demo twice is safe: the runs are idempotent by run id, so the second time every
day is reported as skipped. Delete ``.demo/`` to start over.
"""

from __future__ import annotations

import argparse
import os
import sys

from demo.sample_data import generate_days
from jobs.keyed_aggregation import JobConfig, format_summary, run
from statebackend.cli import app as cli

DEMO_DIR = ".demo"
JOB = "keyed_aggregation"


def run_demo(root: str = DEMO_DIR, *, days: int = 3, events_per_day: int = 20_000,
             n_keys: int = 5_000, parallelism: int = 2, master: str = "local[2]",
             spark=None) -> list[dict]:
    """Generate ``days`` input folders (if missing) and run the job once per day."""
    root = os.path.abspath(root)
    storage = f"file://{root}/checkpoints"
    inputs = generate_days(os.path.join(root, "input"), days, events_per_day=events_per_day,
                           n_keys=n_keys, seed=7, bad_fraction=0.001)
    own_session = spark is None
    if own_session:
        from statebackend.spark.session import get_spark

        spark = get_spark(master, app_name="ckpt-demo")
    summaries = []
    try:
        for folder, _ in inputs:
            day = os.path.basename(folder).split("=", 1)[1]
            summary = run(JobConfig(input=folder, storage=storage, job=JOB, run_id=day,
                                    output=os.path.join(root, "output"),
                                    parallelism=parallelism, master=master), spark)
            print(format_summary(summary), flush=True)
            summaries.append(summary)
    finally:
        if own_session:
            spark.stop()
    print(f"\n$ ckpt --storage {storage} --job {JOB} list", flush=True)
    cli.main(["--storage", storage, "--job", JOB, "list"])
    return summaries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="demo.job_demo", description=__doc__.splitlines()[0])
    p.add_argument("--root", default=DEMO_DIR)
    p.add_argument("--days", type=int, default=3)
    p.add_argument("--events-per-day", type=int, default=20_000)
    p.add_argument("--keys", type=int, default=5_000)
    args = p.parse_args(argv)
    run_demo(args.root, days=args.days, events_per_day=args.events_per_day, n_keys=args.keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
