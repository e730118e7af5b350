"""A job's storage as operations see it, built directly (no Spark): the Checkpoints page tests.

``build_ops_job`` commits N checkpoints one hour apart through `CheckpointStore.commit`
(after writing the files each references): P=2 up to the rescale at ``RESCALE_ID`` (kind
rescale, P=2 -> P=4), then P=4 with subtask 0 holding most bytes (skew). Records before
``METRICS_FROM`` are written as older releases did: chk-1 with no figures, then legacy
``extra`` counters without timings; later ones carry ``extra["metrics"]`` (format 1) and
``extra["context"]["airflow"]``. Validation summaries: passed on every 5th, failed on
``FAILED_VALIDATION``. A savepoint of ``SAVEPOINT_FROM``, a live writer lease, an expired
hold lease, and run records: committed ones, one skipped, and ``FAILED_RUNS`` failed runs
after the last commit. ``expected_*`` give the figures the page must show, computed here
from what was written (the reference for the tests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from statebackend.checkpoint.leases import Lease
from statebackend.checkpoint.metadata import FileRef, SubtaskHandle
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.lifecycle.savepoint import create_savepoint
from statebackend.state.keygroups import key_group_range_for_subtask
from statebackend.storage import checksum_of_bytes, open_storage
from statebackend.validation.report import overview_html

START = datetime(2027, 1, 1, tzinfo=UTC)
RESCALE_ID = 21
METRICS_FROM = 5
FAILED_VALIDATION = 30
SAVEPOINT_FROM = 25
SAVEPOINT = "before-upgrade"
FAILED_RUNS = 2
PHASES = ("restore", "process", "timers", "snapshot", "upload", "commit")


@dataclass(frozen=True)
class OpsJob:
    store: CheckpointStore
    n: int
    start: datetime

    def created(self, cid: int) -> datetime:
        return self.start + timedelta(hours=cid)


def _parallelism(cid: int) -> int:
    return 2 if cid < RESCALE_ID else 4


def subtask_bytes(cid: int, index: int, parallelism: int) -> int:
    """Stored bytes of one subtask: grows with the id; subtask 0 holds 3x the others."""
    return (1000 + 150 * cid) * (3 if index == 0 else 1) // parallelism * 2


def events(cid: int) -> int:
    return 5000 + 100 * cid


def rejects(cid: int) -> dict[str, int]:
    return {"late": cid % 7, "malformed": 2 if cid % 5 == 0 else 0}


def phases(cid: int) -> dict[str, float]:
    return {"restore": 0.5 + 0.01 * cid, "process": 2.0 + 0.05 * cid, "timers": 0.2,
            "snapshot": 0.4, "upload": 0.3 + 0.02 * cid, "commit": 0.05}


def airflow_context(cid: int, start: datetime) -> dict:
    run = f"scheduled__{(start + timedelta(hours=cid)).isoformat()}"
    return {"airflow": {"dag_id": "clicks_pipeline", "run_id": run, "task_id": "run_job",
                        "try_number": 1 + cid % 2, "logical_date": run.split("__")[1]}}


def _extra(cid: int, parallelism: int, start: datetime) -> dict:
    if cid == 1:
        return {}
    by_reason = rejects(cid)
    if cid < METRICS_FROM:  # keyed aggregation before run metrics: counters, no timings
        return {"events_read": events(cid), "events_rejected": sum(by_reason.values()),
                "rejects_by_reason": by_reason, "keys_touched": 40 * cid,
                "input_files": 1, "input_bytes": 10_000}
    subs = [{"index": i, "events": events(cid) // parallelism, "rejected": 0,
             "keys_touched": 10 * cid, "bytes_uploaded": 0, "state_rows": 0,
             "phases": {p: v / parallelism for p, v in phases(cid).items()}}
            for i in range(parallelism)]
    return {"metrics": {"format": 1, "run": {
        "duration_s": sum(phases(cid).values()), "events_read": events(cid),
        "events_rejected": sum(by_reason.values()), "rejects_by_reason": by_reason,
        "keys_touched": 40 * cid, "bytes_uploaded": 0, "state_rows": 0,
        "phases": phases(cid)}, "subtasks": subs},
        "context": airflow_context(cid, start)}


def commit(store: CheckpointStore, cid: int, start: datetime) -> None:
    p = _parallelism(cid)
    handles = []
    for i in range(p):
        r = key_group_range_for_subtask(128, p, i)
        size = subtask_bytes(cid, i, p)
        data = b"\0" * size
        ref = FileRef(f"shared/{cid}-{i}.sst", f"{cid}-{i}.sst", size, checksum_of_bytes(data))
        store.storage.write_bytes(ref.path, data)  # commit checks they exist
        handles.append(SubtaskHandle(i, r.start, r.end, f"b{i}", f"s{cid}", (ref,), (),
                                     {"totals": 10 * cid + i}, size // 2))
    rescale = cid == RESCALE_ID
    meta = build_metadata(MetadataParts(
        job=store.job, checkpoint_id=cid, parent=cid - 1 or None, max_parallelism=128,
        states=[{"name": "totals"}], handles=handles,
        kind="rescale" if rescale else "checkpoint",
        run_id=None if rescale else f"interval__{(start + timedelta(hours=cid)).isoformat()}",
        rescaled_from=2 if rescale else None, extra=_extra(cid, p, start)))
    store.commit(meta.with_changes(created_at=(start + timedelta(hours=cid)).isoformat()))


def write_validation(store: CheckpointStore, cid: int, success: bool, start: datetime) -> None:
    checks = [{"name": "state_decodes", "suite": "ckpt.content.state", "table": "state",
               "critical": True, "success": success, "description": "every value decodes",
               "element_count": 100, "unexpected_count": 0 if success else 3,
               "offending_rows": [] if success else [{"key": "k1", "error": "bad value"}],
               "error": None}]
    summary = {"summary_version": 1, "job": store.job, "checkpoint_id": cid,
               "validated_at": (start + timedelta(hours=cid, minutes=5)).isoformat(),
               "deep": True, "success": success, "critical_failures": 0 if success else 1,
               "failed_checks": [] if success else ["state_decodes"],
               "suites": [{"name": "ckpt.content.state", "table": "state", "success": success,
                           "rows": 100, "checks": 1, "failed": 0 if success else 1}],
               "checks": checks, "duration_seconds": 1.5}
    store.storage.write_bytes(f"reports/chk-{cid}/summary.json", json.dumps(summary).encode())
    store.storage.write_bytes(f"reports/chk-{cid}/index.html",
                              overview_html(summary, {}).encode())


def write_run(store: CheckpointStore, start: datetime, when: datetime, run_id: str,
              outcome: str, checkpoint_id: int | None, error: str | None = None) -> None:
    record = {"format": 1, "run_id": run_id, "outcome": outcome, "checkpoint_id": checkpoint_id,
              "started_at": when.isoformat(), "duration_s": 12.5, "error": error,
              "context": airflow_context(checkpoint_id or 0, start)}
    stamp = when.strftime("%Y%m%dT%H%M%SZ")
    store.storage.write_bytes(f"runs/history/{stamp}-{run_id.replace(':', '_')}.json",
                              json.dumps(record).encode())


def build_ops_job(storage_url: str, job: str = "clicks", n: int = 32,
                  start: datetime = START) -> OpsJob:
    """The job (see the module docstring); chk-<id> is created ``start`` + id hours."""
    store = CheckpointStore(open_storage(storage_url), job)
    for cid in range(1, n + 1):
        commit(store, cid, start)
        if cid % 5 == 0:
            write_validation(store, cid, True, start)
        if cid == SAVEPOINT_FROM:
            create_savepoint(store, cid, SAVEPOINT)
    write_validation(store, FAILED_VALIDATION, False, start)
    for cid in (n - 2, n - 1, n):
        write_run(store, start, start + timedelta(hours=cid, minutes=-1), f"run-{cid}",
                  "committed", cid)
    write_run(store, start, start + timedelta(hours=n, minutes=10), "run-skip", "skipped", None)
    for k in range(FAILED_RUNS):
        write_run(store, start, start + timedelta(hours=n, minutes=20 + k), f"run-fail-{k}",
                  "failed", None, error=f"InputError: input file day={k} is missing\nTraceback")
    now = datetime.now(UTC)
    live = Lease("writer", "worker-1:4242", "job run interval__next", (n,),
                 (now + timedelta(hours=1)).isoformat(), now.isoformat(), "tok-live")
    old = Lease("hold-validate", "worker-2:7", "validate chk-12", (12,),
                (now - timedelta(hours=1)).isoformat(), (now - timedelta(hours=2)).isoformat(),
                "tok-old")
    for lease in (live, old):
        store.storage.write_bytes(lease.path, lease.to_bytes())
    return OpsJob(store, n, start)
