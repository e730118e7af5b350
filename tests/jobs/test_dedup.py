"""The dedup job (jobs/dedup.py) against the pandas reference, and TTL shrinking state.

Six daily runs of seeded events (exact copies in a batch, re-sends one or two days
later, late deliveries) with a one-day TTL, so ids expire across runs and some
re-sends are emitted again; a re-run (skipped), a crashed attempt and a rescale
3 -> 2 in between: every run's output, duplicate and late counts, and the ids left
in the final checkpoint equal tests/reference/dedup.py.
"""

from __future__ import annotations

import pandas as pd
import pytest

from bench.peers.events import EventsSpec, generate_days, write_days
from jobs import BUILTIN_JOBS
from statebackend.checkpoint.store import CheckpointStore
from statebackend.job import JobRunError, JobTester, RunConfig, load_job, run_job
from statebackend.rescale.executor import rescale
from statebackend.storage import open_storage
from tests.jobs.run_reference import backend_settings, final_state
from tests.jobs.test_sessionization import run_output
from tests.reference.dedup import canonical, dedup

DAY = 24 * 60 * 60 * 1000
LATENESS_MIN = 60
SPEC = EventsSpec(days=6, events_per_day=1500, users=200, seed=3, copy_fraction=0.05,
                  resend_fraction=0.1)


@pytest.mark.parametrize(("engine", "backend"), [("spark", None), ("local", None),
                                                 ("local", "memory"), ("local", "external")])
def test_dedup_matches_reference_over_runs(spark, tmp_path, engine, backend, request):
    settings, state_db = backend_settings(request, backend, "dedup")
    days = generate_days(SPEC)
    dirs = write_days(days, str(tmp_path / "in"))
    ref = dedup(days, ttl_ms=DAY, lateness_ms=LATENESS_MIN * 60_000)
    assert sum(r.expired for r in ref.runs) > 0 and sum(r.late for r in ref.runs) > 0
    storage, output = f"file://{tmp_path / 'ckpt'}", str(tmp_path / "out")
    job = load_job(BUILTIN_JOBS["dedup"])
    store = CheckpointStore(open_storage(storage), "dedup")

    def config(d: int, **kw) -> RunConfig:
        return RunConfig(input=dirs[d], storage=storage, run_id=f"d{d}", output=output,
                         local_dir=str(tmp_path / "local"), max_reject_fraction=0.0,
                         engine=engine, **settings,
                         options={"ttl_days": 1, "allowed_lateness_minutes": LATENESS_MIN},
                         **kw)

    def check(d: int, s: dict) -> None:
        r = ref.runs[d]
        got = run_output(output, f"d{d}")
        pd.testing.assert_frame_equal(canonical(got), r.emitted, check_dtype=False)
        assert (s["duplicates_dropped"], s["late_rows"], s["watermark"]) == (
            r.duplicates, r.late, r.watermark), d
        assert s["ttl_purged"] == r.expired, d

    check(0, run_job(job, config(0, parallelism=3), spark))
    check(1, run_job(job, config(1), spark))
    assert run_job(job, config(1), spark)["skipped"]
    with pytest.raises(JobRunError, match="injected failure in subtask 0"):
        run_job(job, config(2, fail_subtask=0), spark)
    assert rescale(store, "latest", 2, spark=spark)["to_parallelism"] == 2
    for d in range(2, SPEC.days):
        check(d, run_job(job, config(d), spark))

    # The stored value is the expiry alone: first_ts = expiry - TTL, from the index rows.
    state = final_state(storage, "dedup", state_db)
    assert set(state["seen"].values()) == {""}  # empty payloads (the dump shows hex)
    got = pd.DataFrame([(int(k), v["expiry"] - DAY) for (k, _), v in state["_ttl"].items()
                        if v["state"] == "seen"],
                       columns=["event_id", "first_ts"]).sort_values("event_id")
    pd.testing.assert_frame_equal(got.reset_index(drop=True), ref.state, check_dtype=False)
    assert sorted(int(k) for k, _ in state["seen"]) == sorted(ref.state["event_id"])
    meta = store.load(store.checkpoint_ids()[-1])
    assert {d["name"]: d.get("ttl") for d in meta.states} == {
        "seen": {"duration_ms": DAY, "time": "event", "update_on": "write"},
        "_ttl": None}


def _day(ids: range, day: int) -> pd.DataFrame:
    return pd.DataFrame({"event_id": list(ids), "user": "u", "ts": day * DAY + 1000,
                         "value": 1.0})


def test_quiet_keys_shrink_the_checkpoint(spark, tmp_path):
    """40,000 ids on day 0, then a few per day: once the TTL passes, purge (with
    compaction) leaves a checkpoint smaller than at its peak; the figures are printed."""
    folders = []
    for d, ids in enumerate((range(40_000), range(50_000, 50_010), range(60_000, 60_010),
                             range(70_000, 70_010), range(80_000, 80_010))):
        folder = tmp_path / f"in{d}"
        folder.mkdir()
        _day(ids, d).to_parquet(folder / "p.parquet")
        folders.append(str(folder))
    storage, output = f"file://{tmp_path / 'ckpt'}", str(tmp_path / "out")
    job = load_job(BUILTIN_JOBS["dedup"])
    store = CheckpointStore(open_storage(storage), "dedup")
    sizes, purged = [], []
    for d, folder in enumerate(folders):
        s = run_job(job, RunConfig(input=folder, storage=storage, run_id=f"d{d}",
                                   output=output, local_dir=str(tmp_path / "local"),
                                   parallelism=2, options={"ttl_days": 2}), spark)
        sizes.append(store.load(s["checkpoint_id"]).bytes_referenced)
        purged.append(s["ttl_purged"])
    print(f"checkpoint bytes per run: {sizes}; ids purged per run: {purged}")
    # day-0 ids expire once the watermark (day d - 1 h) reaches day 0 + 2 days: run 3
    assert purged == [0, 0, 0, 40_000, 10]
    assert sizes[-1] < max(sizes) / 4
    assert len(final_state(storage, "dedup")["seen"]) == 30


def test_dedup_logic_matches_reference_in_process():
    """The logic alone, in process (`JobTester`: no Spark, no storage), one tester run per
    seeded day: every run's output, duplicate, late and expired counts and watermark,
    then the remembered ids (first_ts = expires_at - TTL) equal the reference."""
    days = generate_days(SPEC)
    ref = dedup(days, ttl_ms=DAY, lateness_ms=LATENESS_MIN * 60_000)
    options = {"ttl_days": 1, "allowed_lateness_minutes": LATENESS_MIN}
    with JobTester(load_job(BUILTIN_JOBS["dedup"]), options, batch_rows=500) as tester:
        for day, r in zip(days, ref.runs, strict=True):
            run = tester.run(day)
            pd.testing.assert_frame_equal(canonical(run.outputs["events"].to_pandas()),
                                          r.emitted, check_dtype=False)
            assert (run.counters["duplicates_dropped"], run.reasons.get("late", 0),
                    run.new_watermark, run.ttl_purged) == (
                r.duplicates, r.late, r.watermark, r.expired)
        seen = tester.state_table("seen")
    got = pd.DataFrame({"event_id": seen["key"].astype("int64"),
                        "first_ts": seen["expires_at"] - DAY})
    pd.testing.assert_frame_equal(got.sort_values("event_id").reset_index(drop=True),
                                  ref.state, check_dtype=False)
