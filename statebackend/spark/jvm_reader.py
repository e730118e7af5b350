"""`read_state` inside the JVM: a Spark DataSource V2 (``jvm/src/ckpt/reader``) that
reads a RocksDB checkpoint's SST files itself, with no Python worker in its tasks.

Why: a reader whose tasks run Python pays Spark's Python-worker hand-over and the Arrow
conversion of every row into the JVM, about 0.3 s for four tasks however little they
read; Spark's own ``statestore`` reader never leaves the JVM, and neither does this
one. Spark also prunes its columns (a ``mapInArrow`` DataFrame cannot be pruned).

What it reads, and what it leaves to the Python reader (`reason_not_jvm`, one line):
RocksDB and memory-backend subtasks on storage this host sees as files (``file://``);
value, reducing and aggregating states whose codec is a record (fields as columns),
``str`` or ``bytes``, with or without TTL. Lists, maps, JSON values, the timers, the
external backend, ``s3://``: the Python reader. The jar is built from source by ``make``
(javac against pyspark's jars) into `statebackend.spark.reader_jar.JAR`; sessions made by
`statebackend.spark.session.get_spark` load it (``spark.jars``), and so does the
Connect server of `bench.connect_server`. A session without it reads through Python
(``reader="auto"``) or is refused in one line (``reader="jvm"``).

The task protocol is the Python reader's (`statebackend.spark.state_reader`): each task
holds the checkpoint with a hold lease of the same format (renewed, released), checks
that ``_metadata`` still has the planned digest, and checks each file it reads against
its recorded size and CRC before decoding an entry. A file is read from the executor's
local snapshot (the local-recovery folder a job run on the host left, named on the
driver: ``ReadOptions.local_dir``, else ``CKPT_LOCAL_DIR``, else the temp folder's)
when that holds it with its recorded size, else from storage. Files the direct SST reader does not
read (range tombstones, the files a rescale or bootstrap ingested, a non-empty WAL) are read
through rocksdbjni over links to the stored files. A memory-backend subtask's key-group
files are decoded as the Python reader decodes them (`statebackend.checkpoint.memory_read`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from statebackend.checkpoint.layout import LEASES_DIR, metadata_path
from statebackend.checkpoint.local_copy import instance_dir
from statebackend.checkpoint.metadata import SubtaskHandle
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import UsageError
from statebackend.settings import lease_timing
from statebackend.spark.read_task import ReadTask
from statebackend.spark.reader_jar import jar_path
from statebackend.spark.session import is_connect
from statebackend.state.backend import SNAPSHOTS_DIR
from statebackend.state.codecs import BytesCodec, RecordCodec, StrCodec
from statebackend.state.kinds import StateDescriptor
from statebackend.state.memory import MemoryStateBackend, served_key_groups

SOURCE = "ckpt.reader.StateSource"
PLAN_FORMAT = 1  # ReadPlan.FORMAT in the jar
_DIRECT_KINDS = ("value", "reducing", "aggregating")
_BACKENDS = ("rocksdb", "memory")  # whose files the jar reads


def reason_not_jvm(store: CheckpointStore, task: ReadTask, desc: StateDescriptor
                   ) -> str | None:
    """Why the JVM reader cannot read ``task`` (a `ReadTask` of state ``desc``), or None
    when it can."""
    if store.storage.local_path("") is None:
        return f"storage {store.root_storage.url} is not a local folder (file://)"
    backends = sorted({h.backend for h in task.handles} - set(_BACKENDS))
    if backends:
        return f"the checkpoint has {backends[0]} subtasks (the JVM reader reads RocksDB " \
               "and memory-backend files)"
    if desc.kind not in _DIRECT_KINDS:
        return f"state {desc.name!r} is a {desc.kind} state (the JVM reader reads value, " \
               "reducing and aggregating states)"
    codec = desc.codec
    if isinstance(codec, RecordCodec):
        if not task.options.fields_as_columns:
            return "fields_as_columns=False (the JVM reader gives a record's fields as columns)"
    elif not isinstance(codec, StrCodec | BytesCodec):
        return f"state {desc.name!r} has a {type(codec).__name__} (the JVM reader decodes " \
               "record, str and bytes values)"
    if task.external is not None:
        return "the checkpoint is an external backend's"
    return None


def plan_json(store: CheckpointStore, task: ReadTask, desc: StateDescriptor) -> str:
    """The jar's ``plan`` option (``ReadPlan``) for ``task`` (`reason_not_jvm` is None)."""
    codec = desc.codec
    ttl, beat = lease_timing()
    local = store.storage.local_path
    return json.dumps({
        "format": PLAN_FORMAT, "job": store.job,
        "metadata_path": local(metadata_path(task.checkpoint_id)),
        "leases_dir": local(LEASES_DIR), "checkpoint_id": task.checkpoint_id,
        "record_digest": task.record_digest, "state": desc.name,
        "codec": ("record" if isinstance(codec, RecordCodec)
                  else "str" if isinstance(codec, StrCodec) else "bytes"),
        "fields": [list(f) for f in codec.fields] if isinstance(codec, RecordCodec) else [],
        "ttl": desc.ttl is not None, "now": task.now, "lease_ttl_seconds": ttl,
        "lease_heartbeat_seconds": beat, "pause_file": task.options.pause_file,
        "batch_rows": min(task.options.batch_rows, 4096),
        "backend": task.handles[0].backend if task.handles else "rocksdb",
        "subtasks": [_subtask_json(task, h, local) for h in task.handles]})


def _subtask_json(task: ReadTask, handle: SubtaskHandle, local: Callable[[str], str | None]
                  ) -> dict:
    """One subtask's files (where storage has them, and where this host's copies would
    be); a memory-backend file with the key groups the subtask reads from it."""
    instance = instance_dir(task.storage_url, task.job, handle.index, task.options.local_dir)
    memory = handle.backend == "memory"
    copies = os.path.join(instance, MemoryStateBackend.files_dir) if memory else \
        os.path.join(instance, SNAPSHOTS_DIR, handle.snapshot_id)
    return {"index": handle.index, "key_group_start": handle.key_group_start,
            "key_group_end": handle.key_group_end, "local_snapshot": copies,
            "files": [{"path": local(f.path), "local_name": f.local_name, "size": f.size,
                       "checksum": f.checksum,
                       "key_groups": list(served_key_groups(f.local_name, f.key_group_ids))
                       if memory else []} for f in handle.files]}


def jvm_dataframe(spark, store: CheckpointStore, task: ReadTask, desc: StateDescriptor, schema, *,
                  required: bool):
    """The JVM reader's DataFrame of ``task`` (Spark ``schema``); None when this session
    cannot load the jar and ``required`` is False (UsageError when it is)."""
    reader = spark.read.format(SOURCE).schema(schema).option("plan",
                                                             plan_json(store, task, desc))
    try:
        df = reader.load()
        if is_connect(spark):
            df.columns  # noqa: B018 - Connect resolves the source only when asked
    except Exception as exc:  # noqa: BLE001 - Py4J / Connect errors: the source is missing
        # Spark's own error class for a source it cannot load, classic and Connect alike;
        # any other error of the source is the read's and is raised as it is
        if "DATA_SOURCE_NOT_FOUND" not in str(exc):
            raise
        if not required:
            return None
        raise UsageError(
            f"read_state reader='jvm': this Spark session cannot load {SOURCE}; start it "
            f"with spark.jars={jar_path() or '(build it: make jar)'}") from exc
    return df
