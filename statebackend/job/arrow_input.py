"""The executor-side input reader: pyarrow over fsspec, no Hadoop connector needed.

The driver makes one row per input file (`files_frame`); Spark spreads the rows over
its tasks and each task reads its files with pyarrow through fsspec (`read_files`),
opened with the run's storage options (s3 credentials travel as options, never as
environment variables). The rows come out in `statebackend.job.input.read_ddl`'s
columns, the same ones Spark's own reader gives, so routing, validation and the
quarantine do not know which reader ran:

- Parquet: the job's columns of each row group, typed like Spark's reader does (a
  value that does not convert is null, its text kept in ``_text_<column>``).
- JSON lines (gzip by extension): blank lines give no row; each row keeps its line.
  A file whose lines are all one clean JSON object of the expected types is parsed
  by Arrow's JSON reader in one call; any other file is parsed line by line
  (``json.loads``), where a line that is not exactly one JSON object is
  ``malformed`` and a value is kept as text, as Spark's all-string parse does.

A file that cannot be read fails its task with one line naming it (`InputError`).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import InputError
from statebackend.job.api import Input
from statebackend.job.core import as_text, try_cast  # the validator's, shared
from statebackend.job.input import (
    JSON_EXT,
    LINE,
    MALFORMED,
    REASON,
    TEXT,
    open_input,
    spark_type,
)

FILE_COLUMN = "file"
BATCH_ROWS = 100_000  # rows per Arrow batch a task hands on
_ARROW_TYPES = {
    "string": pa.string(), "boolean": pa.bool_(), "tinyint": pa.int8(),
    "smallint": pa.int16(), "int": pa.int32(), "bigint": pa.int64(), "float": pa.float32(),
    "double": pa.float64(), "date": pa.date32(), "timestamp": pa.timestamp("us", "UTC"),
}


def files_frame(spark, paths: tuple[str, ...], tasks: int):
    """One row per file, the files dealt round robin to ``min(tasks, files)`` partitions
    (each slot value lands in its own partition: `dispatch.partition_values`)."""
    from statebackend.spark.dispatch import partition_values

    n = max(1, min(tasks, len(paths)))
    slots = partition_values(n)
    rows = [(slots[i % n], p) for i, p in enumerate(paths)]
    df = spark.createDataFrame(rows, f"_slot int, {FILE_COLUMN} string")
    return df.repartition(n, "_slot").select(FILE_COLUMN)


def output_schema(inp: Input) -> pa.Schema:
    """Arrow schema of `read_ddl`'s columns (what Spark expects back from a task)."""
    typed = [(n, _ARROW_TYPES[spark_type(inp, n)]) for n in inp.schema.names]
    texts = [(TEXT + n, pa.string()) for n in inp.schema.names]
    return pa.schema([*typed, *texts, (REASON, pa.string()), (LINE, pa.string())])


def read_files(inp: Input, options: Mapping[str, Any], batches: Iterator[pa.RecordBatch]
               ) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: read every file named in ``batches``; yield `output_schema` rows."""
    schema = output_schema(inp)
    for batch in batches:
        for path in batch.column(FILE_COLUMN).to_pylist():
            yield from read_file(inp, options, path, schema)


def read_file(inp: Input, options: Mapping[str, Any], path: str,
              schema: pa.Schema | None = None) -> Iterator[pa.RecordBatch]:
    """One file's rows as `output_schema` batches; InputError naming the file if unreadable."""
    schema = schema or output_schema(inp)
    try:
        if path.lower().endswith(JSON_EXT):
            tables = [_json_table(inp, _read_bytes(path, options), schema)]
        else:
            tables = _parquet_tables(inp, path, options, schema)
        for table in tables:
            yield from table.to_batches(max_chunksize=BATCH_ROWS)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure is this file's, reported in one line
        cause = " ".join(str(exc).split())[:300] or type(exc).__name__
        url = path if "://" in path else f"file://{path}"
        raise InputError(f"cannot read input file {url}: {type(exc).__name__}: {cause}; "
                         "replace or remove that file and re-run") from None


def _read_bytes(path: str, options: Mapping[str, Any]) -> bytes:
    fs, fs_path = open_input(path, options)
    with fs.open(fs_path, "rb") as fh:
        data = fh.read()
    if path.lower().endswith(".gz"):
        import gzip

        data = gzip.decompress(data)
    return data


# -- Parquet ---------------------------------------------------------------------------
def _parquet_tables(inp: Input, path: str, options: Mapping[str, Any],
                    schema: pa.Schema) -> Iterator[pa.Table]:
    import pyarrow.parquet as pq

    fs, fs_path = open_input(path, options)
    with fs.open(fs_path, "rb") as fh:
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        if inp.key not in names:
            raise InputError(f"input file {path} has no {inp.key!r} column (columns: "
                             f"{names}); fix the file or the job's input schema")
        wanted = [n for n in inp.schema.names if n in names]
        for i in range(pf.num_row_groups):
            yield _typed(inp, pf.read_row_group(i, columns=wanted), schema, None, None)


# -- JSON lines ------------------------------------------------------------------------
def _json_table(inp: Input, data: bytes, schema: pa.Schema) -> pa.Table:
    text = data.decode("utf-8", errors="replace")
    lines = [ln.rstrip("\r") for ln in text.split("\n")]
    lines = [ln for ln in lines if ln.strip()]  # blank lines give no row
    if not lines:
        return schema.empty_table()
    fast = _json_fast(inp, lines)
    if fast is not None:
        return _typed(inp, fast, schema, None, pa.array(lines, pa.string()))
    return _json_line_by_line(inp, lines, schema)


def _json_fast(inp: Input, lines: list[str]) -> pa.Table | None:
    """Arrow's JSON reader on clean files; None when any line needs the careful path."""
    import pyarrow.json as pj

    explicit = pa.schema([(n, _ARROW_TYPES[spark_type(inp, n)]) for n in inp.schema.names])
    if any(pa.types.is_timestamp(t) or pa.types.is_date(t) for t in explicit.types):
        return None  # Arrow's JSON text rules for these differ from Spark's
    try:
        table = pj.read_json(io.BytesIO("\n".join(lines).encode("utf-8")),
                             parse_options=pj.ParseOptions(
                                 explicit_schema=explicit, unexpected_field_behavior="ignore"),
                             read_options=pj.ReadOptions(block_size=1 << 26))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None
    # Two objects on one line parse as two rows: only one row per line is clean.
    return table if table.num_rows == len(lines) else None


def _json_line_by_line(inp: Input, lines: list[str], schema: pa.Schema) -> pa.Table:
    names = inp.schema.names
    columns: dict[str, list] = {n: [] for n in names}
    reasons: list[str | None] = []
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        ok = isinstance(obj, dict)
        reasons.append(None if ok else MALFORMED)
        for n in names:
            columns[n].append(_as_json_text(obj.get(n)) if ok else None)
    raw = pa.table({n: pa.array(columns[n], pa.string()) for n in names})
    return _typed(inp, raw, schema, pa.array(reasons, pa.string()), pa.array(lines, pa.string()))


def _as_json_text(value: Any) -> str | None:
    """A JSON value as Spark's all-string parse gives it: strings as is, others as JSON."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# -- typing (Spark's `_typed`, in Arrow) -----------------------------------------------
def _typed(inp: Input, table: pa.Table, schema: pa.Schema, reasons: pa.Array | None,
           lines: pa.Array | None) -> pa.Table:
    """`output_schema` columns: typed values, the text of values that did not convert."""
    n = table.num_rows
    cols: dict[str, pa.Array] = {}
    texts: dict[str, pa.Array] = {}
    for name in inp.schema.names:
        target = schema.field(name).type
        if name not in table.column_names:
            cols[name] = pa.nulls(n, target)
            texts[TEXT + name] = pa.nulls(n, pa.string())
            continue
        col = table[name].combine_chunks()
        value = _exact(col, target)
        if value is None:
            source = col if pa.types.is_string(col.type) else as_text(col)
            value = try_cast(source, target)
            lost = pc.and_(pc.is_valid(col), pc.is_null(value))
            texts[TEXT + name] = pc.if_else(lost, as_text(col), pa.scalar(None, pa.string()))
        else:
            texts[TEXT + name] = pa.nulls(n, pa.string())
        cols[name] = value
    out = {**cols, **texts,
           REASON: reasons if reasons is not None else pa.nulls(n, pa.string()),
           LINE: lines if lines is not None else pa.nulls(n, pa.string())}
    return pa.table(out, schema=schema)


def _exact(col: pa.Array, target: pa.DataType) -> pa.Array | None:
    """``col`` as ``target`` when every value converts as Spark's cast does, else None."""
    t = col.type
    if t == target:
        return col
    same_kind = ((pa.types.is_integer(t) and pa.types.is_integer(target))
                 or (pa.types.is_floating(target) and (pa.types.is_integer(t)
                                                       or pa.types.is_floating(t)))
                 or (pa.types.is_string(target) and not pa.types.is_binary(t))
                 or (pa.types.is_timestamp(t) and pa.types.is_timestamp(target))
                 or (pa.types.is_large_string(t) and pa.types.is_string(target)))
    if not same_kind:
        return None
    try:
        return pc.cast(col, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None  # e.g. an int64 beyond int32: the careful path keeps its text
