"""The commit log of a lineage: commits never fork, none goes missing unnoticed, and a
run is counted once.

Layout (layout.py)::

    <job>/chk-<id>/_metadata                  the commit record (exists iff committed)
    <job>/runs/chain/<block>/<id>-<sha>-<run>.json   its commit-log entry (run-less:
                                              <id>-<sha>.json; <sha>: of the record),
                                              created exclusively right after the record
    <job>/runs/chain/<block>/<id>.retired     written by retention before it deletes
                                              the record
    <job>/runs/<run>.json             the run ledger (runs.py)
    <job>/runs/history/...            run outcomes (runs.py)

Commit protocol (`CheckpointStore.commit` then `log_commit`):

1. A checkpoint's id is its parent's + 1 (1 for a lineage's first record): every
   writer that builds on one parent races for one key (`check_successor`).
2. ``chk-<id>/_metadata`` is created exclusively: one writer wins the id.
3. The commit-log entry is created, unless the log already holds an entry or a
   retired marker for that id: then the id was committed before and retired, and
   the caller is a writer paused since, reusing a freed slot. It deletes what it
   wrote and raises LeaseLostError. The entry records the parent, the run, the
   writer's epoch and the SHA-256 of the record.
4. The run's ledger record (runs.py), then ``_SUCCESS`` of its outputs.

The log is never pruned by lifecycle commands (they never delete ``runs/``); only
``ckpt doctor`` removes entries, and only after writing what it removes and why
into ``runs/repairs/``. It lives in folders of `layout.CHAIN_BLOCK` ids: a writer
lists the blocks from the one before its oldest retained checkpoint's up (one or
two folders), so its cost does not grow with the lineage's age. The ledger of runs
whose commits lie in older blocks is protected by the ledger file and the history.

Failure scenarios (numbered; tests and `ckpt doctor` name them):

1. *Paused writer, lease taken over.* The taker fences first
   (`CheckpointStore.writer`): it commits a carry-forward copy of the latest
   checkpoint at the next id, so the paused writer's create of that id fails.
2. *Paused writer, its id committed and retired meanwhile.* Step 3.
3. *Crash between steps 2 and 3.* A committed id without an entry (``unlogged``):
   the next writer writes the entry from the record (`repair_log`).
4. *Crash between steps 3 and 4, or a deleted ledger file.* The entry names the
   run: the ledger record is rebuilt from it (``ledger-missing``, repaired).
5. *A deleted `_metadata`.* An entry without record nor retired marker
   (``lost``): runs, gc and retention refuse; at the head the safe repair is an
   explicit roll back to the newest intact checkpoint (the lost runs count again),
   in the middle it is to mark it retired (later checkpoints hold its state).
6. *A fork* (made by an earlier release or by hand): a record whose parent is not
   the committed id before it (``fork``), or whose writer epoch is lower than its
   predecessor's (``epoch``): every reader refuses; doctor rolls back to a branch.
7. *Ledger and entry both lost* for a run that the history records as committed
   (``unrecorded-run``): runs refuse; doctor rebuilds the ledger from the history.

Everything here but `read_log`, `log_commit`, `write_entry` and `rebuild_ledger` is
pure. Entries are versioned JSON, parsed strictly; changes must stay
backward-compatible.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from statebackend.checkpoint import layout
from statebackend.checkpoint.metadata import CheckpointMetadata, utc_now_iso
from statebackend.checkpoint.runs import RunRecord, safe_run_name
from statebackend.errors import LeaseLostError, MetadataError, UsageError
from statebackend.storage import Storage

ENTRY_VERSION = 1
SHOWN = 5  # ids named in one problem line
# Problems under which "the latest checkpoint" and "what references a file" are not
# known: readers of latest, gc and retention refuse while one stands.
STATE_PROBLEMS = ("fork", "epoch", "lost", "duplicate", "mismatch")


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_successor(meta: CheckpointMetadata) -> None:
    """Step 1: a commit's id is its parent's + 1 (1 without a parent)."""
    want = (meta.parent or 0) + 1
    if meta.checkpoint_id != want:
        raise UsageError(
            f"checkpoint {meta.checkpoint_id} of job {meta.job!r} cannot be committed on "
            f"{'no parent' if meta.parent is None else f'checkpoint {meta.parent}'}: a "
            f"checkpoint's id is its parent's + 1 ({want}), so that two writers building "
            "on one parent race for one id")


# -- entries ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ChainEntry:
    """One commit of the lineage, as the log records it."""

    checkpoint_id: int
    parent: int | None
    kind: str
    epoch: int
    digest: str                 # SHA-256 of the `_metadata` bytes
    created_at: str
    run: RunRecord | None = None  # the ledger record of the commit's run

    @property
    def path(self) -> str:
        return layout.chain_entry_path(
            self.checkpoint_id, self.digest,
            safe_run_name(self.run.run_id) if self.run else None)

    @staticmethod
    def of(meta: CheckpointMetadata, data: bytes) -> ChainEntry:
        return ChainEntry(meta.checkpoint_id, meta.parent, meta.kind, meta.epoch,
                          digest_of(data), meta.created_at,
                          RunRecord.of(meta) if meta.run_id is not None else None)

    def to_bytes(self) -> bytes:
        return json.dumps({
            "format_version": ENTRY_VERSION, "checkpoint_id": self.checkpoint_id,
            "parent": self.parent, "kind": self.kind, "epoch": self.epoch,
            "sha256": self.digest, "created_at": self.created_at,
            "run": self.run.to_json() if self.run else None}, sort_keys=True).encode()

    @staticmethod
    def from_bytes(data: bytes, where: str) -> ChainEntry:
        try:
            obj: Any = json.loads(data)
            if not isinstance(obj, dict) or obj.get("format_version") != ENTRY_VERSION:
                raise ValueError("unknown format version")
            cid, parent, epoch = obj["checkpoint_id"], obj["parent"], obj["epoch"]
            if not (_natural(cid) and cid >= 1 and (parent is None or _natural(parent))
                    and _natural(epoch)):
                raise ValueError("checkpoint_id, parent and epoch must be integers")
            digest, kind = obj["sha256"], obj["kind"]
            if not (isinstance(digest, str) and len(digest) == 64 and isinstance(kind, str)):
                raise ValueError("sha256 and kind must be strings")
            run = obj.get("run")
            return ChainEntry(cid, parent, kind, epoch, digest, str(obj.get("created_at", "")),
                              RunRecord.from_json(run, where) if run is not None else None)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise MetadataError(f"malformed commit-log entry {where}: {exc}") from exc


def _natural(value: object) -> bool:
    return type(value) is int and value >= 0


# -- the log as names ------------------------------------------------------------------
@dataclass(frozen=True)
class LogListing:
    """What three listings tell of a lineage's bookkeeping (names only, no reads)."""

    entries: Mapping[int, tuple[str, ...]]     # id -> its entries' paths (normally one)
    entry_runs: Mapping[int, str | None]       # id -> safe run name of its (first) entry
    retired: frozenset[int]
    ledger: frozenset[str]                     # safe run names with a ledger record
    history: Mapping[str, str]                 # safe run name -> newest outcome
    digests: Mapping[int, str] = field(default_factory=dict)  # id -> its record's digest

    @property
    def logged_runs(self) -> frozenset[str]:
        return frozenset(r for r in self.entry_runs.values() if r)

    def entry_of_run(self, safe_run: str) -> int | None:
        """The id whose log entry names run ``safe_run`` (newest), or None."""
        found = [cid for cid, run in self.entry_runs.items() if run == safe_run]
        return max(found) if found else None


    def replaced(self, checkpoint_id: int, digest: str) -> bool:
        """Whether a record of SHA-256 ``digest`` is not the one its log entry was written
        for."""
        logged = self.digests.get(checkpoint_id)
        return logged is not None and not digest.startswith(logged)


EMPTY_LOG = LogListing({}, {}, frozenset(), frozenset(), {})


def parse_log_names(chain_names: Iterable[str], ledger_names: Iterable[str] = (),
                    history_names: Iterable[str] = ()) -> LogListing:
    """Pure: the `LogListing` of the file names in blocks of ``runs/chain/``, and of the
    names under ``runs/`` and ``runs/history/`` (history names in time order: the last
    outcome of a run wins)."""
    entries: dict[int, list[str]] = {}
    runs: dict[int, str | None] = {}
    digests: dict[int, str] = {}
    retired: set[int] = set()
    for name in sorted(chain_names):
        parsed = layout.chain_name_of(name)
        if parsed is None:
            continue
        cid, digest, run = parsed
        if digest is None:
            retired.add(cid)
            continue
        entries.setdefault(cid, []).append(f"{layout.chain_block_dir(cid)}/{name}")
        runs.setdefault(cid, run)
        digests.setdefault(cid, digest)
    ledger = frozenset(n[:-len(layout.LEASE_SUFFIX)] for n in ledger_names
                       if n.endswith(layout.LEASE_SUFFIX) and not n.startswith("."))
    history: dict[str, str] = {}
    for name in sorted(history_names):
        parsed_h = layout.history_name_of(name)
        if parsed_h is not None and parsed_h[1] in ("committed", "rolledback"):
            history[parsed_h[0]] = parsed_h[1]
    return LogListing({k: tuple(v) for k, v in entries.items()}, runs, frozenset(retired),
                      ledger, history, digests)


def read_log(job_storage: Storage, from_id: int | None = None) -> LogListing:
    """List the log's blocks (from the one before ``from_id``'s; None: all), ``runs/``
    and ``runs/history``."""
    blocks = sorted(b for name in job_storage.list_dir(layout.CHAIN_DIR)
                    if (b := layout.chain_block_of(name)) is not None)
    if from_id is not None:
        first = from_id // layout.CHAIN_BLOCK - 1
        blocks = [b for b in blocks if b >= first]
    names = [n for b in blocks for n in job_storage.list_dir(
        layout.chain_block_dir(b * layout.CHAIN_BLOCK))]
    return parse_log_names(names, job_storage.list_dir(layout.RUNS_DIR),
                           job_storage.list_dir(layout.HISTORY_DIR))


# -- problems --------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One thing wrong with a lineage: what, which ids, the one-line message, the repair."""

    kind: str            # fork | epoch | lost | duplicate | unlogged | ledger-missing
    #                      | unrecorded-run | malformed | mismatch
    ids: tuple[int, ...]
    message: str
    repair: str          # the safe repair, in words and as a `ckpt doctor` call
    blocking: bool       # runs, gc and retention refuse while it stands
    runs: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "checkpoints": list(self.ids), "message": self.message,
                "repair": self.repair, "blocking": self.blocking, "runs": list(self.runs)}


def find_forks(ids: Sequence[int], parents: Mapping[int, int | None],
               epochs: Mapping[int, int] | None = None) -> list[Problem]:
    """Pure: forks among committed ``ids`` (ascending), judged on the records whose
    parent is known. A record must build on the committed id right before it, or on a
    retired one above it (a gap retention left); one that builds on an earlier
    committed id, or starts a lineage of its own, is on another branch. Epochs (0:
    unknown) never go down from one record to the next."""
    out: list[Problem] = []
    epochs = epochs or {}
    for before, cid in zip(ids, ids[1:], strict=False):
        if cid not in parents:
            continue
        parent = parents[cid]
        if parent is None or parent < before:
            base = "no parent" if parent is None else f"checkpoint {parent}"
            out.append(Problem(
                "fork", (before, cid),
                f"the lineage has forked: checkpoint {cid} builds on {base}, not on "
                f"checkpoint {before} committed before it (chk-{before}/_metadata and "
                f"chk-{cid}/_metadata are on different branches)",
                f"keep one branch: `ckpt doctor --rollback-to {before} --reason ...` or "
                f"`--rollback-to {cid}` (the other branch's runs count again)", True))
        e_before, e = epochs.get(before, 0), epochs.get(cid, 0)
        if e_before and e and e < e_before:
            out.append(Problem(
                "epoch", (before, cid),
                f"checkpoint {cid} was committed by writer epoch {e} after checkpoint "
                f"{before} of epoch {e_before}: a writer that had lost its lease committed",
                f"`ckpt doctor --rollback-to {before} --reason ...`", True))
    return out


def check_log(committed: Sequence[int], log: LogListing) -> list[Problem]:
    """Pure: what the names say about the committed ids (ascending): lost, duplicate and
    unlogged commits, ledger records to rebuild, runs only the history remembers."""
    out: list[Problem] = []
    have = set(committed)
    newest = committed[-1] if committed else 0
    lost = sorted(cid for cid in log.entries if cid not in have and cid not in log.retired)
    head = [cid for cid in lost if cid > newest]
    middle = [cid for cid in lost if cid < newest]
    if head:
        runs = tuple(r for cid in head if (r := log.entry_runs.get(cid)))
        target = f"--rollback-to {newest}" if committed else "a fresh start (delete the job)"
        out.append(Problem(
            "lost", tuple(head),
            f"checkpoint(s) {_ids(head)} were committed (commit log "
            f"{log.entries[head[0]][0]}) but chk-{head[0]}/_metadata is missing: the newest "
            f"intact checkpoint is {newest or 'none'}, and runs refuse to start on it",
            f"restore the record from a backup, or roll back explicitly: `ckpt doctor "
            f"{target} --reason ...` (runs {', '.join(runs[:SHOWN]) or 'none'} then count "
            "again)", True, runs))
    if middle:
        out.append(Problem(
            "lost", tuple(middle),
            f"checkpoint(s) {_ids(middle)} were committed and not retired, but their "
            f"_metadata is missing (commit log {log.entries[middle[0]][0]}); later "
            "checkpoints hold their state",
            "`ckpt doctor --repair` marks them retired (their private files then go with gc)",
            True))
    dup = sorted(cid for cid, names in log.entries.items() if len(names) > 1)
    if dup:
        out.append(Problem(
            "duplicate", tuple(dup),
            f"checkpoint(s) {_ids(dup)} have two commit-log entries "
            f"({', '.join(log.entries[dup[0]])}): two writers committed the same id",
            f"roll back below it: `ckpt doctor --rollback-to {dup[0] - 1} --reason ...`",
            True))
    unlogged = [cid for cid in committed if cid not in log.entries]
    if unlogged and log.entries:
        # a lineage without any entry was written before the log: backfilled quietly
        out.append(Problem(
            "unlogged", tuple(unlogged),
            f"checkpoint(s) {_ids(unlogged)} have no commit-log entry (a crash right after "
            "the commit)", "the next run or `ckpt doctor --repair` writes them", False))
    missing = sorted((cid, run) for cid, run in log.entry_runs.items()
                     if run and run not in log.ledger)
    if missing:
        out.append(Problem(
            "ledger-missing", tuple(cid for cid, _ in missing),
            f"run(s) {', '.join(r for _, r in missing[:SHOWN])} have a commit-log entry but "
            "no ledger record (runs/<run>.json)",
            "the next run or `ckpt doctor --repair` rebuilds them from the log", False,
            tuple(r for _, r in missing)))
    known = log.ledger | log.logged_runs
    forgotten = sorted(r for r, outcome in log.history.items()
                       if outcome == "committed" and r not in known)
    if forgotten:
        out.append(Problem(
            "unrecorded-run", (),
            f"run(s) {', '.join(forgotten[:SHOWN])} are recorded as committed in "
            f"{layout.HISTORY_DIR}/ but neither the ledger nor the commit log has them: a "
            "re-run would count their input twice",
            "`ckpt doctor --repair` rebuilds their ledger records from the history", True,
            tuple(forgotten)))
    return out


def check_digests(log: LogListing, digests: Mapping[int, str], latest: int | None
                  ) -> list[Problem]:
    """Pure: committed records (id -> SHA-256 of their bytes) that are not the record their
    log entry was written for: replaced after the commit (flipped, edited). At the head the
    lineage's latest is unknown (roll back); below it, later checkpoints hold its state."""
    out = []
    for cid in sorted(digests):
        if log.replaced(cid, digests[cid]):
            head = cid == latest
            out.append(Problem(
                "mismatch", (cid,),
                f"chk-{cid}/_metadata is not the record its commit-log entry "
                f"({log.entries[cid][0]}) was written for: replaced after its commit",
                f"`ckpt doctor --rollback-to {cid - 1} --reason ...`, or restore the record"
                if head else "`ckpt doctor --repair` quarantines it (later checkpoints hold "
                             "its state)", True))
    return out


def _ids(ids: Sequence[int]) -> str:
    shown = ", ".join(map(str, ids[:SHOWN]))
    return shown + (f" and {len(ids) - SHOWN} more" if len(ids) > SHOWN else "")


# -- writing ---------------------------------------------------------------------------
def log_commit(job_storage: Storage, meta: CheckpointMetadata, data: bytes) -> ChainEntry:
    """Step 3 of the protocol, right after ``chk-<id>/_metadata`` was created from
    ``data``. LeaseLostError (after deleting what it wrote) when the id's slot was used
    before (scenario 2)."""
    entry = ChainEntry.of(meta, data)
    taken = [p for p in slot(job_storage, meta.checkpoint_id) if p != entry.path]
    if not taken:
        try:
            job_storage.write_exclusive(entry.path, entry.to_bytes())
        except FileExistsError:
            current = job_storage.read_bytes_if_exists(entry.path)
            if current is None or ChainEntry.from_bytes(current, entry.path).digest \
                    != entry.digest:
                taken = [entry.path]
        else:
            # a paused writer of the same id may have raced us between listing and create
            taken = [p for p in slot(job_storage, meta.checkpoint_id) if p != entry.path]
            if taken:
                job_storage.delete_many([entry.path])
    if taken:
        job_storage.delete_many([layout.metadata_path(meta.checkpoint_id)])
        raise LeaseLostError(
            f"checkpoint {meta.checkpoint_id} of job {meta.job!r} was committed before by "
            f"another writer ({taken[0]}); this writer was paused past its lease and must "
            "not commit: its record is withdrawn, run it again")
    return entry


def retired_path(checkpoint_id: int) -> str:
    return layout.retired_marker_path(checkpoint_id)


def slot(job_storage: Storage, checkpoint_id: int) -> list[str]:
    """Paths of the log holding ``checkpoint_id``: entries and a retired marker."""
    prefix = f"{checkpoint_id:0{layout.CHAIN_ID_DIGITS}d}"
    block = layout.chain_block_dir(checkpoint_id)
    return [f"{block}/{n}" for n in job_storage.list_dir(block)
            if n.startswith(prefix) and (parsed := layout.chain_name_of(n)) is not None
            and parsed[0] == checkpoint_id]


def write_entry(job_storage: Storage, entry: ChainEntry) -> None:
    """Write a missing entry (repairs: scenario 3); an existing one is left as it is."""
    try:
        job_storage.write_exclusive(entry.path, entry.to_bytes())
    except FileExistsError:
        pass


def mark_retired(job_storage: Storage, checkpoint_ids: Iterable[int]) -> None:
    """Retention's step before deleting the records of ``checkpoint_ids``."""
    for cid in checkpoint_ids:
        job_storage.write_bytes(layout.retired_marker_path(cid),
                                json.dumps({"retired_at": utc_now_iso()}).encode())


def read_entry(job_storage: Storage, path: str) -> ChainEntry | None:
    data = job_storage.read_bytes_if_exists(path)
    return None if data is None else ChainEntry.from_bytes(data, job_storage.url_of(path))


def entry_of(job_storage: Storage, log: LogListing, checkpoint_id: int) -> ChainEntry | None:
    """The (first) log entry of ``checkpoint_id``, read; None if it has none."""
    paths = log.entries.get(checkpoint_id)
    return read_entry(job_storage, paths[0]) if paths else None


@dataclass(frozen=True)
class RepairRecord:
    """What `ckpt doctor` changed and why: written before it changes anything."""

    action: str
    reason: str
    details: dict[str, Any] = field(default_factory=dict)

    def write(self, job_storage: Storage) -> str:
        stamp = "".join(c for c in utc_now_iso() if c.isdigit())[:20]
        path = layout.repair_record_path(stamp, self.action)
        job_storage.write_exclusive(path, json.dumps(
            {"format_version": 1, "action": self.action, "reason": self.reason,
             "at": utc_now_iso(), **self.details}, sort_keys=True, default=str).encode())
        return path
