"""What RocksDB tells about a column family without reading its entries, and bounded samples.

Deep validation at the ``deep`` level (`statebackend.validation.validate`) checks every
entry only through facts RocksDB keeps itself, and runs the per-entry checks (key group
== the lineage's key hash of the key mod M, values decode, TTL agreement, job checks) on
a bounded sample:

- `cf_facts`: per column family, from RocksDB properties (no entry read): the table
  properties summed over its SST files (entries, deletions, merge operands, range
  deletions), the entries still in memtables (a WAL replayed on open), each SST's
  smallest and largest key (``rocksdb.sstables``), and the first and last live keys
  (two seeks). Keys are sorted bytewise and start with the big-endian 2-byte key
  group, so ``key_group(first) >= start`` and ``key_group(last) <= end`` put *every*
  live key of the column family inside the subtask's range.
- `exact_count`: the number of live entries from those facts, when provable: no
  memtable entries, no deletions, merges or range deletions, and SST key ranges that
  do not overlap, so each key is stored in one file; a file holds one version per key
  because the backend takes no RocksDB snapshots (flush and compaction keep only the
  newest version then, and SstFileWriter writes each key once). Otherwise None.
- `recorded_count_fits`: then the count the snapshot recorded (`row_counts`: a checked
  scan of the same files when they were written) is used when it fits the facts (no
  more than the stored non-deletion entries; zero exactly when no key is live); else
  the caller counts with a checked keys-only scan.
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
import re
from dataclasses import dataclass

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

# one SST line of the ``rocksdb.sstables`` property: "  8:6500061[1 .. 249506]['0000..' seq:13,
# type:1 .. '001F..' seq:249488, type:1](0)"
_SST_LINE = re.compile(r"^\s*(\d+):(\d+)\[\d+ \.\. \d+\]\['([0-9A-F]*)' seq:\d+, type:\d+ \.\. "
                       r"'([0-9A-F]*)' seq:\d+, type:\d+\]", re.MULTILINE)
_ANY_SST_LINE = re.compile(r"^\s*\d+:\d+\[", re.MULTILINE)
_PROPERTY = re.compile(r"# (entries|deletions|merge operands|range deletions)=(\d+)")


@dataclass(frozen=True)
class SstRange:
    number: int
    smallest: bytes
    largest: bytes


@dataclass(frozen=True)
class ColumnFamilyFacts:
    """RocksDB's own facts about one column family (module doc); None: not reported."""

    entries: int | None
    deletions: int | None
    merge_operands: int | None
    range_deletions: int | None
    memtable_entries: int | None
    files: tuple[SstRange, ...] | None  # None when the listing could not be read
    first_key: bytes | None  # None: no live entry
    last_key: bytes | None


def _int_property(cf: Rdict, name: str) -> int | None:
    value = cf.property_value(name)
    return int(value) if value is not None and value.strip().isdigit() else None


def _sst_ranges(listing: str | None) -> tuple[SstRange, ...] | None:
    if listing is None:
        return None
    found = _SST_LINE.findall(listing)
    if len(found) != len(_ANY_SST_LINE.findall(listing)):
        return None  # a line in a format this parser does not know: claim nothing
    return tuple(SstRange(int(n), bytes.fromhex(lo), bytes.fromhex(hi))
                 for n, _, lo, hi in found)


def _edge_key(cf: Rdict, last: bool) -> bytes | None:
    it = cf.iter()
    if last:
        it.seek_to_last()
    else:
        it.seek_to_first()
    if it.valid():
        return it.key()
    it.status()  # an error, not the end of the data: raise (the caller names the subtask)
    return None


def cf_facts(cf: Rdict | MemoryTable) -> ColumnFamilyFacts:
    """The facts of ``cf`` (module doc): properties, SST ranges and the edge keys. A
    memory-backend table knows its exact count and holds one version per key."""
    if isinstance(cf, MemoryTable):
        edges = cf.edge_keys()
        return ColumnFamilyFacts(entries=len(cf), deletions=0, merge_operands=0,
                                 range_deletions=0, memtable_entries=0, files=(),
                                 first_key=edges[0] if edges else None,
                                 last_key=edges[1] if edges else None)
    props = dict((k, int(v)) for k, v in _PROPERTY.findall(
        cf.property_value("rocksdb.aggregated-table-properties") or ""))
    active = _int_property(cf, "rocksdb.num-entries-active-mem-table")
    immutable = _int_property(cf, "rocksdb.num-entries-imm-mem-tables")
    return ColumnFamilyFacts(
        entries=props.get("entries"), deletions=props.get("deletions"),
        merge_operands=props.get("merge operands"),
        range_deletions=props.get("range deletions"),
        memtable_entries=None if active is None or immutable is None else active + immutable,
        files=_sst_ranges(cf.property_value("rocksdb.sstables")),
        first_key=_edge_key(cf, last=False), last_key=_edge_key(cf, last=True))


def recorded_count_fits(facts: ColumnFamilyFacts, recorded: int | None) -> bool:
    """Whether ``recorded`` (the count a snapshot recorded: a checked scan of these very
    files, which the manifest check proves unchanged) agrees with ``facts``: no more
    live entries than stored non-deletion entries, and none exactly when no live key
    is found. False (count again) when a fact is missing."""
    if recorded is None or facts.entries is None or facts.deletions is None \
            or facts.memtable_entries is None:
        return False
    if (recorded == 0) != (facts.first_key is None):
        return False
    return recorded <= facts.entries - facts.deletions + facts.memtable_entries


def exact_count(facts: ColumnFamilyFacts) -> int | None:
    """Live entries of the column family from its facts when provable, else None."""
    if facts.files is None or facts.entries is None or facts.memtable_entries != 0 \
            or facts.deletions != 0 or facts.merge_operands != 0 or facts.range_deletions != 0:
        return None
    ranges = sorted((f.smallest, f.largest) for f in facts.files)
    for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False):
        if lo <= hi:
            return None  # two files may hold versions of the same key
    return facts.entries


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
