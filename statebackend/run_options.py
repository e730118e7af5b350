"""The options of a job run, declared once: the fields of `RunOptions`.

Each field is one option: its type and default are the field's, and its `RunOption`
record (the field's metadata, built by `option`) carries the help text and says how
each surface shows it. Every surface is derived from `run_options()`:

- ``ckpt run`` and the spark-submit entry point (`statebackend.cli.run`): one flag
  ``--<name-with-dashes>`` per option with ``flag``, with its type, default, help,
  metavar and choices (`command_line` writes such arguments back, for spark-submit);
- the YAML job specs (`statebackend.airflow.config.JobSpec`): one key per option with
  ``spec``, with its type, default and choices checked by `RunOption.parse`;
- the operator (`statebackend.airflow.operators.CkptRunJobOperator`): one keyword
  argument per option with an ``argument``; the ``templated`` ones are its template
  fields, and `statebackend.airflow.steps.build_run_config` renders them per interval
  for a YAML spec;
- `statebackend.job.config.RunConfig` is `RunOptions` plus the storage options (their
  secrets need the storage layer), so the run protocol reads them as typed attributes.

A new run option is one field here; the run protocol then reads it.

This module imports only the base modules: DAG files (through `JobSpec`) and the CLI
parser read it without importing the job package (pyarrow, RocksDB).
"""

from __future__ import annotations

import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from statebackend import defaults
from statebackend.errors import UsageError
from statebackend.settings import boolean, number

_METADATA_KEY = "run_option"


@dataclass(frozen=True)
class RunOption:
    """How one option of a run shows on each surface (module docstring).

    ``name``, ``type``, ``default`` and ``required`` are the `RunOptions` field's
    (filled by `run_options`); ``type`` is the value's type without ``None``.
    """

    help: str
    flag: bool = True             # a ``ckpt run`` flag --<name-with-dashes>
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    spec: bool = True             # a key of a YAML job spec (JobSpec)
    argument: str | None = None   # the operator's keyword argument (None: not an argument)
    templated: bool = False       # Jinja-rendered per run in Airflow
    secret: bool = False          # may hold a password: in no repr
    name: str = ""
    type: type = str
    default: Any = None
    required: bool = False

    @property
    def cli_flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def default_value(self) -> Any:
        """The default (a fresh copy of a mapping: callers may keep it)."""
        return dict(self.default) if isinstance(self.default, Mapping) else self.default

    def parse(self, value: Any, what: str) -> Any:
        """``value`` as this option's type; ``None`` and ``""`` mean unset (the default).

        Numbers may come as text (a rendered template, an expanded ``${VAR}``). Anything
        else is refused in one line naming ``what`` and the value (UsageError).
        """
        if value is None or value == "":
            if self.required:
                raise UsageError(f"{what} is required")
            return self.default_value()
        if self.type is bool:
            return boolean(value, what)
        if self.type in (int, float):
            parsed = number(value, what, minimum=-math.inf, integer=self.type is int)
            return float(parsed) if self.type is float else parsed
        if self.type is dict:
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise UsageError(f"{what} must be a mapping of names to values, got {value!r}")
            return dict(value)
        if not isinstance(value, str):
            raise UsageError(f"{what} {value!r} must be a string")
        if self.choices and value not in self.choices:
            raise UsageError(f"{what} {value!r} is not one of {list(self.choices)}")
        return value


def option(default: Any = MISSING, *, help: str, factory: type | None = None,
           secret: bool = False, **surfaces: Any) -> Any:
    """A `RunOptions` field: its default (none: required; ``factory`` for a mapping) and
    its `RunOption` record (``surfaces``: flag, metavar, choices, spec, argument,
    templated); a ``secret`` one is left out of the repr (it may hold a password)."""
    metadata = {_METADATA_KEY: RunOption(help=help, secret=secret, **surfaces)}
    if factory is not None:
        return field(default_factory=factory, hash=False, metadata=metadata)
    return field(default=default, metadata=metadata, repr=not secret)


@dataclass(frozen=True)
class RunOptions:
    """One run of a job: the options every job shares, plus the job's own ``options``.

    ``job`` is the folder under the storage root (default: the job's name);
    ``parallelism``/``max_parallelism`` only matter on a lineage's first run.
    ``logical_time_ms``: the run's processing time (epoch ms) for processing-time timers
    and TTL; Airflow passes the data interval end; default: the wall clock at start.
    """

    input: str = option(help="folder of Parquet and/or JSON-lines files (optionally .gz)",
                        argument="input_path", templated=True)
    storage: str = option(help="checkpoint storage root URL", argument="storage",
                          templated=True)
    run_id: str = option(help="idempotency key: a committed run id is skipped", spec=False,
                         argument="run_key", templated=True)
    # (``output`` is BaseOperator's XCom reference: the operator says output_path)
    output: str | None = option(None, help="output root (required when the job declares "
                                "outputs)", argument="output_path", templated=True)
    job: str | None = option(None, help="folder under the storage root (default: the job's "
                             "name)", spec=False, argument="job")
    parallelism: int | None = option(None, help="subtasks P (first run of a lineage; later "
                                     "runs keep it)", argument="parallelism")
    max_parallelism: int = option(defaults.MAX_PARALLELISM, help="key groups M, fixed at "
                                  "the first run", argument="max_parallelism")
    # A YAML spec sets it as spark.master; `ckpt run` defaults to spark-submit's --master.
    master: str = option("local[*]", help="Spark master (default: spark-submit's --master, "
                         "else local[*])", spec=False, argument="master")
    max_reject_fraction: float = option(
        defaults.MAX_REJECT_FRACTION, argument="max_reject_fraction",
        help="fail when more than this fraction of rows is rejected")
    quarantine: str | None = option(None, help="folder for rejected rows (default "
                                    "<output>/_quarantine)", argument="quarantine_path",
                                    templated=True)
    start_from: str | None = option(None, help="first run only: start from a savepoint or "
                                    "another job's checkpoint", argument="start_from",
                                    templated=True)
    initial_state: str | None = option(
        None, metavar="STATE=PATH,...", argument="initial_state", templated=True,
        help="first run only: bootstrap the state from tables, a Parquet folder per state "
             "(_timers: the timers), into the lineage's first checkpoint; needs "
             "--parallelism (docs/state-as-data.md)")
    local_dir: str | None = option(None, help="executors' local-recovery folder (default "
                                   "$CKPT_LOCAL_DIR or tmp)", spec=False)
    # The job's own options (Job.options): `ckpt run` makes a flag of each once it loaded
    # the job (`statebackend.cli.run.add_job_options`).
    options: Mapping[str, Any] = option(factory=dict, help="the job's own options "
                                        "(Job.options)", flag=False, argument="job_options",
                                        templated=True)
    fail_subtask: int | None = option(None, help="test hook: that subtask raises after its "
                                      "upload", flag=False, spec=False)
    # e.g. {"airflow": {"dag_id": ..., "run_id": ..., "task_id": ..., "try_number": ...}}
    context: Mapping[str, Any] = option(factory=dict, help="who ran it, recorded in "
                                        "_metadata and the run history (the page links to "
                                        "it)", flag=False, spec=False)
    logical_time_ms: int | None = option(
        None, metavar="MS", spec=False,
        help="the run's processing time (epoch ms) for processing-time timers and TTL; "
             "Airflow passes the data interval's end (default: now)")
    backend: str | None = option(
        None, choices=defaults.BACKENDS, argument="backend",
        help="state backend: rocksdb (out of core), memory (hash tables, for states that "
             "fit: --memory-limit-mb per subtask) or external (a PostgreSQL database, "
             "--state-db; versioned per checkpoint); default: the job's, else the lineage's, "
             "else rocksdb; a lineage on another backend is converted at restore "
             "(docs/state-backends.md)")
    state_db: str | None = option(
        None, metavar="URL", argument="state_db", secret=True,
        help="external backend: its PostgreSQL database, postgresql://user@host:port/db "
             "(never logged; keep a password in ~/.pgpass, not on the command line)")
    state_table: str = option(
        "ckpt_state", metavar="NAME", argument="state_table",
        help="external backend: the table of the state rows (with <name>_versions, "
             "<name>_head and the readers' view <name>_committed)")
    state_mode: str | None = option(
        None, choices=defaults.EXTERNAL_MODES, argument="state_mode",
        help="external backend: mvcc (rows versioned per checkpoint: any retained "
             "checkpoint restores) or wal (one current state; each checkpoint's "
             "write-ahead log is applied after its commit); default: the lineage's, "
             "else mvcc; refused on another backend")
    memory_limit_mb: int = option(
        defaults.MEMORY_LIMIT_MB, metavar="MIB", argument="memory_limit_mb",
        help="memory backend: a subtask whose state grows past this fails (never swaps)")
    connect_session: str = option(
        "job", choices=defaults.CONNECT_SESSIONS, argument="connect_session",
        help="on Spark Connect (--remote): job attaches every run of the job to one session "
             "the server keeps, so a run finds the last run's Python workers idle; new "
             "opens a session per run, released at its end (docs/performance.md)")
    input_reader: str = option("auto", help="how input is read (statebackend.job.input)",
                               choices=("spark", "arrow", "auto"), flag=False, spec=False)
    engine: str | None = option(
        None, choices=defaults.ENGINES, argument="engine",
        help="spark, or local: this process, no JVM (small inputs); auto (default, or "
             "$CKPT_ENGINE; spark under spark-submit) picks local for an input up to 64 "
             "MiB (docs/performance.md)")


def _value_type(hint: Any) -> type:
    """``int | None`` -> int, ``Mapping[str, Any]`` -> dict, ``str`` -> str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    origin = typing.get_origin(hint) or hint
    return dict if isinstance(origin, type) and issubclass(origin, Mapping) else origin


@functools.cache
def run_options() -> tuple[RunOption, ...]:
    """Every option of a run, in `RunOptions` field order, with name, type and default."""
    hints = typing.get_type_hints(RunOptions)
    out = []
    for f in fields(RunOptions):
        default: Any = None
        required = False
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            required = True
        out.append(replace(f.metadata[_METADATA_KEY], name=f.name,
                           type=_value_type(hints[f.name]), default=default,
                           required=required))
    return tuple(out)


def run_option(name: str) -> RunOption:
    """The declaration of option ``name`` (KeyError for an unknown name)."""
    return {o.name: o for o in run_options()}[name]


def annotation_of(name: str) -> Any:
    """The declared type hint of option ``name`` (for classes derived from the options)."""
    return typing.get_type_hints(RunOptions)[name]


def command_line(values: Mapping[str, Any], names: Iterable[str] | None = None) -> list[str]:
    """``ckpt run`` flags for ``values`` (by option name; None left out), then the job's
    own ``options`` as ``--<name> <value>`` (booleans as ``true``/``false``)."""
    wanted = set(values if names is None else names)
    args: list[str] = []
    for opt in run_options():
        value = values.get(opt.name)
        if opt.flag and opt.name in wanted and value is not None:
            args += [opt.cli_flag, _text(value)]
    for name, value in sorted((values.get("options") or {}).items()):
        args += ["--" + name.replace("_", "-"), _text(value)]
    return args


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


__all__ = ["RunOption", "RunOptions", "command_line", "option", "run_option", "run_options"]
