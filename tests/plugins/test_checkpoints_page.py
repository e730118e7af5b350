"""The Checkpoints page (`statebackend.airflow.page`): history, metrics of new and old
records, health, charts, static files, report files, plugin registration (the browser
view: test_checkpoints_page_browser.py; the entry point: tests/airflow/test_provider.py)."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import tempfile
from datetime import timedelta

import pytest

from statebackend.airflow.config import specs_from_config
from statebackend.checkpoint.metadata import FileRef, SubtaskHandle
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.state.keygroups import key_group_range_for_subtask
from statebackend.storage import checksum_of_bytes, open_storage

# Airflow reads AIRFLOW_HOME once, at first import: never let it default to ~/airflow.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="ckpt-airflow-home-"))
os.environ.setdefault("CKPT_JOBS_SKIP_VARIABLE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import ops_job  # noqa: E402


@pytest.fixture(scope="module")
def plugin():
    """The page's app module (imported after AIRFLOW_HOME is set above)."""
    return importlib.import_module("statebackend.airflow.page.app")


def commit_fake(store: CheckpointStore, cid: int, parallelism: int, size: int, uploaded: int,
                run_id: str) -> None:
    handles = []
    for i in range(parallelism):
        r = key_group_range_for_subtask(128, parallelism, i)
        data = b"\0" * (size // parallelism)
        ref = FileRef(f"shared/{cid}-{i}.sst", f"{cid}-{i}.sst", len(data),
                      checksum_of_bytes(data))  # true checksums: a savepoint verifies them
        store.storage.write_bytes(ref.path, data)  # commit checks they exist
        handles.append(SubtaskHandle(i, r.start, r.end, f"b{i}", f"s{cid}", (ref,), (),
                                     {"totals": 1}, uploaded // parallelism))
    store.commit(build_metadata(MetadataParts(
        job=store.job, checkpoint_id=cid, parent=cid - 1 or None,
                                max_parallelism=128, states=[{"name": "totals"}],
                                handles=handles, run_id=run_id)))


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


def csp_directives(header: str) -> dict[str, list[str]]:
    return {w[0].lower(): w[1:] for w in (p.split() for p in header.split(";")) if w}


def test_page_and_report_routes(plugin, page_env):
    specs, _ = page_env
    client = logged_in_client(plugin, specs)
    resp = client.get("/")
    assert resp.status_code == 200 and "text/html" in resp.headers["content-type"]
    body = resp.text
    assert "<h1>Checkpoints</h1>" in body and 'id="job-clicks"' in body
    assert 'id="health-clicks"' in body and 'id="chart-clicks-state_size"' in body
    assert "chk-3" in body and "interval__2027-01-02" in body and "5.9 KiB" in body
    assert 'href="/ckpt/reports/clicks/chk-2/data_docs/index.html"' in body
    assert "no checkpoints yet" in body  # empty_job
    assert "http://" not in body and "https://" not in body  # no CDN
    api = client.get("/api/jobs").json()
    assert [j["job"] for j in api] == ["clicks", "empty_job"]
    doc = client.get("/reports/clicks/chk-2/data_docs/index.html")
    assert doc.status_code == 200 and doc.text == "<html>docs 2</html>"
    assert doc.headers["content-type"] == "text/html; charset=utf-8"
    assert "sandbox" in doc.headers["content-security-policy"]
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert client.get("/reports/clicks/chk-9/nothing.html").status_code == 404
    assert client.get("/reports/nojob/chk-2/summary.json").status_code == 404
    assert client.get("/reports/clicks/..%2F..%2Fchk-1%2F_metadata").status_code == 404


def test_page_runs_only_its_own_scripts(plugin, page_env):
    specs, _ = page_env
    resp = logged_in_client(plugin, specs).get("/")
    csp = csp_directives(resp.headers["content-security-policy"])
    assert csp["default-src"] == ["'none'"] and csp["script-src"] == ["'self'"]
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", resp.text, flags=re.S)
    srcs = [re.search(r'src="([^"]+)"', attrs).group(1) for attrs, _ in scripts
            if "src=" in attrs]
    assert srcs == ["/ckpt/static/uplot/uPlot.iife.min.js", "/ckpt/static/page.js"]
    inline = [(attrs, text) for attrs, text in scripts if "src=" not in attrs]
    assert len(inline) == 1 and 'type="application/json"' in inline[0][0]
    data = json.loads(inline[0][1])  # the chart data: valid JSON, x = created time
    clicks = data["jobs"][0]
    assert clicks["job"] == "clicks" and len(clicks["charts"]["t"]) == 3


def test_chart_data_cannot_close_its_script_block(plugin):
    from statebackend.airflow.page.render import chart_data

    text = chart_data([{"job": "j", "charts": {"labels": ["</script><script>alert(1)//"]}}])
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text)["jobs"][0]["charts"]["labels"] == ["</script><script>alert(1)//"]


def test_static_files_are_an_allow_list(plugin, page_env):
    specs, _ = page_env
    client = logged_in_client(plugin, specs)
    js = client.get("/static/uplot/uPlot.iife.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert js.headers["x-content-type-options"] == "nosniff" and b"uPlot" in js.content
    assert client.get("/static/page.js").status_code == 200
    assert client.get("/static/page.css").headers["content-type"].startswith("text/css")
    assert b"MIT" in client.get("/static/uplot/LICENSE").content
    for path in ("/static/app.py", "/static/../app.py", "/static/%2e%2e/app.py",
                 "/static/uplot/README.md", "/static/nothing.js"):
        assert client.get(path).status_code == 404, path


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
        "j_pipeline", "j_reports", "j_maintenance", "j_rescale_restore")
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


@pytest.fixture()
def ops(tmp_path):
    storage = f"file://{tmp_path}/ops"
    job = ops_job.build_ops_job(storage, "clicks", 32)
    spec = specs_from_config({"jobs": {"clicks": {"input": "/i", "output": "/o",
                                                  "storage": storage}}})[0]
    return job, spec


def test_rescale_row_reads_source_and_new_parallelism(plugin, ops):
    job, spec = ops
    rows = plugin.job_history(spec)["rows"]
    rescale = rows[ops_job.RESCALE_ID - 1]
    assert rescale["kind"] == "rescale"
    assert rescale["run_id"] == "rescaled from P=2 to P=4" and rescale["parallelism"] == 4


def test_metrics_of_new_and_older_records(plugin, ops):
    job, spec = ops
    rows = {r["id"]: r for r in plugin.job_history(spec)["rows"]}
    m = rows[10]["metrics"]  # format-1 metrics
    assert m["duration_s"] == pytest.approx(sum(ops_job.phases(10).values()))
    assert m["phases"] == pytest.approx(ops_job.phases(10))
    assert m["events_read"] == ops_job.events(10)
    assert m["events_per_s"] == pytest.approx(ops_job.events(10) / m["duration_s"])
    assert m["rejects_by_reason"] == ops_job.rejects(10) and m["source"] == "metrics"
    legacy = rows[3]["metrics"]  # keyed aggregation's counters, no timings
    assert legacy["events_read"] == ops_job.events(3) and legacy["source"] == "legacy"
    assert legacy["duration_s"] is None and legacy["events_per_s"] is None
    assert legacy["events_rejected"] == sum(ops_job.rejects(3).values())
    bare = rows[1]["metrics"]  # no figures at all
    assert bare["source"] is None and bare["events_read"] is None and bare["phases"] == {}
    subs = rows[32]["subtasks"]
    assert [s["bytes"] for s in subs] == [ops_job.subtask_bytes(32, i, 4) for i in range(4)]
    assert [(s["key_group_start"], s["key_group_end"]) for s in subs] == [
        (0, 31), (32, 63), (64, 95), (96, 127)]
    assert [s["events"] for s in subs] == [ops_job.events(32) // 4] * 4
    assert rows[3]["subtasks"][0]["events"] is None  # legacy: no per-subtask metrics


def test_health_summary(plugin, ops):
    job, spec = ops
    now = job.created(32) + timedelta(minutes=90)
    h = plugin.job_history(spec, now=now.timestamp())["health"]
    assert h["latest_id"] == 32 and h["latest_age_s"] == 5400
    assert h["last_validation"]["id"] == ops_job.FAILED_VALIDATION
    assert h["last_validation"]["status"] == "failed"
    size = lambda cid: sum(ops_job.subtask_bytes(cid, i, 4) for i in range(4))  # noqa: E731
    assert h["state_bytes"] == size(32)
    assert h["state_trend"]["from_id"] == 22
    assert h["state_trend"]["change"] == pytest.approx((size(32) - size(22)) / size(22))
    assert h["last_run"]["duration_s"] == pytest.approx(sum(ops_job.phases(32).values()))
    assert h["failed_runs_since_success"] == ops_job.FAILED_RUNS and h["level"] == "bad"
    assert h["last_failure"] == "InputError: input file day=1 is missing"


def test_failed_runs_before_the_last_commit_do_not_count(plugin, ops):
    job, spec = ops
    before = plugin.job_history(spec)["health"]["failed_runs_since_success"]
    ops_job.commit(job.store, 33, job.start)  # created after the failed runs: recovered
    h = plugin.job_history(spec)["health"]
    assert before == ops_job.FAILED_RUNS
    assert h["failed_runs_since_success"] == 0


def test_charts_use_created_time_and_empty_ones_say_so(plugin, ops, page_env):
    job, spec = ops
    charts = plugin.job_history(spec)["charts"]
    assert charts["t"] == [job.created(i).timestamp() for i in range(1, 33)]
    assert charts["labels"][0] == "chk-1" and len(charts["t"]) == 32  # savepoint left out
    assert list(charts["duration"]) == list(ops_job.PHASES)
    assert charts["duration"]["process"][:4] == [None] * 4  # no timings before metrics
    assert charts["rejects"]["late"][0] is None  # chk-1 recorded no counters
    assert charts["rejects"]["late"][2] == ops_job.rejects(3)["late"]
    specs, _ = page_env
    empty = logged_in_client(plugin, specs).get("/").text
    section = empty[empty.index('id="job-empty_job"'):]
    assert section.count('<p class="no-data">no data yet</p>') == 3
    assert section.count('<p class="no-data">no timings recorded yet</p>') == 2
    assert " 0 B" not in section and "1 B" not in section


def test_airflow_links_follow_the_ui_routes(plugin):
    from statebackend.airflow.page.data import airflow_links

    ctx = {"dag_id": "clicks_pipeline", "run_id": "manual__2027-01-01T00:00:00+00:00",
           "task_id": "run_job", "try_number": 2}
    links = airflow_links(ctx)
    assert links == {
        "dag_run": "/dags/clicks_pipeline/runs/manual__2027-01-01T00%3A00%3A00%2B00%3A00",
        "task_log": "/dags/clicks_pipeline/runs/manual__2027-01-01T00%3A00%3A00%2B00%3A00"
                    "/tasks/run_job?try_number=2"}
    assert airflow_links({"dag_id": "d"}) == {}
    assert airflow_links({"dag_id": "d", "run_id": "a/b"}) == {"dag_run": "/dags/d/runs/a%2Fb"}


def test_broken_run_record_is_left_out(plugin, ops):
    job, spec = ops
    job.store.storage.write_bytes("runs/history/20270101T000000Z-bad.json", b"{not json")
    job.store.storage.write_bytes("runs/history/20270101T000001Z-other.json", b'{"format": 9}')
    hist = plugin.job_history(spec)
    assert hist["errors"] == [] and len(hist["runs"]) == 6


def test_plugins_folder_holds_no_second_copy_of_the_page():
    """The entry point registers the page; a copy in the plugins folder would be loaded
    first and the entry point's reported as an "already registered" import error."""
    from airflow._shared.plugins_manager import _load_plugins_from_plugin_directory

    from statebackend.airflow.plugin import PLUGIN_NAME

    plugins, errors = _load_plugins_from_plugin_directory(
        plugins_folder=os.path.join(ROOT, "plugins"), ignore_file_syntax="glob")
    assert errors == {}
    assert PLUGIN_NAME not in [p.name for p in plugins]


def test_plugin_registration():
    from statebackend.airflow.plugin import CheckpointsPlugin as cls

    assert cls.fastapi_apps[0]["url_prefix"] == "/ckpt"
    view = cls.external_views[0]
    assert view["name"] == "Checkpoints" and view["href"] == "/ckpt/"
    assert view["destination"] == "nav" and view["url_route"] == "checkpoints"
