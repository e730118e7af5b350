"""Inputs and pandas references for the run-protocol tests (example job, keyed aggregation)."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd

from demo.sample_data import expected_totals, generate_events
from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.store import CheckpointStore
from statebackend.storage import open_storage

CATEGORIES = ["Books", "books", "Games", "music", "MUSIC", "food"]
BAD_LINES = ['{"user": "", "ts": 5, "category": "x"}',   # empty_user
             '{"ts": 6, "category": "x"}',               # missing_user
             '{"user": "u1", "ts": "soon", "category": "x"}',  # invalid_ts
             'not json at all']                          # malformed


def activity_events(folder: str, *, rows: int, users: int, seed: int, day: int,
                    fmt: str = "parquet", bad: bool = False) -> pd.DataFrame:
    """Write one day of (user, ts, category) events; return the accepted rows.

    Every ts is unique (a permutation), so "the latest event of a user" never
    depends on the order rows of one key reach the logic.
    """
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({
        "user": [f"user{i}" for i in rng.integers(0, users, rows)],
        "ts": (day * 10_000_000 + rng.permutation(rows) * 7).astype("int64"),
        "category": [CATEGORIES[i] for i in rng.integers(0, len(CATEGORIES), rows)],
    })
    os.makedirs(folder, exist_ok=True)
    if fmt == "parquet":
        df.to_parquet(os.path.join(folder, "part-00000.parquet"), index=False)
    else:
        df.to_json(os.path.join(folder, "part-00000.jsonl"), orient="records", lines=True)
    if bad:
        with open(os.path.join(folder, "bad.jsonl"), "w") as fh:
            fh.write("\n".join(BAD_LINES) + "\n")
    return df


def activity_reference(days: list[pd.DataFrame], normalize: bool = True
                       ) -> tuple[list[pd.DataFrame], dict]:
    """Expected ``activity`` output per run (index user) and the final state."""
    seen = pd.DataFrame(columns=["user", "ts", "category"])
    outputs = []
    for day in days:
        day = day.copy()
        if normalize:
            day["category"] = day["category"].str.lower()
        seen = pd.concat([seen, day], ignore_index=True)
        latest = seen.sort_values("ts").groupby("user").tail(1).set_index("user")
        counts = seen.groupby(["user", "category"]).size()
        users = sorted(day["user"].unique())
        outputs.append(pd.DataFrame({
            "last_ts": latest.loc[users, "ts"].astype("int64").to_numpy(),
            "last_category": latest.loc[users, "category"].to_numpy(),
            "category_events": [int(counts[(u, latest.loc[u, "category"])]) for u in users],
            "categories": seen.groupby("user")["category"].nunique().loc[users].to_numpy(),
        }, index=pd.Index(users, name="user")))
    state = {
        "last_seen": {(u, None): {"ts": int(r["ts"]), "category": r["category"]}
                      for u, r in latest.iterrows()},
        "counts": {(u, c): int(n) for (u, c), n in counts.items()},
    }
    return outputs, state


def backend_settings(request, backend: str | None, table: str) -> tuple[dict, object]:
    """``RunConfig`` options of ``backend`` and the database `final_state` reads: the
    external backend's in table ``table`` on the session's PostgreSQL server."""
    if backend != "external":
        return {"backend": backend}, None
    from statebackend.state.external_store import ExternalStore

    db = ExternalStore(request.getfixturevalue("postgres_server").url, table)
    return {"backend": backend, "state_db": db.url, "state_table": db.table}, db


def final_state(storage_url: str, job: str, state_db=None) -> dict:
    """{state: {(key, user_key): value}} of the latest checkpoint (the dump path;
    ``state_db``: the external backend's database)."""
    store = CheckpointStore(open_storage(storage_url), job)
    out: dict[str, dict] = {}
    for row in checkpoint_rows(store, store.resolve("latest"), state_db):
        out.setdefault(row["state"], {})[(row["key"], row["user_key"])] = row["value"]
    return out


def read_output(url: str, run_dir: str) -> pd.DataFrame:
    """A run folder's parts (only once its _SUCCESS exists), as one DataFrame."""
    import pyarrow.parquet as pq

    storage = open_storage(url)
    assert storage.exists(f"{run_dir}/_SUCCESS"), f"{url}/{run_dir} is not published"
    parts = sorted(n for n in storage.list_dir(run_dir) if n.endswith(".parquet"))
    frames = []
    for name in parts:
        with storage.fs.open(storage.abspath(f"{run_dir}/{name}"), "rb") as fh:
            frames.append(pq.read_table(fh).to_pandas())
    return pd.concat(frames, ignore_index=True)


def totals_days(root: str, days: int, seed: int) -> list[pd.DataFrame]:
    return [generate_events(os.path.join(root, f"in{d}"), n_events=2500, n_keys=600,
                            seed=seed + d, start_ts_ms=1_800_000_000_000 + d * 86_400_000,
                            fmt="json" if d == 1 else "parquet",
                            bad_fraction=0.002 if d == 0 else 0.0)
            for d in range(days)]


def totals_reference(days: list[pd.DataFrame]) -> tuple[list[pd.DataFrame], dict]:
    outputs = []
    for i, day in enumerate(days):
        ref = expected_totals(days[: i + 1])
        outputs.append(ref.loc[sorted(day["key"].unique())])
    final = expected_totals(days)
    state = {"totals": {(k, None): {"count": int(r["count"]), "sum": float(r["sum"]),
                                    "min_ts": int(r["min_ts"]), "max_ts": int(r["max_ts"])}
                        for k, r in final.iterrows()}}
    return outputs, state


def assert_totals_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), "keys differ"
    for k, w in want.items():
        g = got[k]
        assert (g["count"], g["min_ts"], g["max_ts"]) == (w["count"], w["min_ts"], w["max_ts"]), k
        assert abs(g["sum"] - w["sum"]) <= 1e-9 * max(1.0, abs(w["sum"])), k


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def check_totals_output(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert list(got.columns) == ["key", "count", "sum", "min_ts", "max_ts", "run_id",
                                 "checkpoint_id"]
    got = got.set_index("key").sort_index()
    assert got.index.is_unique and got["run_id"].nunique() == 1
    pd.testing.assert_frame_equal(got[["count", "min_ts", "max_ts"]],
                                  want[["count", "min_ts", "max_ts"]], check_dtype=False,
                                  check_names=False)
    assert ((got["sum"] - want["sum"]).abs() <= 1e-9 * want["sum"].abs().clip(lower=1)).all()
