"""A job's input: find the files, read them with Spark, hand raw rows to the tasks.

An input folder holds Parquet files (``*.parquet``) and/or JSON-lines files
(``*.json``, ``*.jsonl``, ``*.ndjson``, each also gzip-compressed as ``*.gz``);
names starting with ``_`` or ``.`` are ignored (``_SUCCESS``, ``.crc``). Any other
file (``*.csv`` ...) is *skipped* and reported in the run summary, never silently:
a folder holding only such files is refused (`InputError`), while an empty folder
is a valid, empty input.

Containment (local folders; `list_input` only stats, it never opens an entry):

- an entry that is not a regular file (a FIFO, a socket, a device) is skipped and
  reported as ``name (fifo)`` ...: reading a FIFO would wait forever;
- a symlink is read only if its target resolves (``realpath``) inside the input
  root and is a regular file; the reader then gets the resolved path. Any other
  symlink is skipped and reported (``name (symlink outside the input root)``), so
  no byte outside the root reaches a row, an output or the quarantine;
- the Arrow reader opens local files with ``O_NOFOLLOW | O_NONBLOCK`` and refuses
  anything but a regular file (`open_input_file`): a link or FIFO swapped in after
  the listing fails that file in one line instead of being followed or waited on.

Reading is generic over the job's `Input` schema (`read_input`): each schema
column is read and typed by Spark (the key as a string; a value that does not
convert becomes null), and where a value arrived but did not convert its text
travels along as ``_text_<column>`` so that rules tell "missing" from "invalid"
and the quarantine shows what arrived. JSON lines are read as text and parsed
with an all-string schema, so a non-numeric value is a rejected row, not a
failed read; a line that is not exactly one JSON object (unparsable, or followed
by trailing garbage) gets ``_reason = "malformed"`` (Spark's JSON reader silently
drops trailing text). A line that is only JSON whitespace (spaces, tabs, CR) gives
no row. Every JSON row keeps its whole line in ``_line`` (the quarantine's ``raw``
column). On the executor, `raw_table` turns those columns back into the raw table
`statebackend.job.core.split_rows` validates.

Keys: one rule on both engines and both readers. A key's text is what the state,
the key groups and the outputs see, so only types whose text is the same
everywhere are accepted:

- Parquet: the key column is a string (utf8, large utf8, dictionary of strings),
  an integer (signed or unsigned, any width: ``5`` is ``"5"``) or a boolean
  (``"true"``/``"false"``). Any other column type (binary, float, decimal, date,
  timestamp, struct, list, map ...) is refused before any row is read, in one line
  naming the file, the key column and its type (`check_key_columns`, from the footers
  `check_parquet` reads once per listing; `check_parquet(files, inp)` does it before
  the engine starts, and both engines call it on the driver before reading).
- JSON lines: a JSON string is the key as it is; an integer (no fraction, no
  exponent) is its digits, ``true``/``false`` their text; null or absent is a
  missing key. Any other JSON value (a number with a fraction or an exponent, an
  object, an array) is a row rejected as ``invalid_<key>`` (their text differs
  between Python's and the JVM's JSON writers: ``1e7`` is ``10000000.0`` in one
  and ``1.0E7`` in the other).

Invalid UTF-8: a JSON line whose bytes are not valid UTF-8 is rejected as
``invalid_utf8`` (`INVALID_UTF8`) with its columns null, never decoded with
replacement characters (which would merge keys that differ only in the invalid
bytes). Its ``_line`` shows the bytes with escapes (``\\xff``): the Arrow reader
escapes them as it reads; Spark's text source keeps the raw bytes, which Spark
checks (``is_valid_utf8``) and `raw_table` escapes on the executor.

Parquet footers are read on the driver before any Spark work (`check_parquet`):
a truncated or non-Parquet file is refused in one line that names it, instead of
a failed Spark task. The footers are kept with the listing (`InputFiles.footers`):
the key check and the engine choice's input weight use them without reading again.

Two readers give the same columns (`choose_readers` picks one per format; the run
summary's ``input_reader`` says which ran): ``spark``, Spark's own file sources, for
local Parquet; ``arrow`` (`statebackend.job.arrow_input`), executors reading their
share of the files with pyarrow over fsspec, for local JSON lines (faster than
Spark's) and for every other URL (``s3://`` ... without a Hadoop connector).
The input is opened with the run's storage options; without
options, s3 credentials of the driver's ``AWS_*`` variables are captured as options
(they reach executors as task parameters, never as environment variables).
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc

from statebackend.errors import InputError, UsageError
from statebackend.job.api import Input
from statebackend.storage import StorageOptions
from statebackend.storage.s3 import environment_s3_options, s3_storage_options

PARQUET_EXT = (".parquet",)
JSON_EXT = (".json", ".jsonl", ".ndjson", ".json.gz", ".jsonl.gz", ".ndjson.gz")
SKIPPED_NAMES_SHOWN = 10  # the summary lists this many skipped files, then counts
FOOTER_CHECK_THREADS = 16
REASON = "_reason"
LINE = "_line"
TEXT = "_text_"
MALFORMED = "malformed"
INVALID_UTF8 = "invalid_utf8"
READERS = ("auto", "spark", "arrow")
KEY_TYPES = "strings, integers or booleans"  # the accepted key column types (module doc)
JSON_BLANK = " \t\r"  # a line of only these gives no row
COUNT_BLOCK_BYTES = 1 << 20  # gzip bytes decompressed at a time when only counting

# Arrow type -> Spark SQL type of the typed column.
_SPARK_TYPES = {
    pa.string(): "string", pa.large_string(): "string", pa.bool_(): "boolean",
    pa.int8(): "tinyint", pa.int16(): "smallint", pa.int32(): "int", pa.int64(): "bigint",
    pa.float32(): "float", pa.float64(): "double", pa.date32(): "date",
}


@dataclass(frozen=True)
class ParquetFooter:
    """What the driver keeps of one Parquet file's footer."""

    schema: pa.Schema
    # What its columns take decoded, at least: per column chunk the larger of its
    # uncompressed size and values x value width (dictionary and run-length encoded
    # pages are far smaller than the values they decode to; strings count 4 bytes).
    decoded_bytes: int
    file_bytes: int


@dataclass(frozen=True)
class InputFiles:
    """The files of one input folder, split by format."""

    url: str
    parquet: tuple[str, ...]
    json: tuple[str, ...]
    total_bytes: int
    # skipped entries, relative to the folder; "name (reason)" unless merely unsupported
    skipped: tuple[str, ...] = ()
    # How to open them (fsspec options; s3: the driver's AWS_* captured if none given).
    options: StorageOptions = field(default_factory=StorageOptions)
    gz_bytes: int = 0  # of total_bytes, in gzip files
    # path -> ParquetFooter, filled by `check_parquet` (read once per listing)
    footers: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def count(self) -> int:
        return len(self.parquet) + len(self.json)

    def skipped_report(self) -> dict:
        """Summary fields: how many files were skipped and (capped) which."""
        return {"input_files_skipped": len(self.skipped),
                "input_files_skipped_names": list(self.skipped[:SKIPPED_NAMES_SHOWN])}


def list_input(url: str, storage_options: Mapping[str, Any] | None = None) -> InputFiles:
    """List an input folder (local path, file:// or any fsspec URL), opened with
    ``storage_options`` (fsspec's for its scheme). Local entries are checked with
    ``lstat``/``realpath`` (module doc, containment); nothing is opened."""
    options = dict(storage_options or {})
    if _scheme(url) in ("s3", "s3a") and not options:
        options = environment_s3_options()  # captured here: executors get them as options
    fs, root = open_input(url, options)
    if not fs.exists(root):
        raise UsageError(f"input folder {url} does not exist")
    if not fs.isdir(root):
        raise UsageError(f"input {url} is not a folder of Parquet or JSON-lines files")
    local = _is_local(fs)
    real_root = os.path.realpath(root) if local else ""
    parquet, json_files, skipped, total, gz = [], [], [], 0, 0
    unsupported_only = True
    for path, info in sorted(fs.find(root, detail=True).items()):
        rel = posixpath.relpath(path, root.rstrip("/")) if root else path
        if any(part.startswith(("_", ".")) for part in rel.split("/")):
            continue
        name = rel.lower()
        if local:
            full, size, why = _local_entry(real_root, path)
            if why is not None:
                skipped.append(f"{rel} ({why})")
                unsupported_only = False
                continue
        else:
            full, size = _spark_path(url, fs, path), int(info.get("size") or 0)
        if name.endswith(PARQUET_EXT):
            parquet.append(full)
        elif name.endswith(JSON_EXT):
            json_files.append(full)
        else:
            skipped.append(rel)
            continue
        total += size
        gz += size if name.endswith(".gz") else 0
    if skipped and not parquet and not json_files:
        shown = ", ".join(skipped[:SKIPPED_NAMES_SHOWN])
        more = f" and {len(skipped) - SKIPPED_NAMES_SHOWN} more" \
            if len(skipped) > SKIPPED_NAMES_SHOWN else ""
        what = "unsupported" if unsupported_only else "skipped"
        raise InputError(f"input folder {url} holds no supported file, only {len(skipped)} "
                         f"{what} ({shown}{more}); the job reads regular *.parquet and JSON-"
                         f"lines files ({', '.join('*' + e for e in JSON_EXT)}): convert them "
                         "or point --input elsewhere")
    return InputFiles(url, tuple(parquet), tuple(json_files), total, tuple(skipped),
                      StorageOptions(options), gz)


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def _local_entry(real_root: str, path: str) -> tuple[str, int, str | None]:
    """(path the readers get, size, None), or ("", 0, why it is skipped).

    ``lstat`` first: a symlink is judged by its resolved target, which must lie inside
    the (resolved) input root and be a regular file; the readers get that target."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return "", 0, f"vanished while listed: {exc.strerror or exc}"
    if stat.S_ISLNK(st.st_mode):
        real = os.path.realpath(path)
        if os.path.commonpath([real, real_root]) != real_root:
            return "", 0, "symlink outside the input root"
        try:
            st = os.stat(real)
        except OSError:  # dangling, or a loop
            return "", 0, "broken symlink"
        kind = _file_kind(st.st_mode)
        if kind != "file":
            return "", 0, f"symlink to a {kind}"
        return real, st.st_size, None
    kind = _file_kind(st.st_mode)
    if kind != "file":
        return "", 0, kind
    return os.path.abspath(path), st.st_size, None


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "special file"


def open_input(path: str, options: Mapping[str, Any] | None):
    """(fsspec filesystem, path inside it) of an input URL, opened with ``options``."""
    import fsspec

    scheme = _scheme(path)
    if scheme in ("file", "local"):
        kwargs: dict = {}
    elif scheme in ("s3", "s3a"):
        kwargs = s3_storage_options(options)
    else:
        kwargs = dict(options or {})
    return fsspec.core.url_to_fs(path, **kwargs)


def open_input_file(path: str, options: Mapping[str, Any] | None) -> BinaryIO:
    """One input file, opened for reading (the caller closes it).

    A local file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular file
    (`list_input` hands on resolved paths): a symlink or a FIFO put there after the
    listing is refused in one line, never followed or waited on. Other schemes open
    through fsspec with ``options``.
    """
    if _scheme(path) not in ("file", "local"):
        fs, fs_path = open_input(path, options)
        return fs.open(fs_path, "rb")
    local = path.split("://", 1)[1] if "://" in path else path
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(local, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputError(f"input file {path} became a symlink after the input was "
                             "listed; it is not followed: re-run") from None
        raise
    kind = _file_kind(os.fstat(fd).st_mode)
    if kind != "file":
        os.close(fd)
        raise InputError(f"input file {path} is a {kind}, not a regular file; it is not "
                         "read: remove it from the input folder and re-run")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)  # no effect on a regular file; a plain reader from here
    return os.fdopen(fd, "rb")


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def choose_readers(files: InputFiles, requested: str = "auto") -> dict[str, str]:
    """{format: ``spark`` | ``arrow``} for the formats present (module doc). ``auto``:
    local Parquet by Spark (faster there), local JSON lines by Arrow (2.5x faster than
    Spark's text + from_json, docs/performance.md), any other scheme by Arrow."""
    if requested not in READERS:
        raise UsageError(f"input reader {requested!r} is unknown; use one of {list(READERS)}")
    local = _scheme(files.url) in ("file", "local")
    if requested == "spark" and not local:
        raise UsageError(f"input {files.url}: Spark's reader needs a Hadoop connector for "
                         f"{_scheme(files.url)}://, which is not installed; use the arrow reader")
    present = [f for f, paths in (("parquet", files.parquet), ("json", files.json)) if paths]
    if requested != "auto":
        return {f: requested for f in present}
    return {f: "spark" if local and f == "parquet" else "arrow" for f in present}


def choose_reader(files: InputFiles, requested: str = "auto") -> str:
    """The run summary's ``input_reader``: ``spark``, ``arrow``, ``spark+arrow`` (one per
    format) or ``none`` (no input file)."""
    used = set(choose_readers(files, requested).values())
    return "+".join(r for r in ("spark", "arrow") if r in used) or "none"


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
    return ParquetFooter(schema, decoded, int(size))


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


def decompressed_bytes(path: str, options: Mapping[str, Any], stop_after: int) -> int:
    """Decompressed size of gzip file ``path``, streamed: counting stops once it passes
    ``stop_after`` (the result is then just above it), so a bomb costs no more."""
    import gzip
    import zlib

    total = 0
    try:
        with open_input_file(path, options) as raw, gzip.GzipFile(fileobj=raw) as fh:
            while total <= stop_after:
                block = fh.read(COUNT_BLOCK_BYTES)
                if not block:
                    break
                total += len(block)
    except (OSError, EOFError, zlib.error):
        pass  # a damaged file counts what it gave; its reader refuses it in one line
    return total


def _spark_path(url: str, fs, path: str) -> str:
    if _is_local(fs):
        return os.path.abspath(path)
    scheme = url.split("://", 1)[0]
    return f"{scheme}://{path}"


# -- the Spark side --------------------------------------------------------------------
def spark_type(inp: Input, name: str) -> str:
    """The Spark SQL type of column ``name`` as the tasks receive it."""
    if name == inp.key:
        return "string"  # keys are stored as strings
    t = inp.schema.field(name).type
    if pa.types.is_timestamp(t):
        return "timestamp"
    found = _SPARK_TYPES.get(t)
    if found is None:
        raise UsageError(f"input column {name!r} has type {t}, which the Spark reader does not "
                         f"support; use one of {sorted({str(k) for k in _SPARK_TYPES})}")
    return found


def spark_ddl(schema: pa.Schema) -> str:
    """The Spark DDL of an Arrow schema of plain column types (e.g. a task's result row)."""
    return ", ".join(f"`{f.name}` {_SPARK_TYPES[f.type]}" for f in schema)


def read_ddl(inp: Input) -> str:
    """Columns of `read_input`'s DataFrame, in order."""
    typed = [f"`{n}` {spark_type(inp, n)}" for n in inp.schema.names]
    texts = [f"`{TEXT}{n}` string" for n in inp.schema.names]
    return ", ".join([*typed, *texts, f"{REASON} string", f"{LINE} string"])


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
        reader = spark.read
        known = parquet_read_schema(inp, files.parquet[0], files.options, files.footers)
        if known is not None:  # no schema-inference job (one Spark stage less per run)
            reader = reader.schema(known)
        frames.append(_typed(reader.parquet(*files.parquet), inp, files.url)
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
    import functools

    from statebackend.job import arrow_input
    from statebackend.spark.session import default_parallelism

    return arrow_input.files_frame(spark, paths, default_parallelism(spark)).mapInArrow(
        functools.partial(arrow_input.read_files, inp, files.options), read_ddl(inp))


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
        spark_name = _SPARK_TYPES.get(arrow.field(name).type)
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


def invalid_key_reason(inp: Input) -> str:
    """The reject reason of a JSON row whose key has a type keys cannot have."""
    return f"invalid_{inp.key}"


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


# -- the executor side -----------------------------------------------------------------
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
