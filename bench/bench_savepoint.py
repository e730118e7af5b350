"""Benchmark: a savepoint against the in-process copy of the same files (issue 26, goal 4).

One checkpoint of the keyed aggregation workload's ``totals`` state (N keys, default
1,000,000, P=4 subtasks, file:// storage under ``--workdir``), then interleaved rounds of:

- savepoint: ``create_savepoint`` (lease, name claim, every file hard-linked on file://
  and checked against its recorded size and checksum, ``_metadata`` written);
- copy:      the same files copied once each, in-process, by a pool of the same size
  (``shutil.copyfile``: the kernel's copy, nothing checked) - the floor;
- get+put:   bench_rescale's in-process copy floor (each file downloaded to a local
  folder, then uploaded, both checksummed) for reference.

Each figure is the best of ``--repeats`` rounds; the ratio savepoint / copy is printed
with the load average (goal: at most 1.5x). Run alone on a quiet machine:
``python bench/bench_savepoint.py [--quick] [--keys N] [--json FILE]``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_rescale import (  # noqa: E402
    bench_args,
    build_our_checkpoint,
    copy_in_process,
    make_events,
)
from statebackend.checkpoint.store import CheckpointStore  # noqa: E402
from statebackend.lifecycle.savepoint import COPY_THREADS, create_savepoint  # noqa: E402


def copy_files(store: CheckpointStore, root: str, checkpoint_id: int) -> int:
    """Copy every file of the checkpoint once (the floor); bytes copied."""
    meta = store.load(checkpoint_id)
    dest = os.path.join(root, "copy-bench", uuid.uuid4().hex)
    os.makedirs(dest)
    job_dir = os.path.join(root, store.job)

    def one(path: str) -> int:
        target = os.path.join(dest, path.replace("/", "_"))
        shutil.copyfile(os.path.join(job_dir, path), target)
        return os.path.getsize(target)

    with ThreadPoolExecutor(max_workers=COPY_THREADS) as pool:
        return sum(pool.map(one, [f.path for f in meta.files]))


def main(argv: list[str] | None = None) -> int:
    args = bench_args(argv, __doc__, (1_000_000, 7), (50_000, 2))
    n_keys, repeats, workdir = args.keys, args.repeats, args.workdir
    root = os.path.join(workdir, "store")
    store = build_our_checkpoint(workdir, f"file://{root}", "sp", 4, make_events(n_keys))
    meta = store.latest()
    create_savepoint(store, "latest", "warm-up")  # imports and first-touch costs: untimed
    times: dict[str, list[float]] = {"savepoint": [], "copy": [], "get_put": []}
    for r in range(repeats):
        t = time.perf_counter()
        create_savepoint(store, "latest", f"round-{r}")
        times["savepoint"].append(time.perf_counter() - t)
        t = time.perf_counter()
        copied = copy_files(store, root, meta.checkpoint_id)
        times["copy"].append(time.perf_counter() - t)
        t = time.perf_counter()
        copy_in_process(store, meta.checkpoint_id)
        times["get_put"].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    load = os.getloadavg()
    row = {"keys": n_keys, "files": len(meta.files), "bytes": copied,
           "savepoint_s": round(best["savepoint"], 4), "copy_s": round(best["copy"], 4),
           "get_put_s": round(best["get_put"], 4),
           "savepoint_over_copy": round(best["savepoint"] / best["copy"], 2),
           "savepoint_over_get_put": round(best["savepoint"] / best["get_put"], 2),
           "load_average": [round(x, 2) for x in load],
           "all_rounds_s": {k: [round(x, 4) for x in v] for k, v in times.items()}}
    print(f"bench_savepoint: {n_keys} keys, {len(meta.files)} files, {copied / 1e6:.1f} MB, "
          f"best of {repeats}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"  savepoint {row['savepoint_s']:.4f} s | copy {row['copy_s']:.4f} s | "
          f"get+put {row['get_put_s']:.4f} s")
    print(f"  savepoint / copy = {row['savepoint_over_copy']:.2f}x (goal <= 1.5x); "
          f"savepoint / get+put = {row['savepoint_over_get_put']:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(row, fh, indent=2)
    if args.temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
