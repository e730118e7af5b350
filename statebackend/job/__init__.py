"""The public job API: declare a stateful job once, run it with the library.

Everything a job module needs is importable from here (the built-in jobs and the
examples import nothing else of the library: tests/test_public_api.py):

- declaring: `Job`, `Input` and its rules, the states (`value_state` ... with their
  codecs, `record`, `StateTtl`, `Upgrade`), `Output`, `Option`, the logic forms
  `PerKey` and `Vectorized`;
- the logic's view: `KeyContext` (per key), `BatchContext` (vectorized), `Timer`,
  `group_by_key`;
- state as data: `bootstrap_state` (a savepoint from tables, `statebackend.job.bootstrap`);
- running: `run_job(job, RunConfig(...))`, `load_job`, `format_summary`,
  `run_dir_name`, the errors; a job module's command line: ``main =
  entry_point("pkg.module:JOB")`` (`statebackend.job.command`); in process: `process`,
  `open_state`, `SubtaskProcessor`, and `JobTester` for tests of a job's logic;
- state as data: `read_state` and its `ReadOptions` (a checkpoint's state as a Spark
  DataFrame, `statebackend.spark.state_reader`), `bootstrap_state` (a savepoint from
  tables, `statebackend.job.bootstrap`).

See `statebackend.job.api` (the `Job` object and its parts),
`statebackend.job.context` (what the logic sees), `statebackend.job.core`
(the in-process processing of one subtask), `statebackend.job.run` (the run
protocol), `statebackend.job.load` and docs/write-a-job.md.
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
from statebackend.job.bootstrap import bootstrap_state
from statebackend.job.command import entry_point
from statebackend.job.config import RunConfig
from statebackend.job.context import BatchContext, KeyContext, KeyTimers, Timers, group_by_key
from statebackend.job.core import (
    ProcessResult,
    SubtaskProcessor,
    open_state,
    process,
    split_rows,
)
from statebackend.job.load import load_job
from statebackend.job.publish import run_dir_name
from statebackend.job.run import run_job
from statebackend.job.summary import format_summary
from statebackend.job.testing import JobTester, TesterRun
from statebackend.job.transform import TransformOptions, transform_state
from statebackend.job.transform_apply import StateTransform
from statebackend.spark.state_reader import ReadOptions, read_state
from statebackend.state.codecs import BytesCodec, JsonCodec, RecordCodec, StrCodec
from statebackend.state.kinds import AggregateFunction, StateDescriptor
from statebackend.state.schema import Upgrade
from statebackend.state.timers import Timer
from statebackend.state.ttl import StateTtl

__all__ = [
    "AggregateFunction", "BatchContext", "BytesCodec", "Input", "Job", "JobRunError", "JsonCodec",
    "KeyContext", "KeyTimers", "Option", "Output", "PerKey", "ProcessResult", "RecordCodec",
    "RejectThresholdError", "Rule", "RunConfig", "StateDescriptor", "StateTtl", "StrCodec",
    "SubtaskProcessor", "Timer", "Timers", "Upgrade", "Vectorized", "aggregating_state", "between",
    "bootstrap_state", "entry_point", "finite", "format_summary", "group_by_key", "list_state",
    "load_job", "map_state", "not_empty", "not_null", "open_state", "parses", "process", "record",
    "reducing_state", "run_dir_name", "run_job", "split_rows", "value_state",
    # in process, and state as data
    "JobTester", "TesterRun", "ReadOptions", "read_state", "StateTransform", "TransformOptions",
    "transform_state",
]
