"""Stateful job definitions for the Airflow DAGs (``ckpt_jobs``): load, check, expand.

Where the definitions come from (first match wins):

1. the file named by ``CKPT_JOBS_FILE`` (YAML or JSON);
2. the Airflow Variable ``ckpt_jobs`` (YAML or JSON text; also read from the
   ``AIRFLOW_VAR_CKPT_JOBS`` environment variable without touching the database);
3. the default file the caller names (the DAG files: ``ckpt_jobs.yaml`` beside
   them), else ``ckpt_jobs.yaml`` in Airflow's DAGs folder.

Shape::

    defaults:                 # optional, merged into every job (job keys win)
      storage: s3://bucket/checkpoints
      storage_conn_id: aws_ckpt   # AWS connection: credentials as storage options
      state_db_conn_id: ckpt_state  # postgres connection: the external backend's database
      index_key_conn_id: ckpt_index_key  # its password signs GC's registry index
      spark: {mode: local, master: "local[*]"}
      engine: auto            # or spark / local (statebackend.job.engine)
    jobs:
      clicks:                 # entry name = folder under the storage root
        job: keyed_aggregation        # a built-in job, or pkg.module:attribute
        options: {}                   # the job's own options (Job.options)
        input: /data/events/dt={{ ds }}
        output: /data/out/clicks/dt={{ ds }}
        parallelism: 2

``job`` names the code to run: a built-in name registered under the
``statebackend.jobs`` entry-point group (this distribution registers
``keyed_aggregation``) or ``pkg.module:attribute`` of a `statebackend.job.Job`.
Only this configuration chooses code; nothing read from storage does.
``options`` are checked against the job's declared options when its task runs.
The run settings (``input``, ``output``, ``parallelism``, ``engine`` ...) are the run
options declared in `statebackend.run_options` with ``spec``: their types, defaults and
choices come from there; ``spark.master`` is the run's master. Unset settings take the
library's defaults (`statebackend.defaults`).

String values may use ``${VAR}`` / ``${VAR:-default}`` (expanded from the
environment at load time) and Jinja fields ``{{ ds }}``, ``{{ ds_nodash }}``,
``{{ ts }}``, ``{{ run_id }}`` (rendered per run). Unknown keys are refused so a
typo does not silently fall back to a default.

This module is imported by DAG files at parse time: it must stay light (stdlib,
yaml). Nothing here touches Spark, RocksDB or storage.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from datetime import UTC, datetime
from importlib.metadata import entry_points
from typing import Any

from statebackend import defaults
from statebackend.checkpoint.store import check_job_name
from statebackend.errors import UsageError
from statebackend.run_options import RunOption, annotation_of, run_option, run_options

CONFIG_ENV = "CKPT_JOBS_FILE"
VARIABLE_NAME = "ckpt_jobs"
CONFIG_FILE_NAME = "ckpt_jobs.yaml"
SPARK_MODES = ("local", "submit")
JOBS_ENTRY_POINT_GROUP = "statebackend.jobs"  # built-in job name -> "module:attr"
DEFAULT_JOB = "keyed_aggregation"
_JOB_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The form `statebackend.job.load_job` takes (checked here without importing the job API,
# which pulls in pyarrow: DAG files load this module at parse time).
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_JOB_REF_RE = re.compile(rf"^{_DOTTED}:{_DOTTED}$")


def is_job_ref(text: str) -> bool:
    return bool(_JOB_REF_RE.match(text or ""))
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class JobConfigError(UsageError):
    """A job definition is missing, malformed or names an unknown setting."""


@dataclass(frozen=True)
class SparkSettings:
    """How the job's Spark runs: in the task process (``local``) or via spark-submit."""

    mode: str = "local"
    master: str = run_option("master").default
    conn_id: str = "spark_default"  # SparkSubmitOperator connection (submit mode)
    conf: dict = field(default_factory=dict)  # extra --conf for spark-submit


# The run options a job spec sets (`statebackend.run_options`), and the keys every job
# spec needs (a deployment's job writes output).
SPEC_RUN_OPTIONS: tuple[RunOption, ...] = tuple(o for o in run_options() if o.spec)
REQUIRED_KEYS = ("input", "output", "storage")


def _run_field(opt: RunOption) -> Any:
    if opt.required:
        return field()
    if isinstance(opt.default, dict):
        return field(default_factory=opt.default_value)
    return field(default=opt.default, repr=not opt.secret)


# JobSpec's run settings: one field per declared option, with its type and default.
_RunSettings = make_dataclass(
    "_RunSettings", [(o.name, annotation_of(o.name), _run_field(o)) for o in SPEC_RUN_OPTIONS],
    frozen=True, kw_only=True)
_RunSettings.__module__ = __name__


@dataclass(frozen=True, kw_only=True)
class JobSpec(_RunSettings):  # type: ignore[misc,valid-type]
    """One stateful job: its run settings (the declared run options, see `_RunSettings`)
    and the schedule/lifecycle settings of its three DAGs."""

    name: str
    job: str = DEFAULT_JOB  # built-in job name or "pkg.module:attribute"
    storage_conn_id: str | None = None  # Airflow AWS connection -> storage options
    # Airflow postgres connection -> the external backend's database (instead of state_db)
    state_db_conn_id: str | None = None
    # Airflow connection whose password signs the registry index GC and retention read:
    # the same key on every worker (statebackend.lifecycle.index_signing), where each
    # host's own key would leave another host's index untrusted (every record re-read)
    index_key_conn_id: str | None = None
    spark: SparkSettings = field(default_factory=SparkSettings)
    schedule: str = "@daily"
    maintenance_schedule: str = "@daily"
    start_date: str = "2026-01-01"
    catchup: bool = False
    keep: int = defaults.RETENTION_KEEP
    gc_grace_seconds: float = defaults.GC_GRACE_SECONDS
    retries: int = 2
    retry_delay_seconds: float = 60.0
    max_retry_delay_seconds: float = 1800.0
    tags: tuple[str, ...] = ()

    @property
    def pipeline_dag_id(self) -> str:
        return f"{self.name}_pipeline"

    @property
    def maintenance_dag_id(self) -> str:
        return f"{self.name}_maintenance"

    @property
    def rescale_dag_id(self) -> str:
        return f"{self.name}_rescale_restore"

    @property
    def reports_dag_id(self) -> str:
        return f"{self.name}_reports"

    @property
    def asset_name(self) -> str:
        return f"ckpt_{self.name}"

    @property
    def asset_uri(self) -> str:
        """The job root as a URI (the Asset the pipeline publishes)."""
        root = self.storage.rstrip("/")
        if "://" not in root:
            root = "file://" + os.path.abspath(root)
        return f"{root}/{self.name}"

    def start_datetime(self) -> datetime:
        try:
            value = datetime.fromisoformat(self.start_date)
        except ValueError as exc:
            raise JobConfigError(f"job {self.name!r}: start_date {self.start_date!r} is not "
                                 "an ISO date (YYYY-MM-DD)") from exc
        return value if value.tzinfo else value.replace(tzinfo=UTC)

    def job_ref(self) -> str:
        """``module:attr`` of the job's code (a built-in name resolved; see `builtin_jobs`)."""
        return resolve_job_ref(self.job, self.name)

    def to_json(self) -> dict:
        data = asdict(self)
        data["tags"] = list(self.tags)
        return data


def builtin_jobs() -> dict[str, str]:
    """Built-in job names -> ``module:attr``, from the ``statebackend.jobs`` entry points.

    Installed distributions register their named jobs there (pyproject.toml:
    ``[project.entry-points."statebackend.jobs"]``); the library names no job itself.
    """
    return {ep.name: ep.value for ep in entry_points(group=JOBS_ENTRY_POINT_GROUP)}


def resolve_job_ref(job: str, entry: str = "?") -> str:
    """``job`` as ``module:attr``: itself when it has that form, else a built-in's."""
    if is_job_ref(job):
        return job
    known = builtin_jobs()
    if job in known:
        return known[job]
    raise JobConfigError(f"ckpt_jobs entry {entry!r}: job {job!r} is neither a built-in job "
                         f"{sorted(known)} nor of the form package.module:attribute")


def expand_env(value: object, environ: Mapping[str, str] | None = None) -> object:
    """Expand ``${VAR}`` / ``${VAR:-default}`` in every string of a nested value."""
    env = os.environ if environ is None else environ
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            name, default = m.group(1), m.group(2)
            got = env.get(name)
            if got:
                return got
            if default is None:
                raise JobConfigError(f"environment variable {name} is not set (used in ckpt_jobs)")
            return default
        return _ENV_RE.sub(sub, value)
    if isinstance(value, dict):
        return {k: expand_env(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, env) for v in value]
    return value


def parse_config_text(text: str, where: str) -> dict:
    """YAML (a superset of JSON) into a dict with a ``jobs`` mapping."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobConfigError(f"{where}: not valid YAML/JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), dict) or not data["jobs"]:
        raise JobConfigError(f"{where}: expected a mapping with a non-empty 'jobs' mapping")
    return data


def _known(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def spec_from_dict(name: str, raw: dict, defaults: dict | None = None,
                   where: str = "ckpt_jobs") -> JobSpec:
    """Merge defaults, check keys and types, build a JobSpec."""
    check_job_name(name)
    if not isinstance(raw, dict):
        raise JobConfigError(f"{where}: job {name!r} must be a mapping")
    merged = dict(defaults or {})
    spark = dict(merged.pop("spark", None) or {})
    merged.update(raw)
    spark.update(merged.pop("spark", None) or {})
    merged.pop("name", None)
    unknown = set(merged) - _known(JobSpec)
    if unknown:
        raise JobConfigError(f"{where}: job {name!r} has unknown setting(s) {sorted(unknown)}")
    unknown = set(spark) - _known(SparkSettings)
    if unknown:
        raise JobConfigError(f"{where}: job {name!r} spark has unknown setting(s) "
                             f"{sorted(unknown)}")
    for required in REQUIRED_KEYS:
        if not merged.get(required):
            raise JobConfigError(f"{where}: job {name!r} needs '{required}'")
    settings = SparkSettings(**spark)
    if settings.mode not in SPARK_MODES:
        raise JobConfigError(f"{where}: job {name!r} spark.mode {settings.mode!r} is not one of "
                             f"{list(SPARK_MODES)}")
    _check_job(name, merged, where)
    _parse_run_settings(name, merged, where)
    if merged.get("engine") == "local" and settings.mode == "submit":
        raise JobConfigError(f"{where}: job {name!r}: engine 'local' runs in the Airflow "
                             "task, spark.mode 'submit' in a spark-submit application: "
                             "choose one")
    merged["tags"] = tuple(merged.get("tags") or ())
    for conn_key in ("storage_conn_id", "state_db_conn_id", "index_key_conn_id"):
        if merged.get(conn_key) == "":
            merged[conn_key] = None
    if merged.get("state_db_conn_id") and merged.get("state_db"):
        raise JobConfigError(f"{where}: job {name!r}: give state_db or state_db_conn_id, "
                             "not both")
    try:
        spec = JobSpec(name=name, spark=settings, **merged)
        _check_numbers(spec)
    except (TypeError, ValueError) as exc:
        raise JobConfigError(f"{where}: job {name!r}: {exc}") from exc
    spec.start_datetime()
    return spec


def _check_job(name: str, merged: dict, where: str) -> None:
    """``job`` is a name or module:attr (resolved when a task runs); ``options`` a mapping."""
    job = merged.setdefault("job", DEFAULT_JOB)
    if not isinstance(job, str) or not (is_job_ref(job) or _JOB_NAME_RE.match(job)):
        raise JobConfigError(f"{where}: job {name!r}: 'job' {job!r} must be a built-in job "
                             "name or package.module:attribute")
    options = merged.get("options")
    if options is None:
        merged["options"] = {}
    elif not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise JobConfigError(f"{where}: job {name!r}: 'options' must be a mapping of option "
                             f"names to values, got {options!r}")


def _parse_run_settings(name: str, merged: dict, where: str) -> None:
    """Each run setting given, as its declared type (numbers may be ``${VAR}`` text),
    within its choices; ``""`` is unset (the default)."""
    for opt in SPEC_RUN_OPTIONS:
        if opt.name in merged:
            try:
                merged[opt.name] = opt.parse(merged[opt.name], f"{where}: job {name!r} "
                                                               f"{opt.name}")
            except UsageError as exc:
                raise JobConfigError(str(exc)) from exc


def _check_numbers(spec: JobSpec) -> None:
    if spec.parallelism is not None:
        p = spec.parallelism
        if not isinstance(p, int) or not 1 <= p <= spec.max_parallelism:
            raise ValueError(f"parallelism {spec.parallelism!r} must be an integer in "
                             f"1..max_parallelism ({spec.max_parallelism})")
    if not isinstance(spec.max_parallelism, int) or not 1 <= spec.max_parallelism <= 32768:
        raise ValueError(f"max_parallelism {spec.max_parallelism!r} must be in 1..32768")
    if not isinstance(spec.keep, int) or spec.keep < 1:
        raise ValueError(f"keep {spec.keep!r} must be an integer >= 1")
    if float(spec.gc_grace_seconds) < 0:
        raise ValueError(f"gc_grace_seconds {spec.gc_grace_seconds!r} must be >= 0")
    if not isinstance(spec.retries, int) or spec.retries < 0:
        raise ValueError(f"retries {spec.retries!r} must be an integer >= 0")


def specs_from_config(data: dict, where: str = "ckpt_jobs",
                      environ: Mapping[str, str] | None = None) -> list[JobSpec]:
    expanded = expand_env(data, environ)
    if not isinstance(expanded, dict):
        raise JobConfigError(f"{where}: the configuration must be a mapping")
    data = expanded
    unknown = set(data) - {"defaults", "jobs"}
    if unknown:
        raise JobConfigError(f"{where}: unknown top-level key(s) {sorted(unknown)}; "
                             "use 'defaults' and 'jobs'")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise JobConfigError(f"{where}: 'defaults' must be a mapping")
    return [spec_from_dict(str(name), raw, defaults, where)
            for name, raw in sorted(data["jobs"].items())]


def _variable_text() -> str | None:
    """The ``ckpt_jobs`` Variable, or None when unset or Airflow is not reachable."""
    text = os.environ.get(f"AIRFLOW_VAR_{VARIABLE_NAME.upper()}")
    if text:
        return text
    if os.environ.get("CKPT_JOBS_SKIP_VARIABLE"):
        return None
    try:
        from airflow.sdk import Variable

        return Variable.get(VARIABLE_NAME, default=None)
    except Exception:  # noqa: BLE001 - no metadata DB / API at hand: fall back to the file
        return None


def dags_folder_config() -> str:
    """``ckpt_jobs.yaml`` in Airflow's DAGs folder (the last place definitions come from)."""
    folder = os.environ.get("AIRFLOW__CORE__DAGS_FOLDER")
    if not folder:
        try:
            from airflow.configuration import conf

            folder = conf.get("core", "dags_folder")
        except Exception:  # noqa: BLE001 - no Airflow here: the current directory
            folder = os.getcwd()
    return os.path.join(os.path.expanduser(folder), CONFIG_FILE_NAME)


def config_source(path: str | None = None, default: str | None = None) -> tuple[str, str]:
    """(where, text) of the job definitions, following the documented precedence."""
    if path:
        file = path
    else:
        env_path = os.environ.get(CONFIG_ENV)
        if env_path:
            file = env_path
        else:
            text = _variable_text()
            if text:
                return f"Airflow Variable {VARIABLE_NAME!r}", text
            file = default or dags_folder_config()
            if not os.path.exists(file):
                # A deployment without its own file: the package's default definitions.
                from importlib.resources import files

                packaged = files("statebackend.airflow") / "ckpt_jobs.default.yaml"
                return f"{packaged} (packaged default)", packaged.read_text(encoding="utf-8")
    try:
        with open(file, encoding="utf-8") as fh:
            return file, fh.read()
    except OSError as exc:
        raise JobConfigError(f"job definitions {file} cannot be read ({exc.strerror}); set "
                             f"{CONFIG_ENV} or the Airflow Variable {VARIABLE_NAME!r}") from exc


def load_job_specs(path: str | None = None, default: str | None = None) -> list[JobSpec]:
    """Every configured job (see the module docstring for where they come from)."""
    where, text = config_source(path, default)
    return specs_from_config(parse_config_text(text, where), where)


def find_spec(name: str, path: str | None = None, default: str | None = None) -> JobSpec:
    for spec in load_job_specs(path, default):
        if spec.name == name:
            return spec
    raise JobConfigError(f"job {name!r} is not configured in ckpt_jobs")


def to_json_text(specs: list[JobSpec]) -> str:
    return json.dumps({"jobs": {s.name: {k: v for k, v in s.to_json().items() if k != "name"}
                                for s in specs}}, indent=2, sort_keys=True)
