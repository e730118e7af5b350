"""Airflow plugin: the "Checkpoints" page (a FastAPI app served by the api-server).

Routes under ``/ckpt`` (``fastapi_apps``), linked in the UI navigation
(``external_views``, embedded page):

- ``GET /ckpt/``                         per configured job: a chart of state size and
                                         uploaded bytes over time (inline SVG, no CDN)
                                         and the checkpoint history table
- ``GET /ckpt/api/jobs``                 the same data as JSON
- ``GET /ckpt/reports/{job}/{path}``     validation report files (Data Docs) read from
                                         the job's ``reports/`` folder in storage

Read-only. Every route needs a user authenticated by Airflow's auth manager (the
``Authorization: Bearer`` header of API clients, else the UI's ``_token`` cookie), and a
job is shown only to users allowed to read all of its DAGs (``<job>_pipeline``,
``<job>_maintenance``, ``<job>_rescale_restore``): other jobs are left out of the page
and of ``/api/jobs``, and their report files answer 403. Without a login the page
redirects to Airflow's login; ``/api`` and report files answer 401.

Report files come from storage, so they are untrusted: only the file types reports
contain are served (fixed content types, ``nosniff``), under a CSP that allows no
script at all and sandboxes the document. Report paths go through ``safe_relpath`` and
are confined to ``<job>/reports/chk-<id>/``; job names must be configured. Nothing
here imports Spark, RocksDB or Great Expectations.
"""

from __future__ import annotations

import html
import logging
import posixpath
import re
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Annotated, Any

from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

log = logging.getLogger(__name__)

URL_PREFIX = "/ckpt"
MAX_ROWS = 200  # newest checkpoints shown per job

# The page: inline <style> and inline SVG only; the Airflow UI embeds it (same origin).
PAGE_CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
            "frame-ancestors 'self'; base-uri 'none'; form-action 'none'")
# Report files are whatever sits in storage: no script of any kind (script-src falls back
# to 'none'), no plugins, forms or popups (sandbox). allow-same-origin only keeps the
# origin so the SameSite=Lax login cookie goes with the report's own CSS/images/fonts;
# without allow-scripts it grants nothing to the document.
REPORT_CSP = ("default-src 'none'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
              "font-src 'self'; frame-ancestors 'self'; base-uri 'none'; form-action 'none'; "
              "sandbox allow-same-origin")
# The file types validation reports contain (overview, Data Docs pages and their static
# assets, summary.json) -> fixed content types; anything else (.js, .svg, ...) is refused.
REPORT_TYPES = {
    ".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
    ".json": "application/json", ".png": "image/png", ".gif": "image/gif",
    ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".ico": "image/x-icon",
    ".otf": "font/otf", ".ttf": "font/ttf", ".woff": "font/woff", ".woff2": "font/woff2",
}
REPORT_DIR = re.compile(r"chk-[0-9]+")


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


# -- access (Airflow's auth manager) ----------------------------------------------
def job_dag_ids(spec) -> tuple[str, ...]:
    """The DAGs of a job (the DAG factory's ids): reading the job means reading them all."""
    return (spec.pipeline_dag_id, spec.maintenance_dag_id, spec.rescale_dag_id)


def _dag_teams(dag_ids: Iterable[str]) -> dict[str, str | None]:
    """dag id -> team; only multi-team deployments have teams (and need the DB for them)."""
    from airflow.configuration import conf

    if not conf.getboolean("core", "multi_team", fallback=False):
        return {}
    from airflow.models.dag import DagModel

    return DagModel.get_dag_id_to_team_name_mapping(list(dag_ids))


def may_read_job(auth_manager, user, spec) -> bool:
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    dag_ids = job_dag_ids(spec)
    teams = _dag_teams(dag_ids)
    requests = [{"method": "GET", "details": DagDetails(id=d, team_name=teams.get(d))}
                for d in dag_ids]
    return auth_manager.batch_is_authorized_dag(requests, user=user)


def _airflow_auth_manager():
    from airflow.api_fastapi.app import get_auth_manager

    return get_auth_manager()


Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


async def request_user(request: Request, credentials: Bearer):
    """The caller, exactly as Airflow's REST API resolves it (Bearer header, else the
    ``_token`` cookie of the UI); HTTPException 401/403 when there is no valid token."""
    from airflow.api_fastapi.core_api.security import get_user

    return await get_user(request, _oauth_token=None, bearer_credentials=credentials)


async def optional_user(request: Request, credentials: Bearer):
    """Like ``request_user`` but None instead of 401/403, so the page can send to login."""
    try:
        return await request_user(request, credentials)
    except HTTPException as exc:
        if exc.status_code in (401, 403):
            return None
        raise


UserDep = Annotated[Any, Depends(request_user)]
MaybeUserDep = Annotated[Any, Depends(optional_user)]


def _secure_headers(csp: str) -> dict[str, str]:
    # Per-user content: never cached by a shared proxy; never content-sniffed.
    return {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "same-origin", "Cache-Control": "no-store"}


def report_content_type(rel: str) -> str | None:
    """The fixed content type of a report path, or None when that type is not served."""
    head = rel.split("/", 1)[0]
    if not REPORT_DIR.fullmatch(head) or "/" not in rel:
        return None
    return REPORT_TYPES.get(posixpath.splitext(rel)[1].lower())


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
def create_app(specs_loader: Callable[[], Iterable[Any]] = load_specs,
               auth_manager_getter: Callable[[], Any] = _airflow_auth_manager) -> FastAPI:
    """The plugin app; ``auth_manager_getter`` is the live auth manager of the api-server."""
    app = FastAPI(title="Checkpoints", description="Checkpoint history and validation reports")

    def specs_by_name() -> dict:
        return {s.name: s for s in specs_loader()}

    def readable(user) -> list:
        manager = auth_manager_getter()
        return [s for s in specs_by_name().values() if may_read_job(manager, user, s)]

    @app.get("/", response_class=HTMLResponse)
    def page(request: Request, user: MaybeUserDep) -> Response:
        if user is None:
            login = auth_manager_getter().get_url_login(next_url=str(request.url))
            return RedirectResponse(login, status_code=303, headers=_secure_headers(PAGE_CSP))
        body = render_page([job_history(s) for s in readable(user)])
        return HTMLResponse(body, headers=_secure_headers(PAGE_CSP))

    @app.get("/api/jobs")
    def jobs_json(user: UserDep) -> JSONResponse:
        return JSONResponse([job_history(s) for s in readable(user)],
                            headers=_secure_headers(PAGE_CSP))

    @app.get("/reports/{job}/{path:path}")
    def report_file(job: str, path: str, user: UserDep) -> Response:
        from jobs.pipeline_tasks import open_store
        from statebackend.errors import CkptError
        from statebackend.storage import safe_relpath

        spec = specs_by_name().get(job)
        if spec is None:
            raise HTTPException(404, f"job {job!r} is not configured")
        if not may_read_job(auth_manager_getter(), user, spec):
            raise HTTPException(403, f"not allowed to read the DAGs of job {job!r}")
        try:
            rel = safe_relpath(path, "report path")
        except CkptError as exc:
            raise HTTPException(404, str(exc)) from exc
        media = report_content_type(rel)
        if media is None:
            raise HTTPException(404, f"report path {path!r} of job {job!r} is not a report "
                                     f"file type ({', '.join(sorted(REPORT_TYPES))})")
        try:
            data = open_store(spec).storage.read_bytes(f"reports/{rel}")
        except CkptError as exc:
            raise HTTPException(404, f"report file {path!r} of job {job!r} not found") from exc
        return Response(content=data, headers={**_secure_headers(REPORT_CSP),
                                               "Content-Type": media})

    return app


app = create_app()


class CheckpointsPlugin(AirflowPlugin):
    name = "ckpt_checkpoints"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "Checkpoints"}]
    external_views = [{"name": "Checkpoints", "href": f"{URL_PREFIX}/", "destination": "nav",
                       "url_route": "checkpoints"}]
