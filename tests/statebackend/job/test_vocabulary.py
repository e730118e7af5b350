"""One vocabulary of state operations for both logic forms (docs/write-a-job.md, "State
operations"): the old names still work for one release, warn naming the new one and
leave the same state; the new operations against a dict model; ``ttl=`` on reducing
and aggregating states (expiry, reads, purge) against a Python reference."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pytest

from statebackend.job import (
    BatchContext,
    Input,
    Job,
    KeyContext,
    PerKey,
    StateTtl,
    Vectorized,
    aggregating_state,
    list_state,
    map_state,
    process,
    record,
    reducing_state,
    value_state,
)
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange
from tests.statebackend.helpers import Average

M = 128
SCHEMA = pa.schema([("k", pa.string()), ("v", pa.int64())])
STATES = (value_state("last"), value_state("rec", record(n="int64")), list_state("all"),
          map_state("by_parity"), reducing_state("top", max),
          aggregating_state("mean", Average()))


def open_backend(path, job: Job) -> KeyedStateBackend:
    return KeyedStateBackend(str(path), job.descriptors, M, KeyGroupRange(0, M - 1))


def raw_state(path, job: Job) -> dict[str, list]:
    with open_backend(path, job) as backend:
        return {d.name: list(backend.iter_raw(d.name)) for d in job.states}


def batches(seed: int) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    return [pa.table({"k": [f"k{i}" for i in rng.integers(0, 12, 40)],
                      "v": rng.integers(0, 100, 40)}, schema=SCHEMA) for _ in range(3)]


# -- vectorized: old and new names ------------------------------------------------------
def vectorized_new(batch: pa.Table, ctx: BatchContext) -> None:
    keys, vals = batch["k"].to_pylist(), batch["v"].to_pylist()
    ctx.state("last").update(keys, vals)
    old = ctx.state("last").value(keys)
    found, cols = ctx.state("rec").value_columns(keys)
    ctx.state("rec").update_columns(keys, {"n": cols["n"] + 1})
    ctx.state("all").add(keys, vals)
    ctx.state("all").update(keys[:2], [[0], [1]])
    ctx.state("by_parity").put(keys, [str(v % 2) for v in vals], old)
    ctx.state("top").add(keys, vals)
    ctx.state("mean").add(keys, vals)
    gone = [k for k in keys if k.endswith("1")]
    for name in ("last", "all", "top", "mean"):
        ctx.state(name).clear(gone)
    ctx.state("by_parity").remove(gone, ["0"] * len(gone))


def vectorized_old(batch: pa.Table, ctx: BatchContext) -> None:
    keys, vals = batch["k"].to_pylist(), batch["v"].to_pylist()
    ctx.state("last").put(keys, vals)
    old = ctx.state("last").get(keys)
    found, cols = ctx.state("rec").get_columns(keys)
    ctx.state("rec").put_columns(keys, {"n": cols["n"] + 1})
    ctx.state("all").append(keys, vals)
    ctx.state("all").put(keys[:2], [[0], [1]])
    ctx.state("by_parity").put(keys, [str(v % 2) for v in vals], old)
    ctx.state("top").add(keys, vals)
    ctx.state("mean").add(keys, vals)
    gone = [k for k in keys if k.endswith("1")]
    for name in ("last", "all", "top", "mean"):
        ctx.state(name).delete(gone)
    ctx.state("by_parity").delete(gone, ["0"] * len(gone))


VECTORIZED_RENAMES = {"put()": "update()", "get()": "value()", "get_columns()":
                      "value_columns()", "put_columns()": "update_columns()",
                      "append()": "add()", "delete()": "clear()"}


def run_collecting_warnings(path, job: Job, runs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for run in runs:
            with open_backend(path, job) as backend:
                process(job, backend, run)
    return [str(w.message) for w in caught if w.category is DeprecationWarning]


def test_vectorized_old_names_warn_and_leave_the_same_state(tmp_path):
    runs = [batches(1), batches(2)]
    new = Job(name="v", input=Input(SCHEMA, "k"), states=STATES,
              logic=Vectorized(vectorized_new))
    old = Job(name="v", input=Input(SCHEMA, "k"), states=STATES,
              logic=Vectorized(vectorized_old))
    assert run_collecting_warnings(tmp_path / "new", new, runs) == []
    messages = set(run_collecting_warnings(tmp_path / "old", old, runs))
    state = raw_state(tmp_path / "new", new)
    assert state == raw_state(tmp_path / "old", old)
    assert all(state.values())  # every kind was written
    for old_name, new_name in VECTORIZED_RENAMES.items():
        assert any(f"{old_name} is deprecated" in m and f"use {new_name}" in m
                   for m in messages), old_name
    assert "state 'by_parity': delete() is deprecated and goes in the next release; use " \
        "remove()" in messages


# -- per key: old and new names ---------------------------------------------------------
def per_key_new(key: str, rows: pa.Table, state: KeyContext) -> None:
    for v in rows["v"].to_pylist():
        state["last"].update(max(v, state["last"].value(0)))
        state["all"].add(v)
        state["top"].add(v)
    if state["top"].get() > 90:
        state["top"].clear()
        state["top"].add(90)


def per_key_old(key: str, rows: pa.Table, state: KeyContext) -> None:
    for v in rows["v"].to_pylist():
        state["last"].update(max(v, state["last"].get(0)))
        state["all"].append(v)
        state["top"].add(v)
    if state["top"].exists() and state["top"].get() > 90:
        state["top"].update(90)


def test_per_key_old_names_warn_and_leave_the_same_state(tmp_path):
    runs = [batches(3), batches(4)]
    states = (value_state("last"), list_state("all"), reducing_state("top", max))
    new = Job(name="p", input=Input(SCHEMA, "k"), states=states, logic=PerKey(per_key_new))
    old = Job(name="p", input=Input(SCHEMA, "k"), states=states, logic=PerKey(per_key_old))
    assert run_collecting_warnings(tmp_path / "new", new, runs) == []
    messages = set(run_collecting_warnings(tmp_path / "old", old, runs))
    assert raw_state(tmp_path / "new", new) == raw_state(tmp_path / "old", old)
    assert messages == {
        "state 'last': get() is deprecated and goes in the next release; use value()",
        "state 'all': append() is deprecated and goes in the next release; use add()",
        "state 'top': exists() is deprecated and goes in the next release; use "
        "get() is not None",
        "state 'top': update() is deprecated and goes in the next release; use clear() "
        "then add(value)"}


# -- the new operations against a model -------------------------------------------------
def test_exists_contains_keys_and_clear_of_both_forms(tmp_path):
    """Vectorized ``exists``/``contains``/``keys``/map ``clear`` and the per-key ones
    agree with a dict model of the same writes."""
    seen: dict[str, tuple] = {}

    def write(batch: pa.Table, ctx: BatchContext) -> None:
        keys, vals = batch["k"].to_pylist(), batch["v"].to_pylist()
        ctx.state("m").put(keys, [f"u{v % 4}" for v in vals], vals)
        ctx.state("last").update(keys[::2], vals[::2])

    def read(key: str, rows: pa.Table, state: KeyContext) -> None:
        seen[key] = (state["last"].exists(), state["m"].keys(),
                     state["m"].contains("u0"))

    def vector_read(batch: pa.Table, ctx: BatchContext) -> None:
        keys = sorted(set(batch["k"].to_pylist()))
        found = ctx.state("last").exists(keys)
        has_u0 = ctx.state("m").contains(keys, ["u0"] * len(keys))
        for k, f, uks, c in zip(keys, found, ctx.state("m").keys(keys), has_u0, strict=True):
            assert seen[k] == (bool(f), uks, bool(c))
        ctx.state("m").clear(keys[:3])
        assert ctx.state("m").keys(keys[:3]) == [[], [], []]

    states = (map_state("m"), value_state("last"))
    data = batches(5)
    model: dict[str, dict] = {}
    last: set[str] = set()
    for b in data:
        keys, vals = b["k"].to_pylist(), b["v"].to_pylist()
        for k, v in zip(keys, vals, strict=True):
            model.setdefault(k, {})[f"u{v % 4}"] = v
        last |= set(keys[::2])
    for i, logic in enumerate((Vectorized(write), PerKey(read), Vectorized(vector_read))):
        job = Job(name="ops", input=Input(SCHEMA, "k"), states=states, logic=logic)
        with open_backend(tmp_path, job) as backend:
            process(job, backend, data if i == 0 else [pa.concat_tables(data)])
    assert seen == {k: (k in last, sorted(m), "u0" in m) for k, m in model.items()}


# -- TTL on reducing and aggregating states ---------------------------------------------
TTL = StateTtl(100, "processing")


def ttl_reference(runs: list[tuple[int, list[tuple[str, int]]]], reduce) -> list[dict]:
    """Per run, the live values at the end (read at the run's time, then purged):
    an expired value counts as absent, a write restarts its time to live."""
    stored: dict[str, tuple] = {}  # key -> (value, expiry)
    out = []
    for now, rows in runs:
        for k, v in rows:
            old = stored.get(k)
            live = old is not None and old[1] > now
            stored[k] = (reduce(old[0], v) if live else reduce(None, v), now + TTL.duration_ms)
        stored = {k: e for k, e in stored.items() if e[1] > now}  # purge
        out.append({k: e[0] for k, e in stored.items()})
    return out


@pytest.mark.parametrize("form", ["per_key", "vectorized"])
@pytest.mark.parametrize("kind", ["reducing", "aggregating"])
def test_ttl_on_reducing_and_aggregating_states(tmp_path, kind, form):
    runs = [(1_000, [("a", 5), ("b", 7), ("c", 1)]),
            (1_060, [("a", 9), ("c", 2)]),        # a and c refreshed to 1160
            (1_120, [("b", 3)]),                  # b expired at 1100: starts over
            (1_170, [("c", 4)]),                  # a, c expired at 1160
            (1_400, [])]                          # everything expired
    if kind == "reducing":
        desc = reducing_state("s", max, ttl=TTL)
        ref = ttl_reference(runs, lambda old, v: v if old is None else max(old, v))
    else:
        desc = aggregating_state("s", Average(), ttl=TTL)
        ref = ttl_reference(runs, lambda old, v: [v, 1] if old is None
                            else [old[0] + v, old[1] + 1])
        ref = [{k: acc[0] / acc[1] for k, acc in r.items()} for r in ref]
    reads: list[dict] = []

    def per_key(key: str, rows: pa.Table, state: KeyContext) -> None:
        for v in rows["v"].to_pylist():
            state["s"].add(v)

    def vectorized(batch: pa.Table, ctx: BatchContext) -> None:
        ctx.state("s").add(batch["k"], batch["v"].to_pylist())

    def read_all(batch: pa.Table, ctx: BatchContext) -> None:
        keys = ["a", "b", "c"]
        reads.append({k: v for k, v in zip(keys, ctx.state("s").get(keys), strict=True)
                      if v is not None})

    logic = PerKey(per_key) if form == "per_key" else Vectorized(vectorized)
    job = Job(name="ttl", input=Input(SCHEMA, "k"), states=(desc,), logic=logic)
    reader = Job(name="ttl", input=Input(SCHEMA, "k"), states=(desc,),
                 logic=Vectorized(read_all))
    purged = []
    for (now, rows), want in zip(runs, ref, strict=True):
        table = pa.table({"k": [k for k, _ in rows], "v": [v for _, v in rows]}, schema=SCHEMA)
        with open_backend(tmp_path, job) as backend:
            purged.append(process(job, backend, [table], processing_time=now).ttl_purged)
            stored = {k.decode("utf-8", "replace")[-1] for k, _ in backend.iter_raw("s")}
        assert stored == set(want), now  # purge removed exactly the expired entries
        with open_backend(tmp_path, reader) as backend:  # a read at the run's time
            process(reader, backend, [pa.table({"k": ["a"], "v": [0]}, schema=SCHEMA)],
                    processing_time=now)
        assert reads[-1] == pytest.approx(want), now
    # expired entries rewritten by their run's add are no purge: a at 1170, b and c at 1400
    assert purged == [0, 0, 0, 1, 2]
