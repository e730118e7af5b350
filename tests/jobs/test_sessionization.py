"""The sessionization job (jobs/sessionization.py) against the pandas reference.

Six daily runs of seeded events (late deliveries within and beyond the allowed
lateness, sessions across midnight that late events extend and merge), with a
re-run of a committed run (skipped), a crashed attempt (``fail_subtask``) and a
rescale 3 -> 2 in between: every run's output, late count and watermark, and the
open sessions left in the final checkpoint, equal tests/reference/sessions.py.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from bench.peers.events import EventsSpec, generate_days, write_days
from jobs import BUILTIN_JOBS
from jobs import sessionization as sz
from statebackend.checkpoint.store import CheckpointStore
from statebackend.job import JobRunError, JobTester, RunConfig, load_job, run_job
from statebackend.job.input import DIRECT_READ_MAX_BYTES_ENV
from statebackend.job.publish import run_dir_name
from statebackend.rescale.executor import rescale
from statebackend.storage import open_storage
from tests.jobs.run_reference import backend_settings, final_state
from tests.reference.sessions import SESSION_COLUMNS, canonical, sessionize

GAP_MIN, LATENESS_MIN = 30, 90
SPEC = EventsSpec(days=6, events_per_day=1200, users=60, seed=12)


def run_output(url: str, run_id: str) -> pd.DataFrame:
    """A published run folder's rows (none when no subtask wrote a part)."""
    import pyarrow.parquet as pq

    storage = open_storage(url)
    folder = run_dir_name(run_id)
    assert storage.exists(f"{folder}/_SUCCESS"), f"{url}/{folder} is not published"
    frames = []
    for name in sorted(n for n in storage.list_dir(folder) if n.endswith(".parquet")):
        with storage.fs.open(storage.abspath(f"{folder}/{name}"), "rb") as fh:
            frames.append(pq.read_table(fh).to_pandas())
    return pd.concat(frames, ignore_index=True) if frames else None


@pytest.mark.parametrize(("engine", "backend"), [
    ("spark", None), ("spark-shuffle", None), ("local", None), ("local", "memory"),
    ("local", "external")])
def test_sessionization_matches_reference_over_runs(spark, tmp_path, engine, backend, request):
    """``spark``: its tasks read the small input directly; ``spark-shuffle``: Spark's
    reader, top-k watermark and shuffle (statebackend.job.spark_direct)."""
    if engine == "spark-shuffle":
        request.getfixturevalue("monkeypatch").setenv(DIRECT_READ_MAX_BYTES_ENV, "0")
        engine = "spark"
    settings, state_db = backend_settings(request, backend, "sessionization")
    days = generate_days(SPEC)
    dirs = write_days(days, str(tmp_path / "in"))
    ref = sessionize([d[["user", "ts", "value"]] for d in days], GAP_MIN * 60_000,
                     LATENESS_MIN * 60_000)
    # the data exercises what the job must get right
    assert sum(r.late for r in ref.runs) > 0
    assert sum(len(r.emitted) for r in ref.runs[1:]) > 0

    storage, output = f"file://{tmp_path / 'ckpt'}", str(tmp_path / "out")
    job = load_job(BUILTIN_JOBS["sessionization"])
    store = CheckpointStore(open_storage(storage), "sessionization")

    def config(d: int, **kw) -> RunConfig:
        return RunConfig(input=dirs[d], storage=storage, run_id=f"d{d}", output=output,
                         local_dir=str(tmp_path / "local"), max_reject_fraction=0.0,
                         engine=engine, **settings,
                         options={"gap_minutes": GAP_MIN,
                                  "allowed_lateness_minutes": LATENESS_MIN}, **kw)

    def check(d: int, s: dict) -> None:
        r = ref.runs[d]
        got = run_output(output, f"d{d}")
        got = canonical(got) if got is not None else canonical(r.emitted.iloc[:0])
        pd.testing.assert_frame_equal(got, r.emitted, check_dtype=False)
        assert (s["late_rows"], s["watermark"]) == (r.late, r.watermark), d
        assert s["timers_fired"] >= len(r.emitted.drop_duplicates("user"))
        assert store.load(s["checkpoint_id"]).watermark == r.watermark

    check(0, run_job(job, config(0, parallelism=3), spark))
    check(1, run_job(job, config(1), spark))
    assert run_job(job, config(1), spark)["skipped"]
    with pytest.raises(JobRunError, match="injected failure in subtask 1"):
        run_job(job, config(2, fail_subtask=1), spark)
    assert store.checkpoint_ids() == [1, 2]
    assert rescale(store, "latest", 2, spark=spark)["to_parallelism"] == 2
    assert store.load(3).watermark == ref.runs[1].watermark  # carried by the rescale
    for d in range(2, SPEC.days):  # timers of sessions opened before fire after the rescale
        s = run_job(job, config(d), spark)
        assert s["parallelism"] == 2
        check(d, s)

    state = final_state(storage, "sessionization", state_db)["sessions"]
    rows = [(k, *sess) for (k, _), sessions in state.items() for sess in sessions]
    got = canonical(pd.DataFrame(rows, columns=SESSION_COLUMNS))
    pd.testing.assert_frame_equal(got, ref.open_sessions, check_dtype=False)
    # every user with open sessions has exactly its next close as a timer
    timers = final_state(storage, "sessionization", state_db).get("_timers", {})
    assert len(timers) == len(ref.open_sessions.drop_duplicates("user"))
    meta = store.load(store.checkpoint_ids()[-1])
    assert [d["name"] for d in meta.states] == ["sessions", "_timers", "_timer_keys"]
    assert json.loads(json.dumps(meta.extra["time"]))["timers_fired"] >= 0


@pytest.mark.parametrize("engine", ["spark", "local"])
def test_late_rows_are_quarantined_not_rejected(spark, tmp_path, engine):
    """A late row goes to the quarantine with reason ``late`` and does not count against
    --max-reject-fraction (0 here); an accept_late job would take it."""
    inp0, inp1 = tmp_path / "in0", tmp_path / "in1"
    h = 3_600_000
    for folder, rows in ((inp0, [("a", 10 * h, 1.0), ("b", 12 * h, 2.0)]),
                         (inp1, [("a", 10 * h + 1, 4.0), ("a", 13 * h, 8.0), ("b", 14 * h, 1.0)])):
        folder.mkdir()
        pd.DataFrame(rows, columns=["user", "ts", "value"]).to_parquet(folder / "p.parquet")
    storage, output = f"file://{tmp_path / 'ckpt'}", str(tmp_path / "out")

    def config(d: int, folder) -> RunConfig:
        return RunConfig(input=str(folder), storage=storage, run_id=f"d{d}", output=output,
                         local_dir=str(tmp_path / "local"), max_reject_fraction=0.0,
                         engine=engine,
                         parallelism=2, options={"allowed_lateness_minutes": 60})

    s0 = run_job(sz.JOB, config(0, inp0), spark)
    assert (s0["watermark"], s0["late_rows"]) == (11 * h, 0)
    # a's session [10h, 10h] closes at wm 11h >= 10h + 30 min; b's stays open
    out = run_output(output, "d0")
    assert out[["user", "session_start", "events"]].values.tolist() == [["a", 10 * h, 1]]
    s1 = run_job(sz.JOB, config(1, inp1), spark)
    # 10h+1 <= 11h: late; the watermark moves to 14h - 1h
    assert (s1["late_rows"], s1["events_rejected"], s1["watermark"]) == (1, 1, 13 * h)
    q = pd.read_parquet(tmp_path / "out" / "_quarantine" / run_dir_name("d1"))
    assert q[["user", "ts", "reason"]].values.tolist() == [["a", str(10 * h + 1), "late"]]
    out = run_output(output, "d1")
    assert out[["user", "session_start", "events"]].values.tolist() == [["b", 12 * h, 1]]


@pytest.mark.parametrize("spec", [SPEC, *(EventsSpec(days=5, events_per_day=25, users=u,
                                                    seed=seed)
                                          for u, seed in ((1, 3), (2, 4), (3, 5), (4, 6)))],
                         ids=["60-users", "1-user", "2-users", "3-users", "4-users"])
def test_sessionization_logic_matches_reference_in_process(spec):
    """The logic alone, in process (`JobTester`: no Spark, no storage), one tester run per
    seeded day: every run's sessions, late rows and watermark, then the open sessions
    and their timers (one per user, at its earliest end + gap) equal the reference.
    With a few users, a timer chunk often closes every session it reads, or none."""
    days = [d[["user", "ts", "value"]] for d in generate_days(spec)]
    gap = GAP_MIN * 60_000
    ref = sessionize(days, gap, LATENESS_MIN * 60_000)
    options = {"gap_minutes": GAP_MIN, "allowed_lateness_minutes": LATENESS_MIN}
    with JobTester(sz.JOB, options, batch_rows=500) as tester:
        for day, r in zip(days, ref.runs, strict=True):
            run = tester.run(day)
            pd.testing.assert_frame_equal(canonical(run.outputs["sessions"].to_pandas()),
                                          r.emitted, check_dtype=False)
            assert (run.reasons.get("late", 0), run.new_watermark) == (r.late, r.watermark)
        table = tester.state_table("sessions")
        timers = [(t.key, t.time) for t in tester.timers()]
    rows = [(k, *s) for k, sessions in zip(table["key"], table["value"], strict=True)
            for s in sessions]
    got = canonical(pd.DataFrame(rows, columns=SESSION_COLUMNS))
    pd.testing.assert_frame_equal(got, ref.open_sessions, check_dtype=False)
    closes = ref.open_sessions.groupby("user")["session_end"].min() + gap
    assert sorted(timers) == sorted(closes.items())


def test_merge_all_equals_the_per_key_merge():
    """`merge_all` (every key in NumPy at once) against `merge_sessions` (one key in plain
    Python, the semantics as written): equal sessions, value sums added in the same order
    (non-integer values compared exactly), the same Python types, and the timers' next
    closes before and after (`merge_with_closes`); random held sessions, empty and missing
    ones, ties at the gap, duplicate times, and times past 2**53 (the exact per-key
    path)."""
    import random

    import numpy as np

    rng = random.Random(5)
    for trial in range(2000):
        gap = rng.choice([1, 5, 30])
        base = 2 ** 60 if trial % 20 == 0 else 1_700_000_000_000
        old, ts, values, offsets = [], [], [], [0]
        for _ in range(rng.randint(1, 6)):
            held, t = [], base + rng.randint(0, 50)
            for _ in range(rng.randint(0, 3) if rng.random() < 0.6 else 0):
                end = t + rng.randint(0, 10)
                held.append([t, end, rng.randint(1, 5), rng.choice([0.1, 2.5, 1e-3]) * 3])
                t = end + gap + rng.randint(0, 10)
            old.append(held if held or rng.random() < 0.5 else None)
            n = rng.randint(1, 8)
            ts += [base + rng.randint(0, 100) for _ in range(n)]
            values += [rng.choice([0.1, 0.7, 3.3]) * rng.randint(1, 9) for _ in range(n)]
            offsets.append(offsets[-1] + n)
        ts_a, values_a, offsets_a = np.array(ts), np.array(values), np.array(offsets)
        got, before, had, after = sz.merge_with_closes(old, ts_a, values_a, offsets_a, gap)
        want = [sz.merge_sessions(o or [], ts_a[lo:hi], values_a[lo:hi], gap)
                for o, lo, hi in zip(old, offsets[:-1], offsets[1:], strict=True)]
        assert got == want, trial
        assert sz.merge_all(old, ts_a, values_a, offsets_a, gap) == want, trial
        assert [b if h else None for b, h in zip(before.tolist(), had.tolist(), strict=True)] \
            == [sz._next_timer(o, gap) for o in old], trial
        assert after.tolist() == [sz._next_timer(w, gap) for w in want], trial
        assert [[type(v) for v in s] for k in got for s in k] == \
            [[type(v) for v in s] for k in want for s in k]


def test_sums_in_order_add_left_to_right_bit_exactly():
    """`merge_all`'s value sums, NumPy over all sessions at once, against `reduce(add)` of
    each run in plain Python: bit-equal where the order of the additions matters (values
    of very different sizes, cancellations, negative zero), for runs of one value, runs
    up to the NumPy steps and runs longer than them (finished in Python)."""
    import random
    from functools import reduce
    from operator import add

    import numpy as np

    rng = random.Random(11)
    pool = [1e16, -1e16, 1.0, 0.1, 3.3, -0.0, 1e-300, 2.0 ** 53, -7.25]
    for trial in range(300):
        lengths = [rng.choice([1, 2, 3, sz._VECTOR_STEPS, sz._VECTOR_STEPS + 1,
                               rng.randint(1, 3 * sz._VECTOR_STEPS)])
                   for _ in range(rng.randint(1, 12))]
        values = np.array([rng.choice(pool) * rng.randint(1, 9) for _ in range(sum(lengths))])
        bounds = np.cumsum([0, *lengths])
        got = sz._sums_in_order(values, bounds).tolist()
        want = [reduce(add, values[a:b].tolist())
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        assert [v.hex() for v in got] == [v.hex() for v in want], trial
    # the order shows: pairwise (NumPy's sum) and left-to-right differ on this run
    run = np.array([1e16, 1.0, 1.0, 1.0, 1.0, -1e16, 1.0, 1.0])
    assert sz._sums_in_order(run, np.array([0, len(run)])).tolist() == [reduce(add, run)]


def test_next_closes_equal_the_per_key_timer():
    """`assign`'s and `close`'s timers, every key at once, against `_next_timer` per key:
    keys without sessions (None, empty), several sessions in any order, and closes at and
    past the int64 limit (the per-key path, exact Python ints)."""
    import random

    rng = random.Random(3)
    top = 2 ** 63 - 1
    for trial in range(500):
        gap = rng.choice([1, 30 * 60_000])
        near = top - gap if trial % 50 == 0 else (top - gap + 1 if trial % 50 == 1 else 0)
        held = [None if rng.random() < 0.2 else
                [[0, near or rng.randint(-10**12, 10**12), 1, 0.5]
                 for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 9))]
        closes, has = sz._next_closes(held, gap)
        want = [sz._next_timer(h, gap) for h in held]
        assert has.tolist() == [w is not None for w in want], trial
        assert [c if h else None for c, h in zip(closes.tolist(), has.tolist(), strict=True)] \
            == want, trial


def test_session_columns_are_exact_on_both_paths():
    """`close`'s emitted columns: through float64 when every number is exact in it, and
    column by column when one is not (an end past 2**53, or past int64: refused by
    Arrow, as before)."""
    import pytest

    def want(flat):
        return {name: list(col) for name, col in
                zip(sz.SESSION_FIELDS, zip(*flat, strict=True), strict=True)}

    for flat in ([[1, 2, 3, 0.1], [-5, 2**53 - 1, 7, -0.0]],
                 [[1, 2**53 + 1, 1, 2.5]], [[2**62 + 1, 2**62 + 3, 2, 1e300]]):
        got = sz._session_columns(flat)
        assert {n: c.to_pylist() for n, c in got.items()} == want(flat)
        assert [c.type for c in got.values()] == [f.type for f in sz.SESSION_FIELDS.values()]
    with pytest.raises(OverflowError):
        sz._session_columns([[1, 2**64, 1, 0.5]])
    # a held value of another shape is refused, even when its numbers would fill rows of 4
    with pytest.raises(ValueError, match="not \\[start, end, events, value_sum\\]"):
        sz._session_columns([[1, 2, 3, 4, 5], [6, 7, 8]])


def test_at_most_compares_int64_with_any_int_exactly():
    """`close`'s ``end + gap <= watermark`` as ``end <= watermark - gap``: exact at the
    boundary and for limits outside int64 (no wrap-around, no float rounding)."""
    import numpy as np

    ends = np.array([-2**63, -1, 0, 2**53 + 1, 2**63 - 1], np.int64)
    for limit in (-2**64, -2**63 - 1, -2**63, -1, 0, 2**53, 2**53 + 1, 2**63 - 1, 2**63,
                  2**70):
        assert sz._at_most(ends, limit).tolist() == [int(e) <= limit for e in ends], limit
