"""One attempt to write a checkpoint: upload first, then commit `_metadata` or discard.

Every writer of checkpoints uses this one mechanism: a job run
(`statebackend.job.run`), rescale-restore (`statebackend.rescale.executor`) and
in-process checkpoints (`statebackend.checkpoint.snapshot.checkpoint_backends`)::

    attempt = Attempt(store, checkpoint_id)
    ... tasks upload; each Spark task attempt records what it uploaded, with the
        attempt's ``token`` (`record_uploads`:
        chk-<id>/_attempts/<subtask>-<attempt>-<uuid>.json) and the driver adds the
        winners' paths (`add_uploaded`) ...
    attempt.commit(meta, winners)   # verify files + lease, exclusive _metadata,
                                    # then drop losing task attempts' uploads
    attempt.discard()               # or: best-effort removal of every upload

Invariants:

- `commit` writes through `CheckpointStore.commit`, which checks that every
  referenced file exists with its size and that the writer lease is still held,
  and creates `_metadata` exclusively. If that raises, the attempt is discarded
  and the error re-raised: nothing half-committed stays behind.
- `discard` deletes only this attempt's own uploads and records (those its tasks
  recorded with its ``token``), never a folder: since a checkpoint's id is its
  parent's + 1 (lineage.py), a writer paused past its lease and the writer that
  took over may both upload into ``chk-<id>/``, and one's discard must not take
  the other's files. Files of tasks whose result never came back are orphans
  that `ckpt gc` removes after its grace period.
- Only paths under ``shared/`` and ``chk-<id>/`` are ever deleted; what cannot
  be deleted now (storage down) is left to `ckpt gc`, which removes orphans
  after its grace period.
- A crash after the commit leaves attempt records behind; `cleanup_committed`
  (run by the skipped re-run of the same run id) finishes the cleanup.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from statebackend.checkpoint.layout import (
    attempt_record_path,
    attempts_dir,
    belongs_to_attempt,
    checkpoint_dir,
    metadata_path,
)
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CkptError
from statebackend.storage import Storage

log = logging.getLogger(__name__)


def record_uploads(job_storage: Storage, checkpoint_id: int, subtask: int, attempt: int,
                   uploaded: Iterable[str], token: str = "") -> None:
    """Executor side: what one task attempt uploaded, before it returns its handle.
    ``token``: the driver's `Attempt.token` (its discard takes only its own)."""
    record = {"subtask": subtask, "attempt": attempt, "uploaded": list(uploaded),
              "token": token}
    job_storage.write_bytes(
        attempt_record_path(checkpoint_id, subtask, attempt, uuid.uuid4().hex[:8]),
        json.dumps(record).encode())


def attempt_records(job_storage: Storage, checkpoint_id: int,
                    token: str | None = None) -> list[dict[str, Any]]:
    """The readable attempt records of ``checkpoint_id`` (unreadable ones are skipped);
    with ``token``, only that attempt's. Each carries its own ``path``."""
    records = []
    for info in job_storage.walk_files(attempts_dir(checkpoint_id)):
        try:
            rec = json.loads(job_storage.read_bytes(info.path))
        except (CkptError, ValueError):
            continue
        if isinstance(rec, dict) and (token is None or rec.get("token") == token):
            records.append(dict(rec, path=info.path))
    return records


def _recorded_paths(rec: dict[str, Any]) -> list[str]:
    return [p for p in rec.get("uploaded", []) if isinstance(p, str)]


class Attempt:
    """The uploads of one attempt at checkpoint ``checkpoint_id`` of ``store``'s job.

    ``on_discard``: what else the attempt wrote that must go with it (a job run's
    output parts); called first by `discard`, never after a successful commit.
    """

    def __init__(self, store: CheckpointStore, checkpoint_id: int,
                 on_discard: Callable[[], None] | None = None) -> None:
        self.store = store
        self.checkpoint_id = checkpoint_id
        self.uploaded: set[str] = set()
        self.on_discard = on_discard
        self.token = uuid.uuid4().hex[:16]  # tells this attempt's task records from others'

    @property
    def storage(self) -> Storage:
        return self.store.storage

    def add_uploaded(self, paths: Iterable[str]) -> None:
        self.uploaded.update(paths)

    def commit(self, meta: CheckpointMetadata,
               winners: Iterable[tuple[int, int]] | None = None) -> CheckpointMetadata:
        """Verify and write `_metadata`; on failure discard and re-raise; then clean up.

        ``winners``: the (subtask, task attempt) pairs whose handles ``meta`` holds;
        uploads recorded by other task attempts (retried tasks) are removed.
        """
        if meta.checkpoint_id != self.checkpoint_id:
            raise CkptError(f"attempt at checkpoint {self.checkpoint_id} cannot commit "
                            f"checkpoint {meta.checkpoint_id}")
        try:
            self.store.commit(meta)
        except BaseException:
            self.discard()
            raise
        # A crash from here on leaves attempt records: `cleanup_committed` finishes.
        self.cleanup(meta, winners)
        return meta

    def cleanup(self, meta: CheckpointMetadata,
                winners: Iterable[tuple[int, int]] | None = None) -> None:
        """After the commit: drop losing task attempts' uploads and the attempt records."""
        referenced = {f.path for f in meta.files}
        won = set(winners or ())
        losers = {p for rec in attempt_records(self.storage, self.checkpoint_id)
                  if (rec.get("subtask"), rec.get("attempt")) not in won
                  for p in _recorded_paths(rec)
                  if p not in referenced and p not in self.uploaded}
        try:
            self.storage.delete_many(sorted(
                p for p in losers if belongs_to_attempt(p, self.checkpoint_id)))
            self.storage.delete_tree(attempts_dir(self.checkpoint_id))
        except CkptError as exc:
            log.warning("cleanup after checkpoint %s incomplete (%s); `ckpt gc` removes the "
                        "orphans later", self.checkpoint_id, exc)

    def discard(self) -> bool:
        """Best effort: remove what this attempt uploaded; True if nothing is left over."""
        if self.on_discard is not None:
            try:
                self.on_discard()
            except CkptError as exc:
                log.warning("discard of checkpoint %s attempt: %s", self.checkpoint_id, exc)
        paths = set(self.uploaded)
        try:
            records = attempt_records(self.storage, self.checkpoint_id, self.token)
            for rec in records:
                paths.update(_recorded_paths(rec))
            self.storage.delete_many(sorted(
                p for p in paths if belongs_to_attempt(p, self.checkpoint_id)
                and p != metadata_path(self.checkpoint_id)))
            self.storage.delete_many([rec["path"] for rec in records])
            # An attempt folder left empty goes too (race-safe: a folder another writer
            # uploads into is not empty).
            self.storage.remove_empty_dirs(
                {attempts_dir(self.checkpoint_id), checkpoint_dir(self.checkpoint_id)}
                | {p.rsplit("/", n)[0] for p in paths if p.startswith(
                    checkpoint_dir(self.checkpoint_id) + "/") for n in (1, 2)})
        except CkptError as exc:
            log.warning("discard of checkpoint %s attempt incomplete (%s); `ckpt gc` removes "
                        "the orphans later", self.checkpoint_id, exc)
            return False
        return True


def cleanup_committed(store: CheckpointStore, meta: CheckpointMetadata) -> None:
    """Drop the attempt records (and losing attempts' uploads) a crash left after a commit."""
    if not attempt_records(store.storage, meta.checkpoint_id):
        return
    Attempt(store, meta.checkpoint_id).cleanup(meta, winners=())
