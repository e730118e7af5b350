"""``ckpt list | show | dump``: JSON shapes, dumps, and one-line errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid

import pyarrow.parquet as pq
import pytest

from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore, metadata_path
from statebackend.cli import app as cli
from statebackend.storage import open_storage
from tests.statebackend.helpers import (
    dump_backends,
    fill,
    keys,
    open_backends,
    two_checkpoint_job,
)

JOB = "clicks"
SUMMARY_KEYS = {"id", "parent", "created_at", "parallelism", "max_parallelism",
                "files_referenced", "bytes_referenced", "bytes_uploaded", "subtasks"}
CKPT_BIN = os.path.join(os.path.dirname(sys.executable), "ckpt")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return two_checkpoint_job(str(tmp_path_factory.mktemp("cli")), JOB)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_json(job, capsys):
    code, out, err = run(capsys, "--storage", job["url"], "--job", JOB, "list", "--json")
    assert code == 0 and err == ""
    items = json.loads(out)
    assert [i["id"] for i in items] == [1, 2]
    assert [i["parent"] for i in items] == [None, 1]
    for item in items:
        assert SUMMARY_KEYS <= set(item)
        assert item["parallelism"] == 2 and item["max_parallelism"] == 128
        assert [s["index"] for s in item["subtasks"]] == [0, 1]
        assert [(s["key_group_start"], s["key_group_end"]) for s in item["subtasks"]] == \
            [(0, 63), (64, 127)]
    assert items[1]["bytes_uploaded"] < items[0]["bytes_uploaded"] == items[0]["bytes_referenced"]
    code, out, _ = run(capsys, "--storage", job["url"], "--job", JOB, "list")
    assert code == 0 and "run-2" in out and len(out.strip().splitlines()) == 3


def test_show_json(job, capsys):
    code, out, _ = run(capsys, "--storage", job["url"], "--job", JOB, "show", "--json")
    latest = json.loads(out)
    assert code == 0 and latest["id"] == 2 and SUMMARY_KEYS <= set(latest)
    meta = job["store"].load(2)
    assert latest["files_referenced"] == len(meta.files)
    assert latest["bytes_referenced"] == sum(f.size for f in meta.files)
    assert latest["bytes_uploaded"] == meta.bytes_uploaded
    for ref in ("1", "chk-1"):
        code, out, _ = run(capsys, "--storage", job["url"], "--job", JOB, "show", ref, "--json")
        assert code == 0 and json.loads(out)["id"] == 1
    code, out, _ = run(capsys, "--storage", job["url"], "--job", JOB, "show")
    assert code == 0 and "checkpoint 2 of job clicks" in out and "key groups [64, 127]" in out


def _canonical(rows):
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def test_dump_jsonl_and_parquet(job, capsys, tmp_path):
    out_path = tmp_path / "rows.jsonl"
    code, out, _ = run(capsys, "--storage", job["url"], "--job", JOB, "dump", "--out",
                       str(out_path))
    assert code == 0 and f"wrote {len(job['rows'])} rows of checkpoint 2" in out
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert _canonical(rows) == _canonical(job["rows"])
    assert set(rows[0]) == {"state", "key", "user_key", "value", "key_group", "subtask"}
    assert any(isinstance(r["value"], dict) for r in rows)  # records / JSON as objects

    pq_path = tmp_path / "rows.parquet"
    code, _, _ = run(capsys, "--storage", job["url"], "--job", JOB, "dump", "1", "--out",
                     str(pq_path), "--format", "parquet")
    assert code == 0
    table = pq.read_table(pq_path).to_pylist()
    assert {r["state"] for r in table} == {"totals", "events", "attrs", "maxima", "avg"}
    assert all(isinstance(r["key_group"], int) and r["subtask"] in (0, 1) for r in table)
    first = next(r for r in table if r["state"] == "totals")
    assert set(json.loads(first["value"])) == {"count", "sum", "flag"}


def test_dump_json_report(job, capsys, tmp_path):
    for fmt, out_path in (("jsonl", tmp_path / "rows.jsonl"), ("parquet", tmp_path / "pq")):
        code, out, _ = run(capsys, "--storage", job["url"], "--job", JOB, "dump", "--out",
                           str(out_path), "--format", fmt, "--json")
        assert code == 0
        assert json.loads(out) == {"checkpoint": 2, "rows": len(job["rows"]),
                                   "out": str(out_path), "format": fmt}
    assert len(pq.read_table(tmp_path / "pq")) == len(job["rows"])
    line = _error(capsys, "--storage", job["url"], "--job", JOB, "dump", "--out", "-", "--json")
    assert "dump --json" in line and "--out -" in line


def test_console_script(job, tmp_path):
    env = dict(os.environ, CKPT_STORAGE=job["url"], CKPT_JOB=JOB)
    proc = subprocess.run([CKPT_BIN, "show", "latest", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["id"] == 2
    proc = subprocess.run([CKPT_BIN, "show", "42"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "checkpoint 42" in proc.stderr


def _error(capsys, *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code != 0
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckpt: error: ")
    return lines[0]


def test_unknown_job_and_missing_checkpoint(job, capsys):
    msg = _error(capsys, "--storage", job["url"], "--job", "nope", "list")
    assert "job 'nope' not found" in msg
    msg = _error(capsys, "--storage", job["url"], "--job", JOB, "show", "7")
    assert "checkpoint 7 of job 'clicks' not found" in msg
    msg = _error(capsys, "--storage", job["url"], "--job", JOB, "dump", "7", "--out", "/dev/null")
    assert "checkpoint 7" in msg
    msg = _error(capsys, "--storage", job["url"], "--job", JOB, "show", "banana")
    assert "'banana'" in msg


@pytest.fixture
def broken(tmp_path):
    """A job whose single checkpoint's metadata each test corrupts in its own way."""
    url = f"file://{tmp_path}/store"
    store = CheckpointStore(open_storage(url), "broken")
    (backend,) = open_backends(str(tmp_path / "work"), 1)
    fill([backend], keys(50))
    meta = checkpoint_backends(store, [backend], parent=None)
    backend.close()
    path = tmp_path / "store" / "broken" / metadata_path(1)
    return url, path, meta


def _rewrite(path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    os.chmod(path, 0o644)
    path.write_text(json.dumps(data))


def _set_first_shared_path(value):
    def change(data):
        data["subtasks"][0]["shared_files"][0]["path"] = value
    return change


@pytest.mark.parametrize(("case", "expected"), [
    ("malformed", "malformed or truncated metadata"),
    ("truncated", "malformed or truncated metadata"),
    ("absolute", "is absolute"),
    ("dotdot", "escapes the job root"),
    ("version", "format version 99"),
    ("missing-key", "missing key 'subtasks'"),
])
def test_bad_metadata_is_one_line_naming_the_file(broken, capsys, case, expected):
    url, path, _ = broken
    if case == "malformed":
        path.write_text("{this is not json")
    elif case == "truncated":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    elif case == "absolute":
        _rewrite(path, _set_first_shared_path("/etc/passwd"))
    elif case == "dotdot":
        _rewrite(path, _set_first_shared_path("shared/../../other-job/shared/x.sst"))
    elif case == "version":
        _rewrite(path, lambda d: d.update(format_version=99))
    elif case == "missing-key":
        _rewrite(path, lambda d: d.pop("subtasks"))
    for command in (["show", "1"], ["dump", "--out", os.devnull]):
        msg = _error(capsys, "--storage", url, "--job", "broken", *command)
        assert expected in msg
        assert "broken/chk-1/_metadata" in msg
    # `list` lists what it can and names the broken record in its row (exit 1)
    assert cli.main(["--storage", url, "--job", "broken", "list"]) == 1
    out = capsys.readouterr().out
    assert "malformed record" in out and expected in out and "broken/chk-1/_metadata" in out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_storage(capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    msg = _error(capsys, "--storage", "s3://unreachable-bucket/root", "--job", JOB, "list")
    assert "unreachable" in msg and "s3://unreachable-bucket/root" in msg


def test_missing_bucket_on_a_live_server(s3_server, capsys):
    msg = _error(capsys, "--storage", "s3://no-such-bucket-xyz/root", "--job", JOB, "list")
    assert "no-such-bucket-xyz" in msg


def test_list_show_dump_on_s3(s3_server, capsys, tmp_path):
    url = f"s3://ckpt-test/{uuid.uuid4().hex}"  # the bucket tests/conftest.py creates
    store = CheckpointStore(open_storage(url), JOB)
    (backend,) = open_backends(str(tmp_path / "work"), 1)
    fill([backend], keys(300))
    checkpoint_backends(store, [backend], parent=None)
    rows = dump_backends([backend])
    backend.close()
    code, out, _ = run(capsys, "--storage", url, "--job", JOB, "list", "--json")
    assert code == 0 and [i["id"] for i in json.loads(out)] == [1]
    out_path = tmp_path / "rows.jsonl"
    code, _, _ = run(capsys, "--storage", url, "--job", JOB, "dump", "latest", "--out",
                     str(out_path))
    assert code == 0
    dumped = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert _canonical(dumped) == _canonical(rows)
