"""The Checkpoints page inside Airflow's real API server app: login and per-job access.

``airflow.api_fastapi.app.create_app`` loads the plugin through the plugins manager (the
package's ``airflow.plugins`` entry point; the repository's ``plugins/`` folder is the
plugins folder and holds no copy) and mounts it at ``/ckpt``, next to the auth manager's
``/auth`` routes.
Users log in with ``POST /auth/token`` (real JWTs, Bearer header or the UI's ``_token``
cookie). Two viewers: alice may read every DAG; bob is denied one DAG of job ``secret``
(``secret_maintenance``), so he must not see that job at all.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from urllib.parse import parse_qs, urlparse

import pytest

from statebackend.checkpoint.store import CheckpointStore
from statebackend.storage import open_storage

# Airflow reads AIRFLOW_HOME once, at first import: never let it default to ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="ckpt-airflow-home-"))
os.environ.setdefault("CKPT_JOBS_SKIP_VARIABLE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from test_checkpoints_page import commit_fake  # noqa: E402

PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw"}
XSS_HTML = (b"<html><body><p id='x'>report</p>"
            b"<script>fetch('/api/v2/variables')</script></body></html>")


def csp_directives(header: str) -> dict[str, list[str]]:
    out = {}
    for part in header.split(";"):
        words = part.split()
        if words:
            out[words[0].lower()] = words[1:]
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(TestClient of the API server app, storage url) with jobs ``clicks`` and ``secret``."""
    from airflow import plugins_manager, settings
    from airflow.api_fastapi import app as api_app
    from airflow.utils import db
    from fastapi.testclient import TestClient

    base = tmp_path_factory.mktemp("api")
    storage = f"file://{base}/store"
    (base / "jobs.json").write_text(json.dumps({"jobs": {
        name: {"input": "/i", "output": "/o", "storage": storage}
        for name in ("clicks", "secret")}}))
    (base / "passwords.json").write_text(json.dumps(PASSWORDS))
    for job in ("clicks", "secret"):
        store = CheckpointStore(open_storage(storage), job)
        commit_fake(store, 1, 2, 4000, 4000, f"interval__{job}")
        store.storage.write_bytes("reports/chk-1/summary.json", b'{"success": true}')
        store.storage.write_bytes("reports/chk-1/index.html", XSS_HTML)
        store.storage.write_bytes("reports/chk-1/evil.js", b"alert(1)")
        store.storage.write_bytes("reports/chk-1/logo.svg",
                                  b"<svg xmlns='http://www.w3.org/2000/svg'><script>alert(1)"
                                  b"</script></svg>")
        store.storage.write_bytes("reports/chk-1/notes.xyz", b"<script>alert(1)</script>")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(HERE)
    for key, value in {
        "AIRFLOW__CORE__AUTH_MANAGER": "deny_auth_manager.DenyingAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "alice:viewer,bob:viewer",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(base / "passwords.json"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__API_AUTH__JWT_SECRET": "ckpt-test-secret-" + "x" * 64,
        "CKPT_TEST_DENIED_DAGS": "bob:secret_maintenance",
        "CKPT_JOBS_FILE": str(base / "jobs.json"), "CKPT_JOBS_SKIP_VARIABLE": "1",
    }.items():
        mp.setenv(key, value)
    mp.setattr(settings, "PLUGINS_FOLDER", os.path.join(ROOT, "plugins"))
    db.initdb()  # revoked-token lookups and the dag bag need the metadata DB
    plugins_manager._get_plugins.cache_clear()
    plugins_manager.get_fastapi_plugins.cache_clear()
    api_app.purge_cached_app()
    try:
        yield TestClient(api_app.create_app(), follow_redirects=False), storage
    finally:
        api_app.purge_cached_app()
        api_app._AuthManagerState.instance = None
        plugins_manager._get_plugins.cache_clear()
        plugins_manager.get_fastapi_plugins.cache_clear()
        mp.undo()


def login(client, user: str) -> str:
    resp = client.post("/auth/token", json={"username": user, "password": PASSWORDS[user]})
    assert resp.status_code == 201, resp.text
    return resp.json()["access_token"]


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_plugin_is_mounted_by_the_api_server(server):
    client, _ = server
    # Sanity: the app answers our routes (not the UI's catch-all) and Airflow's API too.
    assert client.get("/ckpt/api/jobs").status_code == 401
    assert client.get("/api/v2/dags").status_code == 401


def test_unauthenticated_page_redirects_to_airflow_login(server):
    client, _ = server
    resp = client.get("/ckpt/")
    assert resp.status_code == 303, resp.text
    target = urlparse(resp.headers["location"])
    assert target.path == "/auth/login"
    assert urlparse(parse_qs(target.query)["next"][0]).path == "/ckpt/"
    assert "clicks" not in resp.text


@pytest.mark.parametrize("path", ["/ckpt/api/jobs", "/ckpt/reports/clicks/chk-1/index.html",
                                  "/ckpt/reports/clicks/chk-1/summary.json"])
def test_unauthenticated_api_and_reports_answer_401(server, path):
    client, _ = server
    resp = client.get(path)
    assert resp.status_code == 401 and "clicks" not in resp.text and b"<script" not in resp.content


def test_forged_or_garbage_token_is_refused(server):
    client, _ = server
    token = login(client, "alice")
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    for headers in (bearer(forged), bearer("not-a-jwt")):
        assert client.get("/ckpt/api/jobs", headers=headers).status_code in (401, 403)
        assert client.get("/ckpt/", headers=headers).status_code == 303


def test_authorized_user_sees_every_job_by_bearer_and_by_cookie(server):
    client, _ = server
    token = login(client, "alice")
    jobs = client.get("/ckpt/api/jobs", headers=bearer(token))
    assert jobs.status_code == 200
    assert [j["job"] for j in jobs.json()] == ["clicks", "secret"]
    client.cookies.set("_token", token)  # what the UI's login leaves in the browser
    try:
        page = client.get("/ckpt/")
    finally:
        client.cookies.clear()
    assert page.status_code == 200
    assert 'id="job-clicks"' in page.text and 'id="job-secret"' in page.text
    csp = csp_directives(page.headers["content-security-policy"])
    # only the plugin's own scripts (no inline script, no other origin)
    assert csp["default-src"] == ["'none'"] and csp["script-src"] == ["'self'"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert client.get("/ckpt/reports/secret/chk-1/summary.json",
                      headers=bearer(token)).json() == {"success": True}


def test_user_denied_one_dag_of_a_job_does_not_see_that_job(server):
    client, _ = server
    token = login(client, "bob")
    jobs = client.get("/ckpt/api/jobs", headers=bearer(token))
    assert jobs.status_code == 200 and [j["job"] for j in jobs.json()] == ["clicks"]
    page = client.get("/ckpt/", headers=bearer(token))
    assert page.status_code == 200 and 'id="job-clicks"' in page.text
    assert "secret" not in page.text
    for path in ("chk-1/summary.json", "chk-1/index.html", "chk-9/missing.html"):
        resp = client.get(f"/ckpt/reports/secret/{path}", headers=bearer(token))
        assert resp.status_code == 403, (path, resp.text)
    ok = client.get("/ckpt/reports/clicks/chk-1/summary.json", headers=bearer(token))
    assert ok.status_code == 200


def test_stored_script_is_served_under_a_no_script_sandbox(server):
    client, _ = server
    token = login(client, "alice")
    resp = client.get("/ckpt/reports/clicks/chk-1/index.html", headers=bearer(token))
    assert resp.status_code == 200 and resp.content == XSS_HTML
    assert resp.headers["content-type"] == "text/html; charset=utf-8"
    assert resp.headers["x-content-type-options"] == "nosniff"
    csp = csp_directives(resp.headers["content-security-policy"])
    # No script source at all: script-src absent (falls back to default-src 'none').
    assert csp["default-src"] == ["'none'"]
    assert not any(d.startswith("script-src") for d in csp)
    assert "sandbox" in csp and "allow-scripts" not in csp["sandbox"]
    assert "'unsafe-inline'" not in csp.get("img-src", []) + csp.get("font-src", [])


@pytest.mark.parametrize("path", [
    "chk-1/evil.js", "chk-1/logo.svg", "chk-1/notes.xyz",   # types reports do not contain
    "summary.json",                                         # outside a chk-<id>/ folder
    "chk-1/../../chk-1/_metadata", "..%2F..%2Fchk-1%2F_metadata", "chk-1%2F..%2F..%2Fx.html"])
def test_other_file_types_and_escapes_are_refused(server, path):
    client, _ = server
    resp = client.get(f"/ckpt/reports/clicks/{path}", headers=bearer(login(client, "alice")))
    assert resp.status_code == 404, (path, resp.status_code, resp.text)
    assert b"alert(1)" not in resp.content and b"<script" not in resp.content


# -- containment (issue 20: defects 6 and 12) -----------------------------------------
@pytest.mark.parametrize("path", ["/ckpt/docs", "/ckpt/redoc", "/ckpt/openapi.json",
                                  "/ckpt/docs/oauth2-redirect"])
def test_api_docs_are_off(server, path):
    client, _ = server
    for headers in ({}, bearer(login(client, "alice"))):
        resp = client.get(path, headers=headers)
        assert resp.status_code in (401, 404), (path, resp.status_code, resp.text[:200])
        assert "openapi" not in resp.text.lower() and "/reports/" not in resp.text


def test_report_symlinks_are_never_followed(server, tmp_path):
    """A report file or folder that is a symlink (out of the storage root, or inside it)
    answers 404 to a user allowed to read the job, and never the file behind it."""
    client, storage = server
    root = storage.removeprefix("file://")
    reports = os.path.join(root, "clicks", "reports")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.html").write_bytes(b"<p>outside the storage root</p>")
    links = {"chk-2/passwd.css": "/etc/passwd",            # a file out of the root
             "chk-3": str(outside),                       # a folder out of the root
             "chk-4": "/etc",                             # a system folder
             "chk-5/record.json": os.path.join(root, "clicks", "chk-1", "_metadata")}
    try:
        for link, target in links.items():
            os.makedirs(os.path.dirname(os.path.join(reports, link)), exist_ok=True)
            os.symlink(target, os.path.join(reports, link))
        token = bearer(login(client, "alice"))
        for path in ("chk-2/passwd.css", "chk-3/secret.html", "chk-4/hostname.css",
                     "chk-4/passwd.css", "chk-5/record.json"):
            resp = client.get(f"/ckpt/reports/clicks/{path}", headers=token)
            assert resp.status_code in (403, 404), (path, resp.status_code)
            assert b"root:" not in resp.content and b"outside the storage" not in resp.content
            assert b'"checkpoint_id"' not in resp.content
        ok = client.get("/ckpt/reports/clicks/chk-1/summary.json", headers=token)
        assert ok.status_code == 200
    finally:
        for link in links:
            os.unlink(os.path.join(reports, link))
