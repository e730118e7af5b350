"""State schema evolution, applied to a restored instance (statebackend.state.migrate).

Each case writes state with one schema, closes and reopens the instance with the next
schema (as a restore does), migrates, and reads the entries back through the state API
of the new schema: values, expiries (reads at clocks either side of them), the expiry
index (purge finds exactly the expired entries, nothing else is left in it) and the
column families left behind.
"""

from __future__ import annotations

from statebackend.job import Upgrade, list_state, map_state, record, value_state
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange
from statebackend.state.migrate import migrate_backend
from statebackend.state.schema import plan_evolution
from statebackend.state.ttl import TTL_INDEX, StateTtl, parse_index_key, purge_expired

M = 16
KEYS = [f"k{i}" for i in range(40)]


def evolve(tmp_path, old, new, write, *, now=None, renamed=None, dropped=()):
    """Write with ``old`` descriptors, reopen with ``new``, migrate; the new backend."""
    path = str(tmp_path / "db")
    with KeyedStateBackend(path, old, M, KeyGroupRange(0, M - 1)) as be:
        write(be)
    plan = plan_evolution([d.to_json() for d in old], new, renamed=renamed, dropped=dropped)
    assert not plan.refused, plan.refused
    be = KeyedStateBackend(path, new, M, KeyGroupRange(0, M - 1))
    report = migrate_backend(be, plan.migrations, plan.dropped, now or {})
    return be, report


def index_states(be) -> set[str]:
    return {parse_index_key(k).state for k in be.iter_raw(TTL_INDEX, values=False)}


def test_record_fields_added_widened_removed_and_upgraded(tmp_path):
    old = [value_state("t", record(n="int32", spend="float64", old="bool"))]

    def bump(v):  # version 1: spend in cents
        return dict(v, spend=v["spend"] * 100)

    new = [value_state("t", record(n="int64", spend="float64", refunds=("int64", 7)),
                       upgrades=(Upgrade(1, bump),))]
    be, report = evolve(tmp_path, old, new, lambda b: b.value_state("t").put_many(
        KEYS, [{"n": i, "spend": i / 4, "old": True} for i in range(len(KEYS))]))
    with be:
        got = be.value_state("t").get_many(KEYS)
    assert got == [{"n": i, "spend": i * 25.0, "refunds": 7} for i in range(len(KEYS))]
    assert report.entries == {"t": len(KEYS)}


def test_a_renamed_map_moves_and_its_old_family_goes(tmp_path):
    def write(b):
        for i, k in enumerate(KEYS):
            b.map_state("m").put(k, "x", i)

    be, report = evolve(tmp_path, [map_state("m")], [map_state("m2")], write,
                        renamed={"m2": "m"})
    with be:
        assert [be.map_state("m2").get(k, "x") for k in KEYS] == list(range(len(KEYS)))
        assert "m" not in be.column_families and report.dropped == ("m",)


def test_a_dropped_state_family_goes(tmp_path):
    be, report = evolve(tmp_path, [value_state("a"), list_state("l")], [value_state("a")],
                        lambda b: b.list_state("l").add_many(KEYS, list(range(len(KEYS)))),
                        dropped=("l",))
    with be:
        assert "l" not in be.column_families and report.dropped == ("l",)


def test_a_ttl_added_stamps_stored_entries_from_the_runs_clock(tmp_path):
    ttl = StateTtl(1000, "processing")
    be, _ = evolve(tmp_path, [value_state("s")], [value_state("s", ttl=ttl)],
                   lambda b: b.value_state("s").put_many(KEYS, list(range(len(KEYS)))),
                   now={"processing": 5000})
    with be:
        be.set_time(processing_time=5999)
        assert be.value_state("s").get_many(KEYS) == list(range(len(KEYS)))
        assert index_states(be) == {"s"}
        assert purge_expired(be, "processing", 5999).entries_deleted == 0
        be.set_time(processing_time=6000)
        assert be.value_state("s").get_many(KEYS) == [None] * len(KEYS)
        assert purge_expired(be, "processing", 6000).entries_deleted == len(KEYS)
        assert be.count_keys("s") == 0 and be.count_keys(TTL_INDEX) == 0


def test_a_ttl_removed_keeps_every_entry_and_empties_the_index(tmp_path):
    ttl = StateTtl(1000, "event")

    def write(b):
        b.value_state("s").put_many(KEYS, list(range(len(KEYS))),
                                    timestamps=list(range(len(KEYS))))

    be, _ = evolve(tmp_path, [value_state("s", ttl=ttl)], [value_state("s")], write)
    with be:
        be.set_time(event_time=10**9)
        assert be.value_state("s").get_many(KEYS) == list(range(len(KEYS)))
        assert index_states(be) == set()


def test_a_renamed_ttl_list_keeps_each_elements_expiry(tmp_path):
    ttl = StateTtl(1000, "event")

    def write(b):
        ls = b.list_state("l")
        ls.add_many(KEYS, ["a"] * len(KEYS), timestamps=[0] * len(KEYS))
        ls.add_many(KEYS, ["b"] * len(KEYS), timestamps=[5000] * len(KEYS))

    be, _ = evolve(tmp_path, [list_state("l", ttl=ttl)], [list_state("l2", ttl=ttl)], write,
                   renamed={"l2": "l"})
    with be:
        assert index_states(be) == {"l2"}
        be.set_time(event_time=999)
        assert be.list_state("l2").get("k1") == ["a", "b"]
        be.set_time(event_time=1000)
        assert be.list_state("l2").get("k1") == ["b"]
        purge_expired(be, "event", 1000)
        be.set_time(event_time=6000)
        assert be.list_state("l2").get("k1") == []
        purge_expired(be, "event", 6000)
        assert be.count_keys("l2") == 0 and be.count_keys(TTL_INDEX) == 0


def test_a_ttl_duration_change_keeps_stored_expiries(tmp_path):
    """Stored entries keep the expiry their write gave them; only new writes use the
    new duration (no rewrite at all)."""
    plan = plan_evolution([value_state("s", ttl=StateTtl(1000, "event")).to_json()],
                          [value_state("s", ttl=StateTtl(9000, "event"))])
    assert not plan.migrations and plan.changes[0].action == "migrated"
    assert "keep their expiry" in plan.changes[0].steps[0]
