"""Safety defaults of the product, defined once (style: safety defaults live in the library).

Everything that has a default for these settings reads it from here: the job
run (`statebackend.job.RunConfig`), the ``ckpt`` CLI, the Airflow job
definitions (`statebackend.airflow.config.JobSpec`) and the lifecycle
operations. A deployment overrides them per job in ``ckpt_jobs``.

This module imports nothing: DAG files read it at parse time.
"""

from __future__ import annotations

# Key groups of a new lineage (fixed for its whole life; Flink's default is 128 too).
MAX_PARALLELISM = 128
# How a new lineage places keys in key groups (statebackend.state.keygroups): "spark",
# Spark SQL's hash(), lets the Spark engine route rows inside the JVM; an existing
# lineage keeps the hash its records name ("murmur3" when they name none).
KEY_HASH = "spark"
# A run fails (and commits nothing) when more than this fraction of its input is rejected.
MAX_REJECT_FRACTION = 0.01
# Retention keeps the newest N committed checkpoints (plus savepoints and leased ones).
RETENTION_KEEP = 3
# GC spares files no checkpoint references that are younger than this: a running
# attempt may still commit them.
GC_GRACE_SECONDS = 3600.0
# Where a job run's tasks run (statebackend.job.engine): "auto" picks the local engine (this
# process, no JVM) for an input up to LOCAL_ENGINE_MAX_BYTES, else Spark.
ENGINES = ("auto", "spark", "local")
ENGINE = "auto"
LOCAL_ENGINE_MAX_BYTES = 64 * 2**20
# ... and, with a cluster or Connect master, a parent state up to this size.
LOCAL_ENGINE_MAX_STATE_BYTES = 256 * 2**20
# A local-engine run holds its whole (decompressed) input in memory: at most this much.
LOCAL_ENGINE_MAX_MEMORY_BYTES = 2**30
# A Spark run's tasks, one per core, each read the whole input (no shuffle) while its
# decompressed bytes times those tasks stay under this (statebackend.job.spark_direct).
SPARK_DIRECT_READ_MAX_BYTES = 512 * 2**20
# Python's youngest-generation GC threshold while subtasks run (statebackend.python_gc:
# the objects made before them are frozen too; CPython's default is 700).
PYTHON_GC_THRESHOLD = 2_000

# Where a job's keyed state lives (statebackend.state.backend_kinds): embedded RocksDB
# (out of core), or in memory (hash tables per key group, for states that fit; each
# subtask fails past MEMORY_LIMIT_MB, never swaps). A job's `backend`, its ckpt_jobs
# entry or `ckpt run --backend` choose it; an existing lineage keeps its records'.
BACKENDS = ("rocksdb", "memory", "external")
CONNECT_SESSIONS = ("job", "new")  # --connect-session (statebackend.spark.connect_sessions)
EXTERNAL_MODES = ("mvcc", "wal")  # the external backend's (statebackend.state.external_wal)
BACKEND = "rocksdb"
MEMORY_LIMIT_MB = 2048

__all__ = ["BACKEND", "BACKENDS", "CONNECT_SESSIONS", "ENGINE", "ENGINES", "EXTERNAL_MODES",
           "GC_GRACE_SECONDS", "KEY_HASH", "LOCAL_ENGINE_MAX_BYTES",
           "LOCAL_ENGINE_MAX_MEMORY_BYTES", "LOCAL_ENGINE_MAX_STATE_BYTES", "MAX_PARALLELISM",
           "MAX_REJECT_FRACTION", "MEMORY_LIMIT_MB", "PYTHON_GC_THRESHOLD",
           "RETENTION_KEEP", "SPARK_DIRECT_READ_MAX_BYTES"]
