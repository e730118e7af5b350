"""A keyed count whose output names the process that ran each subtask's batch: the
Spark Connect tests see which Python workers a run used (test_connect.py)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from jobs.keyed_aggregation import INPUT  # (its input and validation rules)
from statebackend.job import BatchContext, Job, Output, Vectorized, value_state

OUTPUT = pa.schema([("key", pa.string()), ("count", pa.int64()), ("pid", pa.int64())])


def count(batch: pa.Table, ctx: BatchContext) -> None:
    g = batch.group_by("key", use_threads=False).aggregate([("ts", "count")])
    counts = ctx.state("counts")
    old = np.array([c or 0 for c in counts.value(g["key"])], np.int64)
    new = old + g["ts_count"].to_numpy()
    counts.update(g["key"], new.tolist())
    ctx.emit("pids", {"key": g["key"], "count": pa.array(new),
                      "pid": pa.array(np.full(len(new), os.getpid(), np.int64))})


JOB = Job(name="worker_pids", input=INPUT, states=(value_state("counts"),),
          outputs=(Output("pids", OUTPUT),), logic=Vectorized(count))
