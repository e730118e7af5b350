"""Checkpoint storage over fsspec: ``file://`` (default), ``memory://``, ``s3://``.

`open_storage(url, **options)` picks the class of the URL's scheme; each lives in
its own module (local.py, memory.py, s3.py) and overrides what its filesystem
does differently from the `Storage` base (base.py: the primitives and their
contracts). Checksums: checksums.py. Options and their redaction: options.py.

Storage options are fsspec's for the scheme (s3: ``key``, ``secret``, ``token``,
``profile``, ``client_kwargs={"endpoint_url": ..., "region_name": ...}``...).
They travel with the `Storage` (`child_storage` keeps them) and to Spark
executors inside task parameters; without options s3 reads the standard
``AWS_*`` variables (s3.py). Local and memory roots take no options and ignore
them, so one set serves a run whose checkpoints live on S3 and whose output is
local. The library never writes credentials into the environment, and
`StorageOptions`' repr shows secret names, not values.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

from statebackend.errors import UsageError
from statebackend.storage.base import (
    CHUNK,
    FileInfo,
    Listing,
    Storage,
    child_storage,
    safe_relpath,
)
from statebackend.storage.checksums import (
    CHECKSUM_ALGORITHM,
    checksum_algorithm,
    checksum_of_bytes,
    crc32_hex,
    format_checksum,
)
from statebackend.storage.local import open_local
from statebackend.storage.memory import open_memory
from statebackend.storage.options import SECRET_OPTIONS, StorageOptions
from statebackend.storage.s3 import open_s3

__all__ = [
    "CHECKSUM_ALGORITHM", "CHUNK", "SECRET_OPTIONS", "FileInfo", "Listing", "Storage",
    "StorageOptions",
    "checksum_algorithm", "checksum_of_bytes", "child_storage", "crc32_hex", "format_checksum",
    "open_storage", "safe_relpath",
]


def open_storage(url: str, **options: Any) -> Storage:
    """Open a storage root. ``url`` is a path, file://, memory:// or s3:// URL.

    ``options`` are fsspec's for the scheme (s3: ``key``, ``secret``, ``token``,
    ``profile``, ``client_kwargs={"endpoint_url": ...}``, ...); without them s3
    reads the standard ``AWS_*`` variables. Local and memory roots ignore them.
    """
    if not url:
        raise UsageError("storage URL is empty")
    parts = urlsplit(url)
    scheme = parts.scheme or "file"
    if scheme == "file" or (len(scheme) == 1 and url[1:3] in (":\\", ":/")):
        return open_local(url, parts.path if parts.scheme else url)
    if scheme == "memory":
        return open_memory(url, parts.netloc, parts.path,
                           parse_qs(parts.query, keep_blank_values=True))
    if scheme in ("s3", "s3a"):
        return open_s3(url, parts.netloc, parts.path, options)
    raise UsageError(f"storage URL {url!r} has unsupported scheme {scheme!r}; "
                     "use file://, memory:// or s3://")
