"""The ledger of committed runs, and the history of run outcomes.

``<job>/runs/<run>.json``: one file per committed run id (the ledger).
``<job>/runs/history/<utc>-<run>-<outcome>.json``: one file per finished attempt
(committed, skipped or failed), for the page; retention keeps the newest
`HISTORY_KEPT` (lifecycle/retention.py: planned, dry-run, then deleted), so a run
never lists the history. Paths: layout.py.

Runs are idempotent by run id: a run id that was committed once must never count
its input again. The commit record (`_metadata`) names its run id, but retention
retires commit records, so the run ids of retired checkpoints would be forgotten
and a late retry of such a run (an Airflow retry, a cleared interval) would count
its input twice. The ledger remembers them:

- the run protocol writes a run's record right after its `_metadata` commit
  (before `_SUCCESS`); a crash in between leaves the commit record, which still
  names the run, and the skipped re-run writes the missing record;
- retention writes the record of every checkpoint it retires *before* deleting
  its `_metadata` (and spares the checkpoint if that write fails);
- GC and retention never delete ``runs/`` (GC only looks at ``shared/`` and
  ``chk-<id>/``).

So at every moment a committed run id is named by a retained `_metadata`, by its
ledger record, or by both. A record is written only for a committed run, so a
record never claims a run that did not commit. Records are versioned JSON,
parsed strictly; changes must stay backward-compatible.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from statebackend.checkpoint import layout
from statebackend.checkpoint.metadata import CheckpointMetadata, utc_now_iso
from statebackend.checkpoint.metrics import run_figures
from statebackend.errors import CkptError, MetadataError
from statebackend.storage import Storage

HISTORY_KEPT = 500
# "rolledback": `ckpt doctor` rolled the run's checkpoint back; the run counts again
OUTCOMES = ("committed", "skipped", "failed", "rolledback")
log = logging.getLogger(__name__)
RUN_RECORD_VERSION = 1
# What a skipped re-run needs to finish publishing the run's output: the commit record's
# ``output_parts`` and its run's ``keys_touched`` (`metrics.run_figures`); and which
# engine ran it (`statebackend.job.engine`), still known once retention retired it.
CARRIED_EXTRA = ("output_parts", "engine")


def safe_run_name(run_id: str) -> str:
    """A readable, path-safe, collision-free file/folder name for a run id."""
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "_", run_id)[:80]
    if safe != run_id:
        safe += "-" + hashlib.sha1(run_id.encode()).hexdigest()[:8]
    return safe


def run_record_path(run_id: str) -> str:
    return layout.run_record_path(safe_run_name(run_id))


@dataclass(frozen=True)
class RunRecord:
    """A committed run: which checkpoint committed it, at which parallelism."""

    run_id: str
    checkpoint_id: int
    parallelism: int
    committed_at: str
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(meta: CheckpointMetadata) -> RunRecord:
        if meta.run_id is None:
            raise ValueError(f"checkpoint {meta.checkpoint_id} records no run id")
        carried = {k: meta.extra[k] for k in CARRIED_EXTRA if k in meta.extra}
        keys = run_figures(meta.extra).get("keys_touched")
        if keys is not None:
            carried["keys_touched"] = keys
        return RunRecord(meta.run_id, meta.checkpoint_id, meta.parallelism, meta.created_at,
                         carried)

    def to_json(self) -> dict[str, Any]:
        return {"format_version": RUN_RECORD_VERSION, "run_id": self.run_id,
                "checkpoint_id": self.checkpoint_id, "parallelism": self.parallelism,
                "committed_at": self.committed_at, "extra": self.extra}

    def to_bytes(self) -> bytes:
        return json.dumps(dict(self.to_json(), recorded_at=utc_now_iso()),
                          sort_keys=True).encode()

    @staticmethod
    def from_bytes(data: bytes, where: str) -> RunRecord:
        try:
            obj: Any = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise MetadataError(f"malformed run record {where}: {exc}") from exc
        return RunRecord.from_json(obj, where)

    @staticmethod
    def from_json(obj: Any, where: str) -> RunRecord:
        try:
            if not isinstance(obj, dict) or obj.get("format_version") != RUN_RECORD_VERSION:
                raise ValueError("unknown format version "
                                 f"{obj.get('format_version') if isinstance(obj, dict) else obj!r}")
            run_id, cid, p = obj["run_id"], obj["checkpoint_id"], obj["parallelism"]
            if not isinstance(run_id, str) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (cid, p)):
                raise ValueError("run_id must be a string, checkpoint_id and parallelism "
                                 "positive integers")
            extra = obj.get("extra") or {}
            if not isinstance(extra, dict):
                raise ValueError("extra must be an object")
            return RunRecord(run_id, cid, p, str(obj.get("committed_at", "")), extra)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise MetadataError(f"malformed run record {where}: {exc}") from exc


def read_run_record(job_storage: Storage, run_id: str) -> RunRecord | None:
    """The ledger record of ``run_id``, or None (only "absent" counts as absent)."""
    rel = run_record_path(run_id)
    data = job_storage.read_bytes_if_exists(rel)
    if data is None:
        return None
    record = RunRecord.from_bytes(data, f"{job_storage.url}/{rel}")
    if record.run_id != run_id:  # two run ids whose safe names collide: not ours
        return None
    return record


def write_run_record(job_storage: Storage, meta: CheckpointMetadata) -> None:
    """Record ``meta``'s run as committed (idempotent; no-op without a run id)."""
    if meta.run_id is not None:
        write_record(job_storage, RunRecord.of(meta))


def write_record(job_storage: Storage, record: RunRecord) -> None:
    """Write (or rewrite, idempotent) the ledger record ``record``."""
    job_storage.write_bytes(run_record_path(record.run_id), record.to_bytes())


@dataclass(frozen=True)
class RunOutcome:
    """How one attempt of a run ended (history only: never decides idempotency)."""

    run_id: str
    outcome: str  # one of OUTCOMES
    checkpoint_id: int | None
    started_at: str
    duration_s: float
    error: str | None
    context: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps({"format": 1, **asdict(self)}, sort_keys=True, default=str).encode()


def record_outcome(job_storage: Storage, outcome: RunOutcome) -> None:
    """Best effort: add ``outcome`` to the history (one write; retention prunes it)."""
    stamp = re.sub(r"[^0-9]", "", outcome.started_at)[:20]
    rel = layout.history_path(stamp, safe_run_name(outcome.run_id), outcome.outcome)
    try:
        job_storage.write_bytes(rel, outcome.to_bytes())
    except CkptError as exc:  # the history is a report: a run never fails for it
        log.warning("run history not recorded (%s)", exc)


def history_beyond(paths: list[str], keep: int = HISTORY_KEPT) -> list[str]:
    """The history files to prune: all but the newest ``keep`` of ``paths`` (pure; a
    sorted list, e.g. a listing). Names start with the UTC start time, so name order
    is time order."""
    first = bisect.bisect_left(paths, layout.HISTORY_DIR + "/")
    end = bisect.bisect_left(paths, layout.HISTORY_DIR + "0", first)  # "0" follows "/"
    history = paths[first:end]
    return history[:-keep] if len(history) > keep else []
