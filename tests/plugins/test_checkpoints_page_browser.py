"""The Checkpoints page of a job with 32 checkpoints, in headless Chromium, through Airflow's
real API server app (no `airflow standalone`: uvicorn serves ``create_app()`` on 127.0.0.1).

The job (tests/plugins/ops_job.py) has a rescale (P=2 -> 4), a failed validation, a
savepoint, a live and an expired lease, legacy records without timings and failed runs
after the last commit; a second job has no checkpoint at all. The test logs in as the
UI does, then checks each element in the DOM (health summary, every chart's canvas,
history, per-subtask tables, runs, savepoints, leases, links to Airflow and reports),
that the page ran under its CSP without a violation, and takes the screenshots
(checkpoints.png, checkpoints-full.png, checkpoint-detail.png, validation-report.png).
``CKPT_UPDATE_SCREENSHOTS=1`` copies them to tests/plugins/screenshots/ (the README's).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from urllib.parse import unquote, urlparse

import pytest

os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="ckpt-airflow-home-"))
os.environ.setdefault("CKPT_JOBS_SKIP_VARIABLE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import ops_job  # noqa: E402
from test_standalone_ui import count_color, png_pixels  # noqa: E402

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = os.path.join(HERE, "screenshots")
CHARTS = ("state_size", "bytes_uploaded", "duration", "events_per_s", "rejects")
N = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, password file, the job) with Airflow's API server app on 127.0.0.1."""
    import uvicorn
    from airflow import plugins_manager, settings
    from airflow.api_fastapi import app as api_app
    from airflow.utils import db

    base = tmp_path_factory.mktemp("browser")
    storage = f"file://{base}/store"
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=N + 2)
    job = ops_job.build_ops_job(storage, "clicks", N, start)
    (base / "jobs.json").write_text(json.dumps({"jobs": {
        name: {"input": "/i", "output": "/o", "storage": storage}
        for name in ("clicks", "empty_job")}}))
    (base / "passwords.json").write_text(json.dumps({"admin": "admin-pw"}))
    mp = pytest.MonkeyPatch()
    for key, value in {
        "AIRFLOW__CORE__AUTH_MANAGER":
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(base / "passwords.json"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__API_AUTH__JWT_SECRET": "ckpt-test-secret-" + "y" * 64,
        "CKPT_JOBS_FILE": str(base / "jobs.json"), "CKPT_JOBS_SKIP_VARIABLE": "1",
    }.items():
        mp.setenv(key, value)
    mp.setattr(settings, "PLUGINS_FOLDER", os.path.join(ROOT, "plugins"))
    db.initdb()
    plugins_manager._get_plugins.cache_clear()
    plugins_manager.get_fastapi_plugins.cache_clear()
    api_app.purge_cached_app()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api_app.create_app(), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}", base / "passwords.json", job
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        api_app.purge_cached_app()
        api_app._AuthManagerState.instance = None
        plugins_manager._get_plugins.cache_clear()
        plugins_manager.get_fastapi_plugins.cache_clear()
        mp.undo()


@pytest.fixture(scope="module")
def browser(served, tmp_path_factory):
    assert os.path.exists(CHROMIUM), "chromium missing: `make system-deps` installs it"
    base_url, pw_file, job = served
    out_dir = tmp_path_factory.mktemp("chromium")
    res = subprocess.run([sys.executable, os.path.join(HERE, "cdp_browser.py"), CHROMIUM,
                          base_url, str(pw_file), str(out_dir), "--ops", "clicks"],
                         capture_output=True, text=True, timeout=300)
    lines = [x for x in res.stdout.splitlines() if x.startswith("BROWSER-RESULT")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    out = json.loads(lines[0][len("BROWSER-RESULT"):])
    shots = [out["screenshot"]] + [out["ops"][key] for key in (
        "full_screenshot", "detail_screenshot", "failed_report_screenshot")]
    out["shots_dir"] = str(tmp_path_factory.mktemp("screenshots"))
    targets = [out["shots_dir"]] + ([SCREENSHOTS] if os.environ.get("CKPT_UPDATE_SCREENSHOTS")
                                    else [])
    for target in targets:
        os.makedirs(target, exist_ok=True)
        for path in shots:
            shutil.copy(path, target)
    return out, job


def test_login_then_page_runs_only_its_own_scripts(browser):
    out, _ = browser
    assert urlparse(out["anonymous_url"]).path.startswith("/auth/login"), out["anonymous_url"]
    assert out["login_status"] == 201 and urlparse(out["page_url"]).path == "/ckpt/"
    ops = out["ops"]
    assert ops["uplot"] == "function" and ops["charts_ready"] == "ready"
    assert ops["scripts"] == ["src:/ckpt/static/uplot/uPlot.iife.min.js",
                              "src:/ckpt/static/page.js", "inline:application/json"]
    assert out["csp"] == [] and ops["csp"] == [], (out["csp"], ops["csp"])


def test_health_summary(browser):
    out, job = browser
    h = out["ops"]["health"]
    assert set(h) == {"latest", "validation", "state", "run", "failures"}
    assert h["latest"]["value"] == f"chk-{N}"
    assert h["latest"]["note"].endswith("ago") and "h" in h["latest"]["note"]
    assert h["validation"] == {"value": "failed", "note": f"chk-{ops_job.FAILED_VALIDATION}",
                               "bad": True}
    size = sum(ops_job.subtask_bytes(N, i, 4) for i in range(4))
    assert h["state"]["value"] == f"{size / 1024:.1f} KiB"
    base = sum(ops_job.subtask_bytes(N - 10, i, 4) for i in range(4))
    assert h["state"]["note"].startswith(f"{(size - base) / base:+.0%} since chk-{N - 10}")
    duration = sum(ops_job.phases(N).values())
    assert h["run"]["value"] == f"{duration:.1f} s"
    assert h["run"]["note"] == f"chk-{N} {ops_job.events(N) / duration:,.0f} events/s"
    assert h["failures"]["value"] == str(ops_job.FAILED_RUNS) and h["failures"]["bad"]
    assert "InputError" in h["failures"]["note"] and "Traceback" not in h["failures"]["note"]


def test_every_chart_is_drawn_over_time(browser):
    out, _ = browser
    charts = out["ops"]["charts"]
    assert set(charts) == set(CHARTS)
    for name in CHARTS:
        c = charts[name]
        # uPlot draws on a canvas; every checkpoint but the savepoint is a point
        assert c["canvases"] >= 1 and c["drawn"] == str(N) and c["no_data"] is None, name
        assert c["width"] >= 320, (name, c)
    assert charts["duration"]["legend"][1:] == list(reversed(ops_job.PHASES))
    assert charts["rejects"]["legend"][1:] == ["malformed", "late"]
    assert charts["state_size"]["legend"][1:] == ["state size"]
    # the empty job reads "no data yet" (not "0 B"), with no canvas
    empty = [e for e in out["ops"]["empty_charts"] if e.startswith("chart-empty_job-")]
    assert len(empty) == len(CHARTS), out["ops"]["empty_charts"]
    assert all(e.endswith(("no data yet", "no timings recorded yet")) for e in empty)
    assert 'id="chart-empty_job-state_size"' in out["dom"]
    assert out["dom"].count("<canvas") >= len(CHARTS)


def test_history_detail_and_subtasks(browser):
    out, _ = browser
    ops = out["ops"]
    history = ops["history"]
    assert len(history) == N and history[0][0] == f"chk-{N}" and history[-1][0] == "chk-1"
    rescale = next(r for r in history if r[1] == "rescale")
    assert rescale[0] == f"chk-{ops_job.RESCALE_ID}"
    assert rescale[3] == "rescaled from P=2 to P=4" and rescale[4] == "4"
    failed = next(r for r in history if r[0] == f"chk-{ops_job.FAILED_VALIDATION}")
    assert failed[10] == "failed"
    # older records: chk-1 has no figures, chk-2 legacy counters but no timings
    assert history[-1][7:10] == ["–", "–", "–"]
    assert history[-2][7:10] == ["–", "–", str(sum(ops_job.rejects(2).values()))]
    assert len(ops["detail_ids"]) == N and ops["open_details"] == [f"detail-clicks-{N}"]
    latest = ops["subtasks"][f"subtasks-clicks-{N}"]
    assert [r[0] for r in latest] == ["0", "1", "2", "3"]
    assert [r[1] for r in latest] == ["0–31 (32)", "32–63 (32)", "64–95 (32)", "96–127 (32)"]
    sizes = [ops_job.subtask_bytes(N, i, 4) for i in range(4)]
    assert [r[3] for r in latest] == [f"{s / 1024:.1f} KiB" if s >= 1024 else f"{s} B"
                                      for s in sizes]
    before = ops["subtasks"][f"subtasks-clicks-{ops_job.RESCALE_ID - 1}"]
    assert [r[1] for r in before] == ["0–63 (64)", "64–127 (64)"]


def test_runs_savepoints_leases(browser):
    out, _ = browser
    ops = out["ops"]
    outcomes = [r[2] for r in ops["runs"]]
    assert outcomes[:3] == ["failed", "failed", "skipped"] and outcomes.count("committed") == 3
    assert ops["savepoints"] == [[
        ops_job.SAVEPOINT, f"clicks chk-{ops_job.SAVEPOINT_FROM}", ops["savepoints"][0][2], "4",
        "rocksdb", "4", ops["savepoints"][0][6], f"clicks/savepoints/{ops_job.SAVEPOINT}"]]
    leases = {r[0]: r for r in ops["leases"]}
    assert leases["writer"][1] == "live" and leases["writer"][5] == f"chk-{N}"
    assert leases["hold-validate"][1] == "expired" and leases["hold-validate"][5] == "chk-12"


def test_links_to_airflow_and_reports(browser):
    out, job = browser
    links = out["ops"]["links"]
    run = f"scheduled__{job.created(N).isoformat()}"
    assert unquote(links["dag_run"][0]) == f"/dags/clicks_pipeline/runs/{run}"
    assert unquote(links["task_log"][0]) == (f"/dags/clicks_pipeline/runs/{run}/tasks/run_job"
                                             f"?try_number={1 + N % 2}")
    assert set(links["targets"]) == {"_top"}  # out of the UI's iframe
    assert links["dags"] == ["/dags/clicks_pipeline", "/dags/clicks_reports",
                             "/dags/clicks_maintenance", "/dags/clicks_rescale_restore"]
    assert f"/ckpt/reports/clicks/chk-{ops_job.FAILED_VALIDATION}/index.html" in links["report"]
    report = out["ops"]["failed_report"]
    assert report["title"].startswith(f"Checkpoint {ops_job.FAILED_VALIDATION} of job clicks")
    assert report["styled"] == "rgb(176, 0, 32)" and "FAILED" in report["text"]


def test_screenshots_show_the_charts(browser):
    out, _ = browser
    width, height, rows = png_pixels(os.path.join(out["shots_dir"], "checkpoints.png"))
    assert (width, height) == (1000, 800)
    # state size (blue) and bytes uploaded (orange) are drawn above the fold
    assert count_color(rows, (0x1F, 0x77, 0xB4), tol=24) > 200
    assert count_color(rows, (0xFF, 0x7F, 0x0E), tol=24) > 200
    width, height, _ = png_pixels(os.path.join(out["shots_dir"], "checkpoints-full.png"))
    assert width == 1000 and height > 2000
