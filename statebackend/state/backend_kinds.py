"""The state backends a job can run on, by the name a handle and a run record.

- ``rocksdb`` (`statebackend.state.backend.KeyedStateBackend`): embedded RocksDB, out of
  core, incremental checkpoints of SST files;
- ``memory`` (`statebackend.state.memory.MemoryStateBackend`): hash tables per key group,
  copy-on-write snapshots per key group, bounded by a memory limit;
- ``external`` (`statebackend.state.external.ExternalStateBackend`): the memory backend's
  tables, restored from a PostgreSQL database and pre-committed to it per epoch (MVCC) or
  to a WAL file the driver applies after the commit (WAL mode).

All keep the same keys and the same state API, so a job's code runs on either and a
lineage can move from one to the other (`convert`: a restore copies every entry).
"""

from __future__ import annotations

from collections.abc import Sequence

from statebackend.defaults import BACKENDS
from statebackend.errors import UsageError
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.external import ExternalStateBackend
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.kinds import StateDescriptor
from statebackend.state.memory import MemoryStateBackend

BACKEND_CLASSES: dict[str, type[KeyedStateBackend]] = {
    "rocksdb": KeyedStateBackend, "memory": MemoryStateBackend,
    "external": ExternalStateBackend}
assert tuple(BACKEND_CLASSES) == BACKENDS


def check_backend(kind: str) -> str:
    if kind not in BACKEND_CLASSES:
        raise UsageError(f"state backend {kind!r} is not one of {list(BACKEND_CLASSES)}")
    return kind


def new_backend(kind: str, local_dir: str, descriptors: Sequence[StateDescriptor],
                max_parallelism: int, key_group_range: KeyGroupRange) -> KeyedStateBackend:
    """An empty instance of backend ``kind`` in ``local_dir``."""
    return BACKEND_CLASSES[check_backend(kind)](local_dir, descriptors, max_parallelism,
                                                key_group_range)


def convert(source: KeyedStateBackend, target: KeyedStateBackend, batch: int = 50_000) -> int:
    """Copy every entry of every column family of ``source`` into ``target`` (another
    backend kind over the same key groups); returns the entries copied."""
    copied = 0
    for name in source.column_families:
        target.ensure_family(name)
        handle = target.column_family_handle(name)
        wb = target.write_batch()
        for key, value in source.iter_raw(name):
            wb.put(key, value, handle)
            copied += 1
            if copied % batch == 0:
                target.write(wb)
                wb = target.write_batch()
        target.write(wb)
    return copied
