"""The public job API: declare a stateful job once, run it with the library.

See `statebackend.job.api` (the `Job` object and its parts),
`statebackend.job.context` (what the logic sees), `statebackend.job.core`
(the in-process processing of one subtask), `statebackend.job.run` (the run
protocol: `run_job(job, RunConfig(...))`), `statebackend.job.task` (one Spark
task = one subtask), `statebackend.job.input` (listing and reading input),
`statebackend.job.load` (`load_job("pkg.module:attr")`) and docs/write-a-job.md
("Time": event time, timers, TTL).
Importing this package imports neither Spark nor Great Expectations.
"""

from statebackend.errors import JobRunError, RejectThresholdError
from statebackend.job.api import (
    Input,
    Job,
    Option,
    Output,
    PerKey,
    Rule,
    Vectorized,
    aggregating_state,
    between,
    finite,
    list_state,
    map_state,
    not_empty,
    not_null,
    parses,
    record,
    reducing_state,
    value_state,
)
from statebackend.job.config import RunConfig
from statebackend.job.context import BatchContext, KeyContext, KeyTimers, Timers
from statebackend.job.core import ProcessResult, SubtaskProcessor, process, split_rows
from statebackend.job.load import load_job
from statebackend.job.run import format_summary, run_job
from statebackend.state.schema import Upgrade
from statebackend.state.ttl import StateTtl

__all__ = [
    "BatchContext", "Input", "Job", "JobRunError", "KeyContext", "KeyTimers", "Option", "Output",
    "PerKey", "StateTtl", "Timers",
    "ProcessResult", "RejectThresholdError", "Rule", "RunConfig", "SubtaskProcessor",
    "Vectorized", "aggregating_state", "between", "finite", "format_summary", "list_state",
    "load_job", "map_state", "not_empty", "not_null", "parses", "process", "record",
    "reducing_state", "run_job", "split_rows", "Upgrade", "value_state",
]
