"""Where an executor keeps its local-recovery copies, and read-only restores that use them.

One folder per (storage root, job, subtask) on each executor::

    <root>/<job>-<sha1 of the storage URL, 10 hex>/<subtask>/
        db/                      the working instance a job run restores and writes
        snapshots/<snapshot id>/ its newest local snapshots (hard links of SSTs)
        instance.json            "clean at snapshot X" after a run closed it

``<root>``: the run's ``local_dir``, else ``CKPT_LOCAL_DIR``, else
``<tmp>/ckpt-local`` (`instance_dir`, the one rule job runs and readers share).

A reader (`restored_copy`) never opens or changes that instance: a job run on the same
executor may be using it. When the executor's ``snapshots/<snapshot id>`` holds every
file of the handle with its recorded size, the reader hard-links them into a folder of
its own (SSTs are immutable, and a link outlives a run pruning that snapshot); else it
downloads them (`statebackend.checkpoint.restore`: checked sizes and checksums). It
opens that copy read-only and removes the folder when done. `seed_local_snapshot`
places such links (or copies) for a writer of its own, such as a rescale's base.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from statebackend.checkpoint.metadata import SubtaskHandle
from statebackend.checkpoint.restore import RestoreOptions, restore_subtask
from statebackend.settings import local_root
from statebackend.state.backend import SNAPSHOTS_DIR, KeyedStateBackend
from statebackend.state.kinds import StateDescriptor
from statebackend.storage import Storage


def instance_dir(storage_url: str, job_dir: str, subtask: int,
                 local_dir: str | None = None) -> str:
    """The folder of ``subtask``'s local-recovery instance on this machine (module doc)."""
    root = local_root(local_dir)
    tag = hashlib.sha1(storage_url.encode()).hexdigest()[:10]
    return os.path.join(root, f"{job_dir}-{tag}", str(subtask))


@contextmanager
def restored_copy(job_storage: Storage, handle: SubtaskHandle,
                  descriptors: Sequence[StateDescriptor], max_parallelism: int,
                  instance: str | None = None, read: RestoreOptions | None = None
                  ) -> Iterator[KeyedStateBackend]:
    """``handle`` opened read-only in a folder of its own, from the local snapshot in
    ``instance`` (`instance_dir`) when it holds the handle's files, else from storage;
    ``backend.restore_mode`` says which (``local-snapshot`` or ``download``). ``read``
    gives the label and an external backend's database (`RestoreOptions`)."""
    parent = os.path.dirname(instance) if instance else None
    scratch = tempfile.mkdtemp(prefix=f".read-{handle.index}-",
                               dir=parent if parent and os.path.isdir(parent) else None)
    backend = None
    try:
        seeded = instance is not None and seed_local_snapshot(instance, handle, scratch)
        backend = restore_subtask(job_storage, handle, scratch, descriptors, max_parallelism,
                                  replace(read or RestoreOptions(), read_only=True,
                                          allow_local=seeded))
        yield backend
    finally:
        if backend is not None:
            backend.close()
        shutil.rmtree(scratch, ignore_errors=True)


def seed_local_snapshot(instance: str, handle: SubtaskHandle, folder: str,
                        copy: bool = False) -> bool:
    """Hard-link the executor's snapshot of ``handle`` into ``folder``'s snapshots folder,
    where `restore_subtask` finds it; with ``copy``, copy what
    cannot be linked (another filesystem: cheaper than a download from a remote store).
    False (nothing left behind) unless every file is there with its recorded size."""
    source = os.path.join(instance, SNAPSHOTS_DIR, handle.snapshot_id)
    target = os.path.join(folder, SNAPSHOTS_DIR, handle.snapshot_id)
    try:
        if not all(os.path.getsize(os.path.join(source, f.local_name)) == f.size
                   for f in handle.files):
            return False
        os.makedirs(target)
        for f in handle.files:
            src, dst = os.path.join(source, f.local_name), os.path.join(target, f.local_name)
            try:
                os.link(src, dst)
            except OSError:
                if not copy:
                    raise
                shutil.copyfile(src, dst)
    except OSError:  # pruned meanwhile, or another filesystem: download instead
        shutil.rmtree(target, ignore_errors=True)
        return False
    return True
