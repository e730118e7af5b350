"""A job's input: find the files, read them with Spark, hand raw rows to the tasks.

An input folder holds Parquet files (``*.parquet``) and/or JSON-lines files
(``*.json``, ``*.jsonl``, ``*.ndjson``, each also gzip-compressed as ``*.gz``);
names starting with ``_`` or ``.`` are ignored (``_SUCCESS``, ``.crc``). Any other
file (``*.csv`` ...) is *skipped* and reported in the run summary, never silently:
a folder holding only such files is refused (`InputError`), while an empty folder
is a valid, empty input.

Reading is generic over the job's `Input` schema (`read_input`): each schema
column is read and typed by Spark (the key as a string; a value that does not
convert becomes null), and where a value arrived but did not convert its text
travels along as ``_text_<column>`` so that rules tell "missing" from "invalid"
and the quarantine shows what arrived. JSON lines are read as text and parsed
with an all-string schema, so a non-numeric value is a rejected row, not a
failed read; a line that is not exactly one JSON object (unparsable, or followed
by trailing garbage) gets ``_reason = "malformed"`` (Spark's JSON reader silently
drops trailing text). Every JSON row keeps its whole line in ``_line`` (the
quarantine's ``raw`` column). On the executor, `raw_table` turns those columns
back into the raw table `statebackend.job.core.split_rows` validates.

Parquet footers are read on the driver before any Spark work (`check_parquet`):
a truncated or non-Parquet file is refused in one line that names it, instead of
a failed Spark task.

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

import os
import posixpath
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

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
READERS = ("auto", "spark", "arrow")

# Arrow type -> Spark SQL type of the typed column.
_SPARK_TYPES = {
    pa.string(): "string", pa.large_string(): "string", pa.bool_(): "boolean",
    pa.int8(): "tinyint", pa.int16(): "smallint", pa.int32(): "int", pa.int64(): "bigint",
    pa.float32(): "float", pa.float64(): "double", pa.date32(): "date",
}


@dataclass(frozen=True)
class InputFiles:
    """The files of one input folder, split by format."""

    url: str
    parquet: tuple[str, ...]
    json: tuple[str, ...]
    total_bytes: int
    skipped: tuple[str, ...] = ()  # unsupported files, relative to the folder
    # How to open them (fsspec options; s3: the driver's AWS_* captured if none given).
    options: StorageOptions = field(default_factory=StorageOptions)
    gz_bytes: int = 0  # of total_bytes, in gzip files

    @property
    def count(self) -> int:
        return len(self.parquet) + len(self.json)

    def skipped_report(self) -> dict:
        """Summary fields: how many files were skipped and (capped) which."""
        return {"input_files_skipped": len(self.skipped),
                "input_files_skipped_names": list(self.skipped[:SKIPPED_NAMES_SHOWN])}


def list_input(url: str, storage_options: Mapping[str, Any] | None = None) -> InputFiles:
    """List an input folder (local path, file:// or any fsspec URL), opened with
    ``storage_options`` (fsspec's for its scheme)."""
    options = dict(storage_options or {})
    if _scheme(url) in ("s3", "s3a") and not options:
        options = environment_s3_options()  # captured here: executors get them as options
    fs, root = open_input(url, options)
    if not fs.exists(root):
        raise UsageError(f"input folder {url} does not exist")
    if not fs.isdir(root):
        raise UsageError(f"input {url} is not a folder of Parquet or JSON-lines files")
    parquet, json_files, skipped, total, gz = [], [], [], 0, 0
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
        size = int(info.get("size") or 0)
        total += size
        gz += size if name.endswith(".gz") else 0
    if skipped and not parquet and not json_files:
        shown = ", ".join(skipped[:SKIPPED_NAMES_SHOWN])
        more = f" and {len(skipped) - SKIPPED_NAMES_SHOWN} more" \
            if len(skipped) > SKIPPED_NAMES_SHOWN else ""
        raise InputError(f"input folder {url} holds no supported file, only {len(skipped)} "
                         f"unsupported ({shown}{more}); the job reads *.parquet and JSON lines "
                         f"({', '.join('*' + e for e in JSON_EXT)}): convert them or point "
                         "--input elsewhere")
    return InputFiles(url, tuple(parquet), tuple(json_files), total, tuple(skipped),
                      StorageOptions(options), gz)


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


def check_parquet(files: InputFiles) -> None:
    """Read every Parquet footer (in parallel, footer bytes only) before Spark starts.

    A truncated or foreign file would otherwise fail a Spark task with a long JVM
    trace; here it is refused in one line naming the file.
    """
    if not files.parquet:
        return
    with ThreadPoolExecutor(min(FOOTER_CHECK_THREADS, len(files.parquet))) as pool:
        problems = [p for p in pool.map(lambda path: _footer_problem(path, files.options),
                                        files.parquet) if p]
    if problems:
        path, cause = problems[0]
        more = f" (and {len(problems) - 1} more bad Parquet files)" if len(problems) > 1 else ""
        raise InputError(f"input file {path} is not a readable Parquet file: {cause}{more}; "
                         "replace or remove it and re-run")


def _footer_problem(path: str, options: Mapping[str, Any]) -> tuple[str, str] | None:
    import pyarrow.parquet as pq

    try:
        fs, fs_path = open_input(path, options)
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
    readers = choose_readers(files, reader)
    frames = []
    arrow_paths = tuple(p for fmt, paths in (("parquet", files.parquet), ("json", files.json))
                        if readers.get(fmt) == "arrow" for p in paths)
    if arrow_paths:
        frames.append(_arrow_frame(spark, arrow_paths, files, inp))
    if files.parquet and readers["parquet"] == "spark":
        reader = spark.read
        known = parquet_read_schema(inp, files.parquet[0], files.options)
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


def parquet_read_schema(inp: Input, path: str,
                        options: Mapping[str, Any] | None = None) -> str | None:
    """The Spark schema of the job's columns in Parquet file ``path``, from its footer.

    Spark would infer the same from one file's footer, but with a job of its own;
    reading just the job's columns is also what `_typed` keeps. None (Spark infers)
    when a column's type has no plain Spark name here (timestamps, decimals ...).
    """
    import pyarrow.parquet as pq

    fs, fs_path = open_input(path, options)
    with fs.open(fs_path, "rb") as fh:
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

    Malformed: the line is not exactly one JSON object. Spark's parser stops after
    the first value, so ``{...} xyz`` would pass; wrapping the line in ``[...]`` and
    asking for an array of length 1 rejects trailing text and a second object alike
    (``{...}{...}``, ``{...},{...}``). A malformed line keeps no parsed column.
    """
    from pyspark.sql import functions as F

    line = F.col("value")
    lines = spark.read.text(list(paths)).where(F.trim(line) != "")  # blank lines: no row
    ddl = ", ".join([f"`{n}` string" for n in inp.schema.names] + ["_corrupt string"])
    parsed = F.from_json(line, ddl, {"mode": "PERMISSIVE",
                                     "columnNameOfCorruptRecord": "_corrupt"})
    single = F.json_array_length(F.concat(F.lit("["), line, F.lit("]"))) == 1
    bad = parsed["_corrupt"].isNotNull() | ~F.coalesce(single, F.lit(False))
    df = lines.select(line.alias(LINE), bad.alias("_malformed"), parsed.alias("_j"))
    kept = df.select(*[F.when(~F.col("_malformed"), F.col("_j").getField(n)).alias(n)
                       for n in inp.schema.names],
                     F.when(F.col("_malformed"), F.lit(MALFORMED)).alias(REASON), LINE)
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


# -- the executor side -----------------------------------------------------------------
def raw_table(inp: Input, batch: pa.RecordBatch | pa.Table) -> pa.Table:
    """The raw table `split_rows` validates, from a batch of `read_ddl` columns.

    A column whose values all converted stays typed (the cast in `split_rows` is
    then free); a column with unconverted values becomes text: the arrived text
    where it did not convert, the typed value's text elsewhere.
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
    cols[LINE] = table[LINE]
    return pa.table(cols)
