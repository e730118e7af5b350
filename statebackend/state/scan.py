"""Checked scans of column families, and the bounds and seeks built on them.

rocksdict's iterators (``Rdict.items/keys/values`` and a loop that stops at
``not it.valid()``) end *silently* when RocksDB hits a damaged block: the iterator
turns invalid and only ``RdictIter.status()`` (raises ``Exception("Corruption: ...")``)
tells an error from the end of the data. Every scan of the library goes through
`checked_scan`, `checked_count`, `checked_entries` or `checked_copy`, which check the
status once at the end (cheap: no per-entry cost) and raise `CorruptStateError` naming
the column family, the instance and RocksDB's message.

Also here: `prefix_upper_bound` (an iterator's upper bound for a key prefix),
`earliest_time`, the one-seek-per-key-group lookup of the time-ordered families
(timers, TTL index), and `multi_get`, the one multi-get of raw values. This module
imports no other state module but the key-group helpers, so the backend, the state
kinds, timers and TTL all build on it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import count, starmap, tee
from typing import TYPE_CHECKING, Literal, TypeAlias, cast, overload

from rocksdict import Rdict, RdictIter, ReadOptions

from statebackend.errors import CorruptStateError
from statebackend.state.codecs import decode_time
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.memory_table import MemoryTable

if TYPE_CHECKING:
    from statebackend.state.backend import KeyedStateBackend

# A key as rocksdict's stub types it (a raw-mode column family only ever holds bytes).
_RdictKey: TypeAlias = str | int | float | bytes | bool


def _scan_iter(cf: Rdict, lower: bytes | None, upper: bytes | None) -> RdictIter:
    it = cf.iter(_read_options(upper))
    if lower:
        it.seek(lower)
    else:
        it.seek_to_first()
    return it


def _check_scan_status(it: RdictIter, where: str, file_paths: Mapping[str, str] | None
                       ) -> None:
    try:
        it.status()
    except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
        raise damaged_state(f"a full scan of {where}", exc, file_paths) from exc


def damaged_state(what: str, exc: BaseException, file_paths: Mapping[str, str] | None
                  ) -> CorruptStateError:
    """The one-line error for RocksDB's ``exc`` (a damaged block met by ``what``): its
    message, each local file it names by stored path, and what to do."""
    cause = " ".join(str(exc).split())
    stored = [f"{name} is stored as {path}" for name, path in sorted((file_paths or {}).items())
              if name in cause]
    return CorruptStateError(
        f"RocksDB stopped {what} early: {cause}"
        + (f" ({'; '.join(stored)})" if stored else "")
        + "; the state is damaged: restore from an earlier checkpoint or savepoint "
          "(`ckpt list`)")


@overload
def checked_scan(cf: Rdict | MemoryTable, where: str, lower: bytes | None = None,
                 upper: bytes | None = None, *, values: Literal[True] = True,
                 file_paths: Mapping[str, str] | None = None
                 ) -> Iterator[tuple[bytes, bytes]]: ...
@overload
def checked_scan(cf: Rdict | MemoryTable, where: str, lower: bytes | None = None,
                 upper: bytes | None = None, *, values: Literal[False],
                 file_paths: Mapping[str, str] | None = None) -> Iterator[bytes]: ...
@overload
def checked_scan(cf: Rdict | MemoryTable, where: str, lower: bytes | None = None,
                 upper: bytes | None = None, *, values: bool,
                 file_paths: Mapping[str, str] | None = None
                 ) -> Iterator[tuple[bytes, bytes]] | Iterator[bytes]: ...


def checked_scan(cf: Rdict | MemoryTable, where: str, lower: bytes | None = None,
                 upper: bytes | None = None, *, values: bool = True,
                 file_paths: Mapping[str, str] | None = None
                 ) -> Iterator[tuple[bytes, bytes] | bytes]:
    """Every entry of ``cf`` in [lower, upper): (key, value) pairs, or keys if not ``values``.

    Raises `CorruptStateError` naming ``where`` (column family, subtask, checkpoint) and
    RocksDB's message when the scan ends on an error instead of at the end of the data.
    A `MemoryTable` (the memory backend) has no blocks to damage: its own scan.
    """
    if isinstance(cf, MemoryTable):
        yield from cf.scan(lower, upper, values=values)
        return
    it = _scan_iter(cf, lower, upper)
    valid, key, nxt = it.valid, it.key, it.next
    if values:
        value = it.value
        while valid():
            yield key(), value()
            nxt()
    else:
        while valid():
            yield key()
            nxt()
    _check_scan_status(it, where, file_paths)


def checked_count(cf: Rdict | MemoryTable, where: str, lower: bytes | None = None,
                  upper: bytes | None = None, *,
                  file_paths: Mapping[str, str] | None = None) -> int:
    """Number of live entries of ``cf`` in [lower, upper); same checks as `checked_scan`."""
    if isinstance(cf, MemoryTable):
        return cf.count(lower, upper)
    it = _scan_iter(cf, lower, upper)
    valid, nxt = it.valid, it.next
    n = 0
    while valid():
        n += 1
        nxt()
    _check_scan_status(it, where, file_paths)
    return n


@overload
def checked_entries(cf: Rdict | MemoryTable, where: str, lower: bytes | None = None,
                    upper: bytes | None = None, *, values: Literal[True] = True,
                    file_paths: Mapping[str, str] | None = None
                    ) -> tuple[list[bytes], list[bytes]]: ...
@overload
def checked_entries(cf: Rdict | MemoryTable, where: str, lower: bytes | None = None,
                    upper: bytes | None = None, *, values: Literal[False],
                    file_paths: Mapping[str, str] | None = None
                    ) -> tuple[list[bytes], None]: ...
@overload
def checked_entries(cf: Rdict | MemoryTable, where: str, lower: bytes | None = None,
                    upper: bytes | None = None, *, values: bool,
                    file_paths: Mapping[str, str] | None = None
                    ) -> tuple[list[bytes], list[bytes] | None]: ...


def checked_entries(cf: Rdict | MemoryTable, where: str, lower: bytes | None = None,
                    upper: bytes | None = None, *, values: bool = True,
                    file_paths: Mapping[str, str] | None = None
                    ) -> tuple[list[bytes], list[bytes] | None]:
    """Every key of ``cf`` in [lower, upper) as a list (and the values, or None if not
    ``values``): `checked_scan` in bulk, for scans that need every entry.

    ``Rdict.keys/values`` cost a fraction of a checked scan's per-entry calls but end
    silently on a damaged block, so a checked scan then re-reads from the last key they
    returned: on intact data it yields that key alone; on a damaged block it meets the
    same error and raises `CorruptStateError`. Any other disagreement falls back to the
    checked scan.
    """
    if isinstance(cf, MemoryTable):
        held_keys, held_values = cf.entries(lower, upper)
        return held_keys, held_values if values else None
    keys: list[bytes] | None
    vals: list[bytes] | None
    try:
        # rocksdict's stub types keys of every mode; a raw-mode family holds bytes only
        keys = cast("list[bytes]", list(cf.keys(from_key=lower, read_opt=_read_options(upper))))
        vals = list(cf.values(from_key=lower, read_opt=_read_options(upper))) if values else None
    except Exception:  # noqa: BLE001 - the checked scan below names the damage
        keys, vals = None, None
    if keys is not None and (vals is None or len(vals) == len(keys)) and _ends_at(
            cf, where, keys[-1] if keys else None, lower, upper, file_paths):
        return keys, vals
    pairs = list(checked_scan(cf, where, lower, upper, file_paths=file_paths))
    return [k for k, _ in pairs], [v for _, v in pairs] if values else None


def checked_copy(cf: Rdict | MemoryTable, where: str, lower: bytes | None,
                 upper: bytes | None, sink: Callable[[bytes, bytes], object], *,
                 file_paths: Mapping[str, str] | None = None) -> int | None:
    """Feed every entry of ``cf`` in [lower, upper) to ``sink(key, value)`` in key order,
    streamed (no lists, no Python-level loop); the number of entries fed.

    ``Rdict.items`` ends silently on a damaged block, like `checked_entries`' fast path,
    so the last key fed is then checked the same way. None when that check disagrees or
    the stream failed: what the sink holds is then incomplete, and the caller starts
    over with `checked_entries`, which raises `CorruptStateError` on a damaged block.
    """
    if isinstance(cf, MemoryTable):
        held_keys, held_values = cf.entries(lower, upper)
        deque(map(sink, held_keys, held_values), maxlen=0)
        return len(held_keys)
    try:
        fed, seen = tee(cf.items(from_key=lower, read_opt=_read_options(upper)))
        # (entries so far, sink's result, (key, value)) of the last entry only
        last = deque(zip(count(1), starmap(sink, fed), seen), maxlen=1)
    except Exception:  # noqa: BLE001 - the caller's checked route names the damage
        return None
    # rocksdict's stub types keys of every mode; a raw-mode family holds bytes only
    n, last_key = (last[0][0], cast("bytes", last[0][2][0])) if last else (0, None)
    return n if _ends_at(cf, where, last_key, lower, upper, file_paths) else None


def _read_options(upper: bytes | None) -> ReadOptions:
    ro = ReadOptions()
    ro.set_verify_checksums(True)  # the default, made explicit: scans must verify blocks
    if upper is not None:
        ro.set_iterate_upper_bound(upper)
    return ro


def _ends_at(cf: Rdict, where: str, last: bytes | None, lower: bytes | None,
             upper: bytes | None, file_paths: Mapping[str, str] | None) -> bool:
    """Whether a checked scan agrees that ``last`` (None: nothing) is the last key of
    [lower, upper): on intact data it reads that key alone; where a fast scan ended on
    a damaged block, it meets the same block and raises `CorruptStateError`."""
    tail = list(checked_scan(cf, where, lower if last is None else last, upper,
                             values=False, file_paths=file_paths))
    return tail == ([] if last is None else [last])


def multi_get(cf: Rdict | MemoryTable, keys: Iterable[bytes]) -> list[bytes | None]:
    """One multi-get of raw values: the stored bytes of each key, None where absent."""
    # a list as it is: the memory backend knows a write of the same list follows the read
    wanted: list[_RdictKey] = keys if isinstance(keys, list) else list(keys)
    # rocksdict's stub types the result as one value; a list of keys gets a list back
    return cast("list[bytes | None]", cf.get(wanted))


def prefix_upper_bound(prefix: bytes) -> bytes:
    """The smallest key above every key starting with ``prefix`` (an iterator's upper bound)."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\xff" * (len(prefix) + 1)
    b[-1] += 1
    return bytes(b)


def earliest_time(backend: KeyedStateBackend, cf_name: str, dom: bytes) -> int | None:
    """Smallest time in a ``kg + domain + time ...`` family (timers, TTL index): one seek
    per key group of the backend."""
    best = None
    r = backend.key_group_range
    for kg in range(r.start, r.end + 1):
        lower = key_group_prefix(kg) + dom
        for k in backend.iter_raw(cf_name, lower=lower, upper=prefix_upper_bound(lower),
                                  values=False):
            t = decode_time(k, 3)
            best = t if best is None else min(best, t)
            break
    return best
