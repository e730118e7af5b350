"""The column-wise timer keys equal the per-timer layout (`timer_key`, `reverse_key`,
`parse_timer_key`) byte for byte; what the parser does not take comes back as None."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statebackend.errors import UsageError
from statebackend.state.backend_kinds import new_backend
from statebackend.state.codecs import TIME_DOMAINS, serialize_keys
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.kinds import StateDescriptor
from statebackend.state.state_table import TIMER_SCHEMA, StateRead, read_span
from statebackend.state.timer_columns import (
    FIRED_SCHEMA,
    parse_timer_key_columns,
    reverse_key_column,
    timer_key_columns,
)
from statebackend.state.timers import (
    _timer_and_reverse,
    iter_timers,
    register_timers,
    reverse_key,
    timer_key,
    with_timers,
)

TIMES = st.integers(-(2**63), 2**63 - 1)
KEYS = st.text(max_size=12)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TIMERS = st.lists(st.tuples(st.integers(0, 2**15 - 1), KEYS, TIMES), max_size=40)


@settings(max_examples=200, deadline=None)
@given(TIMERS, st.sampled_from(sorted(TIME_DOMAINS)), st.none() | st.lists(
    st.text(max_size=5), min_size=40, max_size=40))
def test_built_keys_equal_the_per_timer_layout(timers, domain, tags):
    kgs = np.array([t[0] for t in timers], np.int64)
    key_bytes = serialize_keys([t[1] for t in timers])
    times = np.array([t[2] for t in timers], np.int64)
    dom = TIME_DOMAINS[domain]
    tags = None if tags is None else tags[:len(timers)]
    fwd, rev = timer_key_columns(kgs, key_bytes, times, dom, tags)
    each = [(kg, dom, t, k.encode(), "" if tags is None else tags[i])
            for i, (kg, k, t) in enumerate(timers)]
    assert fwd == [timer_key(*e) for e in each]
    assert rev == [reverse_key(*e) for e in each]
    # a backend that derives the reverse lookup asks for the queue's keys alone
    assert timer_key_columns(kgs, key_bytes, times, dom, tags, reverse=False) == (fwd, [])
    derived = reverse_key_column(pa.array(fwd, pa.binary()))
    if tags is None or not any(tags):  # tagless: column-wise; a tag: a timer at a time
        assert derived is not None and derived.to_pylist() == rev
    else:
        assert derived is None


@settings(max_examples=200, deadline=None)
@given(TIMERS, st.sampled_from(sorted(TIME_DOMAINS)))
def test_parsed_columns_equal_the_per_timer_parse(timers, domain):
    tks = [timer_key(kg, TIME_DOMAINS[domain], t, k.encode(), "") for kg, k, t in timers]
    parsed = parse_timer_key_columns(tks)
    if not tks:
        assert parsed is None
        return
    assert parsed is not None
    table, reverse = parsed
    assert table.schema == FIRED_SCHEMA
    each = [_timer_and_reverse(tk) for tk in tks]
    assert table.to_pylist() == [
        {"key": t.key, "time": t.time, "tag": t.tag, "domain": t.domain,
         "key_group": t.key_group} for t, _ in each]
    assert reverse == [rk for _, rk in each]
    no_reverse = parse_timer_key_columns(tks, reverse=False)  # a reader deletes nothing
    assert no_reverse is not None and no_reverse[0].equals(table) and no_reverse[1] == []


def test_what_the_parser_does_not_take_is_left_to_the_per_timer_parse():
    """The parser refuses what does not fit the layout, a tag, an unknown domain and a
    key that is not UTF-8; the reverse keys' builder (which reorders bytes and reads
    neither the domain nor the key as text) refuses the first three."""
    good = timer_key(3, b"\x00", 5, b"user", "")
    assert parse_timer_key_columns([good]) is not None
    assert reverse_key_column(pa.array([good], pa.binary())).to_pylist() == \
        [reverse_key(3, b"\x00", 5, b"user", "")]
    for bad, reversible in ((timer_key(3, b"\x00", 5, b"user", "tag"), False),  # a tag
                            (good[:14], False),  # shorter than the head
                            (good[:-1], False),  # the key is shorter than its length says
                            (good[:2] + b"\x07" + good[3:], True),  # an unknown time domain
                            (timer_key(3, b"\x00", 5, b"\xff\xfe", ""), True)):  # not UTF-8
        assert parse_timer_key_columns([good, bad]) is None
        assert (reverse_key_column(pa.array([good, bad], pa.binary())) is not None) == \
            reversible


@pytest.mark.parametrize("kind", ["rocksdb", "memory"])
def test_bad_times_and_tags_are_refused_naming_them(tmp_path, kind):
    be = new_backend(kind, str(tmp_path / "b"), with_timers([StateDescriptor("s")]), 128,
                     KeyGroupRange(0, 127))
    try:
        for times, tags, named in (([True], None, "True"), ([2**63], None, str(2**63)),
                                   ([1.5], None, "1.5"), ([1], [7], "7")):
            with pytest.raises(UsageError, match=named):
                register_timers(be, ["k"], times, tags=tags)
        register_timers(be, ["k", "l"], [np.int64(5), 2**63 - 1], tags=["", "é"])
        register_timers(be, pa.array(["m"]), [-(2**63)])
        assert sorted((t.key, t.time, t.tag) for t in iter_timers(be)) == [
            ("k", 5, ""), ("l", 2**63 - 1, "é"), ("m", -(2**63), "")]
    finally:
        be.close()


@pytest.mark.parametrize("kind", ["rocksdb", "memory"])
@pytest.mark.parametrize("tagged", [False, True], ids=["column-wise", "a-timer-at-a-time"])
def test_the_timers_table_equals_the_timers(tmp_path, kind, tagged):
    """``read_state(..., state="_timers")``'s table (`state_table.read_span`) lists every
    timer of the span as `iter_timers` does: parsed column-wise, or with a tag a timer
    at a time."""
    states = with_timers([StateDescriptor("s")])
    be = new_backend(kind, str(tmp_path / "b"), states, 128, KeyGroupRange(0, 127))
    rng = np.random.default_rng(7)
    keys = [f"user-{i}-é" for i in range(300)]
    times = rng.integers(-(2**40), 2**40, len(keys))
    try:
        register_timers(be, keys, times, tags=[f"t{i % 3}" for i in range(300)] if tagged
                        else None)
        register_timers(be, keys[:50], times[:50] + 1, domain="processing")
        timers_desc = next(d for d in states if d.name == "_timers")
        batch = read_span(be, StateRead(timers_desc, subtask=3), KeyGroupRange(0, 127))
        assert batch is not None and batch.schema == TIMER_SCHEMA
        got = sorted((r["key"], r["time"], r["domain"], r["tag"], r["key_group"], r["subtask"])
                     for r in batch.to_pylist())
        want = sorted((t.key, EPOCH + timedelta(milliseconds=t.time), t.domain,
                       t.tag, t.key_group, 3) for t in iter_timers(be))
        assert len(got) == 350 and got == want
    finally:
        be.close()
