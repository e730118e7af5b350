"""Which engine runs a job run: Spark, or the local engine in this process.

A scheduled run should cost what its data costs. A small input needs no JVM, no
Spark session and no Python workers: the local engine (`statebackend.job.local_engine`)
runs the same subtasks in the driver process. `choose_engine` is a pure decision
(testable without Spark or storage) over the requested engine, the input, the
lineage's parent and the Spark master:

- ``spark`` / ``local``: as asked.
- ``auto`` (the default; ``CKPT_ENGINE`` sets another default): ``local`` unless
  - the input is larger than ``CKPT_LOCAL_ENGINE_MAX_BYTES`` (default 64 MiB; a
    gzip file counts `GZIP_EXPANSION` times its size), or
  - the master is a cluster or a Connect server (not ``local[...]``) and either the
    lineage starts here without ``--parallelism`` (its parallelism is the cluster's)
    or the parent's state exceeds ``CKPT_LOCAL_ENGINE_MAX_STATE_BYTES`` (default
    256 MiB): the driver would download state the executors keep locally.

The summary and the commit record say which engine ran and why (``engine``,
``engine_reason``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from statebackend import defaults
from statebackend.errors import UsageError

if TYPE_CHECKING:
    from statebackend.job.api import Job
    from statebackend.job.task import TaskParams
    from statebackend.progress import ProgressSink

ENGINES = defaults.ENGINES
ENGINE_ENV = "CKPT_ENGINE"
MAX_BYTES_ENV = "CKPT_LOCAL_ENGINE_MAX_BYTES"
MAX_STATE_BYTES_ENV = "CKPT_LOCAL_ENGINE_MAX_STATE_BYTES"
GZIP_EXPANSION = 8  # JSON lines compress about this well: what a .gz file becomes in memory
_LOCAL_MASTER = re.compile(r"local(\[(\*|\d+)(,\d+)?\])?")


class Engine(Protocol):
    """What the run protocol asks of an engine (`SparkEngine`, `LocalEngine`)."""

    name: str
    task_word: str  # "a Spark task" | "a local subtask": where a failure happened

    def default_parallelism(self) -> int:
        """P of a new lineage run without ``--parallelism``."""

    def max_event_time(self, job: Job, watermark: int | None, progress: ProgressSink,
                       label: str) -> int | None:
        """Max event time of the input rows the tasks will accept."""

    def run_tasks(self, params: TaskParams, progress: ProgressSink, *, label: str,
                  upstream: str, description: str, group_prefix: str,
                  batch_rows: int) -> list[dict]:
        """One result row per subtask (`statebackend.job.task.RESULT_SCHEMA`)."""


@dataclass(frozen=True)
class EngineChoice:
    """The engine of one run and the one-line reason."""

    engine: str  # "spark" | "local"
    reason: str


def requested_engine(engine: str | None) -> str:
    """``engine``, else ``$CKPT_ENGINE``, else ``auto``; UsageError naming a bad value."""
    value = engine or os.environ.get(ENGINE_ENV) or defaults.ENGINE
    if value not in ENGINES:
        source = "--engine" if engine else ENGINE_ENV
        raise UsageError(f"{source} {value!r} is unknown; use one of {list(ENGINES)}")
    return value


def is_local_master(master: str | None) -> bool:
    return bool(master) and _LOCAL_MASTER.fullmatch(master.strip()) is not None


def local_master_cores(master: str | None) -> int:
    """Cores of a ``local[...]`` master (``local[*]``: this machine's)."""
    m = _LOCAL_MASTER.fullmatch((master or "local[*]").strip())
    if m is None or m.group(2) in (None, "*"):
        return 1 if m is not None and m.group(1) is None else (os.cpu_count() or 1)
    return int(m.group(2))


def input_weight(files) -> int:
    """Bytes the input takes in memory, estimated: gzip files count `GZIP_EXPANSION`x."""
    return files.total_bytes + (GZIP_EXPANSION - 1) * files.gz_bytes


def _limit(env: str, default: int) -> int:
    text = os.environ.get(env)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{env}={text!r} is not a byte count") from None
    if value < 0:
        raise UsageError(f"{env}={text!r} must not be negative")
    return value


def choose_engine(requested: str | None, *, input_bytes: int, master: str | None,
                  first_run_without_parallelism: bool, parent_state_bytes: int) -> EngineChoice:
    """The engine of one run (module doc); pure apart from reading the limits' variables."""
    asked = requested_engine(requested)
    if asked != "auto":
        return EngineChoice(asked, f"asked for ({'--engine' if requested else ENGINE_ENV})")
    max_bytes = _limit(MAX_BYTES_ENV, defaults.LOCAL_ENGINE_MAX_BYTES)
    if input_bytes > max_bytes:
        return EngineChoice("spark", f"input {_mib(input_bytes)} exceeds the local engine's "
                                     f"{_mib(max_bytes)} ({MAX_BYTES_ENV})")
    if not is_local_master(master):
        if first_run_without_parallelism:
            return EngineChoice("spark", f"the lineage's first run takes its parallelism "
                                         f"from {master}")
        max_state = _limit(MAX_STATE_BYTES_ENV, defaults.LOCAL_ENGINE_MAX_STATE_BYTES)
        if parent_state_bytes > max_state:
            return EngineChoice("spark", f"state {_mib(parent_state_bytes)} exceeds "
                                         f"{_mib(max_state)} ({MAX_STATE_BYTES_ENV}): the "
                                         f"executors of {master} keep it locally")
    return EngineChoice("local", f"input {_mib(input_bytes)} within the local engine's "
                                 f"{_mib(max_bytes)}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
