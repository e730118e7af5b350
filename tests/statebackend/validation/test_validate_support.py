"""Builders and fault injectors shared by the validation tests (no tests here).

A small checkpoint: P subtasks, a few hundred keys over every state kind
(tests.statebackend.helpers.DESCRIPTORS) plus the keyed-aggregation job's
``agg_totals``-shaped state under the name ``totals`` when ``job_totals``.
"""

from __future__ import annotations

import json
import os
import shutil

from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore, metadata_path
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.codecs import RecordCodec
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.kinds import StateDescriptor
from statebackend.storage import open_storage
from tests.statebackend.helpers import DESCRIPTORS, close_all, fill, keys, open_backends, route

JOB = "orders"
M = 128
AGG_TOTALS = RecordCodec((("count", "int64"), ("sum", "float64"), ("min_ts", "int64"),
                          ("max_ts", "int64")))
AGG_DESCRIPTORS = (StateDescriptor("totals", "value", AGG_TOTALS),
                   StateDescriptor("events", "list"))


def build_checkpoint(url: str, work_dir: str, *, parallelism: int = 3, n_keys: int = 300,
                     job: str = JOB, max_parallelism: int = M, job_totals: bool = False,
                     tamper=None) -> tuple[CheckpointStore, CheckpointMetadata]:
    """Two checkpoints (the second incremental, parent 1) of a fresh lineage; returns the 2nd.

    ``tamper(backends)`` runs before the second snapshot (raw writes for deep faults).
    """
    store = CheckpointStore(open_storage(url), job)
    descriptors = AGG_DESCRIPTORS if job_totals else DESCRIPTORS
    backends = open_backends(work_dir, parallelism, max_parallelism, descriptors)
    try:
        ks = keys(n_keys)
        if job_totals:
            fill_totals(backends, ks)
        else:
            fill(backends, ks)
        first = checkpoint_backends(store, backends, parent=None)
        if job_totals:
            fill_totals(backends, keys(n_keys // 3, "x"))
        else:
            fill(backends, keys(n_keys // 3, "x"), version=1)
        if tamper:
            tamper(backends)
        meta = checkpoint_backends(store, backends, parent=first.checkpoint_id)
    finally:
        close_all(backends)
    return store, meta


def fill_totals(backends: list[KeyedStateBackend], ks: list[str]) -> None:
    p, m = len(backends), backends[0].max_parallelism
    for b, idx in zip(backends, route(ks, m, p), strict=True):
        sub = [ks[i] for i in idx]
        b.value_state("totals").put_columns(sub, {
            "count": [1 + i % 5 for i in idx], "sum": [i * 0.5 for i in idx],
            "min_ts": [1000 + i for i in idx], "max_ts": [2000 + i for i in idx]})
        b.list_state("events").add_many(sub[:5], [{"n": 1}] * len(sub[:5]))


def put_raw(backend: KeyedStateBackend, state: str, key_group: int, key: str,
            value: bytes) -> None:
    """Write one raw RocksDB entry, bypassing the key-group routing checks."""
    backend.column_family(state).put(key_group_prefix(key_group) + key.encode(), value)
    backend.mark_dirty()


def job_dir(store: CheckpointStore) -> str:
    assert store.storage.is_local
    return store.storage.root


def edit_metadata(store: CheckpointStore, checkpoint_id: int, change) -> None:
    """Rewrite ``_metadata`` as raw JSON after ``change(obj)`` (file:// only)."""
    path = os.path.join(job_dir(store), metadata_path(checkpoint_id))
    with open(path) as fh:
        obj = json.load(fh)
    change(obj)
    os.chmod(path, 0o644)
    with open(path, "w") as fh:
        json.dump(obj, fh)


def first_shared(meta: CheckpointMetadata, subtask: int = 0) -> str:
    return next(f.path for f in meta.subtasks[subtask].shared_files)


def copy_job(src_root: str, dst_root: str) -> None:
    shutil.copytree(src_root, dst_root)


def tree_fingerprint(root: str, skip: str = "reports") -> dict[str, tuple[int, float, bytes]]:
    """Every file under ``root`` except ``skip/``: (size, mtime, bytes)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir.split(os.sep)[0] == skip:
            continue
        for n in names:
            p = os.path.join(dirpath, n)
            st = os.stat(p)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime, fh.read())
    return out
