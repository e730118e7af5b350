"""Benchmark: validating a checkpoint vs restoring it.

Builds a checkpoint of N keys (default 1,000,000) at P=4, M=128 on file:// storage
(or, with ``--s3``, on a local S3 API server: moto on 127.0.0.1)
with the keyed-aggregation job's state (``totals``: record count/sum/min_ts/max_ts,
so the job's own checks run too), then times:

- restore: every subtask downloaded and opened read-only (what a job restart costs);
- restore + scan: the same plus reading every entry once (the floor of any content
  check: listing 1M entries from RocksDB into Python already costs more than the
  download on a local disk);
- manifest validation (existence, sizes, streamed CRC32 of every file, ranges ...);
- deep validation, level ``deep`` (downloads with CRC32, read-only open, RocksDB's
  facts for every entry: key range by first/last key, counts from SST properties;
  per-entry checks on a sample of 1024 entries per column family and subtask);
- deep validation, level ``full`` (every entry's key group recomputed and value
  decoded, row counts by scan, job checks).

Each measurement is repeated, interleaved (restore, scan, manifest, deep, full, then
again), and the best is kept: the machine is shared. Validations are timed with
``report="none"`` (the verdict, computed without Great Expectations) and
``report="now"`` (verdict, then GE Data Docs; once each). Then, as
the scheduled pipeline's validate task runs it, a manifest validation in a new
Python process each: without GE (``ckpt validate --report none``) and with GE
(``--report now``), wall time including imports, and their ratio (issue 14).
Goal: deep validation <= 2x restore (issue 14). Usage::

    python bench/bench_validate.py [--keys N] [--quick] [--s3] [--incremental 0.01] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.s3 import MotoS3, moto_s3  # noqa: E402
from statebackend.checkpoint.dump import descriptors_of  # noqa: E402
from statebackend.checkpoint.restore import restored_readonly  # noqa: E402
from statebackend.checkpoint.snapshot import checkpoint_backends  # noqa: E402
from statebackend.checkpoint.store import CheckpointStore  # noqa: E402
from statebackend.state.backend import KeyedStateBackend  # noqa: E402
from statebackend.state.codecs import RecordCodec  # noqa: E402
from statebackend.state.keygroups import key_group_range_for_subtask  # noqa: E402
from statebackend.state.kinds import StateDescriptor  # noqa: E402
from statebackend.storage import open_storage  # noqa: E402

P, M = 4, 128
TOTALS = StateDescriptor("totals", "value", RecordCodec(
    (("count", "int64"), ("sum", "float64"), ("min_ts", "int64"), ("max_ts", "int64"))))


def build(base: str, n_keys: int, url: str | None = None, options: dict | None = None,
          updated: float = 0.0) -> tuple[CheckpointStore, object, float]:
    """The checkpoint to validate; with ``updated`` (a fraction), an incremental one on
    top that rewrites that fraction of the keys (a new SST overlapping the first)."""
    import mmh3

    store = CheckpointStore(open_storage(url or f"file://{base}/store", **(options or {})),
                            "bench")
    started = time.perf_counter()
    keys = [f"user-{i:09d}" for i in range(n_keys)]
    kgs = np.fromiter((mmh3.hash(k.encode(), 0, False) % M for k in keys), np.int64, n_keys)
    owner = kgs * P // M
    backends = []
    for i in range(P):
        b = KeyedStateBackend(f"{base}/work/{i}", [TOTALS], M, key_group_range_for_subtask(M, P, i))
        idx = np.nonzero(owner == i)[0]
        for lo in range(0, len(idx), 100_000):
            part = idx[lo:lo + 100_000]
            b.value_state("totals").put_columns([keys[j] for j in part], {
                "count": 1 + part % 7, "sum": part * 0.25, "min_ts": 1_000 + part,
                "max_ts": 2_000 + part})
        backends.append(b)
    meta = checkpoint_backends(store, backends, parent=None)
    if updated:
        step = max(1, round(1 / updated))
        for i, b in enumerate(backends):
            part = np.nonzero(owner == i)[0][::step]
            b.value_state("totals").put_columns([keys[j] for j in part], {
                "count": 2 + part % 7, "sum": part * 0.5, "min_ts": 1_000 + part,
                "max_ts": 3_000 + part})
        meta = checkpoint_backends(store, backends, parent=meta.checkpoint_id)
    for b in backends:
        b.close()
    return store, meta, time.perf_counter() - started


def time_restore(store: CheckpointStore, meta, scan: bool = False) -> float:
    """Restore every subtask read-only; with ``scan`` also read every entry once."""
    descriptors = descriptors_of(meta)
    started = time.perf_counter()
    for handle in meta.subtasks:
        with restored_readonly(store.storage, handle, descriptors, meta.max_parallelism) as b:
            if scan:
                for name in b.column_families:
                    cf = b.column_family(name)
                    list(cf.keys())
                    list(cf.values())
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="100,000 keys")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--incremental", type=float, default=0.0, metavar="FRACTION",
                        help="validate an incremental checkpoint rewriting this fraction of "
                             "the keys (e.g. 0.01): overlapping SSTs, so deep counts by scan")
    parser.add_argument("--repeat", type=int, default=3,
                        help="interleaved repetitions (best kept; full: at most 2)")
    parser.add_argument("--s3", action="store_true",
                        help="store the checkpoint on a local S3 API server (moto on 127.0.0.1)")
    args = parser.parse_args()
    n_keys = 100_000 if args.quick else args.keys
    base = tempfile.mkdtemp(prefix="bench-validate-")
    with ExitStack() as stack:
        s3 = stack.enter_context(moto_s3("bench-validate")) if args.s3 else None
        return run(args, n_keys, base, s3)


def run(args, n_keys: int, base: str, s3: MotoS3 | None) -> int:
    """Build the checkpoint (under ``base``, or on ``s3``), time restore and validation."""
    try:
        from statebackend.validation.options import ValidationOptions
        from statebackend.validation.suites import load_great_expectations
        from statebackend.validation.validate import validate_checkpoint

        t0 = time.perf_counter()
        load_great_expectations()
        ge_import = time.perf_counter() - t0
        store, meta, build_s = build(base, n_keys, "s3://bench-validate/run" if s3 else None,
                                     s3.options if s3 else {}, args.incremental)
        mib = meta.bytes_referenced / 2**20
        times: dict[str, list[float]] = {"restore": [], "scan": [], "manifest": [],
                                         "deep": [], "full": []}
        summaries: dict[str, dict] = {}

        def validate(level: str, report: str) -> float:
            t0 = time.perf_counter()
            result = validate_checkpoint(store, meta.checkpoint_id, ValidationOptions(
                level=level, report_dir=f"{base}/reports", report=report))
            wall = time.perf_counter() - t0
            assert result.success, result.summary["failed_checks"]
            name = level if report == "none" else f"{level}+docs"
            if report == "now" or not times[level] or wall < min(times[level]):
                summaries[name] = result.summary  # the best run's timings are printed
            return wall

        for rep in range(args.repeat):
            times["restore"].append(time_restore(store, meta))
            times["scan"].append(time_restore(store, meta, scan=True))
            for level in ("manifest", "deep", "full"):
                if level != "full" or rep < 2:
                    times[level].append(validate(level, "none"))
        best = {k: min(v) for k, v in times.items()}
        median = {k: statistics.median(v) for k, v in times.items()}
        restore_s, scan_s = best["restore"], best["scan"]
        runs = {level: (best[level], summaries[level]["timings"])
                for level in ("manifest", "deep", "full")}
        for level in ("manifest", "deep"):
            runs[f"{level}+docs"] = (validate(level, "now"), None)
        child_env = s3.child_env() if s3 else {}
        process = {mode: validate_in_new_process(store, mode, child_env)
                   for mode in ("none", "now")}
        figures = {
            "keys": n_keys, "parallelism": P, "max_parallelism": M,
            "checkpoint_mib": round(mib, 1), "files": len(meta.files),
            "build_seconds": round(build_s, 2), "ge_import_seconds": round(ge_import, 2),
            "restore_seconds": round(restore_s, 3),
            "restore_and_scan_seconds": round(scan_s, 3),
            "manifest_seconds": round(runs["manifest"][0], 3),
            "deep_seconds": round(runs["deep"][0], 3),
            "full_seconds": round(runs["full"][0], 3),
            "deep_entries_checked": summaries["deep"]["figures"]["entries_checked"],
            "deep_counted_by": summaries["deep"]["figures"]["counted_by"],
            "manifest_timings": runs["manifest"][1], "deep_timings": runs["deep"][1],
            "full_timings": runs["full"][1],
            "manifest_over_restore": round(runs["manifest"][0] / restore_s, 2),
            "deep_over_restore": round(runs["deep"][0] / restore_s, 2),
            "full_over_restore": round(runs["full"][0] / restore_s, 2),
            "deep_over_restore_medians": round(median["deep"] / median["restore"], 2),
            "full_over_restore_medians": round(median["full"] / median["restore"], 2),
            "full_over_restore_and_scan": round(runs["full"][0] / scan_s, 2),
            "all_times": {k: [round(x, 3) for x in v] for k, v in times.items()},
            "goal_deep_over_restore": 2.0,
            "manifest_with_docs_seconds": round(runs["manifest+docs"][0], 3),
            "deep_with_docs_seconds": round(runs["deep+docs"][0], 3),
            "process_without_ge_seconds": round(process["none"], 2),
            "process_with_ge_seconds": round(process["now"], 2),
            "process_with_over_without_ge": round(process["now"] / process["none"], 2),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        }
        if args.json:
            print(json.dumps(figures, indent=1))
        else:
            print(f"checkpoint: {n_keys:,} keys, P={P}, M={M}, {mib:.1f} MiB in "
                  f"{len(meta.files)} files on {store.storage.url} (built in {build_s:.1f} s); "
                  f"load average {' '.join(map(str, figures['load_average']))}")
            print(f"GE import (once per process): {ge_import:.2f} s")
            print(f"restore (download + open read-only, all subtasks): {restore_s:.3f} s")
            print(f"restore + read every entry once (lower bound of any content check): "
                  f"{scan_s:.3f} s")
            print(f"manifest validation: {runs['manifest'][0]:.3f} s  "
                  f"({figures['manifest_over_restore']}x restore)  {runs['manifest'][1]}")
            print(f"deep validation (level deep, {figures['deep_entries_checked']:,} entries "
                  f"checked one by one, counts by {figures['deep_counted_by']}): "
                  f"{runs['deep'][0]:.3f} s  "
                  f"({figures['deep_over_restore']}x restore; goal <= 2x)  {runs['deep'][1]}")
            print(f"deep validation (level full, every entry): {runs['full'][0]:.3f} s  "
                  f"({figures['full_over_restore']}x restore, "
                  f"{figures['full_over_restore_and_scan']}x restore + scan)  {runs['full'][1]}")
            print(f"ratio deep/restore: {figures['deep_over_restore']} (best of each), "
                  f"{figures['deep_over_restore_medians']} (medians); full/restore: "
                  f"{figures['full_over_restore']} (best), {figures['full_over_restore_medians']}"
                  f" (medians); every run (s): {figures['all_times']}")
            print(f"with GE Data Docs rendered after the verdict (report now): manifest "
                  f"{figures['manifest_with_docs_seconds']} s, deep "
                  f"{figures['deep_with_docs_seconds']} s")
            print(f"scheduled validate task, new process each (wall incl. imports): without GE "
                  f"(--report none) {process['none']:.2f} s, with GE (--report now) "
                  f"{process['now']:.2f} s -> {figures['process_with_over_without_ge']}x")
            # The pipeline's validate task is the --report none process; the GE render
            # (the --report now process) runs in <job>_reports, beside the next run.
            print(f"before the next pipeline task may start: the pipeline's validate "
                  f"(--report none) {process['none']:.2f} s; its report renders in "
                  f"<job>_reports ({process['now']:.2f} s), which the pipeline does not wait for")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def validate_in_new_process(store: CheckpointStore, report: str,
                            child_env: dict[str, str]) -> float:
    """Wall time of ``ckpt validate latest --report <report>`` (manifest) in a fresh
    Python process, imports included: what one scheduled validate task costs. The CLI
    reads s3 credentials from its environment: ``child_env`` (the child's only)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [sys.executable, "-c", "import sys; from statebackend.cli.app import main; "
            "sys.exit(main(sys.argv[1:]))", "--storage", store.root_storage.url,
            "--job", store.job, "validate", "latest", "--report", report, "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=root, env={**os.environ, **child_env, "PYTHONPATH": root,
                                                "CKPT_PROGRESS": "off"},
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"validate --report {report} failed: {done.stderr.strip()[-500:]}")
    return wall


if __name__ == "__main__":
    sys.exit(main())
