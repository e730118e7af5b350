"""``ckpt retain | gc | savepoint | leases`` through statebackend.cli.main."""

from __future__ import annotations

import json

import pytest

from statebackend.cli import main
from statebackend.leases import acquire_hold
from statebackend.storage import open_storage
from tests.statebackend.test_lifecycle_scenarios import Job, keys


@pytest.fixture
def job(tmp_path):
    url = f"file://{tmp_path}/store"
    j = Job(open_storage(url), "orders", str(tmp_path / "local"))
    for v in range(4):
        j.write(keys(20), v)
        j.checkpoint()
    j.url = url
    yield j
    j.close()


def run(job, capsys, *argv) -> tuple[int, str, str]:
    code = main(["--storage", job.url, "--job", "orders", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_retain_dry_run_json_then_real(job, capsys):
    code, out, _ = run(job, capsys, "retain", "--keep", "2", "--dry-run", "--json")
    report = json.loads(out)
    assert code == 0 and report["dry_run"] and report["retired"] == [1, 2]
    assert report["files_deleted"] == 0 and report["files_planned"] > 2
    assert job.store.checkpoint_ids() == [1, 2, 3, 4]
    code, out, _ = run(job, capsys, "retain", "--keep", "2")
    assert code == 0 and "retired [1, 2]" in out and "deleted" in out
    assert job.store.checkpoint_ids() == [3, 4]


def test_retain_respects_leases(job, capsys):
    acquire_hold(job.store.storage, "validation", [1])
    code, out, _ = run(job, capsys, "retain", "--keep", "1")
    assert code == 0 and "held by lease" in out
    assert job.store.checkpoint_ids() == [1, 4]


def test_gc_json_and_text(job, capsys):
    job.store.storage.write_bytes("shared/orphan.sst", b"x" * 5)
    code, out, _ = run(job, capsys, "gc", "--json")
    report = json.loads(out)
    assert code == 0 and report["files_deleted"] == 0 and report["orphans_pending"] == 1
    assert report["grace_seconds"] == 3600
    code, out, _ = run(job, capsys, "gc", "--grace-seconds", "0", "--dry-run")
    assert code == 0 and "would delete shared/orphan.sst" in out
    code, out, _ = run(job, capsys, "gc", "--grace-seconds", "0", "--json")
    report = json.loads(out)
    assert report["files_deleted"] == 1 and report["bytes_deleted"] == 5
    assert report["by_reason"]["orphan-shared"]["files"] == 1


def test_savepoint_and_leases(job, capsys):
    code, out, _ = run(job, capsys, "savepoint", "2", "--name", "before", "--json")
    data = json.loads(out)
    assert code == 0 and data["kind"] == "savepoint" and data["source_checkpoint"] == 2
    assert data["path"] == "orders/savepoints/before"
    code, out, _ = run(job, capsys, "savepoint", "--name", "latest-one")
    assert code == 0 and "--start-from orders/savepoints/latest-one" in out
    code, out, err = run(job, capsys, "savepoint", "--name", "before")
    assert code != 0 and "already exists" in err
    acquire_hold(job.store.storage, "restore", [3])
    code, out, _ = run(job, capsys, "leases", "--json")
    data = json.loads(out)
    assert data["savepoints"] == ["before", "latest-one"] and data["leases"][0]["live"]
    code, out, _ = run(job, capsys, "leases")
    assert code == 0 and "live" in out


def test_refusals(job, capsys):
    code, _, err = run(job, capsys, "retain", "--keep", "0")
    assert code == 2 and "--keep 0" in err
    job.store.storage.write_bytes("chk-3/_metadata", b"{not json")
    before = sorted(f.path for f in job.store.storage.walk_files(""))
    for argv in (("retain", "--keep", "1"), ("gc", "--grace-seconds", "0")):
        code, _, err = run(job, capsys, *argv)
        assert code == 1 and "malformed" in err and "chk-3/_metadata" in err
    assert sorted(f.path for f in job.store.storage.walk_files("")) == before
    code = main(["--storage", job.url, "--job", "nope", "gc"])
    assert code == 1
