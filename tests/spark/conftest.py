"""A Spark Connect server on 127.0.0.1, started from the pip pyspark, stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
STARTED = "Spark Connect server started"
START_TIMEOUT_S = 180


@dataclass(frozen=True)
class ConnectServer:
    url: str  # sc://127.0.0.1:PORT
    log: str  # the server's log file
    env: dict  # the environment a client subprocess runs with


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_start(log: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log, errors="replace") as fh:
            if STARTED in fh.read():
                return
        time.sleep(0.5)
    with open(log, errors="replace") as fh:
        tail = fh.read()[-3000:]
    raise RuntimeError(f"{STARTED!r} not seen in {log} (exit {proc.poll()}):\n{tail}")


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """``spark-submit --class SparkConnectServer`` (local[2]) on a free loopback port.

    Its executors run the venv's Python with the repository on PYTHONPATH (the
    server decides how executors start, not the client).
    """
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    base = tmp_path_factory.mktemp("connect")
    port = _free_port()
    env = {**os.environ, "SPARK_HOME": home, "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    log = str(base / "server.log")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [os.path.join(home, "bin", "spark-submit"), "--class", SERVER_CLASS,
             "--master", "local[2]", "--conf", "spark.ui.enabled=false",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", f"spark.local.dir={base / 'spark-local'}", "spark-internal"],
            env=env, cwd=str(base), stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: stopped as one below
    try:
        _wait_for_start(log, proc)
        yield ConnectServer(f"sc://127.0.0.1:{port}", log, env)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
