"""What the subtasks of one run report, and their sum.

`TaskResult` is one subtask attempt's report (`statebackend.job.task`): its new
handle (None: nothing changed, the parent's is carried forward), what it uploaded,
counts, timings, the earliest due time per domain, and on the memory and external
backends the state it held in memory, as the limit counts it (`memory_headroom`). Its
row form (`to_row`, `from_row`, `RESULT_SCHEMA`) is what a Spark task returns; the
local engine hands the objects over as they are. `aggregate` sums a run's results into `RunTotals`
(pure); `run_metrics` is the ``extra["metrics"]`` of the commit record.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

import pyarrow as pa

from statebackend.checkpoint.metadata import SubtaskHandle
from statebackend.checkpoint.metrics import MemoryHeadroom
from statebackend.job.core import LATE

PHASES = ("restoring", "processing", "snapshotting", "uploading")
RESULT_SCHEMA = pa.schema([
    ("subtask", pa.int32()), ("attempt", pa.int32()), ("handle", pa.string()),
    ("uploaded", pa.string()), ("events", pa.int64()), ("rejected", pa.int64()),
    ("reasons", pa.string()), ("keys_touched", pa.int64()), ("restore_mode", pa.string()),
    ("reuploaded", pa.string()), ("outputs", pa.string()), ("bytes_uploaded", pa.int64()),
    *[(f"t_{p}", pa.float64()) for p in PHASES], ("t_detail", pa.string()),
    ("t_started", pa.float64()), ("t_finished", pa.float64()),
    ("timers_fired", pa.int64()), ("ttl_purged", pa.int64()), ("counters", pa.string()),
    ("next_times", pa.string()), ("memory_bytes", pa.int64())])
# The JSON-text columns of a result row and the fields they carry.
_JSON_COLUMNS = {"uploaded": "uploaded", "reasons": "reasons", "reuploaded": "reuploaded",
                 "outputs": "outputs", "t_detail": "logic_timings", "counters": "counters"}


@dataclass(frozen=True)
class TaskResult:
    """One subtask attempt's report (module doc)."""

    subtask: int
    attempt: int
    handle: SubtaskHandle | None  # None: carried forward (nothing changed)
    restore_mode: str = "none"
    uploaded: tuple[str, ...] = ()
    events: int = 0  # accepted rows
    rejected: int = 0
    reasons: Mapping[str, int] = field(default_factory=dict)  # rejects by reason
    keys_touched: int = 0
    reuploaded: tuple[str, ...] = ()  # stored files local recovery found damaged
    outputs: Mapping[str, int] = field(default_factory=dict)  # rows written per output
    phases: Mapping[str, float] = field(default_factory=dict)  # seconds per `PHASES`
    logic_timings: Mapping[str, float] = field(default_factory=dict)  # the logic's phases
    timers_fired: int = 0
    ttl_purged: int = 0
    counters: Mapping[str, int] = field(default_factory=dict)  # the job's own counters
    next_times: Mapping[str, int | None] | None = None  # None: the state was not opened
    window: tuple[float, float] = (0.0, 0.0)  # epoch seconds the task started and ended
    memory_bytes: int | None = None  # memory, external backends: held at the end

    @property
    def bytes_uploaded(self) -> int:
        return self.handle.bytes_uploaded if self.handle is not None else 0

    def to_row(self) -> dict[str, Any]:
        """The Arrow row (`RESULT_SCHEMA`) a Spark task returns."""
        row: dict[str, Any] = {"subtask": self.subtask, "attempt": self.attempt,
               "handle": json.dumps(self.handle.to_json()) if self.handle else None,
               "events": self.events, "rejected": self.rejected,
               "keys_touched": self.keys_touched, "restore_mode": self.restore_mode,
               "bytes_uploaded": self.bytes_uploaded, "timers_fired": self.timers_fired,
               "ttl_purged": self.ttl_purged,
               "next_times": json.dumps(self.next_times) if self.next_times else None,
               "memory_bytes": self.memory_bytes}
        for column, name in _JSON_COLUMNS.items():
            value = getattr(self, name)
            row[column] = json.dumps(list(value) if isinstance(value, tuple) else dict(value),
                                     sort_keys=True)
        row.update({f"t_{p}": float(self.phases.get(p, 0.0)) for p in PHASES})
        row["t_started"], row["t_finished"] = self.window
        return row

    @staticmethod
    def from_row(row: Mapping) -> TaskResult:
        """A Spark task's result row back as a `TaskResult` (the driver's own rows: trusted
        JSON; the handle is parsed strictly like any stored handle)."""
        texts = {name: json.loads(row.get(column) or ("[]" if name in ("uploaded", "reuploaded")
                                                      else "{}"))
                 for column, name in _JSON_COLUMNS.items()}
        handle = row.get("handle")
        return TaskResult(
            subtask=row["subtask"], attempt=row["attempt"],
            handle=SubtaskHandle.from_json(json.loads(handle), f"subtask {row['subtask']} "
                                                               f"result") if handle else None,
            restore_mode=row["restore_mode"], events=row["events"], rejected=row["rejected"],
            keys_touched=row["keys_touched"], timers_fired=row.get("timers_fired") or 0,
            ttl_purged=row.get("ttl_purged") or 0,
            next_times=json.loads(row["next_times"]) if row.get("next_times") else None,
            phases={p: row[f"t_{p}"] for p in PHASES},
            window=(row.get("t_started") or 0.0, row.get("t_finished") or 0.0),
            memory_bytes=row.get("memory_bytes"),
            **{**texts, "uploaded": tuple(texts["uploaded"]),
               "reuploaded": tuple(texts["reuploaded"])})


def memory_headroom(results: Sequence[TaskResult], limit_mb: int | None
                    ) -> MemoryHeadroom | None:
    """The subtask of ``results`` holding the most state in memory (None: none opened a
    memory or external backend), with the limit ``limit_mb`` (MiB per subtask), and
    every subtask's together (pure)."""
    held = [r for r in results if r.memory_bytes is not None]
    if not held:
        return None
    top = max(held, key=lambda r: (r.memory_bytes, -r.subtask))
    return MemoryHeadroom(top.subtask, int(top.memory_bytes or 0),
                          None if limit_mb is None else int(limit_mb) * 2**20,
                          total_bytes=sum(int(r.memory_bytes or 0) for r in held),
                          subtasks=len(held))


@dataclass(frozen=True)
class RunTotals:
    """The sum of a run's `TaskResult`s (`aggregate`)."""

    events: int = 0  # accepted rows
    rejected: int = 0
    reasons: Mapping[str, int] = field(default_factory=dict)  # sorted by reason
    keys_touched: int = 0
    timers_fired: int = 0
    ttl_purged: int = 0
    counters: Mapping[str, int] = field(default_factory=dict)  # sorted by name
    phases: Mapping[str, float] = field(default_factory=dict)  # summed over subtasks
    logic_timings: Mapping[str, float] = field(default_factory=dict)
    reuploaded: tuple[str, ...] = ()
    memory: MemoryHeadroom | None = None  # memory and external backends

    @property
    def read(self) -> int:
        """Input rows read: accepted and rejected."""
        return self.events + self.rejected

    @property
    def late(self) -> int:
        return self.reasons.get(LATE, 0)


def aggregate(results: Sequence[TaskResult], memory_limit_mb: int | None = None
              ) -> RunTotals:
    """The run's totals over its subtasks' results, the state in memory against
    ``memory_limit_mb`` (pure)."""
    return RunTotals(
        events=sum(r.events for r in results), rejected=sum(r.rejected for r in results),
        reasons=_summed(r.reasons for r in results),
        keys_touched=sum(r.keys_touched for r in results),
        timers_fired=sum(r.timers_fired for r in results),
        ttl_purged=sum(r.ttl_purged for r in results),
        counters=_summed(r.counters for r in results),
        phases={p: sum(r.phases.get(p, 0.0) for r in results) for p in PHASES},
        logic_timings={k: round(v, 4) for k, v in
                       _summed(r.logic_timings for r in results).items()},
        reuploaded=tuple(sorted(p for r in results for p in r.reuploaded)),
        memory=memory_headroom(results, memory_limit_mb))


def _summed(parts: Iterable[Mapping[str, float]]) -> dict:
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


METRIC_PHASES = {"restore": "restoring", "process": "processing",
                 "snapshot": "snapshotting", "upload": "uploading"}


class SubtaskMetrics(TypedDict):
    """One subtask's entry of ``extra["metrics"]["subtasks"]``."""

    index: int
    events: int
    rejected: int
    keys_touched: int
    bytes_uploaded: int
    state_rows: int
    phases: dict[str, float]  # seconds per `METRIC_PHASES` key, and "timers"
    memory_bytes: NotRequired[int]  # memory and external backends


def run_metrics(results: Sequence[TaskResult], handles: Sequence[SubtaskHandle],
                started: float, totals: RunTotals) -> dict[str, Any]:
    """``extra["metrics"]`` of a commit record (format 1; read by the Checkpoints page).

    Phases are seconds summed over subtasks (they overlap in wall time); ``commit`` is
    not in the record that the commit writes. ``timers``: firing the due timers.
    On the memory and external backends each subtask's ``memory_bytes`` and the run's
    ``state_memory`` (`MemoryHeadroom`) say how much of the limit the state took.
    """
    by_subtask = {r.subtask: r for r in results}
    subtasks: list[SubtaskMetrics] = []
    for h in handles:
        r = by_subtask[h.index]
        subtasks.append({
            "index": h.index, "events": r.events, "rejected": r.rejected,
            "keys_touched": r.keys_touched, "bytes_uploaded": h.bytes_uploaded,
            "state_rows": sum(h.row_counts.values()),
            "phases": {k: round(r.phases.get(p, 0.0), 4) for k, p in METRIC_PHASES.items()}
            | {"timers": round(r.logic_timings.get("timers", 0.0), 4)}})
        if r.memory_bytes is not None:
            subtasks[-1]["memory_bytes"] = r.memory_bytes
    total = {k: round(sum(s["phases"][k] for s in subtasks), 4)
             for k in (*METRIC_PHASES, "timers")}
    events = sum(s["events"] for s in subtasks)
    rejected = sum(s["rejected"] for s in subtasks)
    run: dict[str, Any] = {
        "duration_s": round(time.perf_counter() - started, 3),
        "events_read": events + rejected, "events_rejected": rejected,
        "rejects_by_reason": dict(totals.reasons),
        "keys_touched": sum(s["keys_touched"] for s in subtasks),
        "bytes_uploaded": sum(s["bytes_uploaded"] for s in subtasks),
        "state_rows": sum(s["state_rows"] for s in subtasks), "phases": total}
    if totals.memory is not None:
        run["state_memory"] = totals.memory.to_json()
    return {"format": 1, "subtasks": subtasks, "run": run}
