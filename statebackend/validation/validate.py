"""Validate a checkpoint: manifest checks always, content checks at the deep levels.

Levels (``level``; ``deep=True`` alone means "deep"):

- ``manifest``: the `_metadata` record and the stored files (exist, sizes, CRC32
  streamed from storage, key-group ranges, parent chain). No state is opened.
- ``deep``: the manifest, plus every subtask downloaded (CRC32 of every byte
  received) and opened read-only by RocksDB; from RocksDB's own facts, for *every*
  entry: first and last live key of each column family inside the subtask's range
  (so every key), row counts from the SST table properties when exact, else counted
  by a checked keys-only scan; then the per-entry checks (key group ==
  murmur3(key) mod M, values decode, TTL agreement, the job's checks) on a bounded
  sample: ``sample`` entries per column family and subtask (`sampling.DEFAULT_SAMPLE`),
  a column family that small is checked whole. Cost: about a restore, not a scan.
- ``full``: every entry through every per-entry check (and every RocksDB block read
  and verified): about a full scan of the state in Python (bench/bench_validate.py).

The summary says which level ran (``level``), and at ``deep`` how many entries were
checked one by one (``figures.entries_checked``) and the sample's seed.

Public entry points (other parts code against these names):

- `validate_checkpoint(store, ref="latest", *, deep=False, level=None, sample=None,
  report_dir=None, state_checks=None) -> ValidationResult`
- `read_report_summary(store, checkpoint_id) -> dict | None`
- `register_state_checks(state_name, fn)`: expectations on a state for every
  validation in this process (see `statebackend.validation.checks`); a job's own
  expectations come from its definition: ``state_checks=job.expectations``.

Validation never modifies the checkpoint: it reads `_metadata` and the files,
restores into temp folders opened read-only, and writes only under
``<job root>/reports/chk-<id>/`` (or ``report_dir``). A `_metadata` the strict
parser refuses (e.g. a path with ``..``) is a failed critical check
(``metadata_parses``, ``paths_inside_job_root``), not an exception. Great
Expectations and pandas are imported only when a validation runs, so importing
this module (CLI start, Airflow DAG parsing) stays fast.

The verdict never waits for Great Expectations (about 10 s to import): every
built-in check is computed with pandas (`suites.evaluate_runs`), and GE only
renders the Data Docs, after the verdict, with ``report="now"`` (the default).
``report="none"`` stores the verdict (summary.json and the overview page) and
imports no GE at all, unless a deep validation runs a job's own checks (GE
expectation objects): the scheduled pipeline's per-run validation uses it, and
the maintenance DAG's deep validation renders the Data Docs.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from statebackend.checkpoint.layout import CHK_PREFIX
from statebackend.checkpoint.metadata import utc_now_iso
from statebackend.checkpoint.store import CheckpointStore, metadata_path
from statebackend.errors import CheckpointNotFoundError, UsageError
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.validation.checks import (
    StateCheck,
    register_state_checks,
    unregister_state_checks,
)

REPORT_NOW = "now"    # verdict, then Data Docs rendered by GE in the same call
REPORT_NONE = "none"  # verdict only (summary.json + overview page): GE is not imported
REPORT_MODES = (REPORT_NOW, REPORT_NONE)
LEVEL_MANIFEST, LEVEL_DEEP, LEVEL_FULL = "manifest", "deep", "full"
LEVELS = (LEVEL_MANIFEST, LEVEL_DEEP, LEVEL_FULL)

__all__ = ["LEVELS", "REPORT_MODES", "ValidationResult", "validate_checkpoint",
           "read_report_summary", "register_state_checks", "unregister_state_checks",
           "resolve_checkpoint_id"]


@dataclass(frozen=True)
class ValidationResult:
    """Outcome of one validation; ``summary`` is the JSON summary that was stored."""

    success: bool
    checkpoint_id: int
    summary: dict = field(compare=False)
    report_location: str
    data_docs_index: str | None
    report_index: str | None = None  # the self-contained overview page (works offline)

    @property
    def failed_checks(self) -> list[str]:
        return list(self.summary.get("failed_checks", []))

    def to_json(self) -> dict:
        return self.summary


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


def validate_checkpoint(store: CheckpointStore, ref: str | int | None = "latest", *,
                        deep: bool = False, report_dir: str | None = None,
                        state_checks: Mapping[str, StateCheck] | None = None,
                        work_dir: str | None = None, report: str = REPORT_NOW,
                        progress: ProgressSink = NO_PROGRESS, level: str | None = None,
                        sample: int | None = None, seed: int | None = None
                        ) -> ValidationResult:
    """Run the manifest (and at the deep levels the content) suites; store the report.

    ``level``: "manifest", "deep" or "full" (module doc); None: "deep" if ``deep``,
    else "manifest". ``sample``: entries checked one by one per column family and
    subtask at "deep" (default `sampling.DEFAULT_SAMPLE`); ``seed``: the sample's seed
    (default random; the summary records it, so a run can be repeated).
    ``state_checks`` maps a state name to a job check (see
    `statebackend.validation.checks`); it adds to / overrides the registered ones.
    ``report``: "now" renders GE Data Docs after the verdict, "none" skips them
    (module docstring). ``progress`` is told each phase and, with ``deep``, the subtasks
    restored and checked.
    """
    if report not in REPORT_MODES:
        raise UsageError(f"report mode {report!r} is invalid: use one of "
                         f"{', '.join(REPORT_MODES)}")
    level = level or (LEVEL_DEEP if deep else LEVEL_MANIFEST)
    if level not in LEVELS or (deep and level == LEVEL_MANIFEST):
        raise UsageError(f"validation level {level!r} is invalid"
                         + (" with deep=True" if level == LEVEL_MANIFEST else "")
                         + f": use one of {', '.join(LEVELS)}")
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int)
                               or sample < 1):
        raise UsageError(f"sample {sample!r} is invalid: give a number of entries >= 1")
    deep = level != LEVEL_MANIFEST
    from statebackend.validation import content as content_mod
    from statebackend.validation import manifest as manifest_mod
    from statebackend.validation import report as report_mod
    from statebackend.validation import sampling
    from statebackend.validation import suites as suites_mod
    from statebackend.validation.checks import registered_state_checks

    cid = resolve_checkpoint_id(store, ref)
    timings: dict = {}
    started = time.perf_counter()
    progress.phase(f"checking the manifest of checkpoint {cid}")
    tables = manifest_mod.build_manifest(store, cid, checksums=None if deep else True)
    runs = [suites_mod.builtin_run("checkpoint", tables.checkpoint),
            suites_mod.builtin_run("files", tables.files),
            suites_mod.builtin_run("subtasks", tables.subtasks),
            suites_mod.builtin_run("states", tables.states)]
    figures: dict = {"files": len(tables.files), "bytes_referenced":
                     int(tables.files["recorded_size"].clip(lower=0).sum())
                     if len(tables.files) else 0,
                     "subtasks": len(tables.subtasks)}
    timings["manifest_seconds"] = round(time.perf_counter() - started, 3)
    if deep:
        t0 = time.perf_counter()
        meta = tables.meta
        job_checks = {}
        if meta is not None:
            from statebackend.state.kinds import StateDescriptor

            checks = registered_state_checks(state_checks)
            for s in meta.states:
                fn = checks.get(s["name"])
                expectations = fn(StateDescriptor.from_json(s)) if fn else None
                if expectations:
                    job_checks[s["name"]] = expectations
            progress.phase(f"deep validation of checkpoint {cid}: restoring and checking",
                           total=len(meta.subtasks), unit="subtasks")
            if level == LEVEL_DEEP:
                sample = sample or sampling.DEFAULT_SAMPLE
                seed = random.randrange(2**32) if seed is None else seed
                figures.update(sample_per_column_family=sample, sample_seed=seed)
            content = content_mod.build_content(
                store.storage, meta, frame_states=set(job_checks), work_dir=work_dir,
                progress=progress, sample=sample if level == LEVEL_DEEP else None, seed=seed)
            manifest_mod.refresh_files(tables, content.facts)
            runs[1] = suites_mod.builtin_run("files", tables.files)
            runs += [suites_mod.builtin_run("restore", content.restore),
                     suites_mod.builtin_run("state", content.state),
                     suites_mod.builtin_run("families", content.families),
                     suites_mod.builtin_run("counts", content.counts)]
            for name, expectations in job_checks.items():
                frame = content.frames.get(name)
                if frame is not None:
                    runs.append(suites_mod.job_run(name, frame, expectations))
            figures["state_rows"] = content.rows
            figures["entries_checked"] = len(content.state)
            # how the row counts were taken: {"sst properties" | "scan": column families}
            figures["counted_by"] = {str(k): int(v) for k, v in
                                     content.counts["counted_by"].value_counts().items()}
        else:
            import pandas as pd

            # the record was refused: nothing can be restored safely; say so per check
            restore = pd.DataFrame([{"subtask": -1, "restored": False,
                                     "restore_error": "not restored: " + str(
                                         tables.metadata_error)}])
            runs.append(suites_mod.builtin_run("restore", restore))
        timings["content_seconds"] = round(time.perf_counter() - t0, 3)

    # the verdict: pandas over the tables (GE only for a job's own checks)
    t0 = time.perf_counter()
    progress.phase(f"verdict on checkpoint {cid}")
    suites, checks = suites_mod.evaluate_runs(runs)
    failed = [c for c in checks if not c["success"]]
    critical = [c for c in failed if c["critical"]]
    timings["verdict_seconds"] = round(time.perf_counter() - t0, 3)
    target = report_mod.prepare_report(store.storage, cid, report_dir)
    try:
        if report == REPORT_NOW:
            _render_data_docs(runs, target.docs_dir, timings, progress)
        timings["total_seconds"] = round(time.perf_counter() - started, 3)
        summary = {
            "summary_version": report_mod.SUMMARY_VERSION,
            "job": store.job,
            "checkpoint_id": cid,
            "validated_at": utc_now_iso(),
            "deep": deep,
            "level": level,
            "success": not critical,
            "critical_failures": len(critical),
            "failed_checks": sorted({c["name"] for c in failed}),
            "suites": suites,
            "checks": checks,
            # each state's schema, as the checkpoint records it (docs/evolve-a-job.md)
            "schemas": tables.states.drop(columns=["checkpoint_id"]).to_dict("records"),
            "figures": figures,
            "timings": timings,
            "duration_seconds": timings["total_seconds"],
        }
        index = report_mod.finish_report(store.storage, target, summary)
    except BaseException:
        report_mod.discard_report(target)
        raise
    return ValidationResult(success=summary["success"], checkpoint_id=cid, summary=summary,
                            report_location=target.location, data_docs_index=index,
                            report_index=summary.get("report_index"))


def _render_data_docs(runs: list, docs_dir: str, timings: dict,
                      progress: ProgressSink) -> None:
    """GE's Data Docs of the runs (the verdict is already taken)."""
    from statebackend.validation import suites as suites_mod

    progress.phase("loading Great Expectations (report)")
    t0 = time.perf_counter()
    suites_mod.load_great_expectations()
    timings["ge_import_seconds"] = round(time.perf_counter() - t0, 3)
    progress.phase("rendering Data Docs")
    t0 = time.perf_counter()
    results = suites_mod.run_suites(runs, docs_dir)
    if results:
        timings["data_docs_seconds"] = results[0][1].meta.get("ckpt_docs_seconds")
    timings["report_seconds"] = round(time.perf_counter() - t0, 3)


def read_report_summary(store: CheckpointStore, checkpoint_id: int) -> dict | None:
    """The JSON summary of the checkpoint's last validation, or None if never validated."""
    from statebackend.validation.report import read_report_summary as read

    return read(store, checkpoint_id)
