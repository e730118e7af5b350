"""`memory_state_batches`: a memory-backend subtask's state read straight from its files
equals the same state read through a restore, from intact local copies or storage; a
damaged stored file is refused naming it, a damaged local copy is passed over."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from statebackend.checkpoint.memory_read import memory_state_batches
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import StorageError
from statebackend.state.state_table import StateRead, TableShape, state_batches
from statebackend.storage import open_storage
from tests.statebackend.helpers import DESCRIPTORS, close_all, fill, keys, open_backends

STATES = [d for d in DESCRIPTORS if d.name != "_timers"]


@pytest.fixture
def memory_checkpoint(tmp_path):
    store = CheckpointStore(open_storage(f"file://{tmp_path}/store"), "orders")
    backends = open_backends(str(tmp_path / "work"), 2, kind="memory")
    fill(backends, keys(3000) + ["ключ", "🙂", ""])
    meta = checkpoint_backends(store, backends, parent=None)
    return store, meta, backends


def _table(batches) -> list[dict]:
    return sorted(pa.Table.from_batches(list(batches)).to_pylist(), key=repr) \
        if batches else []


@pytest.mark.parametrize("batch_rows", [100, 1_000_000])
def test_reads_equal_a_restores_read_from_storage_and_local_copies(memory_checkpoint,
                                                                   batch_rows):
    store, meta, backends = memory_checkpoint
    try:
        for handle, backend in zip(meta.subtasks, backends, strict=True):
            local = backend.files_path  # the run's own local copies
            for desc in STATES:
                read = StateRead(desc, handle.index, shape=TableShape(batch_rows=batch_rows))
                want = _table(list(state_batches(backend, read)))
                assert want, desc.name
                from_storage = list(memory_state_batches(store.storage, handle, read))
                assert _table(from_storage) == want
                assert _table(list(memory_state_batches(store.storage, handle, read,
                                                        local))) == want
                if batch_rows == 100:  # whole key groups of about 100 entries per batch
                    assert len(from_storage) > 1
    finally:
        close_all(backends)


def test_a_damaged_local_copy_is_passed_over_and_a_damaged_stored_file_refused(
        memory_checkpoint, tmp_path):
    store, meta, backends = memory_checkpoint
    handle, backend = meta.subtasks[0], backends[0]
    read = StateRead(STATES[0], 0)
    want = _table(list(state_batches(backend, read)))
    close_all(backends)
    local = str(tmp_path / "copies")
    os.makedirs(local)
    ref = sorted(handle.files, key=lambda f: f.local_name)[0]
    with open(os.path.join(local, ref.local_name), "wb") as fh:
        fh.write(b"not the file")
    assert _table(list(memory_state_batches(store.storage, handle, read, local))) == want
    stored = os.path.join(str(tmp_path / "store" / "orders"), ref.path)
    data = bytearray(open(stored, "rb").read())
    data[-1] ^= 0xFF
    with open(stored, "wb") as fh:
        fh.write(bytes(data))
    with pytest.raises(StorageError, match=f"{ref.path}: read .* metadata records"):
        list(memory_state_batches(store.storage, handle, read, local))
