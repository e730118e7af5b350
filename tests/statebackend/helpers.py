"""Small builders for state-backend tests: declared states, filled backends, dumps.

Other test modules may import these (``from tests.statebackend.helpers import ...``);
keep the signatures stable and the module small.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from statebackend.checkpoint.dump import backend_rows
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.restore import RestoreOptions, restore_subtask
from statebackend.checkpoint.store import CheckpointStore
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.backend_kinds import new_backend
from statebackend.state.codecs import RecordCodec
from statebackend.state.keygroups import key_group_for_bytes, key_group_range_for_subtask
from statebackend.state.kinds import StateDescriptor


class Average:
    """Aggregate function: accumulator [sum, count] (JSON), result sum / count."""

    def create_accumulator(self):
        return [0, 0]

    def add(self, value, acc):
        return [acc[0] + value, acc[1] + 1]

    def merge(self, a, b):
        return [a[0] + b[0], a[1] + b[1]]

    def get_result(self, acc):
        return acc[0] / acc[1] if acc[1] else None


TOTALS = RecordCodec((("count", "int64"), ("sum", "float64"), ("flag", "bool")))

DESCRIPTORS: tuple[StateDescriptor, ...] = (
    StateDescriptor("totals", "value", TOTALS),
    StateDescriptor("events", "list"),
    StateDescriptor("attrs", "map"),
    StateDescriptor("maxima", "reducing", reduce_fn=max),
    StateDescriptor("avg", "aggregating", aggregate_fn=Average()),
)


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def route(keys_: Sequence[str], max_parallelism: int, parallelism: int) -> list[list[int]]:
    """Indexes of ``keys_`` per subtask (Flink's assignment)."""
    per: list[list[int]] = [[] for _ in range(parallelism)]
    for i, k in enumerate(keys_):
        kg = key_group_for_bytes(k.encode(), max_parallelism)
        per[kg * parallelism // max_parallelism].append(i)
    return per


def open_backends(base_dir: str, parallelism: int, max_parallelism: int = 128,
                  descriptors: Sequence[StateDescriptor] = DESCRIPTORS, kind: str = "rocksdb"
                  ) -> list[KeyedStateBackend]:
    """New instances of backend ``kind`` (statebackend.state.backend_kinds), one per subtask."""
    return [new_backend(kind, os.path.join(base_dir, f"sub-{i}"), descriptors, max_parallelism,
                        key_group_range_for_subtask(max_parallelism, parallelism, i))
            for i in range(parallelism)]


def fill(backends: Sequence[KeyedStateBackend], keys_: Sequence[str], version: int = 0) -> None:
    """Write ``keys_`` into every state kind; ``version`` changes every value.

    Value state gets every key (columnar record batch); list, map, reducing and
    aggregating state each get one quarter of the keys.
    """
    p = len(backends)
    m = backends[0].max_parallelism
    for sub, idx in zip(backends, route(keys_, m, p), strict=True):
        if not idx:
            continue
        ks = [keys_[i] for i in idx]
        arr = np.asarray(idx, dtype=np.int64)
        sub.value_state("totals").put_columns(ks, {
            "count": arr + version, "sum": arr * 0.5 + version, "flag": (arr + version) % 2 == 0})
        quarter = [[k for j, k in zip(idx, ks, strict=True) if j % 4 == q] for q in range(4)]
        sub.list_state("events").add_many(quarter[0], [{"v": version, "k": k} for k in quarter[0]])
        sub.map_state("attrs").put_many(
            [(k, uk, {"k": k, "v": version}) for k in quarter[1] for uk in ("a", "b")])
        sub.reducing_state("maxima").add_many(quarter[2], [len(k) + version for k in quarter[2]])
        sub.aggregating_state("avg").add_many(quarter[3], [version] * len(quarter[3]))


def dump_backends(backends: Sequence[KeyedStateBackend]) -> list[dict]:
    """Every entry of every backend as dump rows (deterministic order)."""
    rows: list[dict] = []
    for i, b in enumerate(backends):
        rows.extend(backend_rows(b, i))
    return rows


def restore_all(store: CheckpointStore, meta: CheckpointMetadata, base_dir: str,
                descriptors: Sequence[StateDescriptor] = DESCRIPTORS,
                allow_local: bool = True) -> list[KeyedStateBackend]:
    """Restore every subtask of ``meta`` into ``base_dir/sub-<i>`` (no rescale)."""
    return [restore_subtask(store.storage, h, os.path.join(base_dir, f"sub-{h.index}"),
                            descriptors, meta.max_parallelism,
                            RestoreOptions(allow_local=allow_local))
            for h in meta.subtasks]


def close_all(backends: Sequence[KeyedStateBackend]) -> None:
    for b in backends:
        b.close()


def two_checkpoint_job(base: str, job: str) -> dict:
    """A job with two committed checkpoints (P=2, 2,000 keys: a dump larger than a pipe
    buffer; the second rewrites 100) under ``file://<base>/store``, and the latest rows."""
    from statebackend.checkpoint.snapshot import checkpoint_backends
    from statebackend.storage import open_storage

    url = f"file://{base}/store"
    store = CheckpointStore(open_storage(url), job)
    backends = open_backends(os.path.join(base, "work"), 2)
    all_keys = keys(2_000)
    fill(backends, all_keys)
    checkpoint_backends(store, backends, parent=None, run_id="run-1")
    fill(backends, all_keys[:100], version=1)
    checkpoint_backends(store, backends, parent=1, run_id="run-2")
    rows = dump_backends(backends)
    close_all(backends)
    return {"url": url, "store": store, "rows": rows, "tmp": base}


def recommit_record(store: CheckpointStore, checkpoint_id: int, data: bytes) -> None:
    """Replace checkpoint ``checkpoint_id``'s `_metadata` with ``data`` *as if it had been
    committed so* (its commit-log entry rewritten to match): tests of damage that happened
    before the commit. A record replaced after its commit is refused by the lineage check
    (statebackend/checkpoint/lineage.py), which other tests exercise."""
    import json

    from statebackend.checkpoint import lineage
    from statebackend.checkpoint.layout import metadata_path

    names = lineage.read_log(store.storage)
    store.storage.delete_many(list(names.entries.get(checkpoint_id, ())))
    store.storage.write_bytes(metadata_path(checkpoint_id), data)
    obj = json.loads(data)  # leniently: the record may be one the strict parser refuses
    lineage.write_entry(store.storage, lineage.ChainEntry(
        checkpoint_id, obj.get("parent"), obj.get("kind", "checkpoint"), obj.get("epoch", 0),
        lineage.digest_of(data), str(obj.get("created_at", ""))))
