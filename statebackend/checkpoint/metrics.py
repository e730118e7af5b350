"""Where a commit record keeps its run's figures, and how older records kept them.

A job run writes them once, in ``extra["metrics"]`` (format 1, `statebackend.job.run.
run_metrics`): ``run`` (duration, events read and rejected, rejects by reason, keys
touched, bytes uploaded, state rows, phases) and one entry per subtask. Records of
older releases instead carry ``events_read``, ``events_rejected``,
``rejects_by_reason`` and ``keys_touched`` at the top level of ``extra`` (no
timings); records of 2026 builds before the cleanup carry both, with equal values.
Readers go through `run_figures`, so every one of them loads all three forms.
"""

from __future__ import annotations

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
