"""Where an executor keeps its local-recovery copies (read-only restores use them too).

One folder per (storage root, job, subtask) on each executor::

    <root>/<job>-<sha1 of the storage URL, 10 hex>/<subtask>/
        db/                      the working instance a job run restores and writes
        snapshots/<snapshot id>/ its newest local snapshots (hard links of SSTs)
        instance.json            "clean at snapshot X" after a run closed it

``<root>``: the run's ``local_dir``, else ``CKPT_LOCAL_DIR``, else
``<tmp>/ckpt-local`` (`instance_dir`, the one rule job runs and readers share).

A reader (`restore.restored_readonly` with ``RestoreOptions(local_instance=...)``)
never opens or changes that instance: a job run on the same
executor may be using it. When the executor's ``snapshots/<snapshot id>`` holds every
file of the handle with its recorded size, the reader hard-links them into a folder of
its own (SSTs are immutable, and a link outlives a run pruning that snapshot); else it
downloads them (`statebackend.checkpoint.restore`: checked sizes and checksums). It
opens that copy read-only and removes the folder when done. A writer of its own (a
rescale's base) is seeded the same way: `restore.restore_subtask` with
``RestoreOptions(local_instance=...)``, copying across filesystems when the store is
remote.
"""

from __future__ import annotations

import hashlib
import os

from statebackend.settings import local_root


def instance_dir(storage_url: str, job_dir: str, subtask: int,
                 local_dir: str | None = None) -> str:
    """The folder of ``subtask``'s local-recovery instance on this machine (module doc)."""
    root = local_root(local_dir)
    tag = hashlib.sha1(storage_url.encode()).hexdigest()[:10]
    return os.path.join(root, f"{job_dir}-{tag}", str(subtask))
