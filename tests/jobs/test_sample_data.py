"""Sample data generator: deterministic, right schema, bad rows on the side."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq

from demo.sample_data import expected_totals, generate_days, generate_events
from statebackend.job.input import list_input


def test_parquet_events_are_deterministic(tmp_path):
    a = generate_events(str(tmp_path / "a"), n_events=1000, n_keys=50, seed=1)
    b = generate_events(str(tmp_path / "b"), n_events=1000, n_keys=50, seed=1)
    pd.testing.assert_frame_equal(a, b)
    table = pq.read_table(tmp_path / "a" / "part-00000.parquet")
    assert [(f.name, str(f.type)) for f in table.schema] == [
        ("key", "string"), ("ts", "int64"), ("value", "double")]
    assert table.num_rows == 1000 and a["key"].nunique() <= 50


def test_bad_rows_are_json_lines_beside_the_parquet(tmp_path):
    generate_events(str(tmp_path), n_events=400, n_keys=10, seed=2, bad_fraction=0.02)
    rows = [json.loads(x) for x in (tmp_path / "bad-00000.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    assert sum("key" not in r for r in rows) == 2 and sum(r.get("key") == "" for r in rows) == 2
    assert sum(r.get("value") == "not-a-number" for r in rows) == 2
    assert sum("ts" not in r for r in rows) == 2
    files = list_input(str(tmp_path))
    assert len(files.parquet) == 1 and len(files.json) == 1


def test_days_and_expected_totals(tmp_path):
    days = generate_days(str(tmp_path), 2, events_per_day=100, n_keys=5, fmt="json")
    assert [f.rsplit("/", 1)[1] for f, _ in days] == ["day=2027-01-01", "day=2027-01-02"]
    exp = expected_totals([e for _, e in days])
    assert exp["count"].sum() == 200
    assert (exp["min_ts"] <= exp["max_ts"]).all()
