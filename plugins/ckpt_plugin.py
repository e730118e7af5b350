"""Airflow plugin: the "Checkpoints" page (a FastAPI app served by the api-server).

Routes under ``/ckpt`` (``fastapi_apps``), linked in the UI navigation
(``external_views``, embedded page):

- ``GET /ckpt/``                         per configured job: a chart of state size and
                                         uploaded bytes over time (inline SVG, no CDN)
                                         and the checkpoint history table
- ``GET /ckpt/api/jobs``                 the same data as JSON
- ``GET /ckpt/reports/{job}/{path}``     validation report files (Data Docs) read from
                                         the job's ``reports/`` folder in storage

Read-only. Report paths go through ``safe_relpath`` and are confined to
``<job>/reports/``; job names must be configured. Nothing here imports Spark,
RocksDB or Great Expectations.
"""

from __future__ import annotations

import html
import logging
import mimetypes
from datetime import datetime

from airflow.plugins_manager import AirflowPlugin
from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, JSONResponse, Response

log = logging.getLogger(__name__)

URL_PREFIX = "/ckpt"
MAX_ROWS = 200  # newest checkpoints shown per job


# -- data ----------------------------------------------------------------------
def _server_get_connection(conn_id: str):
    from airflow.models.connection import Connection

    return Connection.get_connection_from_secrets(conn_id)


def load_specs():
    from jobs.pipeline_config import load_job_specs

    return load_job_specs()


def _report_index(report_files: dict[int, list[str]], checkpoint_id: int) -> str | None:
    """The Data Docs entry page of a checkpoint's report (shortest index.html path)."""
    candidates = [p for p in report_files.get(checkpoint_id, []) if p.endswith("index.html")]
    if candidates:
        return min(candidates, key=lambda p: (p.count("/"), p))
    htmls = [p for p in report_files.get(checkpoint_id, []) if p.endswith(".html")]
    return min(htmls) if htmls else None


def _report_files(store) -> dict[int, list[str]]:
    """chk id -> report paths relative to ``<job>/reports/``."""
    out: dict[int, list[str]] = {}
    for info in store.storage.walk_files("reports"):
        rel = info.path[len("reports/"):] if info.path.startswith("reports/") else info.path
        head = rel.split("/", 1)[0]
        if head.startswith("chk-") and head[4:].isdigit():
            out.setdefault(int(head[4:]), []).append(rel)
    return out


def _status(summary: dict | None) -> str:
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


def job_history(spec) -> dict:
    """History rows of one job, oldest first; an ``error`` instead if storage fails."""
    from jobs.pipeline_tasks import export_storage_credentials, open_store
    from statebackend.errors import CkptError

    try:
        if spec.storage_conn_id:
            try:
                export_storage_credentials(spec, get_connection=_server_get_connection)
            except Exception as exc:  # noqa: BLE001 - fall back to the server's environment
                log.warning("storage connection %r unavailable: %s", spec.storage_conn_id, exc)
        store = open_store(spec)
        metas = store.load_all()[-MAX_ROWS:]
        reports = _report_files(store)
    except CkptError as exc:
        return {"job": spec.name, "storage": spec.storage, "rows": [], "error": str(exc)}
    try:
        from statebackend.validate import read_report_summary
    except ImportError:  # validation module not installed: show no status
        def read_report_summary(_store, _cid):
            return None
    rows = []
    for meta in metas:
        try:
            summary = read_report_summary(store, meta.checkpoint_id)
        except CkptError:
            summary = None
        index = _report_index(reports, meta.checkpoint_id)
        rows.append({
            "id": meta.checkpoint_id, "kind": meta.kind,
            "run_id": meta.run_id or (f"rescale of chk-{meta.parent} (P={meta.rescaled_from})"
                                      if meta.kind == "rescale" else None),
            "created_at": meta.created_at, "parallelism": meta.parallelism,
            "state_bytes": meta.bytes_referenced, "bytes_uploaded": meta.bytes_uploaded,
            "validation": _status(summary),
            "report": f"{URL_PREFIX}/reports/{spec.name}/{index}" if index else None,
        })
    return {"job": spec.name, "storage": spec.storage, "rows": rows, "error": None}


# -- rendering -------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def svg_chart(job: str, rows: list[dict], width: int = 720, height: int = 240) -> str:
    """Two series over checkpoints in time order: state size and bytes uploaded."""
    left, right, top, bottom = 70, 20, 20, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    series = [("state size", "state_bytes", "#1f77b4"), ("bytes uploaded", "bytes_uploaded",
                                                          "#ff7f0e")]
    peak = max([1] + [r[key] for r in rows for _, key, _ in series])
    n = len(rows)

    def x(i: int) -> float:
        return left + (plot_w / 2 if n == 1 else i * plot_w / (n - 1))

    def y(v: float) -> float:
        return top + plot_h - v / peak * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="ckpt-chart" '
             f'id="chart-{html.escape(job)}" width="{width}" height="{height}" role="img" '
             f'aria-label="state size and uploaded bytes of {html.escape(job)} over time">',
             f'<title>{html.escape(job)}: state size and bytes uploaded per checkpoint</title>',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" '
             'stroke="#ccc"/>']
    for frac in (0, 0.5, 1):
        yy = y(peak * frac)
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{yy:.1f}" y2="{yy:.1f}" '
                     'stroke="#e0e0e0"/>')
        parts.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" font-size="11" text-anchor="end">'
                     f'{human_bytes(peak * frac)}</text>')
    step = max(1, n // 12)
    for i, r in enumerate(rows):
        if i % step == 0 or i == n - 1:
            parts.append(f'<text x="{x(i):.1f}" y="{top + plot_h + 16}" font-size="11" '
                         f'text-anchor="middle">chk-{r["id"]}</text>')
    if not rows:
        parts.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" font-size="13" '
                     'text-anchor="middle">no checkpoints yet</text>')
    for k, (label, key, color) in enumerate(series):
        points = " ".join(f"{x(i):.1f},{y(r[key]):.1f}" for i, r in enumerate(rows))
        if rows:
            parts.append(f'<polyline class="series-{key}" fill="none" stroke="{color}" '
                         f'stroke-width="2" points="{points}"/>')
            for i, r in enumerate(rows):
                parts.append(f'<circle cx="{x(i):.1f}" cy="{y(r[key]):.1f}" r="3" '
                             f'fill="{color}"><title>chk-{r["id"]} {label}: '
                             f'{human_bytes(r[key])}</title></circle>')
        lx = left + 10 + k * 150
        parts.append(f'<rect x="{lx}" y="{height - 14}" width="12" height="4" fill="{color}"/>')
        parts.append(f'<text x="{lx + 16}" y="{height - 9}" font-size="11">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _when(iso: str) -> str:
    try:
        return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError):
        return str(iso)


def render_job(history: dict) -> str:
    job = html.escape(history["job"])
    out = [f'<section class="job" id="job-{job}"><h2>{job}</h2>',
           f'<p class="where">storage: <code>{html.escape(history["storage"])}/{job}</code></p>']
    if history.get("error"):
        out.append(f'<p class="error">{html.escape(history["error"])}</p></section>')
        return "".join(out)
    rows = history["rows"]
    out.append(svg_chart(history["job"], rows))
    out.append('<table><thead><tr><th>id</th><th>kind</th><th>created (UTC)</th><th>run</th>'
               '<th>parallelism</th><th>state size</th><th>bytes uploaded</th>'
               '<th>validation</th></tr></thead><tbody>')
    for r in reversed(rows):
        status = html.escape(r["validation"])
        cell = (f'<a href="{html.escape(r["report"])}" target="_blank">{status}</a>'
                if r["report"] else status)
        run = html.escape(str(r["run_id"] or ""))
        out.append(f'<tr><td>chk-{r["id"]}</td><td>{html.escape(r["kind"])}</td>'
                   f'<td>{_when(r["created_at"])}</td><td>{run}</td>'
                   f'<td>{r["parallelism"]}</td><td>{human_bytes(r["state_bytes"])}</td>'
                   f'<td>{human_bytes(r["bytes_uploaded"])}</td>'
                   f'<td class="status-{status.replace(" ", "-")}">{cell}</td></tr>')
    if not rows:
        out.append('<tr><td colspan="8">no checkpoints yet</td></tr>')
    out.append("</tbody></table></section>")
    return "".join(out)


PAGE_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:12px 0 32px}
th,td{border:1px solid #ddd;padding:4px 10px;font-size:13px;text-align:right}
th{background:#f3f3f3}td:nth-child(2),td:nth-child(4){text-align:left}
.status-passed{color:#137333}.status-failed{color:#c5221f;font-weight:bold}
.error{color:#c5221f}code{background:#f3f3f3;padding:1px 4px}
"""


def render_page(histories: list[dict]) -> str:
    body = "".join(render_job(h) for h in histories) or "<p>No jobs configured (ckpt_jobs).</p>"
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>Checkpoints</title>"
            f"<style>{PAGE_STYLE}</style></head><body><h1>Checkpoints</h1>{body}</body></html>")


# -- app ---------------------------------------------------------------------------
def create_app(specs_loader=load_specs) -> FastAPI:
    app = FastAPI(title="Checkpoints", description="Checkpoint history and validation reports")

    def specs_by_name() -> dict:
        return {s.name: s for s in specs_loader()}

    @app.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        return HTMLResponse(render_page([job_history(s) for s in specs_by_name().values()]))

    @app.get("/api/jobs")
    def jobs_json() -> JSONResponse:
        return JSONResponse([job_history(s) for s in specs_by_name().values()])

    @app.get("/reports/{job}/{path:path}")
    def report_file(job: str, path: str) -> Response:
        from jobs.pipeline_tasks import open_store
        from statebackend.errors import CkptError
        from statebackend.storage import safe_relpath

        spec = specs_by_name().get(job)
        if spec is None:
            raise HTTPException(404, f"job {job!r} is not configured")
        try:
            rel = safe_relpath(path, "report path")
            data = open_store(spec).storage.read_bytes(f"reports/{rel}")
        except CkptError as exc:
            raise HTTPException(404, f"report file {path!r} of job {job!r} not found") from exc
        media = mimetypes.guess_type(rel)[0] or "application/octet-stream"
        return Response(content=data, media_type=media)

    return app


app = create_app()


class CheckpointsPlugin(AirflowPlugin):
    name = "ckpt_checkpoints"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "Checkpoints"}]
    external_views = [{"name": "Checkpoints", "href": f"{URL_PREFIX}/", "destination": "nav",
                       "url_route": "checkpoints"}]
