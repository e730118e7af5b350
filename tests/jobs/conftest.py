"""Fixtures for the job tests: a Spark standalone cluster on 127.0.0.1 (master + 2 workers)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

VENV_BIN = os.path.dirname(sys.executable)


def spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Cluster:
    master_url: str
    worker_local_dirs: tuple[str, ...]
    env: dict


def _wait_for(path: str, needle: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with open(path, errors="replace") as fh:
                if needle in fh.read():
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.5)
    with open(path, errors="replace") as fh:
        tail = fh.read()[-3000:]
    raise RuntimeError(f"{needle!r} not seen in {path} (exit {proc.poll()}):\n{tail}")


@pytest.fixture(scope="session")
def standalone_cluster(tmp_path_factory):
    """Master + 2 workers (1 core, 1 GB each) from the pip pyspark, stopped by PID."""
    base = tmp_path_factory.mktemp("cluster")
    home = spark_home()
    env = dict(os.environ)
    env.update({"SPARK_HOME": home, "SPARK_LOCAL_IP": "127.0.0.1",
                "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
                "SPARK_LOG_DIR": str(base / "logs"), "SPARK_NO_DAEMONIZE": "1"})
    env.pop("CKPT_LOCAL_DIR", None)
    spark_class = os.path.join(home, "bin", "spark-class")
    port, ui = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    logs = []

    def start(args: list[str], name: str, extra_env: dict | None = None) -> subprocess.Popen:
        log = str(base / f"{name}.log")
        fh = open(log, "w")  # noqa: SIM115 - closed in teardown via the list
        logs.append(fh)
        proc = subprocess.Popen([spark_class, *args], env={**env, **(extra_env or {})},
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    master_url = f"spark://127.0.0.1:{port}"
    local_dirs = []
    try:
        master = start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                        "--port", str(port), "--webui-port", str(ui)], "master")
        _wait_for(str(base / "master.log"), "I have been elected leader", master, 90)
        workers = []
        for i in range(2):
            local_dir = str(base / f"worker{i}-local")
            local_dirs.append(local_dir)
            # Each worker has its own local-recovery root: state moves only through storage.
            workers.append(start(
                ["org.apache.spark.deploy.worker.Worker", master_url, "--host", "127.0.0.1",
                 "--port", str(free_port()), "--webui-port", str(free_port()),
                 "--cores", "1", "--memory", "1g", "--work-dir", str(base / f"work{i}")],
                f"worker{i}", {"CKPT_LOCAL_DIR": local_dir}))
        for i, w in enumerate(workers):
            _wait_for(str(base / f"worker{i}.log"), "Successfully registered with master", w, 90)
        yield Cluster(master_url, tuple(local_dirs), env)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for fh in logs:
            fh.close()
