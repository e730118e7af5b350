"""A job's input files: find them, safely, and weigh them.

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
- readers open local files with ``O_NOFOLLOW | O_NONBLOCK`` and refuse anything but
  a regular file (`open_input_file`): a link or FIFO swapped in after the listing
  fails that file in one line instead of being followed or waited on.

The input is opened with the run's storage options (fsspec's); without options,
s3 credentials of the driver's ``AWS_*`` variables are captured as options (they
reach executors as task parameters, never as environment variables).

Two readers give the same rows (`choose_readers` picks one per format; the run
summary's ``input_reader`` says which ran): ``arrow`` (`statebackend.job.arrow_input`:
pyarrow over fsspec, in the local engine or in Spark tasks), for local JSON lines
(faster than Spark's) and for every URL other than a local path (``s3://`` ...
without a Hadoop connector); ``spark`` (`statebackend.job.spark_input`: Spark's own
file sources), for local Parquet.

`input_weight` measures the input as the local engine would hold it, for the engine
choice (`statebackend.engines`): plain files by their size, Parquet by the decoded
size its footers prove at least (when `statebackend.job.arrow_input.check_parquet`
kept them), gzip files by decompressing them as a stream, only until the running
total passes the ``auto`` limit: a gzip bomb costs the driver at most that limit of
decompression and goes to Spark.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import pyarrow as pa

from statebackend import settings
from statebackend.engines import auto_limit
from statebackend.errors import InputError, UsageError
from statebackend.storage import StorageOptions
from statebackend.storage.s3 import environment_s3_options, s3_storage_options

PARQUET_EXT = (".parquet",)
JSON_EXT = (".json", ".jsonl", ".ndjson", ".json.gz", ".jsonl.gz", ".ndjson.gz")
SKIPPED_NAMES_SHOWN = 10  # the summary lists this many skipped files, then counts
READERS = ("auto", "spark", "arrow")
DIRECT_READ_MAX_BYTES_ENV = "CKPT_SPARK_DIRECT_READ_MAX_BYTES"
COUNT_BLOCK_BYTES = 1 << 20  # gzip bytes decompressed at a time when only counting


@dataclass(frozen=True)
class ParquetFooter:
    """What the driver keeps of one Parquet file's footer."""

    schema: pa.Schema
    # What its columns take decoded, at least: per column chunk the larger of its
    # uncompressed size and values x value width (dictionary and run-length encoded
    # pages are far smaller than the values they decode to; strings count 4 bytes).
    decoded_bytes: int
    file_bytes: int
    rows: int  # the footer's row count


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
    # gzip path -> (decompressed bytes counted, whether to its end): `input_weight`
    # weighs a run's input for the engine choice and again for the direct read
    gz_counted: dict = field(default_factory=dict, compare=False, repr=False)

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


def _spark_path(url: str, fs, path: str) -> str:
    if _is_local(fs):
        return os.path.abspath(path)
    scheme = url.split("://", 1)[0]
    return f"{scheme}://{path}"


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


def reads_directly(files: InputFiles, reader: str, readers: int,
                   limit: int | None = None) -> bool:
    """Whether a Spark run's ``readers`` tasks each read the whole input with Arrow
    instead of Spark's shuffle (`statebackend.job.spark_direct`): the reader allows it
    (``auto`` or ``arrow``) and the input's decompressed bytes (`input_weight`: gzip
    files are decompressed to count them, only up to the bound) times ``readers`` are
    at most ``limit`` (default ``CKPT_SPARK_DIRECT_READ_MAX_BYTES``)."""
    if reader not in ("auto", "arrow"):
        return False
    limit = settings.byte_count(DIRECT_READ_MAX_BYTES_ENV) if limit is None else limit
    share = limit // max(1, readers)
    return not files.count or input_weight(files, share) <= share


def input_paths(files: InputFiles) -> tuple[str, ...]:
    """Every input file in the order the local engine and direct reads read them."""
    return (*files.parquet, *files.json)


def choose_reader(files: InputFiles, requested: str = "auto") -> str:
    """The run summary's ``input_reader``: ``spark``, ``arrow``, ``spark+arrow`` (one per
    format) or ``none`` (no input file)."""
    used = set(choose_readers(files, requested).values())
    return "+".join(r for r in ("spark", "arrow") if r in used) or "none"


def decompressed_bytes(path: str, options: Mapping[str, Any], stop_after: int
                       ) -> tuple[int, bool]:
    """(decompressed size of gzip file ``path``, whether counted to its end), streamed:
    counting stops once it passes ``stop_after`` (the size is then just above it), so a
    bomb costs no more."""
    import gzip
    import zlib

    total = 0
    try:
        with open_input_file(path, options) as raw, gzip.GzipFile(fileobj=raw) as fh:
            while total <= stop_after:
                block = fh.read(COUNT_BLOCK_BYTES)
                if not block:
                    return total, True
                total += len(block)
    except (OSError, EOFError, zlib.error):
        return total, True  # a damaged file counts what it gave; its reader refuses it
    return total, False


def has_no_rows(files: InputFiles) -> bool:
    """Whether the input provably holds no row: no file, or only Parquet files whose
    footers (read by `check_parquet`) count none. JSON files are never opened here."""
    return not files.json and all(
        p in files.footers and files.footers[p].rows == 0 for p in files.parquet)


def input_weight(files, limit: int | None = None) -> int:
    """Bytes the input takes decompressed (module doc), counted only until the total
    passes ``limit`` (default `auto_limit`): a larger result is then a lower bound."""
    limit = auto_limit() if limit is None else limit
    footers = [files.footers[p] for p in files.parquet if p in files.footers]
    total = (files.total_bytes - files.gz_bytes - sum(f.file_bytes for f in footers)
             + sum(f.decoded_bytes for f in footers))
    for path in files.json:
        if total > limit:
            break
        if path.lower().endswith(".gz"):
            total += _gzip_weight(files, path, limit - total)
    return total


def _gzip_weight(files: InputFiles, path: str, stop_after: int) -> int:
    """`decompressed_bytes` of one gzip input file, remembered on ``files``: a count that
    reached the file's end, or passed ``stop_after``, is not taken again."""
    counted = files.gz_counted.get(path)
    if counted is None or not (counted[1] or counted[0] > stop_after):
        counted = files.gz_counted[path] = decompressed_bytes(path, files.options, stop_after)
    size: int = counted[0]
    return size
