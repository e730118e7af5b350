"""``ckpt retain | gc | savepoint | savepoints | leases`` through statebackend.cli.app.main."""

from __future__ import annotations

import json
import re

import pytest

from statebackend.checkpoint.leases import acquire_hold
from statebackend.cli.app import main
from statebackend.errors import UsageError
from statebackend.lifecycle.savepoint import import_start_point, parse_start_spec
from statebackend.storage import open_storage
from tests.statebackend.lifecycle.test_lifecycle_scenarios import Job, keys


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
    assert code == 2  # an unknown job is a usage error (cli.EXIT_CODES), as in `show 99`


def _files_outside_savepoints(job) -> list:
    return sorted((f.path, f.size) for f in job.store.storage.walk_files("")
                  if not f.path.startswith("savepoints/"))


def test_savepoints_list_text_and_json(job, capsys):
    assert run(job, capsys, "savepoint", "2", "--name", "before")[0] == 0
    job.store.storage.write_bytes("savepoints/half/_claim", b"{}")  # an interrupted creation
    code, out, err = run(job, capsys, "savepoints", "--json")
    assert code == 0 and err == ""
    items = {s["name"]: s for s in json.loads(out)}
    assert set(items) == {"before", "half"}
    copied = job.store.storage.walk_files("savepoints/before")
    assert items["before"]["complete"] and items["before"]["source_checkpoint"] == 2
    assert items["before"]["bytes"] == sum(f.size for f in copied if f.path.count("/") > 2)
    assert items["before"]["created_at"]
    assert items["before"]["parallelism"] == job.store.load(2).parallelism
    assert (items["before"]["backend"], items["half"]["backend"]) == ("rocksdb", None)
    assert not items["half"]["complete"] and items["half"]["files"] == 1
    code, out, _ = run(job, capsys, "savepoints")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3
    assert "before" in lines[1] and re.search(r"just now|\d+ s ago", lines[1])
    assert re.search(r"\d+\.\d KiB$", lines[1])
    assert re.search(r"  \d+  rocksdb +\d+ +\d+\.\d KiB$", lines[1])  # P, backend, files
    assert "incomplete" in lines[2] and re.search(r"  -  - +1 ", lines[2])


def test_savepoint_delete_dry_run_then_real(job, capsys):
    assert run(job, capsys, "savepoint", "--name", "old")[0] == 0
    checkpoints_before = _files_outside_savepoints(job)
    code, out, _ = run(job, capsys, "savepoint", "--delete", "old", "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["dry_run"] and plan["files_deleted"] == 0
    assert plan["files"][0] == "savepoints/old/_metadata"  # the record goes first
    assert job.store.storage.exists("savepoints/old/_metadata")
    code, out, _ = run(job, capsys, "savepoint", "--delete", "old")
    assert code == 0 and f"deleted savepoint old of job orders: {len(plan['files'])} files" in out
    assert job.store.storage.list_dir("savepoints") == []
    assert _files_outside_savepoints(job) == checkpoints_before  # checkpoints untouched
    assert job.store.checkpoint_ids() == [1, 2, 3, 4]
    # an interrupted creation (no _metadata) can be removed the same way
    job.store.storage.write_bytes("savepoints/half/_claim", b"{}")
    assert run(job, capsys, "savepoint", "--delete", "half")[0] == 0
    assert job.store.storage.list_dir("savepoints") == []


def test_savepoint_delete_refusals(job, capsys):
    assert run(job, capsys, "savepoint", "--name", "busy")[0] == 0
    acquire_hold(job.store.storage, "savepoint busy: import into other", [])
    before = sorted(f.path for f in job.store.storage.walk_files(""))
    code, out, err = run(job, capsys, "savepoint", "--delete", "busy")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "savepoint 'busy' of job 'orders' is in use" in err and "import into other" in err
    assert sorted(f.path for f in job.store.storage.walk_files("")) == before
    code, _, err = run(job, capsys, "savepoint", "--delete", "nosuch")
    assert code == 2 and "savepoint 'nosuch' of job 'orders' not found" in err
    code, _, err = run(job, capsys, "savepoint", "--delete", "../x")
    assert code == 2 and err.count("\n") == 1
    code, _, err = run(job, capsys, "savepoint", "--name", "x", "--dry-run")
    assert code == 2 and "--dry-run applies to --delete" in err


def test_start_from_accepts_what_savepoint_prints(job, capsys):
    """Round trip: the URL and the --start-from hint the command prints both import."""
    code, out, _ = run(job, capsys, "savepoint", "3", "--name", "nightly")
    url = re.search(r" to (\S+); start", out).group(1)
    hint = re.search(r"--start-from (\S+)$", out.strip()).group(1)
    assert url == f"{job.url}/orders/savepoints/nightly"
    storage = open_storage(job.url)
    for spec in (url, hint, url + "/_metadata", f"{job.url[len('file://'):]}/orders/savepoints/"
                 "nightly"):
        assert parse_start_spec(storage, spec) == ("savepoint", "orders", "nightly"), spec
    code, out, _ = run(job, capsys, "savepoint", "3", "--name", "nightly2", "--json")
    printed = json.loads(out)
    assert parse_start_spec(storage, printed["url"]) == ("savepoint", "orders", "nightly2")
    assert parse_start_spec(storage, printed["start_from"]) == ("savepoint", "orders", "nightly2")
    first = import_start_point(storage, "copy", url)
    assert first.source == {"job": "orders", "checkpoint": 3, "savepoint": "nightly"}
    assert first.bytes_referenced == job.store.load(3).bytes_referenced
    with pytest.raises(UsageError, match="not under the storage root"):
        parse_start_spec(storage, "file:///elsewhere/orders/savepoints/nightly")
