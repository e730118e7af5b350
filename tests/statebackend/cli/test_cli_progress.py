"""Progress on stderr: periodic lines off a terminal, a live bar on one; the notice while
Great Expectations loads; stdout stays clean."""

from __future__ import annotations

import io
import json

import pytest

from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
from statebackend.errors import StorageError
from statebackend.progress import Progress, choose_mode
from statebackend.storage import open_storage
from tests.statebackend.helpers import close_all, dump_backends, fill, keys, open_backends

JOB = "clicks"


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
    monkeypatch.setenv("CKPT_PROGRESS", "bogus")  # a typo falls back to auto
    assert choose_mode(Tty()) == "bar"


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


def test_gc_shows_its_phase(job, capsys, monkeypatch):
    url, _ = job
    monkeypatch.setenv("CKPT_PROGRESS", "bar")
    code, out, err = run(capsys, "gc", "--dry-run", "--json", "--storage", url, "--job", JOB)
    assert code == 0 and json.loads(out)["dry_run"]
    assert "ckpt gc: planning orphans of job clicks" in err


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
