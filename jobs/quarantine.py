"""Input of the keyed aggregation job: find the files, read them, tag bad rows.

An input folder holds Parquet files (``*.parquet``) and/or JSON-lines files
(``*.json``, ``*.jsonl``, ``*.ndjson``, each also gzip-compressed as ``*.gz``);
names starting with ``_`` or ``.`` are ignored (``_SUCCESS``, ``.crc``). Any other
file (``*.csv`` ...) is *skipped* and reported in the run summary, never silently:
a folder holding only such files is refused (`InputError`), while an empty folder
is a valid, empty input.

Every row gets a ``reason``: null for an accepted row, else one of
`REJECT_REASONS`. Rejected rows keep their raw ``ts``/``value`` text so the
quarantine output shows what arrived, and rejected JSON lines keep the whole
line in ``raw``. JSON lines are read as text and parsed with an all-string
schema, so a non-numeric value is a rejected row, not a failed read; a line that
is not exactly one JSON object (unparsable, or followed by trailing garbage) is
rejected as ``malformed`` (Spark's JSON reader silently drops trailing text).

Parquet footers are read on the driver before any Spark work (`check_parquet`):
a truncated or non-Parquet file is refused in one line that names it, instead of
a failed Spark task.
"""

from __future__ import annotations

import os
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from statebackend.errors import InputError, UsageError

REJECT_REASONS = ("malformed", "missing_key", "empty_key", "missing_ts", "invalid_ts",
                  "missing_value", "non_numeric_value")
MARKER = "__subtask_marker__"  # reason of the one synthetic row each subtask receives
PARQUET_EXT = (".parquet",)
JSON_EXT = (".json", ".jsonl", ".ndjson", ".json.gz", ".jsonl.gz", ".ndjson.gz")
JSON_DDL = "key string, ts string, value string, _corrupt string"
SKIPPED_NAMES_SHOWN = 10  # the summary lists this many skipped files, then counts
FOOTER_CHECK_THREADS = 16

# Columns after validation; ts_raw/value_raw/raw are only kept on rejected rows.
VALIDATED_DDL = ("key string, ts bigint, value double, reason string, ts_raw string, "
                 "value_raw string, raw string")
QUARANTINE_COLUMNS = ("key", "ts", "value", "reason", "run_id", "raw")


@dataclass(frozen=True)
class InputFiles:
    """The files of one input folder, split by format."""

    url: str
    parquet: tuple[str, ...]
    json: tuple[str, ...]
    total_bytes: int
    skipped: tuple[str, ...] = ()  # unsupported files, relative to the folder

    @property
    def count(self) -> int:
        return len(self.parquet) + len(self.json)

    def skipped_report(self) -> dict:
        """Summary fields: how many files were skipped and (capped) which."""
        return {"input_files_skipped": len(self.skipped),
                "input_files_skipped_names": list(self.skipped[:SKIPPED_NAMES_SHOWN])}


def list_input(url: str) -> InputFiles:
    """List an input folder (local path, file:// or any fsspec URL Spark can also read)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    if not fs.exists(root):
        raise UsageError(f"input folder {url} does not exist")
    if not fs.isdir(root):
        raise UsageError(f"input {url} is not a folder of Parquet or JSON-lines files")
    parquet, json_files, skipped, total = [], [], [], 0
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
            skipped.append(rel)
            continue
        total += int(info.get("size") or 0)
    if skipped and not parquet and not json_files:
        shown = ", ".join(skipped[:SKIPPED_NAMES_SHOWN])
        more = f" and {len(skipped) - SKIPPED_NAMES_SHOWN} more" \
            if len(skipped) > SKIPPED_NAMES_SHOWN else ""
        raise InputError(f"input folder {url} holds no supported file, only {len(skipped)} "
                         f"unsupported ({shown}{more}); the job reads *.parquet and JSON lines "
                         f"({', '.join('*' + e for e in JSON_EXT)}): convert them or point "
                         "--input elsewhere")
    return InputFiles(url, tuple(parquet), tuple(json_files), total, tuple(skipped))


def check_parquet(files: InputFiles) -> None:
    """Read every Parquet footer (in parallel, footer bytes only) before Spark starts.

    A truncated or foreign file would otherwise fail a Spark task with a long JVM
    trace; here it is refused in one line naming the file.
    """
    if not files.parquet:
        return
    with ThreadPoolExecutor(min(FOOTER_CHECK_THREADS, len(files.parquet))) as pool:
        problems = [p for p in pool.map(_footer_problem, files.parquet) if p]
    if problems:
        path, cause = problems[0]
        more = f" (and {len(problems) - 1} more bad Parquet files)" if len(problems) > 1 else ""
        raise InputError(f"input file {path} is not a readable Parquet file: {cause}{more}; "
                         "replace or remove it and re-run")


def _footer_problem(path: str) -> tuple[str, str] | None:
    import fsspec
    import pyarrow.parquet as pq

    try:
        fs, fs_path = fsspec.core.url_to_fs(path)
        with fs.open(fs_path, "rb") as fh:
            pq.read_metadata(fh)
    except Exception as exc:  # noqa: BLE001 - any failure is this file's problem, reported
        cause = " ".join(str(exc).split()) or type(exc).__name__
        return path, f"{type(exc).__name__}: {cause}"[:300]
    return None


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
        frames.append(_typed(spark.read.parquet(*files.parquet), files.url)
                      .withColumn("line", F.lit(None).cast("string"))
                      .withColumn("malformed", F.lit(False)))
    if files.json:
        frames.append(_json_lines(spark, files.json, files.url))
    if not frames:
        return spark.createDataFrame([], VALIDATED_DDL)
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    key, ts, value = F.col("key"), F.col("ts"), F.col("value")
    ts_raw, value_raw = F.col("ts_raw"), F.col("value_raw")
    reason = (F.when(F.col("malformed"), "malformed")
              .when(key.isNull(), "missing_key")
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
                     F.when(rejected, value_raw).alias("value_raw"),
                     F.when(rejected, F.col("line")).alias("raw"))


def _json_lines(spark, paths: tuple[str, ...], url: str):
    """JSON lines read as text (gzip by extension) and parsed; each row keeps its ``line``.

    ``malformed``: the line is not exactly one JSON object. Spark's parser stops after
    the first value, so ``{...} xyz`` would pass; wrapping the line in ``[...]`` and
    asking for an array of length 1 rejects trailing text and a second object alike
    (``{...}{...}``, ``{...},{...}``). A malformed line keeps no parsed column.
    """
    from pyspark.sql import functions as F

    line = F.col("value")
    lines = spark.read.text(list(paths)).where(F.trim(line) != "")  # blank lines: no row
    parsed = F.from_json(line, JSON_DDL, {"mode": "PERMISSIVE",
                                          "columnNameOfCorruptRecord": "_corrupt"})
    single = F.json_array_length(F.concat(F.lit("["), line, F.lit("]"))) == 1
    bad = parsed["_corrupt"].isNotNull() | ~F.coalesce(single, F.lit(False))
    df = lines.select(line.alias("line"), bad.alias("malformed"), parsed.alias("j"))
    kept = df.select(*[F.when(~F.col("malformed"), F.col(f"j.{c}")).alias(c)
                       for c in ("key", "ts", "value")], "line", "malformed")
    return _typed(kept, url, keep=("line", "malformed"))


def _typed(df, url: str, keep: tuple[str, ...] = ()):
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
    return df.select(*cols, *keep)
