"""Stateful job definitions for the Airflow DAGs (``ckpt_jobs``): load, check, expand.

Where the definitions come from (first match wins):

1. the file named by ``CKPT_JOBS_FILE`` (YAML or JSON);
2. the Airflow Variable ``ckpt_jobs`` (YAML or JSON text; also read from the
   ``AIRFLOW_VAR_CKPT_JOBS`` environment variable without touching the database);
3. ``dags/ckpt_jobs.yaml`` beside the DAG files.

Shape::

    defaults:                 # optional, merged into every job (job keys win)
      storage: s3://bucket/checkpoints
      spark: {mode: local, master: "local[*]"}
    jobs:
      clicks:                 # job name = folder under the storage root
        input: /data/events/dt={{ ds }}
        output: /data/out/clicks/dt={{ ds }}
        parallelism: 2

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
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime

from statebackend.checkpoints import check_job_name
from statebackend.errors import UsageError

CONFIG_ENV = "CKPT_JOBS_FILE"
VARIABLE_NAME = "ckpt_jobs"
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "dags", "ckpt_jobs.yaml")
SPARK_MODES = ("local", "submit")
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class JobConfigError(UsageError):
    """A job definition is missing, malformed or names an unknown setting."""


@dataclass(frozen=True)
class SparkSettings:
    """How the job's Spark runs: in the task process (``local``) or via spark-submit."""

    mode: str = "local"
    master: str = "local[*]"
    conn_id: str = "spark_default"  # SparkSubmitOperator connection (submit mode)
    conf: dict = field(default_factory=dict)  # extra --conf for spark-submit


@dataclass(frozen=True)
class JobSpec:
    """One stateful job and the schedule/lifecycle settings of its three DAGs."""

    name: str
    input: str
    output: str
    storage: str
    parallelism: int | None = None
    max_parallelism: int = 128
    max_reject_fraction: float = 0.01
    quarantine: str | None = None
    start_from: str | None = None  # first run only: <job>/savepoints/<name> or <job>:<id|latest>
    storage_conn_id: str | None = None  # Airflow AWS connection exported as AWS_* env vars
    spark: SparkSettings = field(default_factory=SparkSettings)
    schedule: str = "@daily"
    maintenance_schedule: str = "@daily"
    start_date: str = "2026-01-01"
    catchup: bool = False
    keep: int = 3
    gc_grace_seconds: float = 3600.0
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

    def to_json(self) -> dict:
        data = asdict(self)
        data["tags"] = list(self.tags)
        return data


def expand_env(value: object, environ: dict | None = None) -> object:
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
    for required in ("input", "output", "storage"):
        if not merged.get(required):
            raise JobConfigError(f"{where}: job {name!r} needs '{required}'")
    settings = SparkSettings(**spark)
    if settings.mode not in SPARK_MODES:
        raise JobConfigError(f"{where}: job {name!r} spark.mode {settings.mode!r} is not one of "
                             f"{list(SPARK_MODES)}")
    merged["tags"] = tuple(merged.get("tags") or ())
    if merged.get("storage_conn_id") == "":
        merged["storage_conn_id"] = None
    for optional in ("quarantine", "start_from"):
        if merged.get(optional) == "":
            merged[optional] = None
    try:
        spec = JobSpec(name=name, spark=settings, **merged)
        _check_numbers(spec)
    except (TypeError, ValueError) as exc:
        raise JobConfigError(f"{where}: job {name!r}: {exc}") from exc
    spec.start_datetime()
    return spec


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
                      environ: dict | None = None) -> list[JobSpec]:
    data = expand_env(data, environ)
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


def config_source(path: str | None = None) -> tuple[str, str]:
    """(where, text) of the job definitions, following the documented precedence."""
    if path:
        candidates = [path]
    else:
        env_path = os.environ.get(CONFIG_ENV)
        if env_path:
            candidates = [env_path]
        else:
            text = _variable_text()
            if text:
                return f"Airflow Variable {VARIABLE_NAME!r}", text
            candidates = [DEFAULT_CONFIG]
    file = candidates[0]
    try:
        with open(file, encoding="utf-8") as fh:
            return file, fh.read()
    except OSError as exc:
        raise JobConfigError(f"job definitions {file} cannot be read ({exc.strerror}); set "
                             f"{CONFIG_ENV} or the Airflow Variable {VARIABLE_NAME!r}") from exc


def load_job_specs(path: str | None = None) -> list[JobSpec]:
    """Every configured job (see the module docstring for where they come from)."""
    where, text = config_source(path)
    return specs_from_config(parse_config_text(text, where), where)


def find_spec(name: str, path: str | None = None) -> JobSpec:
    for spec in load_job_specs(path):
        if spec.name == name:
            return spec
    raise JobConfigError(f"job {name!r} is not configured in ckpt_jobs")


def to_json_text(specs: list[JobSpec]) -> str:
    return json.dumps({"jobs": {s.name: {k: v for k, v in s.to_json().items() if k != "name"}
                                for s in specs}}, indent=2, sort_keys=True)
