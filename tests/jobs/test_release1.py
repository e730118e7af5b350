"""A lineage written by release 1 (before the job API port) restores, continues,
validates and rescales after the port (fixture: tests/fixtures/release1/)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pandas as pd

from demo.sample_data import DAY_MS, DEFAULT_START_TS_MS, expected_totals, generate_events
from jobs import keyed_aggregation as ka
from statebackend.cli import app as cli
from statebackend.rescale.executor import rescale
from tests.jobs.helpers import assert_state_equals, dump_latest, store_of

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "fixtures", "release1")


def accepted(df: pd.DataFrame) -> pd.DataFrame:
    """The rows the job accepts (pandas, independent of the job's rules)."""
    ts = pd.to_numeric(df.get("ts"), errors="coerce")
    value = pd.to_numeric(df.get("value"), errors="coerce")
    ok = df["key"].notna() & (df["key"] != "") & ts.notna() & np.isfinite(value)
    return pd.DataFrame({"key": df.loc[ok, "key"], "ts": ts[ok].astype("int64"),
                         "value": value[ok].astype("float64")})


def test_release1_lineage_restores_continues_validates_and_rescales(spark, tmp_path, capsys):
    root = tmp_path / "release1"
    shutil.copytree(FIXTURE, root)
    url = f"file://{root}/store"
    store = store_of(url, "agg")
    assert store.checkpoint_ids() == [1, 2] and store.latest().parallelism == 2
    day0 = accepted(pd.read_parquet(root / "input" / "day-0"))
    day1 = accepted(pd.read_json(root / "input" / "day-1" / "part-00000.jsonl", lines=True,
                                 dtype=False))
    assert len(day0) == len(day1) == 600
    assert_state_equals(dump_latest(url, "agg"), expected_totals([day0, day1]))  # restores

    # a re-run of a release-1 run id is recognised and skipped
    again = ka.run(ka.JobConfig(input=str(root / "input" / "day-1"), storage=url, job="agg",
                                run_id="day-1", output=str(tmp_path / "out")), spark)
    assert (again["skipped"], again["checkpoint_id"]) == (True, 2)

    day2 = generate_events(str(tmp_path / "day-2"), n_events=600, n_keys=150, seed=502,
                           start_ts_ms=DEFAULT_START_TS_MS + 2 * DAY_MS)
    s = ka.run(ka.JobConfig(input=str(tmp_path / "day-2"), storage=url, job="agg",
                            run_id="day-2", output=str(tmp_path / "out")), spark)
    assert (s["checkpoint_id"], s["parent"], s["parallelism"], s["events_read"]) == (3, 2, 2, 600)
    assert store.latest().max_parallelism == 32
    everything = expected_totals([day0, day1, day2])
    assert_state_equals(dump_latest(url, "agg"), everything)

    capsys.readouterr()
    code = cli.main(["--storage", url, "--job", "agg", "validate", "--deep", "--job-def",
                     "jobs.keyed_aggregation:JOB", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["failed_checks"]
    assert {"totals_count_at_least_1", "totals_min_ts_le_max_ts"} <= {
        c["name"] for c in report["checks"]}

    r = rescale(store, "latest", 3, spark=spark)
    assert (r["checkpoint_id"], r["from_parallelism"], r["to_parallelism"]) == (4, 2, 3)
    assert_state_equals(dump_latest(url, "agg"), everything)
    code = cli.main(["--storage", url, "--job", "agg", "validate", "--deep", "--job-def",
                     "jobs.keyed_aggregation:JOB", "--json"])
    assert code == 0
