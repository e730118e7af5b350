"""The pre-commit hooks are valid and run what `make test` runs before the suite."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_the_config_is_valid():
    proc = subprocess.run([str(BIN / "pre-commit"), "validate-config",
                           ".pre-commit-config.yaml"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_hooks_are_the_checks_of_make_test():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    entries = {h["entry"] for repo in config["repos"] for h in repo["hooks"]}
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\ntest:"):].split("\n\n", 1)[0]
    checks = set(re.findall(r"\$\(VENV\)/bin/(ruff check|mypy)\b", recipe))
    assert entries == checks == {"ruff check", "mypy"}
