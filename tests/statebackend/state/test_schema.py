"""State schema evolution, the plan (statebackend.state.schema): pure, dicts in, plans out."""

from __future__ import annotations

import pytest

from statebackend.errors import UsageError
from statebackend.job import Upgrade, list_state, map_state, record, value_state
from statebackend.state.schema import plan_evolution
from statebackend.state.ttl import StateTtl

TOTALS_V1 = value_state("totals", record(n="int32", spend="float64"))


def stored(*descs, **schema) -> list[dict]:
    return [dict(d.to_json(), **schema) for d in descs]


def plan(old, new, **kw):
    return plan_evolution(old, new, **kw)


def actions(p) -> dict[str, str]:
    return {c.state: c.action for c in p.changes}


def test_unchanged_states_are_kept_and_need_no_rewrite():
    p = plan(stored(TOTALS_V1, map_state("m")), [TOTALS_V1, map_state("m")])
    assert actions(p) == {"totals": "kept", "m": "kept"}
    assert not p.rewrites and not p.refused
    assert [s.get("schema_version", 1) for s in p.states] == [1, 1]


@pytest.mark.parametrize("new_fields, steps", [
    ({"n": "int64", "spend": "float64"}, ["field n widened int32 -> int64"]),
    ({"n": "float64", "spend": "float64"}, ["field n widened int32 -> float64"]),
    ({"spend": "float64", "n": "int32"}, ["fields reordered"]),
    ({"n": "int32"}, ["field spend removed"]),
    ({"n": "int32", "spend": "float64", "refunds": ("int64", 0)},
     ["field refunds added (default 0)"]),
])
def test_compatible_record_changes_migrate(new_fields, steps):
    p = plan(stored(TOTALS_V1), [value_state("totals", record(**new_fields))],
             checkpoint_id=7)
    (change,) = p.changes
    assert (change.action, list(change.steps)) == ("migrated", steps)
    assert p.rewrites and [m.source for m in p.migrations] == ["totals"]
    (schema,) = p.states
    assert schema["schema_version"] == 2
    assert schema["history"] == [{"name": "totals", "codec": TOTALS_V1.codec.to_json(),
                                  "ttl": None, "schema_version": 1, "upgrade_version": 0,
                                  "until_checkpoint": 7}]


@pytest.mark.parametrize("new_fields, why", [
    ({"n": "int32", "spend": "float32"}, "changes from float64 to float32"),
    ({"n": "bool", "spend": "float64"}, "changes from int32 to bool"),
    ({"n": "int32", "spend": "float64", "refunds": "int64"},
     "added without a default"),
])
def test_narrowing_kind_changes_and_fields_without_default_are_refused(new_fields, why):
    p = plan(stored(TOTALS_V1), [value_state("totals", record(**new_fields))])
    (change,) = p.refused
    assert change.state == "totals" and why in change.steps[0]
    with pytest.raises(UsageError, match=f"state 'totals': .*{why}"):
        p.require_compatible("j", "the lineage")


def test_added_renamed_dropped_and_refused_states():
    old = stored(value_state("a"), map_state("b"), list_state("c"), value_state("d"))
    new = [value_state("a"), map_state("b2"), value_state("e")]
    p = plan(old, new, renamed={"b2": "b"}, dropped=("c",))
    assert actions(p) == {"a": "kept", "b2": "migrated", "e": "added", "c": "dropped",
                          "d": "refused"}
    assert "Job(dropped_states=('d',))" in next(c for c in p.refused).steps[0]
    assert p.dropped == ("c",)
    assert [(m.source, m.target) for m in p.migrations] == [("b", "b2")]


def test_a_rename_already_applied_is_no_rename():
    old = stored(map_state("b2"), schema_version=2)
    p = plan(old, [map_state("b2")], renamed={"b2": "b"})
    assert actions(p) == {"b2": "kept"} and not p.rewrites
    assert p.states[0]["schema_version"] == 2  # the version carries on


def test_a_rename_from_nothing_is_refused():
    p = plan(stored(value_state("a")), [value_state("a"), map_state("x")],
             renamed={"x": "missing"})
    assert actions(p)["x"] == "refused"


def test_kind_and_codec_type_changes_are_refused_naming_the_migration_path():
    p = plan(stored(value_state("a"), value_state("b")),
             [map_state("a"), value_state("b", record(x="int64"))])
    steps = {c.state: c.steps[0] for c in p.refused}
    assert "kind changes from value to map" in steps["a"] and "under a new name" in steps["a"]
    assert "codec changes from json to record" in steps["b"] and "under a new name" in steps["b"]


def test_upgrades_compose_and_never_go_back():
    def up(v):
        return v

    two = value_state("p", upgrades=(Upgrade(1, up), Upgrade(2, up)))
    p = plan(stored(value_state("p")), [two])
    assert p.migrations[0].upgrades == (1, 2) and "values upgraded 0 -> 2" in p.changes[0].steps
    assert p.states[0]["upgrade_version"] == 2
    later = plan(stored(value_state("p"), upgrade_version=1), [two])
    assert later.migrations[0].upgrades == (2,)
    back = plan(stored(value_state("p"), upgrade_version=3), [two])
    assert "never go back" in back.refused[0].steps[0]
    gap = plan(stored(value_state("p")), [value_state("p", upgrades=(Upgrade(2, up),))])
    assert "no Upgrade is declared for version(s) [1]" in gap.refused[0].steps[0]


@pytest.mark.parametrize("old_ttl, new_ttl, restamp, strip, rewrites", [
    (None, StateTtl(1000, "event"), True, False, True),
    (StateTtl(1000, "event"), None, False, True, True),
    (StateTtl(1000, "event"), StateTtl(5000, "event"), False, False, False),
    (StateTtl(1000, "event"), StateTtl(1000, "processing"), True, False, True),
])
def test_ttl_changes(old_ttl, new_ttl, restamp, strip, rewrites):
    p = plan(stored(value_state("s", ttl=old_ttl)), [value_state("s", ttl=new_ttl)])
    assert p.changes[0].action == "migrated" and p.rewrites is rewrites
    if rewrites:
        (m,) = p.migrations
        assert (m.restamp_ttl, m.strip_ttl) == (restamp, strip)
    assert p.states[0]["schema_version"] == 2


def test_internal_families_are_carried_not_compared():
    timers = value_state("x")  # stands for any declared descriptor
    p = plan([{"name": "_timers", "kind": "timers", "codec": {"type": "bytes"}}], [timers],
             internal=("_timers",))
    assert actions(p) == {"x": "added"}
