"""Data of the transform tests (tests/jobs/test_transform.py): the card-spend job's state
moved into a job that keeps ``n`` and ``spend`` as value states of their own (a split of
the record ``totals``, ``big`` dropped), and the transforms, per batch (with a change of
the card ids: every state re-keyed) and per key; a module of its own so Spark tasks
import it."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

from statebackend.job import (
    Input,
    Job,
    StateTransform,
    Vectorized,
    list_state,
    map_state,
    not_null,
    reducing_state,
    value_state,
)


def new_id(card: str) -> str:
    """The new card ids: ``c007`` -> ``card-007``."""
    return "card-" + card[1:]


def split_job(key: str) -> Job:
    """The card-spend job with ``totals`` split, keyed by column ``key``."""
    schema = pa.schema([(key, pa.string()), ("ts", pa.int64()), ("amount", pa.float64()),
                        ("merchant", pa.string())])

    def fold(batch: pa.Table, ctx) -> None:
        df = batch.to_pandas().sort_values([key, "ts"], kind="stable")
        g = df.groupby(key)
        cards = sorted(df[key].unique())
        for name, add in (("n", g.size()), ("spend", g["amount"].sum())):
            state = ctx.state(name)
            old = state.value(cards)
            state.update(cards, [(o or 0) + a.item() for o, a in
                                 zip(old, add.reindex(cards).to_numpy(), strict=True)])
        pairs = df.groupby([key, "merchant"]).size()
        keys, users = [c for c, _ in pairs.index], [m for _, m in pairs.index]
        merchants = ctx.state("per_merchant")
        merchants.put(keys, users, [(o or 0) + int(k) for o, k in
                                    zip(merchants.get(keys, users), pairs.to_numpy(),
                                        strict=True)])
        ctx.state("recent").add(list(df[key]), [float(a) for a in df["amount"]])
        ctx.state("max_amount").add(list(df[key]), [float(a) for a in df["amount"]])

    return Job(name="card_split", input=Input(schema=schema, key=key, rules=tuple(
        not_null(c) for c in schema.names)),
        states=(value_state("n"), value_state("spend"), map_state("per_merchant"),
                list_state("recent"), reducing_state("max_amount", max)),
        logic=Vectorized(fold))


SPLIT_BY_ID = split_job("card_id")  # the new ids, in a column of that name
SPLIT = split_job("card")  # the same keys


def _rekeyed(table: pa.Table) -> pa.Table:
    ids = pa.array([new_id(c) for c in table.column("key").to_pylist()], pa.string())
    return table.set_column(table.schema.get_field_index("key"), "key", ids)


def split_and_rekey(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """Per batch: ``totals`` into ``n`` and ``spend`` (``big`` dropped), every key renamed."""
    totals = _rekeyed(tables["totals"])
    return {
        "n": pa.table({"key": totals["key"], "value": totals["n"]}),
        "spend": pa.table({"key": totals["key"], "value": totals["spend"]}),
        "per_merchant": _rekeyed(tables["per_merchant"]),
        "recent": _rekeyed(tables["recent"]),
        "max_amount": _rekeyed(tables["max_amount"]),
    }


SPLIT_AND_REKEY = StateTransform(split_and_rekey, per="batch")


MIN_SEEN = 16  # about half the cards of two days are seen fewer times


def split_per_key(key: str, states: dict) -> dict | None:
    """Per key: ``totals`` split; cards seen fewer than `MIN_SEEN` times are dropped."""
    totals = states["totals"]
    if totals["n"] < MIN_SEEN:
        return None
    return {"n": totals["n"], "spend": totals["spend"], "per_merchant": states["per_merchant"],
            "recent": states["recent"], "max_amount": states["max_amount"]}


def split_reference(days: pd.DataFrame, key: str = "card_id", dropped: frozenset = frozenset()
                    ) -> dict[str, dict]:
    """What the split job's latest checkpoint holds after ``days`` (events keyed by
    ``key``), by pandas; ``dropped`` keys lost their state before the last day."""
    out: dict[str, dict] = {}
    for k, rows in days.groupby(key):
        kept = rows if k not in dropped else rows[rows["_last"]]
        out.setdefault("n", {})[k] = len(kept)
        out.setdefault("spend", {})[k] = float(kept["amount"].sum())
        out.setdefault("recent", {})[k] = [float(a) for a in
                                           kept.sort_values("ts", kind="stable")["amount"]]
        out.setdefault("max_amount", {})[k] = float(kept["amount"].max())
        for m, n in kept.groupby("merchant").size().items():
            out.setdefault("per_merchant", {})[(k, m)] = int(n)
    return out


def with_new_ids(events: pd.DataFrame) -> pd.DataFrame:
    return events.assign(card=[new_id(c) for c in events["card"]]).rename(
        columns={"card": "card_id"})
