"""Markers are applied from what a test uses (tests/conftest.py): known tests carry them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APPLIED = ("spark", "s3", "airflow", "browser", "slow")

STORAGE = "tests/statebackend/storage/test_storage.py"
INPUT = "tests/jobs/test_input.py"
CONFIG = "tests/airflow/test_config.py"
BROWSER = "tests/statebackend/validation/test_report_browser.py"
WHEEL = "tests/test_wheel.py"
EXPECTED = {
    f"{INPUT}::test_malformed_and_trailing_garbage_lines_are_quarantined_raw": {"spark"},
    f"{INPUT}::test_skipped_files_warn_in_text_mode": set(),
    f"{STORAGE}::test_copy[file]": set(),
    f"{STORAGE}::test_copy[memory]": set(),
    f"{STORAGE}::test_copy[s3]": {"s3"},
    f"{CONFIG}::test_defaults_merge_and_job_keys_win": {"airflow"},
    f"{BROWSER}::test_clean_report_opens_in_headless_chromium": {"browser"},
    f"{WHEEL}::test_deep_validation_with_the_installed_cli": {"slow"},
}

# A plugin for the collecting pytest: prints each test's markers as JSON.
PLUGIN = """
import json

def pytest_collection_finish(session):
    print("MARKERS=" + json.dumps({i.nodeid: sorted({m.name for m in i.iter_markers()})
                                   for i in session.items}))
"""


def test_known_tests_carry_the_markers_of_what_they_use(tmp_path):
    (tmp_path / "print_markers.py").write_text(PLUGIN)
    files = sorted({node.split("::")[0] for node in EXPECTED})
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "print_markers", *files], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MARKERS="))
    markers = json.loads(line.removeprefix("MARKERS="))
    got = {node: set(markers[node]) & set(APPLIED) for node in EXPECTED}
    assert got == EXPECTED


def test_marker_expression_selects_the_spark_tests():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "spark", INPUT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    selected = {x for x in proc.stdout.splitlines() if "::" in x}
    assert f"{INPUT}::test_malformed_and_trailing_garbage_lines_are_quarantined_raw" in selected
    assert f"{INPUT}::test_skipped_files_warn_in_text_mode" not in selected
