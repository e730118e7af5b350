"""Key groups: murmur3 test vectors, Flink's range formula, bounds checks.

These values are the contract of every stored checkpoint: if one of them changes,
existing state lands in the wrong key group after a restore.
"""

from __future__ import annotations

import random

import mmh3
import pyarrow as pa
import pytest

from statebackend.errors import UsageError
from statebackend.state.keygroups import (
    KeyGroupRange,
    check_parallelism,
    key_group_for_bytes,
    key_group_of_rocks_key,
    key_group_prefix,
    key_group_range_for_subtask,
    murmur3_32,
    subtask_for_key_group,
)
from statebackend.state.keygroups_bulk import key_groups, murmur3_32_many, prefixed_keys

# Published MurmurHash3_x86_32 vectors (seed 0, unsigned), e.g. the SMHasher-derived
# list on Wikipedia / Stack Overflow and the Python mmh3 documentation.
MURMUR3_SEED0 = [
    (b"", 0x00000000),
    (b"\x00\x00\x00\x00", 0x2362F9DE),
    (b"hello", 0x248BFA47),
    (b"The quick brown fox jumps over the lazy dog", 0x2E4FF723),
]

# Same list with other seeds: proves the dependency implements the reference
# algorithm (not only the seed-0 special case).
MURMUR3_SEEDED = [
    (b"", 1, 0x514E28B7),
    (b"", 0xFFFFFFFF, 0x81F16F39),
    (b"Hello, world!", 1234, 0xFAF6CDB3),
    (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
]

# Our own published vectors: key -> key group for M=128 and M=32768 (UTF-8 bytes).
KEY_GROUP_VECTORS = [
    ("hello", 71, 31303),
    ("user-1", 99, 1891),
    ("user-2", 75, 18379),
    ("order:42", 80, 27472),
    ("\u00e9t\u00e9", 15, 26127),
    ("", 0, 0),
]


@pytest.mark.parametrize(("data", "expected"), MURMUR3_SEED0)
def test_murmur3_seed0_published_vectors(data, expected):
    assert murmur3_32(data) == expected
    assert mmh3.hash(data, 0, signed=False) == expected


@pytest.mark.parametrize(("data", "seed", "expected"), MURMUR3_SEEDED)
def test_mmh3_matches_reference_with_seeds(data, seed, expected):
    assert mmh3.hash(data, seed, signed=False) == expected


@pytest.mark.parametrize(("key", "kg128", "kg32768"), KEY_GROUP_VECTORS)
def test_key_group_vectors(key, kg128, kg32768):
    data = key.encode("utf-8")
    assert key_group_for_bytes(data, 128) == kg128 == murmur3_32(data) % 128
    assert key_group_for_bytes(data, 32768) == kg32768


def test_hash_is_unsigned():
    assert murmur3_32(b"abc") == 0xB3DD93FA  # high bit set: signed would be negative
    assert all(murmur3_32(f"k{i}".encode()) >= 0 for i in range(1000))


@pytest.mark.parametrize(("m", "p", "expected"), [
    (128, 1, [(0, 127)]),
    (128, 3, [(0, 42), (43, 85), (86, 127)]),
    (128, 4, [(0, 31), (32, 63), (64, 95), (96, 127)]),
    (128, 5, [(0, 25), (26, 51), (52, 76), (77, 102), (103, 127)]),
    (10, 3, [(0, 3), (4, 6), (7, 9)]),
    (4, 4, [(0, 0), (1, 1), (2, 2), (3, 3)]),
])
def test_flink_range_known_values(m, p, expected):
    got = [key_group_range_for_subtask(m, p, i) for i in range(p)]
    assert got == [KeyGroupRange(s, e) for s, e in expected]


@pytest.mark.parametrize("m", [1, 2, 3, 7, 10, 128, 1000, 4096, 32768])
def test_ranges_tile_without_gap_or_overlap(m):
    for p in sorted({1, 2, 3, 5, 7, 16, m // 3 or 1, m - 1 or 1, m}):
        if p > m:
            continue
        ranges = [key_group_range_for_subtask(m, p, i) for i in range(p)]
        assert ranges[0].start == 0 and ranges[-1].end == m - 1
        for a, b in zip(ranges, ranges[1:], strict=False):
            assert b.start == a.end + 1
        assert all(len(r) >= 1 for r in ranges)  # P <= M: no subtask is empty
        sizes = {len(r) for r in ranges}
        assert max(sizes) - min(sizes) <= 1  # balanced


@pytest.mark.parametrize(("m", "p"), [(128, 1), (128, 3), (128, 7), (10, 3), (1000, 999),
                                      (32768, 5)])
def test_subtask_for_key_group_agrees_with_ranges(m, p):
    for i in range(p):
        r = key_group_range_for_subtask(m, p, i)
        for kg in {r.start, r.end, (r.start + r.end) // 2}:
            assert subtask_for_key_group(m, p, kg) == i
            assert kg in r
    if m <= 1000:
        owners = [subtask_for_key_group(m, p, kg) for kg in range(m)]
        assert owners == sorted(owners)
        for kg, i in enumerate(owners):
            assert kg in key_group_range_for_subtask(m, p, i)


def test_parallelism_bounds():
    with pytest.raises(UsageError, match="parallelism 0"):
        check_parallelism(0, 128)
    with pytest.raises(UsageError, match="parallelism -1"):
        key_group_range_for_subtask(128, -1, 0)
    with pytest.raises(UsageError, match="129 exceeds max parallelism 128"):
        key_group_range_for_subtask(128, 129, 0)
    with pytest.raises(UsageError, match="subtask 3 is out of range"):
        key_group_range_for_subtask(128, 3, 3)
    with pytest.raises(UsageError, match="max parallelism 0"):
        check_parallelism(1, 0)
    with pytest.raises(UsageError, match="max parallelism 32769"):
        check_parallelism(1, 32769)
    check_parallelism(128, 128)
    check_parallelism(1, 1)


def test_prefix_is_two_bytes_big_endian_and_orders_by_key_group():
    assert key_group_prefix(0) == b"\x00\x00"
    assert key_group_prefix(258) == b"\x01\x02"
    assert key_group_prefix(32767) == b"\x7f\xff"
    assert key_group_of_rocks_key(key_group_prefix(300) + b"key") == 300
    prefixes = [key_group_prefix(i) for i in range(0, 32768, 97)]
    assert prefixes == sorted(prefixes)
    lower, upper = KeyGroupRange(3, 5).byte_bounds()
    assert lower == b"\x00\x03" and upper == b"\x00\x06"
    assert lower <= key_group_prefix(5) + b"\xff\xff" < upper


def test_range_helpers():
    r = KeyGroupRange(10, 20)
    assert len(r) == 11 and 10 in r and 20 in r and 21 not in r and "10" not in r
    assert r.intersect(KeyGroupRange(15, 30)) == KeyGroupRange(15, 20)
    assert len(r.intersect(KeyGroupRange(30, 40))) == 0


# -- bulk forms: equal to the scalar functions on random keys of every kind ----------
def _random_keys(rng: random.Random, n: int) -> list[str]:
    alphabets = ["abcxyz0123-_:", "\u00e9\u00fc\u00df\u4e2d\u6587", "\U0001f600\U0001f680",
                 "".join(chr(c) for c in range(1, 128))]
    out = []
    for i in range(n):
        alphabet = alphabets[i % len(alphabets)]
        # every tail length (0..3 bytes) and block count, plus a few long keys
        size = rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 13, 31, 64]) if i % 97 else 1000
        out.append("".join(rng.choice(alphabet) for _ in range(size)))
    return out


def _key_columns(keys: list[str]) -> dict[str, pa.Array | pa.ChunkedArray]:
    utf8 = [k.encode("utf-8") for k in keys]
    with_nulls = pa.array([None, *keys[:50], None, *keys[50:]], pa.string())
    return {
        "string": pa.array(keys, pa.string()),
        "large_string": pa.array(keys, pa.large_string()),
        "binary": pa.array(utf8, pa.binary()),
        "large_binary": pa.array(utf8, pa.large_binary()),
        "sliced": pa.array(["pad", *keys, "pad"], pa.string()).slice(1, len(keys)),
        "chunked": pa.chunked_array([pa.array(keys[:100]), pa.array(keys[100:])]),
        "with_nulls": with_nulls,
    }


@pytest.mark.parametrize("kind", ["string", "large_string", "binary", "large_binary",
                                  "sliced", "chunked", "with_nulls"])
def test_bulk_hash_and_key_groups_equal_the_scalar_functions(kind):
    keys = _random_keys(random.Random(kind), 3000)
    col = _key_columns(keys)[kind]
    values = col.to_pylist()
    as_bytes = [v if isinstance(v, bytes) or v is None else v.encode("utf-8") for v in values]
    expected = [0 if b is None else murmur3_32(b) for b in as_bytes]
    assert murmur3_32_many(col).tolist() == expected
    for m in (1, 128, 4096, 32768):
        kgs = key_groups(col, m)
        assert kgs.tolist() == [0 if b is None else key_group_for_bytes(b, m)
                                for b in as_bytes]
        if kind != "with_nulls":
            rocks = prefixed_keys(kgs, col).to_pylist()
            pairs = zip(kgs.tolist(), as_bytes, strict=True)
            assert rocks == [key_group_prefix(kg) + b for kg, b in pairs]


def test_bulk_forms_on_edge_columns():
    assert murmur3_32_many(pa.array([], pa.string())).tolist() == []
    assert murmur3_32_many(pa.array([""] * 3)).tolist() == [0, 0, 0]
    vectors = pa.array([d for d, _ in MURMUR3_SEED0], pa.binary())
    assert murmur3_32_many(vectors).tolist() == [h for _, h in MURMUR3_SEED0]
    keys = pa.array([k for k, _, _ in KEY_GROUP_VECTORS])
    assert key_groups(keys, 128).tolist() == [kg for _, kg, _ in KEY_GROUP_VECTORS]
    assert key_groups(keys, 32768).tolist() == [kg for _, _, kg in KEY_GROUP_VECTORS]
    with pytest.raises(UsageError, match="string or binary"):
        key_groups(pa.array([1, 2]), 128)


def test_backend_rocks_keys_equal_rocks_key_and_refuse_foreign_keys(tmp_path):
    from statebackend.state.backend import KeyedStateBackend
    from tests.statebackend.helpers import DESCRIPTORS

    keys = _random_keys(random.Random(3), 2000)
    whole = KeyedStateBackend(str(tmp_path / "all"), DESCRIPTORS, 128, KeyGroupRange(0, 127))
    half = KeyedStateBackend(str(tmp_path / "half"), DESCRIPTORS, 128, KeyGroupRange(0, 63))
    try:
        expected = [whole.rocks_key(k) for k in keys]
        assert whole.rocks_keys(keys) == expected
        assert whole.rocks_keys(pa.array(keys)) == expected
        assert whole.rocks_keys([]) == []
        outside = next(k for k in keys if key_group_for_bytes(k.encode(), 128) > 63)
        with pytest.raises(UsageError, match=r"outside this backend's range \[0, 63\]"):
            half.rocks_keys(["user-1", outside] if key_group_for_bytes(b"user-1", 128) <= 63
                            else [outside])
        with pytest.raises(UsageError, match="must be strings"):
            whole.rocks_keys(["a", 7])
    finally:
        whole.close()
        half.close()
