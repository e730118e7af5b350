"""`make ui`: the one command that opens the UI (README). `airflow standalone` starts its
components as `airflow` from PATH, so calling `.venv/bin/airflow standalone` alone fails
with FileNotFoundError: the target must put the venv's bin first on PATH and run the
`airflow` found there (through `demo/ui.py`, which stops it on Ctrl-C even when idle
LocalExecutor workers ignore SIGINT). test_standalone_ui.py runs the target for real
(in a namespace)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import psutil

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
    assert words[-4:] == ["exec", ".venv/bin/python", "-m", "demo.ui"]
    assigned = dict(w.split("=", 1) for w in words[:-4])
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
    path = dict(w.split("=", 1) for w in words[:-4])["PATH"].replace("$PATH", "/usr/bin:/bin")
    res = subprocess.run(["bash", "-c", "command -v airflow"], env={"PATH": path},
                         capture_output=True, text=True)
    assert res.stdout.strip() == os.path.join(ROOT, ".venv", "bin", "airflow")


# -- demo/ui.py: Ctrl-C stops the whole of standalone ----------------------------------

# A stand-in for standalone whose shutdown hangs as the real one sometimes does: it and
# its child (an idle LocalExecutor worker) ignore SIGINT; the child ignores SIGTERM too.
HANGS_ON_SIGINT = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
    "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('child', flush=True); time.sleep(600)"])
print("ready", os.getpid(), child.pid, flush=True)
time.sleep(600)
"""


def start_ui(*command: str, grace: float = 1.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "demo.ui", "--grace", str(grace), "--",
                             *command], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})


def wait_line(proc: subprocess.Popen, prefix: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line and not line.startswith(prefix):
        line = proc.stdout.readline()
    assert line.startswith(prefix), f"no {prefix!r} line; stderr: {proc.stderr.read()}"
    return line


def test_ctrl_c_stops_a_command_whose_processes_ignore_sigint():
    proc = start_ui(sys.executable, "-c", HANGS_ON_SIGINT)
    try:
        _, leader, child = wait_line(proc, "ready").split()
        pids = [int(leader), int(child)]
        proc.send_signal(signal.SIGINT)  # what the terminal sends on Ctrl-C
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130
    assert "stopping" in proc.stderr.read()

    def running() -> list[int]:
        return [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    deadline = time.monotonic() + 10  # SIGKILL'd members are reaped by init
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(), "left running"


def test_sigterm_stops_it_too_and_a_command_that_obeys_sigint_stops_within_the_grace():
    proc = start_ui(sys.executable, "-c", "import time; print('ready', flush=True); "
                    "time.sleep(600)", grace=30.0)
    try:
        wait_line(proc, "ready")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
        assert time.monotonic() - started < 20  # stopped by SIGINT, not after the grace
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_command_that_ends_by_itself_gives_its_exit_status():
    proc = start_ui(sys.executable, "-c", "raise SystemExit(3)")
    assert proc.wait(timeout=60) == 3


def test_a_command_missing_from_path_is_refused_in_one_line():
    proc = start_ui("no-such-airflow-here")
    assert proc.wait(timeout=60) == 2
    err = proc.stderr.read().strip()
    assert err == "make ui: 'no-such-airflow-here' is not on PATH (run `make install`)"
