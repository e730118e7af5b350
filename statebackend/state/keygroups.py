"""Key groups: the unit of state redistribution (never change once data exists).

- ``max_parallelism`` M (1..32768) is fixed for a job's lineage; parallelism P is 1..M.
- key group of a key = hash(serialized key bytes) mod M, with the lineage's key hash
  (`KEY_HASHES`, recorded in ``_metadata`` as ``key_hash``; a record without it is
  ``murmur3``): ``murmur3`` is murmur3_32 with seed 0, unsigned (Flink's rule);
  ``spark`` is Spark SQL's ``hash()`` (`spark_hash`), taken ``pmod`` M, which the
  JVM computes itself (``pmod(hash(key), M)``).
- subtask i of P owns the contiguous, inclusive range
  ``[ceil(i*M/P), floor(((i+1)*M - 1)/P)]`` (Flink's KeyGroupRangeAssignment).
- A RocksDB key starts with the key group as 2 bytes big-endian, so a key-group
  range is a byte range: clip it with ``delete_range``, export it with iterator bounds.

The same functions over whole Arrow columns are in `keygroups_bulk` (NumPy), kept
apart so that what imports key groups alone (Airflow's DAG parsing) stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

import mmh3

from statebackend.defaults import MAX_PARALLELISM as DEFAULT_MAX_PARALLELISM  # noqa: F401 - re-exported
from statebackend.errors import UsageError

MAX_MAX_PARALLELISM = 1 << 15  # key group must fit the 2-byte prefix
KEY_GROUP_PREFIX_BYTES = 2
MURMUR3, SPARK_HASH = "murmur3", "spark"
KEY_HASHES = (MURMUR3, SPARK_HASH)


def check_key_hash(key_hash: str) -> str:
    """``key_hash`` when it is one of `KEY_HASHES`; UsageError naming it otherwise."""
    if key_hash not in KEY_HASHES:
        raise UsageError(f"key hash {key_hash!r} is unknown; use one of {list(KEY_HASHES)}")
    return key_hash


@dataclass(frozen=True, order=True)
class KeyGroupRange:
    """Inclusive range of key groups ``[start, end]``; empty when end < start."""

    start: int
    end: int

    def __len__(self) -> int:
        return max(0, self.end - self.start + 1)

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def intersect(self, other: KeyGroupRange) -> KeyGroupRange:
        return KeyGroupRange(max(self.start, other.start), min(self.end, other.end))

    def byte_bounds(self) -> tuple[bytes, bytes]:
        """RocksDB key bounds ``[lower, upper)`` covering every key of the range."""
        return key_group_prefix(self.start), key_group_prefix(self.end + 1)


def check_max_parallelism(max_parallelism: int) -> None:
    if not 1 <= max_parallelism <= MAX_MAX_PARALLELISM:
        raise UsageError(
            f"max parallelism {max_parallelism} is out of range: "
            f"it must be 1..{MAX_MAX_PARALLELISM}"
        )


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    """Raise UsageError unless 1 <= parallelism <= max_parallelism."""
    check_max_parallelism(max_parallelism)
    if parallelism < 1:
        raise UsageError(f"parallelism {parallelism} is invalid: it must be at least 1")
    if parallelism > max_parallelism:
        raise UsageError(
            f"parallelism {parallelism} exceeds max parallelism {max_parallelism}: "
            "key groups cannot be split further (max parallelism is fixed for the lineage)"
        )


def murmur3_32(data: bytes) -> int:
    """MurmurHash3 x86 32-bit, seed 0, as an unsigned int."""
    return mmh3.hash(data, 0, signed=False)


def spark_hash(data: bytes) -> int:
    """Spark SQL's ``hash()`` of a string's UTF-8 bytes, as a signed int: Murmur3 x86_32,
    seed 42, the tail bytes mixed one at a time, each sign-extended
    (``Murmur3_x86_32.hashUnsafeBytes``); `keygroups_bulk.spark_hash_many` over columns."""
    def mix(h: int, k: int) -> int:
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        h ^= (k * 0x1B873593) & 0xFFFFFFFF
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        return (h * 5 + 0xE6546B64) & 0xFFFFFFFF

    h, aligned = 42, len(data) - len(data) % 4
    for i in range(0, aligned, 4):
        h = mix(h, int.from_bytes(data[i:i + 4], "little"))
    for byte in data[aligned:]:
        h = mix(h, (byte - 256 if byte >= 128 else byte) & 0xFFFFFFFF)
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h - (1 << 32) if h >= 1 << 31 else h


def key_group_for_bytes(serialized_key: bytes, max_parallelism: int,
                        key_hash: str = MURMUR3) -> int:
    """The key group of a serialized key under ``key_hash`` (module doc)."""
    if key_hash == SPARK_HASH:
        return spark_hash(serialized_key) % max_parallelism  # Python's % is pmod
    return mmh3.hash(serialized_key, 0, signed=False) % max_parallelism


def key_group_range_for_subtask(
    max_parallelism: int, parallelism: int, subtask: int
) -> KeyGroupRange:
    """Flink's range formula; ranges of the P subtasks tile [0, M) with no gap."""
    check_parallelism(parallelism, max_parallelism)
    if not 0 <= subtask < parallelism:
        raise UsageError(f"subtask {subtask} is out of range for parallelism {parallelism}")
    start = (subtask * max_parallelism + parallelism - 1) // parallelism
    end = ((subtask + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def subtask_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """Inverse of the range formula: the subtask whose range holds ``key_group``."""
    return key_group * parallelism // max_parallelism


def key_group_prefix(key_group: int) -> bytes:
    return key_group.to_bytes(KEY_GROUP_PREFIX_BYTES, "big")


def key_group_of_rocks_key(rocks_key: bytes) -> int:
    return int.from_bytes(rocks_key[:KEY_GROUP_PREFIX_BYTES], "big")
