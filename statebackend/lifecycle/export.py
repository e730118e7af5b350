"""A savepoint of a WAL-mode external checkpoint: its state exported as files.

WAL mode keeps only a job's current state in the database
(statebackend.state.external_wal), so a savepoint cannot name a version there the way
an MVCC savepoint does. Instead `export_subtasks` reads each subtask's key groups from
the database (which must hold the checkpoint's epoch) and writes them as memory-backend
key-group files into the savepoint's folder (finishing the checkpoint's commit first if a
crash cut it short): a self-contained memory-backend savepoint.
A new job started from it (``--start-from``) restores those files, rescales them like any
memory checkpoint, and its first run on the external backend writes a full WAL that
replaces that job's rows.
"""

from __future__ import annotations

import os
import tempfile
import uuid

from statebackend.checkpoint.dump import descriptors_of
from statebackend.checkpoint.external_finish import finish_commit
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskHandle
from statebackend.checkpoint.restore import RestoreOptions, external_read, restored_readonly
from statebackend.checkpoint.snapshot import stored_ref
from statebackend.progress import ProgressSink
from statebackend.state.backend_kinds import convert
from statebackend.state.external_store import ExternalStore
from statebackend.state.memory import MemoryStateBackend, forget_live_instance
from statebackend.storage import Storage


def export_subtasks(storage: Storage, meta: CheckpointMetadata, folder: str,
                    state_db: ExternalStore | None, progress: ProgressSink
                    ) -> tuple[SubtaskHandle, ...]:
    """Each subtask of ``meta`` written to ``folder/<subtask>/`` as memory-backend files;
    returns their handles (the caller removes ``folder`` on failure)."""
    read = external_read(meta, state_db)  # refused in one line without the database
    assert read is not None
    # a crash may have cut its commit short: the record is the decision
    finish_commit(read.store, meta, storage, f"exporting checkpoint {meta.checkpoint_id}")
    descriptors = descriptors_of(meta)
    handles = []
    for sub in meta.subtasks:
        progress.phase(f"exporting subtask {sub.index} of checkpoint {meta.checkpoint_id}")
        label = f"subtask {sub.index} of checkpoint {meta.checkpoint_id}"
        with tempfile.TemporaryDirectory(prefix="ckpt-export-") as tmp, \
                restored_readonly(storage, sub, descriptors, meta.max_parallelism,
                                  options=RestoreOptions(label=label, external=read)) as source:
            target = MemoryStateBackend(tmp, descriptors, meta.max_parallelism,
                                        sub.key_group_range)
            try:
                convert(source, target)
                snapshot = target.take_local_snapshot()
            finally:
                target.close()
                forget_live_instance(tmp)  # nothing reads this instance again
            refs = []
            for name, _ in snapshot.files:
                dst = f"{folder}/{sub.index}/{name}"
                size, checksum = storage.put_file(os.path.join(snapshot.path, name), dst)
                refs.append(stored_ref(snapshot, name, dst, size, checksum))
        handles.append(SubtaskHandle(
            index=sub.index, key_group_start=sub.key_group_start,
            key_group_end=sub.key_group_end, backend_id=uuid.uuid4().hex,
            snapshot_id=snapshot.snapshot_id, shared_files=tuple(refs), private_files=(),
            row_counts=dict(snapshot.row_counts), bytes_uploaded=sum(r.size for r in refs),
            backend="memory"))
    return tuple(handles)
