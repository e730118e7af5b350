"""Airflow plugin: the "Checkpoints" page (a FastAPI app served by the api-server).

Registered by the package's ``airflow.plugins`` entry point (pyproject.toml), so any
Airflow with the package installed shows it; no file goes into the plugins folder. A
copy there under the same name would be skipped by Airflow ("already registered") and
reported as a plugin import error, so there is none: ``plugins/`` is for the
deployment's own plugins.

The page itself is `statebackend.airflow.page` (routes, auth and CSP: ``page/app.py``).
Routes under ``/ckpt`` (``fastapi_apps``), linked in the UI navigation
(``external_views``, embedded page).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from .page.app import URL_PREFIX, create_app

PLUGIN_NAME = "ckpt_checkpoints"

app = create_app()


class CheckpointsPlugin(AirflowPlugin):
    name = PLUGIN_NAME
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "Checkpoints"}]
    external_views = [{"name": "Checkpoints", "href": f"{URL_PREFIX}/", "destination": "nav",
                       "url_route": "checkpoints"}]
