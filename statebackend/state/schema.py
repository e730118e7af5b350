"""State schema evolution: what a job's declared states do to a lineage's stored ones.

Every checkpoint records, per state, its schema (``_metadata`` ``states``)::

    {"name": "totals", "kind": "value", "codec": {...}, "ttl": {...} | absent,
     "schema_version": 3, "upgrade_version": 2,
     "history": [{"schema_version": 1, "name": "sums", "codec": {...}, "ttl": null,
                  "upgrade_version": 0, "until_checkpoint": 4}, ...]}

(``schema_version``, ``upgrade_version`` and ``history`` are optional: a record without
them is version 1 with no upgrade and no history, as every record before this release.)

`plan_evolution` compares the stored schemas with the job's declared states (pure) and
says, per state, what the next run does: ``kept``, ``added`` (starts empty), ``dropped``
(only when the job says so: ``Job(dropped_states=...)``; its entries are not carried
into the next checkpoint, older checkpoints keep them until retention retires them),
``migrated`` (each step named: a rename through ``Job(renamed_states={new: old})``,
record fields added with their declared default, removed, reordered or widened, a
declared value upgrade, a TTL added, removed or changed) or ``refused`` (why, and the
way around it). The rules, with Flink's POJO/Avro rules and Spark 4's transformWithState
evolution as the bar:

- record fields: add (with a default), remove, reorder; widen int32 -> int64,
  int32/int64 -> float32/float64, float32 -> float64 (Avro's promotions). Narrowing, or
  a change to another kind of type (bool <-> number), is refused;
- json, str, bytes (and record) values: ``upgrades=(Upgrade(2, fn), Upgrade(3, fn))``
  on the state: every upgrade above the stored version runs, in order (they compose);
  a declared version below the stored one is refused (no downgrades);
- TTL: added (stored entries expire ``duration`` after the migration, as if written
  then), removed (stored expiries are dropped), duration changed (stored entries keep
  their expiry; new writes use the new one), time domain changed (stored entries are
  stamped again in the new domain, as when added);
- a change of kind, or of codec type (json <-> record ...), is refused (`MIGRATE_HINT`
  says what a job can do instead).

Migrations are applied eagerly, at restore, by `statebackend.state.migrate` (every
subtask of the first run after the change rewrites its entries once). Everything here
is pure: dicts in, frozen plans out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from statebackend.errors import UsageError

if TYPE_CHECKING:
    from statebackend.state.kinds import StateDescriptor

SCHEMA_KEYS = ("schema_version", "upgrade_version", "history")
KEY = "<key>"  # the pseudo-state of a change of the job's key column
MIGRATE_HINT = ("no rule migrates that: keep the old declaration, or declare the changed "
                "state under a new name (it starts empty, the old one is dropped), or move "
                "the state with your own function into a savepoint of the changed job "
                "(`ckpt migrate`, docs/state-as-data.md) and start it as a new lineage "
                "(--job NEW --start-from)")
# Avro's promotions: the types a stored field may be read as without loss of kind.
WIDENINGS = {"int32": ("int64", "float32", "float64"), "int64": ("float32", "float64"),
             "float32": ("float64",)}


@dataclass(frozen=True)
class Upgrade:
    """A declared value upgrade: ``fn(old_value) -> new_value`` brings a stored value
    from version ``version - 1`` to ``version`` (functions live in code, never in
    storage: the record stores the version number only)."""

    version: int
    fn: Callable[[Any], Any] = field(compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) \
                or self.version < 1:
            raise UsageError(f"upgrade version {self.version!r} must be an integer >= 1")
        if not callable(self.fn):
            raise UsageError(f"upgrade {self.version}: {self.fn!r} is not callable")


def check_upgrades(name: str, upgrades: Sequence[Upgrade]) -> None:
    versions = [u.version for u in upgrades]
    if versions != sorted(set(versions)):
        raise UsageError(f"state {name!r}: upgrade versions {versions} must be distinct and "
                         "ascending")


# -- stored schemas ----------------------------------------------------------------------
def schema_of(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A stored state entry with its optional schema keys made explicit."""
    out = dict(stored)
    out.setdefault("kind", "value")
    out.setdefault("codec", {"type": "json"})
    out.setdefault("ttl", None)
    out.setdefault("schema_version", 1)
    out.setdefault("upgrade_version", 0)
    out.setdefault("history", [])
    return out


def check_schema_keys(state: Mapping[str, Any]) -> str | None:
    """Why the optional schema keys of a stored state are malformed, or None (the
    metadata parser's check)."""
    version, upgrade = state.get("schema_version", 1), state.get("upgrade_version", 0)
    for key, value, low in (("schema_version", version, 1), ("upgrade_version", upgrade, 0)):
        if type(value) is not int or not low <= value < 2**31:
            return f"{key} {value!r} must be an integer >= {low}"
    history = state.get("history", [])
    if not isinstance(history, list) or not all(
            isinstance(h, dict) and type(h.get("schema_version")) is int
            and isinstance(h.get("codec", {}), dict) for h in history):
        return "history must be a list of schema objects"
    return None


def describe_schema(stored: Mapping[str, Any]) -> str:
    """One line for people (`ckpt show`, the Checkpoints page): kind, codec (record
    fields), TTL, schema and upgrade version, and the name it had before a rename."""
    s = schema_of(stored)
    codec = s["codec"] if isinstance(s["codec"], dict) else {}
    what = str(codec.get("type", "?"))
    if what == "record":
        what += "(" + ", ".join(f"{n} {t}" for n, t in codec.get("fields", [])) + ")"
    ttl = s["ttl"] if isinstance(s["ttl"], dict) else None
    ttl_text = f", ttl {ttl.get('duration_ms')} ms {ttl.get('time', 'processing')}" if ttl \
        else ""
    upgrade = f", upgrade {s['upgrade_version']}" if s["upgrade_version"] else ""
    names = [h.get("name") for h in s["history"] if isinstance(h, dict)
             and h.get("name") not in (None, s["name"])]
    origin = f" (was {names[-1]!r})" if names else ""
    return f"{s['kind']} {what}{ttl_text} v{s['schema_version']}{upgrade}{origin}"


# -- the plan -------------------------------------------------------------------------
@dataclass(frozen=True)
class StateChange:
    """What the next run does to one state."""

    state: str                 # the declared name (the stored one when dropped)
    action: str                # kept | added | dropped | migrated | refused
    steps: tuple[str, ...] = ()  # how (migrated) or why (refused), in words
    source: str | None = None  # the stored state it comes from (renames: the old name)

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "action": self.action, "steps": list(self.steps),
                "source": self.source}

    @property
    def label(self) -> str:
        return "its key" if self.state == KEY else f"state {self.state!r}"

    def line(self) -> str:
        head = f"{self.state:20} {self.action}"
        if self.source and self.source != self.state:
            head += f" (from {self.source})"
        return head + (f": {'; '.join(self.steps)}" if self.steps else "")


@dataclass(frozen=True)
class StateMigration:
    """How one subtask rewrites one state's entries (what `state.migrate` executes)."""

    target: str                       # the declared name
    source: str                       # the stored column family
    kind: str
    source_codec: dict[str, Any]      # stored codec (JSON)
    source_ttl: dict[str, Any] | None
    restamp_ttl: bool                 # stored entries get a new expiry (TTL added / domain)
    strip_ttl: bool                   # stored expiries go (TTL removed)
    upgrades: tuple[int, ...] = ()    # upgrade versions to run, in order

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "source": self.source, "kind": self.kind,
                "source_codec": self.source_codec, "source_ttl": self.source_ttl,
                "restamp_ttl": self.restamp_ttl, "strip_ttl": self.strip_ttl,
                "upgrades": list(self.upgrades)}


@dataclass(frozen=True)
class EvolutionPlan:
    changes: tuple[StateChange, ...]
    migrations: tuple[StateMigration, ...]    # states whose entries are rewritten
    dropped: tuple[str, ...]                  # stored column families that go
    states: tuple[dict[str, Any], ...]        # the next checkpoint's `states` (schemas)

    @property
    def refused(self) -> tuple[StateChange, ...]:
        return tuple(c for c in self.changes if c.action == "refused")

    @property
    def rewrites(self) -> bool:
        """Whether every subtask must restore and rewrite (a migration or a drop)."""
        return bool(self.migrations or self.dropped)

    def require_compatible(self, job: str, lineage: str) -> None:
        """UsageError naming the first refused state and the change, before any work."""
        bad = self.refused
        if bad:
            more = f" ({len(bad) - 1} more refused)" if len(bad) > 1 else ""
            raise UsageError(f"job {job!r} cannot continue {lineage}: {bad[0].label}: "
                             f"{'; '.join(bad[0].steps)}{more}; `ckpt check` lists every "
                             "state")

    def to_json(self) -> dict[str, Any]:
        return {"changes": [c.to_json() for c in self.changes],
                "migrations": [m.to_json() for m in self.migrations],
                "dropped": list(self.dropped), "compatible": not self.refused}


def plan_evolution(stored: Sequence[Mapping[str, Any]],
                   declared: Sequence[StateDescriptor], *,
                   renamed: Mapping[str, str] | None = None,
                   dropped: Sequence[str] = (), checkpoint_id: int | None = None,
                   internal: Sequence[str] = ()) -> EvolutionPlan:
    """Compare ``stored`` (a record's ``states``) with ``declared`` (module doc).

    ``renamed``: new name -> stored name; ``dropped``: stored names the job gives up;
    ``internal``: reserved column families (timers, TTL index), carried as stored or
    as declared, never compared; ``checkpoint_id``: the stored record's (history).
    """
    renamed = dict(renamed or {})
    internal_names = set(internal)
    stored_by_name = {s["name"]: schema_of(s) for s in stored
                      if s["name"] not in internal_names}
    # a rename applies while the lineage holds the old name; once it holds the new one
    # (a later run of the same code) there is nothing left to rename
    source_of = {d.name: d.name if d.name in stored_by_name else renamed.get(d.name, d.name)
                 for d in declared if d.name not in internal_names}
    changes: list[StateChange] = []
    migrations: list[StateMigration] = []
    states: list[dict[str, Any]] = []
    for d in declared:
        if d.name in internal_names:
            states.append(d.to_json())
            continue
        source = source_of[d.name]
        old = stored_by_name.get(source)
        if old is None:
            if d.name in renamed:
                changes.append(StateChange(d.name, "refused", (
                    f"it is renamed from {source!r}, which the lineage does not hold "
                    f"(stored: {sorted(stored_by_name)})",), source))
            else:
                changes.append(StateChange(d.name, "added", ("starts empty",)))
            states.append(_schema(d, 1, d.upgrade_version, []))
            continue
        change, migration = _compare(d, old, source)
        changes.append(change)
        if migration is not None:
            migrations.append(migration)
        if change.action == "kept":
            states.append(_schema(d, old["schema_version"], old["upgrade_version"],
                                  old["history"]))
        else:
            past = {k: old.get(k) for k in ("name", "codec", "ttl", "schema_version",
                                             "upgrade_version")}
            past["until_checkpoint"] = checkpoint_id
            states.append(_schema(d, old["schema_version"] + 1, d.upgrade_version,
                                  [*old["history"], past]))
    sources = set(source_of.values())
    gone: list[str] = []
    for name in sorted(set(stored_by_name) - sources):
        if name in dropped:
            changes.append(StateChange(name, "dropped", (
                "its entries are not carried into the next checkpoint; older checkpoints "
                "keep them until retention retires them",)))
            gone.append(name)
        else:
            changes.append(StateChange(name, "refused", (
                "the lineage holds it but the job does not declare it: declare it, rename "
                f"it (renamed_states={{'new': {name!r}}}) or drop it explicitly "
                f"(Job(dropped_states=({name!r},)))",)))
    for d in declared:
        if source_of.get(d.name, d.name) != d.name and source_of[d.name] in source_of:
            changes.append(StateChange(d.name, "refused", (
                f"it is renamed from {renamed[d.name]!r}, which the job also declares",)))
    return EvolutionPlan(tuple(changes), tuple(migrations), tuple(gone), tuple(states))


def _schema(d: StateDescriptor, version: int, upgrade: int, history: list[Any]
            ) -> dict[str, Any]:
    out = d.to_json()
    if version > 1:
        out["schema_version"] = version
    if upgrade:
        out["upgrade_version"] = upgrade
    if history:
        out["history"] = list(history)
    return out


def _compare(d: StateDescriptor, old: dict[str, Any], source: str
             ) -> tuple[StateChange, StateMigration | None]:
    steps: list[str] = []
    if source != d.name:
        steps.append(f"renamed from {source!r}")
    if old["kind"] != d.kind:
        return StateChange(d.name, "refused", (
            f"its kind changes from {old['kind']} to {d.kind}; {MIGRATE_HINT}",), source), None
    codec_steps, why = codec_change(old["codec"], d.codec.to_json(),
                                    getattr(d.codec, "default_of", {}))
    if why is not None:
        return StateChange(d.name, "refused", (why,), source), None
    steps += codec_steps
    stored_up, declared_up = old["upgrade_version"], d.upgrade_version
    if declared_up < stored_up:
        return StateChange(d.name, "refused", (
            f"the lineage's values are at upgrade version {stored_up}, the job declares "
            f"{declared_up}: upgrades never go back",), source), None
    upgrades = tuple(u.version for u in d.upgrades if u.version > stored_up)
    if declared_up > stored_up:
        missing = sorted(set(range(stored_up + 1, declared_up + 1)) - set(upgrades))
        if missing:
            return StateChange(d.name, "refused", (
                f"values go from upgrade version {stored_up} to {declared_up}, but no "
                f"Upgrade is declared for version(s) {missing}",), source), None
        steps.append(f"values upgraded {stored_up} -> {declared_up}")
    ttl_steps, restamp, strip = ttl_change(old["ttl"], d.ttl.to_json() if d.ttl else None)
    steps += ttl_steps
    if not steps:
        return StateChange(d.name, "kept"), None
    rewrite = source != d.name or bool(codec_steps) or bool(upgrades) or restamp or strip
    migration = StateMigration(d.name, source, d.kind, old["codec"], old["ttl"], restamp,
                               strip, upgrades) if rewrite else None
    return StateChange(d.name, "migrated", tuple(steps), source), migration


def codec_change(old: dict[str, Any], new: dict[str, Any], defaults: Mapping[str, Any]
                 ) -> tuple[list[str], str | None]:
    """(steps, None) when values of codec ``old`` can be read as codec ``new``, else
    ([], why not). ``defaults``: the new record codec's declared field defaults."""
    if old == new:
        return [], None
    if old.get("type") != new.get("type"):
        return [], (f"its codec changes from {old.get('type')} to {new.get('type')}; "
                    f"{MIGRATE_HINT}")
    if new.get("type") != "record":
        return [], f"its codec changes from {old} to {new}; {MIGRATE_HINT}"
    before, after = dict(map(tuple, old["fields"])), dict(map(tuple, new["fields"]))
    steps: list[str] = []
    for name, ftype in after.items():
        was = before.get(name)
        if was is None:
            if name not in defaults:
                return [], (f"record field {name!r} is added without a default: declare "
                            f"one, e.g. record({name}=({ftype!r}, 0))")
            steps.append(f"field {name} added (default {defaults[name]!r})")
        elif was != ftype:
            if ftype not in WIDENINGS.get(was, ()):
                return [], (f"record field {name!r} changes from {was} to {ftype}: only "
                            f"widening is compatible ({_widenings()}); {MIGRATE_HINT}")
            steps.append(f"field {name} widened {was} -> {ftype}")
    steps += [f"field {name} removed" for name in before if name not in after]
    kept = [n for n in before if n in after]
    if kept != [n for n in after if n in before]:
        steps.append("fields reordered")
    return steps, None


def _widenings() -> str:
    return ", ".join(f"{a} -> {b}" for a, bs in WIDENINGS.items() for b in bs)


def ttl_change(old: dict[str, Any] | None, new: dict[str, Any] | None
               ) -> tuple[list[str], bool, bool]:
    """(steps, restamp stored entries, strip stored expiries)."""
    if old == new:
        return [], False, False
    if new is None:
        return ["TTL removed: stored entries no longer expire"], False, True
    if old is None:
        return [f"TTL added ({new['duration_ms']} ms of {new['time']} time): entries stored "
                "before expire that long after this run"], True, False
    if old.get("time") != new.get("time"):
        return [f"TTL moves from {old.get('time')} to {new.get('time')} time: stored entries "
                "expire one duration after this run"], True, False
    return [f"TTL changes from {old['duration_ms']} to {new['duration_ms']} ms: stored "
            "entries keep their expiry, new writes use the new TTL"], False, False
