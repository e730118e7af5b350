"""``ckpt jobs`` lists a folder only when it holds something committed (issue 20, defect 12).

A failed first run and a ``--start-from`` of a missing job leave folders behind (leases,
``runs/history``); they are not jobs: listed only with ``--all``, marked ``nothing
committed``. Runs go through ``ckpt run`` on the local engine (no Spark).
"""

from __future__ import annotations

import json
import re

import pytest

from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import main
from statebackend.lifecycle.savepoint import create_savepoint
from statebackend.storage import open_storage
from tests.statebackend.helpers import two_checkpoint_job

JOB_MODULE = "examples.user_activity:job"
OLD_KEYS = {"job", "checkpoints", "latest", "created_at", "parallelism", "max_parallelism",
            "bytes_referenced", "savepoints", "live_leases", "error"}


@pytest.fixture(autouse=True)
def no_progress(monkeypatch):
    monkeypatch.setenv("CKPT_PROGRESS", "off")
    monkeypatch.delenv("CKPT_STORAGE", raising=False)
    monkeypatch.delenv("CKPT_JOB", raising=False)


def ckpt(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def jobs(capsys, url, *flags) -> dict[str, dict]:
    code, out, err = ckpt(capsys, "--storage", url, "jobs", "--json", *flags)
    assert (code, err) == (0, ""), err
    rows = json.loads(out)
    assert all(set(r) == OLD_KEYS | {"committed", "backend", "state_memory"}
               for r in rows)  # keys added
    return {r["job"]: r for r in rows}


def failing_input(tmp_path):
    """An input folder whose rows are mostly malformed: the run fails, commits nothing."""
    folder = tmp_path / "in"
    folder.mkdir(exist_ok=True)
    (folder / "a.jsonl").write_text('{"user": "u1", "ts": 1, "category": "a"}\n'
                                    "not json\n{\"broken\": \n")
    return folder


def run_job(capsys, url, job, tmp_path, *extra) -> tuple[int, str]:
    code, _, err = ckpt(capsys, "--storage", url, "--job", job, "run", JOB_MODULE,
                        "--input", str(failing_input(tmp_path)),
                        "--run-id", "r1", "--output", str(tmp_path / "out"),
                        "--engine", "local", *extra)
    return code, err


def test_failed_first_run_leaves_no_listed_job(tmp_path, capsys):
    url = f"file://{tmp_path}/store"
    code, err = run_job(capsys, url, "failed", tmp_path)
    assert code != 0 and "nothing committed" in err
    assert (tmp_path / "store" / "failed" / "runs" / "history").is_dir()  # what it leaves
    assert jobs(capsys, url) == {}
    code, out, _ = ckpt(capsys, "--storage", url, "jobs")
    assert code == 0 and out.splitlines() == [
        f"(no jobs under {url})", "(1 folder with nothing committed not shown: see --all)"]
    row = jobs(capsys, url, "--all")["failed"]
    assert row["committed"] is False and row["checkpoints"] == 0 and row["error"] is None
    code, out, _ = ckpt(capsys, "--storage", url, "jobs", "--all")
    (line,) = [x for x in out.splitlines() if x.startswith("failed")]
    assert line.endswith("(nothing committed)")


@pytest.mark.parametrize("start", ["ghost:latest", "ghost/savepoints/nope"])
def test_start_from_a_missing_job_leaves_no_listed_job(tmp_path, capsys, start):
    url = f"file://{tmp_path}/store"
    committed = two_checkpoint_job(str(tmp_path / "base"), "clicks")  # another root
    code, err = run_job(capsys, url, "fresh", tmp_path, "--start-from", start)
    assert code == 2 and "ghost" in err
    # refused before any write: not even the storage root was created
    assert not (tmp_path / "store").exists()
    assert set(jobs(capsys, committed["url"])) == {"clicks"}


def test_committed_checkpoints_or_a_complete_savepoint_make_a_job(tmp_path, capsys):
    made = two_checkpoint_job(str(tmp_path), "clicks")
    url = made["url"]
    storage = open_storage(url)
    create_savepoint(made["store"], 2, "keep")
    # a job left with a savepoint only: its checkpoints and run records deleted
    spare = CheckpointStore(storage, "spare")
    storage.write_bytes("spare/savepoints/keep/_metadata",
                        made["store"].storage.read_bytes("savepoints/keep/_metadata"))
    assert spare.checkpoint_ids() == []
    storage.write_bytes("attempt/chk-1/0/x", b"x")              # an attempt, no commit
    storage.write_bytes("partial/savepoints/s/0/x", b"x")       # a savepoint being copied
    storage.write_bytes("leased/leases/writer.json", b"{bad")   # unreadable: always shown
    storage.write_bytes("history/runs/history/1-r1-failed.json", b"{}")
    storage.write_bytes("not-a-job/readme.txt", b"hi")
    rows = jobs(capsys, url)
    assert set(rows) == {"clicks", "spare", "leased"}
    assert rows["clicks"]["committed"] and rows["clicks"]["latest"] == 2
    assert rows["clicks"]["savepoints"] == 1
    assert rows["spare"]["committed"] and rows["spare"]["checkpoints"] == 0
    assert (rows["clicks"]["backend"], rows["spare"]["backend"]) == ("rocksdb", None)
    code, out, _ = ckpt(capsys, "--storage", url, "jobs")
    assert out.splitlines()[0].split()[5] == "backend"  # after P
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert re.search(r"  2  rocksdb +\S+ KiB", lines["clicks"]), lines["clicks"]  # P=2
    assert re.search(r"  -  - +- +- +1 +0$", lines["spare"]), lines["spare"]  # no checkpoint
    assert rows["leased"]["committed"] is None and "malformed lease" in rows["leased"]["error"]
    everything = jobs(capsys, url, "--all")
    assert set(everything) == {"clicks", "spare", "leased", "attempt", "partial", "history"}
    assert [j for j, r in everything.items() if r["committed"] is False] == [
        "attempt", "history", "partial"]
    assert everything["partial"]["savepoints"] == 1


def test_a_memory_backend_job_shows_the_share_of_its_limit(tmp_path, capsys):
    """The latest run's largest subtask state against the memory limit, as `ckpt show`
    records it; a RocksDB job shows none."""
    from demo.sample_data import generate_events

    generate_events(str(tmp_path / "in"), n_events=2000, n_keys=500, seed=3,
                    start_ts_ms=1_800_000_000_000, fmt="parquet")
    url = f"file://{tmp_path}/store"
    for job, backend in (("in_memory", "memory"), ("on_disk", "rocksdb")):
        code, _, err = ckpt(capsys, "--storage", url, "--job", job, "run",
                            "jobs.keyed_aggregation:JOB", "--input", str(tmp_path / "in"),
                            "--run-id", "r1", "--output", str(tmp_path / f"out-{job}"),
                            "--engine", "local", "--backend", backend, "--memory-limit-mb", "1")
        assert code == 0, err
    rows = jobs(capsys, url)
    _, shown, _ = ckpt(capsys, "--storage", url, "--job", "in_memory", "show", "--json")
    recorded = json.loads(shown)["state_memory"]
    assert rows["in_memory"]["state_memory"] == recorded and recorded["limit_bytes"] == 2**20
    assert rows["on_disk"]["state_memory"] is None
    share = f"{recorded['held_bytes'] / 2**20:.0%}"
    _, out, _ = ckpt(capsys, "--storage", url, "jobs")
    assert out.splitlines()[0].split()[7] == "mem/limit"  # after size
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert re.search(rf"  memory +\S+ \S+ +{re.escape(share)} +0 +0$", lines["in_memory"]), \
        lines["in_memory"]
    assert re.search(r"  rocksdb +\S+ \S+ +- +0 +0$", lines["on_disk"]), lines["on_disk"]
