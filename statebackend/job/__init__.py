"""The public job API: declare a stateful job once, run it with the library.

See `statebackend.job.api` (the `Job` object and its parts),
`statebackend.job.context` (what the logic sees) and `statebackend.job.core`
(the in-process processing of one subtask), and docs/write-a-job.md.
"""

from .api import (
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
from .context import BatchContext, KeyContext
from .core import ProcessResult, SubtaskProcessor, process, split_rows

__all__ = [
    "BatchContext", "Input", "Job", "KeyContext", "Option", "Output", "PerKey",
    "ProcessResult", "Rule", "SubtaskProcessor", "Vectorized", "aggregating_state",
    "between", "finite", "list_state", "map_state", "not_empty", "not_null", "parses",
    "process", "record", "reducing_state", "split_rows", "value_state",
]
