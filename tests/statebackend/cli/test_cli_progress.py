"""Progress on stderr: periodic lines off a terminal, a live bar on one; the notice while
Great Expectations loads; stdout stays clean.

Through the public CLI on real small checkpoints, in lines mode with a tiny interval:
dump, validate --deep, gc, retain, rescale (real Spark) and `ckpt run` (a subprocess:
it stops its Spark session) print their counts on stderr, stdout carries only the
result (valid JSON with --json), and CKPT_PROGRESS=off prints no progress at all.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from statebackend.checkpoint.metrics import LEGACY_RUN_KEYS, run_figures
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
from statebackend.errors import StorageError, UsageError
from statebackend.progress import Progress, choose_mode
from statebackend.storage import open_storage
from tests.statebackend.helpers import close_all, dump_backends, fill, keys, open_backends

JOB = "clicks"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_mode_writes_one_line_per_interval(monkeypatch):
    monkeypatch.delenv("CKPT_PROGRESS", raising=False)
    clock, stream = Clock(), io.StringIO()
    with Progress("dump", stream=stream, interval=5, clock=clock, thread=False) as progress:
        assert progress.mode == "lines"  # not a terminal
        progress.phase("checkpoint 2", total=1000, unit="rows")
        for _ in progress.wrap(range(240)):
            pass
        clock.now += 4.9
        assert progress.tick() is None  # quick work prints nothing
        clock.now += 0.2
        assert progress.tick() == "ckpt dump: checkpoint 2: 240/1000 rows (24%), 5 s"
        assert progress.tick() is None  # next line only after another interval
        progress.phase("loading Great Expectations")
        clock.now += 5
        assert progress.tick() == "ckpt dump: loading Great Expectations…, 10 s"
    assert stream.getvalue().splitlines() == [
        "ckpt dump: checkpoint 2: 240/1000 rows (24%), 5 s",
        "ckpt dump: loading Great Expectations…, 10 s"]


def test_mode_choice(monkeypatch):
    monkeypatch.delenv("CKPT_PROGRESS", raising=False)
    assert choose_mode(Tty()) == "bar" and choose_mode(io.StringIO()) == "lines"
    monkeypatch.setenv("CKPT_PROGRESS", "off")
    assert choose_mode(Tty()) == "off"
    monkeypatch.setenv("CKPT_PROGRESS", "lines")
    assert choose_mode(Tty()) == "lines"
    monkeypatch.setenv("CKPT_PROGRESS", "bogus")  # a typo is refused, naming the variable
    with pytest.raises(UsageError, match="CKPT_PROGRESS='bogus' is unknown"):
        choose_mode(Tty())


def test_bar_mode_on_a_terminal_shows_phase_and_count(monkeypatch):
    monkeypatch.delenv("CKPT_PROGRESS", raising=False)
    stream = Tty()
    with Progress("validate", stream=stream) as progress:
        assert progress.mode == "bar"
        progress.phase("loading Great Expectations")
        assert "ckpt validate: loading Great Expectations" in stream.getvalue()  # shown at once
        progress.phase("rows", total=10, unit="rows")
        progress.advance(4)
        progress._live.refresh()
    assert "4/10 rows" in stream.getvalue()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli-progress")
    url = f"file://{base}/store"
    store = CheckpointStore(open_storage(url), JOB)
    backends = open_backends(str(base / "work"), 2)
    fill(backends, keys(500))
    checkpoint_backends(store, backends, parent=None)
    rows = dump_backends(backends)
    close_all(backends)
    return url, rows


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_dump_shows_a_bar_on_stderr_and_clean_rows_on_stdout(job, capsys, monkeypatch):
    url, rows = job
    monkeypatch.setenv("CKPT_PROGRESS", "bar")
    code, out, err = run(capsys, "dump", "--out", "-", "--storage", url, "--job", JOB)
    assert code == 0
    assert "ckpt dump: checkpoint 1" in err and f"/{len(rows)} rows" in err
    assert err.rstrip().endswith(f"wrote {len(rows)} rows of checkpoint 1 to stdout")
    assert sorted(out.splitlines()) == sorted(json.dumps(r, sort_keys=True) for r in rows)


def test_validate_notice_is_shown_while_great_expectations_loads(job, capsys, monkeypatch):
    """The notice is on stderr before the import starts; a bad id refuses before it."""
    import statebackend.validation.suites as suites

    url, _ = job
    monkeypatch.setenv("CKPT_PROGRESS", "bar")
    seen: list[str] = []

    def slow_import() -> None:
        seen.append(capsys.readouterr().err)  # what stderr showed when the import began
        raise StorageError("stop here")  # the test needs no real validation

    monkeypatch.setattr(suites, "load_great_expectations", slow_import)
    code, out, err = run(capsys, "validate", "--storage", url, "--job", JOB)
    assert code == 2 and out == "" and "ckpt: error: stop here" in err
    assert len(seen) == 1 and "ckpt validate: loading Great Expectations" in seen[0]
    seen.clear()
    code, _, err = run(capsys, "validate", "99", "--storage", url, "--job", JOB)
    assert code == 2 and seen == [] and "loading" not in err


# -- lines mode through the CLI ------------------------------------------------------
TINY = "0.001"  # seconds: every counted phase prints its final count


def progress_lines(err: str, command: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith(f"ckpt {command}: ")]


@pytest.fixture
def lifecycle_job(tmp_path):
    """Two checkpoints (the first one retire-able) and one orphan under shared/."""
    url = f"file://{tmp_path}/store"
    store = CheckpointStore(open_storage(url), JOB)
    backends = open_backends(str(tmp_path / "work"), 2)
    fill(backends, keys(300))
    checkpoint_backends(store, backends, parent=None, run_id="r1")
    fill(backends, keys(50), version=1)
    checkpoint_backends(store, backends, parent=1, run_id="r2")
    close_all(backends)
    store.storage.write_bytes("shared/orphan-leftover.sst", b"x" * 100)
    return url, store


# command -> (arguments, the line that must appear with its counts)
LINES_CASES = {
    "dump": (["dump", "--out", "-"], r"ckpt dump: checkpoint 1: (\d+)/\1 rows \(100%\)"),
    "validate": (["validate", "--deep", "--report", "none", "--json"],
                 r"ckpt validate: deep validation of checkpoint 1: restoring and checking: "
                 r"2/2 subtasks \(100%\)"),
    "gc": (["gc", "--grace-seconds", "0", "--json"],
           r"ckpt gc: deleting orphans of job clicks: 1/1 files \(100%\)"),
    "retain": (["retain", "--keep", "1", "--json"],
               r"ckpt retain: retiring checkpoints of job clicks: commit records: "
               r"1/1 files \(100%\)"),
}


def _lines_case(command, job, lifecycle_job, capsys, monkeypatch, mode):
    monkeypatch.setenv("CKPT_PROGRESS", mode)
    monkeypatch.setenv("CKPT_PROGRESS_INTERVAL", TINY)
    args, pattern = LINES_CASES[command]
    url = job[0] if command in ("dump", "validate") else lifecycle_job[0]
    code, out, err = run(capsys, *args, "--storage", url, "--job", JOB)
    assert code == 0, err
    return out, err, pattern


@pytest.mark.parametrize("command", sorted(LINES_CASES))
def test_lines_mode_prints_counts_on_stderr_only(command, job, lifecycle_job, capsys,
                                                 monkeypatch):
    out, err, pattern = _lines_case(command, job, lifecycle_job, capsys, monkeypatch, "lines")
    lines = progress_lines(err, command)
    assert any(re.fullmatch(pattern + r", \d+ s", x) for x in lines), lines
    others = [x for x in err.splitlines() if x not in lines]
    if command == "dump":  # --out -: the rows on stdout, the report on stderr
        rows = job[1]
        assert others == [f"wrote {len(rows)} rows of checkpoint 1 to stdout"]
        assert f"{len(rows)}/{len(rows)} rows" in lines[-1]
        assert sorted(out.splitlines()) == sorted(json.dumps(r, sort_keys=True) for r in rows)
    else:
        assert others == []
        json.loads(out)  # stdout is the one JSON document, nothing else
    assert "ckpt " not in out


@pytest.mark.parametrize("command", sorted(LINES_CASES))
def test_progress_off_prints_nothing(command, job, lifecycle_job, capsys, monkeypatch):
    out, err, _ = _lines_case(command, job, lifecycle_job, capsys, monkeypatch, "off")
    assert progress_lines(err, command) == []
    assert err == (f"wrote {len(job[1])} rows of checkpoint 1 to stdout\n"
                   if command == "dump" else "")


def test_gc_and_retain_did_their_work(lifecycle_job, capsys, monkeypatch):
    """The counted deletions are real: the orphan and the retired checkpoint are gone."""
    monkeypatch.setenv("CKPT_PROGRESS", "lines")
    monkeypatch.setenv("CKPT_PROGRESS_INTERVAL", TINY)
    url, store = lifecycle_job
    code, out, err = run(capsys, "gc", "--grace-seconds", "0", "--json", "--storage", url,
                         "--job", JOB)
    assert code == 0 and json.loads(out)["files_deleted"] == 1
    assert not store.storage.exists("shared/orphan-leftover.sst")
    code, out, err = run(capsys, "retain", "--keep", "1", "--storage", url, "--job", JOB)
    assert code == 0 and store.checkpoint_ids() == [2]
    assert "ckpt retain: planning" not in out


def test_gc_bar_mode_shows_its_phase(job, capsys, monkeypatch):
    url, _ = job
    monkeypatch.setenv("CKPT_PROGRESS", "bar")
    code, out, err = run(capsys, "gc", "--dry-run", "--json", "--storage", url, "--job", JOB)
    assert code == 0 and json.loads(out)["dry_run"]
    assert "ckpt gc: planning gc of job clicks" in err


def test_rescale_counts_the_new_subtasks(lifecycle_job, spark, capsys, monkeypatch):
    monkeypatch.setenv("CKPT_PROGRESS", "lines")
    monkeypatch.setenv("CKPT_PROGRESS_INTERVAL", TINY)
    url, store = lifecycle_job
    code, out, err = run(capsys, "rescale", "-p", "3", "--json", "--storage", url, "--job", JOB)
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["checkpoint_id"], summary["to_parallelism"]) == (3, 3)
    assert store.load(3).parallelism == 3
    lines = progress_lines(err, "rescale")
    assert any(re.fullmatch(r"ckpt rescale: new subtasks written: 3/3 subtasks \(100%\), "
                            r"\d+ s", x) for x in lines), lines
    assert all(x in lines for x in err.splitlines())


@pytest.mark.spark
def test_ckpt_run_reports_subtasks_and_phases(tmp_path):
    """`ckpt run --json` as a user runs it: progress lines on stderr, the summary on stdout,
    no Spark console bar mixed in."""
    from tests.jobs.run_reference import totals_days

    day = totals_days(str(tmp_path), 1, seed=7)[0]
    env = {**os.environ, "PYTHONPATH": ROOT, "CKPT_PROGRESS": "lines",
           "CKPT_PROGRESS_INTERVAL": "0.5"}
    proc = subprocess.run(
        [sys.executable, "-m", "statebackend.cli.app", "run", "jobs.keyed_aggregation:JOB",
         "--input", str(tmp_path / "in0"), "--storage", f"file://{tmp_path}/store",
         "--run-id", "d0", "--output", str(tmp_path / "out"), "--parallelism", "3",
         "--master", "local[2]", "--json"],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert (summary["checkpoint_id"], summary["parallelism"]) == (1, 3)
    assert summary["events_read"] - summary["events_rejected"] == len(day)
    lines = progress_lines(proc.stderr, "run")
    # 3 subtasks in one task per core of local[2] (the direct read, job/spark_direct.py)
    assert any(re.fullmatch(r"ckpt run: run d0, checkpoint 1: 2/2 tasks \(100%\), \d+ s",
                            x) for x in lines), lines
    assert any(x.startswith("ckpt run: run d0: publishing outputs: 1/1 outputs") for x in lines)
    assert "[Stage " not in proc.stderr  # Spark's own console bar is off
    # the commit record keeps the run's figures once, in metrics (the summary keeps its keys)
    meta = CheckpointStore(open_storage(f"file://{tmp_path}/store"), "keyed_aggregation").load(1)
    assert not set(LEGACY_RUN_KEYS) & set(meta.extra)
    assert {k: run_figures(meta.extra)[k] for k in LEGACY_RUN_KEYS} == {
        k: summary[k] for k in LEGACY_RUN_KEYS}
