"""Where a job run's or a rescale's subtasks run: Spark tasks, or this process.

Work should cost what its data costs. A small run or rescale needs no JVM, no Spark
job and no Python workers: the local engine runs the same subtasks in this process's
threads (`statebackend.subtasks`). `choose_engine` is the one policy, a pure decision
(testable without Spark or storage) over the requested engine, the Spark master and
the `Workload`:

- storage only this process reaches (``memory://``): ``local`` (an explicit
  ``--engine spark`` is refused: Spark tasks run in other processes);
- ``spark`` / ``local``: as asked;
- ``auto`` (the default; ``CKPT_ENGINE`` sets another default): ``local`` unless
  - the input is larger than ``CKPT_LOCAL_ENGINE_MAX_BYTES`` (default 64 MiB) or than
    ``CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES`` (default 1 GiB, the local engine's bound on
    the input it holds), counted decompressed
    (`statebackend.job.input.input_weight`), or
  - the master is a cluster or a Connect server (not ``local[...]``) and either a
    job's lineage starts here without ``--parallelism`` (its parallelism is the
    cluster's) or the state exceeds ``CKPT_LOCAL_ENGINE_MAX_STATE_BYTES`` (default
    256 MiB): the driver would download state the executors keep locally.

The summaries and commit records say which engine ran and why (``engine``,
``engine_reason``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from statebackend import defaults, settings
from statebackend.errors import UsageError

ENGINES = defaults.ENGINES
ENGINE_ENV = "CKPT_ENGINE"
MAX_BYTES_ENV = "CKPT_LOCAL_ENGINE_MAX_BYTES"
MAX_STATE_BYTES_ENV = "CKPT_LOCAL_ENGINE_MAX_STATE_BYTES"
MAX_MEMORY_ENV = "CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES"
CONNECT_MASTER = "sc://"  # the master of a Spark Connect session, as `choose_engine` sees it
_LOCAL_MASTER = re.compile(r"local(\[(\*|\d+)(,\d+)?\])?")


@dataclass(frozen=True)
class Workload:
    """What `choose_engine` weighs besides the request and the master."""

    input_bytes: int = 0  # decompressed, possibly counted only past the limit
    state_bytes: int = 0  # the state the subtasks restore (parent or source checkpoint)
    new_lineage_without_parallelism: bool = False
    storage_in_process: str | None = None  # the URL of storage only this process reaches
    # (memory://)


@dataclass(frozen=True)
class EngineChoice:
    """The engine of one run or rescale and the one-line reason."""

    engine: str  # "spark" | "local"
    reason: str


def requested_engine(engine: str | None) -> str:
    """``engine``, else ``$CKPT_ENGINE``, else ``auto``; UsageError naming a bad value."""
    if not engine:
        return settings.choice(ENGINE_ENV)
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r} is unknown; use one of {list(ENGINES)}")
    return engine


def is_local_master(master: str | None) -> bool:
    """``local``, ``local[N]``, ``local[*]``, ``local[N,F]``: this machine's executors."""
    return master is not None and _LOCAL_MASTER.fullmatch(master.strip()) is not None


def local_master_cores(master: str | None) -> int:
    """Cores of a ``local[...]`` master (``local[*]`` or none: this machine's)."""
    m = _LOCAL_MASTER.fullmatch((master or "local[*]").strip())
    if m is None or m.group(2) in (None, "*"):
        return 1 if m is not None and m.group(1) is None else (os.cpu_count() or 1)
    return int(m.group(2))


def machine_memory_bytes() -> int:
    """This machine's physical memory (0: unknown): what the local engine's one process
    shares with everything else on it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def auto_limit() -> int:
    """Input bytes (decompressed) up to which ``auto`` runs the local engine."""
    return min(settings.byte_count(MAX_BYTES_ENV), settings.byte_count(MAX_MEMORY_ENV))


def choose_engine(requested: str | None, master: str | None, work: Workload) -> EngineChoice:
    """The engine of one run or rescale (module doc); pure apart from reading settings."""
    asked = requested_engine(requested)
    if work.storage_in_process and asked != "local":
        if requested == "spark":
            raise UsageError(f"storage {work.storage_in_process} lives in one process, but "
                             "Spark tasks run in others: use a file:// path or s3://, or "
                             "--engine local")
        return EngineChoice("local", f"storage {work.storage_in_process} lives in this "
                                     f"process")
    if asked != "auto":
        return EngineChoice(asked, f"asked for ({'--engine' if requested else ENGINE_ENV})")
    max_bytes = settings.byte_count(MAX_BYTES_ENV)
    for limit, env in ((max_bytes, MAX_BYTES_ENV),
                       (settings.byte_count(MAX_MEMORY_ENV), MAX_MEMORY_ENV)):
        if work.input_bytes > limit:
            return EngineChoice("spark", f"input of at least {mib(work.input_bytes)} "
                                         f"(decompressed) exceeds the local engine's "
                                         f"{mib(limit)} ({env})")
    if not is_local_master(master):
        if work.new_lineage_without_parallelism:
            return EngineChoice("spark", f"the lineage's first run takes its parallelism "
                                         f"from {master}")
        max_state = settings.byte_count(MAX_STATE_BYTES_ENV)
        if work.state_bytes > max_state:
            return EngineChoice("spark", f"state {mib(work.state_bytes)} exceeds "
                                         f"{mib(max_state)} ({MAX_STATE_BYTES_ENV}): the "
                                         f"executors of {master} keep it locally")
    if work.input_bytes or not work.state_bytes:
        return EngineChoice("local", f"input {mib(work.input_bytes)} within the local "
                                     f"engine's {mib(max_bytes)}")
    return EngineChoice("local", f"state {mib(work.state_bytes)} on {master or 'local[*]'}: "
                                 f"this process can hold the subtasks")


def mib(n: int) -> str:
    """``n`` bytes as MiB with one decimal (engine reasons, input errors)."""
    return f"{n / 2**20:.1f} MiB"
