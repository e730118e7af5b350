"""A run's clocks: the watermark at its start and end, its logical time, and which
subtasks have due work.

Event time: the new watermark is ``advance(parent's, max event time of the rows that
are not late, allowed lateness)`` (statebackend.state.watermark), computed by the
engine before the tasks. Processing time: the run's logical time (Airflow passes the
data interval end; default: the wall clock at start). A subtask without rows still
runs when a timer or an expiry of its is due (`must_run`, from the parent's record of
each subtask's earliest due times, `next_times`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.job.api import Job
from statebackend.job.config import RunConfig
from statebackend.job.engine import Engine
from statebackend.job.results import TaskResult
from statebackend.progress import ProgressSink
from statebackend.state.watermark import advance


@dataclass(frozen=True)
class RunClock:
    """The run's clocks: watermark at start and end, logical time, subtasks that must run."""

    watermark: int | None
    new_watermark: int | None
    processing_time: int
    must_run: tuple[bool, ...]


def run_clock(engine: Engine, job: Job, config: RunConfig, parent: CheckpointMetadata | None,
              parallelism: int, progress: ProgressSink) -> RunClock:
    """The clocks of one run (module doc); the engine scans the input's event times."""
    wm = parent.watermark if parent else None
    logical = config.logical_time_ms if config.logical_time_ms is not None else \
        int(time.time() * 1000)
    new_wm = wm
    if job.input.event_time is not None:
        new_wm = advance(wm, engine.max_event_time(
            job, wm, parallelism, progress, f"run {config.run_id}: scanning event times"),
            job.input.lateness_ms)
    return RunClock(wm, new_wm, logical, must_run(job, parent, parallelism, new_wm, logical))


def must_run(job: Job, parent: CheckpointMetadata | None, parallelism: int,
              new_wm: int | None, logical: int) -> tuple[bool, ...]:
    """Per subtask: a timer or expiry is due. Unknown (no record, e.g. after a rescale
    or a run before timers): run it, so nothing due is ever skipped."""
    if parent is None or not job.has_time:
        return ()
    recorded = (parent.extra.get("time") or {}).get("next") if parent.extra else None
    if not isinstance(recorded, list) or len(recorded) != parallelism:
        return (True,) * parallelism
    out = []
    for nxt in recorded:
        if not isinstance(nxt, dict):
            out.append(True)
            continue
        ev, pr = nxt.get("event"), nxt.get("processing")
        out.append((ev is not None and new_wm is not None and ev <= new_wm)
                   or (pr is not None and pr <= logical))
    return tuple(out)


def next_times(parent: CheckpointMetadata | None, results: Sequence[TaskResult],
               parallelism: int) -> list[Mapping | None]:
    """Per subtask, the earliest timer/expiry per domain: reported, or the parent's."""
    old = ((parent.extra.get("time") or {}).get("next") if parent and parent.extra
           else None)
    by_subtask = {r.subtask: r for r in results}
    out: list[Mapping | None] = []
    for i in range(parallelism):
        reported = by_subtask[i].next_times
        if reported:
            out.append(dict(reported))
        elif isinstance(old, list) and len(old) == parallelism:
            out.append(old[i])
        else:
            out.append(None)  # unknown: the next run opens this subtask
    return out
