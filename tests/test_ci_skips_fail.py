"""Under CI=true a skipped test fails (tests/conftest.py): a missing tool cannot hide."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_skip_fails_under_ci_and_skips_otherwise(tmp_path):
    suite = tmp_path / "tests"
    suite.mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), suite / "conftest.py")
    (suite / "test_tool.py").write_text(
        "import pytest\n\ndef test_needs_a_tool():\n    pytest.skip('tool X not installed')\n")

    def run(ci: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "CI": ci, "PYTHONPATH": ROOT}
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               str(suite)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)

    ci = run("true")
    assert ci.returncode == 1 and "skipped under CI=true" in ci.stdout
    assert "tool X not installed" in ci.stdout
    local = run("")
    assert local.returncode == 0 and "1 skipped" in local.stdout
