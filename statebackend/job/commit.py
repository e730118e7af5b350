"""The commit of one run, in steps: check the results, build the record.

`check_results` accepts a run's `TaskResult`s only when every subtask reported and
the rejected rows stay within ``--max-reject-fraction`` (late rows are not bad data:
they do not count); otherwise one-line errors, and the caller discards the attempt.
`commit_record` builds the commit record (pure): the subtasks' new handles (a
subtask that changed nothing carries its parent's forward), the states' schemas,
and in ``extra`` what the run read and wrote, its metrics, its time and counters.
The run protocol (`statebackend.job.run`) then commits it through its `Attempt` and
publishes the outputs (`statebackend.job.publish`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskHandle
from statebackend.checkpoint.store import MetadataParts, build_metadata
from statebackend.errors import JobRunError, RejectThresholdError
from statebackend.job.clock import next_times
from statebackend.job.plan import RunPlan
from statebackend.job.publish import output_parts, run_dir_name
from statebackend.job.results import RunTotals, TaskResult, aggregate, run_metrics


def check_results(plan: RunPlan, results: Sequence[TaskResult]) -> RunTotals:
    """The run's totals, once every subtask reported and the rejects are within bounds
    (module doc); `JobRunError` / `RejectThresholdError` otherwise (nothing committed)."""
    config = plan.config
    reported = sorted(r.subtask for r in results)
    if reported != list(range(plan.parallelism)):
        raise JobRunError(f"run {config.run_id!r}: subtasks {reported} reported, expected "
                          f"0..{plan.parallelism - 1}; nothing committed")
    totals = aggregate(results, config.memory_limit_mb)
    bad = totals.rejected - totals.late  # late rows are not bad data
    if bad and bad > config.max_reject_fraction * totals.read:
        detail = ", ".join(f"{k}={v}" for k, v in totals.reasons.items())
        raise RejectThresholdError(
            f"run {config.run_id!r}: {totals.rejected} of {totals.read} input rows rejected "
            f"({totals.rejected / totals.read:.2%}) exceeds --max-reject-fraction "
            f"{config.max_reject_fraction} ({detail}); rows quarantined under "
            f"{config.quarantine_url}/{run_dir_name(config.run_id)}; nothing committed")
    return totals


def commit_record(plan: RunPlan, results: Sequence[TaskResult],
                  totals: RunTotals) -> CheckpointMetadata:
    """The run's commit record (module doc); pure."""
    ordered = sorted(results, key=lambda r: r.subtask)
    handles = [r.handle if r.handle is not None else _carried(plan, r.subtask)
               for r in ordered]
    meta = build_metadata(MetadataParts(
        job=plan.job_dir, checkpoint_id=plan.checkpoint_id,
        parent=plan.parent.checkpoint_id if plan.parent else None,
        max_parallelism=plan.max_parallelism, states=plan.states, handles=handles,
        run_id=plan.config.run_id, inputs=[plan.config.input],
        extra=record_extra(plan, ordered, totals, handles), key_hash=plan.key_hash))
    if _keeps_time(plan):  # other jobs' records stay as they were
        meta = meta.with_changes(watermark=plan.clock.new_watermark,
                                 processing_time=plan.clock.processing_time)
    return meta


def _carried(plan: RunPlan, subtask: int) -> SubtaskHandle:
    """The parent's handle of ``subtask``, carried forward: it uploaded nothing in this
    checkpoint."""
    if plan.parent is None:  # a subtask returns no handle only when there is a parent
        raise JobRunError(f"run {plan.config.run_id!r}: subtask {subtask} returned no "
                          "handle but the lineage has no parent; nothing committed")
    return replace(plan.parent.subtasks[subtask], bytes_uploaded=0)


def record_extra(plan: RunPlan, results: Sequence[TaskResult], totals: RunTotals,
                 handles: Sequence[SubtaskHandle]) -> dict:
    """The commit record's ``extra``: events, rejects and keys touched are recorded once,
    in "metrics" (statebackend.checkpoint.metrics)."""
    config, files = plan.config, plan.files
    extra = {"input_files": files.count, "input_files_skipped": len(files.skipped),
             "input_bytes": files.total_bytes, "input_reader": plan.input_reader,
             "engine": plan.choice.engine, "output": config.output,
             # Which parts the run wrote: a re-run may only publish complete folders.
             "output_parts": output_parts(plan.job, results), "job_kind": plan.job.name,
             "key": plan.job.key,
             "metrics": run_metrics(results, handles, plan.started, totals)}
    if config.context:
        extra["context"] = dict(config.context)
    if _keeps_time(plan):
        extra["time"] = {"late_rows": totals.late, "timers_fired": totals.timers_fired,
                         "ttl_purged": totals.ttl_purged,
                         "next": next_times(plan.parent, results, plan.parallelism)}
    if totals.counters:
        extra["counters"] = dict(totals.counters)
    return extra


def _keeps_time(plan: RunPlan) -> bool:
    return plan.job.has_time or plan.job.input.event_time is not None
