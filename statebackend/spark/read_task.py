"""What a `read_state` plans for its tasks: the options a user gives (`ReadOptions`) and
the task every reader runs from (`ReadTask`: the Python tasks of
`statebackend.spark.state_reader` and the JVM reader of `statebackend.spark.jvm_reader`).
"""

from __future__ import annotations

from dataclasses import dataclass

from statebackend.checkpoint.metadata import SubtaskHandle
from statebackend.state.external_store import ExternalRead, ExternalStore
from statebackend.state.kinds import StateDescriptor
from statebackend.state.state_table import BATCH_ROWS, TableShape
from statebackend.storage import StorageOptions

READERS = ("auto", "jvm", "python")  # ReadOptions.reader


@dataclass(frozen=True)
class ReadOptions:
    """How `read_state` shapes and reads the state.

    ``explode_lists``: a list state as one row per element (``position``, the element)
    instead of one row per key with an array; ``fields_as_columns``: a record's fields
    as columns, else one struct column ``value``; ``local_dir``: the executors'
    local-recovery root (default ``CKPT_LOCAL_DIR``, else ``<tmp>/ckpt-local``: where
    job runs keep it); ``batch_rows``: about how many entries an Arrow batch holds;
    ``state_db``: the database of an external-backend checkpoint (its key groups are
    queried at the checkpoint's version; refused in one line without it);
    ``columns``: only these columns, in this order (None: every column). A DataFrame
    made by ``mapInArrow`` cannot have its columns pruned by Spark: every column a
    task yields crosses into the JVM, about a quarter of a read of 1M entries of 7
    columns. Name what a query needs (the columns: `statebackend.state.state_table`).
    ``reader``: ``auto`` reads inside the JVM where `statebackend.spark.jvm_reader`
    can (no Python worker; Spark prunes the columns), else through Python tasks;
    ``jvm`` refuses in one line where it cannot; ``python`` always the Python tasks.
    ``pause_file`` is a test hook: each task, once it holds the checkpoint, creates
    ``<pause_file>.paused-<subtask>`` and waits until ``pause_file`` exists.
    """

    explode_lists: bool = False
    fields_as_columns: bool = True
    local_dir: str | None = None
    batch_rows: int = BATCH_ROWS
    pause_file: str | None = None
    state_db: ExternalStore | None = None
    columns: tuple[str, ...] | None = None
    reader: str = "auto"

    @property
    def shape(self) -> TableShape:
        return TableShape(self.explode_lists, self.fields_as_columns, self.batch_rows)


@dataclass(frozen=True)
class ReadTask:
    """Everything a task needs (shipped with the function; storage options redacted in
    its repr)."""

    storage_url: str
    storage_options: StorageOptions
    job: str
    checkpoint_id: int
    record_digest: str  # sha256 of the planned `_metadata`
    max_parallelism: int
    descriptors: tuple[StateDescriptor, ...]  # every column family of the checkpoint
    state: str
    handles: tuple[SubtaskHandle, ...]
    now: int | None  # the clock of the state's TTL domain at the checkpoint
    options: ReadOptions
    external: ExternalRead | None = None  # an external-backend checkpoint's database read


def state_descriptor(task: ReadTask) -> StateDescriptor:
    """The descriptor of the state ``task`` reads."""
    return next(d for d in task.descriptors if d.name == task.state)
