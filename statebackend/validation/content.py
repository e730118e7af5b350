"""Content-level (``--deep``) tables: restore each subtask read-only and read it all.

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
  stored 2-byte prefix), computed_key_group (murmur3 of the key bytes mod M),
  range_start/range_end (the subtask's), prefix_ok, in_range, decodes, decode_error;
- ``counts``: one row per (subtask, state): recorded_rows (metadata) vs counted_rows;
- ``frames``: per state with job checks, the decoded entries (record fields as
  columns, else a ``value`` column) for the job's own expectations.

Built column-wise: one pass over RocksDB per column family, murmur3 in a tight
loop, record values decoded in bulk with `RecordCodec.decode_columns`.
"""

from __future__ import annotations

import operator
import os
import shutil
import tempfile
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat

import mmh3
import numpy as np
import pandas as pd

from ..backend import DB_DIR, KeyedStateBackend
from ..errors import CkptError, StorageError
from ..keygroups import KeyGroupRange
from ..metadata import CheckpointMetadata, FileRef, SubtaskHandle
from ..serialization import RECORD_FORMAT, RecordCodec, decode_list, split_map_key
from ..state import StateDescriptor
from ..storage import Storage
from .manifest import FileFacts, recorded_algorithm

DOWNLOAD_THREADS = 4
STATE_COLUMNS = ["subtask", "state", "key", "user_key", "key_group", "computed_key_group",
                 "range_start", "range_end", "prefix_ok", "in_range", "decodes", "decode_error"]


@dataclass
class ContentTables:
    restore: pd.DataFrame
    state: pd.DataFrame
    counts: pd.DataFrame
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

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return dict(zip([f.path for f in files], pool.map(fetch, files), strict=True))


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


def _record_columns(codec: RecordCodec, values: list[bytes]) -> dict | None:
    """Bulk decode when every value has the record's size and format byte, else None."""
    dtype = codec.dtype
    if values and set(map(len, values)) != {dtype.itemsize}:
        return None
    arr = np.frombuffer(b"".join(values), dtype=dtype)
    if len(arr) and not (arr["_format"] == RECORD_FORMAT).all():
        return None
    return {name: arr[name] for name in codec.names}


def _decode_values(desc: StateDescriptor, values: list[bytes]) -> tuple[list, dict | None]:
    """(error or None per value, record columns of the values when the codec is a record)."""
    codec = desc.codec
    n = len(values)
    if isinstance(codec, RecordCodec) and desc.kind != "list":
        cols = _record_columns(codec, values)
        if cols is not None:
            return [None] * n, cols
        errors = []
        for v in values:
            try:
                codec.decode(v)
                errors.append(None)
            except CkptError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        ok = [v if e is None else None for v, e in zip(values, errors, strict=True)]
        _, cols = codec.decode_columns(ok)
        return errors, cols
    errors = []
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


def state_rows(backend: KeyedStateBackend, desc: StateDescriptor, subtask: int,
               max_parallelism: int, keep_frame: bool) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The state-table rows of one column family (and the job-check frame if asked)."""
    rks: list[bytes] = []
    values: list[bytes] = []
    add_key, add_value = rks.append, values.append
    # One checked pass (raises CorruptStateError if RocksDB stops the scan on an error).
    for k, v in backend.iter_raw(desc.name):
        add_key(k)
        add_value(v)
    n = len(rks)
    short = [i for i, k in enumerate(rks) if len(k) < 2] if n and min(map(len, rks)) < 2 else []
    if short:
        rks = [k if len(k) >= 2 else k.rjust(2, b"\x00") for k in rks]
    stored = np.frombuffer(b"".join(map(_PREFIX, rks)), dtype=">u2").astype(np.int32)
    hashed, keys, user_keys, key_errors = _decode_keys(list(map(_BODY, rks)), desc.kind == "map")
    del rks
    hashes = np.fromiter(map(mmh3.hash, hashed, repeat(0, n), repeat(False, n)),
                         dtype=np.uint32, count=n)
    computed = (hashes % np.uint32(max_parallelism)).astype(np.int32)
    r: KeyGroupRange = backend.key_group_range
    value_errors, record_cols = _decode_values(desc, values)
    if not any(key_errors) and not any(value_errors) and not short:
        errors: list = [None] * n
        decodes = np.ones(n, dtype=bool)
    else:
        errors = [ke or ve for ke, ve in zip(key_errors, value_errors, strict=True)]
        for i in short:
            errors[i] = errors[i] or "stored key is shorter than its 2-byte key-group prefix"
        decodes = np.fromiter((e is None for e in errors), dtype=bool, count=n)
    df = pd.DataFrame({
        "subtask": np.full(n, subtask, dtype=np.int32),
        "state": pd.Series([desc.name] * n, dtype=object),
        "key": pd.Series(keys, dtype=object),
        "user_key": pd.Series(user_keys, dtype=object),
        "key_group": stored,
        "computed_key_group": computed,
        "range_start": np.full(n, r.start, dtype=np.int32),
        "range_end": np.full(n, r.end, dtype=np.int32),
        "prefix_ok": stored == computed,
        "in_range": (stored >= r.start) & (stored <= r.end)
                    & (computed >= r.start) & (computed <= r.end),
        "decodes": decodes,
        "decode_error": pd.Series(errors, dtype=object),
    }, columns=STATE_COLUMNS)
    frame = None
    if keep_frame:
        base = {"subtask": df["subtask"], "key": df["key"], "user_key": df["user_key"],
                "key_group": df["key_group"]}
        if record_cols is not None:
            base.update(record_cols)
        else:
            decoded = []
            for v, ok in zip(values, decodes, strict=True):
                decoded.append(_decode_one(desc, v) if ok else None)
            base["value"] = pd.Series(decoded, dtype=object)
        frame = pd.DataFrame(base)[decodes]
    return df, frame


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


def build_content(storage: Storage, meta: CheckpointMetadata, *,
                  frame_states: Collection[str] = (), work_dir: str | None = None
                  ) -> ContentTables:
    """Restore every subtask read-only (one at a time) and build the content tables."""
    descriptors = [StateDescriptor.from_json(s) for s in meta.states]
    m = meta.max_parallelism
    restore_rows, parts, count_rows = [], [], []
    frames: dict[str, list[pd.DataFrame]] = {}
    all_facts: dict[str, FileFacts] = {}
    for handle in meta.subtasks:
        tmp = tempfile.mkdtemp(prefix=f"ckpt-validate-{handle.index}-", dir=work_dir)
        counted: dict[str, int] = {}
        error = None
        try:
            facts = download_checked(storage, handle.files, os.path.join(tmp, DB_DIR))
            all_facts.update(facts)
            bad = _bad_files(handle, facts)
            if bad:
                error = f"not opened: {len(bad)} damaged file(s): " + "; ".join(bad[:3])
            else:
                with KeyedStateBackend(tmp, descriptors, m, handle.key_group_range,
                                       backend_id=handle.backend_id, read_only=True,
                                       label=f"subtask {handle.index} of checkpoint "
                                             f"{meta.checkpoint_id}") as backend:
                    backend.file_paths = {f.local_name: f.path for f in handle.files}
                    for desc in descriptors:
                        df, frame = state_rows(backend, desc, handle.index, m,
                                               desc.name in frame_states)
                        counted[desc.name] = len(df)
                        parts.append(df)
                        if frame is not None:
                            frames.setdefault(desc.name, []).append(frame)
        except Exception as exc:  # noqa: BLE001 - a damaged subtask is a finding, not a crash
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        restore_rows.append({"subtask": handle.index, "restored": error is None,
                             "restore_error": error or ""})
        if error is None:
            for desc in descriptors:
                count_rows.append({
                    "subtask": handle.index, "state": desc.name,
                    "recorded_rows": handle.row_counts.get(desc.name),
                    "counted_rows": counted.get(desc.name, 0)})
    for row in count_rows:
        # None (not recorded: a snapshot taken with count_rows=False) is skipped by GE
        rec = row["recorded_rows"]
        row["counts_ok"] = None if rec is None else rec == row["counted_rows"]
    state = (pd.concat(parts, ignore_index=True) if parts
             else pd.DataFrame({c: pd.Series(dtype=object) for c in STATE_COLUMNS}))
    counts = pd.DataFrame(count_rows, columns=["subtask", "state", "recorded_rows",
                                               "counted_rows", "counts_ok"])
    counts["counts_ok"] = counts["counts_ok"].astype(object)
    counts["recorded_rows"] = counts["recorded_rows"].astype(object)
    return ContentTables(
        restore=pd.DataFrame(restore_rows, columns=["subtask", "restored", "restore_error"]),
        state=state,
        counts=counts,
        frames={k: pd.concat(v, ignore_index=True) for k, v in frames.items()},
        facts=all_facts, rows=len(state))
