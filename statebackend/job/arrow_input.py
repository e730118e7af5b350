"""A job's input rows, read with pyarrow over fsspec: the local engine's and Spark tasks'.

The rows come out in `read_schema`'s columns, the same ones Spark's own reader gives
(`statebackend.job.spark_input`), so routing, validation and the quarantine do not
know which reader ran: each input column typed (the key as a string; a value that
does not convert is null), ``_text_<column>`` with the text of a value that arrived
but did not convert (so rules tell "missing" from "invalid" and the quarantine shows
what arrived), ``_reason`` (a reason decided while reading, else null) and
``_line`` (a JSON row's whole line: the quarantine's ``raw`` column). `raw_table`
turns them into the raw table `statebackend.job.core.split_rows` validates.

- Parquet: the job's columns, ``BATCH_ROWS`` rows at a time. Footers are read on the
  driver before any work (`check_parquet`): a truncated or non-Parquet file is
  refused in one line that names it; the footers stay with the listing
  (`InputFiles.footers`) for the key check and the input weight.
- JSON lines (gzip by extension) are read as a stream (`json_chunks`): about
  `CHUNK_BYTES` of decompressed whole lines at a time, each chunk parsed and handed
  on before the next is read, so memory follows the chunk, not the file (a single
  line longer than `MAX_LINE_BYTES` fails the file in one line). A line of only JSON
  whitespace (spaces, tabs, CR) gives no row. A chunk that is valid UTF-8 and whose
  lines are all one clean JSON object of the expected types (string keys) is parsed
  by Arrow's JSON reader in one call; any other chunk line by line (``json.loads``,
  `BATCH_ROWS` lines at a time), where a line that is not exactly one JSON object is
  ``malformed`` (unparsable, or followed by trailing garbage) and a value is kept as
  text, as Spark's all-string parse does.

Keys: one rule on both engines and both readers. A key's text is what the state,
the key groups and the outputs see, so only types whose text is the same
everywhere are accepted:

- Parquet: the key column is a string (utf8, large utf8, dictionary of strings),
  an integer (signed or unsigned, any width: ``5`` is ``"5"``) or a boolean
  (``"true"``/``"false"``). Any other column type (binary, float, decimal, date,
  timestamp, struct, list, map ...) is refused before any row is read, in one line
  naming the file, the key column and its type (`check_key_columns`, from the kept
  footers; `check_parquet(files, inp)` before the engine starts).
- JSON lines: a JSON string is the key as it is; an integer (no fraction, no
  exponent) is its digits, ``true``/``false`` their text; null or absent is a
  missing key. Any other JSON value (a number with a fraction or an exponent, an
  object, an array) is a row rejected as ``invalid_<key>`` (their text differs
  between Python's and the JVM's JSON writers: ``1e7`` is ``10000000.0`` in one
  and ``1.0E7`` in the other).

Invalid UTF-8: a JSON line whose bytes are not valid UTF-8 is rejected as
``invalid_utf8`` (`INVALID_UTF8`) with its columns null, never decoded with
replacement characters (which would merge keys that differ only in the invalid
bytes). Its ``_line`` shows the bytes with escapes (``\\xff``): this reader escapes
them as it reads; Spark's text source keeps the raw bytes, which `raw_table`
escapes.

`read_file` takes an optional `ByteBudget`, the local engine's bound on the input a
run holds: every block of decompressed JSON bytes and every decoded Parquet batch is
charged before it is parsed or handed on, and the read stops with `BudgetExceeded`
as soon as the total passes the limit. Spark tasks stream and pass no budget.

A file that cannot be read fails with one line naming it (`InputError`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from io import BufferedIOBase
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import InputError, UsageError
from statebackend.fast_json import compact_json
from statebackend.job.api import Input
from statebackend.job.core import as_text, try_cast  # the validator's, shared
from statebackend.job.input import JSON_EXT, InputFiles, ParquetFooter, open_input_file

FOOTER_CHECK_THREADS = 16
REASON = "_reason"
LINE = "_line"
TEXT = "_text_"
MALFORMED = "malformed"
INVALID_UTF8 = "invalid_utf8"
KEY_TYPES = "strings, integers or booleans"  # the accepted key column types (module doc)
JSON_BLANK = " \t\r"  # a line of only these gives no row
FILE_COLUMN = "file"
BATCH_ROWS = 100_000  # rows per Arrow batch a task hands on
CHUNK_BYTES = 32 * 2**20  # decompressed JSON-lines bytes parsed at a time
READ_BYTES = 4 * 2**20  # bytes read (and charged) at a time
MAX_LINE_BYTES = 256 * 2**20  # a longer line fails its file: not JSON lines
# The Arrow type a read column has, by the job's declared type (timestamps: microseconds,
# UTC; the key: string). Spark's reader gives the same (statebackend.job.spark_input).
READ_TYPES = {
    pa.string(): pa.string(), pa.large_string(): pa.string(), pa.bool_(): pa.bool_(),
    pa.int8(): pa.int8(), pa.int16(): pa.int16(), pa.int32(): pa.int32(),
    pa.int64(): pa.int64(), pa.float32(): pa.float32(), pa.float64(): pa.float64(),
    pa.date32(): pa.date32(),
}
TIMESTAMP = pa.timestamp("us", "UTC")


def read_type(inp: Input, name: str) -> pa.DataType:
    """The type of input column ``name`` as the readers give it (`READ_TYPES`)."""
    if name == inp.key:
        return pa.string()  # keys are stored as strings
    t = inp.schema.field(name).type
    if pa.types.is_timestamp(t):
        return TIMESTAMP
    found = READ_TYPES.get(t)
    if found is None:
        raise UsageError(f"input column {name!r} has type {t}, which the input readers do "
                         f"not support; use one of {sorted({str(k) for k in READ_TYPES})} "
                         f"or a timestamp")
    return found


def read_schema(inp: Input) -> pa.Schema:
    """The columns every reader gives (module doc), in order."""
    typed = [(n, read_type(inp, n)) for n in inp.schema.names]
    texts = [(TEXT + n, pa.string()) for n in inp.schema.names]
    return pa.schema([*typed, *texts, (REASON, pa.string()), (LINE, pa.string())])


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


# -- footers and keys (the driver, before any work) ---------------------------------
def check_parquet(files: InputFiles, inp: Input | None = None) -> None:
    """Read every Parquet footer (in parallel, footer bytes only) before Spark starts;
    with ``inp``, also check the key column's type (`check_key_columns`).

    A truncated or foreign file would otherwise fail a Spark task with a long JVM
    trace; here it is refused in one line naming the file. The footers stay with
    ``files`` (`InputFiles.footers`).
    """
    parquet_footers(files)
    if inp is not None:
        check_key_columns(files, inp)


def parquet_footers(files: InputFiles) -> dict[str, ParquetFooter]:
    """path -> footer of every Parquet file, read once per listing (then kept in
    ``files.footers``); InputError naming a file that is not readable Parquet."""
    missing = [p for p in files.parquet if p not in files.footers]
    if missing:
        with ThreadPoolExecutor(min(FOOTER_CHECK_THREADS, len(missing))) as pool:
            read = list(pool.map(lambda path: _read_footer(path, files.options), missing))
        problems = [r for r in read if isinstance(r, tuple)]
        if problems:
            path, cause = problems[0]
            more = f" (and {len(problems) - 1} more bad Parquet files)" \
                if len(problems) > 1 else ""
            raise InputError(f"input file {path} is not a readable Parquet file: {cause}"
                             f"{more}; replace or remove it and re-run")
        files.footers.update(zip(missing, read, strict=True))
    return {p: files.footers[p] for p in files.parquet}


def _read_footer(path: str, options: Mapping[str, Any]) -> ParquetFooter | tuple[str, str]:
    import pyarrow.parquet as pq

    try:
        with open_input_file(path, options) as fh:
            meta = pq.read_metadata(fh)
            size = fh.seek(0, os.SEEK_END)
        schema = meta.schema.to_arrow_schema()
        decoded = _decoded_bytes(meta)
    except Exception as exc:  # noqa: BLE001 - any failure is this file's problem, reported
        cause = " ".join(str(exc).split()) or type(exc).__name__
        return path, f"{type(exc).__name__}: {cause}"[:300]
    return ParquetFooter(schema, decoded, int(size), int(meta.num_rows))


_VALUE_BYTES = {"BOOLEAN": 0.125, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8,
                "INT96": 12, "BYTE_ARRAY": 4}  # Arrow's bytes per value (strings: offsets)

def _decoded_bytes(meta) -> int:
    """`ParquetFooter.decoded_bytes` of a file's metadata."""
    widths = []
    for j in range(meta.num_columns):
        column = meta.schema.column(j)
        widths.append(column.length if column.physical_type == "FIXED_LEN_BYTE_ARRAY"
                      else _VALUE_BYTES.get(column.physical_type, 1))
    total = 0.0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        for j in range(group.num_columns):
            chunk = group.column(j)
            total += max(chunk.total_uncompressed_size, chunk.num_values * (widths[j] or 1))
    return int(total)


def accepted_key_type(t: pa.DataType) -> bool:
    """Whether a Parquet key column of Arrow type ``t`` is accepted (module doc, keys)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
            or pa.types.is_boolean(t))


def key_type_error(path: str, key: str, t: pa.DataType, more: int = 0) -> InputError:
    """The one-line refusal of a Parquet file whose key column has type ``t``."""
    shown = str(t) if len(str(t)) <= 120 else str(t)[:117] + "..."
    also = f" (and {more} more files with such a key column)" if more else ""
    return InputError(f"input file {path}: key column {key!r} has type {shown}{also}; keys "
                      f"must be {KEY_TYPES} (cast it when writing the file); nothing was "
                      "read")


def check_key_columns(files: InputFiles, inp: Input) -> None:
    """Refuse, before any work and identically on both engines, a Parquet file whose
    key column has a type other than `KEY_TYPES` (module doc); uses the kept footers."""
    if not files.parquet:
        return
    bad = [(path, f.schema.field(inp.key).type) for path, f in parquet_footers(files).items()
           if inp.key in f.schema.names and not accepted_key_type(f.schema.field(inp.key).type)]
    if bad:
        raise key_type_error(bad[0][0], inp.key, bad[0][1], len(bad) - 1)


def invalid_key_reason(inp: Input) -> str:
    """The reject reason of a JSON row whose key has a type keys cannot have."""
    return f"invalid_{inp.key}"


# -- reading ---------------------------------------------------------------------------
def read_files(inp: Input, options: Mapping[str, Any], batches: Iterator[pa.RecordBatch]
               ) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: read every file named in ``batches``; yield `read_schema` rows."""
    schema = read_schema(inp)
    for batch in batches:
        for path in batch.column(FILE_COLUMN).to_pylist():
            yield from read_file(inp, options, path, schema)


def read_file(inp: Input, options: Mapping[str, Any], path: str,
              schema: pa.Schema | None = None, budget: ByteBudget | None = None
              ) -> Iterator[pa.RecordBatch]:
    """One file's rows as `read_schema` batches, streamed; InputError naming the file
    if unreadable, `BudgetExceeded` once ``budget`` is spent (module doc)."""
    schema = schema or read_schema(inp)
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
        # gzip: decompressed as read (also files of several gzip members)
        stream: BinaryIO | BufferedIOBase = gzip.GzipFile(fileobj=raw) \
            if path.lower().endswith(".gz") else raw
        with stream:
            for chunk in json_chunks(stream, path, budget):
                yield from _json_chunk(inp, chunk, schema)


def json_chunks(fh: BinaryIO | BufferedIOBase, path: str, budget: ByteBudget | None = None
                ) -> Iterator[bytes]:
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

    explicit = pa.schema([(n, read_type(inp, n)) for n in inp.schema.names])
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
            obj: dict[str, Any] | None = None  # None: not parsed (a reason came with it)
            if reason is None:
                try:
                    parsed = json.loads(line)
                except (ValueError, RecursionError):
                    parsed = None
                if not isinstance(parsed, dict):
                    reason = MALFORMED
                else:
                    obj = parsed
                    if not _key_value_ok(obj.get(key)):
                        reason = bad_key
            reasons.append(reason)
            for n in names:
                keep = reason is None or (reason == bad_key and n != key)
                columns[n].append(_as_json_text(obj.get(n) if keep and obj else None))
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
    return compact_json(value)


# -- typing (Spark's `_typed`, in Arrow) -----------------------------------------------
def _typed(inp: Input, table: pa.Table, schema: pa.Schema, reasons: pa.Array | None,
           lines: pa.Array | None) -> pa.Table:
    """`read_schema` columns: typed values, the text of values that did not convert."""
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


# -- the rows the logic validates -------------------------------------------------------
def raw_table(inp: Input, batch: pa.RecordBatch | pa.Table) -> pa.Table:
    """The raw table `split_rows` validates, from a batch of `read_ddl` columns.

    A column whose values all converted stays typed (the cast in `split_rows` is
    then free); a column with unconverted values becomes text: the arrived text
    where it did not convert, the typed value's text elsewhere. The ``_line`` of an
    ``invalid_utf8`` row is escaped (`escape_invalid_utf8`): Spark's reader hands on
    the raw bytes.
    """
    table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
    cols: dict[str, pa.Array | pa.ChunkedArray] = {}
    for name in inp.schema.names:
        typed, text = table[name], table[TEXT + name]
        if text.null_count == len(text):
            cols[name] = typed
        else:
            cols[name] = pc.coalesce(text, pc.cast(typed, pa.string()))
    cols[REASON] = table[REASON]
    cols[LINE] = _escaped_lines(table[REASON], table[LINE])
    return pa.table(cols)


def escape_invalid_utf8(data: bytes) -> str:
    """A line's bytes as text: UTF-8, with each invalid byte shown as ``\\xNN``."""
    return data.decode("utf-8", "backslashreplace")


def _escaped_lines(reasons: pa.ChunkedArray, lines: pa.ChunkedArray) -> pa.ChunkedArray:
    if not pc.any(pc.equal(reasons, INVALID_UTF8)).as_py():
        return lines
    raw = pc.cast(lines.combine_chunks(), pa.binary()).to_pylist()  # a view: no validation
    return pa.chunked_array([pa.array(
        [None if b is None else escape_invalid_utf8(b) for b in raw], pa.string())])
