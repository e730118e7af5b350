"""The card-spend job of issue 21, in six versions, and its pandas reference.

Input rows ``(card, ts, amount, merchant)``. Version by version (each continues the
lineage of the one before, docs/evolve-a-job.md):

1. ``totals`` record (n int32, spend float64, big int64: amounts >= 100), ``per_merchant``
   map (events per merchant), ``recent`` list (every amount, in event order),
   ``max_amount`` reducing (max amount);
2. adds ``first_seen`` (value: the first event time seen since this version);
3. ``totals`` gains ``refunds`` (int64, default 0: negative amounts from now on) and ``n``
   widens to int64;
4. ``per_merchant`` is renamed ``merchants``;
5. ``recent`` is dropped;
6. ``first_seen`` values are upgraded from an int to ``{"ts": t, "day": t // DAY}``.

`reference(days)` computes what the latest checkpoint holds after the given runs, each
day a ``(events, version)`` pair, with pandas alone.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from statebackend.job import (
    Input,
    Job,
    Upgrade,
    Vectorized,
    list_state,
    map_state,
    not_null,
    record,
    reducing_state,
    value_state,
)

DAY = 86_400_000
INPUT = Input(schema=pa.schema([("card", pa.string()), ("ts", pa.int64()),
                                ("amount", pa.float64()), ("merchant", pa.string())]),
              key="card", rules=(not_null("card"), not_null("ts"), not_null("amount"),
                                 not_null("merchant")))


def _day_of(t):
    return {"ts": t, "day": t // DAY}


def logic(version: int):
    def fold(batch: pa.Table, ctx) -> None:
        df = batch.to_pandas().sort_values(["card", "ts"], kind="stable")
        cards = sorted(df["card"].unique())
        totals = ctx.state("totals")
        found, old = totals.value_columns(pa.array(cards, pa.string()))
        g = df.groupby("card")
        n = g.size().reindex(cards).to_numpy()
        spend = g["amount"].sum().reindex(cards).to_numpy()
        big = g["amount"].apply(lambda a: int((a >= 100).sum())).reindex(cards).to_numpy()
        new = {"n": old["n"] + n, "spend": old["spend"] + spend, "big": old["big"] + big}
        if version >= 3:
            refunds = g["amount"].apply(lambda a: int((a < 0).sum())).reindex(cards).to_numpy()
            new["refunds"] = old["refunds"] + refunds
        totals.update_columns(pa.array(cards, pa.string()), new)
        merchants = ctx.state("merchants" if version >= 4 else "per_merchant")
        pairs = df.groupby(["card", "merchant"]).size()
        keys = [c for c, _ in pairs.index]
        users = [m for _, m in pairs.index]
        old_counts = merchants.get(keys, users)
        merchants.put(keys, users, [(o or 0) + int(k) for o, k in
                                    zip(old_counts, pairs.to_numpy(), strict=True)])
        if version < 5:
            ctx.state("recent").add(list(df["card"]), [float(a) for a in df["amount"]])
        ctx.state("max_amount").add(list(df["card"]), [float(a) for a in df["amount"]])
        if version >= 2:
            first = ctx.state("first_seen")
            firsts = g["ts"].min().reindex(cards)
            new = [(c, int(firsts[c])) for c, have in zip(cards, first.value(cards), strict=True)
                   if have is None]
            if new:
                first.update([c for c, _ in new],
                          [_day_of(t) if version >= 6 else t for _, t in new])
    return Vectorized(fold)


def states(version: int) -> tuple:
    totals = record(n="int32", spend="float64", big="int64") if version < 3 else \
        record(n="int64", spend="float64", big="int64", refunds=("int64", 0))
    out = [value_state("totals", totals),
           map_state("merchants" if version >= 4 else "per_merchant")]
    if version < 5:
        out.append(list_state("recent"))
    out.append(reducing_state("max_amount", max))
    if version >= 2:
        out.append(value_state("first_seen", upgrades=(Upgrade(1, _day_of),)
                               if version >= 6 else ()))
    return tuple(out)


def job(version: int, name: str = "card_spend") -> Job:
    return Job(name=name, input=INPUT, states=states(version), logic=logic(version),
               renamed_states={"merchants": "per_merchant"} if version >= 4 else {},
               dropped_states=("recent",) if version >= 5 else ())


VERSIONS = {v: job(v) for v in range(1, 7)}


def events(n: int, cards: int, seed: int, day: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "card": [f"c{i:03d}" for i in rng.integers(0, cards, n)],
        "ts": day * DAY + rng.integers(0, DAY, n),
        "amount": np.round(rng.normal(40, 60, n), 2),
        "merchant": [f"m{i}" for i in rng.integers(0, 6, n)]})


def reference(days: list[tuple[pd.DataFrame, int]]) -> dict[str, dict]:
    """state -> key (or (key, user_key)) -> value, as `ckpt dump` rows give them."""
    version = days[-1][1]
    all_rows = pd.concat([d.assign(_v=v) for d, v in days], ignore_index=True)
    out: dict[str, dict] = {}
    g = all_rows.groupby("card")
    totals = {}
    for card, rows in g:
        t = {"n": len(rows), "spend": float(rows["amount"].sum()),
             "big": int((rows["amount"] >= 100).sum())}
        if version >= 3:
            t["refunds"] = int(((rows["amount"] < 0) & (rows["_v"] >= 3)).sum())
        totals[card] = t
    out["totals"] = totals
    out["merchants" if version >= 4 else "per_merchant"] = {
        (c, m): int(k) for (c, m), k in all_rows.groupby(["card", "merchant"]).size().items()}
    if version < 5:
        out["recent"] = {card: [float(a) for a in rows.sort_values("ts", kind="stable")[
            "amount"]] for card, rows in all_rows.groupby("card")}
    out["max_amount"] = {card: float(rows["amount"].max()) for card, rows in g}
    if version >= 2:
        since = all_rows[all_rows["_v"] >= 2]
        out["first_seen"] = {card: (_day_of(int(t)) if version >= 6 else int(t))
                             for card, t in since.groupby("card")["ts"].min().items()}
    return out


def dumped(rows) -> dict[str, dict]:
    """`checkpoint_rows` output in the shape of `reference`."""
    out: dict[str, dict] = {}
    for r in rows:
        key = (r["key"], r["user_key"]) if r.get("user_key") is not None else r["key"]
        out.setdefault(r["state"], {})[key] = r["value"]
    return out


# module attributes a deployment's ckpt_jobs can name ("tests.evolution.card_spend:V3")
V1, V2, V3, V4, V5, V6 = (VERSIONS[v] for v in range(1, 7))
TOTALS_AS_MAP = Job(name="card_spend", input=INPUT,
                    states=(map_state("totals"), *states(2)[1:]), logic=logic(2))
