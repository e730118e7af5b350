"""Read every state entry of a checkpoint as plain rows (dump, validation, tests).

A row: ``state``, ``key``, ``user_key`` (map state, else None), ``value`` (decoded;
records and JSON values as objects, lists as lists), ``key_group``, ``subtask``.
Rows come out sorted by subtask, state, RocksDB key order.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from typing import IO

from .backend import KeyedStateBackend
from .checkpoints import CheckpointStore
from .errors import UsageError
from .keygroups import key_group_of_rocks_key
from .metadata import CheckpointMetadata
from .restore import restored_readonly
from .serialization import BytesCodec, decode_list, deserialize_key, split_map_key
from .state import StateDescriptor

DUMP_FORMATS = ("jsonl", "parquet")
STDOUT = "-"  # ``--out -``: jsonl rows to standard output


def descriptors_of(meta: CheckpointMetadata) -> list[StateDescriptor]:
    return [StateDescriptor.from_json(s) for s in meta.states]


def decode_entry(desc: StateDescriptor, rocks_key: bytes, raw: bytes
                 ) -> tuple[str, str | None, object]:
    """(key, user_key, value) of one stored entry; raises SerializationError."""
    body = rocks_key[2:]
    if desc.kind == "map":
        kb, user_key = split_map_key(body)
        key = deserialize_key(kb)
    else:
        key, user_key = deserialize_key(body), None
    if desc.kind == "list":
        value: object = [desc.codec.decode(e) for e in decode_list(raw)]
    else:
        value = desc.codec.decode(raw)
    if isinstance(desc.codec, BytesCodec):  # bytes are not JSON: dump them as hex
        if isinstance(value, bytes):
            value = value.hex()
        elif isinstance(value, list):
            value = [v.hex() if isinstance(v, bytes) else v for v in value]
    return key, user_key, value


def backend_rows(backend: KeyedStateBackend, subtask: int) -> Iterator[dict]:
    for name in sorted(backend.descriptors):
        desc = backend.descriptors[name]
        for rk, raw in backend.iter_raw(name):
            key, user_key, value = decode_entry(desc, rk, raw)
            yield {"state": name, "key": key, "user_key": user_key, "value": value,
                   "key_group": key_group_of_rocks_key(rk), "subtask": subtask}


def checkpoint_rows(store: CheckpointStore, meta: CheckpointMetadata) -> Iterator[dict]:
    descriptors = descriptors_of(meta)
    for handle in meta.subtasks:
        with restored_readonly(store.storage, handle, descriptors, meta.max_parallelism,
                               label=f"subtask {handle.index} of checkpoint "
                                     f"{meta.checkpoint_id}") as be:
            yield from backend_rows(be, handle.index)


def check_dump_target(out: str, fmt: str) -> None:
    """UsageError for a format or target that cannot be written (checked before any work)."""
    if fmt not in DUMP_FORMATS:
        raise UsageError(f"dump format {fmt!r} is unknown; use one of {DUMP_FORMATS}")
    if out == STDOUT and fmt != "jsonl":
        raise UsageError(f"dump format {fmt!r} cannot be written to stdout (--out -); give a "
                         "file name, or use --format jsonl")


def write_dump(rows: Iterator[dict], out: str, fmt: str = "jsonl") -> int:
    """Write rows to ``out`` (``-``: stdout, jsonl only); returns the row count.

    A file is written to a temp file renamed into place at the end, so a scan that
    fails half-way (`CorruptStateError`) leaves no partial dump that looks
    complete. On stdout rows stream as they are read; a failure then ends the
    stream early and the command exits non-zero.
    """
    check_dump_target(out, fmt)
    if out == STDOUT:
        return _write_jsonl(rows, sys.stdout)
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    tmp = f"{out}.tmp-{uuid.uuid4().hex}"
    try:
        count = _write_rows(rows, tmp, fmt)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return count


def _write_jsonl(rows: Iterator[dict], fh: IO[str]) -> int:
    count = 0
    for row in rows:
        fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True))
        fh.write("\n")
        count += 1
    return count


def _write_rows(rows: Iterator[dict], out: str, fmt: str) -> int:
    if fmt == "jsonl":
        with open(out, "w", encoding="utf-8") as fh:
            return _write_jsonl(rows, fh)
    import pyarrow as pa
    import pyarrow.parquet as pq

    count = 0
    cols: dict[str, list] = {k: [] for k in ("state", "key", "user_key", "value", "key_group",
                                             "subtask")}
    for row in rows:
        for k in cols:
            cols[k].append(json.dumps(row[k], sort_keys=True) if k == "value" else row[k])
        count += 1
    table = pa.table({
        "state": pa.array(cols["state"], pa.string()),
        "key": pa.array(cols["key"], pa.string()),
        "user_key": pa.array(cols["user_key"], pa.string()),
        "value": pa.array(cols["value"], pa.string()),
        "key_group": pa.array(cols["key_group"], pa.int32()),
        "subtask": pa.array(cols["subtask"], pa.int32()),
    })
    pq.write_table(table, out)
    return count
