"""Read one state of a checkpoint as a Spark DataFrame: one Spark task per subtask.

``read_state(spark, storage, job, checkpoint="latest", state=NAME)``:

1. the driver resolves the checkpoint and the state, with one-line errors (unknown
   job, checkpoint or state; storage the executors cannot reach), and notes the
   digest of the checkpoint's ``_metadata``;
2. the DataFrame is ``spark.range(P, numPartitions=P).mapInArrow(...)``: partition i
   is subtask i's task, on classic sessions and Spark Connect alike. It is lazy like
   any DataFrame: each action runs the tasks again (``cache()`` or
   ``localCheckpoint()`` one you query many times);
3. each task holds the checkpoint with a hold lease of its own (renewed while it runs,
   released when it ends), checks that ``_metadata`` is still the planned one (same
   digest), restores its subtask read-only
   (`statebackend.checkpoint.restore.restored_readonly`: from the executor's
   local-recovery snapshot when it holds the files, else downloaded into a temp folder
   removed after) and yields typed Arrow batches (`statebackend.state.state_table`:
   the columns, TTL and expiry rules). A memory-backend subtask is read straight from
   its key-group files instead (`statebackend.checkpoint.memory_read`: no restore, no
   Python object per entry), but for its timers.

Why the tasks hold the lease and not only the driver: the read happens when an action
runs, perhaps long after ``read_state`` returned (on Connect, in the server's
executors). While a task holds the checkpoint, retention keeps it, so GC keeps every
file it references; a checkpoint retired between ``read_state`` and the action fails
the read in one line (read it again), it is never read half.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator

import pyarrow as pa

from statebackend.checkpoint.leases import hold
from statebackend.checkpoint.lineage import digest_of
from statebackend.checkpoint.local_copy import instance_dir
from statebackend.checkpoint.memory_read import memory_state_batches
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.restore import (
    RestoreOptions,
    current_external_read,
    restored_readonly,
)
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CheckpointNotFoundError, UsageError
from statebackend.spark import jvm_reader
from statebackend.spark.read_task import READERS, ReadOptions, ReadTask, state_descriptor
from statebackend.state.families import TIMERS
from statebackend.state.kinds import StateDescriptor
from statebackend.state.memory import MemoryStateBackend
from statebackend.state.state_table import (
    StateRead,
    readable,
    state_batches,
    state_schema,
)
from statebackend.storage import Storage, open_storage
from statebackend.subtasks import named_failure

PAUSE_TIMEOUT_S = 300.0


def read_state(spark, storage: str | Storage, job: str, checkpoint: str | int = "latest", *,
               state: str, options: ReadOptions = ReadOptions()):
    """Checkpoint ``checkpoint`` (``latest``, an id or ``chk-<id>``) of ``job`` under
    ``storage`` (a URL, or a `Storage` with its options): state ``state`` as a DataFrame
    of one task per subtask (module doc; columns: `statebackend.state.state_table`)."""
    store = open_job_store(storage, job)
    task = plan_read(store, checkpoint, state, options)
    # Spark only when a session is passed in: the planning above needs none
    from pyspark.sql.pandas.types import from_arrow_schema

    schema = from_arrow_schema(read_schema(task), prefer_timestamp_ntz=False)
    if options.reader != "python":
        desc = state_descriptor(task)
        why_not = jvm_reader.reason_not_jvm(store, task, desc)
        if why_not is None:
            df = jvm_reader.jvm_dataframe(spark, store, task, desc, schema,
                                          required=options.reader == "jvm")
            if df is not None:
                return df
        elif options.reader == "jvm":
            raise UsageError(f"read_state reader='jvm' cannot read this: {why_not}")
    n = len(task.handles)
    # range() puts exactly one id in each of its n partitions: one task per subtask.
    return spark.range(0, n, 1, n).mapInArrow(functools.partial(read_batches, task), schema)


def open_job_store(storage: str | Storage, job: str) -> CheckpointStore:
    """The job's checkpoints under ``storage``; UsageError for storage that Spark tasks
    cannot reach (memory:// lives in this process only)."""
    if isinstance(storage, str):
        storage = open_storage(storage)
    elif not isinstance(storage, Storage):
        raise UsageError(f"storage {storage!r} is neither a URL nor a Storage")
    if storage.process_local:
        raise UsageError(f"storage {storage.url} lives in this process only: Spark tasks "
                         "cannot read it; use file:// or s3:// storage")
    return CheckpointStore(storage, job)


def plan_read(store: CheckpointStore, checkpoint: str | int, state: str,
              options: ReadOptions = ReadOptions()) -> ReadTask:
    """The task of a read of ``state`` from ``checkpoint``: one-line errors for an unknown
    job, checkpoint or state, and for columns that cannot be built."""
    meta = store.resolve(checkpoint)
    data = store.read_record(meta.checkpoint_id)
    if data is None:
        raise _retired(store, meta.checkpoint_id)
    meta = store.parse(meta.checkpoint_id, data)
    descriptors = tuple(StateDescriptor.from_json(s) for s in meta.states)
    desc = _state(descriptors, state, meta)
    if options.reader not in READERS:
        raise UsageError(f"read_state reader={options.reader!r}: use one of {', '.join(READERS)}")
    # a record field named like a column, or an unknown column asked for: refused now
    _projected(state_schema(desc, options.shape), options.columns, state)
    external = current_external_read(meta, options.state_db)  # one line if it cannot
    return ReadTask(
        storage_url=store.root_storage.url, storage_options=store.root_storage.options,
        job=store.job, checkpoint_id=meta.checkpoint_id, record_digest=digest_of(data),
        max_parallelism=meta.max_parallelism, descriptors=descriptors, state=state,
        handles=tuple(meta.subtasks), now=_clock(desc, meta), options=options,
        external=external)


def _state(descriptors: tuple[StateDescriptor, ...], name: str,
           meta: CheckpointMetadata) -> StateDescriptor:
    own = sorted(d.name for d in readable(descriptors))
    found = next((d for d in readable(descriptors) if d.name == name), None)
    if found is None:
        raise UsageError(f"state {name!r} is not in checkpoint {meta.checkpoint_id} of job "
                         f"{meta.job!r}; its states: {', '.join(own) or '(none)'}")
    return found


def _clock(desc: StateDescriptor, meta: CheckpointMetadata) -> int | None:
    """The time TTL expiry is judged at: the checkpoint's clock of the TTL's domain."""
    if desc.ttl is None:
        return None
    return meta.watermark if desc.ttl.time == "event" else meta.processing_time


def read_schema(task: ReadTask) -> pa.Schema:
    return _projected(state_schema(state_descriptor(task), task.options.shape),
                      task.options.columns, task.state)


def _projected(schema: pa.Schema, columns: tuple[str, ...] | None, state: str) -> pa.Schema:
    """``schema`` cut to ``columns`` (`ReadOptions.columns`); UsageError naming a column
    the state does not have."""
    if columns is None:
        return schema
    if isinstance(columns, str) or not columns:
        raise UsageError(f"read_state columns={columns!r}: give a tuple of column names of "
                         f"state {state!r}: {', '.join(schema.names)}")
    for name in columns:
        if name not in schema.names:
            raise UsageError(f"read_state: {name!r} is not a column of state {state!r}; its "
                             f"columns: {', '.join(schema.names)}")
    if len(set(columns)) != len(columns):
        raise UsageError(f"read_state columns={columns!r} names a column twice")
    return pa.schema([schema.field(name) for name in columns])


def _retired(store: CheckpointStore, checkpoint_id: int) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"checkpoint {checkpoint_id} of job {store.job!r} was retired or replaced after "
        "read_state planned the read; read it again (`ckpt list` shows what is kept)")


# -- executors ----------------------------------------------------------------------------

def read_batches(task: ReadTask, ids: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """mapInArrow function: the batches of every subtask whose index arrives."""
    columns = None if task.options.columns is None else list(task.options.columns)
    for batch in ids:
        for subtask in batch.column(0).to_pylist():
            with named_failure("subtask", subtask):
                for out in read_subtask(task, subtask):
                    yield out if columns is None else out.select(columns)


def read_subtask(task: ReadTask, subtask: int) -> Iterator[pa.RecordBatch]:
    """One subtask's state, read while this task holds the checkpoint (module doc)."""
    store = CheckpointStore(open_storage(task.storage_url, **task.storage_options), task.job)
    handle = task.handles[subtask]
    cid = task.checkpoint_id
    with hold(store.storage, f"read_state {task.state!r} of checkpoint {cid}, subtask "
                             f"{subtask}", [cid]):
        _pause(task.options.pause_file, subtask)
        data = store.read_record(cid)
        if data is None or digest_of(data) != task.record_digest:
            raise _retired(store, cid)
        instance = instance_dir(task.storage_url, task.job, subtask, task.options.local_dir)
        read = StateRead(state_descriptor(task), subtask, task.now, task.options.shape)
        if handle.backend == "memory" and task.state != TIMERS:
            yield from memory_state_batches(
                store.storage, handle, read, os.path.join(instance, MemoryStateBackend.files_dir))
            return
        with restored_readonly(store.storage, handle, task.descriptors, task.max_parallelism,
                               options=RestoreOptions(
                                   label=f"subtask {subtask} of checkpoint {cid}",
                                   external=task.external, local_instance=instance)
                               ) as backend:
            yield from state_batches(backend, read, handle.row_counts.get(task.state))


def _pause(pause_file: str | None, subtask: int) -> None:
    """Test hook (`ReadOptions.pause_file`)."""
    if pause_file is None:
        return
    with open(f"{pause_file}.paused-{subtask}", "w"):
        pass
    deadline = time.monotonic() + PAUSE_TIMEOUT_S
    while not os.path.exists(pause_file):
        if time.monotonic() > deadline:
            raise UsageError(f"read paused for {PAUSE_TIMEOUT_S:g} s: {pause_file} never "
                             "appeared")
        time.sleep(0.05)
