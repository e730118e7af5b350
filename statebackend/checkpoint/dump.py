"""Read every state entry of a checkpoint as plain rows (dump, validation, tests).

A row: ``state``, ``key``, ``user_key`` (map state, else None), ``value`` (decoded;
records and JSON values as objects, lists as lists), ``key_group``, ``subtask``.
Rows come out sorted by subtask, state, RocksDB key order.

States with a TTL show their stored value (the expiry prefix removed; entries not
yet purged included). Internal column families: ``_timers`` rows have the timer's
key, ``user_key`` = its tag (None if empty) and ``value`` = ``{"kind": "event" |
"processing", "time": epoch ms}``; ``_ttl`` rows have the entry's key (and user key)
and ``value`` = ``{"state", "time", "expiry"}``. ``_timer_keys`` (the reverse lookup
of ``_timers``, the same timers again) is not dumped.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any, Literal, TypeAlias, TypedDict

from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskHandle
from statebackend.checkpoint.restore import RestoreOptions, external_read, restored_readonly
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import UsageError
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.codecs import (
    TIME_BYTES,
    BytesCodec,
    decode_list,
    deserialize_key,
    split_map_key,
)
from statebackend.state.external_store import ExternalStore
from statebackend.state.families import TIMER_KEYS
from statebackend.state.keygroups import key_group_of_rocks_key
from statebackend.state.kinds import StateDescriptor
from statebackend.state.timers import parse_timer_key
from statebackend.state.ttl import parse_index_key

if TYPE_CHECKING:
    import pyarrow as pa

DUMP_FORMATS = ("jsonl", "parquet")
STDOUT = "-"  # ``--out -``: jsonl rows to standard output

DumpColumn: TypeAlias = Literal["state", "key", "user_key", "value", "key_group", "subtask"]
DUMP_COLUMNS: tuple[DumpColumn, ...] = ("state", "key", "user_key", "value", "key_group",
                                        "subtask")


class DumpRow(TypedDict):
    """One state entry (module doc)."""

    state: str
    key: str
    user_key: str | None
    value: Any  # decoded, JSON-able: what the state's codec stored
    key_group: int
    subtask: int


def descriptors_of(meta: CheckpointMetadata) -> list[StateDescriptor]:
    return [StateDescriptor.from_json(s) for s in meta.states]


def split_body(body: bytes, kind: str) -> tuple[str, str | None]:
    """(key, user_key) of a stored key without its key-group prefix."""
    if kind == "map":
        kb, user_key = split_map_key(body)
        return deserialize_key(kb), user_key
    return deserialize_key(body), None


def decode_entry(desc: StateDescriptor, rocks_key: bytes, raw: bytes,
                 kinds: dict[str, str] | None = None) -> tuple[str, str | None, object]:
    """(key, user_key, value) of one stored entry; raises SerializationError.

    ``kinds`` (state name -> kind) tells how the keys named by ``_ttl`` entries split.
    """
    if desc.kind == "timers":
        t = parse_timer_key(rocks_key)
        return t.key, t.tag or None, {"kind": t.domain, "time": t.time}
    if desc.kind == "ttl_index":
        ent = parse_index_key(rocks_key)
        key, user_key = split_body(ent.body, (kinds or {}).get(ent.state, "value"))
        return key, user_key, {"state": ent.state, "time": ent.domain, "expiry": ent.expiry}
    key, user_key = split_body(rocks_key[2:], desc.kind)
    strip = TIME_BYTES if desc.ttl is not None else 0  # the entry's expiry, not its value
    if desc.kind == "list":
        value: object = [desc.codec.decode(e[strip:]) for e in decode_list(raw)]
    else:
        value = desc.codec.decode(raw[strip:])
    if isinstance(desc.codec, BytesCodec):  # bytes are not JSON: dump them as hex
        if isinstance(value, bytes):
            value = value.hex()
        elif isinstance(value, list):
            value = [v.hex() if isinstance(v, bytes) else v for v in value]
    return key, user_key, value


def backend_rows(backend: KeyedStateBackend, subtask: int) -> Iterator[DumpRow]:
    for name in sorted(backend.descriptors):
        if name != TIMER_KEYS:
            yield from state_rows(backend, name, subtask)


def state_rows(backend: KeyedStateBackend, name: str, subtask: int) -> Iterator[DumpRow]:
    """The rows of state ``name`` of ``backend``."""
    kinds = {n: d.kind for n, d in backend.descriptors.items()}
    desc = backend.descriptors[name]
    for rk, raw in backend.iter_raw(name):
        key, user_key, value = decode_entry(desc, rk, raw, kinds)
        yield {"state": name, "key": key, "user_key": user_key, "value": value,
               "key_group": key_group_of_rocks_key(rk), "subtask": subtask}


def checkpoint_rows(store: CheckpointStore, meta: CheckpointMetadata,
                    state_db: ExternalStore | None = None) -> Iterator[DumpRow]:
    """Every entry of ``meta`` (``state_db``: an external-backend checkpoint's database)."""
    for handle, backend in restored_subtasks(store, meta, state_db):
        yield from backend_rows(backend, handle.index)


def restored_subtasks(store: CheckpointStore, meta: CheckpointMetadata,
                      state_db: ExternalStore | None = None
                      ) -> Iterator[tuple[SubtaskHandle, KeyedStateBackend]]:
    """Each subtask of ``meta`` restored read-only in turn, open while the caller reads
    it (removed when the next one is restored)."""
    descriptors = descriptors_of(meta)
    external = external_read(meta, state_db)
    for handle in meta.subtasks:
        label = f"subtask {handle.index} of checkpoint {meta.checkpoint_id}"
        with restored_readonly(store.storage, handle, descriptors, meta.max_parallelism,
                               options=RestoreOptions(label=label, external=external)) as be:
            yield handle, be


def check_dump_target(out: str, fmt: str) -> None:
    """UsageError for a format or target that cannot be written (checked before any work)."""
    if fmt not in DUMP_FORMATS:
        raise UsageError(f"dump format {fmt!r} is unknown; use one of {DUMP_FORMATS}")
    if out == STDOUT and fmt != "jsonl":
        raise UsageError(f"dump format {fmt!r} cannot be written to stdout (--out -); give a "
                         "file name, or use --format jsonl")


def write_dump(rows: Iterator[DumpRow], out: str, fmt: str = "jsonl") -> int:
    """Write rows to ``out`` (``-``: stdout, jsonl only); returns the row count.

    A file is written to a temp file renamed into place at the end, so a scan that
    fails half-way (`CorruptStateError`) leaves no partial dump that looks
    complete. On stdout rows stream as they are read; a failure then ends the
    stream early and the command exits non-zero.
    """
    check_dump_target(out, fmt)
    if fmt == "jsonl":
        return write_lines(([json_line(row)] for row in rows), out)
    return _atomically(out, lambda tmp: _write_parquet(rows, tmp))


def json_line(row: DumpRow) -> str:
    """A row of a JSON-lines dump (`dump_columns.json_lines` builds the same column-wise)."""
    return json.dumps(row, ensure_ascii=False, sort_keys=True)


def write_lines(parts: Iterable[Sequence[str]], out: str) -> int:
    """Write a JSON-lines dump given as parts of lines (`dump_columns.checkpoint_lines`)
    to ``out``, as `write_dump` does; returns the line count."""
    check_dump_target(out, "jsonl")
    if out == STDOUT:
        return _write_parts(parts, sys.stdout)

    def write(tmp: str) -> int:
        with open(tmp, "w", encoding="utf-8") as fh:
            return _write_parts(parts, fh)

    return _atomically(out, write)


def _atomically(out: str, write: Callable[[str], int]) -> int:
    """``write(temp path)``, then the temp file renamed to ``out`` (gone on failure)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    tmp = f"{out}.tmp-{uuid.uuid4().hex}"
    try:
        count = write(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return count


def _write_parts(parts: Iterable[Sequence[str]], fh: IO[str]) -> int:
    count = 0
    for lines in parts:
        if lines:
            fh.write("\n".join(lines))
            fh.write("\n")
            count += len(lines)
    return count


def _write_parquet(rows: Iterator[DumpRow], out: str) -> int:
    import pyarrow.parquet as pq

    table = rows_table(rows)
    pq.write_table(table, out)
    return int(table.num_rows)


def rows_table(rows: Iterable[DumpRow], ensure_ascii: bool = True) -> pa.Table:
    """Dump rows as the Arrow table of a Parquet dump (``value`` as JSON text, written
    with ``ensure_ascii`` as json.dumps takes it)."""
    import pyarrow as pa  # Arrow only for a Parquet dump

    cols: dict[DumpColumn, list[Any]] = {k: [] for k in DUMP_COLUMNS}
    for row in rows:
        for k in DUMP_COLUMNS:
            cols[k].append(json.dumps(row[k], sort_keys=True, ensure_ascii=ensure_ascii)
                           if k == "value" else row[k])
    return pa.table({
        "state": pa.array(cols["state"], pa.string()),
        "key": pa.array(cols["key"], pa.string()),
        "user_key": pa.array(cols["user_key"], pa.string()),
        "value": pa.array(cols["value"], pa.string()),
        "key_group": pa.array(cols["key_group"], pa.int32()),
        "subtask": pa.array(cols["subtask"], pa.int32()),
    })
