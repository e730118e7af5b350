"""Driven by test_provider.py in a fresh process without any AWS_* variable.

Runs a DAG of its own (argv[1]: its folder) composed of the provider's operators
with ``dag.test`` for two intervals and a re-run, and writes observations to argv[2].
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import UTC, datetime


def main() -> int:
    from airflow.dag_processing.dagbag import DagBag

    folder, result_path = sys.argv[1], sys.argv[2]
    out: dict = {"aws_env_at_start": sorted(k for k in os.environ if k.startswith("AWS_"))}
    bag = DagBag(dag_folder=folder)
    out["import_errors"] = {k: str(v) for k, v in bag.import_errors.items()}
    for key, day, p in (("day1", 1, 3), ("day2", 2, 2), ("rerun_day2", 2, 3)):
        dag = DagBag(dag_folder=folder).dags["my_activity"]
        dr = dag.test(logical_date=datetime(2027, 1, day, tzinfo=UTC), run_conf={"p": p})
        out[key] = {"state": str(dr.state),
                    "tasks": {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}}
    out["aws_env_at_end"] = sorted(k for k in os.environ if k.startswith("AWS_"))
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, default=str)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
