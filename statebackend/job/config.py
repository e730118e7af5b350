"""`RunConfig`: the options of one job run, shared by every job.

The options themselves are declared once, with their help, flags and Airflow
surfaces, in `statebackend.run_options.RunOptions`; `RunConfig` adds the storage
options, whose secrets the storage layer redacts. The run protocol
(`statebackend.job.run`) reads it; the CLI (``ckpt run``), the Airflow steps and
operators build it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from statebackend.errors import UsageError
from statebackend.job.api import Job
from statebackend.run_options import RunOptions
from statebackend.storage import Storage, StorageOptions, open_storage


@dataclass(frozen=True)
class RunConfig(RunOptions):
    """One run of a job: `RunOptions` (see there) and the storage options.

    ``storage_options`` are fsspec's (`statebackend.storage.open_storage`) for the
    checkpoint storage, the output and the quarantine; without them s3 reads the
    driver's ``AWS_*`` variables. They reach executors inside the task parameters
    and their repr shows no secret.
    """

    storage_options: Mapping[str, Any] = field(default_factory=StorageOptions, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.storage_options, StorageOptions):  # repr must redact secrets
            object.__setattr__(self, "storage_options", StorageOptions(self.storage_options))

    def open(self, url: str) -> Storage:
        """``url`` (storage, output or quarantine) opened with this run's storage options."""
        return open_storage(url, **self.storage_options)

    def job_dir(self, job: Job) -> str:
        return self.job or job.name

    @property
    def output_url(self) -> str:
        """The output root (a job with outputs needs one: the run checks it first)."""
        if not self.output:
            raise UsageError("this job writes outputs: give --output")
        return self.output

    @property
    def quarantine_url(self) -> str:
        if self.quarantine:
            return self.quarantine
        if not self.output:
            raise UsageError("a job run needs --quarantine or --output (rejected rows go to "
                             "<output>/_quarantine by default)")
        return f"{self.output.rstrip('/')}/_quarantine"
