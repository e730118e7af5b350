"""Keyed aggregation: per-key running totals in incremental RocksDB state, one run per batch.

The job is `JOB`, a `statebackend.job.Job`: input ``key`` (string), ``ts`` (int64
epoch ms), ``value`` (double); per key the value state ``totals`` keeps ``count``,
``sum``, ``min_ts`` and ``max_ts`` (a fixed-width record, ZSTD-compressed); each
run outputs the keys it touched with their new totals plus ``run_id`` and
``checkpoint_id``. The run protocol (idempotency by run id, writer lease, restore,
snapshot, commit or discard, quarantine, ``_SUCCESS``) is the library's:
`statebackend.job.run.run_job`.

Run it as ``python -m jobs.keyed_aggregation ARGS`` or ``spark-submit
jobs/keyed_aggregation.py ARGS`` (the same as ``ckpt run jobs.keyed_aggregation:JOB``
with ``--job`` required); `JobConfig` and `run` are the Python entry points.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields

if __package__ in (None, ""):  # spark-submit jobs/keyed_aggregation.py: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from statebackend.job import (  # noqa: E402
    BatchContext,
    Input,
    Job,
    JobRunError,
    Output,
    RecordCodec,
    RejectThresholdError,
    RunConfig,
    StateDescriptor,
    Vectorized,
    entry_point,
    finite,
    format_summary,
    not_empty,
    not_null,
    parses,
    record,
    run_dir_name,
    run_job,
    value_state,
)

JOB_KIND = "keyed_aggregation"
TOTALS_FIELDS = (("count", "int64"), ("sum", "float64"), ("min_ts", "int64"),
                 ("max_ts", "int64"))
TOTALS = value_state("totals", record(**dict(TOTALS_FIELDS)))
DESCRIPTORS = [TOTALS]
OUTPUT_SCHEMA = pa.schema([("key", pa.string()), ("count", pa.int64()), ("sum", pa.float64()),
                           ("min_ts", pa.int64()), ("max_ts", pa.int64()),
                           ("run_id", pa.string()), ("checkpoint_id", pa.int64())])
INPUT = Input(
    schema=pa.schema([("key", pa.string()), ("ts", pa.int64()), ("value", pa.float64())]),
    key="key",
    rules=(not_null("key"), not_empty("key"), not_null("ts"), parses("ts"),
           not_null("value"), finite("value", "non_numeric_value")),
)
REJECT_REASONS = ("malformed", "missing_key", "empty_key", "missing_ts", "invalid_ts",
                  "missing_value", "non_numeric_value", "invalid_key", "invalid_utf8")


def fold(batch: pa.Table, ctx: BatchContext) -> None:
    """Pre-aggregate one batch per key, then one multi-get and one write batch."""
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
    n = len(keys)
    ctx.emit("totals", {"key": keys, **{k: pa.array(v) for k, v in new.items()},
                        "run_id": pa.array([ctx.run_id] * n, pa.string()),
                        "checkpoint_id": pa.array(np.full(n, ctx.checkpoint_id, np.int64))})


def totals_checks(descriptor: StateDescriptor) -> list | None:
    """Expectations over the decoded ``totals`` entries, or None for another shape.

    Every stored key has ``count >= 1`` (a key is only stored once seen) and
    ``min_ts <= max_ts``.
    """
    codec = descriptor.codec
    if descriptor.kind != "value" or not isinstance(codec, RecordCodec) \
            or set(codec.fields) != set(TOTALS_FIELDS):
        return None
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnValuesToBeBetween(
            column="count", min_value=1, description="every stored key has count >= 1",
            meta={"check": "totals_count_at_least_1", "critical": True}),
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="max_ts", column_B="min_ts", or_equal=True,
            description="every stored key has min_ts <= max_ts",
            meta={"check": "totals_min_ts_le_max_ts", "critical": True}),
    ]


JOB = Job(name=JOB_KIND, input=INPUT, states=(TOTALS,),
          outputs=(Output("totals", OUTPUT_SCHEMA, last_per="key"),), logic=Vectorized(fold),
          expectations={"totals": totals_checks},
          # Totals are small fixed-width records: ZSTD makes new SSTs (the bytes every
          # checkpoint uploads) about 20% smaller than the default Snappy.
          compression="zstd")


_RUN_DEFAULTS = {f.name: f.default for f in fields(RunConfig)}  # declared once, there


@dataclass(frozen=True)
class JobConfig:
    """One run (the pre-port name, kept for callers). See `statebackend.job.RunConfig`."""

    input: str
    storage: str
    job: str
    run_id: str
    output: str
    parallelism: int | None = None
    max_parallelism: int = _RUN_DEFAULTS["max_parallelism"]
    master: str = "local[*]"
    max_reject_fraction: float = _RUN_DEFAULTS["max_reject_fraction"]
    quarantine: str | None = None  # default: <output>/_quarantine
    start_from: str | None = None
    local_dir: str | None = None
    fail_subtask: int | None = None  # test hook: this subtask raises after its upload
    engine: str | None = None  # spark | local | auto (statebackend.job.engine)

    @property
    def quarantine_url(self) -> str:
        return self.quarantine or f"{self.output.rstrip('/')}/_quarantine"

    def run_config(self) -> RunConfig:
        return RunConfig(
            input=self.input, storage=self.storage, job=self.job, run_id=self.run_id,
            output=self.output, parallelism=self.parallelism,
            max_parallelism=self.max_parallelism, master=self.master,
            max_reject_fraction=self.max_reject_fraction, quarantine=self.quarantine,
            start_from=self.start_from, local_dir=self.local_dir,
            fail_subtask=self.fail_subtask, engine=self.engine)


def run(config: JobConfig | RunConfig, spark=None) -> dict:
    """Run the job once; return the summary (`statebackend.job.run_job`)."""
    if isinstance(config, JobConfig):
        config = config.run_config()
    return run_job(JOB, config, spark)


# The release-1 CLI: `ckpt run`'s arguments (a superset of its flags) with --job required,
# errors prefixed "keyed_aggregation:" and the --json summary on one line.
main = entry_point("jobs.keyed_aggregation:JOB", prog=JOB_KIND, require_job=True, json_line=True)


__all__ = ["DESCRIPTORS", "JOB", "TOTALS", "JobConfig", "JobRunError", "RejectThresholdError",
           "format_summary", "main", "run", "run_dir_name"]

if __name__ == "__main__":
    sys.exit(main())
