"""Apply a state schema evolution to one restored subtask (eagerly, at restore).

`migrate_backend` runs the `statebackend.state.schema.StateMigration` steps of a plan on
an opened `KeyedStateBackend` (its key-group range only), before the run's logic sees
the state, so every later read, write, snapshot, dump and validation sees one schema:

- every entry of the stored column family ``source`` is read (a checked scan), its
  value decoded with the stored codec (after its stored expiry, with a stored TTL),
  its record fields mapped by name (added fields get their declared default, widened
  ones are converted, removed ones dropped), each declared upgrade above the stored
  version applied in order, and the result encoded with the declared codec;
- with a TTL, each entry keeps its stored expiry, or gets ``now + duration`` when the
  TTL is new or moved to another time domain (``now`` is the run's clock of that
  domain), and the expiry index ``_ttl`` is rewritten for the state's new name; without
  one, stored expiries are dropped with their index entries;
- a renamed state's entries move to the new column family and the old family is
  dropped; a dropped state's family is dropped (its entries stay in older checkpoints).

Writes go in batches of `BATCH` entries. Eager, not lazy: a lazy upgrade would leave
two versions side by side in every later checkpoint, which dump, validation, rescale
and readers without the job's code could not tell apart (bench/bench_migration.py
measures both: docs/evolve-a-job.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeVar

from statebackend.errors import SerializationError, UsageError
from statebackend.state.codecs import (
    TIME_BYTES,
    Codec,
    RecordCodec,
    codec_from_json,
    decode_list,
    domain_byte,
    encode_list,
    encode_time,
)
from statebackend.state.families import TTL_INDEX
from statebackend.state.ttl import StateTtl, index_key_at, parse_index_key, state_tag

if TYPE_CHECKING:
    from statebackend.state.backend import KeyedStateBackend
    from statebackend.state.schema import StateMigration

BATCH = 50_000
VALUE_LIKE = ("value", "map", "reducing", "aggregating")
_T = TypeVar("_T")


@dataclass(frozen=True)
class MigrationReport:
    entries: dict[str, int]      # target state -> entries rewritten
    dropped: tuple[str, ...]     # column families dropped

    def to_json(self) -> dict[str, Any]:
        return {"entries": dict(self.entries), "dropped": list(self.dropped)}


def migrate_backend(backend: KeyedStateBackend, migrations: Sequence[StateMigration],
                    dropped: Sequence[str], now: Mapping[str, int | None]) -> MigrationReport:
    """Rewrite this subtask's entries of each migrated state; drop dropped families.

    ``now``: the run's clock per time domain ("event", "processing"), for new expiries.
    """
    counts: dict[str, int] = {}
    for m in migrations:
        counts[m.target] = _migrate_state(backend, m, now)
    gone = [m.source for m in migrations if m.source != m.target] + list(dropped)
    for name in gone:
        _drop_ttl_index(backend, name)
        backend.drop_column_family(name)
    return MigrationReport(counts, tuple(gone))


def _migrate_state(backend: KeyedStateBackend, m: StateMigration,
                   now: Mapping[str, int | None]) -> int:
    target = backend.descriptors.get(m.target)
    if target is None:
        raise UsageError(f"migration of state {m.target!r}: the backend does not declare it")
    if m.source not in backend.column_families:
        return 0  # nothing stored in this subtask yet
    convert = value_converter(codec_from_json(m.source_codec), target.codec,
                              {u.version: u.fn for u in target.upgrades}, m.upgrades)
    old_ttl = StateTtl.from_json(m.source_ttl) if m.source_ttl else None
    new_ttl: StateTtl | None = target.ttl
    new_expiry = None
    if new_ttl is not None and (m.restamp_ttl or old_ttl is None):
        clock = now.get(new_ttl.time)
        if clock is None:
            raise UsageError(f"state {m.target!r} gets a {new_ttl.time}-time TTL but this "
                             f"run has no {new_ttl.time} time yet: run once more after the "
                             "clock is set, or give the run a logical time")
        new_expiry = encode_time(clock + new_ttl.duration_ms)
    is_list = m.kind == "list"
    if old_ttl is not None and (m.source != m.target or new_ttl is None or new_expiry):
        # the stored index entries name the old state, domain or expiries: they go first
        # (the entries written below are the whole new index of the state)
        _drop_ttl_index(backend, m.source)
    tgt_handle = backend.column_family_handle(m.target)
    index = backend.column_family_handle(TTL_INDEX) if new_ttl is not None else None
    tag = state_tag(m.target)
    domain = _domain(new_ttl)
    count = 0
    # a scan sees the family as it was when it started (RocksDB's implicit snapshot), so
    # rewriting in place while scanning reads every stored entry once
    for chunk in batched(backend.iter_raw(m.source, backend.key_group_range), BATCH):
        wb = backend.write_batch()
        for rk, raw in chunk:
            pieces = decode_list(raw) if is_list else [raw]
            out = []
            for piece in pieces:
                expiry, body = (piece[:TIME_BYTES], piece[TIME_BYTES:]) if old_ttl \
                    else (None, piece)
                encoded = convert(body)
                if new_ttl is not None:
                    stamp = new_expiry if new_expiry is not None else expiry
                    if stamp is None:  # a kept expiry implies a stored TTL (new_expiry above)
                        raise SerializationError(f"state {m.source!r}: no expiry to keep")
                    out.append(stamp + encoded)
                    wb.put(index_key_at(rk, domain, stamp, tag), b"", index)
                else:
                    out.append(encoded)
            wb.put(rk, encode_list(out) if is_list else out[0], tgt_handle)
        backend.write(wb)
        count += len(chunk)
    return count


def value_converter(old_codec: Codec, new_codec: Codec,
                    fns: Mapping[int, Callable[[Any], Any]],
                    versions: Sequence[int]) -> Callable[[bytes], bytes]:
    """``stored codec bytes -> declared codec bytes``: record fields by name (defaults,
    widening), then the upgrades of ``versions`` in order."""
    steps = [fns[v] for v in versions]
    to_new: Callable[[Any], Any] = _unchanged
    if isinstance(old_codec, RecordCodec) and isinstance(new_codec, RecordCodec):
        defaults = new_codec.default_of
        kinds = dict(new_codec.fields)

        def record_to_new(old: dict[str, Any]) -> dict[str, Any]:
            out = {}
            for name, ftype in kinds.items():
                value = old[name] if name in old else defaults[name]
                out[name] = float(value) if ftype.startswith("float") else value
            return out
        to_new = record_to_new

    decode, encode = old_codec.decode, new_codec.encode

    def convert(data: bytes) -> bytes:
        value = to_new(decode(data))
        for step in steps:
            value = step(value)
        try:
            return encode(value)
        except (UsageError, TypeError, ValueError) as exc:
            raise SerializationError(f"a migrated value does not fit the declared codec: "
                                     f"{exc}") from exc

    return convert


def _unchanged(value: Any) -> Any:
    return value


def batched(items: Iterable[_T], n: int) -> Iterator[list[_T]]:
    """Lists of ``n`` items (the last may be shorter): itertools.batched of Python 3.12."""
    it = iter(items)
    while chunk := list(islice(it, n)):
        yield chunk


def _domain(ttl: StateTtl | None) -> bytes:
    return domain_byte(ttl.time) if ttl is not None else b""


def _drop_ttl_index(backend: KeyedStateBackend, state: str) -> None:
    """Delete every index entry of ``state`` in this subtask (a scan of the index)."""
    if TTL_INDEX not in backend.column_families:
        return
    index = backend.column_family_handle(TTL_INDEX)
    wb = backend.write_batch()
    n = 0
    for ik in backend.iter_raw(TTL_INDEX, backend.key_group_range, values=False):
        if parse_index_key(ik).state == state:
            wb.delete(ik, index)
            n += 1
    if n:
        backend.write(wb)
