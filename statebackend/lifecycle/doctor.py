"""`ckpt doctor`: what is wrong with a job's lineage, and its safe repairs.

`diagnose` reads everything once (every commit record, the whole commit log, the
ledger and history names, every lease) and lists the problems of
`statebackend.checkpoint.lineage` (forks, lost or replaced records, runs the ledger
forgot) plus malformed records and dead or corrupt leases. Repairs are plans first
(pure, printable with ``--dry-run``), then executed; each execution first writes a
repair record (``runs/repairs/<utc>-<action>.json``) holding the reason and the
bytes of everything it removes, so nothing is lost without a trace:

- `plan_repair` (``--repair``): only what cannot lose a committed run:
  write missing commit-log entries (from their records), rebuild missing ledger
  records (from the log, else from the history), mark lost *middle* records retired
  (later checkpoints hold their state), quarantine malformed *old* records (same
  reason), clear dead leases (expired, or unreadable and untouched for two TTLs).
- `plan_rollback` (``--rollback-to N --reason TEXT``): explicit. Checkpoint N
  becomes the latest: every record above it, and every record of another branch,
  is quarantined; every commit-log entry and retired marker above N is dropped; the
  runs they committed are forgotten (ledger records removed, ``rolledback`` added to
  the history), so those runs count again, once, on top of N.
- `plan_clear_lease` (``--clear-lease NAME``): remove one lease file; a live,
  readable lease only with ``force``.

An external-backend job's latest checkpoint is checked against its database when one is
given (``--state-db``): a commit a crash cut short after ``_metadata`` (readers of the
database still see the older state) is a ``commit-pending`` problem, and ``--repair``
finishes it (`statebackend.checkpoint.external_finish`), as the job's next run would.

Records and log entries are removed by the doctor only: lifecycle commands never
delete ``_metadata``, ``runs/`` or ``leases/`` files they do not own. Changing
records and the ledger needs the writer lease (no run at the same time).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from statebackend import settings
from statebackend.checkpoint import layout
from statebackend.checkpoint import lineage as log
from statebackend.checkpoint.leases import Lease, writer_lease
from statebackend.checkpoint.lineage import LogListing, Problem
from statebackend.checkpoint.metadata import CheckpointMetadata, ParseMemo, utc_now_iso
from statebackend.checkpoint.runs import (
    RunOutcome,
    RunRecord,
    read_run_record,
    safe_run_name,
    write_record,
)
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CheckpointNotFoundError, CkptError, MetadataError, UsageError
from statebackend.storage import Storage

if TYPE_CHECKING:  # the external backend's modules (pyarrow, psycopg) load when used
    from statebackend.checkpoint.external_finish import CommitState
    from statebackend.state.external_store import ExternalStore

LIST_CAP = 20


@dataclass(frozen=True)
class LeaseState:
    name: str
    path: str
    state: str            # live | expired | corrupt
    detail: str           # holder and expiry, or the parse error
    age_seconds: float | None  # since the file was last written
    checkpoint_ids: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "state": self.state,
                "detail": self.detail, "age_seconds": self.age_seconds,
                "checkpoint_ids": list(self.checkpoint_ids)}


@dataclass(frozen=True)
class Diagnosis:
    """A job's lineage read whole: records, the log, leases, and the problems."""

    job: str
    committed: tuple[int, ...]
    records: Mapping[int, CheckpointMetadata]   # parsed records, by id
    malformed: Mapping[int, str]                # id -> why its record does not parse
    log: LogListing
    leases: tuple[LeaseState, ...]
    problems: tuple[Problem, ...]
    ledger: Mapping[str, RunRecord] = field(default_factory=dict)  # read ledger records
    mismatched: frozenset[int] = frozenset()    # records replaced after their commit
    digests: Mapping[int, str] = field(default_factory=dict)  # SHA-256 of each parsed record
    commit: CommitState | None = None  # the latest external checkpoint's, when checked

    @property
    def latest(self) -> int | None:
        return self.committed[-1] if self.committed else None

    @property
    def unchecked_store(self) -> str | None:
        """The database of the latest (external) checkpoint when it was not checked."""
        meta = self.records.get(self.latest or 0)
        if self.commit is None and meta is not None and meta.external is not None:
            return meta.external.store
        return None

    @property
    def blocking(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.blocking)

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "checkpoints": list(self.committed),
                "malformed": {str(k): v for k, v in self.malformed.items()},
                "leases": [x.to_json() for x in self.leases],
                "problems": [p.to_json() for p in self.problems],
                "external": None if self.commit is None else self.commit.to_json(),
                "healthy": not self.problems}


def diagnose(store: CheckpointStore, now: datetime | None = None,
             state_db: ExternalStore | None = None) -> Diagnosis:
    """Read the whole lineage (every record, every log block, every lease) and, given the
    external backend's database ``state_db``, where it stands against the latest record."""
    now = now or datetime.now(UTC)
    storage = store.storage
    ids = store.checkpoint_ids()
    records: dict[int, CheckpointMetadata] = {}
    raw: dict[int, bytes] = {}
    malformed: dict[int, str] = {}
    memo: ParseMemo = {}
    for cid in ids:
        data = store.read_record(cid)
        if data is None:
            continue
        try:
            records[cid] = store.parse(cid, data, memo)
            raw[cid] = data
        except MetadataError as exc:
            malformed[cid] = str(exc)
    committed = tuple(cid for cid in ids if cid in records or cid in malformed)
    names = log.read_log(storage)
    problems = log.check_log(committed, names)
    problems += log.find_forks(list(records), {c: m.parent for c, m in records.items()},
                               {c: m.epoch for c, m in records.items()})
    digests = {c: log.digest_of(b) for c, b in raw.items()}
    replaced = log.check_digests(names, digests, committed[-1] if committed else None)
    problems += replaced
    mismatched = [cid for p in replaced for cid in p.ids]
    if malformed:
        newest = committed[-1]
        old = sorted(c for c in malformed if c != newest)
        if old:
            problems.append(log.Problem(
                "malformed", tuple(old),
                f"commit record(s) of checkpoint(s) {', '.join(map(str, old))} do not parse "
                f"({malformed[old[0]]}); runs go on from the latest, gc and retention refuse",
                "`ckpt doctor --repair` quarantines them (kept in runs/repairs/) and marks "
                "them retired", False))
        if newest in malformed:
            problems.append(log.Problem(
                "malformed", (newest,),
                f"the latest commit record, chk-{newest}/_metadata, does not parse "
                f"({malformed[newest]})",
                "restore it from a backup, or roll back explicitly: `ckpt doctor "
                f"--rollback-to {max(records, default=0) or '...'} --reason ...`", True))
    leases = tuple(_lease_states(storage, now))
    problems += [log.Problem(
        "lease", (), f"lease file {x.path} is unreadable ({x.detail})",
        f"if no writer of job {store.job!r} runs, `ckpt doctor --clear-lease {x.name}` "
        "(`--repair` clears it once it is older than two lease lifetimes)", True)
        for x in leases if x.state == "corrupt"]
    commit = _commit_state(records.get(committed[-1]) if committed else None, state_db)
    if commit is not None and commit.pending:
        problems.append(_pending_problem(commit))
    return Diagnosis(store.job, committed, records, malformed, names, leases, tuple(problems),
                     _ledger(storage, names), frozenset(mismatched), digests, commit)


def _commit_state(latest: CheckpointMetadata | None, state_db: ExternalStore | None
                  ) -> CommitState | None:
    """The database's state against the latest record (None: not external, or no database
    given); another database than the record names is refused in one line."""
    if latest is None or latest.external is None or state_db is None:
        return None
    # the external backend's modules only for an external job checked against its database
    from statebackend.checkpoint.external_finish import commit_state
    from statebackend.checkpoint.restore import external_read

    external_read(latest, state_db)
    return commit_state(state_db, latest, f"checking checkpoint {latest.checkpoint_id}")


def _pending_problem(commit: CommitState) -> log.Problem:
    held = "nothing" if commit.held is None else f"version {commit.held}"
    return log.Problem(
        "commit-pending", (commit.checkpoint_id,),
        f"checkpoint {commit.checkpoint_id} is committed, but {commit.store} holds {held}, "
        f"not its {commit.mode} version {commit.version}: readers of the database still see "
        "older state (a crash cut the commit short)",
        "`ckpt doctor --repair --state-db URL` finishes it (the job's next run does too)",
        False)


def _lease_states(storage: Storage, now: datetime) -> list[LeaseState]:
    out = []
    for name in storage.list_dir(layout.LEASES_DIR):
        path = f"{layout.LEASES_DIR}/{name}"
        if not layout.is_lease_file(path):
            continue
        info = storage.info(path)
        age = None if info is None or info.mtime is None else now.timestamp() - info.mtime
        lease_name = name[:-len(layout.LEASE_SUFFIX)]
        data = storage.read_bytes_if_exists(path)
        if data is None:
            continue
        try:
            lease = Lease.from_bytes(data, storage.url_of(path))
        except MetadataError as exc:
            out.append(LeaseState(lease_name, path, "corrupt", str(exc).split(": ", 1)[-1],
                                  age))
            continue
        state = "expired" if lease.expired(now) else "live"
        out.append(LeaseState(lease_name, path, state,
                              f"{lease.purpose} by {lease.holder} until {lease.expires_at}",
                              age, lease.checkpoint_ids))
    return out


def _ledger(storage: Storage, names: LogListing) -> dict[str, RunRecord]:
    """Every ledger record (read: the doctor may need their checkpoint ids)."""
    out: dict[str, RunRecord] = {}
    for safe in sorted(names.ledger):
        data = storage.read_bytes_if_exists(layout.run_record_path(safe))
        if data is None:
            continue
        try:
            record = RunRecord.from_bytes(data, safe)
        except MetadataError:
            continue
        out[safe] = record
    return out


# -- plans ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RepairAction:
    """One change: ``action`` on ``target`` (a job-relative path), and why."""

    action: str   # write-entry | rebuild-ledger | mark-retired | quarantine | forget-run
    #               | drop-log | clear-lease | finish-commit
    target: str
    why: str
    checkpoint_id: int | None = None
    run_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "target": self.target, "why": self.why,
                "checkpoint": self.checkpoint_id, "run": self.run_id}


@dataclass(frozen=True)
class RepairPlan:
    job: str
    kind: str            # repair | rollback | clear-lease
    reason: str
    actions: tuple[RepairAction, ...]
    rollback_to: int | None = None
    needs_writer: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "kind": self.kind, "reason": self.reason,
                "rollback_to": self.rollback_to,
                "actions": [a.to_json() for a in self.actions]}

    def lines(self, dry_run: bool) -> list[str]:
        verb = "would" if dry_run else "did"
        head = f"doctor {self.kind} of job {self.job}"
        if self.rollback_to is not None:
            head += f" to checkpoint {self.rollback_to}"
        out = [f"{head}: {verb} make {len(self.actions)} change(s) ({self.reason})"]
        out += [f"  {a.action:15} {a.target}: {a.why}" for a in self.actions[:LIST_CAP]]
        if len(self.actions) > LIST_CAP:
            out.append(f"  ... and {len(self.actions) - LIST_CAP} more (--json lists all)")
        return out


def plan_repair(d: Diagnosis, *, now: datetime | None = None,
                ttl_seconds: float | None = None) -> RepairPlan:
    """The safe repairs of ``d`` (module doc); pure."""
    now = now or datetime.now(UTC)
    ttl = ttl_seconds if ttl_seconds is not None else settings.lease_timing()[0]
    acts: list[RepairAction] = []
    have = set(d.committed)
    for cid in d.committed:
        if cid not in d.log.entries and cid in d.records:
            run_id = d.records[cid].run_id
            acts.append(RepairAction("write-entry", layout.chain_entry_path(
                cid, d.digests[cid], safe_run_name(run_id) if run_id else None),
                "a committed record without its commit-log entry", cid))
    for cid, run in sorted(d.log.entry_runs.items()):
        if run and run not in d.log.ledger and (cid in have or cid in d.log.retired):
            acts.append(RepairAction("rebuild-ledger", layout.run_record_path(run),
                                     f"run of checkpoint {cid}, from its commit-log entry", cid,
                                     run))
    known = d.log.ledger | d.log.logged_runs
    for run, outcome in sorted(d.log.history.items()):
        if outcome == "committed" and run not in known:
            acts.append(RepairAction("rebuild-ledger", layout.run_record_path(run),
                                     "recorded as committed in the history only", None, run))
    newest = d.latest or 0
    for cid in sorted(d.log.entries):
        if cid not in have and cid not in d.log.retired and cid < newest:
            acts.append(RepairAction("mark-retired", layout.retired_marker_path(cid),
                                     f"lost record below the latest ({newest}): its state is "
                                     "in the later checkpoints", cid))
    damaged = {cid: f"malformed old record: {why[:120]}" for cid, why in d.malformed.items()}
    damaged.update((cid, "old record replaced after its commit") for cid in d.mismatched)
    for cid in sorted(damaged):
        if cid != newest:
            acts.append(RepairAction("quarantine", layout.metadata_path(cid), damaged[cid], cid))
            acts.append(RepairAction("mark-retired", layout.retired_marker_path(cid),
                                     "its state is in the later checkpoints", cid))
    for x in d.leases:
        dead = x.state == "expired" or (x.state == "corrupt" and x.age_seconds is not None
                                        and x.age_seconds > 2 * ttl)
        if dead:
            acts.append(RepairAction("clear-lease", x.path, f"{x.state} lease ({x.detail})"))
    if d.commit is not None and d.commit.pending:
        acts.append(RepairAction(
            "finish-commit", layout.metadata_path(d.commit.checkpoint_id),
            f"make its {d.commit.mode} version {d.commit.version} the state of "
            f"{d.commit.store}", d.commit.checkpoint_id))
    return RepairPlan(d.job, "repair", "safe repairs", tuple(acts))


def plan_rollback(d: Diagnosis, to: int, reason: str) -> RepairPlan:
    """Make checkpoint ``to`` the latest (module doc); pure. UsageError when ``to`` is not
    a readable committed record or no reason is given."""
    if not reason or not reason.strip():
        raise UsageError("a roll back needs --reason (it is recorded with what it removes)")
    if to not in d.committed:
        raise CheckpointNotFoundError(
            f"checkpoint {to} of job {d.job!r} not found (committed: {list(d.committed)}); "
            "see `ckpt doctor`")
    if to not in d.records or to in d.mismatched:
        raise UsageError(f"cannot roll back job {d.job!r} to checkpoint {to}: it is not a "
                         f"committed, readable checkpoint (committed: {list(d.committed)}, "
                         f"damaged: {sorted(set(d.malformed) | d.mismatched)})")
    ancestry = {to}
    cid = to
    while (parent := d.records[cid].parent) is not None and parent in d.records:
        ancestry.add(parent)
        cid = parent
    floor = min(ancestry)
    quarantined = sorted((c for c in d.committed if c not in ancestry and c > floor),
                         reverse=True)
    held = [(x, c) for x in d.leases if x.state == "live" for c in x.checkpoint_ids
            if c in quarantined]
    if held:
        lease, c = held[0]
        raise UsageError(f"cannot roll back job {d.job!r} to checkpoint {to}: checkpoint {c} "
                         f"is held by the live lease {lease.name} ({lease.detail}); wait until "
                         "it is released")
    acts = [RepairAction("quarantine", layout.metadata_path(c),
                         "above the roll-back point" if c > to else "on another branch", c)
            for c in quarantined]
    forgotten: dict[str, int] = {}
    for c in quarantined:
        meta = d.records.get(c)
        if meta is not None and meta.run_id:
            forgotten[meta.run_id] = c
    for c, run in d.log.entry_runs.items():
        if c > to and run:
            forgotten.setdefault(_run_id_of(d, run, c), c)
    for record in d.ledger.values():
        if record.checkpoint_id > to or record.checkpoint_id in quarantined:
            forgotten.setdefault(record.run_id, record.checkpoint_id)
    acts += [RepairAction("forget-run", layout.run_record_path(safe_run_name(run)),
                          f"committed in checkpoint {c}, which the roll back removes", c, run)
             for run, c in sorted(forgotten.items(), key=lambda kv: (kv[1], kv[0]))]
    drops = [p for c, paths in d.log.entries.items() if c > to or c in quarantined
             for p in paths]
    drops += [layout.retired_marker_path(c) for c in d.log.retired if c > to]
    acts += [RepairAction("drop-log", p, "commit-log file above the roll-back point")
             for p in sorted(drops)]
    return RepairPlan(d.job, "rollback", reason.strip(), tuple(acts), rollback_to=to)


def _run_id_of(d: Diagnosis, safe: str, cid: int) -> str:
    """The run id behind a safe run name: from the ledger or the record (else the name)."""
    record = d.ledger.get(safe)
    if record is not None:
        return record.run_id
    meta = d.records.get(cid)
    return meta.run_id if meta is not None and meta.run_id else safe


def plan_clear_lease(d: Diagnosis, name: str, force: bool = False) -> RepairPlan:
    found = [x for x in d.leases if x.name == name]
    if not found:
        raise UsageError(f"job {d.job!r} has no lease {name!r} (leases: "
                         f"{[x.name for x in d.leases] or 'none'})")
    lease = found[0]
    if lease.state == "live" and not force:
        raise UsageError(f"lease {name!r} of job {d.job!r} is live ({lease.detail}); clear it "
                         "only if its holder is dead: add --force")
    return RepairPlan(d.job, "clear-lease", f"clear the {lease.state} lease {name}",
                      (RepairAction("clear-lease", lease.path, f"{lease.state} lease "
                                                               f"({lease.detail})"),),
                      needs_writer=False)


# -- execution ------------------------------------------------------------------------
@dataclass(frozen=True)
class RepairReport:
    plan: RepairPlan
    dry_run: bool
    record: str | None   # the repair record written (runs/repairs/...)

    def to_json(self) -> dict[str, Any]:
        return dict(self.plan.to_json(), dry_run=self.dry_run, repair_record=self.record)


def execute(store: CheckpointStore, plan: RepairPlan, d: Diagnosis,
            state_db: ExternalStore | None = None) -> RepairReport:
    """Carry out ``plan``: first the repair record (the reason and the bytes of what goes),
    then the changes in the plan's order. Holds the writer lease when the plan changes
    records or the ledger; a ``finish-commit`` writes to ``state_db``."""
    finishing = [a for a in plan.actions if a.action == "finish-commit"]
    if finishing and state_db is None:
        raise UsageError("finishing an external checkpoint's commit needs its database "
                         "(--state-db)")
    if not plan.actions:
        return RepairReport(plan, False, None)
    if not plan.needs_writer:
        record = _write_record(store, plan)
        for a in plan.actions:
            store.storage.delete_many([a.target])
        return RepairReport(plan, False, record)
    with writer_lease(store.storage, f"ckpt doctor {plan.kind}"):
        record = _write_record(store, plan)
        _apply(store, plan, d)
        for a in finishing:
            # the external backend's modules only when a commit is finished
            from statebackend.checkpoint.external_finish import finish_commit

            assert state_db is not None
            cid = _checkpoint_of(a)
            finish_commit(state_db, d.records[cid], store.storage,
                          f"finishing the commit of checkpoint {cid}")
    return RepairReport(plan, False, record)


def _write_record(store: CheckpointStore, plan: RepairPlan) -> str:
    saved = {}
    for a in plan.actions:
        if a.action in ("quarantine", "forget-run", "drop-log", "clear-lease"):
            data = store.storage.read_bytes_if_exists(a.target)
            if data is not None:
                saved[a.target] = data.decode("utf-8", "backslashreplace")
    return log.RepairRecord(plan.kind, plan.reason,
                            {"plan": plan.to_json(), "saved": saved}).write(store.storage)


def _apply(store: CheckpointStore, plan: RepairPlan, d: Diagnosis) -> None:
    storage = store.storage
    by_action: dict[str, list[RepairAction]] = {}
    for a in plan.actions:
        by_action.setdefault(a.action, []).append(a)
    for a in by_action.get("write-entry", ()):
        cid = _checkpoint_of(a)
        data = store.read_record(cid)
        if data is not None:
            log.write_entry(storage, log.ChainEntry.of(store.parse(cid, data), data))
    for a in by_action.get("rebuild-ledger", ()):
        write_record(storage, _rebuilt_record(store, d, a))
    # retired before the records go: a crash leaves retired, not lost, ids
    for a in by_action.get("mark-retired", ()):
        log.mark_retired(storage, [_checkpoint_of(a)])
    # newest first: a crash leaves a shorter lineage with lost entries above, which
    # blocks runs until the roll back is run again
    for a in by_action.get("quarantine", ()):
        _checked(storage.delete_many([a.target]))
    forgotten = by_action.get("forget-run", ())
    for a in forgotten:
        run_id = _run_of(a)
        storage.write_bytes(layout.history_path(
            "".join(c for c in utc_now_iso() if c.isdigit())[:20], safe_run_name(run_id),
            "rolledback"), RunOutcome(run_id, "rolledback", a.checkpoint_id, utc_now_iso(),
                                      0.0, plan.reason).to_bytes())
    _checked(storage.delete_many([a.target for a in forgotten]))
    _checked(storage.delete_many([a.target for a in by_action.get("drop-log", ())]))
    _checked(storage.delete_many([a.target for a in by_action.get("clear-lease", ())]))


def _checkpoint_of(a: RepairAction) -> int:
    """The checkpoint of a write-entry or mark-retired action (the planners name it)."""
    if a.checkpoint_id is None:
        raise UsageError(f"doctor: {a.action} of {a.target} names no checkpoint")
    return a.checkpoint_id


def _run_of(a: RepairAction) -> str:
    """The run of a forget-run action (`plan_rollback` names it)."""
    if a.run_id is None:
        raise UsageError(f"doctor: {a.action} of {a.target} names no run")
    return a.run_id


def _checked(failures: list[tuple[str, str]]) -> None:
    if failures:
        path, why = failures[0]
        raise CkptError(f"doctor: {len(failures)} file(s) not removed, e.g. {path}: {why}; "
                        "run the same repair again")


def _rebuilt_record(store: CheckpointStore, d: Diagnosis, a: RepairAction) -> RunRecord:
    """A ledger record from the commit log (complete), else from the history."""
    if a.checkpoint_id is not None:
        entry = log.entry_of(store.storage, d.log, a.checkpoint_id)
        if entry is not None and entry.run is not None:
            return entry.run
    existing = read_run_record(store.storage, a.run_id or "")
    if existing is not None:
        return existing
    outcome = _history_outcome(store, a.run_id or "")
    cid = outcome.get("checkpoint_id")
    if not isinstance(cid, int) or cid < 1:
        raise MetadataError(f"doctor: the history of run {a.run_id!r} names no checkpoint; "
                            "its ledger record cannot be rebuilt")
    meta = d.records.get(cid)
    return RunRecord(outcome.get("run_id") or a.run_id or "", cid,
                     meta.parallelism if meta is not None else 1,
                     str(outcome.get("started_at", "")), {"rebuilt_from": "history"})


def _history_outcome(store: CheckpointStore, safe: str) -> dict[str, Any]:
    names = [n for n in store.storage.list_dir(layout.HISTORY_DIR)
             if layout.history_name_of(n) == (safe, "committed")]
    if not names:
        return {}
    data = store.storage.read_bytes_if_exists(f"{layout.HISTORY_DIR}/{sorted(names)[-1]}")
    try:
        obj = json.loads(data or b"{}")
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}

