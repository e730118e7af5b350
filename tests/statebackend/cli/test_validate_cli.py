"""`ckpt validate`: exit codes 0 / 1 / 2, --json, --deep, --report-dir; job checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from statebackend.cli.app import main
from statebackend.validation.checks import registered_state_checks
from statebackend.validation.validate import ValidationOptions, validate_checkpoint
from tests.statebackend.validation.test_validate_support import (
    JOB,
    build_checkpoint,
    first_shared,
    job_dir,
)


@pytest.fixture(scope="module")
def lineage(tmp_path_factory):
    base = tmp_path_factory.mktemp("validate-cli")
    store, meta = build_checkpoint(f"file://{base}/store", str(base / "w"), parallelism=2,
                                   n_keys=150)
    return f"file://{base}/store", store, meta


def run(url, *args):
    return main(["--storage", url, "--job", JOB, "validate", *args])


def test_exit_0_and_json(lineage, capsys):
    url, _, meta = lineage
    assert run(url, "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["success"] and out["checkpoint_id"] == meta.checkpoint_id
    assert run(url, "1", "--deep") == 0
    text = capsys.readouterr().out
    assert "checkpoint 1 of job orders: PASSED (deep validation" in text
    assert "ckpt.content.state" in text and "data docs: file://" in text


def test_exit_1_names_the_failed_check(tmp_path, capsys):
    store, meta = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"),
                                   parallelism=2, n_keys=150)
    os.unlink(os.path.join(job_dir(store), first_shared(meta)))
    url = f"file://{tmp_path}/store"
    assert run(url, "--report-dir", str(tmp_path / "r")) == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "critical: files_exist" in text and first_shared(meta) in text
    assert os.path.exists(tmp_path / "r" / f"chk-{meta.checkpoint_id}" / "summary.json")
    assert run(url, "--json") == 1
    assert json.loads(capsys.readouterr().out)["failed_checks"] == ["files_exist"]


def test_exit_2_for_usage_and_access_errors(lineage, tmp_path, capsys):
    url, _, _ = lineage
    assert run(url, "not-an-id") == 2
    assert run(url, "99") == 2
    assert "checkpoint 99" in capsys.readouterr().err
    assert main(["--storage", f"file://{tmp_path}/empty", "--job", JOB, "validate"]) == 2
    assert main(["--storage", "ftp://host/x", "--job", JOB, "validate"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["--storage", url, "--job", JOB, "validate", "--bogus"])
    assert exc.value.code == 2


def test_full_storage_publishes_no_half_report(tmp_path, capsys):
    """memory:// too small for the report: one-line error, no index.html left behind."""
    from statebackend.storage import open_storage
    from statebackend.validation.report import publication_order

    url = "memory://validate-full-storage"
    store, meta = build_checkpoint(url, str(tmp_path / "w"), parallelism=2, n_keys=150)
    report = f"reports/chk-{meta.checkpoint_id}"
    try:
        # a first run with room to spare measures the report, then it is removed
        assert run(url, "--report-dir", str(tmp_path / "r")) == 0
        built = tmp_path / "r" / f"chk-{meta.checkpoint_id}"
        order = publication_order(str(built))
        assert order[0] == "summary.json" and order[-1] == "index.html"
        sizes = [(built / rel).stat().st_size for rel in order]
        used = sum(f.size for f in store.root_storage.walk_files(""))
        # room for the summary and half of the rest: the upload fails half-way
        limit = used + sizes[0] + sum(sizes[1:]) // 2
        capsys.readouterr()
        assert run(f"{url}?max_bytes={limit}") == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert f"validation report {url}?max_bytes={limit}/{JOB}/{report} was not " \
               "published" in lines[0] and f"maximum size of {limit} bytes" in lines[0]
        assert store.storage.walk_files(report) == []  # nothing half-published
        # with room, the same command publishes the whole report
        assert run(url) == 0
        stored = {f.path for f in open_storage(url).walk_files(f"{JOB}/{report}")}
        assert {f"{JOB}/{report}/{rel}" for rel in ("summary.json", "index.html")} <= stored
        assert len(stored) == len(order)  # page names carry the run time: compare counts
    finally:
        open_storage(url).delete_tree("")


def test_cli_import_does_not_load_great_expectations():
    code = ("import sys, statebackend.cli.app as c; c.build_parser(); "
            "import statebackend.validation.validate; "
            "print(any(m.startswith('great_expectations') for m in sys.modules), "
            "'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))).stdout.split()
    assert out == ["False", "False"], out


# -- job checks (jobs/keyed_aggregation_checks.py) ---------------------------------
def test_keyed_aggregation_checks_are_registered_and_run(tmp_path):
    from jobs.keyed_aggregation import JOB

    assert "totals" not in registered_state_checks()  # nothing is imported by name
    store, meta = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"),
                                   parallelism=2, n_keys=150, job_totals=True)
    result = validate_checkpoint(store, "latest", ValidationOptions(
        level="deep", state_checks=JOB.expectations))
    assert result.success, result.summary["failed_checks"]
    names = {c["name"] for c in result.summary["checks"]}
    assert {"totals_count_at_least_1", "totals_min_ts_le_max_ts"} <= names
    assert "ckpt.job.totals" in {s["name"] for s in result.summary["suites"]}


def _bad_totals(backends):
    b = backends[0]
    b.value_state("totals").put(_key_in(b), {"count": 0, "sum": 0.0, "min_ts": 9, "max_ts": 3})


def _key_in(backend):
    from statebackend.state.keygroups import key_group_for_bytes

    return next(f"z{i}" for i in range(10_000) if key_group_for_bytes(
        f"z{i}".encode(), backend.max_parallelism) in backend.key_group_range)


def test_keyed_aggregation_checks_fail_on_bad_totals(tmp_path):
    store, _ = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"), parallelism=2,
                                n_keys=150, job_totals=True, tamper=_bad_totals)
    from jobs.keyed_aggregation import JOB

    result = validate_checkpoint(store, "latest", ValidationOptions(
        level="deep", state_checks=JOB.expectations))
    assert set(result.summary["failed_checks"]) == {"totals_count_at_least_1",
                                                     "totals_min_ts_le_max_ts"}
    for name in result.summary["failed_checks"]:
        c = next(c for c in result.summary["checks"] if c["name"] == name)
        assert c["unexpected_count"] == 1
        assert c["offending_rows"] and c["offending_rows"][0]["key"].startswith("z")


def test_explicit_state_checks_argument(tmp_path):
    import great_expectations.expectations as gxe

    store, _ = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"), parallelism=2,
                                n_keys=150)

    def events_checks(descriptor):
        return [gxe.ExpectColumnValuesToNotBeNull(
            column="value", meta={"check": "events_not_null", "critical": False}),
            gxe.ExpectColumnValuesToBeBetween(
            column="key_group", min_value=0, max_value=0,
            meta={"check": "events_all_in_group_0", "critical": False})]

    result = validate_checkpoint(store, "latest", ValidationOptions(
        level="deep", state_checks={"events": events_checks}))
    assert result.success  # non-critical failures do not fail the validation
    assert result.summary["failed_checks"] == ["events_all_in_group_0"]


def test_report_none_stores_the_verdict_without_data_docs(tmp_path, capsys):
    """--report none: same exit code and failed checks, summary and overview only."""
    store, meta = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"),
                                   parallelism=2, n_keys=150)
    os.unlink(os.path.join(job_dir(store), first_shared(meta)))
    url = f"file://{tmp_path}/store"
    assert run(url, "--report", "none", "--json") == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["failed_checks"] == ["files_exist"] and summary["data_docs_index"] is None
    assert "ge_import_seconds" not in summary["timings"]
    report = os.path.join(job_dir(store), "reports", f"chk-{meta.checkpoint_id}")
    assert sorted(os.listdir(report)) == ["index.html", "summary.json"]
    assert "were not rendered" in open(os.path.join(report, "index.html")).read()
