"""`bytewise_order` against Python's own bytes order (a stable sort of the same keys)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from statebackend.state.bytes_order import RADIX_MAX_BYTES, bytewise_order


def python_order(keys: list[bytes]) -> list[int]:
    return sorted(range(len(keys)), key=lambda i: keys[i])  # stable: ties by index


def random_keys(seed: int, n: int, max_len: int, alphabet: bytes) -> list[bytes]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len + 1, n)
    return [bytes(rng.choice(list(alphabet), int(k))) for k in lengths]


@pytest.mark.parametrize("max_len", [1, 2, 7, 17, RADIX_MAX_BYTES, RADIX_MAX_BYTES + 9])
@pytest.mark.parametrize("alphabet", [b"\x00\x01\xff", bytes(range(256))])
def test_equals_python_order_with_ties_and_trailing_zeros(max_len, alphabet):
    # a 3-letter alphabet with the zero byte makes equal keys and keys that differ only
    # by trailing zeros (b"a" < b"a\x00"), the cases zero padding could get wrong
    for seed in range(3):
        keys = random_keys(seed, 3000, max_len, alphabet)
        got = bytewise_order(pa.array(keys, pa.binary()))
        assert got.tolist() == python_order(keys)


def test_fixed_width_keys_and_a_sliced_array():
    rng = np.random.default_rng(5)
    keys = [b"\x00\x05" + f"user-{i:010d}".encode() for i in rng.permutation(50_000)[:20_000]]
    arr = pa.array([b"zz-before"] + keys + [b"after"], pa.binary()).slice(1, len(keys))
    assert bytewise_order(arr).tolist() == python_order(keys)
    even = [k[:16] for k in keys]  # every key 16 bytes: the buffer is the matrix
    assert bytewise_order(pa.array(even, pa.binary())).tolist() == python_order(even)


@pytest.mark.parametrize("keys", [[], [b"x"], [b"", b""], [b"b", b"", b"a"]])
def test_small_and_empty_keys(keys):
    assert bytewise_order(pa.array(keys, pa.binary())).tolist() == python_order(keys)
