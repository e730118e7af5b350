"""Keyed aggregation: per-key running totals in incremental RocksDB state, one run per batch.

Run it as ``python -m jobs.keyed_aggregation ARGS`` or ``spark-submit
jobs/keyed_aggregation.py ARGS``. Per key the value state ``totals`` keeps
``count``, ``sum``, ``min_ts`` and ``max_ts`` (epoch ms).

One run (driver side; executors: jobs/subtask_runner.py)::

    committed run id?  -> skipped; finish its output publication (_SUCCESS) if a crash
                          came between its commit and the marker
    writer lease       -> a concurrent writer is refused (LeaseConflictError)
    parent = latest checkpoint (or --start-from on the first run)
    list input         -> unsupported files counted; Parquet footers checked (one-line
                          InputError naming a bad file, before any Spark work)
    read + validate    -> key, ts, value, reason, raw     (jobs/quarantine.py)
    key group, subtask -> repartition: partition i holds exactly subtask i's rows
    task i             -> restore, fold batches, write output + quarantine,
                          snapshot + upload, return handle
    driver             -> reject check, commit chk-<id>/_metadata (run id, input),
                          or discard every upload and leave the parent latest

Output: ``<output>/run=<run>/part-<subtask>.parquet`` (touched keys with their new
totals, run_id, checkpoint_id) and a ``_SUCCESS`` file once the checkpoint is
committed; rejected rows go to ``<quarantine>/run=<run>/`` with a ``reason``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, replace

if __package__ in (None, ""):  # spark-submit jobs/keyed_aggregation.py: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from statebackend.checkpoints import CheckpointStore, build_metadata  # noqa: E402
from statebackend.errors import CkptError, UsageError  # noqa: E402
from statebackend.keygroups import DEFAULT_MAX_PARALLELISM, check_parallelism  # noqa: E402
from statebackend.leases import writer_lease  # noqa: E402
from statebackend.metadata import CheckpointMetadata, SubtaskHandle  # noqa: E402
from statebackend.serialization import RecordCodec  # noqa: E402
from statebackend.state import StateDescriptor  # noqa: E402
from statebackend.storage import Storage, open_storage  # noqa: E402

TOTALS = StateDescriptor("totals", "value", RecordCodec(
    (("count", "int64"), ("sum", "float64"), ("min_ts", "int64"), ("max_ts", "int64"))))
DESCRIPTORS = [TOTALS]
JOB_KIND = "keyed_aggregation"
ARROW_BATCH_ROWS = 100_000  # rows per Arrow batch: pre-aggregation works per batch
FORWARDED_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
TIMING_KEYS = ("restoring", "processing", "snapshotting", "uploading", "committing")


class RejectThresholdError(CkptError):
    """More input rows were rejected than --max-reject-fraction allows."""


class JobRunError(CkptError):
    """A Spark task failed; nothing was committed."""


@dataclass(frozen=True)
class JobConfig:
    """One run. ``parallelism``/``max_parallelism`` only matter on a lineage's first run."""

    input: str
    storage: str
    job: str
    run_id: str
    output: str
    parallelism: int | None = None
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    master: str = "local[*]"
    max_reject_fraction: float = 0.01
    quarantine: str | None = None  # default: <output>/_quarantine
    start_from: str | None = None
    local_dir: str | None = None  # executors' local-recovery root (default CKPT_LOCAL_DIR/tmp)
    fail_subtask: int | None = None  # test hook: this subtask raises after its upload

    @property
    def quarantine_url(self) -> str:
        return self.quarantine or f"{self.output.rstrip('/')}/_quarantine"


def run_dir_name(run_id: str) -> str:
    """Folder of one run under output/quarantine: readable, path-safe, collision-free."""
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "_", run_id)[:80]
    if safe != run_id:
        safe += "-" + hashlib.sha1(run_id.encode()).hexdigest()[:8]
    return f"run={safe}"


def _summary(config: JobConfig, *, checkpoint_id: int | None, parallelism: int | None,
             started: float, skipped: bool, events: int = 0, rejected: int = 0,
             keys: int = 0, uploaded: int = 0, timings: dict | None = None,
             **extra: object) -> dict:
    out = {
        "run_id": config.run_id, "job": config.job, "checkpoint_id": checkpoint_id,
        "events_read": events, "events_rejected": rejected, "keys_touched": keys,
        "bytes_uploaded": uploaded, "duration_s": round(time.perf_counter() - started, 3),
        "parallelism": parallelism, "skipped": skipped,
        "timings": {k: round((timings or {}).get(k, 0.0), 3) for k in TIMING_KEYS},
    }
    out.update(extra)
    return out


def run(config: JobConfig, spark=None) -> dict:
    """Run once; return the summary. Raises CkptError subclasses with one-line messages."""
    started = time.perf_counter()
    if not 0.0 <= config.max_reject_fraction <= 1.0:
        raise UsageError(f"--max-reject-fraction {config.max_reject_fraction} must be in [0, 1]")
    if not config.run_id:
        raise UsageError("--run-id must not be empty")
    storage = open_storage(config.storage)
    if storage.protocol == "memory":
        raise UsageError(f"storage {config.storage} lives in one process, but Spark tasks run "
                         "in others: use a file:// path or s3://")
    store = CheckpointStore(storage, config.job)
    done = store.find_by_run_id(config.run_id)
    if done is not None:
        return _skipped(config, store, done, started)
    with writer_lease(store.storage, f"{JOB_KIND} run {config.run_id}"):
        done = store.find_by_run_id(config.run_id)  # committed while we waited for the lease
        if done is not None:
            return _skipped(config, store, done, started)
        parent = store.latest()
        if parent is None and config.start_from:
            from statebackend.savepoint import import_start_point

            parent = import_start_point(storage, config.job, config.start_from)
        elif config.start_from:
            print(f"keyed_aggregation: --start-from ignored: job {config.job!r} already has "
                  f"checkpoint {parent.checkpoint_id}", file=sys.stderr)
        from jobs.quarantine import check_parquet, list_input

        files = list_input(config.input)
        check_parquet(files)  # before Spark starts: a bad file costs no session
        if spark is None:
            from jobs.spark_session import get_spark

            spark = get_spark(config.master, app_name=f"{JOB_KIND}-{config.job}")
        return _run_attempt(spark, config, store, parent, files, started)


def _lineage_shape(config: JobConfig, parent: CheckpointMetadata | None, spark) -> tuple[int, int]:
    if parent is not None:
        for name, asked, kept in (("parallelism", config.parallelism, parent.parallelism),
                                  ("max parallelism", config.max_parallelism,
                                   parent.max_parallelism)):
            if asked is not None and asked != kept and not (
                    name == "max parallelism" and asked == DEFAULT_MAX_PARALLELISM):
                print(f"keyed_aggregation: {name} {asked} ignored: the lineage keeps {kept} "
                      "(use rescale-restore to change parallelism)", file=sys.stderr)
        return parent.parallelism, parent.max_parallelism
    if config.parallelism is not None:
        check_parallelism(config.parallelism, config.max_parallelism)
        return config.parallelism, config.max_parallelism
    p = min(spark.sparkContext.defaultParallelism, config.max_parallelism)
    check_parallelism(p, config.max_parallelism)
    return p, config.max_parallelism


def _run_attempt(spark, config: JobConfig, store: CheckpointStore,
                 parent: CheckpointMetadata | None, files, started: float) -> dict:
    from pyspark.sql import functions as F

    from jobs import subtask_runner as sr
    from jobs.quarantine import MARKER, VALIDATED_DDL, read_validated

    parallelism, max_parallelism = _lineage_shape(config, parent, spark)
    checkpoint_id = store.next_checkpoint_id()
    run_dir = run_dir_name(config.run_id)
    # Leftovers of a crashed attempt of this run id must not mix with this attempt's parts.
    for url in (config.output, config.quarantine_url):
        open_storage(url).delete_tree(run_dir)
    params = sr.TaskParams(
        storage_url=store.root_storage.url, job=config.job, checkpoint_id=checkpoint_id,
        parallelism=parallelism, max_parallelism=max_parallelism,
        parent_handles=tuple(json.dumps(h.to_json()) for h in parent.subtasks) if parent else (),
        descriptors=tuple(DESCRIPTORS), state_name=TOTALS.name, output_url=config.output,
        quarantine_url=config.quarantine_url, run_dir=run_dir, run_id=config.run_id,
        part_values=tuple(sr.partition_values(parallelism)), local_dir=config.local_dir,
        fail_subtask=config.fail_subtask)
    _forward_env(spark)
    validated = read_validated(spark, files)
    routed = validated.mapInArrow(functools.partial(sr.assign_partition, params),
                                  VALIDATED_DDL + ", _p int")
    markers = spark.createDataFrame(
        [(None, None, None, MARKER, None, None, None, v) for v in params.part_values],
        VALIDATED_DDL + ", _p int")
    # Sorting within the partition fixes the order in which floats are summed, so the
    # same input gives bit-identical state in local and cluster mode.
    tasks = (routed.unionByName(markers).repartition(parallelism, F.col("_p"))
             .sortWithinPartitions("key", "ts", "value")
             .mapInArrow(functools.partial(sr.run_subtask, params), sr.RESULT_DDL))
    conf_key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    saved = spark.conf.get(conf_key, None)
    spark.conf.set(conf_key, str(ARROW_BATCH_ROWS))
    group = f"{JOB_KIND}-{config.job}-{checkpoint_id}-{time.time_ns()}"
    spark.sparkContext.setJobGroup(group, f"{JOB_KIND} {config.job} run {config.run_id}")
    try:
        rows = [r.asDict() for r in tasks.collect()]
    except Exception as exc:  # noqa: BLE001 - Py4J/PythonException: re-raised as one line
        _wait_for_tasks(spark, group)
        _discard_attempt(store.storage, checkpoint_id, [], (config.output, run_dir))
        where = f"checkpoint {parent.checkpoint_id} stays latest" if parent else \
            "no checkpoint was committed"
        raise JobRunError(f"run {config.run_id!r} of job {config.job!r} failed in a Spark task: "
                          f"{_task_failure(exc)}; {where}") from exc
    finally:
        for prop in ("spark.jobGroup.id", "spark.job.description"):
            spark.sparkContext.setLocalProperty(prop, None)
        if saved is None:
            spark.conf.unset(conf_key)
        else:
            spark.conf.set(conf_key, saved)
    return _commit(config, store, parent, files, checkpoint_id, parallelism, max_parallelism,
                   rows, started)


def _commit(config: JobConfig, store: CheckpointStore, parent: CheckpointMetadata | None,
            files, checkpoint_id: int, parallelism: int, max_parallelism: int,
            rows: list[dict], started: float) -> dict:
    from jobs import subtask_runner as sr

    by_subtask = {r["subtask"]: r for r in rows}
    if sorted(by_subtask) != list(range(parallelism)):
        _discard_attempt(store.storage, checkpoint_id, rows,
                         (config.output, run_dir_name(config.run_id)))
        raise JobRunError(f"run {config.run_id!r}: subtasks {sorted(by_subtask)} reported, "
                          f"expected 0..{parallelism - 1}; nothing committed")
    handles = []
    for i in range(parallelism):
        text = by_subtask[i]["handle"]
        # A carried-forward handle uploaded nothing in this checkpoint.
        handles.append(SubtaskHandle.from_json(json.loads(text), f"subtask {i} result")
                       if text else replace(parent.subtasks[i], bytes_uploaded=0))
    events = sum(r["events"] for r in rows)
    rejected = sum(r["rejected"] for r in rows)
    reasons: dict[str, int] = {}
    for r in rows:
        for k, v in json.loads(r["reasons"]).items():
            reasons[k] = reasons.get(k, 0) + v
    read = events + rejected
    if rejected and rejected > config.max_reject_fraction * read:
        _discard_attempt(store.storage, checkpoint_id, rows,
                         (config.output, run_dir_name(config.run_id)))
        detail = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items()))
        raise RejectThresholdError(
            f"run {config.run_id!r}: {rejected} of {read} input rows rejected "
            f"({rejected / read:.2%}) exceeds --max-reject-fraction {config.max_reject_fraction}"
            f" ({detail}); rows quarantined under {config.quarantine_url}/"
            f"{run_dir_name(config.run_id)}; nothing committed")
    timings = {k: sum(r[f"t_{k}"] for r in rows) for k in TIMING_KEYS if k != "committing"}
    t0 = time.perf_counter()
    extra = {"events_read": read, "events_rejected": rejected, "rejects_by_reason": reasons,
             "keys_touched": sum(r["keys_touched"] for r in rows), "input_files": files.count,
             "input_files_skipped": len(files.skipped),
             "input_bytes": files.total_bytes, "output": config.output,
             # Which parts the run wrote: a re-run may only publish a complete folder.
             "output_parts": [sr.output_part_name(r["subtask"]) for r in
                              sorted(rows, key=lambda r: r["subtask"]) if r["keys_touched"]],
             "job_kind": JOB_KIND}
    meta = build_metadata(
        job=config.job, checkpoint_id=checkpoint_id,
        parent=parent.checkpoint_id if parent else None, max_parallelism=max_parallelism,
        states=[d.to_json() for d in DESCRIPTORS], handles=handles, run_id=config.run_id,
        inputs=[config.input], extra=extra)
    try:
        store.commit(meta)
    except BaseException:
        _discard_attempt(store.storage, checkpoint_id, rows,
                         (config.output, run_dir_name(config.run_id)))
        raise
    # A crash from here on leaves a committed run without _SUCCESS: its re-run is
    # skipped and finishes both steps (_skipped).
    _cleanup_attempts(store.storage, checkpoint_id, rows)
    _write_success(config)
    timings["committing"] = time.perf_counter() - t0
    return _summary(
        config, checkpoint_id=checkpoint_id, parallelism=parallelism, started=started,
        skipped=False, events=read, rejected=rejected, keys=extra["keys_touched"],
        uploaded=meta.bytes_uploaded, timings=timings, rejects_by_reason=reasons,
        restore_modes=[by_subtask[i]["restore_mode"] for i in range(parallelism)],
        reuploaded=sorted(p for r in rows for p in json.loads(r.get("reuploaded") or "[]")),
        parent=meta.parent, published=True, **files.skipped_report())


def _write_success(config: JobConfig) -> None:
    open_storage(config.output).write_bytes(f"{run_dir_name(config.run_id)}/_SUCCESS", b"")


def _skipped(config: JobConfig, store: CheckpointStore, done: CheckpointMetadata,
             started: float) -> dict:
    """A committed run id: count nothing again, but finish what a crash after its commit left.

    Idempotent: ``_SUCCESS`` is written only when absent and when every output part the
    commit recorded is there (a folder whose parts were removed is not published).
    """
    _cleanup_committed_attempts(store.storage, done)
    published, missing = _finish_publication(config, done)
    extra: dict = {"published": published}
    if missing:
        extra["output_parts_missing"] = missing
    return _summary(config, checkpoint_id=done.checkpoint_id, parallelism=done.parallelism,
                    started=started, skipped=True, **extra)


def _finish_publication(config: JobConfig, done: CheckpointMetadata) -> tuple[bool, list[str]]:
    """Write the run's missing ``_SUCCESS``; returns (written now, missing parts)."""
    out = open_storage(config.output)
    run_dir = run_dir_name(config.run_id)
    if out.exists(f"{run_dir}/_SUCCESS"):
        return False, []
    missing = _missing_parts(out, run_dir, done)
    if missing:
        return False, missing
    _write_success(config)
    return True, []


def _missing_parts(out: Storage, run_dir: str, done: CheckpointMetadata) -> list[str]:
    parts = done.extra.get("output_parts")
    if isinstance(parts, list):
        return [str(p) for p in parts if not out.exists(f"{run_dir}/{p}")]
    # Committed before output_parts was recorded: a folder with parts will do, or none
    # at all when the run touched no key.
    if done.extra.get("keys_touched") == 0 or any(
            n.endswith(".parquet") for n in out.list_dir(run_dir)):
        return []
    return ["part-*.parquet"]


def _cleanup_committed_attempts(job_storage: Storage, meta: CheckpointMetadata) -> None:
    """Drop the attempt records (and losing attempts' uploads) a crash left after a commit."""
    records = _attempt_records(job_storage, meta.checkpoint_id)
    if not records:
        return
    from jobs.subtask_runner import ATTEMPTS_DIR

    referenced = {f.path for f in meta.files}
    losers = {p for rec in records for p in rec.get("uploaded", [])
              if isinstance(p, str) and p not in referenced}
    try:
        job_storage.delete_many(sorted(losers))
        job_storage.delete_tree(f"chk-{meta.checkpoint_id}/{ATTEMPTS_DIR}")
    except CkptError:
        pass  # best effort: `ckpt gc` removes orphans later


def _attempt_records(job_storage: Storage, checkpoint_id: int) -> list[dict]:
    from jobs.subtask_runner import ATTEMPTS_DIR

    records = []
    for info in job_storage.walk_files(f"chk-{checkpoint_id}/{ATTEMPTS_DIR}"):
        try:
            records.append(json.loads(job_storage.read_bytes(info.path)))
        except (CkptError, ValueError):
            continue
    return records


def _discard_attempt(job_storage: Storage, checkpoint_id: int, rows: list[dict],
                     output: tuple[str, str] | None = None) -> None:
    """Best effort: remove everything this uncommitted attempt uploaded (and its output)."""
    if output is not None:
        try:
            open_storage(output[0]).delete_tree(output[1])
        except CkptError:
            pass
    paths = {p for r in rows for p in json.loads(r.get("uploaded") or "[]")}
    for rec in _attempt_records(job_storage, checkpoint_id):
        paths.update(p for p in rec.get("uploaded", []) if isinstance(p, str))
    try:
        job_storage.delete_many(sorted(p for p in paths if p.startswith(("shared/", "chk-"))))
        job_storage.delete_tree(f"chk-{checkpoint_id}")
    except CkptError as exc:
        print(f"keyed_aggregation: cleanup of chk-{checkpoint_id} incomplete ({exc}); "
              "`ckpt gc` removes the orphans later", file=sys.stderr)


def _cleanup_attempts(job_storage: Storage, checkpoint_id: int, rows: list[dict]) -> None:
    """After the commit: drop uploads of losing task attempts and the attempt records."""
    from jobs.subtask_runner import ATTEMPTS_DIR

    winners = {(r["subtask"], r["attempt"]) for r in rows}
    kept = {p for r in rows for p in json.loads(r.get("uploaded") or "[]")}
    losers = [p for rec in _attempt_records(job_storage, checkpoint_id)
              if (rec.get("subtask"), rec.get("attempt")) not in winners
              for p in rec.get("uploaded", []) if isinstance(p, str) and p not in kept]
    try:
        job_storage.delete_many(losers)
        job_storage.delete_tree(f"chk-{checkpoint_id}/{ATTEMPTS_DIR}")
    except CkptError:
        pass


def _wait_for_tasks(spark, group: str, timeout_s: float = 60.0) -> None:
    """After a failed job, let its other tasks stop before their uploads are removed."""
    tracker = spark.sparkContext.statusTracker()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stages = [st for job in tracker.getJobIdsForGroup(group)
                  for info in [tracker.getJobInfo(job)] if info is not None
                  for st in info.stageIds]
        active = 0
        for stage in stages:
            info = tracker.getStageInfo(stage)
            active += info.numActiveTasks if info is not None else 0
        if not active:
            return
        time.sleep(0.2)


def _forward_env(spark) -> None:
    """Python workers get the driver's current AWS_* settings (credentials stay env-only)."""
    env = spark.sparkContext.environment
    for var in FORWARDED_ENV:
        if os.environ.get(var):
            env[var] = os.environ[var]
        else:
            env.pop(var, None)


_FAILED_FILE = re.compile(r"Encountered error while reading file (\S+?)\.?(?:\s|$)")
_CAUSED_BY = re.compile(r"^Caused by: ([A-Za-z_.$]*(?:Error|Exception)\b.*)")


def _task_failure(exc: BaseException) -> str:
    """One line: the input file Spark names (if any) and the deepest cause."""
    text = str(exc)
    found = _FAILED_FILE.search(text)
    if found is None:
        return _root_cause(exc)
    causes = [m.group(1).strip() for ln in text.splitlines()
              if (m := _CAUSED_BY.match(ln.strip()))]
    cause = causes[-1] if causes else _root_cause(exc)
    return (f"cannot read input file {found.group(1)}: {cause[:300]}; replace or remove "
            "that file and re-run")


def _root_cause(exc: BaseException) -> str:
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", ln) and "Py4J" not in ln:
            return ln[:500]
    return (lines[-1] if lines else type(exc).__name__)[:500]


# -- CLI -------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="keyed_aggregation",
        description="Per-key running totals (count, sum, min_ts, max_ts) in incremental "
                    "RocksDB state; one idempotent run per input folder.")
    p.add_argument("--input", required=True,
                   help="folder of Parquet and/or JSON-lines files (key, ts, value)")
    p.add_argument("--storage", required=True, help="checkpoint storage root (path, s3://...)")
    p.add_argument("--job", required=True, help="job name (folder under the storage root)")
    p.add_argument("--run-id", required=True, help="idempotency key: a committed run id is "
                                                   "skipped")
    p.add_argument("--output", required=True, help="output folder (Parquet per run)")
    p.add_argument("--parallelism", type=int, default=None,
                   help="subtasks P (first run of a lineage; later runs keep it)")
    p.add_argument("--max-parallelism", type=int, default=DEFAULT_MAX_PARALLELISM,
                   help="key groups M (fixed at the first run; default %(default)s)")
    p.add_argument("--master", default=None,
                   help="Spark master (default: spark-submit's --master, else local[*])")
    p.add_argument("--max-reject-fraction", type=float, default=0.01,
                   help="fail when more than this fraction of rows is rejected "
                        "(default %(default)s)")
    p.add_argument("--quarantine", default=None,
                   help="folder for rejected rows (default <output>/_quarantine)")
    p.add_argument("--start-from", default=None,
                   help="first run only: start from a savepoint or another job's checkpoint")
    p.add_argument("--local-dir", default=None,
                   help="executors' local-recovery folder (default $CKPT_LOCAL_DIR or tmp)")
    p.add_argument("--json", action="store_true", help="print the run summary as one JSON object")
    return p


def default_master() -> str:
    """Under spark-submit the JVM already knows --master; otherwise local[*]."""
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        from pyspark import SparkConf, SparkContext

        SparkContext._ensure_initialized()  # connect to spark-submit's JVM: its conf has --master
        return SparkConf().get("spark.master", "local[*]")
    return "local[*]"


def config_from_args(args: argparse.Namespace) -> JobConfig:
    return JobConfig(input=args.input, storage=args.storage, job=args.job, run_id=args.run_id,
                     output=args.output, parallelism=args.parallelism,
                     max_parallelism=args.max_parallelism,
                     master=args.master or default_master(),
                     max_reject_fraction=args.max_reject_fraction, quarantine=args.quarantine,
                     start_from=args.start_from, local_dir=args.local_dir)


def _stop_spark() -> None:
    if "pyspark" in sys.modules:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()


def format_summary(s: dict) -> str:
    if s["skipped"]:
        done = ("; its output is now published (_SUCCESS was missing)" if s.get("published")
                else "")
        if s.get("output_parts_missing"):
            done = (f"; output not published: parts missing "
                    f"({', '.join(s['output_parts_missing'][:5])})")
        return (f"run {s['run_id']}: skipped, already committed as checkpoint "
                f"{s['checkpoint_id']} of job {s['job']}{done}")
    t = ", ".join(f"{k} {v:.2f}s" for k, v in s["timings"].items())
    return (f"run {s['run_id']}: checkpoint {s['checkpoint_id']} of job {s['job']} "
            f"(P={s['parallelism']}): {s['events_read']} events read, {s['events_rejected']} "
            f"rejected, {s['keys_touched']} keys touched, {s['bytes_uploaded']} bytes uploaded "
            f"in {s['duration_s']:.2f}s ({t})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Executors import jobs/ and statebackend/ from the same checkout (PYTHONPATH is forwarded).
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p])
    try:
        summary = run(config)
    except CkptError as exc:
        print(f"keyed_aggregation: error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        _stop_spark()
    if args.json:
        json.dump(summary, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print(format_summary(summary))
        if summary.get("input_files_skipped"):
            print(f"keyed_aggregation: warning: {skipped_warning(config.input, summary)}",
                  file=sys.stderr)
    return 0


def skipped_warning(input_url: str, summary: dict) -> str:
    n, names = summary["input_files_skipped"], summary.get("input_files_skipped_names") or []
    more = f" and {n - len(names)} more" if n > len(names) else ""
    return (f"{n} unsupported input file(s) under {input_url} skipped ({', '.join(names)}"
            f"{more}); only *.parquet and JSON lines (optionally .gz) are read")


__all__ = ["DESCRIPTORS", "TOTALS", "JobConfig", "main", "run"]

if __name__ == "__main__":
    if __package__ in (None, ""):
        # Re-enter through the package so Spark pickles task functions by reference.
        from jobs.keyed_aggregation import main as _main

        sys.exit(_main())
    sys.exit(main())
