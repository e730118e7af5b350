"""Keyed state kinds over RocksDB column families.

One column family per declared state. A RocksDB key is the 2-byte key group
followed by the serialized key (plus the user key for map state, see
serialization). Values are encoded with the state's codec (never pickle).

Every state offers single-key calls and batch calls (``get_many`` /
``put_many`` / ``add_many``) so Spark code can work per Arrow batch: one
multi-get and one WriteBatch per batch instead of one call per row. Reducing
and aggregating states pre-combine the values of a batch per key before the
read-modify-write, so each key costs one read and one write per batch.

A state may declare a TTL (`ttl.StateTtl`): its entries then carry their expiry,
reads never return an expired entry, and writes keep the expiry index ``_ttl``
(see `statebackend.state.ttl`). Without a TTL nothing changes. Internal column families
(timers, the TTL index) are states of internal kinds with reserved names; they
have no state class and are reached through `statebackend.state.timers` / `.ttl`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from statebackend.errors import UsageError
from statebackend.state.codecs import (
    BytesCodec,
    Codec,
    JsonCodec,
    RecordCodec,
    append_list_bytes,
    codec_from_json,
    decode_list,
    encode_list,
    encode_records,
    map_key_suffix,
    split_map_key,
)
from statebackend.state.families import INTERNAL_STATES
from statebackend.state.keygroups import key_group_prefix
from statebackend.state.scan import multi_get, prefix_upper_bound
from statebackend.state.schema import Upgrade, check_upgrades
from statebackend.state.ttl import StateTtl, TtlAccess

if TYPE_CHECKING:
    from statebackend.state.backend import KeyedStateBackend

STATE_KINDS = ("value", "list", "map", "reducing", "aggregating")
# Internal column families (reserved name -> kind): `statebackend.state.families`.


class AggregateFunction(Protocol):
    """Flink-style aggregate: accumulators are stored with the state's codec."""

    def create_accumulator(self) -> Any: ...
    def add(self, value: Any, accumulator: Any) -> Any: ...
    def merge(self, a: Any, b: Any) -> Any: ...
    def get_result(self, accumulator: Any) -> Any: ...


@dataclass(frozen=True)
class StateDescriptor:
    """Declares one state. Functions live in code; only name, kind, codec are stored."""

    name: str
    kind: str = "value"
    codec: Codec = field(default_factory=JsonCodec)
    reduce_fn: Callable[[Any, Any], Any] | None = field(default=None, compare=False)
    aggregate_fn: AggregateFunction | None = field(default=None, compare=False)
    ttl: StateTtl | None = None
    # Declared value upgrades (statebackend.state.schema): code, so not compared.
    upgrades: tuple[Upgrade, ...] = field(default=(), compare=False)

    @property
    def upgrade_version(self) -> int:
        """The version of the values this code writes: the newest declared upgrade, or 0."""
        return max((u.version for u in self.upgrades), default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "upgrades", tuple(self.upgrades))
        if not all(isinstance(u, Upgrade) for u in self.upgrades):
            raise UsageError(f"state {self.name!r}: upgrades must be Upgrade(version, fn) "
                             f"values, got {self.upgrades!r}")
        check_upgrades(self.name, self.upgrades)
        internal = INTERNAL_STATES.get(self.name)
        if self.kind not in STATE_KINDS and self.kind != internal:
            raise UsageError(f"state {self.name!r} has unknown kind {self.kind!r}; "
                             f"use one of {STATE_KINDS}")
        if not self.name or self.name == "default" or "/" in self.name:
            raise UsageError(f"state name {self.name!r} is not allowed")
        if internal is not None and self.kind != internal:
            raise UsageError(f"state name {self.name!r} is reserved for the backend's "
                             f"{internal} column family; choose another name")
        if self.ttl is not None and (internal is not None
                                     or not isinstance(self.ttl, StateTtl)):
            raise UsageError(f"state {self.name!r}: ttl must be a StateTtl on a user state, "
                             f"got {self.ttl!r}")
        if self.kind == "reducing" and self.reduce_fn is None:
            raise UsageError(f"reducing state {self.name!r} needs reduce_fn")
        if self.kind == "aggregating" and self.aggregate_fn is None:
            raise UsageError(f"aggregating state {self.name!r} needs aggregate_fn")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind,
                               "codec": self.codec.to_json()}
        if self.ttl is not None:  # only when declared: records without TTL stay as they were
            out["ttl"] = self.ttl.to_json()
        return out

    @property
    def internal(self) -> bool:
        return self.name in INTERNAL_STATES

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> StateDescriptor:
        """Descriptor for reading stored state (dump, validate, rescale): no functions."""
        kind = data.get("kind", "value")
        desc = object.__new__(StateDescriptor)
        object.__setattr__(desc, "name", data["name"])
        object.__setattr__(desc, "kind", kind)
        object.__setattr__(desc, "codec", codec_from_json(data.get("codec", {"type": "json"})))
        object.__setattr__(desc, "reduce_fn", None)
        object.__setattr__(desc, "aggregate_fn", None)
        object.__setattr__(desc, "upgrades", ())
        ttl = data.get("ttl")
        object.__setattr__(desc, "ttl", None if ttl is None else StateTtl.from_json(ttl))
        if kind not in STATE_KINDS and kind != INTERNAL_STATES.get(desc.name):
            raise UsageError(f"state {desc.name!r} has unknown kind {kind!r}")
        return desc


def same_length(name: str, keys: Sized, values: Sized) -> None:
    """UsageError unless state ``name`` got one value per key."""
    if len(keys) != len(values):
        raise UsageError(f"state {name!r}: {len(keys)} keys but {len(values)} values; "
                         "pass one value per key")


def internal_descriptor(name: str) -> StateDescriptor:
    """Descriptor of a reserved internal column family (values are raw bytes)."""
    return StateDescriptor(name, INTERNAL_STATES[name], BytesCodec())


class _State:
    def __init__(self, backend: KeyedStateBackend, descriptor: StateDescriptor) -> None:
        self.backend = backend
        self.descriptor = descriptor
        self.codec = descriptor.codec
        self.cf = backend.column_family(descriptor.name)
        self.cf_handle = backend.column_family_handle(descriptor.name)
        # None without a TTL: every method then runs its original code path.
        self._ttl = TtlAccess(backend, descriptor) if descriptor.ttl is not None else None
        # (keys, what they held, the backend's write number) of the last `read_raw`:
        # a put of the same keys right after knows which entries it adds (row counts)
        self._last_read: tuple[Sequence[bytes], list[bytes | None], int] | None = None

    def _write(self, pairs: Iterable[tuple[bytes, bytes]], added: int | None = None) -> None:
        """One write batch of ``pairs``; ``added``: the entries it creates, when the
        writer read its keys first (row counts; None: unknown)."""
        self.backend.write_pairs(self.cf_handle, pairs, changes=None if added is None
                                 else {self.descriptor.name: added})

    # Raw batch access on precomputed RocksDB keys: the job API encodes a batch's
    # keys once and shares them between the reads and writes of every state.
    def read_raw(self, rocks_keys: Sequence[bytes]) -> list[bytes | None]:
        """One multi-get of stored bytes (None where absent).

        With a TTL: the bytes a state without TTL would hold, None where expired.
        """
        if self._ttl is not None:
            return self._ttl.read(rocks_keys)
        raws = multi_get(self.cf, rocks_keys)
        self._last_read = (rocks_keys, raws, self.backend.writes)
        return raws

    def put_raw(self, rocks_keys: Sequence[bytes], encoded: Iterable[bytes],
                timestamps: Sequence[int] | int | None = None) -> None:
        """One write batch putting ``encoded`` at ``rocks_keys`` (`write_raw`'s puts).
        When ``read_raw`` just read these very keys (the same list, no write since, no
        key twice), the write tells the backend which entries it adds: the snapshot's
        row counts then need no scan."""
        if self._ttl is not None:
            self._ttl.write(zip(rocks_keys, encoded, strict=True), (), timestamps)
            return
        values = encoded if isinstance(encoded, list) else list(encoded)
        if len(values) != len(rocks_keys):
            raise ValueError(f"{len(rocks_keys)} keys but {len(values)} values")
        last, added = self._last_read, None
        if last is not None and last[0] is rocks_keys and last[2] == self.backend.writes \
                and len(set(rocks_keys)) == len(rocks_keys):
            added = last[1].count(None)
        self.backend.write_columns(self.cf_handle, rocks_keys, values, changes=None
                                   if added is None else {self.descriptor.name: added})

    def write_raw(self, puts: Iterable[tuple[bytes, bytes]],
                  deletes: Iterable[bytes] = (),
                  timestamps: Sequence[int] | int | None = None) -> None:
        """One write batch: ``puts`` (rocks key, encoded value) then ``deletes``.

        ``timestamps`` (TTL states only): the write time per put (or one for all); the
        default is the backend's clock of the TTL's time domain.
        """
        if self._ttl is not None:
            self._ttl.write(puts, deletes, timestamps)
            return
        self.backend.write_pairs(self.cf_handle, puts, deletes)

    def delete(self, key: str) -> None:
        if self._ttl is not None:  # the index entries go too
            self._ttl.write((), [self.backend.rocks_key(key)])
            return
        self.backend.mark_dirty()
        self.cf.delete(self.backend.rocks_key(key))

    def delete_many(self, keys: Sequence[str]) -> None:
        if self._ttl is not None:
            self._ttl.write((), self.backend.rocks_keys(keys))
            return
        self.backend.write_pairs(self.cf_handle, (), self.backend.rocks_keys(keys))


class ValueState(_State):
    def get(self, key: str, default: Any = None) -> Any:
        rk = self.backend.rocks_key(key)
        raw = self.cf.get(rk) if self._ttl is None else self._ttl.read([rk])[0]
        return default if raw is None else self.codec.decode(raw)

    def put(self, key: str, value: Any, timestamp: int | None = None) -> None:
        if self._ttl is not None:
            self.write_raw([(self.backend.rocks_key(key), self.codec.encode(value))],
                           timestamps=timestamp)
            return
        self.backend.mark_dirty()
        self.cf.put(self.backend.rocks_key(key), self.codec.encode(value))

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        decode = self.codec.decode
        return [None if r is None else decode(r) for r in self.get_many_raw(keys)]

    def get_many_raw(self, keys: Sequence[str]) -> list[bytes | None]:
        return self.read_raw(self.backend.rocks_keys(keys))

    def put_many(self, keys: Sequence[str], values: Sequence[Any],
                 timestamps: Sequence[int] | int | None = None) -> None:
        encode = self.codec.encode
        self.put_many_raw(keys, [encode(v) for v in values], timestamps)

    def put_many_raw(self, keys: Sequence[str], encoded: Sequence[bytes],
                     timestamps: Sequence[int] | int | None = None) -> None:
        pairs = zip(self.backend.rocks_keys(keys), encoded, strict=True)
        if self._ttl is not None:
            self._ttl.write(pairs, (), timestamps)
            return
        self._write(pairs)

    def insert_absent_raw(self, rocks_keys: Sequence[bytes], encoded: Sequence[bytes],
                          timestamps: Sequence[int] | int | None = None) -> np.ndarray:
        """Write ``encoded`` where a key holds no (live) value; one multi-get and one write
        batch. Returns the found mask (True: a value existed, nothing written there).
        ``rocks_keys`` must be distinct; ``timestamps`` as for `write_raw` (TTL only)."""
        if self._ttl is not None:
            return self._ttl.insert_absent(rocks_keys, encoded, timestamps)
        same_length(self.descriptor.name, rocks_keys, encoded)
        if len(set(rocks_keys)) != len(rocks_keys):
            raise UsageError(f"state {self.descriptor.name!r}: insert_absent got a key more "
                             "than once; pass each key once (group the batch by key first)")
        old = multi_get(self.cf, rocks_keys) if len(rocks_keys) else []
        found = np.fromiter((o is not None for o in old), dtype=np.bool_, count=len(old))
        self._write([(rk, v) for rk, v, f in zip(rocks_keys, encoded, found, strict=True)
                     if not f], len(found) - int(found.sum()))
        return found

    # Columnar access for record codecs: no per-row dicts.
    def get_columns(self, keys: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return self.read_record_columns(self.backend.rocks_keys(keys))

    def put_columns(self, keys: Sequence[str], columns: Mapping[str, Sequence[Any] | np.ndarray],
                    timestamps: Sequence[int] | int | None = None) -> None:
        self.write_record_columns(self.backend.rocks_keys(keys), columns, timestamps)

    def read_record_columns(self, rocks_keys: list[bytes]
                            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(found mask, one array per record field; zeros where absent) of one multi-get.
        The memory backend's record table answers with its rows, no bytes decoded."""
        codec = self._record_codec()
        if self._ttl is None:
            held = self.backend.read_records(self.cf_handle, rocks_keys, codec.dtype)
            if held is not None:
                found, records = held
                return found, {name: records[name].copy() for name in codec.names}
        return codec.decode_columns(self.read_raw(rocks_keys))

    def write_record_columns(self, rocks_keys: list[bytes],
                             columns: Mapping[str, Sequence[Any] | np.ndarray],
                             timestamps: Sequence[int] | int | None = None) -> None:
        """Put one record per key from one array per field (`write_raw`'s rules)."""
        codec = self._record_codec()
        records = codec.records(columns)
        same_length(self.descriptor.name, rocks_keys, records)
        if self._ttl is None and self.backend.write_records(self.cf_handle, rocks_keys,
                                                            records):
            return
        self.put_raw(rocks_keys, encode_records(records), timestamps)

    def _record_codec(self) -> RecordCodec:
        if not isinstance(self.codec, RecordCodec):
            raise UsageError(f"state {self.descriptor.name!r} does not use a record codec")
        return self.codec

    def _merge_stored(self, batch: dict[str, Any], merge: Callable[[Any, Any], Any],
                      timestamps: Sequence[int] | int | None) -> None:
        """Store, per key of ``batch``, ``merge(stored, batch value)`` (the batch value
        where none is stored): one read and one write of the same keys, so the write
        knows the entries it adds (row counts)."""
        rks = self.backend.rocks_keys(list(batch))
        decode, encode = self.codec.decode, self.codec.encode
        self.put_raw(rks, [encode(b if c is None else merge(decode(c), b))
                           for c, b in zip(self.read_raw(rks), batch.values(), strict=True)],
                     timestamps)


class ReducingState(ValueState):
    """Value combined with ``reduce_fn`` on every add.

    With a TTL, an add is a write: the key's value expires ``duration_ms`` after the
    add's ``timestamp`` (default: the backend's clock); an expired value is not
    combined with (the add starts from the new value). The values of one `add_many`
    call are combined per key first and written once, with the timestamp of the
    key's last value in the call.
    """

    def add(self, key: str, value: Any, timestamp: int | None = None) -> None:
        self.add_many([key], [value], timestamp)

    def add_many(self, keys: Sequence[str], values: Sequence[Any],
                 timestamps: Sequence[int] | int | None = None) -> None:
        """``timestamps`` (TTL states only): one per value, or one for all."""
        reduce_fn = self.descriptor.reduce_fn
        if reduce_fn is None:  # refused by StateDescriptor; read-only descriptors have none
            raise UsageError(f"reducing state {self.descriptor.name!r} has no reduce_fn")
        combined: dict[str, Any] = {}
        for k, v in zip(keys, values, strict=True):
            combined[k] = reduce_fn(combined[k], v) if k in combined else v
        self._merge_stored(combined, reduce_fn,
                           _last_timestamps(self.descriptor.name, keys, timestamps))


def _last_timestamps(state: str, keys: Sequence[str], timestamps: Sequence[int] | int | None
                     ) -> Sequence[int] | int | None:
    """Per distinct key (in first-seen order), the timestamp of its last value; one
    timestamp for all, or None, as given."""
    if timestamps is None or not isinstance(timestamps, Iterable):
        return timestamps
    ts = list(timestamps)
    if len(ts) != len(keys):
        raise UsageError(f"state {state!r}: {len(ts)} timestamps for {len(keys)} values; "
                         "pass one timestamp per value")
    return list(dict(zip(keys, ts, strict=True)).values())


class AggregatingState(ValueState):
    """Stores the accumulator; ``get`` returns the aggregate's result. A TTL applies as
    for `ReducingState`."""

    def get(self, key: str, default: Any = None) -> Any:
        acc = super().get(key)
        return default if acc is None else self._aggregate_fn().get_result(acc)

    def get_accumulator(self, key: str) -> Any:
        return super().get(key)

    def get_many(self, keys: Sequence[str]) -> list[Any]:
        result = self._aggregate_fn().get_result
        return [None if a is None else result(a) for a in super().get_many(keys)]

    def _aggregate_fn(self) -> AggregateFunction:
        fn = self.descriptor.aggregate_fn
        if fn is None:  # refused by StateDescriptor; read-only descriptors have none
            raise UsageError(f"aggregating state {self.descriptor.name!r} has no "
                             "aggregate_fn")
        return fn

    def add(self, key: str, value: Any, timestamp: int | None = None) -> None:
        self.add_many([key], [value], timestamp)

    def add_many(self, keys: Sequence[str], values: Sequence[Any],
                 timestamps: Sequence[int] | int | None = None) -> None:
        """``timestamps`` (TTL states only): one per value, or one for all."""
        fn = self._aggregate_fn()
        batch: dict[str, Any] = {}
        for k, v in zip(keys, values, strict=True):
            batch[k] = fn.add(v, batch[k] if k in batch else fn.create_accumulator())
        self._merge_stored(batch, fn.merge,
                           _last_timestamps(self.descriptor.name, keys, timestamps))


class ListState(_State):
    def get(self, key: str) -> list[Any]:
        rk = self.backend.rocks_key(key)
        raw = self.cf.get(rk) if self._ttl is None else self._ttl.read([rk])[0]
        return [] if raw is None else [self.codec.decode(e) for e in decode_list(raw)]

    def update(self, key: str, values: Sequence[Any], timestamp: int | None = None) -> None:
        encoded = encode_list(self.codec.encode(v) for v in values)
        if self._ttl is not None:  # every element is (re)written: all get the new expiry
            self.write_raw([(self.backend.rocks_key(key), encoded)], timestamps=timestamp)
            return
        self.backend.mark_dirty()
        self.cf.put(self.backend.rocks_key(key), encoded)

    def add(self, key: str, value: Any, timestamp: int | None = None) -> None:
        self.add_many([key], [value], None if timestamp is None else [timestamp])

    def add_many(self, keys: Sequence[str], values: Sequence[Any],
                 timestamps: Sequence[int] | int | None = None) -> None:
        """Append each value to its key's list (one read and one write per key).

        With a TTL each appended element gets its own expiry (``timestamps``: one per
        value, or one for all); the elements already stored keep theirs.
        """
        if self._ttl is not None:
            self._add_many_ttl(keys, values, timestamps)
            return
        appended: dict[str, bytes] = {}
        encode = self.codec.encode
        for k, v in zip(keys, values, strict=True):
            appended[k] = append_list_bytes(appended.get(k), encode(v))
        uniq = list(appended)
        rkeys = self.backend.rocks_keys(uniq)
        current = multi_get(self.cf, rkeys)
        merged = ((c or b"") + appended[k] for c, k in zip(current, uniq, strict=True))
        # the keys were just read: the write knows the lists it creates (row counts)
        self._write(zip(rkeys, merged, strict=True), current.count(None))

    def _add_many_ttl(self, keys: Sequence[str], values: Sequence[Any],
                      timestamps: Sequence[int] | int | None) -> None:
        # each element keeps its own expiry; elements of a key stay in input order
        ttl = self._ttl
        if ttl is None:  # the caller checked
            raise UsageError(f"list state {self.descriptor.name!r} has no TTL")
        expiries = ttl.expiries(timestamps, len(keys))
        per_key: dict[str, list[tuple[bytes, int]]] = {}
        encode = self.codec.encode
        for k, v, e in zip(keys, values, expiries, strict=True):
            per_key.setdefault(k, []).append((encode(v), e))
        ttl.append(self.backend.rocks_keys(list(per_key)), list(per_key.values()))

    def get_many(self, keys: Sequence[str]) -> list[list[Any]]:
        decode = self.codec.decode
        return [[] if r is None else [decode(e) for e in decode_list(r)]
                for r in self.read_raw(self.backend.rocks_keys(keys))]


class MapState(_State):
    def _rkey(self, key: str, user_key: str) -> bytes:
        kg, kb = self.backend.key_group_and_bytes(key)
        return key_group_prefix(kg) + map_key_suffix(kb, user_key)

    def get(self, key: str, user_key: str, default: Any = None) -> Any:
        raw = self.read_raw([self._rkey(key, user_key)])[0]
        return default if raw is None else self.codec.decode(raw)

    def put(self, key: str, user_key: str, value: Any, timestamp: int | None = None) -> None:
        if self._ttl is not None:
            self.write_raw([(self._rkey(key, user_key), self.codec.encode(value))],
                           timestamps=timestamp)
            return
        self.backend.mark_dirty()
        self.cf.put(self._rkey(key, user_key), self.codec.encode(value))

    def remove(self, key: str, user_key: str) -> None:
        if self._ttl is not None:
            self._ttl.write((), [self._rkey(key, user_key)])
            return
        self.backend.mark_dirty()
        self.cf.delete(self._rkey(key, user_key))

    def contains(self, key: str, user_key: str) -> bool:
        return self.read_raw([self._rkey(key, user_key)])[0] is not None

    def put_many(self, entries: Sequence[tuple[str, str, Any]],
                 timestamps: Sequence[int] | int | None = None) -> None:
        encode = self.codec.encode
        pairs = [(self._rkey(k, uk), encode(v)) for k, uk, v in entries]
        if self._ttl is not None:
            self._ttl.write(pairs, (), timestamps)
            return
        self._write(pairs)

    def get_many(self, pairs: Sequence[tuple[str, str]]) -> list[Any]:
        decode = self.codec.decode
        raws = self.read_raw([self._rkey(k, uk) for k, uk in pairs])
        return [None if r is None else decode(r) for r in raws]

    def rocks_keys(self, keys: Sequence[str], user_keys: Sequence[str]) -> list[bytes]:
        """RocksDB keys of (key, user key) pairs, with the key groups hashed in one batch."""
        if len(keys) != len(user_keys):
            raise UsageError(f"map state {self.descriptor.name!r}: {len(keys)} keys but "
                             f"{len(user_keys)} user keys; pass one user key per key")
        return [rk[:2] + map_key_suffix(rk[2:], uk)
                for rk, uk in zip(self.backend.rocks_keys(keys), user_keys, strict=True)]

    def remove_many(self, keys: Sequence[str], user_keys: Sequence[str]) -> None:
        self.write_raw((), self.rocks_keys(keys, user_keys))

    def items(self, key: str) -> Iterator[tuple[str, Any]]:
        kg, kb = self.backend.key_group_and_bytes(key)
        prefix = key_group_prefix(kg) + map_key_suffix(kb, "")
        upper = prefix_upper_bound(prefix)
        decode = self.codec.decode
        live = self._ttl.live if self._ttl is not None else None
        for rk, stored in self.backend.iter_raw(self.descriptor.name, lower=prefix,
                                                upper=upper):
            raw = live([stored])[0] if live is not None else stored
            if raw is None:  # expired: never returned
                continue
            _, user_key = split_map_key(rk[2:])
            yield user_key, decode(raw)

    def keys(self, key: str) -> list[str]:
        return [k for k, _ in self.items(key)]


STATE_CLASSES: dict[str, type[_State]] = {
    "value": ValueState,
    "list": ListState,
    "map": MapState,
    "reducing": ReducingState,
    "aggregating": AggregatingState,
}
