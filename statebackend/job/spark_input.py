"""A job's input rows, read by Spark: one DataFrame of the readers' columns.

`read_input` gives one DataFrame over every input file in the columns every reader
gives (`statebackend.job.arrow_input.read_schema`; Spark DDL `read_ddl`), read per
format by the reader `statebackend.job.input.choose_readers` picks:

- ``spark``: Spark's own file sources. Parquet is typed like the Arrow reader does
  (`_typed`); JSON lines are read as text and parsed with an all-string schema, so a
  non-numeric value is a rejected row, not a failed read (`_json_lines`: the
  reasons and how Spark's parser is held to one object per line).
- ``arrow``: one row per file (`files_frame`), spread over Spark's tasks, each
  reading its files with `statebackend.job.arrow_input.read_files` (s3:// without a
  Hadoop connector).

Classic sessions and Spark Connect alike: no SparkContext or RDD call on this path.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from statebackend.errors import UsageError
from statebackend.job.api import Input
from statebackend.job.arrow_input import (
    FILE_COLUMN,
    INVALID_UTF8,
    JSON_BLANK,
    LINE,
    MALFORMED,
    READ_TYPES,
    REASON,
    TEXT,
    check_key_columns,
    invalid_key_reason,
    read_files,
    read_schema,
    read_type,
)
from statebackend.job.input import InputFiles, ParquetFooter, choose_readers, open_input_file
from statebackend.spark.dispatch import partition_values
from statebackend.spark.session import default_parallelism

# Arrow type of a read column (or a task's result row) -> Spark SQL type.
SPARK_TYPES = {
    pa.string(): "string", pa.bool_(): "boolean", pa.int8(): "tinyint",
    pa.int16(): "smallint", pa.int32(): "int", pa.int64(): "bigint", pa.float32(): "float",
    pa.float64(): "double", pa.date32(): "date", pa.timestamp("us", "UTC"): "timestamp",
}


def spark_type(inp: Input, name: str) -> str:
    """The Spark SQL type of column ``name`` as the tasks receive it."""
    return SPARK_TYPES[read_type(inp, name)]


def spark_ddl(schema: pa.Schema) -> str:
    """The Spark DDL of an Arrow schema of plain column types (e.g. a task's result row)."""
    return ", ".join(f"`{f.name}` {SPARK_TYPES[f.type]}" for f in schema)


def read_ddl(inp: Input) -> str:
    """Columns of `read_input`'s DataFrame, in order."""
    return spark_ddl(read_schema(inp))


def marker_row(inp: Input, reason: str) -> tuple:
    """A row of `read_ddl` with only ``_reason`` set (the dispatch marker)."""
    n = len(inp.schema.names)
    return (*([None] * (2 * n)), reason, None)


def read_input(spark, files: InputFiles, inp: Input, reader: str = "auto"):
    """One DataFrame (`read_ddl`) over every input file, read by ``reader`` (`choose_reader`)."""
    from pyspark.sql import functions as F

    if not files.count:
        return spark.createDataFrame([], read_ddl(inp))
    check_key_columns(files, inp)  # on the driver, from the kept footers
    readers = choose_readers(files, reader)
    frames = []
    arrow_paths = tuple(p for fmt, paths in (("parquet", files.parquet), ("json", files.json))
                        if readers.get(fmt) == "arrow" for p in paths)
    if arrow_paths:
        frames.append(_arrow_frame(spark, arrow_paths, files, inp))
    if files.parquet and readers["parquet"] == "spark":
        parquet_reader = spark.read
        known = parquet_read_schema(inp, files.parquet[0], files.options, files.footers)
        if known is not None:  # no schema-inference job (one Spark stage less per run)
            parquet_reader = parquet_reader.schema(known)
        frames.append(_typed(parquet_reader.parquet(*files.parquet), inp, files.url)
                      .withColumn(REASON, F.lit(None).cast("string"))
                      .withColumn(LINE, F.lit(None).cast("string")))
    if files.json and readers["json"] == "spark":
        frames.append(_json_lines(spark, files.json, inp, files.url))
    if not frames:
        return spark.createDataFrame([], read_ddl(inp))
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df


def _arrow_frame(spark, paths: tuple[str, ...], files: InputFiles, inp: Input):
    """Executors read ``paths`` with pyarrow over fsspec (`statebackend.job.arrow_input`)."""
    return files_frame(spark, paths, default_parallelism(spark)).mapInArrow(
        functools.partial(read_files, inp, files.options), read_ddl(inp))


def files_frame(spark, paths: tuple[str, ...], tasks: int):
    """One row per file, the files dealt round robin to ``min(tasks, files)`` partitions
    (each slot value lands in its own partition: `dispatch.partition_values`)."""
    n = max(1, min(tasks, len(paths)))
    slots = partition_values(n)
    rows = [(slots[i % n], p) for i, p in enumerate(paths)]
    df = spark.createDataFrame(rows, f"_slot int, {FILE_COLUMN} string")
    return df.repartition(n, "_slot").select(FILE_COLUMN)


def parquet_read_schema(inp: Input, path: str, options: Mapping[str, Any] | None = None,
                        footers: Mapping[str, ParquetFooter] | None = None) -> str | None:
    """The Spark schema of the job's columns in Parquet file ``path``, from its footer
    (``footers``' if kept there, else read now).

    Spark would infer the same from one file's footer, but with a job of its own;
    reading just the job's columns is also what `_typed` keeps. None (Spark infers)
    when a column's type has no plain Spark name here (timestamps, decimals ...).
    """
    import pyarrow.parquet as pq

    if footers and path in footers:
        arrow = footers[path].schema
    else:
        with open_input_file(path, options) as fh:
            arrow = pq.read_schema(fh)
    if inp.key not in arrow.names:
        return None  # Spark's schema then names the file's columns in the error
    columns = []
    for name in inp.schema.names:
        if name not in arrow.names:
            continue  # absent: `_typed` fills nulls, as with an inferred schema
        spark_name = SPARK_TYPES.get(READ_TYPES.get(arrow.field(name).type))
        if spark_name is None:
            return None
        columns.append(f"`{name}` {spark_name}")
    return ", ".join(columns) if columns else None


def _json_lines(spark, paths: tuple[str, ...], inp: Input, url: str):
    """JSON lines read as text (gzip by extension) and parsed; each row keeps its line.

    Reasons, first match wins, each with every parsed column null except as said:

    - ``invalid_utf8``: the line's bytes are not UTF-8. Spark's text source keeps the
      raw bytes (``is_valid_utf8`` tells); `raw_table` escapes them on the executor.
    - ``malformed``: the line is not exactly one JSON object. Spark's parser stops
      after the first value, so ``{...} xyz`` would pass; wrapping the line in ``[...]``
      and asking for an array of length 1 rejects trailing text and a second object
      alike (``{...}{...}``, ``{...},{...}``).
    - ``invalid_<key>`` (the key null, the other columns kept): the key is a JSON value
      other than a string, an integer or a boolean (module doc). The all-string parse
      gives a number's or an object's text, not its JSON type; for the rare key whose
      text could come from one (a digit, ``-``, ``{``, ``[`` or ``"`` first, not only
      digits), the key is parsed again as a variant to learn its type.
    """
    from pyspark.sql import functions as F

    line, key = F.col("value"), inp.key
    lines = spark.read.text(list(paths)).where(  # blank lines: no row
        F.trim(line, F.lit(JSON_BLANK)) != "")
    ddl = ", ".join([f"`{n}` string" for n in inp.schema.names] + ["_corrupt string"])
    parsed = F.from_json(line, ddl, {"mode": "PERMISSIVE",
                                     "columnNameOfCorruptRecord": "_corrupt"})
    single = F.json_array_length(F.concat(F.lit("["), line, F.lit("]"))) == 1
    utf8 = F.is_valid_utf8(line)
    bad = ~utf8 | parsed["_corrupt"].isNotNull() | ~F.coalesce(single, F.lit(False))
    text = parsed.getField(key)
    maybe_typed = text.rlike(r'^(-?[0-9]|[{\["])') & ~text.rlike(r"^-?[0-9]+$")
    json_type = F.schema_of_variant(F.from_json(line, f"`{key}` variant").getField(key))
    bad_key = F.coalesce(maybe_typed & (json_type != "STRING"), F.lit(False))
    df = lines.select(line.alias(LINE), utf8.alias("_utf8"), bad.alias("_malformed"),
                      parsed.alias("_j"), bad_key.alias("_bad_key"))
    kept = df.select(*[F.when(~F.col("_malformed") & ~F.col("_bad_key") if n == key
                              else ~F.col("_malformed"), F.col("_j").getField(n)).alias(n)
                       for n in inp.schema.names],
                     F.when(~F.col("_utf8"), F.lit(INVALID_UTF8))
                     .when(F.col("_malformed"), F.lit(MALFORMED))
                     .when(F.col("_bad_key"), F.lit(invalid_key_reason(inp))).alias(REASON),
                     LINE)
    return _typed(kept, inp, url, keep=(REASON, LINE))


def _typed(df, inp: Input, url: str, keep: tuple[str, ...] = ()):
    """Typed schema columns plus the text of values that did not convert."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegralType, NumericType, StringType

    if inp.key not in df.columns:
        raise UsageError(f"input {url} has no {inp.key!r} column (columns: {df.columns})")
    types = {f.name: f.dataType for f in df.schema.fields}
    typed, texts = [], []
    for name in inp.schema.names:
        target = spark_type(inp, name)
        if name not in types:
            typed.append(F.lit(None).cast(target).alias(name))
            texts.append(F.lit(None).cast("string").alias(TEXT + name))
            continue
        col, source = F.col(f"`{name}`"), types[name]
        exact = (target == "string"
                 or (target in ("tinyint", "smallint", "int", "bigint")
                     and isinstance(source, IntegralType))
                 or (target in ("float", "double") and isinstance(source, NumericType))
                 or source.simpleString() == target)
        value = col.cast(target) if exact else \
            (col if isinstance(source, StringType) else col.cast("string")).try_cast(target)
        typed.append(value.alias(name))
        # The text only where a value arrived but did not convert (rare): cheap to shuffle.
        texts.append(F.when(col.isNotNull() & value.isNull(), col.cast("string"))
                     .alias(TEXT + name))
    return df.select(*typed, *texts, *keep)
