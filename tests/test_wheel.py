"""The wheel as a user installs it: built from this tree, installed into a fresh venv
with the ``[validate]`` extra, run from a folder outside the source tree.

It ships every package, the default job configuration, the Checkpoints page's static
assets and the entry points Airflow reads (provider, plugin); ``ckpt --help`` and
``ckpt validate --deep`` run from it, and every public module imports (walked in the
installed package, so a new subpackage is covered without naming it here)."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.statebackend.validation.test_validate_support import JOB, build_checkpoint

pytestmark = pytest.mark.slow

ROOT = str(Path(__file__).resolve().parent.parent)

EXTRA = "validate"
# Public modules that need the [airflow] extra, which the fresh venv does not have, with
# the module found missing: the import walk expects exactly these to fail, each for that
# reason (anything else fails).
NEEDS_AIRFLOW_EXTRA = {
    "statebackend.airflow.factory": "airflow",
    "statebackend.airflow.hook": "airflow",
    "statebackend.airflow.operators": "airflow",
    "statebackend.airflow.plugin": "airflow",
    "statebackend.airflow.page.app": "fastapi",  # Airflow's api-server brings FastAPI
}
DEFAULT_CONFIG = "statebackend/airflow/ckpt_jobs.default.yaml"
PAGE_STATIC = "statebackend/airflow/page/static"

# Run in the venv: import every module of the distribution's packages, report failures.
IMPORT_WALK = """
import importlib, json, pkgutil, sys
import jobs, statebackend
failed, seen = {}, []
for pkg in (statebackend, jobs):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if info.name.rpartition(".")[2].startswith("_"):
            continue
        seen.append(info.name)
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            failed[info.name] = exc.name
json.dump({"file": statebackend.__file__, "seen": seen, "failed": failed}, sys.stdout)
"""


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _clean_env() -> dict[str, str]:
    """The environment without anything that points back at the source tree or its venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["UV_PYTHON_DOWNLOADS"] = "never"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (`make install` installs it)")
    base = tmp_path_factory.mktemp("wheel")
    env = _clean_env()
    # sdist first, then the wheel from the unpacked sdist (uv's default): the wheel can
    # only contain what the sdist carries, and the source tree gets no build/ folder.
    _run([uv, "build", "--quiet", "--out-dir", str(base / "dist"), ROOT], base, env)
    wheel = next((base / "dist").glob("*.whl"))
    # The lock's versions for the extra: the same resolution as `make install`.
    constraints = base / "constraints.txt"
    _run([uv, "export", "--frozen", "--quiet", "--extra", EXTRA, "--no-hashes",
          "--no-emit-project", "--no-header", "--project", ROOT, "-o", str(constraints)],
         base, env)
    venv = base / "venv"
    _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], base, env)
    python = venv / "bin" / "python"
    _run([uv, "pip", "install", "--quiet", "--python", str(python), "-c", str(constraints),
          f"{wheel}[{EXTRA}]"], base, env)
    work = base / "outside"
    work.mkdir()
    return {"wheel": wheel, "venv": venv, "python": python, "ckpt": venv / "bin" / "ckpt",
            "cwd": work, "env": env}


def test_wheel_ships_every_package_and_the_default_job_config(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    packages = sorted(os.path.relpath(d, ROOT) for top in ("statebackend", "jobs")
                      for d, _, files in os.walk(os.path.join(ROOT, top))
                      if "__init__.py" in files)
    assert len(packages) > 2
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert missing == [], f"packages left out of the wheel: {missing}"
    assert DEFAULT_CONFIG in names
    # Until the DAG folder's copy is gone, the shipped default must say the same.
    shipped = zipfile.ZipFile(installed["wheel"]).read(DEFAULT_CONFIG).decode()
    assert shipped == Path(ROOT, "dags", "ckpt_jobs.yaml").read_text(encoding="utf-8")


def test_wheel_ships_the_page_assets(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assets = sorted(os.path.relpath(os.path.join(d, f), ROOT)
                    for d, _, files in os.walk(os.path.join(ROOT, PAGE_STATIC)) for f in files)
    assert f"{PAGE_STATIC}/uplot/uPlot.iife.min.js" in assets and len(assets) >= 5
    assert [a for a in assets if a not in names] == []
    site = Path(installed["python"]).parent.parent / "lib"
    installed_js = list(site.glob(f"python*/site-packages/{PAGE_STATIC}/page.js"))
    assert len(installed_js) == 1 and installed_js[0].stat().st_size > 0


def test_wheel_declares_the_projects_entry_points(installed):
    archive = zipfile.ZipFile(installed["wheel"])
    (path,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # entry point names are case-sensitive
    parser.read_string(archive.read(path).decode())
    shipped = {group: dict(parser[group]) for group in parser.sections()}
    declared = tomllib.loads(Path(ROOT, "pyproject.toml").read_text())["project"]
    assert shipped["console_scripts"] == declared["scripts"]
    for group in ("apache_airflow_provider", "airflow.plugins", "statebackend.jobs"):
        assert shipped[group] == declared["entry-points"][group], group
    assert shipped["airflow.plugins"] == {
        "ckpt_checkpoints": "statebackend.airflow.plugin:CheckpointsPlugin"}


def test_cli_help_and_version_from_outside_the_tree(installed):
    out = _run([str(installed["ckpt"]), "--help"], installed["cwd"], installed["env"]).stdout
    assert out.startswith("usage: ckpt") and "validate" in out
    version = tomllib.loads(Path(ROOT, "pyproject.toml").read_text())["project"]["version"]
    out = _run([str(installed["ckpt"]), "--version"], installed["cwd"], installed["env"]).stdout
    assert out.split() == ["ckpt", version]


def test_deep_validation_with_the_installed_cli(installed, tmp_path):
    url = f"file://{tmp_path}/store"
    _, meta = build_checkpoint(url, str(tmp_path / "w"), parallelism=2, n_keys=150)
    proc = _run([str(installed["ckpt"]), "--storage", url, "--job", JOB, "validate", "--deep",
                 "--report-dir", str(tmp_path / "reports")], installed["cwd"], installed["env"])
    assert f"checkpoint {meta.checkpoint_id} of job {JOB}: PASSED (deep validation" in proc.stdout
    assert "FutureWarning" not in proc.stderr  # pandas is held where pyspark supports it
    assert (tmp_path / "reports" / f"chk-{meta.checkpoint_id}" / "summary.json").exists()


def test_every_public_module_imports_from_the_installed_wheel(installed):
    proc = _run([str(installed["python"]), "-c", IMPORT_WALK], installed["cwd"],
                installed["env"])
    result = json.loads(proc.stdout)
    # The code under test is the installed copy, not this source tree.
    assert Path(result["file"]).is_relative_to(installed["venv"])
    assert {"statebackend.cli.app", "statebackend.validation.suites",
            "jobs.keyed_aggregation"} <= set(result["seen"])
    assert {"statebackend.airflow.page.data", "statebackend.airflow.provider"} <= set(
        result["seen"]) - set(result["failed"])
    assert result["failed"] == NEEDS_AIRFLOW_EXTRA, (
        "modules failing to import in a venv with only the core and "
        f"[{EXTRA}] dependencies (name -> missing module): {result['failed']}")


def test_wheel_ships_the_jvm_state_readers_jar(installed):
    """`make jar` (a dependency of `make test`) builds it before the wheel is built; an
    installed read_state then reads inside the JVM (statebackend.spark.jvm_reader)."""
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assert "statebackend/spark/jars/ckpt-state-reader.jar" in names
    site = Path(installed["python"]).parent.parent / "lib"
    jar = list(site.glob("python*/site-packages/statebackend/spark/jars/ckpt-state-reader.jar"))
    assert len(jar) == 1
    with zipfile.ZipFile(jar[0]) as archive:
        assert "ckpt/reader/StateSource.class" in archive.namelist()
