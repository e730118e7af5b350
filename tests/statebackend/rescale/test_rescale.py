"""Rescale-restore end to end on Spark (shared local[2] session): content, ranges, clip,
failure, leases, CLI. Source checkpoints are built in-process with every state kind."""

from __future__ import annotations

import json
import os

import pytest

from statebackend import worker_processes
from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.leases import acquire_writer_lease, list_leases, release
from statebackend.checkpoint.local_copy import instance_dir
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
from statebackend.errors import LeaseConflictError, SnapshotError, UsageError
from statebackend.rescale import executor
from statebackend.rescale.executor import RescaleOptions, rescale
from statebackend.rescale.plan import NothingToRescaleError
from statebackend.state.backend import KeyedStateBackend
from statebackend.state.keygroups import key_group_for_bytes, key_group_range_for_subtask
from statebackend.state.kinds import StateDescriptor
from statebackend.state.timers import with_timers
from statebackend.state.ttl import StateTtl
from statebackend.storage import open_storage
from tests.statebackend.helpers import (
    DESCRIPTORS,
    close_all,
    fill,
    keys,
    open_backends,
    recommit_record,
    route,
)

N_KEYS = 2000
M = 128
TIMER_TTL_DESCRIPTORS = with_timers([
    StateDescriptor("seen", "value", ttl=StateTtl(10_000, "event")),
    StateDescriptor("hist", "list", ttl=StateTtl(10_000, "event")),
    StateDescriptor("attrs", "map", ttl=StateTtl(10_000, "event")),
])


def build_source(tmp_path, url: str, p: int) -> CheckpointStore:
    """Two incremental checkpoints of ``p`` subtasks: value, list, map, reducing, aggregating."""
    store = CheckpointStore(open_storage(url), "orders")
    backends = open_backends(str(tmp_path / f"src-{p}"), p, M, DESCRIPTORS)
    ks = keys(N_KEYS)
    try:
        fill(backends, ks[: N_KEYS * 2 // 3])
        first = checkpoint_backends(store, backends, parent=None, run_id="r1")
        # overwrite part, add the rest: the second checkpoint reuses SSTs of the first
        fill(backends, ks[N_KEYS // 3 :], version=1)
        checkpoint_backends(store, backends, parent=first.checkpoint_id, run_id="r2")
    finally:
        close_all(backends)
    return store


def content(store: CheckpointStore, meta) -> list[tuple]:
    """Every entry, subtask ignored, sorted: duplicates and losses both show."""
    return sorted((r["state"], r["key"], r["user_key"] or "", json.dumps(r["value"],
                                                                        sort_keys=True))
                  for r in checkpoint_rows(store, meta))


def check_ranges_and_clip(store: CheckpointStore, meta) -> None:
    rows = list(checkpoint_rows(store, meta))
    live: dict[tuple[int, str], int] = {}
    for r in rows:
        h = meta.subtasks[r["subtask"]]
        assert h.key_group_start <= r["key_group"] <= h.key_group_end, r
        live[(r["subtask"], r["state"])] = live.get((r["subtask"], r["state"]), 0) + 1
    # live count per subtask (row_counts is counted by iterating the instance) equals the
    # number of entries whose key group is in the subtask's range: the clip removed the rest
    for h in meta.subtasks:
        for state in (d.name for d in DESCRIPTORS):
            assert h.row_counts.get(state, 0) == live.get((h.index, state), 0), (h.index, state)


PAIRS = [(1, 4), (4, 1), (2, 3), (3, 2), (3, 7), (7, 3)]


@pytest.mark.parametrize(("p", "q"), PAIRS)
def test_rescale_keeps_every_entry_once(spark, tmp_path, p, q):
    store = build_source(tmp_path, f"file://{tmp_path}/store", p)
    source = store.latest()
    before = content(store, source)
    assert len(before) > N_KEYS

    summary = rescale(store, "latest", q, spark=spark)

    new = store.latest()
    assert new.checkpoint_id == summary["checkpoint_id"] == source.checkpoint_id + 1
    assert (new.kind, new.parent, new.parallelism, new.rescaled_from) == (
        "rescale", source.checkpoint_id, q, p)
    assert (summary["from_parallelism"], summary["to_parallelism"]) == (p, q)
    assert len(summary["subtasks"]) == q and summary["duration_seconds"] > 0
    assert summary["bytes_downloaded"] > 0 and summary["bytes_uploaded"] > 0
    assert content(store, new) == before
    check_ranges_and_clip(store, new)
    # the source is untouched and no lease is left behind
    assert content(store, store.load(source.checkpoint_id)) == before
    assert list_leases(store.storage) == []


def _spark_jobs(spark) -> set[int]:
    return set(spark.sparkContext.statusTracker().getJobIdsForGroup())


def test_a_local_session_rescales_in_driver_threads_without_a_spark_job(spark, tmp_path):
    store = build_source(tmp_path, f"file://{tmp_path}/store", 3)
    before, jobs = content(store, store.latest()), _spark_jobs(spark)
    # auto (the suite's $CKPT_ENGINE is spark): local[2]'s executors are this process
    summary = rescale(store, "latest", 5, spark=spark, options=RescaleOptions(engine="auto"))
    assert summary["engine"] == "local" and "local[2]" in summary["engine_reason"]
    assert _spark_jobs(spark) == jobs
    assert content(store, store.latest()) == before
    check_ranges_and_clip(store, store.latest())


def test_a_cluster_master_with_a_large_state_rescales_as_spark_tasks(tmp_path, monkeypatch):
    from statebackend.engines import ENGINE_ENV, MAX_STATE_BYTES_ENV
    from statebackend.rescale.executor import choose_rescale_engine

    monkeypatch.delenv(ENGINE_ENV)  # auto
    store = build_source(tmp_path, f"file://{tmp_path}/store", 2)
    meta = store.latest()
    cluster = RescaleOptions(master="spark://127.0.0.1:7077")
    assert choose_rescale_engine(store, meta, cluster).engine == "local"  # a small state
    monkeypatch.setenv(MAX_STATE_BYTES_ENV, str(meta.bytes_referenced - 1))
    picked = choose_rescale_engine(store, meta, cluster)
    assert picked.engine == "spark" and MAX_STATE_BYTES_ENV in picked.reason
    assert choose_rescale_engine(store, meta, RescaleOptions(master="local[2]")).engine \
        == "local"
    memory = build_source(tmp_path, f"memory://rescale-engine-{os.getpid()}", 2)
    with pytest.raises(UsageError, match="lives in one process"):
        choose_rescale_engine(memory, memory.latest(), RescaleOptions(engine="spark"))


@pytest.mark.parametrize(("p", "q"), [(3, 2), (7, 3), (2, 5)])
def test_exports_in_worker_processes_give_the_same_checkpoint(tmp_path, monkeypatch, p, q):
    """A local rescale with enough to import exports its imports in this process's worker
    processes (statebackend.worker_processes): other processes, the same checkpoint."""
    monkeypatch.setattr(executor, "IMPORT_PROCESSES_FROM_BYTES", 0)
    monkeypatch.setattr(executor, "IMPORT_PROCESSES_COLD_FROM_BYTES", 0)
    store = build_source(tmp_path, f"file://{tmp_path}/store", p)
    before = content(store, store.latest())
    summary = rescale(store, "latest", q, options=RescaleOptions(engine="local"))
    assert summary["engine"] == "local" and summary["import_processes"]
    assert all(pid != s["pid"] for s in summary["subtasks"] for pid in s["import_pids"])
    assert content(store, store.latest()) == before
    check_ranges_and_clip(store, store.latest())


def test_a_first_local_rescale_below_the_cold_figure_exports_in_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(executor, "IMPORT_PROCESSES_FROM_BYTES", 0)
    monkeypatch.setattr(worker_processes.WorkerPool, "started", lambda self: False)
    store = build_source(tmp_path, f"file://{tmp_path}/store", 3)
    summary = rescale(store, "latest", 2, options=RescaleOptions(engine="local"))
    assert not summary["import_processes"]
    assert {pid for s in summary["subtasks"] for pid in s["import_pids"]} == {os.getpid()}


@pytest.mark.parametrize(("p", "q"), [(2, 3), (3, 2)])
def test_spark_tasks_give_the_same_checkpoint_as_driver_threads(spark, tmp_path, p, q):
    # the path a cluster or a Spark Connect server takes, asked for on the local session
    store = build_source(tmp_path, f"file://{tmp_path}/store", p)
    before, jobs = content(store, store.latest()), _spark_jobs(spark)
    summary = rescale(store, "latest", q, spark=spark, options=RescaleOptions(engine="spark"))
    assert summary["engine"] == "spark" and _spark_jobs(spark) - jobs  # ran as Spark tasks
    assert content(store, store.latest()) == before
    check_ranges_and_clip(store, store.latest())


def test_rescale_refuses_same_parallelism(spark, tmp_path):
    store = build_source(tmp_path, f"file://{tmp_path}/store", 4)
    with pytest.raises(NothingToRescaleError, match="already at parallelism 4: nothing to do"):
        rescale(store, "latest", 4, spark=spark)
    assert store.checkpoint_ids() == [1, 2]


def test_chained_rescale_3_to_5_to_2(spark, tmp_path):
    store = build_source(tmp_path, f"file://{tmp_path}/store", 3)
    before = content(store, store.latest())
    first = rescale(store, "latest", 5, spark=spark)
    # second hop restores bases that carry range tombstones of the first hop
    second = rescale(store, "latest", 2, spark=spark)
    assert second["source_checkpoint_id"] == first["checkpoint_id"]
    final = store.latest()
    assert (final.parallelism, final.rescaled_from, final.parent) == (2, 5, first["checkpoint_id"])
    assert content(store, final) == before
    check_ranges_and_clip(store, final)


def test_scale_out_compacts_clipped_bases_so_referenced_bytes_do_not_double(spark, tmp_path):
    store = build_source(tmp_path, f"file://{tmp_path}/store", 1)
    source = store.latest()
    before = content(store, source)
    summary = rescale(store, "latest", 4, spark=spark)
    new = store.latest()
    # each new subtask keeps a quarter of the old files' key groups: above the threshold
    assert all(s["compacted"] and s["clipped_share"] > 0.6 for s in summary["subtasks"])
    assert summary["compacted_subtasks"] == 4
    # kept whole, the clipped SSTs would be referenced 4 times (about 4x the bytes); the
    # rest is each new instance's fixed per-file overhead, large beside 2000 keys
    assert new.bytes_referenced < 2 * source.bytes_referenced
    assert content(store, new) == before
    check_ranges_and_clip(store, new)


def test_scale_in_keeps_whole_bases_uncompacted(spark, tmp_path):
    store = build_source(tmp_path, f"file://{tmp_path}/store", 4)
    source = store.latest()
    summary = rescale(store, "latest", 2, spark=spark)
    assert summary["compacted_subtasks"] == 0
    assert all(s["clipped_share"] == 0 for s in summary["subtasks"])
    assert content(store, store.latest()) == content(store, source)


def test_scale_in_references_every_sst_of_each_base_instead_of_uploading_it(tmp_path):
    # The clip's tombstones and the ingested SSTs reach RocksDB's level-0 trigger: an
    # automatic compaction that finished before the snapshot made a new subtask upload
    # its whole state again (26 of 30 new subtasks in 15 runs of this case, before).
    store = build_source(tmp_path, f"memory://rescale-ref-{os.getpid()}-{tmp_path.name}", 4)
    source = store.latest()
    before = content(store, source)
    summary = rescale(store, "latest", 2)
    new = store.latest()
    for sub, handle in zip(summary["subtasks"], new.subtasks, strict=True):
        base = source.subtasks[sub["base"]]
        assert {f.path for f in base.shared_files} <= {f.path for f in handle.shared_files}
        # uploaded: the imports' SSTs, the clip's tombstones and the private files only
        assert sub["bytes_uploaded"] == handle.size - sum(f.size for f in base.shared_files)
    assert content(store, new) == before


def test_compact_option_writes_only_live_data(spark, tmp_path):
    store = build_source(tmp_path, f"file://{tmp_path}/store", 1)
    source = store.latest()
    before = content(store, source)
    rescale(store, "latest", 4, spark=spark, options=RescaleOptions(compact=True))
    new = store.latest()
    source_shared = {f.path for f in source.subtasks[0].shared_files}
    assert not any(f.path in source_shared for h in new.subtasks for f in h.shared_files)
    assert content(store, new) == before


def test_failed_rescale_commits_nothing_and_cleans_up(spark, tmp_path):
    store = build_source(tmp_path, f"file://{tmp_path}/store", 3)
    source = store.latest()
    before = content(store, source)
    files_before = sorted(i.path for i in store.storage.walk_files(""))

    with pytest.raises(SnapshotError, match="failed: new subtask 2: .*injected fault.*"
                                            "nothing was committed"):
        rescale(store, "latest", 5, spark=spark, options=RescaleOptions(fail_subtask=2))

    assert store.checkpoint_ids() == [1, 2]
    # every upload of the attempt (shared SSTs of the 4 good subtasks too) is gone
    assert sorted(i.path for i in store.storage.walk_files("")) == files_before
    assert list_leases(store.storage) == []
    assert content(store, store.latest()) == before
    # and a retry succeeds
    rescale(store, "latest", 5, spark=spark)
    assert content(store, store.latest()) == before


def test_rescale_refused_while_the_job_holds_the_writer_lease(spark, tmp_path):
    store = build_source(tmp_path, f"file://{tmp_path}/store", 2)
    lease = acquire_writer_lease(store.storage, "job run r3")
    try:
        with pytest.raises(LeaseConflictError, match="job run r3"):
            rescale(store, "latest", 3, spark=spark)
    finally:
        release(store.storage, lease)
    assert store.checkpoint_ids() == [1, 2]


def test_rescale_holds_source_and_writer_lease_while_running(spark, tmp_path, monkeypatch):
    from statebackend.rescale import executor as mod
    store = build_source(tmp_path, f"file://{tmp_path}/store", 2)
    seen = []
    real = mod._run_tasks

    def spy(*args, **kwargs):
        seen.extend((lease.name, lease.checkpoint_ids) for lease in list_leases(store.storage))
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "_run_tasks", spy)
    rescale(store, "latest", 3, spark=spark)
    names = {name for name, _ in seen}
    assert "writer" in names and any(n.startswith("hold-") for n in names)
    assert all(ids == (2,) for _, ids in seen)


def test_rescale_of_an_older_checkpoint_is_refused(spark, tmp_path):
    """It would become the latest and drop the runs committed after it: a fork (issue 20).
    The way back is an explicit roll back first."""
    store = build_source(tmp_path, f"file://{tmp_path}/store", 2)
    with pytest.raises(UsageError, match=r"not the latest \(2\).*--rollback-to 1"):
        rescale(store, "1", 3, spark=spark)
    assert store.checkpoint_ids() == [1, 2] and list_leases(store.storage) == []


@pytest.mark.parametrize("engine", ["spark", "processes"])
def test_rescale_on_s3(spark, s3_server, tmp_path, monkeypatch, engine):
    from tests.conftest import S3_BUCKET

    store = build_source(tmp_path, f"s3://{S3_BUCKET}/rescale-{engine}-{os.getpid()}", 2)
    before = content(store, store.latest())
    options = RescaleOptions()
    if engine == "processes":  # the workers reach S3 with the driver's storage options
        monkeypatch.setattr(executor, "IMPORT_PROCESSES_FROM_BYTES", 0)
        monkeypatch.setattr(executor, "IMPORT_PROCESSES_COLD_FROM_BYTES", 0)
        options = RescaleOptions(engine="local")
    summary = rescale(store, "latest", 3, spark=spark, options=options)
    assert summary["import_processes"] == (engine == "processes")
    assert content(store, store.latest()) == before


# -- local recovery: what a job run left on this machine -----------------------------------

def source_left_on_this_machine(tmp_path, url: str, p: int) -> tuple[CheckpointStore, str]:
    """A checkpoint of ``p`` subtasks written from instances where job runs keep them
    (`instance_dir` under a local-recovery root), so their snapshots stay on disk."""
    store = CheckpointStore(open_storage(url), "orders")
    local = str(tmp_path / "local")
    backends = [KeyedStateBackend(instance_dir(url, "orders", i, local), DESCRIPTORS, M,
                                  key_group_range_for_subtask(M, p, i)) for i in range(p)]
    try:
        fill(backends, keys(N_KEYS))
        checkpoint_backends(store, backends, parent=None, run_id="r1")
    finally:
        close_all(backends)
    return store, local


def test_imports_read_this_machines_snapshots_instead_of_downloading(tmp_path):
    store, local = source_left_on_this_machine(tmp_path, f"file://{tmp_path}/store", 3)
    before = content(store, store.latest())
    summary = rescale(store, "latest", 2, options=RescaleOptions(engine="local",
                                                                 local_dir=local))
    modes = [s["restore_modes"] for s in summary["subtasks"]]
    assert all(len(m) == 1 + len(s["imports"]) for m, s in zip(modes, summary["subtasks"],
                                                                strict=True))
    assert {mode for m in modes for mode in m[1:]} == {"local-snapshot"}
    assert content(store, store.latest()) == before
    check_ranges_and_clip(store, store.latest())
    elsewhere = rescale(store, "latest", 3, options=RescaleOptions(
        engine="local", local_dir=str(tmp_path / "elsewhere")))
    assert {mode for s in elsewhere["subtasks"] for mode in s["restore_modes"]} == {"download"}
    assert content(store, store.latest()) == before


def test_on_s3_a_rescale_needs_no_stored_file_this_machine_holds(s3_server, tmp_path):
    """S3: the bases are copied from this machine's snapshots too (another filesystem than
    the scratch folder), their stored files checked before being referenced: deleted
    from the store, they are uploaded again from the verified local copies, so the new
    checkpoint restores from storage alone."""
    from tests.conftest import S3_BUCKET

    url = f"s3://{S3_BUCKET}/rescale-local-{os.getpid()}"
    store, local = source_left_on_this_machine(tmp_path, url, 3)
    source = store.latest()
    before = content(store, source)
    store.storage.delete_many([f.path for h in source.subtasks for f in h.shared_files])
    with pytest.raises(SnapshotError, match="restore failed"):  # nothing left to download
        rescale(store, "latest", 2, options=RescaleOptions(
            engine="local", local_dir=str(tmp_path / "elsewhere")))
    summary = rescale(store, "latest", 2, options=RescaleOptions(engine="local",
                                                                 local_dir=local))
    assert {m for s in summary["subtasks"] for m in s["restore_modes"]} == {"local-snapshot"}
    assert content(store, store.latest()) == before  # read back from S3 alone


def test_cli_rescale_json_and_show(spark, tmp_path, capsys):
    url = f"file://{tmp_path}/store"
    build_source(tmp_path, url, 3)
    code = cli.main(["--storage", url, "--job", "orders", "rescale", "latest",
                     "--parallelism", "2", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    doc = json.loads(out)
    assert (doc["checkpoint_id"], doc["from_parallelism"], doc["to_parallelism"]) == (3, 3, 2)
    assert cli.main(["--storage", url, "--job", "orders", "show", "3"]) == 0
    out, _ = capsys.readouterr()
    assert "rescaled from 3 to 2" in out
    assert cli.main(["--storage", url, "--job", "orders", "rescale", "--parallelism", "2"]) != 0
    _, err = capsys.readouterr()
    assert "already at parallelism 2: nothing to do" in err


def test_key_groups_of_test_keys_spread(tmp_path):
    # guards the fixture: the test keys must populate every key group range we cut
    groups = {key_group_for_bytes(k.encode(), M) for k in keys(N_KEYS)}
    assert len(groups) == M


def test_memory_storage_runs_tasks_in_the_driver(tmp_path):
    # no Spark: a worker process could not see this process's memory:// filesystem
    store = build_source(tmp_path, f"memory://rescale-{os.getpid()}-{tmp_path.name}", 2)
    before = content(store, store.latest())
    summary = rescale(store, "latest", 3)
    assert summary["to_parallelism"] == 3
    assert content(store, store.latest()) == before
    check_ranges_and_clip(store, store.latest())


def test_export_key_groups_writes_exactly_the_range(tmp_path):
    from rocksdict import IngestExternalFileOptions

    from statebackend.rescale.task import export_key_groups
    from statebackend.state.keygroups import KeyGroupRange, key_group_of_rocks_key

    (src,) = open_backends(str(tmp_path / "src"), 1, M, DESCRIPTORS)
    (dst,) = open_backends(str(tmp_path / "dst"), 1, M, DESCRIPTORS)
    try:
        fill([src], keys(N_KEYS))
        part = KeyGroupRange(40, 70)
        ssts = export_key_groups(src, part, str(tmp_path / "export"))
        for cf, (path, n) in ssts.items():
            assert n == src.count_keys(cf, part) > 0
            opts = IngestExternalFileOptions()
            opts.set_move_files(True)
            dst.column_family(cf).ingest_external_file([path], opts)
        for cf in src.column_families:
            got = list(dst.iter_raw(cf))
            assert got == list(src.iter_raw(cf, part))
            assert all(key_group_of_rocks_key(k) in part for k, _ in got)
    finally:
        close_all([src, dst])


# -- timers and TTL entries move with their key groups (issue 12) -------------------------

def build_timer_ttl_source(tmp_path, url: str, p: int) -> CheckpointStore:
    """``p`` subtasks with event/processing timers and TTL value, list and map entries."""
    from statebackend.state.timers import register_timers

    store = CheckpointStore(open_storage(url), "sessions")
    backends = open_backends(str(tmp_path / f"tsrc-{p}"), p, M, TIMER_TTL_DESCRIPTORS)
    ks = keys(600)
    try:
        for be, idx in zip(backends, route(ks, M, p), strict=True):
            mine = [ks[i] for i in idx]
            register_timers(be, mine, [1_000 + i for i in idx], tags=[f"s{i % 2}" for i in idx])
            register_timers(be, mine[::3], [7] * len(mine[::3]), "processing")
            be.value_state("seen").put_many(mine, idx, timestamps=idx)
            be.list_state("hist").add_many(mine + mine, idx + idx,
                                           timestamps=[i for i in idx] + [i + 5 for i in idx])
            be.map_state("attrs").put_many([(k, "x", i) for k, i in zip(mine, idx, strict=True)],
                                           timestamps=idx)
        checkpoint_backends(store, backends, parent=None, run_id="r1")
    finally:
        close_all(backends)
    return store


def check_timers_and_ttl_after_rescale(store: CheckpointStore, source, tmp_path) -> None:
    from statebackend.checkpoint.restore import FROM_STORAGE, restore_subtask
    from statebackend.state.timers import fire_due
    from statebackend.state.ttl import purge_expired
    from statebackend.validation.content import build_content

    meta = store.latest()
    table = build_content(store.storage, meta).state
    names = ["_timers", "_timer_keys", "_ttl"]
    internal = table[table["state"].isin(names)]
    # every internal entry once (the dump comparison does not see _timer_keys)
    assert len(internal) == sum(h.row_counts[n] for h in source.subtasks for n in names) > 2400
    assert table["prefix_ok"].all() and table["in_range"].all() and table["decodes"].all()
    assert table["ttl_ok"].dropna().all()
    fired_all, purged = [], 0
    for h in meta.subtasks:
        be = restore_subtask(store.storage, h, str(tmp_path / f"check-{h.index}"),
                             TIMER_TTL_DESCRIPTORS, M, FROM_STORAGE)
        try:
            fired = [(t.time, t.key) for t in fire_due(be, "event", 10**6)]
            assert [t for t, _ in fired] == sorted(t for t, _ in fired)
            assert all(key_group_for_bytes(k.encode(), M) in h.key_group_range for _, k in fired)
            fired_all += fired
            purged += purge_expired(be, "event", 10**6).entries_deleted
        finally:
            be.close()
    ks = keys(600)
    assert sorted(fired_all) == sorted((1_000 + i, k) for i, k in enumerate(ks))
    assert purged == 600 * 3  # every value, list and map entry, each from its new owner


def test_timers_and_ttl_entries_rescale_in_the_driver(tmp_path):
    store = build_timer_ttl_source(
        tmp_path, f"memory://rescale-timers-{os.getpid()}-{tmp_path.name}", 2)
    source = store.latest()
    before = content(store, source)
    rescale(store, "latest", 3)
    assert content(store, store.latest()) == before
    check_timers_and_ttl_after_rescale(store, source, tmp_path)


def test_timers_and_ttl_entries_rescale_on_spark(spark, tmp_path):
    store = build_timer_ttl_source(tmp_path, f"file://{tmp_path}/store", 3)
    source = store.latest()
    before = content(store, source)
    rescale(store, "latest", 2, spark=spark)
    assert content(store, store.latest()) == before
    check_timers_and_ttl_after_rescale(store, source, tmp_path)


def test_rescale_keeps_the_watermark_and_clock(spark, tmp_path):
    store = build_source(tmp_path, f"file://{tmp_path}/store", 2)
    obj = json.loads(store.storage.read_bytes("chk-2/_metadata"))
    obj.update(watermark=1_800_000_000_000, processing_time=1_800_000_360_000)
    recommit_record(store, 2, json.dumps(obj).encode())  # as a job with event time writes it
    rescale(store, "latest", 3, spark=spark)
    new = store.latest()
    assert (new.kind, new.watermark, new.processing_time) == (
        "rescale", 1_800_000_000_000, 1_800_000_360_000)
