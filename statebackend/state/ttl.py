"""State TTL: entries that expire, a time-ordered expiry index, and purge.

A state declares ``ttl=StateTtl(duration_ms, time="event" | "processing")`` (Flink's
``StateTtlConfig`` with ``OnCreateAndWrite``; Spark's ``TTLConfig`` of
``transformWithState``). Every write stamps the entry with ``expiry = ts +
duration_ms``, where ``ts`` is the write's own time (e.g. the row's event time,
passed as ``timestamps=``) or else the backend's clock of the TTL's time domain
(`KeyedStateBackend.set_time`). An entry is *expired at time now* iff
``expiry <= now`` (a watermark W says "nothing at or before W"); before the clock
is set (``now`` None) nothing is expired.

Stored bytes (the descriptor records the TTL in ``_metadata``, so readers know)::

    value / reducing / aggregating / map entry:  expiry (8) + the codec's bytes
    list: the usual u32-framed elements, each element = expiry (8) + codec bytes

(expiry = `serialization.encode_time`: 8 bytes big-endian, sign bit flipped). A
list element keeps its own expiry (Flink and Spark expire list elements one by
one), so an append stays a byte concatenation.

Expiry index, column family ``_ttl`` (kind ``ttl_index``), value empty::

    key group (2) + domain (1) + expiry (8) + u16 len(state) + state name + body

where ``body`` is the entry's RocksDB key without its key-group prefix (the key
bytes; for map state the map suffix with the user key). Key-group-prefixed, so a
rescale clips and moves it with the state; within a key group and domain the
index is in expiry order, so `purge_expired` seeks once per key group and reads
only the entries that are due.

Invariants: (1) a read never returns an expired entry: it filters on the expiry
stored with the value (no second lookup), whether or not purge has run; (2)
every stored expiry has its index entry (a write puts it and deletes the index
entry of the value it overwrites or deletes, read in the same multi-get), so
purge finds everything that expires; (3) an index entry with ``expiry <= now``
never points at an entry a read at ``now`` would return. Validation checks (2)
and (3) (`validation.content`).

Purge reads only the index: by (2) and (3) a due index entry of a value-like
state (value, reducing, aggregating, map) names an expired entry, which it
deletes without reading it back; a list is read, since its elements expire one
by one. The due index range of each key group then goes with one range
tombstone. `TtlAccess.insert_absent` (dedup's "remember if new") reads each key
once and writes value and index entry in the same batch.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from statebackend.errors import SerializationError, UsageError
from statebackend.state.codecs import (
    DOMAIN_NAMES,
    TIME_BYTES,
    TIME_DOMAINS,
    as_time,
    decode_list,
    decode_time,
    domain_byte,
    encode_time,
    time_upper_bound,
)
from statebackend.state.families import TTL_INDEX
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.scan import checked_entries, earliest_time, multi_get

if TYPE_CHECKING:
    from statebackend.state.backend import KeyedStateBackend
    from statebackend.state.kinds import StateDescriptor

TTL_UPDATE_MODES = ("write",)
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
PURGE_BATCH = 10_000


@dataclass(frozen=True)
class StateTtl:
    """Time to live of a state's entries: ``duration_ms`` of ``time`` after each write."""

    duration_ms: int
    time: str = "processing"
    update_on: str = "write"

    def __post_init__(self) -> None:
        if isinstance(self.duration_ms, bool) or not isinstance(self.duration_ms, int) \
                or self.duration_ms <= 0:
            raise UsageError(f"TTL duration {self.duration_ms!r} must be a positive integer "
                             "of milliseconds")
        if self.time not in TIME_DOMAINS:
            raise UsageError(f"TTL time {self.time!r} is unknown; use one of "
                             f"{sorted(TIME_DOMAINS)}")
        if self.update_on not in TTL_UPDATE_MODES:
            raise UsageError(f"TTL update_on {self.update_on!r} is unknown; use one of "
                             f"{TTL_UPDATE_MODES}")

    def to_json(self) -> dict[str, Any]:
        return {"duration_ms": self.duration_ms, "time": self.time, "update_on": self.update_on}

    @staticmethod
    def from_json(data: Any) -> StateTtl:
        if not isinstance(data, dict) or not isinstance(data.get("duration_ms"), int):
            raise SerializationError(f"TTL description {data!r} is malformed: expected "
                                     '{"duration_ms": int, "time": "event"|"processing"}')
        return StateTtl(data["duration_ms"], data.get("time", "processing"),
                        data.get("update_on", "write"))


# -- byte layouts ----------------------------------------------------------------------

def index_key(rocks_key: bytes, domain: bytes, expiry: int, state: bytes) -> bytes:
    """Index entry of the stored entry ``rocks_key`` (``state`` = u16-framed name)."""
    return index_key_at(rocks_key, domain, encode_time(expiry), state)


def index_key_at(rocks_key: bytes, domain: bytes, expiry: bytes, state: bytes) -> bytes:
    """`index_key` of an encoded expiry (``encode_time``'s bytes, kept by hot loops)."""
    return rocks_key[:2] + domain + expiry + state + rocks_key[2:]


def state_tag(name: str) -> bytes:
    raw = name.encode("utf-8")
    return _U16.pack(len(raw)) + raw


@dataclass(frozen=True)
class IndexEntry:
    key_group: int
    domain: str
    expiry: int
    state: str
    body: bytes  # the entry's RocksDB key without the key-group prefix

    @property
    def rocks_key(self) -> bytes:
        return key_group_prefix(self.key_group) + self.body


def parse_index_key(ik: bytes) -> IndexEntry:
    """Inverse of `index_key`; SerializationError if the bytes do not fit the layout."""
    if len(ik) < 2 + 1 + TIME_BYTES + 2 or ik[2] not in DOMAIN_NAMES:
        raise SerializationError(f"TTL index key {ik[:32].hex()} is truncated or has an "
                                 "unknown time domain")
    (n,) = _U16.unpack_from(ik, 11)
    if 13 + n > len(ik):
        raise SerializationError(f"TTL index key {ik[:32].hex()} has a bad state-name length")
    try:
        state = ik[13 : 13 + n].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SerializationError(f"TTL index key {ik[:32].hex()}: state name is not "
                                 "UTF-8") from exc
    return IndexEntry(int.from_bytes(ik[:2], "big"), DOMAIN_NAMES[ik[2]], decode_time(ik, 3),
                      state, ik[13 + n :])


def stored_expiries(raw: bytes, is_list: bool) -> set[int]:
    """Expiries stored in one TTL value (a list: one per distinct element expiry)."""
    if is_list:
        return {decode_time(e) for e in decode_list(raw)}
    return {decode_time(raw)}


def strip_value(raw: bytes | None, now: int | None) -> bytes | None:
    """Codec bytes of a stored TTL value, None if absent or expired at ``now``."""
    if raw is None or (now is not None and decode_time(raw) <= now):
        return None
    return raw[TIME_BYTES:]


def strip_list(raw: bytes | None, now: int | None) -> bytes | None:
    """Usual list bytes of the live elements of a stored TTL list, None if none is live."""
    if raw is None:
        return None
    live = [e[TIME_BYTES:] for e in decode_list(raw) if now is None or decode_time(e) > now]
    return b"".join(_U32.pack(len(e)) + e for e in live) if live else None


def _stamp_list(list_bytes: bytes, expiry_bytes: bytes) -> bytes:
    return b"".join(_U32.pack(len(e) + TIME_BYTES) + expiry_bytes + e
                    for e in decode_list(list_bytes))


# -- reads and writes of one TTL state (used by `state._State`) ------------------------

class TtlAccess:
    """TTL-aware raw reads and writes of one state with a TTL."""

    def __init__(self, backend: KeyedStateBackend, descriptor: StateDescriptor) -> None:
        if descriptor.ttl is None:
            raise UsageError(f"state {descriptor.name!r} has no TTL")
        self.backend = backend
        self.ttl: StateTtl = descriptor.ttl
        self.name = descriptor.name
        self.is_list = descriptor.kind == "list"
        self.cf = backend.column_family(descriptor.name)
        self.cf_handle = backend.column_family_handle(descriptor.name)
        self.index_handle = backend.column_family_handle(TTL_INDEX)
        self.domain = domain_byte(self.ttl.time)
        self.tag = state_tag(descriptor.name)

    def now(self) -> int | None:
        return self.backend.current_time(self.ttl.time)

    def live(self, raws: Sequence[bytes | None]) -> list[bytes | None]:
        """Stored bytes -> what a state without TTL would store; expired -> None."""
        now = self.now()
        strip = strip_list if self.is_list else strip_value
        return [strip(r, now) for r in raws]

    def read(self, rocks_keys: Sequence[bytes]) -> list[bytes | None]:
        return self.live(multi_get(self.cf, rocks_keys))

    def expiries(self, timestamps: Sequence[int] | int | None, n: int) -> list[int]:
        d = self.ttl.duration_ms
        if timestamps is None:
            now = self.now()
            if now is None:
                raise UsageError(
                    f"state {self.name!r} has a {self.ttl.time}-time TTL but the backend's "
                    f"{self.ttl.time} time is not set: pass timestamps= with the write or "
                    f"call backend.set_time({self.ttl.time}_time=...) first")
            return [now + d] * n
        if not isinstance(timestamps, Iterable):
            return [as_time(timestamps) + d] * n
        ts = list(timestamps)
        if len(ts) != n:
            raise UsageError(f"state {self.name!r}: {len(ts)} timestamps for {n} writes; "
                             "pass one timestamp per written entry")
        return [as_time(t) + d for t in ts]

    def expiry_bytes(self, timestamps: Sequence[int] | int | None, n: int) -> list[bytes]:
        """`encode_time` of each write's expiry; an int64 NumPy array in one pass."""
        if isinstance(timestamps, np.ndarray) and timestamps.dtype.kind in "iu":
            if len(timestamps) != n:
                raise UsageError(f"state {self.name!r}: {len(timestamps)} timestamps for {n} "
                                 "writes; pass one timestamp per written entry")
            if n:
                ts = timestamps.astype(np.int64, copy=False)
                lo, hi = int(ts.min()), int(ts.max())
                # as_time's range, and the expiry's, exactly as per value
                for t in (lo, hi):
                    as_time(t)
                    as_time(t + self.ttl.duration_ms)
            biased = ts.astype(np.uint64) + np.uint64((1 << 63) + self.ttl.duration_ms) \
                if n else np.zeros(0, np.uint64)
            return biased.astype(">u8").view("V8").tolist()
        return [encode_time(e) for e in self.expiries(timestamps, n)]

    def append(self, rocks_keys: Sequence[bytes],
               elements: Sequence[Sequence[tuple[bytes, int]]]) -> None:
        """List state: append (codec bytes, expiry) elements per key, in order; one batch."""
        old = multi_get(self.cf, rocks_keys) if rocks_keys else []
        wb = self.backend.write_batch()
        cf, ix, dom, tag = self.cf_handle, self.index_handle, self.domain, self.tag
        for rk, els, o in zip(rocks_keys, elements, old, strict=True):
            have = set() if o is None else stored_expiries(o, True)
            added = b"".join(_U32.pack(len(e) + TIME_BYTES) + encode_time(x) + e for e, x in els)
            for x in {x for _, x in els} - have:
                wb.put(index_key(rk, dom, x, tag), b"", ix)
            wb.put(rk, (o or b"") + added, cf)
        self.backend.write(wb)

    def write(self, puts: Iterable[tuple[bytes, bytes]], deletes: Iterable[bytes] = (),
              timestamps: Sequence[int] | int | None = None) -> None:
        """One write batch over the state and the index: ``puts``, then ``deletes``.

        ``puts`` carry what a state without TTL would store (codec bytes; list bytes);
        every put replaces the stored entry (a list: all its elements get the expiry).
        """
        puts, deletes = list(puts), list(deletes)
        rks = [k for k, _ in puts]
        # one multi-get: the old values tell which index entries to move or drop
        old_all = multi_get(self.cf, rks + deletes) if rks or deletes else []
        old, old_deleted = old_all[: len(rks)], old_all[len(rks) :]
        if not self.is_list:
            self._write_values(puts, deletes, self.expiry_bytes(timestamps, len(puts))
                               if puts else [], old, old_deleted)
            return
        exps = self.expiries(timestamps, len(puts)) if puts else []
        wb = self.backend.write_batch()
        cf, ix, dom, tag = self.cf_handle, self.index_handle, self.domain, self.tag
        indexed: dict[bytes, set[int]] = {}  # what the index holds per key after this batch
        stored: dict[bytes, bytes] = {}
        for (rk, value), e, o in zip(puts, exps, old, strict=True):
            if rk in indexed:
                have, o = indexed[rk], stored[rk]
            else:
                have = set() if o is None else stored_expiries(o, self.is_list)
            eb = encode_time(e)
            new = _stamp_list(value, eb) if self.is_list else eb + value
            keep = {e}
            for gone in have - keep:
                wb.delete(index_key(rk, dom, gone, tag), ix)
            if e not in have:
                wb.put(index_key(rk, dom, e, tag), b"", ix)
            wb.put(rk, new, cf)
            indexed[rk], stored[rk] = keep, new
        for rk, o in zip(deletes, old_deleted, strict=True):
            if rk in indexed:
                have = indexed[rk]
            else:
                have = set() if o is None else stored_expiries(o, self.is_list)
            for gone in have:
                wb.delete(index_key(rk, dom, gone, tag), ix)
            wb.delete(rk, cf)
            indexed[rk] = set()
        self.backend.write(wb)

    def insert_absent(self, rocks_keys: Sequence[bytes], encoded: Sequence[bytes],
                      timestamps: Sequence[int] | int | None = None) -> np.ndarray:
        """Value-like state: write each entry whose key holds no live value; one multi-get
        and one write batch (value and index entry together, no second read).

        Returns the found mask: True where a live value exists (nothing written). An
        expired value not purged yet counts as absent: it is replaced, and its index
        entry (its expiry, read in the same multi-get) moves. ``rocks_keys`` must be
        distinct.
        """
        n = len(rocks_keys)
        if len(encoded) != n:
            raise UsageError(f"state {self.name!r}: {n} keys but {len(encoded)} values; "
                             "pass one value per key")
        if len(set(rocks_keys)) != n:
            raise UsageError(f"state {self.name!r}: insert_absent got a key more than once; "
                             "pass each key once (group the batch by key first)")
        old = multi_get(self.cf, rocks_keys) if n else []
        now = self.now()
        now_bytes = None if now is None else encode_time(now)
        # byte order of the stored expiry is time order: live iff expiry > now
        found = np.fromiter((o is not None and (now_bytes is None or o[:TIME_BYTES] > now_bytes)
                             for o in old), dtype=np.bool_, count=n)
        if found.all():
            return found
        expiries = self.expiry_bytes(timestamps, n)
        absent = np.flatnonzero(~found).tolist()
        self._write_values([(rocks_keys[i], encoded[i]) for i in absent], [],
                           [expiries[i] for i in absent], [old[i] for i in absent], [])
        return found

    def _write_values(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes],
                      expiries: list[bytes], old: list[bytes | None],
                      old_deleted: list[bytes | None]) -> None:
        """`write` of a value-like state (one expiry per entry): on expiry bytes, no
        decoding (their byte order is time order)."""
        wb = self.backend.write_batch()
        cf, ix, dom, tag = self.cf_handle, self.index_handle, self.domain, self.tag
        stored: dict[bytes, bytes | None] = {}  # what a key holds after this batch so far
        # Entries added (a put on an absent key) or removed (a delete of a stored one):
        # the index gains and loses one with each, as it names exactly the stored expiries
        added = 0
        for (rk, value), eb, o in zip(puts, expiries, old, strict=True):
            if rk in stored:
                o = stored[rk]
            had = None if o is None else o[:TIME_BYTES]
            if had != eb:
                if had is not None:
                    wb.delete(index_key_at(rk, dom, had, tag), ix)
                wb.put(index_key_at(rk, dom, eb, tag), b"", ix)
            new = eb + value
            wb.put(rk, new, cf)
            added += o is None
            stored[rk] = new
        for rk, o in zip(deletes, old_deleted, strict=True):
            if rk in stored:
                o = stored[rk]
            if o is not None:
                wb.delete(index_key_at(rk, dom, o[:TIME_BYTES], tag), ix)
                added -= 1
            wb.delete(rk, cf)
            stored[rk] = None
        self.backend.write(wb, {self.name: added, TTL_INDEX: added})


# -- purge -----------------------------------------------------------------------------

@dataclass(frozen=True)
class PurgeStats:
    """What one `purge_expired` pass did (cost: seeks + index_entries_read)."""

    seeks: int = 0
    index_entries_read: int = 0
    entries_deleted: int = 0  # values, map entries and emptied lists removed
    elements_dropped: int = 0  # expired list elements removed from lists that stay
    compacted: tuple[str, ...] = ()  # column families rewritten (``compact_ratio``)

    def to_json(self) -> dict[str, Any]:
        return {"seeks": self.seeks, "index_entries_read": self.index_entries_read,
                "entries_deleted": self.entries_deleted,
                "elements_dropped": self.elements_dropped, "compacted": list(self.compacted)}


def purge_expired(backend: KeyedStateBackend, domain: str, now: int,
                  batch_size: int = PURGE_BATCH, compact_ratio: float | None = None
                  ) -> PurgeStats:
    """Physically delete every entry of ``domain``-time TTL states expired at ``now``.

    One seek per key group of the backend into ``[kg + domain, kg + domain + (now + 1))``
    of the index, so the cost is the number of key groups plus the entries that expire,
    never the state size. Safe to run any number of times (idempotent).

    Deletes are tombstones: the space comes back only when compaction merges them
    with the data they hide, and universal compaction rewrites the large base run
    rarely, so a checkpoint keeps referencing the dead bytes (measured: 40,000 keys
    going quiet, four runs later the checkpoint was still as large as at its peak).
    With ``compact_ratio`` (e.g. 0.25), a TTL state whose deleted entries reach that
    fraction of its estimated entries is compacted at once, with the index: a full
    rewrite of those column families, worth it only when a large part died.
    """
    if TTL_INDEX not in backend.column_families:
        return PurgeStats()
    estimates = {}
    if compact_ratio is not None:
        estimates = {name: backend.column_family(name).property_int_value(
                         "rocksdb.estimate-num-keys") or 0
                     for name, d in backend.descriptors.items()
                     if d.ttl is not None and d.ttl.time == domain}
    dom = domain_byte(domain)
    now = as_time(now)
    upper_time = time_upper_bound(now)
    index_cf = backend.column_family(TTL_INDEX)
    where = backend.scan_where(TTL_INDEX)
    seeks = read = deleted = dropped = 0
    per_state: dict[str, int] = {}
    pending: list[bytes] = []
    r = backend.key_group_range
    due_ranges: list[tuple[bytes, bytes]] = []  # index ranges that held due entries
    for kg in range(r.start, r.end + 1):
        lower = key_group_prefix(kg) + dom
        upper = lower + upper_time
        seeks += 1
        due, _ = checked_entries(index_cf, where, lower, upper, values=False,
                                 file_paths=backend.file_paths)
        if not due:
            continue
        due_ranges.append((lower, upper))
        read += len(due)
        pending.extend(due)
        if len(pending) >= batch_size:
            d, e = _purge_batch(backend, pending, now, per_state)
            deleted, dropped, pending = deleted + d, dropped + e, []
    if pending:
        d, e = _purge_batch(backend, pending, now, per_state)
        deleted, dropped = deleted + d, dropped + e
    if due_ranges:
        # Every entry of these ranges was read and handled above: one range tombstone
        # per key group instead of a point tombstone per index entry (fewer bytes to
        # write, flush and upload).
        wb = backend.write_batch()
        ix = backend.column_family_handle(TTL_INDEX)
        for lo, hi in due_ranges:
            wb.delete_range(lo, hi, ix)
        backend.write(wb, {TTL_INDEX: -read})
    compacted = tuple(sorted(
        name for name, n in per_state.items()
        if compact_ratio is not None and n and n >= compact_ratio * max(1, estimates.get(name, 0))))
    for name in compacted + ((TTL_INDEX,) if compacted else ()):
        backend.compact_range(name)
    return PurgeStats(seeks, read, deleted, dropped, compacted)


def _purge_batch(backend: KeyedStateBackend, index_keys: list[bytes], now: int,
                 per_state: dict[str, int]) -> tuple[int, int]:
    # Entries by state tag, without building an `IndexEntry` per entry: the scan bounds
    # fixed key group, domain and expiry; only the name framing needs checking.
    by_tag: dict[bytes, list[bytes]] = {}
    sample: dict[bytes, bytes] = {}  # one whole index key per state, parsed once
    tag, end, bodies = b"", 0, []  # the last tag seen: runs of one state skip the framing
    for ik in index_keys:
        if not (tag and ik.startswith(tag, 11)):
            end = 13 + int.from_bytes(ik[11:13], "big")
            if len(ik) < 13 or end > len(ik):
                parse_index_key(ik)  # raises the SerializationError that names it
            tag = ik[11:end]
            if tag not in by_tag:
                by_tag[tag], sample[tag] = [], ik
            bodies = by_tag[tag]
        bodies.append(ik[:2] + ik[end:])
    wb = backend.write_batch()
    deleted = dropped = 0
    removed: dict[str, int] = {}  # row counts: a state's entries this batch deletes
    for tag, keys in by_tag.items():
        name = parse_index_key(sample[tag]).state
        desc = backend.descriptors.get(name)
        if desc is None or desc.ttl is None:
            raise UsageError(f"TTL index of {backend.label} names state {name!r}, which is "
                             "not a declared TTL state: declare it with its TTL")
        cf, handle = backend.column_family(name), backend.column_family_handle(name)
        rks = list(dict.fromkeys(keys))
        gone = 0
        if desc.kind != "list":
            # One expiry per entry, and the index holds exactly the stored ones
            # (invariants 2 and 3): a due index entry names an expired entry, so it is
            # deleted without reading it back.
            for rk in rks:
                wb.delete(rk, handle)
            gone = len(rks)
        else:
            for rk, raw in zip(rks, multi_get(cf, rks), strict=True):
                if raw is None:
                    continue
                elements = decode_list(raw)
                live = [e for e in elements if decode_time(e) > now]
                if not live:
                    wb.delete(rk, handle)
                    gone += 1
                elif len(live) < len(elements):
                    wb.put(rk, b"".join(_U32.pack(len(e)) + e for e in live), handle)
                    dropped += len(elements) - len(live)
        deleted += gone
        removed[name] = -gone  # one tag per state: each name once per batch
        if gone:
            per_state[name] = per_state.get(name, 0) + gone
    backend.write(wb, removed)
    return deleted, dropped


def next_expiry(backend: KeyedStateBackend, domain: str) -> int | None:
    """Earliest expiry of ``domain``-time TTL entries (None: none): one seek per key group."""
    if TTL_INDEX not in backend.column_families:
        return None
    return earliest_time(backend, TTL_INDEX, domain_byte(domain))


def iter_index(backend: KeyedStateBackend) -> Iterator[IndexEntry]:
    """Every index entry of the backend (dump, validation, tests)."""
    if TTL_INDEX in backend.column_families:
        for ik in backend.iter_raw(TTL_INDEX, values=False):
            yield parse_index_key(ik)
