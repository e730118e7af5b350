"""A Spark standalone cluster on 127.0.0.1: a master and N workers from the pip pyspark.

Used by the job tests (`tests/jobs/conftest.py`, master + 2 workers of 1 core) and by the
benches' ``--master standalone`` (`bench_keyed_aggregation.py`). Every process listens on
127.0.0.1 only, runs in its own process group and is stopped by its PID (SIGTERM, then
SIGKILL after 30 s). Each worker gets its own local-recovery root (``CKPT_LOCAL_DIR``):
state moves between workers only through checkpoint storage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from bench.connect_server import free_port, stop_group, wait_for_log

START_TIMEOUT_S = 90


@dataclass(frozen=True)
class Cluster:
    master_url: str                   # spark://127.0.0.1:PORT
    worker_local_dirs: tuple[str, ...]  # each worker's CKPT_LOCAL_DIR
    env: dict                         # the environment a driver subprocess runs with


@contextmanager
def standalone_cluster(base: str, workers: int = 2, cores: int = 1,
                       memory: str = "1g") -> Iterator[Cluster]:
    """Start the master and ``workers`` workers (files under ``base``), yield the
    cluster once every worker registered, stop them all."""
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    os.makedirs(base, exist_ok=True)
    env = dict(os.environ)
    env.update({"SPARK_HOME": home, "SPARK_LOCAL_IP": "127.0.0.1",
                "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
                "SPARK_LOG_DIR": os.path.join(base, "logs"), "SPARK_NO_DAEMONIZE": "1"})
    env.pop("CKPT_LOCAL_DIR", None)
    spark_class = os.path.join(home, "bin", "spark-class")
    master_url = f"spark://127.0.0.1:{free_port()}"

    with ExitStack() as stack:
        def start(args: list[str], name: str, extra_env: dict | None = None
                  ) -> tuple[subprocess.Popen, str]:
            log = os.path.join(base, f"{name}.log")
            fh = stack.enter_context(open(log, "w"))
            proc = subprocess.Popen([spark_class, *args], env={**env, **(extra_env or {})},
                                    stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its own group: stopped as one
            stack.callback(stop_group, proc, (signal.SIGTERM, 30.0))
            return proc, log

        port = master_url.rsplit(":", 1)[1]
        master, log = start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                             "--port", port, "--webui-port", str(free_port())], "master")
        wait_for_log(log, "I have been elected leader", master, START_TIMEOUT_S)
        local_dirs = []
        started = []
        for i in range(workers):
            local_dirs.append(os.path.join(base, f"worker{i}-local"))
            started.append(start(
                ["org.apache.spark.deploy.worker.Worker", master_url, "--host", "127.0.0.1",
                 "--port", str(free_port()), "--webui-port", str(free_port()),
                 "--cores", str(cores), "--memory", memory,
                 "--work-dir", os.path.join(base, f"work{i}")],
                f"worker{i}", {"CKPT_LOCAL_DIR": local_dirs[-1]}))
        for proc, log in started:
            wait_for_log(log, "Successfully registered with master", proc, START_TIMEOUT_S)
        yield Cluster(master_url, tuple(local_dirs), env)
