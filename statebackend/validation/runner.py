"""One validation from start to end: the tables, the verdict, the stored report.

`validate` is what `statebackend.validation.validate.validate_checkpoint` runs once it
has resolved the checkpoint id:

1. the manifest tables (`manifest.build_manifest`) and their built-in suites;
2. at the content levels, the content tables (`content.build_content`: every subtask
   restored read-only) and their suites, plus the job's own checks on its states;
3. the verdict, with pandas (`suites.evaluate_runs`; GE only for a job's checks);
4. the report: Data Docs rendered by GE after the verdict (``report="now"``), then
   the summary and the overview page published (`report.finish_report`); a failure
   before publication removes the half-built report.

This module imports pandas and the content checks (pyarrow, RocksDB): the entry point
imports it only when a validation runs.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import pandas as pd

from statebackend.checkpoint.metadata import CheckpointMetadata, utc_now_iso
from statebackend.checkpoint.restore import external_read
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import MetadataError
from statebackend.progress import ProgressSink
from statebackend.state.kinds import StateDescriptor
from statebackend.validation import content, manifest, report, sampling, suites
from statebackend.validation.checks import StateCheck, registered_state_checks
from statebackend.validation.options import (
    LEVEL_DEEP,
    REPORT_NOW,
    ValidationOptions,
    ValidationResult,
)


@dataclass
class _Findings:
    """What the phases found so far: the table runs, the figures and the timings."""

    runs: list[suites.TableRun]
    figures: dict
    timings: dict = field(default_factory=dict)


def validate(store: CheckpointStore, checkpoint_id: int, options: ValidationOptions,
             progress: ProgressSink) -> ValidationResult:
    """Validate checkpoint ``checkpoint_id`` of ``store`` (module doc) and store the report."""
    started = time.perf_counter()
    progress.phase(f"checking the manifest of checkpoint {checkpoint_id}")
    tables = manifest.build_manifest(store, checkpoint_id,
                                     checksums=None if options.deep else True)
    found = _Findings(
        runs=[suites.builtin_run(name, frame) for name, frame in (
            ("checkpoint", tables.checkpoint), ("files", tables.files),
            ("subtasks", tables.subtasks), ("states", tables.states))],
        figures={"files": len(tables.files),
                 "bytes_referenced": int(tables.files["recorded_size"].clip(lower=0).sum())
                 if len(tables.files) else 0,
                 "subtasks": len(tables.subtasks)})
    found.timings["manifest_seconds"] = round(time.perf_counter() - started, 3)
    if options.deep:
        t0 = time.perf_counter()
        if tables.meta is not None:
            _check_content(store, tables, options, progress, found)
        else:  # the record was refused: nothing can be restored safely; say so per check
            restore = pd.DataFrame([{"subtask": -1, "restored": False,
                                     "restore_error": "not restored: "
                                     + str(tables.metadata_error)}])
            found.runs.append(suites.builtin_run("restore", restore))
        found.timings["content_seconds"] = round(time.perf_counter() - t0, 3)
    # the verdict: pandas over the tables (GE only for a job's own checks)
    t0 = time.perf_counter()
    progress.phase(f"verdict on checkpoint {checkpoint_id}")
    suite_entries, checks = suites.evaluate_runs(found.runs)
    found.timings["verdict_seconds"] = round(time.perf_counter() - t0, 3)
    target = report.prepare_report(store.storage, checkpoint_id, options.report_dir)
    try:
        if options.report == REPORT_NOW:
            _render_data_docs(found, target.docs_dir, progress)
        found.timings["total_seconds"] = round(time.perf_counter() - started, 3)
        summary = _summary(store.job, checkpoint_id, options, found, (suite_entries, checks))
        # each state's schema, as the checkpoint records it (docs/evolve-a-job.md)
        summary["schemas"] = tables.states.drop(columns=["checkpoint_id"]).to_dict("records")
        index = report.finish_report(store.storage, target, summary)
    except BaseException:
        report.discard_report(target)
        raise
    return ValidationResult(success=summary["success"], checkpoint_id=checkpoint_id,
                            summary=summary, report_location=target.location,
                            data_docs_index=index, report_index=summary.get("report_index"))


def job_checks(meta: CheckpointMetadata, extra: Mapping[str, StateCheck] | None
               ) -> dict[str, list]:
    """State name -> the job's expectations on it: the registered checks, then ``extra``;
    a check that answers None (not the state it knows) adds nothing."""
    checks = registered_state_checks(extra)
    found = {}
    for s in meta.states:
        fn = checks.get(s["name"])
        expectations = fn(StateDescriptor.from_json(s)) if fn else None
        if expectations:
            found[s["name"]] = expectations
    return found


def _check_content(store: CheckpointStore, tables: manifest.ManifestTables,
                   options: ValidationOptions, progress: ProgressSink,
                   found: _Findings) -> None:
    """The content tables and their runs (and the job's checks) into ``found``."""
    meta = tables.meta
    if meta is None:  # `validate` reports a refused record without restoring
        raise MetadataError(f"checkpoint {tables.checkpoint_id}: the _metadata record was "
                            f"refused ({tables.metadata_error}); nothing can be restored")
    expectations = job_checks(meta, options.state_checks)
    progress.phase(f"deep validation of checkpoint {meta.checkpoint_id}: restoring and "
                   "checking", total=len(meta.subtasks), unit="subtasks")
    sample = seed = None
    if options.level == LEVEL_DEEP:
        sample = options.sample or sampling.DEFAULT_SAMPLE
        seed = random.randrange(2**32) if options.seed is None else options.seed
        found.figures.update(sample_per_column_family=sample, sample_seed=seed)
    tabled = content.build_content(store.storage, meta, content.ContentOptions(
        frame_states=frozenset(expectations), work_dir=options.work_dir, sample=sample,
        seed=seed, external=external_read(meta, options.state_db)), progress)
    manifest.refresh_files(tables, tabled.facts)
    found.runs[1] = suites.builtin_run("files", tables.files)
    found.runs += [suites.builtin_run(name, frame) for name, frame in (
        ("restore", tabled.restore), ("state", tabled.state), ("families", tabled.families),
        ("counts", tabled.counts))]
    for name, exps in expectations.items():
        frame = tabled.frames.get(name)
        if frame is not None:
            found.runs.append(suites.job_run(name, frame, exps))
    found.figures["state_rows"] = tabled.rows
    found.figures["entries_checked"] = len(tabled.state)
    # how the row counts were taken: {"sst properties" | "scan": column families}
    found.figures["counted_by"] = {str(k): int(v) for k, v in
                                   tabled.counts["counted_by"].value_counts().items()}


def _summary(job: str, checkpoint_id: int, options: ValidationOptions, found: _Findings,
             verdict: tuple[list[dict], list[dict]]) -> dict:
    """The JSON summary (`statebackend.validation.report`) before publication."""
    suite_entries, checks = verdict
    failed = [c for c in checks if not c["success"]]
    critical = [c for c in failed if c["critical"]]
    return {
        "summary_version": report.SUMMARY_VERSION,
        "job": job,
        "checkpoint_id": checkpoint_id,
        "validated_at": utc_now_iso(),
        "deep": options.deep,
        "level": options.level,
        "success": not critical,
        "critical_failures": len(critical),
        "failed_checks": sorted({c["name"] for c in failed}),
        "suites": suite_entries,
        "checks": checks,
        "figures": found.figures,
        "timings": found.timings,
        "duration_seconds": found.timings["total_seconds"],
    }


def _render_data_docs(found: _Findings, docs_dir: str, progress: ProgressSink) -> None:
    """GE's Data Docs of the runs (the verdict is already taken)."""
    progress.phase("loading Great Expectations (report)")
    t0 = time.perf_counter()
    suites.load_great_expectations()
    found.timings["ge_import_seconds"] = round(time.perf_counter() - t0, 3)
    progress.phase("rendering Data Docs")
    t0 = time.perf_counter()
    results = suites.run_suites(found.runs, docs_dir)
    if results:
        found.timings["data_docs_seconds"] = results[0][1].meta.get("ckpt_docs_seconds")
    found.timings["report_seconds"] = round(time.perf_counter() - t0, 3)
