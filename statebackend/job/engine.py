"""Which engine runs a job run: Spark, or the local engine in this process.

A scheduled run should cost what its data costs. A small input needs no JVM, no
Spark session and no Python workers: the local engine (`statebackend.job.local_engine`)
runs the same subtasks in the driver process. `choose_engine` is a pure decision
(testable without Spark or storage) over the requested engine, the input, the
lineage's parent and the Spark master:

- ``spark`` / ``local``: as asked.
- ``auto`` (the default; ``CKPT_ENGINE`` sets another default): ``local`` unless
  - the input is larger than ``CKPT_LOCAL_ENGINE_MAX_BYTES`` (default 64 MiB) or than
    ``CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES`` (default 1 GiB, the local engine's bound on
    the input it holds), counted decompressed (`input_weight`), or
  - the master is a cluster or a Connect server (not ``local[...]``) and either the
    lineage starts here without ``--parallelism`` (its parallelism is the cluster's)
    or the parent's state exceeds ``CKPT_LOCAL_ENGINE_MAX_STATE_BYTES`` (default
    256 MiB): the driver would download state the executors keep locally.

`input_weight` measures the input as the local engine would hold it: plain files by
their size, Parquet by the decoded size its footers prove at least (when
`check_parquet` kept them: `statebackend.job.input.ParquetFooter`), gzip files by
decompressing them as a stream, only until the running total passes the ``auto``
limit: a gzip bomb costs the driver at most that limit of decompression and goes to
Spark. The limits are read with `statebackend.settings` (one-line errors naming the
variable).

The summary and the commit record say which engine ran and why (``engine``,
``engine_reason``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from statebackend import defaults, settings
from statebackend.errors import UsageError
from statebackend.job.input import decompressed_bytes

if TYPE_CHECKING:
    from statebackend.job.api import Job
    from statebackend.job.task import TaskParams
    from statebackend.progress import ProgressSink

ENGINES = defaults.ENGINES
ENGINE_ENV = "CKPT_ENGINE"
MAX_BYTES_ENV = "CKPT_LOCAL_ENGINE_MAX_BYTES"
MAX_STATE_BYTES_ENV = "CKPT_LOCAL_ENGINE_MAX_STATE_BYTES"
MAX_MEMORY_ENV = "CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES"
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
    if not engine:
        return str(settings.value(ENGINE_ENV))
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r} is unknown; use one of {list(ENGINES)}")
    return engine


def is_local_master(master: str | None) -> bool:
    return bool(master) and _LOCAL_MASTER.fullmatch(master.strip()) is not None


def local_master_cores(master: str | None) -> int:
    """Cores of a ``local[...]`` master (``local[*]``: this machine's)."""
    m = _LOCAL_MASTER.fullmatch((master or "local[*]").strip())
    if m is None or m.group(2) in (None, "*"):
        return 1 if m is not None and m.group(1) is None else (os.cpu_count() or 1)
    return int(m.group(2))


def auto_limit() -> int:
    """Input bytes (decompressed) up to which ``auto`` runs the local engine."""
    return min(int(settings.value(MAX_BYTES_ENV)), int(settings.value(MAX_MEMORY_ENV)))


def input_weight(files, limit: int | None = None) -> int:
    """Bytes the input takes decompressed (module doc), counted only until the total
    passes ``limit`` (default `auto_limit`): a larger result is then a lower bound."""
    limit = auto_limit() if limit is None else limit
    footers = [files.footers[p] for p in files.parquet if p in files.footers]
    total = (files.total_bytes - files.gz_bytes - sum(f.file_bytes for f in footers)
             + sum(f.decoded_bytes for f in footers))
    for path in files.json:
        if total > limit:
            break
        if path.lower().endswith(".gz"):
            total += decompressed_bytes(path, files.options, limit - total)
    return total


def choose_engine(requested: str | None, *, input_bytes: int, master: str | None,
                  first_run_without_parallelism: bool, parent_state_bytes: int) -> EngineChoice:
    """The engine of one run (module doc); pure apart from reading the limits' settings.
    ``input_bytes``: `input_weight` (decompressed, possibly counted only past the limit)."""
    asked = requested_engine(requested)
    if asked != "auto":
        return EngineChoice(asked, f"asked for ({'--engine' if requested else ENGINE_ENV})")
    max_bytes = int(settings.value(MAX_BYTES_ENV))
    max_memory = int(settings.value(MAX_MEMORY_ENV))
    for limit, env in ((max_bytes, MAX_BYTES_ENV), (max_memory, MAX_MEMORY_ENV)):
        if input_bytes > limit:
            return EngineChoice("spark", f"input of at least {mib(input_bytes)} "
                                         f"(decompressed) exceeds the local engine's "
                                         f"{mib(limit)} ({env})")
    if not is_local_master(master):
        if first_run_without_parallelism:
            return EngineChoice("spark", f"the lineage's first run takes its parallelism "
                                         f"from {master}")
        max_state = int(settings.value(MAX_STATE_BYTES_ENV))
        if parent_state_bytes > max_state:
            return EngineChoice("spark", f"state {mib(parent_state_bytes)} exceeds "
                                         f"{mib(max_state)} ({MAX_STATE_BYTES_ENV}): the "
                                         f"executors of {master} keep it locally")
    return EngineChoice("local", f"input {mib(input_bytes)} within the local engine's "
                                 f"{mib(max_bytes)}")


def mib(n: int) -> str:
    """``n`` bytes as MiB with one decimal (engine reasons, input errors)."""
    return f"{n / 2**20:.1f} MiB"
