"""Benchmark (issue 21): a value upgrade applied eagerly at restore vs. lazily on read.

A lineage holds ``--keys`` (default 1,000,000) entries of a JSON value state
``profile`` (``{"n": count}``). It is saved once as a savepoint; each contender starts a
fresh lineage from it and runs the same small day (``--touched`` keys, default 10,000):

- none:  the job unchanged (the cost of a run with no change: the baseline);
- eager: the job declares ``Upgrade(1, fn)`` (``{"n": c}`` -> ``{"n": c, "tier": ...}``):
         the run restores, rewrites every entry once (statebackend.state.migrate), then
         runs the day; every later checkpoint holds one version;
- lazy:  the job unchanged in its schema but its logic upgrades a value when it reads
         an old one (what an on-read upgrade does): only the touched keys are
         rewritten; the other entries keep the old shape in every later checkpoint.

Printed per contender: the time of the first run after the change, and the bytes the
run's checkpoint uploaded, each against the baseline; then a second run of every
contender (the steady state). The load average is printed: compare within one run.
Run: ``python bench/bench_migration.py [--keys N] [--touched N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from statebackend.checkpoint.store import CheckpointStore  # noqa: E402
from statebackend.job import (  # noqa: E402
    Input,
    Job,
    RunConfig,
    Upgrade,
    Vectorized,
    run_job,
    value_state,
)
from statebackend.lifecycle.savepoint import create_savepoint  # noqa: E402
from statebackend.storage import open_storage  # noqa: E402

INPUT = Input(schema=pa.schema([("key", pa.string()), ("v", pa.int64())]), key="key")


def tier(value: dict) -> dict:
    """The upgrade: version 1 adds a derived field."""
    return {"n": value["n"], "tier": "gold" if value["n"] >= 2 else "basic"}


def counting(upgrade_on_read: bool):
    def fold(batch: pa.Table, ctx) -> None:
        keys = batch["key"].to_pylist()
        profile = ctx.state("profile")
        old = profile.value(keys)
        new = []
        for value in old:
            value = value or {"n": 0}
            if upgrade_on_read and "tier" not in value:
                value = tier(value)
            value = dict(value, n=value["n"] + 1)
            if "tier" in value:
                value["tier"] = "gold" if value["n"] >= 2 else "basic"
            new.append(value)
        profile.update(keys, new)
    return Vectorized(fold)


def job(kind: str) -> Job:
    upgrades = (Upgrade(1, tier),) if kind == "eager" else ()
    return Job(name="profiles", input=INPUT, logic=counting(kind != "none"),
               states=(value_state("profile", upgrades=upgrades),))


def write_day(folder: str, keys: np.ndarray) -> None:
    os.makedirs(folder, exist_ok=True)
    pq.write_table(pa.table({"key": pa.array([f"u{k:07d}" for k in keys]),
                             "v": pa.array(np.ones(len(keys), np.int64))}),
                   os.path.join(folder, "part.parquet"))


def run(kind: str, storage: str, job_dir: str, day: str, run_id: str, work: str,
        start_from: str | None = None) -> dict:
    t0 = time.perf_counter()
    s = run_job(job(kind), RunConfig(input=day, storage=storage, job=job_dir, run_id=run_id,
                                     output=os.path.join(work, "out"), parallelism=4,
                                     engine="local", start_from=start_from,
                                     local_dir=os.path.join(work, "local", job_dir)))
    return {"seconds": time.perf_counter() - t0, "bytes_uploaded": s["bytes_uploaded"],
            "checkpoint_id": s["checkpoint_id"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--touched", type=int, default=10_000)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench-migration-")
    storage = f"file://{work}/store"
    rng = np.random.default_rng(7)
    write_day(os.path.join(work, "base"), np.arange(args.keys))
    days = [os.path.join(work, f"day{d}") for d in range(2)]
    for folder in days:
        write_day(folder, rng.choice(args.keys, args.touched, replace=False))
    t0 = time.perf_counter()
    run("none", storage, "base", os.path.join(work, "base"), "base", work)
    create_savepoint(CheckpointStore(open_storage(storage), "base"), "latest", "start")
    setup = time.perf_counter() - t0
    results = {}
    for kind in ("none", "eager", "lazy"):
        first = run(kind, storage, kind, days[0], "d0", work, start_from="base/savepoints/start")
        second = run(kind, storage, kind, days[1], "d1", work)
        results[kind] = {"first": first, "second": second}
    load = os.getloadavg()
    base = results["none"]["first"]
    report = {"keys": args.keys, "touched": args.touched, "setup_seconds": round(setup, 2),
              "load_average": [round(x, 2) for x in load], "results": results}
    if args.json:
        print(json.dumps(report, indent=2, default=float))
    else:
        print(f"migration bench: {args.keys:,} entries, {args.touched:,} keys touched per run, "
              f"P=4, local engine; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print(f"{'contender':10} {'first run':>10} {'x none':>7} {'uploaded':>12} "
              f"{'x none':>7} {'second run':>11} {'uploaded':>12}")
        for kind, r in results.items():
            f, s = r["first"], r["second"]
            print(f"{kind:10} {f['seconds']:9.2f}s {f['seconds'] / base['seconds']:6.2f}x "
                  f"{f['bytes_uploaded']:12,} "
                  f"{f['bytes_uploaded'] / max(base['bytes_uploaded'], 1):6.2f}x "
                  f"{s['seconds']:10.2f}s {s['bytes_uploaded']:12,}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
