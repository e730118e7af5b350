"""Validate a checkpoint: manifest checks always, content checks at the deep levels.

Levels (`ValidationOptions.level`):

- ``manifest``: the `_metadata` record and the stored files (exist, sizes, CRC32
  streamed from storage, key-group ranges, parent chain). No state is opened.
- ``deep``: the manifest, plus every subtask downloaded (CRC32 of every byte
  received) and opened read-only by RocksDB; from RocksDB's own facts, for *every*
  entry: first and last live key of each column family inside the subtask's range
  (so every key), row counts from the SST table properties when exact, else counted
  by a checked keys-only scan; then the per-entry checks (key group == the lineage's
  key hash of the key mod M, values decode, TTL agreement, the job's checks) on a bounded
  sample: ``sample`` entries per column family and subtask (`sampling.DEFAULT_SAMPLE`),
  a column family that small is checked whole. Cost: about a restore, not a scan.
- ``full``: every entry through every per-entry check (and every RocksDB block read
  and verified): about a full scan of the state in Python (bench/bench_validate.py).

The summary says which level ran (``level``), and at ``deep`` how many entries were
checked one by one (``figures.entries_checked``) and the sample's seed.

Public entry points (other parts code against these names):

- `validate_checkpoint(store, ref="latest", options=ValidationOptions(level=...,
  sample=..., seed=..., report=..., report_dir=..., work_dir=..., state_checks=...),
  progress=NO_PROGRESS) -> ValidationResult` (`statebackend.validation.options`)
- `read_report_summary(store, checkpoint_id) -> dict | None`
- `register_state_checks(state_name, fn)`: expectations on a state for every
  validation in this process (see `statebackend.validation.checks`); a job's own
  expectations come from its definition: ``state_checks=job.expectations``.

Validation never modifies the checkpoint: it reads `_metadata` and the files,
restores into temp folders opened read-only, and writes only under
``<job root>/reports/chk-<id>/`` (or ``report_dir``). A `_metadata` the strict
parser refuses (e.g. a path with ``..``) is a failed critical check
(``metadata_parses``, ``paths_inside_job_root``), not an exception. This module
and `options` import neither pandas nor RocksDB: the work (`statebackend.validation.runner`)
is imported when a validation runs, so importing this module (CLI start, Airflow DAG
parsing) stays fast.

The verdict never waits for Great Expectations (about 10 s to import): every
built-in check is computed with pandas (`suites.evaluate_runs`), and GE only
renders the Data Docs, after the verdict, with ``report="now"`` (the default).
``report="none"`` stores the verdict (summary.json and the overview page) and
imports no GE at all, unless a deep validation runs a job's own checks (GE
expectation objects): the scheduled pipeline's per-run validation uses it, and
the maintenance DAG's deep validation renders the Data Docs.
"""

from __future__ import annotations

from statebackend.checkpoint.layout import CHK_PREFIX, metadata_path
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CheckpointNotFoundError, UsageError
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.validation.checks import register_state_checks, unregister_state_checks
from statebackend.validation.options import (
    LEVELS,
    REPORT_MODES,
    ValidationOptions,
    ValidationResult,
)
from statebackend.validation.report import read_report_summary

__all__ = ["LEVELS", "REPORT_MODES", "ValidationOptions", "ValidationResult",
           "validate_checkpoint", "read_report_summary", "register_state_checks",
           "unregister_state_checks", "resolve_checkpoint_id"]


def resolve_checkpoint_id(store: CheckpointStore, ref: str | int | None = "latest") -> int:
    """Like `CheckpointStore.resolve`, without parsing the metadata (it may be bad)."""
    store.require_job()
    if ref in (None, "", "latest"):
        ids = store.checkpoint_ids()
        if not ids:
            raise CheckpointNotFoundError(
                f"job {store.job!r} has no committed checkpoint under {store.root_storage.url}")
        return ids[-1]
    text = str(ref)
    text = text.removeprefix(CHK_PREFIX)
    if not text.isdigit():
        raise UsageError(f"checkpoint {ref!r} is not 'latest', an id or chk-<id>")
    cid = int(text)
    if not store.storage.exists(metadata_path(cid)):
        raise CheckpointNotFoundError(
            f"checkpoint {cid} of job {store.job!r} not found (no "
            f"{store.storage.url}/{metadata_path(cid)}); see `ckpt list`")
    return cid


def validate_checkpoint(store: CheckpointStore, ref: str | int | None = "latest",
                        options: ValidationOptions | None = None,
                        progress: ProgressSink = NO_PROGRESS) -> ValidationResult:
    """Run the manifest (and at the deep levels the content) suites; store the report.

    ``options``: the level, sample, report mode and places, the job's checks
    (`ValidationOptions`; default: the manifest level, report now). ``progress`` is
    told each phase and, at the content levels, the subtasks restored and checked. An
    unknown checkpoint is refused before any check runs.
    """
    checkpoint_id = resolve_checkpoint_id(store, ref)
    # pandas, pyarrow and RocksDB only once a validation runs (module doc)
    from statebackend.validation import runner

    return runner.validate(store, checkpoint_id, options or ValidationOptions(), progress)
