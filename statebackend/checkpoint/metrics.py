"""Where a commit record keeps its run's figures, and how older records kept them.

A job run writes them once, in ``extra["metrics"]`` (format 1, `statebackend.job.run.
run_metrics`): ``run`` (duration, events read and rejected, rejects by reason, keys
touched, bytes uploaded, state rows, phases) and one entry per subtask. Records of
older releases instead carry ``events_read``, ``events_rejected``,
``rejects_by_reason`` and ``keys_touched`` at the top level of ``extra`` (no
timings); records of 2026 builds before the cleanup carry both, with equal values.
Readers go through `run_figures`, so every one of them loads all three forms.

A run on the memory or external backend also records ``run["state_memory"]``
(`MemoryHeadroom`: its largest subtask's state in memory against the limit, and every
subtask's together) and each subtask's ``memory_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METRICS_FORMAT = 1
LEGACY_RUN_KEYS = ("events_read", "events_rejected", "rejects_by_reason", "keys_touched")


def run_figures(extra: Any) -> dict[str, Any]:
    """The run's figures of a commit record's ``extra``: ``metrics["run"]`` when recorded,
    else the legacy top-level counters, else ``{}``. Values are as stored (unchecked)."""
    if not isinstance(extra, dict):
        return {}
    metrics = extra.get("metrics")
    if isinstance(metrics, dict) and metrics.get("format") == METRICS_FORMAT:
        run = metrics.get("run")
        if isinstance(run, dict):
            return run
    return {k: extra[k] for k in LEGACY_RUN_KEYS if k in extra}


# The share of its limit a subtask's state in memory may reach before a run warns
MEMORY_WARN_SHARE = 0.8
# The share of the machine's memory the local engine's one process may hold as state
# before a run warns (the limit is per subtask; that process holds all of them)
MACHINE_WARN_SHARE = 0.5


@dataclass(frozen=True)
class MemoryHeadroom:
    """The subtask that held the most state in memory at the end of a run (memory and
    external backends), against the limit each subtask has (``limit_bytes`` None:
    unbounded); ``total_bytes`` of its ``subtasks`` together (None: a record of a
    release that did not keep it)."""

    subtask: int
    held_bytes: int
    limit_bytes: int | None
    total_bytes: int | None = None
    subtasks: int | None = None

    @property
    def share(self) -> float | None:
        return None if not self.limit_bytes else self.held_bytes / self.limit_bytes

    def to_json(self) -> dict[str, Any]:
        share = self.share
        return {"subtask": self.subtask, "held_bytes": self.held_bytes,
                "limit_bytes": self.limit_bytes,
                "share": None if share is None else round(share, 4),
                "total_bytes": self.total_bytes, "subtasks": self.subtasks}

    @staticmethod
    def from_json(data: Any) -> MemoryHeadroom | None:
        """A recorded ``state_memory``; None where it is missing or not of this shape
        (records are read, not trusted: a reader shows nothing rather than fail)."""
        if not isinstance(data, dict):
            return None
        subtask: Any = data.get("subtask")
        held: Any = data.get("held_bytes")
        limit: Any = data.get("limit_bytes")
        total: Any = data.get("total_bytes")
        subtasks: Any = data.get("subtasks")
        if not (_count(subtask) and _count(held)
                and all(v is None or _count(v) for v in (limit, total, subtasks))):
            return None
        if (total is None) != (subtasks is None) or total is not None and total < held:
            return None
        return MemoryHeadroom(subtask, held, limit, total, subtasks)

    def warning(self) -> str | None:
        """One line when the state is at `MEMORY_WARN_SHARE` of the limit or more: a run
        that adds state fails, so say so while this one still committed."""
        share = self.share
        if share is None or share < MEMORY_WARN_SHARE:
            return None
        return (f"subtask {self.subtask} holds {_mib(self.held_bytes)} of state in memory, "
                f"{share:.0%} of the limit of {_mib(self.limit_bytes or 0)} per subtask "
                "(--memory-limit-mb): a run whose state grows past it fails; raise the "
                "limit, add subtasks (ckpt rescale) or move the job to rocksdb")

    def machine_warning(self, machine_bytes: int) -> str | None:
        """One line when every subtask's state together is `MACHINE_WARN_SHARE` of
        ``machine_bytes`` or more: for the local engine, whose one process holds them
        all (each subtask's limit does not bound their sum)."""
        total = self.total_bytes
        if total is None or machine_bytes <= 0 or total < MACHINE_WARN_SHARE * machine_bytes:
            return None
        return (f"the local engine's process holds {_mib(total)} of state in memory over "
                f"{self.subtasks} subtasks, {total / machine_bytes:.0%} of this machine's "
                f"{_mib(machine_bytes)}: a run whose state grows further may be killed for "
                "lack of memory; run it on Spark (--engine spark) or move the job to rocksdb")

    def share_text(self) -> str | None:
        """``80%``, ``0.2%``, ``<0.1%`` (a small share does not read as none); None:
        unbounded."""
        share = self.share
        if share is None:
            return None
        if share >= 0.01:
            return f"{share:.0%}"
        return f"{share:.1%}" if share >= 0.001 else "<0.1%"

    def held(self) -> str:
        """``up to 4.8 MiB (subtask 0, 80% of its limit), 9.1 MiB in all 2 subtasks``."""
        share = self.share_text()
        of = "" if share is None else f", {share} of its limit"
        total = "" if self.total_bytes is None or (self.subtasks or 0) < 2 else \
            f", {_mib(self.total_bytes)} in all {self.subtasks} subtasks"
        return f"up to {_mib(self.held_bytes)} (subtask {self.subtask}{of}){total}"

    def text(self) -> str:
        """The largest state in memory against its limit, as a clause."""
        return f"state in memory {self.held()}"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
