"""`make ui`: the one command that opens the UI (README). `airflow standalone` starts its
components as `airflow` from PATH, so calling `.venv/bin/airflow standalone` alone fails
with FileNotFoundError: the target must put the venv's bin first on PATH and run the
`airflow` found there. test_standalone_ui.py runs the target for real (in a namespace)."""

from __future__ import annotations

import os
import shlex
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def recipe(env: dict | None = None) -> list[str]:
    """The words of the command `make ui` runs (dry run, the venv up to date)."""
    # Under `make test` the suite inherits MAKELEVEL/MAKEFLAGS, and a nested make then
    # prints "Entering/Leaving directory" lines into the dry run's output.
    env = {k: v for k, v in (env or os.environ).items()
           if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    res = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "ui"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    return shlex.split(res.stdout.replace("\\\n", " "))


def test_make_ui_runs_standalone_with_the_venv_first_on_path():
    words = recipe()
    assert words[-3:] == ["exec", "airflow", "standalone"]
    assigned = dict(w.split("=", 1) for w in words[:-3])
    venv_bin = os.path.join(ROOT, ".venv", "bin")
    assert assigned["PATH"].split(os.pathsep)[0] == venv_bin
    assert os.access(os.path.join(venv_bin, "airflow"), os.X_OK)
    assert assigned["AIRFLOW__CORE__DAGS_FOLDER"] == os.path.join(ROOT, "dags")
    assert assigned["AIRFLOW__CORE__PLUGINS_FOLDER"] == os.path.join(ROOT, "plugins")
    assert assigned["AIRFLOW__CORE__LOAD_EXAMPLES"] == "False"
    # the demo's folders unless the caller set its own
    demo = os.path.join(ROOT, ".demo")
    assert assigned["AIRFLOW_HOME"] == "${AIRFLOW_HOME:-" + demo + "/airflow_home}"
    assert assigned["CKPT_STORAGE"] == "${CKPT_STORAGE:-file://" + demo + "/checkpoints}"
    assert assigned["CKPT_DATA"] == "${CKPT_DATA:-" + demo + "/data}"


def test_make_ui_resolves_airflow_from_the_venv():
    """What the recipe's shell runs: with the recipe's PATH, `airflow` is the venv's."""
    words = recipe()
    path = dict(w.split("=", 1) for w in words[:-3])["PATH"].replace("$PATH", "/usr/bin:/bin")
    res = subprocess.run(["bash", "-c", "command -v airflow"], env={"PATH": path},
                         capture_output=True, text=True)
    assert res.stdout.strip() == os.path.join(ROOT, ".venv", "bin", "airflow")
