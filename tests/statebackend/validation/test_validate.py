"""Checkpoint validation (issue 5): each injected fault is detected and named.

One clean lineage is built per module (file://) and copied for each fault; the
deep faults (wrong key group, undecodable value) need their own raw writes.

The verdict is computed without Great Expectations (`suites.evaluate_runs`, issue
14); every validation in this module also runs the same tables through GE and
requires the same checks, counts and offending rows (`ge_agrees`, autouse).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import statebackend.validation.suites as suites
from statebackend.checkpoint.store import CheckpointStore, metadata_path
from statebackend.state.keygroups import key_group_for_bytes
from statebackend.storage import open_storage
from statebackend.validation.validate import (
    ValidationOptions,
    ValidationResult,
    read_report_summary,
    validate_checkpoint,
)
from tests.statebackend.validation.test_validate_support import (
    JOB,
    M,
    build_checkpoint,
    edit_metadata,
    first_shared,
    job_dir,
    put_raw,
    tree_fingerprint,
)

LEVEL = {False: "manifest", True: "deep"}  # the level of a ``deep`` parameter
COMPARED: list[tuple[str, bool]] = []  # (check, success) of every comparison made


@pytest.fixture(autouse=True)
def ge_agrees(monkeypatch):
    """Each verdict computed without GE must equal GE's own, check by check."""
    native = suites.evaluate_runs

    def both(runs):
        suites_out, checks = native(runs)
        suites.load_great_expectations()
        ge_suites, ge_checks = suites.check_entries(suites.run_suites(runs, None))
        assert checks == ge_checks
        strip = [{k: v for k, v in s.items() if k != "seconds"} for s in suites_out]
        assert strip == [{k: v for k, v in s.items() if k != "seconds"} for s in ge_suites]
        COMPARED.extend((c["name"], c["success"]) for c in checks)
        return suites_out, checks

    monkeypatch.setattr(suites, "evaluate_runs", both)


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    base = tmp_path_factory.mktemp("validate-template")
    store, meta = build_checkpoint(f"file://{base}/store", str(base / "work"))
    return str(base / "store"), meta


@pytest.fixture
def copy(template, tmp_path):
    """A private copy of the clean lineage: (store, metadata of checkpoint 2)."""
    src, meta = template
    shutil.copytree(src, tmp_path / "store")
    return CheckpointStore(open_storage(f"file://{tmp_path}/store"), JOB), meta


def failed(result: ValidationResult) -> set[str]:
    return set(result.summary["failed_checks"])


def check(result: ValidationResult, name: str) -> dict:
    return next(c for c in result.summary["checks"] if c["name"] == name)


def test_clean_checkpoint_passes_manifest_and_deep(copy):
    store, meta = copy
    before = tree_fingerprint(job_dir(store))
    result = validate_checkpoint(store, "latest", ValidationOptions(level="deep"))
    assert result.success, result.summary["failed_checks"]
    assert result.checkpoint_id == meta.checkpoint_id == 2
    s = result.summary
    assert s["success"] and s["critical_failures"] == 0 and s["failed_checks"] == []
    suites = {x["name"] for x in s["suites"]}
    assert {"ckpt.manifest.checkpoint", "ckpt.manifest.files", "ckpt.manifest.subtasks",
            "ckpt.content.restore", "ckpt.content.state", "ckpt.content.counts"} <= suites
    assert s["figures"]["state_rows"] == sum(sum(h.row_counts.values()) for h in meta.subtasks)
    # validation never modifies the checkpoint; it only writes under reports/
    assert tree_fingerprint(job_dir(store)) == before
    assert os.listdir(os.path.join(job_dir(store), "reports")) == ["chk-2"]
    assert read_report_summary(store, 2) == json.loads(json.dumps(s))
    assert result.data_docs_index.endswith("reports/chk-2/data_docs/index.html")
    assert os.path.exists(result.data_docs_index.removeprefix("file://"))
    assert read_report_summary(store, 1) is None


def test_missing_shared_file(copy):
    store, meta = copy
    path = first_shared(meta)
    os.unlink(os.path.join(job_dir(store), path))
    result = validate_checkpoint(store, 2)
    assert not result.success
    assert failed(result) == {"files_exist"}
    rows = check(result, "files_exist")["offending_rows"]
    assert [r["path"] for r in rows] == [path]
    page = open(result.report_index.removeprefix("file://")).read()
    assert "FAILED" in page and "Failed checks and offending rows" in page and path in page
    deep = validate_checkpoint(store, 2, ValidationOptions(level="deep"))
    assert {"files_exist", "subtasks_restore"} <= failed(deep)


def test_truncated_file(copy):
    store, meta = copy
    path = first_shared(meta, 1)
    full = os.path.join(job_dir(store), path)
    with open(full, "r+b") as fh:
        fh.truncate(os.path.getsize(full) // 2)
    result = validate_checkpoint(store, 2)
    assert "file_sizes_match" in failed(result)
    assert [r["path"] for r in check(result, "file_sizes_match")["offending_rows"]] == [path]


def test_one_flipped_byte_is_a_checksum_failure(copy):
    store, meta = copy
    path = first_shared(meta, 2)
    full = os.path.join(job_dir(store), path)
    with open(full, "r+b") as fh:
        fh.seek(os.path.getsize(full) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x01]))
    result = validate_checkpoint(store, 2)
    assert failed(result) == {"file_checksums_match"}
    assert [r["path"] for r in check(result, "file_checksums_match")["offending_rows"]] == [path]
    # checksums come from the download
    deep = validate_checkpoint(store, 2, ValidationOptions(level="deep"))
    assert {"file_checksums_match", "subtasks_restore"} <= failed(deep)
    assert check(deep, "subtasks_restore")["offending_rows"][0]["subtask"] == 2


def _shift_start(delta):
    def change(obj):
        obj["subtasks"][1]["key_group_start"] += delta
    return change


def test_overlapping_ranges(copy):
    store, _ = copy
    edit_metadata(store, 2, _shift_start(-3))
    result = validate_checkpoint(store, 2)
    assert {"key_group_ranges_no_overlap", "key_group_ranges_match_formula"} <= failed(result)
    assert "key_group_ranges_no_gap" not in failed(result)
    rows = check(result, "key_group_ranges_no_overlap")["offending_rows"]
    assert [r["subtask"] for r in rows] == [1]


def test_gap_in_ranges(copy):
    store, _ = copy
    edit_metadata(store, 2, _shift_start(+3))
    result = validate_checkpoint(store, 2)
    assert {"key_group_ranges_no_gap", "key_group_ranges_match_formula"} <= failed(result)
    assert "key_group_ranges_no_overlap" not in failed(result)
    row = check(result, "key_group_ranges_no_gap")["offending_rows"][0]
    assert row["subtask"] == 1 and row["gap_before"] == 3


def test_wrong_max_parallelism(copy):
    store, _ = copy

    def change(obj):
        obj["max_parallelism"] = 2 * M
    edit_metadata(store, 2, change)
    result = validate_checkpoint(store, 2)
    assert {"key_group_ranges_match_formula", "key_group_ranges_no_gap"} <= failed(result)
    # The strict parser refuses the record, so deep validation cannot open its state.
    deep = validate_checkpoint(store, 2, ValidationOptions(level="deep"))
    assert {"metadata_parses", "subtasks_restore"} <= failed(deep)

    def out_of_range(obj):
        obj["max_parallelism"] = 40000
    edit_metadata(store, 2, out_of_range)
    assert "max_parallelism_in_range" in failed(validate_checkpoint(store, 2))


def test_parallelism_mismatch(copy):
    store, _ = copy

    def change(obj):
        obj["parallelism"] = 4
    edit_metadata(store, 2, change)
    result = validate_checkpoint(store, 2)
    assert {"parallelism_matches_subtasks", "metadata_parses"} <= failed(result)


def test_parent_chain(copy):
    store, _ = copy
    # parent 1 retired by retention (older than every committed checkpoint): intact
    os.unlink(os.path.join(job_dir(store), metadata_path(1)))
    assert validate_checkpoint(store, 2).success

    def hole(obj):
        obj["parent"] = 3  # a parent inside the retained chain that does not exist
        obj["checkpoint_id"] = 4
    os.makedirs(os.path.join(job_dir(store), "chk-4"))
    shutil.copy(os.path.join(job_dir(store), metadata_path(2)),
                os.path.join(job_dir(store), metadata_path(4)))
    edit_metadata(store, 4, hole)
    result = validate_checkpoint(store, 4)
    assert failed(result) == {"parent_chain_intact"}
    assert check(result, "parent_chain_intact")["offending_rows"][0]["parent"] == "3"


def test_metadata_path_with_dotdot_is_a_failed_check_not_a_crash(copy):
    store, meta = copy
    outside = os.path.join(os.path.dirname(job_dir(store)), "secret.sst")
    with open(outside, "wb") as fh:
        fh.write(b"x" * 10)

    def change(obj):
        obj["subtasks"][0]["shared_files"][0]["path"] = "../secret.sst"
    edit_metadata(store, 2, change)
    for deep in (False, True):
        result = validate_checkpoint(store, 2, ValidationOptions(level=LEVEL[deep]))
        assert not result.success
        assert {"metadata_parses", "paths_inside_job_root"} <= failed(result)
        row = check(result, "metadata_parses")["offending_rows"][0]
        assert "UnsafePathError" in row["metadata_error"] and "'..'" in row["metadata_error"]
        assert [r["path"] for r in check(result, "paths_inside_job_root")["offending_rows"]] \
            == ["../secret.sst"]
        # never read outside the job root: the outside file is not even probed
        assert check(result, "files_exist")["success"]


def _wrong_key_group(backends):
    b = backends[0]
    r = b.key_group_range
    key = next(f"bad{i}" for i in range(10_000)
               if key_group_for_bytes(f"bad{i}".encode(), M) == r.start)
    put_raw(b, "totals", r.start + 1, key, b.value_state("totals").codec.encode(
        {"count": 1, "sum": 1.0, "flag": True}))


def test_key_under_wrong_key_group_deep(tmp_path):
    store, _ = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"),
                                tamper=_wrong_key_group)
    assert validate_checkpoint(store).success  # the manifest cannot see it
    result = validate_checkpoint(store, "latest", ValidationOptions(level="deep"))
    assert failed(result) == {"key_group_prefix_matches_hash"}
    rows = check(result, "key_group_prefix_matches_hash")["offending_rows"]
    assert len(rows) == 1 and rows[0]["key"].startswith("bad")
    assert rows[0]["key_group"] == rows[0]["computed_key_group"] + 1


def _undecodable(backends):
    b = backends[1]
    key = next(f"u{i}" for i in range(10_000)
               if key_group_for_bytes(f"u{i}".encode(), M) in b.key_group_range)
    put_raw(b, "totals", key_group_for_bytes(key.encode(), M), key, b"\x09not a record")


def test_undecodable_value_deep(tmp_path):
    store, _ = build_checkpoint(f"file://{tmp_path}/store", str(tmp_path / "w"),
                                tamper=_undecodable)
    result = validate_checkpoint(store, "latest", ValidationOptions(level="deep"))
    assert failed(result) == {"values_decode"}
    rows = check(result, "values_decode")["offending_rows"]
    assert len(rows) == 1 and rows[0]["key"].startswith("u") and rows[0]["subtask"] == 1
    assert "does not match its layout" in rows[0]["decode_error"]


def test_offending_rows_are_bounded(copy):
    store, meta = copy
    for f in meta.files:
        if f.path.startswith("chk-2/"):
            os.unlink(os.path.join(job_dir(store), f.path))
    result = validate_checkpoint(store, 2)
    c = check(result, "files_exist")
    assert c["unexpected_count"] > 20 or len(c["offending_rows"]) == c["unexpected_count"]
    assert len(c["offending_rows"]) <= 20


def test_report_dir(copy, tmp_path):
    store, _ = copy
    result = validate_checkpoint(store, 2, ValidationOptions(report_dir=str(tmp_path / "out")))
    assert result.report_location == f"file://{tmp_path}/out/chk-2"
    assert os.path.exists(tmp_path / "out" / "chk-2" / "summary.json")
    assert os.path.exists(tmp_path / "out" / "chk-2" / "data_docs" / "index.html")
    assert not os.path.exists(os.path.join(job_dir(store), "reports"))


@pytest.mark.parametrize("deep", [False, True])
def test_clean_checkpoint_on_every_storage(storage_url, tmp_path, deep):
    store, meta = build_checkpoint(storage_url, str(tmp_path / "w"), parallelism=2, n_keys=120)
    result = validate_checkpoint(store, "latest", ValidationOptions(level=LEVEL[deep]))
    assert result.success, result.summary["failed_checks"]
    assert result.report_location == f"{store.storage.url}/reports/chk-{meta.checkpoint_id}"
    assert result.data_docs_index == f"{result.report_location}/data_docs/index.html"
    assert store.storage.exists(f"reports/chk-{meta.checkpoint_id}/data_docs/index.html")
    summary = read_report_summary(store, meta.checkpoint_id)
    assert summary["success"] and summary["deep"] is deep
    assert summary["data_docs_index"] == result.data_docs_index


def test_every_fault_above_was_compared_with_great_expectations():
    """The autouse comparison ran on failed and passed checks of every suite (runs last
    in this module; on its own it validates the faults it needs)."""
    if not COMPARED:
        pytest.skip("run with the rest of the module (the comparisons happen there)")
    failed_seen = {name for name, ok in COMPARED if not ok}
    assert {"files_exist", "file_sizes_match", "file_checksums_match", "metadata_parses",
            "key_group_ranges_no_gap", "key_group_ranges_no_overlap", "parent_chain_intact",
            "paths_inside_job_root", "subtasks_restore", "key_group_prefix_matches_hash",
            "values_decode"} <= failed_seen


def test_report_none_gives_the_same_verdict_without_importing_great_expectations(copy):
    """A fresh process: the verdict and summary.json, no GE import, no Data Docs."""
    store, meta = copy
    os.unlink(os.path.join(job_dir(store), first_shared(meta)))
    code = f"""
import json, sys
from statebackend.checkpoint.store import CheckpointStore
from statebackend.storage import open_storage
from statebackend.validation.validate import ValidationOptions, validate_checkpoint
store = CheckpointStore(open_storage({store.root_storage.url!r}), {store.job!r})
result = validate_checkpoint(store, 2, ValidationOptions(report="none"))
print(json.dumps({{"ge": "great_expectations" in sys.modules, "summary": result.summary}}))
"""
    root = str(Path(__file__).resolve().parents[3])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": root}, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ge"] is False
    summary = got["summary"]
    assert summary["failed_checks"] == ["files_exist"] and summary["data_docs_index"] is None
    assert not os.path.exists(os.path.join(job_dir(store), "reports", "chk-2", "data_docs"))
    with_ge = validate_checkpoint(store, 2)  # report "now": same checks, plus Data Docs
    assert with_ge.summary["checks"] == summary["checks"] and with_ge.data_docs_index
    page = open(os.path.join(job_dir(store), "reports", "chk-2", "index.html")).read()
    assert "data_docs/index.html" in page


def test_unknown_report_mode_is_a_usage_error(copy):
    from statebackend.errors import UsageError

    store, _ = copy
    with pytest.raises(UsageError, match="report mode 'later' is invalid"):
        validate_checkpoint(store, 2, ValidationOptions(report="later"))
