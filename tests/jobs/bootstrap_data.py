"""Data of the bootstrap tests (tests/jobs/test_bootstrap.py, the Connect test): the
card-spend job's state as tables, and a job with every state kind, TTL and timers with
its tables and its pandas reference; a module of its own so Spark tasks import it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from statebackend.job import (
    Input,
    Job,
    Output,
    StateTtl,
    Vectorized,
    aggregating_state,
    group_by_key,
    list_state,
    map_state,
    reducing_state,
    value_state,
)
from tests.evolution.card_spend import events
from tests.statebackend.helpers import Average

DAY = 86_400_000

def history() -> pd.DataFrame:
    return events(400, 30, 7, 0)


def state_tables(ref: dict[str, dict]) -> dict[str, pa.Table]:
    """card_spend's state (pandas' reference) as one table per state."""
    totals, merchants = ref["totals"], ref["per_merchant"]
    return {
        "totals": pa.table({"card": list(totals), "n": [t["n"] for t in totals.values()],
                            "spend": [t["spend"] for t in totals.values()],
                            "big": [t["big"] for t in totals.values()]}),
        "per_merchant": pa.table({"key": [c for c, _ in merchants],
                                  "user_key": [m for _, m in merchants],
                                  "value": list(merchants.values())}),
        "recent": pa.table({"key": list(ref["recent"]), "value": list(ref["recent"].values())}),
        "max_amount": pa.table({"key": list(ref["max_amount"]),
                                "value": list(ref["max_amount"].values())}),
    }


T = 10 * DAY  # the run's logical (processing) time
TTL = StateTtl(DAY, "processing")
FIRED = Output("fired", pa.schema([("key", pa.string()), ("time", pa.int64()),
                                   ("tag", pa.string()), ("domain", pa.string())]))


def _count(batch: pa.Table, ctx) -> None:
    keys, _, offsets = group_by_key(batch, "k")
    counts = ctx.state("count")
    old = counts.value(keys)
    counts.update(keys, [(o or 0) + int(offsets[i + 1] - offsets[i])
                         for i, o in enumerate(old)])


def _fire(timers: pa.Table, ctx) -> None:
    ctx.emit("fired", {n: timers[n] for n in FIRED.schema.names})


KINDS = Job(name="kinds", input=Input(pa.schema([("k", pa.string()), ("ts", pa.int64())]),
                                      key="k", event_time="ts"),
            states=(value_state("count"), value_state("seen", ttl=TTL),
                    map_state("tags", ttl=TTL), list_state("events", ttl=TTL),
                    reducing_state("total", lambda a, b: a + b, ttl=TTL),
                    aggregating_state("avg", Average())),
            outputs=(FIRED,), logic=Vectorized(_count), on_timer=Vectorized(_fire))


def kinds_tables(rng: np.random.Generator) -> dict[str, pd.DataFrame]:
    keys = [f"u{i}" for i in range(25)] + ["ключ", "鍵"]
    n = len(keys)

    def expiries(k: int) -> np.ndarray:  # before, at and after the run's time
        return T + rng.choice([-DAY, -1, 0, 1, DAY], k)

    m = 3 * n
    return {
        "count": pd.DataFrame({"key": keys, "value": rng.integers(0, 9, n)}),
        "seen": pd.DataFrame({"key": keys, "value": [f"s{i}" for i in range(n)],
                              "expires_at": expiries(n)}),
        "tags": pd.DataFrame({"key": keys * 2, "user_key": ["a"] * n + ["b"] * n,
                              "value": rng.integers(0, 99, 2 * n),
                              "expires_at": expiries(2 * n)}),
        "events": pd.DataFrame({"key": rng.choice(keys, m), "value": np.arange(m),
                                "expires_at": expiries(m)}),
        "total": pd.DataFrame({"key": keys, "value": rng.normal(0, 5, n),
                               "expires_at": expiries(n)}),
        "avg": pd.DataFrame({"key": keys, "value": [[float(i), 1 + i % 3] for i in range(n)]}),
        "_timers": pd.DataFrame({
            "key": keys * 2, "time": np.concatenate([T + rng.integers(-5, 5, n),
                                                     rng.integers(90, 110, n)]),
            "domain": ["processing"] * n + ["event"] * n,
            "tag": [f"t{i % 4}" for i in range(2 * n)]}),
    }


def kinds_reference(tables: dict[str, pd.DataFrame], day: pd.DataFrame,
                    watermark: int) -> tuple[dict[str, dict], list[tuple]]:
    """(what the latest checkpoint holds after the run, the timers fired), by pandas."""
    live = {n: t[t["expires_at"] > T] if "expires_at" in t else t for n, t in tables.items()}
    out: dict[str, dict] = {}
    counts = dict(zip(tables["count"]["key"], tables["count"]["value"], strict=True))
    for k, rows in day.groupby("k"):
        counts[k] = counts.get(k, 0) + len(rows)
    out["count"] = {k: int(v) for k, v in counts.items()}
    out["seen"] = dict(zip(live["seen"]["key"], live["seen"]["value"], strict=True))
    out["tags"] = {(k, u): int(v) for k, u, v in
                   zip(live["tags"]["key"], live["tags"]["user_key"], live["tags"]["value"],
                       strict=True)}
    out["events"] = {k: [int(v) for v in rows["value"]]
                     for k, rows in live["events"].groupby("key", sort=False)}
    out["total"] = dict(zip(live["total"]["key"], live["total"]["value"], strict=True))
    out["avg"] = dict(zip(tables["avg"]["key"], tables["avg"]["value"], strict=True))
    timers = tables["_timers"]
    due = ((timers["domain"] == "processing") & (timers["time"] <= T)) | \
        ((timers["domain"] == "event") & (timers["time"] <= watermark))
    out["_timers"] = {(k, d): (int(t), tag) for k, t, d, tag in
                      timers[~due][["key", "time", "domain", "tag"]].itertuples(index=False)}
    fired = sorted(timers[due][["key", "time", "tag", "domain"]].itertuples(index=False,
                                                                           name=None))
    return out, fired


def kinds_dump(rows) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        if r["state"] == "_ttl":
            continue
        if r["state"] == "_timers":
            out.setdefault("_timers", {})[(r["key"], r["value"]["kind"])] = (
                r["value"]["time"], r["user_key"] or "")
            continue
        key = (r["key"], r["user_key"]) if r["user_key"] is not None else r["key"]
        out.setdefault(r["state"], {})[key] = r["value"]
    return out
