"""Bulk load: sorted entries written to an SST file, then ingested into an instance.

`write_sst` writes pairs already in RocksDB's key order (bytewise) with RocksDB's
``SstFileWriter``; `export_sst` streams a key-group range of an instance into one;
`ingest` moves SST files into a backend's column families (no put per key, no
memtable, no WAL). Rescale (the key groups a new subtask imports) and bootstrap (a
savepoint from tables) both load state this way.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping, Sequence

from rocksdict import IngestExternalFileOptions, Options, SstFileWriter

from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange


def write_sst(path: str, keys: Sequence[bytes], values: Sequence[bytes],
              options: Options | None = None) -> int:
    """Write ``keys`` (sorted, unique) with their ``values`` to a new SST file at ``path``;
    the number of entries. ``options``: the instance's (compression), default raw mode."""
    writer = SstFileWriter(options=options or Options(raw_mode=True))
    writer.open(path)
    # one C-level loop over the pairs (SstFileWriter takes one entry per call)
    deque(map(writer.__setitem__, keys, values), maxlen=0)
    writer.finish()
    return len(keys)


def export_sst(path: str, source: KeyedStateBackend, cf_name: str,
               key_groups: KeyGroupRange, options: Options | None = None) -> int:
    """Write the entries of family ``cf_name`` within ``key_groups`` of ``source`` to a new
    SST at ``path``, streamed from the instance into the writer (half the CPU of lists
    in between); the number of entries, 0 with no file when the range is empty. Checked
    like `KeyedStateBackend.read_raw`: a damaged block raises `CorruptStateError`."""
    writer = SstFileWriter(options=options or Options(raw_mode=True))
    writer.open(path)
    n = source.copy_raw(cf_name, key_groups, writer.__setitem__)
    if n:
        writer.finish()
        return n
    del writer  # empty, or to be written again from the checked route
    if os.path.exists(path):
        os.remove(path)
    if n is None:
        keys, values = source.read_raw(cf_name, key_groups)  # raises on a damaged block
        return write_sst(path, keys, values, options) if keys else 0
    return 0


def ingest(backend: KeyedStateBackend, ssts: Mapping[str, Sequence[str]]) -> None:
    """Move the SST files of each column family into ``backend`` (one ingestion per
    family: its files' key ranges must not overlap); the next snapshot holds them."""
    for family, paths in ssts.items():
        opts = IngestExternalFileOptions()
        opts.set_move_files(True)
        backend.column_family(family).ingest_external_file(list(paths), opts)
    if ssts:
        backend.mark_dirty()
