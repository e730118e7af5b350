"""The public job API: one frozen object declares a stateful job.

A user writes::

    job = Job(
        name="user_activity",
        input=Input(schema=pa.schema([("user", pa.string()), ("ts", pa.int64())]),
                    key="user", rules=(not_null("user"), not_empty("user"))),
        states=(value_state("last_seen"), map_state("counts")),
        outputs=(Output("activity", pa.schema([...])),),
        logic=PerKey(handle_rows),          # or Vectorized(process_batch)
        options=(Option("normalize_case", bool, True, "..."),),
        expectations={"last_seen": last_seen_checks},
    )

- **input**: the Arrow schema of the parsed columns, the key column and the
  per-row rules. Raw values are cast to the schema (a value that does not parse
  becomes null, so a rule can reject it); the key is always a string (other key
  types are cast with Arrow's cast, e.g. ``5`` -> ``"5"``). Rules run in order;
  a row is quarantined with the reason of the first rule it fails. A row whose
  key is still null after every rule is quarantined as ``missing_<key>``.
  ``event_time`` (an integer epoch-ms or timestamp column), ``allowed_lateness``
  (ms or a timedelta) and ``accept_late`` drive the watermark: a row with
  ``event_time <= watermark at the start of the run`` is quarantined as ``late``
  unless ``accept_late``; see docs/write-a-job.md, "Time".
- **states**: `statebackend.state.kinds.StateDescriptor` (value, list, map, reducing,
  aggregating, each with its codec and an optional ``ttl=``); `value_state` ... are
  thin constructors.
- **outputs**: zero or more named Arrow schemas. ``last_per=<column>`` keeps
  only the last row emitted per value of that column in a run (for outputs that
  report a key's newest totals).
- **logic**: `Vectorized` (``fn(batch, ctx)``, once per Arrow batch of many
  keys, batch state operations on ``ctx``: a `BatchContext`) or `PerKey`
  (``fn(key, rows, state)``, once per key per run with all of the key's accepted rows
  of the run, per-key state handles on ``state``: a `KeyContext`); see
  `statebackend.job.context`.
- **on_timer**: the timer handler, `Vectorized` (``fn(timers, ctx)``, ``timers`` a
  table ``key, time, tag, domain`` in time order) or `PerKey` (``fn(key, timers,
  state)``, once per key per firing chunk, ``timers`` the key's due `Timer` values in
  time order); called at the end of each run for the due timers.
- **options**: declared job options; values reach the logic as ``ctx.options``.
  ``configure(job, options) -> Job`` (optional) derives the job a run uses from its
  options (e.g. a TTL or the allowed lateness given as an option).
- **expectations**: per state name, a callable taking the state's descriptor and
  returning Great Expectations expectations (the shape of
  `statebackend.validation.checks.StateCheck`); not called here.
- **dropped_states** / **renamed_states**: how the job changed since the lineage it
  continues (docs/evolve-a-job.md): stored states it gives up, and ``{new: old}``
  renames. Record fields with defaults, widened fields, TTL changes and value upgrades
  (``upgrades=`` on a state) need no word here: `statebackend.state.schema` plans them.

Every definition error is a one-line `UsageError` naming the job and the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from statebackend.defaults import BACKENDS
from statebackend.errors import UsageError
from statebackend.state.codecs import Codec, JsonCodec, RecordCodec
from statebackend.state.families import TTL_INDEX
from statebackend.state.kinds import AggregateFunction, StateDescriptor, internal_descriptor
from statebackend.state.schema import Upgrade
from statebackend.state.timers import with_timers
from statebackend.state.ttl import StateTtl

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
RAW = "raw"
TYPED = "typed"

# A rule's check: (table) -> boolean mask, True where the row is bad.
Check = Callable[[pa.Table], "pa.Array | pa.ChunkedArray"]


# -- input rules ----------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """A vectorized row check: ``check(table)`` is True where a row is bad.

    ``on="typed"`` (default): the table holds the columns cast to the input schema
    (values that did not parse are null). ``on="raw"``: the columns as they arrived
    (null only where nothing arrived). A null in the mask means "not bad".
    """

    reason: str
    check: Check = field(compare=False)
    on: str = TYPED

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not _NAME.match(self.reason):
            raise UsageError(f"rule reason {self.reason!r} is not a plain name "
                             "(letters, digits, '_', '.', '-')")
        if not callable(self.check):
            raise UsageError(f"rule {self.reason!r}: check {self.check!r} is not callable")
        if self.on not in (RAW, TYPED):
            raise UsageError(f"rule {self.reason!r}: on={self.on!r}, use 'typed' or 'raw'")


def not_null(column: str, reason: str | None = None) -> Rule:
    """Bad where no value arrived for ``column`` (raw null or column absent)."""
    return Rule(reason or f"missing_{column}", lambda t: pc.is_null(t[column]), on=RAW)


def parses(column: str, reason: str | None = None) -> Rule:
    """Bad where ``column`` is null after the cast to the schema (put after `not_null`)."""
    return Rule(reason or f"invalid_{column}", lambda t: pc.is_null(t[column]))


def not_empty(column: str, reason: str | None = None) -> Rule:
    """Bad where the string ``column`` is ``""``."""
    return Rule(reason or f"empty_{column}", lambda t: pc.equal(t[column], ""))


def finite(column: str, reason: str | None = None) -> Rule:
    """Bad where the float ``column`` is null, NaN or infinite."""
    return Rule(reason or f"non_finite_{column}",
                lambda t: pc.invert(pc.fill_null(pc.is_finite(t[column]), False)))


def between(column: str, lo: Any, hi: Any, reason: str | None = None) -> Rule:
    """Bad where ``column`` is outside ``[lo, hi]`` (null passes: pair with `not_null`)."""
    return Rule(reason or f"out_of_range_{column}",
                lambda t: pc.or_(pc.less(t[column], lo), pc.greater(t[column], hi)))


@dataclass(frozen=True)
class Input:
    """Parsed columns, key column, rules; event time, allowed lateness, late rows."""

    schema: pa.Schema
    key: str
    rules: tuple[Rule, ...] = ()
    event_time: str | None = None
    allowed_lateness: timedelta | int | None = None  # ms when an int
    accept_late: bool = False  # late rows reach the logic instead of the quarantine

    @property
    def lateness_ms(self) -> int:
        """The allowed lateness in ms (0 when not declared)."""
        lat = self.allowed_lateness
        if lat is None:
            return 0
        if isinstance(lat, timedelta):
            return int(lat.total_seconds() * 1000)
        return int(lat)


# -- states ---------------------------------------------------------------------------
def record(**fields: str | tuple[str, Any]) -> RecordCodec:
    """Fixed-width record codec: ``record(count="int64", sum="float64")``; a field added
    to an existing state declares its default: ``record(..., refunds=("int64", 0))``."""
    types = tuple((n, f if isinstance(f, str) else f[0]) for n, f in fields.items())
    defaults = tuple((n, f[1]) for n, f in fields.items() if not isinstance(f, str))
    for name, f in fields.items():
        if not isinstance(f, str) and (not isinstance(f, tuple) or len(f) != 2):
            raise UsageError(f"record field {name!r}: give a type name or (type, default), "
                             f"got {f!r}")
    return RecordCodec(types, defaults)


def value_state(name: str, codec: Codec | None = None, ttl: StateTtl | None = None,
                upgrades: tuple[Upgrade, ...] = ()) -> StateDescriptor:
    """One value per key (JSON by default)."""
    return StateDescriptor(name, "value", codec or JsonCodec(), ttl=ttl, upgrades=upgrades)


def list_state(name: str, codec: Codec | None = None, ttl: StateTtl | None = None,
               upgrades: tuple[Upgrade, ...] = ()) -> StateDescriptor:
    """A list per key; with a TTL each element expires on its own."""
    return StateDescriptor(name, "list", codec or JsonCodec(), ttl=ttl, upgrades=upgrades)


def map_state(name: str, codec: Codec | None = None, ttl: StateTtl | None = None,
              upgrades: tuple[Upgrade, ...] = ()) -> StateDescriptor:
    """A map of string user keys per key; with a TTL each entry expires on its own."""
    return StateDescriptor(name, "map", codec or JsonCodec(), ttl=ttl, upgrades=upgrades)


def reducing_state(name: str, reduce_fn: Callable[[Any, Any], Any],
                   codec: Codec | None = None, ttl: StateTtl | None = None,
                   upgrades: tuple[Upgrade, ...] = ()) -> StateDescriptor:
    """One value per key, folded with ``reduce_fn(old, new)`` on every add; with a TTL an
    expired value counts as absent (the next add starts over)."""
    return StateDescriptor(name, "reducing", codec or JsonCodec(), reduce_fn=reduce_fn,
                           ttl=ttl, upgrades=upgrades)


def aggregating_state(name: str, aggregate_fn: AggregateFunction,
                      codec: Codec | None = None, ttl: StateTtl | None = None,
                      upgrades: tuple[Upgrade, ...] = ()) -> StateDescriptor:
    """An accumulator per key (``aggregate_fn``: create_accumulator, add, merge,
    get_result); reads return the result; with a TTL as `reducing_state`."""
    return StateDescriptor(name, "aggregating", codec or JsonCodec(),
                           aggregate_fn=aggregate_fn, ttl=ttl, upgrades=upgrades)


# -- outputs, logic, options ----------------------------------------------------------
@dataclass(frozen=True)
class Output:
    """A named output table; ``last_per``: keep the last row per value of that column."""

    name: str
    schema: pa.Schema
    last_per: str | None = None


@dataclass(frozen=True)
class Vectorized:
    """``fn(batch: pa.Table, ctx: BatchContext) -> None``, once per batch of many keys
    (a key's rows may span batches); as a timer handler ``fn(timers, ctx)``."""

    fn: Callable[..., None]


@dataclass(frozen=True)
class PerKey:
    """``fn(key: str, rows: pa.Table, state: KeyContext) -> rows | None``, once per key per
    run with all of its accepted rows; as a timer handler ``fn(key, timers, state)``,
    once per key per firing chunk."""

    fn: Callable[..., Any]


_OPTION_TYPES = (bool, int, float, str)
# Block compression of the state (None: RocksDB's default, Snappy). ZSTD makes the
# SSTs of small fixed-width records (the bytes every checkpoint uploads) ~20% smaller.
COMPRESSIONS = (None, "zstd", "lz4", "snappy", "none")


@dataclass(frozen=True)
class Option:
    """A job option: the generic CLI exposes it as ``--<name>``."""

    name: str
    type: type
    default: Any
    help: str = ""

    def parse(self, job: str, value: Any) -> Any:
        """``value`` (typed or a CLI string) as ``self.type``; one-line error otherwise."""
        if isinstance(value, str) and self.type is not str:
            return self._from_text(job, value)
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if type(value) is not self.type:
            raise UsageError(f"job {job!r}: option {self.name!r} must be of type "
                             f"{self.type.__name__}, got {value!r}")
        return value

    def _from_text(self, job: str, text: str) -> Any:
        if self.type is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        else:
            try:
                return self.type(text)
            except ValueError:
                pass
        raise UsageError(f"job {job!r}: option {self.name!r} must be of type "
                         f"{self.type.__name__}, got {text!r}")


# -- the job --------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One stateful job; validated at construction (see the module docstring)."""

    name: str
    input: Input
    logic: Vectorized | PerKey
    states: tuple[StateDescriptor, ...] = ()
    outputs: tuple[Output, ...] = ()
    options: tuple[Option, ...] = ()
    expectations: Mapping[str, Callable[[StateDescriptor], Any]] = field(
        default_factory=dict, compare=False)
    compression: str | None = None  # RocksDB block compression of every state
    # The state backend (statebackend.defaults.BACKENDS; None: the lineage's, else rocksdb)
    backend: str | None = None
    on_timer: Vectorized | PerKey | None = None  # the timer handler (see the docstring)
    configure: Callable[[Job, Mapping[str, Any]], Job] | None = field(default=None,
                                                                       compare=False)
    # Evolution (docs/evolve-a-job.md): stored states given up, and {new name: old name}.
    dropped_states: tuple[str, ...] = ()
    renamed_states: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise UsageError(f"job name {self.name!r} is not a plain name "
                             "(letters, digits, '_', '.', '-')")
        for name in ("states", "outputs", "options", "dropped_states"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "expectations", MappingProxyType(dict(self.expectations)))
        object.__setattr__(self, "renamed_states", MappingProxyType(dict(self.renamed_states)))
        _check_input(self)
        _check_states(self)
        _check_outputs(self)
        _check_logic(self)
        _check_options(self)
        _check_expectations(self)
        _check_evolution(self)
        if self.backend is not None and self.backend not in BACKENDS:
            raise _fail(self, f"backend {self.backend!r} is not one of "
                        f"{list(BACKENDS)}")
        if self.compression not in COMPRESSIONS:
            raise _fail(self, f"compression {self.compression!r} is not one of "
                        f"{list(COMPRESSIONS)}")

    @property
    def key(self) -> str:
        return self.input.key

    @property
    def descriptors(self) -> tuple[StateDescriptor, ...]:
        """What the backend opens: the states, the timer families with a timer handler
        and the TTL index when a state has a TTL (the order `KeyedStateBackend` uses)."""
        out = with_timers(self.states) if self.on_timer is not None else list(self.states)
        if any(d.ttl is not None for d in self.states):
            out.append(internal_descriptor(TTL_INDEX))
        return tuple(out)

    @property
    def has_time(self) -> bool:
        """Timers or TTL: a subtask without rows may still have work at the end of a run."""
        return self.on_timer is not None or any(d.ttl is not None for d in self.states)

    def configured(self, options: Mapping[str, Any]) -> Job:
        """The job a run with ``options`` (resolved) uses: ``configure`` applied once."""
        if self.configure is None:
            return self
        job = self.configure(self, options)
        if not isinstance(job, Job):
            raise _fail(self, f"configure returned {type(job).__name__}, not a Job")
        return replace(job, configure=None)

    def state(self, name: str) -> StateDescriptor:
        for d in self.states:
            if d.name == name:
                return d
        raise UsageError(f"job {self.name!r} declares no state {name!r}; "
                         f"declared: {[d.name for d in self.states]}")

    def output(self, name: str) -> Output:
        for o in self.outputs:
            if o.name == name:
                return o
        raise UsageError(f"job {self.name!r} declares no output {name!r}; "
                         f"declared: {[o.name for o in self.outputs]}")

    def resolve_options(self, values: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
        """Defaults overridden by ``values`` (typed or CLI strings); unknown names refused."""
        values = dict(values or {})
        known = {o.name: o for o in self.options}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UsageError(f"job {self.name!r} has no option {unknown[0]!r}; "
                             f"its options: {sorted(known)}")
        return MappingProxyType({n: o.parse(self.name, values.get(n, o.default))
                                 for n, o in known.items()})


def _fail(job: Job, what: str) -> UsageError:
    return UsageError(f"job {job.name!r}: {what}")


def _check_input(job: Job) -> None:
    inp = job.input
    if not isinstance(inp, Input):
        raise _fail(job, f"input must be an Input, got {type(inp).__name__}")
    if not isinstance(inp.schema, pa.Schema):
        raise _fail(job, f"input.schema must be a pyarrow.Schema, got {type(inp.schema).__name__}")
    names = inp.schema.names
    if len(set(names)) != len(names):
        raise _fail(job, f"input.schema has duplicate columns {names}")
    if inp.key not in names:
        raise _fail(job, f"input.key {inp.key!r} is not a column of input.schema {names}")
    key_type = inp.schema.field(inp.key).type
    if not (pa.types.is_string(key_type) or pa.types.is_large_string(key_type)
            or pa.types.is_integer(key_type)):
        raise _fail(job, f"input.key {inp.key!r} has type {key_type}; use a string or "
                    "integer column (keys are stored as strings)")
    for rule in inp.rules:
        if not isinstance(rule, Rule):
            raise _fail(job, f"input.rules holds {rule!r}, not a Rule")
    if inp.event_time is not None:
        if inp.event_time not in names:
            raise _fail(job, f"input.event_time {inp.event_time!r} is not a column of "
                        f"input.schema {names}")
        t = inp.schema.field(inp.event_time).type
        if not (pa.types.is_timestamp(t) or pa.types.is_integer(t)):
            raise _fail(job, f"input.event_time {inp.event_time!r} has type {t}; "
                        "use a timestamp or integer column")
    lat = inp.allowed_lateness
    if lat is not None and not (
            (isinstance(lat, timedelta) and lat >= timedelta(0))
            or (isinstance(lat, int) and not isinstance(lat, bool) and lat >= 0)):
        raise _fail(job, f"input.allowed_lateness {lat!r} must be a timedelta or an "
                    "integer of ms >= 0")
    if inp.allowed_lateness is not None and inp.event_time is None:
        raise _fail(job, "input.allowed_lateness needs input.event_time")


def _check_states(job: Job) -> None:
    seen: set[str] = set()
    for d in job.states:
        if not isinstance(d, StateDescriptor):
            raise _fail(job, f"states holds {d!r}, not a StateDescriptor "
                        "(use value_state(...), map_state(...) ...)")
        if d.name in seen:
            raise _fail(job, f"state name {d.name!r} is declared twice")
        seen.add(d.name)


def _check_outputs(job: Job) -> None:
    seen: set[str] = set()
    for o in job.outputs:
        if not isinstance(o, Output):
            raise _fail(job, f"outputs holds {o!r}, not an Output")
        if not isinstance(o.name, str) or not _NAME.match(o.name):
            raise _fail(job, f"output name {o.name!r} is not a plain name")
        if o.name in seen:
            raise _fail(job, f"output name {o.name!r} is declared twice")
        seen.add(o.name)
        if not isinstance(o.schema, pa.Schema):
            raise _fail(job, f"output {o.name!r}: schema must be a pyarrow.Schema")
        if o.last_per is not None and o.last_per not in o.schema.names:
            raise _fail(job, f"output {o.name!r}: last_per {o.last_per!r} is not one of "
                        f"its columns {o.schema.names}")


def _check_logic(job: Job) -> None:
    if not isinstance(job.logic, Vectorized | PerKey):
        raise _fail(job, f"logic must be Vectorized(fn) or PerKey(fn), got {job.logic!r}")
    if not callable(job.logic.fn):
        raise _fail(job, f"logic function {job.logic.fn!r} is not callable")
    if job.on_timer is not None and (not isinstance(job.on_timer, Vectorized | PerKey)
                                     or not callable(job.on_timer.fn)):
        raise _fail(job, f"on_timer must be Vectorized(fn) or PerKey(fn) of a callable, "
                    f"got {job.on_timer!r}")
    if job.configure is not None and not callable(job.configure):
        raise _fail(job, f"configure {job.configure!r} is not callable")
    if not isinstance(job.input.accept_late, bool):
        raise _fail(job, f"input.accept_late must be a bool, got {job.input.accept_late!r}")


def _check_options(job: Job) -> None:
    seen: set[str] = set()
    for o in job.options:
        if not isinstance(o, Option):
            raise _fail(job, f"options holds {o!r}, not an Option")
        if not isinstance(o.name, str) or not re.match(r"^[a-z][a-z0-9_]*$", o.name):
            raise _fail(job, f"option name {o.name!r} must be lower_snake_case")
        if o.name in seen:
            raise _fail(job, f"option {o.name!r} is declared twice")
        seen.add(o.name)
        if o.type not in _OPTION_TYPES:
            raise _fail(job, f"option {o.name!r} has type {o.type!r}; use bool, int, "
                        "float or str")
        if isinstance(o.default, str) and o.type is not str:
            raise _fail(job, f"option {o.name!r} has default {o.default!r}; give a value of type "
                        f"{o.type.__name__}, not text")
        o.parse(job.name, o.default)


def _check_evolution(job: Job) -> None:
    declared = {d.name for d in job.states}
    for name in job.dropped_states:
        if not isinstance(name, str) or not name:
            raise _fail(job, f"dropped_states holds {name!r}, not a state name")
        if name in declared:
            raise _fail(job, f"state {name!r} is both declared and in dropped_states")
    for new, old in job.renamed_states.items():
        if new not in declared:
            raise _fail(job, f"renamed_states renames {old!r} to {new!r}, which is not a "
                        f"declared state (states: {sorted(declared)})")
        if not isinstance(old, str) or not old or old == new:
            raise _fail(job, f"renamed_states maps {new!r} to {old!r}: name the stored state")
        if old in job.dropped_states:
            raise _fail(job, f"state {old!r} is both renamed to {new!r} and dropped")
    olds = list(job.renamed_states.values())
    if len(set(olds)) != len(olds):
        raise _fail(job, f"renamed_states renames one state twice: {olds}")


def _check_expectations(job: Job) -> None:
    names = {d.name for d in job.states}
    for name, fn in job.expectations.items():
        if name not in names:
            raise _fail(job, f"expectations name state {name!r}, which is not declared "
                        f"(states: {sorted(names)})")
        if not callable(fn):
            raise _fail(job, f"expectations for state {name!r} is not callable")
