"""What the Checkpoints page shows, read from a job's storage (plain JSON-able dicts).

Sources, all under ``<storage>/<job>/``, each optional:

- ``chk-<id>/_metadata``: the commit records. ``extra["metrics"]`` (format 1) has the
  run's and every subtask's timings and counters; records written before it carry only
  the legacy counters or nothing at all (`statebackend.checkpoint.metrics.run_figures`
  reads every form): every figure here may be None.
  ``extra["context"]["airflow"]`` names the DAG run and task that wrote the record.
- ``runs/history/<utc>-<run>-<outcome>.json``: one record per run outcome (committed,
  skipped, failed), written by the run protocol (`statebackend.checkpoint.runs.record_outcome`).
- ``reports/chk-<id>/summary.json`` and ``index.html``: the validation of a checkpoint.
- ``savepoints/<name>/`` and ``leases/<name>.json``.

A part that cannot be read is reported in that part (``error``), never as a 500.
Times are ISO 8601 strings in the JSON and epoch seconds for the charts (x axis).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, TypedDict
from urllib.parse import quote, urlencode

from statebackend.checkpoint.layout import HISTORY_DIR, REPORTS_DIR, chk_id_of
from statebackend.checkpoint.leases import list_leases
from statebackend.checkpoint.metrics import run_figures
from statebackend.errors import CkptError
from statebackend.formatting import parse_time
from statebackend.lifecycle.savepoint import list_savepoints
from statebackend.state.schema import describe_schema

log = logging.getLogger(__name__)

URL_PREFIX = "/ckpt"
MAX_ROWS = 200          # newest checkpoints shown per job
MAX_RUN_RECORDS = 50    # newest run records (runs/history/*.json) shown per job
TREND_WINDOW = 10       # state size trend: latest vs. this many checkpoints before
PHASES = ("restore", "process", "timers", "snapshot", "upload", "commit")
RUNS_DIR = HISTORY_DIR


# -- small readers -------------------------------------------------------------
def _num(value: Any) -> float | None:
    """A finite number or None (records are untrusted JSON)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if value == value and abs(value) != float("inf") else None


def _epoch(iso: Any) -> float | None:
    when = parse_time(iso)
    return None if when is None else when.timestamp()


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _counts(value: Any) -> dict[str, float]:
    return {str(k): n for k, v in _dict(value).items() if (n := _num(v)) is not None}


def _phases(value: Any) -> dict[str, float]:
    phases = _counts(value)
    return {p: phases[p] for p in PHASES if p in phases}


class RunMetrics(TypedDict):
    """The run's figures of one checkpoint row (`run_metrics`); None: not recorded."""

    duration_s: float | None
    events_read: float | None
    events_rejected: float | None
    rejects_by_reason: dict[str, float]
    keys_touched: float | None
    state_rows: float | None
    phases: dict[str, float]  # seconds per phase (PHASES order)
    source: str | None  # "metrics", "legacy" or None (nothing recorded)
    events_per_s: float | None
    state_memory: str | None  # memory and external backends: the largest against the limit


def run_metrics(meta) -> RunMetrics:
    """The run's figures: ``extra["metrics"]["run"]`` or, for older records, the legacy
    ``extra`` counters (no timings). Unknown figures are None."""
    extra = _dict(meta.extra)
    metrics = _dict(extra.get("metrics"))
    run = _dict(metrics.get("run")) if metrics.get("format") == 1 else {}
    src = run_figures(extra)
    duration, phases = _num(run.get("duration_s")), _phases(run.get("phases"))
    if duration is None and phases:
        duration = sum(phases.values())
    events = _num(src.get("events_read"))
    return {
        "duration_s": duration,
        "events_read": events,
        "events_rejected": _num(src.get("events_rejected")),
        "rejects_by_reason": _counts(src.get("rejects_by_reason")),
        "keys_touched": _num(src.get("keys_touched")),
        "state_rows": _num(run.get("state_rows")),
        "phases": phases,
        "source": "metrics" if run else ("legacy" if "events_read" in extra else None),
        "events_per_s": events / duration if events is not None and duration else None,
        "state_memory": memory.text() if (memory := meta.state_memory()) is not None
        else None,
    }


def subtask_rows(meta) -> list[dict]:
    """Per subtask: key-group range, stored bytes, rows, and the run's metrics when
    recorded (skew between subtasks shows here)."""
    recorded = {}
    metrics = _dict(_dict(meta.extra).get("metrics"))
    for sub in metrics.get("subtasks") or []:
        if isinstance(sub, dict) and isinstance(sub.get("index"), int):
            recorded[sub["index"]] = sub
    rows = []
    for s in meta.subtasks:
        m = recorded.get(s.index, {})
        phases = _phases(m.get("phases"))
        rows.append({
            "index": s.index, "key_group_start": s.key_group_start,
            "key_group_end": s.key_group_end,
            "key_groups": s.key_group_end - s.key_group_start + 1,
            "files": len(s.files), "bytes": s.size, "bytes_uploaded": s.bytes_uploaded,
            "rows": meta.subtask_rows(s),
            "events": _num(m.get("events")), "rejected": _num(m.get("rejected")),
            "keys_touched": _num(m.get("keys_touched")), "phases": phases,
            "duration_s": sum(phases.values()) if phases else None,
        })
    return rows


def airflow_context(extra: Any) -> dict:
    ctx = _dict(_dict(_dict(extra).get("context")).get("airflow"))
    return {k: ctx[k] for k in ("dag_id", "run_id", "task_id", "try_number", "logical_date")
            if isinstance(ctx.get(k), str | int) and not isinstance(ctx.get(k), bool)}


def airflow_links(ctx: dict) -> dict:
    """Airflow 3 UI routes (checked in the installed UI's router): the DAG run page and
    the task instance page, whose default tab is the log of ``?try_number=``."""
    dag, run = ctx.get("dag_id"), ctx.get("run_id")
    if not (isinstance(dag, str) and isinstance(run, str)):
        return {}
    base = f"/dags/{quote(dag, safe='')}/runs/{quote(run, safe='')}"
    links = {"dag_run": base}
    task = ctx.get("task_id")
    if isinstance(task, str):
        query = {"try_number": ctx["try_number"]} if isinstance(ctx.get("try_number"), int) \
            else {}
        links["task_log"] = f"{base}/tasks/{quote(task, safe='')}" + (
            f"?{urlencode(query)}" if query else "")
    return links


def describe_origin(meta) -> str | None:
    """What wrote the checkpoint, for the table: the run key, or the rescale."""
    if meta.kind == "rescale":
        return f"rescaled from P={meta.rescaled_from} to P={meta.parallelism}"
    if meta.kind == "savepoint":
        return f"savepoint {_dict(meta.extra).get('savepoint') or ''}".strip()
    return meta.run_id


def validation_status(summary: dict | None) -> str:
    if summary is None:
        return "not validated"
    success = summary.get("success")
    if success is None:
        success = summary.get("passed")
    if success is True:
        return "passed"
    if success is False:
        return "failed"
    return "unknown"


def report_files(store) -> dict[int, list[str]]:
    """chk id -> report paths relative to ``<job>/reports/``."""
    out: dict[int, list[str]] = {}
    for info in store.storage.walk_files(REPORTS_DIR):
        rel = info.path.removeprefix(REPORTS_DIR + "/")
        cid = chk_id_of(rel.split("/", 1)[0])
        if cid is not None:
            out.setdefault(cid, []).append(rel)
    return out


def report_index(files: dict[int, list[str]], checkpoint_id: int) -> str | None:
    """The entry page of a checkpoint's report: the overview (shortest index.html)."""
    candidates = [p for p in files.get(checkpoint_id, []) if p.endswith("index.html")]
    if candidates:
        return min(candidates, key=lambda p: (p.count("/"), p))
    htmls = [p for p in files.get(checkpoint_id, []) if p.endswith(".html")]
    return min(htmls) if htmls else None


# -- parts of a job ----------------------------------------------------------------
def checkpoint_row(spec, store, meta, summary: dict | None, files: dict[int, list[str]]) -> dict:
    index = report_index(files, meta.checkpoint_id)
    ctx = airflow_context(meta.extra)
    return {
        "id": meta.checkpoint_id, "kind": meta.kind, "parent": meta.parent,
        "run_id": describe_origin(meta), "run_key": meta.run_id,
        "created_at": meta.created_at, "t": _epoch(meta.created_at),
        "parallelism": meta.parallelism, "max_parallelism": meta.max_parallelism,
        "rescaled_from": meta.rescaled_from, "state_backend": meta.state_backend,
        "external_version": meta.external.version if meta.external else None,
        "state_bytes": meta.bytes_referenced, "bytes_uploaded": meta.bytes_uploaded,
        "state_rows": meta.rows(),
        "files": len(meta.files),
        "validation": validation_status(summary),
        "failed_checks": [str(c) for c in (summary or {}).get("failed_checks") or []][:10],
        "report": f"{URL_PREFIX}/reports/{spec.name}/{index}" if index else None,
        "metrics": run_metrics(meta), "subtasks": subtask_rows(meta),
        "context": ctx, "links": airflow_links(ctx),
        # each state's schema and version (statebackend.state.schema)
        "states": [{"name": s.get("name"), "schema": describe_schema(s),
                    "schema_version": s.get("schema_version", 1)} for s in meta.states],
    }


def read_run_records(store) -> list[dict]:
    """``runs/history/*.json`` oldest first; unreadable ones are left out (and logged)."""
    records = []
    for info in store.storage.walk_files(RUNS_DIR)[-MAX_RUN_RECORDS:]:
        if not info.path.endswith(".json"):
            continue
        try:
            raw = json.loads(store.storage.read_bytes(info.path))
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("run record %s/%s unreadable: %s", store.storage.url, info.path, exc)
            continue
        if not isinstance(raw, dict) or raw.get("format") != 1:
            continue
        ctx = airflow_context(raw)
        records.append({
            "file": info.path, "run_id": str(raw.get("run_id") or ""),
            "outcome": str(raw.get("outcome") or "unknown"),
            "checkpoint_id": raw.get("checkpoint_id") if isinstance(
                raw.get("checkpoint_id"), int) else None,
            "started_at": str(raw.get("started_at") or ""), "t": _epoch(raw.get("started_at")),
            "duration_s": _num(raw.get("duration_s")),
            "error": str(raw["error"]).splitlines()[0][:500] if raw.get("error") else None,
            "context": ctx, "links": airflow_links(ctx),
        })
    return sorted(records, key=lambda r: (r["t"] or 0, r["file"]))


def read_savepoints(store) -> list[dict]:
    return [s.to_json() for s in list_savepoints(store)]


def read_leases(store) -> list[dict]:
    now = datetime.now(UTC)
    return [{"name": lease.name, "live": not lease.expired(now), "purpose": lease.purpose,
             "holder": lease.holder, "checkpoint_ids": list(lease.checkpoint_ids),
             "created_at": lease.created_at, "expires_at": lease.expires_at}
            for lease in list_leases(store.storage)]


def _part(what: str, store, reader) -> tuple[list[dict], str | None]:
    """(items, None) or ([], one-line error): one broken part does not hide the others."""
    try:
        return reader(store), None
    except CkptError as exc:
        return [], f"{what}: {exc}"


# -- health ------------------------------------------------------------------------
def health(rows: list[dict], runs: list[dict], now: float) -> dict:
    """The summary line of a job; each figure None when there is nothing to say."""
    chks = [r for r in rows if r["kind"] != "savepoint"]
    latest = chks[-1] if chks else None
    validated = [r for r in rows if r["validation"] in ("passed", "failed", "unknown")]
    with_time = [r for r in chks if r["metrics"]["duration_s"] is not None]
    last_ok = max([r["t"] or 0 for r in chks] +
                  [r["t"] or 0 for r in runs if r["outcome"] == "committed"], default=0)
    failed = [r for r in runs if r["outcome"] == "failed" and (r["t"] or 0) > last_ok]
    trend = None
    if latest is not None and len(chks) >= 2:
        base = chks[max(0, len(chks) - 1 - TREND_WINDOW)]
        trend = {"from_id": base["id"], "to_id": latest["id"],
                 "from_bytes": base["state_bytes"], "to_bytes": latest["state_bytes"],
                 "change": (latest["state_bytes"] - base["state_bytes"]) / base["state_bytes"]
                 if base["state_bytes"] else None}
    last_run = with_time[-1] if with_time else None
    last_validation = {"id": validated[-1]["id"], "status": validated[-1]["validation"],
                       "report": validated[-1]["report"]} if validated else None
    bad = failed or (last_validation and last_validation["status"] == "failed")
    return {
        "latest_id": latest["id"] if latest else None,
        "latest_age_s": max(0.0, now - latest["t"]) if latest and latest["t"] else None,
        "last_validation": last_validation,
        "state_bytes": latest["state_bytes"] if latest else None,
        "state_trend": trend,
        "last_run": {"id": last_run["id"], "duration_s": last_run["metrics"]["duration_s"],
                     "events_per_s": last_run["metrics"]["events_per_s"]} if last_run else None,
        "failed_runs_since_success": len(failed),
        "last_failure": failed[-1]["error"] if failed else None,
        "level": "bad" if bad else ("empty" if latest is None else "ok"),
    }


# -- charts ------------------------------------------------------------------------
def chart_series(rows: list[dict]) -> dict:
    """Columns for the charts, x = created time (epoch seconds), savepoints left out.

    ``duration`` holds one column per phase recorded anywhere (None where a run has no
    such phase), or ``total`` alone when only durations are known; ``rejects`` one
    column per reason, or ``total``. A chart with no point is drawn as "no data yet".
    """
    pts = [r for r in rows if r["kind"] != "savepoint" and r["t"] is not None]
    t = [r["t"] for r in pts]
    labels = [f"chk-{r['id']}" for r in pts]
    phases = [p for p in PHASES if any(p in r["metrics"]["phases"] for r in pts)]
    if phases:
        duration = {p: [r["metrics"]["phases"].get(p) for r in pts] for p in phases}
    else:
        duration = {"total": [r["metrics"]["duration_s"] for r in pts]}
    reasons = sorted({k for r in pts for k in r["metrics"]["rejects_by_reason"]})
    if reasons:
        rejects = {k: [r["metrics"]["rejects_by_reason"].get(k, 0)
                       if r["metrics"]["events_rejected"] is not None
                       or r["metrics"]["rejects_by_reason"] else None for r in pts]
                   for k in reasons}
    else:
        rejects = {"total": [r["metrics"]["events_rejected"] for r in pts]}
    return {
        "t": t, "labels": labels,
        "state_size": {"state size": [r["state_bytes"] for r in pts]},
        "bytes_uploaded": {"bytes uploaded": [r["bytes_uploaded"] for r in pts]},
        "duration": duration,
        "events_per_s": {"events/s": [r["metrics"]["events_per_s"] for r in pts]},
        "rejects": rejects,
    }


def has_points(columns: dict[str, list]) -> bool:
    return any(v is not None for col in columns.values() for v in col)


# -- one job -----------------------------------------------------------------------
def job_history(spec, open_store, read_summary, now: float | None = None) -> dict:
    """Everything the page shows of one job; ``error`` set (and the rest empty) when its
    storage cannot be read at all."""
    base = {"job": spec.name, "storage": spec.storage, "rows": [], "runs": [],
            "savepoints": [], "leases": [], "errors": [], "health": None, "charts": None,
            "dags": {"pipeline": spec.pipeline_dag_id, "reports": spec.reports_dag_id,
                     "maintenance": spec.maintenance_dag_id, "rescale": spec.rescale_dag_id}}
    try:
        store = open_store(spec)
        metas = store.load_all()[-MAX_ROWS:]
        files = report_files(store)
    except CkptError as exc:
        return {**base, "error": str(exc)}
    rows = []
    for meta in metas:
        try:
            summary = read_summary(store, meta.checkpoint_id)
        except CkptError:
            summary = None
        rows.append(checkpoint_row(spec, store, meta, summary, files))
    runs, runs_err = _part("run records", store, read_run_records)
    savepoints, sp_err = _part("savepoints", store, read_savepoints)
    leases, lease_err = _part("leases", store, read_leases)
    now = datetime.now(UTC).timestamp() if now is None else now
    return {**base, "error": None, "rows": rows, "runs": runs, "savepoints": savepoints,
            "leases": leases, "errors": [e for e in (runs_err, sp_err, lease_err) if e],
            "health": health(rows, runs, now), "charts": chart_series(rows)}
