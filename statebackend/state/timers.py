"""Timers as key-group-prefixed, time-ordered state (Flink's RocksDB timer service).

A timer is (key, time, domain, tag): call the job's timer handler for ``key`` once
the ``domain`` clock (``event``: the watermark; ``processing``: the run's logical
time) reaches ``time``. ``tag`` is a string the job chooses to tell timers of one
key apart (e.g. which session); a timer is unique by (key, time, domain, tag), so
registering it twice keeps one.

Two internal column families (declare them with `with_timers`), values empty::

    _timers      key group (2) + domain (1) + time (8) + u32 len(key) + key + tag
    _timer_keys  key group (2) + u32 len(key) + key + domain (1) + time (8) + tag

(time = `serialization.encode_time`: byte order is time order). ``_timers`` is the
priority queue: within a key group and domain it is in time order, so the timers
due at ``t`` of one key group are the byte range ``[kg + domain, kg + domain +
(t + 1))``. ``_timer_keys`` is the reverse lookup: the timers of one key are one
prefix. Both are key-group-prefixed, so rescale clips and moves them with the
state, and checkpoints carry them incrementally like any column family.

`fire_due` merges the per-key-group ranges (one seek per key group of the
subtask, read a chunk at a time and merged by one sort per round: global time
order) and deletes each timer as it fires, before the caller handles it. Timers
registered while a pass runs at or before its ``up_to`` join the same pass in time
order; timers deleted while it runs do not fire (Flink's
``InternalTimerServiceImpl.advanceWatermark``). Cost: the key groups (seeks) plus
the due timers, never the state size. Registering,
deleting and firing build and parse the keys of a batch of timers column-wise
(`statebackend.state.timer_columns`); `timer_key`, `reverse_key` and
`parse_timer_key` are the same layouts a timer at a time.
"""

from __future__ import annotations

import struct
from bisect import bisect_right, insort
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from statebackend.errors import SerializationError, UsageError
from statebackend.state.codecs import (
    DOMAIN_NAMES,
    TIME_BYTES,
    as_time,
    decode_time,
    deserialize_key,
    domain_byte,
    encode_time,
    time_upper_bound,
)
from statebackend.state.families import TIMER_KEYS, TIMERS
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.kinds import StateDescriptor, internal_descriptor
from statebackend.state.scan import checked_scan, earliest_time, multi_get, prefix_upper_bound
from statebackend.state.timer_columns import (
    FIRED_SCHEMA,
    parse_timer_key_columns,
    timer_key_columns,
)

if TYPE_CHECKING:
    from statebackend.state.backend import KeyedStateBackend

TIMER_DESCRIPTORS: tuple[StateDescriptor, ...] = (internal_descriptor(TIMERS),
                                                  internal_descriptor(TIMER_KEYS))
_U32 = struct.Struct(">I")
# A timer's firing order within its domain: its key after key group and domain (time,
# key, tag), distinct for distinct timers whatever their key groups
_FIRING_ORDER = itemgetter(slice(3, None))
_CHUNK = 4096  # due timers read from a key group at a time


def with_timers(descriptors: Sequence[StateDescriptor]) -> list[StateDescriptor]:
    """``descriptors`` plus the timer column families (once): what a job with timers opens."""
    have = {d.name for d in descriptors}
    return list(descriptors) + [d for d in TIMER_DESCRIPTORS if d.name not in have]


@dataclass(frozen=True, order=True)
class Timer:
    """One timer; ordering is firing order within a domain (time, then key group, key, tag)."""

    time: int
    key_group: int
    key: str
    tag: str = ""
    domain: str = "event"

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "time": self.time, "domain": self.domain, "tag": self.tag,
                "key_group": self.key_group}


# -- byte layouts ----------------------------------------------------------------------

def _framed(key_bytes: bytes) -> bytes:
    return _U32.pack(len(key_bytes)) + key_bytes


def timer_key(kg: int, domain: bytes, time: int, key_bytes: bytes, tag: str) -> bytes:
    return key_group_prefix(kg) + domain + encode_time(time) + _framed(key_bytes) + \
        tag.encode("utf-8")


def reverse_key(kg: int, domain: bytes, time: int, key_bytes: bytes, tag: str) -> bytes:
    return key_group_prefix(kg) + _framed(key_bytes) + domain + encode_time(time) + \
        tag.encode("utf-8")


def _split_framed(data: bytes, pos: int, what: str) -> tuple[bytes, int]:
    if len(data) < pos + 4:
        raise SerializationError(f"{what} {data[:32].hex()} is truncated (key length)")
    (n,) = _U32.unpack_from(data, pos)
    if pos + 4 + n > len(data):
        raise SerializationError(f"{what} {data[:32].hex()} has a bad key length")
    return data[pos + 4 : pos + 4 + n], pos + 4 + n


def _domain_name(b: int, data: bytes, what: str) -> str:
    if b not in DOMAIN_NAMES:
        raise SerializationError(f"{what} {data[:32].hex()} has unknown time domain {b}")
    return DOMAIN_NAMES[b]


def parse_timer_key(tk: bytes) -> Timer:
    """Inverse of `timer_key`; SerializationError if the bytes do not fit the layout."""
    return _parse_timer_key(tk)[0]


def _parse_timer_key(tk: bytes) -> tuple[Timer, int]:
    """`parse_timer_key`, and where the framed key ends (the tag starts)."""
    what = "timer key"
    if len(tk) < 3 + TIME_BYTES:
        raise SerializationError(f"{what} {tk[:32].hex()} is truncated")
    domain = _domain_name(tk[2], tk, what)
    kb, pos = _split_framed(tk, 3 + TIME_BYTES, what)
    return Timer(decode_time(tk, 3), int.from_bytes(tk[:2], "big"), deserialize_key(kb),
                 _utf8(tk[pos:], tk, what), domain), pos


def _timer_and_reverse(tk: bytes) -> tuple[Timer, bytes]:
    """`parse_timer_key`, and the timer's `reverse_key` (the same parts, reordered: the
    firing pass deletes both without encoding the time or the key again)."""
    timer, pos = _parse_timer_key(tk)
    return timer, tk[:2] + tk[3 + TIME_BYTES:pos] + tk[2:3 + TIME_BYTES] + tk[pos:]


def fired_timers(timer_keys: list[bytes], *, reverse: bool = True
                 ) -> tuple[pa.Table, list[bytes]]:
    """The timers of ``timer_keys`` (a `FIRED_SCHEMA` table) and their reverse keys (none
    with ``reverse=False``: a reader of the timers deletes nothing): column-wise, else (a
    tag, or bytes that do not fit) a timer at a time."""
    columns = parse_timer_key_columns(timer_keys, reverse=reverse)
    if columns is not None:
        return columns
    timers, reverse_keys = [], []
    if reverse:
        for tk in timer_keys:
            timer, rk = _timer_and_reverse(tk)
            timers.append(timer)
            reverse_keys.append(rk)
    else:
        timers = [parse_timer_key(tk) for tk in timer_keys]
    table = pa.table({name: [getattr(t, name) for t in timers] for name in FIRED_SCHEMA.names},
                     schema=FIRED_SCHEMA)
    return table, reverse_keys


def timers_of_table(table: pa.Table) -> list[Timer]:
    """The rows of a `FIRED_SCHEMA` table as `Timer` objects, in their order."""
    columns = [table.column(c).to_pylist() for c in ("time", "key_group", "key", "tag",
                                                      "domain")]
    return [Timer(*timer) for timer in zip(*columns, strict=True)]


def parse_reverse_key(rk: bytes) -> Timer:
    """Inverse of `reverse_key`."""
    what = "timer reverse key"
    kb, pos = _split_framed(rk, 2, what)
    if len(rk) < pos + 1 + TIME_BYTES:
        raise SerializationError(f"{what} {rk[:32].hex()} is truncated")
    domain = _domain_name(rk[pos], rk, what)
    return Timer(decode_time(rk, pos + 1), int.from_bytes(rk[:2], "big"), deserialize_key(kb),
                 _utf8(rk[pos + 1 + TIME_BYTES :], rk, what), domain)


def key_bytes_of(internal_key: bytes, kind: str) -> bytes:
    """The serialized user key inside a ``timers`` / ``timer_keys`` entry (validation)."""
    if kind == "timers":
        return _split_framed(internal_key, 3 + TIME_BYTES, "timer key")[0]
    return _split_framed(internal_key, 2, "timer reverse key")[0]


def _utf8(raw: bytes, whole: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SerializationError(f"{what} {whole[:32].hex()}: tag is not UTF-8") from exc


# -- register / delete / list ----------------------------------------------------------

def _require_timers(backend: KeyedStateBackend) -> None:
    if TIMERS not in backend.column_families or TIMER_KEYS not in backend.column_families:
        raise UsageError(f"{backend.label} has no timer column families: open it with "
                         "statebackend.state.timers.with_timers(descriptors)")


def register_timers(backend: KeyedStateBackend, keys: Sequence[str], times: Sequence[int],
                    domain: str = "event", tags: Sequence[str] | None = None) -> None:
    """Register one timer per (key, time[, tag]) in one write batch (idempotent)."""
    _set_timers(backend, keys, times, domain, tags, register=True)


def register_timer(backend: KeyedStateBackend, key: str, time: int, domain: str = "event",
                   tag: str = "") -> None:
    _set_timers(backend, [key], [time], domain, [tag], register=True)


def delete_timers(backend: KeyedStateBackend, keys: Sequence[str], times: Sequence[int],
                  domain: str = "event", tags: Sequence[str] | None = None) -> None:
    """Delete the given timers (absent ones are ignored) in one write batch."""
    _set_timers(backend, keys, times, domain, tags, register=False)


def delete_timer(backend: KeyedStateBackend, key: str, time: int, domain: str = "event",
                 tag: str = "") -> None:
    _set_timers(backend, [key], [time], domain, [tag], register=False)


def _set_timers(backend: KeyedStateBackend, keys: Sequence[str], times: Sequence[int],
                domain: str, tags: Sequence[str] | None, *, register: bool) -> None:
    _require_timers(backend)
    n_tags = len(keys) if tags is None else len(tags)
    if not len(keys) == len(times) == n_tags:
        raise UsageError(f"timers: {len(keys)} keys, {len(times)} times and {n_tags} tags; "
                         "pass one time (and tag) per key")
    dom = domain_byte(domain)
    if tags is not None:
        bad = next((t for t in tags if not isinstance(t, str)), None)
        if bad is not None:
            raise UsageError(f"timer tags must be strings, got {type(bad).__name__}: {bad!r}")
        if not any(tags):
            tags = None
    kgs, kbs = backend.key_groups_and_bytes(keys)
    if not len(kbs):
        return
    at = _times_array(times)
    # (no reverse keys where the backend derives them: rev is empty, its write a no-op)
    fwd, rev = timer_key_columns(kgs, kbs, at, dom, tags, reverse=backend.keeps_timer_keys)
    firing = backend.timer_firings.get(domain) if register else None
    if firing is not None:
        for i in np.flatnonzero(at <= firing.up_to).tolist():
            firing.offer(fwd[i], int(at[i]))
    backend.write_keys(((backend.column_family_handle(TIMERS), fwd),
                        (backend.column_family_handle(TIMER_KEYS), rev)), delete=not register)


def _times_array(times: Sequence[int]) -> np.ndarray:
    """``times`` as int64 epoch ms; `as_time`'s error for the first that is not one."""
    if all(type(t) is int for t in times):  # the common case: one conversion (bools are not)
        try:
            return np.array(times, dtype=np.int64)
        except OverflowError:
            pass
    return np.array([as_time(t) for t in times], dtype=np.int64)


def timers_of(backend: KeyedStateBackend, key: str, domain: str | None = None) -> list[Timer]:
    """Every timer of ``key`` (of ``domain`` if given), in time order per domain."""
    _require_timers(backend)
    kg, kb = backend.key_group_and_bytes(key)
    lower = key_group_prefix(kg) + _framed(kb)
    if domain is not None:
        lower += domain_byte(domain)
    out = [parse_reverse_key(rk) for rk in backend.iter_raw(
        TIMER_KEYS, lower=lower, upper=prefix_upper_bound(lower), values=False)]
    return out


def delete_timers_of(backend: KeyedStateBackend, key: str, domain: str | None = None) -> int:
    """Delete every timer of ``key`` (of ``domain`` if given); returns how many."""
    found = timers_of(backend, key, domain)
    for dom in {t.domain for t in found}:
        mine = [t for t in found if t.domain == dom]
        delete_timers(backend, [t.key for t in mine], [t.time for t in mine], dom,
                      [t.tag for t in mine])
    return len(found)


def iter_timers(backend: KeyedStateBackend) -> Iterator[Timer]:
    """Every timer, in stored order (key group, domain, time): dump and tests."""
    if TIMERS in backend.column_families:
        for tk in backend.iter_raw(TIMERS, values=False):
            yield parse_timer_key(tk)


def next_timer_time(backend: KeyedStateBackend, domain: str = "event") -> int | None:
    """Earliest registered time of ``domain`` (None: no timer): one seek per key group.

    A run can record it per subtask, so a later run restores a subtask without new
    rows only when a timer of it is due.
    """
    _require_timers(backend)
    return earliest_time(backend, TIMERS, domain_byte(domain))


# -- firing ----------------------------------------------------------------------------

@dataclass
class FireStats:
    """Cost of one `fire_due` pass: seeks, entries read from the queue, timers fired."""

    seeks: int = 0
    entries_read: int = 0
    fired: int = 0


class TimerFiring:
    """Iterator over the due timers of one domain, in time order; see `fire_due`.

    Each key group's due range is read a chunk at a time (`_CHUNK` keys). A timer's
    order is its key after the key group and domain (time, key, tag: distinct for
    distinct timers of a domain, whatever their key groups), so the next timers in
    order are, at any point, every one read up to the smallest last key among the key
    groups not read to the end: one sort of those (`_refill`), not a heap step per timer.
    """

    def __init__(self, backend: KeyedStateBackend, domain: str, up_to: int) -> None:
        _require_timers(backend)
        if backend.timer_firings.get(domain) is not None:
            raise UsageError(f"a {domain}-time timer pass is already running on "
                             f"{backend.label}: finish it before starting another")
        self.backend = backend
        self.domain = domain
        self.up_to = up_to
        self.stats = FireStats()
        self._cf = backend.column_family(TIMERS)
        self._fwd = backend.column_family_handle(TIMERS)
        self._rev = backend.column_family_handle(TIMER_KEYS)
        self._scans: list[Iterator[bytes] | None] = []  # per key group; None: read to the end
        self._read: list[list[bytes]] = []  # per key group: read, not yet in ``_ready``
        self._ready: list[bytes] = []  # in firing order; ``_ready[:_next]`` are taken
        self._next = 0
        self._offered: list[bytes] = []  # registered while firing, after ``_last``
        self._last: bytes | None = None  # firing order of the last of ``_ready`` (None: all)
        self._started = False
        self._dom = domain_byte(domain)
        backend.timer_firings[domain] = self

    def _start(self) -> None:
        self._started = True
        upper_time = time_upper_bound(self.up_to)
        r = self.backend.key_group_range
        where = self.backend.scan_where(TIMERS)
        for kg in range(r.start, r.end + 1):
            lower = key_group_prefix(kg) + self._dom
            self._scans.append(checked_scan(self._cf, where, lower, lower + upper_time,
                                            values=False, file_paths=self.backend.file_paths))
            self._read.append([])
            self.stats.seeks += 1
        self._refill()

    def _refill(self) -> None:
        """The next timers in firing order into ``_ready``: every one read or offered up
        to the smallest last one read of a key group not read to the end (what it has
        not read comes after it); all of them once every key group is read."""
        for i, scan in enumerate(self._scans):
            if scan is not None and not self._read[i]:
                chunk = list(islice(scan, _CHUNK))
                self.stats.entries_read += len(chunk)
                self._read[i] = chunk
                if len(chunk) < _CHUNK:
                    self._scans[i] = None
        ends = [_FIRING_ORDER(read[-1]) for read, scan in zip(self._read, self._scans,
                                                            strict=True) if scan is not None]
        last = min(ends) if ends else None
        ready: list[bytes] = []
        for i, read in enumerate(self._read):
            n = len(read) if last is None or not read else \
                bisect_right(read, read[0][:3] + last)
            ready += read[:n]
            self._read[i] = read[n:]
        if self._offered:
            ready += [tk for tk in self._offered if last is None or _FIRING_ORDER(tk) <= last]
            self._offered = [] if last is None else [tk for tk in self._offered
                                                     if _FIRING_ORDER(tk) > last]
        ready.sort(key=_FIRING_ORDER)
        self._ready, self._next, self._last = ready, 0, last

    def offer(self, tk: bytes, time: int) -> None:
        """A timer registered during the pass: it fires in this pass if due."""
        if time <= self.up_to and self._started:
            self.stats.entries_read += 1
            if self._last is None or _FIRING_ORDER(tk) <= self._last:
                insort(self._ready, tk, lo=self._next, key=_FIRING_ORDER)
            else:
                self._offered.append(tk)

    def _take_next(self, n: int) -> list[bytes]:
        """Up to ``n`` next timers in firing order (fewer: none left)."""
        out: list[bytes] = []
        while len(out) < n:
            if self._next == len(self._ready):
                if self._last is None and not self._offered:
                    break
                self._refill()
                continue
            chunk = self._ready[self._next:self._next + n - len(out)]
            self._next += len(chunk)
            out += chunk
        return out

    def __iter__(self) -> TimerFiring:
        return self

    def __next__(self) -> Timer:
        chunk = self.take(1)
        if not chunk:
            raise StopIteration
        return chunk[0]

    def take(self, n: int) -> list[Timer]:
        """`take_table`'s timers as `Timer` objects."""
        return timers_of_table(self.take_table(n))

    def take_table(self, n: int) -> pa.Table:
        """The next ``n`` due timers in firing order (a `FIRED_SCHEMA` table), deleted
        (one write) before the caller handles them; fewer than ``n``: the pass ran dry
        and is closed.

        No handler runs while a chunk is gathered, so its timers are checked against the
        queue in one multi-get: one deleted while the pass ran, or already fired (offered
        again, or read and offered), is skipped.
        """
        if not self._started:
            self._start()
        due: list[bytes] = []
        seen: set[bytes] = set()
        while len(due) < n:
            chunk = self._take_next(n - len(due))
            if not chunk:
                break
            fresh = [tk for tk in dict.fromkeys(chunk) if tk not in seen]
            seen.update(fresh)
            due.extend(tk for tk, stored in zip(fresh, multi_get(self._cf, fresh),
                                                 strict=True) if stored is not None)
        table, reverse = fired_timers(due, reverse=self.backend.keeps_timer_keys)
        if due:
            self.backend.write_keys(((self._fwd, due), (self._rev, reverse)), delete=True)
        self.stats.fired += len(due)
        if len(due) < n:
            self.close()
        return table

    def close(self) -> None:
        """End the pass (also when the caller stops early); the rest stays registered."""
        self._scans, self._read, self._ready, self._offered = [], [], [], []
        self._next, self._last = 0, None
        if self.backend.timer_firings.get(self.domain) is self:
            del self.backend.timer_firings[self.domain]


def fire_due(backend: KeyedStateBackend, domain: str, up_to: int) -> TimerFiring:
    """Due timers of ``domain`` (time <= ``up_to``) in global time order, deleted as they fire.

    Iterate it and handle each `Timer`; the handler may register and delete timers
    and change state. ``.stats`` tells the cost. Stop early with ``close()``.
    """
    domain_byte(domain)
    return TimerFiring(backend, domain, as_time(up_to))
