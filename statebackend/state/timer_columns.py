"""The timers' two key layouts (`statebackend.state.timers`) for many timers at once.

`timer_key_columns` builds the ``_timers`` and ``_timer_keys`` keys of a batch of timers
column-wise: NumPy writes the fixed-width parts (key group, domain, time, key length)
as rows, Arrow joins them with the keys and tags. `parse_timer_key_columns` splits a
batch of ``_timers`` keys into the columns a timer handler gets (`FIRED_SCHEMA`) and
builds their ``_timer_keys`` keys from the same bytes; `reverse_key_column` builds
those alone, for a column of ``_timers`` keys. No Python step per timer, where
`timer_key`, `reverse_key` and `parse_timer_key` take one each (a microsecond or two:
registering, deleting and firing were most of a columnar job's run).

They give the bytes of the per-timer functions (tested against them). A batch they
do not take (a key that does not fit the layout, a tag, a key that is not
UTF-8) comes back as None: the caller parses it a timer at a time, whose errors name
the bytes at fault.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.state.codecs import DOMAIN_NAMES

# The timers one call of a vectorized timer handler gets (one row per timer, firing order)
FIRED_SCHEMA = pa.schema([("key", pa.string()), ("time", pa.int64()), ("tag", pa.string()),
                          ("domain", pa.string()), ("key_group", pa.int32())])

# A `_timers` key's fixed-width head (15 bytes, packed): the framed key and the tag follow
_HEAD = np.dtype([("key_group", ">u2"), ("domain", "u1"), ("time", ">u8"), ("length", ">u4")])
_WIDTH = _HEAD.itemsize
_KEY_GROUP_AND_LENGTH = [0, 1, 11, 12, 13, 14]  # a `_timer_keys` key's head
_DOMAIN_AND_TIME = slice(2, 11)  # what follows the key in a `_timer_keys` key
_SIGN = np.uint64(1 << 63)  # encode_time: time + 2**63, so byte order is time order
_END = 1 << 30  # binary_slice's "to the end" (its default stop fails on pyarrow 26)


def timer_key_columns(key_groups: np.ndarray, key_bytes: pa.Array, times: np.ndarray,
                      domain: bytes, tags: Sequence[str] | None, *, reverse: bool = True
                      ) -> tuple[list[bytes], list[bytes]]:
    """(``_timers`` keys, ``_timer_keys`` keys; none with ``reverse=False``) of the timers
    (key group, serialized key, time as int64, tag; no tags: every tag empty), in their
    order."""
    n = len(key_bytes)
    head = np.empty(n, _HEAD)
    head["key_group"] = key_groups
    head["domain"] = domain[0]
    head["time"] = times.view(np.uint64) ^ _SIGN
    head["length"] = pc.binary_length(key_bytes).to_numpy(zero_copy_only=False)
    rows = head.view(np.uint8).reshape(n, _WIDTH)
    kind = key_bytes.type
    tail = [] if tags is None else [pa.array(tags, pa.string()).cast(kind)]
    joined = pa.scalar(b"", kind)
    fwd = pc.binary_join_element_wise(_as_binary(rows, kind), key_bytes, *tail, joined)
    if not reverse:
        return fwd.to_pylist(), []
    rev = pc.binary_join_element_wise(_as_binary(rows[:, _KEY_GROUP_AND_LENGTH], kind),
                                      key_bytes, _as_binary(rows[:, _DOMAIN_AND_TIME], kind),
                                      *tail, joined)
    return fwd.to_pylist(), rev.to_pylist()


def parse_timer_key_columns(timer_keys: list[bytes], *, reverse: bool = True
                            ) -> tuple[pa.Table, list[bytes]] | None:
    """(the timers as a `FIRED_SCHEMA` table, their ``_timer_keys`` keys; none with
    ``reverse=False``), or None for a batch to parse a timer at a time (module
    docstring)."""
    n = len(timer_keys)
    keys = pa.array(timer_keys, pa.binary())
    head = _tagless_heads(keys)
    if head is None:
        return None
    domains = np.unique(head["domain"])
    if not set(domains.tolist()) <= DOMAIN_NAMES.keys():
        return None
    try:
        users = pc.binary_slice(keys, _WIDTH, _END).cast(pa.string())
    except pa.ArrowInvalid:  # not UTF-8
        return None
    names = pa.array([DOMAIN_NAMES[d] for d in domains.tolist()], pa.string())
    table = pa.table([users, pa.array((head["time"].astype(np.uint64) ^ _SIGN).view(np.int64)),
                      pa.nulls(n, pa.string()).fill_null(""),
                      names.take(np.searchsorted(domains, head["domain"])),
                      pa.array(head["key_group"].astype(np.int32))], schema=FIRED_SCHEMA)
    if not reverse:
        return table, []
    return table, _reordered(keys).to_pylist()


def reverse_key_column(timer_keys: pa.Array) -> pa.Array | None:
    """The ``_timer_keys`` keys of ``_timers`` keys ``timer_keys`` (Arrow binary, in
    their order), or None unless every one is a timer without a tag that fits the
    layout (take them a timer at a time)."""
    keys = timer_keys.cast(pa.binary())
    if not len(keys):
        return keys
    if keys.offset:  # a slice: its buffers start before it
        keys = pa.concat_arrays([keys])
    return _reordered(keys) if _tagless_heads(keys) is not None else None


def _tagless_heads(keys: pa.Array) -> np.ndarray | None:
    """The fixed-width heads of ``_timers`` keys (an unsliced Arrow binary array), or
    None unless each key is its head, the framed key and no tag (none: an empty array)."""
    n = len(keys)
    if not n:
        return None
    offsets = np.frombuffer(keys.buffers()[1], np.int32, n + 1)
    lengths = np.diff(offsets)
    if (lengths < _WIDTH).any():
        return None
    data = np.frombuffer(keys.buffers()[2], np.uint8)
    head = np.ascontiguousarray(data[offsets[:-1, None] + np.arange(_WIDTH)]).view(_HEAD)[:, 0]
    if (head["length"].astype(np.int64) + _WIDTH != lengths).any():  # a tag, or no fit
        return None
    return head


def _reordered(keys: pa.Array) -> pa.Array:
    """Tagless ``_timers`` keys as ``_timer_keys`` keys: the same bytes, the framed key
    moved before the domain and time."""
    return pc.binary_join_element_wise(
        pc.binary_slice(keys, 0, 2), pc.binary_slice(keys, 11, _END),
        pc.binary_slice(keys, 2, 11), pa.scalar(b"", pa.binary()))


def _as_binary(rows: np.ndarray, kind: pa.DataType) -> pa.Array:
    """Each row of a 2-D uint8 array as one binary value of type ``kind``."""
    n, width = rows.shape
    fixed = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), n, [None, pa.py_buffer(np.ascontiguousarray(rows))])
    return fixed.cast(kind)
