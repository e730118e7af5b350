"""Key groups over whole Arrow columns, with no per-key Python step (`keygroups` has
the scalar contract these equal value for value; tests compare them on random keys).

`murmur3_32_many` hashes every value of a string/binary array in NumPy (4-byte blocks
of all keys at once), `key_groups` maps keys to key groups and `prefixed_keys` builds
the RocksDB keys (2-byte big-endian key group + key bytes).

`spark_hash_many` is Spark SQL's ``hash(key)`` of a string column over the same
buffers: Murmur3 x86_32 with seed 42 whose tail bytes are mixed one by one, each
sign-extended (``Murmur3_x86_32.hashUnsafeBytes``, kept by Spark for compatibility),
as a signed int32. A key-group rule over it can be computed inside the JVM
(``pmod(hash(key), M)``) and equally here (`keygroups.spark_hash` is the scalar form).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from statebackend.errors import UsageError
from statebackend.state.keygroups import MURMUR3, SPARK_HASH

_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)
_TAIL_MASKS = np.array([0, 0xFF, 0xFFFF, 0xFFFFFF], dtype=np.uint32)


def murmur3_32_many(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """`murmur3_32` of every value's bytes (UTF-8 for strings) as uint32; null -> 0.

    Vectorized over keys: step j mixes block j of every key that has one, so the
    Python loop runs once per 4 bytes of the longest key, never once per key.
    """
    return _murmur3_many(values, 0, spark_tail=False)


def spark_hash_many(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Spark SQL's ``hash()`` of every value's bytes (module doc) as int32; null -> 42
    (Spark's hash of a null is its seed)."""
    return _murmur3_many(values, 42, spark_tail=True).view(np.int32)


def _murmur3_many(values: pa.Array | pa.ChunkedArray, seed: int, spark_tail: bool
                  ) -> np.ndarray:
    arr = _binary_view(values)
    n = len(arr)
    h = np.full(n, seed, dtype=np.uint32)
    if n == 0:
        return h
    offsets_buf, data_buf = arr.buffers()[1], arr.buffers()[2]
    otype: type[np.signedinteger[Any]] = np.int64 if pa.types.is_large_binary(arr.type) \
        else np.int32
    offsets = np.frombuffer(offsets_buf, dtype=otype, count=arr.offset + n + 1)[arr.offset:]
    start = offsets[:-1].astype(np.int64)
    length = (offsets[1:] - offsets[:-1]).astype(np.int64)
    data = (np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None and data_buf.size
            else np.zeros(0, np.uint8))
    lo, hi = int(start[0]), int(offsets[-1])  # the bytes of these keys (a slice may start late)
    padded = np.concatenate([data[lo:hi], np.zeros(3, np.uint8)])  # a last word never overruns
    start = start - lo
    # word[i]: the little-endian uint32 at byte i (an overlapping, unaligned view: no copy)
    word = np.ndarray((hi - lo,), dtype="<u4", buffer=padded, strides=(1,)) if hi > lo \
        else np.zeros(1, np.uint32)
    blocks = length // 4
    with np.errstate(over="ignore"):
        active = None if blocks.min() > 0 else np.flatnonzero(blocks > 0)  # None: all keys
        j = 0
        while active is None or active.size:
            if active is None:  # every key has block j: no gather/scatter of h
                _mix_block(h, word[start + 4 * j])
            else:
                x = h[active]
                _mix_block(x, word[start[active] + 4 * j])
                h[active] = x
            j += 1
            if active is None and blocks.min() <= j:
                active = np.arange(n)
            if active is not None:
                active = active[blocks[active] > j]
        tail = length & 3
        if spark_tail:  # each tail byte a block of its own, sign-extended
            for t in range(3):
                has = np.flatnonzero(tail > t)
                if has.size:
                    b = padded[start[has] + 4 * blocks[has] + t].view(np.int8)
                    x = h[has]
                    _mix_block(x, b.astype(np.int32).view(np.uint32))
                    h[has] = x
        elif tail.any():
            # the tail's bytes only: mask off what follows the key (a key without tail: 0)
            k = word[np.minimum(start + 4 * blocks, len(word) - 1)]
            k &= _TAIL_MASKS[tail]
            h ^= _mix_k(k)
        h ^= length.astype(np.uint32)
        h ^= h >> 16
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> 13
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> 16
    if arr.null_count:
        h[np.asarray(arr.is_null())] = seed
    return h


def key_groups(keys: pa.Array | pa.ChunkedArray, max_parallelism: int,
               key_hash: str = MURMUR3) -> np.ndarray:
    """`key_group_for_bytes` of every key under ``key_hash`` (int64); a null key is in
    key group 0."""
    if key_hash == SPARK_HASH:
        arr = _binary_view(keys)
        kgs: np.ndarray = spark_hash_many(arr).astype(np.int64) % max_parallelism
        if arr.null_count:  # Spark hashes a null to its seed; a null key is in group 0
            kgs[np.asarray(arr.is_null())] = 0
        return kgs
    return (murmur3_32_many(keys) % np.uint32(max_parallelism)).astype(np.int64)


def prefixed_keys(key_groups_: np.ndarray, key_bytes: pa.Array | pa.ChunkedArray) -> pa.Array:
    """RocksDB keys: ``key_group_prefix(kg) + key`` for every (kg, key) pair (binary)."""
    keys = _binary_view(key_bytes)
    prefixes = pa.array(np.asarray(key_groups_, dtype=">u2").view("S2"), pa.binary(2))
    return pa.compute.binary_join_element_wise(prefixes.cast(keys.type), keys,
                                               pa.scalar(b"", keys.type))


def _mix_k(k: np.ndarray) -> np.ndarray:
    """murmur3's mixing of a 4-byte block, in place: rotl(k * c1, 15) * c2."""
    k *= _C1
    _rotl_inplace(k, 15)
    k *= _C2
    return k


def _mix_block(h: np.ndarray, k: np.ndarray) -> None:
    """h = rotl(h ^ mix(k), 13) * 5 + 0xe6546b64, in place (k is scratch)."""
    h ^= _mix_k(k)
    _rotl_inplace(h, 13)
    h *= np.uint32(5)
    h += np.uint32(0xE6546B64)


def _rotl_inplace(x: np.ndarray, r: int) -> None:
    high = x >> np.uint32(32 - r)
    x <<= np.uint32(r)
    x |= high


def _binary_view(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """``values`` as one binary/large_binary array sharing its buffers (UTF-8 as is)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if not isinstance(values, pa.Array):
        values = pa.array(values, pa.string())
    t = values.type
    if pa.types.is_string(t) or pa.types.is_binary(t):
        return values.view(pa.binary())
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        return values.view(pa.large_binary())
    raise UsageError(f"keys must be a string or binary column, got {t}")
