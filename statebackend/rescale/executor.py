"""Rescale-restore: redistribute a checkpoint's key-group state to a new parallelism.

Input: a committed checkpoint with parallelism P (max parallelism M). Output: a
new, full checkpoint with parallelism Q, ``kind="rescale"``, ``parent`` = the
source id, ``rescaled_from`` = P. The source is never modified.

Plan (pure, `plan_rescale`): new subtask j of Q owns key groups R_j (Flink's range
formula). Every old handle whose range meets R_j contributes:

- the *base*: the old handle with the largest key-group overlap (ties: the larger
  handle, then the lower index). It is downloaded, opened read-write and clipped with
  two ``delete_range`` tombstones per column family to its own part of R_j (R_j ∩ its
  old range: the other key groups of R_j come only from their owners);
- every *import*: another overlapping old handle. It is downloaded and opened
  read-only; for each column family the keys of (its range ∩ R_j) are exported with
  a bounded iterator into one SST (SstFileWriter) and ingested into the base
  (``ingest_external_file`` with move: no put-per-key, no memtable, no WAL).

Execution (`rescale`): one task per new subtask, so a task downloads only the files
of the old handles that meet its range (local recovery is not assumed). On a
cluster or through Spark Connect each task is a Spark task; with a local classic
session (whose executors are this process) the same tasks run in this process's
threads, two per core (`driver_threads`, ``TASKS_PER_CORE``): a Spark job would add
its scheduling and Python worker round trips and nothing else.
Inside a task the imports (download, read-only open, export) start at once in
threads and overlap the base's download, clip and count. The task builds its
instances in a scratch folder on tmpfs when they fit (`statebackend.rescale.scratch`:
RocksDB syncs every file it writes, and these instances are thrown away after the
upload), and switches the new instance's automatic compactions off (the clip's
tombstones plus the ingested SSTs reach the level-0 trigger; a compaction would
burn CPU beside the upload, and one that finished before the snapshot would make
the task upload its whole state instead of referencing the base's files).
Each task snapshots its instance and uploads it like a checkpoint of a job run:
the base's SSTs are unchanged by the clip (the tombstones land in a new SST), so
they are *referenced*, not uploaded again. That is safe because they belong to
the committed source checkpoint of this job, which GC keeps while anything
references them; each new handle is still restorable on its own.

But a clipped SST kept whole still holds the key groups its new subtask no longer
owns: every restore downloads them and the checkpoint references them once per
new subtask (a 2 -> 4 scale-out referenced twice the state's bytes). So when the
base's clipped share (`clipped_share`: bytes of its files outside the kept range,
estimated per file from its key span) exceeds ``COMPACT_CLIPPED_SHARE`` (1/3: a
rescaled checkpoint then references at most 1.5x its live bytes), the subtask
compacts the clipped ranges (`compact_clipped`): RocksDB rewrites the files that
overlap them (on level 0, where a small state's files sit, that is all of them)
and the subtask uploads its live keys. A scale-in keeps whole bases (clipped
share 0) and is not compacted. Pass
``compact=True`` to rewrite every new instance to its live keys instead.

Order and failure handling (upload first, commit last):

1. take the job's writer lease (no job run or other rescale at the same time) and
   a hold lease on the source (retention and GC keep it while we read it);
2. run the tasks; a task that fails deletes what it uploaded and reports its error;
3. if any task failed: delete what the other tasks uploaded and the new
   ``chk-<id>`` folder, commit nothing, raise (the source is untouched);
4. else write ``chk-<id>/_metadata`` (exclusive create), release the leases.

Steps 3-4 are `statebackend.checkpoint.attempt.Attempt` (``discard`` / ``commit``), the
commit-or-discard every checkpoint writer shares.

A Spark worker cannot see this process's ``memory://`` filesystem, so memory
storage runs the same tasks one after the other in the driver.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace

from rocksdict import (
    BottommostLevelCompaction,
    CompactOptions,
    IngestExternalFileOptions,
    Options,
    SstFileWriter,
)

from statebackend.checkpoint.attempt import Attempt
from statebackend.checkpoint.leases import hold
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskHandle
from statebackend.checkpoint.restore import download_files
from statebackend.checkpoint.snapshot import upload_snapshot
from statebackend.checkpoint.store import CheckpointStore, build_metadata
from statebackend.errors import CkptError, MetadataError, SnapshotError, UsageError
from statebackend.progress import NO_PROGRESS, ProgressSink
from statebackend.rescale.scratch import scratch_parent
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import (
    KeyGroupRange,
    check_parallelism,
    key_group_of_rocks_key,
    key_group_prefix,
    key_group_range_for_subtask,
)
from statebackend.state.kinds import StateDescriptor
from statebackend.storage import Storage, open_storage

# A new subtask whose base would keep more than this share of its referenced bytes only
# for key groups it no longer owns is compacted (docs/rescale.md: the figures).
COMPACT_CLIPPED_SHARE = 1 / 3
# New subtasks run at once per core of a local session (120,000 keys, load 12, medians
# of 7 interleaved rounds: 4 -> 8 took 0.44 s with one task per core, 0.33 s with two,
# 0.32 s with four; 8 -> 3 0.31, 0.31 and 0.26 s).
TASKS_PER_CORE = 2


class NothingToRescaleError(UsageError):
    """The requested parallelism equals the checkpoint's: a rescale would be a no-op."""


# -- plan (pure) -------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedFile:
    """One file a new subtask downloads, and why."""

    source: int  # old subtask index
    path: str
    local_name: str
    size: int
    reason: str

    def to_json(self) -> dict:
        return {"source": self.source, "path": self.path, "local_name": self.local_name,
                "size": self.size, "reason": self.reason}


@dataclass(frozen=True)
class ImportRange:
    """Key groups of one non-base old handle that a new subtask exports and ingests."""

    source: int
    key_groups: KeyGroupRange

    def to_json(self) -> dict:
        return {"source": self.source, "key_group_start": self.key_groups.start,
                "key_group_end": self.key_groups.end}


@dataclass(frozen=True)
class SubtaskPlan:
    index: int
    key_groups: KeyGroupRange
    base: int  # old subtask index restored and clipped
    base_overlap: KeyGroupRange
    imports: tuple[ImportRange, ...]
    downloads: tuple[PlannedFile, ...]

    @property
    def sources(self) -> tuple[int, ...]:
        return (self.base,) + tuple(i.source for i in self.imports)

    @property
    def bytes_to_download(self) -> int:
        return sum(f.size for f in self.downloads)

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "key_group_start": self.key_groups.start,
            "key_group_end": self.key_groups.end,
            "base": self.base,
            "base_overlap": [self.base_overlap.start, self.base_overlap.end],
            "imports": [i.to_json() for i in self.imports],
            "bytes_to_download": self.bytes_to_download,
            "downloads": [f.to_json() for f in self.downloads],
        }


@dataclass(frozen=True)
class RescalePlan:
    """What each new subtask restores, clips, imports and downloads."""

    job: str
    source_checkpoint_id: int
    from_parallelism: int
    to_parallelism: int
    max_parallelism: int
    subtasks: tuple[SubtaskPlan, ...]

    @property
    def bytes_to_download(self) -> int:
        return sum(s.bytes_to_download for s in self.subtasks)

    def to_json(self) -> dict:
        return {
            "job": self.job,
            "source_checkpoint_id": self.source_checkpoint_id,
            "from_parallelism": self.from_parallelism,
            "to_parallelism": self.to_parallelism,
            "max_parallelism": self.max_parallelism,
            "bytes_to_download": self.bytes_to_download,
            "subtasks": [s.to_json() for s in self.subtasks],
        }

    def describe(self) -> list[str]:
        """Human lines for ``--dry-run``."""
        lines = [f"rescale plan: job {self.job} checkpoint {self.source_checkpoint_id} "
                 f"from parallelism {self.from_parallelism} to {self.to_parallelism} "
                 f"(max parallelism {self.max_parallelism}); "
                 f"{self.bytes_to_download} bytes to download in total"]
        for s in self.subtasks:
            r, o = s.key_groups, s.base_overlap
            lines.append(f"  new subtask {s.index}: key groups [{r.start}, {r.end}]; base old "
                         f"subtask {s.base} (keeps [{o.start}, {o.end}], clip the rest)")
            for imp in s.imports:
                k = imp.key_groups
                lines.append(f"    import key groups [{k.start}, {k.end}] from old subtask "
                             f"{imp.source} (SST export + ingest)")
            lines.append(f"    download {len(s.downloads)} files, {s.bytes_to_download} bytes")
        return lines


def plan_rescale(meta: CheckpointMetadata, new_parallelism: int) -> RescalePlan:
    """Pure: which old handles each of ``new_parallelism`` subtasks needs, and why."""
    if isinstance(new_parallelism, bool) or not isinstance(new_parallelism, int):
        raise UsageError(f"parallelism {new_parallelism!r} is not an integer")
    m, p = meta.max_parallelism, meta.parallelism
    check_parallelism(new_parallelism, m)
    if new_parallelism == p:
        raise NothingToRescaleError(
            f"checkpoint {meta.checkpoint_id} of job {meta.job!r} is already at parallelism "
            f"{p}: nothing to do")
    old = sorted(meta.subtasks, key=lambda h: h.index)
    _check_tiling(meta, old)
    plans = []
    for j in range(new_parallelism):
        target = key_group_range_for_subtask(m, new_parallelism, j)
        overlapping = [(h, target.intersect(h.key_group_range)) for h in old]
        overlapping = [(h, r) for h, r in overlapping if len(r) > 0]
        base, base_overlap = max(overlapping, key=lambda hr: (len(hr[1]), hr[0].size,
                                                               -hr[0].index))
        imports = tuple(ImportRange(h.index, r) for h, r in overlapping if h is not base)
        downloads = [PlannedFile(base.index, f.path, f.local_name, f.size,
                                 f"base: restore old subtask {base.index}, clip to "
                                 f"[{target.start}, {target.end}]") for f in base.files]
        for imp in imports:
            h = old[imp.source]
            k = imp.key_groups
            downloads += [PlannedFile(h.index, f.path, f.local_name, f.size,
                                      f"import: export key groups [{k.start}, {k.end}] of old "
                                      f"subtask {h.index}") for f in h.files]
        plans.append(SubtaskPlan(j, target, base.index, base_overlap, imports, tuple(downloads)))
    return RescalePlan(meta.job, meta.checkpoint_id, p, new_parallelism, m, tuple(plans))


def _check_tiling(meta: CheckpointMetadata, old: Sequence[SubtaskHandle]) -> None:
    for i, h in enumerate(old):
        expected = key_group_range_for_subtask(meta.max_parallelism, meta.parallelism, i)
        if h.index != i or h.key_group_range != expected:
            raise MetadataError(
                f"malformed metadata of checkpoint {meta.checkpoint_id}: subtask {h.index} covers "
                f"key groups [{h.key_group_start}, {h.key_group_end}], expected subtask {i} with "
                f"[{expected.start}, {expected.end}]; cannot rescale it")


# -- one new subtask (runs in a Spark task) ----------------------------------------

def export_key_groups(source: KeyedStateBackend, key_groups: KeyGroupRange, out_dir: str
                      ) -> dict[str, tuple[str, int]]:
    """Write the keys of ``key_groups`` to one SST per column family.

    Returns {column family: (sst path, entries)} for the families that have keys.
    """
    os.makedirs(out_dir, exist_ok=True)
    out: dict[str, tuple[str, int]] = {}
    for name in source.column_families:
        path = os.path.join(out_dir, f"{name}.sst")
        # Checked read: a damaged block raises instead of ending the export early
        # (which would silently drop the rest of the range from the new checkpoint).
        keys, values = source.read_raw(name, key_groups)
        if not keys:
            continue
        writer = SstFileWriter(options=Options(raw_mode=True))
        writer.open(path)
        put = writer.__setitem__
        for key, value in zip(keys, values, strict=True):
            put(key, value)
        writer.finish()
        out[name] = (path, len(keys))
    return out


def count_keys(backend: KeyedStateBackend, cf_name: str, key_groups: KeyGroupRange) -> int:
    """Live keys of one column family within ``key_groups`` (range tombstones apply)."""
    return len(backend.read_raw(cf_name, key_groups, values=False)[0])


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
        cf = backend.column_family(name)
        for lower, upper in ranges:
            cf.compact_range(lower, upper, opts)
    backend.mark_dirty()


def run_subtask(spec: dict, storage_options: Mapping | None = None) -> dict:
    """Build, snapshot and upload one new subtask; never raises (errors are reported).

    ``spec`` is JSON (see `_task_specs`); ``storage_options`` open its storage (the
    driver's, shipped in the task closure, never through the environment). On
    failure the uploads of this attempt are deleted before the error is returned.
    """
    started = time.perf_counter()
    timings: dict[str, float] = {}
    uploaded: tuple[str, ...] = ()
    job_storage: Storage | None = None
    work = None
    index = spec["index"]
    try:
        job_storage = CheckpointStore(open_storage(spec["storage"], **(storage_options or {})),
                                      spec["job"]).storage
        where = f"rescale source {spec['source_checkpoint_id']}"
        handles = {h["index"]: SubtaskHandle.from_json(h, where) for h in spec["handles"]}
        descriptors = [StateDescriptor.from_json(s) for s in spec["states"]]
        m = spec["max_parallelism"]
        target = KeyGroupRange(spec["key_group_start"], spec["key_group_end"])
        base = handles[spec["base"]]
        imports = [(handles[i["source"]], KeyGroupRange(i["key_group_start"], i["key_group_end"]))
                   for i in spec["imports"]]
        bytes_downloaded = base.size + sum(h.size for h, _ in imports)
        work = tempfile.mkdtemp(prefix=f"ckpt-rescale-{index}-",
                                dir=scratch_parent(bytes_downloaded))

        source_id = spec["source_checkpoint_id"]

        def fetch_and_export(item: tuple[SubtaskHandle, KeyGroupRange]
                             ) -> tuple[dict[str, tuple[str, int]], float]:
            """Download one import (two-phase: nothing opens half-downloaded), export its
            part of the new range to SSTs, drop the download; (SSTs, seconds taken)."""
            started_at = time.perf_counter()
            h, kg = item
            folder = os.path.join(work, f"old-{h.index}")
            download_files(job_storage, h.files, os.path.join(folder, "db"))
            src = KeyedStateBackend(folder, descriptors, m, h.key_group_range, read_only=True,
                                    label=f"subtask {h.index} of checkpoint {source_id}")
            src.file_paths = {f.local_name: f.path for f in h.files}
            try:
                ssts = export_key_groups(src, kg, os.path.join(work, f"export-{h.index}"))
            finally:
                src.close()
                shutil.rmtree(folder, ignore_errors=True)
            return ssts, time.perf_counter() - started_at

        # The imports (download, open read-only, export) start at once, each in its own
        # thread, and overlap the base's download, clip and count: a task's wall time is
        # its longest chain, not their sum (rocksdict drops the GIL in RocksDB calls).
        pool = ThreadPoolExecutor(max_workers=max(1, min(4, len(imports))))
        backend: KeyedStateBackend | None = None
        try:
            pending = [pool.submit(fetch_and_export, item) for item in imports]
            # 1. download the base (two-phase: nothing opens half-downloaded)
            t = time.perf_counter()
            base_dir = os.path.join(work, f"old-{base.index}")
            download_files(job_storage, base.files, os.path.join(base_dir, "db"))
            timings["download"] = time.perf_counter() - t

            # 2. open the base as the new instance and clip it
            t = time.perf_counter()
            backend = KeyedStateBackend(base_dir, descriptors, m, target,
                                        label=f"subtask {base.index} of checkpoint {source_id}")
            backend.file_paths = {f.local_name: f.path for f in base.files}
            # Only files of the committed source may be referenced instead of uploaded.
            backend.uploaded = {f.local_name: f for f in base.shared_files}
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
            keep = target.intersect(base.key_group_range)
            clipped = clipped_share(backend.db.live_files(), keep)
            backend.delete_key_groups_outside(keep)
            # Always count with a checked scan, even when the recorded counts would do:
            # the scan reads (and checksums) every block of the part kept, so a damaged
            # base fails here instead of being carried into the new checkpoint.
            rows = {cf: count_keys(backend, cf, keep) for cf in backend.column_families}
            timings["restore_clip"] = time.perf_counter() - t
            compacted = bool(spec.get("compact")) or clipped > spec.get(
                "compact_clipped_share", COMPACT_CLIPPED_SHARE)
            if compacted and not spec.get("compact"):
                t = time.perf_counter()
                compact_clipped(backend, base.key_group_range, keep)
                timings["compact"] = time.perf_counter() - t

            # 3. wait for the imports' SSTs and ingest them
            entries_imported = 0
            t = time.perf_counter()
            done = [fut.result() for fut in pending]
            exported = [ssts for ssts, _ in done]
            t_wait = time.perf_counter() - t
            # the longest import chain (download + open + export), which overlapped the above
            t_export = max((seconds for _, seconds in done), default=0.0)
            t = time.perf_counter()
            # One ingestion per column family: the imported ranges are disjoint, so all
            # their SSTs go in together (one flush of the clip's tombstones, one version).
            per_family: dict[str, list[str]] = {}
            for ssts in exported:
                for cf_name, (path, n) in ssts.items():
                    per_family.setdefault(cf_name, []).append(path)
                    entries_imported += n
                    rows[cf_name] = rows.get(cf_name, 0) + n
            for cf_name, paths in per_family.items():
                opts = IngestExternalFileOptions()
                opts.set_move_files(True)
                backend.column_family(cf_name).ingest_external_file(paths, opts)
            if per_family:
                backend.mark_dirty()
            t_ingest = time.perf_counter() - t
            timings["export"] = t_export
            timings["import_wait"] = t_wait
            timings["ingest"] = t_ingest
            if spec.get("compact"):
                t = time.perf_counter()
                backend.compact()
                timings["compact"] = time.perf_counter() - t

            # 4. snapshot and upload (commits nothing: the driver commits)
            t = time.perf_counter()
            # Rows are known already (base part + imported entries): skip a full scan.
            local = replace(backend.take_local_snapshot(count_rows=False), row_counts=rows)
            timings["snapshot"] = time.perf_counter() - t
            result = upload_snapshot(job_storage, local, checkpoint_id=spec["checkpoint_id"],
                                     subtask=index, backend=backend)
            uploaded = result.uploaded_paths
            timings["upload"] = result.upload_seconds
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if backend is not None:
                backend.close()
        if spec.get("fail") == index:
            raise SnapshotError(f"injected fault in new subtask {index} (test hook)")
        timings["total"] = time.perf_counter() - started
        return {"ok": True, "index": index, "handle": result.handle.to_json(),
                "uploaded_paths": list(uploaded), "bytes_downloaded": bytes_downloaded,
                "bytes_uploaded": result.handle.bytes_uploaded, "files_reused": result.files_reused,
                "entries_imported": entries_imported, "clipped_share": round(clipped, 3),
                "compacted": compacted, "scratch": os.path.dirname(work),
                "rows": sum(result.handle.row_counts.values()), "timings": timings,
                "host": socket.gethostname()}
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which aborts
        if uploaded and job_storage is not None:
            job_storage.delete_many(uploaded)
        return {"ok": False, "index": index, "error": f"{type(exc).__name__}: {exc}",
                "host": socket.gethostname()}
    finally:
        if work:
            shutil.rmtree(work, ignore_errors=True)


def run_subtask_json(spec_json: str, storage_options: Mapping | None = None) -> str:
    """Spark entry point: JSON in, JSON out; the storage options ride in the closure."""
    return json.dumps(run_subtask(json.loads(spec_json), storage_options))


def run_subtask_batches(payload: Sequence[str], storage_options: Mapping | None,
                        batches):
    """``mapInArrow`` body: each row's ``id`` picks its spec from ``payload``; JSON results."""
    import pyarrow as pa

    for batch in batches:
        results = [run_subtask_json(payload[i], storage_options)
                   for i in batch.column("id").to_pylist()]
        yield pa.RecordBatch.from_pydict({"result": results},
                                         schema=pa.schema([("result", pa.string())]))


# -- driver ------------------------------------------------------------------------

def _task_specs(store: CheckpointStore, meta: CheckpointMetadata, plan: RescalePlan,
                checkpoint_id: int, compact: bool, fail: int | None) -> list[dict]:
    by_index = {h.index: h for h in meta.subtasks}
    specs = []
    for s in plan.subtasks:
        specs.append({
            "storage": store.root_storage.url, "job": store.job,
            "source_checkpoint_id": meta.checkpoint_id, "checkpoint_id": checkpoint_id,
            "index": s.index, "key_group_start": s.key_groups.start,
            "key_group_end": s.key_groups.end, "max_parallelism": meta.max_parallelism,
            "states": [dict(x) for x in meta.states],
            "handles": [by_index[i].to_json() for i in s.sources],
            "base": s.base, "imports": [i.to_json() for i in s.imports],
            "compact": compact, "compact_clipped_share": COMPACT_CLIPPED_SHARE, "fail": fail,
        })
    return specs


def driver_threads(spark) -> int:
    """Threads to run the new subtasks with in this process: the cores of a local classic
    session (its executors are this process), else 0 (Spark tasks: a cluster, or a
    Spark Connect server whose machine may not be this one)."""
    from statebackend.spark.session import default_parallelism, is_connect

    if is_connect(spark) or not spark.sparkContext.master.startswith("local"):
        return 0
    return max(1, default_parallelism(spark))


def _run_here(specs: list[dict], storage_options, workers: int,
              progress: ProgressSink) -> list[dict]:
    """Run the subtasks in this process, ``workers`` at a time, counting each one written."""
    run = functools.partial(run_subtask, storage_options=storage_options)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run, spec) for spec in specs]
        for done in as_completed(futures):
            done.result()  # the first failure stops the rescale here
            progress.advance()
    return [f.result() for f in futures]


def _run_tasks(specs: list[dict], store: CheckpointStore, master: str | None, spark,
               description: str, progress: ProgressSink = NO_PROGRESS) -> list[dict]:
    progress.phase("new subtasks written", total=len(specs), unit="subtasks")
    if store.storage.process_local:
        # One after the other: fsspec's memory filesystem hands every reader of a file
        # the same file object, so two subtasks reading one old handle would collide.
        return _run_here(specs, store.root_storage.options, 1, progress)
    if spark is None:
        from statebackend.spark.session import get_spark

        spark = get_spark(master, app_name="ckpt-rescale")
    threads = driver_threads(spark)
    if threads:
        # A local classic session runs its tasks on this machine anyway: the same tasks in
        # this process's threads skip a Spark job's scheduling, task serialization and
        # Python worker round trips (most of a small rescale's time). rocksdict drops
        # the GIL in RocksDB calls, and each task works in its own folder and instance.
        # A task waits (on RocksDB's background flush and compaction, on file I/O) about
        # as long as it computes, so two tasks per core keep the cores busy.
        return _run_here(specs, store.root_storage.options, TASKS_PER_CORE * threads, progress)
    from statebackend.spark.dispatch import job_tag
    from statebackend.spark.progress import report_tasks

    payload = tuple(json.dumps(s) for s in specs)
    task = functools.partial(run_subtask_batches, payload, store.root_storage.options)
    # A DataFrame, not an RDD, so Spark Connect clients can rescale too. range() puts
    # exactly one id in each of its n partitions: one Spark task builds each subtask.
    tasks = spark.range(0, len(payload), 1, len(payload)).mapInArrow(task, "result string")
    with job_tag(spark, f"ckpt-rescale-{store.job}", description), \
            report_tasks(spark, progress, "new subtasks written", total=len(specs)):
        out = [row["result"] for row in tasks.collect()]
    # Other processes wrote under the job root: drop this process's cached listings
    # (s3fs would otherwise answer "does not exist" for the new files).
    store.storage.invalidate_cache()
    return [json.loads(r) for r in out]


def rescale(store: CheckpointStore, ref: str | int | None = "latest",
            parallelism: int | None = None, *, master: str | None = None, spark=None,
            dry_run: bool = False, compact: bool = False,
            _fail_subtask: int | None = None, progress: ProgressSink = NO_PROGRESS) -> dict:
    """Rescale checkpoint ``ref`` to ``parallelism``; commit a new checkpoint; return a summary.

    ``spark``: a SparkSession to use (else ``get_spark(master)``). ``dry_run`` only plans.
    ``_fail_subtask`` is a test hook: that new subtask fails after its upload.
    ``progress`` counts the new subtasks written (`statebackend.progress`).
    """
    if parallelism is None:
        raise UsageError("rescale needs a target parallelism (--parallelism Q)")
    started = time.perf_counter()
    meta = store.resolve(ref)
    plan = plan_rescale(meta, parallelism)  # fail fast, before taking any lease
    if dry_run:
        return {"dry_run": True, "job": store.job, "source_checkpoint_id": meta.checkpoint_id,
                "from_parallelism": plan.from_parallelism, "to_parallelism": parallelism,
                "bytes_to_download": plan.bytes_to_download, "plan": plan.to_json(),
                "plan_text": plan.describe()}
    purpose = f"rescale of checkpoint {meta.checkpoint_id} to parallelism {parallelism}"
    with store.writer(purpose, checkpoint_ids=[meta.checkpoint_id]) as session, \
            hold(store.storage, purpose, [meta.checkpoint_id]):
        # Re-read under the lease: "latest" may have moved since the check above.
        meta = store.resolve(ref)
        latest = session.lineage.latest
        if latest is not None and latest.checkpoint_id != meta.checkpoint_id:
            # the rescaled state would become the latest and silently drop every run
            # committed after the source: a fork (checkpoint/lineage.py)
            raise UsageError(
                f"checkpoint {meta.checkpoint_id} of job {store.job!r} is not the latest "
                f"({latest.checkpoint_id}): a rescale continues the lineage from its latest "
                f"checkpoint; to go back to checkpoint {meta.checkpoint_id} first, roll back "
                f"explicitly (`ckpt doctor --rollback-to {meta.checkpoint_id} --reason ...`)")
        plan = plan_rescale(meta, parallelism)
        checkpoint_id = meta.checkpoint_id + 1  # lineage.py: a commit's id is parent + 1
        specs = _task_specs(store, meta, plan, checkpoint_id, compact, _fail_subtask)
        description = (f"ckpt rescale {store.job} chk-{meta.checkpoint_id} "
                       f"{plan.from_parallelism} -> {parallelism}")
        results: list[dict] = []
        attempt = Attempt(store, checkpoint_id)
        try:
            t_tasks = time.perf_counter()
            results = _run_tasks(specs, store, master, spark, description, progress)
            attempt.add_uploaded(p for r in results if r.get("ok")
                                 for p in r.get("uploaded_paths", []))
            tasks_seconds = time.perf_counter() - t_tasks
            failed = [r for r in results if not r.get("ok")]
            if failed or len(results) != len(specs):
                causes = "; ".join(f"subtask {r['index']}: {r['error']}" for r in failed[:5])
                raise SnapshotError(
                    f"rescale of checkpoint {meta.checkpoint_id} to parallelism {parallelism} "
                    f"failed in {len(failed)} of {len(specs)} new subtasks ({causes}); nothing "
                    f"was committed and checkpoint {meta.checkpoint_id} is unchanged")
            where = f"rescale of checkpoint {meta.checkpoint_id}"
            handles = [SubtaskHandle.from_json(r["handle"], where) for r in results]
            new_meta = build_metadata(
                job=store.job, checkpoint_id=checkpoint_id, parent=meta.checkpoint_id,
                max_parallelism=meta.max_parallelism, states=meta.states, handles=handles,
                kind="rescale", rescaled_from=meta.parallelism, inputs=meta.input,
                source={"checkpoint_id": meta.checkpoint_id, "parallelism": meta.parallelism,
                        "run_id": meta.run_id},
                extra={**meta.extra, "rescale": {"from_parallelism": meta.parallelism,
                                                 "to_parallelism": parallelism,
                                                 "source_checkpoint_id": meta.checkpoint_id,
                                                 "compacted": compact}})
            # Time is state too: the rescaled lineage keeps its watermark and clock.
            new_meta = new_meta.with_changes(watermark=meta.watermark,
                                             processing_time=meta.processing_time)
            attempt.commit(new_meta)  # discards the attempt itself if the commit fails
        except BaseException as exc:
            attempt.discard()
            if isinstance(exc, CkptError):
                raise
            raise SnapshotError(
                f"rescale of checkpoint {meta.checkpoint_id} to parallelism {parallelism} "
                f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                f"nothing was committed and checkpoint {meta.checkpoint_id} is unchanged"
            ) from exc
    results.sort(key=lambda r: r["index"])
    summary = {
        "dry_run": False,
        "job": store.job,
        "checkpoint_id": checkpoint_id,
        "source_checkpoint_id": meta.checkpoint_id,
        "from_parallelism": meta.parallelism,
        "to_parallelism": parallelism,
        "max_parallelism": meta.max_parallelism,
        "bytes_downloaded": sum(r["bytes_downloaded"] for r in results),
        "bytes_uploaded": new_meta.bytes_uploaded,
        "bytes_referenced": new_meta.bytes_referenced,
        "files_reused": sum(r["files_reused"] for r in results),
        "entries_imported": sum(r["entries_imported"] for r in results),
        "rows": sum(r["rows"] for r in results),
        "compacted": compact,
        "compacted_subtasks": sum(bool(r.get("compacted")) for r in results),
        "subtasks": [{"index": r["index"], "base": s.base,
                      "clipped_share": r.get("clipped_share"),
                      "compacted": r.get("compacted"), "scratch": r.get("scratch"),
                      "imports": [i.source for i in s.imports], "rows": r["rows"],
                      "bytes_downloaded": r["bytes_downloaded"],
                      "bytes_uploaded": r["bytes_uploaded"], "files_reused": r["files_reused"],
                      "timings": {k: round(v, 4) for k, v in r["timings"].items()}}
                     for r, s in zip(results, plan.subtasks, strict=True)],
        "tasks_seconds": round(tasks_seconds, 4),
        "duration_seconds": round(time.perf_counter() - started, 4),
    }
    return summary
