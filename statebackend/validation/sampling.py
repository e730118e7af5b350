"""What RocksDB tells about a column family without reading its entries, and bounded samples.

Deep validation at the ``deep`` level (`statebackend.validation.validate`) checks every
entry only through facts RocksDB keeps itself, and runs the per-entry checks (key group
== the lineage's key hash of the key mod M, values decode, TTL agreement, job checks) on
a bounded sample:

- RocksDB's facts on each column family (`statebackend.state.facts`: properties, SST
  ranges, edge keys; an exact count when provable, else the snapshot's recorded count
  when it fits them), else the caller counts with a checked keys-only scan.
- `sample_entries`: up to ``budget`` entries read in chunks of `CHUNK` from random seek
  points (a random key group of the subtask's range, then a random key between the
  group's first and last keys): every column family holding at most
  ``max(budget, WHOLE_UP_TO)`` entries is read whole, so small states are checked
  entry by entry exactly as at the ``full`` level. Reads are checked
  (`KeyedStateBackend.iter_raw`): a damaged block met by the sample raises
  `CorruptStateError`.

- `due_index_entries`: every entry of the ``_ttl`` index already due at the checkpoint's
  clocks (one seek per key group and time domain, as `purge_expired` does: normally
  none are left after a purge); the ``deep`` level adds them to the index's sample,
  so an index entry that says "expired" while a read still returns the entry is
  found wherever it is.

What the sample cannot see: an entry outside it whose value does not decode, whose
stored key group differs from its hash (both still inside the subtask's range), or
a damaged data block no sampled read touches when the file's recorded checksum was
taken over the damaged bytes (damage before upload). The ``full`` level reads every
entry and every block.
"""

from __future__ import annotations

import random

from rocksdict import Rdict

from statebackend.errors import CkptError
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.codecs import time_upper_bound
from statebackend.state.families import TTL_INDEX
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.memory_table import MemoryTable

CHUNK = 32  # entries read per seek point
DEFAULT_SAMPLE = 1024  # entries per column family per subtask at the ``deep`` level
# A column family of at most this many entries is read whole at the ``deep`` level: a
# few milliseconds, and every entry and block of a small state is then checked.
WHOLE_UP_TO = 4096


def _seek_target(cf: Rdict | MemoryTable, key_group: int, rng: random.Random) -> bytes | None:
    """A random key between the first and the last key of ``key_group`` (as numbers of
    equal width), so seeks spread over the group's keys however their bytes are
    distributed; None when the group holds no key."""
    prefix = key_group.to_bytes(2, "big")
    if isinstance(cf, MemoryTable):
        edges = cf.edge_keys(prefix)
        if edges is None:
            return None
        return _between(*edges, rng)
    it = cf.iter()
    it.seek(prefix)
    if not it.valid():
        it.status()  # an invalid iterator is the end of the data or damage: raise on damage
        return None
    if it.key()[:2] != prefix:
        return None
    lo = it.key()
    it.seek_for_prev(prefix + b"\xff" * 16)
    while it.valid() and it.key()[:2] != prefix:
        it.prev()  # a key of the group that sorts after 16 0xff bytes: rare
    if not it.valid():
        it.status()
    return _between(lo, it.key() if it.valid() else lo, rng)


def _between(lo: bytes, hi: bytes, rng: random.Random) -> bytes:
    width = max(len(lo), len(hi))
    a = int.from_bytes(lo.ljust(width, b"\x00"), "big")
    b = int.from_bytes(hi.ljust(width, b"\x00"), "big")
    return rng.randint(min(a, b), max(a, b)).to_bytes(width, "big")


def read_entries(backend: KeyedStateBackend, name: str) -> tuple[list[bytes], list[bytes]]:
    """(keys, values) of every entry of column family ``name`` (a checked scan)."""
    keys, values = backend.read_raw(name)
    if values is None:  # read_raw leaves the values out only when asked to (values=False)
        raise CkptError(f"column family {name!r}: the scan returned no values")
    return keys, values


def sample_entries(backend: KeyedStateBackend, name: str, budget: int, rng: random.Random,
                   stored_entries: int | None) -> tuple[list[bytes], list[bytes], bool]:
    """(keys, values, whole): at most ``budget`` entries of column family ``name`` in key
    order, from random seek points inside the backend's key groups; ``whole`` when
    every entry was read: ``stored_entries`` (RocksDB's count, old versions included)
    is at most ``max(budget, WHOLE_UP_TO)`` or unknown."""
    if stored_entries is None or stored_entries <= max(budget, WHOLE_UP_TO):
        keys, values = read_entries(backend, name)
        return keys, values, True
    cf, r = backend.column_family(name), backend.key_group_range
    found: dict[bytes, bytes] = {}
    for _ in range(max(1, budget // CHUNK) * 2):  # seek points may land on read chunks
        if len(found) >= budget:
            break
        lower = _seek_target(cf, rng.randint(r.start, r.end), rng)
        if lower is None:
            continue
        for n, (k, v) in enumerate(backend.iter_raw(name, lower=lower)):
            if n == CHUNK:
                break
            found[k] = v
    keys = sorted(found)[:budget]
    return keys, [found[k] for k in keys], False


def due_index_entries(backend: KeyedStateBackend, clocks: dict[bytes, int]
                      ) -> dict[bytes, bytes]:
    """{index key: value} of the ``_ttl`` entries with expiry <= the clock of their
    domain (``clocks``: domain byte -> time), every key group of the backend."""
    found: dict[bytes, bytes] = {}
    r = backend.key_group_range
    for kg in range(r.start, r.end + 1):
        for domain, now in clocks.items():
            lower = key_group_prefix(kg) + domain
            found.update(backend.iter_raw(TTL_INDEX, lower=lower,
                                          upper=lower + time_upper_bound(now)))
    return found
