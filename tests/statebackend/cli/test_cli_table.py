"""The CLI contract as a table: every subcommand x (--help, text, --json, bad job, bad id,
bad URL) -> exit code, with exactly one ``ckpt: error: ...`` line for every error.

Also: the one exit-code mapping, global options anywhere, --version, human-readable
text next to exact JSON, ``dump --out -`` and a closed stdout (real subprocesses).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from statebackend import errors
from statebackend.cli import app as cli
from statebackend.formatting import human_age
from statebackend.storage import open_storage
from tests.statebackend.helpers import two_checkpoint_job

JOB = "clicks"
CKPT_BIN = os.path.join(os.path.dirname(sys.executable), "ckpt")
BAD_URLS = ("ftp://host/x", "file:///nonexistent-ckpt-root/x")

# command: (text args, --json args, bad-id args or None when the command takes no id)
# `dump` has no --json: its machine-readable output is `--out -` (JSON lines).
TABLE: dict[str, tuple[list[str], list[str], list[str] | None]] = {
    "jobs": ([], ["--json"], None),
    "list": ([], ["--json"], None),
    "show": (["1"], ["latest", "--json"], ["99"]),
    "dump": (["--out", "{tmp}/rows.jsonl"], ["--out", "-"], ["99", "--out", "-"]),
    "retain": (["--keep", "5", "--dry-run"], ["--keep", "5", "--dry-run", "--json"], None),
    "gc": (["--dry-run"], ["--dry-run", "--json"], None),
    "savepoint": (["1", "--name", "sp-text"], ["2", "--name", "sp-json", "--json"],
                  ["99", "--name", "sp-bad"]),
    "savepoints": ([], ["--json"], None),
    "leases": ([], ["--json"], None),
    "validate": ([], ["--json"], ["99"]),
    "rescale": (["--parallelism", "1", "--dry-run"],
                ["--parallelism", "1", "--dry-run", "--json"],
                ["99", "--parallelism", "1", "--dry-run"]),
    "doctor": ([], ["--json"], ["--rollback-to", "99", "--reason", "x", "--dry-run"]),
}
ROOT_COMMANDS = {"jobs"}  # need --storage only: a bad --job does not apply
# Commands that load a job module (MODULE:ATTR): their successful runs are tested elsewhere
# (tests/jobs/test_run_protocol.py runs `ckpt run` as a subprocess, tests/evolution
# `ckpt check`, tests/jobs/test_bootstrap.py `ckpt bootstrap`, tests/jobs/test_transform.py
# `ckpt migrate`); their refusals here.
SPARK_COMMANDS = {"run": ["jobs.keyed_aggregation:JOB", "--input", "{tmp}", "--run-id", "r",
                          "--output", "{tmp}/out"],
                  "check": ["jobs.keyed_aggregation:JOB"],
                  "bootstrap": ["jobs.keyed_aggregation:JOB", "--state", "totals={tmp}",
                                "--savepoint", "sp", "--parallelism", "2"],
                  "migrate": [f"{JOB}:latest", "tests.jobs.transform_data:split_per_key",
                              "--to", "jobs.keyed_aggregation:JOB", "--savepoint", "sp"]}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return two_checkpoint_job(str(tmp_path_factory.mktemp("cli-table")), JOB)


@pytest.fixture(autouse=True)
def no_progress(monkeypatch):
    monkeypatch.setenv("CKPT_PROGRESS", "off")  # stderr holds errors only
    monkeypatch.delenv("CKPT_STORAGE", raising=False)
    monkeypatch.delenv("CKPT_JOB", raising=False)


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ckpt: error: "), err
    return lines[0]


def argv_of(job, command: str, args: list[str], *, storage: str | None = None,
            job_name: str = JOB) -> list[str]:
    glob = ["--storage", storage or job["url"]]
    if command not in ROOT_COMMANDS:
        glob += ["--job", job_name]
    return [command, *[a.format(tmp=job["tmp"]) for a in args], *glob]


def test_table_covers_every_subcommand():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(TABLE) | set(SPARK_COMMANDS), \
        "add the new command's row to TABLE"


@pytest.mark.parametrize(("args", "text"), [
    (["--storage", "{tmp}/store"], "module 'nosuch' not found"),       # bad job (module)
    (["--storage", "ftp://host/x"], "unsupported scheme 'ftp'"),          # bad URL
])
def test_run_refusals_are_one_line_before_spark(job, args, text, capsys):
    argv = ["run", "nosuch:JOB" if "module" in text else SPARK_COMMANDS["run"][0],
            *SPARK_COMMANDS["run"][1:], *args]
    code, out, err = run(capsys, [a.format(tmp=job["tmp"]) for a in argv])
    assert (code, out) == (2, "")
    assert text in error_line(err)


def test_run_help_lists_the_shared_options(capsys):
    code, out, err = run(capsys, ["run", "--help"])
    assert code == 0 and err == "" and out.startswith("usage: ckpt run")
    assert "--run-id" in out and "--remote" in out and "--logical-time-ms" in out


@pytest.mark.parametrize("command", sorted(TABLE))
def test_help(command, capsys):
    code, out, err = run(capsys, [command, "--help"])
    assert code == 0 and err == ""
    assert out.startswith(f"usage: ckpt {command}") and "--storage URL" in out


@pytest.mark.parametrize("command", sorted(TABLE))
def test_text(job, command, capsys):
    code, out, err = run(capsys, argv_of(job, command, TABLE[command][0]))
    assert (code, err) == (0, "")
    assert out.strip()
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


@pytest.mark.parametrize("command", sorted(TABLE))
def test_json(job, command, capsys):
    code, out, err = run(capsys, argv_of(job, command, TABLE[command][1]))
    assert code == 0
    if command == "dump":
        rows = [json.loads(line) for line in out.splitlines()]
        assert len(rows) == len(job["rows"])
        assert err == f"wrote {len(rows)} rows of checkpoint 2 to stdout\n"
        return
    assert err == ""
    assert isinstance(json.loads(out), dict | list)


@pytest.mark.parametrize("command", sorted(set(TABLE) - ROOT_COMMANDS))
def test_bad_job(job, command, capsys):
    code, out, err = run(capsys, argv_of(job, command, TABLE[command][0], job_name="nope"))
    assert (code, out) == (2, "")
    assert "job 'nope' not found" in error_line(err)


@pytest.mark.parametrize("command", sorted(c for c, row in TABLE.items() if row[2] is not None))
def test_bad_id(job, command, capsys):
    code, out, err = run(capsys, argv_of(job, command, TABLE[command][2]))
    assert (code, out) == (2, "")
    assert "checkpoint 99 of job 'clicks' not found" in error_line(err)


@pytest.mark.parametrize("bad_url", BAD_URLS)
@pytest.mark.parametrize("command", sorted(TABLE))
def test_bad_url(job, command, bad_url, capsys):
    code, out, err = run(capsys, argv_of(job, command, TABLE[command][0], storage=bad_url))
    assert (code, out) == (2, "")
    line = error_line(err)
    assert "ftp" in line if bad_url.startswith("ftp") else "nonexistent-ckpt-root" in line


@pytest.mark.parametrize(("argv", "code", "text"), [
    (["show", "banana"], 2, "'banana'"),                         # an id that is no id
    (["savepoint", "--delete", "nosuch"], 2, "savepoint 'nosuch'"),
    (["rescale", "--parallelism", "0", "--dry-run"], 2, "parallelism"),
    (["retain", "--keep", "0"], 2, "--keep 0"),
    (["dump", "--out", "-", "--format", "parquet"], 2, "cannot be written to stdout"),
])
def test_other_errors_are_one_line(job, capsys, argv, code, text):
    got, out, err = run(capsys, argv_of(job, argv[0], argv[1:]))
    assert (got, out) == (code, "")
    assert text in error_line(err)


def test_missing_global_options_are_one_line(capsys):
    code, _, err = run(capsys, ["list"])
    assert code == 2 and "needs --storage" in error_line(err)
    code, _, err = run(capsys, ["list", "--storage", "/tmp"])
    assert code == 2 and "needs --job" in error_line(err)


# -- the exit-code table --------------------------------------------------------
@pytest.mark.parametrize(("cls", "code"), [
    (errors.CkptError, 1), (errors.MetadataError, 1), (errors.UnsafePathError, 1),
    (errors.UnsupportedFormatVersionError, 1), (errors.SerializationError, 1),
    (errors.LeaseConflictError, 1), (errors.LeaseLostError, 1), (errors.SnapshotError, 1),
    (errors.CorruptStateError, 1), (errors.InputError, 1), (errors.MissingFilesError, 1),
    (errors.UsageError, 2), (errors.StorageError, 2), (errors.StorageFullError, 2),
    (errors.JobNotFoundError, 2), (errors.CheckpointNotFoundError, 2),
])
def test_exit_code_mapping(cls, code):
    assert cli.exit_code_of(cls("x")) == code


def test_help_documents_the_exit_codes(capsys):
    code, out, _ = run(capsys, ["--help"])
    assert code == 0
    for line in ("0    ok", "1    a check failed or the operation was refused",
                 "2    usage or access error", "141  stdout was closed"):
        assert line in out


# -- global options, version ----------------------------------------------------
def test_global_options_anywhere(job, capsys, monkeypatch):
    url = job["url"]
    for argv in (["--storage", url, "--job", JOB, "list", "--json"],
                 ["list", "--json", "--storage", url, "--job", JOB],
                 ["--storage", url, "list", "--job", JOB, "--json"],
                 ["--job", "nope", "list", "--job", JOB, "--storage", url, "--json"]):
        code, out, err = run(capsys, argv)
        assert (code, err) == (0, ""), argv
        assert [c["id"] for c in json.loads(out)] == [1, 2]
    monkeypatch.setenv("CKPT_STORAGE", url)
    monkeypatch.setenv("CKPT_JOB", "nope")
    code, out, _ = run(capsys, ["show", "--job", JOB, "--json"])  # overrides the env
    assert code == 0 and json.loads(out)["id"] == 2
    code, _, err = run(capsys, ["show"])
    assert code == 2 and "job 'nope' not found" in error_line(err)


def test_version(capsys):
    code, out, _ = run(capsys, ["--version"])
    assert code == 0 and out == f"ckpt {importlib.metadata.version('ckpt-lifecycle')}\n"


# -- human text, exact JSON -----------------------------------------------------
@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1_258_291, "1.2 MiB"),
    (3 * 1024 ** 3, "3.0 GiB"), (5 * 1024 ** 4, "5.0 TiB"), (2 * 1024 ** 5, "2.0 PiB"),
])
def test_human_bytes(n, text):
    assert cli.human_bytes(n) == text


@pytest.mark.parametrize(("seconds", "text"), [
    (-5, "just now"), (0.5, "just now"), (59, "59 s ago"), (180, "3 min ago"),
    (3599, "59 min ago"), (7200, "2 h ago"), (3 * 86400 + 5, "3 d ago"),
])
def test_human_age(seconds, text):
    assert human_age(seconds) == text


def test_list_and_jobs_text_is_human_json_is_exact(job, capsys):
    code, out, _ = run(capsys, argv_of(job, "list", ["--json"]))
    items = json.loads(out)
    assert all(isinstance(i["bytes_referenced"], int) for i in items)
    code, out, _ = run(capsys, argv_of(job, "list", []))
    assert code == 0
    for item, line in zip(items, out.splitlines()[1:], strict=True):
        assert cli.human_bytes(item["bytes_referenced"]) in line
        assert str(item["bytes_referenced"]) not in line  # no raw byte counts
        assert item["created_at"] not in line and ("ago" in line or "just now" in line)
        words = line.split()
        backend = words[words.index(f"{item['parallelism']}/{item['max_parallelism']}") + 1]
        assert backend == item["state_backend"] == "rocksdb"  # the column after P/M
    code, out, _ = run(capsys, argv_of(job, "jobs", ["--json"]))
    (row,) = [j for j in json.loads(out) if j["job"] == JOB]
    latest = job["store"].load(2)
    assert row["latest"] == 2 and row["checkpoints"] == 2 and row["parallelism"] == 2
    assert row["bytes_referenced"] == latest.bytes_referenced
    assert row["created_at"] == latest.created_at and row["error"] is None
    code, out, _ = run(capsys, argv_of(job, "jobs", []))
    (line,) = [x for x in out.splitlines() if x.startswith(JOB)]
    assert cli.human_bytes(latest.bytes_referenced) in line


def test_jobs_lists_only_job_folders(tmp_path, capsys):
    url = f"file://{tmp_path}"
    storage = open_storage(url)
    storage.write_bytes("a/chk-1/0/x", b"x")         # an attempt, no commit yet
    storage.write_bytes("b/savepoints/s/_claim", b"{}")
    storage.write_bytes("c/leases/writer.json", b"{bad")  # unreadable lease: reported in its row
    storage.write_bytes("not-a-job/readme.txt", b"hi")
    # --all: folders with nothing committed too (by default only "c": an error is shown)
    code, out, err = run(capsys, ["jobs", "--storage", url, "--json", "--all"])
    assert (code, err) == (0, "")
    rows = {r["job"]: r for r in json.loads(out)}
    assert set(rows) == {"a", "b", "c"}
    assert rows["a"]["checkpoints"] == 0 and rows["a"]["latest"] is None
    assert rows["b"]["savepoints"] == 1
    assert "malformed lease" in rows["c"]["error"]


# -- dump to stdout -------------------------------------------------------------
def test_dump_to_stdout_matches_the_backends(job, capsys):
    code, out, err = run(capsys, argv_of(job, "dump", ["1", "--out", "-"]))
    assert code == 0 and err.startswith("wrote ") and err.endswith(" to stdout\n")
    assert not os.path.exists("-")
    code, out, err = run(capsys, argv_of(job, "dump", ["--out", "-"]))
    rows = sorted(json.dumps(json.loads(line), sort_keys=True) for line in out.splitlines())
    assert rows == sorted(json.dumps(r, sort_keys=True) for r in job["rows"])


# -- a closed stdout --------------------------------------------------------------
def _env(job) -> dict:
    return dict(os.environ, CKPT_STORAGE=job["url"], CKPT_JOB=JOB, CKPT_PROGRESS="off")


def test_closed_stdout_exits_141_without_traceback(job):
    proc = subprocess.Popen([CKPT_BIN, "list", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(job))
    proc.stdout.close()  # the reader is gone before ckpt writes (it is still importing)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == cli.EXIT_CLOSED_PIPE
    assert err == b""


@pytest.mark.parametrize(("args", "codes"), [
    ("list --json", (0, cli.EXIT_CLOSED_PIPE)),  # small: may fit the pipe buffer
    ("dump --out -", (cli.EXIT_CLOSED_PIPE,)),   # ~400 KB: always hits the closed pipe
])
def test_pipe_into_head(job, tmp_path, args, codes):
    script = (f'"{CKPT_BIN}" {args} 2>"{tmp_path}/err" | head -c 10 >/dev/null; '
              'echo "${PIPESTATUS[0]}"')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env=_env(job), timeout=120)
    assert int(proc.stdout.strip()) in codes
    assert (tmp_path / "err").read_text() == ""


@pytest.mark.parametrize(("command", "args", "blocked", "extra"), [
    ("rescale", ["--parallelism", "1"], "pyspark", "spark"),
    ("validate", [], "great_expectations", "validate"),
])
def test_a_missing_extra_is_a_one_line_install_hint(job, command, args, blocked, extra,
                                                    capsys, monkeypatch):
    """As in a core-only install (tests/test_wheel.py installs one): no traceback."""
    import sys

    for name in [m for m in sys.modules if m == blocked or m.startswith(blocked + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, blocked, None)  # `import blocked` now fails
    code, out, err = run(capsys, argv_of(job, command, args + (
        ["--report", "now"] if command == "validate" else [])))
    assert (code, out) == (2, "")
    line = error_line(err)
    assert f"needs the {extra} extra" in line and f"ckpt-lifecycle[{extra}]" in line
