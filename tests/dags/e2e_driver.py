"""Driven by test_dags_e2e.py in a fresh process (Airflow reads AIRFLOW_HOME at import).

Runs the DAGs in-process with ``dag.test`` (one Spark session, one GE import for
all runs) and writes one JSON document of observations to argv[2]; the test asserts
on it. Task logs go to stdout/stderr.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import UTC, datetime


def run(folder: str, dag_id: str, logical_date: datetime | None = None,
        conf: dict | None = None) -> dict:
    # A fresh DAG object per run, like a worker parsing the file: in-process dag.test
    # otherwise carries one run's conf into the next run's params.
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=folder).dags[dag_id]
    try:
        kwargs = {"run_conf": conf}
        if logical_date is not None:
            kwargs["logical_date"] = logical_date
        dr = dag.test(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the test asserts on the refusal
        return {"error_type": type(exc).__name__, "error": str(exc)}
    tis = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    return {"state": str(dr.state), "run_id": dr.run_id, "tasks": tis}


def checkpoints(spec) -> list[dict]:
    from statebackend.airflow.steps import open_store

    return [{"id": m.checkpoint_id, "kind": m.kind, "run_id": m.run_id,
             "parallelism": m.parallelism} for m in open_store(spec).load_all()]


def main() -> int:
    folder = sys.argv[1]
    from airflow.dag_processing.dagbag import DagBag

    from statebackend.airflow.config import find_spec
    from statebackend.airflow.steps import state_totals
    from statebackend.validation.validate import read_report_summary

    bag = DagBag(dag_folder=folder)
    spec = find_spec("clicks")
    out: dict = {"import_errors": {k: str(v) for k, v in bag.import_errors.items()}}
    day1, day2 = datetime(2027, 1, 1, tzinfo=UTC), datetime(2027, 1, 2, tzinfo=UTC)
    out["day1"] = run(folder, "clicks_pipeline", day1)
    out["after_day1"] = checkpoints(spec)
    out["day2"] = run(folder, "clicks_pipeline", day2)
    # the pipeline's verdict renders no Data Docs; the Asset-scheduled DAG does
    from statebackend.airflow.steps import open_store

    out["report_before"] = read_report_summary(open_store(spec), 2)
    out["reports"] = run(folder, "clicks_reports")
    out["report_after"] = read_report_summary(open_store(spec), 2)
    out["rerun_day1"] = run(folder, "clicks_pipeline", day1)
    out["after_rerun"] = checkpoints(spec)
    out["rescale_bad_zero"] = run(folder, "clicks_rescale_restore", conf={"parallelism": 0})
    out["rescale_bad_type"] = run(folder, "clicks_rescale_restore", conf={"parallelism": "four"})
    out["rescale_bad_ref"] = run(folder, "clicks_rescale_restore",
                                 conf={"parallelism": 3, "checkpoint": "../etc"})
    out["after_bad"] = checkpoints(spec)
    out["rescale_dry"] = run(folder, "clicks_rescale_restore",
                             conf={"parallelism": 3, "dry_run": True})
    out["rescale"] = run(folder, "clicks_rescale_restore", conf={"parallelism": 3})
    out["after_rescale"] = checkpoints(spec)
    out["maintenance"] = run(folder, "clicks_maintenance", day2)
    # A user's job (examples.user_activity:job) configured in the same ckpt_jobs.
    activity = find_spec("activity")
    day3 = datetime(2027, 1, 3, tzinfo=UTC)
    for key, when in (("activity_day1", day1), ("activity_day2", day2),
                      ("activity_rerun_day1", day1), ("activity_day3", day3)):
        out[key] = run(folder, "activity_pipeline", when)
        out[f"after_{key}"] = checkpoints(activity)
    # The same job on the memory and the external backend (test_dags_e2e.OTHER_BACKENDS).
    for name in ("clicks_mem", "clicks_ext"):
        other = find_spec(name)
        got: dict = {}
        for key, when in (("day1", day1), ("day2", day2), ("rerun_day1", day1)):
            got[key] = run(folder, f"{name}_pipeline", when)
            got[f"after_{key}"] = checkpoints(other)
        got["rescale"] = run(folder, f"{name}_rescale_restore", conf={"parallelism": 3})
        got["maintenance"] = run(folder, f"{name}_maintenance", day2)
        got["after"] = [{**c, "backend": m.state_backend} for c, m in
                        zip(checkpoints(other), open_store(other).load_all(), strict=True)]
        other_store = open_store(other)
        got["report"] = read_report_summary(other_store, other_store.latest().checkpoint_id)
        out[name] = got
    store = open_store(spec)
    latest = store.latest()
    out["latest_report"] = read_report_summary(store, latest.checkpoint_id)
    state = state_totals(spec)
    out["state"] = {k: [int(r["count"]), float(r["sum"]), int(r["min_ts"]), int(r["max_ts"])]
                    for k, r in state.iterrows()}
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump(out, fh, default=str)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
