"""The processing core against pandas: both logic forms, several batches and runs, rules."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from examples import user_activity
from statebackend.checkpoint.dump import backend_rows
from statebackend.errors import UsageError
from statebackend.job import (
    Input,
    Job,
    Output,
    PerKey,
    Rule,
    Vectorized,
    aggregating_state,
    between,
    finite,
    list_state,
    map_state,
    not_empty,
    not_null,
    parses,
    process,
    record,
    reducing_state,
    value_state,
)
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange
from tests.statebackend.helpers import Average

M = 128
ALL_GROUPS = KeyGroupRange(0, M - 1)


def open_backend(path, job: Job) -> KeyedStateBackend:
    return KeyedStateBackend(str(path), job.states, M, ALL_GROUPS)


def state_of(backend: KeyedStateBackend) -> dict[str, dict]:
    """Decoded state through the dump path (not the job API): {state: {(key, uk): value}}."""
    out: dict[str, dict] = {name: {} for name in backend.descriptors}
    for row in backend_rows(backend, 0):
        out[row["state"]][(row["key"], row["user_key"])] = row["value"]
    return out


def runs_of(path, job, runs, **kw):
    """Process each run with a fresh processor on the reopened backend; results and state."""
    results = []
    for batches in runs:
        with open_backend(path, job) as backend:
            results.append(process(job, backend, batches, **kw))
    with open_backend(path, job) as backend:
        return results, state_of(backend)


# -- (a) keyed aggregation in the vectorized form ----------------------------------------
TOTALS = record(count="int64", sum="float64", min_ts="int64", max_ts="int64")
AGG_OUTPUT = pa.schema([("key", pa.string()), ("count", pa.int64()), ("sum", pa.float64()),
                        ("min_ts", pa.int64()), ("max_ts", pa.int64()), ("run_id", pa.string())])


def fold(batch: pa.Table, ctx) -> None:
    """jobs/subtask_runner._fold_batch on the API: pre-aggregate, one get, one put."""
    g = batch.group_by("key", use_threads=False).aggregate(
        [("ts", "count"), ("value", "sum"), ("ts", "min"), ("ts", "max")])
    keys = g["key"]
    totals = ctx.state("totals")
    found, old = totals.value_columns(keys)
    lo, hi = g["ts_min"].to_numpy(), g["ts_max"].to_numpy()
    new = {"count": old["count"] + g["ts_count"].to_numpy(),
           "sum": old["sum"] + g["value_sum"].to_numpy(),
           "min_ts": np.where(found, np.minimum(old["min_ts"], lo), lo),
           "max_ts": np.where(found, np.maximum(old["max_ts"], hi), hi)}
    totals.update_columns(keys, new)
    ctx.emit("totals", {"key": keys, **new, "run_id": [ctx.run_id] * len(keys)})


AGG = Job(
    name="keyed_aggregation",
    input=Input(schema=pa.schema([("key", pa.string()), ("ts", pa.int64()),
                                  ("value", pa.float64())]), key="key",
                rules=(not_null("key"), not_empty("key"), not_null("ts"), parses("ts"),
                       not_null("value"), finite("value", "non_numeric_value"))),
    states=(value_state("totals", TOTALS),),
    outputs=(Output("totals", AGG_OUTPUT, last_per="key"),),
    logic=Vectorized(fold),
)


def agg_batches(rng, n_batches: int, rows: int, keys: int) -> list[pa.Table]:
    out = []
    for _ in range(n_batches):
        k = rng.integers(0, keys, rows)
        # Multiples of 1/8: float sums are exact in any order, so equality is exact.
        out.append(pa.table({"key": [f"u{i}" for i in k],
                             "ts": rng.integers(0, 10**6, rows),
                             "value": rng.integers(-800, 800, rows) / 8}))
    return out


def test_keyed_aggregation_vectorized_equals_pandas(tmp_path):
    rng = np.random.default_rng(7)
    runs = [agg_batches(rng, 3, 2000, 300), agg_batches(rng, 2, 1500, 400)]
    results = []
    for run_id, batches in zip(("r1", "r2"), runs, strict=True):
        with open_backend(tmp_path, AGG) as backend:
            results.append(process(AGG, backend, batches, run_id=run_id))
    with open_backend(tmp_path, AGG) as backend:
        state = state_of(backend)["totals"]

    seen = pd.DataFrame()
    for run_id, batches, result in zip(("r1", "r2"), runs, results, strict=True):
        run_df = pa.concat_tables(batches).to_pandas()
        seen = pd.concat([seen, run_df])
        ref = seen.groupby("key").agg(count=("ts", "size"), sum=("value", "sum"),
                                      min_ts=("ts", "min"), max_ts=("ts", "max"))
        got = result.outputs["totals"].to_pandas().set_index("key").sort_index()
        want = ref.loc[sorted(run_df["key"].unique())]
        assert (got["run_id"] == run_id).all()
        pd.testing.assert_frame_equal(got.drop(columns="run_id"), want, check_names=False)
        assert result.events == len(run_df)
        assert result.keys_touched == run_df["key"].nunique()
        assert result.rejected_count == 0
    assert {k: tuple(v.values()) for (k, _), v in state.items()} == {
        k: (r["count"], r["sum"], r["min_ts"], r["max_ts"]) for k, r in ref.iterrows()}


# -- (b) the docs example, per-key form ------------------------------------------------
CATEGORIES = ["Books", "books", "Games", "music", "MUSIC", "food"]


def activity_batches(rng, n_batches: int, rows: int, users: int) -> list[pa.Table]:
    out = []
    for _ in range(n_batches):
        u = rng.integers(0, users, rows)
        out.append(pa.table({
            "user": [f"user{i}" for i in u],
            # Few distinct ts values: ties exercise the "later row wins" rule.
            "ts": rng.integers(0, 50, rows),
            "category": [CATEGORIES[i] for i in rng.integers(0, len(CATEGORIES), rows)],
        }))
    return out


def activity_reference(runs: list[list[pa.Table]]) -> tuple[list[pd.DataFrame], dict]:
    """Per run: expected output; and the expected final state, computed with pandas."""
    seen = pd.DataFrame()
    outputs = []
    for batches in runs:
        run_df = pa.concat_tables(batches).to_pandas()
        run_df["category"] = run_df["category"].str.lower()
        seen = pd.concat([seen, run_df], ignore_index=True)
        latest = seen.sort_values("ts", kind="stable").groupby("user").tail(1).set_index("user")
        counts = seen.groupby(["user", "category"]).size()
        users = sorted(run_df["user"].unique())
        out = pd.DataFrame({
            "last_ts": latest.loc[users, "ts"].to_numpy(),
            "last_category": latest.loc[users, "category"].to_numpy(),
            "category_events": [counts[(u, latest.loc[u, "category"])] for u in users],
            "categories": seen.groupby("user")["category"].nunique().loc[users].to_numpy(),
        }, index=pd.Index(users, name="user"))
        outputs.append(out)
    state = {
        "last_seen": {(u, None): {"ts": int(r["ts"]), "category": r["category"]}
                      for u, r in latest.iterrows()},
        "counts": {(u, c): int(n) for (u, c), n in counts.items()},
    }
    return outputs, state


def check_outputs(results, expected: list[pd.DataFrame]) -> None:
    for result, want in zip(results, expected, strict=True):
        got = result.outputs["activity"].to_pandas().set_index("user").sort_index()
        pd.testing.assert_frame_equal(got, want, check_dtype=False)


def test_user_activity_per_key_equals_pandas(tmp_path):
    rng = np.random.default_rng(11)
    runs = [activity_batches(rng, 3, 700, 120), activity_batches(rng, 2, 500, 200)]
    results, state = runs_of(tmp_path, user_activity.job, runs)
    expected, want_state = activity_reference(runs)
    check_outputs(results, expected)
    assert state == want_state
    assert results[1].timings["grouping"] > 0


# -- (c) the same logic both ways gives identical state --------------------------------
def test_per_key_and_vectorized_forms_write_identical_state(tmp_path):
    rng = np.random.default_rng(3)
    runs = [activity_batches(rng, 3, 600, 150), activity_batches(rng, 2, 400, 250)]
    raw = {}
    for name, job in (("per_key", user_activity.job),
                      ("vectorized", user_activity.job_vectorized)):
        results, _ = runs_of(tmp_path / name, job, runs)
        with open_backend(tmp_path / name, job) as backend:
            raw[name] = {cf: list(backend.iter_raw(cf)) for cf in ("last_seen", "counts")}
        expected, _ = activity_reference(runs)
        check_outputs(results, expected)
    assert raw["per_key"] == raw["vectorized"]
    assert len(raw["per_key"]["counts"]) > 250


def test_option_reaches_the_logic(tmp_path):
    batches = [pa.table({"user": ["a", "a"], "ts": [1, 2], "category": ["X", "x"]})]
    for job in (user_activity.job, user_activity.job_vectorized):
        with open_backend(tmp_path / job.logic.__class__.__name__, job) as backend:
            result = process(job, backend, batches, options={"normalize_case": "false"})
        assert result.outputs["activity"].to_pylist() == [
            {"user": "a", "last_ts": 2, "last_category": "x", "category_events": 1,
             "categories": 2}]


def test_per_key_list_reducing_aggregating_handles(tmp_path):
    def logic(key, rows, state):
        for ts in rows["ts"].to_pylist():
            state["history"].add(ts)
            state["latest"].add(ts)
            state["mean"].add(ts)
        if len(state["history"].get()) > 4:
            state["history"].update(state["history"].get()[-4:])

    job = Job(name="handles", input=Input(pa.schema([("k", pa.string()), ("ts", pa.int64())]),
                                          key="k"),
              states=(list_state("history"), reducing_state("latest", max),
                      aggregating_state("mean", Average())),
              logic=PerKey(logic))
    rng = np.random.default_rng(5)
    batches = [pa.table({"k": [f"k{i}" for i in rng.integers(0, 20, 100)],
                         "ts": rng.integers(0, 1000, 100)}) for _ in range(3)]
    _, state = runs_of(tmp_path, job, [batches[:2], batches[2:]])
    df = pa.concat_tables(batches).to_pandas()
    by_key = df.groupby("k")["ts"]
    assert state["history"] == {(k, None): list(v.to_list()[-4:]) for k, v in by_key}
    assert state["latest"] == {(k, None): int(v) for k, v in by_key.max().items()}
    assert {k: a[0] / a[1] for k, a in state["mean"].items()} == pytest.approx(
        {(k, None): v for k, v in by_key.mean().items()})


# -- (d) rules: rejected rows and reasons equal pandas ---------------------------------
RULES_JOB = Job(
    name="rules",
    input=Input(schema=pa.schema([("key", pa.string()), ("ts", pa.int64()),
                                  ("value", pa.float64())]), key="key",
                rules=(not_null("key"), not_empty("key"), not_null("ts"), parses("ts"),
                       between("ts", 0, 10**12), not_null("value"),
                       finite("value", "non_numeric_value"))),
    states=(value_state("n"),),
    logic=Vectorized(lambda batch, ctx: None),
)
TS_TEXT = ["5", " 12 ", "1.5", "x", "", None, "-3", "99999999999999999999",
           "9223372036854775807", "+7", "10000000000000"]
VALUE_TEXT = ["1.5", "abc", "nan", "inf", "-2e3", "", None, "7", ".5", "-inf"]
KEY_TEXT = ["a", "b", "", None, "c"]


def reference_reasons(df: pd.DataFrame) -> pd.Series:
    """The first failing rule per row, written independently with Python parsing."""
    def as_int(s):
        s = s.strip()
        if not re.fullmatch(r"[+-]?[0-9]+", s):
            return None
        v = int(s)
        return v if -2**63 <= v < 2**63 else None

    reasons = []
    for key, ts, value in df[["key", "ts", "value"]].itertuples(index=False):
        ts_v = None if ts is None else as_int(ts)
        value_v = pd.to_numeric(pd.Series([value]), errors="coerce")[0] \
            if value is not None else None
        if key is None:
            reasons.append("missing_key")
        elif key == "":
            reasons.append("empty_key")
        elif ts is None:
            reasons.append("missing_ts")
        elif ts_v is None:
            reasons.append("invalid_ts")
        elif not 0 <= ts_v <= 10**12:
            reasons.append("out_of_range_ts")
        elif value is None:
            reasons.append("missing_value")
        elif not np.isfinite(value_v):
            reasons.append("non_numeric_value")
        else:
            reasons.append(None)
    return pd.Series(reasons, index=df.index, dtype=object)


def test_rules_reject_like_pandas(tmp_path):
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(3):
        n = 400
        batches.append(pa.table({
            "key": pa.array([KEY_TEXT[i] for i in rng.integers(0, len(KEY_TEXT), n)]),
            "ts": pa.array([TS_TEXT[i] for i in rng.integers(0, len(TS_TEXT), n)]),
            "value": pa.array([VALUE_TEXT[i] for i in rng.integers(0, len(VALUE_TEXT), n)]),
        }))
    with open_backend(tmp_path, RULES_JOB) as backend:
        result = process(RULES_JOB, backend, batches)
    df = pa.concat_tables(batches).to_pandas().astype(object)
    df = df.where(df.notna(), None)
    df["reason"] = reference_reasons(df)
    want = df[df["reason"].notna()].reset_index(drop=True)
    got = result.rejected.to_pandas().astype(object)
    got = got.where(got.notna(), None)
    assert got.columns.tolist() == ["key", "ts", "value", "reason"]
    pd.testing.assert_frame_equal(got, want, check_dtype=False)
    assert result.reasons == want["reason"].value_counts().sort_index().to_dict()
    assert result.events == int(df["reason"].isna().sum())
    assert result.rejected_count + result.events == len(df)


def test_missing_column_reader_reason_and_typed_input(tmp_path):
    """An absent column is null (missing_*); ``_reason`` wins; typed input casts as is."""
    batches = [
        pa.table({"key": ["a", "b"], "ts": [1, 2]}),  # no value column at all
        pa.table({"key": ["c", "d", "e"], "ts": pa.array([3.0, 4.5, 5.0]),
                  "value": [1, 2, 3], "_reason": [None, None, "malformed"],
                  "_line": ["l1", "l2", "l3"]}),
    ]
    with open_backend(tmp_path, RULES_JOB) as backend:
        result = process(RULES_JOB, backend, batches)
    assert result.rejected.select(["key", "ts", "reason"]).to_pylist() == [
        {"key": "a", "ts": "1", "reason": "missing_value"},
        {"key": "b", "ts": "2", "reason": "missing_value"},
        {"key": "d", "ts": "4.5", "reason": "invalid_ts"},
        {"key": "e", "ts": "5", "reason": "malformed"},
    ]
    assert result.rejected["_line"].to_pylist() == [None, None, "l2", "l3"]
    assert result.events == 1


def test_integer_keys_are_cast_to_strings(tmp_path):
    job = Job(name="ints", input=Input(pa.schema([("k", pa.int64())]), key="k"),
              states=(value_state("n"),),
              logic=Vectorized(lambda b, ctx: ctx.state("n").update(b["k"], [1] * len(b))))
    with open_backend(tmp_path, job) as backend:
        result = process(job, backend, [pa.table({"k": [5, None, 7]})])
        assert backend.value_state("n").get_many(["5", "7"]) == [1, 1]
    assert result.reasons == {"missing_k": 1}


def test_rule_returning_a_bad_mask_is_one_line(tmp_path):
    job = Job(name="badrule", input=Input(pa.schema([("k", pa.string())]), key="k",
                                          rules=(Rule("oops", lambda t: t["k"]),)),
              logic=Vectorized(lambda b, ctx: None))
    with open_backend(tmp_path, job) as backend, pytest.raises(UsageError) as err:
        process(job, backend, [pa.table({"k": ["a"]})])
    assert "\n" not in str(err.value) and "'badrule'" in str(err.value) \
        and "'oops'" in str(err.value)


# -- (e) output schema errors are one line ----------------------------------------------
@pytest.mark.parametrize(("emitted", "fragment"), [
    ({"k": ["a"]}, "no column 'n'"),
    ({"k": ["a"], "n": ["x"]}, "column 'n' does not convert to int64"),
    (pa.table({"k": ["a"], "n": pa.array([1], pa.int32())}),
     "column 'n' has type int32, expected int64"),
    ({"k": ["a"], "n": [1], "extra": [2]}, "undeclared column 'extra'"),
    ([{"k": "a"}], "no column 'n'"),
    ("rows", "got a str"),
])
def test_output_schema_errors_name_job_output_column(tmp_path, emitted, fragment):
    job = Job(name="emitter", input=Input(pa.schema([("k", pa.string())]), key="k"),
              outputs=(Output("out", pa.schema([("k", pa.string()), ("n", pa.int64())])),),
              logic=Vectorized(lambda b, ctx: ctx.emit("out", emitted)))
    with open_backend(tmp_path, job) as backend, pytest.raises(UsageError) as err:
        process(job, backend, [pa.table({"k": ["a"]})])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("job 'emitter': output 'out'") and fragment in msg


def test_emit_to_undeclared_output_and_per_key_return_with_two_outputs(tmp_path):
    job = Job(name="two", input=Input(pa.schema([("k", pa.string())]), key="k"),
              outputs=(Output("a", pa.schema([("k", pa.string())])),
                       Output("b", pa.schema([("k", pa.string())]))),
              logic=PerKey(lambda k, rows, state: [{"k": k}]))
    with open_backend(tmp_path, job) as backend, pytest.raises(UsageError, match="state.emit"):
        process(job, backend, [pa.table({"k": ["a"]})])
    job2 = Job(name="undeclared", input=Input(pa.schema([("k", pa.string())]), key="k"),
               logic=Vectorized(lambda b, ctx: ctx.emit("nope", b)))
    with open_backend(tmp_path / "2", job2) as backend, \
            pytest.raises(UsageError, match="declares no output 'nope'"):
        process(job2, backend, [pa.table({"k": ["a"]})])


def test_per_key_rows_keep_input_order_and_cover_the_batch(tmp_path):
    seen: dict[str, list] = {}

    def logic(key, rows, state):
        seen.setdefault(key, []).extend(rows["i"].to_pylist())

    job = Job(name="order", input=Input(pa.schema([("k", pa.string()), ("i", pa.int64())]),
                                        key="k"), logic=PerKey(logic))
    keys = ["b", "a", "b", "c", "a", "b"]
    with open_backend(tmp_path, job) as backend:
        process(job, backend, [pa.table({"k": keys, "i": range(6)})])
    assert seen == {"b": [0, 2, 5], "a": [1, 4], "c": [3]}
    assert list(seen) == ["b", "a", "c"]
    assert pc.sum(pa.array([len(v) for v in seen.values()])).as_py() == len(keys)


def test_vectorized_batch_operations_of_every_kind(tmp_path):
    """Value/list/map/reducing batch calls against a dict model of the same operations."""
    def logic(batch, ctx):
        keys = batch["k"].to_pylist()
        vals = batch["v"].to_pylist()
        ctx.state("last").update(keys, vals)
        ctx.state("all").add(keys, vals)
        ctx.state("seen").put(keys, [str(v % 3) for v in vals], [1] * len(keys))
        ctx.state("top").add(keys, vals)
        gone = [k for k in keys if k.endswith("0")]
        ctx.state("last").clear(gone)
        ctx.state("seen").remove(gone, ["0"] * len(gone))
        ctx.emit("lists", {"k": keys[:1], "n": [len(ctx.state("all").get(keys[:1])[0])]})

    job = Job(name="kinds", input=Input(pa.schema([("k", pa.string()), ("v", pa.int64())]),
                                        key="k"),
              states=(value_state("last"), list_state("all"), map_state("seen"),
                      reducing_state("top", max)),
              outputs=(Output("lists", pa.schema([("k", pa.string()), ("n", pa.int64())])),),
              logic=Vectorized(logic))
    rng = np.random.default_rng(9)
    batches = [pa.table({"k": [f"k{i}" for i in rng.integers(0, 30, 50)],
                         "v": rng.integers(0, 100, 50)}) for _ in range(3)]
    _, state = runs_of(tmp_path, job, [batches[:2], batches[2:]])
    last, lists, seen, top = {}, {}, {}, {}
    for b in batches:
        keys, vals = b["k"].to_pylist(), b["v"].to_pylist()
        for k, v in zip(keys, vals, strict=True):
            last[(k, None)] = v
            lists.setdefault((k, None), []).append(v)
            seen[(k, str(v % 3))] = 1
            top[(k, None)] = max(top.get((k, None), v), v)
        for k in keys:
            if k.endswith("0"):
                last.pop((k, None), None)
                seen.pop((k, "0"), None)
    assert state == {"last": last, "all": lists, "seen": seen, "top": top}
