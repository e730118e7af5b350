"""One place that builds SparkSessions for our jobs (local or a standalone master).

Spark on these machines must bind loopback and start workers with the venv's
Python; we set both here so `python -m jobs...` works without a wrapper script.
"""

from __future__ import annotations

import os
import sys

DEFAULT_MASTER = "local[*]"


def spark_env_defaults() -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def get_spark(master: str | None = None, app_name: str = "ckpt-job", conf: dict | None = None):
    """Get or create a SparkSession; executors inherit S3 settings from the environment."""
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
    # Executors on a cluster reach S3 with the same environment as the driver.
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                "PYTHONPATH", "CKPT_LOCAL_DIR"):
        if os.environ.get(var):
            settings[f"spark.executorEnv.{var}"] = os.environ[var]
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
