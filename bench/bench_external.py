"""The external state backend (PostgreSQL; MVCC and WAL mode) against RocksDB: rescale,
restore, run cost.

For each state size (``--keys``, default 1M and 4M distinct keys of the keyed
aggregation, built by one run on the local engine, P=4):

- rescale 4 -> 8 of the external checkpoint (new handles over the same database
  version; nothing read or written) and of the RocksDB one (clip and ingest), each in a
  process of its own as Airflow's rescale task runs it (the call alone timed);
- the next run after the rescale (``--run-events`` events over the same keys): its
  restore time and the bytes it downloaded from checkpoint storage (external: a query of
  each subtask's key groups, 0 bytes);
- run cost: that run's wall time and a warm run's after it (same process: the external
  backend adopts the instance it closed), external against RocksDB (the ratios).

The goal of issue 25: rescale time independent of the state size (1M and 4M within
1.2x of each other) and restores that download 0 bytes. A PostgreSQL server (Debian's
package) is started on 127.0.0.1 for the run, fsync off (as the tests do). Run alone on
a quiet machine; the load average is printed.

``--backends`` (default ``external,external-wal,rocksdb``): ``external-wal`` is the
external backend in WAL mode (``--state-mode wal``: WAL files in checkpoint storage,
applied to unversioned tables after each commit).

    python bench/bench_external.py [--keys 1000000,4000000] [--run-events 250000]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from demo.sample_data import DAY_MS, DEFAULT_START_TS_MS, generate_events  # noqa: E402
from jobs import keyed_aggregation as ka  # noqa: E402
from statebackend.job import RunConfig, run_job  # noqa: E402
from tests.postgres_server import PostgresServer  # noqa: E402

JOB = "keyed_aggregation"


def one_size(work: str, keys: int, run_events: int, backend: str, db_url: str) -> dict:
    """Build the state (one run), rescale 4 -> 8, run once more; the figures."""
    root = os.path.join(work, f"{backend}-{keys}")
    storage = f"file://{root}/store"
    kind, _, mode = backend.partition("-")  # external-wal: the external backend's WAL mode

    def config(day: int, **kw) -> RunConfig:
        extra = {"state_db": db_url, "state_table": f"bench_{mode or 'mvcc'}_{keys}",
                 "state_mode": mode or None} if kind == "external" else {}
        return RunConfig(input=os.path.join(work, f"in-{keys}-{day}"), storage=storage,
                         run_id=f"d{day}", output=os.path.join(root, "out"),
                         local_dir=os.path.join(root, "local"), engine="local",
                         backend=kind, **extra, **kw)

    t0 = time.perf_counter()
    first = run_job(ka.JOB, config(0, parallelism=4))
    build_s = time.perf_counter() - t0
    times = []  # 4 -> 8 three times (8 -> 4 between): the median
    for target in (8, 4, 8, 4, 8):
        r, seconds = rescale_in_fresh_process(storage, target)
        if target == 8:
            times.append(seconds)
    rescale_s = sorted(times)[1]
    t0 = time.perf_counter()
    s = run_job(ka.JOB, config(1))
    run_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = run_job(ka.JOB, config(2))  # the same process: a warm incremental run
    warm_s = time.perf_counter() - t0
    return {"backend": backend, "keys": keys, "build_run_s": round(build_s, 2),
            "state_keys": first["keys_touched"],
            "rescale_s": round(rescale_s, 3), "rescale_bytes_downloaded": r["bytes_downloaded"],
            "rescale_bytes_uploaded": r["bytes_uploaded"],
            "run_after_rescale_s": round(run_s, 2),
            "restoring_s": round(s["timings"].get("restoring", 0.0), 2),
            "restore_modes": sorted(set(s["restore_modes"])),
            "bytes_uploaded_by_run": s["bytes_uploaded"],
            "warm_run_s": round(warm_s, 2), "warm_restore_modes":
            sorted(set(warm["restore_modes"])), "warm_bytes_uploaded": warm["bytes_uploaded"]}


# A rescale as the Airflow rescale task runs it: in a process of its own (this one holds
# the live instances of the runs above, gigabytes at 4M keys); the call alone is timed.
_RESCALE = """
import json, sys, time
from statebackend.checkpoint.store import CheckpointStore
from statebackend.rescale.executor import RescaleOptions, rescale
from statebackend.storage import open_storage
store = CheckpointStore(open_storage(sys.argv[1]), sys.argv[2])
t0 = time.perf_counter()
r = rescale(store, "latest", int(sys.argv[3]), options=RescaleOptions(engine="local"))
print(json.dumps({"seconds": time.perf_counter() - t0, "summary": r}))
"""


def rescale_in_fresh_process(storage: str, target: int) -> tuple[dict, float]:
    out = subprocess.run([sys.executable, "-c", _RESCALE, storage, JOB, str(target)],
                         check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["summary"], result["seconds"]


def make_inputs(work: str, keys: int, run_events: int) -> None:
    generate_events(os.path.join(work, f"in-{keys}-0"), n_events=keys, n_keys=keys,
                    seed=1, key_offset=0)
    for day in (1, 2):
        generate_events(os.path.join(work, f"in-{keys}-{day}"), n_events=run_events,
                        n_keys=keys, seed=1 + day, start_ts_ms=DEFAULT_START_TS_MS + day * DAY_MS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="1000000,4000000")
    ap.add_argument("--run-events", type=int, default=250_000)
    ap.add_argument("--backends", default="external,external-wal,rocksdb")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-external-")
    server = PostgresServer()
    server.start()
    print(f"load average at the start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    rows = []
    try:
        for keys in [int(k) for k in args.keys.split(",")]:
            make_inputs(work, keys, args.run_events)
            for backend in args.backends.split(","):
                row = one_size(work, keys, args.run_events, backend, server.url)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        server.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    print("\n| backend | keys (in state) | rescale 4->8 s (median of 3) | bytes down/up | "
          "run after rescale s (restoring s, summed over subtasks) | restore | warm run s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['keys']:,} ({r['state_keys']:,}) | {r['rescale_s']} | "
              f"{r['rescale_bytes_downloaded']}/{r['rescale_bytes_uploaded']} | "
              f"{r['run_after_rescale_s']} ({r['restoring_s']}) | "
              f"{','.join(r['restore_modes'])} | {r['warm_run_s']} "
              f"({','.join(r['warm_restore_modes'])}) |")
    rocks = {r["keys"]: r for r in rows if r["backend"] == "rocksdb"}
    for variant in ("external", "external-wal"):
        summarize(variant, {r["keys"]: r for r in rows if r["backend"] == variant}, rocks)


def summarize(variant: str, ext: dict[int, dict], rocks: dict[int, dict]) -> None:
    """The goal's ratios of one external variant: rescale time across sizes, run cost."""
    if len(ext) >= 2:
        sizes = sorted(ext)
        small, large = ext[sizes[0]]["rescale_s"], ext[sizes[-1]]["rescale_s"]
        print(f"{variant} rescale time {sizes[-1]:,} keys / {sizes[0]:,} keys: "
              f"{large / max(small, 1e-9):.2f}x (goal <= 1.2x)")
    for keys in sorted(set(ext) & set(rocks)):
        ratio = ext[keys]["run_after_rescale_s"] / rocks[keys]["run_after_rescale_s"]
        warm = ext[keys]["warm_run_s"] / rocks[keys]["warm_run_s"]
        print(f"run cost at {keys:,} keys, {variant} / RocksDB: {warm:.2f}x warm, "
              f"{ratio:.2f}x right after a rescale (rescale: {ext[keys]['rescale_s']}s vs "
              f"{rocks[keys]['rescale_s']}s)")


if __name__ == "__main__":
    main()
