"""Deterministic sample events for the keyed aggregation job (tests, demo, bench).

One call writes one input folder::

    out_dir/
      part-00000.parquet ...   accepted events: key (string), ts (int64 ms), value (double)
      bad-00000.jsonl          optional bad rows (JSON lines, because a non-numeric
                               value cannot live in a Parquet double column)

With ``fmt="json"`` the accepted events are JSON lines too. The same seed always
gives the same files, so a test can regenerate the expected result with pandas.
Bad rows cycle through the reject reasons the job knows: missing key, empty key,
non-numeric value, missing ts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

DAY_MS = 86_400_000
DEFAULT_START_TS_MS = 1_798_761_600_000  # 2027-01-01T00:00:00Z
ROWS_PER_FILE = 200_000
FORMATS = ("parquet", "json")


def generate_events(out_dir: str, *, n_events: int, n_keys: int, seed: int,
                    start_ts_ms: int = DEFAULT_START_TS_MS, bad_fraction: float = 0.0,
                    fmt: str = "parquet", key_prefix: str = "k",
                    key_offset: int = 0) -> pd.DataFrame:
    """Write ``n_events`` accepted events (plus bad rows) to ``out_dir``; return the accepted.

    Keys are ``f"{key_prefix}{i}"`` for i drawn uniformly from
    ``[key_offset, key_offset + n_keys)``; ts lies within one day after ``start_ts_ms``.
    ``bad_fraction`` adds ``round(n_events * bad_fraction)`` bad rows on top.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is unknown; use one of {FORMATS}")
    if n_keys < 1 and n_events:
        raise ValueError(f"n_keys must be at least 1, got {n_keys}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(key_offset, key_offset + max(n_keys, 1), size=n_events)
    keys = np.char.add(key_prefix, ids.astype(str)).astype(object) if n_events else \
        np.array([], dtype=object)
    ts = start_ts_ms + rng.integers(0, DAY_MS, size=n_events, dtype=np.int64)
    values = np.round(rng.normal(50.0, 20.0, size=n_events), 3)
    events = pd.DataFrame({"key": pd.array(keys, dtype=object), "ts": ts.astype(np.int64),
                           "value": values.astype(np.float64)})
    os.makedirs(out_dir, exist_ok=True)
    table = pa.Table.from_pandas(events, preserve_index=False, schema=pa.schema(
        [("key", pa.string()), ("ts", pa.int64()), ("value", pa.float64())]))
    for part, start in enumerate(range(0, max(n_events, 1), ROWS_PER_FILE)):
        if not n_events:
            break
        chunk = table.slice(start, ROWS_PER_FILE)
        if fmt == "parquet":
            pq.write_table(chunk, os.path.join(out_dir, f"part-{part:05d}.parquet"))
        else:
            _write_jsonl(os.path.join(out_dir, f"part-{part:05d}.jsonl"), chunk.to_pylist())
    n_bad = int(round(n_events * bad_fraction))
    if n_bad:
        _write_jsonl(os.path.join(out_dir, "bad-00000.jsonl"),
                     bad_rows(n_bad, rng, start_ts_ms, key_prefix))
    return events


def bad_rows(n: int, rng: np.random.Generator, start_ts_ms: int, key_prefix: str) -> list[dict]:
    """``n`` rows that the job must reject, one reason after the other."""
    rows = []
    for i in range(n):
        ts = int(start_ts_ms + rng.integers(0, DAY_MS))
        kind = i % 4
        if kind == 0:
            rows.append({"ts": ts, "value": 1.0})  # missing key
        elif kind == 1:
            rows.append({"key": "", "ts": ts, "value": 1.0})  # empty key
        elif kind == 2:
            rows.append({"key": f"{key_prefix}bad{i}", "ts": ts, "value": "not-a-number"})
        else:
            rows.append({"key": f"{key_prefix}bad{i}", "value": 2.0})  # missing ts
    return rows


def generate_days(root: str, days: int, *, events_per_day: int, n_keys: int, seed: int = 7,
                  start_ts_ms: int = DEFAULT_START_TS_MS, bad_fraction: float = 0.0,
                  fmt: str = "parquet", key_prefix: str = "k") -> list[tuple[str, pd.DataFrame]]:
    """One folder per day under ``root`` (``day=YYYY-MM-DD``); returns (folder, accepted)."""
    out = []
    for d in range(days):
        day_ts = start_ts_ms + d * DAY_MS
        label = pd.Timestamp(day_ts, unit="ms", tz="UTC").strftime("%Y-%m-%d")
        folder = os.path.join(root, f"day={label}")
        events = generate_events(folder, n_events=events_per_day, n_keys=n_keys,
                                 seed=seed * 1000 + d, start_ts_ms=day_ts,
                                 bad_fraction=bad_fraction, fmt=fmt, key_prefix=key_prefix)
        out.append((folder, events))
    return out


def expected_totals(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The job's final state computed with pandas: key -> count, sum, min_ts, max_ts."""
    if not frames:
        return pd.DataFrame(columns=["count", "sum", "min_ts", "max_ts"])
    allev = pd.concat(frames, ignore_index=True)
    g = allev.groupby("key").agg(count=("ts", "size"), sum=("value", "sum"),
                                 min_ts=("ts", "min"), max_ts=("ts", "max"))
    g.index = g.index.astype(str)
    return g.sort_index()


def _write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row))
            fh.write("\n")
