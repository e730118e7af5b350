"""Leases: time-bounded claims written to ``<job>/leases/<name>.json``.

- The *writer* lease (``leases/writer.json``) makes a job run, rescale or
  savepoint the only writer of a job: it is created exclusively, so a second
  writer is refused with LeaseConflictError naming the holder and the expiry.
- A *hold* lease lists checkpoint ids that retention and GC must keep while a
  restore, rescale or validation reads them.

A lease protects only until ``expires_at``; an expired writer lease may be
taken over (a crashed run must not block the job forever). Lease files are
versioned JSON like every other metadata and are parsed strictly.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from .errors import LeaseConflictError, MetadataError
from .storage import Storage

LEASES_DIR = "leases"
WRITER_LEASE = "writer"
LEASE_FORMAT_VERSION = 1
DEFAULT_TTL_SECONDS = 3600.0


@dataclass(frozen=True)
class Lease:
    name: str
    holder: str
    purpose: str
    checkpoint_ids: tuple[int, ...]
    expires_at: str
    created_at: str

    @property
    def path(self) -> str:
        return f"{LEASES_DIR}/{self.name}.json"

    def expired(self, now: datetime | None = None) -> bool:
        return datetime.fromisoformat(self.expires_at) <= (now or datetime.now(UTC))

    def to_json(self) -> dict:
        return {"format_version": LEASE_FORMAT_VERSION, "name": self.name, "holder": self.holder,
                "purpose": self.purpose, "checkpoint_ids": list(self.checkpoint_ids),
                "expires_at": self.expires_at, "created_at": self.created_at}

    @staticmethod
    def from_bytes(data: bytes, where: str) -> Lease:
        try:
            obj = json.loads(data)
            if obj.get("format_version") != LEASE_FORMAT_VERSION:
                raise ValueError(f"format version {obj.get('format_version')!r}")
            ids = obj["checkpoint_ids"]
            if not all(isinstance(i, int) for i in ids):
                raise ValueError("checkpoint_ids must be integers")
            datetime.fromisoformat(obj["expires_at"])
            return Lease(str(obj["name"]), str(obj["holder"]), str(obj["purpose"]),
                         tuple(ids), obj["expires_at"], str(obj.get("created_at", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MetadataError(f"malformed lease {where}: {exc}") from exc


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _new_lease(name: str, purpose: str, checkpoint_ids: Sequence[int], ttl_seconds: float,
               holder: str | None) -> Lease:
    now = datetime.now(UTC)
    return Lease(name, holder or default_holder(), purpose, tuple(checkpoint_ids),
                 (now + timedelta(seconds=ttl_seconds)).isoformat(), now.isoformat())


def list_leases(job_storage: Storage) -> list[Lease]:
    out = []
    for info in job_storage.walk_files(LEASES_DIR):
        if info.path.endswith(".json"):
            out.append(Lease.from_bytes(job_storage.read_bytes(info.path),
                                        f"{job_storage.url}/{info.path}"))
    return out


def live_leases(job_storage: Storage, now: datetime | None = None) -> list[Lease]:
    return [lease for lease in list_leases(job_storage) if not lease.expired(now)]


def acquire_writer_lease(job_storage: Storage, purpose: str, *, checkpoint_ids: Sequence[int] = (),
                         ttl_seconds: float = DEFAULT_TTL_SECONDS,
                         holder: str | None = None) -> Lease:
    """Become the only writer of the job, or raise LeaseConflictError."""
    lease = _new_lease(WRITER_LEASE, purpose, checkpoint_ids, ttl_seconds, holder)
    for _ in range(2):
        try:
            job_storage.write_exclusive(lease.path, json.dumps(lease.to_json()).encode())
            return lease
        except FileExistsError:
            current = _read(job_storage, lease.path)
            if current is not None and not current.expired():
                raise LeaseConflictError(
                    f"job {job_storage.url} is busy: {current.purpose} by {current.holder} holds "
                    f"the writer lease until {current.expires_at}; wait, or remove "
                    f"{lease.path} if that writer is dead") from None
            job_storage.delete_many([lease.path])  # expired: take over
    raise LeaseConflictError(f"could not take the writer lease of {job_storage.url}")


def acquire_hold(job_storage: Storage, purpose: str, checkpoint_ids: Sequence[int], *,
                 ttl_seconds: float = DEFAULT_TTL_SECONDS, holder: str | None = None) -> Lease:
    """Protect ``checkpoint_ids`` from retention and GC until released or expired."""
    lease = _new_lease(f"hold-{uuid.uuid4().hex}", purpose, checkpoint_ids, ttl_seconds, holder)
    job_storage.write_exclusive(lease.path, json.dumps(lease.to_json()).encode())
    return lease


def release(job_storage: Storage, lease: Lease) -> None:
    current = _read(job_storage, lease.path)
    if current is not None and current.created_at == lease.created_at:
        job_storage.delete_many([lease.path])


@contextmanager
def writer_lease(job_storage: Storage, purpose: str, **kwargs) -> Iterator[Lease]:
    lease = acquire_writer_lease(job_storage, purpose, **kwargs)
    try:
        yield lease
    finally:
        release(job_storage, lease)


@contextmanager
def hold(job_storage: Storage, purpose: str, checkpoint_ids: Sequence[int],
         **kwargs) -> Iterator[Lease]:
    lease = acquire_hold(job_storage, purpose, checkpoint_ids, **kwargs)
    try:
        yield lease
    finally:
        release(job_storage, lease)


def _read(job_storage: Storage, rel: str) -> Lease | None:
    # Only "absent" means no lease: an unreachable store must not look like a free lease.
    data = job_storage.read_bytes_if_exists(rel)
    return None if data is None else Lease.from_bytes(data, f"{job_storage.url}/{rel}")
