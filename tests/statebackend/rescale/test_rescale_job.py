"""Job runs continue from a rescaled checkpoint and keep matching a pandas reference."""

from __future__ import annotations

import pytest

from jobs import keyed_aggregation as jobs_ka
from statebackend.rescale.executor import rescale


@pytest.mark.slow
def test_job_runs_after_rescales_match_pandas(spark, tmp_path):
    from demo.sample_data import DAY_MS, DEFAULT_START_TS_MS, expected_totals, generate_events
    from tests.jobs.helpers import assert_state_equals, dump_latest, store_of

    url = f"file://{tmp_path}/store"
    frames = []

    def run_day(day: int, parallelism: int | None = None) -> dict:
        folder = tmp_path / "in" / f"day{day}"
        frames.append(generate_events(str(folder), n_events=3000, n_keys=800, seed=day,
                                      start_ts_ms=DEFAULT_START_TS_MS + day * DAY_MS))
        return jobs_ka.run(jobs_ka.JobConfig(
            input=str(folder), storage=url, job="agg", run_id=f"day{day}",
            output=str(tmp_path / "out"), parallelism=parallelism,
            local_dir=str(tmp_path / "local")), spark=spark)

    assert run_day(0, parallelism=3)["parallelism"] == 3
    store = store_of(url, "agg")
    rescale(store, "latest", 5, spark=spark)
    after_out = run_day(1)
    assert after_out["parallelism"] == 5 and not after_out["skipped"]
    assert_state_equals(dump_latest(url, "agg"), expected_totals(frames))

    rescale(store, "latest", 2, spark=spark)
    assert run_day(2)["parallelism"] == 2
    latest = store.latest()
    assert latest.parallelism == 2 and latest.kind == "checkpoint"
    assert store.load(latest.parent).kind == "rescale"
    assert_state_equals(dump_latest(url, "agg"), expected_totals(frames))
    # a repeated run id after the rescale is still a no-op
    assert run_day(1)["skipped"] is True
