"""One place that builds SparkSessions for the library (local, standalone or Spark Connect).

Spark on these machines must bind loopback and start workers with the venv's
Python; we set both here so `ckpt run` and `ckpt rescale` work without a wrapper.
Executors get ``PYTHONPATH`` and ``CKPT_LOCAL_DIR`` from the driver's environment.
Storage credentials do not go through the environment: they travel as storage
options inside the task parameters (`statebackend.job.task.TaskParams`).

Spark Connect (``sc://host:port`` as ``remote`` or as the master) gives a client
session: no JVM in this process, no ``SparkContext``. The server's own settings
decide how executors start, so the server must run with the library and the
job's code on its executors' ``PYTHONPATH`` (docker-compose: ``spark-connect``).
A process holds either a classic session or Connect clients, not both:
``pyspark.sql.functions`` answer for whichever mode was started first.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from statebackend.errors import UsageError
from statebackend.spark.connect_sessions import (
    CONNECT_SCHEME,
    JobSession,
    code_digest,
    is_remote_url,
    is_session_closed,
    names_session,
    new_session_id,
    with_session_id,
)
from statebackend.spark.reader_jar import jar_path

DEFAULT_MASTER = "local[*]"
# Without a conf that says how many cores the Connect server has.
CONNECT_FALLBACK_PARALLELISM = 2
# Session (runtime) settings a Connect client may set; the rest belong to the server.
RUNTIME_SETTINGS = {
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}
# Forwarded to executors: where the job's code is, and the local-recovery root.
EXECUTOR_ENV = ("PYTHONPATH", "CKPT_LOCAL_DIR")


def spark_env_defaults() -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def is_connect(spark) -> bool:
    """True for a Spark Connect client session (no SparkContext, no RDD)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def get_spark(master: str | None = None, app_name: str = "ckpt-job", conf: dict | None = None,
              remote: str | None = None, job_session: JobSession | None = None):
    """Get or create a SparkSession (storage options travel with each task, not here).

    ``remote`` (or a ``master`` starting with ``sc://``) gives a Spark Connect client.
    """
    if remote or is_remote_url(master):
        return get_connect(remote or master, app_name, conf,  # type: ignore[arg-type]
                           job_session)
    spark_env_defaults()
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name).master(master or DEFAULT_MASTER)
    settings = {
        # On a real cluster executors must reach the driver: the deployment names it
        # (docker-compose sets the task container's hostname); loopback otherwise.
        "spark.driver.host": os.environ.get("CKPT_SPARK_DRIVER_HOST", "127.0.0.1"),
        "spark.driver.bindAddress": os.environ.get("CKPT_SPARK_DRIVER_BIND_ADDRESS", "127.0.0.1"),
        "spark.ui.enabled": "false",
        **RUNTIME_SETTINGS,
        "spark.python.worker.reuse": "true",
        "spark.executorEnv.PYSPARK_PYTHON": os.environ["PYSPARK_PYTHON"],
    }
    for var in EXECUTOR_ENV:
        if os.environ.get(var):
            settings[f"spark.executorEnv.{var}"] = os.environ[var]
    settings.update(conf or {})
    settings.update(with_state_reader_jar(settings))
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def with_state_reader_jar(settings: dict[str, str]) -> dict[str, str]:
    """``spark.jars`` with the JVM state reader's jar added when it is built
    (`statebackend.spark.jvm_reader`); {} without it."""
    jar = jar_path()
    if jar is None:
        return {}
    given = [j for j in settings.get("spark.jars", "").split(",") if j]
    return {"spark.jars": ",".join([*given, jar] if jar not in given else given)}


def quiet_console(master: str | None) -> dict[str, str]:
    """Conf without Spark's console progress bar, for a command that shows its own
    (`statebackend.progress`); a static setting, so nothing for a Connect client."""
    return {} if is_remote_url(master) else {"spark.ui.showConsoleProgress": "false"}


def get_connect(url: str, app_name: str = "ckpt-job", conf: dict | None = None,
                job_session: JobSession | None = None):
    """A Spark Connect client session on ``url`` (``sc://host:port``) with our session
    settings. ``job_session``: attach to that job's session kept on the server, whose
    Python workers the job's last run left idle (`statebackend.spark.connect_sessions`);
    None: a session of this process's, released when it stops."""
    if not is_remote_url(url):
        raise UsageError(f"--remote {url!r} is not a Spark Connect URL: use sc://host:port")
    classic = active_session()
    if classic is not None and not is_connect(classic):
        raise UsageError(f"cannot open Spark Connect session {url}: this process already runs a "
                         "local Spark session; run the job in its own process (ckpt run --remote)")
    try:
        if job_session is None or names_session(url):
            return _client(url, app_name, conf)
        return _job_client(url, app_name, conf, job_session)
    except Exception as exc:  # noqa: BLE001 - grpc/Spark errors: one line naming the server
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UsageError(f"cannot use Spark Connect server {url}: {first}; start it "
                         "(docker compose up spark-connect) or check --remote") from exc


def _client(url: str, app_name: str, conf: dict | None, *, kept: bool = False):
    """A client of ``url`` with the session settings; ``kept``: of a session the server
    keeps when this client stops (a new client object, attached to the session the URL
    names), else the process's session (created once, released when it stops)."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.remote(url).appName(app_name)
    spark = builder.create() if kept else builder.getOrCreate()
    if kept:
        spark.release_session_on_close = False  # type: ignore[attr-defined]  # (Connect)
    try:
        for key, value in {**RUNTIME_SETTINGS, **(conf or {})}.items():
            spark.conf.set(key, value)
    except BaseException:
        if kept:  # (a session got, not created, may be a caller's)
            spark.stop()
        raise
    return spark


def _job_client(url: str, app_name: str, conf: dict | None, job: JobSession):
    """A client of ``job``'s kept session: the recorded one, else (none recorded, the code
    changed, or the server closed it) a new one, then recorded."""
    code = code_digest()
    recorded = job.recorded(code)
    if recorded is not None:
        try:
            return _client(with_session_id(url, recorded), app_name, conf, kept=True)
        except Exception as exc:
            if not is_session_closed(exc):
                raise
    session_id = new_session_id()
    spark = _client(with_session_id(url, session_id), app_name, conf, kept=True)
    job.record(session_id, code)
    return spark


def master_of(spark) -> str:
    """The master a session's work runs on: a classic session's master URL (``local[2]``,
    ``spark://...``), or ``sc://`` for a Connect client (its executors are the server's,
    never this process)."""
    return CONNECT_SCHEME if is_connect(spark) else spark.sparkContext.master


def default_parallelism(spark) -> int:
    """Cores Spark schedules on: the SparkContext's figure, or the Connect server's conf."""
    if not is_connect(spark):
        return spark.sparkContext.defaultParallelism
    conf = spark.conf
    explicit = conf.get("spark.default.parallelism", None)
    if explicit:
        return int(explicit)
    local = re.fullmatch(r"local\[(\d+)(?:,\d+)?\]", conf.get("spark.master", None) or "")
    if local:
        return int(local.group(1))
    cores, instances = (conf.get(k, None) for k in ("spark.executor.cores",
                                                   "spark.executor.instances"))
    if cores and instances:
        return int(cores) * int(instances)
    return CONNECT_FALLBACK_PARALLELISM


def under_spark_submit() -> bool:
    """This Python is spark-submit's driver (its JVM is up and knows --master)."""
    return bool(os.environ.get("PYSPARK_GATEWAY_PORT"))


def default_master() -> str:
    """Under spark-submit the JVM already knows --master; otherwise local[*]."""
    if under_spark_submit():
        from pyspark import SparkConf, SparkContext

        SparkContext._ensure_initialized()  # connect to spark-submit's JVM: its conf has --master
        return SparkConf().get("spark.master", DEFAULT_MASTER)
    return DEFAULT_MASTER


def active_session():
    """This thread's active session, or None (also when pyspark was never imported)."""
    if "pyspark" not in sys.modules:
        return None
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()


@contextmanager
def owned_session() -> Iterator[None]:
    """Work that may start a Spark session (`get_spark`): a session it started is stopped
    on exit; one already running (a caller's, a test's) stays up."""
    running = active_session()
    try:
        yield
    finally:
        started = active_session() if running is None else None
        if started is not None:
            started.stop()


def add_to_pythonpath(*roots: str) -> None:
    """Prepend ``roots`` to PYTHONPATH (executors import the job's module from there)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    new = [r for r in roots if r and r not in paths]
    if new:
        os.environ["PYTHONPATH"] = os.pathsep.join(new + paths)
