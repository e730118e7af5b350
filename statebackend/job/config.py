"""`RunConfig`: the options of one job run, shared by every job.

The run protocol (`statebackend.job.run`) reads it; the CLI (``ckpt run``), the
Airflow steps and operators build it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from statebackend import defaults
from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.storage import Storage, StorageOptions, open_storage


@dataclass(frozen=True)
class RunConfig:
    """One run of a job: the options every job shares, plus the job's own ``options``.

    ``job`` is the folder under the storage root (default: the job's name);
    ``parallelism``/``max_parallelism`` only matter on a lineage's first run;
    ``storage_options`` are fsspec's (`statebackend.storage.open_storage`) for the
    checkpoint storage, the output and the quarantine; without them s3 reads the
    driver's ``AWS_*`` variables. They reach executors inside the task parameters
    and their repr shows no secret.
    ``fail_subtask`` is a test hook (that subtask raises after its upload).
    ``logical_time_ms``: the run's processing time (epoch ms) for processing-time timers
    and TTL; Airflow passes the data interval end; default: the wall clock at start.
    """

    input: str
    storage: str
    run_id: str
    output: str | None = None
    job: str | None = None
    parallelism: int | None = None
    max_parallelism: int = defaults.MAX_PARALLELISM
    master: str = "local[*]"
    max_reject_fraction: float = defaults.MAX_REJECT_FRACTION
    quarantine: str | None = None  # default: <output>/_quarantine
    start_from: str | None = None
    local_dir: str | None = None  # executors' local-recovery root (default CKPT_LOCAL_DIR/tmp)
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    fail_subtask: int | None = None
    # Who ran it, recorded in `_metadata` and the run history, e.g. {"airflow": {"dag_id":
    # ..., "run_id": ..., "task_id": ..., "try_number": ...}} (the page links to it).
    context: Mapping[str, Any] = field(default_factory=dict, hash=False)
    storage_options: Mapping[str, Any] = field(default_factory=StorageOptions, hash=False)
    logical_time_ms: int | None = None
    input_reader: str = "auto"  # "spark" | "arrow" | "auto" (statebackend.job.input)
    # "spark" | "local" | "auto"; None: $CKPT_ENGINE, else auto (statebackend.job.engine)
    engine: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.storage_options, StorageOptions):  # repr must redact secrets
            object.__setattr__(self, "storage_options", StorageOptions(self.storage_options))

    def open(self, url: str) -> Storage:
        """``url`` (storage, output or quarantine) opened with this run's storage options."""
        return open_storage(url, **self.storage_options)

    def job_dir(self, job: Job) -> str:
        return self.job or job.name

    @property
    def quarantine_url(self) -> str:
        if self.quarantine:
            return self.quarantine
        if not self.output:
            raise UsageError("a job run needs --quarantine or --output (rejected rows go to "
                             "<output>/_quarantine by default)")
        return f"{self.output.rstrip('/')}/_quarantine"
