"""Seeded event-time input for the sessionization and dedup benches (one batch per day).

Each day's batch is a DataFrame ``event_id`` (int64), ``user`` (str), ``ts`` (event
time, epoch ms, int64), ``value`` (float64, whole numbers so sums are exact in any
order). Made of:

- sessions: a user, a start inside the day, a geometric number of events with
  exponential inter-arrival times (mean ``gap/4``: mostly inside the gap, sometimes
  past it, so sessions split; a user's sessions may overlap and merge);
- late deliveries: a fraction of the events of the day's last ``late_window_ms``
  move to the next day's batch with their event time (some within the allowed
  lateness, some beyond, depending on the job's lateness);
- repeats (same ``event_id``): exact copies in the same batch (at-least-once
  redelivery), and re-sends in a later batch (1 or 2 days later) with a later event
  time. Repeats are drawn from events that were not moved, so inside one batch all
  rows of an id are identical: Spark's arrival-order "first" and our smallest-ts
  "first" then agree (see tests/reference/dedup.py).

Deterministic for a given spec (numpy PCG64 seeded by ``seed``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

DAY_MS = 24 * 60 * 60 * 1000
START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
COLUMNS = ["event_id", "user", "ts", "value"]


@dataclass(frozen=True)
class EventsSpec:
    days: int = 3
    events_per_day: int = 100_000
    users: int = 10_000
    seed: int = 0
    gap_ms: int = 30 * 60 * 1000
    events_per_session: float = 5.0
    late_fraction: float = 0.3           # of the events in the day's last late_window_ms
    late_window_ms: int = 2 * 60 * 60 * 1000
    copy_fraction: float = 0.02          # exact copies in the same batch
    resend_fraction: float = 0.02        # re-sent 1-2 days later with a later ts
    start_ms: int = START_MS


def _day_events(rng: np.random.Generator, spec: EventsSpec, day: int) -> pd.DataFrame:
    n_sessions = max(1, int(spec.events_per_day / spec.events_per_session))
    sizes = rng.geometric(1.0 / spec.events_per_session, n_sessions)
    sizes = np.minimum(sizes, 50)
    day_start = spec.start_ms + day * DAY_MS
    starts = day_start + rng.integers(0, DAY_MS, n_sessions)
    session_of = np.repeat(np.arange(n_sessions), sizes)
    steps = rng.exponential(spec.gap_ms / 4, len(session_of)).astype("int64")
    first = np.r_[0, np.cumsum(sizes)[:-1]]
    steps[first] = 0  # the first event of a session is at its start
    offsets = np.cumsum(steps) - np.repeat(np.cumsum(steps)[first], sizes)
    ts = starts[session_of] + offsets
    users = rng.integers(0, spec.users, n_sessions)[session_of]
    keep = ts < day_start + DAY_MS  # the day's batch holds the day's events only
    n = int(keep.sum())
    return pd.DataFrame({
        "event_id": day * 1_000_000_000 + np.arange(n, dtype="int64"),
        "user": pd.Series([f"u{u:07d}" for u in users[keep]], dtype=object),
        "ts": ts[keep].astype("int64"),
        "value": rng.integers(1, 100, n).astype("float64"),
    })


def generate_days(spec: EventsSpec) -> list[pd.DataFrame]:
    """The batches, one DataFrame per day, with late deliveries and repeats."""
    rng = np.random.default_rng(spec.seed)
    base = [_day_events(rng, spec, d) for d in range(spec.days)]
    extra: list[list[pd.DataFrame]] = [[] for _ in range(spec.days)]
    for d, df in enumerate(base):
        day_end = spec.start_ms + (d + 1) * DAY_MS
        tail = df["ts"].to_numpy() >= day_end - spec.late_window_ms
        late = tail & (rng.random(len(df)) < spec.late_fraction) & (d + 1 < spec.days)
        stay = df[~late]
        if d + 1 < spec.days:
            extra[d + 1].append(df[late])
        pick = rng.random(len(stay))
        extra[d].append(stay[pick < spec.copy_fraction])
        resend = stay[(pick >= spec.copy_fraction)
                      & (pick < spec.copy_fraction + spec.resend_fraction)]
        later = rng.integers(1, 3, len(resend))
        resend = resend.assign(ts=resend["ts"].to_numpy() + later * DAY_MS)
        for k in (1, 2):
            if d + k < spec.days:
                extra[d + k].append(resend[later == k])
        base[d] = stay
    days = []
    for d in range(spec.days):
        df = pd.concat([base[d], *extra[d]], ignore_index=True)
        order = rng.permutation(len(df))  # delivery order is not event-time order
        days.append(df.iloc[order].reset_index(drop=True)[COLUMNS])
    return days


def write_days(days: list[pd.DataFrame], root: str, files_per_day: int = 2) -> list[str]:
    """Write each day as Parquet files under ``root/day=NNN/``; returns the day folders."""
    dirs = []
    for d, df in enumerate(days):
        folder = os.path.join(root, f"day={d:03d}")
        os.makedirs(folder, exist_ok=True)
        for i, part in enumerate(np.array_split(np.arange(len(df)), files_per_day)):
            df.iloc[part].to_parquet(os.path.join(folder, f"part-{i:03d}.parquet"), index=False)
        dirs.append(folder)
    return dirs


def read_day(folder: str) -> pd.DataFrame:
    """One day's batch back from its folder (for references and checks)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".parquet"))
    return pd.concat([pd.read_parquet(os.path.join(folder, f)) for f in files],
                     ignore_index=True)[COLUMNS]
