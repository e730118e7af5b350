"""The Checkpoints page app (FastAPI, served by Airflow's api-server under ``/ckpt``).

Routes:

- ``GET /ckpt/``                       per configured job: health summary, charts over
                                       time (uPlot, served from ``static/``), the history,
                                       per-checkpoint detail with per-subtask rows, run
                                       records, savepoints and leases
- ``GET /ckpt/api/jobs``               the same data as JSON
- ``GET /ckpt/static/{file}``          the page's own CSS/JS and vendored uPlot (a fixed
                                       list of files; no login needed, nothing secret)
- ``GET /ckpt/reports/{job}/{path}``   validation report files read from the job's
                                       ``reports/`` folder in storage

No other route exists: FastAPI's generated ``/docs``, ``/redoc`` and ``/openapi.json``
are off (they need no login).

Read-only. Every route but ``static`` needs a user authenticated by Airflow's auth
manager (the ``Authorization: Bearer`` header of API clients, else the UI's ``_token``
cookie), and a job is shown only to users allowed to read all of its DAGs
(``<job>_pipeline``, ``<job>_maintenance``, ``<job>_rescale_restore``): other jobs are
left out of the page and of ``/api/jobs``, and their report files answer 403. Without a
login the page redirects to Airflow's login; ``/api`` and report files answer 401.

The page runs only the plugin's own scripts (CSP ``script-src 'self'``, no inline
script: chart data is a JSON block). Same-origin files that are not ours cannot run as
script on it: report files are never served as JavaScript (allow-list of types, with
``nosniff``), and Airflow's API answers JSON.

Report files come from storage, so they are untrusted: only the file types reports
contain are served (fixed content types, ``nosniff``), under a CSP that allows no
script at all and sandboxes the document. Report paths go through ``safe_relpath`` and
are confined to ``<job>/reports/chk-<id>/``; job names must be configured. Reports are
read through the storage, which never follows a symlink below its root (a symlinked
report file or folder answers 404, see storage/local.py). Nothing
here imports Spark, RocksDB or Great Expectations.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from statebackend.airflow.config import load_job_specs
from statebackend.airflow.steps import open_store
from statebackend.checkpoint.layout import REPORTS_DIR
from statebackend.errors import CkptError
from statebackend.storage import safe_relpath
from statebackend.validation.validate import read_report_summary

from . import data, render

log = logging.getLogger(__name__)

URL_PREFIX = data.URL_PREFIX
STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# The page: its own scripts and styles only (no inline script); the Airflow UI embeds it
# (same origin). style-src keeps 'unsafe-inline' for the bars' widths and uPlot's sizing.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; frame-ancestors 'self'; base-uri 'none'; "
            "form-action 'none'")
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
# The only static files served, with their types.
STATIC_FILES = {
    "page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8",
    "uplot/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uplot/uPlot.min.css": "text/css; charset=utf-8",
    "uplot/LICENSE": "text/plain; charset=utf-8",
}


# -- data ----------------------------------------------------------------------
def _server_get_connection(conn_id: str):
    from airflow.models.connection import Connection

    return Connection.get_connection_from_secrets(conn_id)


def load_specs():
    """The deployment's ``ckpt_jobs`` (the same definitions the DAG files build from)."""
    return load_job_specs()


def _open_store(spec):
    """The job's store, opened with its storage connection's options (never os.environ)
    and its index key connection's key."""
    if spec.storage_conn_id or spec.index_key_conn_id:
        try:
            return open_store(spec, None if spec.storage_conn_id else {},
                              get_connection=_server_get_connection)
        except Exception as exc:  # noqa: BLE001 - fall back to the server's own credentials
            log.warning("connections of job %r unavailable: %s", spec.name,
                        type(exc).__name__)
    # The server's own credentials and index key: the page only reads (an index it does
    # not trust costs time, never correctness).
    return open_store(replace(spec, index_key_conn_id=None), {})


def job_history(spec, now: float | None = None) -> dict:
    """Everything the page shows of one job (see `data.job_history`)."""
    return data.job_history(spec, _open_store, read_report_summary, now)


# -- access (Airflow's auth manager) ----------------------------------------------
def job_dag_ids(spec) -> tuple[str, ...]:
    """The DAGs of a job (the DAG factory's ids): reading the job means reading them all."""
    return (spec.pipeline_dag_id, spec.reports_dag_id, spec.maintenance_dag_id,
            spec.rescale_dag_id)


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


def static_file(name: str) -> tuple[bytes, str] | None:
    """(content, type) of one of the page's static files, None for anything else."""
    media = STATIC_FILES.get(name)
    if media is None:
        return None
    with open(os.path.join(STATIC_DIR, *name.split("/")), "rb") as fh:
        return fh.read(), media


# -- app ---------------------------------------------------------------------------
def create_app(specs_loader: Callable[[], Iterable[Any]] = load_specs,
               auth_manager_getter: Callable[[], Any] = _airflow_auth_manager) -> FastAPI:
    """The plugin app; ``auth_manager_getter`` is the live auth manager of the api-server."""
    # No generated API docs (/docs, /redoc, /openapi.json): FastAPI serves them without
    # any login, and they would list the routes to anyone (issue 20, defect 12).
    app = FastAPI(title="Checkpoints", description="Checkpoint history and validation reports",
                  docs_url=None, redoc_url=None, openapi_url=None)

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
        body = render.render_page([job_history(s) for s in readable(user)])
        return HTMLResponse(body, headers=_secure_headers(PAGE_CSP))

    @app.get("/api/jobs")
    def jobs_json(user: UserDep) -> JSONResponse:
        return JSONResponse([job_history(s) for s in readable(user)],
                            headers=_secure_headers(PAGE_CSP))

    @app.get("/static/{name:path}")
    def static(name: str) -> Response:
        found = static_file(name)
        if found is None:
            raise HTTPException(404, f"static file {name!r} is not part of the page")
        content, media = found
        return Response(content=content, headers={
            "Content-Type": media, "X-Content-Type-Options": "nosniff",
            "Cache-Control": "public, max-age=300"})

    @app.get("/reports/{job}/{path:path}")
    def report_file(job: str, path: str, user: UserDep) -> Response:
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
            content = _open_store(spec).storage.read_bytes(f"{REPORTS_DIR}/{rel}")
        except CkptError as exc:
            raise HTTPException(404, f"report file {path!r} of job {job!r} not found") from exc
        return Response(content=content, headers={**_secure_headers(REPORT_CSP),
                                               "Content-Type": media})

    return app


