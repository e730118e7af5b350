"""The plan of one run, decided before any task starts: `RunPlan`.

Before anything is written (`run_job`, again under the writer lease): the lineage
the run continues (its latest checkpoint, or ``--start-from`` on a lineage's first
run), how the job's states continue its states (`evolution_plan`: a change that
cannot continue is refused in one line, statebackend.state.schema), the max
parallelism (key groups never change once data exists). Then under the lease: the
input files, the engine (statebackend.engines), the parallelism (the lineage's; a
new lineage's from ``--parallelism`` or the engine) and the clocks
(statebackend.job.clock). `RunPlan` holds all of it, immutable; the tasks' parameters,
the commit record and the summary are computed from it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from statebackend import defaults
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.store import CheckpointStore
from statebackend.defaults import MAX_PARALLELISM as DEFAULT_MAX_PARALLELISM
from statebackend.engines import EngineChoice
from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.job.clock import RunClock
from statebackend.job.config import RunConfig
from statebackend.job.engine import Engine
from statebackend.job.input import InputFiles, choose_reader
from statebackend.lifecycle.savepoint import import_start_point, read_start_point
from statebackend.state.families import INTERNAL_STATES
from statebackend.state.keygroups import check_parallelism
from statebackend.state.schema import (
    KEY,
    MIGRATE_HINT,
    EvolutionPlan,
    StateChange,
    plan_evolution,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    """What one run does (module doc)."""

    job: Job
    config: RunConfig
    job_dir: str  # the job's folder under the storage root
    parent: CheckpointMetadata | None
    parallelism: int
    max_parallelism: int
    files: InputFiles
    choice: EngineChoice
    evolution: EvolutionPlan | None  # None: a new lineage
    clock: RunClock
    warnings: tuple[str, ...] = ()
    started: float = 0.0  # time.perf_counter() at the run's start
    # The subtasks read the input themselves with Arrow (`Engine.reads_input_itself`).
    tasks_read_input: bool = False

    @property
    def checkpoint_id(self) -> int:
        return (self.parent.checkpoint_id if self.parent else 0) + 1  # lineage.py: parent + 1

    @property
    def states(self) -> tuple[dict, ...]:
        """The schemas the commit records (statebackend.state.schema)."""
        return (self.evolution or new_lineage_plan(self.job)).states

    @property
    def key_hash(self) -> str:
        """How the lineage places keys in key groups: its records', or for a new lineage
        the default (`statebackend.defaults.KEY_HASH`)."""
        return self.parent.key_hash if self.parent is not None else defaults.KEY_HASH

    @property
    def backend(self) -> str:
        return run_backend(self.config, self.job, self.parent)

    @property
    def migration(self) -> EvolutionPlan | None:
        """The evolution the subtasks apply after restoring, when it rewrites entries."""
        return self.evolution if self.evolution is not None and self.evolution.rewrites \
            else None

    @property
    def input_reader(self) -> str:
        """The summary's ``input_reader``: the local engine and a Spark run's direct read
        (`statebackend.job.spark_direct`) read every file with Arrow."""
        if self.tasks_read_input:
            return "arrow" if self.files.count else "none"
        return choose_reader(self.files, self.config.input_reader)


def new_lineage_plan(job: Job) -> EvolutionPlan:
    """The schemas of a lineage's first checkpoint: every state added at version 1."""
    return plan_evolution((), job.descriptors, internal=tuple(INTERNAL_STATES))


def base_of(config: RunConfig, store: CheckpointStore) -> CheckpointMetadata | None:
    """What the run would build on: the latest checkpoint, else its start point (read,
    not copied)."""
    latest = store.latest()
    if latest is None and config.start_from:
        return read_start_point(store.root_storage, config.start_from)
    return latest


def evolution_plan(job: Job, base: CheckpointMetadata | None, job_dir: str
                   ) -> EvolutionPlan | None:
    """How the job's states continue ``base``'s (statebackend.state.schema); UsageError
    naming the state and the change when they cannot, before any work."""
    plan = plan_for(job, base)
    if plan is not None and base is not None:  # a plan continues a base
        plan.require_compatible(job.name, f"the lineage of {job_dir!r} (checkpoint "
                                          f"{base.checkpoint_id})")
    return plan


def plan_for(job: Job, base: CheckpointMetadata | None) -> EvolutionPlan | None:
    """The evolution plan of ``job`` on ``base`` (None: a new lineage), refusals included:
    a changed key column is refused like a state change. Internal families (timers, TTL
    index) are the backend's, not compared."""
    if base is None:
        return None
    plan = plan_evolution(base.states, job.descriptors, renamed=job.renamed_states,
                          dropped=job.dropped_states, checkpoint_id=base.checkpoint_id,
                          internal=tuple(INTERNAL_STATES))
    stored_key = base.extra.get("key") if base.extra else None
    if stored_key is not None and stored_key != job.key:
        key = StateChange(KEY, "refused", (
            f"the key column changes from {stored_key!r} to {job.key!r}; {MIGRATE_HINT}",))
        plan = replace(plan, changes=(key, *plan.changes))
    return plan


def run_backend(config: RunConfig, job: Job, parent: CheckpointMetadata | None) -> str:
    """The state backend of a run: its choice (--backend), else the job's, else the
    lineage's, else `statebackend.defaults.BACKEND`. A choice other than the lineage's
    converts its state at restore."""
    return config.backend or job.backend or (
        parent.state_backend if parent is not None else defaults.BACKEND)


def check_state_mode(config: RunConfig, backend: str, job_dir: str) -> None:
    """UsageError for ``--state-mode`` on a run that is not on the external backend: a
    contradiction, not a choice to ignore."""
    if config.state_mode is not None and backend != "external":
        raise UsageError(f"--state-mode {config.state_mode} (ckpt_jobs: state_mode) is a "
                         f"mode of the external backend; this run of job {job_dir!r} is on "
                         f"the {backend} backend")


def check_max_parallelism(config: RunConfig, base: CheckpointMetadata | None) -> None:
    """Key groups never change once data exists: another max parallelism is refused."""
    asked = config.max_parallelism
    if base is not None and asked not in (DEFAULT_MAX_PARALLELISM, base.max_parallelism):
        raise UsageError(f"--max-parallelism {asked} differs from the lineage's "
                         f"{base.max_parallelism}: key groups never change once data exists; "
                         f"{MIGRATE_HINT}")


def parent_of(config: RunConfig, store: CheckpointStore, parent: CheckpointMetadata | None,
            warnings: list[str]) -> CheckpointMetadata | None:
    if config.start_from:
        if parent is None:
            return import_start_point(store.root_storage, store.job, config.start_from)
        warn(warnings, f"--start-from ignored: job {store.job!r} already has checkpoint "
                        f"{parent.checkpoint_id}")
    return parent


def lineage_shape(config: RunConfig, parent: CheckpointMetadata | None, engine: Engine,
                   warnings: list[str]) -> tuple[int, int]:
    if parent is not None:
        if config.parallelism is not None and config.parallelism != parent.parallelism:
            warn(warnings, f"parallelism {config.parallelism} ignored: the lineage keeps "
                            f"{parent.parallelism} (use rescale-restore to change parallelism)")
        return parent.parallelism, parent.max_parallelism
    if config.parallelism is not None:
        check_parallelism(config.parallelism, config.max_parallelism)
        return config.parallelism, config.max_parallelism
    p = min(engine.default_parallelism(), config.max_parallelism)
    check_parallelism(p, config.max_parallelism)
    return p, config.max_parallelism


def warn(warnings: list[str], text: str) -> None:
    """Add ``text`` to the run's warnings (its summary carries them: the CLI prints each
    once on stderr) and log it where the application set up logging (Airflow's task log);
    without a handler Python's last resort would print it a second time."""
    if log.hasHandlers():
        log.warning("%s", text)
    warnings.append(text)
