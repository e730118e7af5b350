"""A Spark Connect server on 127.0.0.1, started from the pip pyspark, stopped by its PID.

Used by the tests (`tests/conftest.py`) and by the benches' ``connect`` mode:
``spark-submit --class SparkConnectServer`` on a free loopback port, in its own
process group (stopped as one: SIGTERM, then SIGKILL after 60 s). Its executors run
this interpreter with the repository on PYTHONPATH (the server decides how executors
start, not the client). No credentials are passed: storage options travel with the
job's tasks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
STARTED = "Spark Connect server started"
START_TIMEOUT_S = 180


@dataclass(frozen=True)
class ConnectServer:
    url: str  # sc://127.0.0.1:PORT
    log: str  # the server's log file
    env: dict  # the environment a client subprocess runs with


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_log(log: str, needle: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait until ``needle`` appears in ``log`` (written by ``proc``); RuntimeError with the
    log's tail when ``proc`` exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with open(log, errors="replace") as fh:
                if needle in fh.read():
                    return
        except FileNotFoundError:
            pass  # not written yet
        time.sleep(0.5)
    with open(log, errors="replace") as fh:
        tail = fh.read()[-3000:]
    raise RuntimeError(f"{needle!r} not seen in {log} (exit {proc.poll()}):\n{tail}")


@contextmanager
def connect_server(base: str, master: str = "local[2]",
                   conf: dict[str, str] | None = None) -> Iterator[ConnectServer]:
    """Start a server (files under ``base``), yield it once it listens, stop it."""
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    os.makedirs(base, exist_ok=True)
    port = free_port()
    from bench.process_env import child_env
    from statebackend.spark.session import with_state_reader_jar

    env = {**child_env(), "SPARK_HOME": home, "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    settings = {"spark.ui.enabled": "false", "spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.connect.grpc.binding.port": str(port),
                "spark.local.dir": os.path.join(base, "spark-local"),
                # foreachBatch's Python process imports the Connect client before it
                # connects back: on a loaded 2-core machine that exceeds the 15 s default
                "spark.python.authenticate.socketTimeout": "180s", **(conf or {})}
    settings.update(with_state_reader_jar(settings))  # read_state inside the server's JVM
    flags = [x for key, value in settings.items() for x in ("--conf", f"{key}={value}")]
    log = os.path.join(base, "server.log")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [os.path.join(home, "bin", "spark-submit"), "--class", SERVER_CLASS,
             "--master", master, *flags, "spark-internal"],
            env=env, cwd=base, stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True)  # its own process group: stopped as one below
    try:
        wait_for_log(log, STARTED, proc, START_TIMEOUT_S)
        yield ConnectServer(f"sc://127.0.0.1:{port}", log, env)
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, *signals: tuple[int, float]) -> int | None:
    """Stop the process group ``proc`` leads (started with ``start_new_session``): each
    (signal, grace seconds) of ``signals`` in turn (default SIGTERM, 60 s) until its
    leader has exited, then SIGKILL to what is left of the group (a member that ignored
    the signals, such as an idle Airflow LocalExecutor worker, outlives its leader).
    Returns the signal after which the leader exited, None if only SIGKILL ended it (or
    it had exited before)."""
    ended_by = None
    for sig, grace_s in signals or ((signal.SIGTERM, 60.0),):
        if proc.poll() is not None:
            break
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
            ended_by = sig
        except subprocess.TimeoutExpired:
            pass  # the next signal (the loop's check sees an exit)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group is gone
    proc.wait(timeout=30)
    return ended_by
