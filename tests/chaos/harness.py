"""Chaos harness (issue 10): random steps against one job, every invariant checked after each.

One *step* is one operation on the job ``chaos`` of a storage root (file:// in CI)::

    run-new          the next interval's run (new run id, new input folder)
    run-retry        an interval whose run has not committed (killed, failed or refused)
    run-rerun        a committed interval again: skipped, never counted twice
    gc               collect_garbage(grace_seconds=0)
    retain           retain(keep=k), k in 1..3
    savepoint        create_savepoint(latest) under a fresh name
    rescale          rescale(latest) to another parallelism (on the seed's engine)
    wait             sleep until every stale lease has expired
    check-savepoint  restore a savepoint, compare it with the reference of its creation
    tamper           bad luck or an operator between steps (issue 20): delete the newest or
                     a middle commit record, flip a byte of one, delete a ledger record or a
                     commit-log entry, write a corrupt writer lease
    doctor           the operator: `ckpt doctor` diagnoses; a lost or damaged head, or a
                     fork, is rolled back explicitly to the newest intact checkpoint (the
                     runs it forgets count again later); everything else gets --repair

Faults (the only mocks):

- *kill*: a driver ``kill -9`` at a random point of the step. The N-th storage
  mutation the driver makes (write, exclusive create, upload, copy, delete; N
  random, up to the most the step kind has made so far) raises `Killed`, a
  private BaseException; a batch delete first deletes a random prefix. From then
  on every storage mutation of this process is a no-op until the step ends: a dead
  process runs no cleanup, releases no lease and renews no lease, so its writer
  lease stays behind and must expire (short TTL via ``CKPT_LEASE_TTL_SECONDS``).
- *executor*: ``RunConfig.fail_subtask`` / rescale's ``_fail_subtask``: a task
  fails after its upload (a failed attempt, cleaned up by the driver).
- *torn upload*: after a killed run, one upload that no checkpoint references is
  truncated (an executor that died mid-upload).
- *busy GC*: a run pauses longer than the lease TTL before its commit while
  another process runs GC with zero grace and retain(keep=1): only the lease
  heartbeat keeps the run's uploads alive.
- *paused writer* (issue 20): before a random storage write of a run's commit path
  the whole writer freezes past its lease (its heartbeat too, as under SIGSTOP) while
  another writer runs the next interval; then it resumes. It must commit only if its
  commit became visible before the take-over, and never fork the lineage.

Checks after every step (`Checker`):

1. the latest checkpoint restores (every row read: `statebackend.checkpoint.dump.checkpoint_rows`);
2. its rows equal a pandas reference over the events of every committed run
   (count, min_ts, max_ts exact, sum isclose); a run is committed iff a
   checkpoint with its run id was committed (ledger kept from storage);
3. every file of every committed checkpoint and savepoint exists with its size;
4. no run id is committed twice;
5. a run step that returned (ran or skipped) published ``run=<id>/_SUCCESS``;
6. a lease is left only by a killed step, and never renewed after its writer died;
   a LeaseConflictError happens only while such a stale lease is live;
7. no fork: every retained record builds on the one before it;
8. no run lost: every run a step acknowledged stays committed unless the doctor rolled
   it back; a run refused or failed is not committed (the ledger decides, step 2);
9. nothing outside the storage root changed (a canary folder beside it).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pandas as pd
import pytest

from demo.sample_data import DAY_MS, DEFAULT_START_TS_MS, expected_totals, generate_events
from jobs import keyed_aggregation as ka
from statebackend.checkpoint import layout
from statebackend.checkpoint import leases as lease_module
from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.layout import (
    CLAIM_PREFIX,
    LEASES_DIR,
    savepoint_metadata_path,
)
from statebackend.checkpoint.leases import CLAIM_STALE_SECONDS, HeldLease
from statebackend.checkpoint.lineage import find_forks
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import (
    CheckpointNotFoundError,
    CkptError,
    LeaseConflictError,
    LeaseLostError,
    MetadataError,
    SnapshotError,
)
from statebackend.job import RunConfig, external_commit
from statebackend.job import run as run_protocol
from statebackend.lifecycle import doctor
from statebackend.lifecycle.gc import collect_garbage
from statebackend.lifecycle.registry import load_savepoint
from statebackend.lifecycle.retention import retain
from statebackend.lifecycle.savepoint import create_savepoint
from statebackend.lifecycle.vacuum import vacuum_after_retention
from statebackend.progress import NO_PROGRESS
from statebackend.rescale.executor import RescaleOptions, rescale
from statebackend.state.external import ExternalStateBackend
from statebackend.state.external_store import (
    ExternalStore,
    ensure_schema,
    head_version,
    versions,
)
from statebackend.state.external_wal import applied_epoch, ensure_wal_schema
from statebackend.storage import Storage, open_storage

JOB = "chaos"
TTL_ENV = "CKPT_LEASE_TTL_SECONDS"
LEASE_SLACK_S = 0.75  # clock reads of the harness and the library differ by this much at most
MUTATIONS = ("write_bytes", "write_exclusive", "write_atomic", "put_file", "copy",
             "copy_checked", "delete_many", "delete_tree")
# Initial guesses of how many driver-side storage mutations a step kind makes; raised
# as steps run, so kill points spread over the whole step.
MUTATION_GUESS = {"run": 8, "gc": 2, "retain": 3, "savepoint": 12, "rescale": 6}
WEIGHTS = {"run-new": 24, "run-retry": 9, "run-rerun": 7, "gc": 13, "retain": 12,
           "savepoint": 7, "rescale": 7, "wait": 4, "check-savepoint": 3, "tamper": 5,
           "doctor": 6}
TAMPERS = ("lose-head", "lose-middle", "flip-record", "lose-ledger", "lose-log-entry",
           "corrupt-lease")
COMMIT_PATH_WRITES = 7  # _metadata, log entry, cleanup (2), ledger, _SUCCESS, history


class Killed(BaseException):
    """The injected process death (a BaseException: `except Exception` does not stop it)."""


class ChaosViolation(AssertionError):
    """An invariant broke; the message names the seed, the step and what differs."""


# -- fault injection ------------------------------------------------------------------

class FaultInjector:
    """Counts the driver's storage mutations in one step; kills the process at call ``kill_at``,
    or, with ``pause`` (a callable), freezes it before the ``pause_at``-th mutation of its
    commit path (counted from `CheckpointStore.commit`) and calls ``pause`` meanwhile."""

    def __init__(self, kill_at: int | None, rng: random.Random, pause_at: int | None = None,
                 pause: Callable[[], None] | None = None) -> None:
        self.kill_at = kill_at
        self.rng = rng
        self.calls = 0
        self.dead = False
        self.where = ""
        self.pause_at, self.pause = pause_at, pause
        self.committing = False
        self.commit_calls = 0
        self.paused = ""  # where the writer froze, once it did
        self.passthrough = False  # another writer runs while this one is frozen

    def _counted(self, rel: str) -> bool:
        # Heartbeats renew the lease from a background thread at times that depend on
        # the clock: counting them would make the kill point of a seed irreproducible.
        return threading.current_thread() is threading.main_thread() or \
            not str(rel).startswith(f"{LEASES_DIR}/")

    def wrap(self, name: str, original: Callable) -> Callable:
        injector = self

        def mutation(storage: Storage, *args, **kwargs):
            if injector.passthrough:
                return original(storage, *args, **kwargs)
            if injector.dead:
                return _dead_result(name)
            rel = args[1] if name in ("put_file", "copy", "copy_checked") \
                else (args[0] if args else "")
            if injector.committing and injector.pause is not None \
                    and threading.current_thread() is threading.main_thread():
                if injector.commit_calls == injector.pause_at and not injector.paused:
                    injector.paused = f"{name}({_short(args)})"
                    injector.passthrough = True
                    try:
                        injector.pause()
                    finally:
                        injector.passthrough = False
                injector.commit_calls += 1
            if name == "delete_many":
                args = (list(args[0]),) + args[1:]
                rel = args[0][0] if args[0] else ""
            if injector._counted(rel):
                if injector.kill_at is not None and injector.calls == injector.kill_at:
                    injector._die(name, storage, args, original)
                injector.calls += 1
            return original(storage, *args, **kwargs)

        return mutation

    def _die(self, name: str, storage: Storage, args: tuple, original: Callable) -> None:
        self.where = f"{name}({_short(args)})"
        if name == "delete_many" and len(args[0]) > 1:
            cut = self.rng.randrange(len(args[0]))  # killed in the middle of a batch
            original(storage, args[0][:cut])
            self.where += f" after {cut} of {len(args[0])}"
        self.dead = True
        raise Killed(self.where)

    @contextmanager
    def installed(self) -> Iterator[FaultInjector]:
        with pytest.MonkeyPatch.context() as mp:
            # each scheme's class overrides some primitives: wrap every definition
            for cls in (Storage, *Storage.__subclasses__()):
                for name in MUTATIONS:
                    if name in vars(cls):
                        mp.setattr(cls, name, self.wrap(name, vars(cls)[name]))
            real_commit = CheckpointStore.commit
            injector = self

            def commit(store, meta, **kwargs):
                if threading.current_thread() is threading.main_thread():
                    injector.committing = True
                return real_commit(store, meta, **kwargs)

            mp.setattr(CheckpointStore, "commit", commit)
            yield self


def _dead_result(name: str):
    return {"put_file": (0, "crc32c:00000000"), "copy_checked": (0, "crc32c:00000000"),
            "delete_many": []}.get(name)


def _short(args: tuple) -> str:
    first = args[0] if args else ""
    if isinstance(first, list):
        return f"{len(first)} paths, first {first[0] if first else None!r}"
    return repr(first)[:80]


# -- the model: intervals, ledger, savepoints --------------------------------------------

@dataclass
class Interval:
    run_id: str
    input_dir: str
    events: pd.DataFrame


@dataclass
class Model:
    intervals: list[Interval] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)  # run ids, in commit order
    commit_of: dict[str, int] = field(default_factory=dict)  # run id -> its checkpoint id
    savepoints: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> runs in it
    stale: dict[str, tuple[str, str]] = field(default_factory=dict)  # path -> created, expires
    parallelism: int | None = None
    acked: set[str] = field(default_factory=set)        # runs a step returned ok / skipped for
    rolled_back: set[str] = field(default_factory=set)  # runs the doctor rolled back
    damaged: str = ""  # a tamper whose repair is the doctor's (runs may be refused meanwhile)

    def interval(self, run_id: str) -> Interval:
        return next(i for i in self.intervals if i.run_id == run_id)

    def pending(self) -> list[str]:
        done = set(self.committed)
        return [i.run_id for i in self.intervals if i.run_id not in done]

    def reference(self, runs: tuple[str, ...] | list[str] | None = None) -> pd.DataFrame:
        frames = [self.interval(r).events for r in (self.committed if runs is None else runs)]
        return expected_totals([f for f in frames if len(f)])


@dataclass(frozen=True)
class ChaosConfig:
    seed: int
    steps: int
    storage_url: str
    work_dir: str
    kill_probability: float = 0.3
    executor_failure_probability: float = 0.1
    busy_gc_probability: float = 0.04
    events_per_run: tuple[int, int] = (150, 400)
    key_universe: int = 60
    keys_per_run: int = 30
    rerun_retired: bool = True  # also re-run run ids whose checkpoint retention retired
    # The job runs' engine: "spark" (tasks in Python workers, out of the faults' reach) or
    # "local" (subtasks in this process: kills also hit restores, snapshots and uploads)
    engine: str = "spark"
    backend: str | None = None  # the job runs' state backend (None: rocksdb)
    pause_probability: float = 0.06  # a run freezes past its lease in its commit path
    # The external backend's database and its server (tests/postgres_server.py): runs
    # whose database restarts while they snapshot, retention with its vacuum, and the
    # check that the database names only versions committed records name.
    state_db: ExternalStore | None = None
    state_mode: str | None = None  # "wal": the external backend's WAL mode
    postgres: Any = None
    db_restart_probability: float = 0.12


@dataclass
class StepRecord:
    index: int
    kind: str
    detail: str
    outcome: str
    seconds: float


# -- the harness --------------------------------------------------------------------------

class Chaos:
    def __init__(self, config: ChaosConfig, spark) -> None:
        self.config = config
        self.spark = spark
        self.rng = random.Random(config.seed)
        self.model = Model()
        self.store = CheckpointStore(open_storage(config.storage_url), JOB)
        self.output = os.path.join(config.work_dir, "out")
        self.local_dir = os.path.join(config.work_dir, "local")
        self.mutations_seen = dict(MUTATION_GUESS)
        self.history: list[StepRecord] = []
        self.kinds: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.seconds: Counter = Counter()
        self.ttl = float(os.environ.get(TTL_ENV, "0") or 0)
        # a folder beside the storage root: nothing any step does may change it (check 9)
        self.outside = os.path.join(config.work_dir, "outside")
        os.makedirs(self.outside, exist_ok=True)
        for name in ("canary.txt", "canary.sst"):
            with open(os.path.join(self.outside, name), "w") as fh:
                fh.write(f"seed {config.seed}: must never change\n")
        self.outside_before = _snapshot(self.outside)
        self.named_versions: set[int] = set()  # external versions records ever named

    # -- driving --------------------------------------------------------------------
    def run(self) -> dict:
        started = time.monotonic()
        for index in range(self.config.steps):
            self.step(index)
        self.finish()
        return self.summary(time.monotonic() - started)

    def step(self, index: int) -> None:
        kind = self.choose()
        t0 = time.monotonic()
        detail, outcome = getattr(self, "do_" + kind.replace("-", "_"))()
        dt = time.monotonic() - t0
        self.history.append(StepRecord(index, kind, detail, outcome, dt))
        self.kinds[kind] += 1
        self.outcomes[outcome] += 1
        self.seconds[kind] += dt
        self.check(index, kind, outcome, detail)

    def choose(self) -> str:
        m = self.model
        allowed = dict(WEIGHTS)
        if not m.pending() or not m.intervals:
            allowed.pop("run-retry")
        if not m.committed:
            for k in ("run-rerun", "savepoint", "rescale"):
                allowed.pop(k)
        if not self._live_stale():
            allowed.pop("wait")
        if not m.savepoints:
            allowed.pop("check-savepoint")
        if m.damaged:
            allowed.pop("tamper")  # one damage at a time; the operator comes soon
            allowed["doctor"] = 20
        else:
            allowed.pop("doctor")
        kinds = sorted(allowed)
        return self.rng.choices(kinds, [allowed[k] for k in kinds])[0]

    def finish(self) -> None:
        """Recovery: the operator repairs, stale leases expire, every interval commits, the
        state is exact, no acknowledged run is lost."""
        if self.model.damaged:
            self.do_doctor()
        self.do_wait()
        for run_id in self.model.pending():
            _, outcome = self._run(run_id, kill=False, fail=False, busy=False)
            self.check(len(self.history), "final-run", outcome, run_id)
            if outcome not in ("ok", "skipped"):
                self.violation(len(self.history), f"final run {run_id}: {outcome}")
        if self.model.pending():
            self.violation(len(self.history), f"runs never committed: {self.model.pending()}")
        self.check_acked(len(self.history))

    # -- steps ----------------------------------------------------------------------
    def do_run_new(self) -> tuple[str, str]:
        interval = self.new_interval()
        return self._run_step(interval.run_id)

    def do_run_retry(self) -> tuple[str, str]:
        return self._run_step(self.model.pending()[0])

    def do_run_rerun(self) -> tuple[str, str]:
        runs = self.model.committed
        if not self.config.rerun_retired:
            # Only run ids whose checkpoint is still retained (the ledger in
            # statebackend/checkpoint/runs.py remembers the others; this narrows the search).
            retained = {m.run_id for m in self.records()}
            runs = [r for r in runs if r in retained] or runs[-1:]
        return self._run_step(self.rng.choice(runs))

    def _run_step(self, run_id: str) -> tuple[str, str]:
        c = self.config
        self.maybe_wait()
        busy = self.rng.random() < c.busy_gc_probability
        pause = not busy and not self.model.damaged and self.rng.random() < c.pause_probability
        kill = not busy and not pause and self.rng.random() < c.kill_probability
        fail = not busy and not pause and self.rng.random() < c.executor_failure_probability
        restart = self.config.postgres is not None and not pause \
            and self.rng.random() < c.db_restart_probability
        if pause:
            self.do_wait()  # the other writer meets only the paused one's lease
        return self._run(run_id, kill=kill, fail=fail, busy=busy, pause=pause,
                         restart=restart)

    def _run(self, run_id: str, *, kill: bool, fail: bool, busy: bool,
             pause: bool = False, restart: bool = False) -> tuple[str, str]:
        p = self.model.parallelism or self.rng.randint(1, 3)
        fail_subtask = self.rng.randrange(p) if fail else None
        cfg = RunConfig(input=self.model.interval(run_id).input_dir,
                           storage=self.config.storage_url, job=JOB, run_id=run_id,
                           output=self.output, parallelism=p, local_dir=self.local_dir,
                           fail_subtask=fail_subtask, engine=self.config.engine,
                           backend=self.config.backend, **self._db_options())
        detail = f"{run_id} P={p}" + (f" fail_subtask={fail_subtask}" if fail else "") + \
            (" busy-gc" if busy else "")
        allowed: tuple[type, ...] = (ka.JobRunError,) if fail else ()
        frozen = None
        if pause:  # frozen past its lease before a write of its commit path (SIGSTOP)
            frozen = (self.rng.randrange(COMMIT_PATH_WRITES), self.paused_writer)
            allowed = (LeaseConflictError,)  # fenced off, or its id taken: a clean refusal
        if restart:
            detail += " db-restart"
            allowed = (*allowed, ka.JobRunError)
        with self._busy_gc(busy), self._db_restart(restart):
            detail2, outcome = self.attempt("run", lambda: ka.run(cfg, self.spark), kill,
                                            allowed, frozen)
        if outcome == "killed":
            self.tear_an_upload()
        self.sync_ledger()
        if outcome in ("ok", "skipped"):
            self.check_success_marker(run_id)
            self.model.acked.add(run_id)
        return detail + detail2, outcome

    def _db_options(self) -> dict:
        db = self.config.state_db
        return {} if db is None else {"state_db": db.url, "state_table": db.table,
                                      "state_mode": self.config.state_mode}

    @contextmanager
    def _db_restart(self, restart: bool) -> Iterator[None]:
        """The database restarts while the first subtask snapshots (the others' and its
        connections break: the run fails or, opening anew, goes on)."""
        if not restart:
            yield
            return
        real = ExternalStateBackend.take_local_snapshot
        done: list[bool] = []

        def snapshot(backend, *args, **kwargs):
            if not done:
                done.append(True)
                self.config.postgres.restart()
                self.outcomes["db-restarted"] += 1
            return real(backend, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ExternalStateBackend, "take_local_snapshot", snapshot)
            yield

    def paused_writer(self) -> None:
        """While the run is frozen: its leases lapse (no heartbeat), then another writer
        runs the next interval in a thread of its own (a process of its own, as far as
        leases go), and only then does the frozen run go on."""
        frozen = lease_module._HELD.get()  # the frozen run's held leases (this context)
        real_renew = HeldLease.renew

        def renew(held, now=None):
            return True if any(held is f for f in frozen) else real_renew(held, now)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(HeldLease, "renew", renew)
            # until the frozen run's leases lapse (a beat under way may extend them once;
            # frozen while releasing, its lease is no longer in `frozen` but still there)
            paths = {h.lease.path for h in frozen} | {layout.lease_path("writer")}
            for path in sorted(paths):
                while (lease := lease_module.read_lease_file(self.store.storage, path)) \
                        is not None and _epoch(lease.expires_at) + LEASE_SLACK_S > time.time():
                    time.sleep(_epoch(lease.expires_at) - time.time() + LEASE_SLACK_S)
            other = self.new_interval()
            cfg = RunConfig(input=other.input_dir, storage=self.config.storage_url, job=JOB,
                               run_id=other.run_id, output=self.output,
                               parallelism=self.model.parallelism or 2,
                               local_dir=self.local_dir, engine=self.config.engine,
                               backend=self.config.backend, **self._db_options())
            result: list = []
            thread = threading.Thread(target=lambda: result.append(_outcome(
                lambda: ka.run(cfg, self.spark))))
            thread.start()
            thread.join()
        error = result[0] if result else RuntimeError("the other writer did not finish")
        if isinstance(error, BaseException):
            self.violation(len(self.history), f"the writer that took over from a paused one "
                                              f"failed: {type(error).__name__}: {error}")
        self.model.acked.add(other.run_id)
        self.outcomes["took-over-from-paused"] += 1

    def do_gc(self) -> tuple[str, str]:
        kill = self.rng.random() < self.config.kill_probability
        return self.attempt("gc", lambda: collect_garbage(self.store, grace_seconds=0), kill)

    def do_retain(self) -> tuple[str, str]:
        keep = self.rng.randint(1, 3)
        kill = self.rng.random() < self.config.kill_probability
        def retention() -> None:
            report = retain(self.store, keep=keep)
            if self.config.state_db is not None and not report.failures:
                vacuum_after_retention(self.store, self.config.state_db, False, NO_PROGRESS)

        detail, outcome = self.attempt("retain", retention, kill)
        return f"keep={keep}" + detail, outcome

    def do_savepoint(self) -> tuple[str, str]:
        name = f"sp-{len(self.history)}"
        runs = tuple(self.model.committed)
        kill = self.rng.random() < self.config.kill_probability
        detail, outcome = self.attempt(
            "savepoint", lambda: create_savepoint(self.store, "latest", name,
                                                  self.config.state_db), kill)
        if self.store.storage.exists(savepoint_metadata_path(name)):
            self.model.savepoints[name] = runs
        return name + detail, outcome

    def maybe_wait(self) -> None:
        """Most writers facing a stale lease wait it out (a scheduler's retry); the rest
        are refused, which is allowed."""
        if self._live_stale() and self.rng.random() < 0.7:
            self.do_wait()
            self.outcomes["waited-for-stale-lease"] += 1

    def do_rescale(self) -> tuple[str, str]:
        self.maybe_wait()
        try:
            latest = self.store.latest()
        except CkptError as exc:
            if not self.model.damaged:
                raise
            return f"refused: {str(exc)[:100]}", "refused"
        if latest is None:
            return "no checkpoint", "noop"
        q = self.rng.choice([x for x in (1, 2, 3, 4) if x != latest.parallelism])
        fail = self.rng.random() < self.config.executor_failure_probability
        kill = not fail and self.rng.random() < self.config.kill_probability
        fail_at = self.rng.randrange(q) if fail else None
        detail, outcome = self.attempt(
            "rescale", lambda: rescale(self.store, "latest", q, spark=self.spark,
                                       options=RescaleOptions(engine=self.config.engine,
                                                              fail_subtask=fail_at)),
            kill, (SnapshotError,) if fail else ())
        self.sync_ledger()
        return f"{latest.parallelism}->{q}" + (" fail" if fail else "") + detail, outcome

    def do_wait(self) -> tuple[str, str]:
        if not self._live_stale():
            return "nothing stale", "noop"
        until = max(_epoch(exp) for _, exp in self.model.stale.values())
        delay = until - time.time() + LEASE_SLACK_S
        if delay > 60:
            raise ChaosViolation(
                f"seed {self.config.seed}: a stale lease expires {delay:.0f} s after the kill "
                f"({self.model.stale}); with {TTL_ENV}={self.ttl or 'unset'} a killed writer "
                "must not block the job for long (issue 10 defect 3)")
        if delay > 0:
            time.sleep(delay)
        return f"slept {max(delay, 0):.2f}s", "ok"

    def do_check_savepoint(self) -> tuple[str, str]:
        name = self.rng.choice(sorted(self.model.savepoints))
        meta = load_savepoint(self.store, name)
        problems = compare_state(self._rows(meta), self.model.reference(
            self.model.savepoints[name]))
        if problems:
            self.violation(len(self.history), f"savepoint {name} differs from the reference "
                                              f"of its creation: {problems}")
        return name, "ok"

    def do_tamper(self) -> tuple[str, str]:
        """Bad luck or an operator between steps (issue 20)."""
        st = self.store.storage
        ids = self.store.checkpoint_ids()
        kinds = [k for k in TAMPERS if not (k in ("lose-head", "flip-record") and len(ids) < 2)
                 and not (k == "lose-middle" and len(ids) < 3)]
        kind = self.rng.choice(kinds)
        self.outcomes[f"tamper-{kind}"] += 1
        if kind == "lose-head":
            st.delete_many([layout.metadata_path(ids[-1])])
            self.model.damaged = kind
            return f"{kind} chk-{ids[-1]}", "ok"
        if kind == "lose-middle":
            cid = self.rng.choice(ids[1:-1])
            st.delete_many([layout.metadata_path(cid)])
            self.model.damaged = kind
            return f"{kind} chk-{cid}", "ok"
        if kind == "flip-record":
            cid = self.rng.choice(ids)
            data = bytearray(st.read_bytes(layout.metadata_path(cid)))
            at = self.rng.randrange(len(data))
            data[at] ^= 1 << self.rng.randrange(8)
            st.write_bytes(layout.metadata_path(cid), bytes(data))
            self.model.damaged = kind
            return f"{kind} chk-{cid} byte {at}", "ok"
        if kind == "lose-ledger":
            names = [n for n in st.list_dir(layout.RUNS_DIR) if n.endswith(".json")]
            if names:
                st.delete_many([f"{layout.RUNS_DIR}/{self.rng.choice(names)}"])
            return f"{kind} ({len(names)} records)", "ok"
        if kind == "lose-log-entry":
            entries = [f"{layout.CHAIN_DIR}/{b}/{n}" for b in st.list_dir(layout.CHAIN_DIR)
                       for n in st.list_dir(f"{layout.CHAIN_DIR}/{b}") if n.endswith(".json")]
            if entries:
                st.delete_many([self.rng.choice(entries)])
            return f"{kind} ({len(entries)} entries)", "ok"
        if self._live_stale():  # corrupt-lease: a live writer's lease is not ours to break
            return f"{kind}: a live lease, skipped", "noop"
        st.write_bytes(layout.lease_path("writer"), b'{"format_version": 1, "name": "wri')
        self.model.damaged = kind
        return kind, "ok"

    def do_doctor(self) -> tuple[str, str]:
        """The operator: diagnose; roll back a damaged head explicitly (its runs count again
        later); apply the safe repairs; clear a lease known to be garbage."""
        index = len(self.history)
        self.do_wait()  # a killed writer's lease lapses first (the doctor takes the lease)
        d = doctor.diagnose(self.store)
        if any(p.kind in ("fork", "epoch", "duplicate") for p in d.problems):
            self.violation(index, f"the lineage forked: {[p.message for p in d.problems]}")
        done = []
        for lease in d.leases:
            if lease.state == "corrupt":
                doctor.execute(self.store, doctor.plan_clear_lease(d, lease.name, force=True),
                               d)
                done.append(f"cleared {lease.name}")
        newest = d.committed[-1] if d.committed else None
        head = [p for p in d.problems if p.blocking and (
            (p.kind == "lost" and max(p.ids) > (newest or 0))
            or (p.kind in ("malformed", "mismatch") and newest in p.ids))]
        if head:
            d = doctor.diagnose(self.store)
            target = max(c for c in d.records if c not in d.mismatched)
            plan = doctor.plan_rollback(d, target, f"chaos seed {self.config.seed}: {head[0].kind}")
            doctor.execute(self.store, plan, d)
            forgotten = [a.run_id for a in plan.actions if a.action == "forget-run"]
            for run_id in forgotten:
                if run_id in self.model.committed:
                    self.model.committed.remove(run_id)
                self.model.commit_of.pop(run_id, None)
                self.model.acked.discard(run_id)
            done.append(f"rolled back to {target}, forgot {forgotten}")
            self.outcomes["rolled-back"] += 1
        d = doctor.diagnose(self.store)
        plan = doctor.plan_repair(d)
        if plan.actions:
            doctor.execute(self.store, plan, d)
            done.append(f"repaired {sorted({a.action for a in plan.actions})}")
        left = [p.message for p in doctor.diagnose(self.store).blocking]
        if left:
            self.violation(index, f"the doctor left blocking problems: {left}")
        self.model.damaged = ""
        return "; ".join(done) or "healthy", "ok"

    # -- attempts, kills ------------------------------------------------------------
    def attempt(self, kind: str, fn: Callable[[], object], kill: bool,
                allowed: tuple[type, ...] = (),
                pause: tuple[int, Callable[[], None]] | None = None) -> tuple[str, str]:
        kill_at = self.rng.randint(0, self.mutations_seen[kind]) if kill else None
        injector = FaultInjector(kill_at, self.rng, *(pause or (None, None)))
        live_stale = self._live_stale()
        result: object = None
        error: BaseException | None = None
        with injector.installed():
            try:
                result = fn()
            except Killed as exc:
                error = exc
            except Exception as exc:  # noqa: BLE001 - judged below, with the step's history
                error = exc
        if not injector.dead and not injector.paused:
            self.mutations_seen[kind] = max(self.mutations_seen[kind], injector.calls)
        if injector.dead:
            self.record_stale()
            return f" killed at {injector.where}", "killed"
        if injector.paused:
            self.outcomes["paused-writer"] += 1
            where = f" paused before {injector.paused}"
            if error is None:
                return where + ": committed before the take-over", "ok"
            if isinstance(error, LeaseConflictError):
                self.outcomes["paused-writer-fenced"] += 1
                return where + f": refused ({type(error).__name__})", "fenced"
            self.violation(len(self.history), f"a paused {kind} raised "
                                              f"{type(error).__name__}: {error}")
        if self.model.damaged and isinstance(error, CkptError):
            # the lineage is damaged until the doctor comes: refusing is right
            return f" refused: {str(error)[:100]}", "refused"
        if isinstance(error, LeaseLostError):
            # Only a starved heartbeat loses a lease here (no other writer runs): the
            # attempt must not commit, and its expired lease file may stay behind.
            self.record_stale()
            return f" lease lost: {error}", "lease-lost"
        if isinstance(error, LeaseConflictError) and "committed by another" not in str(error):
            if not live_stale:
                self.violation(len(self.history), f"{kind} refused although no stale lease is "
                                                  f"live: {error}")
            return " conflict", "conflict"
        if error is not None and isinstance(error, allowed):
            return f" failed: {str(error)[:120]}", "failed"
        if error is not None:
            self.violation(len(self.history), f"{kind} raised {type(error).__name__}: {error}")
        skipped = isinstance(result, dict) and result.get("skipped") is True
        return "", "skipped" if skipped else "ok"

    def _live_stale(self) -> bool:
        """A stale lease, or the take-over claim of a killed taker, that is not expired."""
        now = time.time()
        return any(_epoch(exp) + LEASE_SLACK_S > now for _, exp in self.model.stale.values())

    def leases(self) -> list:
        """Every lease file that parses (a corrupt one is the doctor's business)."""
        out = []
        for name in self.store.storage.list_dir(LEASES_DIR):
            path = f"{LEASES_DIR}/{name}"
            if not layout.is_lease_file(path):
                continue
            try:
                lease = lease_module.read_lease_file(self.store.storage, path)
            except MetadataError:
                if not self.model.damaged:
                    raise
                continue
            if lease is not None:
                out.append(lease)
        return out

    def record_stale(self) -> None:
        """After a kill: what the dead process left under leases/ (leases, take-over claims)."""
        for lease in self.leases():
            known = self.model.stale.get(lease.path)
            if known is None or known[0] != lease.created_at:
                self.model.stale[lease.path] = (lease.created_at, lease.expires_at)
        for info in self.store.storage.walk_files(LEASES_DIR):
            if info.path.split("/")[-1].startswith(CLAIM_PREFIX) and \
                    info.path not in self.model.stale:
                created = datetime.fromtimestamp(info.mtime or time.time(), UTC)
                expires = created + timedelta(seconds=CLAIM_STALE_SECONDS)
                self.model.stale[info.path] = (created.isoformat(), expires.isoformat())

    def tear_an_upload(self) -> None:
        """An executor killed mid-upload leaves a partial file nobody references."""
        files = {f.path: f.size for f in self.store.storage.walk_files("")}
        referenced = self.referenced_files()
        torn = sorted(p for p, size in files.items() if p not in referenced and size > 1
                      and (p.startswith("shared/") or (p.startswith("chk-") and
                                                       not p.endswith("_metadata"))))
        if torn and self.rng.random() < 0.5:
            path = self.rng.choice(torn)
            data = self.store.storage.read_bytes(path)
            self.store.storage.write_bytes(path, data[: len(data) // 2])
            self.outcomes["torn-upload"] += 1

    @contextmanager
    def _busy_gc(self, busy: bool) -> Iterator[None]:
        """Another process runs GC(grace 0) and retain(keep 1) while the run waits > TTL."""
        if not busy:
            yield
            return
        original = run_protocol.commit_record  # the run's last step before its commit
        pause = max(self.ttl * 1.5, 1.0)

        def commit_later(*args, **kwargs):
            time.sleep(pause)
            other = CheckpointStore(open_storage(self.config.storage_url), JOB)
            collect_garbage(other, grace_seconds=0)
            retain(other, keep=1)
            return original(*args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(run_protocol, "commit_record", commit_later)
            yield

    # -- model updates --------------------------------------------------------------
    def new_interval(self) -> Interval:
        c, n = self.config, len(self.model.intervals)
        run_id = f"i{n:04d}"
        folder = os.path.join(c.work_dir, "in", run_id)
        size = 0 if self.rng.random() < 0.04 else self.rng.randint(*c.events_per_run)
        events = generate_events(
            folder, n_events=size, n_keys=c.keys_per_run, seed=c.seed * 100_003 + n,
            start_ts_ms=DEFAULT_START_TS_MS + n * DAY_MS, fmt=self.rng.choice(["parquet", "json"]),
            key_offset=self.rng.randrange(c.key_universe - c.keys_per_run + 1))
        if size == 0:
            os.makedirs(folder, exist_ok=True)
        interval = Interval(run_id, folder, events)
        self.model.intervals.append(interval)
        return interval

    def records(self) -> list:
        """The committed records that parse (damaged ones are the doctor's business)."""
        out = []
        for cid in self.store.checkpoint_ids():
            try:
                out.append(self.store.load(cid))
            except (MetadataError, CheckpointNotFoundError):
                continue
        return out

    def sync_ledger(self) -> None:
        metas = self.records()
        seen: Counter = Counter(m.run_id for m in metas if m.run_id and m.kind == "checkpoint")
        twice = [r for r, n in seen.items() if n > 1]
        if twice:
            self.violation(len(self.history), f"run ids committed twice: {twice}")
        for m in metas:
            if not m.run_id or m.kind != "checkpoint":
                continue
            first = self.model.commit_of.setdefault(m.run_id, m.checkpoint_id)
            if first != m.checkpoint_id:
                self.violation(len(self.history), f"run {m.run_id} committed twice: chk-{first}, "
                                                  f"then chk-{m.checkpoint_id} (counted twice)")
            if m.run_id not in self.model.committed:
                self.model.committed.append(m.run_id)
        if metas:
            self.model.parallelism = metas[-1].parallelism

    def referenced_files(self) -> dict[str, int]:
        out = {f.path: f.size for m in self.records() for f in m.files}
        for name in self.model.savepoints:
            out.update({f.path: f.size for f in load_savepoint(self.store, name).files})
        return out

    # -- checks ---------------------------------------------------------------------
    def check(self, index: int, kind: str, outcome: str, detail: str) -> None:
        self.sync_ledger()
        self.check_no_fork(index)
        if _snapshot(self.outside) != self.outside_before:
            self.violation(index, f"a file outside the storage root changed: {self.outside}")
        self.check_leases(index, outcome)
        if self.model.damaged:
            return  # refusing is right until the doctor repairs; it is checked after that
        if kind in ("doctor", "tamper") or index % (4 if self.store.storage.remote else 1) == 0:
            self.check_acked(index)
        latest = self.store.latest()
        reference = self.model.reference()
        if latest is None:
            if len(reference):
                self.violation(index, "no checkpoint left, but runs "
                                      f"{self.model.committed} were committed")
        else:
            self.finish_wal_commit(index, latest)
            problems = compare_state(self._rows(latest), reference)
            if problems:
                self.violation(index, f"latest chk-{latest.checkpoint_id} differs from the "
                                      f"reference over {len(self.model.committed)} runs: "
                                      f"{problems}")
        self.check_files(index)
        self.check_versions(index, latest)

    def finish_wal_commit(self, index: int, latest) -> None:
        """WAL mode: the database holds only the applied state, so a kill between
        _metadata and the apply is finished (what the next run does first) before the
        latest checkpoint is read; counted as commit-pending. Applying it must work: the
        database is at its parent's epoch or already at its own."""
        db = self.config.state_db
        if db is None or latest.external is None or latest.external.mode != "wal":
            return
        with db.connect() as conn:
            ensure_wal_schema(db, conn)
            if applied_epoch(db, conn, JOB) != latest.external.version:
                self.outcomes["commit-pending"] += 1
        try:
            external_commit.commit(db, latest, self.store.storage)
        except CkptError as exc:
            self.violation(index, f"the commit of chk-{latest.checkpoint_id} cannot be "
                                  f"finished: {exc}")

    def check_versions(self, index: int, latest) -> None:
        """External backend: each version the database holds was named by a committed
        record (a discarded attempt's epoch is never committed, none twice); the head is
        the latest record's version once its commit finished."""
        db = self.config.state_db
        if db is None or self.config.state_mode == "wal":
            return  # WAL mode: finish_wal_commit checked the applied epoch
        self.named_versions |= {m.external.version for m in self.records() if m.external}
        with db.connect() as conn:
            ensure_schema(db, conn)  # before the first run made it
            held = versions(db, conn, JOB)
            head = head_version(db, conn, JOB)
        stray = sorted(set(held) - self.named_versions)
        if stray:
            self.violation(index, f"database versions {stray} were named by no record")
        if latest is not None and latest.external is not None:
            if latest.external.version not in held:
                self.outcomes["commit-pending"] += 1  # a kill between _metadata and commit
            elif head != latest.external.version and head not in self.named_versions:
                self.violation(index, f"head {head} is no record's version")

    def check_no_fork(self, index: int) -> None:
        metas = self.records()
        forks = find_forks([m.checkpoint_id for m in metas],
                           {m.checkpoint_id: m.parent for m in metas},
                           {m.checkpoint_id: m.epoch for m in metas})
        if forks:
            self.violation(index, f"the lineage forked: {forks[0].message}")

    def check_acked(self, index: int) -> None:
        """No run a step acknowledged is lost: the ledger (or the commit log) has it."""
        lost = sorted(r for r in self.model.acked if self.store.find_run(r) is None)
        if lost:
            self.violation(index, f"acknowledged runs lost (counted nowhere): {lost[:5]}")

    def _rows(self, meta) -> dict[str, dict]:
        try:
            rows = list(checkpoint_rows(self.store, meta, self.config.state_db))
        except Exception as exc:  # noqa: BLE001 - a restore failure is a violation
            self.violation(len(self.history), f"{meta.kind} {meta.checkpoint_id} does not "
                                              f"restore: {type(exc).__name__}: {exc}")
        return {r["key"]: r["value"] for r in rows if r["state"] == "totals"}

    def check_files(self, index: int) -> None:
        stored = {f.path: f.size for f in self.store.storage.walk_files("")}
        bad = [f"{p} ({'missing' if p not in stored else f'{stored[p]} bytes'}, "
               f"recorded {size})" for p, size in sorted(self.referenced_files().items())
               if stored.get(p) != size]
        if bad:
            self.violation(index, f"{len(bad)} referenced files missing or resized: {bad[:5]}")

    def check_leases(self, index: int, outcome: str) -> None:
        for info in self.store.storage.walk_files(LEASES_DIR):
            if info.path.split("/")[-1].startswith(CLAIM_PREFIX) and \
                    info.path not in self.model.stale:
                self.violation(index, f"take-over claim {info.path} was left behind by a step "
                                      f"that ended with {outcome!r}")
        for lease in self.leases():
            known = self.model.stale.get(lease.path)
            if known is None or known[0] != lease.created_at:
                self.violation(index, f"lease {lease.path} ({lease.purpose}) was left behind "
                                      f"by a step that ended with {outcome!r}")
            elif known[1] != lease.expires_at:
                self.violation(index, f"lease {lease.path} of a killed writer was renewed "
                                      f"after its death ({known[1]} -> {lease.expires_at}): "
                                      "its heartbeat outlived it")
        present = {f.path for f in self.store.storage.walk_files(LEASES_DIR)}
        for path in [p for p in self.model.stale if p not in present]:
            del self.model.stale[path]  # taken over (deleted) by a later writer

    def check_success_marker(self, run_id: str) -> None:
        marker = f"{ka.run_dir_name(run_id)}/_SUCCESS"
        if not open_storage(self.output).exists(marker):
            self.violation(len(self.history), f"run {run_id} returned but {self.output}/"
                                              f"{marker} is missing (issue 10 defect 4)")

    def violation(self, index: int, message: str) -> None:
        tail = "\n".join(f"  #{r.index} {r.kind} {r.detail} -> {r.outcome}"
                         for r in self.history[-12:])
        raise ChaosViolation(f"seed {self.config.seed}, step {index}: {message}\n"
                             f"last steps:\n{tail}")

    # -- summary --------------------------------------------------------------------
    def summary(self, seconds: float) -> dict:
        return {"seed": self.config.seed, "steps": len(self.history),
                "seconds": round(seconds, 1), "steps_by_kind": dict(sorted(self.kinds.items())),
                "outcomes": dict(sorted(self.outcomes.items())),
                "seconds_by_kind": {k: round(v, 1) for k, v in sorted(self.seconds.items())},
                "intervals": len(self.model.intervals),
                "committed_runs": len(self.model.committed),
                "savepoints": len(self.model.savepoints),
                "checkpoints_retained": len(self.store.checkpoint_ids())}


def compare_state(state: dict[str, dict], expected: pd.DataFrame) -> list[str]:
    """Differences between a dump (key -> totals) and the pandas reference (first 5)."""
    problems = []
    missing, extra = sorted(set(expected.index) - set(state)), sorted(set(state) -
                                                                       set(expected.index))
    if missing or extra:
        problems.append(f"keys missing {missing[:5]}, unexpected {extra[:5]}")
    for key, row in expected.iterrows():
        got = state.get(key)
        if got is None:
            continue
        same = (got["count"] == row["count"] and got["min_ts"] == row["min_ts"]
                and got["max_ts"] == row["max_ts"]
                and math.isclose(got["sum"], row["sum"], rel_tol=1e-9, abs_tol=1e-9))
        if not same:
            problems.append(f"{key}: got {got}, expected {row.to_dict()}")
        if len(problems) >= 5:
            break
    return problems


def _snapshot(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = fh.read()
    return out


def _outcome(fn: Callable[[], object]) -> object:
    """``fn()``, or the exception it raised (for a thread's result)."""
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        return exc


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).astimezone(UTC).timestamp()


def format_summary(summaries: list[dict]) -> str:
    return "\n".join(json.dumps(s, sort_keys=True) for s in summaries)
