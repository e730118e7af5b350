"""The executor-side input reader: pyarrow over fsspec, no Hadoop connector needed.

The driver makes one row per input file (`files_frame`); Spark spreads the rows over
its tasks and each task reads its files with pyarrow through fsspec (`read_files`),
opened with the run's storage options (s3 credentials travel as options, never as
environment variables); local files are opened without following a symlink and only
if they are regular files (`statebackend.job.input.open_input_file`). The rows come
out in `statebackend.job.input.read_ddl`'s columns, the same ones Spark's own reader
gives, so routing, validation and the quarantine do not know which reader ran:

- Parquet: the job's columns, ``BATCH_ROWS`` rows at a time, typed like Spark's reader
  does (a value that does not convert is null, its text kept in ``_text_<column>``).
  A key column of a type keys cannot have is refused in one line
  (`statebackend.job.input.key_type_error`; the driver checks the footers first).
- JSON lines (gzip by extension) are read as a stream (`json_chunks`): about
  `CHUNK_BYTES` of decompressed whole lines at a time, each chunk parsed and handed
  on before the next is read, so a task's memory follows the chunk, not the file (a
  single line longer than `MAX_LINE_BYTES` fails the file in one line). A line of
  only JSON whitespace gives no row; each row keeps its line. A chunk that is valid
  UTF-8 and whose lines are all one clean JSON object of the expected types (string
  keys) is parsed by Arrow's JSON reader in one call; any other chunk line by line
  (``json.loads``, `BATCH_ROWS` lines at a time), where a line whose bytes are not
  UTF-8 is ``invalid_utf8`` (its text escaped, ``\\xff``), a line that is not exactly
  one JSON object is ``malformed``, a key that is not a JSON string, integer or
  boolean is ``invalid_<key>``, and a value is kept as text, as Spark's all-string
  parse does (`statebackend.job.input`, module doc).

`read_file` takes an optional `ByteBudget`, the local engine's bound on the input a
run holds: every block of decompressed JSON bytes and every decoded Parquet batch is
charged before it is parsed or handed on, and the read stops with `BudgetExceeded`
as soon as the total passes the limit. Spark tasks stream and pass no budget.

A file that cannot be read fails its task with one line naming it (`InputError`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import InputError
from statebackend.job.api import Input
from statebackend.job.core import as_text, try_cast  # the validator's, shared
from statebackend.job.input import (
    INVALID_UTF8,
    JSON_BLANK,
    JSON_EXT,
    LINE,
    MALFORMED,
    REASON,
    TEXT,
    accepted_key_type,
    escape_invalid_utf8,
    invalid_key_reason,
    key_type_error,
    open_input_file,
    spark_type,
)

FILE_COLUMN = "file"
BATCH_ROWS = 100_000  # rows per Arrow batch a task hands on
CHUNK_BYTES = 32 * 2**20  # decompressed JSON-lines bytes parsed at a time
READ_BYTES = 4 * 2**20  # bytes read (and charged) at a time
MAX_LINE_BYTES = 256 * 2**20  # a longer line fails its file: not JSON lines
_ARROW_TYPES = {
    "string": pa.string(), "boolean": pa.bool_(), "tinyint": pa.int8(),
    "smallint": pa.int16(), "int": pa.int32(), "bigint": pa.int64(), "float": pa.float32(),
    "double": pa.float64(), "date": pa.date32(), "timestamp": pa.timestamp("us", "UTC"),
}


class BudgetExceeded(InputError):
    """The input read so far passed a `ByteBudget`'s limit (the reader stopped)."""

    def __init__(self, path: str, limit: int, total: int) -> None:
        super().__init__(f"input file {path}: the input read passed {limit} bytes "
                         f"({total} read so far)")
        self.path, self.limit, self.total = path, limit, total


class ByteBudget:
    """Decompressed input bytes readers may hold together (thread-safe): `charge` adds
    bytes about to be kept and raises `BudgetExceeded` once the total passes ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._lock = threading.Lock()

    def charge(self, n: int, path: str) -> None:
        with self._lock:
            self.total += n
            total = self.total
        if total > self.limit:
            raise BudgetExceeded(path, self.limit, total)


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
              schema: pa.Schema | None = None, budget: ByteBudget | None = None
              ) -> Iterator[pa.RecordBatch]:
    """One file's rows as `output_schema` batches, streamed; InputError naming the file
    if unreadable, `BudgetExceeded` once ``budget`` is spent (module doc)."""
    schema = schema or output_schema(inp)
    try:
        if path.lower().endswith(JSON_EXT):
            tables = _json_tables(inp, options, path, schema, budget)
        else:
            tables = _parquet_tables(inp, path, options, schema, budget)
        for table in tables:
            yield from table.to_batches(max_chunksize=BATCH_ROWS)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure is this file's, reported in one line
        cause = " ".join(str(exc).split())[:300] or type(exc).__name__
        url = path if "://" in path else f"file://{path}"
        raise InputError(f"cannot read input file {url}: {type(exc).__name__}: {cause}; "
                         "replace or remove that file and re-run") from None


# -- Parquet ---------------------------------------------------------------------------
def _parquet_tables(inp: Input, path: str, options: Mapping[str, Any], schema: pa.Schema,
                    budget: ByteBudget | None) -> Iterator[pa.Table]:
    import pyarrow.parquet as pq

    with open_input_file(path, options) as fh:
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        if inp.key not in names:
            raise InputError(f"input file {path} has no {inp.key!r} column (columns: "
                             f"{names}); fix the file or the job's input schema")
        key_type = pf.schema_arrow.field(inp.key).type
        if not accepted_key_type(key_type):
            raise key_type_error(path, inp.key, key_type)
        wanted = [n for n in inp.schema.names if n in names]
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=wanted):
            if budget is not None:
                budget.charge(batch.nbytes, path)
            yield _typed(inp, pa.Table.from_batches([batch]), schema, None, None)


# -- JSON lines ------------------------------------------------------------------------
def _json_tables(inp: Input, options: Mapping[str, Any], path: str, schema: pa.Schema,
                 budget: ByteBudget | None) -> Iterator[pa.Table]:
    import gzip

    with open_input_file(path, options) as raw:
        stream: BinaryIO = gzip.GzipFile(fileobj=raw) if path.lower().endswith(".gz") \
            else raw  # gzip: decompressed as read (also files of several gzip members)
        with stream:
            for chunk in json_chunks(stream, path, budget):
                yield from _json_chunk(inp, chunk, schema)


def json_chunks(fh: BinaryIO, path: str, budget: ByteBudget | None = None) -> Iterator[bytes]:
    """Whole lines of ``fh``, at least `CHUNK_BYTES` at a time (the last chunk: the
    rest). Each `READ_BYTES` block is charged to ``budget`` as it is read, so reading
    stops within a block of the limit; a line longer than `MAX_LINE_BYTES` is refused."""
    chunk_bytes, read_bytes = CHUNK_BYTES, READ_BYTES  # read at call time (tests shrink them)
    parts: list[bytes] = []
    held, last = 0, -1  # last: index of the last part holding a newline
    while True:
        block = fh.read(read_bytes)
        if not block:
            if parts:
                yield b"".join(parts)
            return
        if budget is not None:
            budget.charge(len(block), path)
        parts.append(block)
        held += len(block)
        if b"\n" in block:
            last = len(parts) - 1
        if held < chunk_bytes:
            continue
        if last < 0:
            if held > MAX_LINE_BYTES:
                raise InputError(f"input file {path}: a line is longer than "
                                 f"{MAX_LINE_BYTES // 2**20} MiB; JSON lines hold one "
                                 "object per line: fix or remove that file and re-run")
            continue
        cut = parts[last].rfind(b"\n") + 1
        head = b"".join([*parts[:last], parts[last][:cut]])
        parts = [p for p in (parts[last][cut:], *parts[last + 1:]) if p]
        held, last = sum(len(p) for p in parts), -1
        yield head


def _json_chunk(inp: Input, chunk: bytes, schema: pa.Schema) -> Iterator[pa.Table]:
    """The rows of one chunk of whole lines (module doc)."""
    whole = pa.Array.from_buffers(pa.binary(), 1, [  # the chunk itself, not a copy
        None, pa.py_buffer(np.array([0, len(chunk)], np.int32)), pa.py_buffer(chunk)])
    split = pc.list_flatten(pc.split_pattern(whole, pattern=b"\n"))
    try:
        text = split.cast(pa.string())  # validates UTF-8
    except pa.ArrowInvalid:
        yield from _json_line_by_line(inp, _decoded_lines(split.to_pylist()), schema)
        return
    if b"\r" in chunk:
        text = pc.utf8_rtrim(text, "\r")
    blank = pc.match_substring_regex(text, f"^[{JSON_BLANK}]*$")
    lines = text.filter(pc.invert(blank)) if pc.any(blank).as_py() else text
    if not len(lines):
        return
    fast = _json_fast(inp, chunk, len(lines))
    if fast is not None:
        yield _typed(inp, fast, schema, None, lines)
        return
    yield from _json_line_by_line(inp, [(ln, None) for ln in lines.to_pylist()], schema)


def _decoded_lines(raw: list[bytes]) -> list[tuple[str, str | None]]:
    """(text, reason) of each non-blank line of a chunk that is not all valid UTF-8."""
    out: list[tuple[str, str | None]] = []
    for data in raw:
        data = data.rstrip(b"\r")
        if not data.strip(JSON_BLANK.encode()):
            continue
        try:
            out.append((data.decode("utf-8"), None))
        except UnicodeDecodeError:
            out.append((escape_invalid_utf8(data), INVALID_UTF8))
    return out


def _json_fast(inp: Input, data: bytes, lines: int) -> pa.Table | None:
    """Arrow's JSON reader on a clean chunk; None when any line needs the careful path."""
    import pyarrow.json as pj

    explicit = pa.schema([(n, _ARROW_TYPES[spark_type(inp, n)]) for n in inp.schema.names])
    if any(pa.types.is_timestamp(t) or pa.types.is_date(t) for t in explicit.types):
        return None  # Arrow's JSON text rules for these differ from Spark's
    try:
        # A key that is not a JSON string fails the explicit string type: careful path.
        table = pj.read_json(pa.BufferReader(data),
                             parse_options=pj.ParseOptions(
                                 explicit_schema=explicit, unexpected_field_behavior="ignore"),
                             read_options=pj.ReadOptions(block_size=len(data) + 1))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None
    # Two objects on one line parse as two rows: only one row per line is clean.
    return table if table.num_rows == lines else None


def _json_line_by_line(inp: Input, lines: list[tuple[str, str | None]],
                       schema: pa.Schema) -> Iterator[pa.Table]:
    """Tables of `BATCH_ROWS` lines each: (text, a reason already decided or None)."""
    names, key = inp.schema.names, inp.key
    bad_key = invalid_key_reason(inp)
    for start in range(0, len(lines), BATCH_ROWS):
        group = lines[start:start + BATCH_ROWS]
        columns: dict[str, list] = {n: [] for n in names}
        reasons: list[str | None] = []
        for line, reason in group:
            obj = None
            if reason is None:
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError):
                    obj = None
                if not isinstance(obj, dict):
                    reason = MALFORMED
                elif not _key_value_ok(obj.get(key)):
                    reason = bad_key
            reasons.append(reason)
            for n in names:
                keep = reason is None or (reason == bad_key and n != key)
                columns[n].append(_as_json_text(obj.get(n)) if keep else None)
        raw = pa.table({n: pa.array(columns[n], pa.string()) for n in names})
        yield _typed(inp, raw, schema, pa.array(reasons, pa.string()),
                     pa.array([ln for ln, _ in group], pa.string()))


def _key_value_ok(value: Any) -> bool:
    """A JSON key value keys may have: a string, an integer or a boolean (or none)."""
    return value is None or isinstance(value, str | int)  # bool is an int


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
