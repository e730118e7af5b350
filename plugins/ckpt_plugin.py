"""Airflow plugin: the "Checkpoints" page (a FastAPI app served by the api-server).

The page lives in the ``ckpt_page`` package next to this file (routes, auth and CSP:
``ckpt_page/app.py``); this module is what Airflow's plugin loader finds. Routes under
``/ckpt`` (``fastapi_apps``), linked in the UI navigation (``external_views``, embedded
page).
"""

from __future__ import annotations

import os
import sys

from airflow.plugins_manager import AirflowPlugin

# Airflow puts the plugins folder on sys.path; a loader that does not (a test importing
# this file by path) still finds the package next to it.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)

from ckpt_page.app import (  # noqa: E402
    PAGE_CSP,
    REPORT_CSP,
    REPORT_TYPES,
    URL_PREFIX,
    create_app,
    job_dag_ids,
    job_history,
    may_read_job,
    optional_user,
    report_content_type,
    request_user,
    static_file,
)
from ckpt_page.render import human_bytes, render_page  # noqa: E402

__all__ = ["PAGE_CSP", "REPORT_CSP", "REPORT_TYPES", "URL_PREFIX", "CheckpointsPlugin", "app",
           "create_app", "human_bytes", "job_dag_ids", "job_history", "may_read_job",
           "optional_user", "render_page", "report_content_type", "request_user",
           "static_file"]

app = create_app()


class CheckpointsPlugin(AirflowPlugin):
    name = "ckpt_checkpoints"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "Checkpoints"}]
    external_views = [{"name": "Checkpoints", "href": f"{URL_PREFIX}/", "destination": "nav",
                       "url_route": "checkpoints"}]
