"""docker-compose.yaml and docker/Dockerfile, checked without a Docker engine.

It parses (no duplicate keys), every referenced file and variable exists, every
image is pinned, the four Airflow 3 components, Postgres, Spark master/worker, a
Spark Connect server and MinIO (with bucket creation) are there, and the DAG config resolves to s3://
storage and the Spark master with the compose environment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml

from statebackend.airflow.config import load_job_specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "dags", "ckpt_jobs.yaml")
COMPOSE = os.path.join(ROOT, "docker-compose.yaml")
DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")
ENV_FILE = os.path.join(ROOT, "docker", "compose.env")
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?-[^}]*)?\}")
AIRFLOW_COMPONENTS = {"airflow-apiserver": "api-server", "airflow-scheduler": "scheduler",
                      "airflow-dag-processor": "dag-processor", "airflow-triggerer": "triggerer"}


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (compose would silently keep the last)."""


def _construct_mapping(loader, node, deep=False):
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}",
                                                    key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def env_defaults() -> dict:
    out = {}
    for line in open(ENV_FILE, encoding="utf-8"):
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def substitute(text: str, env: dict) -> str:
    def sub(m):
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default:
            return default.lstrip(":")[1:]
        raise KeyError(name)
    return VAR_RE.sub(sub, text)


@pytest.fixture(scope="module")
def raw_text() -> str:
    return open(COMPOSE, encoding="utf-8").read()


@pytest.fixture(scope="module")
def compose(raw_text) -> dict:
    return yaml.load(substitute(raw_text, env_defaults()), Loader=StrictLoader)


def test_parses_without_duplicate_keys(raw_text):
    assert isinstance(yaml.load(raw_text, Loader=StrictLoader), dict)


def test_every_variable_has_a_value(raw_text):
    env = env_defaults()
    for m in VAR_RE.finditer(raw_text):
        assert m.group(1) in env or m.group(2), f"${{{m.group(1)}}} has no value or default"


def test_services_present(compose):
    services = compose["services"]
    for name in (*AIRFLOW_COMPONENTS, "airflow-init", "postgres", "spark-master",
                 "spark-worker", "spark-connect", "minio", "minio-init"):
        assert name in services, name
    for name, command in AIRFLOW_COMPONENTS.items():
        assert services[name]["command"][:2] == ["airflow", command]
    for svc in services.values():
        for dep in svc.get("depends_on", {}) or {}:
            assert dep in services, dep
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            if source.startswith("."):
                assert os.path.exists(os.path.join(ROOT, source)), (name, source)
            else:
                assert source in compose["volumes"], (name, source)


def test_the_external_backends_database_is_private_and_healthy(compose):
    """state-db (docs/state-backends.md): no port on the host, a health check the
    Airflow services wait for, and the URL the jobs use names it without a password."""
    db = compose["services"]["state-db"]
    assert "ports" not in db and db["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    scheduler = compose["services"]["airflow-scheduler"]
    assert scheduler["depends_on"]["state-db"]["condition"] == "service_healthy"
    from statebackend.state.external_store import ExternalStore

    url = scheduler["environment"]["CKPT_STATE_DB"]
    store = ExternalStore(url)
    assert store.identity == f"{url}#ckpt_state" and "@state-db:5432/" in url


def _pinned(image: str) -> bool:
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest")


def test_images_pinned_and_builds_exist(compose):
    for name, svc in compose["services"].items():
        assert "image" in svc, f"service {name} has no image"
        assert _pinned(svc["image"]), f"service {name} image {svc['image']!r} is not pinned"
        if "build" in svc:
            build = svc["build"]
            path = os.path.join(ROOT, build["context"], build.get("dockerfile", "Dockerfile"))
            assert os.path.isfile(path), path


def test_dockerfile_base_pinned_and_copies_exist():
    text = open(DOCKERFILE, encoding="utf-8").read()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms and all(_pinned(f) for f in froms), froms
    for line in re.findall(r"^COPY\s+(.+)$", text, re.M):
        parts = [p for p in line.split() if not p.startswith("--")]
        for src in parts[:-1]:
            assert os.path.exists(os.path.join(ROOT, src)), src
    assert "openjdk" in text and "uv sync --frozen" in text


def test_container_paths_of_scripts_are_copied(compose):
    dockerfile = open(DOCKERFILE, encoding="utf-8").read()
    entry = compose["services"]["airflow-init"]["entrypoint"]
    script = entry[-1]
    assert script.startswith("/opt/ckpt/")
    rel = script[len("/opt/ckpt/"):]
    assert os.path.isfile(os.path.join(ROOT, rel)) and rel in dockerfile
    for rel in ("docker/entrypoint.sh", "docker/init-airflow.sh", "docker/create-bucket.sh"):
        shell = "sh" if rel.endswith("create-bucket.sh") else "bash"
        subprocess.run([shell, "-n", os.path.join(ROOT, rel)], check=True)


def test_airflow_points_at_s3_and_spark_master(compose, monkeypatch):
    env = compose["services"]["airflow-scheduler"]["environment"]
    assert env["CKPT_STORAGE"].startswith("s3://")
    assert env["CKPT_SPARK_MASTER"] == "spark://spark-master:7077"
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql")
    s3 = json.loads(env["AIRFLOW_CONN_CKPT_S3"])
    assert s3["conn_type"] == "aws" and s3["extra"]["endpoint_url"] == "http://minio:9000"
    assert s3["login"] == compose["services"]["minio"]["environment"]["MINIO_ROOT_USER"]
    spark = json.loads(env["AIRFLOW_CONN_SPARK_DEFAULT"])
    assert (spark["host"], spark["port"]) == ("spark://spark-master", 7077)
    assert compose["services"]["spark-worker"]["environment"]["SPARK_MASTER_URL"] == \
        env["CKPT_SPARK_MASTER"]
    assert compose["services"]["minio-init"]["environment"]["CKPT_BUCKET"] in env["CKPT_STORAGE"]
    for key, value in env.items():
        if key.startswith("CKPT_"):
            monkeypatch.setenv(key, str(value))
    (spec,) = load_job_specs(DEFAULT_CONFIG)
    assert spec.storage == env["CKPT_STORAGE"] and spec.storage_conn_id == "ckpt_s3"
    assert spec.spark.mode == "submit" and spec.spark.master == env["CKPT_SPARK_MASTER"]
    assert spec.input.startswith("/data/events/")
    for name in AIRFLOW_COMPONENTS:
        assert compose["services"][name]["environment"] == env


def _conf(command: list[str]) -> dict:
    return dict(command[i + 1].split("=", 1) for i, arg in enumerate(command) if arg == "--conf")


def test_spark_connect_server_runs_on_the_cluster(compose):
    services = compose["services"]
    svc = services["spark-connect"]
    command = svc["command"]
    assert command[0] == "spark-submit" and command[-1] == "spark-internal"
    assert command[command.index("--class") + 1] == \
        "org.apache.spark.sql.connect.service.SparkConnectServer"
    # Its executors are the cluster's workers: same master as the Airflow tasks use.
    master = services["airflow-scheduler"]["environment"]["CKPT_SPARK_MASTER"]
    assert command[command.index("--master") + 1] == master
    conf = _conf(command)
    # Executors connect back to this driver by its hostname; clients reach the gRPC port.
    assert conf["spark.driver.host"] == svc["hostname"] == "spark-connect"
    assert conf["spark.connect.grpc.binding.address"] == "0.0.0.0"
    port = conf["spark.connect.grpc.binding.port"]
    assert any(p.endswith(f":{port}") for p in svc["ports"])
    assert str(port) in " ".join(svc["healthcheck"]["test"])
    # The same image as the workers: executors import the library and the jobs.
    assert svc["image"] == services["spark-worker"]["image"]
    assert {"spark-master", "spark-worker"} <= set(svc["depends_on"])
