"""Errors of the checkpoint lifecycle library.

One base class (`CkptError`) and a few specific subclasses. Every message names
the thing at fault, the offending value and, where there is one, the next step.
The CLI prints `str(error)` as a single line and exits non-zero.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base class of every error this project raises on purpose."""

    exit_code = 1


class UsageError(CkptError):
    """Bad arguments (parallelism out of range, unknown format ...)."""

    exit_code = 2


class StorageError(CkptError):
    """Storage unreachable, a file missing, or a write refused."""

    exit_code = 2


class StateDatabaseError(StorageError):
    """The external backend's database refused or lost a statement (one line)."""


class StorageFullError(StorageError):
    """A bounded storage (memory://) would exceed its maximum size."""


class JobNotFoundError(CkptError):
    """No job folder (no checkpoint, savepoint or lease) under the storage root."""

    exit_code = 2


class CheckpointNotFoundError(CkptError):
    """The requested checkpoint has no committed `_metadata`."""

    exit_code = 2


class MetadataError(CkptError):
    """Metadata that is malformed, truncated, or inconsistent."""


class UnsafePathError(MetadataError):
    """A path in metadata is absolute or escapes the job root."""


class UnsupportedFormatVersionError(MetadataError):
    """Metadata written by a newer (or unknown) format version."""


class SerializationError(CkptError):
    """A stored value or key that cannot be decoded."""


class LeaseConflictError(CkptError):
    """Another writer holds a live lease on this job or checkpoint."""


class SnapshotError(CkptError):
    """A snapshot attempt failed; nothing was committed."""


class CorruptStateError(CkptError):
    """RocksDB reported corruption while reading state (a scan stopped early)."""


class CommitConflictError(LeaseConflictError):
    """Another writer committed the checkpoint id this attempt wanted."""


class LeaseLostError(LeaseConflictError):
    """This writer's lease expired or was taken over while it was still working."""


class MissingFilesError(StorageError):
    """Files a commit record would reference are missing or have the wrong size."""

    exit_code = 1


class InputError(CkptError):
    """Input that cannot be read as a whole (a truncated file, no supported files)."""


class TaskFailedError(CkptError):
    """A task of a job run (a Spark task, or a subtask of the local engine) failed; the
    message is the one-line cause."""


class LineageError(CkptError):
    """A lineage that forked, lost a commit record or forgot a run: readers and writers
    refuse it until `ckpt doctor` repairs it."""


class RejectThresholdError(CkptError):
    """More input rows were rejected than --max-reject-fraction allows; nothing committed."""


class JobRunError(CkptError):
    """A job run's subtasks did not all report; nothing was committed."""
