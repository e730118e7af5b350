"""Vacuum of the external backend: the database keeps what checkpoints and savepoints read.

Retention retires checkpoints from storage; their database versions stay until a vacuum.
`plan_vacuum` lists the versions the job's committed checkpoints and savepoints name
(from their records, no database needed: printable with ``--dry-run``);
`execute_vacuum` keeps, for each of them (and the readers' head), the newest row per
key along its parent chain, and deletes every other committed row and the versions no
retained chain passes through (statebackend.state.external_store.vacuum). Rows of
uncommitted epochs are the next run's to delete (they may belong to a commit in flight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import UsageError
from statebackend.lifecycle.registry import load_savepoint
from statebackend.lifecycle.savepoint import list_savepoints
from statebackend.progress import ProgressSink
from statebackend.state.external_store import (
    ExternalStore,
    VacuumResult,
    connection,
    vacuum,
)


@dataclass(frozen=True)
class VacuumPlan:
    """The versions of ``job`` in database ``store`` (no credentials) that stay readable."""

    job: str
    store: str
    retained: tuple[int, ...]
    parents: tuple[int | None, ...]  # each retained version's parent, as its record says

    def describe(self) -> list[str]:
        return [f"vacuum plan: job {self.job} in {self.store}: keep what versions "
                f"{list(self.retained)} read (checkpoints and savepoints); delete every "
                "older row they do not read and the versions outside their chains"]

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "store": self.store, "retained_versions": list(self.retained)}


def plan_vacuum(store: CheckpointStore) -> VacuumPlan | None:
    """The job's vacuum plan (None: no committed checkpoint keeps its state externally)."""
    records = store.load_all() + [load_savepoint(store, s.name) for s in list_savepoints(store)
                                  if s.complete]
    # WAL mode keeps one current state, nothing versioned (statebackend.state.external_wal)
    external = [m.external for m in records
                if m.external is not None and m.external.mode == "mvcc"]
    if not external:
        return None
    stores = {e.store for e in external}
    if len(stores) > 1:  # a lineage moved between databases: vacuum neither blindly
        raise UsageError(f"job {store.job!r} has checkpoints in several databases "
                         f"{sorted(stores)}: vacuum refused")
    parents = {e.version: e.parent for e in external}
    retained = tuple(sorted(parents))
    return VacuumPlan(external[0].job, external[0].store, retained,
                      tuple(parents[v] for v in retained))


def execute_vacuum(plan: VacuumPlan, state_db: ExternalStore) -> VacuumResult:
    """Run ``plan`` on ``state_db`` (refused when it is not the plan's database)."""
    if state_db.identity != plan.store:
        raise UsageError(f"job {plan.job!r} keeps its state in {plan.store}, not "
                         f"{state_db.identity}: vacuum refused")
    with connection(state_db, f"vacuum of job {plan.job!r}") as conn:
        return vacuum(state_db, conn, plan.job, dict(zip(plan.retained, plan.parents,
                                                         strict=True)))


@dataclass(frozen=True)
class VacuumReport:
    """What `vacuum_after_retention` did: ``lines`` for people, `to_json` for machines."""

    plan: VacuumPlan
    lines: tuple[str, ...]
    vacuumed: bool | None = None  # None: a dry run
    result: VacuumResult | None = None

    def to_json(self) -> dict[str, Any]:
        out = self.plan.to_json()
        if self.vacuumed is not None:
            out["vacuumed"] = self.vacuumed
        if self.result is not None:
            out.update(rows_deleted=self.result.rows_deleted,
                       versions_deleted=list(self.result.versions_deleted))
        return out


def vacuum_after_retention(store: CheckpointStore, state_db: ExternalStore | None,
                           dry_run: bool, progress: ProgressSink) -> VacuumReport | None:
    """The external backend's vacuum after a retention (None: nothing external to vacuum).
    Without ``state_db`` only a job whose latest checkpoint is external is planned (and
    told it was not vacuumed): other jobs pay one record read, not all of them."""
    if state_db is None:
        latest = store.latest()
        if latest is None or latest.external is None or latest.external.mode != "mvcc":
            return None
    plan = plan_vacuum(store)
    if plan is None:
        return None
    if dry_run:
        return VacuumReport(plan, tuple(plan.describe()))
    if state_db is None:
        return VacuumReport(plan, (f"external versions of job {plan.job} not vacuumed: pass "
                                   f"--state-db to delete what no retained checkpoint reads "
                                   f"in {plan.store}",), vacuumed=False)
    progress.phase(f"vacuuming {plan.store}")
    result = execute_vacuum(plan, state_db)
    return VacuumReport(plan, (f"vacuumed {plan.store}: {result.rows_deleted} rows and "
                               f"{len(result.versions_deleted)} versions deleted; versions "
                               f"{list(plan.retained)} kept",), vacuumed=True, result=result)
