"""Checksums of stored files: ``"<algorithm>:<8 hex digits>"``.

New files get CRC32C (hardware accelerated, about 5x zlib's CRC32 here, and S3's
own checksum family); references recorded with ``"crc32:"`` are still verified
with CRC32. Local copies checksum the bytes while the kernel copies them, so a
checksum costs no second read. Both work on open descriptors too, so file://
storage (local.py) copies and checksums files it opened without following a
symlink.
"""

from __future__ import annotations

import mmap
import os
import threading
import zlib
from collections.abc import Callable

import crc32c as _crc32c

from statebackend.errors import MetadataError

CHECKSUM_ALGORITHM = "crc32c"
# Files this large are checksummed in a thread beside the copy (`copy_open_file`).
THREADED_CHECKSUM_BYTES = 8 << 20
CRC_FUNCTIONS: dict[str, Callable[..., int]] = {"crc32": zlib.crc32, "crc32c": _crc32c.crc32c}


def crc32_hex(value: int) -> str:
    return f"crc32:{value & 0xFFFFFFFF:08x}"


def checksum_algorithm(checksum: str) -> str:
    """The algorithm named by a recorded checksum; MetadataError if unknown."""
    algorithm = checksum.split(":", 1)[0] if isinstance(checksum, str) else None
    if algorithm not in CRC_FUNCTIONS:
        raise MetadataError(f"checksum {checksum!r} uses an unknown algorithm; "
                            f"known: {sorted(CRC_FUNCTIONS)}")
    return algorithm


def format_checksum(algorithm: str, value: int) -> str:
    return f"{algorithm}:{value & 0xFFFFFFFF:08x}"


def checksum_of_bytes(data: bytes, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    return format_checksum(algorithm, CRC_FUNCTIONS[algorithm](data))


def copy_local_file(src: str, dst: str, algorithm: str = CHECKSUM_ALGORITHM
                    ) -> tuple[int, int]:
    """Copy one local file; return (size, checksum value) of the bytes copied."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        return copy_open_file(fin.fileno(), fout.fileno(), algorithm, src)


def copy_open_file(fin: int, fout: int, algorithm: str | None = CHECKSUM_ALGORITHM,
                   name: str = "file") -> tuple[int, int]:
    """Copy the open file ``fin`` to ``fout`` (descriptors; the caller opened and
    closes them); return (size, checksum value), the value 0 without ``algorithm``.

    The kernel copies (sendfile) while the same bytes are checksummed through a
    memory map of the page cache: in a second thread for a file of
    `THREADED_CHECKSUM_BYTES` or more (both release the GIL, so the checksum costs
    little wall time on top of a plain copy), after the copy for a smaller one
    (starting a thread costs more than checksumming a few MB with CRC32C, and
    checkpoints hold mostly small files).
    """
    size = os.fstat(fin).st_size
    if size == 0:
        return 0, 0
    if algorithm is None:
        _send_all(fin, fout, size, name)
        return size, 0
    crc_of = CRC_FUNCTIONS[algorithm]
    if size < THREADED_CHECKSUM_BYTES:
        _send_all(fin, fout, size, name)
        return crc_open_file(fin, algorithm)
    with mmap.mmap(fin, 0, access=mmap.ACCESS_READ) as view:
        result: list[int] = []
        checksummer = threading.Thread(target=lambda: result.append(crc_of(view)))
        checksummer.start()
        try:
            _send_all(fin, fout, size, name)
        finally:
            checksummer.join()
    return size, result[0]


def _send_all(fin: int, fout: int, size: int, name: str) -> None:
    offset = 0
    while offset < size:
        sent = os.sendfile(fout, fin, offset, size - offset)
        if sent == 0:
            raise OSError(f"{name} shrank while it was copied")
        offset += sent


def crc_local_file(path: str, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, int]:
    """(size, checksum value) of a local file, read through a memory map."""
    with open(path, "rb") as fh:
        return crc_open_file(fh.fileno(), algorithm)


def crc_open_file(fd: int, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, int]:
    """(size, checksum value) of an open file (a descriptor), read through a memory map."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0, 0
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as view:
        return size, CRC_FUNCTIONS[algorithm](view)
