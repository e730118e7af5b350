"""One place that builds SparkSessions for the library (local or a standalone master).

Spark on these machines must bind loopback and start workers with the venv's
Python; we set both here so `ckpt run` and `ckpt rescale` work without a wrapper.
Executors get ``PYTHONPATH`` and ``CKPT_LOCAL_DIR`` from the driver's environment.
Storage credentials do not go through the environment: they travel as storage
options inside the task parameters (`statebackend.job.task.TaskParams`).
"""

from __future__ import annotations

import os
import sys

DEFAULT_MASTER = "local[*]"
# Forwarded to executors: where the job's code is, and the local-recovery root.
EXECUTOR_ENV = ("PYTHONPATH", "CKPT_LOCAL_DIR")


def spark_env_defaults() -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def get_spark(master: str | None = None, app_name: str = "ckpt-job", conf: dict | None = None):
    """Get or create a SparkSession (storage options travel with each task, not here)."""
    spark_env_defaults()
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name).master(master or DEFAULT_MASTER)
    settings = {
        # On a real cluster executors must reach the driver: the deployment names it
        # (docker-compose sets the task container's hostname); loopback otherwise.
        "spark.driver.host": os.environ.get("CKPT_SPARK_DRIVER_HOST", "127.0.0.1"),
        "spark.driver.bindAddress": os.environ.get("CKPT_SPARK_DRIVER_BIND_ADDRESS", "127.0.0.1"),
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "8",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.python.worker.reuse": "true",
        "spark.executorEnv.PYSPARK_PYTHON": os.environ["PYSPARK_PYTHON"],
    }
    for var in EXECUTOR_ENV:
        if os.environ.get(var):
            settings[f"spark.executorEnv.{var}"] = os.environ[var]
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def default_master() -> str:
    """Under spark-submit the JVM already knows --master; otherwise local[*]."""
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        from pyspark import SparkConf, SparkContext

        SparkContext._ensure_initialized()  # connect to spark-submit's JVM: its conf has --master
        return SparkConf().get("spark.master", DEFAULT_MASTER)
    return DEFAULT_MASTER


def stop_active_session() -> None:
    """Stop the active session, if pyspark was imported at all."""
    if "pyspark" in sys.modules:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()


def add_to_pythonpath(*roots: str) -> None:
    """Prepend ``roots`` to PYTHONPATH (executors import the job's module from there)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    new = [r for r in roots if r and r not in paths]
    if new:
        os.environ["PYTHONPATH"] = os.pathsep.join(new + paths)
