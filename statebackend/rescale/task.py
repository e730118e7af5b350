"""One new subtask of a rescale: restore the base, clip it, import the rest, upload.

`run_rescale_task` builds new subtask j from its frozen `RescaleTask` (the plan's
`SubtaskPlan` plus the source's handles), in whichever runner the driver chose
(this process's threads or a Spark task; statebackend.rescale.executor):

1. the imports (download, open read-only, export their part of R_j to one SST per
   column family with a bounded iterator) start at once in threads and overlap
2. the base's restore (`restore_subtask` with the new range: this machine's snapshot
   of it or a download, its reused files checked) as the new instance, then the clip: two
   ``delete_range`` tombstones per column family keep the base's own part of R_j;
   when the base keeps more than ``COMPACT_CLIPPED_SHARE`` of its bytes only for key
   groups it no longer owns, a compaction of the clipped ranges; then its rows
   (`kept_rows`: every kept block is read once, so a damaged block fails here, not in
   the new checkpoint);
3. the imports' SSTs are ingested (``ingest_external_file`` with move: no
   put-per-key, no memtable, no WAL), one ingestion per column family;
4. snapshot and upload like a job run's checkpoint: the base's SSTs are unchanged by
   the clip (the tombstones land in a new SST), so they are referenced, not uploaded.

The task works in a scratch folder (statebackend.rescale.scratch) with automatic
compactions off (see ``_open_base``). A failure removes this attempt's uploads and
goes on as the exception: the runner reports it in one line and the driver commits
nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

from rocksdict import (
    BottommostLevelCompaction,
    CompactOptions,
)

from statebackend.checkpoint.attempt import record_uploads
from statebackend.checkpoint.local_copy import instance_dir
from statebackend.checkpoint.metadata import SubtaskHandle
from statebackend.checkpoint.restore import (
    RestoreOptions,
    restore_subtask,
    restored_readonly,
)
from statebackend.checkpoint.snapshot import SnapshotResult, upload_snapshot
from statebackend.errors import SnapshotError
from statebackend.rescale.plan import SubtaskPlan
from statebackend.rescale.scratch import scratch_parent
from statebackend.spark.dispatch import task_context
from statebackend.state import facts
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import KeyGroupRange, key_group_of_rocks_key, key_group_prefix
from statebackend.state.kinds import StateDescriptor
from statebackend.state.sst import export_sst, ingest
from statebackend.storage import Storage, StorageOptions, child_storage, open_storage
from statebackend.subtasks import named_failure
from statebackend.worker_processes import worker_pool

# A new subtask whose base would keep more than this share of its referenced bytes only
# for key groups it no longer owns is compacted (docs/rescale.md: the figures).
COMPACT_CLIPPED_SHARE = 1 / 3
IMPORT_THREADS = 4  # imports downloaded and exported at once within one task


@dataclass(frozen=True)
class RescaleTask:
    """Everything new subtask ``plan.index`` needs; shipped to a Spark task with the
    function (pickled by the driver, never read from storage). ``storage_options``
    carry the credentials (never the environment); their repr shows no secret."""

    storage_url: str
    job: str
    source_checkpoint_id: int
    checkpoint_id: int
    max_parallelism: int
    states: tuple[StateDescriptor, ...]
    plan: SubtaskPlan
    sources: tuple[SubtaskHandle, ...]  # the source's handles this subtask reads
    compact: bool = False  # rewrite the new instance to its live keys
    compact_clipped_share: float = COMPACT_CLIPPED_SHARE
    fail: bool = False  # test hook: fail after the upload
    # The imports' exports run in this process's worker processes (a local rescale with
    # much to export: statebackend.worker_processes), else in the task's threads.
    import_processes: bool = False
    # The root of this machine's local-recovery instances (statebackend.checkpoint.
    # local_copy; None: CKPT_LOCAL_DIR, else the temp folder's): what a job run on this
    # machine left there is read instead of downloaded.
    local_dir: str | None = None
    # The driver's `Attempt.token`: the upload record names it, so a failed rescale's
    # discard takes every upload of its tasks (statebackend.checkpoint.attempt).
    attempt_token: str = ""
    storage_options: StorageOptions = field(default_factory=StorageOptions, hash=False)

    def handle(self, index: int) -> SubtaskHandle:
        return next(h for h in self.sources if h.index == index)

    @property
    def index(self) -> int:
        return self.plan.index


@dataclass(frozen=True)
class RescaleTaskResult:
    """What one new subtask wrote; its JSON is the Spark task's result row."""

    index: int
    attempt: int  # the task attempt (Spark retries a failed task)
    handle: SubtaskHandle
    uploaded_paths: tuple[str, ...]
    bytes_downloaded: int
    files_reused: int
    entries_imported: int
    clipped_share: float
    compacted: bool
    rows: int | None  # None: not recorded (an external or memory rescale reads nothing)
    timings: Mapping[str, float]
    scratch: str = ""
    host: str = ""
    pid: int = 0  # the process that built it (a Spark task's Python worker)
    import_pids: tuple[int, ...] = ()  # the processes that exported the imports
    # how the base and each import were placed: local-snapshot (this machine's copy) or
    # download (statebackend.checkpoint.restore)
    restore_modes: tuple[str, ...] = ()

    @property
    def bytes_uploaded(self) -> int:
        return self.handle.bytes_uploaded

    def to_json(self) -> dict:
        return {"index": self.index, "attempt": self.attempt, "handle": self.handle.to_json(),
                "uploaded_paths": list(self.uploaded_paths),
                "bytes_downloaded": self.bytes_downloaded, "files_reused": self.files_reused,
                "entries_imported": self.entries_imported, "clipped_share": self.clipped_share,
                "compacted": self.compacted, "rows": self.rows, "timings": dict(self.timings),
                "scratch": self.scratch, "host": self.host, "pid": self.pid,
                "import_pids": list(self.import_pids),
                "restore_modes": list(self.restore_modes)}

    @staticmethod
    def from_json(data: Mapping) -> RescaleTaskResult:
        where = f"result of new subtask {data.get('index')}"
        return RescaleTaskResult(**{**data, "handle": SubtaskHandle.from_json(
            data["handle"], where), "uploaded_paths": tuple(data["uploaded_paths"]),
            "import_pids": tuple(data.get("import_pids", ())),
            "restore_modes": tuple(data.get("restore_modes", ()))})


def run_rescale_task(task: RescaleTask, attempt: int = 0) -> RescaleTaskResult:
    """Attempt ``attempt`` of one new subtask: build, snapshot, upload, record the
    uploads (module doc); on failure its uploads are removed before the exception goes on."""
    build = _NewSubtask(task, attempt)
    try:
        return build.run()
    except BaseException:
        build.discard()
        raise
    finally:
        build.close()


def run_rescale_batches(tasks: Sequence[RescaleTask], batches):
    """``mapInArrow`` body: each row's ``id`` picks its task; one JSON result per row."""
    import pyarrow as pa

    attempt = task_context().attemptNumber()
    for batch in batches:
        results = []
        for i in batch.column("id").to_pylist():
            with named_failure("new subtask", i):
                results.append(json.dumps(run_rescale_task(tasks[i], attempt).to_json()))
        yield pa.RecordBatch.from_pydict({"result": results},
                                         schema=pa.schema([("result", pa.string())]))


class _NewSubtask:
    """One attempt of one new subtask (`run_rescale_task`)."""

    def __init__(self, task: RescaleTask, attempt: int) -> None:
        self.task, self.attempt = task, attempt
        self.storage: Storage = _job_storage(task.storage_url, task.storage_options, task.job)
        base = task.handle(task.plan.base)
        self.imports = [(task.handle(i.source), i.key_groups) for i in task.plan.imports]
        self.bytes_downloaded = base.size + sum(h.size for h, _ in self.imports)
        self.work = tempfile.mkdtemp(prefix=f"ckpt-rescale-{task.index}-",
                                     dir=scratch_parent(self.bytes_downloaded))
        self.base = base
        self.backend: KeyedStateBackend | None = None
        self.uploaded: tuple[str, ...] = ()
        self.timings: dict[str, float] = {}
        self.import_pids: tuple[int, ...] = ()
        self.restore_modes: tuple[str, ...] = ()  # the base's, then the imports'
        self.started = time.perf_counter()

    def run(self) -> RescaleTaskResult:
        # The imports start at once and overlap the base's download, clip and count: a
        # task's wall time is its longest chain, not their sum. In the task's threads
        # (rocksdict drops the GIL in RocksDB calls, not while it hands keys to Python),
        # or in worker processes when the task says so.
        threads = ThreadPoolExecutor(max_workers=max(1, min(IMPORT_THREADS, len(self.imports))))
        pool = worker_pool() if self.task.import_processes else threads
        pending = [pool.submit(fetch_and_export, ImportSpec.of(self.task, h, key_groups,
                                                               self.work).to_json())
                   for h, key_groups in self.imports]
        try:
            backend, rows, clipped, compacted = self._open_base()
            entries = self._ingest(backend, pending, rows)
        finally:
            for f in pending:
                f.cancel()
            wait(pending)  # the started ones finish before close() removes their folder
            threads.shutdown()
        if self.task.compact:
            with self._timed("compact"):
                backend.compact()
        result = self._upload(backend, rows)
        if self.task.fail:
            raise SnapshotError(f"injected fault in new subtask {self.task.index} (test hook)")
        self.timings["total"] = time.perf_counter() - self.started
        return RescaleTaskResult(
            index=self.task.index, attempt=self.attempt, handle=result.handle,
            uploaded_paths=self.uploaded,
            bytes_downloaded=self.bytes_downloaded, files_reused=result.files_reused,
            entries_imported=entries, clipped_share=round(clipped, 3), compacted=compacted,
            rows=sum(result.handle.row_counts.values()), timings=dict(self.timings),
            scratch=os.path.dirname(self.work), host=socket.gethostname(), pid=os.getpid(),
            import_pids=self.import_pids, restore_modes=self.restore_modes)

    def _open_base(self) -> tuple[KeyedStateBackend, dict[str, int], float, bool]:
        """Restore the base as the new instance and clip it to its own part of
        the new range; (instance, rows per column family, clipped share, compacted)."""
        base, task = self.base, self.task
        with self._timed("restore"):
            # This machine's snapshot of the base when a job run left one: linked, or
            # copied on another filesystem when the store is remote (a local copy beats
            # a download); restore then checks its stored files before they are
            # referenced, and only files of the committed source are referenced.
            instance = instance_dir(task.storage_url, task.job, base.index, task.local_dir)
            base_dir = os.path.join(self.work, f"old-{base.index}")
            self.backend = backend = restore_subtask(
                self.storage, base, base_dir, task.states, task.max_parallelism,
                RestoreOptions(local_instance=instance, key_groups=task.plan.key_groups,
                               label=_label(task.source_checkpoint_id, base)))
            self.restore_modes = (backend.restore_mode, *self.restore_modes)
        with self._timed("clip"):
            # No automatic compaction in this short-lived instance: the clip's tombstones
            # and the ingested SSTs reach the level-0 trigger, and a compaction finishing
            # before the snapshot would upload the whole state again instead of
            # referencing the base's files (the stored OPTIONS file records the switch;
            # every restore opens with the backend's own options, never with that file).
            for name in backend.column_families:
                backend.column_family(name).set_options({"disable_auto_compactions": "true"})
            # Clip to the base's own part of the new range, not the whole new range: the
            # other key groups must come only from their owners (a stray key the base may
            # hold there is dropped), and the live rows of the base part are then exact.
            keep = task.plan.key_groups.intersect(base.key_group_range)
            clipped = clipped_share(backend.db.live_files(), keep)
            backend.delete_key_groups_outside(keep)
        compacted = task.compact or clipped > task.compact_clipped_share
        clipped_compacted = compacted and not task.compact  # --compact runs after the imports
        if clipped_compacted:
            with self._timed("compact"):
                compact_clipped(backend, base.key_group_range, keep)
        with self._timed("count"):
            rows = {cf: kept_rows(backend, cf, keep, clipped_compacted)
                    for cf in backend.column_families}
        return backend, rows, clipped, compacted

    def _ingest(self, backend: KeyedStateBackend, pending: list[Future],
                rows: dict[str, int]) -> int:
        """Wait for the imports' SSTs and ingest them; entries imported (``rows`` grows)."""
        t = time.perf_counter()
        done = [f.result() for f in pending]
        self.timings["import_wait"] = time.perf_counter() - t
        # the longest import chain (download + open + export), which overlapped the above
        self.timings["export"] = max((seconds for _, seconds, _, _ in done), default=0.0)
        self.import_pids = tuple(pid for _, _, pid, _ in done)
        self.restore_modes += tuple(mode for _, _, _, mode in done)
        entries = 0
        with self._timed("ingest"):
            # One ingestion per column family: the imported ranges are disjoint, so all
            # their SSTs go in together (one flush of the clip's tombstones, one version).
            per_family: dict[str, list[str]] = {}
            for ssts, _, _, _ in done:
                for cf_name, (path, n) in ssts.items():
                    per_family.setdefault(cf_name, []).append(path)
                    entries += n
                    rows[cf_name] = rows.get(cf_name, 0) + n
            ingest(backend, per_family)
        return entries

    def _upload(self, backend: KeyedStateBackend, rows: dict[str, int]) -> SnapshotResult:
        """Snapshot and upload (commits nothing: the driver commits)."""
        with self._timed("snapshot"):
            # Rows are known already (base part + imported entries): skip a full scan.
            local = replace(backend.take_local_snapshot(count_rows=False), row_counts=rows)
        result = upload_snapshot(self.storage, local, checkpoint_id=self.task.checkpoint_id,
                                 subtask=self.task.index, backend=backend)
        self.uploaded = result.uploaded_paths
        self.timings["upload"] = result.upload_seconds
        record_uploads(self.storage, self.task.checkpoint_id, self.task.index, self.attempt,
                       self.uploaded, self.task.attempt_token)
        return result

    def _timed(self, phase: str):
        return _Timer(self.timings, phase)

    def discard(self) -> None:
        if self.uploaded:
            self.storage.delete_many(self.uploaded)

    def close(self) -> None:
        if self.backend is not None:
            backend, self.backend = self.backend, None
            try:
                backend.close()
            except Exception:  # noqa: BLE001, S110
                # A scratch instance, thrown away: its snapshot is uploaded or the task
                # failed already (RocksDB repeats a compaction's background error on close,
                # which would hide the error that names the damaged file).
                pass
        shutil.rmtree(self.work, ignore_errors=True)


@dataclass(frozen=True)
class ImportSpec:
    """One import of a new subtask (`fetch_and_export`), as JSON for a worker process."""

    storage_url: str
    storage_options: StorageOptions
    job: str
    source_checkpoint_id: int
    max_parallelism: int
    states: tuple[StateDescriptor, ...]
    handle: SubtaskHandle
    key_groups: KeyGroupRange
    local_dir: str | None
    work: str  # the task's scratch folder: the exported SSTs go there

    @staticmethod
    def of(task: RescaleTask, handle: SubtaskHandle, key_groups: KeyGroupRange,
           work: str) -> ImportSpec:
        return ImportSpec(task.storage_url, task.storage_options, task.job,
                          task.source_checkpoint_id, task.max_parallelism, task.states, handle,
                          key_groups, task.local_dir, work)

    def to_json(self) -> dict:
        return {"storage_url": self.storage_url, "storage_options": self.storage_options.to_dict(),
                "job": self.job, "source_checkpoint_id": self.source_checkpoint_id,
                "max_parallelism": self.max_parallelism,
                "states": [d.to_json() for d in self.states], "handle": self.handle.to_json(),
                "key_groups": [self.key_groups.start, self.key_groups.end],
                "local_dir": self.local_dir, "work": self.work}

    @staticmethod
    def from_json(data: Mapping) -> ImportSpec:
        return ImportSpec(
            data["storage_url"], StorageOptions(data["storage_options"]), data["job"],
            data["source_checkpoint_id"], data["max_parallelism"],
            tuple(StateDescriptor.from_json(d) for d in data["states"]),
            SubtaskHandle.from_json(data["handle"], "an import's handle"),
            KeyGroupRange(*data["key_groups"]), data["local_dir"], data["work"])


def fetch_and_export(spec_json: Mapping) -> tuple[dict[str, tuple[str, int]], float, int, str]:
    """Open one import's old subtask read-only (this machine's snapshot of it when a job
    run left one, else downloaded: two-phase, nothing opens half-downloaded), export its
    key groups to SSTs in the task's scratch folder, drop the copy; (SSTs, seconds
    taken, process id, restore mode). Runs in a task's thread or a worker process
    (`ImportSpec` as JSON in, JSON values out)."""
    started = time.perf_counter()
    spec = ImportSpec.from_json(spec_json)
    h = spec.handle
    instance = instance_dir(spec.storage_url, spec.job, h.index, spec.local_dir)
    with restored_readonly(_job_storage(spec.storage_url, spec.storage_options, spec.job), h,
                           spec.states, spec.max_parallelism,
                           options=RestoreOptions(label=_label(spec.source_checkpoint_id, h),
                                                  local_instance=instance)) as src:
        ssts = export_key_groups(src, spec.key_groups,
                                 os.path.join(spec.work, f"export-{h.index}"))
        mode = src.restore_mode
    return ssts, time.perf_counter() - started, os.getpid(), mode


def _job_storage(url: str, options: StorageOptions, job: str) -> Storage:
    return child_storage(open_storage(url, **options), job)


def _label(checkpoint_id: int, h: SubtaskHandle) -> str:
    """Names an old subtask's instance in scan errors."""
    return f"subtask {h.index} of checkpoint {checkpoint_id}"


class _Timer:
    """``with`` block adding its seconds to ``timings[phase]``."""

    def __init__(self, timings: dict[str, float], phase: str) -> None:
        self.timings, self.phase = timings, phase

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timings[self.phase] = self.timings.get(self.phase, 0.0) + \
            time.perf_counter() - self.started


def export_key_groups(source: KeyedStateBackend, key_groups: KeyGroupRange, out_dir: str
                      ) -> dict[str, tuple[str, int]]:
    """Write the keys of ``key_groups`` to one SST per column family.

    Returns {column family: (sst path, entries)} for the families that have keys.
    """
    os.makedirs(out_dir, exist_ok=True)
    out: dict[str, tuple[str, int]] = {}
    for name in source.column_families:
        path = os.path.join(out_dir, f"{name}.sst")
        # Checked: a damaged block raises instead of ending the export early (which
        # would silently drop the rest of the range from the new checkpoint).
        n = export_sst(path, source, name, key_groups)
        if n:
            out[name] = (path, n)
    return out


def kept_rows(backend: KeyedStateBackend, cf_name: str, keep: KeyGroupRange,
              compacted: bool) -> int:
    """Live keys of one column family after the clip. Every block of the part kept is
    read and checksummed once, so a damaged base fails here instead of being carried
    into the new checkpoint:

    - a compacted base: the compaction did that, and left one run of files without
      tombstones, so its stored entries are the live keys (`facts.exact_count`) when
      every key lies in ``keep``: no scan;
    - else a checked keys-only scan of ``keep`` (range tombstones apply).
    """
    if compacted:
        f = facts.cf_facts(backend.column_family(cf_name))
        exact = facts.exact_count(f)
        if exact is not None and facts.edges_within(f, keep) is not False:
            return exact
    return backend.count_keys(cf_name, keep)


def clipped_share(files: Sequence[Mapping], keep: KeyGroupRange) -> float:
    """Estimated share of the bytes of ``files`` that lie outside ``keep``.

    ``files`` are RocksDB live-file records (``size``, ``start_key``, ``end_key``); a
    file's key groups are those between its first and last key's 2-byte prefixes, and
    its bytes are taken as spread evenly over them (keys hash evenly to key groups).
    """
    total = dead = 0.0
    for f in files:
        start, end, size = f.get("start_key") or b"", f.get("end_key") or b"", f["size"]
        total += size
        if len(start) < 2 or len(end) < 2:
            continue  # no key-group prefix: counted as live
        span = KeyGroupRange(key_group_of_rocks_key(start), key_group_of_rocks_key(end))
        dead += size * (1 - len(span.intersect(keep)) / len(span))
    return dead / total if total else 0.0


def compact_clipped(backend: KeyedStateBackend, base: KeyGroupRange,
                    keep: KeyGroupRange) -> None:
    """Rewrite the base's files that hold key groups the clip removed (run before any
    ingestion, so imported files are not rewritten): RocksDB compacts the files that
    overlap the clipped ranges and drops the keys their tombstones cover."""
    opts = CompactOptions()
    opts.set_bottommost_level_compaction(BottommostLevelCompaction.force_optimized())
    ranges = []
    if base.start < keep.start:
        ranges.append((key_group_prefix(base.start), key_group_prefix(keep.start)))
    if keep.end < base.end:
        ranges.append((key_group_prefix(keep.end + 1), key_group_prefix(base.end + 1)))
    for name in backend.column_families:
        for lower, upper in ranges:
            backend.compact_range(name, lower, upper, opts)
    backend.mark_dirty()

