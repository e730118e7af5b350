"""`make ui` in its own network namespace: REST-triggered rescale, page in Chromium.

The test starts the server exactly as users do, with ``make ui`` (which puts the venv's
``bin`` on PATH for the components `airflow standalone` starts; the test's PATH lacks it),
on 127.0.0.1 inside ``unshare -n`` (its log servers bind every interface whatever the
config says), reaches it with ``nsenter``, triggers a
rescale-restore through REST API v2 with conf (a bad conf is answered 400), waits
for success, then opens the Checkpoints page in headless Chromium: without a login it
lands on Airflow's login page; logged in as admin it checks the DOM and the screenshot
for the job name and the chart, and that the linked validation report renders under
its no-script CSP. Before that, a queued run of the (paused) pipeline DAG makes the
rescale refuse. Stopped by SIGINT to its process group (as Ctrl-C in a terminal does:
make waits for its recipe, standalone stops its components), then SIGTERM (the
LocalExecutor's idle workers ignore SIGINT).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from urllib.parse import urlparse

import pytest

from bench.connect_server import stop_group
from demo.sample_data import generate_events

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
PORT = 8080  # the namespace is private, no clash with anything on the host
BASE = f"http://127.0.0.1:{PORT}"
START_MS = 1_798_761_600_000  # 2027-01-01T00:00:00Z


def path_without_venv() -> str:
    """PATH without the venv's bin: `make ui` must put it there itself."""
    venv_bin = os.path.dirname(sys.executable)
    return os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if p and os.path.realpath(p) != os.path.realpath(venv_bin))


def can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-n", "true"], capture_output=True).returncode == 0


def nsenter(pid: int, args: list[str], timeout: float, env: dict | None = None):
    return subprocess.run(["nsenter", "-t", str(pid), "-n", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def wait_healthy(pid: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"airflow standalone exited with {proc.returncode}")
        res = nsenter(pid, ["curl", "-sf", f"{BASE}/api/v2/monitor/health"], 30)
        if res.returncode == 0 and '"healthy"' in res.stdout:
            try:
                health = json.loads(res.stdout)
            except ValueError:
                health = {}
            if health.get("scheduler", {}).get("status") == "healthy":
                return
        time.sleep(2)
    raise AssertionError("airflow standalone did not become healthy in time")


def png_pixels(path: str) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into rows."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line) if bpp == 3 else bytes(
            v for j in range(0, stride, 4) for v in line[j:j + 3]))
        prev = line
    return width, height, rows


def count_color(rows: list[bytes], rgb: tuple[int, int, int], tol: int = 40) -> int:
    n = 0
    for row in rows:
        for j in range(0, len(row), 3):
            if all(abs(row[j + k] - rgb[k]) <= tol for k in range(3)):
                n += 1
    return n


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    if not can_unshare():
        pytest.skip("needs `unshare -n` (root or user namespaces) for an isolated standalone")
    base = tmp_path_factory.mktemp("standalone")
    home, data = base / "airflow_home", base / "data"
    generate_events(str(data / "events" / "day=2027-01-01"), n_events=2000, n_keys=300,
                    seed=5, start_ts_ms=START_MS)
    storage = f"file://{base}/store"
    config = base / "ckpt_jobs.yaml"
    config.write_text(json.dumps({"defaults": {"spark": {"master": "local[2]"}}, "jobs": {
        "clicks": {"input": f"{data}/events/day={{{{ ds }}}}",
                   "output": f"{data}/out/day={{{{ ds }}}}", "storage": storage,
                   "parallelism": 2, "retries": 0}}}))
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(ROOT, "dags"),
           "AIRFLOW__CORE__PLUGINS_FOLDER": os.path.join(ROOT, "plugins"),
           "AIRFLOW__CORE__PARALLELISM": "4", "AIRFLOW__API__HOST": "127.0.0.1",
           "AIRFLOW__API__PORT": str(PORT), "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
           "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "True",
           "CKPT_JOBS_FILE": str(config), "CKPT_JOBS_SKIP_VARIABLE": "1",
           "PATH": path_without_venv()}
    # `make ui` installs first; inside the namespace there is no network for that
    fresh = subprocess.run(["make", "-q", ".venv/.installed"], cwd=ROOT, env=env)
    assert fresh.returncode == 0, "the venv is not up to date: run `make install` first"
    # One committed checkpoint for the rescale (the job run itself is tested elsewhere).
    seed = subprocess.run([sys.executable, "-m", "jobs.keyed_aggregation", "--input",
                           str(data / "events" / "day=2027-01-01"), "--storage", storage,
                           "--job", "clicks", "--run-id", "seed", "--output", str(data / "out"),
                           "--parallelism", "2", "--master", "local[2]", "--engine", "local",
                           "--json"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert seed.returncode == 0, seed.stderr[-3000:]
    log = open(base / "standalone.log", "w")
    proc = subprocess.Popen(
        ["unshare", "-n", "--", "bash", "-c",
         f"ip link set lo up && exec env --default-signal=INT make -C {ROOT} ui"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(base), start_new_session=True)
    try:
        wait_healthy(proc.pid, proc, 300)
        yield {"pid": proc.pid, "home": home, "base": base, "env": env, "storage": storage}
    finally:
        # Ctrl-C alone must stop `make ui`: the LocalExecutor's idle workers ignore SIGINT
        # and kept standalone waiting for minutes before demo/ui.py, which escalates to
        # SIGTERM after 5 s. Whatever is left of the group after that is killed.
        ended_by = stop_group(proc, (signal.SIGINT, 60.0), (signal.SIGTERM, 30.0))
        log.close()
        assert ended_by == signal.SIGINT, "make ui was still running 60 s after Ctrl-C"


@pytest.fixture(scope="module")
def client_result(standalone):
    res = nsenter(standalone["pid"], [
        sys.executable, os.path.join(os.path.dirname(__file__), "standalone_client.py"), BASE,
        str(standalone["home"] / "simple_auth_manager_passwords.json.generated"),
        "clicks_rescale_restore", json.dumps({"parallelism": 3}),
        json.dumps({"parallelism": 0}), "600"], timeout=900)
    lines = [x for x in res.stdout.splitlines() if x.startswith("CLIENT-RESULT")]
    tail = open(standalone["base"] / "standalone.log").read()[-4000:]
    assert res.returncode == 0 and lines, (res.stderr[-1500:], tail[-1500:])
    return json.loads(lines[0][len("CLIENT-RESULT"):])


def test_rescale_refused_while_pipeline_has_an_active_run(client_result):
    out = client_result
    assert out["blocker"] == {"status": 200, "state": "queued"}, out["blocker"]
    assert out["refused"]["state"] == "failed", out["refused"]
    assert out["refused"]["tasks"]["check_no_running_pipeline"] == "failed"
    assert out["refused"]["tasks"]["rescale"] == "upstream_failed"
    assert out["blocker_deleted"] == 204


def test_rest_trigger_with_conf_runs_the_rescale(client_result, standalone):
    out = client_result
    assert out["token_status"] in (200, 201) and out["unpause"] == 200
    bad = out["bad_trigger"]
    assert bad["status"] == 400 and "parallelism" in json.dumps(bad["body"])
    assert out["trigger"]["status"] == 200, out["trigger"]
    assert out["run_state"] == "success", out
    assert out["tasks"] == {"check_no_running_pipeline": "success", "rescale": "success",
                            "validate": "success"}
    from statebackend.checkpoint.store import CheckpointStore
    from statebackend.storage import open_storage

    latest = CheckpointStore(open_storage(standalone["storage"]), "clicks").latest()
    assert (latest.checkpoint_id, latest.kind, latest.parallelism) == (2, "rescale", 3)


def test_plugin_registered_with_nav_view(client_result):
    plugins = client_result["plugins"]["plugins"]
    ours = [p for p in plugins if p["name"] == "ckpt_checkpoints"]
    assert ours, plugins
    assert ours[0]["external_views"][0]["href"] == "/ckpt/"
    assert ours[0]["fastapi_apps"][0]["url_prefix"] == "/ckpt"
    assert client_result["anonymous_api_status"] == 401
    assert client_result["page_status"] == 200
    assert 'id="chart-clicks-state_size"' in client_result["page"]


def test_checkpoints_page_renders_in_chromium(client_result, standalone, tmp_path):
    assert os.path.exists(CHROMIUM), "chromium missing: `make system-deps` installs it"
    res = nsenter(standalone["pid"], [
        sys.executable, os.path.join(os.path.dirname(__file__), "cdp_browser.py"), CHROMIUM,
        BASE, str(standalone["home"] / "simple_auth_manager_passwords.json.generated"),
        str(tmp_path)], timeout=300)
    lines = [x for x in res.stdout.splitlines() if x.startswith("BROWSER-RESULT")]
    assert res.returncode == 0 and lines, res.stderr[-2000:]
    out = json.loads(lines[0][len("BROWSER-RESULT"):])
    # Not logged in: Airflow's own login page, which brings the user back afterwards.
    assert urlparse(out["anonymous_url"]).path.startswith("/auth/login"), out["anonymous_url"]
    assert out["login_status"] == 201
    assert urlparse(out["page_url"]).path == "/ckpt/"
    dom = out["dom"]
    assert "<h1>Checkpoints</h1>" in dom and out["csp"] == []
    assert 'id="job-clicks"' in dom and 'id="health-clicks"' in dom
    # uPlot drew the charts (two checkpoints: the seed run and the rescale)
    assert 'id="chart-clicks-state_size" data-job="clicks" data-chart="state_size" ' \
           'data-drawn="2"' in dom and dom.count("<canvas") >= 3
    assert "rescaled from P=2 to P=3" in dom and "chk-2" in dom
    width, height, rows = png_pixels(out["screenshot"])
    assert (width, height) == (1000, 800)
    # The chart's two series colors are drawn (state size blue, uploaded orange).
    assert count_color(rows, (0x1F, 0x77, 0xB4), tol=24) > 50
    assert count_color(rows, (0xFF, 0x7F, 0x0E), tol=24) > 50
    # The validation report of the rescaled checkpoint renders (inline style allowed by
    # its CSP: the status is colored) though scripts are not.
    assert "/ckpt/reports/clicks/chk-2/" in (out["report_url"] or ""), out["report_url"]
    report = out["report"]
    assert report["title"].startswith("Checkpoint 2 of job clicks"), report
    assert report["styled"] in ("rgb(10, 125, 44)", "rgb(176, 0, 32)"), report
