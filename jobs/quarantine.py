"""Input of the keyed aggregation job: find the files, read them, tag bad rows.

An input folder holds Parquet files (``*.parquet``) and/or JSON-lines files
(``*.json``, ``*.jsonl``, ``*.ndjson``); names starting with ``_`` or ``.`` are
ignored (``_SUCCESS``, ``.crc``). An empty folder is a valid, empty input.

Every row gets a ``reason``: null for an accepted row, else one of
`REJECT_REASONS`. Rejected rows keep their raw ``ts``/``value`` text so the
quarantine output shows what arrived. JSON is read with an all-string schema so
that a non-numeric value is a rejected row, not a failed read.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

from statebackend.errors import UsageError

REJECT_REASONS = ("missing_key", "empty_key", "missing_ts", "invalid_ts", "missing_value",
                  "non_numeric_value")
MARKER = "__subtask_marker__"  # reason of the one synthetic row each subtask receives
PARQUET_EXT = (".parquet",)
JSON_EXT = (".json", ".jsonl", ".ndjson")

# Columns after validation; ts_raw/value_raw are only kept on rejected rows.
VALIDATED_DDL = ("key string, ts bigint, value double, reason string, ts_raw string, "
                 "value_raw string")
QUARANTINE_COLUMNS = ("key", "ts", "value", "reason", "run_id")


@dataclass(frozen=True)
class InputFiles:
    """The files of one input folder, split by format."""

    url: str
    parquet: tuple[str, ...]
    json: tuple[str, ...]
    total_bytes: int

    @property
    def count(self) -> int:
        return len(self.parquet) + len(self.json)


def list_input(url: str) -> InputFiles:
    """List an input folder (local path, file:// or any fsspec URL Spark can also read)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(root):
        raise UsageError(f"input folder {url} does not exist")
    if not fs.isdir(root):
        raise UsageError(f"input {url} is not a folder of Parquet or JSON-lines files")
    parquet, json_files, total = [], [], 0
    for path, info in sorted(fs.find(root, detail=True).items()):
        rel = posixpath.relpath(path, root.rstrip("/")) if root else path
        if any(part.startswith(("_", ".")) for part in rel.split("/")):
            continue
        name = rel.lower()
        full = _spark_path(url, fs, path)
        if name.endswith(PARQUET_EXT):
            parquet.append(full)
        elif name.endswith(JSON_EXT):
            json_files.append(full)
        else:
            continue
        total += int(info.get("size") or 0)
    return InputFiles(url, tuple(parquet), tuple(json_files), total)


def _spark_path(url: str, fs, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return os.path.abspath(path)
    scheme = url.split("://", 1)[0]
    return f"{scheme}://{path}"


def read_validated(spark, files: InputFiles):
    """One DataFrame (VALIDATED_DDL) over every input file, with a reject reason per row."""
    from pyspark.sql import functions as F

    frames = []
    if files.parquet:
        frames.append(_typed(spark.read.parquet(*files.parquet), files.url))
    if files.json:
        frames.append(_typed(spark.read.schema("key string, ts string, value string")
                             .json(list(files.json)), files.url))
    if not frames:
        return spark.createDataFrame([], VALIDATED_DDL)
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    key, ts, value = F.col("key"), F.col("ts"), F.col("value")
    ts_raw, value_raw = F.col("ts_raw"), F.col("value_raw")
    reason = (F.when(key.isNull(), "missing_key")
              .when(key == "", "empty_key")
              .when(ts_raw.isNull(), "missing_ts")
              .when(ts.isNull(), "invalid_ts")
              .when(value_raw.isNull(), "missing_value")
              .when(value.isNull() | F.isnan(value)
                    | (F.abs(value) == float("inf")), "non_numeric_value"))
    df = df.withColumn("reason", reason)
    rejected = F.col("reason").isNotNull()
    # Raw text only for rejected rows: accepted rows cross the shuffle without it.
    return df.select("key", "ts", "value", "reason",
                     F.when(rejected, ts_raw).alias("ts_raw"),
                     F.when(rejected, value_raw).alias("value_raw"))


def _typed(df, url: str):
    """key string, ts bigint, value double (null when unparsable) plus their raw text."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegralType, NumericType, StringType

    if "key" not in df.columns:
        raise UsageError(f"input {url} has no 'key' column (columns: {df.columns})")
    types = {f.name: f.dataType for f in df.schema.fields}
    cols = [F.col("key").cast("string").alias("key")]
    for name, target, exact in (("ts", "bigint", IntegralType), ("value", "double", NumericType)):
        if name not in types:
            cols += [F.lit(None).cast(target).alias(name),
                     F.lit(None).cast("string").alias(f"{name}_raw")]
            continue
        col = F.col(name)
        typed = col.cast(target) if isinstance(types[name], exact) else \
            (col if isinstance(types[name], StringType) else col.cast("string")).try_cast(target)
        cols += [typed.alias(name), col.cast("string").alias(f"{name}_raw")]
    return df.select(*cols)
