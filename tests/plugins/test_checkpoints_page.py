"""The Checkpoints page: history table, SVG chart, report files, plugin registration."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile

import pytest

from jobs.pipeline_config import specs_from_config
from statebackend.checkpoints import CheckpointStore, build_metadata
from statebackend.keygroups import key_group_range_for_subtask
from statebackend.metadata import FileRef, SubtaskHandle
from statebackend.storage import open_storage

# Airflow reads AIRFLOW_HOME once, at first import: never let it default to ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="ckpt-airflow-home-"))
os.environ.setdefault("CKPT_JOBS_SKIP_VARIABLE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_plugin_module():
    spec = importlib.util.spec_from_file_location(
        "ckpt_plugin_under_test", os.path.join(ROOT, "plugins", "ckpt_plugin.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plugin():
    return load_plugin_module()


def commit_fake(store: CheckpointStore, cid: int, parallelism: int, size: int, uploaded: int,
                run_id: str) -> None:
    handles = []
    for i in range(parallelism):
        r = key_group_range_for_subtask(128, parallelism, i)
        ref = FileRef(f"shared/{cid}-{i}.sst", f"{cid}-{i}.sst", size // parallelism, "crc32:0")
        store.storage.write_bytes(ref.path, b"\0" * ref.size)  # commit checks they exist
        handles.append(SubtaskHandle(i, r.start, r.end, f"b{i}", f"s{cid}", (ref,), (),
                                     {"totals": 1}, uploaded // parallelism))
    store.commit(build_metadata(job=store.job, checkpoint_id=cid, parent=cid - 1 or None,
                                max_parallelism=128, states=[{"name": "totals"}],
                                handles=handles, run_id=run_id))


class FakeAuthManager:
    """Stands in for Airflow's auth manager (the real one: test_checkpoints_page_auth.py)."""

    def __init__(self, denied_dag_ids: frozenset[str] = frozenset()) -> None:
        self.denied = denied_dag_ids

    def batch_is_authorized_dag(self, requests, *, user) -> bool:
        return all(r["method"] == "GET" and r["details"].id not in self.denied for r in requests)

    def get_url_login(self, **kwargs) -> str:
        return "/auth/login"


def logged_in_client(plugin, specs, denied: frozenset[str] = frozenset()):
    """A client of the plugin app alone, as a logged-in user."""
    from fastapi.testclient import TestClient

    app = plugin.create_app(lambda: specs, lambda: FakeAuthManager(denied))
    app.dependency_overrides[plugin.request_user] = lambda: "alice"
    app.dependency_overrides[plugin.optional_user] = lambda: "alice"
    return TestClient(app)


@pytest.fixture()
def page_env(tmp_path):
    storage = f"file://{tmp_path}/store"
    specs = specs_from_config({"jobs": {
        "clicks": {"input": "/i", "output": "/o", "storage": storage},
        "empty_job": {"input": "/i", "output": "/o", "storage": storage}}})
    store = CheckpointStore(open_storage(storage), "clicks")
    commit_fake(store, 1, 2, 4000, 4000, "interval__2027-01-01T00:00:00+00:00")
    commit_fake(store, 2, 2, 6000, 2000, "interval__2027-01-02T00:00:00+00:00")
    commit_fake(store, 3, 4, 6000, 1000, None)
    store.storage.write_bytes("reports/chk-2/summary.json", json.dumps({"success": True}).encode())
    store.storage.write_bytes("reports/chk-2/data_docs/index.html", b"<html>docs 2</html>")
    store.storage.write_bytes("reports/chk-3/summary.json", json.dumps({"success": False}).encode())
    return specs, store


def test_history_rows(plugin, page_env):
    specs, _ = page_env
    hist = plugin.job_history(specs[0])
    assert hist["error"] is None
    rows = hist["rows"]
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert [r["parallelism"] for r in rows] == [2, 2, 4]
    assert [r["state_bytes"] for r in rows] == [4000, 6000, 6000]
    assert [r["bytes_uploaded"] for r in rows] == [4000, 2000, 1000]
    assert [r["validation"] for r in rows] == ["not validated", "passed", "failed"]
    assert rows[1]["report"] == "/ckpt/reports/clicks/chk-2/data_docs/index.html"
    assert rows[0]["report"] is None


def test_page_and_report_routes(plugin, page_env):
    specs, _ = page_env
    client = logged_in_client(plugin, specs)
    resp = client.get("/")
    assert resp.status_code == 200 and "text/html" in resp.headers["content-type"]
    body = resp.text
    assert "<h1>Checkpoints</h1>" in body and 'id="job-clicks"' in body
    assert 'id="chart-clicks"' in body and "<polyline" in body and "series-state_bytes" in body
    assert "chk-3" in body and "interval__2027-01-02" in body and "5.9 KiB" in body
    assert 'href="/ckpt/reports/clicks/chk-2/data_docs/index.html"' in body
    assert "no checkpoints yet" in body  # empty_job
    assert "http://" not in body.replace('xmlns="http://www.w3.org/2000/svg"', "")  # no CDN
    api = client.get("/api/jobs").json()
    assert [j["job"] for j in api] == ["clicks", "empty_job"]
    doc = client.get("/reports/clicks/chk-2/data_docs/index.html")
    assert doc.status_code == 200 and doc.text == "<html>docs 2</html>"
    assert doc.headers["content-type"] == "text/html; charset=utf-8"
    assert "sandbox" in doc.headers["content-security-policy"]
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert "script-src" not in resp.headers["content-security-policy"]
    assert client.get("/reports/clicks/chk-9/nothing.html").status_code == 404
    assert client.get("/reports/nojob/chk-2/summary.json").status_code == 404
    assert client.get("/reports/clicks/..%2F..%2Fchk-1%2F_metadata").status_code == 404


def test_unreachable_storage_shows_error_not_500(plugin, tmp_path):
    specs = specs_from_config({"jobs": {"bad": {"input": "/i", "output": "/o",
                                                "storage": "s3:///nobucket"}}})
    resp = logged_in_client(plugin, specs).get("/")
    assert resp.status_code == 200 and 'class="error"' in resp.text


def test_jobs_of_unreadable_dags_are_hidden(plugin, page_env):
    specs, _ = page_env
    client = logged_in_client(plugin, specs, frozenset({"clicks_rescale_restore"}))
    assert [j["job"] for j in client.get("/api/jobs").json()] == ["empty_job"]
    page = client.get("/")
    assert page.status_code == 200 and "clicks" not in page.text and "empty_job" in page.text
    assert client.get("/reports/clicks/chk-2/summary.json").status_code == 403


def test_report_content_types_are_an_allow_list(plugin):
    assert plugin.job_dag_ids(specs_from_config({"jobs": {"j": {
        "input": "/i", "output": "/o", "storage": "memory://x"}}})[0]) == (
        "j_pipeline", "j_maintenance", "j_rescale_restore")
    allowed = {"chk-1/index.html": "text/html; charset=utf-8",
               "chk-12/data_docs/static/styles/x.css": "text/css; charset=utf-8",
               "chk-1/summary.json": "application/json",
               "chk-1/data_docs/static/images/logo.PNG": "image/png",
               "chk-1/data_docs/static/fonts/a.otf": "font/otf"}
    for rel, media in allowed.items():
        assert plugin.report_content_type(rel) == media, rel
    for rel in ("chk-1/a.js", "chk-1/logo.svg", "chk-1/x.xhtml", "chk-1/noext", "index.html",
                "chk-x/index.html", "savepoints/index.html", "chk-1"):
        assert plugin.report_content_type(rel) is None, rel


def test_svg_chart_scales_and_labels(plugin):
    rows = [{"id": i, "state_bytes": 1024 * i, "bytes_uploaded": 512} for i in range(1, 4)]
    svg = plugin.svg_chart("j", rows)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<circle") == 6 and "chk-1" in svg and "3.0 KiB" in svg
    assert "no checkpoints yet" in plugin.svg_chart("j", [])


def test_plugin_registration(plugin):
    cls = plugin.CheckpointsPlugin
    assert cls.fastapi_apps[0]["url_prefix"] == "/ckpt"
    view = cls.external_views[0]
    assert view["name"] == "Checkpoints" and view["href"] == "/ckpt/"
    assert view["destination"] == "nav" and view["url_route"] == "checkpoints"
