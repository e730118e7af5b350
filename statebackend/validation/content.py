"""Content-level tables (``--deep``, ``--full``): restore each subtask read-only and read it.

``build_content(storage, meta, ContentOptions(sample=None))`` (the ``full`` level) reads
every entry; ``sample=N`` (the ``deep`` level) reads N entries per column family and subtask
(`statebackend.validation.sampling`) and takes the row counts and the key range of
every entry from RocksDB's own facts (the ``families`` table).

Each subtask's files are downloaded into a temp folder (removed after) with the
size and CRC32 of the bytes received, so the manifest's checksum column comes
from the same read; a subtask whose files are missing, truncated or corrupt is
not opened (its failure is already named by the file checks, and RocksDB is never
asked to read a damaged file) and gets a ``restored = False`` row instead. The
checkpoint itself is never modified: downloads only read, and the instance is
opened read-only.

Tables (pandas):

- ``restore``: one row per subtask: restored, restore_error;
- ``state``: one row per stored entry: subtask, state, key, user_key, key_group (the
  stored 2-byte prefix), computed_key_group (the lineage's key hash of the key bytes
  mod M),
  range_start/range_end (the subtask's), prefix_ok, in_range, decodes, decode_error;
  ttl_ok (states with a TTL and the ``_ttl`` index, else None);
- ``families``: one row per (subtask, column family): first and last live key and
  their key groups against the subtask's range (``edges_in_range``), SST files,
  RocksDB's entry count (old versions included) and how the rows were counted;
- ``counts``: one row per (subtask, state): recorded_rows (metadata) vs counted_rows,
  counted_by ("sst properties" when RocksDB's count is exact; at ``deep``, else
  "recorded at snapshot" when the snapshot's count fits RocksDB's facts; else "scan");
- ``frames``: per state with job checks, the decoded entries (record fields as
  columns, else a ``value`` column) for the job's own expectations.

Internal column families (``_timers``, ``_timer_keys``, ``_ttl``) are checked like
states: the key group is computed from the user key stored inside their keys.
TTL agreement (``ttl_ok``): every expiry stored with a TTL entry has its index
entry (else purge would never remove it), and no index entry with ``expiry <=``
the checkpoint's clock (``watermark`` for event-time TTL, ``processing_time`` for
processing-time TTL) points at an entry a read at that clock would still return.
A failure also marks the row ``decodes = False`` with a ``TTL:`` message, so the
``values_decode`` check fails on it.

Built column-wise: one pass over RocksDB per column family, murmur3 in a tight
loop, record values decoded in bulk with `RecordCodec.decode_columns`.
"""

from __future__ import annotations

import operator
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import pandas as pd
import pyarrow as pa

from statebackend.checkpoint.metadata import CheckpointMetadata, FileRef, SubtaskHandle
from statebackend.checkpoint.restore import RestoreOptions, restored_readonly
from statebackend.errors import CkptError, SerializationError, StorageError
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.state import facts as facts_
from statebackend.state.backend import KeyedStateBackend, StoredInstance
from statebackend.state.backend_kinds import BACKEND_CLASSES
from statebackend.state.codecs import (
    RECORD_FORMAT,
    TIME_BYTES,
    RecordCodec,
    decode_list,
    deserialize_key,
    domain_byte,
    encode_list,
    split_map_key,
)
from statebackend.state.external_store import ExternalRead
from statebackend.state.families import TTL_INDEX
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.keygroups_bulk import key_groups
from statebackend.state.kinds import StateDescriptor
from statebackend.state.state_table import binary_buffers, strip_prefix
from statebackend.state.timers import key_bytes_of, parse_reverse_key, parse_timer_key
from statebackend.state.ttl import (
    index_key,
    parse_index_key,
    state_tag,
    stored_expiries,
    strip_list,
    strip_value,
)
from statebackend.storage import Storage
from statebackend.validation import sampling
from statebackend.validation.manifest import FileFacts, recorded_algorithm

DOWNLOAD_THREADS = 4
# Subtasks checked at once at the ``deep`` level: downloads, file removal and RocksDB's
# reads overlap (1M keys, P=4: 0.077 s with 2 threads vs 0.083 s with 1, best of 4).
# The ``full`` level is bound by Python work under the GIL: 2 threads were slower
# (2.61 s vs 2.26 s), so it checks one subtask at a time.
SUBTASK_THREADS = 2
# ``counted_by`` of a deep count taken from the snapshot's row_counts (`sampling`)
RECORDED = "recorded at snapshot"
STATE_COLUMNS = ["subtask", "state", "key", "user_key", "key_group", "computed_key_group",
                 "range_start", "range_end", "prefix_ok", "in_range", "decodes", "decode_error",
                 "ttl_ok"]
# one column of the ``state`` table: a NumPy array (``key``: an Arrow string array)
Column: TypeAlias = np.ndarray | pa.Array
StateColumns: TypeAlias = dict[str, Column]  # STATE_COLUMNS of one column family

FAMILY_COLUMNS = ["subtask", "state", "first_key", "last_key", "first_key_group",
                  "last_key_group", "range_start", "range_end", "edges_in_range", "sst_files",
                  "stored_entries", "counted_by"]


@dataclass
class ContentTables:
    restore: pd.DataFrame
    state: pd.DataFrame
    counts: pd.DataFrame
    families: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=FAMILY_COLUMNS))
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    facts: dict[str, FileFacts] = field(default_factory=dict)
    rows: int = 0


def download_checked(storage: Storage, files: Sequence[FileRef], target: str,
                     threads: int = DOWNLOAD_THREADS) -> dict[str, FileFacts]:
    """Download every file; return the facts of the bytes received (never raises on data)."""
    os.makedirs(target, exist_ok=True)

    def fetch(ref: FileRef) -> FileFacts:
        try:
            size, checksum = storage.get_file(ref.path, os.path.join(target, ref.local_name),
                                              recorded_algorithm(ref.checksum))
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return FileFacts(exists=False)
            raise
        return FileFacts(exists=True, size=size, checksum=checksum)

    return dict(zip([f.path for f in files], storage.map_requests(fetch, files, max(1, threads)),
                    strict=True))


_PREFIX = operator.itemgetter(slice(0, 2))
_BODY = operator.itemgetter(slice(2, None))


def _decode_keys(bodies: list[bytes], is_map: bool) -> tuple[list, list, list, list]:
    """(hash input bytes, key, user_key, key error) per entry."""
    n = len(bodies)
    if not is_map:
        try:
            keys = list(map(bytes.decode, bodies))
            return bodies, keys, [None] * n, [None] * n
        except UnicodeDecodeError:
            pass
    hashed, keys, user_keys, errors = [], [], [], []
    for body in bodies:
        try:
            if is_map:
                kb, uk = split_map_key(body)
            else:
                kb, uk = body, None
            key, err = kb.decode("utf-8"), None
        except (CkptError, UnicodeDecodeError) as exc:
            kb = body[4:] if is_map else body
            key, uk, err = body[:64].hex(), None, f"key does not decode: {exc}"
        hashed.append(kb)
        keys.append(key)
        user_keys.append(uk)
        errors.append(err)
    return hashed, keys, user_keys, errors


def _decode_internal_keys(rks: list[bytes], kind: str, kinds: dict[str, str]
                          ) -> tuple[list, list, list, list]:
    """(hash input bytes, key, user_key, key error) per entry of an internal column family."""
    hashed, keys, user_keys, errors = [], [], [], []
    for rk in rks:
        try:
            if kind == "timers":
                t = parse_timer_key(rk)
                kb, key, uk = key_bytes_of(rk, kind), t.key, t.tag or None
            elif kind == "timer_keys":
                t = parse_reverse_key(rk)
                kb, key, uk = key_bytes_of(rk, kind), t.key, t.tag or None
            else:
                ent = parse_index_key(rk)
                if kinds.get(ent.state) == "map":
                    kb, uk = split_map_key(ent.body)
                else:
                    kb, uk = ent.body, None
                key = deserialize_key(kb)
            err = None
        except CkptError as exc:
            kb, key, uk, err = rk[2:], rk[:64].hex(), None, f"key does not decode: {exc}"
        hashed.append(kb)
        keys.append(key)
        user_keys.append(uk)
        errors.append(err)
    return hashed, keys, user_keys, errors


def _strip_ttl(desc: StateDescriptor, values: list[bytes]
               ) -> tuple[list[bytes], list[str | None]]:
    """Values of a TTL state without their expiries (what the codec reads), and errors."""
    out: list[bytes] = []
    errors: list[str | None] = []
    for v in values:
        try:
            if desc.kind == "list":
                stripped = b"" if not v else strip_list(v, None) or b""
                if any(len(e) < TIME_BYTES for e in decode_list(v)):
                    raise CkptError("a list element is shorter than its 8-byte expiry")
            else:
                if len(v) < TIME_BYTES:
                    raise CkptError("value is shorter than its 8-byte expiry")
                stripped = strip_value(v, None) or b""  # None only for an absent value
            out.append(stripped)
            errors.append(None)
        except CkptError as exc:
            out.append(encode_list(()) if desc.kind == "list" else v)
            errors.append(f"TTL value does not decode: {exc}")
    return out, errors


def ttl_findings(backend: KeyedStateBackend, descriptors: Sequence[StateDescriptor],
                 clocks: dict[str, int | None],
                 sampled: Mapping[str, tuple[list[bytes], list[bytes]]] | None = None,
                 ) -> dict[tuple[str, bytes], str]:
    """{(column family, stored key): failure} of the TTL agreement checks (module doc).

    ``sampled``: the entries read per column family at the ``deep`` level; the checks
    then run on them (an index entry is looked up by its key instead of a full index
    scan). None: every entry."""
    ttl_descs = {d.name: d for d in descriptors if d.ttl is not None}
    ttl_time = {d.name: d.ttl.time for d in descriptors if d.ttl is not None}  # time domain
    findings: dict[tuple[str, bytes], str] = {}
    has_index = TTL_INDEX in backend.column_families
    index_cf = backend.column_family(TTL_INDEX) if has_index else None
    if sampled is None:
        index_keys: Iterable[bytes] = backend.iter_raw(TTL_INDEX, values=False) \
            if has_index else ()
    else:
        index_keys = sampled.get(TTL_INDEX, ([], []))[0]
    index: dict[tuple[str, bytes], set[int]] = {}
    for ik in index_keys:
        try:
            ent = parse_index_key(ik)
        except CkptError:
            continue  # reported by the row's key decoding
        if ent.state not in ttl_descs:
            findings[(TTL_INDEX, ik)] = (f"TTL: index entry names state {ent.state!r}, "
                                         "which has no TTL")
            continue
        index.setdefault((ent.state, ent.rocks_key), set()).add(ent.expiry)
    for name, desc in ttl_descs.items():
        entries = backend.iter_raw(name) if sampled is None else \
            zip(*sampled.get(name, ([], [])), strict=True)
        for rk, raw in entries:
            try:
                exps = stored_expiries(raw, desc.kind == "list")
            except CkptError:
                continue  # reported as a value that does not decode
            if sampled is None:
                missing = exps - index.get((name, rk), set())
            else:
                tag, domain = state_tag(name), domain_byte(ttl_time[name])
                missing = {e for e in exps if index_cf is None
                           or index_cf.get(index_key(rk, domain, e, tag)) is None}
            if missing:
                findings[(name, rk)] = (f"TTL: stored expiry {min(missing)} has no entry in the "
                                        f"{TTL_INDEX} index: purge would never remove it")
    for (name, rk), exps in index.items():
        desc, time = ttl_descs[name], ttl_time[name]
        now = clocks.get(time)
        due = sorted(e for e in exps if now is not None and e <= now)
        if not due:
            continue
        stored: bytes | None = backend.column_family(name).get(rk)
        if stored is None:
            continue  # the index points at no entry: a read returns nothing
        strip = strip_list if desc.kind == "list" else strip_value
        try:
            readable = strip(stored, now) is not None
        except CkptError:
            continue
        if readable:
            msg = (f"TTL: the index says this {name!r} entry expired at {due[0]} <= the "
                   f"checkpoint's {time} time {now}, but a read at {now} still returns "
                   f"it (stored expiries {sorted(stored_expiries(raw, desc.kind == 'list'))})")
            ik = index_key(rk, domain_byte(time), due[0], state_tag(name))
            findings[(TTL_INDEX, ik)] = msg
            findings.setdefault((name, rk), msg)
    return findings


def _record_columns(codec: RecordCodec, values: list[bytes]) -> dict | None:
    """Bulk decode when every value has the record's size and format byte, else None."""
    dtype = codec.dtype
    offsets, data = binary_buffers(pa.array(values, pa.large_binary()))
    if (np.diff(offsets) != dtype.itemsize).any():
        return None
    arr = data.view(dtype)
    if len(arr) and not (arr["_format"] == RECORD_FORMAT).all():
        return None
    return {name: arr[name] for name in codec.names}


def _decode_values(desc: StateDescriptor, values: list[bytes]
                   ) -> tuple[list[str | None], dict | None]:
    """(error or None per value, record columns of the values when the codec is a record)."""
    codec = desc.codec
    n = len(values)
    errors: list[str | None] = []
    if isinstance(codec, RecordCodec) and desc.kind != "list":
        cols = _record_columns(codec, values)
        if cols is not None:
            return [None] * n, cols
        for v in values:
            try:
                codec.decode(v)
                errors.append(None)
            except CkptError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        ok = [v if e is None else None for v, e in zip(values, errors, strict=True)]
        _, cols = codec.decode_columns(ok)
        return errors, cols
    for v in values:
        try:
            if desc.kind == "list":
                for element in decode_list(v):
                    codec.decode(element)
            else:
                codec.decode(v)
            errors.append(None)
        except CkptError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors, None


def _bulk_keys(rks: list[bytes]) -> tuple[np.ndarray, pa.Array] | None:
    """(stored key-group prefixes, keys as strings) of a plain state's stored keys in
    bulk, or None when an entry is malformed (too short, not UTF-8): the per-entry
    path then names it."""
    n = len(rks)
    stored_keys = pa.array(rks, pa.large_binary())
    offsets, data = binary_buffers(stored_keys)
    if n and np.diff(offsets).min() < 2:
        return None
    starts = offsets[:-1]
    stored = (data[starts].astype(np.int32) << 8) | data[starts + 1]
    try:
        keys = strip_prefix(stored_keys, 2, pa.large_string(), "stored key")
    except SerializationError:
        return None
    return stored, keys


@dataclass
class _StoredKeys:
    """The keys of one column family's entries, decoded (`_stored_keys`)."""

    stored: np.ndarray  # the stored 2-byte key-group prefixes
    keys: pa.Array  # the keys as strings (a hex dump where one does not decode)
    hashed: pa.Array  # the bytes murmur3 hashes: the serialized key (binary or string)
    user_keys: list | None = None  # map and timer entries: the user key / tag
    errors: list | None = None  # per entry: why its key does not decode, or None
    short: list[int] = field(default_factory=list)  # entries without a 2-byte prefix


def _stored_keys(backend: KeyedStateBackend, desc: StateDescriptor,
                 rks: list[bytes]) -> _StoredKeys:
    """Decode the stored keys of ``desc``'s entries: in bulk for a plain state's keys,
    else entry by entry (map and internal keys, malformed entries)."""
    bulk = None if desc.internal or desc.kind == "map" else _bulk_keys(rks)
    if bulk is not None:
        stored, key_array = bulk
        return _StoredKeys(stored, key_array, key_array)  # a plain key is its UTF-8 bytes
    short: list[int] = []
    if rks and min(map(len, rks)) < 2:
        short = [i for i, k in enumerate(rks) if len(k) < 2]
        rks = [k if len(k) >= 2 else k.rjust(2, b"\x00") for k in rks]
    stored = np.frombuffer(b"".join(map(_PREFIX, rks)), dtype=">u2").astype(np.int32)
    if desc.internal:
        kinds = {name: d.kind for name, d in backend.descriptors.items()}
        hashed, keys, user_keys, key_errors = _decode_internal_keys(rks, desc.kind, kinds)
    else:
        hashed, keys, user_keys, key_errors = _decode_keys(list(map(_BODY, rks)),
                                                           desc.kind == "map")
    return _StoredKeys(stored, pa.array(keys, type=pa.large_string()),
                       pa.array(hashed, pa.binary()), user_keys,
                       key_errors, short)


def _value_errors(desc: StateDescriptor, values: list[bytes]
                  ) -> tuple[list[bytes], list, dict | None]:
    """(the values as the codec reads them, error or None per value, record columns)."""
    if desc.internal:  # internal entries hold no value
        return values, [None if not v else f"internal {desc.kind} entry holds a value "
                        f"({len(v)} bytes)" for v in values], None
    strip_errors = None
    if desc.ttl is not None:
        values, strip_errors = _strip_ttl(desc, values)
    errors, record_cols = _decode_values(desc, values)
    if strip_errors is not None:
        errors = [se or ve for se, ve in zip(strip_errors, errors, strict=True)]
    return values, errors, record_cols


def _first_errors(n: int, short: list[int], error_columns: list[list]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(decode_error, decodes) per entry: the first error of an entry wins (key, value,
    TTL), then a key too short for its prefix."""
    errors = np.full(n, None, dtype=object)
    if not short and not any(any(e) for e in error_columns):
        return errors, np.ones(n, dtype=bool)
    for column in error_columns:
        for i, e in enumerate(column):
            if e and errors[i] is None:
                errors[i] = e
    for i in short:
        errors[i] = errors[i] or "stored key is shorter than its 2-byte key-group prefix"
    return errors, np.fromiter((e is None for e in errors), dtype=bool, count=n)


def state_rows(backend: KeyedStateBackend, desc: StateDescriptor, subtask: int,
               keep_frame: bool, findings: dict[tuple[str, bytes], str] | None = None,
               entries: tuple[list[bytes], list[bytes]] | None = None,
               ) -> tuple[StateColumns, pd.DataFrame | None]:
    """The state-table columns of one column family (and the job-check frame if asked).

    ``findings``: the TTL failures of the subtask (`ttl_findings`); ``entries``: the
    (keys, values) to check (a sample), else every entry, read here. Columns are NumPy
    arrays (``key``: an Arrow string array); `build_content` joins them into the table.
    """
    # One checked pass (raises CorruptStateError if RocksDB stops the scan on an error).
    rks, values = entries if entries is not None else sampling.read_entries(backend, desc.name)
    n = len(rks)
    keys = _stored_keys(backend, desc, rks)
    ttl_rows = desc.ttl is not None or desc.kind == "ttl_index"
    ttl_errors = [findings.get((desc.name, k)) for k in rks] if ttl_rows and findings \
        else None
    del rks
    computed = key_groups(keys.hashed, backend.max_parallelism,
                          backend.key_hash).astype(np.int32)  # the lineage's key hash
    r: KeyGroupRange = backend.key_group_range
    values, value_errors, record_cols = _value_errors(desc, values)
    errors, decodes = _first_errors(n, keys.short, [e for e in (
        keys.errors, value_errors, ttl_errors) if e is not None])
    if ttl_rows:  # None (not checked) outside TTL states and the TTL index
        ttl_ok = np.ones(n, dtype=bool).astype(object) if ttl_errors is None else \
            np.fromiter((te is None for te in ttl_errors), dtype=bool, count=n).astype(object)
    else:
        ttl_ok = np.full(n, None, dtype=object)
    user_key_column = np.full(n, None, dtype=object)
    if keys.user_keys is not None and any(uk is not None for uk in keys.user_keys):
        user_key_column[:] = keys.user_keys
    stored = keys.stored
    columns: StateColumns = {
        "subtask": np.full(n, subtask, dtype=np.int32),
        "state": _objects(n, desc.name),
        "key": keys.keys,
        "user_key": user_key_column,
        "key_group": stored,
        "computed_key_group": computed,
        "range_start": np.full(n, r.start, dtype=np.int32),
        "range_end": np.full(n, r.end, dtype=np.int32),
        "prefix_ok": stored == computed,
        "in_range": (stored >= r.start) & (stored <= r.end)
                    & (computed >= r.start) & (computed <= r.end),
        "decodes": decodes,
        "decode_error": errors,
        "ttl_ok": ttl_ok,
    }
    frame = _job_frame(desc, columns, values, record_cols) if keep_frame else None
    return columns, frame


def _objects(n: int, value: object) -> np.ndarray:
    """An object column of ``n`` times ``value`` (`np.full` with a str is 15x slower)."""
    out = np.empty(n, dtype=object)
    out[:] = value
    return out


def _job_frame(desc: StateDescriptor, columns: StateColumns, values: list[bytes],
               record_cols: dict | None) -> pd.DataFrame:
    """The decoded entries of one state for the job's own checks (module doc)."""
    decodes = columns["decodes"]
    base = {"subtask": columns["subtask"], "key": _string_series(columns["key"]),
            "user_key": pd.Series(columns["user_key"], dtype=object),
            "key_group": columns["key_group"]}
    if record_cols is not None:
        base.update(record_cols)
    else:
        base["value"] = pd.Series([_decode_one(desc, v) if ok else None
                                   for v, ok in zip(values, decodes, strict=True)],
                                  dtype=object)
    return pd.DataFrame(base)[decodes].reset_index(drop=True)


def _string_series(array: pa.Array | pa.ChunkedArray) -> pd.Series:
    """A pandas string column over Arrow strings (no Python object per value)."""
    return pd.Series(pd.arrays.ArrowStringArray(array), copy=False)


def _state_table(parts: list[StateColumns]) -> pd.DataFrame:
    """One table from the columns of every column family (joined column by column: a
    `pd.concat` of per-family frames checks object columns value by value)."""
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in STATE_COLUMNS})
    data: dict[str, Any] = {}
    for c in STATE_COLUMNS:
        if c != "key":
            joined = np.concatenate([p[c] for p in parts])
            # an object column given as such: pandas would look for dates in 1M values
            data[c] = pd.Series(joined, dtype=object, copy=False) \
                if joined.dtype == object else joined
    data["key"] = pd.arrays.ArrowStringArray(
        pa.chunked_array([p["key"] for p in parts], type=pa.large_string()))
    # ndarrays without a copy: pandas keeps one block per column (no consolidation)
    return pd.DataFrame(data, columns=STATE_COLUMNS, copy=False)


def _decode_one(desc: StateDescriptor, raw: bytes) -> object:
    if desc.kind == "list":
        return [desc.codec.decode(e) for e in decode_list(raw)]
    return desc.codec.decode(raw)


def _bad_files(handle: SubtaskHandle, facts: dict[str, FileFacts]) -> list[str]:
    bad = []
    for ref in handle.files:
        f = facts.get(ref.path) or FileFacts()
        if f.exists is False:
            bad.append(f"{ref.path} is missing")
        elif f.size != ref.size or f.checksum != ref.checksum:
            bad.append(f"{ref.path} has {f.size} bytes {f.checksum}, recorded {ref.size} "
                       f"bytes {ref.checksum}")
    return bad


def _with_due_entries(backend: KeyedStateBackend, declared: Sequence[StateDescriptor],
                      clocks: dict[str, int | None], sample: tuple[list[bytes], list[bytes]]
                      ) -> tuple[list[bytes], list[bytes]]:
    """The ``_ttl`` sample plus every index entry due at the checkpoint's clocks."""
    domains: dict[bytes, int] = {}  # domain byte -> the checkpoint's clock
    for d in declared:
        now = None if d.ttl is None else clocks.get(d.ttl.time)
        if d.ttl is not None and now is not None:
            domains[domain_byte(d.ttl.time)] = now
    if not domains:
        return sample
    entries = dict(zip(*sample, strict=True))
    entries.update(sampling.due_index_entries(backend, domains))
    keys = sorted(entries)
    return keys, [entries[k] for k in keys]


def family_row(subtask: int, name: str, facts: facts_.ColumnFamilyFacts,
               r: KeyGroupRange, counted_by: str) -> dict:
    """One row of the ``families`` table: RocksDB's facts on one column family."""
    first, last = facts_.edge_key_group(facts.first_key), facts_.edge_key_group(facts.last_key)
    return {"subtask": subtask, "state": name,
            "first_key": None if facts.first_key is None else facts.first_key[:64].hex(),
            "last_key": None if facts.last_key is None else facts.last_key[:64].hex(),
            "first_key_group": first, "last_key_group": last,
            "range_start": r.start, "range_end": r.end,
            "edges_in_range": facts_.edges_within(facts, r),
            "sst_files": None if facts.files is None else len(facts.files),
            "stored_entries": facts.entries, "counted_by": counted_by}


@dataclass(frozen=True)
class ContentOptions:
    """How `build_content` reads the subtasks.

    ``sample``: None checks every entry (the ``full`` level); a number runs the
    per-entry checks on at most that many entries per column family and subtask, and
    takes counts and key ranges from RocksDB (`statebackend.validation.sampling`).
    ``seed`` seeds the sample's seek points (default random; one generator per
    subtask, so the sample does not depend on the order the threads run in).
    ``frame_states``: the states whose decoded entries the job's checks read
    (``frames``); ``work_dir``: where subtasks are restored (default: temp folders);
    ``threads``: subtasks checked at once (default `SUBTASK_THREADS` with a sample,
    else 1).
    """

    frame_states: frozenset[str] = frozenset()
    work_dir: str | None = None
    sample: int | None = None
    seed: int | None = None
    threads: int | None = None
    external: ExternalRead | None = None  # an external-backend checkpoint's rows

    def __post_init__(self) -> None:
        object.__setattr__(self, "frame_states", frozenset(self.frame_states))


@dataclass(frozen=True)
class _Scope:
    """What every subtask's check shares."""

    storage: Storage
    meta: CheckpointMetadata
    descriptors: tuple[StateDescriptor, ...]
    options: ContentOptions


@dataclass
class _SubtaskContent:
    """What one subtask contributes to the tables (`_check_subtask`)."""

    restore_row: dict
    parts: list[StateColumns] = field(default_factory=list)
    count_rows: list[dict] = field(default_factory=list)
    family_rows: list[dict] = field(default_factory=list)
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    facts: dict[str, FileFacts] = field(default_factory=dict)
    counted: dict[str, int] = field(default_factory=dict)  # entries per column family
    counted_by: dict[str, str] = field(default_factory=dict)  # "scan" | "sst properties"


def _check_subtask(scope: _Scope, handle: SubtaskHandle, rng: random.Random
                   ) -> _SubtaskContent:
    """Download, open read-only and read one subtask (module doc); never raises on data."""
    tmp = tempfile.mkdtemp(prefix=f"ckpt-validate-{handle.index}-", dir=scope.options.work_dir)
    out = _SubtaskContent(restore_row={})
    error = None
    try:
        error = _open_and_read(scope, handle, tmp, rng, out)
    except Exception as exc:  # noqa: BLE001 - a damaged subtask is a finding, not a crash
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.restore_row = {"subtask": handle.index, "restored": error is None,
                       "restore_error": error or ""}
    if error is not None:  # rows read before the failure stay; no counts (incomplete)
        return out
    for name in dict.fromkeys([d.name for d in scope.descriptors] + list(out.counted)):
        rec = handle.row_counts.get(name)
        counted = out.counted.get(name, 0)
        out.count_rows.append({
            "subtask": handle.index, "state": name, "recorded_rows": rec,
            "counted_rows": counted, "counted_by": out.counted_by.get(name, "scan"),
            # None (not recorded: a snapshot taken with count_rows=False) is skipped by GE
            "counts_ok": None if rec is None else rec == counted})
    return out


def _open_and_read(scope: _Scope, handle: SubtaskHandle, tmp: str, rng: random.Random,
                   out: _SubtaskContent) -> str | None:
    """Download (checked), open read-only in ``tmp`` and read one subtask into ``out``;
    returns why it was not opened (damaged files), None once read."""
    meta = scope.meta
    label = f"subtask {handle.index} of checkpoint {meta.checkpoint_id}"
    if handle.backend == "external":  # rows in a database: nothing to download
        with restored_readonly(scope.storage, handle, scope.descriptors, meta.max_parallelism,
                               tmp, RestoreOptions(label=label,
                                                   external=scope.options.external)) as backend:
            _read_subtask(scope, backend.place_keys_by(meta.key_hash), handle, rng, out)
        return None
    kind = BACKEND_CLASSES[handle.backend]
    out.facts = download_checked(scope.storage, handle.files, os.path.join(tmp, kind.files_dir))
    bad = _bad_files(handle, out.facts)
    if bad:
        return f"not opened: {len(bad)} damaged file(s): " + "; ".join(bad[:3])
    origin = StoredInstance(handle.backend_id, label,
                            {f.local_name: f.path for f in handle.files},
                            file_key_groups=handle.file_key_groups)
    with kind(tmp, scope.descriptors, meta.max_parallelism, handle.key_group_range,
              read_only=True, origin=origin) as backend:
        _read_subtask(scope, backend.place_keys_by(meta.key_hash), handle, rng, out)
    return None


def _read_subtask(scope: _Scope, backend: KeyedStateBackend, handle: SubtaskHandle,
                  rng: random.Random, out: _SubtaskContent) -> None:
    """Every column family of the opened subtask into ``out``: RocksDB's facts, the TTL
    agreement, then the state rows (of the sample, or of every entry)."""
    # the backend adds the internal families it holds (e.g. ``_ttl``) even when a
    # record lists only the job's states
    declared = list(backend.descriptors.values())
    clocks = {"event": scope.meta.watermark, "processing": scope.meta.processing_time}
    subtask = handle.index
    sampled = _family_facts(backend, subtask, handle.row_counts, scope.options.sample, rng,
                            out)
    if sampled is not None and TTL_INDEX in sampled:
        sampled[TTL_INDEX] = _with_due_entries(backend, declared, clocks, sampled[TTL_INDEX])
    findings = ttl_findings(backend, declared, clocks, sampled)
    for desc in declared:
        columns, frame = state_rows(backend, desc, subtask,
                                    desc.name in scope.options.frame_states, findings,
                                    None if sampled is None else sampled[desc.name])
        if sampled is None:
            out.counted[desc.name] = len(columns["subtask"])
        out.parts.append(columns)
        if frame is not None:
            out.frames[desc.name] = frame


def _family_facts(backend: KeyedStateBackend, subtask: int, recorded: Mapping[str, int],
                  sample: int | None, rng: random.Random, out: _SubtaskContent
                  ) -> dict[str, tuple[list[bytes], list[bytes]]] | None:
    """RocksDB's facts on each column family (``out.family_rows``); with a ``sample``,
    the sampled (keys, values) per column family, and the counts (``out.counted``):
    exact from the facts when provable, else the snapshot's ``recorded`` count when it
    fits the facts, else a checked keys-only scan."""
    r = backend.key_group_range
    sampled: dict[str, tuple[list[bytes], list[bytes]]] = {}
    for name in backend.descriptors:
        facts = facts_.cf_facts(backend.column_family(name))
        out.counted_by[name] = "scan"
        if sample is not None:
            keys, values, whole = sampling.sample_entries(backend, name, sample, rng,
                                                          facts.entries)
            sampled[name] = (keys, values)
            exact = len(keys) if whole else facts_.exact_count(facts)
            if exact is not None and not whole:
                out.counted_by[name] = "sst properties"
            elif exact is None and facts_.recorded_count_fits(facts, recorded.get(name)):
                exact = recorded[name]
                out.counted_by[name] = RECORDED
            elif exact is None:
                exact = backend.count_keys(name)
            out.counted[name] = exact
        out.family_rows.append(family_row(subtask, name, facts, r, out.counted_by[name]))
    return None if sample is None else sampled


def build_content(storage: Storage, meta: CheckpointMetadata,
                  options: ContentOptions | None = None,
                  progress: ProgressSink = NO_PROGRESS) -> ContentTables:
    """Restore every subtask read-only and build the content tables (`ContentOptions`:
    every entry or a sample, the threads); ``progress`` counts the subtasks checked."""
    options = options or ContentOptions()
    base_seed = random.randrange(2**32) if options.seed is None else options.seed
    scope = _Scope(storage, meta, tuple(StateDescriptor.from_json(s) for s in meta.states),
                   options)

    def check(handle: SubtaskHandle) -> _SubtaskContent:
        return _check_subtask(scope, handle, random.Random(f"{base_seed}-{handle.index}"))

    results: dict[int, _SubtaskContent] = {}
    threads = options.threads
    if threads is None:
        threads = SUBTASK_THREADS if options.sample is not None else 1
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        futures = {pool.submit(check, h): h.index for h in meta.subtasks}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            progress.advance()
    ordered = [results[h.index] for h in meta.subtasks]
    parts = [p for c in ordered for p in c.parts]
    state = _state_table(parts)
    counts = pd.DataFrame([row for c in ordered for row in c.count_rows],
                          columns=["subtask", "state", "recorded_rows", "counted_rows",
                                   "counted_by", "counts_ok"])
    counts["counts_ok"] = counts["counts_ok"].astype(object)
    counts["recorded_rows"] = counts["recorded_rows"].astype(object)
    families = pd.DataFrame([row for c in ordered for row in c.family_rows],
                            columns=FAMILY_COLUMNS)
    families["edges_in_range"] = families["edges_in_range"].astype(object)
    frames: dict[str, list[pd.DataFrame]] = {}
    for c in ordered:
        for name, frame in c.frames.items():
            frames.setdefault(name, []).append(frame)
    return ContentTables(
        restore=pd.DataFrame([c.restore_row for c in ordered],
                             columns=["subtask", "restored", "restore_error"]),
        state=state,
        counts=counts,
        families=families,
        frames={k: pd.concat(v, ignore_index=True) for k, v in frames.items()},
        facts={path: f for c in ordered for path, f in c.facts.items()},
        rows=int(counts["counted_rows"].sum()) if len(counts) else 0)
