"""The summary of one run: what `run_job` returns (as JSON) and ``ckpt run`` prints.

`RunSummary` is immutable; `RunSummary.to_json` is the dict callers receive (the CLI's
``--json``, the Airflow task's XCom): the counts of the run, its timings, and for a
committed run the detail `CommittedRun` holds. A job's own counters also appear at
the top level (e.g. ``duplicates_dropped``) unless they would shadow a field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from statebackend.checkpoint.metrics import MemoryHeadroom
from statebackend.job.input import SKIPPED_NAMES_SHOWN
from statebackend.job.results import RunTotals, TaskResult

TIMING_KEYS = ("restoring", "processing", "snapshotting", "uploading", "committing")
TIME_SPLIT_KEYS = ("planning", "before_subtasks", "subtasks", "after_subtasks", "committing")


@dataclass(frozen=True)
class RunTimeline:
    """When a committed run's parts happened, for `time_split`: seconds of planning (from
    the run's start to the tasks' call: listing, engine choice, Spark's start, the
    watermark's job), the wall-clock epoch seconds the engine was called and returned,
    and seconds of committing (checks, commit, publication)."""

    planning_s: float
    tasks_called: float
    tasks_returned: float
    committing_s: float

    def split(self, results: Sequence[TaskResult]) -> dict[str, float]:
        """Where the run's wall time went (`TIME_SPLIT_KEYS`, seconds):

        - ``before_subtasks``: from the engine's call to the first subtask's start. On
          Spark: scheduling, reading the input, routing and the shuffle; locally:
          reading and routing;
        - ``subtasks``: from the first subtask's start to the last one's end, waves
          included (their own phases are ``timings``);
        - ``after_subtasks``: from the last subtask's end to the results on the driver.

        Subtasks on other hosts time themselves with their own clocks, so on a cluster
        the middle parts carry the hosts' clock skew.
        """
        windows = [r.window for r in results if r.window[0] > 0]
        first = min((w[0] for w in windows), default=self.tasks_returned)  # none: unknown
        last = max((w[1] for w in windows), default=first)
        first = min(max(first, self.tasks_called), self.tasks_returned)
        last = min(max(last, first), self.tasks_returned)
        parts = (self.planning_s, first - self.tasks_called, last - first,
                 self.tasks_returned - last, self.committing_s)
        return {k: round(max(0.0, v), 3) for k, v in zip(TIME_SPLIT_KEYS, parts, strict=True)}


@dataclass(frozen=True)
class CommittedRun:
    """What only a committed run reports."""

    parent: int | None
    output: str | None
    restore_modes: tuple[str, ...]
    input_files: int
    input_bytes: int
    skipped_files: tuple[str, ...]  # "name (reason)" of each input entry not read
    input_reader: str
    engine: str
    engine_reason: str
    warnings: tuple[str, ...] = ()
    watermark: int | None = None
    processing_time: int | None = None


@dataclass(frozen=True)
class RunSummary:
    """One run's outcome: committed (``committed`` set) or skipped (its run id was)."""

    run_id: str
    job: str  # the job's folder under the storage root
    job_kind: str  # the job's name
    checkpoint_id: int | None
    parallelism: int | None
    skipped: bool
    duration_s: float
    published: bool = False  # skipped: its output was published now (_SUCCESS was missing)
    totals: RunTotals = field(default_factory=RunTotals)
    bytes_uploaded: int = 0
    timings: Mapping[str, float] = field(default_factory=dict)
    committed: CommittedRun | None = None
    output_parts_missing: tuple[str, ...] = ()
    time_split: Mapping[str, float] = field(default_factory=dict)  # committed runs

    def to_json(self) -> dict[str, Any]:
        t = self.totals
        out: dict[str, Any] = {
            "run_id": self.run_id, "job": self.job, "checkpoint_id": self.checkpoint_id,
            "events_read": t.read, "events_rejected": t.rejected,
            "keys_touched": t.keys_touched, "bytes_uploaded": self.bytes_uploaded,
            "duration_s": round(self.duration_s, 3), "parallelism": self.parallelism,
            "skipped": self.skipped,
            "timings": {k: round(self.timings.get(k, 0.0), 3) for k in TIMING_KEYS},
            "job_kind": self.job_kind}
        c = self.committed
        if c is None:
            out["published"] = self.published
            if self.output_parts_missing:
                out["output_parts_missing"] = list(self.output_parts_missing)
            return out
        out.update(
            rejects_by_reason=dict(t.reasons), restore_modes=list(c.restore_modes),
            reuploaded=list(t.reuploaded), parent=c.parent, published=True, output=c.output,
            input_files=c.input_files, input_bytes=c.input_bytes, input_reader=c.input_reader,
            engine=c.engine, engine_reason=c.engine_reason,
            logic_timings=dict(t.logic_timings), input_files_skipped=len(c.skipped_files),
            input_files_skipped_names=list(c.skipped_files[:SKIPPED_NAMES_SHOWN]))
        if c.warnings:
            out["warnings"] = list(c.warnings)
        out["time_split"] = dict(self.time_split)
        if t.memory is not None:  # memory and external backends
            out["state_memory"] = t.memory.to_json()
        out.update(watermark=c.watermark, processing_time=c.processing_time,
                   timers_fired=t.timers_fired, ttl_purged=t.ttl_purged, late_rows=t.late,
                   counters=dict(t.counters))
        out.update({k: v for k, v in t.counters.items() if k not in out})
        return out


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
    headroom = MemoryHeadroom.from_json(s.get("state_memory"))
    memory = f"; {headroom.text()}" if headroom is not None else ""
    return (f"run {s['run_id']}: checkpoint {s['checkpoint_id']} of job {s['job']} "
            f"(P={s['parallelism']}): {s['events_read']} events read, {s['events_rejected']} "
            f"rejected, {s['keys_touched']} keys touched, {s['bytes_uploaded']} bytes uploaded "
            f"in {s['duration_s']:.2f}s ({t}){memory}")


def skipped_warning(input_url: str, s: dict) -> str:
    n, names = s["input_files_skipped"], s.get("input_files_skipped_names") or []
    more = f" and {n - len(names)} more" if n > len(names) else ""
    return (f"{n} input file(s) under {input_url} skipped ({', '.join(names)}{more}); "
            f"only regular *.parquet and JSON-lines files (optionally .gz) inside the "
            f"input root are read")
