"""`JobTester` (statebackend/job/testing.py): a job's runs in process against its state.

Every result is compared with an independent reference: pandas over the same rows for
the per-key and the vectorized form of the example job (outputs, rejected rows, both
states), the timer and TTL rules written out by hand (a timer fires in the first run
whose clock reaches it; an entry is gone once its clock reaches the expiry), and the
docs' examples executed as written.
"""

from __future__ import annotations

import ast
import operator
import os
import random
import re
from collections import Counter
from pathlib import Path

import mmh3
import pandas as pd
import pyarrow as pa
import pytest

from examples import user_activity
from statebackend.errors import UsageError
from statebackend.job import (
    Input,
    Job,
    JobTester,
    Output,
    PerKey,
    StateTtl,
    Vectorized,
    aggregating_state,
    list_state,
    map_state,
    record,
    reducing_state,
    value_state,
)
from tests.statebackend.helpers import Average

ROOT = Path(__file__).resolve().parents[3]


# -- the example job, both forms, against pandas ---------------------------------------------
def activity_runs(seed: int, runs: int = 3, rows: int = 120) -> list[list[dict]]:
    """Rows of ``runs`` runs: unique ``ts`` per row (so "the latest event" is one row),
    mixed-case categories, unicode users, and a few rows each rule rejects."""
    rng = random.Random(seed)
    users = ["ann", "bob", "zoë", "Émile", "k-1", "k-2", "k-3", "李"]
    categories = ["Books", "books", "GAMES", "music", "Music"]
    stamps = rng.sample(range(1, 100_000), runs * rows)
    out = []
    for r in range(runs):
        batch = [{"user": rng.choice(users), "ts": stamps[r * rows + i],
                  "category": rng.choice(categories)} for i in range(rows)]
        batch += [{"user": "", "ts": 5, "category": "x"},
                  {"user": "ann", "ts": "soon", "category": "books"}]
        rng.shuffle(batch)
        out.append(batch)
    return out


def activity_reference(runs: list[list[dict]]) -> tuple[list[list[dict]], dict, dict]:
    """pandas: per run the activity rows (sorted by user) and the rejected (user, reason);
    the final ``last_seen`` per user and ``counts`` per (user, category)."""
    last: dict[str, dict] = {}
    counts: dict[str, Counter] = {}
    outputs = []
    for rows in runs:
        df = pd.DataFrame(rows)
        ok = (df["user"] != "") & df["ts"].map(lambda v: isinstance(v, int))
        good = df[ok].assign(ts=lambda d: d["ts"].astype("int64"),
                             category=lambda d: d["category"].str.lower())
        run_rows = []
        for user, g in good.groupby("user", sort=True):
            newest = g.loc[g["ts"].idxmax()]
            if user not in last or newest["ts"] >= last[user]["ts"]:
                last[user] = {"ts": int(newest["ts"]), "category": newest["category"]}
            counts.setdefault(user, Counter()).update(g["category"].value_counts().to_dict())
            seen = last[user]
            run_rows.append({"user": user, "last_ts": seen["ts"],
                             "last_category": seen["category"],
                             "category_events": counts[user][seen["category"]],
                             "categories": len(counts[user])})
        outputs.append(run_rows)
    return outputs, last, counts


@pytest.mark.parametrize("form", ["per_key", "vectorized"])
@pytest.mark.parametrize("batch_rows", [7, 100_000])
def test_outputs_and_state_equal_pandas_over_runs(form, batch_rows):
    job = user_activity.job if form == "per_key" else user_activity.job_vectorized
    runs = activity_runs(seed=5)
    expected, last, counts = activity_reference(runs)
    with JobTester(job, batch_rows=batch_rows) as tester:
        for rows, want in zip(runs, expected, strict=True):
            got = tester.run(rows)
            assert sorted(got.rows(), key=lambda r: r["user"]) == want
            assert sorted((r["user"], r["reason"]) for r in got.rejected.to_pylist()) == [
                ("", "empty_user"), ("ann", "invalid_ts")]
            assert got.reasons == {"empty_user": 1, "invalid_ts": 1}
        for user, seen in last.items():
            assert tester.state("last_seen", user) == seen
            assert tester.state("counts", user) == dict(counts[user])
            assert tester.state("counts", user, "books") == counts[user].get("books")
        assert tester.state("last_seen", "nobody") is None
        assert tester.state("counts", "nobody") == {}

        table = tester.state_table("counts")
        want = pd.DataFrame([(u, c, n) for u, per in counts.items() for c, n in per.items()],
                            columns=["key", "user_key", "value"])
        want = want.sort_values(["key", "user_key"]).reset_index(drop=True)
        pd.testing.assert_frame_equal(table[["key", "user_key", "value"]], want)
        assert list(table.columns) == ["key", "user_key", "value", "key_group"]
        assert table["key_group"].tolist() == [
            mmh3.hash(k.encode(), 0, signed=False) % 128 for k in table["key"]]
        seen = tester.state_table("last_seen")
        assert dict(zip(seen["key"], seen["value"], strict=True)) == last


def test_the_per_key_form_is_called_once_per_key_per_run_across_batches():
    """A key's rows of one run reach one call, whatever the batch size; a key's rows of
    two runs are two calls; the rows arrive sorted by event time."""
    schema = pa.schema([("k", pa.string()), ("ts", pa.int64())])

    def fn(key, rows, state):
        state.count("calls")
        ts = rows["ts"].to_pylist()
        assert ts == sorted(ts)
        state["n"].update(state["n"].value(0) + len(ts))

    job = Job(name="calls", input=Input(schema, "k", event_time="ts"),
              states=(value_state("n"),), logic=PerKey(fn))
    rows = [{"k": f"k{i % 5}", "ts": 1000 - i} for i in range(40)]
    with JobTester(job, batch_rows=3) as tester:
        first = tester.run(rows[:20], rows[20:])  # two inputs, one run
        assert first.counters == {"calls": 5}
        second = tester.run([{"k": "k0", "ts": 2000}])
        assert second.counters == {"calls": 1}
        assert {k: tester.state("n", k) for k in ("k0", "k1")} == {"k0": 9, "k1": 8}


def test_the_vectorized_form_is_called_once_per_batch_of_sorted_rows():
    schema = pa.schema([("k", pa.string()), ("v", pa.int64())])

    def fn(batch, ctx):
        ctx.count("calls")
        ctx.emit("seen", {"k": batch["k"], "v": batch["v"],
                          "call": [ctx.counters["calls"]] * batch.num_rows})

    seen = Output("seen", pa.schema([("k", pa.string()), ("v", pa.int64()),
                                     ("call", pa.int64())]))
    job = Job(name="calls", input=Input(schema, "k"), outputs=(seen,), logic=Vectorized(fn))
    rows = [{"k": k, "v": v} for k, v in zip("dcbadcbadc", range(10), strict=True)]
    with JobTester(job, batch_rows=3) as tester:
        run = tester.run(rows)
    want = sorted(rows, key=lambda r: (r["k"], r["v"]))  # the engines' order: key, then v
    assert run.counters == {"calls": 4}
    assert run.rows() == [{**r, "call": 1 + i // 3} for i, r in enumerate(want)]


def test_every_input_form_gives_the_same_run():
    rows = [{"user": "ann", "ts": 1, "category": "a"}, {"user": "bob", "ts": 2, "category": "b"}]
    frame = pd.DataFrame(rows)
    table = pa.Table.from_pandas(frame, preserve_index=False)
    forms = [rows, frame, table, table.to_batches()[0], frame.to_dict(orient="list")]
    results = []
    for form in forms:
        with JobTester(user_activity.job) as tester:
            results.append(tester.run(form).rows())
    assert all(r == results[0] for r in results) and len(results[0]) == 2
    with JobTester(user_activity.job) as tester, pytest.raises(UsageError, match="got int"):
        tester.run(5)


def test_reducing_and_aggregating_states_read_as_their_values():
    def fold(key, rows, state):
        for v in rows["v"].to_pylist():
            state["total"].add(v)
            state["mean"].add(v)

    job = Job(name="folds", input=Input(pa.schema([("k", pa.string()), ("v", pa.int64())]),
                                        "k"), logic=PerKey(fold),
              states=(reducing_state("total", operator.add),
                      aggregating_state("mean", Average())))
    rng = random.Random(3)
    runs = [[{"k": rng.choice("abc"), "v": rng.randint(-9, 9)} for _ in range(30)]
            for _ in range(3)]
    with JobTester(job) as tester:
        for rows in runs:
            tester.run(rows)
        both = pd.DataFrame([r for rows in runs for r in rows]).groupby("k")["v"]
        assert {k: tester.state("total", k) for k in "abc"} == both.sum().to_dict()
        assert {k: tester.state("mean", k) for k in "abc"} == pytest.approx(
            both.mean().to_dict())
        table = tester.state_table("mean")
        assert dict(zip(table["key"], table["value"], strict=True)) == pytest.approx(
            both.mean().to_dict())
        tester.set_state("mean", "a", [10, 4])  # an aggregating state's accumulator
        assert tester.state("mean", "a") == 2.5


# -- timers ------------------------------------------------------------------------------------
EVENTS = pa.schema([("k", pa.string()), ("ts", pa.int64())])
FIRED = Output("fired", pa.schema([("k", pa.string()), ("time", pa.int64()),
                                   ("domain", pa.string()), ("clock", pa.int64())]))


def _register(batch, ctx):
    """An event timer at ts + 100 and a processing timer 50 after the run's time, per row."""
    keys = batch["k"].to_pylist()
    ctx.timers.register(keys, [t + 100 for t in batch["ts"].to_pylist()])
    ctx.timers.register(keys, [ctx.processing_time + 50] * len(keys), domain="processing")


def _fire(timers, ctx):
    rows = timers.to_pylist()
    ctx.emit("fired", {"k": [r["key"] for r in rows], "time": [r["time"] for r in rows],
                       "domain": [r["domain"] for r in rows],
                       "clock": [ctx.new_watermark if r["domain"] == "event"
                                 else ctx.processing_time for r in rows]})


TIMED = Job(name="timed", input=Input(EVENTS, "k", event_time="ts", allowed_lateness=20),
            outputs=(FIRED,), logic=Vectorized(_register), on_timer=Vectorized(_fire))


def fired(run) -> list[tuple]:
    return [(r["k"], r["time"], r["domain"]) for r in run.rows()]


def test_event_timers_fire_in_the_first_run_whose_watermark_reaches_them():
    with JobTester(TIMED, processing_time=1_000) as tester:
        first = tester.run([{"k": "a", "ts": 10}, {"k": "b", "ts": 150}])
        # the engines' rule: max event time - allowed lateness
        assert (first.watermark, first.new_watermark) == (None, 130)
        assert fired(first) == [("a", 110, "event")]  # 110 <= 130; b's 250 waits
        assert [(t.key, t.time, t.domain) for t in tester.timers()] == [
            ("b", 250, "event"), ("a", 1_050, "processing"), ("b", 1_050, "processing")]
        assert fired(tester.run(watermark=249)) == []
        late = tester.run([{"k": "c", "ts": 249}, {"k": "c", "ts": 300}])
        assert [r["reason"] for r in late.rejected.to_pylist()] == ["late"]  # 249 <= 249
        # c's rows move the watermark to 280: b's timer (250) fires, c's (400) waits
        assert (late.new_watermark, fired(late)) == (280, [("b", 250, "event")])
        assert late.rows()[0]["clock"] == 280
        assert fired(tester.run(watermark=400)) == [("c", 400, "event")]
        assert [t.key for t in tester.timers("c")] == ["c"]  # the processing one


def test_processing_timers_fire_when_the_processing_time_reaches_them():
    with JobTester(TIMED, processing_time=1_000) as tester:
        tester.run([{"k": "a", "ts": 10}])  # processing timer at 1_050
        assert fired(tester.run(processing_time=1_049)) == []
        run = tester.run(processing_time=1_050)
        assert fired(run) == [("a", 1_050, "processing")]
        assert run.rows()[0]["clock"] == 1_050 and run.timers_fired == 1
        assert [(t.key, t.time, t.domain) for t in tester.timers()] == [("a", 110, "event")]


def test_the_clocks_never_go_back_and_a_watermark_needs_event_time():
    with JobTester(TIMED, watermark=100, processing_time=5) as tester:
        with pytest.raises(UsageError, match="watermark=99 is below 100"):
            tester.run(watermark=99)
        with pytest.raises(UsageError, match=r"watermark=150 is below 180"):
            tester.run([{"k": "a", "ts": 200}], watermark=150)
        with pytest.raises(UsageError, match="processing_time=4 is before 5"):
            tester.run(processing_time=4)
        assert tester.run(watermark=150).new_watermark == 150  # refusals changed nothing
    with pytest.raises(UsageError, match="no event-time column"):
        JobTester(user_activity.job, watermark=1)
    with JobTester(user_activity.job) as tester, \
            pytest.raises(UsageError, match="no event-time column"):
        tester.run(watermark=1)


# -- TTL ---------------------------------------------------------------------------------------
KV = pa.schema([("k", pa.string()), ("v", pa.int64())])


def _remember(batch, ctx):
    keys, values = batch["k"].to_pylist(), batch["v"].to_pylist()
    ctx.state("last").update(keys, values)
    ctx.state("history").add(keys, values)
    ctx.state("by_value").put(keys, [str(v) for v in values], values)
    ctx.state("sums").update_columns(keys, {"total": values})


TTL_JOB = Job(
    name="ttl", input=Input(KV, "k"), logic=Vectorized(_remember),
    states=(value_state("last", ttl=StateTtl(1_000, time="processing")),
            list_state("history", ttl=StateTtl(1_000, time="processing")),
            map_state("by_value", ttl=StateTtl(1_000, time="processing")),
            value_state("sums", record(total="int64"))))


def test_ttl_expiry_shows_in_state_reads_once_the_clock_reaches_it():
    with JobTester(TTL_JOB, processing_time=0) as tester:
        tester.run([{"k": "a", "v": 1}, {"k": "b", "v": 2}])
        tester.run([{"k": "a", "v": 3}], processing_time=500)  # a's entries written at 500
        assert tester.state("last", "a") == 3 and tester.state("history", "a") == [1, 3]
        table = tester.state_table("history")
        assert table[["key", "value", "expires_at"]].values.tolist() == [
            ["a", [1, 3], [1_000, 1_500]], ["b", [2], [1_000]]]
        last = tester.state_table("last")
        assert list(last.columns) == ["key", "value", "key_group", "expires_at"]
        assert last[["key", "expires_at"]].values.tolist() == [["a", 1_500], ["b", 1_000]]

        gone = tester.run(processing_time=1_000)  # expiry <= clock: gone
        assert tester.state("last", "b") is None and tester.state("history", "b") == []
        assert tester.state("by_value", "b") == {} and tester.state("history", "a") == [3]
        assert tester.state("by_value", "a") == {"3": 3}
        assert tester.state_table("last")["key"].tolist() == ["a"]
        # b's value, list and map entry; a's first list element and first map entry
        assert gone.ttl_purged == 5
        sums = tester.state_table("sums")  # no TTL: kept, one column per record field
        assert sums.values.tolist() == [
            ["a", 3, mmh3.hash(b"a", 0, signed=False) % 128],
            ["b", 2, mmh3.hash(b"b", 0, signed=False) % 128]]
        # expired but not purged yet (purge runs at the end of a run): absent already
        tester.set_state("last", "c", 7, timestamp=0)  # expires at 1_000: the clock
        assert tester.state("last", "c") is None
        assert "c" not in tester.state_table("last")["key"].tolist()
        tester.run(processing_time=1_499)
        assert tester.state("last", "a") == 3
        tester.run(processing_time=1_500)
        assert tester.state_table("last").empty and tester.state_table("by_value").empty


def test_event_time_ttl_follows_the_watermark():
    def keep(batch, ctx):
        ctx.state("seen").update(batch["k"], batch["ts"].to_pylist(), timestamps=batch["ts"])

    job = Job(name="seen", input=Input(EVENTS, "k", event_time="ts"), logic=Vectorized(keep),
              states=(value_state("seen", ttl=StateTtl(100, time="event")),))
    with JobTester(job) as tester:
        run = tester.run([{"k": "a", "ts": 10}, {"k": "b", "ts": 60}])
        assert run.new_watermark == 60
        assert tester.state_table("seen")[["key", "expires_at"]].values.tolist() == [
            ["a", 110], ["b", 160]]
        tester.run(watermark=109)
        assert tester.state("seen", "a") == 10
        assert tester.run(watermark=110).ttl_purged == 1
        assert tester.state("seen", "a") is None and tester.state("seen", "b") == 60


# -- seeding, lifetime -------------------------------------------------------------------------
def test_a_run_continues_from_state_set_directly():
    with JobTester(user_activity.job) as tester:
        tester.set_state("counts", "ann", {"books": 5, "games": 1})
        tester.set_state("last_seen", "ann", {"ts": 50, "category": "games"})
        run = tester.run([{"user": "ann", "ts": 10, "category": "Books"}])
        # an older event: last_seen stays, the count grows
        assert run.rows() == [{"user": "ann", "last_ts": 50, "last_category": "games",
                               "category_events": 1, "categories": 2}]
        assert tester.state("counts", "ann") == {"books": 6, "games": 1}
        tester.set_state("counts", "ann", {"x": 1})  # replaces the key's entries
        assert tester.state("counts", "ann") == {"x": 1}
        tester.set_state("counts", "ann", None)
        assert tester.state_table("counts").empty
    with JobTester(TTL_JOB) as tester:
        tester.set_state("history", "a", [1, 2], timestamp=-600)
        assert tester.state("history", "a") == [1, 2]
        tester.run(processing_time=400)
        assert tester.state("history", "a") == []


def test_close_removes_the_folder_and_a_failed_run_stops_the_tester():
    def boom(key, rows, state):
        state["n"].update(1)
        if key == "b":
            raise RuntimeError("logic bug")

    job = Job(name="boom", input=Input(KV, "k"), states=(value_state("n"),),
              logic=PerKey(boom))
    tester = JobTester(job)
    folder = tester._folder
    assert os.path.isdir(folder)
    with pytest.raises(RuntimeError, match="logic bug"):
        tester.run([{"k": "a", "v": 1}, {"k": "b", "v": 1}])
    with pytest.raises(UsageError, match="run 'run-1' raised RuntimeError"):
        tester.run([{"k": "c", "v": 1}])
    assert tester.state("n", "a") is None  # still readable: nothing of the batch written
    tester.close()
    tester.close()
    assert not os.path.exists(folder)
    with pytest.raises(UsageError, match="is closed"):
        tester.state("n", "a")


def test_bad_reads_name_the_state_and_the_output():
    with JobTester(user_activity.job) as tester:
        run = tester.run([{"user": "ann", "ts": 1, "category": "a"}])
        with pytest.raises(UsageError, match="declares no state 'count'"):
            tester.state("count", "ann")
        with pytest.raises(UsageError, match="user_key= is for map states"):
            tester.state("last_seen", "ann", "x")
        with pytest.raises(UsageError, match="declares no output 'x'"):
            run.rows("x")
        with pytest.raises(UsageError, match="key 1.5 must be a string"):
            tester.state("last_seen", 1.5)


# -- the docs ------------------------------------------------------------------------------------
def section_snippet(doc: str, heading: str) -> str:
    text = (ROOT / "docs" / doc).read_text()
    section = text[text.index(heading):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return snippet


def run_snippet(snippet: str, where: str, monkeypatch) -> dict:
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict = {}
    exec(compile(snippet, where, "exec"), namespace)  # noqa: S102 - our doc
    return namespace


def test_the_state_as_data_example_runs_and_matches_the_reference(monkeypatch, capsys):
    """docs/state-as-data.md, "Test a job against its state", executed as written: what it
    prints equals tests/reference/sessions.py over the same two runs, then the session
    the manual watermark closes."""
    from tests.reference.sessions import sessionize

    snippet = section_snippet("state-as-data.md", "## Test a job against its state")
    ns = run_snippet(snippet, "docs/state-as-data.md", monkeypatch)
    lines = capsys.readouterr().out.splitlines()
    ref = sessionize([pd.DataFrame(ns["day1"]), pd.DataFrame(ns["day2"])],
                     gap_ms=30 * 60_000, lateness_ms=60 * 60_000)
    assert ast.literal_eval(lines[0]) == ref.runs[0].watermark
    assert ast.literal_eval(lines[1]) == ref.runs[0].emitted.to_dict("records")
    bob = ref.open_sessions[ref.open_sessions["user"] == "bob"].to_dict("records")
    assert ast.literal_eval(lines[2]) == [
        [s["session_start"], s["session_end"], s["events"], s["value_sum"]] for s in bob]
    assert [r["reason"] for r in ast.literal_eval(lines[3])] == ["late"] * ref.runs[1].late
    assert ref.runs[1].late == 1 and ref.runs[1].emitted.empty
    assert ast.literal_eval(lines[4]) == bob  # the session the manual watermark closed
    assert lines[5:] == ["Empty DataFrame", "Columns: [key, value, key_group]", "Index: []"]


def test_the_write_a_job_example_runs(monkeypatch):
    """docs/write-a-job.md, "Test your job", executed as written (its asserts hold)."""
    snippet = section_snippet("write-a-job.md", "## Test your job")
    ns = run_snippet(snippet, "docs/write-a-job.md", monkeypatch)
    assert ns["second"].events == 1
