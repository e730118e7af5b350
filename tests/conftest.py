"""Shared fixtures: storage backends (file, memory, real S3 API on loopback), Spark."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# Commands under test print no progress lines unless a test asks for them.
os.environ.setdefault("CKPT_PROGRESS", "off")
# Runs use the Spark engine unless a test picks another: small test inputs would
# otherwise take the local engine (statebackend.job.engine), which has its own tests.
os.environ.setdefault("CKPT_ENGINE", "spark")
# Every RocksDB snapshot of the suite checks its tracked row counts against a scan
# (statebackend.state.backend: row counts); a drift fails the snapshot.
os.environ.setdefault("CKPT_ROW_COUNTS", "verify")
# Registry indexes are signed with a key of this test session, not the user's own
# (statebackend.lifecycle.index_signing): commands under test inherit it.
os.environ.setdefault("CKPT_INDEX_KEY_FILE", os.path.join(
    tempfile.mkdtemp(prefix="ckpt-test-index-key-"), "index-key"))
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")

S3_BUCKET = "ckpt-test"


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 (real HTTP S3 API), credentials via env only."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")}
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"})
    import fsspec

    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint})
    fs.mkdir(S3_BUCKET)
    yield endpoint
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(params=["file", "memory", "s3"])
def storage_url(request, tmp_path):
    """The same contract tests run against every storage backend."""
    if request.param == "file":
        return f"file://{tmp_path}/store"
    if request.param == "memory":
        return f"memory://t-{uuid.uuid4().hex}"
    request.getfixturevalue("s3_server")
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(params=["file", "s3"])
def durable_storage_url(request, tmp_path):
    """file:// and s3:// only (suites too large for memory://)."""
    if request.param == "file":
        return f"file://{tmp_path}/store"
    request.getfixturevalue("s3_server")
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession for the whole run (start-up costs ~10 s)."""
    from statebackend.spark.session import get_spark

    session = get_spark("local[2]", app_name="ckpt-tests")
    yield session
    session.stop()
    # py4j logs from __del__ at interpreter exit, after pytest closed the captured streams.
    logging.getLogger("py4j").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """A Spark Connect server on 127.0.0.1 for the session (`bench.connect_server`)."""
    from bench import connect_server as server_module

    with server_module.connect_server(str(tmp_path_factory.mktemp("connect"))) as server:
        yield server


# Markers name what a test needs, applied from what it uses so that no test can forget
# one: `pytest -m "not spark and not browser"` is a quick run, `-m s3` the S3 suite.
SPARK_FIXTURES = frozenset({"spark", "standalone_cluster", "connect_server"})
STORAGE_PARAM_FIXTURES = ("storage_url", "durable_storage_url")
AIRFLOW_DIRS = ("tests/dags/", "tests/airflow/", "tests/plugins/")
BROWSER_FILES = frozenset({
    "tests/plugins/test_standalone_ui.py",
    "tests/plugins/test_checkpoints_page_browser.py",
    "tests/plugins/test_report_offline.py",
    "tests/statebackend/validation/test_report_browser.py",
})


def needed_markers(item: pytest.Item) -> set[str]:
    """The markers (spark, s3, airflow, browser) a collected test needs, from its fixtures
    (fixturenames is the closure: a fixture built on `spark` counts) and its file."""
    fixtures = set(getattr(item, "fixturenames", ()))
    params = getattr(getattr(item, "callspec", None), "params", {})
    path = os.path.relpath(str(item.path), ROOT).replace(os.sep, "/")
    markers = set()
    if fixtures & SPARK_FIXTURES:
        markers.add("spark")
    if "s3_server" in fixtures or any(params.get(f) == "s3" for f in STORAGE_PARAM_FIXTURES):
        markers.add("s3")
    if path.startswith(AIRFLOW_DIRS):
        markers.add("airflow")
    if path in BROWSER_FILES:
        markers.add("browser")
    return markers


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in sorted(needed_markers(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(name)


# A test that skips because a tool is missing must fail in CI instead (CI=true): the
# skip would hide that the suite did not test what it claims.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI", "").lower() in ("1", "true", "yes") \
            and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (a missing tool fails in CI): {reason}"


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server on 127.0.0.1 for the external state backend (Debian's package)."""
    from tests.postgres_server import PostgresServer, available

    if not available():
        pytest.skip("PostgreSQL server binaries (initdb, postgres) are not installed")
    server = PostgresServer()
    server.start()
    yield server
    server.cleanup()
