"""What RocksDB tells about a column family without reading its entries.

- `cf_facts`: per column family, from RocksDB properties (no entry read): the table
  properties summed over its SST files (entries, deletions, merge operands, range
  deletions), the entries still in memtables (a WAL replayed on open), each SST's
  smallest and largest key (``rocksdb.sstables``), and the first and last live keys
  (two seeks). Keys are sorted bytewise and start with the big-endian 2-byte key
  group, so ``key_group(first) >= start`` and ``key_group(last) <= end`` put *every*
  live key of the column family inside a key-group range (`edges_within`).
- `exact_count`: the number of live entries from those facts, when provable: no
  memtable entries, no deletions, merges or range deletions, and SST key ranges that
  do not overlap, so each key is stored in one file; a file holds one version per key
  because the backend takes no RocksDB snapshots (flush and compaction keep only the
  newest version then, and SstFileWriter writes each key once). Otherwise None.
- `recorded_count_fits`: whether the count a snapshot recorded (`row_counts`: a
  checked scan of the same files when they were written) fits the facts (no more than
  the stored non-deletion entries; zero exactly when no key is live).

Deep validation (statebackend.validation) and rescale (statebackend.rescale.task) count
from these facts instead of scanning where they prove the count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

from rocksdict import Rdict

from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.memory_table import MemoryTable

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
        return cast(bytes, it.key())  # a raw-mode column family holds bytes
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


def edge_key_group(key: bytes | None) -> int | None:
    """The key group of a stored key (its 2-byte prefix); None for no key or a short one."""
    return None if key is None or len(key) < 2 else int.from_bytes(key[:2], "big")


def edges_within(facts: ColumnFamilyFacts, key_groups: KeyGroupRange) -> bool | None:
    """Whether every live key lies in ``key_groups`` (first and last key's groups do:
    keys sort by key group); None when the column family holds no live key."""
    if facts.first_key is None:
        return None
    first, last = edge_key_group(facts.first_key), edge_key_group(facts.last_key)
    return first is not None and last is not None and key_groups.start <= first \
        and last <= key_groups.end
