"""One state of a memory-backend subtask as Arrow batches, straight from its files.

A memory-backend subtask is a set of files (`statebackend.state.memory`), each holding
the sorted entries of every state of some key groups as Arrow binary arrays, and each
reference names the key groups the subtask reads from it. Reading one state as data
(`read_state`) needs no backend: each file's bytes come from the executor's local copy
when it has the recorded size and checksum, else from storage, checked the same way (a
damaged or replaced file is refused, naming it); they decode to arrays (no Python
object per entry) that `statebackend.state.state_table.decode_entries` turns into
batches: key groups in order, about ``batch_rows`` entries per batch (whole key
groups), expired entries left out. The checks on each file are a restore's
(`statebackend.state.memory.key_group_sections`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow as pa

from statebackend.checkpoint.metadata import FileRef, SubtaskHandle
from statebackend.checkpoint.restore import require_recorded
from statebackend.errors import SerializationError
from statebackend.state.memory import key_group_sections, served_key_groups
from statebackend.state.state_table import StateRead, decode_entries
from statebackend.storage import Storage
from statebackend.storage.checksums import checksum_algorithm, checksum_of_bytes


def memory_state_batches(storage: Storage, handle: SubtaskHandle, read: StateRead,
                         local_files: str | None = None) -> Iterator[pa.RecordBatch]:
    """The live entries of ``read``'s state in ``handle``'s key-group files (module doc);
    ``local_files``: the executor's folder of local copies, if any."""
    label = f"subtask {handle.index} (memory backend)"
    sections: list[tuple[int, pa.Array, pa.Array]] = []
    for ref in handle.files:
        data = _file_bytes(storage, ref, local_files)
        found, _ = key_group_sections(ref.local_name, data,
                                      served_key_groups(ref.local_name, ref.key_group_ids),
                                      ref.path, label)
        sections += [(kg, keys, values) for family, kg, keys, values in found
                     if family == read.desc.name]
    keys: list[pa.Array] = []
    values: list[pa.Array] = []
    held = 0
    for _, family_keys, family_values in sorted(sections, key=lambda s: s[0]):
        keys.append(family_keys)
        values.append(family_values)
        held += len(family_keys)
        if held >= read.shape.batch_rows:
            yield from _decoded(keys, values, read, label)
            keys, values, held = [], [], 0
    if held:
        yield from _decoded(keys, values, read, label)


def _decoded(keys: list[pa.Array], values: list[pa.Array], read: StateRead,
             label: str) -> Iterator[pa.RecordBatch]:
    try:
        batch = decode_entries(pa.concat_arrays(keys), pa.concat_arrays(values), read)
    except SerializationError as exc:
        raise SerializationError(f"state {read.desc.name!r} of {label}: {exc}") from exc
    if batch.num_rows:
        yield batch


def _file_bytes(storage: Storage, ref: FileRef, local_files: str | None) -> bytes:
    """``ref``'s bytes: the local copy if intact, else storage's (checked)."""
    algorithm = checksum_algorithm(ref.checksum)
    if local_files is not None:
        try:
            with open(os.path.join(local_files, ref.local_name), "rb") as fh:
                data = fh.read()
        except OSError:
            data = None
        if data is not None and (len(data), checksum_of_bytes(data, algorithm)) == (
                ref.size, ref.checksum):
            return data
    data = storage.read_bytes(ref.path)
    require_recorded(ref, len(data), checksum_of_bytes(data, algorithm), "read")
    return data
