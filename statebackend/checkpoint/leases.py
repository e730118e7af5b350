"""Leases: time-bounded claims written to ``<job>/leases/<name>.json`` (layout.py).

This module is the one reader of lease files (`read_lease_file`, `list_leases`,
`live_leases`); the lifecycle registry reads the leases of its listing with it.

- The *writer* lease (``leases/writer.json``) makes a job run, rescale or
  savepoint the only writer of a job: it is created exclusively, so a second
  writer is refused with LeaseConflictError naming the holder and the expiry.
- A *hold* lease lists checkpoint ids that retention and GC must keep while a
  restore, rescale or validation reads them.

Timing (docs/lifecycle.md): a lease lives ``ttl_seconds`` (default 60 s, env
``CKPT_LEASE_TTL_SECONDS``) and the `writer_lease` / `hold` context managers
renew it every ``heartbeat_seconds`` (default ttl / 4, env
``CKPT_LEASE_HEARTBEAT_SECONDS``) from a daemon thread. A holder that dies
stops renewing, so its lease is stale at most one TTL after its last renewal
and may then be taken over.

Safety of renewal and take-over (numbered failure scenarios; tests name them):

1. *Run outlives the TTL.* The heartbeat keeps ``expires_at`` in the future, so
   GC and retention keep protecting the attempt (issue 10, defect 2).
2. *Killed holder.* No renewal: after the TTL the next writer takes over
   (defect 3: the job is blocked for at most one TTL, not an hour).
3. *Two takers race for one stale lease.* Each lease has a unique ``token``.
   A taker first creates ``leases/.takeover-<digest of the stale token>``
   exclusively: only one taker per stale lease gets it; the other gets
   LeaseConflictError. The winner re-reads the lease and deletes it only if it
   is still the stale one, then creates its own exclusively (a fresh writer
   racing it loses that create). A claim left by a taker that crashed inside
   that millisecond window is stale after the taker's lease TTL (at most
   ``CLAIM_STALE_SECONDS``), recorded in the claim, and removed.
4. *Holder paused past its expiry, then taken over.* Renewal re-reads the lease
   first: another token (or no file) means the lease is *lost*; so does a
   renewal that comes after our own ``expires_at`` (someone may have acted on
   the expiry). A lost holder stops renewing and `HeldLease.ensure_held` raises
   LeaseLostError; `CheckpointStore.commit` calls it (through `held_writer_leases`)
   right before writing ``_metadata``, so a lost writer never commits.
5. *Storage briefly unreachable.* A failed renewal is logged and retried at the
   next beat; only a lapse (scenario 4) marks the lease lost.

6. *Paused writer committing after a take-over.* Checking the lease and writing
   ``_metadata`` cannot be one atomic step on file:// or S3, so the lease alone
   cannot stop a writer paused between the two. The commit protocol does
   (`statebackend.checkpoint.lineage`): a checkpoint's id is its parent's + 1 and
   both ``_metadata`` and its commit-log entry are created exclusively, and a writer
   that takes over a stale lease first commits a *fence* (`CheckpointStore.writer`)
   at the next id, so the paused writer's commit finds its slot taken. A taker
   learns it took over from `HeldLease.taken_over`.

Every acquisition carries a fencing ``epoch``: the writer's, raised above the
lineage's newest commit and above a lease it took over (`HeldLease.set_epoch`);
commits record it, and readers check that epochs never go down along the chain.

Lease files are versioned JSON like every other metadata and are parsed
strictly (times must carry a timezone; a corrupt file is refused in one line
that says how to clear it); ``token`` and ``epoch`` are optional keys (lease
files written before them parse, and older readers ignore them), so the format
version stays 1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from statebackend import settings
from statebackend.checkpoint.layout import LEASES_DIR, claim_path, is_lease_file, lease_path
from statebackend.errors import LeaseConflictError, LeaseLostError, MetadataError
from statebackend.storage import Storage

WRITER_LEASE = "writer"
LEASE_FORMAT_VERSION = 1
DEFAULT_TTL_SECONDS = 60.0
HEARTBEATS_PER_TTL = 4
TTL_ENV = "CKPT_LEASE_TTL_SECONDS"
HEARTBEAT_ENV = "CKPT_LEASE_HEARTBEAT_SECONDS"
CLAIM_STALE_SECONDS = 30.0
MAX_EPOCH = 2**53

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """One lease record. Changes must stay backward-compatible (optional keys only)."""

    name: str
    holder: str
    purpose: str
    checkpoint_ids: tuple[int, ...]
    expires_at: str
    created_at: str
    token: str = ""  # unique per acquisition; "" in lease files written before tokens
    epoch: int = 0   # the holder's fencing epoch (0: not set, or written before epochs)

    @property
    def path(self) -> str:
        return lease_path(self.name)

    @property
    def identity(self) -> str:
        """What tells two acquisitions of the same lease name apart."""
        return self.token or f"{self.holder}@{self.created_at}"

    def expired(self, now: datetime | None = None) -> bool:
        return datetime.fromisoformat(self.expires_at) <= (now or datetime.now(UTC))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": LEASE_FORMAT_VERSION, "name": self.name, "holder": self.holder,
            "purpose": self.purpose, "checkpoint_ids": list(self.checkpoint_ids),
            "expires_at": self.expires_at, "created_at": self.created_at}
        if self.token:
            out["token"] = self.token
        if self.epoch:
            out["epoch"] = self.epoch
        return out

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json()).encode()

    @staticmethod
    def from_bytes(data: bytes, where: str) -> Lease:
        """Parse a lease file strictly; MetadataError (one line, naming the file and how to
        clear it) on anything off."""
        try:
            obj = json.loads(data)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            if obj.get("format_version") != LEASE_FORMAT_VERSION:
                raise ValueError(f"format version {obj.get('format_version')!r}")
            ids = obj["checkpoint_ids"]
            if not isinstance(ids, list) or not all(
                    type(i) is int and 1 <= i < MAX_EPOCH for i in ids):
                raise ValueError("checkpoint_ids must be a list of checkpoint ids")
            for key in ("name", "holder", "purpose"):
                if not isinstance(obj[key], str) or "\x00" in obj[key]:
                    raise ValueError(f"{key} must be a string")
            expires_at = _aware_time(obj["expires_at"], "expires_at")
            created_at = obj.get("created_at", "")
            if created_at:
                _aware_time(created_at, "created_at")
            token = obj.get("token", "")
            if not isinstance(token, str):
                raise ValueError("token must be a string")
            epoch = obj.get("epoch", 0)
            if type(epoch) is not int or not 0 <= epoch < MAX_EPOCH:
                raise ValueError(f"epoch {epoch!r} must be an integer >= 0")
            return Lease(obj["name"], obj["holder"], obj["purpose"], tuple(ids), expires_at,
                         str(created_at), token, epoch)
        except RecursionError as exc:
            raise MetadataError(f"malformed lease {where}: JSON nested too deeply; "
                                f"{clear_hint(where)}") from exc
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MetadataError(f"malformed lease {where}: {exc}; {clear_hint(where)}") from exc


def clear_hint(where: str) -> str:
    """How to clear the lease file at ``where`` (its name is the file's, without .json)."""
    name = where.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json")
    return (f"if no writer of this job is running, clear it with `ckpt doctor --clear-lease "
            f"{name}` (see `ckpt doctor`)")


def _aware_time(value: object, key: str) -> str:
    """An ISO time with a timezone (naive times would compare with aware ones and crash)."""
    if not isinstance(value, str):
        raise ValueError(f"{key} must be an ISO time string")
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise ValueError(f"{key} {value!r} has no timezone")
    return value


def default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def lease_timing(ttl_seconds: float | None = None,
                 heartbeat_seconds: float | None = None) -> tuple[float, float]:
    """(ttl, heartbeat) from the arguments, else the environment, else the defaults
    (`statebackend.settings.lease_timing`: finite, heartbeat in [0.05 s, ttl/2])."""
    return settings.lease_timing(ttl_seconds, heartbeat_seconds)


def _new_lease(name: str, purpose: str, checkpoint_ids: Sequence[int], ttl_seconds: float,
               holder: str | None) -> Lease:
    now = datetime.now(UTC)
    return Lease(name, holder or default_holder(), purpose, tuple(checkpoint_ids),
                 (now + timedelta(seconds=ttl_seconds)).isoformat(), now.isoformat(),
                 uuid.uuid4().hex)


def read_lease_file(job_storage: Storage, rel: str) -> Lease | None:
    """The lease in ``rel``, strictly parsed; None if it is gone (released meanwhile).
    Only "absent" means no lease: an unreachable store must not look like a free lease."""
    data = job_storage.read_bytes_if_exists(rel)
    return None if data is None else Lease.from_bytes(data, job_storage.url_of(rel))


def list_leases(job_storage: Storage) -> list[Lease]:
    """Every lease of a job root, live or expired; leases released meanwhile are skipped."""
    paths = [p for name in job_storage.list_dir(LEASES_DIR)
             if is_lease_file(p := f"{LEASES_DIR}/{name}")]
    return [x for x in (read_lease_file(job_storage, p) for p in paths) if x is not None]


def live_leases(job_storage: Storage, now: datetime | None = None) -> list[Lease]:
    return [lease for lease in list_leases(job_storage) if not lease.expired(now)]


def acquire_writer_lease(job_storage: Storage, purpose: str, *, checkpoint_ids: Sequence[int] = (),
                         ttl_seconds: float | None = None,
                         holder: str | None = None) -> Lease:
    """Become the only writer of the job, or raise LeaseConflictError (no heartbeat:
    use `writer_lease` to keep it alive)."""
    return _acquire_writer(job_storage, purpose, checkpoint_ids, ttl_seconds, holder)[0]


def _acquire_writer(job_storage: Storage, purpose: str, checkpoint_ids: Sequence[int],
                    ttl_seconds: float | None, holder: str | None
                    ) -> tuple[Lease, Lease | None]:
    """(our lease, the expired lease we took over or None)."""
    if ttl_seconds is None:
        ttl_seconds = lease_timing()[0]
    lease = _new_lease(WRITER_LEASE, purpose, checkpoint_ids, ttl_seconds, holder)
    taken: Lease | None = None
    # at most: void a crashed taker's claim, remove the stale lease, create ours
    for _ in range(4):
        if taken is not None:  # the epoch a stale holder may have used is spent
            lease = replace(lease, epoch=max(lease.epoch, taken.epoch + 1))
        try:
            job_storage.write_exclusive(lease.path, lease.to_bytes())
            return lease, taken
        except FileExistsError:
            pass
        current = read_lease_file(job_storage, lease.path)
        if current is None:
            continue  # released meanwhile: try again
        if not current.expired():
            raise LeaseConflictError(
                f"job {job_storage.url} is busy: {current.purpose} by {current.holder} holds "
                f"the writer lease until {current.expires_at}; wait, or remove "
                f"{lease.path} if that writer is dead") from None
        if _take_over(job_storage, current, ttl_seconds):
            taken = current
    raise LeaseConflictError(f"could not take the writer lease of {job_storage.url}: other "
                             "writers keep taking it; retry later")


def _take_over(job_storage: Storage, stale: Lease, ttl_seconds: float) -> bool:
    """Remove the expired ``stale`` lease, unless another taker is doing so (scenario 3);
    True if this call removed it.

    The claim expires with the taker's TTL (capped): a job tuned to a short TTL
    is not blocked longer by a crashed taker than by a crashed writer."""
    digest = hashlib.sha256(stale.identity.encode()).hexdigest()[:32]
    claim = claim_path(digest)
    now = datetime.now(UTC)
    expires = now + timedelta(seconds=min(ttl_seconds, CLAIM_STALE_SECONDS))
    try:
        job_storage.write_exclusive(claim, json.dumps(
            {"holder": default_holder(), "created_at": now.isoformat(),
             "expires_at": expires.isoformat()}).encode())
    except FileExistsError:
        data = job_storage.read_bytes_if_exists(claim)
        if data is None:
            # That taker finished meanwhile: look at the lease again. Deleting the claim
            # path here could remove a third taker's new claim (two takers at once).
            return False
        if _claim_is_stale(data, now):
            job_storage.delete_many([claim])  # its taker crashed: the caller retries
            return False
        raise LeaseConflictError(
            f"job {job_storage.url}: another writer is taking over the expired writer lease "
            f"of {stale.purpose} by {stale.holder}; retry later") from None
    try:
        current = read_lease_file(job_storage, stale.path)
        if current is not None and current.identity == stale.identity:
            job_storage.delete_many([stale.path])
            return True
        return False
    finally:
        job_storage.delete_many([claim])


def _claim_is_stale(data: bytes, now: datetime) -> bool:
    try:
        claim_record = json.loads(data)
        created = datetime.fromisoformat(claim_record["created_at"])
        # a claim written before expires_at was recorded lives the longest
        expires = datetime.fromisoformat(claim_record.get("expires_at") or (
            created + timedelta(seconds=CLAIM_STALE_SECONDS)).isoformat())
    except (ValueError, KeyError, TypeError, AttributeError):
        return True  # unreadable claim: nobody can finish it
    return now > expires


def acquire_hold(job_storage: Storage, purpose: str, checkpoint_ids: Sequence[int], *,
                 ttl_seconds: float | None = None, holder: str | None = None) -> Lease:
    """Protect ``checkpoint_ids`` from retention and GC until released or expired
    (no heartbeat: use `hold` to keep it alive)."""
    if ttl_seconds is None:
        ttl_seconds = lease_timing()[0]
    lease = _new_lease(f"hold-{uuid.uuid4().hex}", purpose, checkpoint_ids, ttl_seconds, holder)
    job_storage.write_exclusive(lease.path, lease.to_bytes())
    return lease


def release(job_storage: Storage, lease: Lease | HeldLease) -> None:
    """Delete the lease file if it is still this acquisition's."""
    record = lease.lease if isinstance(lease, HeldLease) else lease
    current = read_lease_file(job_storage, record.path)
    if current is not None and current.identity == record.identity:
        job_storage.delete_many([record.path])


class HeldLease:
    """A lease this process holds, renewed by a heartbeat thread (scenarios 1, 4, 5).

    Attribute reads not defined here (``name``, ``checkpoint_ids``, ``expires_at``
    ...) go to the current `Lease` record.
    """

    def __init__(self, storage: Storage, lease: Lease, *, ttl_seconds: float,
                 heartbeat_seconds: float, taken_over: Lease | None = None) -> None:
        self.storage = storage
        self.lease = lease
        # the expired lease this acquisition removed: its holder may still be paused
        # mid-commit, so the new writer fences it (`CheckpointStore.writer`)
        self.taken_over = taken_over
        self.ttl_seconds = ttl_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.renewals = 0
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr == "lease":  # not set yet: do not recurse
            raise AttributeError(attr)
        return getattr(self.lease, attr)

    def __repr__(self) -> str:
        return f"HeldLease({self.storage.url}/{self.lease.path}, lost={self._lost!r})"

    @property
    def lost(self) -> str | None:
        """Why the lease was lost, or None while it is held."""
        return self._lost

    def renew(self, now: datetime | None = None) -> bool:
        """Re-read, then push ``expires_at`` one TTL ahead; False once the lease is lost."""
        with self._lock:
            now = now or datetime.now(UTC)
            if self._lost is None:
                self._check(now)
            if self._lost is not None:
                return False
            renewed = replace(self.lease,
                              expires_at=(now + timedelta(seconds=self.ttl_seconds)).isoformat())
            # readers (GC, takers) must never see half a lease
            self.storage.write_atomic(self.lease.path, renewed.to_bytes())
            self.lease = renewed
            self.renewals += 1
            return True

    def set_epoch(self, epoch: int) -> None:
        """Record our fencing epoch in the lease file (raised, never lowered); LeaseLostError
        if the lease was lost meanwhile."""
        self.ensure_held()
        with self._lock:
            if epoch > self.lease.epoch:
                updated = replace(self.lease, epoch=epoch)
                self.storage.write_atomic(self.lease.path, updated.to_bytes())
                self.lease = updated

    def ensure_held(self) -> None:
        """Raise LeaseLostError unless the lease is still ours and unexpired (re-read now)."""
        with self._lock:
            if self._lost is None:
                self._check(datetime.now(UTC))
            if self._lost is not None:
                raise LeaseLostError(
                    f"the {self.lease.name} lease {self.storage.url}/{self.lease.path} of "
                    f"{self.lease.purpose} was lost ({self._lost}); this attempt must not "
                    "commit: run it again")

    def _check(self, now: datetime) -> None:
        current = read_lease_file(self.storage, self.lease.path)
        if current is None:
            self._lost = "its file was removed"
        elif current.identity != self.lease.identity:
            self._lost = (f"taken over by {current.purpose} of {current.holder} at "
                          f"{current.created_at}")
        elif self.lease.expired(now):
            self._lost = f"not renewed before it expired at {self.lease.expires_at}"
        if self._lost is not None:
            log.warning("lease %s/%s lost: %s", self.storage.url, self.lease.path, self._lost)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._beat, name=f"ckpt-lease-{self.lease.name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                if not self.renew():
                    return
            except Exception as exc:  # noqa: BLE001 - retry at the next beat (scenario 5)
                log.warning("renewing lease %s/%s failed, retrying in %g s: %s",
                            self.storage.url, self.lease.path, self.heartbeat_seconds, exc)

    def close(self) -> None:
        """Stop renewing; delete the lease file if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._lost is None:
                release(self.storage, self.lease)


# Leases held by the code running in this context (thread / task): commit checks them.
_HELD: ContextVar[tuple[HeldLease, ...]] = ContextVar("ckpt_held_leases", default=())


def held_writer_leases(job_storage: Storage) -> tuple[HeldLease, ...]:
    """Writer leases of ``job_storage`` held by the current context (see `writer_lease`)."""
    return tuple(h for h in _HELD.get()
                 if h.lease.name == WRITER_LEASE and h.storage.url == job_storage.url)


@contextmanager
def _renewed(job_storage: Storage, lease: Lease, ttl: float, beat: float,
             taken_over: Lease | None = None) -> Iterator[HeldLease]:
    held = HeldLease(job_storage, lease, ttl_seconds=ttl, heartbeat_seconds=beat,
                     taken_over=taken_over)
    held.start()
    token = _HELD.set(_HELD.get() + (held,))
    try:
        yield held
    finally:
        _HELD.reset(token)
        held.close()


@contextmanager
def writer_lease(job_storage: Storage, purpose: str, *, checkpoint_ids: Sequence[int] = (),
                 ttl_seconds: float | None = None, heartbeat_seconds: float | None = None,
                 holder: str | None = None) -> Iterator[HeldLease]:
    """Hold the writer lease, renewed by a heartbeat, for the ``with`` block.

    `CheckpointStore.commit` inside the block raises LeaseLostError if the lease
    was lost (scenario 4)."""
    ttl, beat = lease_timing(ttl_seconds, heartbeat_seconds)
    lease, taken = _acquire_writer(job_storage, purpose, checkpoint_ids, ttl, holder)
    with _renewed(job_storage, lease, ttl, beat, taken) as held:
        yield held


@contextmanager
def hold(job_storage: Storage, purpose: str, checkpoint_ids: Sequence[int], *,
         ttl_seconds: float | None = None, heartbeat_seconds: float | None = None,
         holder: str | None = None) -> Iterator[HeldLease]:
    """Hold ``checkpoint_ids`` against retention and GC, renewed by a heartbeat."""
    ttl, beat = lease_timing(ttl_seconds, heartbeat_seconds)
    lease = acquire_hold(job_storage, purpose, checkpoint_ids, ttl_seconds=ttl, holder=holder)
    with _renewed(job_storage, lease, ttl, beat) as held:
        yield held
