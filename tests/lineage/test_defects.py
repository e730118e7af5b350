"""Issue 20: the reproductions of the defects in checkpoint storage, as tests.

Each test is one defect's minimal reproduction, run as a user would (the job run API
and the ``ckpt`` CLI), with the state compared to pandas over the committed runs. Runs
take both engines where an engine is involved and both durable storages (file:// and
the S3 API of moto) where storage is involved. Defects 6-8 and part of 12 have their
own tests (storage containment, inputs, the page).
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from demo.sample_data import DAY_MS, DEFAULT_START_TS_MS, expected_totals, generate_events
from jobs.keyed_aggregation import JobConfig, run
from statebackend.checkpoint import layout
from statebackend.checkpoint.lineage import log_commit
from statebackend.checkpoint.runs import run_record_path
from statebackend.cli import app as cli
from statebackend.errors import LineageError, UsageError
from statebackend.lifecycle.doctor import diagnose
from statebackend.lifecycle.savepoint import create_savepoint, list_savepoints
from tests.conftest import S3_BUCKET
from tests.jobs.helpers import assert_state_equals, dump_latest, store_of

JOB = "agg"


@pytest.fixture(params=["local", "spark"])
def engine(request) -> tuple[str, object]:
    spark = request.getfixturevalue("spark") if request.param == "spark" else None
    return request.param, spark


@pytest.fixture(params=["file", "s3"])
def storage(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    request.getfixturevalue("s3_server")
    return f"s3://{S3_BUCKET}/d-{uuid.uuid4().hex}"


class Lineage:
    """One job's days, runs and CLI calls on one storage and engine."""

    def __init__(self, tmp_path, storage: str, engine: str = "local", spark=None,
                 days: int = 4) -> None:
        self.tmp, self.storage, self.engine, self.spark = tmp_path, storage, engine, spark
        self.days = [generate_events(str(tmp_path / f"in{d}"), n_events=300, n_keys=50,
                                     seed=900 + d, start_ts_ms=DEFAULT_START_TS_MS + d * DAY_MS)
                     for d in range(days)]
        self.store = store_of(storage, JOB)

    def run(self, d: int, run_id: str | None = None) -> dict:
        return run(JobConfig(input=str(self.tmp / f"in{d}"), storage=self.storage, job=JOB,
                             run_id=run_id or f"r{d}", output=str(self.tmp / "out"),
                             parallelism=2, engine=self.engine), self.spark)

    def ckpt(self, capsys, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = cli.main(["--storage", self.storage, "--job", JOB, *args])
        except SystemExit as exc:  # argparse refuses a bad flag value
            code = int(exc.code)
        out, err = capsys.readouterr()
        return code, out, err

    def assert_state(self, days) -> None:
        assert_state_equals(dump_latest(self.storage, JOB),
                            expected_totals([self.days[d] for d in days]))


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ckpt: error:"), err
    return lines[0]


# -- defect 3: a lost `_metadata` ------------------------------------------------------
def test_a_lost_head_record_stops_runs_until_an_explicit_roll_back(tmp_path, storage, engine,
                                                                   capsys):
    job = Lineage(tmp_path, storage, *engine)
    for d in range(3):
        job.run(d)
    job.store.storage.delete_many(["chk-3/_metadata"])  # an operator "rolling back" by hand
    with pytest.raises(LineageError, match=r"checkpoint\(s\) 3 were committed .*missing"):
        job.run(3)
    with pytest.raises(LineageError, match="chk-3/_metadata is missing"):
        job.run(2)  # the lost run is not "skipped, already committed as checkpoint 3"
    code, _, err = job.ckpt(capsys, "list")
    assert code == 1 and "chk-3/_metadata is missing" in err
    code, _, err = job.ckpt(capsys, "show", "latest")
    assert code == 1 and "missing" in one_line(err)
    before = {i.path for i in job.store.storage.walk_files("")}
    code, _, err = job.ckpt(capsys, "gc", "--grace-seconds", "0")
    assert code == 1 and "nothing deleted" in one_line(err)
    assert {i.path for i in job.store.storage.walk_files("")} == before
    code, out, _ = job.ckpt(capsys, "doctor")
    assert code == 1 and "--rollback-to 2" in out
    code, out, _ = job.ckpt(capsys, "doctor", "--rollback-to", "2", "--reason", "lost chk-3",
                            "--dry-run")
    assert code == 0 and "forget-run" in out and "(dry run: nothing changed)" in out
    assert {i.path for i in job.store.storage.walk_files("")} == before
    code, out, _ = job.ckpt(capsys, "doctor", "--rollback-to", "2", "--reason", "lost chk-3")
    assert code == 0 and "runs/repairs/" in out
    assert job.run(0)["skipped"] and job.run(1)["skipped"]
    assert job.run(2)["skipped"] is False  # counted again, once, on top of checkpoint 2
    job.run(3)
    job.assert_state(range(4))
    assert not diagnose(job.store).problems


def test_a_lost_middle_record_is_marked_retired_by_the_safe_repair(tmp_path, capsys):
    job = Lineage(tmp_path, f"file://{tmp_path}/store")
    for d in range(3):
        job.run(d)
    job.store.storage.delete_many(["chk-2/_metadata"])
    with pytest.raises(LineageError, match=r"checkpoint\(s\) 2 were committed and not retired"):
        job.run(3)
    code, out, _ = job.ckpt(capsys, "doctor", "--repair")
    assert code == 0 and "mark-retired" in out
    job.run(3)
    job.assert_state(range(4))
    assert job.run(1)["skipped"]


# -- defect 1, as readers see it: a forked lineage ------------------------------------
def commit_behind_the_fence(job: Lineage, **changes) -> None:
    """What a writer without fencing left: chk-3 from chk-2's record with ``changes``,
    written with its commit-log entry as a commit would (the record and its log agree)."""
    meta = job.store.load(2).with_changes(checkpoint_id=3, **changes)
    data = meta.to_bytes()
    job.store.storage.write_bytes("chk-3/_metadata", data)
    log_commit(job.store.storage, meta, data)


@pytest.mark.parametrize("changes, words", [
    ({"parent": 1}, ["the lineage has forked: checkpoint 3 builds on checkpoint 1, not on "
                     "checkpoint 2", "chk-2/_metadata and chk-3/_metadata"]),
    ("epoch", ["checkpoint 3 was committed by writer epoch", "after checkpoint 2 of epoch",
               "a writer that had lost its lease committed"]),
])
def test_readers_refuse_a_forked_lineage_naming_both_records(tmp_path, capsys, changes,
                                                             words):
    job = Lineage(tmp_path, f"file://{tmp_path}/store")
    for d in range(2):
        job.run(d)
    if changes == "epoch":  # builds on 2, but by a writer older than 2's
        epoch = job.store.load(2).epoch
        assert epoch >= 1
        changes = {"parent": 2, "epoch": epoch - 1}
    commit_behind_the_fence(job, **changes)
    before = {i.path for i in job.store.storage.walk_files("")}
    with pytest.raises(LineageError) as info:
        job.run(2)
    assert all(w in str(info.value) for w in words), info.value
    for args in (["list"], ["show", "latest"], ["gc", "--grace-seconds", "0"],
                 ["retain", "--keep", "1"]):
        code, _, err = job.ckpt(capsys, *args)
        line = one_line(err)
        assert code == 1 and all(w in line for w in words), (args, line)
    assert {i.path for i in job.store.storage.walk_files("")} == before  # nothing deleted
    code, out, _ = job.ckpt(capsys, "doctor")
    assert code == 1 and "--rollback-to 2" in out
    code, out, _ = job.ckpt(capsys, "doctor", "--rollback-to", "2", "--reason", "fork")
    assert code == 0
    job.run(2)
    job.assert_state(range(3))
    assert not diagnose(job.store).problems


def test_doctor_rewrites_a_lost_commit_log_entry(tmp_path, capsys):
    """A committed record whose commit-log entry is gone: `ckpt doctor --repair` writes
    the entry back (the planned path is the one written), and the lineage is whole."""
    job = Lineage(tmp_path, f"file://{tmp_path}/store", days=3)
    for d in range(2):
        job.run(d)
    block = layout.chain_block_dir(2)
    entry = [f"{block}/{n}" for n in job.store.storage.list_dir(block)
             if (parsed := layout.chain_name_of(n)) is not None and parsed[0] == 2]
    assert len(entry) == 1
    job.store.storage.delete_many(entry)
    assert "unlogged" in {p.kind for p in diagnose(job.store).problems}
    code, out, _ = job.ckpt(capsys, "doctor", "--repair")
    assert code == 0 and "write-entry" in out
    assert not diagnose(job.store).problems
    assert job.store.storage.exists(entry[0])
    job.run(2)
    job.assert_state(range(3))


# -- defect 4: one lost ledger file ----------------------------------------------------
def test_a_lost_ledger_file_is_rebuilt_never_counted_twice(tmp_path, storage, engine, capsys):
    job = Lineage(tmp_path, storage, *engine)
    for d in range(3):
        job.run(d)
    assert job.ckpt(capsys, "retain", "--keep", "1")[0] == 0
    assert job.ckpt(capsys, "gc", "--grace-seconds", "0")[0] == 0
    job.store.storage.delete_many([run_record_path("r1")])
    again = job.run(1)
    assert again["skipped"] is True and again["checkpoint_id"] == 2
    assert job.store.storage.exists(run_record_path("r1"))  # rebuilt from the commit log
    job.assert_state(range(3))


def test_a_run_only_the_history_remembers_is_refused_then_rebuilt(tmp_path, capsys):
    job = Lineage(tmp_path, f"file://{tmp_path}/store")
    for d in range(3):
        job.run(d)
    job.ckpt(capsys, "retain", "--keep", "1")
    entry = [f"{layout.chain_block_dir(1)}/{n}" for n in
             job.store.storage.list_dir(layout.chain_block_dir(1)) if n.endswith("-r0.json")]
    job.store.storage.delete_many([run_record_path("r0"), *entry])
    with pytest.raises(LineageError, match="r0 are recorded as committed"):
        job.run(0)
    code, out, _ = job.ckpt(capsys, "doctor", "--repair")
    assert code == 0 and "rebuild-ledger" in out
    assert job.run(0)["skipped"] is True
    job.run(3)
    job.assert_state(range(4))


# -- defect 2: a tampered record makes retention delete what is not its own ----------------
def test_a_record_listing_reserved_files_is_refused_by_every_command(tmp_path, storage,
                                                                     capsys):
    job = Lineage(tmp_path, storage)
    for d in range(3):
        job.run(d)
    create_savepoint(job.store, "latest", "sp1")
    assert job.ckpt(capsys, "gc", "--grace-seconds", "0")[0] == 0  # writes _index/
    st = job.store.storage
    victims = ["chk-3/_metadata", "savepoints/sp1/_metadata", run_record_path("r2"),
               layout.INDEX_FILE]
    record = json.loads(st.read_bytes("chk-1/_metadata"))
    record["subtasks"][0]["private_files"] += [
        {"path": p, "local_name": f"f{i}", "size": st.info(p).size, "checksum": "crc32c:0"}
        for i, p in enumerate(victims)]
    st.write_bytes("chk-1/_metadata", json.dumps(record).encode())
    for args in (("retain", "--keep", "2"), ("gc", "--grace-seconds", "0"), ("show", "1"),
                 ("savepoint", "1", "--name", "sp2"),
                 ("dump", "1", "--out", str(tmp_path / "d.jsonl"))):
        code, _, err = job.ckpt(capsys, *args)
        line = one_line(err)
        assert code == 1 and "chk-1/_metadata" in line, (args, line)
        assert "is not a private file" in line or "is neither" in line, (args, line)
    code, out, _ = job.ckpt(capsys, "validate", "1")  # a report, whose critical check fails
    assert code == 1 and "critical: metadata_parses" in out and "is neither" in out
    assert all(st.exists(p) for p in victims)
    assert job.run(3)["skipped"] is False  # the latest is intact: runs go on
    job.assert_state(range(4))


def test_a_checkpoint_may_not_reference_savepoint_files(tmp_path, capsys):
    job = Lineage(tmp_path, f"file://{tmp_path}/store")
    job.run(0)
    create_savepoint(job.store, "latest", "sp1")
    st = job.store.storage
    record = json.loads(st.read_bytes("chk-1/_metadata"))
    sp = json.loads(st.read_bytes("savepoints/sp1/_metadata"))
    record["subtasks"][0]["shared_files"] = sp["subtasks"][0]["shared_files"]
    st.write_bytes("chk-1/_metadata", json.dumps(record).encode())
    code, _, err = job.ckpt(capsys, "show", "1")
    assert code == 1 and "savepoints/sp1/" in one_line(err)


# -- defect 5: a savepoint copies damage silently ------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_savepoint_of_a_damaged_file_fails_and_leaves_nothing(tmp_path, storage, damage,
                                                               capsys):
    job = Lineage(tmp_path, storage)
    job.run(0)
    st = job.store.storage
    sst = next(f for f in job.store.latest().files if f.path.startswith("shared/"))
    data = st.read_bytes(sst.path)
    bad = data[: len(data) // 2] if damage == "truncate" else \
        data[:100] + bytes([data[100] ^ 0x40]) + data[101:]
    st.write_bytes(sst.path, bad)
    code, _, err = job.ckpt(capsys, "savepoint", "--name", "sp1")
    line = one_line(err)
    assert code == 1 and sst.path in line and "damaged" in line
    assert "run it again" not in line
    assert list_savepoints(job.store) == []
    assert not st.walk_files(layout.savepoint_dir("sp1"))


# -- defect 9: what the metadata parser accepted ---------------------------------------
BAD_RECORDS = {
    "nul-in-path": lambda r: r["subtasks"][0]["shared_files"][0].update(
        path=r["subtasks"][0]["shared_files"][0]["path"] + "\x00x"),
    "nul-in-local-name": lambda r: r["subtasks"][0]["shared_files"][0].update(
        local_name="a\x00b"),
    "nul-in-state-name": lambda r: r["states"][0].update(name="tot\x00als"),
    "duplicate-local-name": lambda r: r["subtasks"][0]["private_files"][1].update(
        local_name=r["subtasks"][0]["private_files"][0]["local_name"]),
    "backslash-local-name": lambda r: r["subtasks"][0]["shared_files"][0].update(
        local_name="..\\x.sst"),
    "empty-checksum": lambda r: r["subtasks"][0]["shared_files"][0].update(checksum=""),
    "md5-checksum": lambda r: r["subtasks"][0]["shared_files"][0].update(
        checksum="md5:d41d8cd98f00b204e9800998ecf8427e"),
    "huge-size": lambda r: r["subtasks"][0]["shared_files"][0].update(size=10**30),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_metadata_the_parser_refuses_in_one_line(tmp_path, case, capsys):
    job = Lineage(tmp_path, f"file://{tmp_path}/store", days=1)
    job.run(0)
    st = job.store.storage
    record = json.loads(st.read_bytes("chk-1/_metadata"))
    BAD_RECORDS[case](record)
    st.write_bytes("chk-1/_metadata", json.dumps(record).encode())
    for args in (("show", "1"), ("dump", "1", "--out", "-"), ("retain", "--keep", "1")):
        code, _, err = job.ckpt(capsys, *args)
        line = one_line(err)
        assert code == 1 and "malformed metadata" in line, (case, args, line)
    code, out, err = job.ckpt(capsys, "validate", "1")
    assert code == 1 and "critical: metadata_parses" in out and "Traceback" not in err
    code, out, err = job.ckpt(capsys, "list")  # names the broken one, no traceback
    assert "malformed record" in out and "Traceback" not in err


# -- defect 10: leases and knobs ---------------------------------------------------
def test_a_lease_time_without_timezone_is_refused_with_its_repair(tmp_path, capsys):
    job = Lineage(tmp_path, f"file://{tmp_path}/store", days=2)
    job.run(0)
    job.store.storage.write_bytes("leases/writer.json", json.dumps({
        "format_version": 1, "name": "writer", "holder": "h:1", "purpose": "run x",
        "checkpoint_ids": [], "expires_at": "2020-01-01T00:00:00",
        "created_at": "2020-01-01T00:00:00+00:00"}).encode())
    with pytest.raises(Exception, match="has no timezone.*`ckpt doctor --clear-lease writer`"):
        job.run(1)
    for args in (("gc", "--grace-seconds", "0"), ("retain", "--keep", "1"),
                 ("rescale", "latest", "--parallelism", "3")):
        code, _, err = job.ckpt(capsys, *args)
        assert code == 1 and "has no timezone" in one_line(err), args
    code, out, _ = job.ckpt(capsys, "doctor", "--clear-lease", "writer")
    assert code == 0
    job.run(1)
    job.assert_state(range(2))


@pytest.mark.parametrize("env, value, fragment", [
    ("CKPT_LEASE_TTL_SECONDS", "inf", "not a finite number"),
    ("CKPT_LEASE_TTL_SECONDS", "nan", "not a finite number"),
    ("CKPT_LEASE_HEARTBEAT_SECONDS", "1e-6", "out of range"),
    ("CKPT_LOCAL_ENGINE_MAX_STATE_BYTES", "-1", "out of range"),
    ("CKPT_LOCAL_ENGINE_MAX_BYTES", "lots", "not an integer"),
])
def test_a_bad_setting_is_refused_before_any_work(tmp_path, monkeypatch, capsys, env, value,
                                                  fragment):
    job = Lineage(tmp_path, f"file://{tmp_path}/store", days=1)
    monkeypatch.setenv(env, value)
    with pytest.raises(UsageError, match=f"{env}=.*{fragment}"):
        job.run(0)
    assert not os.path.exists(tmp_path / "store")  # nothing written
    code, _, err = job.ckpt(capsys, "list")
    assert code == 2 and env in one_line(err)


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_gc_grace_seconds_must_be_a_finite_number(tmp_path, capsys, value):
    job = Lineage(tmp_path, f"file://{tmp_path}/store", days=1)
    job.run(0)
    code, _, err = job.ckpt(capsys, "gc", "--grace-seconds", value)
    assert code == 2 and "--grace-seconds" in err


# -- defect 11: one bad file blocks a job ------------------------------------------
def test_an_old_malformed_record_does_not_block_runs(tmp_path, capsys):
    job = Lineage(tmp_path, f"file://{tmp_path}/store")
    for d in range(3):
        job.run(d)
    job.store.storage.write_bytes("chk-1/_metadata", b'{"format_version": 1, "job": "agg"')
    job.run(3)  # runs go on from the intact latest
    job.assert_state(range(4))
    code, out, _ = job.ckpt(capsys, "list")
    assert "malformed record" in out and " 4 " in out
    code, _, err = job.ckpt(capsys, "gc", "--grace-seconds", "0")
    assert code == 1 and "chk-1/_metadata" in one_line(err)
    code, out, _ = job.ckpt(capsys, "doctor", "--repair")
    assert code == 0 and "quarantine" in out
    assert job.ckpt(capsys, "gc", "--grace-seconds", "0")[0] == 0
    assert job.ckpt(capsys, "retain", "--keep", "1")[0] == 0
    job.assert_state(range(4))
    assert job.run(0)["skipped"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_corrupt_writer_lease_says_how_to_clear_it(tmp_path, capsys, damage):
    job = Lineage(tmp_path, f"file://{tmp_path}/store", days=2)
    job.run(0)
    good = json.dumps({"format_version": 1, "name": "writer", "holder": "h:1",
                       "purpose": "run x", "checkpoint_ids": [],
                       "expires_at": "2020-01-01T00:00:00+00:00",
                       "created_at": "2020-01-01T00:00:00+00:00"}).encode()
    bad = good[: len(good) // 2] if damage == "truncate" else \
        good.replace(b'"writer"', b'"wr\xffter"')
    job.store.storage.write_bytes("leases/writer.json", bad)
    with pytest.raises(Exception, match="`ckpt doctor --clear-lease writer`"):
        job.run(1)
    for args in (("gc", "--grace-seconds", "0"), ("retain", "--keep", "1")):
        code, _, err = job.ckpt(capsys, *args)
        assert code == 1 and "`ckpt doctor --clear-lease writer`" in one_line(err), args
    code, out, _ = job.ckpt(capsys, "doctor")
    assert code == 1 and "lease writer: corrupt" in out
    assert job.ckpt(capsys, "doctor", "--clear-lease", "writer")[0] == 0
    job.run(1)
    job.assert_state(range(2))
