"""``make demo``: the whole product on embedded defaults, in about five minutes.

SQLite Airflow in ``.demo/airflow_home``, ``file://`` storage in ``.demo/checkpoints``;
the daily runs take the default engine (auto: these small days run in the task process,
no JVM), the rescale runs on local Spark. Steps (each an ``airflow dags test`` run, logs in
``.demo/logs``):

1. generate three days of sample events (``.demo/data/events/day=YYYY-MM-DD``);
2. run ``clicks_pipeline`` for the three consecutive intervals (job -> validate ->
   retain -> gc), then re-run the first one to show that nothing is counted twice;
3. trigger ``clicks_rescale_restore`` with ``{"parallelism": 4}``;
4. run ``clicks_maintenance`` (retention, GC, deep validation report);
5. check the final state against a pandas computation of the same events, and
   print where checkpoints and reports are and how to open the UI.

Re-running the demo starts from fresh data and checkpoints (the Airflow DB stays).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, ".demo")
AIRFLOW_HOME = os.path.join(DEMO, "airflow_home")
STORAGE = f"file://{DEMO}/checkpoints"
DATA = os.path.join(DEMO, "data")
LOGS = os.path.join(DEMO, "logs")
JOB = "clicks"
DAYS = 3
EVENTS_PER_DAY = 20_000
N_KEYS = 2_000
RESCALE_TO = 4


def demo_env() -> dict:
    """Environment of every Airflow command of the demo (also printed for the UI)."""
    venv_bin = os.path.dirname(sys.executable)
    env = dict(os.environ)
    env.update({
        "AIRFLOW_HOME": AIRFLOW_HOME,
        "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(ROOT, "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": os.path.join(ROOT, "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "CKPT_JOBS_FILE": os.path.join(ROOT, "dags", "ckpt_jobs.yaml"),
        "CKPT_STORAGE": STORAGE,
        "CKPT_DATA": DATA,
        "CKPT_SPARK_MODE": "local",
        "CKPT_SPARK_MASTER": "local[2]",
        "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
    })
    return env


def step(title: str, args: list[str], log_name: str, env: dict) -> float:
    """Run one command with its output in a log file; fail loudly with the log's tail."""
    os.makedirs(LOGS, exist_ok=True)
    log_path = os.path.join(LOGS, log_name)
    print(f"==> {title}", flush=True)
    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.call(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    took = time.perf_counter() - started
    if code != 0:
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            tail = fh.read().splitlines()[-40:]
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"demo: step failed ({title}), exit {code}; full log: {log_path}")
    print(f"    done in {took:.0f}s (log: {os.path.relpath(log_path, ROOT)})", flush=True)
    return took


def airflow(*args: str) -> list[str]:
    return [os.path.join(os.path.dirname(sys.executable), "airflow"), *args]


def describe_latest(env: dict) -> str:
    from statebackend.airflow.config import find_spec
    from statebackend.airflow.steps import open_store

    os.environ.update({k: env[k] for k in ("CKPT_STORAGE", "CKPT_DATA", "CKPT_JOBS_FILE")})
    meta = open_store(find_spec(JOB)).latest()
    if meta is None:
        return "no checkpoint"
    return (f"chk-{meta.checkpoint_id} ({meta.kind}, P={meta.parallelism}, {origin(meta)}): "
            f"state {meta.bytes_referenced} B, uploaded {meta.bytes_uploaded} B")


def origin(meta) -> str:
    if meta.kind == "rescale":
        return f"rescale of chk-{meta.parent} from P={meta.rescaled_from}"
    return f"run {meta.run_id}"


def main() -> int:
    started = time.perf_counter()
    env = demo_env()
    for folder in (os.path.join(DEMO, "checkpoints"), DATA, LOGS):
        shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(AIRFLOW_HOME, exist_ok=True)
    print(f"Demo home: {DEMO}")
    step("airflow db migrate (SQLite in .demo/airflow_home)", airflow("db", "migrate"),
         "00-db-migrate.log", env)

    from demo.sample_data import expected_totals, generate_days

    print(f"==> generating {DAYS} days x {EVENTS_PER_DAY} events over {N_KEYS} keys")
    days = generate_days(os.path.join(DATA, "events"), DAYS, events_per_day=EVENTS_PER_DAY,
                         n_keys=N_KEYS, seed=7, bad_fraction=0.002)
    dates = [os.path.basename(folder).split("=", 1)[1] for folder, _ in days]

    for i, ds in enumerate(dates, 1):
        step(f"{JOB}_pipeline for interval {ds} (job -> validate -> retain -> gc)",
             airflow("dags", "test", f"{JOB}_pipeline", ds), f"{i:02d}-pipeline-{ds}.log", env)
        print(f"    latest: {describe_latest(env)}")
    step(f"{JOB}_pipeline re-run of {dates[0]} (idempotent: the job skips, counts nothing twice)",
         airflow("dags", "test", f"{JOB}_pipeline", dates[0]), "04-pipeline-rerun.log", env)
    conf = json.dumps({"parallelism": RESCALE_TO, "checkpoint": "latest", "dry_run": False})
    step(f"{JOB}_rescale_restore with conf {conf}",
         airflow("dags", "test", f"{JOB}_rescale_restore", "-c", conf), "05-rescale.log", env)
    latest = describe_latest(env)
    print(f"    latest: {latest}")
    if f"P={RESCALE_TO}" not in latest:
        raise SystemExit(f"demo: the rescale committed no checkpoint with P={RESCALE_TO}; "
                         f"see {os.path.join(LOGS, '05-rescale.log')}")
    step(f"{JOB}_maintenance (retention, GC, full validation of the latest)",
         airflow("dags", "test", f"{JOB}_maintenance", dates[-1]), "06-maintenance.log", env)

    from statebackend.airflow.config import find_spec
    from statebackend.airflow.steps import open_store, state_totals

    spec = find_spec(JOB)
    got = state_totals(spec)
    want = expected_totals([events for _, events in days])
    same = (list(got.index) == list(want.index)
            and (got["count"].astype(int).values == want["count"].astype(int).values).all()
            and ((got["sum"].astype(float) - want["sum"].astype(float)).abs() < 1e-6).all())
    print(f"==> final state: {len(got)} keys, {int(got['count'].sum())} events; equals the pandas "
          f"reference: {'yes' if same else 'NO'}")

    store = open_store(spec)
    print("\nCheckpoints of job 'clicks':")
    for meta in store.load_all():
        print(f"  chk-{meta.checkpoint_id:<3} {meta.kind:<10} P={meta.parallelism:<2} "
              f"state {meta.bytes_referenced:>9} B  uploaded {meta.bytes_uploaded:>9} B  "
              f"{origin(meta)}")
    reports = sorted({p.path.split("/")[1] for p in store.storage.walk_files("reports")})
    chk_dir = os.path.relpath(os.path.join(DEMO, "checkpoints", JOB), ROOT)
    rel = os.path.relpath
    print(f"""
Where things are:
  checkpoints      {chk_dir}/   (chk-<id>/_metadata, shared/)
  reports          {chk_dir}/reports/  ({', '.join(reports)})
                   open <report>/index.html in a browser (links to the Data Docs pages)
  job output       {rel(os.path.join(DATA, 'output', JOB), ROOT)}/
  Airflow logs     {rel(os.path.join(AIRFLOW_HOME, 'logs'), ROOT)}/ and {rel(LOGS, ROOT)}/
  inspect          .venv/bin/ckpt --storage {STORAGE} --job {JOB} list

Open the UI (Checkpoints page in the navigation, or /ckpt/ directly):
  make ui     # airflow standalone on this demo's data; http://localhost:8080, user admin,
              # password in {rel(AIRFLOW_HOME, ROOT)}/simple_auth_manager_passwords.json.generated

Demo finished in {time.perf_counter() - started:.0f}s.""")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
