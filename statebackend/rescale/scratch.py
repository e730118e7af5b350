"""Where a rescale task builds its throw-away RocksDB instances.

A new subtask's instance lives only until its files are uploaded, yet RocksDB syncs
every file it writes (on open: MANIFEST, OPTIONS, CURRENT and the folder; then each
flushed or compacted SST; then the native checkpoint). On a disk those syncs were
half of a small rescale task's wall time (bench/bench_rescale.py: 45 ms on tmpfs
against 90 ms on this machine's disk per 4 -> 8 subtask, the CPU time equal), while
the durable copy is the upload. So a task works on a memory filesystem (tmpfs,
where a sync costs nothing) when one is mounted and its files fit in a small share
of the free space there, else in the temp folder.

Order of choice: ``CKPT_LOCAL_DIR`` if set (the deployment decides); else
``TMPFS_DIR`` if it is a writable tmpfs folder, the bytes the task will write are
under ``TMPFS_MAX_BYTES`` and both the free space there and the memory available
(tmpfs pages are memory) are at least ``TMPFS_FREE_FACTOR`` x those bytes; else None
(`tempfile`'s default folder). The task removes its scratch folder when it ends.
"""

from __future__ import annotations

import os

TMPFS_DIR = "/dev/shm"
# A task writes about 3x what it downloads: the downloads, the clip's compaction
# output or the exported SSTs, and the snapshot's new SSTs (hard links cost nothing).
WRITE_FACTOR = 3
TMPFS_FREE_FACTOR = 8  # leave room for other tasks of this executor and other users
TMPFS_MAX_BYTES = 256 * 1024 * 1024  # larger states: a sync costs little beside the bytes


def _is_tmpfs(path: str) -> bool:
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            mounts = [line.split()[1:3] for line in fh if len(line.split()) > 2]
    except OSError:
        return False
    real = os.path.realpath(path)
    # the longest mount point that contains the folder decides its filesystem type
    best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best is not None and best[1] == "tmpfs"


def _memory_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def scratch_parent(bytes_downloaded: int) -> str | None:
    """The folder to create a task's scratch folder in (None: the temp folder)."""
    configured = os.environ.get("CKPT_LOCAL_DIR")
    if configured:
        return configured
    need = WRITE_FACTOR * max(0, bytes_downloaded)
    if need > TMPFS_MAX_BYTES or not os.access(TMPFS_DIR, os.W_OK | os.X_OK):
        return None
    try:
        st = os.statvfs(TMPFS_DIR)
    except OSError:
        return None
    room = st.f_bavail * st.f_frsize
    memory = _memory_available()
    if memory is not None:
        room = min(room, memory)
    if room < TMPFS_FREE_FACTOR * need or not _is_tmpfs(TMPFS_DIR):
        return None
    return TMPFS_DIR
