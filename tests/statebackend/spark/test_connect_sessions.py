"""`statebackend.spark.connect_sessions` without a server: the record of a job's kept
session, its code digest and the session URLs (the server's side: tests/spark/
test_connect.py)."""

from __future__ import annotations

import json
import os
import sys
import uuid

import pytest

from statebackend.errors import UsageError
from statebackend.spark import connect_sessions as cs


def _job(tmp_path, job: str = "orders", server: str = "sc://127.0.0.1:15002") -> cs.JobSession:
    return cs.JobSession(server, "file:///data/store", job, str(tmp_path / "connect-sessions"))


def test_a_recorded_session_is_found_for_the_same_code_only(tmp_path):
    job = _job(tmp_path)
    assert job.recorded("code-1") is None  # nothing recorded yet
    sid = cs.new_session_id()
    job.record(sid, "code-1")
    assert job.recorded("code-1") == sid
    assert job.recorded("code-2") is None  # changed code: a new session
    # another job, server or storage root has a record of its own
    assert _job(tmp_path, job="other").recorded("code-1") is None
    assert _job(tmp_path, server="sc://127.0.0.1:15003").recorded("code-1") is None
    assert os.listdir(tmp_path / "connect-sessions") == [os.path.basename(job.path)]


def test_a_jobs_runs_rescales_and_migrations_keep_a_record_each(tmp_path):
    """Each command kind of one job has its own record (a rescale must not replace the
    runs' one); the runs' record is where it was before purposes existed."""
    where = str(tmp_path / "local")
    kept = {p: cs.kept_session("sc://127.0.0.1:15002/;token=t", "file:///data/store",
                               "orders", purpose=p, local_dir=where)
            for p in ("run", "rescale", "migrate")}
    assert all(k is not None and k.folder == f"{where}/connect-sessions" for k in kept.values())
    assert len({k.path for k in kept.values() if k}) == 3
    assert kept["run"] == _job(tmp_path / "local")  # the same record path as before
    sid = cs.new_session_id()
    kept["rescale"].record(sid, "c")  # type: ignore[union-attr]
    assert kept["rescale"].recorded("c") == sid  # type: ignore[union-attr]
    assert kept["run"].recorded("c") is None  # type: ignore[union-attr]
    with open(kept["rescale"].path) as fh:  # type: ignore[union-attr]
        assert json.load(fh)["purpose"] == "rescale"


@pytest.mark.parametrize("master, mode", [("local[2]", "job"), (None, "job"),
                                          ("spark://h:7077", "job"),
                                          ("sc://127.0.0.1:15002", "new")])
def test_no_kept_session_off_connect_or_when_asked_for_a_new_one(tmp_path, master, mode):
    assert cs.kept_session(master, "file:///s", "orders", mode=mode,
                           local_dir=str(tmp_path)) is None


def test_an_unknown_connect_session_mode_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"^connect session 'reuse' is not one of job, new$"):
        cs.kept_session("sc://h:15002", "file:///s", "orders", mode="reuse",
                        local_dir=str(tmp_path))


@pytest.mark.parametrize("content", ["not json", json.dumps({"format": 1, "code": "c"}),
                                     json.dumps({"format": 1, "code": "c",
                                                 "session_id": "../../etc"}),
                                     json.dumps({"format": 9, "code": "c",
                                                 "session_id": str(uuid.uuid4())}),
                                     json.dumps(["a list"])])
def test_a_damaged_record_means_a_new_session(tmp_path, content):
    job = _job(tmp_path)
    os.makedirs(job.folder)
    with open(job.path, "w") as fh:
        fh.write(content)
    assert job.recorded("c") is None


def test_an_unwritable_record_folder_only_loses_the_reuse(tmp_path):
    (tmp_path / "connect-sessions").write_text("a file where the folder goes")
    job = _job(tmp_path)
    job.record(cs.new_session_id(), "c")  # no error: the next run opens a new session
    assert job.recorded("c") is None


def test_the_record_names_the_server_without_the_urls_parameters(tmp_path):
    server = cs.server_of("sc://h:15002/;token=s3cr3t;use_ssl=true")
    assert server == "sc://h:15002" == cs.server_of("sc://h:15002/")
    job = cs.JobSession(server, "file:///data/store", "orders", str(tmp_path))
    job.record(cs.new_session_id(), "c")
    assert "s3cr3t" not in open(job.path).read()


def test_session_urls():
    sid = str(uuid.uuid4())
    assert cs.with_session_id("sc://h:15002", sid) == f"sc://h:15002/;session_id={sid}"
    assert cs.with_session_id("sc://h:15002/", sid) == f"sc://h:15002/;session_id={sid}"
    assert cs.with_session_id("sc://h:15002/;use_ssl=true", sid) == \
        f"sc://h:15002/;use_ssl=true;session_id={sid}"
    assert cs.names_session(f"sc://h:1/;session_id={sid}")
    assert not cs.names_session("sc://h:1/;use_ssl=true")


def test_the_servers_refusal_of_a_closed_session_is_recognised():
    closed = RuntimeError("(org.apache.spark.SparkSQLException) [INVALID_HANDLE."
                          "SESSION_CLOSED] The handle 85dc is invalid. Session was closed.")
    assert cs.is_session_closed(closed)
    assert not cs.is_session_closed(RuntimeError("[CONNECTION_REFUSED] no server"))


def test_the_code_digest_follows_every_file_of_an_imported_package(tmp_path, monkeypatch):
    """A package imported from PYTHONPATH: a change to any of its files, imported or
    not yet (a worker may import it), gives another digest; files elsewhere do not."""
    pkg = tmp_path / "my_jobs"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "later.py").write_text("X = 1\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("my_jobs")
    try:
        def digest() -> str:
            cs.code_digest.cache_clear()
            return cs.code_digest()

        before = digest()
        assert digest() == before
        later = pkg / "sub" / "later.py"
        later.write_text("X = 22\n")
        os.utime(later, ns=(later.stat().st_atime_ns, later.stat().st_mtime_ns + 10**9))
        changed = digest()
        assert changed != before
        (tmp_path / "notes.txt").write_text("not code")
        assert digest() == changed
    finally:
        sys.modules.pop("my_jobs", None)
        cs.code_digest.cache_clear()
